//! Recording: what the request path, the breakers, the pools and the realtime
//! sessions tell the registry. Each call takes one short lock (one family's) or none.

use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::family::Histogram;
use super::{BreakerState, CallSums, Registry, call_labels, label};
use crate::audit::{AuditRecord, UsageSource};

const NANOS_PER_MS: i64 = 1_000_000;

/// What the gateway adds to a call: sub-millisecond is the aim.
pub(super) const OVERHEAD_BOUNDS_NS: [i64; 12] = [
    100_000,
    250_000,
    500_000,
    NANOS_PER_MS,
    2 * NANOS_PER_MS + NANOS_PER_MS / 2,
    5 * NANOS_PER_MS,
    10 * NANOS_PER_MS,
    25 * NANOS_PER_MS,
    50 * NANOS_PER_MS,
    100 * NANOS_PER_MS,
    250 * NANOS_PER_MS,
    1_000 * NANOS_PER_MS,
];

/// Time to first byte from a backend: model latency, tens of milliseconds to a minute.
const TTFB_BOUNDS_NS: [i64; 10] = [
    50 * NANOS_PER_MS,
    100 * NANOS_PER_MS,
    250 * NANOS_PER_MS,
    500 * NANOS_PER_MS,
    1_000 * NANOS_PER_MS,
    2_500 * NANOS_PER_MS,
    5_000 * NANOS_PER_MS,
    10_000 * NANOS_PER_MS,
    30_000 * NANOS_PER_MS,
    60_000 * NANOS_PER_MS,
];

/// Estimated minus reported tokens. `le="-1"` counts underestimates, `le="0"` minus
/// `le="-1"` exact estimates, and the rest overestimates by size.
const DRIFT_BOUNDS: [i64; 8] = [-1_000, -100, -10, -1, 0, 10, 100, 1_000];
/// Calls refused by one holder's per-minute window of one kind, as this process
/// counted them since it started (`flexway_rate_limited_total`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimited {
    pub tenant: String,
    /// As the refusal names it: `tenant acme`, `agent acme/bot`, `key 9f86d081884c7d65`.
    pub holder: String,
    /// `requests` or `tokens`.
    pub kind: String,
    pub refused: u64,
}

impl Registry {
    /// A configuration reload: put in use (`true`), or refused.
    pub fn reloaded(&self, ok: bool) {
        self.reloads[usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
    }
    /// Counts one call and its cost from its audit record, and, when its usage was
    /// settled on an estimate (`usage_source: estimated` with some tokens), counts that
    /// too. Call it once per record written, refused calls included.
    pub fn record_call(&self, record: &AuditRecord) {
        let labels = call_labels(record);
        let failed = u64::from(record.status >= 500);
        let count = |sums: &mut CallSums| {
            sums.calls = sums.calls.saturating_add(1);
            sums.cost_micro_eur = sums.cost_micro_eur.saturating_add(record.cost_micro_eur);
            sums.errors = sums.errors.saturating_add(failed);
        };
        let minute = u64::try_from(record.ts.unix_millis() / 60_000).unwrap_or(0);
        {
            let mut ring = self.per_minute.lock().unwrap_or_else(PoisonError::into_inner);
            let slot = &mut ring[(minute % 60) as usize];
            *slot = if slot.0 == minute { (minute, slot.1 + 1) } else { (minute, 1) };
        }
        match record.feature.as_deref() {
            // A metered gRPC or REST call adds its feature as a fifth label (SPEC §10).
            Some(feature) => {
                let [tenant, backend, metered_by, capability] = labels;
                self.calls.with(
                    &[tenant, backend, metered_by, capability, label(Some(feature))],
                    CallSums::default,
                    count,
                )
            }
            None => self.calls.with(&labels, CallSums::default, count),
        }
        self.record_mcp_call(record);
        let tokens = record.prompt_tokens.saturating_add(record.completion_tokens);
        if record.usage_source == UsageSource::Estimated && tokens > 0 {
            self.usage_estimated.with(&[labels[1]], u64::default, |count| *count = count.saturating_add(1));
        }
    }

    /// A backend wrote `tokens` completion tokens past the allowance it was sent (the
    /// call is charged in full; this says which backend ignores its limit).
    pub fn observe_overshoot(&self, backend: &str, tokens: u64) {
        self.overshoot.with(&[label(Some(backend))], <(u64, u64)>::default, |(calls, total)| {
            *calls = calls.saturating_add(1);
            *total = total.saturating_add(tokens);
        });
    }

    /// The latency the gateway itself adds to a call (total minus upstream time).
    pub fn observe_gateway_overhead(&self, overhead: Duration) {
        self.overhead.observe(nanos(overhead));
    }

    pub fn observe_time_to_first_byte(&self, backend: &str, ttfb: Duration) {
        self.ttfb.with(&[label(Some(backend))], || Histogram::new(&TTFB_BOUNDS_NS), |h| h.observe(nanos(ttfb)));
    }

    /// For a stream where both an estimate (from what was relayed) and the backend's
    /// reported usage exist: how far the estimate was off, in tokens.
    pub fn observe_usage_drift(&self, backend: &str, estimated: u64, reported: u64) {
        let drift = i128::from(estimated) - i128::from(reported);
        let drift = i64::try_from(drift).unwrap_or(if drift < 0 { i64::MIN } else { i64::MAX });
        self.usage_drift.with(&[label(Some(backend))], || Histogram::new(&DRIFT_BOUNDS), |h| h.observe(drift));
    }

    /// `budget` names the counter, e.g. `tokens_per_day`, `eur_per_month`.
    pub fn set_budget_remaining(&self, tenant: &str, budget: &str, remaining: f64) {
        self.budget_remaining.with(&[label(Some(tenant)), label(Some(budget))], f64::default, |v| *v = remaining);
    }

    /// A realtime session ended (its call and cost are counted by its audit record).
    pub fn realtime_session_ended(&self, backend: Option<&str>, close_reason: &str) {
        self.realtime_sessions.with(&[label(backend), close_reason], u64::default, |n| *n = n.saturating_add(1));
    }

    /// A realtime session's response was charged (`response.done`).
    pub fn realtime_response(&self, tenant: &str, backend: &str) {
        self.realtime_responses
            .with(&[label(Some(tenant)), label(Some(backend))], u64::default, |n| *n = n.saturating_add(1));
    }

    pub fn set_realtime_open(&self, open: usize) {
        self.realtime_open.store(open as u64, Ordering::Relaxed);
    }

    pub fn set_breaker_state(&self, backend: &str, state: BreakerState) {
        self.breaker_state.with(&[label(Some(backend))], f64::default, |v| *v = f64::from(state.gauge_value()));
    }

    /// A pool member's load as routing sees it now: the model server's queue and
    /// KV-cache use from a fresh sample (`None` without one), and the gateway's own
    /// calls in flight to it.
    pub fn set_member_load(&self, backend: &str, sample: Option<(u32, f64)>, in_flight: u32) {
        let (queue, kv) = sample.map_or((f64::NAN, f64::NAN), |(q, kv)| (f64::from(q), kv));
        self.member_load.with(&[label(Some(backend))], Default::default, |v| *v = (queue, kv, f64::from(in_flight)));
    }

    /// A call refused by `holder`'s per-minute window of `kind` (`requests`, `tokens`).
    pub fn rate_limited(&self, tenant: &str, holder: &str, kind: &str) {
        let labels = [label(Some(tenant)), label(Some(holder)), label(Some(kind))];
        self.rate_limited.with(&labels, u64::default, |n| *n = n.saturating_add(1));
    }

    /// Every series of `flexway_rate_limited_total`, sorted by tenant, holder, kind:
    /// what the console shows of the refusals.
    pub fn rate_limited_totals(&self) -> Vec<RateLimited> {
        let series = self.rate_limited.snapshot(|n| *n).into_iter();
        series
            .filter_map(|(values, refused)| {
                let [tenant, holder, kind] = <[String; 3]>::try_from(values.into_vec()).ok()?;
                Some(RateLimited { tenant, holder, kind, refused })
            })
            .collect()
    }

    /// The share of `backend`'s provider quota of `kind` (`requests`, `tokens`) used
    /// in its current minute, as last read (1 or more: at its quota).
    pub fn set_backend_quota_used(&self, backend: &str, kind: &str, ratio: f64) {
        self.backend_quota_used.with(&[label(Some(backend)), label(Some(kind))], f64::default, |v| *v = ratio);
    }

    /// A sheddable call refused because every member of `pool` was saturated.
    pub fn shed(&self, tenant: &str, pool: &str) {
        self.shed.with(&[label(Some(tenant)), label(Some(pool))], u64::default, |n| *n = n.saturating_add(1));
    }
}

fn nanos(duration: Duration) -> i64 {
    i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::super::tests::lines;
    use super::*;
    use crate::audit::sample::record;
    use crate::config::Metering;

    #[test]
    fn usage_drift_is_signed_and_estimates_are_counted() {
        let registry = Registry::new();
        registry.observe_usage_drift("payg", 120, 100); // over by 20
        registry.observe_usage_drift("payg", 100, 100); // exact
        registry.observe_usage_drift("payg", 95, 100); // under by 5
        let mut estimated = record("acme", Some("payg"), Metering::Local, 10);
        estimated.usage_source = UsageSource::Estimated;
        registry.record_call(&estimated);
        registry.record_call(&estimated);
        let mut refused = estimated.clone();
        (refused.prompt_tokens, refused.completion_tokens) = (0, 0);
        registry.record_call(&refused);
        registry.record_call(&record("acme", Some("payg"), Metering::Local, 10));
        let text = registry.render_prometheus();
        let drift = lines(&text, "flexway_usage_drift_tokens");
        assert!(drift.contains(&r#"flexway_usage_drift_tokens_bucket{backend="payg",le="-10"} 0"#));
        assert!(drift.contains(&r#"flexway_usage_drift_tokens_bucket{backend="payg",le="-1"} 1"#));
        assert!(drift.contains(&r#"flexway_usage_drift_tokens_bucket{backend="payg",le="0"} 2"#));
        assert!(drift.contains(&r#"flexway_usage_drift_tokens_bucket{backend="payg",le="100"} 3"#));
        assert!(drift.contains(&r#"flexway_usage_drift_tokens_sum{backend="payg"} 15"#));
        assert!(drift.contains(&r#"flexway_usage_drift_tokens_count{backend="payg"} 3"#));
        assert_eq!(
            lines(&text, "flexway_usage_estimated_total{"),
            vec![r#"flexway_usage_estimated_total{backend="payg"} 2"#]
        );
    }
    #[test]
    fn concurrent_recording_loses_nothing() {
        let registry = std::sync::Arc::new(Registry::new());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let registry = std::sync::Arc::clone(&registry);
                std::thread::spawn(move || {
                    for _ in 0..1_000 {
                        let tenant = if t % 2 == 0 { "acme" } else { "globex" };
                        registry.record_call(&record(tenant, Some("ptu-west"), Metering::Local, 3));
                        registry.observe_gateway_overhead(Duration::from_micros(100));
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let text = registry.render_prometheus();
        let calls = lines(&text, "flexway_inference_calls_total{");
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert!(calls.iter().all(|l| l.ends_with(" 4000")), "{calls:?}");
        assert!(text.contains("flexway_gateway_overhead_seconds_count 8000\n"));
        assert!(text.contains("flexway_gateway_overhead_seconds_sum 0.8\n"));
    }
}
