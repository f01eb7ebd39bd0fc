//! Reading what a backend sends after its response head, bounded in time and memory.
//!
//! A non-streamed answer is read whole before anything reaches the client, never past
//! `ai.limits.max_response_bytes`; a stream is read event by event, never holding more
//! than `ai.limits.max_event_bytes` of one event. Whatever a backend sends, a call's
//! memory stays bounded, and every way the read can go wrong is a `Fault` that the
//! caller turns into a fallback (before the client's first byte) or an in-band error
//! event (after it).

use std::pin::Pin;

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
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

/// Reads a whole body, refusing it as soon as it passes `limit` bytes.
pub async fn read_whole(mut response: reqwest::Response, limit: u64, deadline: Instant) -> Result<Bytes, Fault> {
    let too_large =
        || Fault::Invalid(format!("the answer is larger than {limit} bytes (ai.limits.max_response_bytes)"));
    let declared = response.content_length();
    if declared.is_some_and(|len| len > limit) {
        return Err(too_large());
    }
    // Most answers arrive in one chunk: keep it without copying.
    let mut first: Option<Bytes> = None;
    let mut joined = BytesMut::new();
    loop {
        let chunk = match timeout_at(deadline, response.chunk()).await {
            Err(_) => return Err(Fault::Timeout),
            Ok(Err(e)) => return Err(Fault::Cut(format!("reading the answer failed: {}", super::without_url(&e)))),
            Ok(Ok(None)) => break,
            Ok(Ok(Some(chunk))) => chunk,
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

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// A backend's server-sent events, one at a time.
pub struct Events {
    body: ByteStream,
    splitter: Splitter,
    max_event: usize,
    ended: bool,
}

impl Events {
    pub fn new(response: reqwest::Response, max_event_bytes: u64) -> Self {
        Events {
            body: Box::pin(response.bytes_stream()),
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
            match timeout_at(deadline, self.body.next()).await {
                Err(_) => return Err(Fault::Timeout),
                Ok(None) => self.ended = true,
                Ok(Some(Err(e))) => {
                    return Err(Fault::Cut(format!("the backend stream failed: {}", super::without_url(&e))));
                }
                Ok(Some(Ok(bytes))) => self.splitter.push(&bytes),
            }
        }
    }

    fn too_large(&self) -> Fault {
        Fault::Invalid(format!("an event is larger than {} bytes (ai.limits.max_event_bytes)", self.max_event))
    }
}
