//! `/mcp` against a loopback MCP server written here: a few tools in JSON and SSE, a
//! session it can forget, and every `Authorization` it was sent kept.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Request, StatusCode};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::audit::sinks::MemoryAuditSink;
use crate::audit::{AuditRecord, McpStatus};
use crate::config::{Auth, Mcp, McpNarrowing, McpPrice, McpServer, SecretRef, ToolGlobs};
use crate::gateway::Gateway;
use crate::money::MicroEur;

const TOKEN: &str = "upstream-secret";

/// What the fake server saw.
#[derive(Default)]
struct Seen {
    authorizations: Vec<String>,
    calls: Vec<String>,
    /// The sessions it knows (it forgets them all when told to).
    sessions: Vec<String>,
    initialized: usize,
}

type Shared = Arc<Mutex<Seen>>;

async fn fake(State(seen): State<Shared>, headers: HeaderMap, body: String) -> Response {
    let message: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let auth = headers.get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let session = headers.get("mcp-session-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut seen = seen.lock().unwrap();
    seen.authorizations.push(auth);
    let method = message["method"].as_str().unwrap_or("").to_owned();
    let id = message["id"].clone();
    if let Some(session) = &session
        && !seen.sessions.contains(session)
    {
        return StatusCode::NOT_FOUND.into_response();
    }
    let result = match method.as_str() {
        "initialize" => {
            seen.initialized += 1;
            let session = format!("up-{}", seen.initialized);
            seen.sessions.push(session.clone());
            let body = json!({"jsonrpc": "2.0", "id": id, "result": {
                "protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                "serverInfo": {"name": "fake", "version": "1"}}});
            return ([("mcp-session-id", session)], axum::Json(body)).into_response();
        }
        "notifications/initialized" => return StatusCode::ACCEPTED.into_response(),
        "notifications/cancelled" => {
            seen.calls.push(format!("cancelled {}", message["params"]["requestId"]));
            return StatusCode::ACCEPTED.into_response();
        }
        "prompts/list" => json!({"prompts": [{"name": "greet", "description": "Greets."}]}),
        "prompts/get" if message["params"]["name"] == "greet" => {
            json!({"messages": [{"role": "user", "content": {"type": "text", "text": "hello"}}]})
        }
        "resources/list" => json!({"resources": [{"uri": "file:///a.txt", "name": "a"}]}),
        "resources/read" => json!({"contents": [{"uri": message["params"]["uri"], "text": "A"}]}),
        "tools/list" => json!({"tools": [
            {"name": "search", "description": "Searches.", "inputSchema": {"type": "object"}},
            {"name": "admin_delete", "inputSchema": {"type": "object"}},
            {"name": "flaky", "inputSchema": {"type": "object"}},
            {"name": "broken", "inputSchema": {"type": "object"}},
            {"name": "streamed", "inputSchema": {"type": "object"}},
            {"name": "hanging", "inputSchema": {"type": "object"}},
        ]}),
        "tools/call" => {
            let tool = message["params"]["name"].as_str().unwrap_or("").to_owned();
            seen.calls.push(tool.clone());
            match tool.as_str() {
                "search" => json!({"content": [{"type": "text", "text": "found"}]}),
                "flaky" => json!({"content": [{"type": "text", "text": "no"}], "isError": true}),
                "broken" => {
                    let error = json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32603, "message": "boom"}});
                    return axum::Json(error).into_response();
                }
                "hanging" => {
                    let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                        "params": {"progressToken": 1, "progress": 1}});
                    let first = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(format!(
                        "event: message\ndata: {progress}\n\n"
                    ))]);
                    let body =
                        Body::from_stream(futures_util::StreamExt::chain(first, futures_util::stream::pending()));
                    return ([("content-type", "text/event-stream")], body).into_response();
                }
                "streamed" => {
                    let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                        "params": {"progressToken": 1, "progress": 1}});
                    let answer = json!({"jsonrpc": "2.0", "id": id,
                        "result": {"content": [{"type": "text", "text": "streamed"}]}});
                    let body = format!("event: message\ndata: {progress}\n\nevent: message\ndata: {answer}\n\n");
                    return ([("content-type", "text/event-stream")], body).into_response();
                }
                _ => {
                    let error =
                        json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32602, "message": "no such tool"}});
                    return axum::Json(error).into_response();
                }
            }
        }
        _ => {
            let error = json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "nope"}});
            return axum::Json(error).into_response();
        }
    };
    axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
}

/// A fake MCP server on loopback (and an identity provider's key set, `/jwks`); its
/// address and what it saw.
async fn server(jwks: Value) -> (String, Shared) {
    let seen = Shared::default();
    let keys = move || std::future::ready(axum::Json(jwks.clone()));
    let app = axum::Router::new()
        .route("/mcp", axum::routing::post(fake))
        .route("/jwks", axum::routing::get(keys))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{address}/mcp"), seen)
}

fn mcp_server(url: &str) -> McpServer {
    McpServer {
        url: url.to_owned(),
        auth: Auth::Bearer { secret: SecretRef::Env("MCP_TOKEN".into()) },
        external: true,
        jurisdiction: None,
        timeout: Duration::from_secs(5),
        price: McpPrice { per_call: MicroEur(1_000), tools: BTreeMap::from([("flaky".into(), MicroEur(2_500))]) },
        tools: ToolGlobs { allow: None, deny: vec!["admin_*".into()] },
    }
}

/// A gateway whose `/mcp` federates `search` (the fake server) and `down` (nothing
/// listening), key `k` for tenant `acme`.
async fn gateway() -> (Arc<Gateway>, Arc<MemoryAuditSink>, Shared) {
    build(json!({"keys": []}), false, "").await
}

/// The same, accepting JWTs of `https://idp.example` signed by a key of `jwks` when
/// `oauth`, its tenant declared with `tenant` too (`budgets: …`).
async fn build(jwks: Value, oauth: bool, tenant: &str) -> (Arc<Gateway>, Arc<MemoryAuditSink>, Shared) {
    build_with(jwks, oauth, tenant, |_| {}).await
}

/// The same, the fake server `search` configured as `tweak` leaves it.
async fn build_with(
    jwks: Value,
    oauth: bool,
    tenant: &str,
    tweak: impl FnOnce(&mut McpServer),
) -> (Arc<Gateway>, Arc<MemoryAuditSink>, Shared) {
    use sha2::Digest;
    let (url, seen) = server(jwks).await;
    let yaml = format!(
        "version: 1\ntenants:\n  acme:\n    keys: [{{sha256: {}}}]\n{tenant}ai:\n  default_backend: a\n  \
         backends:\n    a: {{url: 'http://127.0.0.1:9/v1'}}\n",
        hex::encode(sha2::Sha256::digest(b"k"))
    );
    let env = std::collections::HashMap::from([("MCP_TOKEN".to_owned(), TOKEN.to_owned())]);
    let mut loaded = crate::config::load_str(&yaml, &env).unwrap();
    let mut search = mcp_server(&url);
    tweak(&mut search);
    let servers =
        BTreeMap::from([("search".to_owned(), search), ("down".to_owned(), mcp_server("http://127.0.0.1:9/mcp"))]);
    let oauth = oauth.then(|| crate::config::McpOauth {
        issuer: "https://idp.example".into(),
        audience: "https://gw.example/mcp".into(),
        jwks_url: url.replace("/mcp", "/jwks"),
        tenant_claim: "tenant".into(),
        agent_claim: Some("agent".into()),
    });
    loaded.config.mcp = Some(Mcp { servers, session_key: None, oauth, expose_rest: false });
    if let Some(tenant) = loaded.config.tenants.values_mut().next() {
        tenant.mcp = McpNarrowing::default();
    }
    let audit = Arc::new(MemoryAuditSink::new());
    let adapters = crate::gateway::Adapters {
        budgets: Arc::new(crate::budget::MemoryBudgetStore::new()),
        audit: audit.clone(),
        export: crate::telemetry::Export::Batched,
        cache: None,
    };
    let secrets = Arc::new(crate::secret::LocalSecrets { env });
    (Arc::new(Gateway::new(loaded.config, secrets, adapters).await.unwrap()), audit, seen)
}

/// `POST /mcp` with `message` and `headers`; the status, headers and body.
async fn post(gateway: &Arc<Gateway>, headers: &[(&str, &str)], message: Value) -> (StatusCode, HeaderMap, Value) {
    post_as(gateway, "k", headers, message).await
}

async fn post_as(
    gateway: &Arc<Gateway>,
    bearer: &str,
    headers: &[(&str, &str)],
    message: Value,
) -> (StatusCode, HeaderMap, Value) {
    let mut request = Request::post("/mcp")
        .header("authorization", format!("Bearer {bearer}"))
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

/// A session: `initialize` answered, its id.
async fn initialize(gateway: &Arc<Gateway>) -> String {
    let message = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
    let (status, headers, body) = post(gateway, &[], message).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["result"]["protocolVersion"], "2025-11-25");
    headers.get("mcp-session-id").unwrap().to_str().unwrap().to_owned()
}

async fn in_session(gateway: &Arc<Gateway>, session: &str, id: u64, method: &str, params: Value) -> Value {
    in_session_with(gateway, session, &[], id, method, params).await
}

/// [`in_session`], sending `extra` headers too.
async fn in_session_with(
    gateway: &Arc<Gateway>,
    session: &str,
    extra: &[(&str, &str)],
    id: u64,
    method: &str,
    params: Value,
) -> Value {
    let mut headers = vec![("mcp-session-id", session), ("mcp-protocol-version", "2025-11-25")];
    headers.extend_from_slice(extra);
    let (status, _, body) =
        post(gateway, &headers, json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

async fn records(audit: &MemoryAuditSink, n: usize) -> Vec<AuditRecord> {
    for _ in 0..200 {
        if audit.records().len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    audit.records()
}

#[tokio::test]
async fn tools_are_listed_as_server_tool_without_the_denied_and_the_down_server_left_out() {
    let (gateway, _, _) = gateway().await;
    let session = initialize(&gateway).await;
    let body = in_session(&gateway, &session, 1, "tools/list", json!({})).await;
    let names: Vec<&str> =
        body["result"]["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["search__search", "search__flaky", "search__broken", "search__streamed", "search__hanging"]);
    assert_eq!(body["result"]["tools"][0]["description"], "Searches.", "the server's description kept");
    let metrics = gateway.metrics.render_prometheus();
    assert!(metrics.contains("flexway_mcp_servers_down_total{server=\"down\"}"), "{metrics}");
}

#[tokio::test]
async fn a_denied_tool_is_answered_exactly_as_an_unknown_one_and_never_sent() {
    let (gateway, _, seen) = gateway().await;
    let session = initialize(&gateway).await;
    let denied = in_session(&gateway, &session, 7, "tools/call", json!({"name": "search__admin_delete"})).await;
    let unknown = in_session(&gateway, &session, 7, "tools/call", json!({"name": "search__admin_nothing"})).await;
    assert_eq!(denied["error"]["code"], -32602);
    assert_eq!(denied["error"]["message"], "Unknown tool: search__admin_delete");
    let strip = |mut v: Value| {
        v["error"]["message"] = Value::Null;
        v
    };
    assert_eq!(strip(denied), strip(unknown), "the same answer but the name");
    assert!(seen.lock().unwrap().calls.is_empty(), "nothing was sent upstream");
}

#[tokio::test]
async fn a_tool_call_is_charged_and_recorded_once_and_refunded_on_an_error() {
    let (gateway, audit, _) = gateway().await;
    let session = initialize(&gateway).await;
    let ok = in_session(
        &gateway,
        &session,
        2,
        "tools/call",
        json!({"name": "search__search", "arguments": {"q": "secret words"}}),
    )
    .await;
    assert_eq!(ok["result"]["content"][0]["text"], "found");
    assert_eq!(ok["id"], 2);
    let flaky = in_session(&gateway, &session, 3, "tools/call", json!({"name": "search__flaky"})).await;
    assert_eq!(flaky["result"]["isError"], true);
    let broken = in_session(&gateway, &session, 4, "tools/call", json!({"name": "search__broken"})).await;
    assert_eq!(broken["error"]["message"], "boom");
    // A client that takes SSE gets the server's stream event by event; one that takes
    // JSON only, the answer.
    let call = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": "search__streamed"}});
    let request = Request::post("/mcp")
        .header("authorization", "Bearer k")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-session-id", &session)
        .header("mcp-protocol-version", "2025-11-25")
        .body(Body::from(call.to_string()))
        .unwrap();
    let response = crate::http::app(gateway.clone()).oneshot(request).await.unwrap();
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let text =
        String::from_utf8(axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap().to_vec()).unwrap();
    let progress = text.find("notifications/progress").unwrap();
    let result = text.find("\"text\":\"streamed\"").unwrap();
    assert!(progress < result, "{text}");
    let headers =
        [("mcp-session-id", session.as_str()), ("mcp-protocol-version", "2025-11-25"), ("accept", "application/json")];
    let mut call = call;
    call["id"] = json!(6);
    let request = Request::post("/mcp")
        .header("authorization", "Bearer k")
        .header(headers[2].0, headers[2].1)
        .header(headers[0].0, headers[0].1)
        .header(headers[1].0, headers[1].1)
        .body(Body::from(call.to_string()))
        .unwrap();
    let response = crate::http::app(gateway.clone()).oneshot(request).await.unwrap();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    let streamed: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        (streamed["id"].clone(), streamed["result"]["content"][0]["text"].clone()),
        (json!(6), json!("streamed"))
    );

    let records = records(&audit, 5).await;
    assert_eq!(records.len(), 5, "one record a call, none for initialize or lists");
    let summary: Vec<_> = records
        .iter()
        .map(|r| {
            (r.tool.as_deref().unwrap(), r.mcp_status.unwrap(), r.cost_micro_eur, r.mcp_server.as_deref().unwrap())
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("search", McpStatus::Ok, 1_000, "search"),
            ("flaky", McpStatus::ToolError, 2_500, "search"),
            ("broken", McpStatus::Error, 0, "search"),
            ("streamed", McpStatus::Ok, 1_000, "search"),
            ("streamed", McpStatus::Ok, 1_000, "search"),
        ]
    );
    assert!(records.iter().all(|r| r.operation == crate::call::Operation::Mcp));
    let line = serde_json::to_string(&records[0]).unwrap();
    assert!(!line.contains("secret words") && !line.contains("found"), "no argument or result in the audit: {line}");
    // The ledger holds what the records say: 4.5 thousandths of a euro, the error refunded.
    let metrics = gateway.metrics.render_prometheus();
    assert!(
        metrics.contains("flexway_mcp_calls_total{tenant=\"acme\",server=\"search\",outcome=\"error\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_callers_credential_never_reaches_the_server_its_own_does() {
    let (gateway, _, seen) = gateway().await;
    let session = initialize(&gateway).await;
    in_session(&gateway, &session, 1, "tools/list", json!({})).await;
    in_session(&gateway, &session, 2, "tools/call", json!({"name": "search__search"})).await;
    let seen = seen.lock().unwrap();
    assert!(!seen.authorizations.is_empty());
    for auth in &seen.authorizations {
        assert_eq!(auth, &format!("Bearer {TOKEN}"), "the server's own credential, never the caller's");
    }
}

#[tokio::test]
async fn a_tampered_or_missing_session_is_refused_and_a_forgotten_one_reopened() {
    let (gateway, _, seen) = gateway().await;
    let session = initialize(&gateway).await;
    let mut tampered = session.clone().into_bytes();
    let last = tampered.len() - 1;
    tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(tampered).unwrap();
    let message = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
    let headers = [("mcp-session-id", tampered.as_str()), ("mcp-protocol-version", "2025-11-25")];
    let (status, _, _) = post(&gateway, &headers, message.clone()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, _) = post(&gateway, &[("mcp-protocol-version", "2025-11-25")], message).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // The server forgets its sessions: the next call opens one again, once.
    seen.lock().unwrap().sessions.clear();
    let ok = in_session(&gateway, &session, 2, "tools/call", json!({"name": "search__search"})).await;
    assert_eq!(ok["result"]["content"][0]["text"], "found");
    in_session(&gateway, &session, 3, "tools/call", json!({"name": "search__search"})).await;
    assert_eq!(seen.lock().unwrap().initialized, 2, "initialized again once, its new session kept");
}

#[tokio::test]
async fn the_stateless_revision_checks_its_headers_against_the_body() {
    let (gateway, _, _) = gateway().await;
    let message = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
    let headers = [("mcp-protocol-version", "2026-07-28"), ("mcp-method", "tools/call")];
    let (status, _, body) = post(&gateway, &headers, message.clone()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["code"], -32020);
    let headers = [("mcp-protocol-version", "2026-07-28"), ("mcp-method", "server/discover")];
    let discover = json!({"jsonrpc": "2.0", "id": 2, "method": "server/discover", "params": {"_meta": meta()}});
    let (status, _, body) = post(&gateway, &headers, discover).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["result"]["supportedVersions"].as_array().unwrap().contains(&json!("2025-06-18")));
    // The version its `_meta` says is not its header's.
    let mut other = meta();
    other["io.modelcontextprotocol/protocolVersion"] = json!("2025-11-25");
    let discover = json!({"jsonrpc": "2.0", "id": 3, "method": "server/discover", "params": {"_meta": other}});
    let (status, _, body) = post(&gateway, &headers, discover).await;
    assert_eq!(
        (status, body["error"]["code"].clone(), body["id"].clone()),
        (StatusCode::BAD_REQUEST, json!(-32020), json!(3))
    );
}

/// The `_meta` a stateless (2026-07-28) request must carry.
fn meta() -> Value {
    json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"}})
}

#[tokio::test]
async fn a_stateless_request_without_its_version_or_capabilities_in_meta_is_invalid() {
    let (gateway, _, _) = gateway().await;
    let headers = [("mcp-protocol-version", "2026-07-28"), ("mcp-method", "server/discover")];
    let without_version = json!({"io.modelcontextprotocol/clientCapabilities": {}});
    let without_capabilities = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28"});
    for (id, params) in [
        (1, None),
        (2, Some(json!({}))),
        (3, Some(json!({"_meta": without_version}))),
        (4, Some(json!({"_meta": without_capabilities}))),
    ] {
        let mut message = json!({"jsonrpc": "2.0", "id": id, "method": "server/discover"});
        if let Some(params) = params {
            message["params"] = params;
        }
        let (status, _, body) = post(&gateway, &headers, message).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!((body["error"]["code"].clone(), body["id"].clone()), (json!(-32602), json!(id)));
    }
    // clientInfo is not required.
    let mut without_info = meta();
    without_info.as_object_mut().unwrap().remove("io.modelcontextprotocol/clientInfo");
    let message = json!({"jsonrpc": "2.0", "id": 5, "method": "server/discover", "params": {"_meta": without_info}});
    let (status, _, body) = post(&gateway, &headers, message).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["result"]["resultType"], "complete");
}

#[tokio::test]
async fn methods_the_stateless_revision_lacks_are_not_found_and_sessions_keep_them() {
    let (gateway, _, _) = gateway().await;
    let removed =
        ["initialize", "ping", "logging/setLevel", "resources/subscribe", "resources/unsubscribe", "unknown/method"];
    for (id, method) in removed.into_iter().enumerate() {
        let headers = [("mcp-protocol-version", "2026-07-28"), ("mcp-method", method)];
        let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": {"_meta": meta()}});
        let (status, _, body) = post(&gateway, &headers, message).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{method}: {body}");
        assert_eq!((body["error"]["code"].clone(), body["id"].clone()), (json!(-32601), json!(id)), "{method}");
    }
    // In a session (2025-11-25) `ping` is answered, an unknown method -32601 on HTTP 200.
    let session = initialize(&gateway).await;
    assert_eq!(in_session(&gateway, &session, 1, "ping", json!({})).await["result"], json!({}));
    let unknown = in_session(&gateway, &session, 2, "unknown/method", json!({})).await;
    assert_eq!(unknown["error"]["code"], -32601);
}

#[tokio::test]
async fn batches_unsupported_versions_and_strangers_are_refused() {
    let (gateway, _, _) = gateway().await;
    let (status, _, body) = post(&gateway, &[], json!([{"jsonrpc": "2.0", "id": 1, "method": "ping"}])).await;
    assert_eq!((status, body["error"]["code"].clone()), (StatusCode::BAD_REQUEST, json!(-32600)));
    let message = json!({"jsonrpc": "2.0", "id": 1, "method": "ping"});
    let (status, _, body) = post(&gateway, &[("mcp-protocol-version", "2024-11-05")], message).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["data"]["supported"], json!(crate::mcp::wire::VERSIONS));
    let request = Request::post("/mcp").header("authorization", "Bearer nope").body(Body::from("{}")).unwrap();
    let response = crate::http::app(gateway.clone()).oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let challenge = response.headers().get("www-authenticate").unwrap().to_str().unwrap();
    assert_eq!(challenge, "Bearer resource_metadata=\"http://localhost/.well-known/oauth-protected-resource/mcp\"");
    let request = Request::get("/.well-known/oauth-protected-resource/mcp")
        .header("host", "gw.example")
        .body(Body::empty())
        .unwrap();
    let response = crate::http::app(gateway.clone()).oneshot(request).await.unwrap();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    let document: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(document["resource"], "http://gw.example/mcp");
}

#[tokio::test]
async fn without_mcp_configured_the_door_is_not_there() {
    let (gateway, _) = crate::http::testing::gateway().await;
    let request = Request::post("/mcp").header("authorization", "Bearer k").body(Body::from("{}")).unwrap();
    let response = crate::http::app(gateway).oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_jwt_of_the_issuer_for_a_declared_tenant_is_a_caller() {
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng).unwrap();
    let point = key.public_key().as_ref();
    let b64 = |bytes: &[u8]| URL_SAFE_NO_PAD.encode(bytes);
    let jwk = json!({"kty": "EC", "kid": "k1", "crv": "P-256", "x": b64(&point[1..33]), "y": b64(&point[33..])});
    let (gateway, audit, seen) = build(json!({"keys": [jwk]}), true, "").await;
    let token = |tenant: &str| {
        let now = crate::budget::period::unix_now();
        let header = json!({"alg": "ES256", "typ": "JWT", "kid": "k1"});
        let claims = json!({"iss": "https://idp.example", "aud": "https://gw.example/mcp", "sub": "user-7",
            "tenant": tenant, "exp": now + 300, "nbf": now - 10});
        let signed = format!("{}.{}", b64(header.to_string().as_bytes()), b64(claims.to_string().as_bytes()));
        let signature = key.sign(&rng, signed.as_bytes()).unwrap();
        format!("{signed}.{}", b64(signature.as_ref()))
    };
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "search__search", "_meta": meta()}});
    let headers =
        [("mcp-protocol-version", "2026-07-28"), ("mcp-method", "tools/call"), ("mcp-name", "search__search")];
    let (status, _, body) = post_as(&gateway, &token("acme"), &headers, call.clone()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["result"]["content"][0]["text"], "found");
    let records = records(&audit, 1).await;
    assert_eq!(records[0].tenant, "acme");
    assert!(seen.lock().unwrap().authorizations.iter().all(|a| a == &format!("Bearer {TOKEN}")), "never the JWT");

    let (status, headers_back, _) = post_as(&gateway, &token("globex"), &headers, call).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "a tenant the configuration does not declare");
    assert!(headers_back.contains_key("www-authenticate"));

    let request = Request::get("/.well-known/oauth-protected-resource/mcp").body(Body::empty()).unwrap();
    let response = crate::http::app(gateway.clone()).oneshot(request).await.unwrap();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    let document: Value = serde_json::from_slice(&bytes).unwrap();
    let expected = json!({"resource": "https://gw.example/mcp", "authorization_servers": ["https://idp.example"],
        "bearer_methods_supported": ["header"]});
    assert_eq!(document, expected);
}

#[tokio::test]
async fn a_call_past_the_budget_is_refused_before_it_is_sent_and_an_error_costs_nothing() {
    // 1.5 thousandths of a euro: one search (1 thousandth) fits, two do not.
    let (gateway, audit, seen) = build(json!({"keys": []}), false, "    budgets: {eur_per_month: 0.0015}\n").await;
    let session = initialize(&gateway).await;
    let broken = in_session(&gateway, &session, 1, "tools/call", json!({"name": "search__broken"})).await;
    assert_eq!(broken["error"]["message"], "boom");
    let ok = in_session(&gateway, &session, 2, "tools/call", json!({"name": "search__search"})).await;
    assert_eq!(ok["result"]["content"][0]["text"], "found", "the error's reservation was refunded: {ok}");
    let refused = in_session(&gateway, &session, 3, "tools/call", json!({"name": "search__search"})).await;
    assert_eq!(refused["error"]["code"], -32000, "{refused}");
    assert_eq!(refused["error"]["data"]["flexway_code"], "budget_exceeded");
    assert!(refused["error"]["data"].get("retry_after_s").is_some());
    assert_eq!(seen.lock().unwrap().calls, ["broken", "search"], "the refused call was never sent");
    let records = records(&audit, 3).await;
    let last = &records[2];
    assert_eq!(
        (last.mcp_status, last.error_code, last.cost_micro_eur),
        (Some(McpStatus::Error), Some(crate::call::ErrorCode::BudgetExceeded), 0)
    );
}

#[tokio::test]
async fn a_tool_call_past_requests_per_minute_is_refused_until_the_minutes_end() {
    past_requests_per_minute(1_000).await;
}

/// A tool of no price counts in the window all the same: settled at nothing, never
/// refunded, once it answered.
#[tokio::test]
async fn a_free_tool_counts_in_requests_per_minute() {
    past_requests_per_minute(0).await;
}

/// A tool of no price is not refused by a budget its tenant already passed (a
/// realtime response may pass a cap): it adds nothing to it. It still counts in the
/// tenant's window.
#[tokio::test]
async fn a_free_tool_is_not_refused_by_a_cap_already_passed() {
    use crate::budget::{Line, ReserveOutcome, ReserveRequest, Unit, period::unix_now};
    let tenant = "    budgets: {eur_per_month: 0.001}\n    limits: {requests_per_minute: 100}\n";
    let free = |s: &mut McpServer| s.price.per_call = MicroEur(0);
    let (gateway, _, seen) = build_with(json!({"keys": []}), false, tenant, free).await;
    let now = unix_now();
    let acme = crate::config::TenantId::new("acme");
    let month = crate::budget::plan::budgets_for(&gateway.config, &acme, None, now);
    let eur = month.iter().find(|b| b.unit == Unit::MicroEur).unwrap();
    // 5,000 µ€ counted against a cap of 1,000: past it.
    let lines = vec![Line { key: eur.key.clone(), amount: 5_000, limit: None }];
    let past = ReserveRequest { request_id: "past".into(), lines, expires_at: now + 600 };
    assert!(matches!(gateway.budgets.reserve(&past).await.unwrap(), ReserveOutcome::Reserved));
    let session = initialize(&gateway).await;
    let ok = in_session(&gateway, &session, 1, "tools/call", json!({"name": "search__search"})).await;
    assert_eq!(ok["result"]["content"][0]["text"], "found", "{ok}");
    assert_eq!(seen.lock().unwrap().calls, ["search"]);
    // Counted in the window of its minute (the minute may have turned since `now`).
    let mut minutes = vec![now / 60 * 60, unix_now() / 60 * 60];
    minutes.dedup();
    let windows: Vec<_> =
        minutes.into_iter().map(|at| crate::budget::CounterKey::window("acme", None, Unit::Requests, at)).collect();
    assert_eq!(gateway.budgets.used(&windows).await.unwrap().iter().sum::<u64>(), 1, "the call counts in its window");
}

async fn past_requests_per_minute(per_call: u64) {
    use crate::budget::period::unix_now;
    // Two tool calls a minute: the third of the same minute is refused, never sent.
    // Calls that straddled a minute are made again on a new gateway.
    let (gateway, audit, seen, refused, before, after) = loop {
        let limited = "    limits: {requests_per_minute: 2}\n";
        let priced = |s: &mut McpServer| s.price.per_call = MicroEur(per_call);
        let (gateway, audit, seen) = build_with(json!({"keys": []}), false, limited, priced).await;
        let session = initialize(&gateway).await;
        let before = unix_now();
        for id in 1..=2 {
            let ok = in_session(&gateway, &session, id, "tools/call", json!({"name": "search__search"})).await;
            assert_eq!(ok["result"]["content"][0]["text"], "found", "{ok}");
        }
        let refused = in_session(&gateway, &session, 3, "tools/call", json!({"name": "search__search"})).await;
        let after = unix_now();
        if before / 60 == after / 60 {
            break (gateway, audit, seen, refused, before, after);
        }
    };
    assert_eq!((refused["id"].clone(), refused["error"]["code"].clone()), (json!(3), json!(-32000)), "{refused}");
    let data = &refused["error"]["data"];
    assert_eq!(data["flexway_code"], "rate_limit_exceeded", "{refused}");
    let retry = data["retry_after_s"].as_u64().unwrap();
    assert!((60 - after % 60..=60 - before % 60).contains(&retry), "retry_after_s {retry}, at {before}..{after}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.contains("tenant acme"), "the refusal names its holder: {message}");
    assert_eq!(seen.lock().unwrap().calls, ["search", "search"], "the refused call was never sent");
    let records = records(&audit, 3).await;
    let last = &records[2];
    assert_eq!(
        (last.status, last.error_code, last.cost_micro_eur),
        (429, Some(crate::call::ErrorCode::RateLimitExceeded), 0)
    );
    let window = crate::budget::CounterKey::window("acme", None, crate::budget::Unit::Requests, before);
    assert_eq!(gateway.budgets.used(&[window]).await.unwrap(), [2], "the window counts the two calls served");
}

/// `request` through the gateway's router: its status and JSON body.
async fn send(gateway: &Arc<Gateway>, request: Request<Body>) -> (StatusCode, Value) {
    let response = crate::http::app(gateway.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_tool_call_with_flexway_run_counts_in_the_run() {
    let (gateway, audit, seen) = build(json!({"keys": []}), false, "    agents:\n      bot: {}\n").await;
    // 4 thousandths of a euro: a search (1) and a flaky call (2.5) fit, a second search not.
    let create = Request::post("/v1/flexway/runs")
        .header("authorization", "Bearer k")
        .header("flexway-agent", "bot")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"budget": {"eur": "0.004"}}"#))
        .unwrap();
    let (status, run) = send(&gateway, create).await;
    assert_eq!(status, StatusCode::CREATED, "{run}");
    let id = run["id"].as_str().unwrap().to_owned();

    let message = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
    let (status, headers, body) = post(&gateway, &[("flexway-agent", "bot")], message).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let session = headers.get("mcp-session-id").unwrap().to_str().unwrap().to_owned();
    let in_run = [("flexway-agent", "bot"), ("flexway-run", id.as_str())];
    let call = |id: u64, tool: &'static str| {
        let (gateway, session) = (&gateway, &session);
        async move { in_session_with(gateway, session, &in_run, id, "tools/call", json!({"name": tool})).await }
    };
    assert_eq!(call(1, "search__broken").await["error"]["message"], "boom", "refunded: no call of the run");
    assert_eq!(call(2, "search__search").await["result"]["content"][0]["text"], "found");
    assert_eq!(call(3, "search__flaky").await["result"]["isError"], true);
    let refused = call(4, "search__search").await;
    assert_eq!(refused["error"]["data"]["flexway_code"], "budget_exceeded", "{refused}");
    assert_eq!(refused["error"]["data"]["retry_after_s"], Value::Null, "a run's budget never resets");
    assert!(refused["error"]["message"].as_str().unwrap().contains(&id), "{refused}");
    assert_eq!(seen.lock().unwrap().calls, ["broken", "search", "flaky"]);

    let get = Request::get(format!("/v1/flexway/runs/{id}"))
        .header("authorization", "Bearer k")
        .header("flexway-agent", "bot")
        .body(Body::empty())
        .unwrap();
    let (status, state) = send(&gateway, get).await;
    assert_eq!(status, StatusCode::OK, "{state}");
    assert_eq!(state["calls"], 2, "the two charged tool calls: {state}");
    let micro = |eur: &Value| (eur.as_f64().unwrap() * 1e6).round() as u64;
    assert_eq!((micro(&state["spent"]["eur"]), micro(&state["remaining"]["eur"])), (3_500, 500), "{state}");
    assert_eq!(state["spent"]["tokens"], 0);

    let records = records(&audit, 4).await;
    assert!(records.iter().all(|r| r.run.as_deref() == Some(id.as_str())), "every record names the run");
    let report = crate::audit::report::by_run(&records, &crate::audit::report::Filter::default());
    let row = report.local.iter().find(|r| r.run.as_deref() == Some(id.as_str())).unwrap();
    assert_eq!((row.totals.calls, row.totals.cost), (2, MicroEur(3_500)), "the report agrees with GET");
}

#[tokio::test]
async fn a_client_that_leaves_a_streamed_call_cancels_it_upstream_and_is_charged() {
    let (gateway, audit, seen) = gateway().await;
    let session = initialize(&gateway).await;
    let call = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "search__hanging"}});
    let request = Request::post("/mcp")
        .header("authorization", "Bearer k")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-session-id", &session)
        .header("mcp-protocol-version", "2025-11-25")
        .body(Body::from(call.to_string()))
        .unwrap();
    let response = crate::http::app(gateway.clone()).oneshot(request).await.unwrap();
    let mut body = response.into_body();
    let first = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(first.data_ref().unwrap()).contains("notifications/progress"));
    drop(body);
    let records = records(&audit, 1).await;
    // Sent, so charged: the tool may have run (a refund is for a call with no answer).
    let ended = (records[0].status, records[0].cost_micro_eur, records[0].mcp_status);
    assert_eq!(ended, (499, 1_000, Some(McpStatus::Error)));
    for _ in 0..200 {
        if seen.lock().unwrap().calls.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(seen.lock().unwrap().calls, ["hanging", "cancelled 9"]);
}

#[tokio::test]
async fn prompts_and_resources_are_federated_and_an_unknown_tool_is_said_alike() {
    let (gateway, _, seen) = gateway().await;
    let session = initialize(&gateway).await;
    let prompts = in_session(&gateway, &session, 1, "prompts/list", json!({})).await;
    assert_eq!(prompts["result"]["prompts"], json!([{"name": "search__greet", "description": "Greets."}]));
    let greeting = in_session(&gateway, &session, 2, "prompts/get", json!({"name": "search__greet"})).await;
    assert_eq!(
        (greeting["id"].clone(), greeting["result"]["messages"][0]["content"]["text"].clone()),
        (json!(2), json!("hello"))
    );
    let resources = in_session(&gateway, &session, 3, "resources/list", json!({})).await;
    assert_eq!(resources["result"]["resources"], json!([{"uri": "file:///a.txt", "name": "search__a"}]));
    let read = in_session(&gateway, &session, 4, "resources/read", json!({"uri": "file:///a.txt"})).await;
    assert_eq!(read["result"]["contents"][0]["text"], "A");
    let missing = in_session(&gateway, &session, 5, "resources/read", json!({"uri": "file:///b.txt"})).await;
    assert_eq!(missing["error"]["code"], -32002);
    let page = in_session(&gateway, &session, 6, "tools/list", json!({"cursor": "not a cursor"})).await;
    assert_eq!(page["error"]["code"], -32602);
    let ping = in_session(&gateway, &session, 7, "ping", json!({})).await;
    assert_eq!(ping["result"], json!({}));

    // A tool the server does not list: answered as a denied one, never sent.
    let unknown = in_session(&gateway, &session, 8, "tools/call", json!({"name": "search__nothing"})).await;
    assert_eq!(unknown["error"], json!({"code": -32602, "message": "Unknown tool: search__nothing"}));
    let denied = in_session(&gateway, &session, 8, "tools/call", json!({"name": "search__admin_delete"})).await;
    assert_eq!(denied["error"], json!({"code": -32602, "message": "Unknown tool: search__admin_delete"}));
    assert!(seen.lock().unwrap().calls.is_empty());

    // A notification is accepted; a message past 4 MiB is not read.
    let headers = [("mcp-session-id", session.as_str()), ("mcp-protocol-version", "2025-11-25")];
    let (status, _, _) =
        post(&gateway, &headers, json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let large = json!({"jsonrpc": "2.0", "id": 9, "method": "ping", "params": {"pad": "x".repeat(super::MAX_MESSAGE)}});
    let (status, _, body) = post(&gateway, &headers, large).await;
    assert_eq!((status, body["error"]["code"].clone()), (StatusCode::PAYLOAD_TOO_LARGE, json!(-32600)));
}

#[tokio::test]
async fn an_initialize_in_a_version_not_spoken_is_answered_in_one_that_is() {
    let (gateway, _, seen) = gateway().await;
    for asked in ["2024-11-05", "2025-03-26"] {
        let message = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": asked, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
        let (status, headers, body) = post(&gateway, &[], message).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["result"]["protocolVersion"], "2025-11-25", "{asked}");
        assert!(body.get("error").is_none());
        // A session in the version offered, which the client may go on in.
        let session = headers.get("mcp-session-id").unwrap().to_str().unwrap().to_owned();
        let listed = in_session(&gateway, &session, 2, "tools/list", json!({})).await;
        assert!(listed["result"]["tools"].as_array().is_some_and(|t| !t.is_empty()), "{listed}");
    }
    assert_eq!(seen.lock().unwrap().initialized, 2, "the server was initialized in the version offered");
}

/// `DELETE /mcp` with `session`; its status.
async fn delete(gateway: &Arc<Gateway>, session: &str) -> StatusCode {
    let request = Request::delete("/mcp")
        .header("authorization", "Bearer k")
        .header("mcp-session-id", session)
        .header("mcp-protocol-version", "2025-11-25")
        .body(Body::empty())
        .unwrap();
    crate::http::app(gateway.clone()).oneshot(request).await.unwrap().status()
}

fn sealed_session(issued_at: u64) -> crate::mcp::session::Session {
    crate::mcp::session::Session {
        tenant: "acme".into(),
        agent: None,
        version: "2025-11-25".into(),
        upstream: BTreeMap::new(),
        issued_at,
    }
}

#[tokio::test]
async fn a_session_a_day_old_or_ended_is_not_found() {
    use crate::mcp::session::MAX_AGE;
    let (gateway, _, _) = gateway().await;
    let state = gateway.mcp.clone().unwrap();
    let now = crate::budget::period::unix_now();
    let aged = |age: u64| state.key.seal(&sealed_session(now - age));
    let message = json!({"jsonrpc": "2.0", "id": 1, "method": "ping"});
    for (age, expected) in [(MAX_AGE.as_secs() - 60, StatusCode::OK), (MAX_AGE.as_secs(), StatusCode::NOT_FOUND)] {
        let id = aged(age);
        let headers = [("mcp-session-id", id.as_str()), ("mcp-protocol-version", "2025-11-25")];
        let (status, _, _) = post(&gateway, &headers, message.clone()).await;
        assert_eq!(status, expected, "{age} s old");
    }
    assert_eq!(delete(&gateway, &aged(MAX_AGE.as_secs() + 1)).await, StatusCode::NOT_FOUND);

    // Ended: 404 at once, here; another session goes on.
    let (ended, kept) = (initialize(&gateway).await, initialize(&gateway).await);
    in_session(&gateway, &ended, 2, "tools/list", json!({})).await;
    assert_eq!(delete(&gateway, &ended).await, StatusCode::NO_CONTENT);
    let headers = [("mcp-session-id", ended.as_str()), ("mcp-protocol-version", "2025-11-25")];
    let (status, _, _) = post(&gateway, &headers, message.clone()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(delete(&gateway, &ended).await, StatusCode::NOT_FOUND);
    in_session(&gateway, &kept, 3, "ping", json!({})).await;
    assert_eq!(state.revoked_len(), 1);
}

#[test]
fn the_ended_sessions_set_drops_the_expired_ids() {
    use crate::mcp::session::MAX_AGE;
    let mcp = Mcp { servers: BTreeMap::new(), session_key: None, oauth: None, expose_rest: false };
    let state = crate::gateway::McpState::new(&mcp, &crate::secret::Resolved::default(), b"salt", None);
    let now = 2_000_000_000;
    let old = sealed_session(now - MAX_AGE.as_secs() + 100);
    let old_id = state.key.seal(&old);
    state.revoke(&old_id, &old, now);
    assert!(state.open(&old_id, now).is_none(), "ended");
    let fresh = sealed_session(now);
    let fresh_id = state.key.seal(&fresh);
    assert!(state.open(&fresh_id, now).is_some());
    // Within its age the old id is kept.
    state.revoke(&state.key.seal(&fresh), &fresh, now + 60);
    assert_eq!(state.revoked_len(), 2);
    // Past it, it is dropped at the next end (it would not open anyway).
    state.revoke(&state.key.seal(&fresh), &fresh, now + 200);
    assert_eq!(state.revoked_len(), 2, "the old id dropped, the new one kept");
    assert!(state.open(&old_id, now + 200).is_none(), "expired");
}

#[tokio::test]
async fn a_clients_cancellation_of_a_call_in_flight_reaches_its_server() {
    let (gateway, _, seen) = gateway().await;
    let (session, other) = (initialize(&gateway).await, initialize(&gateway).await);
    let call = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "search__hanging"}});
    let request = Request::post("/mcp")
        .header("authorization", "Bearer k")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-session-id", &session)
        .header("mcp-protocol-version", "2025-11-25")
        .body(Body::from(call.to_string()))
        .unwrap();
    let response = crate::http::app(gateway.clone()).oneshot(request).await.unwrap();
    let mut body = response.into_body();
    let first = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(first.data_ref().unwrap()).contains("notifications/progress"));

    let cancel = |request: u64| json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": request, "reason": "x"}});
    // Another session's, and an id not in flight: nothing is forwarded.
    for (session, request) in [(&other, 9), (&session, 10)] {
        let headers = [("mcp-session-id", session.as_str()), ("mcp-protocol-version", "2025-11-25")];
        let (status, _, _) = post(&gateway, &headers, cancel(request)).await;
        assert_eq!(status, StatusCode::ACCEPTED);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(seen.lock().unwrap().calls, ["hanging"]);
    // The call's own: forwarded while the client still holds its stream.
    let headers = [("mcp-session-id", session.as_str()), ("mcp-protocol-version", "2025-11-25")];
    let (status, _, _) = post(&gateway, &headers, cancel(9)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    for _ in 0..200 {
        if seen.lock().unwrap().calls.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(seen.lock().unwrap().calls, ["hanging", "cancelled 9"]);
    // Once the call is over, it is no longer in flight.
    drop(body);
    let state = gateway.mcp.clone().unwrap();
    for _ in 0..200 {
        if state.call_in_flight(&session, &json!(9)).is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(state.call_in_flight(&session, &json!(9)), None);
}

/// The `Authorization` the fake server was last sent with a tool call of `session`.
async fn called_with(gateway: &Arc<Gateway>, seen: &Shared, session: &str, id: u64) -> String {
    let answer = in_session(gateway, session, id, "tools/call", json!({"name": "search__search"})).await;
    assert_eq!(answer["result"]["content"][0]["text"], "found", "{answer}");
    seen.lock().unwrap().authorizations.last().cloned().unwrap_or_default()
}

#[tokio::test]
async fn a_servers_rotated_secret_is_sent_after_a_refresh_and_a_token_file_read_at_each_call() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "one\n").unwrap();
    let auth = Auth::Bearer { secret: SecretRef::File(secret.clone()) };
    let (gateway, _, seen) = build_with(json!({"keys": []}), false, "", |s| s.auth = auth).await;
    let session = initialize(&gateway).await;
    assert_eq!(called_with(&gateway, &seen, &session, 1).await, "Bearer one");
    std::fs::write(&secret, "two").unwrap();
    assert_eq!(called_with(&gateway, &seen, &session, 2).await, "Bearer one", "until the refresh");
    gateway.refresh_secrets().await;
    assert_eq!(called_with(&gateway, &seen, &session, 3).await, "Bearer two");
    // A reference that no longer resolves: the value in use stays.
    std::fs::remove_file(&secret).unwrap();
    gateway.refresh_secrets().await;
    assert_eq!(called_with(&gateway, &seen, &session, 4).await, "Bearer two");

    let token = dir.path().join("token");
    std::fs::write(&token, "t1").unwrap();
    let auth = Auth::TokenFile { path: token.clone() };
    let (gateway, _, seen) = build_with(json!({"keys": []}), false, "", |s| s.auth = auth).await;
    let session = initialize(&gateway).await;
    assert_eq!(called_with(&gateway, &seen, &session, 1).await, "Bearer t1");
    std::fs::write(&token, "t2").unwrap();
    assert_eq!(called_with(&gateway, &seen, &session, 2).await, "Bearer t2", "read again, no refresh needed");
}
