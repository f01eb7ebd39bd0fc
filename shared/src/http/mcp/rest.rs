//! REST operations as tools (SPEC §17, `mcp.expose_rest`): each operation of a `kind:
//! http` backend's contract that carries `x-flexway-ai` and an `operationId` is also a
//! tool, `{mount}__{operationId}` (the mount without its leading `/`, each other `/`
//! as `_`; cut to 64 characters as every federated name is), its input schema the
//! contract's ([`RestOperation::input_schema`]): a property per path and query
//! parameter, `body` for the JSON body. An operation whose body is required and
//! cannot be JSON is no tool.
//!
//! Who sees it: the tenant's and agent's `mcp.servers`, for which a REST tool's server
//! is its name's prefix (so a list without it hides the mount's tools), their
//! `mcp.tools` globs on its name, and the REST route's own filters (a sensitive call
//! reaches internal backends only; residency).
//! A name the caller may not call is answered as an unknown tool.
//!
//! A call is the REST operation's own call: the request is built from the arguments
//! (the path template filled, each path parameter percent-encoded; the query; the
//! `body` as JSON) and run through the REST door's pipeline (`rest::proxied`: route,
//! fallback, breakers, reservation, metering per call or per byte, the response
//! cache) under a door whose operation is `mcp`, so the driver reserves, settles and
//! writes the one record: `mcp_server` the backend, `tool` the operationId, `feature`
//! the operation's. Only Flexway's own headers of the MCP request go into it (the
//! sensitivity, residency and run headers, the trace context); the backend's `auth`
//! is added upstream as for any REST call. The answer is read whole (at most 4 MiB;
//! the relay ends the call as its body ends) and answered as a `CallToolResult`: the
//! body as text, `structuredContent` when it is a JSON object, `isError` when the
//! status is not 2xx. The record's `status` is the operation's HTTP status and its
//! `mcp_status` follows it (`ok` for 2xx, `tool_error` for another answer).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, header};
use http_body_util::BodyExt;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde_json::{Value, json};

use super::super::Deadline;
use super::super::drive::{self, Call, Charge, Ending, Reply, drive};
use super::super::record::Draft;
use super::{Accept, Access, Inbound, MAX_MESSAGE, call};
use crate::audit::McpStatus;
use crate::call::{ErrorCode, Operation};
use crate::config::contract::{Matched, ParameterIn, RestOperation};
use crate::config::{BackendId, BackendKind, Capability, McpNarrowing};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::mcp::names::federated;
use crate::mcp::policy::allows;
use crate::mcp::wire;
use crate::routing::Declared;

/// What is percent-encoded in a path parameter or a query's key or value: all but
/// RFC 3986's unreserved characters.
const ENCODED: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// A REST operation that is a tool.
struct Tool<'a> {
    name: String,
    /// The name's prefix: its "server" for a narrowing's `mcp.servers`.
    prefix: String,
    backend: &'a BackendId,
    mount: &'a str,
    operation: &'a RestOperation,
}

/// Every REST operation that is a tool, in backend then contract order (a name two
/// of them federate to is the first's); none unless `mcp.expose_rest`.
fn all(gateway: &Gateway) -> Vec<Tool<'_>> {
    if !gateway.config.mcp.as_ref().is_some_and(|mcp| mcp.expose_rest) {
        return Vec::new();
    }
    let mut tools: Vec<Tool<'_>> = Vec::new();
    for (backend, config) in &gateway.config.ai.backends {
        let BackendKind::Http { mount, contract, .. } = &config.kind else { continue };
        let prefix = mount.trim_start_matches('/').replace('/', "_");
        for operation in &contract.operations {
            let Some(id) = operation.operation_id.as_deref().filter(|_| operation.ai.is_some()) else { continue };
            // A body it cannot take as JSON, or a parameter that `body` would name too.
            let takes_body = operation.body.is_some_and(|body| body.json);
            if operation.body.is_some_and(|body| body.required && !body.json)
                || (takes_body && operation.parameters.iter().any(|p| p.name == "body"))
            {
                continue;
            }
            let name = federated(&prefix, id);
            if tools.iter().all(|tool| tool.name != name) {
                tools.push(Tool { name, prefix: prefix.clone(), backend, mount, operation });
            }
        }
    }
    tools
}

/// The caller may call `tool`: its tenant's and agent's `servers` list its prefix
/// (or are absent), their globs let the name through, and the REST route's filters
/// leave a backend for it.
fn may_call(gateway: &Gateway, access: &Access<'_>, tool: &Tool<'_>) -> bool {
    let who = &access.who;
    // The globs see the whole name too, not only the one cut at 64 characters.
    let whole = format!("{}__{}", tool.prefix, tool.operation.operation_id.as_deref().unwrap_or_default());
    let lets = |narrowing: &McpNarrowing| {
        narrowing.servers.as_ref().is_none_or(|servers| servers.contains(&tool.prefix))
            && allows(&narrowing.tools, &[whole.as_str(), tool.name.as_str()])
    };
    if !lets(who.tenant) || who.agent.is_some_and(|agent| !lets(agent)) {
        return false;
    }
    let declared = Declared::Rest { owner: tool.backend, operation: tool.operation };
    matches!(gateway.router.route_operation(declared, who.sensitive, &access.residency), Ok(Some(_)))
}

/// The REST tools the caller may call, as `tools/list` items.
pub(super) fn tools(gateway: &Gateway, access: &Access<'_>) -> Vec<Value> {
    let tools = all(gateway);
    tools.iter().filter(|tool| may_call(gateway, access, tool)).map(listed).collect()
}

fn listed(tool: &Tool<'_>) -> Value {
    let operation = tool.operation;
    let described = operation.description.as_deref().or(operation.summary.as_deref());
    let description = match described {
        Some(text) => text.to_owned(),
        None => format!("{} {}{}", operation.method, tool.mount, operation.path),
    };
    let mut item = json!({"name": tool.name, "description": description, "inputSchema": operation.input_schema});
    if let Some(summary) = &operation.summary {
        item["title"] = Value::String(summary.clone());
    }
    item
}

/// Whether `name` is a REST tool (whoever may call it): `tools/call` of it is
/// [`handle`]'s.
pub(super) fn is_tool(gateway: &Gateway, name: &str) -> bool {
    all(gateway).iter().any(|tool| tool.name == name)
}

/// `tools/call` of a REST tool: the REST operation's call, through the driver.
pub(super) async fn handle(
    gateway: Arc<Gateway>,
    inbound: Inbound,
    id: Value,
    message: Value,
    request: Request,
) -> Response {
    // Its own task, as a server tool's call: a client that leaves once the operation
    // is sent does not undo it.
    let (accept, reply_id) = (inbound.accept, id.clone());
    match tokio::spawn(drive(gateway, RestTool { inbound, id, message }, request)).await {
        Ok(response) => response,
        Err(e) => {
            tracing::error!("mcp: a REST tool call's task failed: {e}");
            let failed = crate::error::GatewayError::Internal("a tool call's task failed".into());
            Accept::answer(accept, &call::refusal_message(Some(reply_id), &failed))
        }
    }
}

/// One `tools/call` of a REST tool.
struct RestTool {
    inbound: Inbound,
    id: Value,
    message: Value,
}

/// Why a REST tool call has no result.
enum Refusal {
    Gateway(GatewayError),
    /// A name the caller may not call, or that is no tool: the same answer.
    UnknownTool(String),
    /// Arguments that do not make the operation's request.
    Arguments(String),
}

impl From<GatewayError> for Refusal {
    fn from(error: GatewayError) -> Self {
        Refusal::Gateway(error)
    }
}

impl drive::Refusal for Refusal {
    fn noted(&self, draft: &mut Draft) -> (u16, ErrorCode) {
        match self {
            Refusal::Gateway(error) => draft.refused(error),
            Refusal::UnknownTool(_) | Refusal::Arguments(_) => (400, ErrorCode::InvalidRequest),
        }
    }
}

impl drive::Door for RestTool {
    type Refusal = Refusal;

    fn operation(&self) -> Operation {
        Operation::Mcp
    }

    /// Identified before the message was read.
    fn identify(&self, _: &Gateway, _: &HeaderMap) -> Result<Caller, Refusal> {
        Ok(self.inbound.caller.clone())
    }

    async fn call(
        &mut self,
        call: Call<'_>,
        draft: &mut Draft,
        charge: &mut Charge,
        request: Request,
    ) -> Result<Reply, Refusal> {
        let Call { gateway, caller, .. } = call;
        let Some(mcp) = gateway.config.mcp.as_ref() else {
            return Err(GatewayError::Internal("/mcp without its configuration".into()).into());
        };
        let name = self.message.pointer("/params/name").and_then(Value::as_str).unwrap_or("").to_owned();
        draft.request(Capability::Http, &name, None);
        let access = Access::of(gateway, mcp, caller, request.headers())?;
        let tools = all(gateway);
        let Some(tool) = tools.iter().find(|tool| tool.name == name).filter(|tool| may_call(gateway, &access, tool))
        else {
            return Err(Refusal::UnknownTool(name));
        };
        let Some(operation_id) = tool.operation.operation_id.as_deref() else {
            return Err(Refusal::UnknownTool(name));
        };
        draft.mcp_tool(tool.backend.as_str(), operation_id, &name);
        let arguments = self.message.pointer("/params/arguments").cloned().unwrap_or_else(|| json!({}));
        let rest_request = built(gateway, tool, &arguments, request.headers()).map_err(Refusal::Arguments)?;
        let below = rest_request.uri().path().to_owned();
        let reply = super::super::rest::proxied(call, draft, charge, tool.backend, &below, rest_request).await;
        // The REST door names the call by its operation: a tool call is named as called.
        draft.mcp_tool(tool.backend.as_str(), operation_id, &name);
        let (id, accept) = (self.id.clone(), self.inbound.accept);
        match reply? {
            // A response cache's hit: whole already.
            Reply::Now(response, ended) => {
                draft.mcp_status(if response.status().is_success() { McpStatus::Ok } else { McpStatus::ToolError });
                let message = answered(response, &id).await;
                Ok(Reply::Now(accept.answer(&message), ended))
            }
            Reply::Relay(relay) => {
                draft.mcp_status_by_answer();
                Ok(Reply::Relay(Box::new(ToolAnswer { relay, id, accept })))
            }
        }
    }

    fn refuse(&self, refusal: &Refusal) -> Response {
        let id = Some(self.id.clone());
        let message = match refusal {
            Refusal::Gateway(error) => call::refusal_message(id, error),
            Refusal::UnknownTool(name) => wire::error(id, wire::INVALID_PARAMS, &format!("Unknown tool: {name}"), None),
            Refusal::Arguments(why) => wire::error(id, wire::INVALID_PARAMS, why, None),
        };
        self.inbound.accept.answer(&message)
    }
}

/// The REST request `arguments` make for `tool`: its path (below the mount) and query,
/// its JSON body, and only Flexway's own of the MCP request's `headers`.
fn built(gateway: &Gateway, tool: &Tool<'_>, arguments: &Value, headers: &HeaderMap) -> Result<Request, String> {
    let operation = tool.operation;
    let Some(arguments) = arguments.as_object() else {
        return Err("arguments must be an object".to_owned());
    };
    let takes_body = operation.body.is_some_and(|body| body.json);
    let declared = |name: &str| operation.parameters.iter().any(|p| p.name == name) || (takes_body && name == "body");
    if let Some(unknown) = arguments.keys().find(|key| !declared(key)) {
        return Err(format!("unknown argument `{unknown}`"));
    }
    let mut path = operation.path.clone();
    let mut query = Vec::new();
    for parameter in &operation.parameters {
        let value = match arguments.get(&parameter.name) {
            Some(Value::Null) | None if parameter.required => {
                return Err(format!("missing argument `{}`", parameter.name));
            }
            Some(Value::Null) | None => continue,
            Some(value) => value,
        };
        match parameter.location {
            ParameterIn::Path => {
                let text = scalar(value).filter(|text| !text.is_empty()).ok_or_else(|| {
                    format!("argument `{}` must be a non-empty string, number or boolean", parameter.name)
                })?;
                let encoded = utf8_percent_encode(&text, ENCODED).to_string();
                path = path.replace(&format!("{{{}}}", parameter.name), &encoded);
            }
            ParameterIn::Query => {
                let values = match value {
                    Value::Array(items) => items.iter().map(scalar).collect::<Option<Vec<_>>>(),
                    other => scalar(other).map(|text| vec![text]),
                };
                let values = values.ok_or_else(|| {
                    format!("argument `{}` must be a string, number, boolean or a list of them", parameter.name)
                })?;
                let key = utf8_percent_encode(&parameter.name, ENCODED).to_string();
                query.extend(values.iter().map(|v| format!("{key}={}", utf8_percent_encode(v, ENCODED))));
            }
        }
    }
    // The path must name this operation, not another the contract declares.
    let Some(BackendKind::Http { contract, .. }) = gateway.config.ai.backends.get(tool.backend).map(|b| &b.kind) else {
        return Err("the tool's backend is not a kind http backend".to_owned());
    };
    match contract.find(&operation.method, &path) {
        Matched::Operation(found) if found.path == operation.path => {}
        _ => return Err(format!("the path arguments do not make a path of {}", operation.path)),
    }
    let body = match (arguments.get("body"), operation.body) {
        (Some(body), Some(_)) if takes_body && !body.is_null() => Some(body.to_string()),
        (_, Some(body)) if body.required => return Err("missing argument `body`".to_owned()),
        _ => None,
    };

    let target = if query.is_empty() { path } else { format!("{path}?{}", query.join("&")) };
    let mut request = Request::builder().method(operation.method.clone()).uri(&target);
    let own = |name: &str| {
        name.starts_with("flexway-")
            || name == gateway.config.ai.sensitive_header.as_str()
            || name == "traceparent"
            || name == "tracestate"
    };
    for (name, value) in headers.iter().filter(|(name, _)| own(name.as_str())) {
        request = request.header(name, value);
    }
    request = request.header(header::ACCEPT, "application/json");
    let body = match body {
        Some(json) => {
            request = request.header(header::CONTENT_TYPE, "application/json");
            Body::from(json)
        }
        None => Body::empty(),
    };
    request.body(body).map_err(|e| format!("the arguments do not make a request: {e}"))
}

/// A path or query parameter's text.
fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Number(number) => Some(number.to_string()),
        Value::Bool(flag) => Some(flag.to_string()),
        _ => None,
    }
}

/// A relayed REST answer as a tool's result: read whole, then answered.
struct ToolAnswer {
    relay: Box<dyn drive::Relay>,
    id: Value,
    accept: Accept,
}

impl drive::Relay for ToolAnswer {
    fn respond(self: Box<Self>, ending: Ending, deadline: Option<Deadline>) -> Response {
        let ToolAnswer { relay, id, accept } = *self;
        // The REST relay ends the call as the body it relays ends (or is dropped).
        let relayed = relay.respond(ending, deadline);
        // The head of the client's answer (its content type), then its one chunk.
        let (head, _) = accept.answer(&Value::Null).into_parts();
        let body = futures_util::stream::once(async move {
            let message = answered(relayed, &id).await;
            let bytes = axum::body::to_bytes(accept.answer(&message).into_body(), usize::MAX).await;
            Ok::<Bytes, axum::Error>(bytes.unwrap_or_default())
        });
        Response::from_parts(head, Body::from_stream(body))
    }
}

/// The JSON-RPC answer to `id` for a REST answer: a `CallToolResult`, or an error when
/// its body could not be read whole.
async fn answered(response: Response, id: &Value) -> Value {
    let status = response.status();
    let body = match http_body_util::Limited::new(response.into_body(), MAX_MESSAGE).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            let message = if e.is::<http_body_util::LengthLimitError>() {
                "the operation's answer is larger than 4 MiB".to_owned()
            } else {
                format!("the operation's answer was cut: {e}")
            };
            return wire::error(Some(id.clone()), wire::INTERNAL_ERROR, &message, None);
        }
    };
    let mut text = String::from_utf8_lossy(&body).into_owned();
    if text.is_empty() && !status.is_success() {
        text = format!("HTTP {status}");
    }
    let mut result = json!({"content": [{"type": "text", "text": text}]});
    if let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(&body) {
        result["structuredContent"] = Value::Object(object);
    }
    if !status.is_success() {
        result["isError"] = Value::Bool(true);
    }
    wire::result(id.clone(), result)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use axum::extract::Path;
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    use http::{HeaderValue, StatusCode};

    use super::*;
    use crate::audit::AuditRecord;
    use crate::audit::sinks::MemoryAuditSink;

    /// `ocr_document` per call at 2 € a thousand (2,000 µ€ a call), `get_document` per
    /// call at 0.5 € a thousand; `unnamed` metered without an operationId and
    /// `health` named and unmetered: neither a tool; `secret_dump` denied by the
    /// tenant's globs.
    const CONTRACT: &str = r##"
openapi: 3.1.0
info: {title: OCR, version: "1"}
components:
  schemas:
    Document: {type: object, required: [pages], properties: {pages: {type: array, items: {type: string}}}}
paths:
  /documents/{id}/ocr:
    post:
      operationId: ocr_document
      summary: Reads a document
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "2", feature: ocr}
      parameters:
        - {name: id, in: path, required: true, schema: {type: string}}
        - {name: lang, in: query, required: true, schema: {type: string}}
      requestBody:
        required: true
        content: {application/json: {schema: {$ref: "#/components/schemas/Document"}}}
  /documents/{id}:
    get:
      operationId: get_document
      description: One document.
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "0.5", feature: fetch}
      parameters: [{name: id, in: path, required: true, schema: {type: string}}]
  /documents/latest:
    get:
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "0.5", feature: fetch}
  /echo:
    post:
      operationId: echo
      x-flexway-ai: {metering: per_byte, price_per_thousand_eur: "0.001", feature: echo}
      requestBody: {content: {application/json: {schema: {type: object}}}}
  /health:
    get: {operationId: health}
  /secret:
    get:
      operationId: secret_dump
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "1", feature: secret}
"##;

    /// What the upstream saw: method, path and query, headers, body.
    type Seen = Arc<Mutex<Vec<(String, String, HeaderMap, String)>>>;

    /// The REST upstream on loopback: `POST /documents/{id}/ocr` answers what it was
    /// sent as JSON; `GET /documents/{id}` is 404 for `missing`.
    async fn upstream() -> (String, Seen) {
        let seen = Seen::default();
        let log = seen.clone();
        let router = axum::Router::new()
            .route(
                "/documents/{id}/ocr",
                post(|Path(id): Path<String>, body: String| async move {
                    let document: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                    axum::Json(json!({"id": id, "pages": document["pages"].as_array().map_or(0, Vec::len)}))
                }),
            )
            .route(
                "/documents/{id}",
                get(|Path(id): Path<String>| async move {
                    match id.as_str() {
                        "missing" => (StatusCode::NOT_FOUND, "no such document").into_response(),
                        _ => axum::Json(json!({"id": id})).into_response(),
                    }
                }),
            )
            .route("/echo", post(|body: String| async move { ([(header::CONTENT_TYPE, "application/json")], body) }))
            .layer(axum::middleware::from_fn(move |request: Request, next: axum::middleware::Next| {
                let log = log.clone();
                async move {
                    let (parts, body) = request.into_parts();
                    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
                    let target = parts.uri.path_and_query().map(|p| p.to_string()).unwrap_or_default();
                    let text = String::from_utf8_lossy(&bytes).into_owned();
                    log.lock().unwrap().push((parts.method.to_string(), target, parts.headers.clone(), text));
                    next.run(Request::from_parts(parts, Body::from(bytes))).await
                }
            }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        (format!("http://{address}"), seen)
    }

    /// A gateway with the `kind: http` backend `ocr` mounted at `/apis/ocr` (the
    /// upstream above; `external: false` when `internal`), `mcp.expose_rest`, and the
    /// key `k` of tenant `acme`, whose `mcp` globs deny `*__secret_*`.
    async fn setup(internal: bool) -> (Arc<Gateway>, Arc<MemoryAuditSink>, Seen, tempfile::TempDir) {
        setup_narrowed(internal, "{tools: {deny: ['*__secret_*']}}").await
    }

    /// [`setup`]'s gateway with `narrowing` as acme's `mcp`, and the MCP server
    /// `files` declared too (never reached).
    async fn setup_narrowed(
        internal: bool,
        narrowing: &str,
    ) -> (Arc<Gateway>, Arc<MemoryAuditSink>, Seen, tempfile::TempDir) {
        use sha2::Digest;
        let (url, seen) = upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let contract = dir.path().join("ocr.yaml");
        std::fs::write(&contract, CONTRACT).unwrap();
        let yaml = format!(
            "version: 1\ntenants:\n  acme:\n    keys: [{{sha256: {}}}]\n    mcp: {narrowing}\n\
             ai:\n  backends:\n    ocr: {{kind: http, url: '{url}', mount: /apis/ocr, contract: '{}', external: {}}}\n\
             mcp:\n  expose_rest: true\n  servers: {{files: {{url: 'http://127.0.0.1:9/mcp'}}}}\n",
            hex::encode(sha2::Sha256::digest(b"k")),
            contract.display(),
            !internal,
        );
        let env = std::collections::HashMap::new();
        let loaded = crate::config::load_str(&yaml, &env).unwrap();
        let audit = Arc::new(MemoryAuditSink::new());
        let adapters = crate::gateway::Adapters {
            budgets: Arc::new(crate::budget::MemoryBudgetStore::new()),
            audit: audit.clone(),
            export: crate::telemetry::Export::Batched,
            cache: None,
        };
        let secrets = Arc::new(crate::secret::LocalSecrets { env });
        let gateway = Arc::new(Gateway::new(loaded.config, secrets, adapters).await.unwrap());
        (gateway, audit, seen, dir)
    }

    fn headers(extra: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        headers.insert("x-private", HeaderValue::from_static("the caller's"));
        for (name, value) in extra {
            headers
                .insert(http::HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    fn listed_names(gateway: &Gateway, headers: &HeaderMap) -> Vec<String> {
        let mcp = gateway.config.mcp.as_ref().unwrap();
        let caller = gateway.keys.authenticate(headers).unwrap();
        let access = Access::of(gateway, mcp, &caller, headers).unwrap();
        tools(gateway, &access).iter().map(|tool| tool["name"].as_str().unwrap().to_owned()).collect()
    }

    /// `tools/call` of `name` with `arguments` through the door; the JSON-RPC answer.
    async fn call_tool(gateway: &Arc<Gateway>, name: &str, arguments: Value, extra: &[(&str, &str)]) -> Value {
        let headers = headers(extra);
        let caller = gateway.keys.authenticate(&headers).unwrap();
        let inbound = Inbound { caller, version: "2025-11-25".into(), session: None, accept: Accept::of(&headers) };
        let message = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}});
        let mut request = Request::post("/mcp").body(Body::empty()).unwrap();
        *request.headers_mut() = headers;
        let response = handle(gateway.clone(), inbound, json!(7), message, request).await;
        assert_eq!(response.status(), StatusCode::OK);
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    async fn recorded(audit: &MemoryAuditSink, n: usize) -> Vec<AuditRecord> {
        for _ in 0..200 {
            if audit.records().len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        audit.records()
    }

    #[tokio::test]
    async fn a_metered_operation_with_an_id_is_listed_with_its_schema_unless_denied() {
        let (gateway, _, _, _dir) = setup(false).await;
        assert_eq!(
            listed_names(&gateway, &headers(&[])),
            ["apis_ocr__get_document", "apis_ocr__ocr_document", "apis_ocr__echo"]
        );
        let mcp = gateway.config.mcp.as_ref().unwrap();
        let caller = gateway.keys.authenticate(&headers(&[])).unwrap();
        let access = Access::of(&gateway, mcp, &caller, &headers(&[])).unwrap();
        let listed = tools(&gateway, &access);
        assert_eq!(listed[1]["title"], "Reads a document");
        assert_eq!(listed[1]["description"], "Reads a document");
        assert_eq!((listed[0]["description"].as_str(), listed[0].get("title")), (Some("One document."), None));
        assert_eq!(
            listed[1]["inputSchema"],
            json!({"type": "object",
                "properties": {"id": {"type": "string"}, "lang": {"type": "string"}, "body": {"$ref": "#/$defs/Document"}},
                "required": ["id", "lang", "body"],
                "$defs": {"Document": {"type": "object", "required": ["pages"],
                    "properties": {"pages": {"type": "array", "items": {"type": "string"}}}}}})
        );
        // A sensitive caller: the backend is external, so no tool is left.
        assert!(listed_names(&gateway, &headers(&[("flexway-sensitive", "true")])).is_empty());
        let (internal, _, _, _dir) = setup(true).await;
        assert_eq!(listed_names(&internal, &headers(&[("flexway-sensitive", "true")])).len(), 3);
        assert!(is_tool(&gateway, "apis_ocr__secret_dump") && !is_tool(&gateway, "apis_ocr__health"));
    }

    #[tokio::test]
    async fn a_call_is_the_rest_operation_charged_per_call_and_recorded_once_as_a_tool() {
        let (gateway, audit, seen, _dir) = setup(false).await;
        let arguments = json!({"id": "a b", "lang": "fr", "body": {"pages": ["one", "two"]}});
        let answer = call_tool(&gateway, "apis_ocr__ocr_document", arguments, &[("flexway-sensitive", "false")]).await;
        assert_eq!(answer["id"], 7);
        let result = &answer["result"];
        assert_eq!(result["structuredContent"], json!({"id": "a b", "pages": 2}));
        assert_eq!(serde_json::from_str::<Value>(result["content"][0]["text"].as_str().unwrap()).unwrap()["pages"], 2);
        assert_eq!(result["content"][0]["type"], "text");
        assert_eq!(result.get("isError"), None);

        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 1);
        let (method, target, headers, body) = &seen[0];
        assert_eq!((method.as_str(), target.as_str()), ("POST", "/documents/a%20b/ocr?lang=fr"));
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert_eq!(serde_json::from_str::<Value>(body).unwrap(), json!({"pages": ["one", "two"]}));
        for private in ["authorization", "x-private", "flexway-sensitive"] {
            assert!(!headers.contains_key(private), "{private} went upstream");
        }

        let records = recorded(&audit, 1).await;
        assert_eq!(records.len(), 1, "one record a call");
        let record = &records[0];
        assert_eq!(record.operation, Operation::Mcp);
        assert_eq!((record.mcp_server.as_deref(), record.tool.as_deref()), (Some("ocr"), Some("ocr_document")));
        assert_eq!(record.model_requested.as_deref(), Some("apis_ocr__ocr_document"));
        assert_eq!((record.feature.as_deref(), record.mcp_status), (Some("ocr"), Some(McpStatus::Ok)));
        assert_eq!((record.status, record.cost_micro_eur), (200, 2_000));
    }

    #[tokio::test]
    async fn a_non_2xx_answer_is_a_tool_error_and_not_charged() {
        let (gateway, audit, _, _dir) = setup(false).await;
        let answer = call_tool(&gateway, "apis_ocr__get_document", json!({"id": "missing"}), &[]).await;
        let result = &answer["result"];
        assert_eq!(result["isError"], true);
        assert_eq!(result["content"][0]["text"], "no such document");
        assert_eq!(result.get("structuredContent"), None);
        let records = recorded(&audit, 1).await;
        assert_eq!((records[0].status, records[0].mcp_status), (404, Some(McpStatus::ToolError)));
        assert_eq!((records[0].cost_micro_eur, records[0].feature.as_deref()), (0, Some("fetch")));

        // Served: charged its own price.
        let answer = call_tool(&gateway, "apis_ocr__get_document", json!({"id": 42}), &[]).await;
        assert_eq!(answer["result"]["structuredContent"], json!({"id": "42"}));
        let records = recorded(&audit, 2).await;
        assert_eq!((records[1].cost_micro_eur, records[1].mcp_status), (500, Some(McpStatus::Ok)));
    }

    #[tokio::test]
    async fn a_per_byte_operation_is_charged_its_request_and_answer_bytes() {
        let (gateway, audit, _, _dir) = setup(false).await;
        // 15 bytes sent, the same 15 answered: 30 µ€ at 1 µ€ a byte.
        let answer = call_tool(&gateway, "apis_ocr__echo", json!({"body": {"pages": ["x"]}}), &[]).await;
        assert_eq!(answer["result"]["content"][0]["text"], r#"{"pages":["x"]}"#);
        let records = recorded(&audit, 1).await;
        assert_eq!((records[0].cost_micro_eur, records[0].feature.as_deref()), (30, Some("echo")));
        assert_eq!(records[0].mcp_status, Some(McpStatus::Ok));
    }

    /// Through `/mcp` itself: the REST tools in `tools/list`, and called by name.
    #[tokio::test]
    async fn over_mcp_the_rest_tools_are_listed_and_called() {
        use tower::ServiceExt;
        let (gateway, audit, _, _dir) = setup(false).await;
        let post = |message: Value, session: Option<String>| {
            let gateway = gateway.clone();
            async move {
                let mut request = Request::post("/mcp")
                    .header("authorization", "Bearer k")
                    .header("content-type", "application/json")
                    .header("accept", "application/json, text/event-stream")
                    .header("mcp-protocol-version", "2025-11-25");
                if let Some(session) = session {
                    request = request.header("mcp-session-id", session);
                }
                let request = request.body(Body::from(message.to_string())).unwrap();
                let response = crate::http::app(gateway).oneshot(request).await.unwrap();
                let session = response.headers().get("mcp-session-id").map(|v| v.to_str().unwrap().to_owned());
                let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
                (session, serde_json::from_slice::<Value>(&bytes).unwrap())
            }
        };
        let initialize = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
        let (session, _) = post(initialize, None).await;
        let list = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}});
        let (_, listed) = post(list, session.clone()).await;
        let names: Vec<_> = listed["result"]["tools"].as_array().unwrap().iter().map(|t| t["name"].clone()).collect();
        assert_eq!(names, [json!("apis_ocr__get_document"), json!("apis_ocr__ocr_document"), json!("apis_ocr__echo")]);
        let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "apis_ocr__get_document", "arguments": {"id": "7"}}});
        let (_, answer) = post(call, session).await;
        assert_eq!(
            (answer["id"].clone(), answer["result"]["structuredContent"].clone()),
            (json!(2), json!({"id": "7"}))
        );
        let records = recorded(&audit, 1).await;
        assert_eq!((records[0].operation, records[0].tool.as_deref()), (Operation::Mcp, Some("get_document")));
        assert_eq!(records[0].cost_micro_eur, 500);
    }

    #[tokio::test]
    async fn a_narrowings_servers_take_a_rest_tool_s_mount_as_its_server() {
        // Only the MCP server `files`: no REST tool is listed, nor called.
        let (gateway, _, seen, _dir) = setup_narrowed(false, "{servers: [files]}").await;
        assert!(listed_names(&gateway, &headers(&[])).is_empty());
        let answer = call_tool(&gateway, "apis_ocr__get_document", json!({"id": "7"}), &[]).await;
        assert_eq!(answer["error"]["message"], "Unknown tool: apis_ocr__get_document");
        assert!(seen.lock().unwrap().is_empty());
        // The mount's prefix lets its tools through.
        let (gateway, _, _, _dir) = setup_narrowed(false, "{servers: [apis_ocr]}").await;
        let all = ["apis_ocr__get_document", "apis_ocr__ocr_document", "apis_ocr__echo", "apis_ocr__secret_dump"];
        assert_eq!(listed_names(&gateway, &headers(&[])), all);
    }

    #[tokio::test]
    async fn a_denied_or_unknown_tool_and_bad_arguments_are_invalid_params_sending_nothing() {
        let (gateway, audit, seen, _dir) = setup(false).await;
        for name in ["apis_ocr__secret_dump", "apis_ocr__health", "apis_ocr__nothing"] {
            let answer = call_tool(&gateway, name, json!({}), &[]).await;
            assert_eq!(answer["error"]["code"], wire::INVALID_PARAMS, "{name}");
            assert_eq!(answer["error"]["message"], format!("Unknown tool: {name}"));
        }
        let bad = [
            json!({"lang": "fr", "body": {"pages": []}}),
            json!({"id": "x", "lang": "fr"}),
            json!({"id": "x", "lang": "fr", "body": {}, "extra": 1}),
            json!({"id": {"nested": 1}, "lang": "fr", "body": {}}),
            json!({"id": "..", "lang": "fr", "body": {}}),
            json!({"id": "a/b", "lang": "fr", "body": {}}),
        ];
        for arguments in bad {
            let answer = call_tool(&gateway, "apis_ocr__ocr_document", arguments.clone(), &[]).await;
            assert_eq!(answer["error"]["code"], wire::INVALID_PARAMS, "{arguments}");
        }
        // `latest` would name another operation than `GET /documents/{id}`.
        let answer = call_tool(&gateway, "apis_ocr__get_document", json!({"id": "latest"}), &[]).await;
        assert_eq!(answer["error"]["code"], wire::INVALID_PARAMS);
        assert!(seen.lock().unwrap().is_empty());
        let records = recorded(&audit, 10).await;
        assert_eq!(records.len(), 10, "each call recorded once");
        assert!(records.iter().all(|r| r.cost_micro_eur == 0 && r.mcp_status != Some(McpStatus::Ok)));
    }
}
