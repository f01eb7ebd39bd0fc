//! The Anthropic Messages API, inbound (SPEC §2.2): a client's `POST /v1/messages`
//! into a [`Call`] (or, for an `anthropic` backend, forwarded as it came but for the
//! model and the allowance), and the answer back in Anthropic's shapes: a `message`,
//! its event stream (`message_start` ... `message_stop`) written one [`Delta`] at a
//! time, and errors in Anthropic's envelope.
//!
//! The request is checked and measured once here; what only a translation needs (a
//! tool the other format cannot carry) is checked by [`MessagesRequest::call`], with
//! the field at fault.

use bytes::{BufMut, Bytes, BytesMut};
use serde_json::{Map, Value, json};

use super::Measure;
use super::chat::{Call, Completion, Delta, Finish, Image, Message, Part, Role, Tokens, Tool, ToolCall, ToolChoice};
use super::openai::{ImageRef, InvalidRequest};

fn invalid(param: &'static str, message: impl Into<String>) -> InvalidRequest {
    InvalidRequest { message: message.into(), param: Some(param) }
}

/// A `POST /v1/messages` (or `/v1/messages/count_tokens`) body.
#[derive(Debug, Clone)]
pub struct MessagesRequest {
    body: Map<String, Value>,
    pub measure: Measure,
}

impl MessagesRequest {
    /// A `messages.create` body: `max_tokens` is required, as Anthropic requires it.
    pub fn parse(bytes: &[u8]) -> Result<Self, InvalidRequest> {
        let request = Self::parse_count(bytes)?;
        if request.measure.max_tokens.is_none() {
            return Err(invalid("max_tokens", "`max_tokens` is required"));
        }
        Ok(request)
    }

    /// A `count_tokens` body: a Messages request without `max_tokens`.
    pub fn parse_count(bytes: &[u8]) -> Result<Self, InvalidRequest> {
        let body = match serde_json::from_slice::<Value>(bytes) {
            Ok(Value::Object(map)) => map,
            Ok(_) => {
                return Err(InvalidRequest { message: "the request body must be a JSON object".into(), param: None });
            }
            Err(e) => {
                return Err(InvalidRequest {
                    message: format!("the request body is not valid JSON: {e}"),
                    param: None,
                });
            }
        };
        let model = match body.get("model") {
            Some(Value::String(m)) if !m.trim().is_empty() => m.clone(),
            _ => return Err(invalid("model", "`model` is required and must be a string")),
        };
        InvalidRequest::check_bounded("model", &model, crate::call::MAX_MODEL_BYTES)?;
        let max_tokens = match body.get("max_tokens") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => Some(n),
                _ => return Err(invalid("max_tokens", "`max_tokens` must be an integer of at least 1")),
            },
        };
        let stream = match body.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(invalid("stream", "`stream` must be a boolean")),
        };
        let mut measure = Measure { model, stream, max_tokens, ..Measure::default() };
        match body.get("system") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => measure.prompt_text_bytes += s.len() as u64,
            Some(Value::Array(blocks)) => {
                for block in blocks {
                    measure.prompt_text_bytes += text_block(block, "system")?.len() as u64;
                }
            }
            Some(_) => return Err(invalid("system", "`system` must be a string or an array of text blocks")),
        }
        let messages = match body.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => m,
            _ => return Err(invalid("messages", "`messages` is required and must be a non-empty array")),
        };
        for (i, message) in messages.iter().enumerate() {
            match message.get("role").and_then(Value::as_str) {
                Some("user" | "assistant") => {}
                _ => return Err(invalid("messages", format!("messages[{i}].role must be `user` or `assistant`"))),
            }
            match message.get("content") {
                Some(Value::String(s)) => measure.prompt_text_bytes += s.len() as u64,
                Some(Value::Array(blocks)) => {
                    for (j, block) in blocks.iter().enumerate() {
                        measure_block(block, &format!("messages[{i}].content[{j}]"), &mut measure)?;
                    }
                }
                _ => {
                    return Err(invalid(
                        "messages",
                        format!("messages[{i}].content must be a string or an array of content blocks"),
                    ));
                }
            }
        }
        // The system prompt is framed like a message.
        measure.message_count = messages.len() as u64 + u64::from(body.get("system").is_some_and(|s| !s.is_null()));
        match body.get("tools") {
            None | Some(Value::Null) => {}
            Some(tools @ Value::Array(_)) => measure.prompt_text_bytes += super::json_len(tools),
            Some(_) => return Err(invalid("tools", "`tools` must be an array")),
        }
        measure.user = match body.get("metadata").and_then(|m| m.get("user_id")) {
            None | Some(Value::Null) => None,
            Some(Value::String(u)) => {
                InvalidRequest::check_bounded("metadata", u, crate::call::MAX_USER_BYTES)?;
                Some(u.clone())
            }
            Some(_) => return Err(invalid("metadata", "`metadata.user_id` must be a string")),
        };
        Ok(MessagesRequest { body, measure })
    }

    /// The body for an `anthropic` backend: the client's, with the served model and
    /// the gateway's allowance as `max_tokens`.
    pub fn upstream_body(&self, served_model: &str, allowance: u64) -> Vec<u8> {
        let mut body = self.body.clone();
        body.insert("model".into(), served_model.into());
        body.insert("max_tokens".into(), allowance.into());
        serde_json::to_vec(&body).unwrap_or_default()
    }

    /// The call this request makes, for a backend of another format.
    pub fn call(&self) -> Result<Call, InvalidRequest> {
        let body = &self.body;
        let number = |key: &str| body.get(key).and_then(Value::as_f64);
        let mut call = Call {
            max_tokens: self.measure.max_tokens,
            stream: self.measure.stream,
            choices: 1,
            user: self.measure.user.clone(),
            temperature: number("temperature"),
            top_p: number("top_p"),
            tools: tools(body.get("tools"))?,
            tool_choice: tool_choice(body.get("tool_choice"))?,
            ..Call::default()
        };
        match body.get("stop_sequences") {
            None | Some(Value::Null) => {}
            Some(Value::Array(items)) => {
                for item in items {
                    let stop = item.as_str().ok_or_else(|| invalid("stop_sequences", "must be strings"))?;
                    call.stop.push(stop.to_owned());
                }
            }
            Some(_) => return Err(invalid("stop_sequences", "`stop_sequences` must be an array of strings")),
        }
        match body.get("system") {
            Some(Value::String(s)) => call.system.push(s.clone()),
            Some(Value::Array(blocks)) => {
                for block in blocks {
                    call.system.push(text_block(block, "system")?.to_owned());
                }
            }
            _ => {}
        }
        for message in body.get("messages").and_then(Value::as_array).into_iter().flatten() {
            let role =
                if message.get("role").and_then(Value::as_str) == Some("user") { Role::User } else { Role::Assistant };
            let parts = match message.get("content") {
                Some(Value::String(s)) => vec![Part::Text(s.clone())],
                Some(Value::Array(blocks)) => {
                    blocks.iter().filter_map(|b| part(b).transpose()).collect::<Result<_, _>>()?
                }
                _ => Vec::new(),
            };
            call.messages.push(Message { role, parts });
        }
        Ok(call)
    }
}

/// The text of a `{type: text, text}` block (in `system`, or a tool result).
fn text_block<'a>(block: &'a Value, place: &'static str) -> Result<&'a str, InvalidRequest> {
    match (block.get("type").and_then(Value::as_str), block.get("text").and_then(Value::as_str)) {
        (Some("text"), Some(text)) => Ok(text),
        _ => Err(invalid(place, format!("`{place}` blocks must be {{type: text, text}}"))),
    }
}

/// Measures one content block, collecting its images; refuses the types the gateway
/// cannot measure.
fn measure_block(block: &Value, at: &str, measure: &mut Measure) -> Result<(), InvalidRequest> {
    let field = |key: &str| block.get(key);
    let bytes = |v: Option<&Value>| v.map_or(0, |v| v.as_str().map_or_else(|| super::json_len(v), |s| s.len() as u64));
    match block.get("type").and_then(Value::as_str) {
        Some("text") => match field("text") {
            Some(Value::String(t)) => measure.prompt_text_bytes += t.len() as u64,
            _ => return Err(invalid("messages", format!("{at}.text must be a string"))),
        },
        Some("image") => measure.images.push(image_ref(block, at)?),
        Some("tool_use") => {
            if field("id").and_then(Value::as_str).is_none() || field("name").and_then(Value::as_str).is_none() {
                return Err(invalid("messages", format!("{at}: a tool_use block needs an `id` and a `name`")));
            }
            measure.prompt_text_bytes += bytes(field("name")) + bytes(field("input"));
        }
        Some("tool_result") => {
            if field("tool_use_id").and_then(Value::as_str).is_none() {
                return Err(invalid("messages", format!("{at}.tool_use_id is required")));
            }
            match field("content") {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) => measure.prompt_text_bytes += s.len() as u64,
                Some(Value::Array(inner)) => {
                    for (k, inner) in inner.iter().enumerate() {
                        match inner.get("type").and_then(Value::as_str) {
                            Some("text" | "image") => measure_block(inner, &format!("{at}.content[{k}]"), measure)?,
                            _ => {
                                return Err(invalid(
                                    "messages",
                                    format!("{at}.content[{k}]: a tool result holds text and image blocks"),
                                ));
                            }
                        }
                    }
                }
                Some(_) => return Err(invalid("messages", format!("{at}.content must be a string or blocks"))),
            }
        }
        // A previous turn's reasoning, sent back as the API asks: read, never shown.
        Some("thinking" | "redacted_thinking") => {
            measure.prompt_text_bytes += bytes(field("thinking")) + bytes(field("data"));
        }
        Some(other) => {
            return Err(invalid(
                "messages",
                format!("{at}: content block type `{other}` is not supported (text, image, tool_use, tool_result)"),
            ));
        }
        None => return Err(invalid("messages", format!("{at}.type is required"))),
    }
    Ok(())
}

/// An image block's source as the vision checks read it: a `data:` URI or its URL.
fn image_ref(block: &Value, at: &str) -> Result<ImageRef, InvalidRequest> {
    let source = block.get("source");
    let get = |key: &str| source.and_then(|s| s.get(key)).and_then(Value::as_str);
    match (get("type"), get("media_type"), get("data"), get("url")) {
        (Some("base64"), Some(media_type), Some(data), _) => {
            Ok(ImageRef { url: format!("data:{media_type};base64,{data}") })
        }
        (Some("url"), _, _, Some(url)) => Ok(ImageRef { url: url.to_owned() }),
        _ => Err(invalid(
            "messages",
            format!("{at}.source must be {{type: base64, media_type, data}} or {{type: url, url}}"),
        )),
    }
}

/// A content block as a part (`None` for a reasoning block: the other format has no
/// place for it).
fn part(block: &Value) -> Result<Option<Part>, InvalidRequest> {
    let text = |key: &str| block.get(key).and_then(Value::as_str).unwrap_or_default().to_owned();
    Ok(Some(match block.get("type").and_then(Value::as_str) {
        Some("text") => Part::Text(text("text")),
        Some("image") => Part::Image(Image::from_url(&image_ref(block, "messages")?.url)),
        Some("tool_use") => Part::ToolCall(ToolCall {
            id: text("id"),
            name: text("name"),
            arguments: block.get("input").map_or_else(|| "{}".to_owned(), Value::to_string),
        }),
        Some("tool_result") => {
            let content = match block.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(inner)) => {
                    let mut joined = String::new();
                    for inner in inner {
                        let Ok(t) = text_block(inner, "messages") else {
                            let why = "a tool result with images is served by an `anthropic` backend only";
                            return Err(invalid("messages", why));
                        };
                        joined.push_str(t);
                    }
                    joined
                }
                _ => String::new(),
            };
            Part::ToolResult { call_id: text("tool_use_id"), content }
        }
        _ => return Ok(None),
    }))
}

fn tools(value: Option<&Value>) -> Result<Vec<Tool>, InvalidRequest> {
    let Some(Value::Array(items)) = value else {
        return Ok(Vec::new());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            let kind = tool.get("type").and_then(Value::as_str);
            let name = tool.get("name").and_then(Value::as_str);
            match (kind, name) {
                (None | Some("custom"), Some(name)) => Ok(Tool {
                    name: name.to_owned(),
                    description: tool.get("description").and_then(Value::as_str).map(str::to_owned),
                    parameters: tool.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"})),
                }),
                (Some(kind), _) => Err(invalid(
                    "tools",
                    format!("tools[{i}]: the tool type `{kind}` is served by an `anthropic` backend only"),
                )),
                (None, None) => Err(invalid("tools", format!("tools[{i}].name is required"))),
            }
        })
        .collect()
}

fn tool_choice(value: Option<&Value>) -> Result<Option<ToolChoice>, InvalidRequest> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    Ok(Some(match (value.get("type").and_then(Value::as_str), value.get("name").and_then(Value::as_str)) {
        (Some("auto"), _) => ToolChoice::Auto,
        (Some("none"), _) => ToolChoice::None,
        (Some("any"), _) => ToolChoice::Required,
        (Some("tool"), Some(name)) => ToolChoice::Named(name.to_owned()),
        _ => return Err(invalid("tool_choice", "`tool_choice` must be auto, any, none or {type: tool, name}")),
    }))
}

// ---------------------------------------------------------------- answers

fn stop_reason(finish: Finish) -> &'static str {
    match finish {
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
        Finish::ContentFilter => "refusal",
    }
}

/// Usage as Anthropic reports it: `input_tokens` without the cached prompt tokens,
/// which it counts apart.
fn usage(tokens: &Tokens) -> Value {
    json!({
        "input_tokens": tokens.input.saturating_sub(tokens.cache_read).saturating_sub(tokens.cache_write),
        "output_tokens": tokens.output,
        "cache_creation_input_tokens": tokens.cache_write,
        "cache_read_input_tokens": tokens.cache_read,
    })
}

fn tool_input(arguments: &str) -> Value {
    serde_json::from_str::<Value>(arguments).ok().filter(Value::is_object).unwrap_or_else(|| json!({}))
}

/// A `message` object.
pub fn message(answer: &Completion) -> Value {
    let mut content: Vec<Value> = answer.text.iter().map(|t| json!({"type": "text", "text": t})).collect();
    for call in &answer.tool_calls {
        content
            .push(json!({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(&call.arguments)}));
    }
    json!({
        "id": answer.id,
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": content,
        "stop_reason": answer.finish.map(stop_reason),
        "stop_sequence": null,
        "usage": usage(&answer.usage.unwrap_or_default()),
    })
}

/// The `error.type` Anthropic gives a status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        _ if status < 500 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Anthropic's error envelope.
pub fn error_envelope(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// An OpenAI-format backend's refusal in Anthropic's envelope: its message kept, its
/// code first, as the gateway's own codes are.
pub fn error_from_openai(status: u16, body: &[u8]) -> Value {
    let error = serde_json::from_slice::<Value>(body).ok().and_then(|v| v.get("error").cloned());
    let text = |key: &str| error.as_ref().and_then(|e| e.get(key)).and_then(Value::as_str).map(str::to_owned);
    let message = match (text("code"), text("message")) {
        (Some(code), Some(message)) => format!("{code}: {message}"),
        (None, Some(message)) => message,
        _ => format!("the backend answered {status}"),
    };
    error_envelope(error_type(status), &message)
}

/// Writes a stream's [`Delta`]s as Anthropic's events: `message_start`, a content
/// block per text run or tool call (`content_block_start`, `_delta`s, `_stop`), then
/// `message_delta` (stop reason, usage) and `message_stop` at the end. What it keeps
/// across events is a few numbers, whatever the answer's length.
#[derive(Debug, Default)]
pub struct Events {
    started: bool,
    /// The index of the next content block.
    blocks: u64,
    /// The open block: `None`, or its index and whether it is text.
    open: Option<(u64, bool)>,
    /// `(tool call index, its block)` of the tool calls begun.
    tools: Vec<(u32, u64)>,
    finish: Option<Finish>,
    usage: Option<Tokens>,
}

/// Tool calls one streamed answer may begin (as the outbound translator bounds them).
const MAX_TOOL_CALLS: usize = 1024;

fn push(out: &mut BytesMut, name: &str, data: &Value) {
    out.put_slice(b"event: ");
    out.put_slice(name.as_bytes());
    out.put_slice(b"\ndata: ");
    out.put_slice(data.to_string().as_bytes());
    out.put_slice(b"\n\n");
}

impl Events {
    /// The events one delta makes, appended to `out`.
    pub fn write(&mut self, delta: Delta, out: &mut BytesMut) -> Result<(), String> {
        if let Delta::Start { id, model } = &delta {
            self.start(id, model, out);
            return Ok(());
        }
        self.start("msg_flexway", "", out);
        match delta {
            Delta::Start { .. } => {}
            Delta::Text(text) => {
                let index = match self.open {
                    Some((index, true)) => index,
                    _ => self.open_block(json!({"type": "text", "text": ""}), true, out),
                };
                let delta = json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}});
                push(out, "content_block_delta", &delta);
            }
            Delta::ToolCall { index, id, name } => {
                if self.tools.len() >= MAX_TOOL_CALLS {
                    return Err(format!("the backend began more than {MAX_TOOL_CALLS} tool calls in one answer"));
                }
                let block = json!({"type": "tool_use", "id": id, "name": name, "input": {}});
                let block = self.open_block(block, false, out);
                self.tools.push((index, block));
            }
            Delta::ToolArguments { index, fragment } => {
                if let Some(&(_, block)) = self.tools.iter().find(|(call, _)| *call == index) {
                    let delta = json!({"type": "content_block_delta", "index": block, "delta": {"type": "input_json_delta", "partial_json": fragment}});
                    push(out, "content_block_delta", &delta);
                }
            }
            Delta::Finish(finish) => self.finish = Some(finish),
            Delta::Usage(tokens) => self.usage = Some(tokens),
            Delta::Done => {
                self.close(out);
                let tokens = self.usage.unwrap_or_default();
                let delta = json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(self.finish.unwrap_or(Finish::Stop)), "stop_sequence": null},
                    "usage": usage(&tokens),
                });
                push(out, "message_delta", &delta);
                push(out, "message_stop", &json!({"type": "message_stop"}));
            }
        }
        Ok(())
    }

    fn start(&mut self, id: &str, model: &str, out: &mut BytesMut) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let message = json!({
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        });
        push(out, "message_start", &json!({"type": "message_start", "message": message}));
    }

    fn open_block(&mut self, block: Value, text: bool, out: &mut BytesMut) -> u64 {
        self.close(out);
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((index, text));
        push(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        );
        index
    }

    fn close(&mut self, out: &mut BytesMut) {
        if let Some((index, _)) = self.open.take() {
            push(out, "content_block_stop", &json!({"type": "content_block_stop", "index": index}));
        }
    }
}

/// An in-band error event, as Anthropic ends a stream that failed.
pub fn error_event(code: &str, message: &str) -> Bytes {
    let mut out = BytesMut::new();
    push(&mut out, "error", &error_envelope("api_error", &format!("{code}: {message}")));
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<MessagesRequest, InvalidRequest> {
        MessagesRequest::parse(v.to_string().as_bytes())
    }

    #[test]
    fn a_messages_request_is_measured_and_becomes_a_call() {
        let request = parse(json!({
            "model": "claude-x", "max_tokens": 50, "stream": true,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "What?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
                ]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "look", "input": {"q": 1}}
                ]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a cat"}]}]}
            ],
            "tools": [{"name": "look", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u-1"},
            "temperature": 0.5
        }))
        .unwrap();
        let m = &request.measure;
        assert_eq!((m.model.as_str(), m.max_tokens, m.stream, m.message_count), ("claude-x", Some(50), true, 4));
        assert_eq!(m.images, [ImageRef { url: "data:image/png;base64,iVBO".into() }]);
        assert_eq!(m.user.as_deref(), Some("u-1"));
        assert!(m.prompt_text_bytes > 20, "{}", m.prompt_text_bytes);
        let call = request.call().unwrap();
        assert_eq!(call.system, ["Be brief."]);
        assert_eq!(call.messages.len(), 3);
        assert_eq!(
            call.messages[0].parts[1],
            Part::Image(Image::Data { media_type: "image/png".into(), base64: "iVBO".into() })
        );
        let look = ToolCall { id: "t1".into(), name: "look".into(), arguments: "{\"q\":1}".into() };
        assert_eq!(call.messages[1], Message { role: Role::Assistant, parts: vec![Part::ToolCall(look)] });
        assert_eq!(call.messages[2].parts, [Part::ToolResult { call_id: "t1".into(), content: "a cat".into() }]);
        assert_eq!(
            (call.tool_choice, call.stop, call.temperature),
            (Some(ToolChoice::Required), vec!["END".to_owned()], Some(0.5))
        );
        let native: Value = serde_json::from_slice(&request.upstream_body("claude-real", 7)).unwrap();
        assert_eq!((native["model"].as_str(), native["max_tokens"].as_u64()), (Some("claude-real"), Some(7)));
        assert_eq!(native["system"][0]["cache_control"]["type"], "ephemeral", "the native body keeps every field");
    }

    #[test]
    fn malformed_requests_are_refused_with_the_field() {
        let ok = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]});
        assert!(parse(ok.clone()).is_ok());
        let with = |key: &str, value: Value| {
            let mut body = ok.clone();
            body[key] = value;
            parse(body).unwrap_err().param
        };
        assert_eq!(with("max_tokens", json!(0)), Some("max_tokens"));
        assert_eq!(with("messages", json!([])), Some("messages"));
        assert_eq!(with("messages", json!([{"role": "system", "content": "x"}])), Some("messages"));
        assert_eq!(with("messages", json!([{"role": "user", "content": [{"type": "document"}]}])), Some("messages"));
        assert_eq!(with("system", json!(3)), Some("system"));
        assert_eq!(with("stream", json!("yes")), Some("stream"));
        let mut no_limit = ok.clone();
        no_limit.as_object_mut().unwrap().remove("max_tokens");
        assert_eq!(parse(no_limit.clone()).unwrap_err().param, Some("max_tokens"));
        assert!(MessagesRequest::parse_count(no_limit.to_string().as_bytes()).is_ok(), "count_tokens needs none");
        let server_tool = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}]});
        assert_eq!(parse(server_tool).unwrap().call().unwrap_err().param, Some("tools"));
    }

    #[test]
    fn an_answer_reads_as_an_anthropic_message() {
        let answer = Completion {
            id: "chatcmpl-1".into(),
            model: "gpt-x".into(),
            text: Some("Looking.".into()),
            tool_calls: vec![ToolCall { id: "c1".into(), name: "look".into(), arguments: "{\"q\":1}".into() }],
            finish: Some(Finish::ToolCalls),
            usage: Some(Tokens { input: 30, output: 4, cache_read: 10, cache_write: 0 }),
        };
        let m = message(&answer);
        assert_eq!(m["content"][0], json!({"type": "text", "text": "Looking."}));
        assert_eq!(m["content"][1], json!({"type": "tool_use", "id": "c1", "name": "look", "input": {"q": 1}}));
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(m["usage"]["input_tokens"], 20);
        assert_eq!(m["usage"]["cache_read_input_tokens"], 10);
    }

    #[test]
    fn deltas_become_anthropic_events() {
        let mut events = Events::default();
        let mut out = BytesMut::new();
        for delta in [
            Delta::Start { id: "c".into(), model: "gpt-x".into() },
            Delta::Text("Hi".into()),
            Delta::ToolCall { index: 0, id: "t".into(), name: "look".into() },
            Delta::ToolArguments { index: 0, fragment: "{}".into() },
            Delta::Finish(Finish::ToolCalls),
            Delta::Usage(Tokens { input: 5, output: 2, ..Tokens::default() }),
            Delta::Done,
        ] {
            events.write(delta, &mut out).unwrap();
        }
        let text = String::from_utf8(out.to_vec()).unwrap();
        let names: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert!(text.contains(r#""stop_reason":"tool_use""#), "{text}");
        assert!(text.contains(r#""output_tokens":2"#), "{text}");
        let json_delta = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| serde_json::from_str::<Value>(d).unwrap())
            .find(|d| d["delta"]["type"] == "input_json_delta")
            .unwrap();
        assert_eq!((json_delta["index"].as_u64(), json_delta["delta"]["partial_json"].as_str()), (Some(1), Some("{}")));
    }

    #[test]
    fn an_openai_refusal_reads_in_anthropic_s_envelope() {
        let body = br#"{"error": {"message": "slow down", "type": "requests", "code": "rate_limited"}}"#;
        let e = error_from_openai(429, body);
        assert_eq!(
            e,
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "rate_limited: slow down"}})
        );
    }
}
