//! The SSE relay: upstream events forwarded to the client as each one completes.
//!
//! A pump task reads the backend's stream and feeds a small channel that is the
//! client's body, so nothing is buffered whole and a slow client slows the backend
//! read (back-pressure) instead of growing memory. The usage chunk the gateway always
//! asks for is tapped on the way and shown only to a client that asked for it. If the
//! backend's stream breaks (an error, a stall past the timeout, or an end without
//! `[DONE]`), the client's stream ends with an SSE error event, never a clean `[DONE]`.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderValue, header};
use serde_json::Value;
use tokio::sync::mpsc;

use super::proxy::{Served, UsageSource};
use super::record::Draft;
use crate::budget::{Ticket, plan};
use crate::config::Price;
use crate::protocol::openai::{Usage, error_envelope};
use crate::protocol::sse::{self, Splitter};

/// How a relayed stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnd {
    /// `[DONE]` relayed.
    Done,
    /// The backend's stream failed or ended early; the client got an error event.
    Broken(String),
    /// The client went away; the backend read was abandoned.
    ClientGone,
}

/// What a finished stream tells the settle and record phases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayOutcome {
    pub end: StreamEnd,
    /// The usage the backend reported in the stream, if it did.
    pub usage: Option<Usage>,
    /// Bytes of completion content relayed to the client (for estimation).
    pub content_bytes: u64,
    pub events: u64,
}

/// What settles a stream's reservation once it has ended.
pub(super) struct Settle {
    pub ticket: Ticket,
    pub price: Price,
    /// The prompt's typical token count, if the backend reports no usage.
    pub prompt_typical: u64,
}

impl Settle {
    /// Settles on the reported usage, else on an estimate of what was relayed (a
    /// stream that broke mid-way included: its first byte reached the client), and
    /// writes the call's record.
    async fn finish(self, outcome: &RelayOutcome, mut draft: Draft) {
        let estimate = Usage {
            prompt_tokens: self.prompt_typical,
            completion_tokens: plan::typical_tokens(outcome.content_bytes),
        };
        let (usage, source) = match outcome.usage {
            Some(reported) => {
                // How far the estimate would have been: the streaming reconciliation delta.
                draft.drift(estimate.total(), reported.total());
                (reported, UsageSource::Reported)
            }
            None => (estimate, UsageSource::Estimated),
        };
        let cost = self.ticket.settle(usage, self.price).await;
        draft.usage(usage, source, cost);
        match &outcome.end {
            StreamEnd::Done => draft.finish(200, None).await,
            StreamEnd::Broken(_) => draft.finish(200, Some("upstream_error")).await,
            StreamEnd::ClientGone => draft.finish(499, Some("client_closed_request")).await,
        }
    }
}

/// The streamed response. Settlement and the record run in the pump task when the
/// stream ends, before the body completes, so they finish inside the invocation.
pub(super) fn stream(
    served: Served,
    client_wants_usage: bool,
    extra: Vec<(&'static str, HeaderValue)>,
    settle: Settle,
    mut draft: Draft,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let timeout = served.timeout;
    tokio::spawn(async move {
        let outcome = pump(served.response, &tx, client_wants_usage, timeout, &mut draft).await;
        settle.finish(&outcome, draft).await;
        drop(tx);
    });
    let body =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx)) });
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    for (name, value) in extra {
        headers.insert(name, value);
    }
    response
}

/// Reads the backend's stream to its end, forwarding events.
pub async fn pump(
    response: reqwest::Response,
    tx: &mpsc::Sender<Bytes>,
    client_wants_usage: bool,
    idle_timeout: Duration,
    draft: &mut Draft,
) -> RelayOutcome {
    let mut outcome = RelayOutcome { end: StreamEnd::Done, usage: None, content_bytes: 0, events: 0 };
    let mut upstream = response.bytes_stream();
    let mut splitter = Splitter::default();
    loop {
        let chunk = match tokio::time::timeout(idle_timeout, upstream.next()).await {
            Err(_) => Err(format!("the backend stalled for {idle_timeout:?}")),
            Ok(None) => Err("the backend ended the stream before [DONE]".to_owned()),
            Ok(Some(Err(e))) => Err(format!("the backend stream failed: {e}")),
            Ok(Some(Ok(bytes))) => Ok(bytes),
        };
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(reason) => return broken(outcome, tx, reason).await,
        };
        splitter.push(&chunk);
        while let Some(event) = splitter.next_event() {
            if event.is_done() {
                if tx.send(event.raw).await.is_err() {
                    outcome.end = StreamEnd::ClientGone;
                }
                return outcome;
            }
            let forward = tap(&event.data, client_wants_usage, &mut outcome);
            if forward {
                outcome.events += 1;
                draft.first_byte();
                if tx.send(event.raw).await.is_err() {
                    outcome.end = StreamEnd::ClientGone;
                    return outcome;
                }
            }
        }
    }
}

/// Reads usage and content sizes from one event; false when it must not be forwarded.
fn tap(data: &str, client_wants_usage: bool, outcome: &mut RelayOutcome) -> bool {
    let Ok(chunk) = serde_json::from_str::<Value>(data) else {
        return true;
    };
    if let Some(choices) = chunk.get("choices").and_then(Value::as_array) {
        for choice in choices {
            let delta = &choice["delta"];
            if let Some(text) = delta.get("content").and_then(Value::as_str) {
                outcome.content_bytes += text.len() as u64;
            }
            if let Some(calls) = delta.get("tool_calls") {
                outcome.content_bytes += calls.to_string().len() as u64;
            }
        }
    }
    match Usage::from_value(chunk.get("usage")) {
        Some(usage) => {
            outcome.usage = Some(usage);
            let usage_only = chunk.get("choices").and_then(Value::as_array).is_none_or(Vec::is_empty);
            client_wants_usage || !usage_only
        }
        None => true,
    }
}

async fn broken(mut outcome: RelayOutcome, tx: &mpsc::Sender<Bytes>, reason: String) -> RelayOutcome {
    tracing::warn!("stream broke mid-way: {reason}");
    let message = format!("{reason}; the response is incomplete");
    let event = sse::event(Some("error"), &error_envelope(&message, "api_error", "upstream_error", None));
    // If the client is gone too, there is no one left to tell.
    let _ = tx.send(event).await;
    outcome.end = StreamEnd::Broken(reason);
    outcome
}
