//! One error facade for the whole request path.
//!
//! Each module owns its error; `GatewayError` composes them and answers the three
//! questions the edge asks: which HTTP status, which SPEC code, and whether another
//! backend might do better (`is_retryable`, used by fallback). Rendering lives in
//! `http::error`, once.

use http::StatusCode;

use crate::config::BackendId;
use crate::identity::IdentityError;
use crate::protocol::openai::InvalidRequest;

/// Why no backend could serve (`Flexway-Error-Cause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnavailableCause {
    CircuitOpen,
    PoolExhausted,
    UpstreamFailed,
}

impl UnavailableCause {
    pub fn as_str(self) -> &'static str {
        match self {
            UnavailableCause::CircuitOpen => "circuit_open",
            UnavailableCause::PoolExhausted => "pool_exhausted",
            UnavailableCause::UpstreamFailed => "upstream_failed",
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
    #[error("request body is larger than {limit} bytes (ai.vision.max_body_bytes)")]
    BodyTooLarge { limit: u64 },
    #[error("an image is larger than {limit} bytes (ai.vision.max_image_bytes)")]
    ImageTooLarge { limit: u64 },
    #[error(
        "the request headers are too large: the gateway reads at most {max_headers} headers of {max_bytes} bytes in all"
    )]
    HeadersTooLarge { max_headers: usize, max_bytes: usize },
    #[error("budget exceeded: {budget}; it resets in {retry_after_secs} s")]
    BudgetExceeded { budget: String, retry_after_secs: u64 },
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
    #[error("backend `{backend}` timed out; {attempts}")]
    UpstreamTimeout { backend: BackendId, attempts: Attempts },
    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
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

impl From<crate::budget::StoreError> for GatewayError {
    fn from(e: crate::budget::StoreError) -> Self {
        match e {
            crate::budget::StoreError::Busy(detail) => {
                tracing::warn!("{detail}");
                GatewayError::LedgerBusy
            }
            other => GatewayError::Internal(other.to_string()),
        }
    }
}

impl GatewayError {
    pub fn status(&self) -> StatusCode {
        match self {
            GatewayError::InvalidRequest(_)
            | GatewayError::CapabilityUnavailable { .. }
            | GatewayError::ImageOriginNotAllowed { .. } => StatusCode::BAD_REQUEST,
            GatewayError::Identity(IdentityError::MissingKey | IdentityError::UnknownKey) => StatusCode::UNAUTHORIZED,
            GatewayError::Identity(_) | GatewayError::SensitiveNoInternalBackend => StatusCode::FORBIDDEN,
            GatewayError::BodyTooLarge { .. } | GatewayError::ImageTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            GatewayError::BudgetExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::UpstreamError { .. } => StatusCode::BAD_GATEWAY,
            GatewayError::UpstreamUnavailable { .. } | GatewayError::LedgerBusy => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            GatewayError::NotFound { .. } => StatusCode::NOT_FOUND,
            GatewayError::RealtimeUnavailable => StatusCode::NOT_IMPLEMENTED,
            GatewayError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            GatewayError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The SPEC's error code (also the low-cardinality label for metrics).
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::InvalidRequest(_) => "invalid_request",
            GatewayError::Identity(IdentityError::MissingKey | IdentityError::UnknownKey) => "invalid_api_key",
            GatewayError::Identity(IdentityError::UnknownTenant { .. }) => "unknown_tenant",
            GatewayError::Identity(IdentityError::UnreadableTenant) => "unknown_tenant",
            GatewayError::Identity(_) => "unknown_agent",
            GatewayError::CapabilityUnavailable { .. } => "capability_unavailable",
            GatewayError::ImageOriginNotAllowed { .. } => "image_origin_not_allowed",
            GatewayError::SensitiveNoInternalBackend => "sensitive_no_internal_backend",
            GatewayError::BodyTooLarge { .. } => "body_too_large",
            GatewayError::ImageTooLarge { .. } => "image_too_large",
            GatewayError::HeadersTooLarge { .. } => "headers_too_large",
            GatewayError::BudgetExceeded { .. } => "budget_exceeded",
            GatewayError::UpstreamError { .. } => "upstream_error",
            GatewayError::UpstreamUnavailable { .. } => "upstream_unavailable",
            GatewayError::UpstreamTimeout { .. } => "upstream_timeout",
            GatewayError::NotFound { .. } => "not_found",
            GatewayError::RealtimeUnavailable => "realtime_unavailable",
            GatewayError::MethodNotAllowed { .. } => "method_not_allowed",
            GatewayError::LedgerBusy => "ledger_busy",
            GatewayError::Internal(_) => "internal_error",
        }
    }

    /// The OpenAI error `type` for this status, as OpenAI's own API uses them.
    pub fn openai_type(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "insufficient_quota",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        }
    }

    pub fn param(&self) -> Option<&'static str> {
        match self {
            GatewayError::InvalidRequest(e) => e.param,
            _ => None,
        }
    }

    /// Whether another backend could succeed where this one failed (fallback).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            GatewayError::UpstreamError { .. }
                | GatewayError::UpstreamUnavailable { .. }
                | GatewayError::UpstreamTimeout { .. }
        )
    }

    /// Response headers this error carries besides the envelope.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        match self {
            GatewayError::BudgetExceeded { retry_after_secs, .. } => {
                vec![("retry-after", retry_after_secs.to_string())]
            }
            GatewayError::LedgerBusy => vec![("retry-after", "1".to_owned())],
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

    #[test]
    fn a_contended_ledger_is_a_503_to_retry_and_a_broken_one_names_nothing_of_aws() {
        let busy = GatewayError::from(crate::budget::StoreError::Busy("TransactionConflict on acme".into()));
        assert_eq!((busy.status(), busy.code()), (StatusCode::SERVICE_UNAVAILABLE, "ledger_busy"));
        assert_eq!(busy.headers(), [("retry-after", "1".to_owned())]);
        assert!(!busy.to_string().contains("acme"), "{busy}");
        let arn = "User: arn:aws:sts::123456789012:assumed-role/gw is not authorized on table/ledger";
        let broken = GatewayError::from(crate::budget::StoreError::Backend(arn.into()));
        assert_eq!((broken.status(), broken.code()), (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"));
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
        assert_eq!(err.code(), "upstream_unavailable");
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
        assert_eq!((missing.status().as_u16(), missing.code()), (401, "invalid_api_key"));
        let agent = GatewayError::from(IdentityError::UnknownAgent { agent: "x".into() });
        assert_eq!((agent.status().as_u16(), agent.code()), (403, "unknown_agent"));
        for refused in
            [IdentityError::UnreadableAgent, IdentityError::AmbiguousAgent { first: "a".into(), other: "b".into() }]
        {
            let refused = GatewayError::from(refused);
            assert_eq!((refused.status().as_u16(), refused.code()), (403, "unknown_agent"));
        }
        for refused in [IdentityError::UnknownTenant { tenant: "t".into() }, IdentityError::UnreadableTenant] {
            let refused = GatewayError::from(refused);
            assert_eq!((refused.status().as_u16(), refused.code()), (403, "unknown_tenant"));
        }
    }
}
