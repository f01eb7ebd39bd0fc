//! The OpenAI wire shapes the fake answers with, as pure functions.
//!
//! Everything here is a function of the request and its scenario (ids and
//! timestamps are passed in), so tests can assert exact contents and token
//! counts: a "token" is a whitespace-separated word, plus 3 per message on the
//! prompt side; completion tokens count every choice.

use serde::Deserialize;
use serde_json::{Value, json};

use crate::scenario::Scenario;

/// The most choices (`n`) a request may ask for, as with OpenAI.
pub(crate) const MAX_CHOICES: usize = 128;

/// Stands for the content of a `huge_mb` answer in its serialized JSON: the
/// server sends the text before it, the content made on the fly, then the
/// text after it, so the content never exists in memory.
pub(crate) const HUGE_MARK: &str = "@@fake-model-huge-content@@";

/// The id of the tool call a `tool_use` reply makes.
pub(crate) const TOOL_CALL_ID: &str = "call_fake_1";

/// The fields of a chat request the fake looks at; the rest is ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Vec<Message>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub n: Option<usize>,
    #[serde(default)]
    pub tools: Vec<Value>,
    pub tool_choice: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Message {
    #[serde(default)]
    pub role: String,
    #[serde(default)]
    pub content: Value,
}

#[derive(Debug, Deserialize)]
pub(crate) struct StreamOptions {
    pub include_usage: Option<bool>,
}

impl ChatRequest {
    pub fn wants_stream(&self) -> bool {
        self.stream == Some(true)
    }

    pub fn wants_usage_chunk(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage) == Some(true)
    }

    /// How many choices to answer with (`n`, default 1).
    pub fn choices(&self) -> usize {
        self.n.unwrap_or(1)
    }

    fn prompt_tokens(&self) -> usize {
        self.messages.iter().map(|m| words(&message_text(&m.content)) + 3).sum()
    }
}

/// What the fake "model" answers, before it is shaped into a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    /// The content of every choice.
    pub content: String,
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    /// The tokens of one choice.
    pub choice_tokens: usize,
    /// How many identical choices the answer has.
    pub choices: usize,
    /// Under `tool_use`: the function called (name, JSON arguments) instead of
    /// content.
    pub tool_call: Option<(String, String)>,
    /// Under `cache`: the prompt tokens read from the prompt cache (half the
    /// prompt), reported as `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: usize,
}

impl Reply {
    /// Echo the last user message (first 40 characters), or `words` numbered
    /// words if the scenario asks, cut to the request's token limit if it has
    /// one and the scenario does not say to ignore it.
    pub fn for_request(request: &ChatRequest, scenario: &Scenario) -> Reply {
        let mut reply = Self::uncached(request, scenario);
        if scenario.cache {
            reply.cached_tokens = reply.prompt_tokens / 2;
        }
        reply
    }

    fn uncached(request: &ChatRequest, scenario: &Scenario) -> Reply {
        let content = match scenario.words {
            Some(n) => (1..=n).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" "),
            None => {
                let said: String = request
                    .messages
                    .iter()
                    .rev()
                    .find(|m| m.role == "user")
                    .map(|m| message_text(&m.content))
                    .unwrap_or_default()
                    .chars()
                    .take(40)
                    .collect();
                format!("Hello from fake-model! You said: {said}")
            }
        };
        let prompt_tokens = request.prompt_tokens();
        let choices = request.choices();
        if let Some(reply) = Self::tool_reply(request, scenario, prompt_tokens) {
            return reply;
        }
        let limit = [request.max_tokens, request.max_completion_tokens].into_iter().flatten().min();
        match limit.filter(|_| !scenario.ignore_limit) {
            Some(limit) if limit < words(&content) => Reply {
                content: content.split_whitespace().take(limit).collect::<Vec<_>>().join(" "),
                finish_reason: "length",
                prompt_tokens,
                choice_tokens: limit,
                choices,
                tool_call: None,
                cached_tokens: 0,
            },
            _ => Reply {
                choice_tokens: words(&content),
                content,
                finish_reason: "stop",
                prompt_tokens,
                choices,
                tool_call: None,
                cached_tokens: 0,
            },
        }
    }

    /// Under `tool_use`, a request with tools (and `tool_choice` not `none`)
    /// calls the first tool (or the one `tool_choice` names) with `{"echo":
    /// <last user text>}`; once the last message is a tool's result, the reply
    /// says what the tool said (`The tool said: <result>`).
    fn tool_reply(request: &ChatRequest, scenario: &Scenario, prompt_tokens: usize) -> Option<Reply> {
        let choice = request.tool_choice.as_ref();
        if !scenario.tool_use || request.tools.is_empty() || choice.and_then(Value::as_str) == Some("none") {
            return None;
        }
        let last = request.messages.last()?;
        if last.role == "tool" {
            let content = format!("The tool said: {}", message_text(&last.content));
            let choice_tokens = words(&content);
            return Some(Reply {
                content,
                finish_reason: "stop",
                prompt_tokens,
                choice_tokens,
                choices: 1,
                tool_call: None,
                cached_tokens: 0,
            });
        }
        let named = choice.and_then(|c| c.pointer("/function/name")).and_then(Value::as_str);
        let first = request.tools[0].pointer("/function/name").and_then(Value::as_str);
        let name = named.or(first)?.to_owned();
        let said = request.messages.iter().rev().find(|m| m.role == "user").map(|m| message_text(&m.content));
        let arguments = json!({"echo": said.unwrap_or_default()}).to_string();
        Some(Reply {
            content: String::new(),
            finish_reason: "tool_calls",
            prompt_tokens,
            choice_tokens: words(&arguments),
            choices: 1,
            tool_call: Some((name, arguments)),
            cached_tokens: 0,
        })
    }

    /// The reply of `huge_mb`: one choice of one long word (one token),
    /// whatever the limits; its content is [`HUGE_MARK`], for the server to
    /// replace while sending.
    pub fn huge(request: &ChatRequest) -> Reply {
        Reply {
            content: HUGE_MARK.to_owned(),
            finish_reason: "stop",
            prompt_tokens: request.prompt_tokens(),
            choice_tokens: 1,
            choices: 1,
            tool_call: None,
            cached_tokens: 0,
        }
    }

    fn usage(&self) -> Value {
        let completion_tokens = self.choice_tokens * self.choices;
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        });
        if self.cached_tokens > 0 {
            usage["prompt_tokens_details"] = json!({"cached_tokens": self.cached_tokens, "audio_tokens": 0});
        }
        usage
    }
}

/// The identity shared by every object of one completion.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// A non-streamed `chat.completion` object.
pub(crate) fn completion(meta: &Meta, reply: &Reply, with_usage: bool) -> Value {
    let choices: Vec<Value> = (0..reply.choices)
        .map(|index| {
            let message = match &reply.tool_call {
                Some((name, arguments)) => json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": TOOL_CALL_ID, "type": "function", "function": {"name": name, "arguments": arguments}}
                ]}),
                None => json!({"role": "assistant", "content": reply.content}),
            };
            json!({
                "index": index,
                "message": message,
                "logprobs": null,
                "finish_reason": reply.finish_reason,
            })
        })
        .collect();
    let mut body = json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
    });
    if with_usage {
        body["usage"] = reply.usage();
    }
    body
}

/// The `chat.completion.chunk` objects of a stream as its steps, in order:
/// the role step, `content_chunks` content steps, the finish step and, if
/// `with_usage`, the usage chunk (`choices: []`). Each step but the last holds
/// one chunk per choice, as OpenAI sends them for `n` > 1. Like OpenAI, when
/// usage is on every other chunk carries `"usage": null`. `[DONE]` is the
/// transport's business.
pub(crate) fn stream_chunks(meta: &Meta, reply: &Reply, content_chunks: usize, with_usage: bool) -> Vec<Vec<Value>> {
    let step = |delta: Value, finish_reason: Option<&str>| -> Vec<Value> {
        (0..reply.choices)
            .map(|index| {
                let mut chunk = json!({
                    "id": meta.id,
                    "object": "chat.completion.chunk",
                    "created": meta.created,
                    "model": meta.model,
                    "choices": [{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
                });
                if with_usage {
                    chunk["usage"] = Value::Null;
                }
                chunk
            })
            .collect()
    };
    let mut steps = vec![step(json!({"role": "assistant", "content": ""}), None)];
    match &reply.tool_call {
        Some((name, arguments)) => {
            let call = json!({"index": 0, "id": TOOL_CALL_ID, "type": "function", "function": {"name": name, "arguments": ""}});
            steps.push(step(json!({"tool_calls": [call]}), None));
            steps.extend(
                split_in(arguments, content_chunks)
                    .into_iter()
                    .map(|piece| step(json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}), None)),
            );
        }
        None => steps.extend(
            split_in(&reply.content, content_chunks).into_iter().map(|piece| step(json!({ "content": piece }), None)),
        ),
    }
    steps.push(step(json!({}), Some(reply.finish_reason)));
    if with_usage {
        steps.push(vec![json!({
            "id": meta.id,
            "object": "chat.completion.chunk",
            "created": meta.created,
            "model": meta.model,
            "choices": [],
            "usage": reply.usage(),
        })]);
    }
    steps
}

/// The inputs of an embeddings request as (text, token count), or `None` if
/// `input` is not a string, a token array, or a non-empty array of either.
pub(crate) fn embedding_inputs(input: &Value) -> Option<Vec<(String, usize)>> {
    let tokens = |items: &[Value]| -> Option<(String, usize)> {
        let ids: Option<Vec<String>> = items.iter().map(|t| t.as_u64().map(|t| t.to_string())).collect();
        ids.map(|ids| (ids.join(" "), ids.len()))
    };
    match input {
        Value::String(text) => Some(vec![(text.clone(), words(text))]),
        Value::Array(items) if items.is_empty() => None,
        Value::Array(items) if items.iter().all(Value::is_number) => tokens(items).map(|t| vec![t]),
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(text) => Some((text.clone(), words(text))),
                Value::Array(ids) => tokens(ids),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// An `embeddings` list response: [`crate::similar`]'s vectors for a model it is
/// chosen by, [`embedding_of`]'s otherwise.
pub(crate) fn embeddings(model: &str, inputs: &[(String, usize)]) -> Value {
    let embed = if crate::similar::chosen_by(model) { crate::similar::embedding } else { embedding_of };
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, (text, _))| json!({"object": "embedding", "index": index, "embedding": embed(text)}))
        .collect();
    let tokens: usize = inputs.iter().map(|(_, n)| n).sum();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })
}

/// The `GET /v1/models` list.
pub(crate) fn models() -> Value {
    let model = |id: &str| json!({"id": id, "object": "model", "created": 0, "owned_by": "fake-model"});
    json!({"object": "list", "data": [model("fake-chat"), model("fake-embed")]})
}

/// The OpenAI error envelope.
pub(crate) fn error(message: &str, kind: &str, code: &str, param: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

/// Eight numbers in [-1, 1) derived from the text alone (FNV-1a, then
/// SplitMix64 per dimension): equal texts embed equally, others almost never.
pub(crate) fn embedding_of(text: &str) -> Vec<f32> {
    let seed = text
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3));
    (0..8_u64)
        .map(|dim| {
            let mut x = seed.wrapping_add(dim.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^= x >> 31;
            // The top 24 bits are exact in an f32.
            (x >> 40) as f32 / (1_u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// The text of a message: its string content, or its text parts joined.
fn message_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter(|p| p["type"] == "text")
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

pub(crate) fn words(text: &str) -> usize {
    text.split_whitespace().count()
}

/// Split `text` into `n` consecutive pieces of near-equal character counts
/// (some empty if the text is shorter than `n`); they concatenate to `text`.
pub(crate) fn split_in(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    (0..n).map(|i| chars[i * chars.len() / n..(i + 1) * chars.len() / n].iter().collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_in_keeps_every_character() {
        let text = "Hello from fake-model! You said: héllo";
        for n in [1, 2, 3, 5, 7, 100] {
            let pieces = split_in(text, n);
            assert_eq!(pieces.len(), n);
            assert_eq!(pieces.concat(), text);
        }
        assert!(split_in(text, 0).is_empty());
    }

    #[test]
    fn embeddings_are_deterministic_and_bounded() {
        let a = embedding_of("hello");
        assert_eq!(a, embedding_of("hello"));
        assert_ne!(a, embedding_of("hello!"));
        assert_eq!(a.len(), 8);
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
    }

    #[test]
    fn embedding_inputs_accept_the_openai_forms() {
        assert_eq!(embedding_inputs(&json!("a b")).unwrap(), vec![("a b".into(), 2)]);
        assert_eq!(embedding_inputs(&json!(["a", "b c"])).unwrap().len(), 2);
        assert_eq!(embedding_inputs(&json!([1, 2, 3])).unwrap(), vec![("1 2 3".into(), 3)]);
        assert_eq!(embedding_inputs(&json!([[1], [2, 3]])).unwrap()[1].1, 2);
        assert!(embedding_inputs(&json!([])).is_none());
        assert!(embedding_inputs(&json!(42)).is_none());
        assert!(embedding_inputs(&json!([{"x": 1}])).is_none());
    }
}
