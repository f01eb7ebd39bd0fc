//! The OpenAI Responses API, inbound and stateless (SPEC §2.1): a client's `POST
//! /v1/responses` into a [`Call`], and the answer back as a `response` object, or, streamed,
//! as the Responses events (`response.created` ... `response.completed`) written one
//! [`Delta`] at a time.
//!
//! The gateway keeps no conversation: what needs stored state (`previous_response_id`,
//! `store: true`, `background`, `conversation`, item references) and the built-in
//! tools are refused with the field named, never silently dropped.
//!
//! A stream's `.done` events and its final `response` repeat the whole output, as the
//! API's do: the text is kept as it passes, bounded by the caller's limit (the
//! gateway's `ai.limits.max_response_bytes`, as for a non-streamed answer).

use bytes::{BufMut, Bytes, BytesMut};
use serde_json::{Map, Value, json};

use super::Measure;
use super::chat::{Call, Completion, Delta, Finish, Image, Message, Part, Role, Tokens, Tool, ToolCall, ToolChoice};
use super::openai::{ImageRef, InvalidRequest};

fn invalid(param: &'static str, message: impl Into<String>) -> InvalidRequest {
    InvalidRequest { message: message.into(), param: Some(param) }
}

/// A `POST /v1/responses` body, as a call.
#[derive(Debug, Clone)]
pub struct ResponsesRequest {
    pub measure: Measure,
    pub call: Call,
    /// The request's parameters a `response` object repeats.
    echo: Map<String, Value>,
}

/// Fields the gateway cannot serve without stored state, and when they ask for it.
const STATEFUL: &[&str] = &["previous_response_id", "conversation", "prompt"];

impl ResponsesRequest {
    pub fn parse(bytes: &[u8]) -> Result<Self, InvalidRequest> {
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
        for &key in STATEFUL {
            if body.get(key).is_some_and(|v| !v.is_null()) {
                return Err(invalid(key, format!("`{key}` is not supported: the gateway keeps no conversation state")));
            }
        }
        for key in ["store", "background"] {
            if body.get(key).and_then(Value::as_bool) == Some(true) {
                return Err(invalid(
                    if key == "store" { "store" } else { "background" },
                    format!(
                        "`{key}: true` is not supported: the gateway keeps no response state (send `{key}: false`)"
                    ),
                ));
            }
        }
        if let Some(format) =
            body.get("text").and_then(|t| t.get("format")).and_then(|f| f.get("type")).and_then(Value::as_str)
            && format != "text"
        {
            return Err(invalid("text", format!("`text.format` `{format}` is not supported (only `text`)")));
        }
        let model = match body.get("model") {
            Some(Value::String(m)) if !m.trim().is_empty() => m.clone(),
            _ => return Err(invalid("model", "`model` is required and must be a string")),
        };
        InvalidRequest::check_bounded("model", &model, crate::call::MAX_MODEL_BYTES)?;
        let stream = match body.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(invalid("stream", "`stream` must be a boolean")),
        };
        let max_tokens =
            match body.get("max_output_tokens") {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().filter(|n| *n >= 1).ok_or_else(|| {
                    invalid("max_output_tokens", "`max_output_tokens` must be an integer of at least 1")
                })?),
            };
        let user = match body.get("user") {
            None | Some(Value::Null) => None,
            Some(Value::String(u)) => {
                InvalidRequest::check_bounded("user", u, crate::call::MAX_USER_BYTES)?;
                Some(u.clone())
            }
            Some(_) => return Err(invalid("user", "`user` must be a string")),
        };
        let number = |key: &str| body.get(key).and_then(Value::as_f64);
        let mut measure = Measure { model, stream, max_tokens, user: user.clone(), ..Measure::default() };
        let mut call = Call {
            max_tokens,
            stream,
            choices: 1,
            user,
            temperature: number("temperature"),
            top_p: number("top_p"),
            tools: tools(body.get("tools"))?,
            tool_choice: tool_choice(body.get("tool_choice"))?,
            ..Call::default()
        };
        if let Some(tools) = body.get("tools") {
            measure.prompt_text_bytes += super::json_len(tools);
        }
        match body.get("instructions") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => {
                measure.prompt_text_bytes += s.len() as u64;
                call.system.push(s.clone());
            }
            Some(_) => return Err(invalid("instructions", "`instructions` must be a string")),
        }
        match body.get("input") {
            Some(Value::String(s)) => {
                measure.prompt_text_bytes += s.len() as u64;
                call.messages.push(Message { role: Role::User, parts: vec![Part::Text(s.clone())] });
            }
            Some(Value::Array(items)) if !items.is_empty() => {
                for (i, item) in items.iter().enumerate() {
                    read_item(i, item, &mut call, &mut measure)?;
                }
            }
            _ => return Err(invalid("input", "`input` is required: a string or a non-empty array of items")),
        }
        measure.message_count = call.messages.len() as u64 + call.system.len() as u64;
        let mut echo = Map::new();
        for key in
            ["instructions", "max_output_tokens", "temperature", "top_p", "tool_choice", "tools", "metadata", "user"]
        {
            if let Some(v) = body.get(key) {
                echo.insert(key.to_owned(), v.clone());
            }
        }
        Ok(ResponsesRequest { measure, call, echo })
    }

    /// What the answer repeats of the request.
    pub fn echo(&self) -> Echo {
        Echo(self.echo.clone())
    }
}

/// One input item: a message, a function call the model made, or its output.
fn read_item(i: usize, item: &Value, call: &mut Call, measure: &mut Measure) -> Result<(), InvalidRequest> {
    let field = |key: &str| item.get(key).and_then(Value::as_str);
    let kind = field("type").unwrap_or("message");
    match kind {
        "message" => {
            let role = field("role").unwrap_or_default();
            let parts = content(i, item.get("content"), measure)?;
            match role {
                "system" | "developer" => {
                    let mut text = String::new();
                    for part in parts {
                        match part {
                            Part::Text(t) => text.push_str(&t),
                            _ => return Err(invalid("input", format!("input[{i}]: a {role} message holds text only"))),
                        }
                    }
                    call.system.push(text);
                }
                "user" => call.messages.push(Message { role: Role::User, parts }),
                "assistant" => push(call, Role::Assistant, parts),
                other => return Err(invalid("input", format!("input[{i}].role `{other}` is not a message role"))),
            }
        }
        "function_call" => {
            let (Some(call_id), Some(name)) = (field("call_id"), field("name")) else {
                return Err(invalid("input", format!("input[{i}]: a function_call needs a `call_id` and a `name`")));
            };
            let arguments = field("arguments").unwrap_or("{}");
            measure.prompt_text_bytes += (name.len() + arguments.len()) as u64;
            let tool_call = ToolCall { id: call_id.to_owned(), name: name.to_owned(), arguments: arguments.to_owned() };
            push(call, Role::Assistant, vec![Part::ToolCall(tool_call)]);
        }
        "function_call_output" => {
            let Some(call_id) = field("call_id") else {
                return Err(invalid("input", format!("input[{i}]: a function_call_output needs a `call_id`")));
            };
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("")
                }
                _ => return Err(invalid("input", format!("input[{i}].output must be a string"))),
            };
            measure.prompt_text_bytes += output.len() as u64;
            let result = Part::ToolResult { call_id: call_id.to_owned(), content: output };
            // Results of one turn's calls go together, before anything the user adds.
            match call.messages.last_mut() {
                Some(last)
                    if last.role == Role::User && last.parts.iter().all(|p| matches!(p, Part::ToolResult { .. })) =>
                {
                    last.parts.push(result);
                }
                _ => call.messages.push(Message { role: Role::User, parts: vec![result] }),
            }
        }
        // A previous turn's reasoning summary: the other formats have no place for it.
        "reasoning" => {}
        "item_reference" => {
            return Err(invalid(
                "input",
                format!("input[{i}]: item references need stored state, which the gateway does not keep"),
            ));
        }
        other => return Err(invalid("input", format!("input[{i}]: item type `{other}` is not supported"))),
    }
    Ok(())
}

/// An assistant turn continues the previous one (its text, then its tool calls).
fn push(call: &mut Call, role: Role, parts: Vec<Part>) {
    match call.messages.last_mut() {
        Some(last) if last.role == role => last.parts.extend(parts),
        _ => call.messages.push(Message { role, parts }),
    }
}

fn content(i: usize, content: Option<&Value>, measure: &mut Measure) -> Result<Vec<Part>, InvalidRequest> {
    let parts = match content {
        Some(Value::String(s)) => {
            measure.prompt_text_bytes += s.len() as u64;
            return Ok(vec![Part::Text(s.clone())]);
        }
        Some(Value::Array(parts)) => parts,
        _ => return Err(invalid("input", format!("input[{i}].content must be a string or an array of parts"))),
    };
    parts
        .iter()
        .enumerate()
        .map(|(j, part)| match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text" | "text") => match part.get("text").and_then(Value::as_str) {
                Some(text) => {
                    measure.prompt_text_bytes += text.len() as u64;
                    Ok(Part::Text(text.to_owned()))
                }
                None => Err(invalid("input", format!("input[{i}].content[{j}].text must be a string"))),
            },
            Some("refusal") => {
                let text = part.get("refusal").and_then(Value::as_str).unwrap_or_default();
                measure.prompt_text_bytes += text.len() as u64;
                Ok(Part::Text(text.to_owned()))
            }
            Some("input_image") => match part.get("image_url").and_then(Value::as_str) {
                Some(url) => {
                    measure.images.push(ImageRef { url: url.to_owned() });
                    Ok(Part::Image(Image::from_url(url)))
                }
                None => Err(invalid(
                    "input",
                    format!(
                        "input[{i}].content[{j}]: an input_image needs an `image_url` (file ids need stored state)"
                    ),
                )),
            },
            Some(other) => Err(invalid(
                "input",
                format!(
                    "input[{i}].content[{j}]: content part type `{other}` is not supported (input_text, input_image)"
                ),
            )),
            None => Err(invalid("input", format!("input[{i}].content[{j}].type is required"))),
        })
        .collect()
}

fn tools(value: Option<&Value>) -> Result<Vec<Tool>, InvalidRequest> {
    let items = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("tools", "`tools` must be an array")),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, tool)| match (tool.get("type").and_then(Value::as_str), tool.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => Ok(Tool {
                name: name.to_owned(),
                description: tool.get("description").and_then(Value::as_str).map(str::to_owned),
                parameters: tool
                    .get("parameters")
                    .cloned()
                    .filter(|p| !p.is_null())
                    .unwrap_or_else(|| json!({"type": "object"})),
            }),
            (Some("function"), None) => Err(invalid("tools", format!("tools[{i}].name is required"))),
            (kind, _) => Err(invalid(
                "tools",
                format!("tools[{i}]: built-in tool `{}` is not supported (only `function` tools)", kind.unwrap_or("?")),
            )),
        })
        .collect()
}

fn tool_choice(value: Option<&Value>) -> Result<Option<ToolChoice>, InvalidRequest> {
    Ok(Some(match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(Value::String(s)) if s == "required" => ToolChoice::Required,
        Some(v) => match (v.get("type").and_then(Value::as_str), v.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => ToolChoice::Named(name.to_owned()),
            _ => {
                return Err(invalid(
                    "tool_choice",
                    "`tool_choice` must be auto, none, required or {type: function, name}",
                ));
            }
        },
    }))
}

// ---------------------------------------------------------------- answers

/// The request's parameters, as a `response` object repeats them.
#[derive(Debug, Clone, Default)]
pub struct Echo(Map<String, Value>);

/// The Responses `usage` object.
fn usage(tokens: &Tokens) -> Value {
    json!({
        "input_tokens": tokens.input,
        "input_tokens_details": {"cached_tokens": tokens.cache_read},
        "output_tokens": tokens.output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": tokens.input.saturating_add(tokens.output),
    })
}

/// A `response` object: `id` is the gateway's, `status` from the finish.
fn response(
    id: &str,
    model: &str,
    created: u64,
    echo: &Echo,
    output: Vec<Value>,
    finish: Option<Finish>,
    tokens: Option<Tokens>,
) -> Value {
    let (status, incomplete) = match finish {
        None => ("in_progress", Value::Null),
        Some(Finish::Length) => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some(Finish::ContentFilter) => ("incomplete", json!({"reason": "content_filter"})),
        Some(_) => ("completed", Value::Null),
    };
    let mut body = json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": null,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "parallel_tool_calls": true,
        "store": false,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "tool_choice": "auto",
        "tools": [],
        "usage": tokens.as_ref().map(usage),
    });
    for (key, value) in &echo.0 {
        body[key] = value.clone();
    }
    body
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message", "id": id, "status": status, "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })
}

fn function_item(id: &str, call: &ToolCall, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call.id, "name": call.name, "arguments": call.arguments, "status": status})
}

/// The id of the response a call with this request id makes (`req_...` → `resp_...`),
/// so that a client's response id names the call in the audit.
pub fn response_id(request_id: &str) -> String {
    format!("resp_{}", request_id.strip_prefix("req_").unwrap_or(request_id))
}

/// A non-streamed `response` object.
pub fn answer(id: &str, completion: &Completion, echo: &Echo, created: u64) -> Value {
    let suffix = id.strip_prefix("resp_").unwrap_or(id);
    let mut output: Vec<Value> =
        completion.text.iter().map(|t| message_item(&format!("msg_{suffix}"), t, "completed")).collect();
    for (i, call) in completion.tool_calls.iter().enumerate() {
        output.push(function_item(&format!("fc_{suffix}_{i}"), call, "completed"));
    }
    let finish = completion.finish.or(Some(Finish::Stop));
    response(id, &completion.model, created, echo, output, finish, completion.usage)
}

/// An output item of a stream, as it grows.
#[derive(Debug)]
enum Item {
    Text { id: String, text: String },
    Function { id: String, index: u32, call: ToolCall },
}

/// Writes a stream's [`Delta`]s as Responses events. It keeps the output so far (the
/// `.done` events and the final `response` carry it), never more than `limit` bytes.
#[derive(Debug)]
pub struct Events {
    id: String,
    model: String,
    created: u64,
    echo: Echo,
    sequence: u64,
    started: bool,
    items: Vec<Item>,
    /// The last item is still open.
    open: bool,
    kept: u64,
    limit: u64,
    finish: Option<Finish>,
    usage: Option<Tokens>,
}

impl Events {
    pub fn new(id: String, echo: Echo, created: u64, limit: u64) -> Events {
        Events {
            id,
            model: String::new(),
            created,
            echo,
            sequence: 0,
            started: false,
            items: Vec::new(),
            open: false,
            kept: 0,
            limit,
            finish: None,
            usage: None,
        }
    }

    fn push(&mut self, out: &mut BytesMut, kind: &str, mut data: Value) {
        data["type"] = kind.into();
        data["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        out.put_slice(b"event: ");
        out.put_slice(kind.as_bytes());
        out.put_slice(b"\ndata: ");
        out.put_slice(data.to_string().as_bytes());
        out.put_slice(b"\n\n");
    }

    fn keep(&mut self, bytes: usize) -> Result<(), String> {
        self.kept += bytes as u64;
        if self.kept > self.limit {
            return Err(format!("the answer is larger than {} bytes (ai.limits.max_response_bytes)", self.limit));
        }
        Ok(())
    }

    fn suffix(&self) -> &str {
        self.id.strip_prefix("resp_").unwrap_or(&self.id)
    }

    fn snapshot(&self, finish: Option<Finish>, usage: Option<Tokens>) -> Value {
        let output = self.items.iter().map(|item| self.item_json(item, "completed")).collect();
        response(&self.id, &self.model, self.created, &self.echo, output, finish, usage)
    }

    fn item_json(&self, item: &Item, status: &str) -> Value {
        match item {
            Item::Text { id, text } => message_item(id, text, status),
            Item::Function { id, call, .. } => function_item(id, call, status),
        }
    }

    /// The events one delta makes, appended to `out`.
    pub fn write(&mut self, delta: Delta, out: &mut BytesMut) -> Result<(), String> {
        if let Delta::Start { model, .. } = &delta {
            self.model.clone_from(model);
        }
        if !std::mem::replace(&mut self.started, true) {
            let response = response(&self.id, &self.model, self.created, &self.echo, Vec::new(), None, None);
            self.push(out, "response.created", json!({"response": response}));
            self.push(out, "response.in_progress", json!({"response": response}));
        }
        match delta {
            Delta::Start { .. } => {}
            Delta::Text(text) => {
                self.keep(text.len())?;
                if !(self.open && matches!(self.items.last(), Some(Item::Text { .. }))) {
                    self.close(out);
                    let id = format!("msg_{}_{}", self.suffix(), self.items.len());
                    let index = self.items.len();
                    self.items.push(Item::Text { id: id.clone(), text: String::new() });
                    self.open = true;
                    let item = json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []});
                    self.push(out, "response.output_item.added", json!({"output_index": index, "item": item}));
                    let part = json!({"type": "output_text", "text": "", "annotations": []});
                    self.push(
                        out,
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                    );
                }
                let index = self.items.len() - 1;
                let Some(Item::Text { id, text: kept }) = self.items.last_mut() else {
                    return Ok(());
                };
                kept.push_str(&text);
                let id = id.clone();
                self.push(
                    out,
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []}),
                );
            }
            Delta::ToolCall { index, id: call_id, name } => {
                self.keep(call_id.len() + name.len())?;
                self.close(out);
                let output_index = self.items.len();
                let id = format!("fc_{}_{}", self.suffix(), output_index);
                let call = ToolCall { id: call_id, name, arguments: String::new() };
                let item = function_item(&id, &call, "in_progress");
                self.items.push(Item::Function { id, index, call });
                self.open = true;
                self.push(out, "response.output_item.added", json!({"output_index": output_index, "item": item}));
            }
            Delta::ToolArguments { index, fragment } => {
                self.keep(fragment.len())?;
                let found = self.items.iter_mut().enumerate().find_map(|(output_index, item)| match item {
                    Item::Function { id, index: i, call } if *i == index => {
                        call.arguments.push_str(&fragment);
                        Some((output_index, id.clone()))
                    }
                    _ => None,
                });
                if let Some((output_index, id)) = found {
                    self.push(
                        out,
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": output_index, "delta": fragment}),
                    );
                }
            }
            Delta::Finish(finish) => self.finish = Some(finish),
            Delta::Usage(tokens) => self.usage = Some(tokens),
            Delta::Done => {
                self.close(out);
                let finish = self.finish.or(Some(Finish::Stop));
                let response = self.snapshot(finish, self.usage);
                let kind = if response["status"] == "completed" { "response.completed" } else { "response.incomplete" };
                self.push(out, kind, json!({"response": response}));
            }
        }
        Ok(())
    }

    /// Ends the open item: its `.done` events, with its whole text or arguments.
    fn close(&mut self, out: &mut BytesMut) {
        if !std::mem::replace(&mut self.open, false) {
            return;
        }
        let index = self.items.len() - 1;
        let Some(item) = self.items.last() else {
            return;
        };
        let done = self.item_json(item, "completed");
        match item {
            Item::Text { id, text } => {
                let (id, text) = (id.clone(), text.clone());
                let part = json!({"type": "output_text", "text": text, "annotations": []});
                self.push(
                    out,
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                );
                self.push(
                    out,
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
            }
            Item::Function { id, call, .. } => {
                let (id, arguments, name) = (id.clone(), call.arguments.clone(), call.name.clone());
                self.push(
                    out,
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments}),
                );
            }
        }
        self.push(out, "response.output_item.done", json!({"output_index": index, "item": done}));
    }

    /// The in-band `error` event a broken stream ends with.
    pub fn error_event(&mut self, code: &str, message: &str) -> Bytes {
        let mut out = BytesMut::new();
        self.push(&mut out, "error", json!({"code": code, "message": message, "param": null}));
        out.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ResponsesRequest, InvalidRequest> {
        ResponsesRequest::parse(v.to_string().as_bytes())
    }

    #[test]
    fn a_string_input_with_instructions_is_a_call() {
        let r = parse(json!({"model": "m", "input": "hello", "instructions": "Be brief.", "max_output_tokens": 30,
            "temperature": 0.2, "stream": true}))
        .unwrap();
        assert_eq!(r.call.system, ["Be brief."]);
        assert_eq!(r.call.messages, [Message { role: Role::User, parts: vec![Part::Text("hello".into())] }]);
        assert_eq!((r.measure.max_tokens, r.measure.stream, r.call.temperature), (Some(30), true, Some(0.2)));
        assert_eq!(r.measure.prompt_text_bytes, 14);
    }

    #[test]
    fn items_with_images_and_a_tool_round_trip_become_a_call() {
        let r = parse(json!({"model": "m", "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "data:image/png;base64,iVBO", "detail": "auto"}
            ]},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "look", "arguments": "{}", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a cat"}
        ], "tools": [{"type": "function", "name": "look", "parameters": {"type": "object"}, "strict": true}],
           "tool_choice": {"type": "function", "name": "look"}}))
        .unwrap();
        assert_eq!(r.call.system, ["Use tools."]);
        assert_eq!(r.measure.images, [ImageRef { url: "data:image/png;base64,iVBO".into() }]);
        assert_eq!(r.call.messages.len(), 3);
        let look = ToolCall { id: "call_1".into(), name: "look".into(), arguments: "{}".into() };
        assert_eq!(r.call.messages[1].parts, [Part::Text("Looking.".into()), Part::ToolCall(look)]);
        assert_eq!(r.call.messages[2].parts, [Part::ToolResult { call_id: "call_1".into(), content: "a cat".into() }]);
        assert_eq!(r.call.tools[0].name, "look");
        assert_eq!(r.call.tool_choice, Some(ToolChoice::Named("look".into())));
    }

    #[test]
    fn what_needs_state_or_built_in_tools_is_refused_naming_the_field() {
        let base = json!({"model": "m", "input": "x"});
        let with = |key: &str, value: Value| {
            let mut body = base.clone();
            body[key] = value;
            parse(body).unwrap_err().param
        };
        assert_eq!(with("previous_response_id", json!("resp_1")), Some("previous_response_id"));
        assert_eq!(with("store", json!(true)), Some("store"));
        assert_eq!(with("background", json!(true)), Some("background"));
        assert_eq!(with("tools", json!([{"type": "web_search"}])), Some("tools"));
        assert_eq!(with("input", json!([{"type": "item_reference", "id": "x"}])), Some("input"));
        assert_eq!(with("input", json!([{"role": "user", "content": [{"type": "input_file"}]}])), Some("input"));
        assert_eq!(with("model", json!(null)), Some("model"));
        assert!(parse(json!({"model": "m", "input": "x", "store": false, "background": false})).is_ok());
    }

    #[test]
    fn an_answer_is_a_response_object() {
        let completion = Completion {
            id: "x".into(),
            model: "gpt-x".into(),
            text: Some("Hi".into()),
            tool_calls: vec![ToolCall { id: "call_1".into(), name: "look".into(), arguments: "{}".into() }],
            finish: Some(Finish::ToolCalls),
            usage: Some(Tokens { input: 5, output: 2, ..Tokens::default() }),
        };
        let r = answer("resp_1", &completion, &Echo::default(), 9);
        assert_eq!(
            (r["object"].as_str(), r["status"].as_str(), r["model"].as_str()),
            (Some("response"), Some("completed"), Some("gpt-x"))
        );
        assert_eq!(r["output"][0]["content"][0]["text"], "Hi");
        assert_eq!(r["output"][1]["call_id"], "call_1");
        assert_eq!(r["usage"]["total_tokens"], 7);
        let cut = Completion { finish: Some(Finish::Length), ..completion };
        assert_eq!(answer("resp_1", &cut, &Echo::default(), 9)["status"], "incomplete");
    }

    #[test]
    fn deltas_become_the_responses_event_sequence() {
        let mut events = Events::new("resp_1".into(), Echo::default(), 1, 1 << 20);
        let mut out = BytesMut::new();
        for delta in [
            Delta::Start { id: "c".into(), model: "gpt-x".into() },
            Delta::Text("Hel".into()),
            Delta::Text("lo".into()),
            Delta::ToolCall { index: 0, id: "call_1".into(), name: "look".into() },
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
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let last = text.lines().filter_map(|l| l.strip_prefix("data: ")).next_back().unwrap();
        let last: Value = serde_json::from_str(last).unwrap();
        assert_eq!(last["response"]["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(last["response"]["usage"]["output_tokens"], 2);
        assert_eq!(last["sequence_number"], 13);
    }

    #[test]
    fn a_stream_keeps_no_more_than_its_limit() {
        let mut events = Events::new("resp_1".into(), Echo::default(), 1, 4);
        let mut out = BytesMut::new();
        events.write(Delta::Text("abc".into()), &mut out).unwrap();
        assert!(events.write(Delta::Text("de".into()), &mut out).is_err());
    }
}
