//! Metrics (SPEC §9): an in-process registry rendered as Prometheus text in the local
//! shape. (The serverless shape's CloudWatch metric lines are the AWS adapter's,
//! `flexway-aws`, labelled with [`call_labels`] too.)
//!
//! Invariants: the call and cost counters are fed from the audit record itself
//! ([`Registry::record_call`], [`call_labels`]), so metrics and audit never disagree; labels
//! are only low-cardinality values (tenant, backend, metering, capability, budget name:
//! names from the config; never a request id, a model string, a key or a user); money is kept
//! in integer micro-euros and only turned into euros when rendered. Recording is cheap:
//! one short lock per family, no allocation once a series exists.

mod cache;
mod family;
mod mcp;
mod recording;
mod render;

use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, PoisonError};

use crate::audit::AuditRecord;
use crate::money::MicroEur;
use family::{Family, Histogram};
use recording::OVERHEAD_BOUNDS_NS;

/// The label value used when a record has no value (e.g. no backend: refused before
/// routing). Never empty: an empty label is an absent label to Prometheus, and
/// CloudWatch refuses empty dimension values.
pub const NONE: &str = "none";

/// A circuit breaker's state; `gauge_value` is how `flexway_breaker_state` encodes it.
pub use crate::routing::breaker::State as BreakerState;
pub use cache::{CACHE_FAILED_OPERATIONS, CACHE_OUTCOMES, CacheTotals};
pub use mcp::{MCP_OUTCOMES, McpTotals};
pub use recording::RateLimited;

/// The process's metrics. Share it (`Arc`) between the request path and `/metrics`.
pub struct Registry {
    /// (calls, micro-euros) per [tenant, backend, metered_by, capability], and
    /// [.., feature] for metered gRPC calls.
    calls: Family<CallSums>,
    usage_estimated: Family<u64>,
    /// (calls, tokens) written past the allowance sent, per backend.
    overshoot: Family<(u64, u64)>,
    overhead: Histogram,
    ttfb: Family<Histogram>,
    usage_drift: Family<Histogram>,
    budget_remaining: Family<f64>,
    breaker_state: Family<f64>,
    /// A pool member's last seen load: (queue, KV-cache use, calls in flight); the
    /// first two are absent (NaN) without a fresh sample.
    member_load: Family<(f64, f64, f64)>,
    /// Sheddable calls refused for saturation, per [tenant, pool].
    shed: Family<u64>,
    /// Calls refused by a per-minute window, per [tenant, holder, kind].
    rate_limited: Family<u64>,
    /// The share of a backend's provider quota used in its current minute, as last
    /// read, per [backend, kind].
    backend_quota_used: Family<f64>,
    /// Realtime sessions ended, per [backend, close_reason].
    realtime_sessions: Family<u64>,
    /// Realtime responses charged, per [tenant, backend].
    realtime_responses: Family<u64>,
    realtime_open: AtomicU64,
    /// Calls recorded in each of the last 60 minutes: (Unix minute, calls), at the
    /// minute's index modulo 60.
    per_minute: Mutex<[(u64, u64); 60]>,
    /// Configuration reloads put in use, and refused.
    reloads: [AtomicU64; 2],
    /// Response cache lookups, per [tenant, policy, outcome].
    cache_lookups: Family<u64>,
    /// Answers stored in the response cache, per [tenant, policy].
    cache_stores: Family<u64>,
    /// Response cache store failures, per [operation].
    cache_store_failures: Family<u64>,
    /// Micro-euros that cache hits did not spend upstream, per [tenant].
    cache_saved: Family<u64>,
    /// A tenant's live cache entries, as last counted, per [tenant].
    cache_entries: Family<u64>,
    /// When the entries were last counted (Unix seconds; 0: never).
    cache_counted_at: AtomicU64,
    /// MCP tool calls and what they were charged (micro-euros), per [tenant, server,
    /// outcome].
    mcp_calls: Family<(u64, u64)>,
    /// MCP servers left out of a `tools/list`, per [server].
    mcp_down: Family<u64>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Default, Clone, Copy)]
struct CallSums {
    calls: u64,
    cost_micro_eur: u64,
    /// Calls that ended with a 5xx: the backend's failure, or the gateway's.
    errors: u64,
}

/// One backend's calls since the process started, as the console shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendTotals {
    pub backend: String,
    pub calls: u64,
    pub cost: MicroEur,
    pub errors: u64,
}

impl Registry {
    pub fn new() -> Self {
        Registry {
            calls: Family::new(),
            usage_estimated: Family::new(),
            overshoot: Family::new(),
            overhead: Histogram::new(&OVERHEAD_BOUNDS_NS),
            ttfb: Family::new(),
            usage_drift: Family::new(),
            budget_remaining: Family::new(),
            breaker_state: Family::new(),
            member_load: Family::new(),
            shed: Family::new(),
            rate_limited: Family::new(),
            backend_quota_used: Family::new(),
            realtime_sessions: Family::new(),
            realtime_responses: Family::new(),
            realtime_open: AtomicU64::new(0),
            per_minute: Mutex::new([(0, 0); 60]),
            reloads: [AtomicU64::new(0), AtomicU64::new(0)],
            cache_lookups: Family::new(),
            cache_stores: Family::new(),
            cache_store_failures: Family::new(),
            cache_saved: Family::new(),
            cache_entries: Family::new(),
            cache_counted_at: AtomicU64::new(0),
            mcp_calls: Family::new(),
            mcp_down: Family::new(),
        }
    }

    /// Calls, cost and 5xx per backend (refused calls, before any backend, under
    /// [`NONE`]), by name.
    pub fn backend_totals(&self) -> Vec<BackendTotals> {
        let mut totals: Vec<BackendTotals> = Vec::new();
        for (values, sums) in self.calls.snapshot(|sums| *sums) {
            let backend = values.get(1).map_or(NONE, String::as_str);
            let index = match totals.iter().position(|t| t.backend == backend) {
                Some(index) => index,
                None => {
                    let zero = BackendTotals { backend: backend.to_owned(), calls: 0, cost: MicroEur(0), errors: 0 };
                    totals.push(zero);
                    totals.len() - 1
                }
            };
            let total = &mut totals[index];
            total.calls += sums.calls;
            total.cost = MicroEur(total.cost.0 + sums.cost_micro_eur);
            total.errors += sums.errors;
        }
        totals.sort_by(|a, b| a.backend.cmp(&b.backend));
        totals
    }

    /// Calls recorded in each of the 60 minutes up to `now` (Unix seconds), the
    /// oldest first.
    pub fn calls_per_minute(&self, now: u64) -> Vec<u64> {
        let minute = now / 60;
        let ring = self.per_minute.lock().unwrap_or_else(PoisonError::into_inner);
        (0..60)
            .rev()
            .map(|ago| {
                let at = minute.saturating_sub(ago);
                let (stamp, calls) = ring[(at % 60) as usize];
                if stamp == at && at + ago == minute { calls } else { 0 }
            })
            .collect()
    }
}

/// The labels of the call and cost counters, in this order; [`call_labels`] gives a
/// call's values.
pub const CALL_LABELS: [&str; 4] = ["tenant", "backend", "metered_by", "capability"];

/// The call and cost counters' labels for a metered gRPC call: [`CALL_LABELS`] and its
/// method's `feature` (the series of other calls do not carry it).
pub const GRPC_CALL_LABELS: [&str; 5] = ["tenant", "backend", "metered_by", "capability", "feature"];

/// A call's values for [`CALL_LABELS`], from its audit record, never empty ([`NONE`]
/// for a missing backend): what the Prometheus counters here and the serverless
/// shape's metric lines (`flexway-aws`) both label a call with.
pub fn call_labels(record: &AuditRecord) -> [&str; 4] {
    [
        label(Some(&record.tenant)),
        label(record.backend.as_deref()),
        record.metered_by.as_str(),
        record.capability.as_str(),
    ]
}

fn label(value: Option<&str>) -> &str {
    match value {
        Some(value) if !value.is_empty() => value,
        _ => NONE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::sample::record;
    use crate::config::Metering;

    /// The lines of `text` that start with `prefix`, in order.
    pub(super) fn lines<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        text.lines().filter(|l| l.starts_with(prefix)).collect()
    }

    #[test]
    fn totals_per_backend_and_the_last_hour_by_minute() {
        let registry = Registry::new();
        let mut failed = record("acme", Some("b"), Metering::Local, 0);
        failed.status = 503;
        registry.record_call(&failed);
        registry.record_call(&record("acme", Some("a"), Metering::Local, 150));
        registry.record_call(&record("globex", Some("a"), Metering::Local, 50));
        let totals = registry.backend_totals();
        let a = BackendTotals { backend: "a".into(), calls: 2, cost: MicroEur(200), errors: 0 };
        let b = BackendTotals { backend: "b".into(), calls: 1, cost: MicroEur(0), errors: 1 };
        assert_eq!(totals, [a, b]);
        let text = registry.render_prometheus();
        let errors =
            "flexway_inference_errors_total{tenant=\"acme\",backend=\"b\",metered_by=\"local\",capability=\"chat\"} 1";
        assert!(text.contains(errors), "{text}");

        // The sample records' minute, then an hour and more later.
        let at = u64::try_from(failed.ts.unix_millis() / 1000).unwrap();
        let minutes = registry.calls_per_minute(at);
        assert_eq!((minutes.len(), minutes[59], minutes.iter().sum::<u64>()), (60, 3, 3));
        assert_eq!(registry.calls_per_minute(at + 120)[57], 3, "two minutes later");
        assert_eq!(registry.calls_per_minute(at + 3600).iter().sum::<u64>(), 0, "out of the hour");
    }
    #[test]
    fn label_cardinality_ignores_per_request_fields() {
        let registry = Registry::new();
        for n in 0..500_u64 {
            let mut r = record("acme", Some("ptu-west"), Metering::Local, 1);
            r.request_id = format!("req-{n}");
            r.key_hash = format!("{n:064x}");
            r.user_hash = Some(format!("{n:064x}"));
            r.agent = Some(format!("agent-{}", n % 7));
            r.model_served = Some(format!("model-{n}"));
            r.status = if n % 2 == 0 { 200 } else { 429 };
            r.ts = format!("2025-03-01T10:{:02}:00Z", n % 60).parse().unwrap();
            registry.record_call(&r);
        }
        let text = registry.render_prometheus();
        assert_eq!(
            lines(&text, "flexway_inference_calls_total{"),
            vec![
                r#"flexway_inference_calls_total{tenant="acme",backend="ptu-west",metered_by="local",capability="chat"} 500"#
            ]
        );
        assert_eq!(lines(&text, "flexway_inference_cost_eur_total{").len(), 1);
        // The last call's key and user hash: every call's would be there if either were a label.
        for leaked in ["req-", "agent-", "model-", &format!("{:064x}", 499)] {
            assert!(!text.contains(leaked), "{leaked} leaked into the metrics");
        }
    }
}
