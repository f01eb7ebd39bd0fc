//! A complete audit record to build test cases from: for tests only (the
//! `test-support` feature), as the budget conformance suite.

use super::{AuditRecord, BudgetState, Operation, SCHEMA_VERSION, UsageSource};
use crate::config::{Capability, Metering};

/// A served chat call of `tenant` through `backend`, costing `cost` µ€.
#[allow(clippy::unwrap_used)] // a literal timestamp
pub fn record(tenant: &str, backend: Option<&str>, metered_by: Metering, cost: u64) -> AuditRecord {
    AuditRecord {
        schema_version: SCHEMA_VERSION,
        ts: "2025-03-01T10:00:00.250Z".parse().unwrap(),
        request_id: "req-1".into(),
        tenant: tenant.into(),
        agent: Some("billing-bot".into()),
        operation: Operation::Chat,
        capability: Capability::Chat,
        model_requested: Some("gpt-4o".into()),
        model_served: Some("gpt-4o-2024-08-06".into()),
        backend: backend.map(Into::into),
        metered_by,
        prompt_tokens: 100,
        completion_tokens: 50,
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
        latency_ms: 420,
        ttfb_ms: Some(120),
        key_hash: "ab".repeat(32),
        user_hash: Some("cd".repeat(32)),
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
