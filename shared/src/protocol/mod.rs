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

/// The length of `value` written as compact JSON (what `value.to_string().len()` gives),
/// counted without writing it anywhere: tools, tool calls and schemas are measured as
/// prompt text, and can be large.
pub fn json_len(value: &serde_json::Value) -> u64 {
    struct Counting(u64);
    impl std::io::Write for Counting {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len() as u64;
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counting = Counting(0);
    // A `Value` (string keys only) written to a writer that never fails cannot fail.
    let _ = serde_json::to_writer(&mut counting, value);
    counting.0
}

/// Now, in the seconds of a Chat Completions `created`.
pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn json_len_is_the_written_lengths() {
        for value in [
            json!(null),
            json!("é\"\n\u{1}"),
            json!([{"type": "function", "function": {"name": "f", "parameters": {"a": [1, 2.5, -3]}}}]),
            json!({}),
        ] {
            assert_eq!(super::json_len(&value), value.to_string().len() as u64, "{value}");
        }
    }
}
