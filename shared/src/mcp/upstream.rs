//! The client that sends one JSON-RPC message to an upstream MCP server (Streamable
//! HTTP). Stateless by design: every call names its server ([`Target`]) and the
//! upstream session the caller's sealed session carries; nothing is kept between calls
//! but the connection pool. It never retries (a tool call may have side effects), and
//! every wait is under the target's timeout.
//!
//! Only the server's own headers (its `auth`, resolved by the caller) and the
//! protocol's go upstream: nothing of the client that called the gateway. An answer
//! is bounded at [`MAX_MESSAGE`] (a JSON body, or each event of a stream).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::header::{ACCEPT, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{Value, json};
use tokio::time::{Instant, timeout_at};

use super::wire::{MAX_MESSAGE, PROTOCOL_VERSION, SESSION_ID, VERSIONS, sse, standard_headers, stateless};

/// The server a message goes to, and how.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// Its MCP endpoint.
    pub url: &'a str,
    /// The server's own headers (its `auth`, resolved by the caller): never the
    /// caller's.
    pub headers: &'a HeaderMap,
    /// How long the exchange may take, the answer read whole (a stream to its end)
    /// included.
    pub timeout: Duration,
    /// The protocol version spoken to it.
    pub version: &'a str,
}

/// What the server answered.
#[derive(Debug)]
pub enum Answer {
    /// One JSON-RPC message, and the session id the server set, if any.
    Json { message: Value, session: Option<String> },
    /// An event stream: the server's messages one by one.
    Stream(Events),
    /// 202: a notification or a response taken, no message back.
    Accepted,
}

/// Why no answer came.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    /// 404 to a request that carried a session: the server forgot it. Also a 400
    /// whose JSON-RPC error speaks of the session, as servers built on the TypeScript
    /// SDK's example answer an id they do not know (`server-everything`: "Bad
    /// Request: No valid session ID provided"): the request was not run either way.
    #[error("the MCP server no longer knows the session")]
    SessionGone,
    #[error("the MCP server did not answer in time")]
    Timeout,
    #[error("MCP server unreachable or answer unreadable: {0}")]
    Transport(String),
    #[error("the MCP server answered HTTP {0}")]
    Status(u16),
}

fn transport(error: reqwest::Error) -> UpstreamError {
    if error.is_timeout() {
        return UpstreamError::Timeout;
    }
    UpstreamError::Transport(error.without_url().to_string())
}

/// An upstream's event stream, read as its consumer asks. Events that carry no
/// JSON-RPC message (an empty priming event, another event type) are skipped.
pub struct Events(Box<Stream>);

/// An [`Events`]' state: boxed, so an [`Answer`] stays small.
struct Stream {
    response: reqwest::Response,
    parser: sse::Parser,
    pending: VecDeque<sse::Event>,
    session: Option<String>,
    deadline: Instant,
    done: bool,
    /// A response whose id is the first is given the second instead.
    restore: Option<(Value, Value)>,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").field("session", &self.0.session).field("done", &self.0.done).finish_non_exhaustive()
    }
}

impl Events {
    /// The session id the server set on this answer (an `initialize` answered as a
    /// stream sets it here).
    pub fn session(&self) -> Option<&str> {
        self.0.session.as_deref()
    }

    /// These events with the response to the request `sent` given the id `original`
    /// (the request went upstream under an id of the gateway's own).
    pub fn restoring(mut self, sent: Value, original: Value) -> Events {
        self.0.restore = Some((sent, original));
        self
    }

    /// The next message; `None` once the stream ended (after an error too). Past the
    /// target's timeout, [`UpstreamError::Timeout`].
    pub async fn next(&mut self) -> Option<Result<Value, UpstreamError>> {
        let stream = &mut *self.0;
        loop {
            while let Some(event) = stream.pending.pop_front() {
                let message_type = event.event.as_deref().is_none_or(|kind| kind == "message");
                if !message_type || event.data.trim().is_empty() {
                    continue;
                }
                let Ok(mut message) = serde_json::from_str::<Value>(&event.data) else {
                    stream.done = true;
                    return Some(Err(UpstreamError::Transport("an event of the stream is not JSON".to_owned())));
                };
                if let Some((sent, original)) = &stream.restore
                    && message.get("method").is_none()
                    && message.get("id") == Some(sent)
                {
                    message["id"] = original.clone();
                }
                return Some(Ok(message));
            }
            if stream.done {
                return None;
            }
            let chunk = match timeout_at(stream.deadline, stream.response.chunk()).await {
                Err(_) => Err(UpstreamError::Timeout),
                Ok(Err(e)) => Err(transport(e)),
                Ok(Ok(chunk)) => Ok(chunk),
            };
            match chunk {
                Ok(Some(bytes)) => match stream.parser.feed(&bytes) {
                    Ok(events) => stream.pending.extend(events),
                    Err(too_large) => {
                        stream.done = true;
                        return Some(Err(UpstreamError::Transport(too_large.to_string())));
                    }
                },
                Ok(None) => stream.done = true,
                Err(e) => {
                    stream.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

/// The one client every upstream MCP call goes through (its pool shared).
#[derive(Debug, Clone)]
pub struct McpClient {
    /// `None` only if the TLS stack could not be set up: then every call fails.
    client: Option<reqwest::Client>,
    /// The versions servers agreed to at `initialize` other than the one asked: (the
    /// server's URL, the session it gave or "", the version asked) → the version its
    /// later messages in that session go in. Per process, bounded as the renewed
    /// sessions are.
    agreed: Arc<Mutex<HashMap<Agreed, String>>>,
}

/// A session the version agreed to is kept for: (URL, session id or "", version asked).
type Agreed = (String, String, String);

/// What `initialize` opened: the session id the server gave, if any, and the
/// protocol version it agreed to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    pub session: Option<String>,
    pub version: String,
}

/// Agreed versions a process remembers; past it, the map starts again (a session
/// whose entry went then speaks the version asked again).
const MAX_AGREED: usize = 10_000;

/// The longest upstream session id kept: a longer one (sealed into the gateway's own
/// session id) could outgrow the header limits of the client's requests.
pub const MAX_SESSION_ID: usize = 256;

impl Default for McpClient {
    fn default() -> Self {
        McpClient::new()
    }
}

impl McpClient {
    pub fn new() -> Self {
        // No redirects: the server's credential goes to its URL and nowhere else.
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(crate::call::headers::USER_AGENT)
            .build();
        if let Err(e) = &client {
            tracing::error!("mcp: cannot build the upstream client, every MCP call will fail: {e}");
        }
        McpClient { client: client.ok(), agreed: Arc::default() }
    }

    fn client(&self) -> Result<&reqwest::Client, UpstreamError> {
        self.client.as_ref().ok_or_else(|| UpstreamError::Transport("no HTTP client".to_owned()))
    }

    /// The version messages to `target` in `session` go in: the one the server agreed
    /// to at `initialize`, else the target's.
    fn version(&self, target: &Target<'_>, session: Option<&str>) -> Option<String> {
        let key = (target.url.to_owned(), session.unwrap_or("").to_owned(), target.version.to_owned());
        self.agreed.lock().unwrap_or_else(PoisonError::into_inner).get(&key).cloned()
    }

    /// The headers of a request to `target`: the server's own, then the protocol's.
    fn headers(&self, target: &Target<'_>, session: Option<&str>, message: Option<&Value>) -> HeaderMap {
        let agreed = self.version(target, session);
        let target = &Target { version: agreed.as_deref().unwrap_or(target.version), ..*target };
        let mut headers = target.headers.clone();
        headers.insert(ACCEPT, HeaderValue::from_static("application/json, text/event-stream"));
        let initialize = message.and_then(|m| m.get("method")).and_then(Value::as_str) == Some("initialize");
        if !initialize && let Ok(version) = HeaderValue::from_str(target.version) {
            headers.insert(PROTOCOL_VERSION, version);
        }
        if let Some(session) = session.and_then(|s| HeaderValue::from_str(s).ok()) {
            headers.insert(SESSION_ID, session);
        }
        if let Some(message) = message {
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            if stateless(target.version) {
                for (name, value) in standard_headers(message) {
                    headers.insert(name, value);
                }
            }
        }
        headers
    }

    /// Sends `message` (a request, a notification or a response) to `target` within
    /// the upstream `session`, if any.
    pub async fn send(
        &self,
        target: &Target<'_>,
        session: Option<&str>,
        message: &Value,
    ) -> Result<Answer, UpstreamError> {
        let deadline = Instant::now() + target.timeout;
        let body = serde_json::to_vec(message).map_err(|e| UpstreamError::Transport(e.to_string()))?;
        if body.len() > MAX_MESSAGE {
            return Err(UpstreamError::Transport(format!("a message over {MAX_MESSAGE} bytes")));
        }
        let request = self.client()?.post(target.url).headers(self.headers(target, session, Some(message))).body(body);
        let response = match timeout_at(deadline, request.send()).await {
            Err(_) => return Err(UpstreamError::Timeout),
            Ok(response) => response.map_err(transport)?,
        };
        let status = response.status();
        if status == StatusCode::ACCEPTED {
            return Ok(Answer::Accepted);
        }
        if status == StatusCode::NOT_FOUND && session.is_some() {
            return Err(UpstreamError::SessionGone);
        }
        if !status.is_success() {
            if status == StatusCode::BAD_REQUEST && session.is_some() && speaks_of_session(response, deadline).await {
                return Err(UpstreamError::SessionGone);
            }
            return Err(UpstreamError::Status(status.as_u16()));
        }
        let session = response.headers().get(SESSION_ID).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let content_type = response.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        if content_type.trim_start().to_ascii_lowercase().starts_with("text/event-stream") {
            return Ok(Answer::Stream(Events(Box::new(Stream {
                response,
                parser: sse::Parser::new(),
                pending: VecDeque::new(),
                session,
                deadline,
                done: false,
                restore: None,
            }))));
        }
        let body = read_bounded(response, deadline).await?;
        if body.iter().all(u8::is_ascii_whitespace) {
            // A 200 with nothing in it: a notification taken.
            return Ok(Answer::Accepted);
        }
        let message: Value =
            serde_json::from_slice(&body).map_err(|_| UpstreamError::Transport("the answer is not JSON".to_owned()))?;
        if !message.is_object() {
            return Err(UpstreamError::Transport("the answer is not a JSON-RPC message".to_owned()));
        }
        Ok(Answer::Json { message, session })
    }

    /// Opens a session with `target` ([`McpClient::open`]): the session id the server
    /// gave, if it gave one.
    pub async fn initialize(&self, target: &Target<'_>) -> Result<Option<String>, UpstreamError> {
        Ok(self.open(target).await?.session)
    }

    /// Opens a session with `target`: `initialize`, then `notifications/initialized`.
    /// The session id the server gave, if it gave one (one over [`MAX_SESSION_ID`]
    /// bytes fails the opening), and the version it agreed to: later messages to
    /// `target` in that session go in it. The stateless revision has no handshake:
    /// nothing is sent.
    pub async fn open(&self, target: &Target<'_>) -> Result<Opened, UpstreamError> {
        if stateless(target.version) {
            return Ok(Opened { session: None, version: target.version.to_owned() });
        }
        let request = json!({
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": target.version,
                "capabilities": {},
                "clientInfo": {"name": "flexway", "version": env!("CARGO_PKG_VERSION")},
            },
        });
        let (response, session) = match self.send(target, None, &request).await? {
            Answer::Json { message, session } => (message, session),
            Answer::Stream(mut events) => {
                let mut response = None;
                while let Some(message) = events.next().await {
                    let message = message?;
                    if message.get("id") == Some(&json!(0)) && message.get("method").is_none() {
                        response = Some(message);
                        break;
                    }
                }
                let response = response
                    .ok_or_else(|| UpstreamError::Transport("the initialize stream ended with no answer".to_owned()))?;
                (response, events.session().map(str::to_owned))
            }
            Answer::Accepted => {
                return Err(UpstreamError::Transport("initialize was answered with no message".to_owned()));
            }
        };
        if response.get("result").is_none() {
            let code = response.pointer("/error/code").and_then(Value::as_i64).unwrap_or_default();
            return Err(UpstreamError::Transport(format!("initialize refused (JSON-RPC error {code})")));
        }
        if let Some(length) = session.as_ref().map(String::len).filter(|length| *length > MAX_SESSION_ID) {
            tracing::warn!(
                url = target.url,
                length,
                "mcp: a session id over {MAX_SESSION_ID} bytes: initialize failed"
            );
            return Err(UpstreamError::Transport(format!("a session id over {MAX_SESSION_ID} bytes")));
        }
        let agreed = response.pointer("/result/protocolVersion").and_then(Value::as_str);
        let version = match agreed {
            Some(agreed) if agreed != target.version && VERSIONS.contains(&agreed) && !stateless(agreed) => {
                let key = (target.url.to_owned(), session.clone().unwrap_or_default(), target.version.to_owned());
                let mut all = self.agreed.lock().unwrap_or_else(PoisonError::into_inner);
                if all.len() >= MAX_AGREED {
                    all.clear();
                }
                all.insert(key, agreed.to_owned());
                agreed
            }
            Some(agreed) if agreed != target.version => {
                tracing::warn!(url = target.url, "mcp: initialize agreed to a version not spoken: the one asked kept");
                target.version
            }
            _ => target.version,
        };
        let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        self.send(target, session.as_deref(), &initialized).await?;
        Ok(Opened { session, version: version.to_owned() })
    }

    /// Ends `session` with `target` (`DELETE`), best effort: a server that refuses or
    /// does not answer forgets it on its own.
    pub async fn end(&self, target: &Target<'_>, session: &str) {
        let Ok(client) = self.client() else {
            return;
        };
        let request = client.delete(target.url).headers(self.headers(target, Some(session), None));
        let _ = tokio::time::timeout(target.timeout, request.send()).await;
    }
}

/// `response` is a JSON-RPC error whose message is about the session.
async fn speaks_of_session(response: reqwest::Response, deadline: Instant) -> bool {
    let Ok(body) = read_bounded(response, deadline).await else {
        return false;
    };
    serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|answer| {
            answer.pointer("/error/message")?.as_str().map(|m| m.to_ascii_lowercase().contains("session"))
        })
        .unwrap_or(false)
}

/// The body of `response`, refused past [`MAX_MESSAGE`] or `deadline`.
async fn read_bounded(mut response: reqwest::Response, deadline: Instant) -> Result<Vec<u8>, UpstreamError> {
    let too_large = || UpstreamError::Transport(format!("an answer over {MAX_MESSAGE} bytes"));
    let announced = response.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if announced.is_some_and(|length| length > MAX_MESSAGE) {
        return Err(too_large());
    }
    let mut body = Vec::with_capacity(announced.unwrap_or(0));
    loop {
        match timeout_at(deadline, response.chunk()).await {
            Err(_) => return Err(UpstreamError::Timeout),
            Ok(Err(e)) => return Err(transport(e)),
            Ok(Ok(None)) => return Ok(body),
            Ok(Ok(Some(chunk))) => {
                if body.len() + chunk.len() > MAX_MESSAGE {
                    return Err(too_large());
                }
                body.extend_from_slice(&chunk);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    use axum::body::{Body, Bytes};
    use axum::extract::State;
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use futures_util::StreamExt;

    use super::*;
    use crate::mcp::wire::{Message, check_headers};

    /// What the loopback server saw: each request's method and headers.
    #[derive(Default)]
    struct Seen(Mutex<Vec<(String, HeaderMap)>>);

    impl Seen {
        fn all(&self) -> Vec<(String, HeaderMap)> {
            self.0.lock().map(|seen| seen.clone()).unwrap_or_default()
        }
    }

    fn json_answer(session: Option<&str>, body: Value) -> Response {
        let mut response = ([(CONTENT_TYPE, "application/json")], body.to_string()).into_response();
        if let Some(session) = session.and_then(|s| HeaderValue::from_str(s).ok()) {
            response.headers_mut().insert(SESSION_ID, session);
        }
        response
    }

    /// A stream whose events arrive in the chunks given (split mid-event, CRLF).
    fn sse_answer(chunks: Vec<String>, session: Option<&str>) -> Response {
        let stream = futures_util::stream::iter(chunks.into_iter().map(|c| Ok::<_, Infallible>(Bytes::from(c))));
        let mut response = ([(CONTENT_TYPE, "text/event-stream")], Body::from_stream(stream)).into_response();
        if let Some(session) = session.and_then(|s| HeaderValue::from_str(s).ok()) {
            response.headers_mut().insert(SESSION_ID, session);
        }
        response
    }

    /// A tiny MCP server: answers by method, `Mcp-Session-Id: gone` is a forgotten session.
    async fn handle(State(seen): State<Arc<Seen>>, headers: HeaderMap, body: Bytes) -> Response {
        let message: Value = serde_json::from_slice(&body).unwrap_or_default();
        let method = message.get("method").and_then(Value::as_str).unwrap_or("").to_owned();
        if let Ok(mut all) = seen.0.lock() {
            all.push((method.clone(), headers.clone()));
        }
        if headers.get(SESSION_ID).is_some_and(|s| s == "gone") {
            return StatusCode::NOT_FOUND.into_response();
        }
        if headers.get(SESSION_ID).is_some_and(|s| s == "unknown") {
            let body = json!({"jsonrpc": "2.0", "id": message.get("id"), "error": {"code": -32000, "message": "Bad Request: No valid session ID provided"}});
            return (StatusCode::BAD_REQUEST, [(CONTENT_TYPE, "application/json")], body.to_string()).into_response();
        }
        let id = message.get("id").cloned().unwrap_or(Value::Null);
        match method.as_str() {
            "initialize" => {
                // `x-speaks`: the version it agrees to; `x-long-session`: an id too long.
                let speaks = headers.get("x-speaks").and_then(|v| v.to_str().ok()).unwrap_or("2025-11-25");
                let long = "s".repeat(MAX_SESSION_ID + 1);
                let session = if headers.contains_key("x-long-session") { long.as_str() } else { "up-42" };
                json_answer(
                    Some(session),
                    json!({"jsonrpc": "2.0", "id": id, "result": {"protocolVersion": speaks, "capabilities": {}}}),
                )
            }
            "notifications/initialized" => StatusCode::ACCEPTED.into_response(),
            "tools/list" => json_answer(None, json!({"jsonrpc": "2.0", "id": id, "result": {"tools": []}})),
            "tools/call" => {
                let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}});
                let result = json!({"jsonrpc": "2.0", "id": id, "result": {"content": [], "isError": false}});
                let stream =
                    format!("id: 0\r\ndata:\r\n\r\nevent: message\r\ndata: {progress}\r\n\r\ndata: {result}\n\n");
                let (a, b) = stream.split_at(stream.len() / 2);
                sse_answer(vec![a.to_owned(), b.to_owned()], None)
            }
            "slow" => {
                tokio::time::sleep(Duration::from_secs(5)).await;
                StatusCode::ACCEPTED.into_response()
            }
            "slow/stream" => {
                let first = json!({"jsonrpc": "2.0", "method": "notifications/progress"});
                let stream = futures_util::stream::iter([Ok::<_, Infallible>(Bytes::from(format!(
                    "data: {first}\n\n"
                )))])
                .chain(futures_util::stream::once(async {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok(Bytes::from("data: {}\n\n"))
                }));
                ([(CONTENT_TYPE, "text/event-stream")], Body::from_stream(stream)).into_response()
            }
            "big" => json_answer(None, json!({"blob": "x".repeat(MAX_MESSAGE)})),
            "teapot" => StatusCode::IM_A_TEAPOT.into_response(),
            _ => {
                let body = json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32600, "message": "Bad Request"}});
                (StatusCode::BAD_REQUEST, [(CONTENT_TYPE, "application/json")], body.to_string()).into_response()
            }
        }
    }

    async fn end(State(seen): State<Arc<Seen>>, headers: HeaderMap) -> StatusCode {
        if let Ok(mut all) = seen.0.lock() {
            all.push(("DELETE".to_owned(), headers));
        }
        StatusCode::OK
    }

    async fn server() -> (String, Arc<Seen>) {
        let seen = Arc::new(Seen::default());
        let app = axum::Router::new().route("/mcp", post(handle).delete(end)).with_state(seen.clone());
        let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
            Ok(listener) => listener,
            Err(e) => unreachable!("loopback bind: {e}"),
        };
        let url = format!("http://{}/mcp", listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, seen)
    }

    fn auth() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, HeaderValue::from_static("Bearer server-token"));
        headers
    }

    fn target<'a>(url: &'a str, headers: &'a HeaderMap, version: &'a str) -> Target<'a> {
        Target { url, headers, timeout: Duration::from_secs(5), version }
    }

    fn request(method: &str, params: Value) -> Value {
        json!({"jsonrpc": "2.0", "id": 7, "method": method, "params": params})
    }

    #[tokio::test]
    async fn initialize_keeps_the_session_and_sends_initialized_in_it() {
        let (url, seen) = server().await;
        let headers = auth();
        let client = McpClient::new();
        let session = client.initialize(&target(&url, &headers, "2025-11-25")).await;
        assert_eq!(session, Ok(Some("up-42".to_owned())));
        let seen = seen.all();
        assert_eq!(
            seen.iter().map(|(m, _)| m.as_str()).collect::<Vec<_>>(),
            ["initialize", "notifications/initialized"]
        );
        assert_eq!(seen[0].1.get(SESSION_ID), None);
        assert_eq!(seen[0].1.get(PROTOCOL_VERSION), None, "the version travels in the body of initialize");
        assert_eq!(seen[1].1.get(SESSION_ID).map(HeaderValue::as_bytes), Some(&b"up-42"[..]));
        assert_eq!(seen[1].1.get(PROTOCOL_VERSION).map(HeaderValue::as_bytes), Some(&b"2025-11-25"[..]));
    }

    #[tokio::test]
    async fn a_json_answer_is_one_message_with_the_session_header() {
        let (url, _) = server().await;
        let headers = auth();
        let client = McpClient::new();
        let t = target(&url, &headers, "2025-11-25");
        match client.send(&t, Some("up-42"), &request("tools/list", json!({}))).await {
            Ok(Answer::Json { message, session }) => {
                assert_eq!(message, json!({"jsonrpc": "2.0", "id": 7, "result": {"tools": []}}));
                assert_eq!(session, None);
            }
            other => unreachable!("{other:?}"),
        }
        match client.send(&t, None, &request("initialize", json!({}))).await {
            Ok(Answer::Json { session, .. }) => assert_eq!(session.as_deref(), Some("up-42")),
            other => unreachable!("{other:?}"),
        }
        let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        assert!(matches!(client.send(&t, Some("up-42"), &note).await, Ok(Answer::Accepted)));
    }

    #[tokio::test]
    async fn an_sse_answer_yields_its_messages_event_by_event() {
        let (url, _) = server().await;
        let headers = auth();
        let client = McpClient::new();
        let t = target(&url, &headers, "2025-11-25");
        let Ok(Answer::Stream(mut events)) =
            client.send(&t, Some("up-42"), &request("tools/call", json!({"name": "web"}))).await
        else {
            unreachable!("a stream")
        };
        let first = events.next().await;
        assert_eq!(
            first.and_then(Result::ok).and_then(|m| m.get("method").cloned()),
            Some(json!("notifications/progress"))
        );
        let second = events.next().await.and_then(Result::ok).unwrap_or_default();
        assert_eq!(second, json!({"jsonrpc": "2.0", "id": 7, "result": {"content": [], "isError": false}}));
        assert_eq!(events.next().await, None);
        assert_eq!(events.next().await, None);
    }

    #[tokio::test]
    async fn a_forgotten_session_is_session_gone_other_refusals_a_status() {
        let (url, _) = server().await;
        let headers = auth();
        let client = McpClient::new();
        let t = target(&url, &headers, "2025-11-25");
        let list = request("tools/list", json!({}));
        assert_eq!(client.send(&t, Some("gone"), &list).await.err(), Some(UpstreamError::SessionGone));
        assert_eq!(client.send(&t, Some("unknown"), &list).await.err(), Some(UpstreamError::SessionGone));
        let odd = request("no/such/method", json!({}));
        assert_eq!(client.send(&t, Some("up-42"), &odd).await.err(), Some(UpstreamError::Status(400)));
        let missing = format!("{url}/elsewhere");
        let t = target(&missing, &headers, "2025-11-25");
        assert_eq!(client.send(&t, None, &list).await.err(), Some(UpstreamError::Status(404)));
        let t = target(&url, &headers, "2025-11-25");
        assert_eq!(client.send(&t, None, &request("teapot", json!({}))).await.err(), Some(UpstreamError::Status(418)));
    }

    #[tokio::test]
    async fn no_answer_in_time_is_a_timeout() {
        let (url, _) = server().await;
        let headers = auth();
        let client = McpClient::new();
        let t = Target { timeout: Duration::from_millis(200), ..target(&url, &headers, "2025-11-25") };
        let started = std::time::Instant::now();
        assert_eq!(client.send(&t, None, &request("slow", json!({}))).await.err(), Some(UpstreamError::Timeout));
        assert!(started.elapsed() < Duration::from_secs(2));

        let Ok(Answer::Stream(mut events)) = client.send(&t, None, &request("slow/stream", json!({}))).await else {
            unreachable!("a stream")
        };
        assert!(matches!(events.next().await, Some(Ok(_))));
        assert_eq!(events.next().await, Some(Err(UpstreamError::Timeout)));
        assert_eq!(events.next().await, None);
    }

    #[tokio::test]
    async fn an_answer_over_4_mib_is_refused() {
        let (url, _) = server().await;
        let headers = auth();
        let client = McpClient::new();
        let t = target(&url, &headers, "2025-11-25");
        let answer = client.send(&t, None, &request("big", json!({}))).await;
        assert!(matches!(answer, Err(UpstreamError::Transport(ref m)) if m.contains("over")), "{answer:?}");
    }

    #[tokio::test]
    async fn an_unreachable_server_is_a_transport_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0");
        let port = listener.as_ref().map(|l| l.local_addr().map(|a| a.port()).unwrap_or(1)).unwrap_or(1);
        drop(listener);
        let url = format!("http://127.0.0.1:{port}/mcp");
        let headers = HeaderMap::new();
        let answer =
            McpClient::new().send(&target(&url, &headers, "2025-11-25"), None, &request("ping", json!({}))).await;
        assert!(matches!(answer, Err(UpstreamError::Transport(_))), "{answer:?}");
    }

    #[tokio::test]
    async fn the_request_carries_only_the_targets_and_the_protocols_headers() {
        let (url, seen) = server().await;
        let headers = auth();
        let client = McpClient::new();
        let t = target(&url, &headers, "2026-07-28");
        let call = request("tools/call", json!({"name": "caf\u{e9} au lait", "arguments": {"q": "x"}}));
        assert!(client.send(&t, Some("up-42"), &call).await.is_ok());
        client.end(&t, "up-42").await;

        let seen = seen.all();
        assert_eq!(seen.len(), 2);
        let allowed = [
            "host",
            "accept",
            "content-type",
            "content-length",
            "user-agent",
            "authorization",
            "mcp-protocol-version",
            "mcp-session-id",
            "mcp-method",
            "mcp-name",
        ];
        for (method, headers) in &seen {
            for name in headers.keys() {
                assert!(allowed.contains(&name.as_str()), "{method}: unexpected header {name}");
            }
            assert_eq!(headers.get_all(http::header::AUTHORIZATION).iter().count(), 1);
            assert_eq!(
                headers.get(http::header::AUTHORIZATION).map(HeaderValue::as_bytes),
                Some(&b"Bearer server-token"[..])
            );
            assert_eq!(headers.get(SESSION_ID).map(HeaderValue::as_bytes), Some(&b"up-42"[..]));
            assert_eq!(headers.get(PROTOCOL_VERSION).map(HeaderValue::as_bytes), Some(&b"2026-07-28"[..]));
        }
        let (method, call_headers) = &seen[0];
        assert_eq!(method, "tools/call");
        assert_eq!(
            call_headers.get(ACCEPT).map(HeaderValue::as_bytes),
            Some(&b"application/json, text/event-stream"[..])
        );
        assert_eq!(call_headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes), Some(&b"application/json"[..]));
        // The standard headers of the stateless revision, as a server checks them.
        let message: Message = serde_json::from_value(call).unwrap_or_default();
        assert_eq!(check_headers(call_headers, &message), Ok(()));
        assert!(call_headers.get("mcp-name").is_some_and(|v| v.as_bytes().starts_with(b"=?base64?")));
        assert_eq!(seen[1].0, "DELETE");
    }

    #[tokio::test]
    async fn the_stateless_revision_has_no_handshake() {
        let (url, seen) = server().await;
        let headers = HeaderMap::new();
        assert_eq!(McpClient::new().initialize(&target(&url, &headers, "2026-07-28")).await, Ok(None));
        assert!(seen.all().is_empty());
    }

    #[tokio::test]
    async fn the_version_the_server_agreed_to_is_the_one_its_session_speaks() {
        let (url, seen) = server().await;
        let mut headers = auth();
        headers.insert("x-speaks", HeaderValue::from_static("2025-06-18"));
        let client = McpClient::new();
        let t = target(&url, &headers, "2025-11-25");
        let opened = client.open(&t).await;
        assert_eq!(opened, Ok(Opened { session: Some("up-42".to_owned()), version: "2025-06-18".to_owned() }));
        assert!(client.send(&t, Some("up-42"), &request("tools/list", json!({}))).await.is_ok());
        client.end(&t, "up-42").await;
        // Another session is not concerned.
        assert!(client.send(&t, Some("up-43"), &request("tools/list", json!({}))).await.is_ok());
        let seen = seen.all();
        let versions: Vec<_> = seen.iter().map(|(m, h)| (m.as_str(), h.get(PROTOCOL_VERSION).cloned())).collect();
        let agreed = Some(HeaderValue::from_static("2025-06-18"));
        assert_eq!(
            versions,
            [
                ("initialize", None),
                ("notifications/initialized", agreed.clone()),
                ("tools/list", agreed.clone()),
                ("DELETE", agreed),
                ("tools/list", Some(HeaderValue::from_static("2025-11-25"))),
            ]
        );
    }

    #[tokio::test]
    async fn a_session_id_over_256_bytes_fails_the_initialize() {
        let (url, seen) = server().await;
        let mut headers = auth();
        headers.insert("x-long-session", HeaderValue::from_static("1"));
        let answer = McpClient::new().initialize(&target(&url, &headers, "2025-11-25")).await;
        assert!(matches!(answer, Err(UpstreamError::Transport(ref m)) if m.contains("256")), "{answer:?}");
        assert_eq!(seen.all().len(), 1, "not initialized in a session refused");
    }
}
