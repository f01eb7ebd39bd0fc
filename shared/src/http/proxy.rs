//! The inference handlers, as the phases of ARCHITECTURE.md: authenticate → parse and
//! measure → admit (route + reserve) → dispatch (with fallback, before the first byte
//! only) → relay → settle → record.
//!
//! Fallback happens on a connection error, a 5xx or a timeout, never on a 4xx: a
//! backend's own 4xx (its 429 included) is the caller's answer and is relayed as is.
//! Every identified call ends in exactly one audit record (`record::Draft`), and every
//! reservation is settled or refunded (`budget::Ticket`), on every path below.

use std::sync::Arc;
use std::time::Instant;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};

use super::RequestId;
use super::error::render;
use super::record::Draft;
use super::relay;
use crate::admission::{Admission, Demand, admit};
use crate::budget::{Ticket, plan};
use crate::config::{BackendId, Capability, Endpoint};
use crate::error::{GatewayError, UnavailableCause};
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::protocol::openai::{Answer, ChatRequest, EmbeddingsRequest, InvalidRequest, Usage};
use crate::protocol::vision;
use crate::routing::breaker::{Admit, Outcome};
use crate::routing::{Candidate, Route};
use crate::upstream::CallError;

pub const BACKEND_HEADER: &str = "flexway-backend";
pub const DEGRADED_HEADER: &str = "flexway-degraded";
pub const BUDGET_HEADER: &str = "flexway-budget";

/// A backend that answered (any status but 5xx), before a byte reached the client.
pub(super) struct Served {
    pub candidate: Candidate,
    pub response: reqwest::Response,
    pub timeout: std::time::Duration,
}

/// What the call phases hand to the record phase.
enum Reply {
    /// A complete response (relayed 4xx included).
    Now(Response),
    /// A stream to relay; it settles and records when it ends.
    Stream {
        served: Served,
        client_wants_usage: bool,
        headers: Vec<(&'static str, HeaderValue)>,
        settle: relay::Settle,
    },
}

/// Who is calling, under which request id.
#[derive(Clone, Copy)]
struct Call<'a> {
    caller: &'a Caller,
    request_id: &'a RequestId,
}

#[derive(Clone, Copy)]
enum Operation {
    Chat,
    Embeddings,
}

pub(super) async fn chat_completions(
    State(gateway): State<Arc<Gateway>>,
    Extension(request_id): Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(gateway, request_id, headers, body, Operation::Chat).await
}

pub(super) async fn embeddings(
    State(gateway): State<Arc<Gateway>>,
    Extension(request_id): Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(gateway, request_id, headers, body, Operation::Embeddings).await
}

/// Authenticates, runs the call, and records it whatever happened.
async fn handle(
    gateway: Arc<Gateway>,
    request_id: RequestId,
    headers: HeaderMap,
    body: Body,
    op: Operation,
) -> Response {
    let caller = match gateway.keys.authenticate(&headers) {
        Ok(caller) => caller,
        // Refused before identification: no audit record (SPEC §9), only the log.
        Err(e) => return render(&GatewayError::from(e), true),
    };
    let name = match op {
        Operation::Chat => "chat",
        Operation::Embeddings => "embeddings",
    };
    let mut draft = Draft::begin(&gateway, &request_id, &caller, name);
    let call = Call { caller: &caller, request_id: &request_id };
    let result = match op {
        Operation::Chat => chat(&gateway, call, &mut draft, &headers, body).await,
        Operation::Embeddings => embed(&gateway, call, &mut draft, &headers, body).await,
    };
    match result {
        Ok(Reply::Now(response)) => {
            draft.finish(response.status().as_u16(), None).await;
            response
        }
        Ok(Reply::Stream { served, client_wants_usage, headers, settle }) => {
            relay::stream(served, client_wants_usage, headers, settle, draft)
        }
        Err(e) => {
            draft.fail(&e).await;
            render(&e, true)
        }
    }
}

async fn chat(
    gateway: &Gateway,
    call: Call<'_>,
    draft: &mut Draft,
    headers: &HeaderMap,
    body: Body,
) -> Result<Reply, GatewayError> {
    let bytes = read_body(body, headers, gateway.config.ai.vision.max_body_bytes).await?;
    let request = ChatRequest::parse(&bytes)?;
    draft.request(request.capability(), &request.model, request.user.as_deref());
    vision::check_images(&request.images, &gateway.config.ai.vision)?;
    let images = request.images.len() as u64;
    let demand = Demand {
        capability: request.capability(),
        prompt_tokens: plan::prompt_upper_bound(request.prompt_text_bytes, request.message_count, images),
        max_tokens: request.max_tokens,
        completes: true,
        stream: request.stream,
        sensitive: crate::identity::sensitivity(headers, &gateway.config.ai.sensitive_header)?,
    };
    let Admission { route, ticket, soft, clamped_max_tokens } =
        admit(gateway, call.caller, &call.request_id.0, &demand).await?;
    draft.soft(soft);
    let prompt_typical = plan::prompt_typical(request.prompt_text_bytes, request.message_count, images);
    let body_for = |model: &str| request.upstream_body(model, clamped_max_tokens);
    let served = match dispatch(gateway, draft, &route, "/chat/completions", &request.model, body_for).await {
        Ok(served) => served,
        Err(e) => return Err(refunded(ticket, e).await),
    };
    if !request.stream || !served.response.status().is_success() {
        return complete(gateway, draft, served, ticket, soft, prompt_typical).await;
    }
    if !is_event_stream(served.response.headers()) {
        let detail = "a stream was asked for but the response is not text/event-stream".into();
        return Err(refunded(ticket, GatewayError::UpstreamError { backend: served.candidate.backend, detail }).await);
    }
    let price = gateway.price(&served.candidate.backend);
    let headers = model_headers(&served.candidate, soft);
    draft.streaming();
    let settle = relay::Settle { ticket, price, prompt_typical };
    Ok(Reply::Stream { served, client_wants_usage: request.client_wants_usage, headers, settle })
}

async fn embed(
    gateway: &Gateway,
    call: Call<'_>,
    draft: &mut Draft,
    headers: &HeaderMap,
    body: Body,
) -> Result<Reply, GatewayError> {
    let bytes = read_body(body, headers, gateway.config.ai.vision.max_body_bytes).await?;
    let request = EmbeddingsRequest::parse(&bytes)?;
    draft.request(Capability::Embeddings, &request.model, request.user.as_deref());
    let demand = Demand {
        capability: Capability::Embeddings,
        prompt_tokens: request.input_units,
        max_tokens: None,
        completes: false,
        stream: false,
        sensitive: crate::identity::sensitivity(headers, &gateway.config.ai.sensitive_header)?,
    };
    let Admission { route, ticket, soft, .. } = admit(gateway, call.caller, &call.request_id.0, &demand).await?;
    draft.soft(soft);
    let body_for = |model: &str| request.upstream_body(model);
    let served = match dispatch(gateway, draft, &route, "/embeddings", &request.model, body_for).await {
        Ok(served) => served,
        Err(e) => return Err(refunded(ticket, e).await),
    };
    complete(gateway, draft, served, ticket, soft, plan::typical_tokens(request.input_units)).await
}

/// Refunds the reservation of a call that failed before its first byte.
async fn refunded(ticket: Ticket, error: GatewayError) -> GatewayError {
    ticket.refund().await;
    error
}

/// The tail every non-streamed answer shares: a backend's own 4xx relayed as is (and
/// refunded), or the answer read and settled on its usage — or, if it reports none,
/// on `prompt_typical` plus the typical tokens of the completion it wrote.
async fn complete(
    gateway: &Gateway,
    draft: &mut Draft,
    served: Served,
    ticket: Ticket,
    soft: bool,
    prompt_typical: u64,
) -> Result<Reply, GatewayError> {
    let headers = model_headers(&served.candidate, soft);
    if !served.response.status().is_success() {
        ticket.refund().await;
        return relay_error_as_is(served, headers).await.map(Reply::Now);
    }
    let price = gateway.price(&served.candidate.backend);
    let reading = Instant::now();
    let read = read_json(served).await;
    draft.waited(reading.elapsed());
    let (response, answer) = match read {
        Ok(read) => read,
        Err(e) => return Err(refunded(ticket, e).await),
    };
    let (usage, source) = match answer.usage {
        Some(usage) => (usage, UsageSource::Reported),
        None => {
            let completion_tokens = plan::typical_tokens(answer.completion_bytes);
            (Usage { prompt_tokens: prompt_typical, completion_tokens }, UsageSource::Estimated)
        }
    };
    let cost = ticket.settle(usage, price).await;
    draft.usage(usage, source, cost);
    Ok(Reply::Now(with_headers(response, headers)))
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

/// Reads the body, refusing it as soon as it passes `limit` (never buffering more).
async fn read_body(body: Body, headers: &HeaderMap, limit: u64) -> Result<Bytes, GatewayError> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(GatewayError::BodyTooLarge { limit });
    }
    let max = usize::try_from(limit).unwrap_or(usize::MAX);
    axum::body::to_bytes(body, max).await.map_err(|e| {
        if is_length_limit(&e) {
            GatewayError::BodyTooLarge { limit }
        } else {
            GatewayError::InvalidRequest(InvalidRequest {
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

/// Tries the route in order until a backend answers with something other than a
/// failure its breaker counts (by default a 5xx, a connection error, a timeout).
/// Backends whose breaker is open are skipped; each outcome feeds the breaker.
async fn dispatch(
    gateway: &Gateway,
    draft: &mut Draft,
    route: &Route,
    path: &str,
    requested_model: &str,
    body_for: impl Fn(&str) -> Vec<u8>,
) -> Result<Served, GatewayError> {
    let mut tried = Vec::new();
    let mut skipped = Vec::new();
    let mut timed_out = None;
    for candidate in &route.candidates {
        let backend = &candidate.backend;
        let (Some(endpoint), Some(client)) = (endpoint(gateway, backend), gateway.upstreams.get(backend)) else {
            continue;
        };
        if gateway.breakers.admit(backend, Instant::now()) == Admit::No {
            skipped.push(backend.clone());
            continue;
        }
        let model = endpoint.served_model(requested_model);
        tried.push(backend.clone());
        draft.trying(candidate, &model);
        timed_out = None;
        let sent = Instant::now();
        let answer = client.post_json(path, body_for(&model)).await;
        draft.waited(sent.elapsed());
        match answer {
            Ok(response) => {
                let status = response.status();
                let retry_after = retry_after(response.headers());
                gateway.breakers.record(
                    backend,
                    Outcome::Status { status: status.as_u16(), retry_after },
                    Instant::now(),
                );
                if !status.is_server_error() {
                    return Ok(Served { candidate: candidate.clone(), response, timeout: client.timeout });
                }
                tracing::warn!(backend = %backend, status = status.as_u16(), "backend failed");
            }
            Err(CallError::Timeout(after)) => {
                gateway.breakers.record(backend, Outcome::Timeout, Instant::now());
                tracing::warn!(backend = %backend, ?after, "backend timed out");
                timed_out = Some(backend.clone());
            }
            Err(CallError::Connect(e)) => {
                gateway.breakers.record(backend, Outcome::ConnectionError, Instant::now());
                tracing::warn!(backend = %backend, "backend unreachable: {e}");
            }
            // Our own credential file is missing: not the backend's health.
            Err(e @ CallError::Credential(_)) => tracing::error!(backend = %backend, "{e}"),
        }
    }
    if let Some(backend) = timed_out {
        return Err(GatewayError::UpstreamTimeout { backend });
    }
    let cause = if tried.is_empty() && !skipped.is_empty() {
        UnavailableCause::CircuitOpen
    } else if route.via_pool {
        UnavailableCause::PoolExhausted
    } else {
        UnavailableCause::UpstreamFailed
    };
    Err(GatewayError::UpstreamUnavailable { cause, tried, skipped })
}

/// `Retry-After` in seconds (the HTTP-date form is not used by model APIs).
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<std::time::Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse::<u64>().ok().map(std::time::Duration::from_secs)
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
        Ok(Err(e)) => Err(GatewayError::UpstreamError { backend, detail: format!("reading the body failed: {e}") }),
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
) -> Result<Response, GatewayError> {
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
async fn read_json(mut served: Served) -> Result<(Response, Answer), GatewayError> {
    let body = read_upstream_body(&mut served).await?;
    match Answer::read(&body) {
        Some(answer) => {
            let response =
                response_with(StatusCode::OK, body, HeaderValue::from_static("application/json"), Vec::new());
            Ok((response, answer))
        }
        None => Err(GatewayError::UpstreamError {
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
