//! The vocabulary of one call, at the bottom of the crate: every other module may use
//! it, and it uses none of them. What a call is named by (`RequestId`), what it
//! consumed (`Usage`), why it was refused (`InvalidRequest`, `ErrorCode`), the door it
//! came by (`Operation`), and the names of the headers the gateway writes.
//!
//! `ErrorCode` is the one list of codes the gateway writes anywhere: a refusal's
//! envelope, a stream's in-band error event, a gRPC status message, a WebSocket close
//! reason, and the audit record's `error_code`. Each envelope maps it once, in the
//! module that writes that envelope (`http::error`, `protocol::grpc`,
//! `audit::CloseReason`).

use http::StatusCode;
use serde::{Deserialize, Serialize};

/// Header names the gateway writes on its answers.
pub mod headers {
    /// The id of the call, on every answer.
    pub const REQUEST_ID: &str = "flexway-request-id";
    /// The backend that served (for a pool, the member).
    pub const BACKEND: &str = "flexway-backend";
    /// `backend-fallback` when a fallback served.
    pub const DEGRADED: &str = "flexway-degraded";
    /// `soft` once the soft cap is reached.
    pub const BUDGET: &str = "flexway-budget";
    /// The settled cost of a non-streamed answer, in euros (`0.000123`); a stream's is
    /// only known after its last byte, so only its audit record says it.
    pub const COST: &str = "flexway-cost-eur";
    /// What the gateway's own HTTP clients call themselves.
    pub const USER_AGENT: &str = concat!("flexway/", env!("CARGO_PKG_VERSION"));
    /// Request headers that carry a caller's credential: never passed on to a
    /// backend, by any door.
    pub const CREDENTIALS: [&str; 4] = ["authorization", "proxy-authorization", "x-api-key", "cookie"];
}

/// The id of one request, returned as `Flexway-Request-Id` and used by the ledger
/// and the audit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(pub String);

impl RequestId {
    /// `req_` and a random (v4) UUID, from the thread's own generator (ChaCha,
    /// seeded from the OS once): `Uuid::new_v4` asks the kernel each time, a
    /// `getrandom` system call a request.
    pub fn generate() -> Self {
        let uuid = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
        RequestId(format!("req_{}", uuid.simple()))
    }
}

/// Token usage as a backend reports it. `prompt_tokens` counts every prompt token;
/// those the provider read from its prompt cache (`cached_tokens`) and wrote to it
/// (`cache_write_tokens`) are among them, priced apart (SPEC §3 "Price").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub cache_write_tokens: u64,
}

impl Usage {
    /// Prompt and completion tokens, nothing from a prompt cache.
    pub const fn new(prompt_tokens: u64, completion_tokens: u64) -> Usage {
        Usage { prompt_tokens, completion_tokens, cached_tokens: 0, cache_write_tokens: 0 }
    }

    pub fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// A refused request: a message and the offending parameter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidRequest {
    pub message: String,
    pub param: Option<&'static str>,
}

/// The longest `model` a caller may send (SPEC §2): the audit keeps it, and no call
/// may make a record that a log store cuts or a report cannot read.
pub const MAX_MODEL_BYTES: usize = 256;
/// The longest `user` a caller may send (SPEC §2; the audit keeps its salted hash,
/// the backend gets it as sent).
pub const MAX_USER_BYTES: usize = 1024;

impl InvalidRequest {
    /// A refusal of the request as a whole (no one parameter at fault).
    pub fn message(message: String) -> InvalidRequest {
        InvalidRequest { message, param: None }
    }

    /// Refuses a caller's `text` (its `param`: a model name, a user) over `max` bytes.
    pub fn check_bounded(param: &'static str, text: &str, max: usize) -> Result<(), InvalidRequest> {
        if text.len() > max {
            return Err(InvalidRequest {
                message: format!("`{param}` is {} bytes; the gateway takes at most {max}", text.len()),
                param: Some(param),
            });
        }
        Ok(())
    }
}

/// The door a call came in by (`realtime`: a WebSocket session, one record for the
/// whole session).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
#[schemars(inline)]
pub enum Operation {
    Chat,
    Embeddings,
    Grpc,
    Realtime,
    // A chat call that came in by the Responses API (SPEC §2.1), or by the Anthropic
    // Messages API (§2.2). Plain comments: doc comments would split the schema's enum.
    Responses,
    Messages,
    // A REST operation of a `kind: http` backend's contract (SPEC §10).
    Http,
    // A `tools/call` through `/mcp` (SPEC §17).
    Mcp,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Chat => "chat",
            Operation::Embeddings => "embeddings",
            Operation::Grpc => "grpc",
            Operation::Realtime => "realtime",
            Operation::Responses => "responses",
            Operation::Messages => "messages",
            Operation::Http => "http",
            Operation::Mcp => "mcp",
        }
    }
}

/// A call's class when the model servers of a pool are saturated (SPEC §5), from
/// `Flexway-Criticality`, lowered to its tenant's and agent's `max_criticality`.
/// Ordered: `Sheddable` < `Standard` < `Critical`.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
#[schemars(inline)]
pub enum Criticality {
    Sheddable,
    #[default]
    Standard,
    Critical,
}

impl Criticality {
    /// The request header that asks for a class.
    pub const HEADER: &str = "flexway-criticality";
    pub const ALL: [Criticality; 3] = [Criticality::Sheddable, Criticality::Standard, Criticality::Critical];

    pub fn as_str(self) -> &'static str {
        match self {
            Criticality::Sheddable => "sheddable",
            Criticality::Standard => "standard",
            Criticality::Critical => "critical",
        }
    }

    /// The class the call asks for: `standard` without the header; a value that is
    /// not one of the three (any case), or two values that differ, is refused.
    pub fn asked(headers: &http::HeaderMap) -> Result<Criticality, InvalidRequest> {
        let mut asked = None;
        for value in headers.get_all(Self::HEADER) {
            let text = value.to_str().unwrap_or_default().trim().to_ascii_lowercase();
            let class = match text.as_str() {
                "critical" => Criticality::Critical,
                "standard" => Criticality::Standard,
                "sheddable" => Criticality::Sheddable,
                _ => {
                    return Err(InvalidRequest {
                        message: "Flexway-Criticality must be one of critical, standard, sheddable".into(),
                        param: None,
                    });
                }
            };
            if asked.is_some_and(|a| a != class) {
                return Err(InvalidRequest {
                    message: "Flexway-Criticality is sent twice with different classes".into(),
                    param: None,
                });
            }
            asked = Some(class);
        }
        Ok(asked.unwrap_or_default())
    }
}

/// Why the backend that served was chosen (SPEC §5, the audit's `pick_reason`): the
/// pick of its pool (`picker`: the first endpoint an inference pool's picker named),
/// or `fallback` when it served after the one picked first did not. Absent for a call
/// to a backend that is not in a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
pub enum PickReason {
    Weighted,
    LeastLoaded,
    Latency,
    CacheAffinity,
    Picker,
    Fallback,
}

impl PickReason {
    pub const ALL: [PickReason; 6] = [
        PickReason::Weighted,
        PickReason::LeastLoaded,
        PickReason::Latency,
        PickReason::CacheAffinity,
        PickReason::Picker,
        PickReason::Fallback,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PickReason::Weighted => "weighted",
            PickReason::LeastLoaded => "least_loaded",
            PickReason::Latency => "latency",
            PickReason::CacheAffinity => "cache_affinity",
            PickReason::Picker => "picker",
            PickReason::Fallback => "fallback",
        }
    }
}

/// Every code the gateway writes (SPEC §2's table, and the codes of a call that
/// ended after its answer began). Plain comments on the variants: doc comments would
/// split the schema's enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
pub enum ErrorCode {
    // Refusals, before a byte of an answer: each is an HTTP status of its own.
    InvalidRequest,
    CapabilityUnavailable,
    ImageOriginNotAllowed,
    InvalidApiKey,
    UnknownAgent,
    UnknownTenant,
    SensitiveNoInternalBackend,
    ResidencyUnavailable,
    NotFound,
    // A path under a REST mount that its contract does not declare.
    OperationNotFound,
    MethodNotAllowed,
    BodyTooLarge,
    ImageTooLarge,
    HeadersTooLarge,
    BudgetExceeded,
    RateLimitExceeded,
    RunNotFound,
    RunEnded,
    RealtimeUnavailable,
    LedgerBusy,
    InternalError,
    UpstreamError,
    UpstreamUnavailable,
    Overloaded,
    UpstreamTimeout,
    // gRPC: no backend declares the service or method.
    UnknownService,
    // A call that ended after its answer began: a stream cut before the platform's
    // deadline, a client gone (HTTP's 499, gRPC's CANCELLED), a realtime message over
    // the limit.
    Deadline,
    ClientClosedRequest,
    Cancelled,
    MessageTooLarge,
}

impl ErrorCode {
    /// Every code, in the order of SPEC §2's table and then the others.
    pub const ALL: [ErrorCode; 30] = [
        ErrorCode::InvalidRequest,
        ErrorCode::CapabilityUnavailable,
        ErrorCode::ImageOriginNotAllowed,
        ErrorCode::InvalidApiKey,
        ErrorCode::UnknownAgent,
        ErrorCode::UnknownTenant,
        ErrorCode::SensitiveNoInternalBackend,
        ErrorCode::ResidencyUnavailable,
        ErrorCode::NotFound,
        ErrorCode::OperationNotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::BodyTooLarge,
        ErrorCode::ImageTooLarge,
        ErrorCode::HeadersTooLarge,
        ErrorCode::BudgetExceeded,
        ErrorCode::RateLimitExceeded,
        ErrorCode::RunNotFound,
        ErrorCode::RunEnded,
        ErrorCode::RealtimeUnavailable,
        ErrorCode::LedgerBusy,
        ErrorCode::InternalError,
        ErrorCode::UpstreamError,
        ErrorCode::UpstreamUnavailable,
        ErrorCode::Overloaded,
        ErrorCode::UpstreamTimeout,
        ErrorCode::UnknownService,
        ErrorCode::Deadline,
        ErrorCode::ClientClosedRequest,
        ErrorCode::Cancelled,
        ErrorCode::MessageTooLarge,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::CapabilityUnavailable => "capability_unavailable",
            ErrorCode::ImageOriginNotAllowed => "image_origin_not_allowed",
            ErrorCode::InvalidApiKey => "invalid_api_key",
            ErrorCode::UnknownAgent => "unknown_agent",
            ErrorCode::UnknownTenant => "unknown_tenant",
            ErrorCode::SensitiveNoInternalBackend => "sensitive_no_internal_backend",
            ErrorCode::ResidencyUnavailable => "residency_unavailable",
            ErrorCode::NotFound => "not_found",
            ErrorCode::OperationNotFound => "operation_not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::ImageTooLarge => "image_too_large",
            ErrorCode::HeadersTooLarge => "headers_too_large",
            ErrorCode::BudgetExceeded => "budget_exceeded",
            ErrorCode::RateLimitExceeded => "rate_limit_exceeded",
            ErrorCode::RunNotFound => "run_not_found",
            ErrorCode::RunEnded => "run_ended",
            ErrorCode::RealtimeUnavailable => "realtime_unavailable",
            ErrorCode::LedgerBusy => "ledger_busy",
            ErrorCode::InternalError => "internal_error",
            ErrorCode::UpstreamError => "upstream_error",
            ErrorCode::UpstreamUnavailable => "upstream_unavailable",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::UpstreamTimeout => "upstream_timeout",
            ErrorCode::UnknownService => "unknown_service",
            ErrorCode::Deadline => "deadline",
            ErrorCode::ClientClosedRequest => "client_closed_request",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::MessageTooLarge => "message_too_large",
        }
    }

    /// The HTTP status of a refusal with this code; `None` for the codes that are
    /// never an HTTP refusal (they end a call whose answer began, or another
    /// transport's).
    pub fn refusal_status(self) -> Option<StatusCode> {
        Some(match self {
            ErrorCode::InvalidRequest | ErrorCode::CapabilityUnavailable | ErrorCode::ImageOriginNotAllowed => {
                StatusCode::BAD_REQUEST
            }
            ErrorCode::InvalidApiKey => StatusCode::UNAUTHORIZED,
            ErrorCode::UnknownAgent
            | ErrorCode::UnknownTenant
            | ErrorCode::SensitiveNoInternalBackend
            | ErrorCode::ResidencyUnavailable => StatusCode::FORBIDDEN,
            ErrorCode::NotFound | ErrorCode::OperationNotFound => StatusCode::NOT_FOUND,
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::BodyTooLarge | ErrorCode::ImageTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ErrorCode::BudgetExceeded | ErrorCode::RateLimitExceeded => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::RunNotFound => StatusCode::NOT_FOUND,
            ErrorCode::RunEnded => StatusCode::CONFLICT,
            ErrorCode::RealtimeUnavailable => StatusCode::NOT_IMPLEMENTED,
            ErrorCode::LedgerBusy | ErrorCode::UpstreamUnavailable | ErrorCode::Overloaded => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ErrorCode::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::UpstreamError => StatusCode::BAD_GATEWAY,
            ErrorCode::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorCode::UnknownService
            | ErrorCode::Deadline
            | ErrorCode::ClientClosedRequest
            | ErrorCode::Cancelled
            | ErrorCode::MessageTooLarge => return None,
        })
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_is_written_as_serde_writes_it_and_read_back() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
            assert!(seen.insert(code.as_str()), "{code} twice");
        }
        // ALL holds every variant: the schema lists them all.
        let schema = schemars::schema_for!(ErrorCode).to_value();
        assert_eq!(schema["enum"].as_array().map(Vec::len), Some(ErrorCode::ALL.len()), "{schema}");
    }
}

/// Why a caller could not be identified (SPEC §9): the identity phase's refusals.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error("missing API key: send `Authorization: Bearer <key>`")]
    MissingKey,
    #[error("invalid API key")]
    UnknownKey,
    #[error("agent `{agent}` is not declared for this tenant")]
    UnknownAgent { agent: String },
    #[error("this key is bound to agent `{bound}`; the Flexway-Agent header cannot re-bind it to `{asked}`")]
    AgentRebind { bound: String, asked: String },
    #[error("the Flexway-Agent header must name an agent in readable text (UTF-8, no control characters)")]
    UnreadableAgent,
    #[error("the Flexway-Agent header appears more than once with different values (`{first}`, `{other}`)")]
    AmbiguousAgent { first: String, other: String },
    #[error("tenant `{tenant}` asserted by the relay peer is not declared here")]
    UnknownTenant { tenant: String },
    #[error(
        "the Flexway-Tenant header from a relay peer must name one tenant in readable text (UTF-8, no control characters)"
    )]
    UnreadableTenant,
}

/// What a per-minute window counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rate {
    Requests,
    Tokens,
}

impl Rate {
    /// OpenAI's error `type` for it, and the `x-ratelimit-*` suffix.
    pub fn as_str(self) -> &'static str {
        match self {
            Rate::Requests => "requests",
            Rate::Tokens => "tokens",
        }
    }

    /// Its config key, and `Flexway-Error-Cause` when it refuses.
    pub fn cause(self) -> &'static str {
        match self {
            Rate::Requests => "requests_per_minute",
            Rate::Tokens => "tokens_per_minute",
        }
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.cause())
    }
}
