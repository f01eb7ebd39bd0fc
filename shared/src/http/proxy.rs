//! The inference handlers, as the phases of ARCHITECTURE.md: authenticate → parse and
//! measure → admit (route + reserve) → dispatch (with fallback, before the first byte
//! only) → relay → settle → record.
//!
//! Fallback happens on a connection error, a 5xx, a timeout, or an answer cut, stalled
//! or invalid before the client's first byte (SPEC §5: a non-streamed answer counts as
//! served once read whole, a stream once its first content arrives), never on a 4xx: a
//! backend's own 4xx (its 429 included) is the caller's answer and is relayed as is.
//! Every identified call ends in exactly one audit record (`record::Draft`), and every
//! reservation is settled or refunded (`budget::Ticket`), on every path below.

use std::sync::Arc;
use std::time::{Duration, Instant};

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
use crate::error::{Attempts, GatewayError, UnavailableCause};
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::protocol::openai::{Answer, ChatRequest, EmbeddingsRequest, InvalidRequest, Usage};
use crate::protocol::vision;
use crate::routing::breaker::{Admit, Outcome};
use crate::routing::{Candidate, Route};
use crate::upstream::body::{self, Fault};
use crate::upstream::{CallError, UpstreamClient};

pub const BACKEND_HEADER: &str = "flexway-backend";
pub const DEGRADED_HEADER: &str = "flexway-degraded";
pub const BUDGET_HEADER: &str = "flexway-budget";
/// The settled cost of a non-streamed answer, in euros (`0.000123`); a stream's is
/// only known after its last byte, so only its audit record says it.
pub const COST_HEADER: &str = "flexway-cost-eur";

/// A backend whose answer is in (a non-streamed one read whole, a stream held until
/// its first content), before a byte reached the client.
pub(super) struct Served {
    pub candidate: Candidate,
    pub answered: Answered,
    pub timeout: Duration,
}

pub(super) enum Answered {
    /// A non-streamed answer read whole: a 2xx checked to be a JSON object (`answer`),
    /// or the backend's own refusal (4xx) to relay as is.
    Whole {
        status: StatusCode,
        content_type: HeaderValue,
        retry_after: Option<HeaderValue>,
        body: Bytes,
        answer: Option<Answer>,
    },
    /// A stream whose first content event (or clean end) has arrived.
    Stream(relay::Held),
}

/// What the caller expects of a successful answer.
#[derive(Clone, Copy)]
enum Expect {
    Json,
    Stream { client_wants_usage: bool },
}

/// Why one attempt failed, before anything reached the client.
enum Failure {
    /// A 5xx (whether its breaker counts it is the breaker policy's business).
    Status {
        status: u16,
        retry_after: Option<Duration>,
    },
    Head(CallError),
    Body(Fault),
}

/// What the call phases hand to the record phase.
enum Reply {
    /// A complete response (relayed 4xx included).
    Now(Response),
    /// A held stream to relay; it settles and records when it ends.
    Stream(Box<Streamed>),
}

struct Streamed {
    backend: BackendId,
    held: relay::Held,
    timeout: Duration,
    headers: Vec<(&'static str, HeaderValue)>,
    settle: relay::Settle,
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
        Ok(Reply::Stream(streamed)) => {
            let Streamed { backend, held, timeout, headers, settle } = *streamed;
            relay::stream(gateway, backend, held, timeout, headers, settle, draft)
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
        choices: request.choices,
        completes: true,
        stream: request.stream,
        sensitive: crate::identity::sensitivity(headers, &gateway.config.ai.sensitive_header)?,
    };
    let Admission { route, ticket, soft, allowance } = admit(gateway, call.caller, &call.request_id.0, &demand).await?;
    draft.soft(soft);
    let prompt_typical = plan::prompt_typical(request.prompt_text_bytes, request.message_count, images);
    let body_for = |model: &str| request.upstream_body(model, allowance);
    let expect =
        if request.stream { Expect::Stream { client_wants_usage: request.client_wants_usage } } else { Expect::Json };
    let served = match dispatch(gateway, draft, &route, "/chat/completions", &request.model, body_for, expect).await {
        Ok(served) => served,
        Err(e) => return Err(refunded(ticket, e).await),
    };
    let backend = served.candidate.backend.clone();
    let settle = relay::Settle {
        ticket,
        price: gateway.price(&backend),
        backend,
        prompt_typical,
        allowance: Some(allowance.saturating_mul(request.choices)),
    };
    match served.answered {
        Answered::Stream(held) => {
            draft.streaming();
            let headers = model_headers(&served.candidate, soft);
            let backend = served.candidate.backend;
            Ok(Reply::Stream(Box::new(Streamed { backend, held, timeout: served.timeout, headers, settle })))
        }
        Answered::Whole { .. } => complete(gateway, draft, served, settle, soft).await,
    }
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
        choices: 1,
        completes: false,
        stream: false,
        sensitive: crate::identity::sensitivity(headers, &gateway.config.ai.sensitive_header)?,
    };
    let Admission { route, ticket, soft, .. } = admit(gateway, call.caller, &call.request_id.0, &demand).await?;
    draft.soft(soft);
    let body_for = |model: &str| request.upstream_body(model);
    let served = match dispatch(gateway, draft, &route, "/embeddings", &request.model, body_for, Expect::Json).await {
        Ok(served) => served,
        Err(e) => return Err(refunded(ticket, e).await),
    };
    let backend = served.candidate.backend.clone();
    let settle = relay::Settle {
        ticket,
        price: gateway.price(&backend),
        backend,
        prompt_typical: plan::typical_tokens(request.input_units),
        allowance: None,
    };
    complete(gateway, draft, served, settle, soft).await
}

/// Refunds the reservation of a call that failed before its first byte.
async fn refunded(ticket: Ticket, error: GatewayError) -> GatewayError {
    ticket.refund().await;
    error
}

/// The tail every non-streamed answer shares: a backend's own 4xx relayed as is (and
/// refunded), or the answer (read whole) settled on its usage — or, if it reports
/// none, on the prompt's typical tokens plus those of the completion it wrote.
async fn complete(
    gateway: &Gateway,
    draft: &mut Draft,
    served: Served,
    settle: relay::Settle,
    soft: bool,
) -> Result<Reply, GatewayError> {
    let mut headers = model_headers(&served.candidate, soft);
    let Answered::Whole { status, content_type, retry_after, body, answer } = served.answered else {
        return Err(
            refunded(settle.ticket, GatewayError::Internal("a stream where an answer was expected".into())).await
        );
    };
    let Some(answer) = answer else {
        settle.ticket.refund().await;
        // Refunded: the backend's refusal costs the caller nothing, and says so.
        headers.push((COST_HEADER, HeaderValue::from_static("0.000000")));
        if let Some(v) = retry_after {
            headers.push(("retry-after", v));
        }
        tracing::info!(backend = %served.candidate.backend, status = status.as_u16(), "backend refused the call");
        return Ok(Reply::Now(response_with(status, body, content_type, headers)));
    };
    let (usage, source) = match answer.usage {
        Some(usage) => (usage, UsageSource::Reported),
        None => {
            let completion_tokens = plan::typical_tokens(answer.completion_bytes);
            (Usage { prompt_tokens: settle.prompt_typical, completion_tokens }, UsageSource::Estimated)
        }
    };
    let cost = settle.settle(gateway, usage).await;
    draft.usage(usage, source, cost);
    if let Ok(v) = HeaderValue::from_str(&cost.to_eur_string()) {
        headers.push((COST_HEADER, v));
    }
    Ok(Reply::Now(response_with(StatusCode::OK, body, HeaderValue::from_static("application/json"), headers)))
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

/// Tries the route in order until a backend's answer is in: read whole, or for a
/// stream, held until its first content. A connection error, a status its breaker
/// counts (5xx by default), a timeout, a body cut, stalled or invalid: each falls back
/// to the next candidate, since nothing has reached the client yet. Backends whose
/// breaker is open are skipped; every outcome feeds the breaker (a stream's success
/// is recorded when it ends).
async fn dispatch(
    gateway: &Gateway,
    draft: &mut Draft,
    route: &Route,
    path: &str,
    requested_model: &str,
    body_for: impl Fn(&str) -> Vec<u8>,
    expect: Expect,
) -> Result<Served, GatewayError> {
    let mut attempts = Attempts::default();
    let mut last: Option<(BackendId, Failure)> = None;
    for candidate in &route.candidates {
        let backend = &candidate.backend;
        let (Some(endpoint), Some(client)) = (endpoint(gateway, backend), gateway.upstreams.get(backend)) else {
            continue;
        };
        if gateway.breakers.admit(backend, Instant::now()) == Admit::No {
            attempts.skipped.push(backend.clone());
            continue;
        }
        let model = endpoint.served_model(requested_model);
        attempts.tried.push(backend.clone());
        draft.trying(candidate, &model);
        let sent = Instant::now();
        let answer = attempt(gateway, client, path, body_for(&model), expect).await;
        draft.waited(sent.elapsed());
        let failure = match answer {
            Ok(answered) => {
                if let Answered::Whole { status, retry_after, .. } = &answered {
                    let retry_after = retry_after.as_ref().and_then(seconds);
                    let outcome = Outcome::Status { status: status.as_u16(), retry_after };
                    gateway.breakers.record(backend, outcome, Instant::now());
                }
                return Ok(Served { candidate: candidate.clone(), answered, timeout: client.timeout });
            }
            Err(failure) => failure,
        };
        let outcome = match &failure {
            Failure::Status { status, retry_after } => {
                tracing::warn!(backend = %backend, status, "backend failed");
                Some(Outcome::Status { status: *status, retry_after: *retry_after })
            }
            Failure::Head(CallError::Timeout(after)) => {
                tracing::warn!(backend = %backend, ?after, "backend timed out");
                Some(Outcome::Timeout)
            }
            Failure::Head(CallError::Connect(e)) => {
                tracing::warn!(backend = %backend, "backend unreachable: {e}");
                Some(Outcome::ConnectionError)
            }
            // Our own credential file is missing: not the backend's health.
            Failure::Head(e @ CallError::Credential(_)) => {
                tracing::error!(backend = %backend, "{e}");
                None
            }
            Failure::Body(fault) => {
                tracing::warn!(backend = %backend, "backend answer failed before the first byte: {fault}");
                Some(relay::fault_outcome(fault))
            }
        };
        if let Some(outcome) = outcome {
            gateway.breakers.record(backend, outcome, Instant::now());
        }
        last = Some((backend.clone(), failure));
    }
    Err(match last {
        Some((backend, Failure::Head(CallError::Timeout(_)) | Failure::Body(Fault::Timeout))) => {
            GatewayError::UpstreamTimeout { backend, attempts }
        }
        Some((backend, Failure::Body(Fault::Invalid(detail)))) => {
            GatewayError::UpstreamError { backend, detail, attempts }
        }
        _ => {
            let cause = if attempts.tried.is_empty() && !attempts.skipped.is_empty() {
                UnavailableCause::CircuitOpen
            } else if route.via_pool {
                UnavailableCause::PoolExhausted
            } else {
                UnavailableCause::UpstreamFailed
            };
            GatewayError::UpstreamUnavailable { cause, attempts }
        }
    })
}

/// One call to one backend, up to its answer being in (bounded by the backend's
/// `timeout` from the moment the request is sent).
async fn attempt(
    gateway: &Gateway,
    client: &UpstreamClient,
    path: &str,
    body: Vec<u8>,
    expect: Expect,
) -> Result<Answered, Failure> {
    let deadline = tokio::time::Instant::now() + client.timeout;
    let limits = gateway.config.ai.limits;
    let response = client.post_json(path, body).await.map_err(Failure::Head)?;
    let status = response.status();
    let headers = response.headers();
    if status.is_server_error() {
        let retry_after = headers.get(header::RETRY_AFTER).and_then(seconds);
        return Err(Failure::Status { status: status.as_u16(), retry_after });
    }
    let expect = if status.is_success() { expect } else { Expect::Json };
    match expect {
        Expect::Json => {
            let content_type =
                headers.get(header::CONTENT_TYPE).cloned().unwrap_or(HeaderValue::from_static("application/json"));
            let retry_after = headers.get(header::RETRY_AFTER).cloned();
            let body = body::read_whole(response, limits.max_response_bytes, deadline).await.map_err(Failure::Body)?;
            let answer = if status.is_success() {
                let answer = Answer::read(&body)
                    .ok_or_else(|| Failure::Body(Fault::Invalid("the answer is not a JSON object".into())))?;
                Some(answer)
            } else {
                None
            };
            Ok(Answered::Whole { status, content_type, retry_after, body, answer })
        }
        Expect::Stream { client_wants_usage } => {
            if !is_event_stream(headers) {
                let detail = "a stream was asked for but the answer is not text/event-stream";
                return Err(Failure::Body(Fault::Invalid(detail.into())));
            }
            let held = relay::hold(response, limits.max_event_bytes, deadline, client_wants_usage).await;
            held.map(Answered::Stream).map_err(Failure::Body)
        }
    }
}

/// `Retry-After` in seconds (the HTTP-date form is not used by model APIs).
fn seconds(value: &HeaderValue) -> Option<Duration> {
    value.to_str().ok()?.trim().parse::<u64>().ok().map(Duration::from_secs)
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
