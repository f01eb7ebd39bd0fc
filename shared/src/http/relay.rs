//! The SSE relay: upstream events forwarded to the client as each one completes.
//!
//! A stream is first *held* ([`hold`]): the gateway sends its own status and headers
//! only once the backend's first event that carries content (or its clean end)
//! arrives, so a slow first token, a cut or a malformed first event still falls back
//! like a failure before the headers. The events held go out with the headers, as the
//! body's first chunk (one write, with no task in between). Then a pump task reads
//! the rest and feeds a small channel that is the client's body, so nothing is
//! buffered whole and a slow client slows the backend read (back-pressure) instead of
//! growing memory. The usage chunk the gateway always asks for is tapped on the way
//! and shown only to a client that asked for it. If the backend's stream breaks after
//! the headers (an error, a stall past the timeout, a malformed or oversized event, an
//! end without `[DONE]`), the client's stream ends with an SSE error event, never a
//! clean `[DONE]`, and the backend's breaker counts the failure.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderValue, header};
use serde_json::Value;
use serde_json::value::RawValue;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::Deadline;
use super::cache::Kept;
use super::drive::{Ended, Ending, Spent};
use super::format::{Format, Writer};
use crate::call::ErrorCode;
use crate::config::BackendId;
use crate::protocol::anthropic;
use crate::protocol::chat::{Delta, Finish};
use crate::protocol::openai::{self, MAX_CHOICES, TextLen, Usage, UsageView, error_envelope, translate};
use crate::protocol::{Wire, sse};
use crate::routing::breaker::{Outcome, Pass};
use crate::upstream::body::{Events, Fault};

/// How a relayed stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnd {
    /// `[DONE]` relayed.
    Done,
    /// The backend's stream failed or ended early; the client got an error event.
    Broken(Fault),
    /// The client went away; the backend read was abandoned.
    ClientGone,
    /// The platform's deadline was near: the client got the `deadline` error event.
    Deadline,
}

/// What a finished stream tells the settle and record phases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayOutcome {
    pub end: StreamEnd,
    /// The usage the backend reported in the stream, if it did.
    pub usage: Option<Usage>,
    /// Bytes of completion content relayed to the client (for estimation).
    pub content_bytes: u64,
    /// Each choice's finish reason, as the stream gave them.
    pub finish_reasons: Vec<Finish>,
    /// The answer's text, kept for the response cache while it may still be kept
    /// (one choice, no tool call, within the policy's `max_entry_bytes`); `None` when
    /// nothing is kept. Boxed: most streams keep nothing.
    pub captured: Option<Box<Capture>>,
}

/// A streamed answer's text, as the response cache would keep it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capture {
    pub text: String,
    /// The most bytes it may grow to: past it, nothing is kept.
    limit: u64,
}

impl RelayOutcome {
    /// Adds `text` to what is kept, giving up past the limit.
    fn capture(&mut self, text: &str) {
        if let Some(capture) = &mut self.captured {
            if (capture.text.len() + text.len()) as u64 > capture.limit {
                self.captured = None;
            } else {
                capture.text.push_str(text);
            }
        }
    }

    /// What the stream sends is no answer the cache may keep (a tool call, another
    /// choice).
    fn give_up_capture(&mut self) {
        self.captured = None;
    }

    /// Reads a chunk's text into what is kept.
    fn capture_chunk(&mut self, event: &sse::Event) {
        let Ok(Some(chunk)) = read_chunk(event) else { return };
        for choice in chunk.get("choices").and_then(Value::as_array).into_iter().flatten() {
            let delta = &choice["delta"];
            let other_choice = choice.get("index").and_then(Value::as_u64).is_some_and(|i| i != 0);
            let present = |key: &str| delta.get(key).is_some_and(|v| !v.is_null());
            // Only plain text finished by `stop` is kept: a tool call, a refusal, audio,
            // or a finish the gateway reads as `stop` without it being one (a server's
            // own `abort`, `error`) is not.
            let finish = choice.get("finish_reason").and_then(Value::as_str);
            let odd_finish = finish.is_some_and(|f| f != "stop");
            let other_part = ["tool_calls", "function_call", "refusal", "audio"].into_iter().any(present);
            if other_choice || odd_finish || other_part {
                self.give_up_capture();
                return;
            }
            if let Some(text) = delta.get("content").and_then(Value::as_str) {
                self.capture(text);
            }
        }
    }
}

/// A stream whose first content event (or clean end) has arrived, nothing sent yet.
pub(super) struct Held {
    events: Source,
    /// Events read while holding, to forward first (the usage-only chunk a client did
    /// not ask for already left out).
    pending: Vec<Bytes>,
    outcome: RelayOutcome,
    /// The stream's end (`[DONE]`, `message_stop`, ...) is among `pending`.
    done: bool,
}

/// Reads a stream until its first event that carries content, or its `[DONE]`, before
/// `deadline`. Every way it can fail first is a `Fault`, and the caller falls back.
/// Memory stays bounded: at most `max_event_bytes` of events is held before the
/// stream counts as started.
pub(super) async fn hold(
    response: crate::upstream::Answer,
    max_event_bytes: u64,
    deadline: tokio::time::Instant,
    client_wants_usage: bool,
    wire: Wire,
    format: &Format,
    keep: Option<u64>,
) -> Result<Held, Fault> {
    let events = Events::new(response.into_body(), max_event_bytes);
    let mode = if format.native(wire) && wire == Wire::OpenAi {
        Mode::Chunks { client_wants_usage }
    } else {
        let read = match wire {
            Wire::OpenAi => Reader::OpenAi,
            Wire::Anthropic => Reader::Anthropic(anthropic::Stream::default()),
        };
        Mode::Translate { read, write: Box::new(format.writer(wire, client_wants_usage)) }
    };
    let mut held = Held {
        events: Source { events, mode },
        pending: Vec::new(),
        outcome: RelayOutcome {
            end: StreamEnd::Done,
            usage: None,
            content_bytes: 0,
            finish_reasons: Vec::new(),
            captured: keep.map(|limit| Box::new(Capture { text: String::new(), limit })),
        },
        done: false,
    };
    let mut held_bytes = 0u64;
    loop {
        let Some(step) = held.events.next(deadline, &mut held.outcome).await? else {
            return Err(ended_early());
        };
        if !step.out.is_empty() {
            held_bytes += step.out.len() as u64;
            held.pending.push(step.out);
        }
        if step.done {
            held.done = true;
            return Ok(held);
        }
        if step.content || held_bytes > max_event_bytes {
            return Ok(held);
        }
    }
}

/// A held stream and what its relay needs.
pub(super) struct Stream {
    /// The serving backend's breaker pass: the stream's end is its outcome.
    pub pass: Pass,
    pub held: Held,
    /// The backend's `timeout`, between two of its events.
    pub idle_timeout: Duration,
    /// The gateway's own response headers.
    pub headers: Vec<(&'static str, HeaderValue)>,
    /// The serving backend: the call is settled at its price.
    pub backend: BackendId,
}

impl super::drive::Relay for Stream {
    fn respond(self: Box<Self>, ending: Ending, deadline: Option<Deadline>) -> Response {
        stream(*self, ending, deadline)
    }
}

/// The streamed response, headers first. The call's end (settled on the reported
/// usage, else on an estimate of what was relayed, a stream that broke mid-way
/// included: its first byte reached the client; then recorded) runs in the pump task
/// when the stream ends, before the body completes, so it finishes inside the
/// invocation.
fn stream(stream: Stream, mut ending: Ending, deadline: Option<Deadline>) -> Response {
    let Stream { pass, mut held, idle_timeout, headers: extra, backend } = stream;
    let first = joined(std::mem::take(&mut held.pending));
    if first.is_some() {
        ending.first_byte();
    }
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    // The pump outlives the handler: it carries the call's span (its request id) along.
    let pumping = async move {
        let outcome = pump(held, &tx, idle_timeout, &mut ending, deadline.map(Deadline::cutoff)).await;
        match &outcome.end {
            StreamEnd::Broken(fault) => pass.tell(fault),
            // A client that leaves, or the platform's clock, says nothing of the
            // backend, which was answering.
            StreamEnd::Done | StreamEnd::ClientGone | StreamEnd::Deadline => pass.tell(&Outcome::Success),
        }
        let (status, code) = match &outcome.end {
            StreamEnd::Done => (200, None),
            StreamEnd::Broken(_) => (200, Some(ErrorCode::UpstreamError)),
            StreamEnd::ClientGone => (499, Some(ErrorCode::ClientClosedRequest)),
            StreamEnd::Deadline => (200, Some(ErrorCode::Deadline)),
        };
        // Only a stream that ended properly offers its text to the cache.
        let kept = match outcome.end {
            StreamEnd::Done => outcome.captured.map(|c| Box::new(Kept::Chat(c.text))),
            _ => None,
        };
        let spent = Spent::Tokens { backend, usage: outcome.usage, content_bytes: outcome.content_bytes, kept };
        let ended = Ended { status, code, spent, finish_reasons: outcome.finish_reasons };
        // Boxed, as the rare ends below: the task's own size is what each open stream
        // holds while it waits for the next event.
        Box::pin(ending.end(ended)).await;
        drop(tx);
    };
    tokio::spawn(pumping.instrument(tracing::Span::current()));
    let rest = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) });
    let body = futures_util::stream::iter(first).chain(rest).map(Ok::<_, Infallible>);
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    for (name, value) in extra {
        headers.insert(name, value);
    }
    response
}

/// Events as one chunk; `None` for none.
fn joined(events: Vec<Bytes>) -> Option<Bytes> {
    match events.len() {
        0 | 1 => events.into_iter().next(),
        _ => Some(events.concat().into()),
    }
}

/// Reads the backend's stream after the events held (already in the client's body) to
/// its end, or until `cutoff` (the platform's deadline, less the margin to settle and
/// record).
async fn pump(
    held: Held,
    tx: &mpsc::Sender<Bytes>,
    idle_timeout: Duration,
    ending: &mut Ending,
    cutoff: Option<tokio::time::Instant>,
) -> RelayOutcome {
    let Held { mut events, mut outcome, done, .. } = held;
    let past_cutoff = || cutoff.is_some_and(|c| tokio::time::Instant::now() >= c);
    if done {
        return outcome;
    }
    loop {
        let idle = tokio::time::Instant::now() + idle_timeout;
        let step = match events.next(cutoff.map_or(idle, |c| c.min(idle)), &mut outcome).await {
            Ok(Some(step)) => step,
            Ok(None) => return Box::pin(broken(outcome, &mut events, tx, ended_early())).await,
            Err(Fault::Timeout) if past_cutoff() => return Box::pin(deadline(outcome, &mut events, tx)).await,
            Err(fault) => return Box::pin(broken(outcome, &mut events, tx, fault)).await,
        };
        if !step.out.is_empty() {
            ending.first_byte();
            match send(tx, step.out, cutoff).await {
                Sent::Yes => {}
                Sent::ClientGone => return ended(outcome, StreamEnd::ClientGone),
                Sent::Deadline => return Box::pin(deadline(outcome, &mut events, tx)).await,
            }
        }
        if step.done {
            return outcome;
        }
    }
}

enum Sent {
    Yes,
    ClientGone,
    /// The client was still reading the last event when the cutoff came.
    Deadline,
}

/// Hands an event to the client's body, waiting no later than `cutoff` for a slow
/// client to make room. Written out rather than through `http::before`: this runs on
/// every event of every stream, and the helper's own future, moved in and out, cost
/// 900 instructions a 12-event stream (benches/instructions).
async fn send(tx: &mpsc::Sender<Bytes>, raw: Bytes, cutoff: Option<tokio::time::Instant>) -> Sent {
    let sent = match cutoff {
        None => tx.send(raw).await,
        Some(cutoff) => match tokio::time::timeout_at(cutoff, tx.send(raw)).await {
            Ok(sent) => sent,
            Err(_) => return Sent::Deadline,
        },
    };
    if sent.is_ok() { Sent::Yes } else { Sent::ClientGone }
}

fn ended(mut outcome: RelayOutcome, end: StreamEnd) -> RelayOutcome {
    outcome.end = end;
    outcome
}

/// Ends the client's stream before the platform does: the in-band `deadline` error
/// (offered for a moment only: a client that reads no more must not hold the settle
/// past the deadline).
async fn deadline(outcome: RelayOutcome, source: &mut Source, tx: &mpsc::Sender<Bytes>) -> RelayOutcome {
    tracing::warn!("stream ended at the function's deadline; settled on what was relayed");
    let message = "the gateway's time limit was reached; the response is incomplete";
    let event = source.error_event(ErrorCode::Deadline.as_str(), message);
    let _ = tokio::time::timeout(Duration::from_millis(200), tx.send(event)).await;
    ended(outcome, StreamEnd::Deadline)
}

/// The backend's events, as the client reads them: an OpenAI backend's chunks for a
/// Chat Completions client as they come (`Mode::Chunks`), anything else read into
/// [`Delta`]s one event at a time and written in the door's format (an event may make
/// several of the client's, or none), or relayed as it came when the formats agree.
struct Source {
    events: Events,
    mode: Mode,
}

enum Mode {
    Chunks { client_wants_usage: bool },
    Translate { read: Reader, write: Box<Writer> },
}

/// A backend's stream format, read into deltas.
enum Reader {
    OpenAi,
    Anthropic(anthropic::Stream),
}

/// What one backend event gives the client.
struct Step {
    /// The bytes to send (none: a usage chunk the client did not ask for, ...).
    out: Bytes,
    /// It carries the answer proper (text, a tool call, a finish, usage).
    content: bool,
    /// The stream's proper end.
    done: bool,
}

impl Source {
    /// The next backend event as a step, its usage and sizes tapped into `outcome`;
    /// `None` when the backend's body ended.
    async fn next(
        &mut self,
        deadline: tokio::time::Instant,
        outcome: &mut RelayOutcome,
    ) -> Result<Option<Step>, Fault> {
        let Some(event) = self.events.next(deadline).await? else {
            return Ok(None);
        };
        let (read, write) = match &mut self.mode {
            Mode::Chunks { client_wants_usage } => {
                if event.is_done() {
                    return Ok(Some(Step { out: event.raw, content: false, done: true }));
                }
                let (content, forward) = tap_chunk(&event, *client_wants_usage, outcome)?;
                if outcome.captured.is_some() {
                    outcome.capture_chunk(&event);
                }
                let out = if forward { event.raw } else { Bytes::new() };
                return Ok(Some(Step { out, content, done: false }));
            }
            Mode::Translate { read, write } => (read, write),
        };
        if event.data.is_empty() {
            // A comment or keep-alive: only a stream relayed as it came shows it.
            let out = if matches!(**write, Writer::Raw) { event.raw } else { Bytes::new() };
            return Ok(Some(Step { out, content: false, done: false }));
        }
        let deltas = match read {
            Reader::OpenAi if event.is_done() => vec![Delta::Done],
            Reader::OpenAi => read_chunk(&event)?.map(|chunk| translate::deltas(&chunk)).unwrap_or_default(),
            Reader::Anthropic(stream) => stream.next(&event.data).map_err(|e| Fault::Invalid(e.to_string()))?,
        };
        let mut step = Step { out: Bytes::new(), content: false, done: false };
        for delta in &deltas {
            match delta {
                Delta::Start { .. } => {}
                Delta::Text(text) => {
                    outcome.content_bytes += text.len() as u64;
                    outcome.capture(text);
                }
                Delta::ToolCall { name, .. } => {
                    outcome.content_bytes += name.len() as u64;
                    outcome.give_up_capture();
                }
                Delta::ToolArguments { fragment, .. } => outcome.content_bytes += fragment.len() as u64,
                Delta::Finish(finish) => {
                    if outcome.finish_reasons.len() < MAX_CHOICES as usize {
                        outcome.finish_reasons.push(*finish);
                    }
                }
                Delta::Usage(tokens) => {
                    outcome.usage = Some(Usage::from(*tokens));
                }
                Delta::Done => step.done = true,
            }
            step.content |= !matches!(delta, Delta::Start { .. });
        }
        step.out = write.write(&event.raw, deltas).map_err(Fault::Invalid)?;
        Ok(Some(step))
    }

    /// The in-band error event of the client's format.
    fn error_event(&mut self, code: &str, message: &str) -> Bytes {
        match &mut self.mode {
            Mode::Chunks { .. } => sse::event(Some("error"), &error_envelope(message, "api_error", code, None)),
            Mode::Translate { write, .. } => write.error_event(code, message),
        }
    }
}

fn ended_early() -> Fault {
    Fault::Cut("the backend ended the stream before [DONE]".to_owned())
}

/// Reads one chunk of an OpenAI stream: whether it carries content, and whether it
/// goes to the client (not the usage-only chunk the client did not ask for), its
/// usage and sizes tapped into `outcome`. A chunk of the usual shape is read through
/// [`ChunkView`], borrowed from the event's text; any other goes through a `Value`,
/// which decides what it means (a fault, or fields of unexpected types ignored).
fn tap_chunk(event: &sse::Event, client_wants_usage: bool, outcome: &mut RelayOutcome) -> Result<(bool, bool), Fault> {
    match ChunkView::read(&event.data) {
        Some(view) => Ok(view.tap(client_wants_usage, outcome)),
        None => tap_as_value(event, client_wants_usage, outcome),
    }
}

/// [`tap_chunk`] through a `Value`: any chunk, whatever its shape.
fn tap_as_value(
    event: &sse::Event,
    client_wants_usage: bool,
    outcome: &mut RelayOutcome,
) -> Result<(bool, bool), Fault> {
    let chunk = read_chunk(event)?;
    let content = chunk.as_ref().is_some_and(carries_content);
    Ok((content, tap(chunk.as_ref(), client_wants_usage, outcome)))
}

/// The fields of a chunk the relay reads, nothing else built: a chunk parsed into a
/// `Value` (a map, a `String` for every key and text) was a stream's largest cost a
/// chunk. Strict where the `Value` reading is lenient: a field of another
/// type, a repeated key or an `error` make [`ChunkView::read`] give up, and the chunk
/// is read as a `Value`, so both readings agree on every chunk (tested below).
#[derive(serde::Deserialize)]
struct ChunkView<'a> {
    #[serde(default, borrow)]
    choices: Option<Vec<ChoiceView<'a>>>,
    #[serde(default)]
    usage: Option<UsageView>,
    #[serde(default, borrow, deserialize_with = "present")]
    error: Option<&'a RawValue>,
}

#[derive(serde::Deserialize)]
struct ChoiceView<'a> {
    #[serde(default, borrow)]
    delta: Option<DeltaView<'a>>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(serde::Deserialize)]
struct DeltaView<'a> {
    #[serde(default)]
    content: Option<TextLen>,
    #[serde(default)]
    refusal: Option<TextLen>,
    /// Kept when `null` too: the `Value` reading counts a `null`'s four bytes.
    #[serde(default, borrow, deserialize_with = "present")]
    tool_calls: Option<&'a RawValue>,
    #[serde(default, borrow)]
    function_call: Option<&'a RawValue>,
}

/// A field present, whatever its value (`null` included).
fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue as serde::Deserialize>::deserialize(deserializer).map(Some)
}

impl<'a> ChunkView<'a> {
    /// `None` when the chunk is not of the usual shape (see above).
    fn read(data: &'a str) -> Option<Self> {
        if !openai::is_object(data.as_bytes()) {
            return None;
        }
        let view: ChunkView<'a> = serde_json::from_str(data).ok()?;
        view.error.is_none_or(|e| e.get() == "null").then_some(view)
    }

    /// As [`carries_content`] and [`tap`] together.
    fn tap(self, client_wants_usage: bool, outcome: &mut RelayOutcome) -> (bool, bool) {
        let mut content = false;
        let choices = self.choices.unwrap_or_default();
        for choice in &choices {
            if let Some(delta) = &choice.delta {
                if let Some(TextLen(len)) = delta.content {
                    outcome.content_bytes += len;
                    content |= len > 0;
                }
                content |= delta.refusal.as_ref().is_some_and(|TextLen(len)| *len > 0);
                if let Some(calls) = delta.tool_calls {
                    let calls = serde_json::from_str::<Value>(calls.get()).unwrap_or(Value::Null);
                    outcome.content_bytes += crate::protocol::json_len(&calls);
                    content |= !calls.is_null();
                }
                content |= delta.function_call.is_some();
            }
            if let Some(reason) = &choice.finish_reason {
                content = true;
                if outcome.finish_reasons.len() < MAX_CHOICES as usize {
                    outcome.finish_reasons.push(Finish::from_openai(reason));
                }
            }
        }
        let Some(usage) = self.usage else {
            return (content, true);
        };
        let Some(usage) = usage.usage() else {
            return (true, true);
        };
        outcome.usage = Some(usage);
        (true, client_wants_usage || !choices.is_empty())
    }
}

/// The JSON chunk an event carries; `None` for an event without data (a comment, a
/// keep-alive). Data that is not a JSON object, or an error the backend reports in the
/// stream, is a fault: relayed as is it would read as a chunk of a complete answer.
fn read_chunk(event: &sse::Event) -> Result<Option<Value>, Fault> {
    if event.data.is_empty() {
        return Ok(None);
    }
    match serde_json::from_str::<Value>(&event.data) {
        Ok(chunk @ Value::Object(_)) => match chunk.get("error") {
            Some(error) if !error.is_null() => {
                let message = error.get("message").and_then(Value::as_str).unwrap_or("no message");
                Err(Fault::Invalid(format!("the backend sent an error event: {message}")))
            }
            _ => Ok(Some(chunk)),
        },
        _ => Err(Fault::Invalid("the backend sent an event that is not a JSON object".to_owned())),
    }
}

/// Whether a chunk is the start of the answer proper: text, a tool call, a refusal, a
/// finish reason or usage. The role-only first chunk is not.
fn carries_content(chunk: &Value) -> bool {
    if chunk.get("usage").is_some_and(|u| !u.is_null()) {
        return true;
    }
    let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
        return false;
    };
    choices.iter().any(|choice| {
        let delta = &choice["delta"];
        let text = |key: &str| delta.get(key).and_then(Value::as_str).is_some_and(|t| !t.is_empty());
        text("content")
            || text("refusal")
            || delta.get("tool_calls").is_some_and(|v| !v.is_null())
            || delta.get("function_call").is_some_and(|v| !v.is_null())
            || choice.get("finish_reason").is_some_and(|v| !v.is_null())
    })
}

/// Reads usage and content sizes from one chunk; false when it must not be forwarded
/// (the usage-only chunk the client did not ask for).
fn tap(chunk: Option<&Value>, client_wants_usage: bool, outcome: &mut RelayOutcome) -> bool {
    let Some(chunk) = chunk else {
        return true;
    };
    if let Some(choices) = chunk.get("choices").and_then(Value::as_array) {
        for choice in choices {
            let delta = &choice["delta"];
            if let Some(text) = delta.get("content").and_then(Value::as_str) {
                outcome.content_bytes += text.len() as u64;
            }
            if let Some(calls) = delta.get("tool_calls") {
                outcome.content_bytes += crate::protocol::json_len(calls);
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str)
                && outcome.finish_reasons.len() < MAX_CHOICES as usize
            {
                outcome.finish_reasons.push(Finish::from_openai(reason));
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

/// Ends the client's stream with the in-band error event (never `[DONE]`).
async fn broken(
    mut outcome: RelayOutcome,
    source: &mut Source,
    tx: &mpsc::Sender<Bytes>,
    fault: Fault,
) -> RelayOutcome {
    tracing::warn!("stream broke mid-way: {fault}");
    let message = format!("{fault}; the response is incomplete");
    let event = source.error_event(ErrorCode::UpstreamError.as_str(), &message);
    // If the client is gone too, there is no one left to tell.
    let _ = tx.send(event).await;
    outcome.end = StreamEnd::Broken(fault);
    outcome
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn event(data: &str) -> sse::Event {
        let mut splitter = sse::Splitter::default();
        splitter.push(format!("data: {data}\n\n").as_bytes());
        splitter.next_event().unwrap()
    }

    #[test]
    fn the_role_chunk_carries_no_content_the_first_token_does() {
        let role =
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]});
        assert!(!carries_content(&role));
        let token = json!({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]});
        assert!(carries_content(&token));
        let tool = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]});
        assert!(carries_content(&tool));
        let stop = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        assert!(carries_content(&stop));
        assert!(carries_content(&json!({"choices": [], "usage": {"prompt_tokens": 1}})));
        assert!(!carries_content(&json!({"choices": [], "usage": null})));
    }

    #[test]
    fn malformed_and_error_events_are_faults_comments_are_not() {
        assert!(matches!(read_chunk(&event("{not json")), Err(Fault::Invalid(_))));
        assert!(matches!(read_chunk(&event("[1, 2]")), Err(Fault::Invalid(_))));
        let error = read_chunk(&event(r#"{"error": {"message": "overloaded"}}"#)).unwrap_err();
        assert!(error.to_string().contains("overloaded"), "{error}");
        let mut splitter = sse::Splitter::default();
        splitter.push(b": keep-alive\n\n");
        assert_eq!(read_chunk(&splitter.next_event().unwrap()), Ok(None));
        assert!(read_chunk(&event(r#"{"choices": []}"#)).unwrap().is_some());
    }

    #[test]
    fn the_borrowed_reading_of_a_chunk_agrees_with_the_value_reading() {
        // Read by the view: the usual shapes, escapes, nulls, unknown fields.
        let usual = [
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}],"usage":null}"#,
            r#"{"choices":[{"delta":{"content":"caf\u00e9 \"quoted\"\n"}}]}"#,
            r#"{"choices":[{"delta":{"refusal":"no"}}]}"#,
            r#"{"choices":[{"delta":{"refusal":""}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"look", "arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":null}}]}"#,
            r#"{"choices":[{"delta":{"function_call":{"name":"f"}}}]}"#,
            r#"{"choices":[{"delta":{"function_call":null,"content":null}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"stop"},{"delta":{},"finish_reason":"length"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":0}}}"#,
            r#"{"choices":null,"usage":{"prompt_tokens":3}}"#,
            r#"{"usage":{"completion_tokens":4}}"#,
            r#"{"usage":{"prompt_tokens":null}}"#,
            r#"{"choices":[{"delta":null}],"error":null}"#,
            r#"  {"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
            r#"{}"#,
        ];
        // Left to the `Value` reading: other types, repeated keys, errors, not objects.
        let unusual = [
            r#"{"choices":"none"}"#,
            r#"{"choices":[1,{"delta":{"content":"x"}}]}"#,
            r#"{"choices":[{"delta":"x"}]}"#,
            r#"{"choices":[{"delta":{"content":["part"]}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":7}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1.5,"completion_tokens":2}}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":"2"}}"#,
            r#"{"choices":[],"usage":7}"#,
            r#"{"choices":[],"choices":[{"delta":{"content":"last"}}]}"#,
            r#"{"error":{"message":"overloaded"}}"#,
            r#"[1,2]"#,
            r#"{not json"#,
            r#""#,
        ];
        for (data, usual) in usual.iter().map(|d| (d, true)).chain(unusual.iter().map(|d| (d, false))) {
            assert_eq!(ChunkView::read(data).is_some(), usual, "{data}");
            let event = sse::Event { raw: Bytes::new(), data: (*data).to_owned(), name: None };
            for wants in [false, true] {
                let fresh = || RelayOutcome {
                    end: StreamEnd::Done,
                    usage: None,
                    content_bytes: 1,
                    finish_reasons: vec![Finish::Stop],
                    captured: None,
                };
                let (mut ours, mut theirs) = (fresh(), fresh());
                let read = tap_chunk(&event, wants, &mut ours);
                assert_eq!(read, tap_as_value(&event, wants, &mut theirs), "{data}");
                assert_eq!(ours, theirs, "{data}");
            }
        }
    }

    #[test]
    fn the_usage_chunk_is_tapped_and_hidden_unless_asked_for() {
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}});
        let mut outcome = RelayOutcome {
            end: StreamEnd::Done,
            usage: None,
            content_bytes: 0,
            finish_reasons: Vec::new(),
            captured: None,
        };
        assert!(!tap(Some(&usage), false, &mut outcome));
        assert_eq!(outcome.usage, Some(Usage::new(3, 4)));
        assert!(tap(Some(&usage), true, &mut outcome));
    }
}
