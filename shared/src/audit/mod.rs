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

use crate::config::{Capability, Metering};
use crate::money::MicroEur;

pub mod chain;
pub mod report;
#[cfg(any(test, feature = "test-support"))]
pub mod sample;
pub mod sinks;
mod timestamp;

pub use sinks::{FileAuditSink, StdoutAuditSink};

/// A record the audit sink did not take goes to the log in full (it holds metadata
/// only, never a prompt or a completion), under a message an alarm can match, so
/// that it can be replayed into the audit.
pub fn not_written(record: &AuditRecord, why: &str) {
    let line = serde_json::to_string(record).unwrap_or_default();
    tracing::error!(request_id = %record.request_id, audit_record = %line, "{AUDIT_NOT_WRITTEN}: {why}");
}

/// The start of the log message of a record the audit sink did not take (a sink that
/// writes over the network: CloudWatch with PutLogEvents, the fleet shape; a file
/// that refused a write). The serverless template's gateway prints its records
/// instead, which cannot fail.
pub const AUDIT_NOT_WRITTEN: &str = "audit record not written";
pub use timestamp::{Timestamp, TimestampError};

pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct AuditRecord {
    pub schema_version: u32,
    /// RFC 3339, UTC: when the call ended.
    #[schemars(with = "String")]
    pub ts: Timestamp,
    /// The `Flexway-Request-Id` returned to the client.
    pub request_id: String,
    pub tenant: String,
    pub agent: Option<String>,
    /// The endpoint family the call came through.
    pub operation: Operation,
    /// What the call asked of a backend (`vision`: a chat with images).
    pub capability: Capability,
    pub model_requested: Option<String>,
    pub model_served: Option<String>,
    /// The backend that served (for a pool, the member), or the last one tried.
    pub backend: Option<String>,
    /// Where this consumption is billed: `upstream` when the backend that served (or
    /// was tried last) is a relay with `metering: upstream`, so the Flexway it leads
    /// to bills it; `local` otherwise (any other backend, a relay metered locally, a
    /// call refused before routing). Either way the local ledger settled it.
    pub metered_by: Metering,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Of `prompt_tokens`, those the provider read from its prompt cache, when it
    /// reported some (priced at `cached_input_per_mtok_eur`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    /// Of `prompt_tokens`, those it wrote to its prompt cache, when it reported some
    /// (priced at `cache_write_per_mtok_eur`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    /// Whether the tokens came from the backend's report or from Flexway's estimate.
    pub usage_source: UsageSource,
    /// Euros, as a number (from `cost_micro_eur`).
    pub cost_eur: f64,
    /// The exact cost in integer micro-euros, as settled in the ledger.
    pub cost_micro_eur: u64,
    /// Whether the call was charged: served and settled rather than refunded, at any
    /// cost (nothing included), its request kept counted where the ledger counts
    /// requests (one of its run's `calls`, a request in its windows). `false` for a
    /// refusal and for a call refunded whole (no backend answered, a tool's JSON-RPC
    /// error, an operation not served). A realtime session is one call of its run
    /// (each response a request in its windows): charged when a response of it
    /// counted its request. `flexway report --by run` counts these as a run's calls.
    /// Written on every record; absent in records written before it existed (the
    /// report then judges from tokens and cost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charged: Option<bool>,
    /// The call's status: the HTTP status returned to the client, or for `operation:
    /// grpc` the call's gRPC status code (`grpc-status`: 0 OK, 14 UNAVAILABLE, ...).
    /// Read it typed with `AuditRecord::call_status`.
    pub status: u16,
    pub error_code: Option<ErrorCode>,
    pub degraded: bool,
    /// `soft`: past a soft limit, still served; `exceeded`: refused by a hard limit.
    pub budget_state: BudgetState,
    pub latency_ms: u64,
    pub ttfb_ms: Option<u64>,
    /// Salted SHA-256 of the caller's key hash.
    pub key_hash: String,
    /// Salted SHA-256 of the OpenAI `user` field, when the client sent one.
    pub user_hash: Option<String>,
    /// A realtime session's (`operation: realtime`) end: who closed it and why. The
    /// session's totals are its tokens and cost, its duration `latency_ms`. Absent
    /// for every other operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_reason: Option<CloseReason>,
    /// A gRPC call's feature, from its method's `(flexway.v1.operation).ai` option
    /// (absent for HTTP calls and unmetered methods; records written before it read
    /// as absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature: Option<String>,
    /// Why the backend that served (or was tried last) was chosen (SPEC §5): its
    /// pool's pick (`weighted`, `least_loaded`, `latency`, `cache_affinity`), or
    /// `fallback` after the one chosen first did not serve. Absent for
    /// a backend outside any pool chosen first, and before any backend was tried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pick_reason: Option<PickReason>,
    /// The call's class (`Flexway-Criticality`, lowered to its caller's
    /// `max_criticality`); absent for calls refused before it was read, gRPC and REST
    /// calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criticality: Option<Criticality>,
    /// The UTC date (`YYYY-MM-DD`) the call was reserved on: its day and month
    /// budgets are that date's and that month's, and `flexway report` counts it on
    /// that date, so that a call reserved before midnight and ended after it is in
    /// one period in the ledger and in the report. Absent for a call refused before
    /// any reservation, and in records written before it existed (the report then
    /// uses the date of `ts`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<String>,
    /// The run the call named in `Flexway-Run` (SPEC §15), refused calls included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// The backends of the call's route passed over without a call, in order, and
    /// why (SPEC §14): an open breaker, a provider quota reached. Absent when none was.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<Skipped>,
    /// What the response cache did for the call (SPEC §16); absent when no cache
    /// policy applies to the model it asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheOutcome>,
    /// A hit's cosine similarity to the entry it was served (1 for an exact match).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_similarity: Option<f64>,
    /// A hit's entry's age, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_age_s: Option<u64>,
    /// A hit's saving: what the call that produced its entry cost, euros as a number
    /// (from `cost_saved_micro_eur`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_saved_eur: Option<f64>,
    /// The same saving, exact, in integer micro-euros.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_saved_micro_eur: Option<u64>,
    /// A tool call's (`operation: mcp`, SPEC §17) server, as `mcp.servers` names it.
    /// Absent for every other operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp_server: Option<String>,
    /// A tool call's tool, by its name on its server (never its arguments or result).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// How a tool call ended: `ok`, `tool_error` (the tool ran and said it failed:
    /// charged) or `error` (no result: refunded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp_status: Option<McpStatus>,
    /// With `audit.chain_key`: `{writer}:{seq}:{mac}`, the record's place in its
    /// writer's sequence and its HMAC-SHA256 over the record before (see
    /// `flexway report --verify`). Always the last field. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain: Option<String>,
}

/// A backend of the call's route passed over without a call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Skipped {
    pub backend: String,
    pub cause: SkipCause,
}

/// What the response cache did for a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
pub enum CacheOutcome {
    /// Served from the cache: no backend was called.
    Hit,
    /// Looked up, not found (or a failing store): the backends answered, and the
    /// answer was not kept (incomplete, `no-store`, ...).
    Miss,
    /// Not found, and the backend's answer was kept.
    Stored,
    /// Neither read nor written: a sensitive call, `Cache-Control: no-cache, no-store`,
    /// or a request the cache cannot hold (several choices, a last message that is not
    /// the user's).
    Bypass,
    /// The caller's tenant or agent has `cache: off`.
    Off,
}

/// How a tool call ended (`operation: mcp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
pub enum McpStatus {
    /// The tool answered with a result.
    Ok,
    /// The tool answered with a result that says it failed (`isError: true`): it ran.
    ToolError,
    /// No result: a JSON-RPC error, a transport failure, a timeout, a refusal.
    Error,
}

impl McpStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            McpStatus::Ok => "ok",
            McpStatus::ToolError => "tool_error",
            McpStatus::Error => "error",
        }
    }
}

/// Why a backend was passed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
pub enum SkipCause {
    /// Its circuit breaker was open (or its one half-open probe was out).
    CircuitOpen,
    /// Its provider quota (`quota`) was reached for the minute.
    Quota,
}

impl SkipCause {
    pub fn as_str(self) -> &'static str {
        match self {
            SkipCause::CircuitOpen => "circuit_open",
            SkipCause::Quota => "quota",
        }
    }
}

/// How a realtime session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
pub enum CloseReason {
    /// The client closed the session (or went away).
    ClientClosed,
    /// The backend closed the session with a close frame (relayed to the client).
    UpstreamClosed,
    /// The backend dropped the connection, or sent what is not a WebSocket message:
    /// the client's session is closed with 1011 `upstream_error`.
    UpstreamError,
    /// A hard budget cap was reached: closed with 4429 `budget_exceeded`.
    BudgetExceeded,
    /// A message over `ai.limits.max_event_bytes`, from either side: closed with 1009.
    MessageTooLarge,
    /// The gateway stopped (SIGTERM, Ctrl-C): closed with 1001.
    Shutdown,
    /// The gateway failed (the ledger could not reserve the next allowance): closed
    /// with 1011 `internal_error`.
    #[serde(rename = "internal_error")]
    Internal,
}

impl CloseReason {
    /// The code the session's record carries: none when a side closed it in the
    /// ordinary way.
    pub fn error_code(self) -> Option<ErrorCode> {
        match self {
            CloseReason::BudgetExceeded => Some(ErrorCode::BudgetExceeded),
            CloseReason::UpstreamError => Some(ErrorCode::UpstreamError),
            CloseReason::MessageTooLarge => Some(ErrorCode::MessageTooLarge),
            CloseReason::Internal => Some(ErrorCode::InternalError),
            CloseReason::ClientClosed | CloseReason::UpstreamClosed | CloseReason::Shutdown => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::ClientClosed => "client_closed",
            CloseReason::UpstreamClosed => "upstream_closed",
            CloseReason::UpstreamError => "upstream_error",
            CloseReason::BudgetExceeded => "budget_exceeded",
            CloseReason::MessageTooLarge => "message_too_large",
            CloseReason::Shutdown => "shutdown",
            CloseReason::Internal => "internal_error",
        }
    }
}

pub use crate::call::{Criticality, ErrorCode, Operation, PickReason};

/// Whether the usage settled came from the backend or from Flexway's estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
#[schemars(inline)]
pub enum UsageSource {
    Reported,
    Estimated,
}

impl UsageSource {
    pub fn as_str(self) -> &'static str {
        match self {
            UsageSource::Reported => "reported",
            UsageSource::Estimated => "estimated",
        }
    }
}

/// Where the call left the tenant's budgets: within them, past a soft limit, or
/// refused for a hard one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
#[schemars(inline)]
pub enum BudgetState {
    Ok,
    Soft,
    Exceeded,
}

impl BudgetState {
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetState::Ok => "ok",
            BudgetState::Soft => "soft",
            BudgetState::Exceeded => "exceeded",
        }
    }
}

/// The JSON Schema of [`AuditRecord`], as published in `config/audit-record.schema.json`.
pub fn record_schema() -> serde_json::Value {
    schemars::schema_for!(AuditRecord).to_value()
}

impl AuditRecord {
    pub fn cost(&self) -> MicroEur {
        MicroEur(self.cost_micro_eur)
    }

    /// The record's `status`, saying which kind it is.
    pub fn call_status(&self) -> CallStatus {
        match self.operation {
            Operation::Grpc => CallStatus::Grpc(self.status),
            _ => CallStatus::Http(self.status),
        }
    }
}

/// A call's status: an HTTP status, or a gRPC call's status code. The record keeps
/// one number (`status`); its `operation` says which it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallStatus {
    Http(u16),
    Grpc(u16),
}

/// Salted SHA-256, hex: how identifiers enter the audit.
#[derive(Clone)]
pub struct Hasher {
    salt: Vec<u8>,
    /// The hashes of the configured keys (by their SHA-256), computed once: every
    /// call's record names its key, and SHA-256 in software is ~3,000 instructions.
    keys: foldhash::HashMap<[u8; 32], String>,
}

impl std::fmt::Debug for Hasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hasher(salt: ***)")
    }
}

impl Hasher {
    pub fn new(salt: &[u8]) -> Self {
        Hasher { salt: salt.to_vec(), keys: Default::default() }
    }

    /// A hasher that knows the hashes of these keys (their SHA-256s) ahead.
    pub fn with_keys<'a>(salt: &[u8], keys: impl IntoIterator<Item = &'a [u8; 32]>) -> Self {
        let mut hasher = Hasher::new(salt);
        hasher.keys = keys.into_iter().map(|key| (*key, hasher.hash(key))).collect();
        hasher
    }

    /// The same salt, with `keys`' hashes computed ahead (a reloaded configuration's).
    pub fn rekeyed<'a>(&self, keys: impl IntoIterator<Item = &'a [u8; 32]>) -> Hasher {
        Hasher::with_keys(&self.salt, keys)
    }

    /// The hash of a key, from its SHA-256: `hash(key_sha256)`, computed ahead for the
    /// configured keys.
    pub fn hash_key(&self, key_sha256: &[u8; 32]) -> String {
        self.keys.get(key_sha256).cloned().unwrap_or_else(|| self.hash(key_sha256))
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

    /// Whether records land in the order `write` is called, so that a reader finds
    /// them in that order (a file, stdout). A sink whose concurrent writes may land in
    /// either order (a network put) says no: the chain then does not hold writes one
    /// at a time for it, and its reader orders each writer's records by `chain`.
    fn ordered(&self) -> bool {
        true
    }

    /// Whether `write` may wait (for a lock, the network) rather than end in the poll
    /// that starts it. A server cancels a call wherever it waits when its client
    /// leaves; a record for a sink that waits is therefore written from a task of its
    /// own, which nothing cancels, so that no record is lost or left half-written.
    fn waits(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_hash_computed_ahead_is_the_salted_hash_of_its_sha256() {
        let known = [7u8; 32];
        let unknown = [9u8; 32];
        let hasher = Hasher::with_keys(b"salt", [&known]);
        let plain = Hasher::new(b"salt");
        assert_eq!(hasher.hash_key(&known), plain.hash(&known));
        assert_eq!(hasher.hash_key(&unknown), plain.hash(&unknown));
        assert_ne!(hasher.hash_key(&known), Hasher::with_keys(b"other", [&known]).hash_key(&known), "salted");
        assert_eq!(plain.hash(&known).len(), 64);
    }

    fn record() -> AuditRecord {
        AuditRecord {
            schema_version: SCHEMA_VERSION,
            ts: "2026-11-29T15:44:30.007Z".parse().unwrap(),
            request_id: "req-1".into(),
            tenant: "acme".into(),
            agent: Some("bot".into()),
            operation: Operation::Embeddings,
            capability: Capability::Vision,
            model_requested: Some("chat-default".into()),
            model_served: Some("gpt-4.1".into()),
            backend: Some("peer".into()),
            metered_by: Metering::Upstream,
            prompt_tokens: 12,
            completion_tokens: 34,
            cached_tokens: None,
            cache_write_tokens: None,
            usage_source: UsageSource::Estimated,
            cost_eur: 0.000_296,
            cost_micro_eur: 296,
            charged: None,
            status: 429,
            error_code: Some(ErrorCode::BudgetExceeded),
            degraded: true,
            budget_state: BudgetState::Exceeded,
            latency_ms: 120,
            ttfb_ms: None,
            key_hash: "ab".repeat(2),
            user_hash: None,
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

    /// Finance reads these lines: the enums write the strings the fields held before.
    #[test]
    fn a_record_serializes_to_the_same_line_as_before() {
        let line = serde_json::to_string(&record()).unwrap();
        assert_eq!(
            line,
            r#"{"schema_version":1,"ts":"2026-11-29T15:44:30.007Z","request_id":"req-1","tenant":"acme","agent":"bot","operation":"embeddings","capability":"vision","model_requested":"chat-default","model_served":"gpt-4.1","backend":"peer","metered_by":"upstream","prompt_tokens":12,"completion_tokens":34,"usage_source":"estimated","cost_eur":0.000296,"cost_micro_eur":296,"status":429,"error_code":"budget_exceeded","degraded":true,"budget_state":"exceeded","latency_ms":120,"ttfb_ms":null,"key_hash":"abab","user_hash":null}"#
        );
        assert_eq!(serde_json::from_str::<AuditRecord>(&line).unwrap(), record());
    }

    /// `charged` follows the cost, present on every record written now, and reads
    /// back; an older line without it reads as `None`.
    #[test]
    fn charged_is_written_after_the_cost_and_read_back() {
        let mut charged = record();
        charged.charged = Some(false);
        let line = serde_json::to_string(&charged).unwrap();
        assert!(line.contains(r#""cost_micro_eur":296,"charged":false,"status":429"#), "{line}");
        assert_eq!(serde_json::from_str::<AuditRecord>(&line).unwrap(), charged);
        let older = serde_json::to_string(&record()).unwrap();
        assert!(!older.contains("charged"));
        assert_eq!(serde_json::from_str::<AuditRecord>(&older).unwrap().charged, None);
    }

    #[test]
    fn enum_fields_write_their_names_in_lowercase() {
        fn written(value: impl Serialize) -> String {
            serde_json::to_value(value).unwrap().as_str().unwrap().to_owned()
        }
        for operation in [Operation::Chat, Operation::Embeddings, Operation::Grpc] {
            assert_eq!(written(operation), operation.as_str());
        }
        for capability in [Capability::Chat, Capability::Vision, Capability::Embeddings] {
            assert_eq!(written(capability), capability.as_str());
        }
        for metering in [Metering::Local, Metering::Upstream] {
            assert_eq!(written(metering), metering.as_str());
        }
        for source in [UsageSource::Reported, UsageSource::Estimated] {
            assert_eq!(written(source), source.as_str());
        }
        for state in [BudgetState::Ok, BudgetState::Soft, BudgetState::Exceeded] {
            assert_eq!(written(state), state.as_str());
        }
        assert_eq!(
            [Operation::Grpc.as_str(), Capability::Embeddings.as_str(), Metering::Local.as_str()],
            ["grpc", "embeddings", "local"]
        );
        assert_eq!([UsageSource::Reported.as_str(), BudgetState::Soft.as_str()], ["reported", "soft"]);
        // A value the schema does not list is not an audit record.
        let unknown = serde_json::to_string(&record()).unwrap().replace("\"exceeded\"", "\"over\"");
        assert!(serde_json::from_str::<AuditRecord>(&unknown).is_err());
    }
}
