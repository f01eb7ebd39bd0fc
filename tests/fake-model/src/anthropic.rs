//! The Anthropic Messages API as the fake speaks it: request validation and
//! the reply's wire shapes, as pure functions.
//!
//! The gateway translates OpenAI requests into this API, so the fake must
//! refuse what Anthropic refuses, or translation mistakes pass unseen: every
//! top-level key outside the Messages API is refused (an OpenAI `n`,
//! `stream_options` or `response_format` leaking through), as are blocks in
//! the wrong role, a `system` role inside `messages`, or a `temperature`
//! above 1. Refusals read as Anthropic's do: `<field path>: <why>`.
//!
//! Tokens are counted as in the OpenAI mode, so a translated request costs
//! the same: a word is a whitespace-separated piece, each message (and the
//! `system` prompt) adds 3 to the input, and the output is the reply's words.

use serde_json::{Map, Value, json};

use crate::openai::{split_in, words};
use crate::scenario::Scenario;

/// `cache_creation_input_tokens` under the `cache` scenario.
pub(crate) const CACHE_CREATION_TOKENS: usize = 2048;
/// `cache_read_input_tokens` under the `cache` scenario.
pub(crate) const CACHE_READ_TOKENS: usize = 1024;

const TOP_LEVEL: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "tools",
    "tool_choice",
    "stream",
    "metadata",
    "temperature",
    "top_p",
    "top_k",
];
const IMAGE_TYPES: &[&str] = &["image/jpeg", "image/png", "image/gif", "image/webp"];

/// A valid Messages request, reduced to what the reply depends on.
#[derive(Debug)]
pub(crate) struct MessagesRequest {
    pub model: String,
    pub max_tokens: usize,
    pub stream: bool,
    messages: Vec<Message>,
    /// The words of the `system` prompt, if there is one.
    system_words: Option<usize>,
    stop_sequences: Vec<String>,
    tool_names: Vec<String>,
    tool_choice: ToolChoice,
}

#[derive(Debug)]
struct Message {
    from_user: bool,
    /// The text blocks, joined by a space.
    text: String,
    /// The words of the message as input: text and tool results.
    words: usize,
}

#[derive(Debug, PartialEq, Eq)]
enum ToolChoice {
    Auto,
    Any,
    None,
    Tool(String),
}

/// Who a content block appears under; each role admits its own blocks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    User,
    Assistant,
    System,
    ToolResult,
}

type Checked<T> = Result<T, String>;

impl MessagesRequest {
    /// Validate a request body as Anthropic does; the error is the message of
    /// an `invalid_request_error`.
    pub fn parse(body: &Value) -> Checked<MessagesRequest> {
        let top = body.as_object().ok_or("the request body must be a JSON object")?;
        only_keys(top, "", TOP_LEVEL)?;
        let model = string(top.get("model"), "model")?.to_owned();
        let max_tokens = match top.get("max_tokens") {
            None => return refuse("max_tokens", "Field required"),
            Some(value) => match value.as_u64() {
                Some(0) => return refuse("max_tokens", "Input should be greater than or equal to 1"),
                Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
                None => return refuse("max_tokens", "Input should be a valid integer"),
            },
        };
        let messages = array(top.get("messages"), "messages")?;
        if messages.is_empty() {
            return refuse("messages", "at least one message is required");
        }
        let last = messages.len() - 1;
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, message)| parse_message(message, &format!("messages.{i}"), i == last))
            .collect::<Checked<Vec<Message>>>()?;
        if !messages[0].from_user {
            return refuse("messages", "first message must use the \"user\" role");
        }
        let system_words = match top.get("system") {
            None => None,
            Some(Value::String(text)) => Some(words(text)),
            Some(Value::Array(blocks)) => {
                let mut text = Vec::new();
                for (i, block) in blocks.iter().enumerate() {
                    text.extend(parse_block(block, &format!("system.{i}"), Place::System)?.text);
                }
                Some(words(&text.join(" ")))
            }
            Some(_) => return refuse("system", "Input should be a valid string or a list of text blocks"),
        };
        let stop_sequences = match top.get("stop_sequences") {
            None => Vec::new(),
            Some(value) => array(Some(value), "stop_sequences")?
                .iter()
                .enumerate()
                .map(|(i, s)| string(Some(s), &format!("stop_sequences.{i}")).map(str::to_owned))
                .collect::<Checked<_>>()?,
        };
        let tool_names = match top.get("tools") {
            None => Vec::new(),
            Some(value) => array(Some(value), "tools")?
                .iter()
                .enumerate()
                .map(|(i, tool)| parse_tool(tool, &format!("tools.{i}")))
                .collect::<Checked<_>>()?,
        };
        let tool_choice = match top.get("tool_choice") {
            None => ToolChoice::Auto,
            Some(value) => parse_tool_choice(value)?,
        };
        let stream = match top.get("stream") {
            None => false,
            Some(value) => value.as_bool().ok_or("stream: Input should be a valid boolean")?,
        };
        if let Some(metadata) = top.get("metadata") {
            let metadata = object(metadata, "metadata")?;
            only_keys(metadata, "metadata", &["user_id"])?;
            if let Some(id) = metadata.get("user_id").filter(|id| !id.is_null()) {
                string(Some(id), "metadata.user_id")?;
            }
        }
        for key in ["temperature", "top_p"] {
            match top.get(key).map(Value::as_f64) {
                None => {}
                Some(Some(x)) if (0.0..=1.0).contains(&x) => {}
                Some(Some(x)) if x < 0.0 => return refuse(key, "Input should be greater than or equal to 0"),
                Some(Some(_)) => return refuse(key, "Input should be less than or equal to 1"),
                Some(None) => return refuse(key, "Input should be a valid number"),
            }
        }
        if let Some(top_k) = top.get("top_k")
            && top_k.as_u64().is_none()
        {
            return refuse("top_k", "Input should be a non-negative integer");
        }
        Ok(MessagesRequest {
            model,
            max_tokens,
            stream,
            messages,
            system_words,
            stop_sequences,
            tool_names,
            tool_choice,
        })
    }

    /// As the OpenAI mode's `prompt_tokens`: words plus 3 per message, the
    /// `system` prompt counting as one.
    fn input_tokens(&self) -> usize {
        let system = self.system_words.map_or(0, |w| w + 3);
        system + self.messages.iter().map(|m| m.words + 3).sum::<usize>()
    }

    /// The text of the last user message that has any (tool results are not
    /// the user speaking).
    fn last_user_text(&self) -> String {
        let mut user = self.messages.iter().rev().filter(|m| m.from_user);
        user.clone().find(|m| !m.text.is_empty()).or_else(|| user.next()).map(|m| m.text.clone()).unwrap_or_default()
    }

    /// The tool to call under the `tool_use` scenario: the one `tool_choice`
    /// names, else the first; none without tools or with `tool_choice: none`.
    fn tool_to_call(&self) -> Option<&str> {
        match &self.tool_choice {
            ToolChoice::None => None,
            ToolChoice::Tool(name) => Some(name),
            ToolChoice::Auto | ToolChoice::Any => self.tool_names.first().map(String::as_str),
        }
    }
}

fn parse_message(message: &Value, path: &str, is_last: bool) -> Checked<Message> {
    let fields = object(message, path)?;
    only_keys(fields, path, &["role", "content"])?;
    let role = string(fields.get("role"), &format!("{path}.role"))?;
    let place = match role {
        "user" => Place::User,
        "assistant" => Place::Assistant,
        "system" => {
            let why = "Unexpected role \"system\". The Messages API accepts a top-level `system` parameter, \
                       not \"system\" as an input message role.";
            return refuse("messages", why);
        }
        other => {
            return refuse(&format!("{path}.role"), &format!("Input should be 'user' or 'assistant', not '{other}'"));
        }
    };
    let (text, words_in, empty) = match fields.get("content") {
        None => return refuse(&format!("{path}.content"), "Field required"),
        Some(Value::String(text)) => (text.clone(), words(text), text.is_empty()),
        Some(Value::Array(blocks)) => {
            let mut text = Vec::new();
            let mut counted = 0;
            for (i, block) in blocks.iter().enumerate() {
                let parsed = parse_block(block, &format!("{path}.content.{i}"), place)?;
                counted += parsed.words;
                text.extend(parsed.text);
            }
            (text.join(" "), counted, blocks.is_empty())
        }
        Some(_) => return refuse(&format!("{path}.content"), "Input should be a valid string or a list of blocks"),
    };
    // Anthropic lets only a final assistant message be empty (a prefill).
    if empty && !(is_last && place == Place::Assistant) {
        return refuse(
            path,
            "all messages must have non-empty content except for the optional final assistant message",
        );
    }
    Ok(Message { from_user: place == Place::User, text, words: words_in })
}

/// What a block contributes: its text (text blocks only) and its input words.
struct Block {
    text: Option<String>,
    words: usize,
}

fn parse_block(block: &Value, path: &str, place: Place) -> Checked<Block> {
    let fields = object(block, path)?;
    let kind = string(fields.get("type"), &format!("{path}.type"))?;
    let field = |name: &str| format!("{path}.{name}");
    let allowed = match (kind, place) {
        ("text", _) => &["type", "text", "cache_control", "citations"][..],
        ("image", Place::User | Place::ToolResult) => &["type", "source", "cache_control", "transformations"][..],
        ("tool_use", Place::Assistant) => {
            &["type", "id", "name", "input", "cache_control", "caller", "toolset_name"][..]
        }
        ("tool_result", Place::User) => {
            &["type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"][..]
        }
        ("image" | "tool_use" | "tool_result", _) => {
            let role = match place {
                Place::User => "user",
                Place::Assistant => "assistant",
                Place::System => "system",
                Place::ToolResult => "tool_result",
            };
            return refuse(&field("type"), &format!("`{kind}` blocks are not allowed in {role} content"));
        }
        (other, _) => {
            return refuse(
                &field("type"),
                &format!(
                    "Input tag '{other}' does not match any of the expected tags: 'text', 'image', 'tool_use', 'tool_result'"
                ),
            );
        }
    };
    only_keys(fields, path, allowed)?;
    match kind {
        "text" => {
            let text = string(fields.get("text"), &field("text"))?;
            if text.is_empty() {
                return refuse(&field("text"), "text content blocks must be non-empty");
            }
            Ok(Block { words: words(text), text: Some(text.to_owned()) })
        }
        "image" => {
            let source_path = field("source");
            let source = object(fields.get("source").ok_or(format!("{source_path}: Field required"))?, &source_path)?;
            match string(source.get("type"), &format!("{source_path}.type"))? {
                "base64" => {
                    only_keys(source, &source_path, &["type", "media_type", "data"])?;
                    let media_type = string(source.get("media_type"), &format!("{source_path}.media_type"))?;
                    if !IMAGE_TYPES.contains(&media_type) {
                        let why = format!("Input should be {}", IMAGE_TYPES.join(", "));
                        return refuse(&format!("{source_path}.media_type"), &why);
                    }
                    string(source.get("data"), &format!("{source_path}.data"))?;
                }
                "url" => {
                    only_keys(source, &source_path, &["type", "url"])?;
                    string(source.get("url"), &format!("{source_path}.url"))?;
                }
                other => {
                    let why = format!("Input tag '{other}' does not match any of the expected tags: 'base64', 'url'");
                    return refuse(&format!("{source_path}.type"), &why);
                }
            }
            Ok(Block { text: None, words: 0 })
        }
        "tool_use" => {
            string(fields.get("id"), &field("id"))?;
            string(fields.get("name"), &field("name"))?;
            object(fields.get("input").ok_or(format!("{}: Field required", field("input")))?, &field("input"))?;
            Ok(Block { text: None, words: 0 })
        }
        _ => {
            string(fields.get("tool_use_id"), &field("tool_use_id"))?;
            if let Some(is_error) = fields.get("is_error")
                && !is_error.is_boolean()
            {
                return refuse(&field("is_error"), "Input should be a valid boolean");
            }
            let words = match fields.get("content") {
                None => 0,
                Some(Value::String(text)) => words(text),
                Some(Value::Array(blocks)) => {
                    let mut counted = 0;
                    for (i, block) in blocks.iter().enumerate() {
                        counted += parse_block(block, &format!("{}.{i}", field("content")), Place::ToolResult)?.words;
                    }
                    counted
                }
                Some(_) => return refuse(&field("content"), "Input should be a valid string or a list of blocks"),
            };
            Ok(Block { text: None, words })
        }
    }
}

fn parse_tool(tool: &Value, path: &str) -> Checked<String> {
    let fields = object(tool, path)?;
    // A custom tool's fields as the API documents them; anything else (an
    // OpenAI `parameters` or `function`) is refused.
    let allowed = [
        "name",
        "description",
        "input_schema",
        "cache_control",
        "type",
        "strict",
        "allowed_callers",
        "defer_loading",
        "eager_input_streaming",
        "input_examples",
    ];
    only_keys(fields, path, &allowed)?;
    if let Some(kind) = fields.get("type")
        && kind != "custom"
    {
        return refuse(&format!("{path}.type"), "Input should be 'custom'");
    }
    let name = string(fields.get("name"), &format!("{path}.name"))?;
    if let Some(description) = fields.get("description") {
        string(Some(description), &format!("{path}.description"))?;
    }
    let schema_path = format!("{path}.input_schema");
    object(fields.get("input_schema").ok_or(format!("{schema_path}: Field required"))?, &schema_path)?;
    Ok(name.to_owned())
}

fn parse_tool_choice(value: &Value) -> Checked<ToolChoice> {
    let fields = object(value, "tool_choice")?;
    let choice = match string(fields.get("type"), "tool_choice.type")? {
        "auto" => ToolChoice::Auto,
        "any" => ToolChoice::Any,
        "none" => ToolChoice::None,
        "tool" => ToolChoice::Tool(string(fields.get("name"), "tool_choice.name")?.to_owned()),
        other => {
            let why =
                format!("Input tag '{other}' does not match any of the expected tags: 'auto', 'any', 'tool', 'none'");
            return refuse("tool_choice.type", &why);
        }
    };
    let allowed = match choice {
        ToolChoice::None => &["type"][..],
        ToolChoice::Tool(_) => &["type", "name", "disable_parallel_tool_use"][..],
        ToolChoice::Auto | ToolChoice::Any => &["type", "disable_parallel_tool_use"][..],
    };
    only_keys(fields, "tool_choice", allowed)?;
    if let Some(flag) = fields.get("disable_parallel_tool_use")
        && !flag.is_boolean()
    {
        return refuse("tool_choice.disable_parallel_tool_use", "Input should be a valid boolean");
    }
    Ok(choice)
}

fn refuse<T>(path: &str, why: &str) -> Checked<T> {
    Err(format!("{path}: {why}"))
}

fn only_keys(fields: &Map<String, Value>, path: &str, allowed: &[&str]) -> Checked<()> {
    match fields.keys().find(|key| !allowed.contains(&key.as_str())) {
        Some(key) if path.is_empty() => refuse(key, "Extra inputs are not permitted"),
        Some(key) => refuse(&format!("{path}.{key}"), "Extra inputs are not permitted"),
        None => Ok(()),
    }
}

fn object<'a>(value: &'a Value, path: &str) -> Checked<&'a Map<String, Value>> {
    value.as_object().ok_or_else(|| format!("{path}: Input should be a valid dictionary"))
}

fn string<'a>(value: Option<&'a Value>, path: &str) -> Checked<&'a str> {
    match value {
        Some(Value::String(text)) => Ok(text),
        Some(_) => refuse(path, "Input should be a valid string"),
        None => refuse(path, "Field required"),
    }
}

fn array<'a>(value: Option<&'a Value>, path: &str) -> Checked<&'a Vec<Value>> {
    match value {
        Some(Value::Array(items)) => Ok(items),
        Some(_) => refuse(path, "Input should be a valid list"),
        None => refuse(path, "Field required"),
    }
}

/// One block of the answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Content {
    Text(String),
    ToolUse { name: String, input: Value },
}

/// What the fake "model" answers, before it is shaped into a response.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    pub content: Vec<Content>,
    pub stop_reason: &'static str,
    pub stop_sequence: Option<String>,
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub cached: bool,
}

impl Reply {
    /// The OpenAI mode's reply (the echo or `words`, cut at `max_tokens`
    /// unless `ignore_limit`), then cut before the first stop sequence in it;
    /// or, under `tool_use` with tools, a call of the tool.
    pub fn for_request(request: &MessagesRequest, scenario: &Scenario) -> Reply {
        let input_tokens = request.input_tokens();
        let said = request.last_user_text();
        if let Some(name) = request.tool_to_call().filter(|_| scenario.tool_use) {
            let input = json!({ "echo": said });
            let mut content = Vec::new();
            // A forced call comes without a preamble, as Anthropic's does.
            if request.tool_choice == ToolChoice::Auto {
                content.push(Content::Text(format!("I'll call {name}.")));
            }
            content.push(Content::ToolUse { name: name.to_owned(), input });
            return Reply {
                output_tokens: content.iter().map(Content::words).sum(),
                content,
                stop_reason: "tool_use",
                stop_sequence: None,
                input_tokens,
                cached: scenario.cache,
            };
        }
        let mut text = match scenario.words {
            Some(n) => (1..=n).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" "),
            None => format!("Hello from fake-model! You said: {}", said.chars().take(40).collect::<String>()),
        };
        let mut stop_reason = "end_turn";
        if !scenario.ignore_limit && request.max_tokens < words(&text) {
            text = text.split_whitespace().take(request.max_tokens).collect::<Vec<_>>().join(" ");
            stop_reason = "max_tokens";
        }
        // The earliest stop sequence in what was generated ends it there.
        let stop = request
            .stop_sequences
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        let mut stop_sequence = None;
        if let Some((at, sequence)) = stop {
            text.truncate(at);
            stop_reason = "stop_sequence";
            stop_sequence = Some(sequence.clone());
        }
        Reply {
            output_tokens: words(&text),
            content: vec![Content::Text(text)],
            stop_reason,
            stop_sequence,
            input_tokens,
            cached: scenario.cache,
        }
    }

    fn usage(&self, output_tokens: usize) -> Value {
        let (creation, read) = if self.cached { (CACHE_CREATION_TOKENS, CACHE_READ_TOKENS) } else { (0, 0) };
        json!({
            "input_tokens": self.input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": read,
        })
    }
}

impl Content {
    /// Its output words: the text's, or those of the tool input's JSON.
    fn words(&self) -> usize {
        match self {
            Content::Text(text) => words(text),
            Content::ToolUse { input, .. } => words(&input.to_string()),
        }
    }
}

/// The identity of one answer.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    /// `msg_fake_N`.
    pub id: String,
    /// `toolu_fake_N`, the id of its tool call if it makes one.
    pub tool_use_id: String,
    pub model: String,
}

/// A block as the `content` array and `content_block_start` carry it; a
/// started tool call has an empty input.
fn block(meta: &Meta, content: &Content, started: bool) -> Value {
    match content {
        Content::Text(text) => json!({"type": "text", "text": if started { "" } else { text }}),
        Content::ToolUse { name, input } => json!({
            "type": "tool_use",
            "id": meta.tool_use_id,
            "name": name,
            "input": if started { json!({}) } else { input.clone() },
        }),
    }
}

fn message_object(meta: &Meta, content: Vec<Value>, stop_reason: Value, stop_sequence: Value, usage: Value) -> Value {
    json!({
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    })
}

/// The non-streamed `message` object.
pub(crate) fn message(meta: &Meta, reply: &Reply) -> Value {
    let content = reply.content.iter().map(|c| block(meta, c, false)).collect();
    message_object(
        meta,
        content,
        json!(reply.stop_reason),
        json!(reply.stop_sequence),
        reply.usage(reply.output_tokens),
    )
}

/// One server-sent event: its `event:` name and its `data:`.
pub(crate) type Event = (&'static str, Value);

/// The events of a stream as its steps, and how many of them are content
/// steps. Step 0 opens (`message_start`, the first `content_block_start`,
/// `ping`); then one step per content delta (`content_chunks` per block),
/// those that open a block preceded by the previous block's
/// `content_block_stop` and their own `content_block_start`; then the last
/// `content_block_stop`, `message_delta` and `message_stop`, a step each.
pub(crate) fn stream_steps(meta: &Meta, reply: &Reply, content_chunks: usize) -> (Vec<Vec<Event>>, usize) {
    let start = |index: usize, content: &Content| -> Event {
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block(meta, content, true)}),
        )
    };
    let stop =
        |index: usize| -> Event { ("content_block_stop", json!({"type": "content_block_stop", "index": index})) };
    let opening = message_object(meta, Vec::new(), Value::Null, Value::Null, reply.usage(1));
    let mut opening = vec![("message_start", json!({"type": "message_start", "message": opening}))];
    // The rest, each event marked whether it is a content delta.
    let mut events: Vec<(Event, bool)> = Vec::new();
    for (index, content) in reply.content.iter().enumerate() {
        if index == 0 {
            opening.push(start(index, content));
            opening.push(("ping", json!({"type": "ping"})));
        } else {
            events.push((stop(index - 1), false));
            events.push((start(index, content), false));
        }
        let (pieces, delta) = match content {
            Content::Text(text) => (split_in(text, content_chunks), "text"),
            Content::ToolUse { input, .. } => (split_in(&input.to_string(), content_chunks), "partial_json"),
        };
        for piece in pieces {
            let delta = match delta {
                "text" => json!({"type": "text_delta", "text": piece}),
                _ => json!({"type": "input_json_delta", "partial_json": piece}),
            };
            let data = json!({"type": "content_block_delta", "index": index, "delta": delta});
            events.push((("content_block_delta", data), true));
        }
    }
    events.push((stop(reply.content.len().saturating_sub(1)), false));
    events.push((
        (
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": {"stop_reason": reply.stop_reason, "stop_sequence": reply.stop_sequence},
                "usage": {"output_tokens": reply.output_tokens},
            }),
        ),
        false,
    ));
    events.push((("message_stop", json!({"type": "message_stop"})), false));

    let mut steps = vec![opening];
    let mut pending = Vec::new();
    let mut content_steps = 0;
    for (event, is_delta) in events {
        pending.push(event);
        if is_delta {
            steps.push(std::mem::take(&mut pending));
            content_steps += 1;
        }
    }
    steps.extend(pending.into_iter().map(|event| vec![event]));
    (steps, content_steps)
}

/// Anthropic's error type for a status.
pub(crate) fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The Anthropic error envelope, as an answer's body or an in-stream `error`
/// event's data.
pub(crate) fn error(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(extra: Value) -> Value {
        let mut body = json!({
            "model": "claude-fake",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": "hello there"}],
        });
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        body
    }

    fn refusal(extra: Value) -> String {
        MessagesRequest::parse(&request(extra)).unwrap_err()
    }

    #[test]
    fn accepts_every_documented_field() {
        let body = request(json!({
            "system": [{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "Look"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                ]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a cat"}], "is_error": false},
                ]},
                {"role": "assistant", "content": ""},
            ],
            "stop_sequences": ["END"],
            "tools": [{"name": "look", "description": "Look", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "look", "disable_parallel_tool_use": true},
            "stream": false,
            "metadata": {"user_id": "u1"},
            "temperature": 1,
            "top_p": 0.9,
            "top_k": 5,
        }));
        let request = MessagesRequest::parse(&body).unwrap();
        // system 2 + 3, messages (1 + 3) + 3 + (2 + 3) + 3.
        assert_eq!(request.input_tokens(), 5 + 4 + 3 + 5 + 3);
        assert_eq!(request.last_user_text(), "Look");
        assert_eq!(request.tool_to_call(), Some("look"));
    }

    #[test]
    fn refuses_what_anthropic_refuses() {
        assert_eq!(refusal(json!({"n": 2})), "n: Extra inputs are not permitted");
        assert_eq!(refusal(json!({"temperature": 1.5})), "temperature: Input should be less than or equal to 1");
        assert_eq!(refusal(json!({"max_tokens": 0})), "max_tokens: Input should be greater than or equal to 1");
        assert_eq!(
            refusal(
                json!({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]})
            ),
            "messages.0.content.0.type: `tool_use` blocks are not allowed in user content"
        );
        assert_eq!(
            refusal(json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})),
            "messages.0.content.0.type: Input tag 'image_url' does not match any of the expected tags: 'text', 'image', 'tool_use', 'tool_result'"
        );
        assert_eq!(
            refusal(json!({"tools": [{"name": "f", "parameters": {}}]})),
            "tools.0.parameters: Extra inputs are not permitted"
        );
        assert_eq!(
            refusal(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})),
            "tools.0.function: Extra inputs are not permitted"
        );
        assert_eq!(refusal(json!({"tool_choice": {"type": "required"}})).split(':').next(), Some("tool_choice.type"));
        assert_eq!(
            refusal(json!({"messages": [{"role": "assistant", "content": "hi"}]})),
            "messages: first message must use the \"user\" role"
        );
        assert!(
            refusal(json!({"messages": [{"role": "user", "content": ""}]})).starts_with("messages.0: all messages")
        );
    }

    #[test]
    fn stop_sequence_cuts_before_it_after_the_limit_applies() {
        let parsed = |extra| MessagesRequest::parse(&request(extra)).unwrap();
        let reply = Reply::for_request(&parsed(json!({"stop_sequences": ["zzz", "fake"]})), &Scenario::default());
        assert_eq!(reply.content, vec![Content::Text("Hello from ".into())]);
        assert_eq!((reply.stop_reason, reply.stop_sequence.as_deref()), ("stop_sequence", Some("fake")));
        assert_eq!(reply.output_tokens, 2);

        // Past the limit, the sequence is never generated.
        let reply =
            Reply::for_request(&parsed(json!({"max_tokens": 1, "stop_sequences": ["fake"]})), &Scenario::default());
        assert_eq!(reply.content, vec![Content::Text("Hello".into())]);
        assert_eq!(reply.stop_reason, "max_tokens");
    }

    #[test]
    fn stream_steps_open_then_one_step_per_delta_then_close() {
        let meta = Meta { id: "msg_fake_1".into(), tool_use_id: "toolu_fake_1".into(), model: "m".into() };
        let reply = Reply {
            content: vec![
                Content::Text("abc".into()),
                Content::ToolUse { name: "f".into(), input: json!({"echo": "x"}) },
            ],
            stop_reason: "tool_use",
            stop_sequence: None,
            input_tokens: 4,
            output_tokens: 2,
            cached: false,
        };
        let (steps, content) = stream_steps(&meta, &reply, 2);
        let names: Vec<Vec<&str>> = steps.iter().map(|step| step.iter().map(|(name, _)| *name).collect()).collect();
        assert_eq!(content, 4);
        assert_eq!(
            names,
            vec![
                vec!["message_start", "content_block_start", "ping"],
                vec!["content_block_delta"],
                vec!["content_block_delta"],
                vec!["content_block_stop", "content_block_start", "content_block_delta"],
                vec!["content_block_delta"],
                vec!["content_block_stop"],
                vec!["message_delta"],
                vec!["message_stop"],
            ]
        );
        let (steps, content) = stream_steps(&meta, &reply, 0);
        assert_eq!(content, 0);
        assert_eq!(steps.iter().map(Vec::len).sum::<usize>(), 3 + 2 + 3);
    }
}
