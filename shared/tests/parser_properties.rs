//! What a client sends is read without ever panicking: request bodies
//! (`ChatRequest::parse`, `EmbeddingsRequest::parse`) and the headers that choose an
//! agent or narrow routing (`identity::agent_header`, `identity::sensitivity`). Each
//! input is either read or refused with a clean error: a message, and for a body a
//! `param` that names a top-level field. The sensitivity header can only narrow.

use flexway::identity::{AGENT_HEADER, IdentityError, agent_header, sensitivity};
use flexway::protocol::openai::{ChatRequest, EmbeddingsRequest, InvalidRequest};
use http::{HeaderMap, HeaderValue};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// The fields the parsers look at, and a few they pass through.
const KEYS: [&str; 22] = [
    "model",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "image_url",
    "url",
    "stream",
    "stream_options",
    "include_usage",
    "max_tokens",
    "max_completion_tokens",
    "user",
    "input",
    "tools",
    "tool_calls",
    "name",
    "functions",
    "response_format",
    "function_call",
    "other",
];

/// Any JSON value, its object keys mostly the parsers' own, so that generated
/// bodies reach past the first check.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop_oneof![Just("text".to_owned()), Just("image_url".to_owned()), Just("user".to_owned()), ".*"]
            .prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..6).prop_map(|fields| Value::Object(fields.into_iter().collect())),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![4 => prop::sample::select(&KEYS[..]).prop_map(str::to_owned), 1 => "[a-z_]{0,8}"]
}

/// A body with the usual top-level fields, each present or not, of any shape.
fn request_object() -> impl Strategy<Value = Value> {
    prop::collection::vec((prop::sample::select(&KEYS[..]), json_value()), 0..8).prop_map(|fields| {
        let mut body = Map::new();
        for (k, v) in fields {
            body.insert(k.to_owned(), v);
        }
        Value::Object(body)
    })
}

/// A valid chat body, so that truncations and byte flips start from the real thing.
fn valid_chat() -> Vec<u8> {
    json!({"model": "m", "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 5,
        "user": "u", "messages": [{"role": "user", "content": [{"type": "text", "text": "héllo"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    .to_string()
    .into_bytes()
}

/// Bytes a client could send: arbitrary, JSON of any shape, or a valid body cut or
/// with a byte changed.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        json_value().prop_map(|v| v.to_string().into_bytes()),
        request_object().prop_map(|v| v.to_string().into_bytes()),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, byte)| {
            let mut bytes = valid_chat();
            let i = at.index(bytes.len());
            bytes[i] = byte;
            bytes
        }),
        any::<prop::sample::Index>().prop_map(|at| {
            let bytes = valid_chat();
            bytes[..at.index(bytes.len())].to_vec()
        }),
    ]
}

fn assert_clean(error: &InvalidRequest) -> Result<(), TestCaseError> {
    prop_assert!(!error.message.is_empty());
    if let Some(param) = error.param {
        prop_assert!(KEYS.contains(&param), "param `{param}` is not a request field");
    }
    Ok(())
}

/// Header values as a transport hands them over: any bytes `http` accepts (visible
/// ASCII, tab, and the 0x80-0xFF of obs-text), often one of the words or a list.
fn header_value() -> impl Strategy<Value = HeaderValue> {
    let words = prop::sample::select(&["true", "false", "1", "0", "yes", "no", "TRUE", "No", "", " ", "maybe"][..]);
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..24),
        prop::collection::vec(words.clone(), 1..4).prop_map(|w| w.join(",").into_bytes()),
        (words, "[ \t]{0,2}", "[ \t]{0,2}").prop_map(|(w, a, b)| format!("{a}{w}{b}").into_bytes()),
        "\\PC{0,12}".prop_map(String::into_bytes),
    ]
    .prop_filter_map("not a header value", |bytes| HeaderValue::from_bytes(&bytes).ok())
}

fn headers(name: &'static str, values: &[HeaderValue]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for value in values {
        map.append(name, value.clone());
    }
    map
}

const SENSITIVE: &str = "flexway-sensitive";

/// The reading the SPEC asks for, written plainly: `Some(sensitive)`, or `None`
/// when some item is not one of the six words.
fn expected_sensitivity(values: &[HeaderValue]) -> Option<bool> {
    let mut sensitive = false;
    for value in values {
        for item in value.as_bytes().split(|&b| b == b',') {
            let item = String::from_utf8(item.to_vec()).ok()?;
            match item.trim_matches([' ', '\t']).to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" => sensitive = true,
                "false" | "0" | "no" => {}
                _ => return None,
            }
        }
    }
    Some(sensitive)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn chat_parse_reads_or_refuses_cleanly(bytes in body()) {
        if let Err(error) = ChatRequest::parse(&bytes) {
            assert_clean(&error)?;
        }
    }

    #[test]
    fn embeddings_parse_reads_or_refuses_cleanly(bytes in body()) {
        if let Err(error) = EmbeddingsRequest::parse(&bytes) {
            assert_clean(&error)?;
        }
    }

    #[test]
    fn a_parsed_chat_request_has_a_model_and_messages(body in request_object()) {
        if let Ok(request) = ChatRequest::parse(body.to_string().as_bytes()) {
            prop_assert!(!request.model.trim().is_empty());
            prop_assert!(request.message_count > 0);
        }
    }

    #[test]
    fn sensitivity_reads_every_value_and_refuses_any_other(values in prop::collection::vec(header_value(), 0..4)) {
        let got = sensitivity(&headers(SENSITIVE, &values), SENSITIVE);
        match (got, expected_sensitivity(&values)) {
            (Ok(got), Some(expected)) => prop_assert_eq!(got, expected),
            (Err(error), None) => {
                prop_assert!(error.message.contains(SENSITIVE));
                prop_assert_eq!(error.param, None);
            }
            (got, expected) => prop_assert!(false, "{values:?}: got {got:?}, expected {expected:?}"),
        }
    }

    #[test]
    fn sensitivity_only_narrows(values in prop::collection::vec(header_value(), 0..4), extra in header_value()) {
        // Adding a value never makes a sensitive request less sensitive, and adding a
        // true one makes any readable request sensitive.
        let before = sensitivity(&headers(SENSITIVE, &values), SENSITIVE);
        let mut more = values.clone();
        more.push(extra);
        let after = sensitivity(&headers(SENSITIVE, &more), SENSITIVE);
        if before == Ok(true) {
            prop_assert!(after != Ok(false));
        }
        let mut marked = values;
        marked.push(HeaderValue::from_static("true"));
        let marked = sensitivity(&headers(SENSITIVE, &marked), SENSITIVE);
        prop_assert!(before.is_err() || marked == Ok(true));
    }

    #[test]
    fn agent_header_names_one_readable_agent_or_refuses(values in prop::collection::vec(header_value(), 0..3)) {
        let map = headers(AGENT_HEADER, &values);
        match agent_header(&map) {
            Ok(None) => prop_assert!(values.is_empty()),
            Ok(Some(agent)) => {
                prop_assert!(!agent.is_empty() && !agent.chars().any(char::is_control));
                prop_assert_eq!(agent, agent.trim_matches([' ', '\t']));
                for value in &values {
                    prop_assert_eq!(std::str::from_utf8(value.as_bytes()).unwrap().trim_matches([' ', '\t']), agent);
                }
            }
            Err(IdentityError::UnreadableAgent) => {
                let unreadable = |v: &HeaderValue| {
                    std::str::from_utf8(v.as_bytes())
                        .map(|s| s.trim_matches([' ', '\t']))
                        .map_or(true, |s| s.is_empty() || s.chars().any(char::is_control))
                };
                prop_assert!(values.iter().any(unreadable));
            }
            Err(IdentityError::AmbiguousAgent { first, other }) => prop_assert_ne!(first, other),
            Err(other) => prop_assert!(false, "unexpected {other:?}"),
        }
    }
}
