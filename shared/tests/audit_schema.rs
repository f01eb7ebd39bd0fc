//! The published JSON Schema of an audit record (`config/audit-record.schema.json`) is
//! generated from [`flexway::audit::AuditRecord`]; finance pipelines depend on it, so
//! this test fails when the checked-in file drifts from the type.
//! Regenerate with `FLEXWAY_BLESS=1 cargo test -p flexway --test audit_schema`.
#![cfg(test)]

use flexway_testkit::golden as support;

use std::path::PathBuf;

fn schema_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/audit-record.schema.json")
}

fn generated() -> String {
    let mut text = serde_json::to_string_pretty(&flexway::audit::record_schema()).unwrap();
    text.push('\n');
    text
}

#[test]
fn checked_in_schema_matches_the_record_type() {
    support::matches_or_bless(
        &schema_path(),
        &generated(),
        "AuditRecord in shared/src/audit/mod.rs; regenerate it with: FLEXWAY_BLESS=1 cargo test -p flexway \
         --test audit_schema (and bump SCHEMA_VERSION if the change is not backward compatible)",
    );
}

#[test]
fn schema_lists_every_spec_field() {
    let schema = flexway::audit::record_schema();
    let properties = schema["properties"].as_object().unwrap();
    let spec_fields = [
        "schema_version",
        "ts",
        "request_id",
        "tenant",
        "agent",
        "operation",
        "capability",
        "model_requested",
        "model_served",
        "backend",
        "metered_by",
        "prompt_tokens",
        "completion_tokens",
        "usage_source",
        "cost_eur",
        "cost_micro_eur",
        "status",
        "error_code",
        "degraded",
        "budget_state",
        "latency_ms",
        "ttfb_ms",
        "key_hash",
        "user_hash",
        // §2.3: a realtime session's record says how it ended (absent for other calls).
        "close_reason",
        // SPEC §10: a gRPC call's record names its method's feature.
        "feature",
        // The date the call was reserved on: the report counts it where the ledger did.
        "period",
        // With audit.chain_key: the record's place in its writer's HMAC chain.
        "chain",
        // SPEC §5: which pool member served and why, and the call's class.
        "pick_reason",
        "criticality",
        // SPEC §3 "Price": the prompt tokens a provider's cache read and wrote.
        "cached_tokens",
        "cache_write_tokens",
        // SPEC §15: the run the call named, refused calls included.
        "run",
        // SPEC §15: whether the call was charged (served and settled, its request kept
        // counted): what the report counts as a run's calls.
        "charged",
        // SPEC §14: the backends passed over without a call, and why.
        "skipped",
        // SPEC §16: what the response cache did, a hit's similarity, age and saving
        // (in euros and, exact, in micro-euros).
        "cache",
        "cache_similarity",
        "cache_age_s",
        "cost_saved_eur",
        "cost_saved_micro_eur",
        // SPEC §17: a tool call's server, tool (its name on its server) and outcome.
        "mcp_server",
        "tool",
        "mcp_status",
    ];
    for field in spec_fields {
        assert!(properties.contains_key(field), "missing {field}");
    }
    assert_eq!(properties.len(), spec_fields.len(), "fields beyond the SPEC's: {properties:?}");
    for never in ["prompt", "completion", "messages", "user", "key", "ip", "client_ip"] {
        assert!(!properties.contains_key(never), "{never} must never be in an audit record");
    }
}
