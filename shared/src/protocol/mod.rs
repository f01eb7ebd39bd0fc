//! Wire formats: one model of a chat call (`chat`), and a translator per format
//! spoken (`openai` inbound and outbound, `anthropic` outbound, `responses` and
//! `messages` inbound), with the server-sent events they stream.

pub mod anthropic;
pub mod chat;
pub mod grpc;
pub mod messages;
pub mod openai;
pub mod responses;
pub mod sse;
pub mod vision;

use openai::ImageRef;

/// What the call phases read of a request, whatever door it came by: the model asked
/// for, the allowance, and the measure of its prompt (for the budget's upper bound and
/// the vision checks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Measure {
    pub model: String,
    pub stream: bool,
    /// The completion limit the client set, in its format's field.
    pub max_tokens: Option<u64>,
    pub images: Vec<ImageRef>,
    /// Bytes of text across the prompt (tool definitions, calls and results
    /// included): an upper bound of their token count.
    pub prompt_text_bytes: u64,
    pub message_count: u64,
    /// The end user the client names: hashed before it goes anywhere.
    pub user: Option<String>,
}

/// The wire format a backend speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    OpenAi,
    Anthropic,
}

/// Now, in the seconds of a Chat Completions `created`.
pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
