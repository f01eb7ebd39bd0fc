//! An MCP server for Flexway's MCP tests and benchmark: the official Rust SDK's
//! (`rmcp`) Streamable HTTP server on loopback, at `/mcp`. It speaks the session
//! revisions (2025-06-18, 2025-11-25: `initialize`, `Mcp-Session-Id`, SSE answers) and
//! the stateless 2026-07-28 one (`server/discover`, no session), as the SDK does.
//!
//! Its tools, deterministic:
//! - `echo {text}` → `text`;
//! - `add {a, b}` → their sum, in decimal;
//! - `fail` → a result with `isError: true` (the tool ran and failed);
//! - `explode` → a JSON-RPC error (-32603), no result;
//! - `slow {ms}` → answers after `ms` milliseconds;
//! - `whoami` → the `Authorization` header the server received (`(none)` without one):
//!   what proves which credential reached it.
//!
//! [`FakeMcp::forget`] (or `POST /forget`) drops every session, so the next request
//! with an old session id is answered 404, as a restarted server would;
//! [`FakeMcp::calls`] counts the calls per tool; [`FakeMcp::start_requiring`] answers
//! 401 to a request without `Authorization: Bearer {token}`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData, InitializeRequestParams,
    InitializeResult, JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::SessionManager;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::{Value, json};
use tokio::sync::oneshot;

/// What the server's handlers share: calls per tool, initializations.
#[derive(Debug, Default)]
struct Counters {
    calls: Mutex<HashMap<String, u64>>,
    initializations: AtomicU64,
}

/// A running server; stops on drop.
pub struct FakeMcp {
    addr: SocketAddr,
    counters: Arc<Counters>,
    sessions: Arc<LocalSessionManager>,
    _stop: oneshot::Sender<()>,
}

impl FakeMcp {
    /// On a free loopback port, with no credential required.
    pub async fn start() -> std::io::Result<FakeMcp> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), None).await
    }

    /// On a free loopback port, answering 401 to a request without
    /// `Authorization: Bearer {token}`.
    pub async fn start_requiring(token: &str) -> std::io::Result<FakeMcp> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), Some(token.to_owned())).await
    }

    pub async fn start_on(addr: SocketAddr, token: Option<String>) -> std::io::Result<FakeMcp> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let counters = Arc::new(Counters::default());
        let sessions = Arc::new(LocalSessionManager::default());
        let handler = Tools { counters: counters.clone() };
        let mcp = StreamableHttpService::new(
            move || Ok(handler.clone()),
            sessions.clone(),
            // No keep-alive comments: an answer is its events and nothing else.
            StreamableHttpServerConfig::default().with_sse_keep_alive(None),
        );
        let app = Router::new()
            .nest_service("/mcp", mcp)
            .route("/forget", post(forget_route))
            .with_state(sessions.clone())
            .layer(middleware::from_fn_with_state(token.map(Arc::<str>::from), require_token));
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(FakeMcp { addr, counters, sessions, _stop: stop })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The MCP endpoint: `http://127.0.0.1:PORT/mcp`.
    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// How many times `tool` was called (refused calls to an unknown tool included).
    pub fn calls(&self, tool: &str) -> u64 {
        self.counters.calls.lock().map(|calls| calls.get(tool).copied().unwrap_or(0)).unwrap_or(0)
    }

    /// How many `initialize` requests it answered.
    pub fn initializations(&self) -> u64 {
        self.counters.initializations.load(Ordering::SeqCst)
    }

    /// Drops every session: the next request with an old session id is a 404.
    pub async fn forget(&self) {
        forget_all(&self.sessions).await;
    }
}

async fn forget_all(sessions: &LocalSessionManager) {
    let ids: Vec<_> = sessions.sessions.read().await.keys().cloned().collect();
    for id in ids {
        let _ = sessions.close_session(&id).await;
    }
}

async fn forget_route(State(sessions): State<Arc<LocalSessionManager>>) -> http::StatusCode {
    forget_all(&sessions).await;
    http::StatusCode::NO_CONTENT
}

async fn require_token(State(token): State<Option<Arc<str>>>, request: Request, next: Next) -> Response {
    if let Some(token) = token {
        let expected = format!("Bearer {token}");
        let given = request.headers().get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if given != Some(expected.as_str()) {
            return (http::StatusCode::UNAUTHORIZED, "a bearer token is required").into_response();
        }
    }
    next.run(request).await
}

#[derive(Debug, Clone)]
struct Tools {
    counters: Arc<Counters>,
}

fn schema(properties: Value, required: &[&str]) -> Arc<JsonObject> {
    let schema = json!({"type": "object", "properties": properties, "required": required});
    Arc::new(schema.as_object().cloned().unwrap_or_default())
}

fn tools() -> Vec<Tool> {
    vec![
        Tool::new("echo", "Answers its text", schema(json!({"text": {"type": "string"}}), &["text"])),
        Tool::new(
            "add",
            "Adds two integers",
            schema(json!({"a": {"type": "integer"}, "b": {"type": "integer"}}), &["a", "b"]),
        ),
        Tool::new("fail", "Runs and fails (isError: true)", schema(json!({}), &[])),
        Tool::new("explode", "Answers a JSON-RPC error", schema(json!({}), &[])),
        Tool::new("slow", "Answers after ms milliseconds", schema(json!({"ms": {"type": "integer"}}), &["ms"])),
        Tool::new("whoami", "The Authorization header it received", schema(json!({}), &[])),
    ]
}

fn text(text: impl Into<String>) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(text)])
}

fn integer(arguments: &JsonObject, name: &str) -> Result<i64, ErrorData> {
    arguments
        .get(name)
        .and_then(Value::as_i64)
        .ok_or_else(|| ErrorData::invalid_params(format!("`{name}` must be an integer"), None))
}

impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_instructions("Flexway's fake MCP server")
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        self.counters.initializations.fetch_add(1, Ordering::SeqCst);
        context.peer.set_peer_info(request.clone());
        self.negotiate_initialize(&request)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        tools().into_iter().find(|tool| tool.name == name)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if let Ok(mut calls) = self.counters.calls.lock() {
            *calls.entry(request.name.to_string()).or_default() += 1;
        }
        let arguments = request.arguments.unwrap_or_default();
        let result = match request.name.as_ref() {
            "echo" => text(arguments.get("text").and_then(Value::as_str).unwrap_or_default()),
            "add" => text((integer(&arguments, "a")? + integer(&arguments, "b")?).to_string()),
            "fail" => CallToolResult::error(vec![ContentBlock::text("failed, as asked")]),
            "explode" => return Err(ErrorData::internal_error("exploded, as asked", None)),
            "slow" => {
                let ms = integer(&arguments, "ms")?.max(0) as u64;
                tokio::time::sleep(Duration::from_millis(ms)).await;
                text(format!("slept {ms} ms"))
            }
            "whoami" => {
                let parts = context.extensions.get::<http::request::Parts>();
                let auth = parts.and_then(|p| p.headers.get(http::header::AUTHORIZATION));
                text(auth.and_then(|v| v.to_str().ok()).unwrap_or("(none)"))
            }
            other => return Err(ErrorData::invalid_params(format!("Unknown tool: {other}"), None)),
        };
        Ok(result.into())
    }
}
