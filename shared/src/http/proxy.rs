//! The inference handlers: authenticate → parse and measure → route → dispatch (with
//! fallback, before the first byte only) → relay.
//!
//! Fallback happens on a connection error, a 5xx or a timeout, never on a 4xx: a
//! backend's own 4xx (its 429 included) is the caller's answer and is relayed as is.

use std::sync::Arc;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};

use super::RequestId;
use super::error::ApiError;
use super::relay;
use crate::admission::{Admission, Demand, admit};
use crate::budget::plan;
use crate::config::{BackendId, Capability, Endpoint};
use crate::error::{GatewayError, UnavailableCause};
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::money::MicroEur;
use crate::protocol::openai::{ChatRequest, EmbeddingsRequest, Usage};
use crate::routing::Candidate;
use crate::upstream::CallError;

pub const BACKEND_HEADER: &str = "flexway-backend";
pub const DEGRADED_HEADER: &str = "flexway-degraded";
pub const BUDGET_HEADER: &str = "flexway-budget";

/// A backend that answered (any status but 5xx), before a byte reached the client.
pub(super) struct Served {
    pub candidate: Candidate,
    pub model: String,
    pub response: reqwest::Response,
    pub timeout: std::time::Duration,
}

pub(super) async fn chat_completions(
    State(gateway): State<Arc<Gateway>>,
    Extension(request_id): Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let caller = gateway.keys.authenticate(&headers)?;
    let bytes = read_body(body, &headers, gateway.config.ai.vision.max_body_bytes).await?;
    let request = ChatRequest::parse(&bytes)?;
    let images = request.images.len() as u64;
    let demand = Demand {
        capability: request.capability(),
        prompt_tokens: plan::prompt_upper_bound(request.prompt_text_bytes, request.message_count, images),
        max_tokens: request.max_tokens,
        completes: true,
        stream: request.stream,
    };
    let Admission {
        chain,
        ticket,
        soft,
        clamped_max_tokens,
    } = admit(&gateway, &caller, &request_id.0, &demand).await?;
    let prompt_typical = plan::prompt_typical(request.prompt_text_bytes, request.message_count, images);
    let dispatched = dispatch(&gateway, &chain, "/chat/completions", &request.model, |model| {
        request.upstream_body(model, clamped_max_tokens)
    })
    .await;
    let served = match dispatched {
        Ok(served) => served,
        Err(e) => {
            ticket.refund().await;
            return Err(e.into());
        }
    };
    let headers = model_headers(&served.candidate, soft);
    if !served.response.status().is_success() {
        ticket.refund().await;
        return relay_error_as_is(served, headers).await;
    }
    let price = gateway.price(&served.candidate.backend);
    let call = CallInfo {
        request_id,
        caller,
        backend: served.candidate.backend.clone(),
        model: served.model.clone(),
    };
    if request.stream {
        if !is_event_stream(served.response.headers()) {
            ticket.refund().await;
            let detail = "a stream was asked for but the response is not text/event-stream".into();
            return Err(GatewayError::UpstreamError {
                backend: served.candidate.backend,
                detail,
            }
            .into());
        }
        let finish = relay::Finish {
            ticket,
            price,
            prompt_typical,
            call,
        };
        return Ok(relay::stream(served, request.client_wants_usage, headers, finish));
    }
    let (response, body) = match read_json(served).await {
        Ok(read) => read,
        Err(e) => {
            ticket.refund().await;
            return Err(e.into());
        }
    };
    let (usage, source) = match Usage::from_value(body.get("usage")) {
        Some(usage) => (usage, UsageSource::Reported),
        None => {
            let completion = plan::typical_tokens(completion_bytes(&body));
            (
                Usage {
                    prompt_tokens: prompt_typical,
                    completion_tokens: completion,
                },
                UsageSource::Estimated,
            )
        }
    };
    let cost = ticket.settle(usage, price).await;
    log_served(&call, usage, source, cost);
    Ok(with_headers(response, headers))
}

pub(super) async fn embeddings(
    State(gateway): State<Arc<Gateway>>,
    Extension(request_id): Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let caller = gateway.keys.authenticate(&headers)?;
    let bytes = read_body(body, &headers, gateway.config.ai.vision.max_body_bytes).await?;
    let request = EmbeddingsRequest::parse(&bytes)?;
    let demand = Demand {
        capability: Capability::Embeddings,
        prompt_tokens: request.input_units,
        max_tokens: None,
        completes: false,
        stream: false,
    };
    let Admission {
        chain, ticket, soft, ..
    } = admit(&gateway, &caller, &request_id.0, &demand).await?;
    let dispatched = dispatch(&gateway, &chain, "/embeddings", &request.model, |model| {
        request.upstream_body(model)
    })
    .await;
    let served = match dispatched {
        Ok(served) => served,
        Err(e) => {
            ticket.refund().await;
            return Err(e.into());
        }
    };
    let headers = model_headers(&served.candidate, soft);
    if !served.response.status().is_success() {
        ticket.refund().await;
        return relay_error_as_is(served, headers).await;
    }
    let price = gateway.price(&served.candidate.backend);
    let call = CallInfo {
        request_id,
        caller,
        backend: served.candidate.backend.clone(),
        model: served.model.clone(),
    };
    let (response, body) = match read_json(served).await {
        Ok(read) => read,
        Err(e) => {
            ticket.refund().await;
            return Err(e.into());
        }
    };
    let (usage, source) = match Usage::from_value(body.get("usage")) {
        Some(usage) => (usage, UsageSource::Reported),
        None => (
            Usage {
                prompt_tokens: plan::typical_tokens(request.input_units),
                completion_tokens: 0,
            },
            UsageSource::Estimated,
        ),
    };
    let cost = ticket.settle(usage, price).await;
    log_served(&call, usage, source, cost);
    Ok(with_headers(response, headers))
}

/// Whether the usage settled came from the backend or from Flexway's estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// What the finishing phase needs to know about a call.
pub(super) struct CallInfo {
    pub request_id: RequestId,
    pub caller: Caller,
    pub backend: BackendId,
    /// The model the backend was asked for (after aliases and defaults).
    pub model: String,
}

pub(super) fn log_served(call: &CallInfo, usage: Usage, source: UsageSource, cost: MicroEur) {
    tracing::info!(
        request_id = %call.request_id.0,
        tenant = %call.caller.tenant,
        backend = %call.backend,
        model = %call.model,
        prompt_tokens = usage.prompt_tokens,
        completion_tokens = usage.completion_tokens,
        usage_source = source.as_str(),
        cost_eur = %cost.to_eur_string(),
        "call served"
    );
}

/// Bytes of completion text in a non-streamed answer (for estimation).
fn completion_bytes(body: &serde_json::Value) -> u64 {
    let choices = body.get("choices").and_then(serde_json::Value::as_array);
    choices
        .into_iter()
        .flatten()
        .filter_map(|c| c.pointer("/message/content").and_then(serde_json::Value::as_str))
        .map(|t| t.len() as u64)
        .sum()
}

/// Reads the body, refusing it as soon as it passes `limit` (never buffering more).
async fn read_body(body: Body, headers: &HeaderMap, limit: u64) -> Result<Bytes, GatewayError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(GatewayError::BodyTooLarge { limit });
    }
    let max = usize::try_from(limit).unwrap_or(usize::MAX);
    axum::body::to_bytes(body, max).await.map_err(|e| {
        if is_length_limit(&e) {
            GatewayError::BodyTooLarge { limit }
        } else {
            GatewayError::InvalidRequest(crate::protocol::openai::InvalidRequest {
                message: format!("could not read the request body: {e}"),
                param: None,
            })
        }
    })
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// Tries the chain in order until a backend answers with something other than a 5xx.
async fn dispatch(
    gateway: &Gateway,
    chain: &[Candidate],
    path: &str,
    requested_model: &str,
    body_for: impl Fn(&str) -> Vec<u8>,
) -> Result<Served, GatewayError> {
    let mut tried = Vec::new();
    let mut timed_out = None;
    for candidate in chain {
        let (Some(endpoint), Some(client)) = (
            endpoint(gateway, &candidate.backend),
            gateway.upstreams.get(&candidate.backend),
        ) else {
            continue;
        };
        let model = endpoint.served_model(requested_model);
        tried.push(candidate.backend.clone());
        match client.post_json(path, body_for(&model)).await {
            Ok(response) if response.status().is_server_error() => {
                tracing::warn!(backend = %candidate.backend, status = response.status().as_u16(), "backend failed");
                timed_out = None;
            }
            Ok(response) => {
                return Ok(Served {
                    candidate: candidate.clone(),
                    model,
                    response,
                    timeout: client.timeout,
                });
            }
            Err(CallError::Timeout(after)) => {
                tracing::warn!(backend = %candidate.backend, ?after, "backend timed out");
                timed_out = Some(candidate.backend.clone());
            }
            Err(e) => {
                tracing::warn!(backend = %candidate.backend, "backend unreachable: {e}");
                timed_out = None;
            }
        }
    }
    match timed_out {
        Some(backend) => Err(GatewayError::UpstreamTimeout { backend }),
        None => Err(GatewayError::UpstreamUnavailable {
            cause: UnavailableCause::UpstreamFailed,
            tried,
        }),
    }
}

fn endpoint<'a>(gateway: &'a Gateway, backend: &BackendId) -> Option<&'a Endpoint> {
    gateway.config.ai.backends.get(backend).and_then(|b| b.kind.endpoint())
}

fn is_event_stream(headers: &reqwest::header::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}

/// `Flexway-Backend`; `Flexway-Degraded` when a fallback served; `Flexway-Budget`
/// when the soft cap is reached.
pub(super) fn model_headers(candidate: &Candidate, soft: bool) -> Vec<(&'static str, HeaderValue)> {
    let mut headers = Vec::new();
    if soft {
        headers.push((BUDGET_HEADER, HeaderValue::from_static("soft")));
    }
    if let Ok(v) = HeaderValue::from_str(candidate.backend.as_str()) {
        headers.push((BACKEND_HEADER, v));
    }
    if candidate.degraded {
        headers.push((DEGRADED_HEADER, HeaderValue::from_static("backend-fallback")));
    }
    headers
}

fn response_with(
    status: StatusCode,
    body: Bytes,
    content_type: HeaderValue,
    extra: Vec<(&'static str, HeaderValue)>,
) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, content_type);
    for (name, value) in extra {
        response.headers_mut().insert(name, value);
    }
    response
}

async fn read_upstream_body(served: &mut Served) -> Result<Bytes, GatewayError> {
    let backend = served.candidate.backend.clone();
    let response = std::mem::replace(&mut served.response, empty_response());
    match tokio::time::timeout(served.timeout, response.bytes()).await {
        Err(_) => Err(GatewayError::UpstreamTimeout { backend }),
        Ok(Err(e)) => Err(GatewayError::UpstreamError {
            backend,
            detail: format!("reading the body failed: {e}"),
        }),
        Ok(Ok(bytes)) => Ok(bytes),
    }
}

fn empty_response() -> reqwest::Response {
    reqwest::Response::from(http::Response::new(Vec::<u8>::new()))
}

/// A backend's own 4xx: relayed as is (status, body, content type, Retry-After).
async fn relay_error_as_is(
    mut served: Served,
    mut extra: Vec<(&'static str, HeaderValue)>,
) -> Result<Response, ApiError> {
    let status = served.response.status();
    let content_type = served
        .response
        .headers()
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or(HeaderValue::from_static("application/json"));
    let retry_after = served.response.headers().get(header::RETRY_AFTER).cloned();
    let body = read_upstream_body(&mut served).await?;
    if let Some(v) = retry_after {
        extra.push(("retry-after", v));
    }
    tracing::info!(backend = %served.candidate.backend, status = status.as_u16(), "backend refused the call");
    Ok(response_with(status, body, content_type, extra))
}

/// A non-streamed answer, checked to be a JSON object: the response to relay (body
/// as the backend wrote it) and the parsed body.
async fn read_json(mut served: Served) -> Result<(Response, serde_json::Value), GatewayError> {
    let body = read_upstream_body(&mut served).await?;
    match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(value) if value.is_object() => {
            let response = response_with(
                StatusCode::OK,
                body,
                HeaderValue::from_static("application/json"),
                Vec::new(),
            );
            Ok((response, value))
        }
        _ => Err(GatewayError::UpstreamError {
            backend: served.candidate.backend,
            detail: "the response is not a JSON object".into(),
        }),
    }
}

fn with_headers(mut response: Response, extra: Vec<(&'static str, HeaderValue)>) -> Response {
    for (name, value) in extra {
        response.headers_mut().insert(name, value);
    }
    response
}
