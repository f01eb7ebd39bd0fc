//! `EmfAuditSink`: in the serverless shape, metrics are CloudWatch Embedded Metric
//! Format lines in the function's own log (stdout), one per call, taken from the very
//! record the audit gets ([`emf_line`]), so metrics and audit never disagree.
//! CloudWatch turns them into `flexway.inference.cost`, `flexway.inference.calls` and
//! `flexway.inference.errors` in the stack's namespace (`Flexway/<stack>`, see
//! [`namespace`]: two stacks in one region never mix), which the dashboard in
//! `infra/template.yaml` shows. A call the response cache had a say in (SPEC §16)
//! also counts in `flexway_cache_lookups_total`, `flexway_cache_stores_total` and
//! `flexway_cache_saved_eur_total`, the names of the local shape's Prometheus
//! counters (see [`cache_metrics`] for what the audit record cannot tell); a tool
//! call through `/mcp` (SPEC §17) in `flexway_mcp_calls_total` and
//! `flexway_mcp_cost_eur_total` ([`mcp_metrics`]); a call a per-minute limit refused
//! (SPEC §14) in `flexway_rate_limited_total` ([`rate_limited_metrics`]); and a call
//! that counted on its backend's provider quota in
//! `flexway_backend_quota_used_ratio`, its share of the quota, on lines of their own
//! ([`quota_lines`]). The
//! format is CloudWatch's, so it lives here: the core only gives the call's labels
//! (`flexway::metrics::call_labels`, the same as its Prometheus counters').

use std::io::Write;

use flexway::audit::{AuditError, AuditRecord, AuditSink, CacheOutcome, ErrorCode, McpStatus, SkipCause};
use flexway::config::{Config, Rates};
use flexway::metrics::{CALL_LABELS, GRPC_CALL_LABELS, call_labels};
use flexway::money::MicroEur;
use serde_json::json;

/// The metrics' namespace: `FLEXWAY_METRICS_NAMESPACE` when set (the stack sets
/// `Flexway/<stack>`), else `Flexway/<stack>` read from the audit group the stack
/// names `/<stack>/audit` (a gateway deployed with `cargo lambda deploy` on the
/// stack's group), else `Flexway`.
pub fn namespace(declared: Option<String>, audit_log_group: &str) -> String {
    if let Some(declared) = declared.filter(|n| !n.trim().is_empty()) {
        return declared;
    }
    match audit_log_group.strip_prefix('/').and_then(|g| g.strip_suffix("/audit")) {
        Some(stack) if !stack.is_empty() && !stack.contains('/') => format!("Flexway/{stack}"),
        _ => "Flexway".to_owned(),
    }
}

/// Prints one EMF line per record (and one per quota window it counted on) to stdout,
/// then hands the records to `inner`.
#[derive(Debug)]
pub struct EmfAuditSink<S> {
    inner: S,
    namespace: String,
    /// The provider quota of each backend that has one (SPEC §14), by name.
    quotas: Vec<(String, Rates)>,
}

impl<S> EmfAuditSink<S> {
    pub fn new(inner: S, namespace: String) -> Self {
        EmfAuditSink { inner, namespace, quotas: Vec::new() }
    }

    /// With the provider quotas of `config`'s backends, for [`quota_lines`] (a
    /// function's config is read once, at init).
    pub fn with_quotas(mut self, config: &Config) -> Self {
        let quoted = config.ai.backends.iter().filter(|(_, backend)| !backend.quota.is_none());
        self.quotas = quoted.map(|(name, backend)| (name.to_string(), backend.quota)).collect();
        self
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }
}

#[async_trait::async_trait]
impl<S: AuditSink> AuditSink for EmfAuditSink<S> {
    fn ordered(&self) -> bool {
        self.inner.ordered()
    }

    async fn write(&self, records: &[AuditRecord]) -> Result<(), AuditError> {
        if !records.is_empty() {
            let mut lines = String::new();
            for record in records {
                lines.push_str(&emf_line(record, &self.namespace));
                lines.push('\n');
                for line in quota_lines(record, &self.quotas, &self.namespace) {
                    lines.push_str(&line);
                    lines.push('\n');
                }
            }
            // Metrics are best effort (a lost line is a gap on a graph); the audit
            // write below is not, and its error is returned.
            let mut out = std::io::stdout().lock();
            if let Err(e) = out.write_all(lines.as_bytes()).and_then(|()| out.flush()) {
                tracing::warn!("cannot write EMF metrics to stdout: {e}");
            }
        }
        self.inner.write(records).await
    }
}

/// The CloudWatch Embedded Metric Format line (JSON, no trailing newline) for one call:
/// `flexway.inference.cost` (euros), `flexway.inference.calls` and
/// `flexway.inference.errors` (1 for a call that ended with a 5xx), with the
/// dimensions of SPEC §9, at the record's `ts`, in `namespace`. Only dimension values
/// and numbers: nothing else of the record.
fn emf_line(record: &AuditRecord, namespace: &str) -> String {
    let [tenant, backend, metered_by, capability] = call_labels(record);
    let cost_eur = record.cost_micro_eur as f64 / MicroEur::PER_EUR as f64;
    // A metered gRPC call: the feature is a dimension too (SPEC §10).
    let dimensions = match &record.feature {
        Some(_) => json!([GRPC_CALL_LABELS, ["tenant"], ["backend"], ["feature"]]),
        None => json!([CALL_LABELS, ["tenant"], ["backend"]]),
    };
    let mut line = json!({
        "_aws": {
            "Timestamp": record.ts.unix_millis(),
            "CloudWatchMetrics": [{
                "Namespace": namespace,
                "Dimensions": dimensions,
                "Metrics": [
                    {"Name": "flexway.inference.cost", "Unit": "None"},
                    {"Name": "flexway.inference.calls", "Unit": "Count"},
                    {"Name": "flexway.inference.errors", "Unit": "Count"},
                ],
            }],
        },
        "tenant": tenant,
        "backend": backend,
        "metered_by": metered_by,
        "capability": capability,
        "flexway.inference.cost": cost_eur,
        "flexway.inference.calls": 1,
        "flexway.inference.errors": u8::from(record.status >= 500),
    });
    if let (Some(feature), Some(fields)) = (&record.feature, line.as_object_mut()) {
        fields.insert("feature".to_owned(), json!(feature));
    }
    if let Some(outcome) = record.cache {
        cache_metrics(&mut line, record, outcome, namespace);
    }
    if let (Some(server), Some(status)) = (&record.mcp_server, record.mcp_status) {
        mcp_metrics(&mut line, record, server, status, namespace);
    }
    if is_rate_limited(record) {
        rate_limited_metrics(&mut line, namespace);
    }
    line.to_string()
}

/// Whether a per-minute limit of the caller (its tenant's, agent's or key's) refused
/// the call: `rate_limit_exceeded` with no backend passed over at its quota (that
/// one is `backend_quota`, which the Prometheus counter does not count either).
fn is_rate_limited(record: &AuditRecord) -> bool {
    record.error_code == Some(ErrorCode::RateLimitExceeded)
        && !record.skipped.iter().any(|skipped| skipped.cause == SkipCause::Quota)
}

/// A refusal by a per-minute limit, added to its line, named as the Prometheus counter
/// is, with the dimension `tenant`: the record names neither the holder nor the kind
/// (the function's log and the answer's `Flexway-Error-Cause` do).
fn rate_limited_metrics(line: &mut serde_json::Value, namespace: &str) {
    let directive = json!({
        "Namespace": namespace,
        "Dimensions": [["tenant"]],
        "Metrics": [{"Name": RATE_LIMITED, "Unit": "Count"}],
    });
    if let Some(all) = line.pointer_mut("/_aws/CloudWatchMetrics").and_then(|d| d.as_array_mut()) {
        all.push(directive);
    }
    if let Some(fields) = line.as_object_mut() {
        fields.insert(RATE_LIMITED.to_owned(), json!(1));
    }
}

const RATE_LIMITED: &str = "flexway_rate_limited_total";

/// The quota metric's name, as the Prometheus gauge's.
const QUOTA_USED: &str = "flexway_backend_quota_used_ratio";

/// One EMF line per window of the provider quota a call counted on (SPEC §14):
/// `flexway_backend_quota_used_ratio` with the dimensions `backend` and `kind`
/// (`requests`, `tokens`), valued at the call's share of the window (1 over the
/// requests per minute; its tokens over the tokens per minute). Their sum over a
/// minute (the `Sum` statistic, 60-second periods) is the share of the quota the
/// fleet used in it, as the gauge of the local shape reads it from the ledger: every
/// call a function settles on a backend's quota writes its record. A call counts on
/// the quota of the backend that served it, when it settled on usage (tokens counted;
/// a call refunded counted nothing); at the record's time, its end (a stream that
/// crosses a minute counts in the minute it ends, where the ledger counts it in the
/// one it began); a realtime session's record as one request, with all its tokens.
fn quota_lines(record: &AuditRecord, quotas: &[(String, Rates)], namespace: &str) -> Vec<String> {
    let tokens = record.prompt_tokens.saturating_add(record.completion_tokens);
    let Some(backend) = record.backend.as_deref() else { return Vec::new() };
    let Some((_, quota)) = quotas.iter().find(|(name, _)| name == backend) else { return Vec::new() };
    if tokens == 0 || record.status >= 400 {
        return Vec::new();
    }
    let windows = [("requests", quota.requests_per_minute, 1), ("tokens", quota.tokens_per_minute, tokens)];
    let counted = windows.into_iter().filter_map(|(kind, limit, used)| Some((kind, limit.filter(|l| *l > 0)?, used)));
    counted
        .map(|(kind, limit, used)| {
            json!({
                "_aws": {
                    "Timestamp": record.ts.unix_millis(),
                    "CloudWatchMetrics": [{
                        "Namespace": namespace,
                        "Dimensions": [["backend", "kind"]],
                        "Metrics": [{"Name": QUOTA_USED, "Unit": "None"}],
                    }],
                },
                "backend": backend,
                "kind": kind,
                QUOTA_USED: used as f64 / limit as f64,
            })
            .to_string()
        })
        .collect()
}

/// A tool call's metrics, added to its line, named as the Prometheus counters are
/// (dimensions `tenant`, `server`, and `mcp_status`, the record's field: the
/// Prometheus label `outcome`, named apart from the cache's `outcome` dimension).
fn mcp_metrics(line: &mut serde_json::Value, record: &AuditRecord, server: &str, status: McpStatus, namespace: &str) {
    let directive = json!({
        "Namespace": namespace,
        "Dimensions": [["tenant", "server", "mcp_status"]],
        "Metrics": [{"Name": MCP_CALLS, "Unit": "Count"}, {"Name": MCP_COST, "Unit": "None"}],
    });
    if let Some(all) = line.pointer_mut("/_aws/CloudWatchMetrics").and_then(|d| d.as_array_mut()) {
        all.push(directive);
    }
    if let Some(fields) = line.as_object_mut() {
        fields.insert("server".to_owned(), json!(server));
        fields.insert("mcp_status".to_owned(), json!(status.as_str()));
        fields.insert(MCP_CALLS.to_owned(), json!(1));
        fields.insert(MCP_COST.to_owned(), json!(record.cost_micro_eur as f64 / MicroEur::PER_EUR as f64));
    }
}

const MCP_CALLS: &str = "flexway_mcp_calls_total";
const MCP_COST: &str = "flexway_mcp_cost_eur_total";

/// The response cache's metrics, added to a call's line: a lookup by `outcome`
/// (dimensions `tenant`, `outcome`), and an answer stored and the euros a hit saved
/// (dimension `tenant`), named as the Prometheus counters are. The audit record has
/// no policy, so there is no `policy` dimension; a failing store is a `miss` in it,
/// so there is no `error` outcome here, and no store failure nor entry count (the
/// function's log has the failures' warnings).
fn cache_metrics(line: &mut serde_json::Value, record: &AuditRecord, outcome: CacheOutcome, namespace: &str) {
    // As `Registry::cache_lookup` counts it: an answer stored was a miss first.
    let looked = match outcome {
        CacheOutcome::Hit => "hit",
        CacheOutcome::Miss | CacheOutcome::Stored => "miss",
        CacheOutcome::Bypass => "bypass",
        CacheOutcome::Off => "off",
    };
    let saved = match outcome {
        CacheOutcome::Hit => record.cost_saved_micro_eur.unwrap_or(0) as f64 / MicroEur::PER_EUR as f64,
        _ => 0.0,
    };
    let directives = [
        json!({
            "Namespace": namespace,
            "Dimensions": [["tenant", "outcome"]],
            "Metrics": [{"Name": CACHE_LOOKUPS, "Unit": "Count"}],
        }),
        json!({
            "Namespace": namespace,
            "Dimensions": [["tenant"]],
            "Metrics": [{"Name": CACHE_STORES, "Unit": "Count"}, {"Name": CACHE_SAVED, "Unit": "None"}],
        }),
    ];
    if let Some(all) = line.pointer_mut("/_aws/CloudWatchMetrics").and_then(|d| d.as_array_mut()) {
        all.extend(directives);
    }
    if let Some(fields) = line.as_object_mut() {
        fields.insert("outcome".to_owned(), json!(looked));
        fields.insert(CACHE_LOOKUPS.to_owned(), json!(1));
        fields.insert(CACHE_STORES.to_owned(), json!(u8::from(outcome == CacheOutcome::Stored)));
        fields.insert(CACHE_SAVED.to_owned(), json!(saved));
    }
}

const CACHE_LOOKUPS: &str = "flexway_cache_lookups_total";
const CACHE_STORES: &str = "flexway_cache_stores_total";
const CACHE_SAVED: &str = "flexway_cache_saved_eur_total";

/// The drift metric's name, in Prometheus (`flexway reconcile --push`) and EMF alike.
pub const DRIFT_METRIC: &str = "flexway_reconciliation_drift_ratio";

/// One EMF line per backend with a drift (SPEC §9): `flexway_reconciliation_drift_ratio`
/// with the dimension `backend`, and without (the dimension set `[]`), so that one
/// alarm on the stack's namespace watches every backend's, by its maximum.
pub fn drift_lines(reconciliation: &flexway::reconcile::Reconciliation, namespace: &str, now_ms: i64) -> Vec<String> {
    let backends = reconciliation.backends.iter();
    let drifts = backends.filter_map(|b| Some((b.backend.as_str(), b.drift_ratio?)));
    drifts
        .map(|(backend, ratio)| {
            json!({
                "_aws": {
                    "Timestamp": now_ms,
                    "CloudWatchMetrics": [{
                        "Namespace": namespace,
                        "Dimensions": [["backend"], []],
                        "Metrics": [{"Name": DRIFT_METRIC, "Unit": "None"}],
                    }],
                },
                "backend": backend,
                DRIFT_METRIC: ratio,
            })
            .to_string()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use flexway::audit::sample::record;
    use flexway::config::Metering;

    use super::*;

    #[test]
    fn emf_line_has_the_cloudwatch_structure() {
        let line = emf_line(&record("acme", Some("ptu-west"), Metering::Local, 1_500_020), "Flexway/prod");
        assert!(!line.contains('\n'));
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        let aws = &value["_aws"];
        assert_eq!(aws["Timestamp"], 1_740_823_200_250_i64);
        let directive = &aws["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], "Flexway/prod");
        assert_eq!(
            directive["Dimensions"],
            json!([["tenant", "backend", "metered_by", "capability"], ["tenant"], ["backend"]])
        );
        assert_eq!(
            directive["Metrics"],
            json!([
                {"Name": "flexway.inference.cost", "Unit": "None"},
                {"Name": "flexway.inference.calls", "Unit": "Count"},
                {"Name": "flexway.inference.errors", "Unit": "Count"},
            ])
        );
        assert_eq!(value["tenant"], "acme");
        assert_eq!(value["backend"], "ptu-west");
        assert_eq!(value["metered_by"], "local");
        assert_eq!(value["capability"], "chat");
        assert_eq!(value["flexway.inference.cost"], 1.500_02);
        assert_eq!(value["flexway.inference.calls"], 1);
        assert_eq!(value["flexway.inference.errors"], 0);
        let mut keys: Vec<&str> = value.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            vec![
                "_aws",
                "backend",
                "capability",
                "flexway.inference.calls",
                "flexway.inference.cost",
                "flexway.inference.errors",
                "metered_by",
                "tenant",
            ],
            "nothing else of the record (no key, user, agent, model) goes into a metric line"
        );
    }

    #[test]
    fn a_cached_call_counts_its_lookup_store_and_saving_under_the_prometheus_names() {
        let mut hit = record("acme", None, Metering::Local, 0);
        hit.cache = Some(CacheOutcome::Hit);
        hit.cost_saved_micro_eur = Some(1_250_000);
        hit.cost_saved_eur = Some(1.25);
        let value: serde_json::Value = serde_json::from_str(&emf_line(&hit, "Flexway/prod")).unwrap();
        let directives = value["_aws"]["CloudWatchMetrics"].as_array().unwrap();
        assert_eq!(directives.len(), 3, "the call's, then the cache's two");
        assert_eq!(
            directives[1],
            json!({
                "Namespace": "Flexway/prod",
                "Dimensions": [["tenant", "outcome"]],
                "Metrics": [{"Name": "flexway_cache_lookups_total", "Unit": "Count"}],
            })
        );
        assert_eq!(directives[2]["Dimensions"], json!([["tenant"]]));
        assert_eq!(
            directives[2]["Metrics"],
            json!([
                {"Name": "flexway_cache_stores_total", "Unit": "Count"},
                {"Name": "flexway_cache_saved_eur_total", "Unit": "None"},
            ])
        );
        assert_eq!(value["outcome"], "hit");
        assert_eq!(value["flexway_cache_lookups_total"], 1);
        assert_eq!(value["flexway_cache_stores_total"], 0);
        assert_eq!(value["flexway_cache_saved_eur_total"], 1.25);
        assert_eq!(value["flexway.inference.calls"], 1, "a hit is a call too");

        let mut stored = record("acme", Some("ptu-west"), Metering::Local, 300);
        stored.cache = Some(CacheOutcome::Stored);
        let value: serde_json::Value = serde_json::from_str(&emf_line(&stored, "Flexway/prod")).unwrap();
        assert_eq!(value["outcome"], "miss", "looked up and not found, then kept");
        assert_eq!(value["flexway_cache_stores_total"], 1);
        assert_eq!(value["flexway_cache_saved_eur_total"], 0.0);
        for (outcome, named) in
            [(CacheOutcome::Miss, "miss"), (CacheOutcome::Bypass, "bypass"), (CacheOutcome::Off, "off")]
        {
            stored.cache = Some(outcome);
            let value: serde_json::Value = serde_json::from_str(&emf_line(&stored, "Flexway")).unwrap();
            assert_eq!(
                (value["outcome"].as_str(), value["flexway_cache_stores_total"].as_u64()),
                (Some(named), Some(0))
            );
        }
    }

    #[test]
    fn a_tool_call_counts_under_its_server_and_status() {
        let mut call = record("acme", None, Metering::Local, 2_500);
        call.mcp_server = Some("search".into());
        call.tool = Some("deep_search".into());
        call.mcp_status = Some(McpStatus::ToolError);
        let value: serde_json::Value = serde_json::from_str(&emf_line(&call, "Flexway/prod")).unwrap();
        let directives = value["_aws"]["CloudWatchMetrics"].as_array().unwrap();
        assert_eq!(directives.len(), 2, "the call's, then the tool call's");
        assert_eq!(directives[1]["Dimensions"], json!([["tenant", "server", "mcp_status"]]));
        assert_eq!((value["server"].as_str(), value["mcp_status"].as_str()), (Some("search"), Some("tool_error")));
        assert_eq!(
            (value["flexway_mcp_calls_total"].as_u64(), value["flexway_mcp_cost_eur_total"].as_f64()),
            (Some(1), Some(0.0025))
        );
        assert!(value.get("tool").is_none(), "the tool is no dimension");
    }

    #[test]
    fn a_call_a_per_minute_limit_refused_counts_under_its_tenant() {
        let mut refused = record("acme", None, Metering::Local, 0);
        (refused.status, refused.error_code) = (429, Some(ErrorCode::RateLimitExceeded));
        let value: serde_json::Value = serde_json::from_str(&emf_line(&refused, "Flexway/prod")).unwrap();
        let directives = value["_aws"]["CloudWatchMetrics"].as_array().unwrap();
        assert_eq!(directives.len(), 2, "the call's, then the refusal's");
        assert_eq!(
            directives[1],
            json!({
                "Namespace": "Flexway/prod",
                "Dimensions": [["tenant"]],
                "Metrics": [{"Name": "flexway_rate_limited_total", "Unit": "Count"}],
            })
        );
        assert_eq!((value["tenant"].as_str(), value["flexway_rate_limited_total"].as_u64()), (Some("acme"), Some(1)));
        assert_eq!(value["flexway.inference.calls"], 1, "a refusal is a call too");

        // Every backend at its provider quota: `backend_quota`, not the caller's limit.
        refused.skipped = vec![flexway::audit::Skipped { backend: "ptu-west".into(), cause: SkipCause::Quota }];
        let value: serde_json::Value = serde_json::from_str(&emf_line(&refused, "Flexway/prod")).unwrap();
        assert_eq!(value["_aws"]["CloudWatchMetrics"].as_array().unwrap().len(), 1);
        assert!(value.get("flexway_rate_limited_total").is_none());
        let served = record("acme", Some("ptu-west"), Metering::Local, 10);
        let value: serde_json::Value = serde_json::from_str(&emf_line(&served, "Flexway/prod")).unwrap();
        assert!(value.get("flexway_rate_limited_total").is_none(), "only refusals count");
    }

    #[test]
    fn a_call_on_a_backend_with_a_quota_counts_its_share_of_each_window() {
        let quotas = vec![
            ("ptu-west".to_owned(), Rates { requests_per_minute: Some(50), tokens_per_minute: Some(10_000) }),
            ("payg".to_owned(), Rates { requests_per_minute: None, tokens_per_minute: Some(4_000) }),
        ];
        let mut served = record("acme", Some("ptu-west"), Metering::Local, 10);
        (served.prompt_tokens, served.completion_tokens) = (1_500, 1_000);
        let lines = quota_lines(&served, &quotas, "Flexway/prod");
        let values: Vec<serde_json::Value> = lines.iter().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(values.len(), 2, "{lines:?}");
        let directive = json!([{
            "Namespace": "Flexway/prod",
            "Dimensions": [["backend", "kind"]],
            "Metrics": [{"Name": "flexway_backend_quota_used_ratio", "Unit": "None"}],
        }]);
        for value in &values {
            assert_eq!(value["_aws"]["CloudWatchMetrics"], directive);
            assert_eq!(value["_aws"]["Timestamp"], served.ts.unix_millis());
            assert_eq!(value["backend"], "ptu-west");
            assert!(value.get("tenant").is_none(), "a backend's quota is every tenant's");
        }
        assert_eq!(
            (values[0]["kind"].as_str(), values[0]["flexway_backend_quota_used_ratio"].as_f64()),
            (Some("requests"), Some(0.02))
        );
        assert_eq!(
            (values[1]["kind"].as_str(), values[1]["flexway_backend_quota_used_ratio"].as_f64()),
            (Some("tokens"), Some(0.25))
        );

        served.backend = Some("payg".into());
        let only_tokens = quota_lines(&served, &quotas, "Flexway/prod");
        assert_eq!(only_tokens.len(), 1, "payg has no requests_per_minute");
        assert!(only_tokens[0].contains(r#""flexway_backend_quota_used_ratio":0.625"#), "{only_tokens:?}");

        served.backend = Some("other".into());
        assert!(quota_lines(&served, &quotas, "Flexway/prod").is_empty(), "no quota");
        let mut refunded = record("acme", Some("ptu-west"), Metering::Local, 0);
        (refunded.status, refunded.prompt_tokens, refunded.completion_tokens) = (503, 0, 0);
        assert!(quota_lines(&refunded, &quotas, "Flexway/prod").is_empty(), "a call refunded counted nothing");
        assert!(quota_lines(&record("acme", None, Metering::Local, 0), &quotas, "Flexway/prod").is_empty());
    }

    #[test]
    fn emf_line_names_a_missing_backend() {
        let value: serde_json::Value =
            serde_json::from_str(&emf_line(&record("acme", None, Metering::Upstream, 0), "Flexway")).unwrap();
        assert_eq!(value["backend"], flexway::metrics::NONE);
        assert_eq!(value["metered_by"], "upstream");
    }

    #[test]
    fn the_namespace_is_the_stack_s() {
        assert_eq!(namespace(Some("Flexway/prod".into()), "/other/audit"), "Flexway/prod", "declared wins");
        assert_eq!(namespace(None, "/prod/audit"), "Flexway/prod", "the stack's audit group names it");
        assert_eq!(namespace(Some(" ".into()), "/prod/audit"), "Flexway/prod");
        assert_eq!(namespace(None, "/var/log/audit/x"), "Flexway");
        assert_eq!(namespace(None, "audit"), "Flexway");
    }
}
