//! `tools/call`: the one metered MCP method, a door of the driver (ARCHITECTURE.md,
//! "One driver, many doors"), so that its reservation, settlement and record are every
//! call's.
//!
//! The tool's federated name is resolved to its server and its own name; one the
//! caller may not call (denied, on a server it may not use, on an external server for
//! a sensitive call, outside its residency) is answered exactly as an unknown tool
//! (-32602 `Unknown tool: NAME`). Then the server's breaker (open: answered at once,
//! the server named), the tool's price reserved on every euro budget of the caller (and
//! its run), the call sent once (never retried: tools have side effects) with the
//! server's own credential. A result is charged (`isError: true` too: the tool ran);
//! a JSON-RPC error, a transport failure or a timeout is refunded. A refusal is a
//! JSON-RPC error on HTTP 200 whose `data` says `{flexway_code, retry_after_s}`.
//!
//! The record says `operation: mcp`, `mcp_server`, `tool` (its name on its server) and
//! `mcp_status` (`ok`, `tool_error`, `error`); its `status` is the HTTP status the
//! refusal would have on any other door (200 for an answer); never the arguments or
//! the result.

use std::sync::Arc;

use axum::extract::Request;
use axum::response::Response;
use http::HeaderMap;
use serde_json::{Value, json};
use tower::{Layer, Service};

use super::super::admit::{Metered, reserve, sensitive_and_residency};
use super::super::drive::{self, Call, Charge, Ended, Ending, Reply, Spent, drive};
use super::super::record::Draft;
use super::{Accept, Access, Inbound, federation};
use crate::audit::McpStatus;
use crate::call::{ErrorCode, Operation};
use crate::config::{AiOperation, BackendId, Capability, GrpcMetering};
use crate::error::GatewayError;
use crate::gateway::{Gateway, McpInFlight, McpInFlightGuard};
use crate::identity::Caller;
use crate::mcp::upstream::{Answer, UpstreamError};
use crate::mcp::wire;
use crate::metering::Meter;
use crate::routing::breaker::{self, BreakerLayer, Classify, Outcome, Passed};

/// The JSON-RPC code of a refusal by the gateway (budget, rate, run, an unavailable
/// server): the implementation-defined server error range.
const REFUSED: i64 = -32000;

pub(super) async fn handle(
    gateway: Arc<Gateway>,
    inbound: Inbound,
    id: Value,
    message: Value,
    request: Request,
) -> Response {
    // Its own task: a client that leaves once the call is sent does not cancel it
    // (the tool runs anyway: it is charged and recorded on what the server answers).
    let (accept, reply_id) = (inbound.accept, id.clone());
    match tokio::spawn(drive(gateway, ToolCall { inbound, id, message }, request)).await {
        Ok(response) => response,
        Err(e) => {
            tracing::error!("mcp: a tool call's task failed: {e}");
            let failed = GatewayError::Internal("a tool call's task failed".into());
            Accept::answer(accept, &refusal_message(Some(reply_id), &failed))
        }
    }
}

/// One `tools/call`.
struct ToolCall {
    inbound: Inbound,
    id: Value,
    message: Value,
}

/// Why a tool call has no result.
pub(super) enum Refusal {
    /// The gateway's own (budget, rate, run, a header it refuses).
    Gateway(GatewayError),
    /// A name the caller may not call, or that does not exist: the same answer.
    UnknownTool(String),
    /// The server's breaker is open: nothing was sent.
    Open(String),
    /// Sent, and no answer came: a transport failure, a timeout, an error status.
    Unanswered { server: String, timeout: bool },
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
            Refusal::UnknownTool(_) => (400, ErrorCode::InvalidRequest),
            Refusal::Open(_) => (503, ErrorCode::UpstreamUnavailable),
            Refusal::Unanswered { timeout: true, .. } => (504, ErrorCode::UpstreamTimeout),
            Refusal::Unanswered { timeout: false, .. } => (502, ErrorCode::UpstreamUnavailable),
        }
    }
}

/// A refusal of the gateway as a JSON-RPC error: `data: {flexway_code, retry_after_s}`.
pub(super) fn refusal_message(id: Option<Value>, error: &GatewayError) -> Value {
    let retry_after = error.headers().into_iter().find(|(name, _)| *name == "retry-after");
    let retry_after_s = retry_after.and_then(|(_, value)| value.parse::<u64>().ok());
    let data = json!({"flexway_code": error.code().as_str(), "retry_after_s": retry_after_s});
    let message = match error {
        GatewayError::Internal(_) => crate::error::INTERNAL_MESSAGE.to_owned(),
        other => other.to_string(),
    };
    wire::error(id, REFUSED, &message, Some(data))
}

impl Refusal {
    fn message(&self, id: Value) -> Value {
        match self {
            Refusal::Gateway(error) => refusal_message(Some(id), error),
            Refusal::UnknownTool(name) => {
                wire::error(Some(id), wire::INVALID_PARAMS, &format!("Unknown tool: {name}"), None)
            }
            Refusal::Open(server) => {
                let data = json!({"flexway_code": ErrorCode::UpstreamUnavailable.as_str(), "retry_after_s": null, "server": server});
                let message = format!("MCP server {server} is unavailable: its circuit breaker is open");
                wire::error(Some(id), REFUSED, &message, Some(data))
            }
            Refusal::Unanswered { server, timeout } => {
                let code = if *timeout { ErrorCode::UpstreamTimeout } else { ErrorCode::UpstreamUnavailable };
                let data = json!({"flexway_code": code.as_str(), "retry_after_s": null, "server": server});
                let what = if *timeout { "did not answer in time" } else { "did not answer" };
                wire::error(Some(id), REFUSED, &format!("MCP server {server} {what}"), Some(data))
            }
        }
    }
}

impl drive::Door for ToolCall {
    type Refusal = Refusal;

    fn operation(&self) -> Operation {
        Operation::Mcp
    }

    /// Identified before the message was read (a JWT takes a fetch).
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
        let Call { gateway, caller, request_id, run } = call;
        let (Some(mcp), Some(state)) = (gateway.config.mcp.as_ref(), gateway.mcp.as_ref()) else {
            return Err(GatewayError::Internal("/mcp without its state".into()).into());
        };
        let name = self.message.pointer("/params/name").and_then(Value::as_str).unwrap_or("").to_owned();
        draft.request(Capability::Http, &name, None);
        let (sensitive, residency) = sensitive_and_residency(gateway, caller, request.headers(), draft)?;
        let access = Access::with(gateway, mcp, caller, sensitive, residency);
        let inbound = &self.inbound;
        let resolved = federation::resolve(state, &access, inbound, &name, "tools/list", "tools").await;
        let Some((server, tool)) = resolved.filter(|(server, tool)| access.may_call(server, tool)) else {
            return Err(Refusal::UnknownTool(name));
        };
        draft.mcp_tool(&server, &tool, &name);
        let Some(config) = mcp.servers.get(&server) else { return Err(Refusal::UnknownTool(name)) };
        let Some(server_at) = federation::target(mcp, state, &server, &inbound.version) else {
            return Err(Refusal::UnknownTool(name));
        };
        let target = server_at.target();

        // Reserve the tool's price on every euro budget of the caller and its run.
        let price = config.price.of(&tool);
        let operation = AiOperation {
            metering: GrpcMetering::PerCall,
            price_per_thousand: crate::money::MicroEur(price.0.saturating_mul(1000)),
            feature: format!("mcp:{server}"),
            cache: None,
        };
        let meter =
            Meter::new(gateway.clone(), caller.clone(), run.cloned(), request_id, Some(operation), config.timeout);
        reserve(call, draft, charge, Metered { meter: Arc::new(meter), bytes: 0 }).await?;

        // In flight, for the client's own `notifications/cancelled` (sessions only: a
        // stateless caller's request ids are its own to reuse).
        let session_id = request.headers().get(super::SESSION_HEADER).and_then(|v| v.to_str().ok());
        let in_flight = match (gateway.mcp.as_ref(), &inbound.session, session_id) {
            (Some(shared), Some(session), Some(session_id)) => {
                let carried = session.upstream.get(&server).filter(|c| !c.is_empty()).cloned();
                let call = McpInFlight { server: server.clone(), carried, version: inbound.version.clone() };
                shared.call_started(session_id, &self.id, call)
            }
            _ => None,
        };

        // Sent once, through the server's breaker.
        let mut upstream = self.message.clone();
        upstream["params"]["name"] = Value::String(tool);
        let sending = |_: ()| {
            let (target, server, upstream) = (&target, &server, &upstream);
            async move {
                let sent = federation::send(state, target, server, inbound, upstream).await;
                sent.map(Sent).map_err(Failed)
            }
        };
        let started = std::time::Instant::now();
        let mut guarded = BreakerLayer::new(state.breakers.clone()).layer(tower::service_fn(sending));
        let answered = match std::future::poll_fn(|cx| guarded.poll_ready(cx)).await {
            Ok(()) => {
                let call = breaker::Call { backend: BackendId::new(&server), in_flight: None, request: () };
                guarded.call(call).await
            }
            Err(refused) => Err(refused),
        };
        draft.waited(started.elapsed());
        let answer = match answered {
            Ok(Passed { answer: Sent(answer), .. }) => answer,
            Err(breaker::Refused::Open) => return Err(Refusal::Open(server)),
            Err(breaker::Refused::Failed(Failed(e))) => return Err(unanswered(server, &e)),
        };
        let message = match answer {
            Answer::Json { message, .. } => message,
            Answer::Accepted => return Err(Refusal::Unanswered { server, timeout: false }),
            // Relayed event by event (progress first, the result last).
            Answer::Stream(events) if self.inbound.accept.sse => {
                draft.streaming();
                let carried = inbound.session.as_ref().and_then(|s| s.upstream.get(&server)).filter(|c| !c.is_empty());
                let cancel = Cancel {
                    gateway: gateway.clone(),
                    server: server.clone(),
                    version: inbound.version.clone(),
                    session: carried.map(|carried| state.session_in_use(&server, carried)),
                    id: self.id.clone(),
                    done: false,
                };
                let (id, called, version) = (self.id.clone(), name, inbound.version.clone());
                let relay =
                    Streamed { events, id, called, version, server, cancel, ending: None, _in_flight: in_flight };
                return Ok(Reply::Relay(Box::new(relay)));
            }
            Answer::Stream(events) => match federation::response(Answer::Stream(events), &self.id).await {
                Ok(Some(message)) => message,
                Ok(None) => return Err(Refusal::Unanswered { server, timeout: false }),
                Err(e) => return Err(unanswered(server, &e)),
            },
        };
        draft.first_byte();
        let (status, ended) = outcome(&message);
        draft.mcp_status(status);
        let mut message = message;
        message["id"] = self.id.clone();
        if unknown_upstream(&message) {
            // Said in the gateway's words, as a tool the caller may not call is.
            message = Refusal::UnknownTool(name).message(self.id.clone());
        }
        super::typed(&self.inbound.version, &mut message);
        Ok(Reply::Now(self.inbound.accept.answer(&message), ended))
    }

    fn refuse(&self, refusal: &Refusal) -> Response {
        Accept::answer(self.inbound.accept, &refusal.message(self.id.clone()))
    }
}

/// How a call answered `message` ended: charged on a result (`isError: true` too: the
/// tool ran), refunded on a JSON-RPC error.
fn outcome(message: &Value) -> (McpStatus, Ended) {
    let (status, code, served) = match message.get("result") {
        Some(result) if result.get("isError").and_then(Value::as_bool) == Some(true) => {
            (McpStatus::ToolError, None, true)
        }
        Some(_) => (McpStatus::Ok, None, true),
        None => (McpStatus::Error, Some(ErrorCode::UpstreamError), false),
    };
    let spent = Spent::Metered { answered: true, served, kept: None };
    (status, Ended { status: 200, code, spent, finish_reasons: Vec::new() })
}

/// The server's own "unknown tool" answer (-32602 naming an unknown or missing
/// tool): answered exactly as a tool the caller may not call, so that the two cannot
/// be told apart.
fn unknown_upstream(message: &Value) -> bool {
    let Some(error) = message.get("error") else { return false };
    let text = error.get("message").and_then(Value::as_str).unwrap_or("").to_ascii_lowercase();
    error.get("code").and_then(Value::as_i64) == Some(wire::INVALID_PARAMS)
        && text.contains("tool")
        && (text.contains("unknown") || text.contains("not found") || text.contains("no such"))
}

fn unanswered(server: String, error: &UpstreamError) -> Refusal {
    tracing::warn!(server, "mcp: tools/call had no answer: {error:?}");
    Refusal::Unanswered { server, timeout: matches!(error, UpstreamError::Timeout) }
}

/// A tool call's upstream stream, relayed to the client event by event; the call ends
/// at the event that answers it (charged or refunded as [`outcome`] says), or when
/// the stream ends or fails without one (refunded). A client that leaves drops the
/// relay: the call is cancelled upstream, and charged (it was sent, and the tool may
/// have run: a refund is for a call that had no answer), recorded 499.
struct Streamed {
    /// The call's end, once the relay has it.
    ending: Option<Ending>,
    events: crate::mcp::upstream::Events,
    id: Value,
    /// The tool's name as the caller called it.
    called: String,
    /// The caller's protocol revision.
    version: String,
    server: String,
    cancel: Cancel,
    /// The call registered in flight until the relay ends.
    _in_flight: Option<McpInFlightGuard>,
}

/// Sends `notifications/cancelled` for the call upstream if dropped before the call
/// ended: the client left its stream.
struct Cancel {
    gateway: Arc<Gateway>,
    server: String,
    version: String,
    session: Option<String>,
    id: Value,
    done: bool,
}

impl Drop for Cancel {
    fn drop(&mut self) {
        if self.done || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let (gateway, server, version) = (self.gateway.clone(), self.server.clone(), self.version.clone());
        let session = self.session.take();
        let params = json!({"requestId": self.id, "reason": "the client closed its stream"});
        let message = json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": params});
        tokio::spawn(async move {
            let (Some(mcp), Some(state)) = (gateway.config.mcp.as_ref(), gateway.mcp.as_ref()) else { return };
            if let Some(server_at) = federation::target(mcp, state, &server, &version) {
                let target = server_at.target();
                let _ = state.client.send(&target, session.as_deref(), &message).await;
            }
        });
    }
}

impl drive::Relay for Streamed {
    fn respond(self: Box<Self>, ending: Ending, _: Option<super::super::Deadline>) -> Response {
        let mut this = *self;
        this.ending = Some(ending);
        let relay = futures_util::stream::unfold(Some(this), |state| async move {
            let mut this = state?;
            match this.events.next().await {
                Some(Ok(mut message)) => {
                    let answers = message.get("result").is_some() || message.get("error").is_some();
                    if let Some(ending) = this.ending.as_mut() {
                        ending.first_byte();
                    }
                    if answers && message.get("id") == Some(&this.id) {
                        let (status, ended) = outcome(&message);
                        message["id"] = this.id.clone();
                        if unknown_upstream(&message) {
                            message = Refusal::UnknownTool(this.called.clone()).message(this.id.clone());
                        }
                        super::typed(&this.version, &mut message);
                        this.cancel.done = true;
                        if let Some(mut ending) = this.ending.take() {
                            ending.mcp_status(status);
                            ending.end(ended).await;
                        }
                        return Some((Ok::<_, std::convert::Infallible>(super::sse_event(&message)), None));
                    }
                    Some((Ok(super::sse_event(&message)), Some(this)))
                }
                other => {
                    let timeout = matches!(other, Some(Err(UpstreamError::Timeout)));
                    if let Some(Err(e)) = &other {
                        tracing::warn!(server = this.server, "mcp: a tool call's stream failed: {e:?}");
                    }
                    this.cancel.done = true;
                    let spent = Spent::Metered { answered: false, served: false, kept: None };
                    let code = Some(ErrorCode::UpstreamError);
                    if let Some(ending) = this.ending.take() {
                        ending.end(Ended { status: 200, code, spent, finish_reasons: Vec::new() }).await;
                    }
                    // The client's request still gets its answer: an error.
                    let refusal = Refusal::Unanswered { server: this.server.clone(), timeout };
                    Some((Ok(super::sse_event(&refusal.message(this.id.clone()))), None))
                }
            }
        });
        super::event_stream(axum::body::Body::from_stream(relay))
    }
}

impl Drop for Streamed {
    /// The client left before the answer: the call was sent, so it is charged.
    fn drop(&mut self) {
        let Some(mut ending) = self.ending.take() else { return };
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        ending.mcp_status(McpStatus::Error);
        let spent = Spent::Metered { answered: true, served: true, kept: None };
        let ended =
            Ended { status: 499, code: Some(ErrorCode::ClientClosedRequest), spent, finish_reasons: Vec::new() };
        tokio::spawn(ending.end(ended));
    }
}

/// A server's answer, as its breaker hears it: the server is up.
struct Sent(Answer);

/// No answer, as the breaker hears it: a failure, but a session the server forgot
/// (which says nothing of its health).
#[derive(Debug)]
struct Failed(UpstreamError);

impl Classify for Sent {
    fn breaker_outcome(&self) -> Option<Outcome> {
        Some(Outcome::Success)
    }
}

impl Classify for Failed {
    fn breaker_outcome(&self) -> Option<Outcome> {
        match &self.0 {
            UpstreamError::SessionGone => None,
            UpstreamError::Timeout => Some(Outcome::Timeout),
            UpstreamError::Transport(_) => Some(Outcome::ConnectionError),
            UpstreamError::Status(status) => Some(Outcome::Status { status: *status, retry_after: None }),
        }
    }
}
