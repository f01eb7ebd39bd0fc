//! What the operator's console shows (SPEC §9): per tenant and agent, the spend and
//! tokens counted in the ledger against each budget; per backend, this process's
//! calls, cost, errors, breaker state, its provider quota's use in the current minute
//! (from the ledger) and, for pools that pick by load, each member's live load; per
//! tenant, what the response cache saved and holds (SPEC §16) and the calls its
//! per-minute limits refused (SPEC §14); and the calls of the last hour, minute by
//! minute. Read from the ledger (the figures admission reads: in
//! the fleet shape, the shared DynamoDB table) and from the process's own metrics;
//! nothing else. `http::console` renders it.

use serde::Serialize;

use crate::budget::period::unix_now;
use crate::budget::plan::{self, Budget};
use crate::budget::{StoreError, Unit};
use crate::config::{BackendKind, Pick};
use crate::gateway::Gateway;
use crate::metrics::{CacheTotals, RateLimited};
use crate::money::MicroEur;

/// Tenants (with their agents) shown on one page.
pub const PAGE: usize = 50;

/// How often, at most, the console counts the response cache's entries: in some
/// stores a count reads every entry.
const COUNT_ENTRIES_EVERY_SECS: u64 = 60;
/// How long the console waits for that count; past it, the last counts are shown.
const COUNT_ENTRIES_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The console's figures at one instant.
#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    /// Unix seconds.
    pub at: u64,
    /// The tenants of this page (those whose name contains the filter), the closest
    /// to a cap first, each followed by its agents with budgets of their own.
    pub scopes: Vec<Scope>,
    /// Tenants matching the filter, on every page.
    pub tenants: usize,
    /// This page, from 1, and how many there are.
    pub page: usize,
    pub pages: usize,
    pub backends: Vec<BackendRow>,
    /// The response cache of this page's tenants that have a figure, in the page's
    /// order.
    pub cache: Vec<CacheRow>,
    /// The calls this page's tenants' per-minute limits refused, per holder and kind,
    /// in the page's order.
    pub rate_limited: Vec<RateLimitedRow>,
    /// Calls recorded by this process in each of the last 60 minutes, oldest first.
    pub calls_per_minute: Vec<u64>,
    /// Every budget past its soft threshold or at its cap, on any page.
    pub alerts: Vec<Alert>,
}

/// A tenant, or one of its agents with budgets of its own.
#[derive(Debug, Clone, Serialize)]
pub struct Scope {
    pub tenant: String,
    pub agent: Option<String>,
    pub budgets: Vec<BudgetRow>,
}

impl Scope {
    /// The largest share of a limit used, in parts per million (0 with no limit).
    fn pressure(&self) -> u64 {
        self.budgets.iter().map(BudgetRow::used_ppm).max().unwrap_or(0)
    }
}

/// One counter: what was used in its period, against its limit.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetRow {
    /// `tokens_per_day`, `tokens_per_month` or `eur_per_month`.
    pub budget: &'static str,
    /// Tokens, or micro-euros for `eur_per_month`.
    pub used: u64,
    pub limit: Option<u64>,
    pub state: CapState,
    /// Whole seconds until the period resets.
    pub resets_in_secs: u64,
}

impl BudgetRow {
    fn used_ppm(&self) -> u64 {
        match self.limit {
            Some(limit) if limit > 0 => {
                u64::try_from(u128::from(self.used) * 1_000_000 / u128::from(limit)).unwrap_or(u64::MAX)
            }
            Some(_) => 1_000_000,
            None => 0,
        }
    }

    /// The share of the limit used, as a percentage (for the bar), at most 100.
    pub fn percent(&self) -> u64 {
        (self.used_ppm() / 10_000).min(100)
    }

    pub fn is_money(&self) -> bool {
        self.budget == "eur_per_month"
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CapState {
    Ok,
    /// Past `ai.budget.soft.threshold`: calls go to the soft backend.
    Soft,
    /// At the limit: calls are refused.
    Exceeded,
}

impl CapState {
    pub fn as_str(self) -> &'static str {
        match self {
            CapState::Ok => "ok",
            CapState::Soft => "soft",
            CapState::Exceeded => "exceeded",
        }
    }
}

/// A budget at its soft threshold or its cap.
#[derive(Debug, Clone, Serialize)]
pub struct Alert {
    pub tenant: String,
    pub agent: Option<String>,
    pub budget: &'static str,
    pub state: CapState,
}

/// One tenant's response cache, as this process counted it since it started: from
/// its own metrics (`flexway_cache_*`), not the ledger, where a hit's savings are
/// never reserved nor settled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CacheRow {
    pub tenant: String,
    /// Calls served from the cache.
    pub hits: u64,
    /// Calls looked up and not served (a failing store's included).
    pub misses: u64,
    /// Calls that did not look: bypassed, or `cache: off`.
    pub skipped: u64,
    /// Answers stored.
    pub stores: u64,
    /// What the hits did not spend upstream.
    pub saved_micro_eur: u64,
    /// Live entries as last counted; `None` until counted.
    pub entries: Option<u64>,
}

impl CacheRow {
    /// Hits among the calls that looked, in percent; `None` before any.
    pub fn hit_percent(&self) -> Option<f64> {
        let looked = self.hits.saturating_add(self.misses);
        (looked > 0).then(|| self.hits as f64 * 100.0 / looked as f64)
    }
}

/// The cache rows of the tenants in `scopes` (their agents' rows skipped) that have a
/// figure in `totals`, in the order of `scopes`.
fn cache_rows(scopes: &[Scope], totals: &[CacheTotals]) -> Vec<CacheRow> {
    scopes
        .iter()
        .filter(|scope| scope.agent.is_none())
        .filter_map(|scope| totals.iter().find(|t| t.tenant == scope.tenant))
        .map(|t| CacheRow {
            tenant: t.tenant.clone(),
            hits: t.hits,
            misses: t.misses,
            skipped: t.skipped,
            stores: t.stores,
            saved_micro_eur: t.saved.0,
            entries: t.entries,
        })
        .collect()
}

/// The calls one holder's per-minute window of one kind refused (429
/// `rate_limit_exceeded`), as this process counted them since it started
/// (`flexway_rate_limited_total`): a tenant's own window, one of its agents', or a
/// key's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RateLimitedRow {
    pub tenant: String,
    /// As the refusal names it: `tenant acme`, `agent acme/bot`, `key 9f86d081884c7d65`.
    pub holder: String,
    /// `requests` or `tokens` (per minute).
    pub kind: String,
    pub refused: u64,
}

/// The refusals of the tenants in `scopes` (their agents' rows skipped), in the order
/// of `scopes`, each tenant's by holder and kind.
fn rate_limited_rows(scopes: &[Scope], totals: Vec<RateLimited>) -> Vec<RateLimitedRow> {
    let mut rows = Vec::new();
    for scope in scopes.iter().filter(|scope| scope.agent.is_none()) {
        let theirs = totals.iter().filter(|t| t.tenant == scope.tenant);
        rows.extend(theirs.map(|t| RateLimitedRow {
            tenant: t.tenant.clone(),
            holder: t.holder.clone(),
            kind: t.kind.clone(),
            refused: t.refused,
        }));
    }
    rows
}

/// One backend, as this process saw it since it started.
#[derive(Debug, Clone, Serialize)]
pub struct BackendRow {
    pub backend: String,
    pub kind: &'static str,
    pub calls: u64,
    pub cost_micro_eur: u64,
    /// Calls that ended with a 5xx.
    pub errors: u64,
    /// `closed`, `open` or `half_open`.
    pub breaker: &'static str,
    /// For a pool that picks by load: each member's last seen load.
    pub members: Vec<MemberLoad>,
    /// Its provider quota (SPEC §14), each kind's use in the current minute, counted
    /// fleet-wide in the ledger; empty without a quota.
    pub quota: Vec<QuotaRow>,
}

/// One window of a backend's provider quota, in the current minute.
#[derive(Debug, Clone, Serialize)]
pub struct QuotaRow {
    /// `requests` or `tokens` (per minute).
    pub kind: &'static str,
    pub used: u64,
    pub limit: u64,
    /// Whole seconds until the minute ends.
    pub resets_in_secs: u64,
}

impl QuotaRow {
    /// The share of the limit used, as a percentage, at most 100.
    pub fn percent(&self) -> u64 {
        if self.limit == 0 {
            return 100;
        }
        u64::try_from(u128::from(self.used) * 100 / u128::from(self.limit)).unwrap_or(u64::MAX).min(100)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct MemberLoad {
    pub backend: String,
    /// From its metrics, when fresh.
    pub queue: Option<u32>,
    pub kv_cache_ppm: Option<u32>,
    /// The gateway's own calls in flight to it.
    pub in_flight: u32,
}

/// The console's figures for the tenants whose name contains `filter` (any case),
/// page `page` (from 1) of them.
pub async fn overview(gateway: &Gateway, filter: &str, page: usize) -> Result<Overview, StoreError> {
    let now = unix_now();
    let config = &gateway.config;
    // Every budget of every tenant and agent: one read of the ledger for all, so the
    // alerts cover every page.
    let mut scopes: Vec<(String, Option<String>, Vec<Budget>)> = Vec::new();
    for (name, tenant) in &config.tenants {
        scopes.push((name.to_string(), None, plan::budgets_for(config, name, None, now).to_vec()));
        for (agent, settings) in &tenant.agents {
            if settings.budgets != Default::default() {
                let own: Vec<Budget> = plan::budgets_for(config, name, Some(agent.as_str()), now)
                    .iter()
                    .filter(|b| b.key.as_str().split('/').nth(1) == Some(agent.as_str()))
                    .cloned()
                    .collect();
                scopes.push((name.to_string(), Some(agent.to_string()), own));
            }
        }
    }
    let keys: Vec<_> = scopes.iter().flat_map(|(_, _, budgets)| budgets.iter().map(|b| b.key.clone())).collect();
    let mut used = gateway.budgets.used(&keys).await?.into_iter();
    let threshold = config.ai.budget.soft.as_ref().map(|s| s.threshold_ppm);
    let mut all: Vec<Scope> = scopes
        .into_iter()
        .map(|(tenant, agent, budgets)| Scope {
            tenant,
            agent,
            budgets: budgets.iter().map(|b| row(b, used.next().unwrap_or(0), threshold, now)).collect(),
        })
        .collect();
    let alerts = all
        .iter()
        .flat_map(|scope| {
            scope.budgets.iter().filter(|b| b.state != CapState::Ok).map(|b| Alert {
                tenant: scope.tenant.clone(),
                agent: scope.agent.clone(),
                budget: b.budget,
                state: b.state,
            })
        })
        .collect();

    // Tenants that match, the closest to a cap first, each with its agents.
    let filter = filter.trim().to_lowercase();
    all.retain(|s| s.tenant.to_lowercase().contains(&filter));
    let mut tenants: Vec<(u64, String)> = Vec::new();
    for scope in &all {
        match tenants.iter_mut().find(|(_, name)| *name == scope.tenant) {
            Some((pressure, _)) => *pressure = (*pressure).max(scope.pressure()),
            None => tenants.push((scope.pressure(), scope.tenant.clone())),
        }
    }
    tenants.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let pages = tenants.len().div_ceil(PAGE).max(1);
    let page = page.clamp(1, pages);
    let shown: Vec<&String> = tenants.iter().skip((page - 1) * PAGE).take(PAGE).map(|(_, name)| name).collect();
    let mut scopes = Vec::new();
    for name in shown {
        scopes.extend(all.iter().filter(|s| &s.tenant == name).cloned());
    }

    count_cache_entries(gateway, now).await;
    let cache = cache_rows(&scopes, &gateway.metrics.cache_totals());
    let rate_limited = rate_limited_rows(&scopes, gateway.metrics.rate_limited_totals());
    Ok(Overview {
        at: now,
        scopes,
        cache,
        rate_limited,
        tenants: tenants.len(),
        page,
        pages,
        backends: backends(gateway, quotas(gateway, now).await?),
        calls_per_minute: gateway.metrics.calls_per_minute(now),
        alerts,
    })
}

fn row(budget: &Budget, used: u64, threshold: Option<u32>, now: u64) -> BudgetRow {
    let name = budget.name.rsplit(' ').next().unwrap_or_default();
    let budget_name = match (budget.unit, name) {
        (Unit::MicroEur, _) => "eur_per_month",
        (Unit::Tokens, "tokens_per_day") => "tokens_per_day",
        (Unit::Tokens, _) => "tokens_per_month",
        // Rows are a tenant's and its agents' budgets, never a window or a run.
        (Unit::Requests, _) => "requests",
    };
    let state = match budget.limit {
        Some(limit) if used >= limit => CapState::Exceeded,
        Some(limit) if threshold.is_some_and(|t| u128::from(used) * 1_000_000 >= u128::from(limit) * u128::from(t)) => {
            CapState::Soft
        }
        _ => CapState::Ok,
    };
    BudgetRow {
        budget: budget_name,
        used,
        limit: budget.limit,
        state,
        resets_in_secs: budget.resets_at.saturating_sub(now),
    }
}

/// Sets `flexway_cache_entries` of every tenant (0 with none) from the cache store's
/// count, when the gateway has a cache and the last count is a minute old. A store
/// that fails or is slow leaves the last counts: never an error for the console.
pub async fn count_cache_entries(gateway: &Gateway, now: u64) {
    let Some(cache) = &gateway.cache else { return };
    if !gateway.metrics.cache_entries_due(now, COUNT_ENTRIES_EVERY_SECS) {
        return;
    }
    let stats = match tokio::time::timeout(COUNT_ENTRIES_WAIT, cache.store.stats()).await {
        Ok(Ok(stats)) => stats,
        Ok(Err(e)) => return tracing::warn!("response cache: cannot count the entries: {e}"),
        Err(_) => return tracing::warn!("response cache: no entry count within {COUNT_ENTRIES_WAIT:?}"),
    };
    for name in gateway.config.tenants.keys() {
        let entries = stats.iter().filter(|s| s.tenant == name.as_str()).map(|s| s.entries).sum();
        gateway.metrics.cache_entries(name.as_str(), entries);
    }
}

/// The provider quota of every backend that has one, read from the ledger at once
/// (no read when none has); its used-ratio gauge set from the same read.
async fn quotas(gateway: &Gateway, now: u64) -> Result<Vec<(String, Vec<QuotaRow>)>, StoreError> {
    let windows: Vec<(String, Vec<Budget>)> = gateway
        .config
        .ai
        .backends
        .iter()
        .filter(|(_, backend)| !backend.quota.is_none())
        .map(|(name, backend)| (name.to_string(), plan::quota_for(backend, now)))
        .collect();
    if windows.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<_> = windows.iter().flat_map(|(_, w)| w.iter().map(|b| b.key.clone())).collect();
    let mut used = gateway.budgets.used(&keys).await?.into_iter();
    let mut rows = Vec::with_capacity(windows.len());
    for (backend, windows) in windows {
        let mut quota = Vec::with_capacity(windows.len());
        for window in windows {
            let (plan::Kind::Window(rate), Some(limit)) = (window.kind, window.limit) else { continue };
            let used = used.next().unwrap_or(0);
            let ratio = if limit == 0 { 1.0 } else { used as f64 / limit as f64 };
            gateway.metrics.set_backend_quota_used(&backend, rate.as_str(), ratio);
            quota.push(QuotaRow {
                kind: rate.as_str(),
                used,
                limit,
                resets_in_secs: window.resets_at.saturating_sub(now),
            });
        }
        rows.push((backend, quota));
    }
    Ok(rows)
}

/// Every declared backend, with what this process saw of it, and its quota's use.
fn backends(gateway: &Gateway, mut quotas: Vec<(String, Vec<QuotaRow>)>) -> Vec<BackendRow> {
    let totals = gateway.metrics.backend_totals();
    let breakers = gateway.breakers.states(std::time::Instant::now());
    let loads = gateway.router.loads.snapshot();
    gateway
        .config
        .ai
        .backends
        .iter()
        .map(|(name, backend)| {
            let seen = totals.iter().find(|t| t.backend == name.as_str());
            let members = match &backend.kind {
                BackendKind::Pool { members, picking } if picking.pick == Pick::LeastLoaded => members
                    .iter()
                    .map(|member| {
                        let load = loads.iter().find(|(b, _)| *b == member.backend).map(|(_, seen)| seen);
                        let sample = load.and_then(|l| l.sample);
                        MemberLoad {
                            backend: member.backend.to_string(),
                            queue: sample.map(|s| s.waiting),
                            kv_cache_ppm: sample.map(|s| s.kv_ppm),
                            in_flight: load.map_or(0, |l| l.in_flight),
                        }
                    })
                    .collect(),
                _ => Vec::new(),
            };
            BackendRow {
                backend: name.to_string(),
                kind: backend.kind.name(),
                calls: seen.map_or(0, |t| t.calls),
                cost_micro_eur: seen.map_or(MicroEur(0), |t| t.cost).0,
                errors: seen.map_or(0, |t| t.errors),
                breaker: breakers.iter().find(|(b, _)| b == name).map_or("closed", |(_, state)| state.as_str()),
                members,
                quota: quotas
                    .iter_mut()
                    .find(|(backend, _)| backend == name.as_str())
                    .map(|(_, rows)| std::mem::take(rows))
                    .unwrap_or_default(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(tenant: &str, agent: Option<&str>) -> Scope {
        Scope { tenant: tenant.into(), agent: agent.map(Into::into), budgets: Vec::new() }
    }

    #[test]
    fn cache_rows_follow_the_page_s_tenants() {
        let metrics = crate::metrics::Registry::new();
        metrics.cache_lookup("acme", "faq", "hit");
        metrics.cache_lookup("acme", "faq", "miss");
        metrics.cache_lookup("acme", "faq", "miss");
        metrics.cache_lookup("acme", "faq", "error");
        metrics.cache_saved("acme", MicroEur(2_500));
        metrics.cache_entries("acme", 17);
        metrics.cache_lookup("globex", "faq", "off");
        metrics.cache_lookup("initech", "faq", "hit");
        // This page: globex (the closest to a cap), acme and its agent, umbrella (no cache).
        let page = [scope("globex", None), scope("acme", None), scope("acme", Some("bot")), scope("umbrella", None)];
        let rows = cache_rows(&page, &metrics.cache_totals());
        let acme = CacheRow {
            tenant: "acme".into(),
            hits: 1,
            misses: 3,
            skipped: 0,
            stores: 0,
            saved_micro_eur: 2_500,
            entries: Some(17),
        };
        let globex = CacheRow {
            tenant: "globex".into(),
            hits: 0,
            misses: 0,
            skipped: 1,
            stores: 0,
            saved_micro_eur: 0,
            entries: None,
        };
        assert_eq!(rows, [globex.clone(), acme.clone()], "initech is on another page");
        assert_eq!(acme.hit_percent(), Some(25.0));
        assert_eq!(globex.hit_percent(), None, "nothing looked up");
    }

    #[test]
    fn rate_limited_rows_follow_the_page_s_tenants() {
        let metrics = crate::metrics::Registry::new();
        metrics.rate_limited("acme", "tenant acme", "requests");
        metrics.rate_limited("acme", "tenant acme", "requests");
        metrics.rate_limited("acme", "agent acme/bot", "tokens");
        metrics.rate_limited("globex", "key 9f86d081884c7d65", "requests");
        metrics.rate_limited("initech", "tenant initech", "requests");
        let page = [scope("globex", None), scope("acme", None), scope("acme", Some("bot")), scope("umbrella", None)];
        let row = |tenant: &str, holder: &str, kind: &str, refused| RateLimitedRow {
            tenant: tenant.into(),
            holder: holder.into(),
            kind: kind.into(),
            refused,
        };
        assert_eq!(
            rate_limited_rows(&page, metrics.rate_limited_totals()),
            [
                row("globex", "key 9f86d081884c7d65", "requests", 1),
                row("acme", "agent acme/bot", "tokens", 1),
                row("acme", "tenant acme", "requests", 2),
            ],
            "initech is on another page; an agent's refusals are its tenant's"
        );
    }
}
