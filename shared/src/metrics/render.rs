//! The Prometheus text exposition format, version 0.0.4: every family under its
//! `# HELP` and `# TYPE` lines, its series sorted by label values, label values
//! escaped, money and latencies turned from integers into exact decimals.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use super::family::{Histogram, HistogramSnapshot};
use super::{GRPC_CALL_LABELS, Registry};
use crate::money::MicroEur;

/// Histogram bounds for latencies are kept in nanoseconds and rendered in seconds.
const SECOND_DECIMALS: u32 = 9;

impl Registry {
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
        header(
            &mut out,
            "flexway_rate_limited_total",
            "counter",
            "Calls refused (429 rate_limit_exceeded) by a per-minute limit, per holder and kind.",
        );
        for (values, count) in self.rate_limited.snapshot(|c| *c) {
            let names = ["tenant", "holder", "kind"];
            sample(&mut out, "flexway_rate_limited_total", &names, &values, None, &count.to_string());
        }

        header(
            &mut out,
            "flexway_backend_quota_used_ratio",
            "gauge",
            "The share of a backend's provider quota used in its current minute, per kind, as last read.",
        );
        for (values, ratio) in self.backend_quota_used.snapshot(|v| *v) {
            let names = ["backend", "kind"];
            sample(&mut out, "flexway_backend_quota_used_ratio", &names, &values, None, &float(ratio));
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
        self.render_cache(&mut out);
        self.render_mcp(&mut out);
        out
    }

    /// The response cache's families (SPEC §16).
    fn render_cache(&self, out: &mut String) {
        header(
            out,
            "flexway_cache_lookups_total",
            "counter",
            "Response cache lookups, by policy and outcome: hit (served from the cache), miss (not found), \
             bypass (not looked up: Cache-Control no-cache, or a sensitive call), off (cache: off for the \
             tenant or agent), error (the store failed: counted and served as a miss).",
        );
        for (values, n) in self.cache_lookups.snapshot(|n| *n) {
            let names = ["tenant", "policy", "outcome"];
            sample(out, "flexway_cache_lookups_total", &names, &values, None, &n.to_string());
        }
        header(
            out,
            "flexway_cache_stores_total",
            "counter",
            "Complete answers stored in the response cache, by policy.",
        );
        for (values, n) in self.cache_stores.snapshot(|n| *n) {
            sample(out, "flexway_cache_stores_total", &["tenant", "policy"], &values, None, &n.to_string());
        }
        header(
            out,
            "flexway_cache_store_failures_total",
            "counter",
            "Response cache failures, by operation: lookup, store, embed (the semantic policy's embedding call). \
             Each is a miss for the call, never an error.",
        );
        for (values, n) in self.cache_store_failures.snapshot(|n| *n) {
            sample(out, "flexway_cache_store_failures_total", &["operation"], &values, None, &n.to_string());
        }
        header(
            out,
            "flexway_cache_saved_eur_total",
            "counter",
            "Euros that response cache hits saved: for each hit, the cost of the call that produced the entry \
             it was served (the audit's cost_saved_eur).",
        );
        for (values, saved) in self.cache_saved.snapshot(|n| *n) {
            let euros = MicroEur(saved).to_eur_string();
            sample(out, "flexway_cache_saved_eur_total", &["tenant"], &values, None, &euros);
        }
        header(out, "flexway_cache_entries", "gauge", "A tenant's live response cache entries, as last counted.");
        for (values, n) in self.cache_entries.snapshot(|n| *n) {
            sample(out, "flexway_cache_entries", &["tenant"], &values, None, &n.to_string());
        }
    }
}

pub(super) fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// One sample line; `le` is appended after the other labels for histogram buckets.
pub(super) fn sample(out: &mut String, name: &str, names: &[&str], values: &[String], le: Option<&str>, value: &str) {
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
    use std::time::Duration;

    use super::super::tests::lines;
    use super::*;
    use crate::audit::sample::record;
    use crate::config::Metering;
    use crate::metrics::BreakerState;

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
        registry.rate_limited("acme", "key 9f86d081884c7d65", "requests");
        registry.set_backend_quota_used("ptu-west", "tokens", 0.25);
        registry.cache_lookup("acme", "faq", "hit");
        registry.cache_stored("acme", "faq");
        registry.cache_store_failed("lookup");
        registry.cache_saved("acme", MicroEur(1_500));
        registry.cache_entries("acme", 9);
        registry.mcp_server_down("search");
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
        assert_eq!(types.len(), 29, "{types:?}");
        let quota = "flexway_backend_quota_used_ratio{backend=\"ptu-west\",kind=\"tokens\"} 0.25\n";
        assert!(text.contains(quota), "{text}");
        let limited = r#"flexway_rate_limited_total{tenant="acme",holder="key 9f86d081884c7d65",kind="requests"} 1"#;
        assert!(text.contains(limited), "{text}");
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
    fn scales_integers_to_exact_decimals() {
        assert_eq!(scaled(2_500_000, 9), "0.0025");
        assert_eq!(scaled(1_000_000_000, 9), "1");
        assert_eq!(scaled(-1_000, 0), "-1000");
        assert_eq!(scaled(-1_500_000_000, 9), "-1.5");
        assert_eq!(scaled(i64::MIN, 0), i64::MIN.to_string());
    }
}
