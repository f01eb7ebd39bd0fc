//! One chat call as the gateway understands it, whatever wire format carried it.
//!
//! Each wire format has a translator on each side it is spoken on. Inbound, a client's
//! request becomes a [`Call`] and the answer goes back in the client's format: OpenAI
//! Chat Completions (`openai/translate.rs`), the Responses API (`responses.rs`) and
//! Anthropic Messages (`messages.rs`), SPEC §2, §2.1, §2.2. Outbound, a [`Call`]
//! becomes a backend's request, and the backend's answer a [`Completion`], or a stream
//! of [`Delta`]s, one backend event at a time: OpenAI (`openai/translate.rs`) and
//! Anthropic (`anthropic.rs`).
//!
//! When both sides speak the same format (a Chat Completions client and an OpenAI
//! backend, an Anthropic Messages client and an `anthropic` backend), the request is
//! forwarded as the client sent it but for the fields the gateway owns (the model, the
//! allowance, usage in streams): the identity translation, which keeps every field a
//! provider adds that this model does not name, and costs no re-encoding on the hot
//! path (`http/format.rs` decides).

use serde_json::Value;

/// A chat request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Call {
    /// The system (and developer) instructions, in order.
    pub system: Vec<String>,
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
    pub tool_choice: Option<ToolChoice>,
    /// The completion allowance the client asked for (the gateway sends its own).
    pub max_tokens: Option<u64>,
    pub stop: Vec<String>,
    /// Sampling parameters, as the client wrote them (they are not money).
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub stream: bool,
    /// How many alternative completions the client asked for.
    pub choices: u64,
    /// The end user the client names, if any.
    pub user: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
}

/// One turn of the conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    pub parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Text(String),
    Image(Image),
    /// The model asked for a tool: `arguments` is the JSON text it wrote.
    ToolCall(ToolCall),
    /// What a tool answered to the call `call_id`.
    ToolResult {
        call_id: String,
        content: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    /// Inline bytes, base64 as a `data:` URI carries them.
    Data { media_type: String, base64: String },
    /// An https URL (its origin already checked by `vision`).
    Url(String),
}

impl Image {
    /// `data:<type>;base64,<data>` or an URL.
    pub fn from_url(url: &str) -> Image {
        url.strip_prefix("data:")
            .and_then(|rest| rest.split_once(";base64,"))
            .map(|(media_type, data)| Image::Data { media_type: media_type.to_owned(), base64: data.to_owned() })
            .unwrap_or_else(|| Image::Url(url.to_owned()))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The JSON Schema of its arguments.
    pub parameters: Value,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    /// Some tool must be called.
    Required,
    Named(String),
}

/// Why the model stopped, in OpenAI's words (the inbound format today).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    ToolCalls,
    ContentFilter,
}

impl Finish {
    /// An OpenAI `finish_reason`; one it does not name (a server's own) reads as `stop`.
    pub fn from_openai(reason: &str) -> Finish {
        match reason {
            "length" => Finish::Length,
            "tool_calls" | "function_call" => Finish::ToolCalls,
            "content_filter" => Finish::ContentFilter,
            _ => Finish::Stop,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
            Finish::ContentFilter => "content_filter",
        }
    }
}

/// Tokens as a backend counts them. `input` counts every prompt token, those read
/// from or written to a prompt cache included (each of those also counted apart).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
    pub cache_read: u64,
    pub cache_write: u64,
}

impl From<Tokens> for crate::call::Usage {
    fn from(tokens: Tokens) -> Self {
        crate::call::Usage {
            prompt_tokens: tokens.input,
            completion_tokens: tokens.output,
            cached_tokens: tokens.cache_read.min(tokens.input),
            cache_write_tokens: tokens.cache_write.min(tokens.input.saturating_sub(tokens.cache_read)),
        }
    }
}

/// A non-streamed answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub id: String,
    pub model: String,
    pub text: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    pub finish: Option<Finish>,
    pub usage: Option<Tokens>,
}

/// One step of a streamed answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// The answer begins: its id and the model serving it.
    Start {
        id: String,
        model: String,
    },
    Text(String),
    /// The `index`-th tool call of the answer begins.
    ToolCall {
        index: u32,
        id: String,
        name: String,
    },
    /// More of the `index`-th tool call's arguments (JSON text, in pieces).
    ToolArguments {
        index: u32,
        fragment: String,
    },
    Finish(Finish),
    /// The answer's usage, once known (at its end).
    Usage(Tokens),
    /// The answer is complete.
    Done,
}
