//! The audit: one metadata-only record per inference call, on every outcome (SPEC §9).
//!
//! What must never happen: a prompt, a completion, a key, the OpenAI `user` field or a
//! client address in a record (identifiers appear only as salted SHA-256); a call that
//! ends without its record; a record dropped without anyone being told. Records are
//! written by the request's final phase, in the order calls end. Finance bills from
//! them: the schema is versioned (`schema_version`) and documented in
//! `config/audit-record.schema.json`.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::money::MicroEur;

pub mod report;
pub mod sinks;

pub use sinks::{FileAuditSink, StdoutAuditSink};

pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct AuditRecord {
    pub schema_version: u32,
    /// RFC 3339, UTC: when the call ended.
    pub ts: String,
    /// The `Flexway-Request-Id` returned to the client.
    pub request_id: String,
    pub tenant: String,
    pub agent: Option<String>,
    /// `chat` | `embeddings` | `grpc`.
    pub operation: String,
    /// `chat` | `vision` | `embeddings`.
    pub capability: String,
    pub model_requested: Option<String>,
    pub model_served: Option<String>,
    /// The backend that served (for a pool, the member), or the last one tried.
    pub backend: Option<String>,
    /// `local` | `upstream`: where this consumption is billed.
    pub metered_by: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// `reported` | `estimated`.
    pub usage_source: String,
    /// Euros, as a number (from `cost_micro_eur`).
    pub cost_eur: f64,
    /// The exact cost in integer micro-euros, as settled in the ledger.
    pub cost_micro_eur: u64,
    /// HTTP status returned to the client (or gRPC code).
    pub status: u16,
    pub error_code: Option<String>,
    pub degraded: bool,
    /// `ok` | `soft` | `exceeded`.
    pub budget_state: String,
    pub latency_ms: u64,
    pub ttfb_ms: Option<u64>,
    /// Salted SHA-256 of the caller's key hash.
    pub key_hash: String,
    /// Salted SHA-256 of the OpenAI `user` field, when the client sent one.
    pub user_hash: Option<String>,
}

/// The JSON Schema of [`AuditRecord`], as published in `config/audit-record.schema.json`.
pub fn record_schema() -> serde_json::Value {
    schemars::schema_for!(AuditRecord).to_value()
}

impl AuditRecord {
    pub fn cost(&self) -> MicroEur {
        MicroEur(self.cost_micro_eur)
    }
}

/// Salted SHA-256, hex: how identifiers enter the audit.
#[derive(Clone)]
pub struct Hasher {
    salt: Vec<u8>,
}

impl std::fmt::Debug for Hasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hasher(salt: ***)")
    }
}

impl Hasher {
    pub fn new(salt: &[u8]) -> Self {
        Hasher { salt: salt.to_vec() }
    }

    pub fn hash(&self, value: &[u8]) -> String {
        let mut digest = Sha256::new();
        digest.update(&self.salt);
        digest.update(value);
        hex::encode(digest.finalize())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("audit sink: {0}")]
    Sink(String),
}

/// Where records go. `write` returns only when the records are handed to durable
/// storage (or the error says they were not).
#[async_trait::async_trait]
pub trait AuditSink: Send + Sync {
    async fn write(&self, records: &[AuditRecord]) -> Result<(), AuditError>;
}
