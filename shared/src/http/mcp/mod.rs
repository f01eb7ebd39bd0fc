//! `/mcp` (SPEC §17): the Model Context Protocol over Streamable HTTP, one endpoint
//! that federates the tools of `mcp.servers` behind the caller's identity, budgets and
//! audit.
//!
//! A message is read whole (at most 4 MiB), its caller identified (a Flexway key as
//! Bearer, or a JWT under `mcp.oauth`: 401 with the resource metadata's address
//! otherwise), its protocol version read (`initialize`'s, else `MCP-Protocol-Version`,
//! else its session's), then its session opened (2025-06-18 and 2025-11-25: sealed
//! state, [`crate::mcp::session`]) or its headers checked against its body (the
//! stateless 2026-07-28: -32020 on a mismatch; its `params._meta` must say its version
//! and the client's capabilities, 400 -32602 otherwise; a method that revision lacks,
//! `initialize` and `ping` included, is 404 -32601). Then by method:
//! - `initialize`: an upstream session opened at each server the caller may use, in
//!   parallel (a server that does not answer is left out), all sealed in the
//!   `Mcp-Session-Id`; `server/discover`, `ping`: answered here;
//! - `tools/list`, `resources/list`, `resources/templates/list`, `prompts/list`: the
//!   union over the servers the caller may use, names as `{server}__{name}`, paged
//!   here ([`federation`]); a server down is left out, logged and counted;
//! - `tools/call`: the one metered method, through the driver ([`call`]): one record
//!   per call; `prompts/get` by its prefixed name, `resources/read` to the server that
//!   lists the URI.
//!
//! A session id opens for [`crate::mcp::session::MAX_AGE`] (a day) after its
//! `initialize`, then is 404 (the client initializes again). `DELETE /mcp` ends it:
//! its upstream sessions are ended (best effort) and the id is 404 at once on the
//! process that ended it (a per-process set of ended ids, each kept until its age
//! would refuse it anyway). Another process of a fleet, or another Lambda instance,
//! still opens it: it finds the upstream sessions gone, re-initializes them, and
//! serves the id until it expires. That is the price of sealed sessions stored
//! nowhere: an id cannot be withdrawn everywhere at once, only outlived.
//!
//! Every other answer is JSON-RPC on HTTP 200 (a refusal too), JSON, or one SSE event
//! when the client accepts only `text/event-stream`. The caller's credential and
//! headers never go upstream: each server gets its own `auth` only.

mod call;
mod federation;
mod rest;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::{Value, json};

use crate::config::{Mcp, McpNarrowing, McpOauth, ToolGlobs};
use crate::error::GatewayError;
use crate::gateway::{Gateway, McpState};
use crate::identity::Caller;
use crate::mcp::policy::Who;
use crate::mcp::session::Session;
use crate::mcp::wire::{self, VERSIONS};
use crate::routing::Residency;

/// The largest message `/mcp` reads.
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;
const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";
const METADATA_PATH: &str = "/.well-known/oauth-protected-resource/mcp";

pub(super) fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/mcp", post(message).get(stream).delete(end_session))
        .route(METADATA_PATH, get(resource_metadata))
}

/// What `/mcp` answers when `mcp` is not configured.
fn not_configured(method: &http::Method, path: &str) -> Response {
    let error = GatewayError::NotFound { method: method.to_string(), path: path.to_owned() };
    super::render(&error, false)
}

/// `GET /.well-known/oauth-protected-resource/mcp` (RFC 9728).
async fn resource_metadata(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let Some(mcp) = &gateway.config.mcp else {
        return not_configured(request.method(), request.uri().path());
    };
    let resource = match &mcp.oauth {
        Some(oauth) => oauth.audience.clone(),
        None => format!("{}/mcp", base_url(request.headers())),
    };
    let mut document = json!({"resource": resource, "bearer_methods_supported": ["header"]});
    if let Some(oauth) = &mcp.oauth {
        document["authorization_servers"] = json!([oauth.issuer]);
    }
    axum::Json(document).into_response()
}

/// `scheme://host` as the client reached the gateway: `X-Forwarded-Proto` (a load
/// balancer's) or `http`, and `Host`.
fn base_url(headers: &HeaderMap) -> String {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    let scheme = text("x-forwarded-proto").and_then(|p| p.split(',').next()).map(str::trim);
    let scheme = match scheme {
        Some("https") => "https",
        _ => "http",
    };
    let host = text("host").filter(|h| !h.is_empty() && !h.contains(['/', ' ', '"'])).unwrap_or("localhost");
    format!("{scheme}://{host}")
}

/// 401, pointing at the resource metadata (RFC 9728 §5.1).
fn unauthorized(headers: &HeaderMap, why: &str) -> Response {
    let metadata = format!("{}{METADATA_PATH}", base_url(headers));
    let mut response =
        (StatusCode::UNAUTHORIZED, axum::Json(json!({"error": "invalid_token", "error_description": why})))
            .into_response();
    if let Ok(value) = HeaderValue::from_str(&format!("Bearer resource_metadata=\"{metadata}\"")) {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, value);
    }
    response
}

/// The caller: a Flexway key as Bearer, else a JWT of `mcp.oauth`'s issuer whose
/// tenant (and agent) are declared.
async fn identify(gateway: &Gateway, mcp: &Mcp, headers: &HeaderMap) -> Result<Caller, Response> {
    use crate::identity::IdentityError;
    match gateway.keys.authenticate(headers) {
        Ok(caller) => return Ok(caller),
        Err(IdentityError::MissingKey | IdentityError::UnknownKey) => {}
        // A key it knows, with a header it refuses (an agent the key is not bound to).
        Err(other) => return Err(super::render(&GatewayError::from(other), false)),
    }
    let Some(oauth) = &mcp.oauth else {
        return Err(unauthorized(headers, "a Flexway key is required as the Bearer token"));
    };
    jwt_caller(gateway, oauth, headers).await
}

/// A JWT's caller (`identity::jwt`).
async fn jwt_caller(gateway: &Gateway, oauth: &McpOauth, headers: &HeaderMap) -> Result<Caller, Response> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    let Some(token) = token else { return Err(unauthorized(headers, "a Bearer token is required")) };
    let Some(verifier) = gateway.mcp.as_ref().and_then(|state| state.verifier.as_ref()) else {
        return Err(unauthorized(headers, "the token is not a Flexway key"));
    };
    let claims = match verifier.verify(token).await {
        Ok(claims) => claims,
        Err(e) => {
            tracing::info!("mcp: a JWT was refused: {e}");
            return Err(unauthorized(headers, "the token is not valid for this resource"));
        }
    };
    let config = &gateway.config;
    let Some((tenant, declared)) = config.tenants.get_key_value(claims.tenant.as_str()) else {
        return Err(unauthorized(headers, "the token's tenant is not declared"));
    };
    let agent = match &claims.agent {
        Some(agent) => match declared.agents.keys().find(|a| a.as_str() == agent) {
            Some(agent) => Some(agent.clone()),
            None => return Err(unauthorized(headers, "the token's agent is not declared")),
        },
        None => None,
    };
    // What the audit hashes as the caller's key: the token's issuer and subject.
    let subject = format!("jwt\u{0}{}\u{0}{}", oauth.issuer, claims.subject.as_deref().unwrap_or(""));
    let key_sha256 = <sha2::Sha256 as sha2::Digest>::digest(subject.as_bytes()).into();
    Ok(Caller { tenant: tenant.clone(), agent, key_sha256, relay_peer: false, key_limits: Default::default() })
}

/// What the caller may reach: its tenant's and agent's narrowing, its sensitivity and
/// residency (as the headers of this message say them).
pub(super) struct Access<'a> {
    pub mcp: &'a Mcp,
    who: Who<'a>,
    residency: Residency,
}

/// A tenant or agent with no `mcp:` narrowing.
static OPEN: McpNarrowing = McpNarrowing { servers: None, tools: ToolGlobs { allow: None, deny: Vec::new() } };

impl<'a> Access<'a> {
    pub fn of(gateway: &'a Gateway, mcp: &'a Mcp, caller: &Caller, headers: &HeaderMap) -> Result<Self, GatewayError> {
        let sensitive = crate::identity::sensitivity(headers, &gateway.config.ai.sensitive_header)?;
        let residency = crate::admission::residency(&gateway.config, caller, headers)?;
        Ok(Access::with(gateway, mcp, caller, sensitive, residency))
    }

    pub fn with(gateway: &'a Gateway, mcp: &'a Mcp, caller: &Caller, sensitive: bool, residency: Residency) -> Self {
        let tenant = gateway.config.tenants.get(&caller.tenant);
        let agent = caller.agent.as_ref().and_then(|a| tenant.and_then(|t| t.agents.get(a)));
        let who = Who {
            tenant: tenant.map_or(&OPEN, |t| &t.mcp),
            agent: agent.map(|a| &a.mcp),
            sensitive,
            // Residency is the call's (the caller's, narrowed by its header): below.
            residency: None,
        };
        Access { mcp, who, residency }
    }

    pub fn may_use(&self, server: &str) -> bool {
        let jurisdiction = self.mcp.servers.get(server).and_then(|s| s.jurisdiction.as_deref());
        self.who.may_use(self.mcp, server) && self.residency.allows_jurisdiction(jurisdiction)
    }

    pub fn may_call(&self, server: &str, tool: &str) -> bool {
        self.may_use(server) && self.who.may_call(self.mcp, server, tool)
    }

    /// The servers the caller may use, in name order.
    pub fn servers(&self) -> Vec<&'a str> {
        self.mcp.servers.keys().map(String::as_str).filter(|s| self.may_use(s)).collect()
    }
}

/// How the client takes its answers.
#[derive(Clone, Copy)]
pub(super) struct Accept {
    /// Only `text/event-stream`: an answer is one SSE event.
    pub sse_only: bool,
    /// `text/event-stream` among others: a tool call's upstream stream is relayed as
    /// it comes.
    pub sse: bool,
}

impl Accept {
    fn of(headers: &HeaderMap) -> Accept {
        let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
        let sse = accept.contains("text/event-stream");
        let json = accept.is_empty() || accept.contains("application/json") || accept.contains("*/*");
        Accept { sse_only: sse && !json, sse }
    }

    /// A JSON-RPC message as the client takes it, on HTTP 200.
    pub fn answer(self, message: &Value) -> Response {
        if self.sse_only {
            return event_stream(Body::from(sse_event(message)));
        }
        let body = serde_json::to_vec(message).unwrap_or_default();
        let mut response = Response::new(Body::from(body));
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        response
    }
}

/// For a stateless caller, a result from a server of an earlier revision says it is
/// whole (`resultType: complete`), as the stateless revision's results must.
pub(super) fn typed(version: &str, message: &mut Value) {
    if wire::stateless(version)
        && let Some(result) = message.get_mut("result").and_then(Value::as_object_mut)
    {
        result.entry("resultType").or_insert_with(|| json!("complete"));
    }
}

/// `message` as one SSE event.
pub(super) fn sse_event(message: &Value) -> Vec<u8> {
    let mut event = b"event: message\ndata: ".to_vec();
    event.extend_from_slice(&serde_json::to_vec(message).unwrap_or_default());
    event.extend_from_slice(b"\n\n");
    event
}

/// An answer of SSE events.
pub(super) fn event_stream(body: Body) -> Response {
    let mut response = Response::new(body);
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// A JSON-RPC error on an HTTP status (a message the door could not take).
fn rejected(status: StatusCode, id: Option<Value>, code: i64, message: &str, data: Option<Value>) -> Response {
    let body = wire::error(id, code, message, data);
    (status, axum::Json(body)).into_response()
}

/// A message this door serves: who sent it, in which version and session.
pub(super) struct Inbound {
    pub caller: Caller,
    pub version: String,
    pub session: Option<Session>,
    pub accept: Accept,
}

/// `POST /mcp`: one JSON-RPC message.
async fn message(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let (Some(mcp), Some(state)) = (gateway.config.mcp.as_ref(), gateway.mcp.clone()) else {
        return not_configured(request.method(), request.uri().path());
    };
    let caller = match identify(&gateway, mcp, request.headers()).await {
        Ok(caller) => caller,
        Err(response) => return response,
    };
    let (parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_MESSAGE).await {
        Ok(bytes) => bytes,
        Err(_) => {
            let message = "the message is larger than 4 MiB";
            return rejected(StatusCode::PAYLOAD_TOO_LARGE, None, wire::INVALID_REQUEST, message, None);
        }
    };
    let value: Value = match serde_json::from_slice(&bytes) {
        Ok(value) => value,
        Err(_) => return rejected(StatusCode::BAD_REQUEST, None, wire::PARSE_ERROR, "Parse error", None),
    };
    if value.is_array() {
        let message = "batches are not part of this protocol's revisions: send one message a request";
        return rejected(StatusCode::BAD_REQUEST, None, wire::INVALID_REQUEST, message, None);
    }
    let parsed: wire::Message = match serde_json::from_value(value.clone()) {
        Ok(parsed) => parsed,
        Err(_) => return rejected(StatusCode::BAD_REQUEST, None, wire::INVALID_REQUEST, "Invalid Request", None),
    };
    // Notifications and the client's answers to requests the gateway never sends.
    if !parsed.is_request() {
        if parsed.is_notification() && parsed.method.as_deref() == Some("notifications/cancelled") {
            cancelled(&gateway, &state, &caller, &parts.headers, parsed.params.as_ref());
        }
        return StatusCode::ACCEPTED.into_response();
    }
    let id = parsed.id.clone().unwrap_or(Value::Null);
    let method = parsed.method.clone().unwrap_or_default();
    let headers = &parts.headers;
    let accept = Accept::of(headers);

    let header_version = headers.get(VERSION_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let asked = match method.as_str() {
        // A stateless client's `initialize` says its version in the header only.
        "initialize" => value
            .pointer("/params/protocolVersion")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| header_version.clone().filter(|v| wire::stateless(v))),
        "server/discover" => header_version.clone().or_else(|| Some(VERSIONS[0].to_owned())),
        _ => header_version.clone(),
    };
    let session_id = headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok());
    let mut session = None;
    let version = match asked {
        Some(version) if VERSIONS.contains(&version.as_str()) => version,
        // The lifecycle's negotiation: another version the gateway speaks is offered,
        // and the client decides whether it goes on in it.
        Some(_) if method == "initialize" => OFFERED.to_owned(),
        Some(version) => return unsupported(accept, id, &version),
        // No version said: the session's, if it carries one.
        None => match session_id {
            Some(_) => String::new(),
            None => return unsupported(accept, id, "(none)"),
        },
    };
    if wire::stateless(&version) {
        if let Err(why) = wire::check_headers(headers, &parsed) {
            return rejected(StatusCode::BAD_REQUEST, Some(id), wire::HEADER_MISMATCH, &why, None);
        }
        if let Some(refusal) = stateless_refusal(&version, &method, &value, &id) {
            return refusal;
        }
    } else if method != "initialize" {
        let Some(session_id) = session_id else {
            let message = "Mcp-Session-Id is required: send initialize first";
            return rejected(StatusCode::BAD_REQUEST, Some(id), wire::INVALID_REQUEST, message, None);
        };
        match session_of(&state, &caller, session_id) {
            Some(opened) if version.is_empty() || opened.version == version => session = Some(opened),
            _ => return rejected(StatusCode::NOT_FOUND, Some(id), wire::INVALID_REQUEST, "Session not found", None),
        }
    }
    let version = match (&session, version.is_empty()) {
        (Some(session), true) => session.version.clone(),
        _ => version,
    };
    let inbound = Inbound { caller, version, session, accept };

    match method.as_str() {
        "initialize" => initialize(&gateway, mcp, &state, inbound, headers, id).await,
        "server/discover" => accept.answer(&wire::result(id, discover())),
        "ping" => accept.answer(&wire::result(id, json!({}))),
        "tools/call" => {
            let request = Request::from_parts(parts, Body::empty());
            let name = value.pointer("/params/name").and_then(Value::as_str).unwrap_or("");
            match rest::is_tool(&gateway, name) {
                true => rest::handle(gateway.clone(), inbound, id, value, request).await,
                false => call::handle(gateway.clone(), inbound, id, value, request).await,
            }
        }
        _ => {
            let access = match Access::of(&gateway, mcp, &inbound.caller, headers) {
                Ok(access) => access,
                Err(e) => return accept.answer(&call::refusal_message(Some(id), &e)),
            };
            let answer = federation::other(&gateway, &state, &access, &inbound, &method, id, &value).await;
            accept.answer(&answer)
        }
    }
}

/// The methods a stateless (2026-07-28) caller is served; any other, those the
/// revision removed (`initialize`, `ping`, `logging/setLevel`, `resources/subscribe`,
/// ...) included, is not found.
const STATELESS_METHODS: [&str; 8] = [
    "server/discover",
    "tools/list",
    "tools/call",
    "resources/list",
    "resources/templates/list",
    "resources/read",
    "prompts/list",
    "prompts/get",
];

const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
const META_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";

/// A stateless request carries its protocol version and the client's capabilities in
/// `params._meta` (400, -32602 otherwise; a version other than its header's is a
/// header mismatch, -32020), and names a method the revision has (404, -32601).
fn stateless_refusal(version: &str, method: &str, message: &Value, id: &Value) -> Option<Response> {
    let meta = message.pointer("/params/_meta").and_then(Value::as_object);
    let said = meta.and_then(|m| m.get(META_VERSION)).and_then(Value::as_str);
    let capabilities = meta.and_then(|m| m.get(META_CAPABILITIES)).filter(|c| c.is_object());
    let invalid =
        |message: &str| rejected(StatusCode::BAD_REQUEST, Some(id.clone()), wire::INVALID_PARAMS, message, None);
    let Some(said) = said else {
        return Some(invalid(&format!("params._meta must carry {META_VERSION} at {version}")));
    };
    if capabilities.is_none() {
        return Some(invalid(&format!("params._meta must carry {META_CAPABILITIES} at {version}")));
    }
    if said != version {
        let why = format!("{META_VERSION} is {said} but MCP-Protocol-Version is {version}");
        return Some(rejected(StatusCode::BAD_REQUEST, Some(id.clone()), wire::HEADER_MISMATCH, &why, None));
    }
    if !STATELESS_METHODS.contains(&method) {
        let why = format!("Method not found: {method} (not part of {version})");
        return Some(rejected(StatusCode::NOT_FOUND, Some(id.clone()), wire::METHOD_NOT_FOUND, &why, None));
    }
    None
}

/// The version `initialize` answers when the client asked for one the gateway does
/// not speak (2024-11-05, 2025-03-26, …): the latest revision with sessions, which is
/// what `initialize` opens. Not an error: the MCP lifecycle has the server answer
/// with a version it supports, and the client disconnect if it cannot speak it.
const OFFERED: &str = "2025-11-25";

/// A version the gateway does not speak, in `MCP-Protocol-Version` (or none at all)
/// on any message but `initialize`: 400, the error listing those it does. An
/// `initialize` is never refused for its version: it is answered in [`OFFERED`].
fn unsupported(accept: Accept, id: Value, asked: &str) -> Response {
    let data = json!({"supported": VERSIONS, "requested": asked});
    let message = format!("Unsupported protocol version {asked}: supported are {}", VERSIONS.join(", "));
    let code = wire::UNSUPPORTED_PROTOCOL_VERSION;
    let mut response = accept.answer(&wire::error(Some(id), code, &message, Some(data)));
    *response.status_mut() = StatusCode::BAD_REQUEST;
    response
}

/// What the gateway offers: tools, resources and prompts (no subscriptions, no
/// change notifications: its lists are each caller's union, read when asked).
fn capabilities() -> Value {
    json!({"tools": {}, "resources": {}, "prompts": {}})
}

fn server_info() -> Value {
    json!({"name": "flexway", "version": env!("CARGO_PKG_VERSION")})
}

/// `server/discover` (2026-07-28).
fn discover() -> Value {
    json!({
        "resultType": "complete",
        "supportedVersions": VERSIONS,
        "capabilities": capabilities(),
        "ttlMs": 0,
        "cacheScope": "private",
        "_meta": {"io.modelcontextprotocol/serverInfo": server_info()},
    })
}

/// `initialize`: an upstream session at each server the caller may use (in parallel;
/// a server that fails is left out, logged and counted), sealed with the caller into
/// the session id.
async fn initialize(
    gateway: &Arc<Gateway>,
    mcp: &Mcp,
    state: &McpState,
    inbound: Inbound,
    headers: &HeaderMap,
    id: Value,
) -> Response {
    let Inbound { caller, version, accept, .. } = inbound;
    let access = match Access::of(gateway, mcp, &caller, headers) {
        Ok(access) => access,
        Err(e) => return accept.answer(&call::refusal_message(Some(id), &e)),
    };
    let servers = access.servers();
    let asked = version.as_str();
    let opened = futures_util::future::join_all(servers.iter().map(|server| async move {
        let server_at = federation::target(mcp, state, server, asked)?;
        match state.client.initialize(&server_at.target()).await {
            Ok(session) => Some((server.to_string(), session)),
            Err(e) => {
                tracing::warn!(server, "mcp: initialize failed, the server is left out of the session: {e:?}");
                gateway.metrics.mcp_server_down(server);
                None
            }
        }
    }))
    .await;
    // A server that gave no session id is sealed with an empty one: it is in the
    // session, and needs none (never initialized again for it).
    let upstream =
        opened.into_iter().flatten().map(|(server, session)| (server, session.unwrap_or_default())).collect();
    let session = Session {
        tenant: caller.tenant.to_string(),
        agent: caller.agent.as_ref().map(ToString::to_string),
        version: version.clone(),
        upstream,
        issued_at: crate::budget::period::unix_now(),
    };
    let result = json!({
        "protocolVersion": version,
        "capabilities": capabilities(),
        "serverInfo": server_info(),
    });
    let mut response = accept.answer(&wire::result(id, result));
    if let Ok(value) = HeaderValue::from_str(&state.key.seal(&session)) {
        response.headers_mut().insert(SESSION_HEADER, value);
    }
    response
}

/// The client's `notifications/cancelled` for a tool call in flight in its session:
/// forwarded to the server the call went to, in the session's upstream session there,
/// best effort (in the background; the client has its 202 at once). One for a call
/// this process does not have in flight (ended, unknown, sent through another
/// process, or a stateless caller's) is dropped, as the protocol allows.
fn cancelled(gateway: &Arc<Gateway>, state: &McpState, caller: &Caller, headers: &HeaderMap, asked: Option<&Value>) {
    let Some(session_id) = headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok()) else { return };
    let Some(request) = asked.and_then(|p| p.get("requestId")) else { return };
    if session_of(state, caller, session_id).is_none() {
        return;
    }
    let Some(call) = state.call_in_flight(session_id, request) else { return };
    let session = call.carried.as_deref().map(|carried| state.session_in_use(&call.server, carried));
    // The client's words, no more: the request id and its reason.
    let mut params = json!({"requestId": request});
    if let Some(reason) = asked.and_then(|p| p.get("reason")).filter(|r| r.is_string()) {
        params["reason"] = reason.clone();
    }
    let message = json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": params});
    let gateway = gateway.clone();
    tokio::spawn(async move {
        let (Some(mcp), Some(state)) = (gateway.config.mcp.as_ref(), gateway.mcp.as_ref()) else { return };
        if let Some(server_at) = federation::target(mcp, state, &call.server, &call.version) {
            let target = server_at.target();
            let _ = state.client.send(&target, session.as_deref(), &message).await;
        }
    });
}

/// The session `id` seals, if it is `caller`'s, not expired and not ended here.
fn session_of(state: &McpState, caller: &Caller, id: &str) -> Option<Session> {
    state.open(id, crate::budget::period::unix_now()).filter(|s| {
        s.tenant == caller.tenant.as_str() && s.agent.as_deref() == caller.agent.as_ref().map(|a| a.as_str())
    })
}

/// `GET /mcp`: the server-to-client stream, which the gateway does not offer (the
/// protocol allows 405).
async fn stream(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    if gateway.config.mcp.is_none() {
        return not_configured(request.method(), request.uri().path());
    }
    let mut response = StatusCode::METHOD_NOT_ALLOWED.into_response();
    response.headers_mut().insert(header::ALLOW, HeaderValue::from_static("POST, DELETE"));
    response
}

/// `DELETE /mcp`: the session ends; its upstream sessions are ended too, best effort.
async fn end_session(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let (Some(mcp), Some(state)) = (gateway.config.mcp.as_ref(), gateway.mcp.clone()) else {
        return not_configured(request.method(), request.uri().path());
    };
    let caller = match identify(&gateway, mcp, request.headers()).await {
        Ok(caller) => caller,
        Err(response) => return response,
    };
    let Some(id) = request.headers().get(SESSION_HEADER).and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let Some(session) = session_of(&state, &caller, id) else { return StatusCode::NOT_FOUND.into_response() };
    // 404 from now on, here; another process finds it out later (the module's docs).
    state.revoke(id, &session, crate::budget::period::unix_now());
    let ends = session.upstream.iter().filter(|(_, carried)| !carried.is_empty()).filter_map(|(server, carried)| {
        let server_at = federation::target(mcp, &state, server, &session.version)?;
        let in_use = state.session_in_use(server, carried);
        let state = &state;
        Some(async move { state.client.end(&server_at.target(), &in_use).await })
    });
    futures_util::future::join_all(ends).await;
    StatusCode::NO_CONTENT.into_response()
}
