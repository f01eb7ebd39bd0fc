//! Wire formats: one model of a chat call (`chat`), and a translator per format
//! spoken (`openai` inbound and outbound, `anthropic` outbound), with the server-sent
//! events they stream.

pub mod anthropic;
pub mod chat;
pub mod grpc;
pub mod openai;
pub mod sse;
pub mod vision;

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
