//! The dispatch phase of an HTTP call: what one attempt at one backend is, for the
//! attempt phase (`chain`) that tries the route in order (SPEC §5). A non-streamed
//! answer is in once read whole, a stream once its first content arrives
//! ([`relay::hold`]); every failure before that point is a [`Failure`], and the chain
//! falls back to the next candidate.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};

use super::cache::Kept;
use super::chain::{self, Failure};
use super::drive::Charge;
use super::format::Format;
use super::record::Draft;
use super::relay;
use crate::config::{BackendId, Endpoint};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::protocol::openai::{Answer, InvalidRequest};
use crate::protocol::{Wire, anthropic};
use crate::routing::Route;
use crate::routing::breaker::Outcome;
use crate::telemetry::TraceContext;
use crate::upstream::body::{self, Fault};
use crate::upstream::{CallerIdentity, UpstreamClient};

/// A backend whose answer is in (a non-streamed one read whole, a stream held until
/// its first content), before a byte reached the client.
pub(super) type Served = chain::Served<Answered>;

pub(super) enum Answered {
    /// A non-streamed answer read whole: a 2xx checked to be a JSON object (`answer`),
    /// or the backend's own refusal (4xx) to relay as is.
    Whole {
        status: StatusCode,
        content_type: HeaderValue,
        retry_after: Option<HeaderValue>,
        body: Bytes,
        answer: Option<Answer>,
        /// What the response cache may keep of it, when the call asked to keep it
        /// (boxed: most calls keep nothing).
        kept: Option<Box<Kept>>,
    },
    /// A stream whose first content event (or clean end) has arrived.
    Stream(Box<relay::Held>),
}

/// What the caller expects of a successful answer, and the format it goes back in.
#[derive(Clone, Copy)]
pub(super) struct Expect<'a> {
    pub shape: Shape,
    pub format: &'a Format,
    /// What to read of a successful answer for the response cache, if anything.
    pub keep: Option<KeepAs>,
}

/// How the response cache keeps an answer: a chat answer's text (its format's own,
/// rendered again for each door), or an embeddings body as it came.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum KeepAs {
    /// At most `limit` bytes of text (a stream's is given up past it).
    Text {
        limit: u64,
    },
    Body,
}

#[derive(Clone, Copy)]
pub(super) enum Shape {
    Json,
    Stream { client_wants_usage: bool },
}

/// Tries the route in order until a backend's answer is in (`chain`): read whole, or
/// for a stream, held until its first content. An answer read whole tells its
/// breaker its status; a stream's success is told when it ends (the relay). What it
/// reserves of a backend's provider quota is held in the call's `charge`.
pub(super) async fn dispatch(
    gateway: &Gateway,
    (draft, charge): (&mut Draft, &mut Charge),
    route: &Route,
    path: &str,
    requested_model: &str,
    body_for: impl Fn(&str, Wire) -> Result<Vec<u8>, InvalidRequest> + Sync,
    expect: Expect<'_>,
) -> Result<Served, GatewayError> {
    let door = Http { gateway, path, requested_model, body_for, expect };
    chain::attempt_chain(gateway, draft, charge, route, &door).await
}

/// An HTTP door's attempt: a JSON body POSTed to the backend's path, its answer read
/// whole or, for a stream, held until its first content.
struct Http<'a, B> {
    gateway: &'a Gateway,
    path: &'a str,
    requested_model: &'a str,
    body_for: B,
    expect: Expect<'a>,
}

impl<'a, B> chain::Attempt for Http<'a, B>
where
    B: Fn(&str, Wire) -> Result<Vec<u8>, InvalidRequest> + Sync,
{
    type Target = (&'a Endpoint, chain::Reached<'a>);
    type Prepared = Vec<u8>;
    type Answer = Answered;

    fn reach(&self, backend: &BackendId) -> Option<(Self::Target, Duration)> {
        chain::endpoint(self.gateway, backend)
    }

    fn at(&self, pool: &BackendId, (endpoint, _): &Self::Target, picked: &str) -> Option<Self::Target> {
        let client = self.gateway.upstreams.at(pool, picked)?;
        Some((*endpoint, chain::Reached::Picked(Box::new(client))))
    }

    fn question<'p>(&'p self, body: &'p Vec<u8>) -> Option<(&'p str, &'p [u8])> {
        Some((self.path, body))
    }

    fn prepare(&self, (endpoint, client): &Self::Target) -> Result<(String, Vec<u8>), GatewayError> {
        let model = endpoint.served_model(self.requested_model);
        let body = (self.body_for)(&model, client.wire)?;
        Ok((model, body))
    }

    fn attempt(
        &self,
        (_, client): &Self::Target,
        body: Vec<u8>,
        draft: &Draft,
    ) -> impl Future<Output = Result<chain::Answered<Answered>, Failure>> + Send {
        let (gateway, client, path, expect): (_, &UpstreamClient, _, _) =
            (self.gateway, client, self.path, self.expect);
        let (trace, caller) = (draft.trace(), draft.caller());
        async move {
            let answered = attempt(gateway, client, path, body, trace, caller, expect).await?;
            let outcome = match &answered {
                Answered::Whole { status, retry_after, .. } => {
                    let retry_after = retry_after.as_ref().and_then(seconds);
                    Some(Outcome::Status { status: status.as_u16(), retry_after })
                }
                // A stream's success is told when it ends (the relay).
                Answered::Stream(_) => None,
            };
            Ok(chain::Answered { value: answered, outcome })
        }
    }
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
    let format = expect.format;
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
                let body = format.refusal(client.wire, status.as_u16(), body);
                let content_type = if format.native(client.wire) {
                    content_type
                } else {
                    HeaderValue::from_static("application/json")
                };
                return Ok(Answered::Whole { status, content_type, retry_after, body, answer: None, kept: None });
            }
            let keep_text = matches!(expect.keep, Some(KeepAs::Text { .. }));
            let (body, answer, completion) = format.answer(client.wire, body, keep_text).ok_or_else(|| {
                let what = match client.wire {
                    Wire::OpenAi => "the answer is not a JSON object",
                    Wire::Anthropic => "the answer is not an Anthropic Messages `message`",
                };
                Failure::Body(Fault::Invalid(what.into()))
            })?;
            let kept = match expect.keep {
                Some(KeepAs::Body) => Some(Box::new(Kept::Body(body.clone()))),
                Some(KeepAs::Text { .. }) => completion
                    .filter(|c| c.tool_calls.is_empty())
                    .and_then(|c| c.text)
                    .map(|text| Box::new(Kept::Chat(text))),
                None => None,
            };
            Ok(Answered::Whole { status, content_type, retry_after, body, answer: Some(answer), kept })
        }
        Shape::Stream { client_wants_usage } => {
            if !is_event_stream(headers) {
                let detail = "a stream was asked for but the answer is not text/event-stream";
                return Err(Failure::Body(Fault::Invalid(detail.into())));
            }
            let keep = match expect.keep {
                Some(KeepAs::Text { limit }) => Some(limit),
                _ => None,
            };
            let held =
                relay::hold(response, limits.max_event_bytes, deadline, client_wants_usage, client.wire, format, keep)
                    .await;
            held.map(|held| Answered::Stream(Box::new(held))).map_err(Failure::Body)
        }
    }
}

/// `Retry-After` in seconds (the HTTP-date form is not used by model APIs).
fn seconds(value: &HeaderValue) -> Option<Duration> {
    value.to_str().ok()?.trim().parse::<u64>().ok().map(Duration::from_secs)
}

fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}
