//! Errors become responses here, once: the OpenAI envelope under `/v1/*`, RFC 9457
//! problem details everywhere else. Each error is logged once, at this point.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, header};
use serde_json::json;

use crate::call::ErrorCode;
use crate::error::{GatewayError, INTERNAL_MESSAGE};
use crate::protocol::messages;
use crate::protocol::openai::error_envelope;

/// An error on an OpenAI route: rendered as the OpenAI envelope.
#[derive(Debug)]
pub struct ApiError(pub GatewayError);

impl<E: Into<GatewayError>> From<E> for ApiError {
    fn from(e: E) -> Self {
        ApiError(e.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        render(&self.0, true)
    }
}

pub fn render(error: &GatewayError, openai: bool) -> Response {
    render_in(error, if openai { Envelope::OpenAi } else { Envelope::Problem })
}

/// The shape an error is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Envelope {
    /// `{"error": {"message", "type", "param", "code"}}`, under `/v1/*`.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}` on the Anthropic Messages
    /// door (SPEC §2.2): the gateway's code leads the message.
    Anthropic,
    /// RFC 9457 problem details, everywhere else.
    Problem,
}

/// The OpenAI error `type` of a refusal's status, as OpenAI's own API uses them.
fn openai_type(status: http::StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "insufficient_quota",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

pub fn render_in(error: &GatewayError, envelope: Envelope) -> Response {
    let status = error.status();
    let code: ErrorCode = error.code();
    if status.is_server_error() {
        tracing::warn!(code = code.as_str(), status = status.as_u16(), "{error}");
    } else {
        tracing::debug!(code = code.as_str(), status = status.as_u16(), "{error}");
    }
    let message = match error {
        GatewayError::Internal(_) => INTERNAL_MESSAGE.to_owned(),
        _ => error.to_string(),
    };
    let (body, content_type) = if envelope == Envelope::OpenAi {
        // A per-minute limit's `type` says which window refused, as OpenAI's does (a
        // provider quota's too).
        let kind = match error {
            GatewayError::RateLimited { kind, .. } | GatewayError::BackendQuota { kind, .. } => kind.as_str(),
            _ => openai_type(status),
        };
        (error_envelope(&message, kind, code.as_str(), error.param()), "application/json")
    } else if envelope == Envelope::Anthropic {
        let message = format!("{code}: {message}");
        (messages::error_envelope(messages::error_type(status.as_u16()), &message), "application/json")
    } else {
        let problem = json!({
            "type": format!("https://flexway.dev/errors/{code}"),
            "title": status.canonical_reason().unwrap_or("Error"),
            "status": status.as_u16(),
            "detail": message,
            "code": code.as_str(),
        });
        (problem, "application/problem+json")
    };
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    for (name, value) in error.headers() {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    }
    response
}
