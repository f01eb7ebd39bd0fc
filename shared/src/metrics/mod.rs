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

use std::fmt::Write as _;
use std::hash::BuildHasher as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use foldhash::HashMap;

use crate::audit::{AuditRecord, UsageSource};
use crate::money::MicroEur;

/// The label value used when a record has no value (e.g. no backend: refused before
/// routing). Never empty: an empty label is an absent label to Prometheus, and
/// CloudWatch refuses empty dimension values.
pub const NONE: &str = "none";

const NANOS_PER_MS: i64 = 1_000_000;
/// Histogram bounds for latencies are kept in nanoseconds and rendered in seconds.
const SECOND_DECIMALS: u32 = 9;

/// What the gateway adds to a call: sub-millisecond is the aim.
const OVERHEAD_BOUNDS_NS: [i64; 12] = [
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

/// A circuit breaker's state; `gauge_value` is how `flexway_breaker_state` encodes it.
pub use crate::routing::breaker::State as BreakerState;

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
            realtime_sessions: Family::new(),
            realtime_responses: Family::new(),
            realtime_open: AtomicU64::new(0),
            per_minute: Mutex::new([(0, 0); 60]),
            reloads: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// A configuration reload: put in use (`true`), or refused.
    pub fn reloaded(&self, ok: bool) {
        self.reloads[usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
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

    /// A sheddable call refused because every member of `pool` was saturated.
    pub fn shed(&self, tenant: &str, pool: &str) {
        self.shed.with(&[label(Some(tenant)), label(Some(pool))], u64::default, |n| *n = n.saturating_add(1));
    }

    /// The Prometheus text exposition format, version 0.0.4.
    pub fn render_prometheus(&self) -> String {
        let mut out = String::with_capacity(4096);
        let calls = self.calls.snapshot(|sums| *sums);

        header(
            &mut out,
            "flexway_inference_calls_total",
            "counter",
            "Inference calls with an audit record, refused ones included.",
        );
        for (values, sums) in &calls {
            let calls = sums.calls.to_string();
            sample(&mut out, "flexway_inference_calls_total", &GRPC_CALL_LABELS, values, None, &calls);
        }

        header(
            &mut out,
            "flexway_inference_cost_eur_total",
            "counter",
            "Cost of inference calls in euros, as settled in the ledger.",
        );
        for (values, sums) in &calls {
            let euros = MicroEur(sums.cost_micro_eur).to_eur_string();
            sample(&mut out, "flexway_inference_cost_eur_total", &GRPC_CALL_LABELS, values, None, &euros);
        }

        header(
            &mut out,
            "flexway_inference_errors_total",
            "counter",
            "Inference calls that ended with a 5xx (the backends' failures and the gateway's).",
        );
        for (values, sums) in &calls {
            let errors = sums.errors.to_string();
            sample(&mut out, "flexway_inference_errors_total", &GRPC_CALL_LABELS, values, None, &errors);
        }

        header(
            &mut out,
            "flexway_usage_estimated_total",
            "counter",
            "Calls whose usage was settled on an estimate (the backend reported none).",
        );
        for (values, count) in self.usage_estimated.snapshot(|c| *c) {
            sample(&mut out, "flexway_usage_estimated_total", &["backend"], &values, None, &count.to_string());
        }

        let overshoot = self.overshoot.snapshot(|v| *v);
        header(
            &mut out,
            "flexway_allowance_overshoot_total",
            "counter",
            "Calls whose backend wrote more completion tokens than the allowance it was sent.",
        );
        for (values, (calls, _)) in &overshoot {
            sample(&mut out, "flexway_allowance_overshoot_total", &["backend"], values, None, &calls.to_string());
        }
        header(
            &mut out,
            "flexway_allowance_overshoot_tokens_total",
            "counter",
            "Completion tokens written past the allowance sent (charged in full).",
        );
        for (values, (_, tokens)) in &overshoot {
            sample(
                &mut out,
                "flexway_allowance_overshoot_tokens_total",
                &["backend"],
                values,
                None,
                &tokens.to_string(),
            );
        }

        header(
            &mut out,
            "flexway_gateway_overhead_seconds",
            "histogram",
            "Latency the gateway adds to a call, upstream time excluded.",
        );
        let overhead = self.overhead.snapshot();
        histogram(&mut out, "flexway_gateway_overhead_seconds", &[], &[], &overhead, SECOND_DECIMALS);

        header(
            &mut out,
            "flexway_time_to_first_byte_seconds",
            "histogram",
            "Time from sending a request to a backend to its first response byte.",
        );
        for (values, snapshot) in self.ttfb.snapshot(Histogram::snapshot) {
            histogram(
                &mut out,
                "flexway_time_to_first_byte_seconds",
                &["backend"],
                &values,
                &snapshot,
                SECOND_DECIMALS,
            );
        }

        header(
            &mut out,
            "flexway_usage_drift_tokens",
            "histogram",
            "Estimated minus reported tokens, for streams where both exist.",
        );
        for (values, snapshot) in self.usage_drift.snapshot(Histogram::snapshot) {
            histogram(&mut out, "flexway_usage_drift_tokens", &["backend"], &values, &snapshot, 0);
        }

        header(
            &mut out,
            "flexway_budget_remaining",
            "gauge",
            "What remains of a tenant's budget, in the budget's unit (tokens or euros).",
        );
        for (values, value) in self.budget_remaining.snapshot(|v| *v) {
            sample(&mut out, "flexway_budget_remaining", &["tenant", "budget"], &values, None, &float(value));
        }

        header(
            &mut out,
            "flexway_breaker_state",
            "gauge",
            "Circuit breaker state per backend: 0 closed, 1 open, 2 half-open.",
        );
        for (values, value) in self.breaker_state.snapshot(|v| *v) {
            sample(&mut out, "flexway_breaker_state", &["backend"], &values, None, &float(value));
        }

        let members = self.member_load.snapshot(|v| *v);
        let gauges = [
            ("flexway_member_queue", "A pool member's model server queue, as last read (absent when stale).", 0),
            ("flexway_member_kv_cache_ratio", "A pool member's KV-cache use, as last read (absent when stale).", 1),
            ("flexway_member_in_flight", "The gateway's own calls in flight to a pool member.", 2),
        ];
        for (name, help, field) in gauges {
            header(&mut out, name, "gauge", help);
            for (values, load) in &members {
                let value = [load.0, load.1, load.2][field];
                if !value.is_nan() {
                    sample(&mut out, name, &["backend"], values, None, &float(value));
                }
            }
        }
        header(
            &mut out,
            "flexway_calls_shed_total",
            "counter",
            "Sheddable calls refused (503 overloaded) because every member of the pool was saturated.",
        );
        for (values, count) in self.shed.snapshot(|c| *c) {
            sample(&mut out, "flexway_calls_shed_total", &["tenant", "pool"], &values, None, &count.to_string());
        }

        header(&mut out, "flexway_realtime_sessions_open", "gauge", "Realtime sessions open now.");
        let open = self.realtime_open.load(Ordering::Relaxed).to_string();
        sample(&mut out, "flexway_realtime_sessions_open", &[], &[], None, &open);
        header(
            &mut out,
            "flexway_realtime_sessions_total",
            "counter",
            "Realtime sessions ended, by backend and close reason.",
        );
        for (values, n) in self.realtime_sessions.snapshot(|v| *v) {
            let names = ["backend", "close_reason"];
            sample(&mut out, "flexway_realtime_sessions_total", &names, &values, None, &n.to_string());
        }
        header(
            &mut out,
            "flexway_realtime_responses_total",
            "counter",
            "Responses of realtime sessions charged (response.done), by tenant and backend.",
        );
        for (values, n) in self.realtime_responses.snapshot(|v| *v) {
            sample(&mut out, "flexway_realtime_responses_total", &["tenant", "backend"], &values, None, &n.to_string());
        }
        header(
            &mut out,
            "flexway_config_reloads_total",
            "counter",
            "Configuration reloads (SIGHUP, --watch): put in use, or refused and the running one kept.",
        );
        for (outcome, count) in ["ok", "failed"].iter().zip(&self.reloads) {
            let count = count.load(Ordering::Relaxed).to_string();
            sample(&mut out, "flexway_config_reloads_total", &["outcome"], &[(*outcome).to_owned()], None, &count);
        }
        out
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

fn nanos(duration: Duration) -> i64 {
    i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX)
}

/// Series of one family, keyed by their label values. The map is keyed by a hash of
/// the values so that finding an existing series needs no allocation.
struct Family<V> {
    hasher: foldhash::fast::RandomState,
    series: Mutex<HashMap<u64, Vec<Series<V>>>>,
}

/// A series: its label values (in the family's label order) and its value.
type Series<V> = (Box<[String]>, V);

impl<V> Family<V> {
    fn new() -> Self {
        Family { hasher: Default::default(), series: Default::default() }
    }

    fn with<R>(&self, labels: &[&str], make: impl FnOnce() -> V, update: impl FnOnce(&mut V) -> R) -> R {
        let hash = self.hasher.hash_one(labels);
        let mut series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        let bucket = series.entry(hash).or_default();
        let same = |key: &[String]| key.len() == labels.len() && key.iter().zip(labels).all(|(k, l)| k == l);
        if let Some((_, value)) = bucket.iter_mut().find(|(key, _)| same(key)) {
            return update(value);
        }
        let mut value = make();
        let result = update(&mut value);
        bucket.push((labels.iter().map(|l| (*l).to_owned()).collect(), value));
        result
    }

    /// Every series, sorted by label values, read with `read` under the lock.
    fn snapshot<T>(&self, read: impl Fn(&V) -> T) -> Vec<Series<T>> {
        let series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<_> = series.values().flatten().map(|(key, value)| (key.clone(), read(value))).collect();
        drop(series);
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}

/// A fixed-bucket histogram of integer observations (nanoseconds, tokens).
struct Histogram {
    bounds: &'static [i64],
    /// Per bucket, not cumulative; the last one is `+Inf`.
    counts: Box<[AtomicU64]>,
    sum: AtomicI64,
}

struct HistogramSnapshot {
    bounds: &'static [i64],
    /// Cumulative, the last one (`+Inf`) being the count.
    cumulative: Vec<u64>,
    sum: i64,
}

impl Histogram {
    fn new(bounds: &'static [i64]) -> Self {
        Histogram { bounds, counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(), sum: AtomicI64::new(0) }
    }

    fn observe(&self, value: i64) {
        // The first bucket whose bound is >= value (`le` is inclusive).
        let index = self.bounds.partition_point(|bound| *bound < value);
        if let Some(count) = self.counts.get(index) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        self.sum.fetch_add(value, Ordering::Relaxed);
    }

    fn snapshot(&self) -> HistogramSnapshot {
        let mut running = 0_u64;
        let cumulative = self
            .counts
            .iter()
            .map(|count| {
                running = running.saturating_add(count.load(Ordering::Relaxed));
                running
            })
            .collect();
        HistogramSnapshot { bounds: self.bounds, cumulative, sum: self.sum.load(Ordering::Relaxed) }
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// One sample line; `le` is appended after the other labels for histogram buckets.
fn sample(out: &mut String, name: &str, names: &[&str], values: &[String], le: Option<&str>, value: &str) {
    out.push_str(name);
    let mut pairs = names.iter().zip(values).map(|(n, v)| (*n, v.as_str())).chain(le.map(|le| ("le", le)));
    if let Some((first_name, first_value)) = pairs.next() {
        let _ = write!(out, "{{{first_name}=\"{}\"", escape_label(first_value));
        for (name, value) in pairs {
            let _ = write!(out, ",{name}=\"{}\"", escape_label(value));
        }
        out.push('}');
    }
    out.push(' ');
    out.push_str(value);
    out.push('\n');
}

fn histogram(
    out: &mut String,
    name: &str,
    names: &[&str],
    values: &[String],
    snapshot: &HistogramSnapshot,
    decimals: u32,
) {
    let bucket = format!("{name}_bucket");
    let les = snapshot.bounds.iter().map(|bound| scaled(*bound, decimals)).chain(std::iter::once("+Inf".to_owned()));
    for (le, count) in les.zip(&snapshot.cumulative) {
        sample(out, &bucket, names, values, Some(&le), &count.to_string());
    }
    let count = snapshot.cumulative.last().copied().unwrap_or(0);
    sample(out, &format!("{name}_sum"), names, values, None, &scaled(snapshot.sum, decimals));
    sample(out, &format!("{name}_count"), names, values, None, &count.to_string());
}

/// `value / 10^decimals` as an exact decimal without trailing zeros: `2500000, 9` → `0.0025`.
fn scaled(value: i64, decimals: u32) -> String {
    let sign = if value < 0 { "-" } else { "" };
    let magnitude = value.unsigned_abs();
    let unit = 10_u64.pow(decimals);
    let (whole, fraction) = (magnitude / unit, magnitude % unit);
    if fraction == 0 {
        return format!("{sign}{whole}");
    }
    let digits = format!("{fraction:0width$}", width = decimals as usize);
    format!("{sign}{whole}.{}", digits.trim_end_matches('0'))
}

fn float(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        value.to_string()
    }
}

/// Label values escape backslash, double quote and line feed (format 0.0.4).
fn escape_label(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::sample::record;
    use crate::config::Metering;

    /// The lines of `text` that start with `prefix`, in order.
    fn lines<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        text.lines().filter(|l| l.starts_with(prefix)).collect()
    }

    #[test]
    fn renders_call_and_cost_counters_from_records() {
        let registry = Registry::new();
        registry.record_call(&record("acme", Some("ptu-west"), Metering::Local, 150));
        registry.record_call(&record("acme", Some("ptu-west"), Metering::Local, 1_500_020));
        registry.record_call(&record("acme", Some("peer"), Metering::Upstream, 7));
        registry.record_call(&record("globex", None, Metering::Local, 0));
        let text = registry.render_prometheus();
        assert_eq!(
            lines(&text, "flexway_inference_calls_total"),
            vec![
                r#"flexway_inference_calls_total{tenant="acme",backend="peer",metered_by="upstream",capability="chat"} 1"#,
                r#"flexway_inference_calls_total{tenant="acme",backend="ptu-west",metered_by="local",capability="chat"} 2"#,
                r#"flexway_inference_calls_total{tenant="globex",backend="none",metered_by="local",capability="chat"} 1"#,
            ]
        );
        assert_eq!(
            lines(&text, "flexway_inference_cost_eur_total"),
            vec![
                r#"flexway_inference_cost_eur_total{tenant="acme",backend="peer",metered_by="upstream",capability="chat"} 0.000007"#,
                r#"flexway_inference_cost_eur_total{tenant="acme",backend="ptu-west",metered_by="local",capability="chat"} 1.500170"#,
                r#"flexway_inference_cost_eur_total{tenant="globex",backend="none",metered_by="local",capability="chat"} 0.000000"#,
            ]
        );
        assert!(text.contains(
            "# HELP flexway_inference_calls_total Inference calls with an audit record, refused ones included.\n\
             # TYPE flexway_inference_calls_total counter\n"
        ));
        assert!(text.contains("# TYPE flexway_inference_cost_eur_total counter\n"));
    }

    #[test]
    fn renders_histograms_with_cumulative_buckets_sum_and_count() {
        let registry = Registry::new();
        registry.observe_time_to_first_byte("ptu-west", Duration::from_millis(80));
        registry.observe_time_to_first_byte("ptu-west", Duration::from_millis(100));
        registry.observe_time_to_first_byte("ptu-west", Duration::from_secs(90));
        let text = registry.render_prometheus();
        assert_eq!(
            lines(&text, "flexway_time_to_first_byte_seconds"),
            vec![
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="0.05"} 0"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="0.1"} 2"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="0.25"} 2"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="0.5"} 2"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="1"} 2"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="2.5"} 2"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="5"} 2"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="10"} 2"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="30"} 2"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="60"} 2"#,
                r#"flexway_time_to_first_byte_seconds_bucket{backend="ptu-west",le="+Inf"} 3"#,
                r#"flexway_time_to_first_byte_seconds_sum{backend="ptu-west"} 90.18"#,
                r#"flexway_time_to_first_byte_seconds_count{backend="ptu-west"} 3"#,
            ]
        );
        assert!(text.contains("# TYPE flexway_time_to_first_byte_seconds histogram\n"));
    }

    #[test]
    fn overhead_histogram_is_rendered_without_labels_even_when_empty() {
        let registry = Registry::new();
        let text = registry.render_prometheus();
        assert!(text.contains("flexway_gateway_overhead_seconds_bucket{le=\"0.0001\"} 0\n"));
        assert!(text.contains("flexway_gateway_overhead_seconds_bucket{le=\"+Inf\"} 0\n"));
        assert!(text.contains("flexway_gateway_overhead_seconds_sum 0\nflexway_gateway_overhead_seconds_count 0\n"));

        registry.observe_gateway_overhead(Duration::from_micros(300));
        registry.observe_gateway_overhead(Duration::from_micros(500));
        let text = registry.render_prometheus();
        assert!(text.contains("flexway_gateway_overhead_seconds_bucket{le=\"0.00025\"} 0\n"), "{text}");
        assert!(text.contains("flexway_gateway_overhead_seconds_bucket{le=\"0.0005\"} 2\n"), "{text}");
        assert!(text.contains("flexway_gateway_overhead_seconds_sum 0.0008\n"), "{text}");
        assert!(text.contains("flexway_gateway_overhead_seconds_count 2\n"), "{text}");
    }

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
    fn gauges_hold_the_last_value_set() {
        let registry = Registry::new();
        registry.set_budget_remaining("acme", "tokens_per_day", 1_000.0);
        registry.set_budget_remaining("acme", "tokens_per_day", 750.0);
        registry.set_budget_remaining("acme", "eur_per_month", 12.5);
        registry.set_breaker_state("ptu-west", BreakerState::Open);
        registry.set_breaker_state("payg", BreakerState::HalfOpen);
        registry.set_breaker_state("payg-north", BreakerState::Closed);
        let text = registry.render_prometheus();
        assert_eq!(
            lines(&text, "flexway_budget_remaining{"),
            vec![
                r#"flexway_budget_remaining{tenant="acme",budget="eur_per_month"} 12.5"#,
                r#"flexway_budget_remaining{tenant="acme",budget="tokens_per_day"} 750"#,
            ]
        );
        assert_eq!(
            lines(&text, "flexway_breaker_state{"),
            vec![
                r#"flexway_breaker_state{backend="payg"} 2"#,
                r#"flexway_breaker_state{backend="payg-north"} 0"#,
                r#"flexway_breaker_state{backend="ptu-west"} 1"#,
            ]
        );
        assert!(text.contains("# TYPE flexway_budget_remaining gauge\n"));
        assert_eq!(float(f64::INFINITY), "+Inf");
        assert_eq!(float(f64::NAN), "NaN");
    }

    #[test]
    fn escapes_label_values() {
        let registry = Registry::new();
        registry.set_breaker_state("a\"b\\c\nd", BreakerState::Open);
        let text = registry.render_prometheus();
        assert!(text.contains("flexway_breaker_state{backend=\"a\\\"b\\\\c\\nd\"} 1\n"), "{text}");
        // One sample line: the line feed did not split it.
        assert_eq!(lines(&text, "flexway_breaker_state{").len(), 1);
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
    fn every_non_comment_line_is_a_well_formed_sample() {
        let registry = Registry::new();
        registry.record_call(&record("acme", Some("ptu-west"), Metering::Local, 150));
        registry.observe_gateway_overhead(Duration::from_micros(700));
        registry.observe_time_to_first_byte("ptu-west", Duration::from_millis(300));
        registry.observe_usage_drift("ptu-west", 10, 20);
        registry.set_budget_remaining("acme", "tokens_per_day", 5.0);
        registry.set_breaker_state("ptu-west", BreakerState::Closed);
        registry.observe_overshoot("ptu-west", 12);
        registry.realtime_session_ended(Some("rt"), "budget_exceeded");
        registry.realtime_response("acme", "rt");
        registry.realtime_response("acme", "rt");
        registry.set_realtime_open(3);
        registry.set_member_load("gpu-a", Some((7, 0.5)), 2);
        registry.set_member_load("gpu-b", None, 4);
        registry.shed("acme", "gpus");
        let text = registry.render_prometheus();
        assert!(text.ends_with('\n'));
        for line in text.lines() {
            if let Some(comment) = line.strip_prefix("# ") {
                assert!(comment.starts_with("HELP flexway_") || comment.starts_with("TYPE flexway_"), "{line}");
                continue;
            }
            let (series, value) = line.rsplit_once(' ').unwrap();
            assert!(series.starts_with("flexway_"), "{line}");
            assert!(value == "+Inf" || value.parse::<f64>().is_ok(), "{line}");
        }
        let types = lines(&text, "# TYPE");
        assert_eq!(types.len(), 19, "{types:?}");
        assert!(text.contains("flexway_member_queue{backend=\"gpu-a\"} 7\n"), "{text}");
        assert!(!text.contains("flexway_member_queue{backend=\"gpu-b\"}"), "a stale member shows no queue: {text}");
        assert!(text.contains("flexway_member_in_flight{backend=\"gpu-b\"} 4\n"), "{text}");
        assert!(text.contains("flexway_calls_shed_total{tenant=\"acme\",pool=\"gpus\"} 1\n"), "{text}");
        assert!(text.contains("flexway_allowance_overshoot_tokens_total{backend=\"ptu-west\"} 12\n"), "{text}");
        assert!(text.contains("flexway_realtime_sessions_open 3\n"), "{text}");
        let ended = "flexway_realtime_sessions_total{backend=\"rt\",close_reason=\"budget_exceeded\"} 1\n";
        assert!(text.contains(ended), "{text}");
        assert!(text.contains("flexway_realtime_responses_total{tenant=\"acme\",backend=\"rt\"} 2\n"), "{text}");
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
        for leaked in ["req-", "agent-", "model-", "billing-bot", &"ab".repeat(32)] {
            assert!(!text.contains(leaked), "{leaked} leaked into the metrics");
        }
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
        assert!(calls.iter().all(|l| l.ends_with(" 4000")), "{calls:?}");
        assert!(text.contains("flexway_gateway_overhead_seconds_count 8000\n"));
        assert!(text.contains("flexway_gateway_overhead_seconds_sum 0.8\n"));
    }

    #[test]
    fn scales_integers_to_exact_decimals() {
        assert_eq!(scaled(2_500_000, 9), "0.0025");
        assert_eq!(scaled(1_000_000_000, 9), "1");
        assert_eq!(scaled(-1_000, 0), "-1000");
        assert_eq!(scaled(-1_500_000_000, 9), "-1.5");
        assert_eq!(scaled(i64::MIN, 0), i64::MIN.to_string());
    }
}
