//! The servers behind `/mcp` as one: a message sent to one of them in the caller's
//! session (its upstream session opened again once, transparently, if the server
//! forgot it), and the lists (`tools/list`, `resources/list`, `resources/templates/
//! list`, `prompts/list`) as the union over the servers the caller may use, each name
//! `{server}__{name}`, paged here with an opaque cursor (an offset in the union). A
//! server that does not answer a list is left out of it, logged and counted; one that
//! answers a list with a JSON-RPC error (it has no resources, say) adds nothing.
//!
//! `prompts/get` goes to the server its prefixed name designates; `resources/read` to
//! the server whose `resources/list` holds the URI (URIs are the servers' own, not
//! prefixed: a client reads what it was listed), the first one in name order when two
//! do.

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::{Value, json};

use super::{Access, Inbound};
use crate::config::Mcp;
use crate::gateway::{Gateway, McpState};
use crate::mcp::names::{MAX_TOOL_NAME, federated, server_of, tool_of};
use crate::mcp::upstream::{Answer, Target, UpstreamError};
use crate::mcp::wire;

/// Items a page of a list holds.
const PAGE: usize = 100;
/// Pages of one server's list read at most (a server that pages forever).
const MAX_PAGES: usize = 50;
/// The JSON-RPC code of a resource no server lists (the MCP specification's).
const RESOURCE_NOT_FOUND: i64 = -32002;

/// Where `server` is, and what it is sent with (its own auth as it is now: a
/// refreshed secret, a token file read again), in `version`.
pub(super) fn target<'a>(mcp: &'a Mcp, state: &McpState, server: &str, version: &'a str) -> Option<Server<'a>> {
    let config = mcp.servers.get(server)?;
    let headers = state.auth_headers(server)?;
    Some(Server { url: &config.url, headers, timeout: config.timeout, version })
}

/// A server as one message (or one exchange) goes to it.
pub(super) struct Server<'a> {
    url: &'a str,
    headers: http::HeaderMap,
    timeout: std::time::Duration,
    version: &'a str,
}

impl Server<'_> {
    pub fn target(&self) -> Target<'_> {
        Target { url: self.url, headers: &self.headers, timeout: self.timeout, version: self.version }
    }
}

/// `message` sent to `server` in `session`'s upstream session there (a stateless
/// caller's: none). A server that forgot the session (or wants one the call does not
/// carry) is initialized, once, and the message sent again in the new session (the
/// first was refused unread). A server the caller's session does not carry (it failed
/// at `initialize`, or was configured since) is initialized first, once per session
/// in this process, its session kept as a renewed one is.
pub(super) async fn send(
    state: &McpState,
    target: &Target<'_>,
    server: &str,
    inbound: &Inbound,
    message: &Value,
) -> Result<Answer, UpstreamError> {
    if wire::stateless(&inbound.version) {
        match state.client.send(target, None, message).await {
            // A server of an earlier revision refuses the stateless one unread.
            Err(UpstreamError::Status(400)) => return earlier(state, target, server, inbound, message).await,
            other => return other,
        }
    }
    let session = inbound.session.as_ref();
    // What the upstream session is kept under here: the id the caller's session
    // carries, else a key of that session's own.
    let (key, in_use) = match (session.and_then(|s| s.upstream.get(server)), session) {
        // A server that gave the session no id: it needs none.
        (Some(carried), _) if carried.is_empty() => (None, None),
        (Some(carried), _) => (Some(carried.clone()), Some(state.session_in_use(server, carried))),
        (None, Some(session)) => {
            let key = missing(&inbound.caller, session);
            let held = match state.renewed(server, &key) {
                Some(held) => Some(held),
                None => {
                    tracing::info!(server, "mcp: the server is not in the session: initialized");
                    let fresh = state.client.initialize(target).await?;
                    if let Some(fresh) = &fresh {
                        state.renew(server, &key, fresh.clone());
                    }
                    fresh
                }
            };
            (Some(key), held)
        }
        (None, None) => (None, None),
    };
    match state.client.send(target, in_use.as_deref(), message).await {
        Err(UpstreamError::SessionGone) => {
            tracing::info!(server, "mcp: the server wants a session: initialized (again)");
            let fresh = state.client.initialize(target).await?;
            // Renewed for the session's later calls; one opened for a call without a
            // session serves this call only: never shared between callers.
            if let (Some(key), Some(fresh)) = (&key, &fresh) {
                state.renew(server, key, fresh.clone());
            }
            state.client.send(target, fresh.as_deref(), message).await
        }
        other => other,
    }
}

/// The key under which the upstream session opened for `session` (of `caller`) at a
/// server it does not carry is kept: a digest of the caller's key and the session.
fn missing(caller: &crate::identity::Caller, session: &crate::mcp::session::Session) -> String {
    use sha2::Digest;
    let mut digest = sha2::Sha256::new();
    digest.update(caller.key_sha256);
    digest.update(serde_json::to_vec(session).unwrap_or_default());
    format!("\u{0}missing\u{0}{}", hex::encode(digest.finalize()))
}

/// The revision a stateless caller's messages go in to a server that does not speak
/// the stateless one.
const EARLIER: &str = "2025-11-25";

/// `message` of a stateless caller sent to a server of an earlier revision, in a
/// session this process holds with it for the caller (its tenant, agent and key:
/// opened on first use and again when the server forgets it; never another
/// caller's). A request goes under an id of the gateway's own, the caller's put back
/// on the answer: a caller's ids are its own to reuse, and a session is only ever
/// one caller's even then.
async fn earlier(
    state: &McpState,
    target: &Target<'_>,
    server: &str,
    inbound: &Inbound,
    message: &Value,
) -> Result<Answer, UpstreamError> {
    let target = Target { url: target.url, headers: target.headers, timeout: target.timeout, version: EARLIER };
    let caller = &inbound.caller;
    let agent = caller.agent.as_ref().map_or("", |a| a.as_str());
    let key = format!("\u{0}stateless\u{0}{}\u{0}{agent}\u{0}{}", caller.tenant, hex::encode(caller.key_sha256));
    let (message, ids) = own_id(message);
    if let Some(held) = state.renewed(server, &key) {
        match state.client.send(&target, Some(&held), &message).await {
            Err(UpstreamError::SessionGone) => {}
            other => return other.map(|answer| restored(answer, ids)),
        }
    }
    let fresh = state.client.initialize(&target).await?;
    if let Some(fresh) = &fresh {
        state.renew(server, &key, fresh.clone());
    }
    let answer = state.client.send(&target, fresh.as_deref(), &message).await?;
    Ok(restored(answer, ids))
}

/// Request ids the gateway sent upstream in sessions it holds for stateless callers.
static SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `message` under an id unique in this process (`flexway-{n}`) if it is a request,
/// and (that id, the caller's).
fn own_id(message: &Value) -> (Value, Option<(Value, Value)>) {
    let (Some(id), Some(_)) = (message.get("id"), message.get("method")) else { return (message.clone(), None) };
    let n = SENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let sent = json!(format!("flexway-{n}"));
    let mut message = message.clone();
    message["id"] = sent.clone();
    (message, Some((sent, id.clone())))
}

/// `answer` with the caller's id back in the response to `ids`' first (sent).
fn restored(answer: Answer, ids: Option<(Value, Value)>) -> Answer {
    let Some((sent, original)) = ids else { return answer };
    match answer {
        Answer::Json { mut message, session } => {
            if message.get("id") == Some(&sent) {
                message["id"] = original;
            }
            Answer::Json { message, session }
        }
        Answer::Stream(events) => Answer::Stream(events.restoring(sent, original)),
        Answer::Accepted => Answer::Accepted,
    }
}

/// The answer to the request `id`: the JSON answer, or the response among the events
/// of a stream (the others, its progress notifications, are passed over). `None`: the
/// server accepted the message and gave no answer.
pub(super) async fn response(answer: Answer, id: &Value) -> Result<Option<Value>, UpstreamError> {
    match answer {
        Answer::Json { message, .. } => Ok(Some(message)),
        Answer::Accepted => Ok(None),
        Answer::Stream(mut events) => {
            while let Some(event) = events.next().await {
                let message = event?;
                let answers = message.get("result").is_some() || message.get("error").is_some();
                if answers && message.get("id") == Some(id) {
                    return Ok(Some(message));
                }
            }
            Ok(None)
        }
    }
}

/// The methods other than `initialize`, `server/discover`, `ping` and `tools/call`.
pub(super) async fn other(
    gateway: &Gateway,
    state: &McpState,
    access: &Access<'_>,
    inbound: &Inbound,
    method: &str,
    id: Value,
    message: &Value,
) -> Value {
    let cursor = message.pointer("/params/cursor").and_then(Value::as_str);
    let listed = match method {
        "tools/list" => Some("tools"),
        "resources/list" => Some("resources"),
        "resources/templates/list" => Some("resourceTemplates"),
        "prompts/list" => Some("prompts"),
        _ => None,
    };
    if let Some(key) = listed {
        let Some(offset) = offset(cursor) else {
            return wire::error(Some(id), wire::INVALID_PARAMS, "Invalid cursor", None);
        };
        let mut all = union(gateway, state, access, inbound, method, key).await;
        if key == "tools" {
            // REST operations as tools (`mcp.expose_rest`; none otherwise).
            all.extend(super::rest::tools(gateway, access));
        }
        let page: Vec<Value> = all.iter().skip(offset).take(PAGE).cloned().collect();
        let mut result = json!({ key: page });
        let next = offset + PAGE;
        if next < all.len() {
            result["nextCursor"] = json!(URL_SAFE_NO_PAD.encode(next.to_string()));
        }
        if wire::stateless(&inbound.version) {
            // The stateless revision's list results say they are whole and uncacheable
            // beyond this caller (each caller's list is its own).
            result["resultType"] = json!("complete");
            result["ttlMs"] = json!(0);
            result["cacheScope"] = json!("private");
        }
        return wire::result(id, result);
    }
    match method {
        "prompts/get" => prompt(state, access, inbound, id, message).await,
        "resources/read" => read(state, access, inbound, id, message).await,
        _ => wire::error(Some(id), wire::METHOD_NOT_FOUND, &format!("Method not found: {method}"), None),
    }
}

/// The offset a cursor stands for (none: the first page); `None` for one that is not
/// a cursor of the gateway's (an offset whose next page's would overflow included).
fn offset(cursor: Option<&str>) -> Option<usize> {
    match cursor {
        None => Some(0),
        Some(cursor) => {
            let offset: usize = String::from_utf8(URL_SAFE_NO_PAD.decode(cursor).ok()?).ok()?.parse().ok()?;
            offset.checked_add(PAGE).map(|_| offset)
        }
    }
}

/// The union of `key` over the servers the caller may use, in server name order then
/// each server's order, every item's `name` federated; a tool the caller may not call
/// is not in it.
async fn union(
    gateway: &Gateway,
    state: &McpState,
    access: &Access<'_>,
    inbound: &Inbound,
    method: &str,
    key: &str,
) -> Vec<Value> {
    let servers = access.servers();
    let lists = futures_util::future::join_all(servers.iter().map(|server| async move {
        match list(state, access.mcp, inbound, server, method, key).await {
            Ok(items) => {
                if matches!(key, "tools" | "prompts") {
                    keep(state, server, method, &items);
                }
                items
            }
            Err(e) => {
                tracing::warn!(server, method, "mcp: the server did not answer: left out of the list: {e:?}");
                gateway.metrics.mcp_server_down(server);
                Vec::new()
            }
        }
    }))
    .await;
    let mut all = Vec::new();
    for (server, items) in servers.iter().zip(lists) {
        for mut item in items {
            let Some(name) = item.get("name").and_then(Value::as_str).map(str::to_owned) else { continue };
            if key == "tools" && !access.may_call(server, &name) {
                continue;
            }
            item["name"] = Value::String(federated(server, &name));
            all.push(item);
        }
    }
    all
}

/// One server's whole list (every page), within its one timeout: a union of lists,
/// read in parallel, takes at most the longest of its servers' timeouts.
pub(super) async fn list(
    state: &McpState,
    mcp: &Mcp,
    inbound: &Inbound,
    server: &str,
    method: &str,
    key: &str,
) -> Result<Vec<Value>, UpstreamError> {
    let Some(server_at) = target(mcp, state, server, &inbound.version) else { return Ok(Vec::new()) };
    let target = server_at.target();
    let pages = async {
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        for page in 0..MAX_PAGES {
            let params = match &cursor {
                Some(cursor) => json!({"cursor": cursor}),
                None => json!({}),
            };
            let id = json!(format!("flexway-list-{page}"));
            let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
            let answer = send(state, &target, server, inbound, &message).await?;
            let Some(answer) = response(answer, &id).await? else {
                return Err(UpstreamError::Transport(format!("no answer to {method}")));
            };
            let Some(result) = answer.get("result") else {
                // A server without this kind of item (-32601) has none to add.
                return Ok(items);
            };
            if let Some(page) = result.get(key).and_then(Value::as_array) {
                items.extend(page.iter().cloned());
            }
            cursor = result.get("nextCursor").and_then(Value::as_str).map(str::to_owned);
            if cursor.is_none() {
                break;
            }
        }
        Ok(items)
    };
    tokio::time::timeout(target.timeout, pages).await.map_err(|_| UpstreamError::Timeout)?
}

/// The server a federated name designates, if the caller may use it, and the name on
/// that server: one the server's own listing holds (a name it does not list is
/// unknown, as a denied one is: nothing sent, nothing said about what exists). The
/// listing is the one kept for the server if it is fresh, read again when it is not,
/// or when it lacks the name and was read over [`REREAD_AFTER`] ago. A server whose
/// listing cannot be read is sent the name as it is (it answers that it is down).
pub(super) async fn resolve(
    state: &McpState,
    access: &Access<'_>,
    inbound: &Inbound,
    name: &str,
    method: &str,
    key: &str,
) -> Option<(String, String)> {
    // No federated name is longer: not one to list a server for.
    if name.chars().count() > MAX_TOOL_NAME {
        return None;
    }
    let server = server_of(name)?;
    if !access.may_use(server) {
        return None;
    }
    let kept = state.listed.lock().unwrap_or_else(PoisonError::into_inner).get(&listing(server, method)).cloned();
    if let Some((read, names)) = kept.filter(|(read, _)| read.elapsed() < LISTED_FOR) {
        if let Some(own) = listed_as(name, server, &names) {
            return Some((server.to_owned(), own));
        }
        if read.elapsed() < REREAD_AFTER {
            return None;
        }
    }
    match list(state, access.mcp, inbound, server, method, key).await {
        Ok(listed) => {
            let names = keep(state, server, method, &listed);
            Some((server.to_owned(), listed_as(name, server, &names)?))
        }
        Err(e) => {
            tracing::warn!(server, method, "mcp: the server's list could not be read: {e:?}");
            Some((server.to_owned(), tool_of(name, server, std::iter::empty())?))
        }
    }
}

/// How long a server's listed names are trusted.
const LISTED_FOR: Duration = Duration::from_secs(60);
/// How soon after a listing was read a name it lacks reads it again.
const REREAD_AFTER: Duration = Duration::from_secs(5);

/// What a server's listing of `method` is kept under.
fn listing(server: &str, method: &str) -> (String, String) {
    (server.to_owned(), method.to_owned())
}

/// The names in `listed` (a server's whole list of `method`), kept for the server as
/// read now.
fn keep(state: &McpState, server: &str, method: &str, listed: &[Value]) -> Arc<[String]> {
    let names: Arc<[String]> =
        listed.iter().filter_map(|item| item.get("name").and_then(Value::as_str).map(str::to_owned)).collect();
    let mut kept = state.listed.lock().unwrap_or_else(PoisonError::into_inner);
    kept.insert(listing(server, method), (Instant::now(), names.clone()));
    names
}

/// The name among `names` (`server`'s listing) whose federated name is `name`.
fn listed_as(name: &str, server: &str, names: &[String]) -> Option<String> {
    tool_of(name, server, names.iter().map(String::as_str)).filter(|own| names.contains(own))
}

/// `message` forwarded to `server` with its `params.name` (or nothing) replaced; the
/// server's answer under the client's `id`.
async fn forward(
    state: &McpState,
    access: &Access<'_>,
    inbound: &Inbound,
    server: &str,
    id: Value,
    message: &Value,
) -> Value {
    let Some(server_at) = target(access.mcp, state, server, &inbound.version) else {
        return wire::error(Some(id), wire::INTERNAL_ERROR, "the server is not configured", None);
    };
    let target = server_at.target();
    let answer = match send(state, &target, server, inbound, message).await {
        Ok(answer) => response(answer, &id).await,
        Err(e) => Err(e),
    };
    match answer {
        Ok(Some(mut answer)) => {
            answer["id"] = id;
            super::typed(&inbound.version, &mut answer);
            answer
        }
        Ok(None) => wire::error(Some(id), wire::INTERNAL_ERROR, &format!("MCP server {server} gave no answer"), None),
        Err(e) => {
            tracing::warn!(server, "mcp: the server did not answer: {e:?}");
            let message = format!("MCP server {server} is unavailable");
            wire::error(Some(id), wire::INTERNAL_ERROR, &message, Some(json!({"flexway_code": "upstream_unavailable"})))
        }
    }
}

/// `prompts/get`, to the server its name designates.
async fn prompt(state: &McpState, access: &Access<'_>, inbound: &Inbound, id: Value, message: &Value) -> Value {
    let name = message.pointer("/params/name").and_then(Value::as_str).unwrap_or("");
    let Some((server, own)) = resolve(state, access, inbound, name, "prompts/list", "prompts").await else {
        return wire::error(Some(id), wire::INVALID_PARAMS, &format!("Unknown prompt: {name}"), None);
    };
    let mut message = message.clone();
    message["params"]["name"] = Value::String(own);
    forward(state, access, inbound, &server, id, &message).await
}

/// `resources/read`, to the server that lists the URI.
async fn read(state: &McpState, access: &Access<'_>, inbound: &Inbound, id: Value, message: &Value) -> Value {
    let uri = message.pointer("/params/uri").and_then(Value::as_str).unwrap_or("");
    for server in access.servers() {
        let Ok(listed) = list(state, access.mcp, inbound, server, "resources/list", "resources").await else {
            continue;
        };
        if listed.iter().any(|r| r.get("uri").and_then(Value::as_str) == Some(uri)) {
            return forward(state, access, inbound, server, id, message).await;
        }
    }
    let data = json!({"uri": uri});
    wire::error(Some(id), RESOURCE_NOT_FOUND, &format!("Resource not found: {uri}"), Some(data))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use axum::body::Body;
    use axum::extract::State;
    use axum::response::{IntoResponse, Response};
    use http::{HeaderMap, Request, StatusCode};
    use serde_json::{Value, json};
    use tower::ServiceExt;

    use crate::config::{Auth, Mcp, McpNarrowing, McpPrice, McpServer, ToolGlobs};
    use crate::gateway::Gateway;
    use crate::money::MicroEur;

    /// A request the fake server saw: its method, session, id and version header.
    #[derive(Debug, Clone)]
    struct Hit {
        method: String,
        session: Option<String>,
        id: Value,
        version: Option<String>,
    }

    /// The fake server of an earlier revision: what it saw, how it behaves.
    #[derive(Default)]
    struct Fake {
        seen: Vec<Hit>,
        sessions: Vec<String>,
        /// `initialize`s still to refuse (500).
        refuse_initialize: usize,
        /// `tools/list` pages forever, slowly.
        pages_forever: bool,
        /// Gives no session id, and wants none.
        sessionless: bool,
    }

    type Shared = Arc<Mutex<Fake>>;

    fn lock(fake: &Shared) -> std::sync::MutexGuard<'_, Fake> {
        fake.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bad_request(text: &str) -> Response {
        let body = json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32000, "message": text}});
        (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
    }

    async fn fake(State(fake): State<Shared>, headers: HeaderMap, body: String) -> Response {
        let message: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (session, version) = (header("mcp-session-id"), header("mcp-protocol-version"));
        let method = message["method"].as_str().unwrap_or("").to_owned();
        let id = message["id"].clone();
        let pages_forever = {
            let mut fake = lock(&fake);
            let seen =
                Hit { method: method.clone(), session: session.clone(), id: id.clone(), version: version.clone() };
            fake.seen.push(seen);
            if version.as_deref() == Some("2026-07-28") {
                return bad_request("Bad Request: Unsupported protocol version");
            }
            if method == "initialize" {
                if fake.refuse_initialize > 0 {
                    fake.refuse_initialize -= 1;
                    return StatusCode::INTERNAL_SERVER_ERROR.into_response();
                }
                let session = format!("s-{}", fake.sessions.len() + 1);
                fake.sessions.push(session.clone());
                let result = json!({"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                    "serverInfo": {"name": "fake", "version": "1"}});
                let body = json!({"jsonrpc": "2.0", "id": id, "result": result});
                if fake.sessionless {
                    return axum::Json(body).into_response();
                }
                return ([("mcp-session-id", session)], axum::Json(body)).into_response();
            }
            match &session {
                None if fake.sessionless => {}
                None => return bad_request("Bad Request: No valid session ID provided"),
                Some(session) if !fake.sessions.contains(session) => return StatusCode::NOT_FOUND.into_response(),
                Some(_) => {}
            }
            fake.pages_forever
        };
        let result = match method.as_str() {
            "notifications/initialized" => return StatusCode::ACCEPTED.into_response(),
            "tools/list" if pages_forever => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                json!({"tools": [{"name": "search", "inputSchema": {"type": "object"}}], "nextCursor": "more"})
            }
            "tools/list" => json!({"tools": [{"name": "search", "inputSchema": {"type": "object"}},
                {"name": "wipe", "inputSchema": {"type": "object"}}]}),
            "tools/call" => json!({"content": [{"type": "text", "text": "found"}]}),
            _ => return bad_request("Bad Request"),
        };
        axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
    }

    /// A gateway federating `old` (the fake server, `timeout`, its tool `wipe` denied),
    /// keys `k1` and `k2` of tenant `acme`.
    async fn gateway(timeout: Duration) -> (Arc<Gateway>, Shared) {
        use sha2::Digest;
        let shared = Shared::default();
        let app = axum::Router::new().route("/mcp", axum::routing::post(fake)).with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let yaml = format!(
            "version: 1\ntenants:\n  acme:\n    keys: [{{sha256: {}}}, {{sha256: {}}}]\nai:\n  default_backend: a\n  \
             backends:\n    a: {{url: 'http://127.0.0.1:9/v1'}}\n",
            hex::encode(sha2::Sha256::digest(b"k1")),
            hex::encode(sha2::Sha256::digest(b"k2")),
        );
        let env = std::collections::HashMap::new();
        let mut loaded = crate::config::load_str(&yaml, &env).unwrap();
        let server = McpServer {
            url: format!("http://{address}/mcp"),
            auth: Auth::None,
            external: false,
            jurisdiction: None,
            timeout,
            price: McpPrice { per_call: MicroEur(0), tools: BTreeMap::new() },
            tools: ToolGlobs { allow: None, deny: vec!["wipe".to_owned()] },
        };
        let servers = BTreeMap::from([("old".to_owned(), server)]);
        loaded.config.mcp = Some(Mcp { servers, session_key: None, oauth: None, expose_rest: false });
        if let Some(tenant) = loaded.config.tenants.values_mut().next() {
            tenant.mcp = McpNarrowing::default();
        }
        let adapters = crate::gateway::Adapters {
            budgets: Arc::new(crate::budget::MemoryBudgetStore::new()),
            audit: Arc::new(crate::audit::sinks::MemoryAuditSink::new()),
            export: crate::telemetry::Export::Batched,
            cache: None,
        };
        let secrets = Arc::new(crate::secret::LocalSecrets { env });
        (Arc::new(Gateway::new(loaded.config, secrets, adapters).await.unwrap()), shared)
    }

    /// `POST /mcp` of `message` with `key` and `headers`: the status, headers and body.
    async fn post(
        gateway: &Arc<Gateway>,
        key: &str,
        headers: &[(&str, &str)],
        message: Value,
    ) -> (StatusCode, HeaderMap, Value) {
        let mut request = Request::post("/mcp")
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Body::from(message.to_string())).unwrap();
        let response = crate::http::app(gateway.clone()).oneshot(request).await.unwrap();
        let (status, headers) = (response.status(), response.headers().clone());
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
        (status, headers, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    /// A stateless caller's (2026-07-28) `method` with the request id 1.
    async fn stateless(gateway: &Arc<Gateway>, key: &str, method: &str, params: Value) -> Value {
        let mut headers = vec![("mcp-protocol-version", "2026-07-28"), ("mcp-method", method)];
        let name = params["name"].as_str().map(str::to_owned);
        if let Some(name) = &name {
            headers.push(("mcp-name", name));
        }
        let mut params = params;
        params["_meta"] = json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
        });
        let message = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let (status, _, body) = post(gateway, key, &headers, message).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body
    }

    #[tokio::test]
    async fn stateless_callers_each_have_their_own_upstream_session_and_ids() {
        let (gateway, fake) = gateway(Duration::from_secs(5)).await;
        for key in ["k1", "k2", "k1"] {
            let listed = stateless(&gateway, key, "tools/list", json!({})).await;
            assert_eq!(listed["id"], 1);
            assert_eq!(listed["result"]["tools"][0]["name"], "old__search");
            let called = stateless(&gateway, key, "tools/call", json!({"name": "old__search", "arguments": {}})).await;
            assert_eq!(called["id"], 1);
            assert_eq!(called["result"]["content"][0]["text"], "found", "{called}");
        }
        let fake = lock(&fake);
        assert_eq!(fake.sessions.len(), 2, "one session per caller, kept: {:?}", fake.seen);
        let sent: Vec<&Hit> =
            fake.seen.iter().filter(|r| r.method.starts_with("tools/") && r.session.is_some()).collect();
        assert_eq!(sent.len(), 6);
        assert!(sent.iter().all(|r| r.version.as_deref() == Some("2025-11-25")), "{sent:?}");
        let by_key = |session: &str| sent.iter().filter(|r| r.session.as_deref() == Some(session)).count();
        assert_eq!((by_key("s-1"), by_key("s-2")), (4, 2));
        let mut ids: Vec<String> = sent.iter().map(|r| r.id.as_str().unwrap_or("").to_owned()).collect();
        assert!(ids.iter().all(|id| id.starts_with("flexway-")), "{ids:?}");
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 6, "no two requests under one id");
    }

    /// A session (2025-11-25) of key `k1`: its id.
    async fn initialize(gateway: &Arc<Gateway>) -> String {
        let message = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
        let (status, headers, body) = post(gateway, "k1", &[], message).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        headers.get("mcp-session-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()
    }

    async fn in_session(gateway: &Arc<Gateway>, session: &str, method: &str, params: Value) -> Value {
        let headers = [("mcp-session-id", session), ("mcp-protocol-version", "2025-11-25")];
        let message = json!({"jsonrpc": "2.0", "id": 3, "method": method, "params": params});
        let (status, _, body) = post(gateway, "k1", &headers, message).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body
    }

    #[tokio::test]
    async fn a_server_that_gives_no_session_id_is_initialized_once() {
        let (gateway, fake) = gateway(Duration::from_secs(5)).await;
        lock(&fake).sessionless = true;
        let session = initialize(&gateway).await;
        for _ in 0..3 {
            let listed = in_session(&gateway, &session, "tools/list", json!({})).await;
            assert_eq!(listed["result"]["tools"][0]["name"], "old__search", "{listed}");
        }
        let called = in_session(&gateway, &session, "tools/call", json!({"name": "old__search"})).await;
        assert_eq!(called["result"]["content"][0]["text"], "found", "{called}");
        let fake = lock(&fake);
        let initializes = fake.seen.iter().filter(|r| r.method == "initialize").count();
        assert_eq!(initializes, 1, "initialized at the session's start only: {:?}", fake.seen);
    }

    #[tokio::test]
    async fn a_server_the_session_does_not_carry_is_initialized_once_for_it() {
        let (gateway, fake) = gateway(Duration::from_secs(5)).await;
        lock(&fake).refuse_initialize = 1;
        let session = initialize(&gateway).await;
        assert!(lock(&fake).sessions.is_empty(), "the server failed its initialize");
        for _ in 0..3 {
            let listed = in_session(&gateway, &session, "tools/list", json!({})).await;
            assert_eq!(listed["result"]["tools"][0]["name"], "old__search", "{listed}");
        }
        let called = in_session(&gateway, &session, "tools/call", json!({"name": "old__search"})).await;
        assert_eq!(called["result"]["content"][0]["text"], "found", "{called}");
        let fake = lock(&fake);
        assert_eq!(fake.sessions, ["s-1"], "initialized once, for the session's every call");
        let unsessioned = fake.seen.iter().filter(|r| r.method.starts_with("tools/") && r.session.is_none()).count();
        assert_eq!(unsessioned, 0, "{:?}", fake.seen);
    }

    #[tokio::test]
    async fn a_list_has_one_deadline_and_a_cursor_past_the_end_is_invalid() {
        let (gateway, fake) = gateway(Duration::from_millis(500)).await;
        let session = initialize(&gateway).await;
        lock(&fake).pages_forever = true;
        let started = std::time::Instant::now();
        let listed = in_session(&gateway, &session, "tools/list", json!({})).await;
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        assert_eq!(listed["result"]["tools"], json!([]), "the server that did not finish is left out");

        use base64::Engine;
        for offset in [u64::MAX.to_string(), (usize::MAX - 50).to_string(), "-1".to_owned()] {
            let cursor = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(offset);
            let answer = in_session(&gateway, &session, "tools/list", json!({"cursor": cursor})).await;
            assert_eq!(answer["error"]["code"], -32602, "{answer}");
        }
    }

    #[tokio::test]
    async fn a_tool_name_longer_than_any_federated_one_is_unknown_unsent_and_unlisted() {
        let (gateway, fake) = gateway(Duration::from_secs(5)).await;
        let session = initialize(&gateway).await;
        let before = lock(&fake).seen.len();
        let name = format!("old__{}", "x".repeat(60));
        let answer = in_session(&gateway, &session, "tools/call", json!({"name": name})).await;
        assert_eq!(answer["error"]["code"], -32602, "{answer}");
        assert!(answer["error"]["message"].as_str().unwrap_or("").contains("Unknown tool"), "{answer}");
        assert_eq!(lock(&fake).seen.len(), before, "neither listed nor called");
    }

    #[tokio::test]
    async fn a_tool_the_server_does_not_list_is_answered_as_a_denied_one_and_never_sent() {
        let (gateway, fake) = gateway(Duration::from_secs(5)).await;
        let session = initialize(&gateway).await;
        let calls = |fake: &Shared, method: &str| lock(fake).seen.iter().filter(|r| r.method == method).count();

        // Two calls in a row: the server's tools listed once, for both.
        for _ in 0..2 {
            let called = in_session(&gateway, &session, "tools/call", json!({"name": "old__search"})).await;
            assert_eq!(called["result"]["content"][0]["text"], "found", "{called}");
        }
        assert_eq!((calls(&fake, "tools/list"), calls(&fake, "tools/call")), (1, 2));

        // The fake answers any call with a result: a name it does not list is not sent.
        let denied = in_session(&gateway, &session, "tools/call", json!({"name": "old__wipe"})).await;
        let absent = in_session(&gateway, &session, "tools/call", json!({"name": "old__nope"})).await;
        assert_eq!(denied["error"], json!({"code": -32602, "message": "Unknown tool: old__wipe"}), "{denied}");
        assert_eq!(absent["error"], json!({"code": -32602, "message": "Unknown tool: old__nope"}), "{absent}");
        let shape = |answer: &Value, name: &str| answer.to_string().replace(name, "NAME");
        assert_eq!(shape(&denied, "old__wipe"), shape(&absent, "old__nope"));
        assert_eq!(calls(&fake, "tools/call"), 2, "neither was sent: {:?}", lock(&fake).seen);
        // `nope` not in a listing read under 5 s ago: the server is not asked again.
        assert_eq!(calls(&fake, "tools/list"), 1);

        // The listing read as if `by` ago.
        let age = |by: u64| {
            let state = gateway.mcp.as_ref().unwrap();
            let read = std::time::Instant::now().checked_sub(Duration::from_secs(by)).unwrap();
            state.listed.lock().unwrap().values_mut().for_each(|(kept, _)| *kept = read);
        };
        // Over 5 s: a name it lacks reads it again (still lacking: unknown, unsent).
        age(6);
        let absent = in_session(&gateway, &session, "tools/call", json!({"name": "old__nope"})).await;
        assert_eq!(absent["error"]["code"], -32602, "{absent}");
        assert_eq!((calls(&fake, "tools/list"), calls(&fake, "tools/call")), (2, 2));
        // Over 60 s: read again even for a name it holds.
        age(61);
        let called = in_session(&gateway, &session, "tools/call", json!({"name": "old__search"})).await;
        assert_eq!(called["result"]["content"][0]["text"], "found", "{called}");
        assert_eq!((calls(&fake, "tools/list"), calls(&fake, "tools/call")), (3, 3));
    }
}
