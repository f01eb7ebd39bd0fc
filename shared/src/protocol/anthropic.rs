//! The Anthropic Messages translator, outbound: a [`Call`] into a `POST /v1/messages`
//! body, its answer into a [`Completion`], its stream's events into [`Delta`]s one
//! event at a time, and its error envelope into OpenAI's.

use serde_json::{Map, Value, json};

use super::chat::{Call, Completion, Delta, Finish, Image, Part, Role, Tokens, ToolCall, ToolChoice};
use super::openai::{InvalidRequest, error_envelope};

/// The API version sent as `anthropic-version`: the one whose shapes this module reads.
pub const VERSION: &str = "2023-06-01";
/// The path under the backend's `url`.
pub const PATH: &str = "/v1/messages";

/// The request body for `model`, with the gateway's `allowance` as `max_tokens` (the
/// API requires it). Consecutive turns of one role are merged into one message, as
/// the API wants them alternating (a run of tool results is one user turn).
pub fn request(call: &Call, model: &str, allowance: u64) -> Result<Vec<u8>, InvalidRequest> {
    if call.choices > 1 {
        let message = "`n` above 1 is not served by this backend (an Anthropic Messages API)";
        return Err(InvalidRequest { message: message.into(), param: Some("n") });
    }
    let mut messages: Vec<(Role, Vec<Value>)> = Vec::new();
    for message in &call.messages {
        let blocks = message.parts.iter().map(block).collect::<Vec<_>>();
        match messages.last_mut() {
            Some((role, merged)) if *role == message.role => merged.extend(blocks),
            _ => messages.push((message.role, blocks)),
        }
    }
    let messages: Vec<Value> = messages
        .into_iter()
        .map(|(role, content)| {
            let role = if role == Role::User { "user" } else { "assistant" };
            json!({"role": role, "content": content})
        })
        .collect();
    let mut body = Map::new();
    body.insert("model".into(), model.into());
    body.insert("max_tokens".into(), allowance.into());
    if !call.system.is_empty() {
        body.insert("system".into(), call.system.join("\n\n").into());
    }
    body.insert("messages".into(), messages.into());
    if !call.stop.is_empty() {
        body.insert("stop_sequences".into(), call.stop.clone().into());
    }
    if let Some(t) = call.temperature {
        body.insert("temperature".into(), t.into());
    }
    if let Some(p) = call.top_p {
        body.insert("top_p".into(), p.into());
    }
    if !call.tools.is_empty() {
        let tools = call.tools.iter().map(|t| {
            let mut tool = json!({"name": t.name, "input_schema": t.parameters});
            if let Some(d) = &t.description {
                tool["description"] = d.clone().into();
            }
            tool
        });
        body.insert("tools".into(), tools.collect());
    }
    if let Some(choice) = &call.tool_choice {
        let choice = match choice {
            ToolChoice::Auto => json!({"type": "auto"}),
            ToolChoice::None => json!({"type": "none"}),
            ToolChoice::Required => json!({"type": "any"}),
            ToolChoice::Named(name) => json!({"type": "tool", "name": name}),
        };
        body.insert("tool_choice".into(), choice);
    }
    if call.stream {
        body.insert("stream".into(), true.into());
    }
    if let Some(user) = &call.user {
        body.insert("metadata".into(), json!({"user_id": user}));
    }
    serde_json::to_vec(&body).map_err(|e| InvalidRequest { message: e.to_string(), param: None })
}

fn block(part: &Part) -> Value {
    match part {
        Part::Text(text) => json!({"type": "text", "text": text}),
        Part::Image(Image::Data { media_type, base64 }) => {
            json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": base64}})
        }
        Part::Image(Image::Url(url)) => json!({"type": "image", "source": {"type": "url", "url": url}}),
        Part::ToolCall(call) => {
            // The model wrote the arguments as JSON text; the API wants the object.
            let input = serde_json::from_str::<Value>(&call.arguments)
                .ok()
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}));
            json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input})
        }
        Part::ToolResult { call_id, content } => {
            json!({"type": "tool_result", "tool_use_id": call_id, "content": content})
        }
    }
}

/// `stop_reason` in OpenAI's words: a stop sequence, a pause or anything new is a
/// `stop`; a refusal is a `content_filter`.
fn finish(reason: &str) -> Finish {
    match reason {
        "max_tokens" | "model_context_window_exceeded" => Finish::Length,
        "tool_use" => Finish::ToolCalls,
        "refusal" => Finish::ContentFilter,
        _ => Finish::Stop,
    }
}

/// Usage as the API reports it: `input_tokens` excludes the cached prompt tokens,
/// which are billed too, so they are added to the input.
fn tokens(usage: &Value) -> Option<Tokens> {
    let get = |key: &str| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
    usage.get("input_tokens").and_then(Value::as_u64)?;
    let (cache_read, cache_write) = (get("cache_read_input_tokens"), get("cache_creation_input_tokens"));
    Some(Tokens {
        input: get("input_tokens").saturating_add(cache_read).saturating_add(cache_write),
        output: get("output_tokens"),
        cache_read,
        cache_write,
    })
}

/// A non-streamed answer; `None` when it is not a Messages API `message`.
pub fn completion(body: &[u8]) -> Option<Completion> {
    let answer: Value = serde_json::from_slice(body).ok()?;
    if answer.get("type").and_then(Value::as_str) != Some("message") {
        return None;
    }
    let mut text: Option<String> = None;
    let mut tool_calls = Vec::new();
    for block in answer.get("content")?.as_array()? {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => text.get_or_insert_default().push_str(block.get("text")?.as_str()?),
            Some("tool_use") => tool_calls.push(ToolCall {
                id: block.get("id")?.as_str()?.to_owned(),
                name: block.get("name")?.as_str()?.to_owned(),
                arguments: block.get("input").map_or_else(|| "{}".to_owned(), Value::to_string),
            }),
            // Thinking and other blocks have no place in a Chat Completions answer.
            _ => {}
        }
    }
    Some(Completion {
        id: answer.get("id").and_then(Value::as_str).unwrap_or_default().to_owned(),
        model: answer.get("model").and_then(Value::as_str).unwrap_or_default().to_owned(),
        text,
        tool_calls,
        finish: answer.get("stop_reason").and_then(Value::as_str).map(finish),
        usage: answer.get("usage").and_then(tokens),
    })
}

/// An Anthropic error body in OpenAI's envelope: its `type` becomes the type and the
/// code, its message stays. A body that is not one is described, not relayed raw.
pub fn error(status: u16, body: &[u8]) -> Value {
    let error = serde_json::from_slice::<Value>(body).ok().and_then(|v| v.get("error").cloned());
    let kind = error.as_ref().and_then(|e| e.get("type")).and_then(Value::as_str);
    let message = error.as_ref().and_then(|e| e.get("message")).and_then(Value::as_str);
    match (kind, message) {
        (Some(kind), Some(message)) => error_envelope(message, kind, kind, None),
        _ => error_envelope(&format!("the backend answered {status}"), "api_error", "upstream_status", None),
    }
}

/// Why a stream event could not be translated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    #[error("the backend sent an event that is not a JSON object")]
    NotJson,
    #[error("the backend sent an error event: {0}")]
    Error(String),
    #[error("the backend began more than {MAX_TOOL_CALLS} tool calls in one answer")]
    TooManyToolCalls,
}

/// Tool calls one streamed answer may begin: what the stream remembers of each is
/// small, but a backend must not make it grow without end.
const MAX_TOOL_CALLS: usize = 1024;

/// A stream's state across events: which content blocks are tool calls (and their
/// index among the answer's tool calls), and the usage so far.
#[derive(Debug, Default)]
pub struct Stream {
    /// `(block index, tool call index)` of each tool-use block begun.
    tools: Vec<(u64, u32)>,
    usage: Option<Tokens>,
}

impl Stream {
    /// The deltas one event's data makes (none for a `ping`, a block's end, a
    /// thinking block's text). `message_stop` ends the answer: its usage, then
    /// [`Delta::Done`].
    pub fn next(&mut self, data: &str) -> Result<Vec<Delta>, StreamError> {
        let event: Value = serde_json::from_str(data).map_err(|_| StreamError::NotJson)?;
        let field = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).unwrap_or_default().to_owned();
        Ok(match event.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                let message = &event["message"];
                self.usage = message.get("usage").and_then(tokens);
                vec![Delta::Start { id: field(message, "id"), model: field(message, "model") }]
            }
            Some("content_block_start") => {
                let block = &event["content_block"];
                let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
                match block.get("type").and_then(Value::as_str) {
                    Some("tool_use") => {
                        if self.tools.len() >= MAX_TOOL_CALLS {
                            return Err(StreamError::TooManyToolCalls);
                        }
                        let call = u32::try_from(self.tools.len()).unwrap_or(u32::MAX);
                        self.tools.push((index, call));
                        vec![Delta::ToolCall { index: call, id: field(block, "id"), name: field(block, "name") }]
                    }
                    Some("text") => {
                        let text = field(block, "text");
                        if text.is_empty() { vec![] } else { vec![Delta::Text(text)] }
                    }
                    _ => vec![],
                }
            }
            Some("content_block_delta") => {
                let delta = &event["delta"];
                let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => vec![Delta::Text(field(delta, "text"))],
                    Some("input_json_delta") => match self.tools.iter().find(|(block, _)| *block == index) {
                        Some(&(_, call)) => {
                            vec![Delta::ToolArguments { index: call, fragment: field(delta, "partial_json") }]
                        }
                        None => vec![],
                    },
                    _ => vec![],
                }
            }
            Some("message_delta") => {
                if let Some(output) = event.get("usage").and_then(|u| u.get("output_tokens")).and_then(Value::as_u64) {
                    self.usage.get_or_insert_default().output = output;
                }
                match event.get("delta").and_then(|d| d.get("stop_reason")).and_then(Value::as_str) {
                    Some(reason) => vec![Delta::Finish(finish(reason))],
                    None => vec![],
                }
            }
            Some("message_stop") => self.usage.take().map(Delta::Usage).into_iter().chain([Delta::Done]).collect(),
            Some("error") => {
                let message = event.get("error").map(|e| field(e, "message")).unwrap_or_default();
                return Err(StreamError::Error(message));
            }
            // `ping`, `content_block_stop`, and events added to the API later.
            _ => vec![],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::chat::{Message, Tool};

    fn user(text: &str) -> Message {
        Message { role: Role::User, parts: vec![Part::Text(text.into())] }
    }

    fn body(call: &Call) -> Value {
        serde_json::from_slice(&request(call, "claude-x", 64).unwrap()).unwrap()
    }

    #[test]
    fn a_call_becomes_a_messages_request() {
        let look = ToolCall { id: "t1".into(), name: "look".into(), arguments: "{\"q\":\"cat\"}".into() };
        let call = Call {
            system: vec!["Be brief.".into(), "Use tools.".into()],
            messages: vec![
                Message {
                    role: Role::User,
                    parts: vec![
                        Part::Text("What?".into()),
                        Part::Image(Image::Data { media_type: "image/png".into(), base64: "iVBO".into() }),
                        Part::Image(Image::Url("https://img.example.com/a.png".into())),
                    ],
                },
                Message { role: Role::Assistant, parts: vec![Part::ToolCall(look)] },
                Message {
                    role: Role::User,
                    parts: vec![Part::ToolResult { call_id: "t1".into(), content: "a".into() }],
                },
                user("And?"),
            ],
            tools: vec![Tool {
                name: "look".into(),
                description: Some("Looks".into()),
                parameters: json!({"type": "object"}),
            }],
            tool_choice: Some(ToolChoice::Required),
            max_tokens: Some(10),
            stop: vec!["END".into()],
            temperature: Some(0.5),
            stream: true,
            choices: 1,
            user: Some("u-1".into()),
            ..Call::default()
        };
        let body = body(&call);
        assert_eq!(body["model"], "claude-x");
        assert_eq!(body["max_tokens"], 64, "the gateway's allowance, not the client's");
        assert_eq!(body["system"], "Be brief.\n\nUse tools.");
        assert_eq!(body["stop_sequences"], json!(["END"]));
        assert_eq!(body["tool_choice"], json!({"type": "any"}));
        assert_eq!(
            body["tools"],
            json!([{"name": "look", "description": "Looks", "input_schema": {"type": "object"}}])
        );
        assert_eq!(body["metadata"], json!({"user_id": "u-1"}));
        assert_eq!((body["stream"].as_bool(), body["temperature"].as_f64()), (Some(true), Some(0.5)));
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 3, "the tool result and the next user text are one user turn");
        assert_eq!(
            messages[0]["content"][1]["source"],
            json!({"type": "base64", "media_type": "image/png", "data": "iVBO"})
        );
        assert_eq!(messages[0]["content"][2]["source"], json!({"type": "url", "url": "https://img.example.com/a.png"}));
        assert_eq!(
            messages[1]["content"][0],
            json!({"type": "tool_use", "id": "t1", "name": "look", "input": {"q": "cat"}})
        );
        assert_eq!(messages[2]["role"], "user");
        assert_eq!(messages[2]["content"][0], json!({"type": "tool_result", "tool_use_id": "t1", "content": "a"}));
        assert_eq!(messages[2]["content"][1], json!({"type": "text", "text": "And?"}));
        let keys: Vec<&str> = body.as_object().unwrap().keys().map(String::as_str).collect();
        for openai_only in ["n", "stream_options", "max_completion_tokens", "user", "stop"] {
            assert!(!keys.contains(&openai_only), "{openai_only} leaked into {keys:?}");
        }
    }

    #[test]
    fn several_choices_are_refused_rather_than_answered_with_one() {
        let call = Call { messages: vec![user("hi")], choices: 3, ..Call::default() };
        assert_eq!(request(&call, "m", 1).unwrap_err().param, Some("n"));
    }

    #[test]
    fn an_answer_reads_back_with_its_finish_and_every_billed_token() {
        let answer = json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {"q": "cat"}}
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 3, "cache_read_input_tokens": 20}
        });
        let c = completion(answer.to_string().as_bytes()).unwrap();
        assert_eq!(c.text.as_deref(), Some("Let me look."));
        assert_eq!(
            c.tool_calls,
            [ToolCall { id: "toolu_1".into(), name: "look".into(), arguments: "{\"q\":\"cat\"}".into() }]
        );
        assert_eq!(c.finish, Some(Finish::ToolCalls));
        assert_eq!(c.usage, Some(Tokens { input: 33, output: 5, cache_read: 20, cache_write: 3 }));
        for (reason, expected) in [
            ("end_turn", Finish::Stop),
            ("stop_sequence", Finish::Stop),
            ("max_tokens", Finish::Length),
            ("refusal", Finish::ContentFilter),
        ] {
            assert_eq!(finish(reason), expected, "{reason}");
        }
        assert_eq!(completion(br#"{"type": "error"}"#), None);
        assert_eq!(completion(b"[]"), None);
    }

    #[test]
    fn errors_keep_their_type_and_message_in_the_openai_envelope() {
        let body = br#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: too big"}}"#;
        let e = error(400, body);
        assert_eq!(e["error"]["message"], "max_tokens: too big");
        assert_eq!(
            (e["error"]["type"].as_str(), e["error"]["code"].as_str()),
            (Some("invalid_request_error"), Some("invalid_request_error"))
        );
        assert_eq!(error(404, b"<html>")["error"]["message"], "the backend answered 404");
    }

    #[test]
    fn a_stream_translates_event_by_event() {
        let mut stream = Stream::default();
        let mut all = Vec::new();
        for event in [
            json!({"type": "message_start", "message": {"id": "msg_1", "model": "claude-x", "usage": {"input_tokens": 12, "output_tokens": 1, "cache_read_input_tokens": 2}}}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "ping"}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {}}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"q\":"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "1}"}}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 9}}),
            json!({"type": "message_stop"}),
        ] {
            all.extend(stream.next(&event.to_string()).unwrap());
        }
        assert_eq!(
            all,
            [
                Delta::Start { id: "msg_1".into(), model: "claude-x".into() },
                Delta::Text("Hi".into()),
                Delta::ToolCall { index: 0, id: "toolu_1".into(), name: "look".into() },
                Delta::ToolArguments { index: 0, fragment: "{\"q\":".into() },
                Delta::ToolArguments { index: 0, fragment: "1}".into() },
                Delta::Finish(Finish::ToolCalls),
                Delta::Usage(Tokens { input: 14, output: 9, cache_read: 2, cache_write: 0 }),
                Delta::Done,
            ]
        );
        let overloaded = json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
        assert_eq!(stream.next(&overloaded.to_string()), Err(StreamError::Error("Overloaded".into())));
        assert_eq!(stream.next("not json"), Err(StreamError::NotJson));
    }

    #[test]
    fn a_stream_cannot_grow_its_tool_calls_without_end() {
        let mut stream = Stream::default();
        let start = |i: usize| {
            json!({"type": "content_block_start", "index": i, "content_block": {"type": "tool_use", "id": "t", "name": "n"}})
                .to_string()
        };
        for i in 0..MAX_TOOL_CALLS {
            assert_eq!(stream.next(&start(i)).unwrap().len(), 1);
        }
        assert_eq!(stream.next(&start(MAX_TOOL_CALLS)), Err(StreamError::TooManyToolCalls));
    }
}
