//! Reading what a backend sends after its response head, bounded in time and memory.
//!
//! A non-streamed answer is read whole before anything reaches the client, never past
//! `ai.limits.max_response_bytes`; a stream is read event by event, never holding more
//! than `ai.limits.max_event_bytes` of one event. Whatever a backend sends, a call's
//! memory stays bounded, and every way the read can go wrong is a `Fault` that the
//! caller turns into a fallback (before the client's first byte) or an in-band error
//! event (after it).

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Body;
use tokio::time::{Instant, timeout_at};

use crate::protocol::sse::{Event, Splitter};

/// Why reading an answer failed after its head arrived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Fault {
    /// Nothing came before the deadline: a stalled body or stream.
    #[error("the backend stalled")]
    Timeout,
    /// The connection broke, or the stream ended before its proper end.
    #[error("{0}")]
    Cut(String),
    /// What came is not a valid answer (malformed, an error event, over a limit).
    #[error("{0}")]
    Invalid(String),
}

/// The next piece of data of `body` (trailers skipped), `None` at its end.
async fn next_data<B>(body: &mut B) -> Option<Result<Bytes, B::Error>>
where
    B: Body<Data = Bytes> + Unpin,
{
    loop {
        match body.frame().await? {
            Ok(frame) => match frame.into_data() {
                Ok(data) => return Some(Ok(data)),
                Err(_trailers) => continue,
            },
            Err(e) => return Some(Err(e)),
        }
    }
}

/// Reads a whole body, refusing it as soon as it passes `limit` bytes.
pub async fn read_whole<B>(mut body: B, limit: u64, deadline: Instant) -> Result<Bytes, Fault>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + 'static,
{
    let too_large =
        || Fault::Invalid(format!("the answer is larger than {limit} bytes (ai.limits.max_response_bytes)"));
    let declared = body.size_hint().exact();
    if declared.is_some_and(|len| len > limit) {
        return Err(too_large());
    }
    // Most answers arrive in one chunk: keep it without copying.
    let mut first: Option<Bytes> = None;
    let mut joined = BytesMut::new();
    loop {
        let chunk = match timeout_at(deadline, next_data(&mut body)).await {
            Err(_) => return Err(Fault::Timeout),
            Ok(Some(Err(e))) => return Err(Fault::Cut(format!("reading the answer failed: {}", super::describe(&e)))),
            Ok(None) => break,
            Ok(Some(Ok(chunk))) => chunk,
        };
        let read = first.as_ref().map_or(0, Bytes::len) + joined.len() + chunk.len();
        if read as u64 > limit {
            return Err(too_large());
        }
        match first.take() {
            None if joined.is_empty() => first = Some(chunk),
            None => joined.extend_from_slice(&chunk),
            Some(previous) => {
                let capacity = declared.map_or(read, |len| usize::try_from(len).unwrap_or(read));
                joined.reserve(capacity);
                joined.extend_from_slice(&previous);
                joined.extend_from_slice(&chunk);
            }
        }
    }
    Ok(first.unwrap_or_else(|| joined.freeze()))
}

/// A backend's server-sent events, one at a time, from its body (`B`: a backend's
/// answer, or any body in tests).
pub struct Events<B = super::AnswerBody> {
    body: B,
    splitter: Splitter,
    max_event: usize,
    ended: bool,
}

impl<B> Events<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + 'static,
{
    pub fn new(body: B, max_event_bytes: u64) -> Self {
        Events {
            body,
            splitter: Splitter::default(),
            max_event: usize::try_from(max_event_bytes).unwrap_or(usize::MAX),
            ended: false,
        }
    }

    /// The next complete event; `None` when the body ended (whatever was left without
    /// an end is dropped: the caller decides whether an end without `[DONE]` is a cut).
    pub async fn next(&mut self, deadline: Instant) -> Result<Option<Event>, Fault> {
        loop {
            if let Some(event) = self.splitter.next_event() {
                if event.raw.len() > self.max_event {
                    return Err(self.too_large());
                }
                return Ok(Some(event));
            }
            if self.splitter.pending().len() > self.max_event {
                return Err(self.too_large());
            }
            if self.ended {
                return Ok(None);
            }
            match timeout_at(deadline, next_data(&mut self.body)).await {
                Err(_) => return Err(Fault::Timeout),
                Ok(None) => self.ended = true,
                Ok(Some(Err(e))) => {
                    return Err(Fault::Cut(format!("the backend stream failed: {}", super::describe(&e))));
                }
                Ok(Some(Ok(bytes))) => self.splitter.push(&bytes),
            }
        }
    }

    fn too_large(&self) -> Fault {
        Fault::Invalid(format!("an event is larger than {} bytes (ai.limits.max_event_bytes)", self.max_event))
    }
}
