//! One error facade for the whole request path.
//!
//! Each module owns its error; `GatewayError` composes them and answers what the edge
//! asks: which SPEC code (`ErrorCode`, which gives the HTTP status), which message,
//! which headers. Rendering lives in each envelope's module, once.

use http::StatusCode;

use crate::call::{ErrorCode, IdentityError, InvalidRequest};
use crate::config::BackendId;

/// Why no backend could serve (`Flexway-Error-Cause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnavailableCause {
    CircuitOpen,
    PoolExhausted,
    UpstreamFailed,
    /// An inference pool's endpoint picker could not answer (`fail_close`).
    PickerUnavailable,
}

impl UnavailableCause {
    pub fn as_str(self) -> &'static str {
        match self {
            UnavailableCause::CircuitOpen => "circuit_open",
            UnavailableCause::PoolExhausted => "pool_exhausted",
            UnavailableCause::UpstreamFailed => "upstream_failed",
            UnavailableCause::PickerUnavailable => "picker_unavailable",
        }
    }
}

fn or_none(backends: &[BackendId]) -> String {
    if backends.is_empty() { "none".to_owned() } else { names(backends) }
}

fn names(backends: &[BackendId]) -> String {
    let names: Vec<&str> = backends.iter().map(BackendId::as_str).collect();
    names.join(", ")
}

/// The backends a call went through before it failed: every error after routing names
/// them, so a consuming team can act without a ticket.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attempts {
    /// Backends called, in order.
    pub tried: Vec<BackendId>,
    /// Backends skipped because their breaker was open.
    pub skipped: Vec<BackendId>,
}

impl std::fmt::Display for Attempts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tried: {}; skipped for an open circuit: {}", or_none(&self.tried), or_none(&self.skipped))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    InvalidRequest(#[from] InvalidRequest),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error("no backend reachable by this caller serves the `{capability}` capability")]
    CapabilityUnavailable { capability: &'static str },
    #[error(
        "image URL origin `{origin}` is not allowed: remote images must be under a declared https origin (ai.vision.allowed_origins)"
    )]
    ImageOriginNotAllowed { origin: String },
    #[error("this request is marked sensitive and no internal backend can serve it")]
    SensitiveNoInternalBackend,
    #[error("no backend in the jurisdictions this call may be processed in ({allowed}) can serve it")]
    ResidencyUnavailable { allowed: String },
    #[error("request body is larger than {limit} bytes (ai.vision.max_body_bytes)")]
    BodyTooLarge { limit: u64 },
    #[error("an image is larger than {limit} bytes (ai.vision.max_image_bytes)")]
    ImageTooLarge { limit: u64 },
    #[error(
        "the request headers are too large: the gateway reads at most {max_headers} headers of {max_bytes} bytes in all"
    )]
    HeadersTooLarge { max_headers: usize, max_bytes: usize },
    /// A hard cap: a tenant's or agent's budget (`Retry-After` to its period's reset),
    /// or a run's (SPEC §15: `None`, it never resets).
    #[error(
        "budget exceeded: {budget}{}",
        .retry_after_secs.map(|s| format!("; it resets in {s} s")).unwrap_or_else(|| "; it does not reset".to_owned())
    )]
    BudgetExceeded { budget: String, retry_after_secs: Option<u64> },
    /// A per-minute limit (SPEC §14): `holder` names it (`tenant acme`, `agent acme/bot`,
    /// `key 9f86d081…`); the window ends in `retry_after_secs` (1–60).
    #[error("rate limit reached: {holder} {kind} ({limit}); retry in {retry_after_secs} s")]
    RateLimited { holder: String, kind: crate::call::Rate, limit: u64, retry_after_secs: u64 },
    /// Every candidate backend is at its provider quota (SPEC §14); `kind` is the rate
    /// that refused last (the OpenAI error's `type`).
    #[error(
        "every backend that could serve this call is at its provider quota ({backends}); retry in {retry_after_secs} s"
    )]
    BackendQuota { backends: String, kind: crate::call::Rate, retry_after_secs: u64 },
    /// A `Flexway-Run` that is not the caller's or does not exist: never says which.
    #[error("run `{run}` was not found")]
    RunNotFound { run: String },
    /// A run past its `expires_at`, or ended (by its own or an ancestor's `DELETE`).
    #[error("run `{run}` has ended ({why}): start another run")]
    RunEnded { run: String, why: &'static str },
    #[error("backend `{backend}` answered with an invalid response: {detail}; {attempts}")]
    UpstreamError { backend: BackendId, detail: String, attempts: Attempts },
    #[error(
        "no backend could serve this request ({}){}; {attempts}",
        cause.as_str(),
        .last_failure.as_ref().map(|f| format!(": {f}")).unwrap_or_default()
    )]
    UpstreamUnavailable {
        cause: UnavailableCause,
        attempts: Attempts,
        /// What the last backend tried said, when it is ours to fix and safe to show
        /// (a TLS failure: the certificate refused and why).
        last_failure: Option<String>,
    },
    /// A `sheddable` call while every member of the pool that would serve it is
    /// saturated (SPEC §5): refused before anything is sent or reserved.
    #[error("every model server of pool `{pool}` is saturated and this call is sheddable; retry in a second")]
    Overloaded { pool: BackendId },
    #[error("backend `{backend}` timed out; {attempts}")]
    UpstreamTimeout { backend: BackendId, attempts: Attempts },
    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    /// A path under a REST mount that its contract does not declare (SPEC §10).
    #[error("{method} {path}: the contract of backend `{backend}` declares no such operation")]
    OperationNotFound { method: String, path: String, backend: BackendId },
    /// A path the contract declares, with a method it does not: `Allow` lists those it does.
    #[error("{method} {path}: the contract of backend `{backend}` declares this path for {allow} only")]
    OperationMethodNotAllowed { method: String, path: String, backend: BackendId, allow: String },
    /// `GET /v1/realtime` in the serverless shape: a function URL holds no WebSocket.
    #[error(
        "realtime sessions (WebSocket, GET /v1/realtime) are not served by the serverless shape: a Lambda function \
         URL cannot hold a WebSocket; use a gateway run with `flexway serve`"
    )]
    RealtimeUnavailable,
    /// The budget ledger stayed contended past its retries.
    #[error("the budget ledger is busy; retry in a second")]
    LedgerBusy,
    /// The detail is for the log only: the client's message is [`INTERNAL_MESSAGE`]
    /// (a store's error can name a role, a table, an account).
    #[error("internal error: {0}")]
    Internal(String),
}

/// What a client reads of an internal error.
pub const INTERNAL_MESSAGE: &str =
    "internal error in the gateway; its log has the details under this call's Flexway-Request-Id";

impl GatewayError {
    /// The HTTP status of this refusal: its code's.
    pub fn status(&self) -> StatusCode {
        self.code().refusal_status().unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The SPEC's error code (also the low-cardinality label for metrics).
    pub fn code(&self) -> ErrorCode {
        match self {
            GatewayError::InvalidRequest(_) => ErrorCode::InvalidRequest,
            GatewayError::Identity(IdentityError::MissingKey | IdentityError::UnknownKey) => ErrorCode::InvalidApiKey,
            GatewayError::Identity(IdentityError::UnknownTenant { .. } | IdentityError::UnreadableTenant) => {
                ErrorCode::UnknownTenant
            }
            GatewayError::Identity(_) => ErrorCode::UnknownAgent,
            GatewayError::CapabilityUnavailable { .. } => ErrorCode::CapabilityUnavailable,
            GatewayError::ImageOriginNotAllowed { .. } => ErrorCode::ImageOriginNotAllowed,
            GatewayError::SensitiveNoInternalBackend => ErrorCode::SensitiveNoInternalBackend,
            GatewayError::ResidencyUnavailable { .. } => ErrorCode::ResidencyUnavailable,
            GatewayError::BodyTooLarge { .. } => ErrorCode::BodyTooLarge,
            GatewayError::ImageTooLarge { .. } => ErrorCode::ImageTooLarge,
            GatewayError::HeadersTooLarge { .. } => ErrorCode::HeadersTooLarge,
            GatewayError::BudgetExceeded { .. } => ErrorCode::BudgetExceeded,
            GatewayError::RateLimited { .. } | GatewayError::BackendQuota { .. } => ErrorCode::RateLimitExceeded,
            GatewayError::RunNotFound { .. } => ErrorCode::RunNotFound,
            GatewayError::RunEnded { .. } => ErrorCode::RunEnded,
            GatewayError::UpstreamError { .. } => ErrorCode::UpstreamError,
            GatewayError::UpstreamUnavailable { .. } => ErrorCode::UpstreamUnavailable,
            GatewayError::UpstreamTimeout { .. } => ErrorCode::UpstreamTimeout,
            GatewayError::Overloaded { .. } => ErrorCode::Overloaded,
            GatewayError::NotFound { .. } => ErrorCode::NotFound,
            GatewayError::RealtimeUnavailable => ErrorCode::RealtimeUnavailable,
            GatewayError::MethodNotAllowed { .. } | GatewayError::OperationMethodNotAllowed { .. } => {
                ErrorCode::MethodNotAllowed
            }
            GatewayError::OperationNotFound { .. } => ErrorCode::OperationNotFound,
            GatewayError::LedgerBusy => ErrorCode::LedgerBusy,
            GatewayError::Internal(_) => ErrorCode::InternalError,
        }
    }

    pub fn param(&self) -> Option<&'static str> {
        match self {
            GatewayError::InvalidRequest(e) => e.param,
            _ => None,
        }
    }

    /// Whether the same request may pass later (SPEC §14, `x-should-retry`): never
    /// for a 4xx (but a 408 and a rate limit, which pass once the window turns), and
    /// yes for a rate limit and an overload. `None`: said nothing (the SDKs decide).
    pub fn should_retry(&self) -> Option<bool> {
        match self {
            GatewayError::RateLimited { .. } | GatewayError::BackendQuota { .. } | GatewayError::Overloaded { .. } => {
                Some(true)
            }
            other if other.status().is_client_error() && other.status() != StatusCode::REQUEST_TIMEOUT => Some(false),
            _ => None,
        }
    }

    /// Response headers this error carries besides the envelope.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = self.own_headers();
        if let Some(retry) = self.should_retry() {
            headers.push(("x-should-retry", retry.to_string()));
        }
        headers
    }

    fn own_headers(&self) -> Vec<(&'static str, String)> {
        match self {
            GatewayError::BudgetExceeded { retry_after_secs, .. } => {
                retry_after_secs.iter().map(|s| ("retry-after", s.to_string())).collect()
            }
            GatewayError::RateLimited { kind, retry_after_secs, .. } => {
                vec![("retry-after", retry_after_secs.to_string()), ("flexway-error-cause", kind.cause().to_owned())]
            }
            GatewayError::BackendQuota { retry_after_secs, .. } => {
                vec![("retry-after", retry_after_secs.to_string()), ("flexway-error-cause", "backend_quota".to_owned())]
            }
            GatewayError::LedgerBusy => vec![("retry-after", "1".to_owned())],
            GatewayError::Overloaded { .. } => {
                vec![("flexway-error-cause", "saturated".to_owned()), ("retry-after", "1".to_owned())]
            }
            GatewayError::OperationMethodNotAllowed { allow, .. } => vec![("allow", allow.clone())],
            GatewayError::UpstreamUnavailable { cause, attempts, .. } => {
                let mut h = vec![("flexway-error-cause", cause.as_str().to_owned())];
                attempts.headers(&mut h);
                h
            }
            GatewayError::UpstreamTimeout { attempts, .. } | GatewayError::UpstreamError { attempts, .. } => {
                let mut h = Vec::new();
                attempts.headers(&mut h);
                h
            }
            _ => Vec::new(),
        }
    }

    /// The backends this error names, if it comes after routing.
    pub fn attempts(&self) -> Option<&Attempts> {
        match self {
            GatewayError::UpstreamUnavailable { attempts, .. }
            | GatewayError::UpstreamTimeout { attempts, .. }
            | GatewayError::UpstreamError { attempts, .. } => Some(attempts),
            _ => None,
        }
    }
}

impl Attempts {
    /// `Flexway-Backends-Tried` and `Flexway-Backends-Skipped`, when not empty.
    fn headers(&self, out: &mut Vec<(&'static str, String)>) {
        if !self.tried.is_empty() {
            out.push(("flexway-backends-tried", names(&self.tried)));
        }
        if !self.skipped.is_empty() {
            out.push(("flexway-backends-skipped", names(&self.skipped)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::vision::VisionError;

    #[test]
    fn a_contended_ledger_is_a_503_to_retry_and_a_broken_one_names_nothing_of_aws() {
        let busy = GatewayError::from(crate::budget::StoreError::Busy("TransactionConflict on acme".into()));
        assert_eq!((busy.status(), busy.code().as_str()), (StatusCode::SERVICE_UNAVAILABLE, "ledger_busy"));
        assert_eq!(busy.headers(), [("retry-after", "1".to_owned())]);
        assert!(!busy.to_string().contains("acme"), "{busy}");
        let arn = "User: arn:aws:sts::123456789012:assumed-role/gw is not authorized on table/ledger";
        let broken = GatewayError::from(crate::budget::StoreError::Backend(arn.into()));
        assert_eq!((broken.status(), broken.code().as_str()), (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"));
        let response = crate::http::render(&broken, true);
        let body =
            futures_util::FutureExt::now_or_never(axum::body::to_bytes(response.into_body(), 4096)).unwrap().unwrap();
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains(INTERNAL_MESSAGE) && !body.contains("arn:aws"), "{body}");
    }

    #[test]
    fn unavailable_names_cause_and_backends() {
        let err = GatewayError::UpstreamUnavailable {
            cause: UnavailableCause::UpstreamFailed,
            attempts: Attempts {
                tried: vec![BackendId::new("a"), BackendId::new("b")],
                skipped: vec![BackendId::new("c")],
            },
            last_failure: None,
        };
        assert!(err.to_string().contains("skipped for an open circuit: c"));
        assert_eq!(err.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(err.code().as_str(), "upstream_unavailable");
        assert!(err.to_string().contains("upstream_failed"));
        assert!(err.to_string().contains("a, b"));
        assert!(err.headers().contains(&("flexway-error-cause", "upstream_failed".to_owned())));
    }

    #[test]
    fn a_timeout_after_a_fallback_names_every_backend_tried() {
        let err = GatewayError::UpstreamTimeout {
            backend: BackendId::new("b"),
            attempts: Attempts { tried: vec![BackendId::new("a"), BackendId::new("b")], skipped: vec![] },
        };
        assert_eq!(err.status(), StatusCode::GATEWAY_TIMEOUT);
        assert!(err.to_string().contains("tried: a, b"), "{err}");
        assert_eq!(err.headers(), vec![("flexway-backends-tried", "a, b".to_owned())]);
    }

    #[test]
    fn identity_errors_map_to_spec_codes() {
        let missing = GatewayError::from(IdentityError::MissingKey);
        assert_eq!((missing.status().as_u16(), missing.code().as_str()), (401, "invalid_api_key"));
        let agent = GatewayError::from(IdentityError::UnknownAgent { agent: "x".into() });
        assert_eq!((agent.status().as_u16(), agent.code().as_str()), (403, "unknown_agent"));
        for refused in
            [IdentityError::UnreadableAgent, IdentityError::AmbiguousAgent { first: "a".into(), other: "b".into() }]
        {
            let refused = GatewayError::from(refused);
            assert_eq!((refused.status().as_u16(), refused.code().as_str()), (403, "unknown_agent"));
        }
        for refused in [IdentityError::UnknownTenant { tenant: "t".into() }, IdentityError::UnreadableTenant] {
            let refused = GatewayError::from(refused);
            assert_eq!((refused.status().as_u16(), refused.code().as_str()), (403, "unknown_tenant"));
        }
    }

    #[test]
    fn vision_errors_map_to_spec_codes() {
        let too_large = GatewayError::from(VisionError::TooLarge { limit: 8, size: 9 });
        assert_eq!((too_large.status().as_u16(), too_large.code().as_str()), (413, "image_too_large"));
        assert!(matches!(too_large, GatewayError::ImageTooLarge { limit: 8 }));

        let origin = GatewayError::from(VisionError::OriginNotAllowed { origin: "https://evil.net".to_owned() });
        assert_eq!((origin.status().as_u16(), origin.code().as_str()), (400, "image_origin_not_allowed"));
        assert!(origin.to_string().contains("https://evil.net"));

        let invalid = GatewayError::from(VisionError::Invalid("bad image".to_owned()));
        assert_eq!((invalid.status().as_u16(), invalid.code().as_str()), (400, "invalid_request"));
        assert_eq!(invalid.param(), Some("messages"));
        assert_eq!(invalid.to_string(), "bad image");
    }
}
