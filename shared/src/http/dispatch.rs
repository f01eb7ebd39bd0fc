//! The dispatch phase: the route tried in order until one backend's answer is in,
//! before a byte reaches the client (SPEC §5). A non-streamed answer is in once read
//! whole, a stream once its first content arrives ([`relay::hold`]); every failure
//! before that point falls back to the next candidate and feeds its breaker.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};

use super::door::Door;
use super::record::Draft;
use super::relay;
use crate::config::{BackendId, Endpoint};
use crate::error::{Attempts, GatewayError, UnavailableCause};
use crate::gateway::Gateway;
use crate::protocol::openai::{Answer, InvalidRequest};
use crate::protocol::{Wire, anthropic};
use crate::routing::breaker::{Admit, Outcome};
use crate::routing::{Candidate, Route};
use crate::telemetry::TraceContext;
use crate::upstream::body::{self, Fault};
use crate::upstream::{CallError, CallerIdentity, UpstreamClient};

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
    Stream(Box<relay::Held>),
}

/// What the caller expects of a successful answer, and the door it goes back by.
#[derive(Clone, Copy)]
pub(super) struct Expect<'a> {
    pub shape: Shape,
    pub door: &'a Door,
}

#[derive(Clone, Copy)]
pub(super) enum Shape {
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

/// Tries the route in order until a backend's answer is in: read whole, or for a
/// stream, held until its first content. A connection error, a status its breaker
/// counts (5xx by default), a timeout, a body cut, stalled or invalid: each falls back
/// to the next candidate, since nothing has reached the client yet. Backends whose
/// breaker is open are skipped; every outcome feeds the breaker (a stream's success
/// is recorded when it ends).
pub(super) async fn dispatch(
    gateway: &Gateway,
    draft: &mut Draft,
    route: &Route,
    path: &str,
    requested_model: &str,
    body_for: impl Fn(&str, Wire) -> Result<Vec<u8>, InvalidRequest>,
    expect: Expect<'_>,
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
        // A request this backend's format cannot carry is the caller's to change.
        let body = body_for(&model, client.wire)?;
        attempts.tried.push(backend.clone());
        draft.trying(candidate, &model);
        let sent = Instant::now();
        let answer = attempt(gateway, client, path, body, draft.trace(), draft.caller(), expect).await;
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
            Failure::Head(e @ CallError::Tls(_)) => {
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
            // A TLS failure is named: it is a certificate to fix, not a backend down.
            let last_failure = match last {
                Some((backend, Failure::Head(e @ CallError::Tls(_)))) => Some(format!("backend `{backend}`: {e}")),
                _ => None,
            };
            GatewayError::UpstreamUnavailable { cause, attempts, last_failure }
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
    trace: &TraceContext,
    caller: &CallerIdentity,
    expect: Expect<'_>,
) -> Result<Answered, Failure> {
    let door = expect.door;
    let deadline = tokio::time::Instant::now() + client.timeout;
    let limits = gateway.config.ai.limits;
    let path = match client.wire {
        Wire::OpenAi => path,
        Wire::Anthropic => anthropic::PATH,
    };
    let response = client.post_json(path, body, trace, caller).await.map_err(Failure::Head)?;
    let status = response.status();
    let headers = response.headers();
    if status.is_server_error() {
        let retry_after = headers.get(header::RETRY_AFTER).and_then(seconds);
        return Err(Failure::Status { status: status.as_u16(), retry_after });
    }
    let shape = if status.is_success() { expect.shape } else { Shape::Json };
    match shape {
        Shape::Json => {
            let content_type =
                headers.get(header::CONTENT_TYPE).cloned().unwrap_or(HeaderValue::from_static("application/json"));
            let retry_after = headers.get(header::RETRY_AFTER).cloned();
            let body = body::read_whole(response.into_body(), limits.max_response_bytes, deadline)
                .await
                .map_err(Failure::Body)?;
            if !status.is_success() {
                // Its refusal, in the envelope the caller reads.
                let body = door.refusal(client.wire, status.as_u16(), body);
                let content_type =
                    if door.native(client.wire) { content_type } else { HeaderValue::from_static("application/json") };
                return Ok(Answered::Whole { status, content_type, retry_after, body, answer: None });
            }
            let (body, answer) = door.answer(client.wire, body).ok_or_else(|| {
                let what = match client.wire {
                    Wire::OpenAi => "the answer is not a JSON object",
                    Wire::Anthropic => "the answer is not an Anthropic Messages `message`",
                };
                Failure::Body(Fault::Invalid(what.into()))
            })?;
            Ok(Answered::Whole { status, content_type, retry_after, body, answer: Some(answer) })
        }
        Shape::Stream { client_wants_usage } => {
            if !is_event_stream(headers) {
                let detail = "a stream was asked for but the answer is not text/event-stream";
                return Err(Failure::Body(Fault::Invalid(detail.into())));
            }
            let held =
                relay::hold(response, limits.max_event_bytes, deadline, client_wants_usage, client.wire, door).await;
            held.map(|held| Answered::Stream(Box::new(held))).map_err(Failure::Body)
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

fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}
