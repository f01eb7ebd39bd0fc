//! The front doors (SPEC §2, §2.1, §2.2): what differs between a call that came in as
//! Chat Completions, as a Responses request or as an Anthropic Messages request is the
//! format its answer goes back in. Everything else (identity, routing, budget,
//! dispatch with fallback, relay, settle, record) is the one chat path.
//!
//! A backend that speaks the door's own format (OpenAI for chat, Anthropic for
//! messages) is relayed as it answers; any other answer is read into the chat model
//! ([`Completion`], [`Delta`]s) and written in the door's format, one event at a time.

use bytes::{Bytes, BytesMut};
use serde_json::Value;

use crate::protocol::chat::{Completion, Delta};
use crate::protocol::openai::{Answer, error_envelope, translate};
use crate::protocol::responses::{self, Echo};
use crate::protocol::{Wire, anthropic, messages, sse, unix_seconds};

/// The format a call's answer goes back in (by the door it came in by), and what it
/// needs.
#[derive(Debug, Clone)]
pub(super) enum Format {
    Chat,
    /// `id`: the response's id (from the request id); `limit`: what a stream may keep
    /// of its output for the `.done` events (`ai.limits.max_response_bytes`).
    Responses {
        id: String,
        echo: Echo,
        limit: u64,
    },
    Messages,
}

impl Format {
    /// Whether a backend of this format answers in the door's own.
    pub fn native(&self, wire: Wire) -> bool {
        matches!((self, wire), (Format::Chat, Wire::OpenAi) | (Format::Messages, Wire::Anthropic))
    }

    /// A backend's successful answer, read whole, as the client's body and what the
    /// gateway reads of it (with the answer itself when `keep`: for the response
    /// cache); `None` when it is not a valid answer.
    pub fn answer(&self, wire: Wire, body: Bytes, keep: bool) -> Option<(Bytes, Answer, Option<Box<Completion>>)> {
        if let (Format::Chat, Wire::OpenAi) = (self, wire) {
            let answer = Answer::read(&body)?;
            let completion = if keep { translate::read_completion(&body).map(Box::new) } else { None };
            return Some((body, answer, completion));
        }
        let completion = match wire {
            Wire::OpenAi => translate::read_completion(&body)?,
            Wire::Anthropic => anthropic::completion(&body)?,
        };
        let answer = Answer::of(&completion);
        if self.native(wire) {
            return Some((body, answer, keep.then(|| Box::new(completion))));
        }
        let rendered = Bytes::from(self.render(&completion).to_string());
        Some((rendered, answer, keep.then(|| Box::new(completion))))
    }

    /// An answer in the door's format.
    pub fn render(&self, completion: &Completion) -> Value {
        match self {
            Format::Chat => translate::completion(completion, unix_seconds()),
            Format::Responses { id, echo, .. } => responses::answer(id, completion, echo, unix_seconds()),
            Format::Messages => messages::message(completion),
        }
    }

    /// A backend's own refusal (4xx), in the door's envelope (as it came when the
    /// formats agree).
    pub fn refusal(&self, wire: Wire, status: u16, body: Bytes) -> Bytes {
        match (self, wire) {
            (Format::Messages, Wire::Anthropic) | (Format::Chat | Format::Responses { .. }, Wire::OpenAi) => body,
            (Format::Messages, Wire::OpenAi) => Bytes::from(messages::error_from_openai(status, &body).to_string()),
            (Format::Chat | Format::Responses { .. }, Wire::Anthropic) => {
                Bytes::from(anthropic::error(status, &body).to_string())
            }
        }
    }

    /// How the stream of a backend of `wire` reaches this door's client.
    pub fn writer(&self, wire: Wire, client_wants_usage: bool) -> Writer {
        match self {
            _ if self.native(wire) && wire == Wire::Anthropic => Writer::Raw,
            Format::Chat => Writer::Chat { chunks: translate::Chunks::new(unix_seconds()), client_wants_usage },
            Format::Responses { id, echo, limit } => {
                Writer::Responses(responses::Events::new(id.clone(), echo.clone(), unix_seconds(), *limit))
            }
            Format::Messages => Writer::Messages(messages::Events::default()),
        }
    }
}

/// Writes a translated stream's [`Delta`]s for the client.
pub(super) enum Writer {
    /// The backend's events as they came (their deltas read for the tap only).
    Raw,
    Chat {
        chunks: translate::Chunks,
        client_wants_usage: bool,
    },
    Responses(responses::Events),
    Messages(messages::Events),
}

impl Writer {
    /// The events `deltas` make, after `raw` (the backend's event) for [`Writer::Raw`].
    pub fn write(&mut self, raw: &Bytes, deltas: Vec<Delta>) -> Result<Bytes, String> {
        let mut out = BytesMut::new();
        match self {
            Writer::Raw => return Ok(raw.clone()),
            Writer::Chat { chunks, client_wants_usage } => {
                for delta in deltas {
                    if matches!(delta, Delta::Usage(_)) && !*client_wants_usage {
                        continue;
                    }
                    let data = chunks.chunk(delta).map_or_else(|| "[DONE]".to_owned(), |c| c.to_string());
                    out.extend_from_slice(format!("data: {data}\n\n").as_bytes());
                }
            }
            Writer::Responses(events) => {
                for delta in deltas {
                    events.write(delta, &mut out)?;
                }
            }
            Writer::Messages(events) => {
                for delta in deltas {
                    events.write(delta, &mut out)?;
                }
            }
        }
        Ok(out.freeze())
    }

    /// The in-band error event a stream that cannot end properly ends with, in the
    /// door's format, carrying the gateway's `code`.
    pub fn error_event(&mut self, code: &str, message: &str) -> Bytes {
        match self {
            Writer::Responses(events) => events.error_event(code, message),
            Writer::Raw | Writer::Messages(_) => messages::error_event(code, message),
            Writer::Chat { .. } => sse::event(Some("error"), &error_envelope(message, "api_error", code, None)),
        }
    }
}
