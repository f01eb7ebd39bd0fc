//! Streamable HTTP as the gateway speaks it, to clients and to servers: the protocol
//! versions, JSON-RPC messages and error codes (rmcp's, where it has them), the
//! standard headers of the stateless 2026-07-28 revision and how they must match the
//! body, and the event-stream framing ([`sse`]).
//!
//! The header rules mirror rmcp's `transport/common/mcp_headers.rs` (SEP-2243):
//! `Mcp-Method` always, `Mcp-Name` from `params.name` (`tools/call`, `prompts/get`),
//! `params.uri` (`resources/read`, `resources/subscribe`, `resources/unsubscribe`) or
//! `params.taskId` (`tasks/get`, `tasks/update`, `tasks/cancel`); a value that cannot
//! travel bare is sent as `=?base64?<standard Base64>?=`. `Mcp-Param-*` headers depend
//! on a tool's input schema and are left to the server that owns it.

pub mod sse;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use http::{HeaderMap, HeaderName, HeaderValue};
use rmcp::model::ErrorCode;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The revisions `/mcp` speaks, newest first.
pub const VERSIONS: [&str; 3] = ["2026-07-28", "2025-11-25", "2025-06-18"];

/// `version` is the stateless revision: no `initialize`, no session, standard headers.
pub fn stateless(version: &str) -> bool {
    version == VERSIONS[0]
}

/// The largest JSON-RPC message either way (SPEC §17).
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

pub const PARSE_ERROR: i64 = ErrorCode::PARSE_ERROR.0 as i64;
pub const INVALID_REQUEST: i64 = ErrorCode::INVALID_REQUEST.0 as i64;
pub const METHOD_NOT_FOUND: i64 = ErrorCode::METHOD_NOT_FOUND.0 as i64;
pub const INVALID_PARAMS: i64 = ErrorCode::INVALID_PARAMS.0 as i64;
pub const INTERNAL_ERROR: i64 = ErrorCode::INTERNAL_ERROR.0 as i64;
/// The standard headers do not match the body (answered with HTTP 400).
pub const HEADER_MISMATCH: i64 = ErrorCode::HEADER_MISMATCH.0 as i64;
/// The version asked for is not one of [`VERSIONS`].
pub const UNSUPPORTED_PROTOCOL_VERSION: i64 = ErrorCode::UNSUPPORTED_PROTOCOL_VERSION.0 as i64;

/// `Mcp-Session-Id` (the names as rmcp's `http_header.rs` spells them, lower-cased).
pub const SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");
pub const PROTOCOL_VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");
pub const MCP_METHOD: HeaderName = HeaderName::from_static("mcp-method");
pub const MCP_NAME: HeaderName = HeaderName::from_static("mcp-name");
/// Wraps a header value sent in Base64: `=?base64?<value>?=`.
const BASE64_PREFIX: &str = "=?base64?";
const BASE64_SUFFIX: &str = "?=";

/// One JSON-RPC 2.0 message: a request, a notification or a response.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub jsonrpc: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
}

impl Message {
    /// A method with an id: it expects a response.
    pub fn is_request(&self) -> bool {
        self.method.is_some() && self.id.is_some()
    }

    /// A method without an id: no response.
    pub fn is_notification(&self) -> bool {
        self.method.is_some() && self.id.is_none()
    }

    /// A result or an error, and no method.
    pub fn is_response(&self) -> bool {
        self.method.is_none() && (self.result.is_some() || self.error.is_some())
    }
}

/// A successful response to request `id`.
pub fn result(id: Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

/// An error response (`id` null when the request's could not be read).
pub fn error(id: Option<Value>, code: i64, message: &str, data: Option<Value>) -> Value {
    let mut error = json!({"code": code, "message": message});
    if let (Some(data), Some(object)) = (data, error.as_object_mut()) {
        object.insert("data".to_owned(), data);
    }
    json!({"jsonrpc": "2.0", "id": id.unwrap_or(Value::Null), "error": error})
}

/// The `Mcp-Name` a request of `method` carries, from its params.
fn name_of(method: &str, params: Option<&Value>) -> Option<String> {
    let key = match method {
        "tools/call" | "prompts/get" => "name",
        "resources/read" | "resources/subscribe" | "resources/unsubscribe" => "uri",
        "tasks/get" | "tasks/update" | "tasks/cancel" => "taskId",
        _ => return None,
    };
    params?.get(key)?.as_str().map(str::to_owned)
}

/// `value` cannot travel as a bare header value: leading or trailing blank, a control
/// or non-ASCII character, or it already looks like the Base64 form.
fn needs_base64(value: &str) -> bool {
    value.starts_with([' ', '\t'])
        || value.ends_with([' ', '\t'])
        || value.chars().any(|c| !(' '..='~').contains(&c))
        || (value.starts_with(BASE64_PREFIX) && value.ends_with(BASE64_SUFFIX))
}

/// `value` as a header carries it: bare, or in the Base64 form.
pub fn encode_header_value(value: &str) -> Option<HeaderValue> {
    if needs_base64(value) {
        HeaderValue::from_str(&format!("{BASE64_PREFIX}{}{BASE64_SUFFIX}", STANDARD.encode(value))).ok()
    } else {
        HeaderValue::from_str(value).ok()
    }
}

/// What a header value says: the Base64 form decoded, any other taken as it is.
/// `None`: the Base64 form wraps something that is not Base64 of UTF-8.
fn decode_header_value(value: &str) -> Option<String> {
    match value.strip_prefix(BASE64_PREFIX).and_then(|inner| inner.strip_suffix(BASE64_SUFFIX)) {
        Some(inner) => String::from_utf8(STANDARD.decode(inner).ok()?).ok(),
        None => Some(value.to_owned()),
    }
}

/// The standard headers a 2026-07-28 request carries: `Mcp-Method`, and `Mcp-Name`
/// when its method names something.
pub fn standard_headers(message: &Value) -> Vec<(HeaderName, HeaderValue)> {
    let Some(method) = message.get("method").and_then(Value::as_str) else {
        return Vec::new();
    };
    let mut headers = Vec::with_capacity(2);
    if let Ok(value) = HeaderValue::from_str(method) {
        headers.push((MCP_METHOD, value));
    }
    if let Some(value) = name_of(method, message.get("params")).as_deref().and_then(encode_header_value) {
        headers.push((MCP_NAME, value));
    }
    headers
}

/// The one value of header `name`; an error when it is repeated (an intermediary could
/// route on another than the one dispatched) or not visible ASCII.
fn single<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<Option<&'a str>, String> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(format!("duplicate {name} header"));
    }
    value.to_str().map(Some).map_err(|_| format!("{name} header contains invalid characters"))
}

/// The 2026-07-28 rule: `Mcp-Method` equals the body's method and `Mcp-Name` the name
/// it designates. `Err` says what is wrong; the door answers 400 with
/// [`HEADER_MISMATCH`]. A response or a message without a method needs neither.
pub fn check_headers(headers: &HeaderMap, message: &Message) -> Result<(), String> {
    let Some(method) = message.method.as_deref() else {
        return Ok(());
    };
    match single(headers, &MCP_METHOD)? {
        None => return Err("missing required Mcp-Method header".to_owned()),
        Some(value) if value != method => {
            return Err(format!("Mcp-Method header `{value}` does not match body method `{method}`"));
        }
        Some(_) => {}
    }
    if let Some(expected) = name_of(method, message.params.as_ref()) {
        let Some(raw) = single(headers, &MCP_NAME)? else {
            return Err(format!("missing required Mcp-Name header for `{method}`"));
        };
        let decoded = decode_header_value(raw).ok_or_else(|| "Mcp-Name header is not valid Base64".to_owned())?;
        if decoded != expected {
            return Err(format!("Mcp-Name header `{decoded}` does not match body value `{expected}`"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rmcp::model::ProtocolVersion;

    use super::*;

    /// rmcp's name for a version, to hold [`VERSIONS`] to the SDK's list.
    fn known(version: &str) -> Option<ProtocolVersion> {
        ProtocolVersion::KNOWN_VERSIONS.iter().find(|known| known.as_str() == version).cloned()
    }

    fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
                map.append(name, value);
            }
        }
        map
    }

    fn message(value: Value) -> Message {
        serde_json::from_value(value).unwrap_or_default()
    }

    fn tools_call() -> Message {
        message(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "deploy"}}))
    }

    #[test]
    fn versions_are_rmcps_and_only_the_newest_is_stateless() {
        assert_eq!(known(VERSIONS[0]), Some(ProtocolVersion::NO_INITIALIZE));
        assert_eq!(known(VERSIONS[1]), Some(ProtocolVersion::V_2025_11_25));
        assert_eq!(known(VERSIONS[2]), Some(ProtocolVersion::V_2025_06_18));
        assert!(stateless("2026-07-28"));
        assert!(!stateless("2025-11-25"));
        assert!(!stateless("2025-06-18"));
        for version in VERSIONS {
            assert_eq!(stateless(version), known(version).is_some_and(|v| !v.has_initialize()));
        }
    }

    #[test]
    fn error_codes_are_the_protocols() {
        assert_eq!(PARSE_ERROR, -32700);
        assert_eq!(INVALID_REQUEST, -32600);
        assert_eq!(METHOD_NOT_FOUND, -32601);
        assert_eq!(INVALID_PARAMS, -32602);
        assert_eq!(INTERNAL_ERROR, -32603);
        assert_eq!(HEADER_MISMATCH, -32020);
        assert_eq!(UNSUPPORTED_PROTOCOL_VERSION, -32022);
    }

    #[test]
    fn messages_are_told_apart() {
        let request = tools_call();
        assert!(request.is_request() && !request.is_notification() && !request.is_response());
        let note = message(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        assert!(note.is_notification() && !note.is_request() && !note.is_response());
        let answer = message(json!({"jsonrpc": "2.0", "id": "a", "result": {}}));
        assert!(answer.is_response() && !answer.is_request());
        let failure = message(json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "x"}}));
        assert!(failure.is_response());
        assert_eq!(failure.id, None);
        let round: Message =
            serde_json::from_value(serde_json::to_value(&request).unwrap_or_default()).unwrap_or_default();
        assert_eq!(round, request);
    }

    #[test]
    fn results_and_errors_are_jsonrpc_envelopes() {
        assert_eq!(result(json!(3), json!({"tools": []})), json!({"jsonrpc": "2.0", "id": 3, "result": {"tools": []}}));
        assert_eq!(
            error(None, PARSE_ERROR, "Parse error", None),
            json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "Parse error"}})
        );
        assert_eq!(
            error(Some(json!("r")), -32000, "budget", Some(json!({"flexway_code": "budget_exceeded"}))),
            json!({"jsonrpc": "2.0", "id": "r", "error": {"code": -32000, "message": "budget", "data": {"flexway_code": "budget_exceeded"}}})
        );
    }

    #[test]
    fn accepts_matching_method_and_name() {
        let headers = header_map(&[("Mcp-Method", "tools/call"), ("Mcp-Name", "deploy")]);
        assert_eq!(check_headers(&headers, &tools_call()), Ok(()));
    }

    #[test]
    fn rejects_a_missing_or_other_method() {
        assert!(check_headers(&header_map(&[("Mcp-Name", "deploy")]), &tools_call()).is_err());
        let other = header_map(&[("Mcp-Method", "tools/list"), ("Mcp-Name", "deploy")]);
        assert!(check_headers(&other, &tools_call()).is_err());
    }

    #[test]
    fn rejects_a_missing_or_other_name() {
        assert!(check_headers(&header_map(&[("Mcp-Method", "tools/call")]), &tools_call()).is_err());
        let other = header_map(&[("Mcp-Method", "tools/call"), ("Mcp-Name", "other")]);
        assert!(check_headers(&other, &tools_call()).is_err());
    }

    #[test]
    fn rejects_duplicate_headers() {
        let methods = header_map(&[("Mcp-Method", "tools/call"), ("Mcp-Method", "tools/list"), ("Mcp-Name", "deploy")]);
        assert_eq!(check_headers(&methods, &tools_call()), Err("duplicate mcp-method header".to_owned()));
        let names = header_map(&[("Mcp-Method", "tools/call"), ("Mcp-Name", "deploy"), ("Mcp-Name", "other")]);
        assert!(check_headers(&names, &tools_call()).is_err());
    }

    #[test]
    fn the_name_comes_from_uri_and_task_id_too() {
        let read =
            message(json!({"jsonrpc": "2.0", "id": 1, "method": "resources/read", "params": {"uri": "file:///a"}}));
        assert_eq!(
            check_headers(&header_map(&[("Mcp-Method", "resources/read"), ("Mcp-Name", "file:///a")]), &read),
            Ok(())
        );
        assert!(check_headers(&header_map(&[("Mcp-Method", "resources/read")]), &read).is_err());
        let task = message(json!({"jsonrpc": "2.0", "id": 1, "method": "tasks/get", "params": {"taskId": "t1"}}));
        assert_eq!(check_headers(&header_map(&[("Mcp-Method", "tasks/get"), ("Mcp-Name", "t1")]), &task), Ok(()));
        let prompt = message(json!({"jsonrpc": "2.0", "id": 1, "method": "prompts/get", "params": {"name": "p"}}));
        assert!(check_headers(&header_map(&[("Mcp-Method", "prompts/get"), ("Mcp-Name", "q")]), &prompt).is_err());
    }

    #[test]
    fn a_method_without_a_name_needs_only_mcp_method() {
        let list = message(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
        assert_eq!(check_headers(&header_map(&[("Mcp-Method", "tools/list")]), &list), Ok(()));
        let response = message(json!({"jsonrpc": "2.0", "id": 1, "result": {}}));
        assert_eq!(check_headers(&HeaderMap::new(), &response), Ok(()));
    }

    #[test]
    fn the_base64_form_of_mcp_name_is_decoded() {
        let call = message(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "café"}}));
        let encoded = format!("=?base64?{}?=", STANDARD.encode("café"));
        assert_eq!(check_headers(&header_map(&[("Mcp-Method", "tools/call"), ("Mcp-Name", &encoded)]), &call), Ok(()));
        let wrong = format!("=?base64?{}?=", STANDARD.encode("cafe"));
        assert!(check_headers(&header_map(&[("Mcp-Method", "tools/call"), ("Mcp-Name", &wrong)]), &call).is_err());
        let broken = header_map(&[("Mcp-Method", "tools/call"), ("Mcp-Name", "=?base64?***?=")]);
        assert_eq!(check_headers(&broken, &call), Err("Mcp-Name header is not valid Base64".to_owned()));
    }

    #[test]
    fn values_that_cannot_travel_bare_are_sent_in_base64_and_read_back() {
        for value in ["deploy", "file:///a b", " lead", "trail\t", "café", "line\nbreak", "=?base64?abc?=", ""] {
            let encoded = encode_header_value(value);
            let text = encoded.as_ref().and_then(|v| v.to_str().ok()).unwrap_or("<none>");
            assert_eq!(text.starts_with(BASE64_PREFIX), needs_base64(value), "{value:?} → {text}");
            assert_eq!(decode_header_value(text).as_deref(), Some(value), "{value:?}");
        }
        assert_eq!(encode_header_value("deploy").as_ref().map(HeaderValue::as_bytes), Some(&b"deploy"[..]));
    }

    #[test]
    fn standard_headers_pass_the_check_they_are_made_for() {
        for body in [
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "deploy", "arguments": {}}}),
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": " odd\u{e9}"}}),
            json!({"jsonrpc": "2.0", "id": 1, "method": "resources/read", "params": {"uri": "file:///x"}}),
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
        ] {
            let mut headers = HeaderMap::new();
            for (name, value) in standard_headers(&body) {
                headers.append(name, value);
            }
            assert!(headers.contains_key("mcp-method"));
            assert_eq!(check_headers(&headers, &message(body.clone())), Ok(()), "{body}");
        }
        assert!(standard_headers(&json!({"jsonrpc": "2.0", "id": 1, "result": {}})).is_empty());
    }
}
