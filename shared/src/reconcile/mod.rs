//! Reconciliation (SPEC §9, `flexway reconcile`): the gateway's metering, which
//! enforces budgets in real time, set against the provider's usage, which finance
//! pays.
//!
//! Per backend, model and UTC day both sides' tokens are shown with the drift,
//! `(provider − gateway) / provider` in tokens; a row one side has and the other
//! never saw is shown, never dropped. Only the backends the provider's usage speaks
//! for are compared (the others are named apart). The corrected chargeback scales
//! each tenant's cost within its backend so that the backend's total is the
//! provider's: its cost when the provider states one for every row, else the
//! gateway's cost scaled by the ratio of tokens. Money stays in integer micro-euros;
//! a scaled share is rounded so that the shares add up to the total exactly (largest
//! remainder).

pub mod fetch;
pub mod usage;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

pub use jiff::civil::Date;
use serde_json::{Value, json};

use crate::audit::AuditRecord;
use crate::audit::report::{Filter, Unreadable, csv_field, md_cell, record_date};
use crate::config::Metering;
use crate::money::MicroEur;

/// Tokens as both sides count them: `input` includes the prompt tokens read from
/// (`cached`) and written to (`cache_write`) a prompt cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
    pub cached: u64,
    pub cache_write: u64,
}

impl Tokens {
    pub fn total(self) -> u64 {
        self.input.saturating_add(self.output)
    }

    fn add(&mut self, other: Tokens) {
        self.input = self.input.saturating_add(other.input);
        self.output = self.output.saturating_add(other.output);
        self.cached = self.cached.saturating_add(other.cached);
        self.cache_write = self.cache_write.saturating_add(other.cache_write);
    }
}

/// A line of the provider's usage: a backend's model on a UTC day, and its cost when
/// the export states one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderRow {
    pub date: Date,
    pub backend: String,
    pub model: String,
    pub tokens: Tokens,
    pub cost: Option<MicroEur>,
}

/// The provider's side: its rows, the lines it could not read, and the backends it
/// speaks for (a backend named with none of its rows in the period still counts: the
/// provider saw nothing there).
#[derive(Debug, Default)]
pub struct ProviderUsage {
    pub rows: Vec<ProviderRow>,
    pub unreadable: Vec<Unreadable>,
    pub backends: BTreeSet<String>,
}

impl ProviderUsage {
    pub fn extend(&mut self, other: ProviderUsage) {
        self.rows.extend(other.rows);
        self.unreadable.extend(other.unreadable);
        self.backends.extend(other.backends);
    }
}

/// Which side saw a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeenBy {
    Both,
    Gateway,
    Provider,
}

impl SeenBy {
    pub fn as_str(self) -> &'static str {
        match self {
            SeenBy::Both => "both",
            SeenBy::Gateway => "gateway",
            SeenBy::Provider => "provider",
        }
    }
}

/// A backend's model on a UTC day, seen from both sides.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub date: Date,
    pub backend: String,
    pub model: String,
    pub gateway: Tokens,
    pub provider: Tokens,
    pub gateway_cost: MicroEur,
    /// `None` when the provider's usage states no cost (or not for all its lines).
    pub provider_cost: Option<MicroEur>,
    pub seen_by: SeenBy,
}

impl Row {
    pub fn drift_ratio(&self) -> Option<f64> {
        drift(self.gateway.total(), self.provider.total())
    }
}

/// Today's UTC date, `YYYY-MM-DD`: where a fetch ends by default.
pub fn today() -> String {
    jiff::tz::Offset::UTC.to_datetime(jiff::Timestamp::now()).date().to_string()
}

/// `(provider − gateway) / provider`; none when the provider counts nothing.
pub fn drift(gateway: u64, provider: u64) -> Option<f64> {
    #[allow(clippy::cast_precision_loss)] // a ratio for people: 2^53 tokens is far off.
    (provider > 0).then(|| (provider as f64 - gateway as f64) / provider as f64)
}

/// A backend's drift over the period, and day by day.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendDrift {
    pub backend: String,
    pub gateway: Tokens,
    pub provider: Tokens,
    pub gateway_cost: MicroEur,
    pub provider_cost: Option<MicroEur>,
    pub drift_ratio: Option<f64>,
    /// Each UTC day with usage on either side, and its drift.
    pub periods: Vec<(Date, Option<f64>)>,
    /// The drift rose from each period to the next over the last three (or two).
    pub growing: bool,
}

/// A drift counts as rising from one period to the next when it rises by more than
/// this (a tenth of a percentage point): below, it is noise of rounding.
const RISE: f64 = 0.001;

/// Whether the drift rose from each period to the next over the last three periods
/// that have one (the last two, when only two have).
fn growing(periods: &[(Date, Option<f64>)]) -> bool {
    let drifts: Vec<f64> = periods.iter().filter_map(|(_, d)| *d).collect();
    let last = &drifts[drifts.len().saturating_sub(3)..];
    last.len() >= 2 && last.windows(2).all(|pair| pair[1] - pair[0] > RISE)
}

/// A tenant's cost through one agent on one backend, as metered and as corrected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargebackRow {
    pub tenant: String,
    pub agent: Option<String>,
    pub backend: String,
    pub cost: MicroEur,
    pub corrected: MicroEur,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Reconciliation {
    pub filter: Filter,
    pub rows: Vec<Row>,
    pub backends: Vec<BackendDrift>,
    /// Backends the gateway served in the period that the provider's usage does not
    /// speak for.
    pub not_compared: Vec<String>,
    /// With `--chargeback`: the corrected chargeback.
    pub chargeback: Option<Vec<ChargebackRow>>,
}

impl Reconciliation {
    fn backend(&self, name: &str) -> Option<&BackendDrift> {
        self.backends.iter().find(|b| b.backend == name)
    }
}

type Key = (Date, String, String);

/// A share of the chargeback: (backend, tenant, agent).
type Share = (String, String, Option<String>);

/// What the gateway counted: per (day, backend, model), tokens and cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Metered {
    tokens: Tokens,
    cost: MicroEur,
}

/// The audit's side of a reconciliation, folded one record at a time: per UTC day,
/// backend and model, the tokens and cost the gateway metered; with the chargeback,
/// per backend, tenant and agent, the cost billed locally.
///
/// Invariant: its size grows with the days, backends, models, tenants and agents of
/// the period, never with the number of records, so that a month of millions of
/// records is read a page at a time and folded, never held. The order records come
/// in does not change the result (sums only).
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayUsage {
    filter: Filter,
    metered: BTreeMap<Key, Metered>,
    /// Per (backend, tenant, agent); `None` without the chargeback.
    costs: Option<BTreeMap<Share, MicroEur>>,
}

impl GatewayUsage {
    /// Nothing counted yet, for the period of `filter`; with `chargeback`, the costs
    /// the corrected chargeback needs are counted too.
    pub fn new(filter: &Filter, chargeback: bool) -> Self {
        GatewayUsage { filter: filter.clone(), metered: BTreeMap::new(), costs: chargeback.then(BTreeMap::new) }
    }

    /// Counts `record` when it falls in the period.
    pub fn add(&mut self, record: &AuditRecord) {
        if !self.filter.matches(record) {
            return;
        }
        let Some(backend) = record.backend.as_deref() else { return };
        if let Some(costs) = &mut self.costs
            && record.metered_by != Metering::Upstream
        {
            let key = (backend.to_owned(), record.tenant.clone(), record.agent.clone());
            let cost = costs.entry(key).or_default();
            *cost = cost.saturating_add(record.cost());
        }
        let tokens = Tokens {
            input: record.prompt_tokens,
            output: record.completion_tokens,
            cached: record.cached_tokens.unwrap_or(0),
            cache_write: record.cache_write_tokens.unwrap_or(0),
        };
        if tokens.total() == 0 && record.cost() == MicroEur(0) {
            return; // refused or failed before any token: nothing to compare
        }
        let model = record.model_served.as_deref().or(record.model_requested.as_deref()).unwrap_or(usage::NO_MODEL);
        let metered = self.metered.entry((record_date(record), backend.to_owned(), model.to_owned())).or_default();
        metered.tokens.add(tokens);
        metered.cost = metered.cost.saturating_add(record.cost());
    }

    /// How many sums it holds (days × backends × models, and the chargeback's
    /// backends × tenants × agents): what its size grows with.
    pub fn sums(&self) -> usize {
        self.metered.len() + self.costs.as_ref().map_or(0, BTreeMap::len)
    }

    /// The counted usage set against `provider`'s.
    pub fn reconcile(&self, provider: &ProviderUsage) -> Reconciliation {
        let filter = &self.filter;
        let mut not_compared = BTreeSet::new();
        let mut gateway: BTreeMap<&Key, &Metered> = BTreeMap::new();
        for (key, metered) in &self.metered {
            if provider.backends.contains(&key.1) {
                gateway.insert(key, metered);
            } else {
                not_compared.insert(key.1.clone());
            }
        }
        let mut theirs: BTreeMap<Key, (Tokens, Option<MicroEur>)> = BTreeMap::new();
        for row in provider.rows.iter().filter(|r| filter.contains(r.date)) {
            let entry = theirs
                .entry((row.date, row.backend.clone(), row.model.clone()))
                .or_insert((Tokens::default(), Some(MicroEur(0))));
            entry.0.add(row.tokens);
            entry.1 = entry.1.zip(row.cost).map(|(a, b)| a.saturating_add(b));
        }

        let keys: BTreeSet<&Key> = gateway.keys().copied().chain(theirs.keys()).collect();
        let rows: Vec<Row> = keys
            .into_iter()
            .map(|key| {
                let ours = gateway.get(key);
                let provided = theirs.get(key);
                let seen_by = match (ours, provided) {
                    (Some(_), Some(_)) => SeenBy::Both,
                    (Some(_), None) => SeenBy::Gateway,
                    _ => SeenBy::Provider,
                };
                Row {
                    date: key.0,
                    backend: key.1.clone(),
                    model: key.2.clone(),
                    gateway: ours.map(|s| s.tokens).unwrap_or_default(),
                    provider: provided.map(|p| p.0).unwrap_or_default(),
                    gateway_cost: ours.map(|s| s.cost).unwrap_or_default(),
                    provider_cost: provided.map_or(Some(MicroEur(0)), |p| p.1),
                    seen_by,
                }
            })
            .collect();

        let backends = provider.backends.iter().map(|name| backend_drift(name, &rows)).collect();
        let mut reconciliation = Reconciliation {
            filter: filter.clone(),
            rows,
            backends,
            not_compared: not_compared.into_iter().collect(),
            chargeback: None,
        };
        if let Some(costs) = &self.costs {
            reconciliation.chargeback = Some(corrected_chargeback(costs, &reconciliation));
        }
        reconciliation
    }
}

/// Sets the audit's `records` against `provider` over the period of `filter`; with
/// `chargeback`, the corrected chargeback too. A long audit is better folded as it
/// is read ([`GatewayUsage`]): this holds every record.
pub fn reconcile(
    records: &[AuditRecord],
    provider: &ProviderUsage,
    filter: &Filter,
    chargeback: bool,
) -> Reconciliation {
    let mut usage = GatewayUsage::new(filter, chargeback);
    for record in records {
        usage.add(record);
    }
    usage.reconcile(provider)
}

fn backend_drift(name: &str, rows: &[Row]) -> BackendDrift {
    let mut drift_of = BackendDrift {
        backend: name.to_owned(),
        gateway: Tokens::default(),
        provider: Tokens::default(),
        gateway_cost: MicroEur(0),
        provider_cost: Some(MicroEur(0)),
        drift_ratio: None,
        periods: Vec::new(),
        growing: false,
    };
    let mut days: BTreeMap<Date, (u64, u64)> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.backend == name) {
        drift_of.gateway.add(row.gateway);
        drift_of.provider.add(row.provider);
        drift_of.gateway_cost = drift_of.gateway_cost.saturating_add(row.gateway_cost);
        drift_of.provider_cost = drift_of.provider_cost.zip(row.provider_cost).map(|(a, b)| a.saturating_add(b));
        let day = days.entry(row.date).or_default();
        day.0 = day.0.saturating_add(row.gateway.total());
        day.1 = day.1.saturating_add(row.provider.total());
    }
    // A cost of zero stated for no line at all is no statement.
    if drift_of.provider.total() == 0 && drift_of.provider_cost == Some(MicroEur(0)) {
        drift_of.provider_cost = None;
    }
    drift_of.drift_ratio = drift(drift_of.gateway.total(), drift_of.provider.total());
    drift_of.periods = days.into_iter().map(|(date, (g, p))| (date, drift(g, p))).collect();
    drift_of.growing = growing(&drift_of.periods);
    drift_of
}

/// The chargeback of the period (what `flexway report` bills locally, per tenant,
/// agent and backend), each compared backend's shares scaled to the provider's total.
fn corrected_chargeback(costs: &BTreeMap<Share, MicroEur>, reconciliation: &Reconciliation) -> Vec<ChargebackRow> {
    let mut rows: Vec<ChargebackRow> = costs
        .iter()
        .map(|((backend, tenant, agent), &cost)| ChargebackRow {
            tenant: tenant.clone(),
            agent: agent.clone(),
            backend: backend.clone(),
            cost,
            corrected: cost,
        })
        .collect();
    // Sorted by backend first: each backend's shares are one run.
    for shares in rows.chunk_by_mut(|a, b| a.backend == b.backend) {
        if let Some(scale) = reconciliation.backend(&shares[0].backend).and_then(scale) {
            scale_shares(shares, scale);
        }
    }
    rows.sort_by(|a, b| (&a.tenant, &a.agent, &a.backend).cmp(&(&b.tenant, &b.agent, &b.backend)));
    rows
}

/// The factor a backend's costs are scaled by, as a fraction: the provider's cost
/// over the gateway's when the provider states it, else its tokens over the
/// gateway's. `None` when the gateway counted nothing to scale.
fn scale(backend: &BackendDrift) -> Option<(u128, u128)> {
    match backend.provider_cost {
        Some(theirs) if backend.gateway_cost.0 > 0 => Some((theirs.0.into(), backend.gateway_cost.0.into())),
        _ => {
            let ours = backend.gateway.total();
            (ours > 0).then(|| (backend.provider.total().into(), ours.into()))
        }
    }
}

/// Each share times `num / den`, rounded down, then the micro-euros left to reach the
/// rounded total given one each to the shares with the largest remainders.
fn scale_shares(rows: &mut [ChargebackRow], (num, den): (u128, u128)) {
    let total: u128 = rows.iter().map(|r| u128::from(r.cost.0)).sum();
    let target = (total * num + den / 2) / den;
    let mut remainders = Vec::with_capacity(rows.len());
    let mut given: u128 = 0;
    for (i, row) in rows.iter_mut().enumerate() {
        let scaled = u128::from(row.cost.0) * num;
        let share = scaled / den;
        given += share;
        row.corrected = MicroEur(u64::try_from(share).unwrap_or(u64::MAX));
        remainders.push((scaled % den, i));
    }
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let left = usize::try_from(target.saturating_sub(given)).unwrap_or(usize::MAX);
    for (_, i) in remainders.into_iter().take(left) {
        rows[i].corrected = MicroEur(rows[i].corrected.0.saturating_add(1));
    }
}

fn eur(cost: MicroEur) -> Value {
    // Exact to the micro-euro: the f64 nearest a six-place decimal prints as it.
    #[allow(clippy::cast_precision_loss)]
    let euros = cost.0 as f64 / 1e6;
    json!(euros)
}

fn ratio_text(ratio: Option<f64>) -> String {
    ratio.map_or_else(|| "-".to_owned(), |r| format!("{r:.6}"))
}

/// The JSON of SPEC §9: `rows`, `backends`, and with `--chargeback`, `chargeback`;
/// each with more than the SPEC's keys (cached tokens, costs, which side saw a row).
pub fn to_json(r: &Reconciliation) -> Value {
    let rows: Vec<Value> = r
        .rows
        .iter()
        .map(|row| {
            json!({
                "date": row.date.to_string(),
                "backend": row.backend,
                "model": row.model,
                "gateway_input_tokens": row.gateway.input,
                "gateway_output_tokens": row.gateway.output,
                "provider_input_tokens": row.provider.input,
                "provider_output_tokens": row.provider.output,
                "gateway_cached_tokens": row.gateway.cached,
                "provider_cached_tokens": row.provider.cached,
                "gateway_cache_write_tokens": row.gateway.cache_write,
                "provider_cache_write_tokens": row.provider.cache_write,
                "gateway_cost_eur": eur(row.gateway_cost),
                "provider_cost_eur": row.provider_cost.map(eur),
                "drift_ratio": row.drift_ratio(),
                "seen_by": row.seen_by.as_str(),
            })
        })
        .collect();
    let backends: Vec<Value> = r
        .backends
        .iter()
        .map(|b| {
            json!({
                "backend": b.backend,
                "drift_ratio": b.drift_ratio,
                "growing": b.growing,
                "gateway_tokens": b.gateway.total(),
                "provider_tokens": b.provider.total(),
                "drift_tokens": i128::from(b.provider.total()) - i128::from(b.gateway.total()),
                "gateway_cost_eur": eur(b.gateway_cost),
                "provider_cost_eur": b.provider_cost.map(eur),
                "periods": b.periods.iter().map(|(d, r)| json!({"date": d.to_string(), "drift_ratio": r})).collect::<Vec<_>>(),
            })
        })
        .collect();
    let mut out = json!({
        "from": r.filter.from(),
        "to": r.filter.to(),
        "rows": rows,
        "backends": backends,
        "not_compared": r.not_compared,
    });
    if let (Some(chargeback), Some(object)) = (&r.chargeback, out.as_object_mut()) {
        let rows: Vec<Value> = chargeback
            .iter()
            .map(|c| {
                json!({
                    "tenant": c.tenant,
                    "agent": c.agent,
                    "backend": c.backend,
                    "cost_eur": eur(c.cost),
                    "corrected_cost_eur": eur(c.corrected),
                    "cost_micro_eur": c.cost.0,
                    "corrected_cost_micro_eur": c.corrected.0,
                    "drift_ratio": r.backend(&c.backend).and_then(|b| b.drift_ratio),
                })
            })
            .collect();
        object.insert("chargeback".into(), Value::Array(rows));
    }
    out
}

/// CSV: the corrected chargeback with `--chargeback` (the document finance takes,
/// each line with its backend's drift), else the rows per day, backend and model.
pub fn to_csv(r: &Reconciliation) -> String {
    let mut out = String::new();
    if let Some(chargeback) = &r.chargeback {
        out.push_str("tenant,agent,backend,cost_eur,corrected_cost_eur,drift_ratio\n");
        for c in chargeback {
            let drift = r.backend(&c.backend).and_then(|b| b.drift_ratio);
            let _ = writeln!(
                out,
                "{},{},{},{},{},{}",
                csv_field(&c.tenant),
                csv_field(c.agent.as_deref().unwrap_or("-")),
                csv_field(&c.backend),
                c.cost.to_eur_string(),
                c.corrected.to_eur_string(),
                ratio_text(drift)
            );
        }
        return out;
    }
    out.push_str(
        "date,backend,model,gateway_input_tokens,gateway_output_tokens,provider_input_tokens,\
         provider_output_tokens,gateway_cached_tokens,provider_cached_tokens,drift_ratio,seen_by\n",
    );
    for row in &r.rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{}",
            row.date,
            csv_field(&row.backend),
            csv_field(&row.model),
            row.gateway.input,
            row.gateway.output,
            row.provider.input,
            row.provider.output,
            row.gateway.cached,
            row.provider.cached,
            ratio_text(row.drift_ratio()),
            row.seen_by.as_str()
        );
    }
    out
}

/// Markdown: the drift per backend, the rows, what was not compared, and with
/// `--chargeback` the corrected chargeback with the drift stated above it.
pub fn to_markdown(r: &Reconciliation) -> String {
    let mut out = String::from("# Flexway reconciliation\n\n");
    let period = r.filter.describe();
    let _ =
        writeln!(out, "Period: {period} (UTC dates, inclusive). Drift = (provider − gateway) / provider, in tokens.\n");
    out.push_str("## Drift per backend\n\n| backend | gateway tokens | provider tokens | drift (tokens) | drift | growing |\n| --- | ---: | ---: | ---: | ---: | --- |\n");
    for b in &r.backends {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            md_cell(&b.backend),
            b.gateway.total(),
            b.provider.total(),
            i128::from(b.provider.total()) - i128::from(b.gateway.total()),
            ratio_text(b.drift_ratio),
            if b.growing { "**yes**" } else { "no" }
        );
    }
    out.push_str("\n## Per day and model\n\n| date | backend | model | gateway in/out | provider in/out | cached (gateway/provider) | drift | seen by |\n| --- | --- | --- | ---: | ---: | ---: | ---: | --- |\n");
    for row in &r.rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {}/{} | {}/{} | {}/{} | {} | {} |",
            row.date,
            md_cell(&row.backend),
            md_cell(&row.model),
            row.gateway.input,
            row.gateway.output,
            row.provider.input,
            row.provider.output,
            row.gateway.cached,
            row.provider.cached,
            ratio_text(row.drift_ratio()),
            row.seen_by.as_str()
        );
    }
    if !r.not_compared.is_empty() {
        let names: Vec<String> = r.not_compared.iter().map(|n| md_cell(n)).collect();
        let _ = writeln!(out, "\nNot compared (no provider usage for them): {}.", names.join(", "));
    }
    if let Some(chargeback) = &r.chargeback {
        out.push_str("\n## Chargeback, corrected to the provider's totals\n\n");
        for b in &r.backends {
            let basis = if b.provider_cost.is_some() && b.gateway_cost.0 > 0 { "stated cost" } else { "tokens" };
            let _ = match scale(b) {
                Some(_) => writeln!(
                    out,
                    "- {}: drift {}; each share scaled by the provider's {basis} ({} € metered, {} € corrected).",
                    md_cell(&b.backend),
                    ratio_text(b.drift_ratio),
                    b.gateway_cost.to_eur_string(),
                    corrected_total(chargeback, &b.backend).to_eur_string()
                ),
                None => writeln!(
                    out,
                    "- {}: the gateway metered nothing here; the provider's {} tokens are not attributed to any tenant.",
                    md_cell(&b.backend),
                    b.provider.total()
                ),
            };
        }
        out.push_str(
            "\n| tenant | agent | backend | cost (EUR) | corrected (EUR) |\n| --- | --- | --- | ---: | ---: |\n",
        );
        for c in chargeback {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                md_cell(&c.tenant),
                md_cell(c.agent.as_deref().unwrap_or("-")),
                md_cell(&c.backend),
                c.cost.to_eur_string(),
                c.corrected.to_eur_string()
            );
        }
    }
    out
}

fn corrected_total(chargeback: &[ChargebackRow], backend: &str) -> MicroEur {
    chargeback.iter().filter(|c| c.backend == backend).fold(MicroEur(0), |sum, c| sum.saturating_add(c.corrected))
}

/// The drift as Prometheus's text format, for a Pushgateway: one gauge per backend
/// that has a drift.
pub fn to_prometheus(r: &Reconciliation) -> String {
    let mut out = String::from(
        "# HELP flexway_reconciliation_drift_ratio (provider - gateway) / provider tokens, per backend.\n\
         # TYPE flexway_reconciliation_drift_ratio gauge\n",
    );
    for b in &r.backends {
        if let Some(ratio) = b.drift_ratio {
            let name = b.backend.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(out, "flexway_reconciliation_drift_ratio{{backend=\"{name}\"}} {ratio}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(cost: u64) -> ChargebackRow {
        ChargebackRow {
            tenant: "t".into(),
            agent: None,
            backend: "b".into(),
            cost: MicroEur(cost),
            corrected: MicroEur(0),
        }
    }

    #[test]
    fn scaled_shares_add_up_to_the_rounded_total() {
        let mut rows = vec![row(1), row(1), row(1)];
        scale_shares(&mut rows, (3, 2)); // 4.5 → 5: one share gets the half's remainder
        let corrected: Vec<u64> = rows.iter().map(|r| r.corrected.0).collect();
        assert_eq!(corrected.iter().sum::<u64>(), 5);
        assert_eq!(corrected, [2, 2, 1], "the first of equal remainders first");
        let mut rows = vec![row(1_000_000), row(2_000_000)];
        scale_shares(&mut rows, (105, 100));
        assert_eq!(rows.iter().map(|r| r.corrected.0).collect::<Vec<_>>(), [1_050_000, 2_100_000]);
    }

    #[test]
    fn a_drift_grows_when_it_rose_over_the_last_periods() {
        let d = |n: i8| Date::new(2026, 11, n).unwrap_or_default();
        assert!(growing(&[(d(1), Some(0.01)), (d(2), Some(0.02)), (d(3), Some(0.04))]));
        assert!(growing(&[(d(1), Some(0.01)), (d(2), Some(0.02))]));
        assert!(!growing(&[(d(1), Some(0.01)), (d(2), Some(0.03)), (d(3), Some(0.02))]));
        assert!(!growing(&[(d(1), Some(0.02)), (d(2), Some(0.0205))]), "within noise");
        assert!(!growing(&[(d(1), Some(0.02))]));
        assert!(growing(&[(d(1), Some(0.02)), (d(2), None), (d(3), Some(0.05))]), "days without a drift skipped");
    }

    #[test]
    fn the_fold_gives_the_same_reconciliation_whatever_the_order_of_the_records() {
        let records: Vec<AuditRecord> = (0..40u64)
            .map(|i| AuditRecord {
                ts: format!("2026-11-0{}T10:00:00Z", 1 + (i / 3) % 3).parse().unwrap(),
                prompt_tokens: 100 + i,
                // A refusal (no tokens, no cost) and a record metered upstream now and then.
                completion_tokens: if i % 7 == 0 { 0 } else { 50 },
                ..crate::audit::sample::record(
                    ["acme", "globex"][(i % 2) as usize],
                    Some(["openai", "anthropic", "local"][(i % 3) as usize]),
                    if i % 5 == 0 { Metering::Upstream } else { Metering::Local },
                    if i % 7 == 0 { 0 } else { 1_000 + i },
                )
            })
            .collect();
        let provider = ProviderUsage {
            rows: vec![ProviderRow {
                date: Date::new(2026, 11, 1).unwrap(),
                backend: "openai".into(),
                model: "gpt-4o-2024-08-06".into(),
                tokens: Tokens { input: 2_000, output: 700, ..Tokens::default() },
                cost: None,
            }],
            unreadable: Vec::new(),
            backends: ["openai".to_owned(), "anthropic".to_owned()].into(),
        };
        let filter = Filter::new(Some("2026-11-01".into()), Some("2026-11-02".into())).unwrap();
        let at_once = reconcile(&records, &provider, &filter, true);
        let mut usage = GatewayUsage::new(&filter, true);
        for record in records.iter().rev() {
            usage.add(record);
        }
        assert_eq!(usage.reconcile(&provider), at_once);
        assert_eq!(at_once.not_compared, ["local"]);
        // Per day (2 in the period) and backend (3, one model each); per backend and tenant.
        assert_eq!(usage.sums(), 2 * 3 + 3 * 2);
    }

    #[test]
    fn drift_is_relative_to_the_provider() {
        assert_eq!(drift(100, 105), Some(5.0 / 105.0));
        assert_eq!(drift(100, 0), None);
        assert_eq!(drift(0, 10), Some(1.0));
    }
}
