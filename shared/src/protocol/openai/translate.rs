//! The OpenAI Chat Completions translator. Inbound: a client's request into a
//! [`Call`], and the answer ([`Completion`], [`Delta`]s) back into Chat Completions
//! JSON. Outbound: a [`Call`] made by another inbound format into a request for an
//! OpenAI backend, and that backend's answer and chunks back into the model.

use serde_json::{Map, Value, json};

use super::{ChatRequest, InvalidRequest, invalid, value};
use crate::protocol::chat::{
    Call, Completion, Delta, Finish, Image, Message, Part, Role, Tokens, Tool, ToolCall, ToolChoice,
};

impl ChatRequest {
    /// The call this request makes. The request was checked by `parse`; what only a
    /// translation needs (a tool message's `tool_call_id`, well-formed tools) is
    /// checked here, with the `param` at fault.
    pub fn call(&self) -> Result<Call, InvalidRequest> {
        let field = |key: &str| self.body.get(key).map(|raw| value(raw));
        let mut call = Call {
            max_tokens: self.max_tokens,
            stream: self.stream,
            choices: self.choices,
            user: self.user.clone(),
            temperature: field("temperature").as_ref().and_then(Value::as_f64),
            top_p: field("top_p").as_ref().and_then(Value::as_f64),
            stop: match field("stop") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::String(s)) => vec![s],
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|s| s.as_str().map(str::to_owned))
                    .collect::<Option<_>>()
                    .ok_or_else(|| invalid("stop", "`stop` must be a string or an array of strings"))?,
                Some(_) => return Err(invalid("stop", "`stop` must be a string or an array of strings")),
            },
            tools: tools(field("tools").as_ref())?,
            tool_choice: tool_choice(field("tool_choice").as_ref())?,
            ..Call::default()
        };
        for (i, message) in self.messages.iter().enumerate() {
            let role = message.get("role").and_then(Value::as_str).unwrap_or_default();
            let content = message.get("content");
            match role {
                "system" | "developer" => call.system.push(text_of(i, content)?),
                "user" => call.messages.push(Message { role: Role::User, parts: parts(content) }),
                "assistant" => {
                    let mut parts = parts(content);
                    for tool_call in message.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                        parts.push(Part::ToolCall(assistant_tool_call(i, tool_call)?));
                    }
                    call.messages.push(Message { role: Role::Assistant, parts });
                }
                "tool" => {
                    let call_id = message.get("tool_call_id").and_then(Value::as_str).ok_or_else(|| {
                        invalid("messages", format!("messages[{i}].tool_call_id is required for a tool message"))
                    })?;
                    let part = Part::ToolResult { call_id: call_id.to_owned(), content: text_of(i, content)? };
                    call.messages.push(Message { role: Role::User, parts: vec![part] });
                }
                other => {
                    return Err(invalid("messages", format!("messages[{i}].role `{other}` is not a chat role")));
                }
            }
        }
        Ok(call)
    }
}

/// A message's content as parts (`parse` checked their shapes).
fn parts(content: Option<&Value>) -> Vec<Part> {
    match content {
        Some(Value::String(text)) => vec![Part::Text(text.clone())],
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| match part.get("type").and_then(Value::as_str) {
                Some("text") => part.get("text").and_then(Value::as_str).map(|t| Part::Text(t.to_owned())),
                Some("image_url") => {
                    let url = part.get("image_url").and_then(|u| u.get("url").or(Some(u))).and_then(Value::as_str);
                    url.map(|url| Part::Image(Image::from_url(url)))
                }
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A content that must be text: a string, or text parts (joined).
fn text_of(i: usize, content: Option<&Value>) -> Result<String, InvalidRequest> {
    let mut text = String::new();
    for part in parts(content) {
        match part {
            Part::Text(t) => text.push_str(&t),
            _ => return Err(invalid("messages", format!("messages[{i}].content must be text for this role"))),
        }
    }
    Ok(text)
}

fn assistant_tool_call(i: usize, value: &Value) -> Result<ToolCall, InvalidRequest> {
    let field = |key: &str| value.get(key).and_then(Value::as_str);
    let function = value.get("function");
    let function_field = |key: &str| function.and_then(|f| f.get(key)).and_then(Value::as_str);
    match (field("id"), function_field("name")) {
        (Some(id), Some(name)) => Ok(ToolCall {
            id: id.to_owned(),
            name: name.to_owned(),
            arguments: function_field("arguments").unwrap_or("{}").to_owned(),
        }),
        _ => Err(invalid("messages", format!("messages[{i}].tool_calls[] needs an `id` and a `function.name`"))),
    }
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
        .map(|(i, tool)| {
            let function =
                tool.get("function").filter(|_| tool.get("type").and_then(Value::as_str) == Some("function"));
            let name = function.and_then(|f| f.get("name")).and_then(Value::as_str);
            let Some((function, name)) = function.zip(name) else {
                return Err(invalid(
                    "tools",
                    format!("tools[{i}] must be {{type: function, function: {{name, ...}}}}"),
                ));
            };
            Ok(Tool {
                name: name.to_owned(),
                description: function.get("description").and_then(Value::as_str).map(str::to_owned),
                parameters: function.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"})),
            })
        })
        .collect()
}

fn tool_choice(value: Option<&Value>) -> Result<Option<ToolChoice>, InvalidRequest> {
    Ok(Some(match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(Value::String(s)) if s == "required" => ToolChoice::Required,
        Some(v) => match v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) => ToolChoice::Named(name.to_owned()),
            None => {
                return Err(invalid(
                    "tool_choice",
                    "`tool_choice` must be auto, none, required or {type: function, function: {name}}",
                ));
            }
        },
    }))
}

/// The `usage` object of Chat Completions: cache reads as `cached_tokens`.
pub fn usage(tokens: &Tokens) -> Value {
    let mut usage = json!({
        "prompt_tokens": tokens.input,
        "completion_tokens": tokens.output,
        "total_tokens": tokens.input.saturating_add(tokens.output),
    });
    if tokens.cache_read > 0 || tokens.cache_write > 0 {
        usage["prompt_tokens_details"] = json!({"cached_tokens": tokens.cache_read});
    }
    usage
}

fn tool_calls(calls: &[ToolCall]) -> Value {
    calls
        .iter()
        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect()
}

/// A `chat.completion` object.
pub fn completion(answer: &Completion, created: u64) -> Value {
    let mut message = Map::new();
    message.insert("role".into(), "assistant".into());
    message.insert("content".into(), answer.text.clone().map_or(Value::Null, Value::String));
    if !answer.tool_calls.is_empty() {
        message.insert("tool_calls".into(), tool_calls(&answer.tool_calls));
    }
    let mut body = json!({
        "id": answer.id,
        "object": "chat.completion",
        "created": created,
        "model": answer.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": answer.finish.map(|f| f.as_str()),
        }],
    });
    if let Some(tokens) = &answer.usage {
        body["usage"] = usage(tokens);
    }
    body
}

/// Writes a stream's [`Delta`]s as `chat.completion.chunk` objects.
#[derive(Debug, Default)]
pub struct Chunks {
    id: String,
    model: String,
    created: u64,
}

impl Chunks {
    pub fn new(created: u64) -> Chunks {
        Chunks { created, ..Chunks::default() }
    }

    /// The chunk a delta makes; `None` for [`Delta::Done`] (the transport's `[DONE]`).
    pub fn chunk(&mut self, delta: Delta) -> Option<Value> {
        let choice = |delta: Value, finish: Option<&str>| json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
        let (choices, usage) = match delta {
            Delta::Start { id, model } => {
                (self.id, self.model) = (id, model);
                (choice(json!({"role": "assistant", "content": ""}), None), None)
            }
            Delta::Text(text) => (choice(json!({"content": text}), None), None),
            Delta::ToolCall { index, id, name } => {
                let call =
                    json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}});
                (choice(json!({"tool_calls": [call]}), None), None)
            }
            Delta::ToolArguments { index, fragment } => {
                (choice(json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}), None), None)
            }
            Delta::Finish(finish) => (choice(json!({}), Some(finish.as_str())), None),
            Delta::Usage(tokens) => (json!([]), Some(usage(&tokens))),
            Delta::Done => return None,
        };
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        Some(chunk)
    }
}

// ---------------------------------------------------------------- outbound
// A [`Call`] from another inbound format, to an OpenAI backend. (A Chat Completions
// client's own request goes as it came: the identity, `ChatRequest::upstream_body`.)

/// The Chat Completions request a call makes for `model`, with the gateway's
/// `allowance` as `max_completion_tokens`, usage asked for in a stream.
pub fn request(call: &Call, model: &str, allowance: u64) -> Vec<u8> {
    let mut messages: Vec<Value> = call.system.iter().map(|s| json!({"role": "system", "content": s})).collect();
    for message in &call.messages {
        let mut content = Vec::new();
        let mut calls = Vec::new();
        for part in &message.parts {
            match part {
                Part::Text(text) => content.push(json!({"type": "text", "text": text})),
                Part::Image(Image::Data { media_type, base64 }) => content.push(
                    json!({"type": "image_url", "image_url": {"url": format!("data:{media_type};base64,{base64}")}}),
                ),
                Part::Image(Image::Url(url)) => content.push(json!({"type": "image_url", "image_url": {"url": url}})),
                Part::ToolCall(call) => calls.push(call.clone()),
                // A tool's answer is a message of its own.
                Part::ToolResult { call_id, content } => {
                    messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": content}));
                }
            }
        }
        if content.is_empty() && calls.is_empty() {
            continue;
        }
        let role = if message.role == Role::User { "user" } else { "assistant" };
        let mut out = json!({"role": role, "content": if content.is_empty() { Value::Null } else { content.into() }});
        if !calls.is_empty() {
            out["tool_calls"] = tool_calls(&calls);
        }
        messages.push(out);
    }
    let mut body = json!({"model": model, "messages": messages, "max_completion_tokens": allowance});
    let mut set = |key: &str, value: Value| {
        body[key] = value;
    };
    if !call.stop.is_empty() {
        set("stop", call.stop.clone().into());
    }
    if let Some(t) = call.temperature {
        set("temperature", t.into());
    }
    if let Some(p) = call.top_p {
        set("top_p", p.into());
    }
    if call.choices > 1 {
        set("n", call.choices.into());
    }
    if let Some(user) = &call.user {
        set("user", user.clone().into());
    }
    if !call.tools.is_empty() {
        let tools = call.tools.iter().map(|t| {
            let mut function = json!({"name": t.name, "parameters": t.parameters});
            if let Some(d) = &t.description {
                function["description"] = d.clone().into();
            }
            json!({"type": "function", "function": function})
        });
        set("tools", tools.collect());
    }
    if let Some(choice) = &call.tool_choice {
        set(
            "tool_choice",
            match choice {
                ToolChoice::Auto => "auto".into(),
                ToolChoice::None => "none".into(),
                ToolChoice::Required => "required".into(),
                ToolChoice::Named(name) => json!({"type": "function", "function": {"name": name}}),
            },
        );
    }
    if call.stream {
        set("stream", true.into());
        set("stream_options", json!({"include_usage": true}));
    }
    serde_json::to_vec(&body).unwrap_or_default()
}

fn finish(reason: &str) -> Finish {
    Finish::from_openai(reason)
}

fn tokens(usage: &Value) -> Option<Tokens> {
    let input = usage.get("prompt_tokens")?.as_u64()?;
    let cache_read = usage.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0);
    let output = usage.get("completion_tokens").and_then(Value::as_u64).unwrap_or(0);
    Some(Tokens { input, output, cache_read, cache_write: 0 })
}

/// A `chat.completion` as a [`Completion`] (its first choice); `None` when it is not one.
pub fn read_completion(body: &[u8]) -> Option<Completion> {
    let answer: Value = serde_json::from_slice(body).ok()?;
    let choice = answer.get("choices")?.as_array()?.first()?;
    let message = choice.get("message")?;
    let tool_calls = message.get("tool_calls").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).map(str::to_owned);
    Some(Completion {
        id: text(&answer, "id").unwrap_or_default(),
        model: text(&answer, "model").unwrap_or_default(),
        text: text(message, "content"),
        tool_calls: tool_calls
            .iter()
            .filter_map(|c| {
                let function = c.get("function")?;
                Some(ToolCall {
                    id: text(c, "id")?,
                    name: text(function, "name")?,
                    arguments: text(function, "arguments").unwrap_or_default(),
                })
            })
            .collect(),
        finish: choice.get("finish_reason").and_then(Value::as_str).map(finish),
        usage: answer.get("usage").and_then(tokens),
    })
}

/// The [`Delta`]s of one `chat.completion.chunk` (its first choice), or of `[DONE]`.
pub fn read_chunk(data: &str) -> Option<Vec<Delta>> {
    if data.trim() == "[DONE]" {
        return Some(vec![Delta::Done]);
    }
    let chunk: Value = serde_json::from_str(data).ok()?;
    Some(deltas(&chunk))
}

/// The [`Delta`]s of one `chat.completion.chunk` already read (its first choice).
pub fn deltas(chunk: &Value) -> Vec<Delta> {
    let mut deltas = Vec::new();
    if let Some(choice) = chunk.get("choices").and_then(Value::as_array).and_then(|c| c.first()) {
        let delta = &choice["delta"];
        if delta.get("role").is_some() {
            let field = |key: &str| chunk.get(key).and_then(Value::as_str).unwrap_or_default().to_owned();
            deltas.push(Delta::Start { id: field("id"), model: field("model") });
        }
        if let Some(text) = delta.get("content").and_then(Value::as_str).filter(|t| !t.is_empty()) {
            deltas.push(Delta::Text(text.to_owned()));
        }
        for call in delta.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
            let index = call.get("index").and_then(Value::as_u64).and_then(|i| u32::try_from(i).ok()).unwrap_or(0);
            let function = &call["function"];
            if let (Some(id), Some(name)) =
                (call.get("id").and_then(Value::as_str), function.get("name").and_then(Value::as_str))
            {
                deltas.push(Delta::ToolCall { index, id: id.to_owned(), name: name.to_owned() });
            }
            if let Some(fragment) = function.get("arguments").and_then(Value::as_str).filter(|a| !a.is_empty()) {
                deltas.push(Delta::ToolArguments { index, fragment: fragment.to_owned() });
            }
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            deltas.push(Delta::Finish(finish(reason)));
        }
    }
    if let Some(tokens) = chunk.get("usage").and_then(tokens) {
        deltas.push(Delta::Usage(tokens));
    }
    deltas
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::chat::Finish;

    fn call(body: Value) -> Result<Call, InvalidRequest> {
        ChatRequest::parse(body.to_string().as_bytes()).unwrap().call()
    }

    #[test]
    fn a_conversation_with_tools_and_images_becomes_a_call() {
        let call = call(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                    {"type": "image_url", "image_url": {"url": "https://img.example.com/a.png"}}
                ]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{\"q\":1}"}}
                ]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a cat"}
            ],
            "tools": [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "look"}},
            "stop": "END",
            "max_completion_tokens": 50,
            "temperature": 0.5,
            "stream": true,
            "user": "u-1"
        }))
        .unwrap();
        assert_eq!(call.system, ["Be brief.", "Use tools."]);
        assert_eq!(call.messages.len(), 3);
        assert_eq!(
            call.messages[0].parts,
            [
                Part::Text("What is this?".into()),
                Part::Image(Image::Data { media_type: "image/png".into(), base64: "iVBO".into() }),
                Part::Image(Image::Url("https://img.example.com/a.png".into())),
            ]
        );
        let look = ToolCall { id: "call_1".into(), name: "look".into(), arguments: "{\"q\":1}".into() };
        assert_eq!(call.messages[1], Message { role: Role::Assistant, parts: vec![Part::ToolCall(look)] });
        let result = Part::ToolResult { call_id: "call_1".into(), content: "a cat".into() };
        assert_eq!(call.messages[2], Message { role: Role::User, parts: vec![result] });
        assert_eq!(call.tools[0].name, "look");
        assert_eq!(call.tool_choice, Some(ToolChoice::Named("look".into())));
        assert_eq!((call.stop, call.max_tokens, call.temperature), (vec!["END".to_owned()], Some(50), Some(0.5)));
        assert!(call.stream);
        assert_eq!(call.user.as_deref(), Some("u-1"));
    }

    #[test]
    fn what_a_translation_cannot_carry_is_refused_with_its_param() {
        let no_id = json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]});
        assert!(call(no_id).unwrap_err().message.contains("tool_call_id"));
        let tools = json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]});
        assert_eq!(call(tools).unwrap_err().param, Some("tools"));
        let stop = json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [1]});
        assert_eq!(call(stop).unwrap_err().param, Some("stop"));
        let image_system = json!({"model": "m", "messages": [
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "https://a/b.png"}}]}
        ]});
        assert!(call(image_system).unwrap_err().message.contains("must be text"));
    }

    #[test]
    fn deltas_become_chunks_of_one_id_and_model() {
        let mut chunks = Chunks::new(7);
        let start = chunks.chunk(Delta::Start { id: "msg_1".into(), model: "claude".into() }).unwrap();
        assert_eq!(start["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
        let text = chunks.chunk(Delta::Text("Hi".into())).unwrap();
        assert_eq!(
            (text["id"].as_str(), text["model"].as_str(), text["created"].as_u64()),
            (Some("msg_1"), Some("claude"), Some(7))
        );
        assert_eq!(text["choices"][0]["delta"]["content"], "Hi");
        let tool = chunks.chunk(Delta::ToolCall { index: 0, id: "t".into(), name: "look".into() }).unwrap();
        assert_eq!(tool["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "look");
        let args = chunks.chunk(Delta::ToolArguments { index: 0, fragment: "{\"a\"".into() }).unwrap();
        assert_eq!(args["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"], "{\"a\"");
        let finish = chunks.chunk(Delta::Finish(Finish::ToolCalls)).unwrap();
        assert_eq!(finish["choices"][0]["finish_reason"], "tool_calls");
        let tokens = Tokens { input: 10, output: 3, cache_read: 4, cache_write: 0 };
        let usage = chunks.chunk(Delta::Usage(tokens)).unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(
            usage["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 4}})
        );
        assert_eq!(chunks.chunk(Delta::Done), None);
    }

    #[test]
    fn a_completion_with_tool_calls_reads_as_openai() {
        let answer = Completion {
            id: "msg_1".into(),
            model: "claude".into(),
            text: None,
            tool_calls: vec![ToolCall { id: "t1".into(), name: "look".into(), arguments: "{}".into() }],
            finish: Some(crate::protocol::chat::Finish::ToolCalls),
            usage: Some(Tokens { input: 5, output: 2, ..Tokens::default() }),
        };
        let body = completion(&answer, 9);
        assert_eq!(body["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(body["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "look");
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(body["usage"], json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}));
        let read = super::super::Answer::read(body.to_string().as_bytes()).unwrap();
        assert_eq!(read.finish_reasons, [Finish::ToolCalls]);
    }

    #[test]
    fn a_call_goes_out_and_reads_back_the_same() {
        let original = call(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [
                    {"type": "text", "text": "What?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}
                ]},
                {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
                ]},
                {"role": "tool", "tool_call_id": "c1", "content": "a cat"}
            ],
            "tools": [{"type": "function", "function": {"name": "look", "description": "d", "parameters": {"type": "object"}}}],
            "tool_choice": "required",
            "stop": ["END"],
            "n": 2,
            "top_p": 0.9,
            "stream": true,
            "user": "u"
        }))
        .unwrap();
        let sent = request(&original, "gpt-x", 77);
        let back = ChatRequest::parse(&sent).unwrap();
        assert_eq!((back.model.as_str(), back.max_tokens, back.client_wants_usage), ("gpt-x", Some(77), true));
        assert_eq!(back.call().unwrap(), Call { max_tokens: Some(77), ..original });
    }

    #[test]
    fn answers_and_chunks_read_back_into_the_model() {
        let answer = Completion {
            id: "a".into(),
            model: "m".into(),
            text: Some("Hi".into()),
            tool_calls: vec![ToolCall { id: "t".into(), name: "look".into(), arguments: "{}".into() }],
            finish: Some(Finish::Length),
            usage: Some(Tokens { input: 9, output: 2, cache_read: 3, cache_write: 0 }),
        };
        assert_eq!(read_completion(completion(&answer, 1).to_string().as_bytes()), Some(answer));
        let deltas = [
            Delta::Start { id: "a".into(), model: "m".into() },
            Delta::Text("Hi".into()),
            Delta::ToolCall { index: 1, id: "t".into(), name: "look".into() },
            Delta::ToolArguments { index: 1, fragment: "{}".into() },
            Delta::Finish(Finish::ToolCalls),
            Delta::Usage(Tokens { input: 9, output: 2, cache_read: 0, cache_write: 0 }),
        ];
        let mut chunks = Chunks::new(1);
        for delta in deltas {
            let chunk = chunks.chunk(delta.clone()).unwrap();
            assert_eq!(read_chunk(&chunk.to_string()), Some(vec![delta]));
        }
        assert_eq!(read_chunk("[DONE]"), Some(vec![Delta::Done]));
    }
}
