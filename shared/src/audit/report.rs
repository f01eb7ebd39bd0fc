//! Chargeback: the audit turned into what each tenant owes (SPEC §9, `flexway report`).
//!
//! Invariants: money is summed in integer micro-euros (`cost_micro_eur`), never from the
//! float `cost_eur`; a consumption metered upstream (`metered_by: upstream`, a relay to
//! another Flexway that bills it) is shown apart and never added to what is billed
//! locally, so nothing is billed twice; a line that is not a record, or a record this
//! build does not understand (a newer `schema_version`), is never misread nor
//! skipped in silence: the read finishes and lists it apart from the totals (SPEC §2),
//! and `flexway report` exits 3.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::BufRead;

use jiff::civil::Date;
use jiff::tz::Offset;
use serde_json::json;

use super::chain::Verifier;
use super::{AuditRecord, SCHEMA_VERSION};
use crate::config::Metering;
use crate::money::MicroEur;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("line {line}: cannot read: {source}")]
    Io { line: usize, source: std::io::Error },
    #[error("{name} date {value:?} is not a calendar date YYYY-MM-DD")]
    Date { name: &'static str, value: String },
    #[error("--from {from} is after --to {to}")]
    EmptyPeriod { from: String, to: String },
}

/// A line the reader could not take as a record: where (`line 12`, a log event) and
/// why. It is counted nowhere and listed apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    pub at: String,
    pub why: String,
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.at, self.why)
    }
}

/// The lines a long read could not take, listed up to a bound and counted past it: a
/// read of millions of lines keeps the first `keep` (where and why) and the number of
/// the others, so that a damaged audit cannot grow the list with its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadables {
    listed: Vec<Unreadable>,
    unlisted: u64,
    keep: usize,
}

impl Unreadables {
    /// Every line listed.
    pub fn all() -> Self {
        Unreadables::first(usize::MAX)
    }

    /// The first `keep` lines listed, the others counted.
    pub fn first(keep: usize) -> Self {
        Unreadables { listed: Vec::new(), unlisted: 0, keep }
    }

    pub fn push(&mut self, line: Unreadable) {
        if self.listed.len() < self.keep {
            self.listed.push(line);
        } else {
            self.unlisted = self.unlisted.saturating_add(1);
        }
    }

    /// The lines listed, in the order read.
    pub fn listed(&self) -> &[Unreadable] {
        &self.listed
    }

    /// The lines past the bound: counted, not listed.
    pub fn unlisted(&self) -> u64 {
        self.unlisted
    }

    pub fn into_listed(self) -> Vec<Unreadable> {
        self.listed
    }
}

/// What reading an audit gave: the records, and every line that was not one.
#[derive(Debug, Default, PartialEq)]
pub struct Read {
    pub records: Vec<AuditRecord>,
    pub unreadable: Vec<Unreadable>,
}

/// A line's record, or why it is not one this build can count.
pub fn parse_record(line: &str) -> Result<AuditRecord, String> {
    let record: AuditRecord = serde_json::from_str(line).map_err(|e| format!("not an audit record: {e}"))?;
    if record.schema_version > SCHEMA_VERSION {
        return Err(format!(
            "schema_version {} is newer than this flexway understands ({SCHEMA_VERSION})",
            record.schema_version
        ));
    }
    if let Some(period) = record.period.as_deref().filter(|p| parse_date(p).is_none()) {
        return Err(format!("period {period:?} is not a date YYYY-MM-DD"));
    }
    Ok(record)
}

/// Reads a JSONL audit: one record per line, blank lines skipped. A line that is not
/// a record (cut, damaged, not UTF-8, of a newer schema) is listed by its number
/// (1-based) and the read goes on; only a file that cannot be read at all is an error.
pub fn read_jsonl(reader: impl BufRead) -> Result<Read, ReportError> {
    read_jsonl_verifying(reader, None)
}

/// [`read_jsonl`], each line that is text also handed to `verifier`, which checks the
/// audit's HMAC chain (`flexway report --verify`).
pub fn read_jsonl_verifying(reader: impl BufRead, verifier: Option<&mut Verifier>) -> Result<Read, ReportError> {
    let mut read = Read::default();
    for_each_jsonl(reader, verifier, |line| match line {
        Ok(record) => read.records.push(record),
        Err(unreadable) => read.unreadable.push(unreadable),
    })?;
    Ok(read)
}

/// Each line of a JSONL audit read and handed to `each` as soon as it is: its record,
/// or where and why it is not one; blank lines skipped, each line that is text also
/// handed to `verifier`. Nothing is held past its line.
pub fn for_each_jsonl(
    mut reader: impl BufRead,
    mut verifier: Option<&mut Verifier>,
    mut each: impl FnMut(Result<AuditRecord, Unreadable>),
) -> Result<(), ReportError> {
    let mut bytes = Vec::new();
    for line_no in 1.. {
        bytes.clear();
        match reader.read_until(b'\n', &mut bytes) {
            Ok(0) => break,
            Ok(_) => {}
            Err(source) => return Err(ReportError::Io { line: line_no, source }),
        }
        let at = || format!("line {line_no}");
        let Ok(line) = std::str::from_utf8(&bytes) else {
            each(Err(Unreadable { at: at(), why: "not UTF-8".into() }));
            continue;
        };
        if line.trim().is_empty() {
            continue;
        }
        if let Some(verifier) = verifier.as_deref_mut() {
            verifier.line(at, line);
        }
        each(parse_record(line.trim_end_matches(['\n', '\r'])).map_err(|why| Unreadable { at: at(), why }));
    }
    Ok(())
}

/// Which records count: those whose `ts` falls on a UTC date in `from..=to`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Inclusive.
    from: Option<Date>,
    /// Inclusive.
    to: Option<Date>,
}

impl Filter {
    /// A filter on `YYYY-MM-DD` dates, checked: calendar dates, `from` not after `to`.
    pub fn new(from: Option<String>, to: Option<String>) -> Result<Self, ReportError> {
        let date = |name: &'static str, value: Option<String>| {
            value.map(|value| parse_date(&value).ok_or(ReportError::Date { name, value })).transpose()
        };
        let (from, to) = (date("from", from)?, date("to", to)?);
        if let (Some(from), Some(to)) = (from, to)
            && from > to
        {
            return Err(ReportError::EmptyPeriod { from: from.to_string(), to: to.to_string() });
        }
        Ok(Filter { from, to })
    }

    /// The first date included, `YYYY-MM-DD`; `None` when the period is open there.
    pub fn from(&self) -> Option<String> {
        self.from.map(|date| date.to_string())
    }

    /// The last date included, `YYYY-MM-DD`; `None` when the period is open there.
    pub fn to(&self) -> Option<String> {
        self.to.map(|date| date.to_string())
    }

    /// The period in words, for a document's heading: `all records`, `from D`,
    /// `until D`, `D1 to D2`.
    pub fn describe(&self) -> String {
        match (self.from(), self.to()) {
            (None, None) => "all records".to_owned(),
            (Some(from), None) => format!("from {from}"),
            (None, Some(to)) => format!("until {to}"),
            (Some(from), Some(to)) => format!("{from} to {to}"),
        }
    }

    /// The period as Unix milliseconds: the first millisecond of `from` and the last of
    /// `to` (UTC), both inclusive; `None` where the period is open. For sources that can
    /// narrow a read by time (a CloudWatch log group); [`Filter::matches`] still decides.
    pub fn unix_millis(&self) -> (Option<i64>, Option<i64>) {
        let start_of = |date: Date| Offset::UTC.to_timestamp(date.at(0, 0, 0, 0)).ok().map(|ts| ts.as_millisecond());
        let from = self.from.and_then(start_of);
        let to = self.to.and_then(|to| match to.tomorrow() {
            Ok(next) => start_of(next).map(|start| start - 1),
            Err(_) => Some(i64::MAX),
        });
        (from, to)
    }

    /// Whether the record counts on a UTC date of the period: its reservation's date
    /// (`period`, the ledger's rule), else the date of its `ts`.
    pub fn matches(&self, record: &AuditRecord) -> bool {
        (self.from.is_none() && self.to.is_none()) || self.contains(record_date(record))
    }

    /// Whether `date` is in the period.
    pub fn contains(&self, date: Date) -> bool {
        self.from.is_none_or(|from| date >= from) && self.to.is_none_or(|to| date <= to)
    }

    /// The first and last dates included, as dates.
    pub fn dates(&self) -> (Option<Date>, Option<Date>) {
        (self.from, self.to)
    }
}

/// The UTC date a record counts on: its reservation's (`period`, the ledger's rule),
/// else its `ts`'s.
pub fn record_date(record: &AuditRecord) -> Date {
    record.period.as_deref().and_then(parse_date).unwrap_or_else(|| Offset::UTC.to_datetime(record.ts.instant()).date())
}

/// A calendar date written `YYYY-MM-DD`, and nothing else that reads as one.
pub fn parse_date(text: &str) -> Option<Date> {
    text.parse::<Date>().ok().filter(|date| date.to_string() == text)
}

/// Calls, tokens and cost, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cost: MicroEur,
}

impl Totals {
    fn add_record(&mut self, record: &AuditRecord) {
        self.calls = self.calls.saturating_add(1);
        self.prompt_tokens = self.prompt_tokens.saturating_add(record.prompt_tokens);
        self.completion_tokens = self.completion_tokens.saturating_add(record.completion_tokens);
        self.cost = self.cost.saturating_add(record.cost());
    }

    /// As [`Totals::add_record`], the record counted as a call only when it is one of
    /// its run's ([`is_a_runs_call`]): its tokens and cost are added either way (a
    /// refusal's are none).
    fn add_run_record(&mut self, record: &AuditRecord) {
        let calls = self.calls;
        self.add_record(record);
        self.calls = calls.saturating_add(u64::from(is_a_runs_call(record)));
    }

    fn add(&mut self, other: &Totals) {
        self.calls = self.calls.saturating_add(other.calls);
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.completion_tokens = self.completion_tokens.saturating_add(other.completion_tokens);
        self.cost = self.cost.saturating_add(other.cost);
    }

    fn to_json(self) -> serde_json::Value {
        json!({
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost_micro_eur": self.cost.0,
            "cost_eur": self.cost.to_eur_string(),
        })
    }
}

/// One line of the breakdown: a tenant's consumption through one agent (or none) on
/// one backend (or none: a call refused before routing), metered one way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub tenant: String,
    pub agent: Option<String>,
    pub backend: Option<String>,
    /// A metered gRPC method's or REST operation's feature (SPEC §10): their rows are
    /// split by feature.
    pub feature: Option<String>,
    pub metered_by: Metering,
    pub totals: Totals,
}

/// A tenant's part of the report: what is billed here, and apart, what is metered
/// (and billed) upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantReport {
    pub tenant: String,
    /// Rows billed locally (every `metered_by` other than `upstream`).
    pub local: Vec<Row>,
    /// Rows metered upstream: for information, not billed here.
    pub upstream: Vec<Row>,
    pub local_total: Totals,
    pub upstream_total: Totals,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub filter: Filter,
    /// By tenant name.
    pub tenants: Vec<TenantReport>,
    /// What is billed locally, all tenants.
    pub local_total: Totals,
    /// What is metered upstream, all tenants (not part of `local_total`).
    pub upstream_total: Totals,
}

/// Sums the records that pass `filter` per (tenant, agent, backend, feature,
/// metered_by); only metered gRPC methods and REST operations have a feature.
pub fn chargeback(records: &[AuditRecord], filter: &Filter) -> Report {
    type Key<'a> = (&'a str, Option<&'a str>, Option<&'a str>, Option<&'a str>, Metering);
    let mut sums: BTreeMap<Key<'_>, Totals> = BTreeMap::new();
    for record in records.iter().filter(|r| filter.matches(r)) {
        let backend = record.backend.as_deref();
        let key =
            (record.tenant.as_str(), record.agent.as_deref(), backend, record.feature.as_deref(), record.metered_by);
        sums.entry(key).or_default().add_record(record);
    }

    let mut tenants: Vec<TenantReport> = Vec::new();
    for ((tenant, agent, backend, feature, metered_by), totals) in sums {
        if tenants.last().is_none_or(|t| t.tenant != tenant) {
            tenants.push(TenantReport {
                tenant: tenant.to_owned(),
                local: Vec::new(),
                upstream: Vec::new(),
                local_total: Totals::default(),
                upstream_total: Totals::default(),
            });
        }
        let Some(part) = tenants.last_mut() else {
            continue;
        };
        let row = Row {
            tenant: tenant.to_owned(),
            agent: agent.map(str::to_owned),
            backend: backend.map(str::to_owned),
            feature: feature.map(str::to_owned),
            metered_by,
            totals,
        };
        if metered_by == Metering::Upstream {
            part.upstream_total.add(&totals);
            part.upstream.push(row);
        } else {
            part.local_total.add(&totals);
            part.local.push(row);
        }
    }

    let mut local_total = Totals::default();
    let mut upstream_total = Totals::default();
    for part in &tenants {
        local_total.add(&part.local_total);
        upstream_total.add(&part.upstream_total);
    }
    Report { filter: filter.clone(), tenants, local_total, upstream_total }
}

const NONE: &str = "-";

/// One row per line, locally billed rows first, then the upstream-metered ones; no
/// totals rows, so that summing the cost column of the `local` rows gives the bill.
/// When metered gRPC or REST rows are present, a last column says their feature (`-`
/// for others).
pub fn to_csv(report: &Report) -> String {
    let rows = || report.tenants.iter().flat_map(|t| &t.local).chain(report.tenants.iter().flat_map(|t| &t.upstream));
    let features = rows().any(|row| row.feature.is_some());
    let mut out = String::from("tenant,agent,backend,metered_by,calls,prompt_tokens,completion_tokens,cost_eur");
    out.push_str(if features { ",feature\n" } else { "\n" });
    for row in rows() {
        let fields = [
            csv_field(&row.tenant),
            csv_field(row.agent.as_deref().unwrap_or(NONE)),
            csv_field(row.backend.as_deref().unwrap_or(NONE)),
            csv_field(row.metered_by.as_str()),
            row.totals.calls.to_string(),
            row.totals.prompt_tokens.to_string(),
            row.totals.completion_tokens.to_string(),
            row.totals.cost.to_eur_string(),
        ];
        out.push_str(&fields.join(","));
        if features {
            out.push(',');
            out.push_str(&csv_field(row.feature.as_deref().unwrap_or(NONE)));
        }
        out.push('\n');
    }
    out
}

/// RFC 4180: a field with a comma, quote or line break is quoted, quotes doubled.
pub fn csv_field(value: &str) -> String {
    if value.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value.to_owned()
    }
}

/// Costs appear twice: `cost_micro_eur` (exact integer) and `cost_eur` (a string with
/// six decimals, so that no float rounding creeps in). A missing agent or backend is null.
pub fn to_json(report: &Report) -> serde_json::Value {
    let row_json = |row: &Row| {
        let mut value = row.totals.to_json();
        if let Some(object) = value.as_object_mut() {
            object.insert("agent".into(), json!(row.agent));
            object.insert("backend".into(), json!(row.backend));
            object.insert("metered_by".into(), json!(row.metered_by));
            if let Some(feature) = &row.feature {
                object.insert("feature".into(), json!(feature));
            }
        }
        value
    };
    let tenants: Vec<serde_json::Value> = report
        .tenants
        .iter()
        .map(|t| {
            json!({
                "tenant": t.tenant,
                "local": {
                    "rows": t.local.iter().map(row_json).collect::<Vec<_>>(),
                    "total": t.local_total.to_json(),
                },
                "upstream": {
                    "rows": t.upstream.iter().map(row_json).collect::<Vec<_>>(),
                    "total": t.upstream_total.to_json(),
                },
            })
        })
        .collect();
    json!({
        "from": report.filter.from(),
        "to": report.filter.to(),
        "tenants": tenants,
        "local_total": report.local_total.to_json(),
        "upstream_total": report.upstream_total.to_json(),
    })
}

/// A section per tenant (a table of locally billed rows with its total, then the
/// upstream-metered rows apart), and a summary table of what is billed locally.
pub fn to_markdown(report: &Report) -> String {
    let mut out = String::from("# Flexway chargeback\n\n");
    let _ = writeln!(out, "Period: {} (UTC dates, inclusive). Costs in EUR.\n", report.filter.describe());
    if report.tenants.is_empty() {
        out.push_str("No calls in this period.\n");
        return out;
    }
    const HEADER: &str = "| agent | backend | calls | prompt tokens | completion tokens | cost (EUR) |\n\
                          | --- | --- | ---: | ---: | ---: | ---: |\n";
    for tenant in &report.tenants {
        let _ = writeln!(out, "## {}\n", md_cell(&tenant.tenant));
        out.push_str("Billed locally:\n\n");
        if tenant.local.is_empty() {
            out.push_str("None.\n\n");
        } else {
            out.push_str(HEADER);
            for row in &tenant.local {
                md_row(&mut out, row);
            }
            md_total(&mut out, "**total**", &tenant.local_total);
            out.push('\n');
        }
        if !tenant.upstream.is_empty() {
            out.push_str("Metered upstream (billed where it is paid, not included above):\n\n");
            out.push_str(HEADER);
            for row in &tenant.upstream {
                md_row(&mut out, row);
            }
            md_total(&mut out, "**total upstream**", &tenant.upstream_total);
            out.push('\n');
        }
    }
    out.push_str("## Billed locally, all tenants\n\n");
    out.push_str("| tenant | calls | prompt tokens | completion tokens | cost (EUR) |\n");
    out.push_str("| --- | ---: | ---: | ---: | ---: |\n");
    for tenant in &report.tenants {
        let t = &tenant.local_total;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            md_cell(&tenant.tenant),
            t.calls,
            t.prompt_tokens,
            t.completion_tokens,
            t.cost.to_eur_string()
        );
    }
    let t = &report.local_total;
    let _ = writeln!(
        out,
        "| **total** | **{}** | **{}** | **{}** | **{}** |",
        t.calls,
        t.prompt_tokens,
        t.completion_tokens,
        t.cost.to_eur_string()
    );
    if report.upstream_total.calls > 0 {
        let t = &report.upstream_total;
        let _ = writeln!(
            out,
            "\nMetered upstream, all tenants (not included above): {} call(s), {} EUR.",
            t.calls,
            t.cost.to_eur_string()
        );
    }
    out
}

fn md_row(out: &mut String, row: &Row) {
    let t = &row.totals;
    let backend = row.backend.as_deref().unwrap_or(NONE);
    // A gRPC row: the backend and, in parentheses, the feature.
    let backend = match &row.feature {
        Some(feature) => format!("{backend} ({feature})"),
        None => backend.to_owned(),
    };
    let _ = writeln!(
        out,
        "| {} | {} | {} | {} | {} | {} |",
        md_cell(row.agent.as_deref().unwrap_or(NONE)),
        md_cell(&backend),
        t.calls,
        t.prompt_tokens,
        t.completion_tokens,
        t.cost.to_eur_string()
    );
}

fn md_total(out: &mut String, label: &str, t: &Totals) {
    let _ = writeln!(
        out,
        "| {label} | | **{}** | **{}** | **{}** | **{}** |",
        t.calls,
        t.prompt_tokens,
        t.completion_tokens,
        t.cost.to_eur_string()
    );
}

/// Whether a record's call is one of its run's `calls`, as the run's
/// `GET /v1/flexway/runs/{id}` counts them (SPEC §15): the record's `charged`, a call
/// served and settled (at any cost, nothing included: a tool priced at nothing, an
/// unmetered operation, a response cache hit), its request kept counted in the
/// ledger. A refusal (a budget, a rate, a run that ended), and a call refunded whole
/// (no backend answered, a tool's JSON-RPC error, a metered operation not served), is
/// recorded with its run but is not one of its calls. A realtime session is one call,
/// charged when one of its responses was.
///
/// A record written before `charged` existed is judged from what it holds: tokens or
/// a cost, or a model call's cache hit. There a gRPC, REST or MCP call served at no
/// cost cannot be told from a refund (it is not counted), and a realtime session
/// counts once where the ledger of then counted each response.
pub fn is_a_runs_call(record: &AuditRecord) -> bool {
    use super::{CacheOutcome, Operation};
    if let Some(charged) = record.charged {
        return charged;
    }
    let metered = matches!(record.operation, Operation::Grpc | Operation::Http | Operation::Mcp);
    record.cost_micro_eur > 0
        || record.prompt_tokens > 0
        || record.completion_tokens > 0
        || (record.cache == Some(CacheOutcome::Hit) && !metered)
}

/// What `flexway report --by run` groups on: one row per run (SPEC §15), per the
/// tenant and agent whose run it is, metered one way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRow {
    pub tenant: String,
    pub agent: Option<String>,
    /// `None`: the calls that named no run, so that the rows still add up to the bill.
    pub run: Option<String>,
    pub metered_by: Metering,
    pub totals: Totals,
}

/// The audit totalled per run: locally billed rows, and apart those metered upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunReport {
    pub filter: Filter,
    /// By tenant, agent, then run (the calls of no run first).
    pub local: Vec<RunRow>,
    pub upstream: Vec<RunRow>,
    /// What is billed locally, all runs and the calls of none: the tokens and cost of
    /// [`Report::local_total`] of the same records; its calls are the charged ones.
    pub local_total: Totals,
    pub upstream_total: Totals,
}

/// Sums the records that pass `filter` per (tenant, agent, run, metered_by). A record
/// that named no run counts in its tenant's and agent's row of no run: every record
/// is in one row, so the locally billed rows add up to the same bill as
/// [`chargeback`]'s. A row's `calls` are its charged calls ([`is_a_runs_call`]), as a
/// run's `GET` counts them: a refused call adds nothing to it.
pub fn by_run(records: &[AuditRecord], filter: &Filter) -> RunReport {
    type Key<'a> = (&'a str, Option<&'a str>, Option<&'a str>, Metering);
    let mut sums: BTreeMap<Key<'_>, Totals> = BTreeMap::new();
    for record in records.iter().filter(|r| filter.matches(r)) {
        let key = (record.tenant.as_str(), record.agent.as_deref(), record.run.as_deref(), record.metered_by);
        sums.entry(key).or_default().add_run_record(record);
    }
    let mut report = RunReport {
        filter: filter.clone(),
        local: Vec::new(),
        upstream: Vec::new(),
        local_total: Totals::default(),
        upstream_total: Totals::default(),
    };
    for ((tenant, agent, run, metered_by), totals) in sums {
        let row = RunRow {
            tenant: tenant.to_owned(),
            agent: agent.map(str::to_owned),
            run: run.map(str::to_owned),
            metered_by,
            totals,
        };
        if metered_by == Metering::Upstream {
            report.upstream_total.add(&totals);
            report.upstream.push(row);
        } else {
            report.local_total.add(&totals);
            report.local.push(row);
        }
    }
    report
}

/// As [`to_csv`]: locally billed rows first, then the upstream-metered ones, no totals
/// rows; a call of no run has run `-`.
pub fn runs_to_csv(report: &RunReport) -> String {
    let mut out = String::from("tenant,agent,run,metered_by,calls,prompt_tokens,completion_tokens,cost_eur\n");
    for row in report.local.iter().chain(&report.upstream) {
        let fields = [
            csv_field(&row.tenant),
            csv_field(row.agent.as_deref().unwrap_or(NONE)),
            csv_field(row.run.as_deref().unwrap_or(NONE)),
            csv_field(row.metered_by.as_str()),
            row.totals.calls.to_string(),
            row.totals.prompt_tokens.to_string(),
            row.totals.completion_tokens.to_string(),
            row.totals.cost.to_eur_string(),
        ];
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    out
}

/// As [`to_json`]; a call of no run has `"run": null`.
pub fn runs_to_json(report: &RunReport) -> serde_json::Value {
    let row_json = |row: &RunRow| {
        let mut value = row.totals.to_json();
        if let Some(object) = value.as_object_mut() {
            object.insert("tenant".into(), json!(row.tenant));
            object.insert("agent".into(), json!(row.agent));
            object.insert("run".into(), json!(row.run));
            object.insert("metered_by".into(), json!(row.metered_by));
        }
        value
    };
    json!({
        "from": report.filter.from(),
        "to": report.filter.to(),
        "by": "run",
        "local": {
            "rows": report.local.iter().map(row_json).collect::<Vec<_>>(),
            "total": report.local_total.to_json(),
        },
        "upstream": {
            "rows": report.upstream.iter().map(row_json).collect::<Vec<_>>(),
            "total": report.upstream_total.to_json(),
        },
    })
}

/// One table of locally billed rows and their total, then the upstream-metered rows
/// apart.
pub fn runs_to_markdown(report: &RunReport) -> String {
    let mut out = String::from("# Flexway chargeback by run\n\n");
    let _ = writeln!(out, "Period: {} (UTC dates, inclusive). Costs in EUR.\n", report.filter.describe());
    if report.local.is_empty() && report.upstream.is_empty() {
        out.push_str("No calls in this period.\n");
        return out;
    }
    out.push_str("Run `-`: the calls that named no run.\n\n");
    const HEADER: &str = "| tenant | agent | run | calls | prompt tokens | completion tokens | cost (EUR) |\n\
                          | --- | --- | --- | ---: | ---: | ---: | ---: |\n";
    let table = |out: &mut String, rows: &[RunRow], label: &str, total: &Totals| {
        out.push_str(HEADER);
        for row in rows {
            let t = &row.totals;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                md_cell(&row.tenant),
                md_cell(row.agent.as_deref().unwrap_or(NONE)),
                md_cell(row.run.as_deref().unwrap_or(NONE)),
                t.calls,
                t.prompt_tokens,
                t.completion_tokens,
                t.cost.to_eur_string()
            );
        }
        let _ = writeln!(
            out,
            "| {label} | | | **{}** | **{}** | **{}** | **{}** |",
            total.calls,
            total.prompt_tokens,
            total.completion_tokens,
            total.cost.to_eur_string()
        );
    };
    out.push_str("Billed locally:\n\n");
    if report.local.is_empty() {
        out.push_str("None.\n");
    } else {
        table(&mut out, &report.local, "**total**", &report.local_total);
    }
    if !report.upstream.is_empty() {
        out.push_str("\nMetered upstream (billed where it is paid, not included above):\n\n");
        table(&mut out, &report.upstream, "**total upstream**", &report.upstream_total);
    }
    out
}

/// Names come from the config, but a `|` or a line break would still break the table.
pub fn md_cell(value: &str) -> String {
    value.replace('\\', "\\\\").replace('|', "\\|").replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::{BudgetState, Operation, UsageSource};
    use crate::config::Capability;

    fn record(
        ts: &str,
        tenant: &str,
        agent: Option<&str>,
        backend: &str,
        metered_by: Metering,
        cost: u64,
    ) -> AuditRecord {
        AuditRecord {
            schema_version: SCHEMA_VERSION,
            ts: ts.parse().unwrap(),
            request_id: format!("req-{ts}-{cost}"),
            tenant: tenant.into(),
            agent: agent.map(Into::into),
            operation: Operation::Chat,
            capability: Capability::Chat,
            model_requested: Some("gpt-4o".into()),
            model_served: Some("gpt-4o".into()),
            backend: Some(backend.into()),
            metered_by,
            prompt_tokens: 100,
            completion_tokens: 10,
            cached_tokens: None,
            cache_write_tokens: None,
            usage_source: UsageSource::Reported,
            cost_eur: cost as f64 / 1e6,
            cost_micro_eur: cost,
            charged: None,
            status: 200,
            error_code: None,
            degraded: false,
            budget_state: BudgetState::Ok,
            latency_ms: 300,
            ttfb_ms: Some(90),
            key_hash: "00".repeat(32),
            user_hash: None,
            close_reason: None,
            feature: None,
            pick_reason: None,
            criticality: None,
            period: None,
            run: None,
            skipped: Vec::new(),
            cache: None,
            cache_similarity: None,
            cache_age_s: None,
            cost_saved_eur: None,
            cost_saved_micro_eur: None,
            mcp_server: None,
            tool: None,
            mcp_status: None,
            chain: None,
        }
    }

    fn sample() -> Vec<AuditRecord> {
        vec![
            record("2025-03-01T08:00:00Z", "acme", Some("bot"), "ptu-west", Metering::Local, 1_000),
            record("2025-03-01T09:00:00Z", "acme", Some("bot"), "ptu-west", Metering::Local, 2_000),
            record("2025-03-02T09:00:00Z", "acme", None, "payg-north", Metering::Local, 500),
            record("2025-03-02T10:00:00Z", "acme", Some("bot"), "peer", Metering::Upstream, 9_000_000),
            record("2025-03-03T23:59:59Z", "globex", None, "ptu-west", Metering::Local, 1_500_020),
        ]
    }

    fn key(row: &Row) -> (&str, Option<&str>, Option<&str>, Metering) {
        (row.tenant.as_str(), row.agent.as_deref(), row.backend.as_deref(), row.metered_by)
    }

    #[test]
    fn by_run_totals_each_run_and_keeps_calls_of_no_run_in_the_bill() {
        let mut records = sample();
        records[0].run = Some("run_a".into());
        records[1].run = Some("run_a".into());
        records[3].run = Some("run_a".into());
        records[4].run = Some("run_b".into());
        let report = by_run(&records, &Filter::default());
        let keys: Vec<_> =
            report.local.iter().map(|r| (r.tenant.as_str(), r.agent.as_deref(), r.run.as_deref())).collect();
        assert_eq!(
            keys,
            vec![("acme", None, None), ("acme", Some("bot"), Some("run_a")), ("globex", None, Some("run_b"))]
        );
        let run_a = &report.local[1].totals;
        assert_eq!(*run_a, Totals { calls: 2, prompt_tokens: 200, completion_tokens: 20, cost: MicroEur(3_000) });
        assert_eq!(report.upstream.len(), 1, "run_a's upstream-metered call is apart");
        assert_eq!(report.upstream[0].run.as_deref(), Some("run_a"));
        let bill = chargeback(&records, &Filter::default());
        assert_eq!(report.local_total, bill.local_total, "the rows add up to the same bill");
        assert_eq!(report.upstream_total, bill.upstream_total);
    }

    #[test]
    fn by_run_counts_a_runs_charged_calls_not_its_refusals() {
        let mut records = sample();
        records.truncate(2);
        let mut refused = record("2025-03-01T10:00:00Z", "acme", Some("bot"), "ptu-west", Metering::Local, 0);
        (refused.prompt_tokens, refused.completion_tokens, refused.status) = (0, 0, 429);
        refused.error_code = Some(crate::call::ErrorCode::BudgetExceeded);
        let mut hit = record("2025-03-01T11:00:00Z", "acme", Some("bot"), "ptu-west", Metering::Local, 0);
        (hit.prompt_tokens, hit.completion_tokens, hit.cache) = (0, 0, Some(crate::audit::CacheOutcome::Hit));
        records.extend([refused, hit]);
        for record in &mut records {
            record.run = Some("run_a".into());
        }
        let report = by_run(&records, &Filter::default());
        let run_a = &report.local[0].totals;
        assert_eq!(*run_a, Totals { calls: 3, prompt_tokens: 200, completion_tokens: 20, cost: MicroEur(3_000) });
        let bill = chargeback(&records, &Filter::default()).local_total;
        assert_eq!((bill.calls, bill.cost), (4, run_a.cost), "the bill counts every record, the run its calls");
        assert!(!is_a_runs_call(&records[2]), "a refusal is no call of its run");
        assert!(is_a_runs_call(&records[3]), "a cache hit is, at no cost");
    }

    /// A record's `charged` decides, whatever its tokens and cost: a tool of no price
    /// served counts, a session of tokens whose responses counted no request does not.
    /// Without it (an older record), the tokens and cost do.
    #[test]
    fn a_records_charged_says_whether_it_is_a_call_of_its_run() {
        let mut free = record("2025-03-01T10:00:00Z", "acme", Some("bot"), "tools", Metering::Local, 0);
        (free.operation, free.prompt_tokens, free.completion_tokens) = (Operation::Mcp, 0, 0);
        assert!(!is_a_runs_call(&free), "an older record of nothing reads as a refund");
        free.charged = Some(true);
        assert!(is_a_runs_call(&free), "served at no cost, charged");
        let mut refunded = free.clone();
        refunded.charged = Some(false);
        assert!(!is_a_runs_call(&refunded));
        let mut session = record("2025-03-01T11:00:00Z", "acme", Some("bot"), "rt", Metering::Local, 75);
        session.operation = Operation::Realtime;
        assert!(is_a_runs_call(&session), "an older record of tokens reads as a call");
        session.charged = Some(false);
        assert!(!is_a_runs_call(&session), "no response of it counted its request");
        let mut records = vec![free, refunded, session];
        for record in &mut records {
            record.run = Some("run_a".into());
        }
        let run_a = by_run(&records, &Filter::default()).local[0].totals;
        assert_eq!((run_a.calls, run_a.cost), (1, MicroEur(75)), "one call; every record's cost");
    }

    #[test]
    fn by_run_formats_name_the_run_and_a_dash_for_none() {
        let mut records = sample();
        records[0].run = Some("run_a".into());
        let report = by_run(&records, &Filter::default());
        let csv = runs_to_csv(&report);
        assert!(csv.starts_with("tenant,agent,run,metered_by,calls,prompt_tokens,completion_tokens,cost_eur\n"));
        assert!(csv.contains("acme,bot,run_a,local,1,100,10,0.001000\n"), "{csv}");
        assert!(csv.contains("acme,bot,-,local,1,100,10,0.002000\n"), "{csv}");
        let json = runs_to_json(&report);
        assert_eq!(json["by"], "run");
        assert_eq!(json["local"]["total"]["cost_micro_eur"], 3_500 + 1_500_020);
        assert!(json["local"]["rows"].as_array().unwrap().iter().any(|r| r["run"].is_null()));
        let md = runs_to_markdown(&report);
        assert!(md.contains("| acme | bot | run_a | 1 | 100 | 10 | 0.001000 |"), "{md}");
        assert!(md.contains("Metered upstream"));
    }

    #[test]
    fn breaks_down_per_agent_and_backend() {
        let report = chargeback(&sample(), &Filter::default());
        let acme = &report.tenants[0];
        assert_eq!(acme.tenant, "acme");
        let keys: Vec<_> = acme.local.iter().map(key).collect();
        assert_eq!(
            keys,
            vec![
                ("acme", None, Some("payg-north"), Metering::Local),
                ("acme", Some("bot"), Some("ptu-west"), Metering::Local),
            ]
        );
        let bot = &acme.local[1].totals;
        assert_eq!(*bot, Totals { calls: 2, prompt_tokens: 200, completion_tokens: 20, cost: MicroEur(3_000) });
        assert_eq!(report.tenants[1].tenant, "globex");
    }

    #[test]
    fn upstream_rows_are_apart_and_not_billed_locally() {
        let report = chargeback(&sample(), &Filter::default());
        let acme = &report.tenants[0];
        assert_eq!(acme.upstream.len(), 1);
        assert_eq!(key(&acme.upstream[0]), ("acme", Some("bot"), Some("peer"), Metering::Upstream));
        assert_eq!(acme.upstream_total.cost, MicroEur(9_000_000));
        assert_eq!(acme.local_total.cost, MicroEur(3_500));
        assert_eq!(report.local_total.cost, MicroEur(3_500 + 1_500_020));
        assert_eq!(report.upstream_total.cost, MicroEur(9_000_000));
        assert!(acme.local.iter().all(|r| r.metered_by != Metering::Upstream));
    }

    #[test]
    fn totals_equal_the_sum_of_local_costs() {
        let records = sample();
        let report = chargeback(&records, &Filter::default());
        let local: u64 = records.iter().filter(|r| r.metered_by == Metering::Local).map(|r| r.cost_micro_eur).sum();
        assert_eq!(report.local_total.cost, MicroEur(local));
        let per_tenant: u64 = report.tenants.iter().map(|t| t.local_total.cost.0).sum();
        assert_eq!(per_tenant, local);
        assert_eq!(report.local_total.calls + report.upstream_total.calls, records.len() as u64);
    }

    #[test]
    fn sums_micro_euros_not_the_float() {
        let mut odd = record("2025-03-01T00:00:00Z", "acme", None, "b", Metering::Local, 7);
        odd.cost_eur = 123.0;
        let report = chargeback(&[odd.clone(), odd], &Filter::default());
        assert_eq!(report.local_total.cost, MicroEur(14));
    }

    #[test]
    fn date_filters_are_inclusive() {
        let records = sample();
        let filter = Filter::new(Some("2025-03-02".into()), Some("2025-03-03".into())).unwrap();
        let report = chargeback(&records, &filter);
        assert_eq!(report.local_total.calls, 2);
        assert_eq!(report.local_total.cost, MicroEur(500 + 1_500_020));
        assert_eq!(report.upstream_total.calls, 1);

        let day = Filter::new(Some("2025-03-01".into()), Some("2025-03-01".into())).unwrap();
        assert_eq!(chargeback(&records, &day).local_total.cost, MicroEur(3_000));
        let until = Filter::new(None, Some("2025-03-01".into())).unwrap();
        assert_eq!(chargeback(&records, &until).local_total.calls, 2);
        let since = Filter::new(Some("2025-03-03".into()), None).unwrap();
        assert_eq!(chargeback(&records, &since).local_total.calls, 1);
    }

    #[test]
    fn filter_refuses_bad_dates_and_an_empty_period() {
        assert!(matches!(Filter::new(Some("2025/03/01".into()), None), Err(ReportError::Date { name: "from", .. })));
        assert!(Filter::new(None, Some("2025-02-29".into())).is_err());
        assert!(Filter::new(None, Some("2024-02-29".into())).is_ok());
        assert!(Filter::new(Some("2025-13-01".into()), None).is_err());
        // Only the YYYY-MM-DD spelling: the other ISO 8601 forms of a date are refused.
        for other in ["20250301", "2025-3-1", "+002025-03-01", "2025-03-01T00:00:00Z", " 2025-03-01"] {
            assert!(Filter::new(Some(other.into()), None).is_err(), "{other}");
        }
        let filter = Filter::new(Some("2024-02-29".into()), Some("2024-03-01".into())).unwrap();
        assert_eq!((filter.from().as_deref(), filter.to().as_deref()), (Some("2024-02-29"), Some("2024-03-01")));
        let error = Filter::new(Some("2025-03-02".into()), Some("2025-03-01".into())).unwrap_err();
        assert!(matches!(error, ReportError::EmptyPeriod { .. }), "{error}");
    }

    #[test]
    fn the_period_in_unix_millis_covers_whole_utc_days() {
        assert_eq!(Filter::default().unix_millis(), (None, None));
        let day = Filter::new(Some("1970-01-02".into()), Some("1970-01-02".into())).unwrap();
        assert_eq!(day.unix_millis(), (Some(86_400_000), Some(2 * 86_400_000 - 1)));
        // 2026-11-29T00:00:00Z and 2026-11-30T23:59:59.999Z.
        let span = Filter::new(Some("2026-11-29".into()), Some("2026-11-30".into())).unwrap();
        assert_eq!(span.unix_millis(), (Some(1_795_910_400_000), Some(1_796_083_199_999)));
        let leap = Filter::new(None, Some("2024-02-29".into())).unwrap();
        assert_eq!(leap.unix_millis(), (None, Some(1_709_251_199_999)));
        let before_the_epoch = Filter::new(Some("1969-12-31".into()), None).unwrap();
        assert_eq!(before_the_epoch.unix_millis(), (Some(-86_400_000), None));
    }

    /// A call reserved at 23:59:58 on the last day of a month and ended on the first
    /// of the next counts where the ledger counted it: on its reservation's date.
    #[test]
    fn a_record_counts_on_its_reservations_date_at_a_months_edge() {
        let mut late = record("2025-04-01T00:00:03Z", "acme", None, "b", Metering::Local, 7);
        late.period = Some("2025-03-31".into());
        let march = Filter::new(Some("2025-03-01".into()), Some("2025-03-31".into())).unwrap();
        let april = Filter::new(Some("2025-04-01".into()), Some("2025-04-30".into())).unwrap();
        assert_eq!(chargeback(std::slice::from_ref(&late), &march).local_total.calls, 1);
        assert_eq!(chargeback(std::slice::from_ref(&late), &april).local_total.calls, 0);
        let line = serde_json::to_string(&late).unwrap();
        assert!(line.contains(r#""period":"2025-03-31""#), "{line}");
        let bad = line.replace("2025-03-31", "March");
        let read = read_jsonl(bad.as_bytes()).unwrap();
        assert!(read.unreadable[0].why.contains("is not a date"), "{:?}", read.unreadable);
    }

    #[test]
    fn a_record_counts_on_its_utc_date_whatever_the_offset_written() {
        // 00:30 on the 2nd at +01:00 is 23:30 on the 1st in UTC.
        let late = record("2025-03-02T00:30:00+01:00", "acme", None, "b", Metering::Local, 1);
        let first = Filter::new(Some("2025-03-01".into()), Some("2025-03-01".into())).unwrap();
        assert_eq!(chargeback(std::slice::from_ref(&late), &first).local_total.calls, 1);
        let second = Filter::new(Some("2025-03-02".into()), None).unwrap();
        assert_eq!(chargeback(&[late], &second).local_total.calls, 0);
    }

    #[test]
    fn a_record_whose_ts_is_not_a_timestamp_is_listed_with_its_line() {
        let good = serde_json::to_string(&sample()[0]).unwrap();
        let bad = good.replace("2025-03-01T08:00:00.000Z", "yesterday");
        assert_ne!(good, bad);
        let read = read_jsonl(format!("{good}\n{bad}\n").as_bytes()).unwrap();
        assert_eq!(read.records, sample()[..1]);
        let [unreadable] = read.unreadable.as_slice() else { panic!("{:?}", read.unreadable) };
        assert_eq!(unreadable.at, "line 2");
        assert!(unreadable.why.contains("\"yesterday\" is not an RFC 3339 timestamp"), "{unreadable}");
    }

    #[test]
    fn reads_jsonl_skipping_blank_lines() {
        let records = sample();
        let mut text = String::new();
        for r in &records {
            text.push_str(&serde_json::to_string(r).unwrap());
            text.push_str("\n\n");
        }
        text.push_str("   \n");
        assert_eq!(read_jsonl(text.as_bytes()).unwrap(), Read { records, unreadable: Vec::new() });
    }

    #[test]
    fn the_read_goes_past_unreadable_lines_and_names_each() {
        let good = serde_json::to_string(&sample()[0]).unwrap();
        let cut = &good[..good.len() / 2];
        let mut text = format!("{good}\n\n{{\"tenant\": \"acme\"}}\n{cut}\n").into_bytes();
        text.extend_from_slice(b"\xff\xfe\n");
        text.extend_from_slice(format!("{good}\n").as_bytes());
        let read = read_jsonl(text.as_slice()).unwrap();
        assert_eq!(read.records.len(), 2, "the lines around the unreadable ones are read");
        let at: Vec<&str> = read.unreadable.iter().map(|u| u.at.as_str()).collect();
        assert_eq!(at, ["line 3", "line 4", "line 5"]);
        assert!(read.unreadable[0].why.starts_with("not an audit record"), "{}", read.unreadable[0]);
        assert_eq!(read.unreadable[2].why, "not UTF-8");
    }

    #[test]
    fn a_bounded_list_of_unreadable_lines_keeps_the_first_and_counts_the_others() {
        let line = |n: usize| Unreadable { at: format!("line {n}"), why: "cut".into() };
        let mut first = Unreadables::first(2);
        let mut all = Unreadables::all();
        for n in 1..=5 {
            first.push(line(n));
            all.push(line(n));
        }
        assert_eq!(first.listed(), [line(1), line(2)]);
        assert_eq!(first.unlisted(), 3);
        assert_eq!((all.into_listed().len(), 0), (5, first.into_listed().len() - 2));
    }

    #[test]
    fn a_newer_schema_version_is_listed_never_misread() {
        let mut newer = sample()[0].clone();
        newer.schema_version = SCHEMA_VERSION + 1;
        let text = serde_json::to_string(&newer).unwrap();
        let read = read_jsonl(text.as_bytes()).unwrap();
        assert!(read.records.is_empty());
        assert_eq!(read.unreadable.len(), 1);
        assert!(read.unreadable[0].why.contains("is newer than this flexway understands"), "{}", read.unreadable[0]);
    }

    #[test]
    fn csv_has_a_header_and_quotes_commas() {
        let records = vec![
            record("2025-03-01T08:00:00Z", "acme, inc", Some("say \"hi\""), "ptu", Metering::Local, 1_500_020),
            record("2025-03-01T08:00:00Z", "acme, inc", None, "peer", Metering::Upstream, 7),
        ];
        let csv = to_csv(&chargeback(&records, &Filter::default()));
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines,
            vec![
                "tenant,agent,backend,metered_by,calls,prompt_tokens,completion_tokens,cost_eur",
                "\"acme, inc\",\"say \"\"hi\"\"\",ptu,local,1,100,10,1.500020",
                "\"acme, inc\",-,peer,upstream,1,100,10,0.000007",
            ]
        );
    }

    #[test]
    fn csv_lists_local_rows_before_upstream_rows() {
        let csv = to_csv(&chargeback(&sample(), &Filter::default()));
        let metered: Vec<&str> = csv.lines().skip(1).map(|l| l.split(',').nth(3).unwrap()).collect();
        assert_eq!(metered, vec!["local", "local", "local", "upstream"]);
    }

    #[test]
    fn json_carries_exact_costs_and_upstream_apart() {
        let value = to_json(&chargeback(&sample(), &Filter::default()));
        assert_eq!(value["local_total"]["cost_micro_eur"], 1_503_520);
        assert_eq!(value["local_total"]["cost_eur"], "1.503520");
        assert_eq!(value["upstream_total"]["cost_eur"], "9.000000");
        let acme = &value["tenants"][0];
        assert_eq!(acme["tenant"], "acme");
        assert_eq!(acme["local"]["total"]["cost_micro_eur"], 3_500);
        assert_eq!(acme["upstream"]["rows"][0]["backend"], "peer");
        assert_eq!(acme["local"]["rows"][0]["agent"], serde_json::Value::Null);
        assert_eq!(value["from"], serde_json::Value::Null);
    }

    #[test]
    fn markdown_shows_tables_totals_and_upstream_apart() {
        let filter = Filter::new(Some("2025-03-01".into()), Some("2025-03-31".into())).unwrap();
        let md = to_markdown(&chargeback(&sample(), &filter));
        assert!(md.contains("Period: 2025-03-01 to 2025-03-31"), "{md}");
        assert!(md.contains("## acme"), "{md}");
        assert!(md.contains("| bot | ptu-west | 2 | 200 | 20 | 0.003000 |"), "{md}");
        assert!(md.contains("| **total** | | **3** | **300** | **30** | **0.003500** |"), "{md}");
        assert!(md.contains("Metered upstream"), "{md}");
        assert!(md.contains("| bot | peer | 1 | 100 | 10 | 9.000000 |"), "{md}");
        assert!(md.contains("| **total** | **4** | **400** | **40** | **1.503520** |"), "{md}");
        // The upstream section comes after acme's local total, before globex.
        let upstream = md.find("| bot | peer").unwrap();
        assert!(md.find("**0.003500**").unwrap() < upstream && upstream < md.find("## globex").unwrap());
    }

    #[test]
    fn markdown_escapes_pipes_and_says_when_empty() {
        let records = vec![record("2025-03-01T08:00:00Z", "a|b", None, "x", Metering::Local, 1)];
        let md = to_markdown(&chargeback(&records, &Filter::default()));
        assert!(md.contains("## a\\|b"), "{md}");
        let empty = to_markdown(&chargeback(&[], &Filter::default()));
        assert!(empty.contains("No calls in this period."), "{empty}");
    }
}
