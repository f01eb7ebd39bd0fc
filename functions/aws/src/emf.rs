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
//! `flexway_mcp_cost_eur_total` ([`mcp_metrics`]). The
//! format is CloudWatch's, so it lives here: the core only gives the call's labels
//! (`flexway::metrics::call_labels`, the same as its Prometheus counters').

use std::io::Write;

use flexway::audit::{AuditError, AuditRecord, AuditSink, CacheOutcome, McpStatus};
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

/// Prints one EMF line per record to stdout, then hands the records to `inner`.
#[derive(Debug)]
pub struct EmfAuditSink<S> {
    inner: S,
    namespace: String,
}

impl<S> EmfAuditSink<S> {
    pub fn new(inner: S, namespace: String) -> Self {
        EmfAuditSink { inner, namespace }
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
    line.to_string()
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
