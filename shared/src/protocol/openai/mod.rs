//! The OpenAI surface: request views, usage, error envelopes.
//!
//! Requests are kept as their top-level fields, each as the client wrote it, and relayed
//! with every field the client sent, except the few the gateway owns (`model`,
//! `stream_options`, the completion allowance): the client's own text of each field
//! goes upstream, never written again from values (that cost as much as
//! reading them). What the gateway needs to decide (model, stream, limits, images) is
//! read once here, from values of the fields it reads, and a malformed request is
//! refused here with the `param` that is wrong.

use std::collections::BTreeMap;

use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use crate::config::Capability;
use crate::protocol::chat::Finish;

pub mod translate;

pub use crate::call::{InvalidRequest, Usage};
use crate::call::{MAX_MODEL_BYTES, MAX_USER_BYTES};

fn invalid(param: &'static str, message: impl Into<String>) -> InvalidRequest {
    InvalidRequest { message: message.into(), param: Some(param) }
}

/// The OpenAI error envelope.
pub fn error_envelope(message: &str, kind: &str, code: &str, param: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

impl Usage {
    /// Reads an OpenAI `usage` object; `None` when absent or null.
    pub fn from_value(usage: Option<&Value>) -> Option<Usage> {
        let usage = usage?.as_object()?;
        let get = |k: &str| usage.get(k).and_then(Value::as_u64);
        let prompt = get("prompt_tokens")?;
        let completion = get("completion_tokens").unwrap_or(0);
        let cached = usage
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .min(prompt);
        Some(Usage { cached_tokens: cached, ..Usage::new(prompt, completion) })
    }
}

/// What the gateway reads of a non-streamed answer: its usage, and the size of its
/// completion text (to estimate usage a backend did not report). Everything else is
/// skipped without being built (an embeddings answer is mostly floats).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub usage: Option<Usage>,
    pub completion_bytes: u64,
    /// Each choice's `finish_reason` (`stop`, `length`, ...), in the order given.
    pub finish_reasons: Vec<Finish>,
}

#[derive(serde::Deserialize)]
struct AnswerView {
    #[serde(default)]
    usage: Option<UsageView>,
    #[serde(default)]
    choices: Option<Vec<ChoiceView>>,
}

#[derive(serde::Deserialize)]
pub(crate) struct UsageView {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetailsView>,
}

/// OpenAI's `prompt_tokens_details`: the prompt tokens its prompt cache held.
#[derive(serde::Deserialize)]
struct PromptDetailsView {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl UsageView {
    /// As [`Usage::from_value`]: `prompt_tokens` required, `completion_tokens` 0 when
    /// absent, `prompt_tokens_details.cached_tokens` (at most the prompt) when given.
    pub(crate) fn usage(&self) -> Option<Usage> {
        let prompt = self.prompt_tokens?;
        let cached = self.prompt_tokens_details.as_ref().and_then(|d| d.cached_tokens).unwrap_or(0).min(prompt);
        Some(Usage { cached_tokens: cached, ..Usage::new(prompt, self.completion_tokens.unwrap_or(0)) })
    }
}

/// Whether a JSON text is an object: serde reads a struct from a JSON array too, and
/// the views here read objects only.
pub(crate) fn is_object(text: &[u8]) -> bool {
    text.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

#[derive(serde::Deserialize)]
struct ChoiceView {
    #[serde(default)]
    message: Option<MessageView>,
    #[serde(default)]
    finish_reason: Option<Value>,
}

#[derive(serde::Deserialize)]
struct MessageView {
    #[serde(default)]
    content: Option<TextLen>,
}

/// A string's length in bytes (its escapes undone), read without keeping the string:
/// the completion's text is measured, never held.
pub(crate) struct TextLen(pub u64);

impl<'de> serde::Deserialize<'de> for TextLen {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Measure;
        impl serde::de::Visitor<'_> for Measure {
            type Value = TextLen;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<TextLen, E> {
                Ok(TextLen(text.len() as u64))
            }
        }
        deserializer.deserialize_str(Measure)
    }
}

impl Answer {
    /// `None` when the body is not a JSON object of the OpenAI shape.
    pub fn read(body: &[u8]) -> Option<Answer> {
        if !is_object(body) {
            return None;
        }
        let view: AnswerView = serde_json::from_slice(body).ok()?;
        let usage = view.usage.as_ref().and_then(UsageView::usage);
        let choices = view.choices.unwrap_or_default();
        let finish_reasons = choices
            .iter()
            .filter_map(|c| c.finish_reason.as_ref().and_then(Value::as_str))
            .take(MAX_CHOICES as usize)
            .map(Finish::from_openai)
            .collect();
        let completion_bytes =
            choices.into_iter().filter_map(|c| c.message.and_then(|m| m.content)).map(|TextLen(len)| len).sum();
        Some(Answer { usage, completion_bytes, finish_reasons })
    }

    /// What the gateway reads of an answer translated from another format.
    pub fn of(completion: &crate::protocol::chat::Completion) -> Answer {
        let text = completion.text.as_ref().map_or(0, String::len);
        let calls: usize = completion.tool_calls.iter().map(|c| c.name.len() + c.arguments.len()).sum();
        Answer {
            usage: completion.usage.map(Usage::from),
            completion_bytes: (text + calls) as u64,
            finish_reasons: completion.finish.into_iter().collect(),
        }
    }
}

/// A request body's top-level fields, each as the client wrote it: sorted by key, and
/// the last of a repeated key kept, as serde_json's `Map` keeps them.
type Fields = BTreeMap<String, Box<RawValue>>;

fn parse_object(body: &[u8]) -> Result<Fields, InvalidRequest> {
    match serde_json::from_slice::<Fields>(body) {
        Ok(fields) => Ok(fields),
        // Valid JSON of another type than an object.
        Err(e) if e.is_data() => {
            Err(InvalidRequest { message: "the request body must be a JSON object".into(), param: None })
        }
        Err(e) => Err(InvalidRequest { message: format!("the request body is not valid JSON: {e}"), param: None }),
    }
}

/// A field read as a value (its text was parsed once already: it parses again).
fn value(raw: &RawValue) -> Value {
    serde_json::from_str(raw.get()).unwrap_or(Value::Null)
}

/// The compact length of a field written as JSON.
fn json_len(raw: &RawValue) -> u64 {
    crate::protocol::json_len(&value(raw))
}

fn is_null(raw: &RawValue) -> bool {
    raw.get() == "null"
}

fn required_model(body: &Fields) -> Result<String, InvalidRequest> {
    match body.get("model").map(|raw| value(raw)) {
        Some(Value::String(m)) if !m.trim().is_empty() => {
            InvalidRequest::check_bounded("model", &m, MAX_MODEL_BYTES)?;
            Ok(m)
        }
        Some(Value::String(_)) | None => Err(invalid("model", "`model` is required")),
        Some(_) => Err(invalid("model", "`model` must be a string")),
    }
}

fn optional_user(body: &Fields) -> Result<Option<String>, InvalidRequest> {
    match body.get("user").map(|raw| value(raw)) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(u)) => {
            InvalidRequest::check_bounded("user", &u, MAX_USER_BYTES)?;
            Ok(Some(u))
        }
        Some(_) => Err(invalid("user", "`user` must be a string")),
    }
}

fn optional_u64(body: &Fields, key: &'static str) -> Result<Option<u64>, InvalidRequest> {
    match body.get(key).map(|raw| value(raw)) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| invalid(key, format!("`{key}` must be a non-negative integer"))),
    }
}

/// An image found in a message, measured without decoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// The `url` field: a `data:` URI or a remote URL.
    pub url: String,
}

/// The most choices (`n`) one call may ask for, as OpenAI's own API.
pub const MAX_CHOICES: u64 = 128;

/// A `POST /v1/chat/completions` body.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    body: Fields,
    /// The messages as values: measured by `parse`, read by the translations.
    messages: Vec<Value>,
    pub model: String,
    pub stream: bool,
    /// Whether the client itself asked for the usage chunk.
    pub client_wants_usage: bool,
    /// The completion limit of each choice the client set: the smaller of
    /// `max_completion_tokens` and `max_tokens` when it sent both.
    pub max_tokens: Option<u64>,
    /// `n`: how many choices the backend writes, each up to the allowance.
    pub choices: u64,
    pub images: Vec<ImageRef>,
    /// Bytes of text across the messages: an upper bound of their token count.
    pub prompt_text_bytes: u64,
    pub message_count: u64,
    /// The OpenAI `user` field: hashed before it goes anywhere.
    pub user: Option<String>,
}

impl ChatRequest {
    pub fn parse(bytes: &[u8]) -> Result<Self, InvalidRequest> {
        let body = parse_object(bytes)?;
        let model = required_model(&body)?;
        let stream = match body.get("stream").map(|raw| value(raw)) {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(_) => return Err(invalid("stream", "`stream` must be a boolean")),
        };
        let client_wants_usage = match body.get("stream_options").map(|raw| value(raw)) {
            None | Some(Value::Null) => false,
            Some(Value::Object(o)) => match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(invalid("stream_options", "`stream_options.include_usage` must be a boolean"));
                }
            },
            Some(_) => {
                return Err(invalid("stream_options", "`stream_options` must be an object"));
            }
        };
        let max_tokens = [optional_u64(&body, "max_completion_tokens")?, optional_u64(&body, "max_tokens")?]
            .into_iter()
            .flatten()
            .min();
        let choices = match optional_u64(&body, "n")? {
            None => 1,
            Some(n @ 1..=MAX_CHOICES) => n,
            Some(_) => return Err(invalid("n", format!("`n` must be between 1 and {MAX_CHOICES}"))),
        };
        let messages = match body.get("messages").map(|raw| value(raw)) {
            Some(Value::Array(m)) if !m.is_empty() => m,
            Some(Value::Array(_)) => {
                return Err(invalid("messages", "`messages` must not be empty"));
            }
            None => return Err(invalid("messages", "`messages` is required")),
            Some(_) => return Err(invalid("messages", "`messages` must be an array")),
        };
        let mut images = Vec::new();
        let mut prompt_text_bytes = 0u64;
        for (i, message) in messages.iter().enumerate() {
            let Some(message) = message.as_object() else {
                return Err(invalid("messages", format!("messages[{i}] must be an object")));
            };
            if !matches!(message.get("role"), Some(Value::String(_))) {
                return Err(invalid("messages", format!("messages[{i}].role is required")));
            }
            prompt_text_bytes += measure_content(i, message.get("content"), &mut images)?;
            // Tool calls and names count towards the prompt too: measure them as text.
            for key in ["tool_calls", "function_call", "name"] {
                if let Some(v) = message.get(key) {
                    prompt_text_bytes += crate::protocol::json_len(v);
                }
            }
        }
        // Tool definitions are part of the prompt the model reads.
        for key in ["tools", "functions", "response_format"] {
            if let Some(raw) = body.get(key) {
                prompt_text_bytes += json_len(raw);
            }
        }
        let message_count = messages.len() as u64;
        let user = optional_user(&body)?;
        Ok(ChatRequest {
            user,
            body,
            model,
            stream,
            client_wants_usage,
            max_tokens,
            choices,
            images,
            prompt_text_bytes,
            message_count,
            messages,
        })
    }

    pub fn capability(&self) -> Capability {
        if self.images.is_empty() { Capability::Chat } else { Capability::Vision }
    }

    /// The body sent upstream: the client's, with the served model, usage always asked
    /// of a stream, and the completion allowance reserved for each choice: written
    /// in each limit field the client sent, or in `max_tokens` (the field every
    /// OpenAI-compatible server reads) when it sent none.
    pub fn upstream_body(&self, served_model: &str, allowance: u64) -> Vec<u8> {
        let mut owned = vec![("model", Value::String(served_model.to_owned()))];
        if self.stream {
            let mut options = match self.body.get("stream_options").map(|raw| value(raw)) {
                Some(Value::Object(o)) => o,
                _ => Map::new(),
            };
            options.insert("include_usage".into(), Value::Bool(true));
            owned.push(("stream_options", Value::Object(options)));
        }
        let sent = |key: &str| self.body.get(key).is_some_and(|raw| !is_null(raw));
        let (completion, legacy) = (sent("max_completion_tokens"), sent("max_tokens"));
        if completion {
            owned.push(("max_completion_tokens", json!(allowance)));
        }
        if legacy || !completion {
            owned.push(("max_tokens", json!(allowance)));
        }
        with_owned(&self.body, &owned)
    }
}

/// A client's body with the fields the gateway owns set to `owned`: the client's other
/// fields copied as it wrote them (the messages, the input: never written again from
/// values), sorted by key with the owned ones, as serde_json writes a `Map`.
fn with_owned(body: &Fields, owned: &[(&str, Value)]) -> Vec<u8> {
    enum Field<'a> {
        Kept(&'a RawValue),
        Owned(&'a Value),
    }
    let kept = body
        .iter()
        .filter(|(key, _)| !owned.iter().any(|(k, _)| k == key))
        .map(|(key, raw)| (key.as_str(), Field::Kept(raw)));
    let mut fields: Vec<(&str, Field)> =
        kept.chain(owned.iter().map(|(key, value)| (*key, Field::Owned(value)))).collect();
    fields.sort_unstable_by_key(|(key, _)| *key);
    let size = body.iter().map(|(key, raw)| key.len() + raw.get().len() + 4).sum::<usize>();
    let mut out = Vec::with_capacity(size + 64 * owned.len() + 2);
    out.push(b'{');
    for (i, (key, field)) in fields.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        crate::json::string(&mut out, key);
        out.push(b':');
        match field {
            Field::Kept(raw) => out.extend_from_slice(raw.get().as_bytes()),
            // Into a Vec, a value with string keys cannot fail to serialize.
            Field::Owned(value) => {
                let _ = serde_json::to_writer(&mut out, value);
            }
        }
    }
    out.push(b'}');
    out
}

/// Measures one message's content, collecting its images. Returns its text bytes.
fn measure_content(i: usize, content: Option<&Value>, images: &mut Vec<ImageRef>) -> Result<u64, InvalidRequest> {
    let parts = match content {
        None | Some(Value::Null) => return Ok(0),
        Some(Value::String(s)) => return Ok(s.len() as u64),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            return Err(invalid("messages", format!("messages[{i}].content must be a string or an array of parts")));
        }
    };
    let mut bytes = 0u64;
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str);
        match kind {
            Some("text") => match part.get("text") {
                Some(Value::String(t)) => bytes += t.len() as u64,
                _ => {
                    return Err(invalid("messages", format!("messages[{i}].content[{j}].text must be a string")));
                }
            },
            Some("image_url") => {
                let url = match part.get("image_url") {
                    Some(Value::String(u)) => u,
                    Some(Value::Object(o)) => match o.get("url") {
                        Some(Value::String(u)) => u,
                        _ => {
                            return Err(invalid(
                                "messages",
                                format!("messages[{i}].content[{j}].image_url.url must be a string"),
                            ));
                        }
                    },
                    _ => {
                        return Err(invalid("messages", format!("messages[{i}].content[{j}].image_url is required")));
                    }
                };
                images.push(ImageRef { url: url.clone() });
            }
            Some(other) => {
                return Err(invalid(
                    "messages",
                    format!(
                        "messages[{i}].content[{j}]: content part type `{other}` is not supported (use `text` or `image_url`)"
                    ),
                ));
            }
            None => {
                return Err(invalid("messages", format!("messages[{i}].content[{j}].type is required")));
            }
        }
    }
    Ok(bytes)
}

/// A `POST /v1/embeddings` body.
#[derive(Debug, Clone)]
pub struct EmbeddingsRequest {
    body: Fields,
    pub model: String,
    /// Bytes (or token ids) of input: an upper bound of its token count.
    pub input_units: u64,
    /// The OpenAI `user` field: hashed before it goes anywhere.
    pub user: Option<String>,
}

impl EmbeddingsRequest {
    pub fn parse(bytes: &[u8]) -> Result<Self, InvalidRequest> {
        let body = parse_object(bytes)?;
        let model = required_model(&body)?;
        let input_units = match body.get("input").map(|raw| value(raw)) {
            Some(Value::String(s)) if !s.is_empty() => s.len() as u64,
            Some(Value::Array(items)) if !items.is_empty() => {
                let mut units = 0u64;
                for item in items {
                    units += match item {
                        Value::String(s) => s.len() as u64,
                        Value::Number(_) => 1,
                        Value::Array(tokens) if tokens.iter().all(Value::is_number) => tokens.len() as u64,
                        _ => {
                            return Err(invalid(
                                "input",
                                "`input` must be a string, an array of strings, or token arrays",
                            ));
                        }
                    };
                }
                units
            }
            None => return Err(invalid("input", "`input` is required")),
            Some(_) => {
                return Err(invalid("input", "`input` must be a non-empty string or array"));
            }
        };
        let user = optional_user(&body)?;
        Ok(EmbeddingsRequest { body, model, input_units, user })
    }

    pub fn upstream_body(&self, served_model: &str) -> Vec<u8> {
        with_owned(&self.body, &[("model", Value::String(served_model.to_owned()))])
    }
}

/// The `GET /v1/models` list.
pub fn model_list<'a>(names: impl IntoIterator<Item = &'a str>) -> Value {
    let data: Vec<Value> =
        names.into_iter().map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "flexway"})).collect();
    json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Result<ChatRequest, InvalidRequest> {
        ChatRequest::parse(v.to_string().as_bytes())
    }

    #[test]
    fn reads_what_routing_and_budgets_need() {
        let req = chat(json!({"model": "m", "stream": true, "max_tokens": 7,
            "messages": [{"role": "user", "content": "héllo"}]}))
        .unwrap();
        assert_eq!(req.model, "m");
        assert!(req.stream);
        assert!(!req.client_wants_usage);
        assert_eq!(req.max_tokens, Some(7));
        assert_eq!(req.prompt_text_bytes, 6);
        assert_eq!(req.capability(), Capability::Chat);
    }

    #[test]
    fn the_smaller_limit_governs_and_both_fields_carry_the_allowance() {
        for (max_tokens, max_completion_tokens) in [(7, 3), (3, 7)] {
            let req = chat(json!({"model": "m", "max_tokens": max_tokens,
                "max_completion_tokens": max_completion_tokens,
                "messages": [{"role": "user", "content": "x"}]}))
            .unwrap();
            assert_eq!(req.max_tokens, Some(3));
            let body: Value = serde_json::from_slice(&req.upstream_body("m", 2)).unwrap();
            assert_eq!((body["max_tokens"].clone(), body["max_completion_tokens"].clone()), (json!(2), json!(2)));
        }
    }

    #[test]
    fn the_allowance_goes_in_the_field_the_client_used_else_max_tokens() {
        let sent = |extra: Value| {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let body: Value = serde_json::from_slice(&chat(body).unwrap().upstream_body("m", 5)).unwrap();
            (body.get("max_tokens").cloned(), body.get("max_completion_tokens").cloned())
        };
        assert_eq!(sent(json!({})), (Some(json!(5)), None));
        assert_eq!(sent(json!({"max_tokens": null})), (Some(json!(5)), None));
        assert_eq!(sent(json!({"max_completion_tokens": 9})), (None, Some(json!(5))));
        assert_eq!(sent(json!({"max_tokens": 9})), (Some(json!(5)), None));
    }

    #[test]
    fn n_is_read_and_bounded() {
        let with_n = |n: Value| chat(json!({"model": "m", "n": n, "messages": [{"role": "user", "content": "x"}]}));
        assert_eq!(chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]})).unwrap().choices, 1);
        assert_eq!(with_n(json!(4)).unwrap().choices, 4);
        for bad in [json!(0), json!(129), json!(-1), json!("2"), json!(1.5)] {
            assert_eq!(with_n(bad.clone()).unwrap_err().param, Some("n"), "{bad}");
        }
    }

    #[test]
    fn refuses_malformed_requests_with_the_param() {
        let cases = [
            (json!([1]), None),
            (json!({"messages": [{"role": "user", "content": "x"}]}), Some("model")),
            (json!({"model": 3, "messages": []}), Some("model")),
            (json!({"model": "m"}), Some("messages")),
            (json!({"model": "m", "messages": []}), Some("messages")),
            (json!({"model": "m", "messages": [{"content": "x"}]}), Some("messages")),
            (json!({"model": "m", "stream": "yes", "messages": [{"role": "user", "content": "x"}]}), Some("stream")),
            (
                json!({"model": "m", "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]}),
                Some("max_tokens"),
            ),
            (json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "audio"}]}]}), Some("messages")),
        ];
        for (body, param) in cases {
            let err = chat(body.clone()).unwrap_err();
            assert_eq!(err.param, param, "{body}");
        }
        assert!(ChatRequest::parse(b"{not json").is_err());
    }

    #[test]
    fn finds_images_in_content_parts() {
        let req = chat(json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}))
        .unwrap();
        assert_eq!(req.capability(), Capability::Vision);
        assert_eq!(req.images.len(), 1);
        assert_eq!(req.prompt_text_bytes, 12);
    }

    #[test]
    fn upstream_body_sets_model_and_always_asks_stream_usage() {
        let req = chat(json!({"model": "alias", "stream": true, "temperature": 0.5,
            "messages": [{"role": "user", "content": "x"}]}))
        .unwrap();
        let body: Value = serde_json::from_slice(&req.upstream_body("real", 9)).unwrap();
        assert_eq!(body["model"], "real");
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["max_tokens"], 9);
    }

    #[test]
    fn every_form_of_the_owned_fields_is_written_in_key_order() {
        let cases = [
            (
                json!({"stream": true, "stream_options": {"include_usage": false, "x": 1}}),
                json!({"include_usage": true, "x": 1}),
            ),
            (json!({"stream": true, "stream_options": null}), json!({"include_usage": true})),
            (json!({"stream": true}), json!({"include_usage": true})),
        ];
        for (mut body, options) in cases {
            body["model"] = json!("alias");
            body["messages"] = json!([{"role": "user", "content": "x"}]);
            body["max_completion_tokens"] = json!(7);
            body["max_tokens"] = Value::Null;
            let sent = chat(body).unwrap().upstream_body("real", 5);
            let read: Value = serde_json::from_slice(&sent).unwrap();
            // Written as serde_json writes the object it reads back: the same key order.
            assert_eq!(sent, read.to_string().into_bytes());
            assert_eq!(read["stream_options"], options);
            assert_eq!((read["max_completion_tokens"].clone(), read["max_tokens"].clone()), (json!(5), Value::Null));
            assert_eq!(read["model"], "real");
        }
    }

    #[test]
    fn the_owned_fields_are_written_where_the_body_with_them_inserted_would_have_them() {
        let body = json!({"model": "alias", "messages": [{"role": "user", "content": "x\"y"}], "max_tokens": 3,
            "a": 1, "zeta": {"k": [1, 2]}, "stream_options": {"include_usage": false, "other": true}});
        let Value::Object(body) = body else { unreachable!() };
        let fields = parse_object(Value::Object(body.clone()).to_string().as_bytes()).unwrap();
        let owned = [
            ("max_completion_tokens", json!(5)),
            ("max_tokens", json!(5)),
            ("model", json!("real")),
            ("stream_options", json!({"include_usage": true, "other": true})),
        ];
        let mut inserted = body.clone();
        for (key, value) in &owned {
            inserted.insert((*key).to_owned(), value.clone());
        }
        assert_eq!(String::from_utf8(with_owned(&fields, &owned)).unwrap(), Value::Object(inserted).to_string());
        assert_eq!(with_owned(&Fields::new(), &owned[2..3]), br#"{"model":"real"}"#);
    }

    /// What the client wrote goes upstream as it wrote it (spaces, escapes, numbers),
    /// and is read as serde_json reads it: a repeated name's last value, an escaped
    /// name for the name it spells.
    #[test]
    fn the_client_fields_go_upstream_as_written() {
        let messages = r#"[ {"role":"system","role" : "user", "content" : "caf\u00e9 \"x\""},
            {"rol\u0065": "assistant", "content": [{"type": "text", "text": "ab"}, {"type": "image_url",
            "image_url": {"url": "https://x/1.png", "url": "https://x/2.png"}}], "name": "n"} ]"#;
        let body = format!(
            r#"{{ "temperature" : 1.0e0, "model": "first", "messages": {messages}, "model": "alias", "x": {{"deep": [1, {{"k": null}}]}} }}"#
        );
        let request = ChatRequest::parse(body.as_bytes()).unwrap();
        assert_eq!(request.model, "alias");
        // `café "x"` (9 bytes) + `ab` + the name written as JSON (`"n"`).
        assert_eq!(request.prompt_text_bytes, 9 + 2 + 3);
        assert_eq!(request.images, [ImageRef { url: "https://x/2.png".into() }]);
        let sent = String::from_utf8(request.upstream_body("real", 5)).unwrap();
        assert_eq!(
            sent,
            format!(
                r#"{{"max_tokens":5,"messages":{messages},"model":"real","temperature":1.0e0,"x":{{"deep": [1, {{"k": null}}]}}}}"#
            )
        );
        let read: Value = serde_json::from_str(&sent).unwrap();
        assert_eq!(read["messages"][0]["content"], "café \"x\"");
        let call = request.call().unwrap();
        assert_eq!(call.messages.len(), 2);
    }

    #[test]
    fn a_body_that_is_not_an_object_is_told_apart_from_one_that_is_not_json() {
        for (body, message) in [
            (&b"[1]"[..], "the request body must be a JSON object"),
            (&b"\"text\""[..], "the request body must be a JSON object"),
            (&b"{\"model\": "[..], "the request body is not valid JSON: EOF while parsing a value at line 1 column 10"),
            (&b"{} {}"[..], "the request body is not valid JSON: trailing characters at line 1 column 4"),
        ] {
            let err = ChatRequest::parse(body).unwrap_err();
            assert_eq!((err.message.as_str(), err.param), (message, None), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn embeddings_input_forms() {
        let ok = |v: Value| EmbeddingsRequest::parse(v.to_string().as_bytes());
        assert_eq!(ok(json!({"model": "e", "input": "abc"})).unwrap().input_units, 3);
        assert_eq!(ok(json!({"model": "e", "input": ["ab", "c"]})).unwrap().input_units, 3);
        assert_eq!(ok(json!({"model": "e", "input": [[1, 2, 3]]})).unwrap().input_units, 3);
        assert_eq!(ok(json!({"model": "e"})).unwrap_err().param, Some("input"));
        assert_eq!(ok(json!({"model": "e", "input": [{}]})).unwrap_err().param, Some("input"));
    }

    #[test]
    fn reads_an_answer_without_building_it() {
        let body = json!({"id": "x", "choices": [{"message": {"role": "assistant", "content": "héllo"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}});
        let answer = Answer::read(body.to_string().as_bytes()).unwrap();
        assert_eq!(answer.usage, Some(Usage::new(3, 4)));
        assert_eq!(answer.finish_reasons, vec![Finish::Stop]);
        assert_eq!(answer.completion_bytes, 6);
        let embeddings = json!({"data": [{"embedding": [0.1, 0.2]}], "usage": {"prompt_tokens": 2, "total_tokens": 2}});
        let answer = Answer::read(embeddings.to_string().as_bytes()).unwrap();
        assert_eq!(answer.usage, Some(Usage::new(2, 0)));
        assert_eq!(Answer::read(b"[1, 2]"), None);
        assert_eq!(Answer::read(b" []"), None);
        assert_eq!(Answer::read(b"not json"), None);
        assert_eq!(Answer::read(b"{\"usage\": null}").unwrap().usage, None);
        // The text's length is its bytes once unescaped, summed over the choices.
        let escaped = br#"{"choices": [{"message": {"content": "a\"\u00e9\n"}}, {"message": {"content": null}},
            {"message": {"content": "xy"}}]}"#;
        assert_eq!(Answer::read(escaped).unwrap().completion_bytes, 5 + 2);
        assert_eq!(Answer::read(br#"{"choices": [{"message": {"content": 7}}]}"#), None);
    }

    #[test]
    fn reads_usage_blocks() {
        let u = Usage::from_value(Some(&json!({"prompt_tokens": 3, "completion_tokens": 4}))).unwrap();
        assert_eq!(u.total(), 7);
        assert_eq!(Usage::from_value(Some(&Value::Null)), None);
        let cached =
            json!({"prompt_tokens": 3000, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2048}});
        assert_eq!(Usage::from_value(Some(&cached)), Some(Usage { cached_tokens: 2048, ..Usage::new(3000, 4) }));
        let answer = Answer::read(json!({"usage": cached, "choices": []}).to_string().as_bytes());
        let view = answer.map(|a| a.usage);
        assert_eq!(
            view,
            Some(Some(Usage { cached_tokens: 2048, ..Usage::new(3000, 4) })),
            "the view a stream reads too"
        );
        let more = json!({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 99}});
        assert_eq!(Usage::from_value(Some(&more)).unwrap().cached_tokens, 10, "never more than the prompt");
    }
}
