//! `GET /v1/realtime?model=NAME` (SPEC §2.3, local shape): a WebSocket session proxied
//! message by message to one backend that serves `realtime`.
//!
//! Before the upgrade, as for any call: identity (`Authorization: Bearer`, or the
//! `openai-insecure-api-key.` subprotocol browsers send), routing, a response's
//! allowance reserved (a refusal is a plain HTTP 429 `budget_exceeded`), and the
//! backend's own WebSocket opened, trying the route in order like a call's fallback:
//! nothing has reached the client yet. Once the client is upgraded the session is
//! pinned to that backend: no failover, no retry.
//!
//! Budget: a response runs only on an allowance reserved for it
//! (`admission::reserve_turn`), and a session holds nothing while no response runs
//! (SPEC §15). The opening's reservation is the check that one fits, given back once
//! the session is open. A client's `response.create` reserves its response's allowance
//! before it goes upstream; a response the backend starts on its own (server voice
//! activity detection) reserves at its `response.created`, before any of it is
//! relayed. Refused past a window (or a provider quota, or its run ended), the
//! `response.create` is answered with an `error` event and not sent, and the backend's
//! own response is cancelled (`response.cancel`), its events not relayed, the client
//! sent the same `error` event: the session stays open. One response runs at a time on
//! the session's allowance: a `response.create` sent while one runs reserves nothing
//! (the backend refuses it; the allowance held stays the running response's), and a
//! response that starts while another runs is cancelled the same way. A hard cap
//! reached closes it with 4429 `budget_exceeded`. Its `response.done` settles the
//! allowance on the usage reported, before the event is relayed. A cancelled
//! response's `response.done` may still report what the backend used before the cancel
//! reached it: its tokens and cost are charged, never refused, and no request is
//! counted (it was refused before its first byte): only the backend, never the
//! gateway, passes a window, and by that much. The allowance reserved is the allowance
//! sent: every client `session.update` and `response.create` goes upstream with its
//! output limit lowered to the output allowance last reserved
//! (`realtime::with_allowance`), so a response the client asks for cannot write past
//! its own. One the backend starts on its own is bound only by the session's limit
//! (the allowance last reserved when the client sent its last `session.update`), and
//! its own allowance, reserved at its `response.created`, may be lower: what it writes
//! past it is charged in full. What a response reads is known only from its
//! `response.done` (the conversation so far, the backend's own instructions, audio):
//! each allowance counts the last response's total as its floor, and a response that
//! reads more than that passes a cap by the difference, charged in full. The allowance
//! held when the session ends is refunded; a response still running then is not
//! charged (its usage never came).
//!
//! Every session ends in exactly one audit record (`operation: realtime`, its totals,
//! its duration in `latency_ms`, `close_reason`) whatever ends it: either side closing
//! or dropping, the cap, a message over the limit, or the gateway stopping (which
//! closes every session with 1001 and waits for their records). Memory per session is
//! bounded: one message of at most `ai.limits.max_event_bytes` per direction.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::{self, CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, HeaderValue, header};
use tokio_tungstenite::tungstenite::{self, protocol::frame::coding::CloseCode};

use super::admit::{Admitted, Asked, Tokens, asked, reserve};
use super::chain::{self, Answered, Failure};
use super::drive::{self, Call, Reply, drive};
use super::drive::{Charge, Ended, Ending, Spent};
use super::error::render;
use super::models::answer_headers;
use super::record::Draft;
use crate::admission::Demand;
use crate::audit::CloseReason;
use crate::call::Operation;
use crate::config::{BackendId, Capability, Endpoint};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::protocol::openai::InvalidRequest;
use crate::realtime::{self as rt, subprotocol_key};
use crate::routing::Candidate;
use crate::routing::breaker::{Outcome, Pass};
use crate::upstream::UpstreamClient;
use crate::upstream::realtime::{BUFFER_BYTES, ConnectError, Upstream};

/// The subprotocol the gateway selects when the client offers it (OpenAI's browser
/// clients do); the key's own subprotocol is never echoed.
const SUBPROTOCOL: &str = "realtime";
/// How long a closing side is given to answer the close before its connection is
/// dropped.
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

pub(super) async fn session(
    State(gateway): State<Arc<Gateway>>,
    Query(query): Query<HashMap<String, String>>,
    upgrade: Result<WebSocketUpgrade, ws::rejection::WebSocketUpgradeRejection>,
    request: Request,
) -> Response {
    drive(gateway, Realtime { upgrade: Some(upgrade), model: query.get("model").cloned() }, request).await
}

/// The realtime door: the WebSocket upgrade asked for, and the model in the query.
struct Realtime {
    upgrade: Option<Result<WebSocketUpgrade, ws::rejection::WebSocketUpgradeRejection>>,
    model: Option<String>,
}

impl drive::Door for Realtime {
    type Refusal = GatewayError;

    fn operation(&self) -> Operation {
        Operation::Realtime
    }

    fn identify(&self, gateway: &Gateway, headers: &HeaderMap) -> Result<Caller, GatewayError> {
        authenticate(gateway, headers)
    }

    async fn call(
        &mut self,
        call: Call<'_>,
        draft: &mut Draft,
        charge: &mut Charge,
        request: Request,
    ) -> Result<Reply, GatewayError> {
        let upgrade = match self.upgrade.take() {
            Some(Ok(upgrade)) => upgrade,
            Some(Err(e)) => {
                let message = format!("GET /v1/realtime opens a WebSocket session: {e}");
                return Err(InvalidRequest { message, param: None }.into());
            }
            None => return Err(GatewayError::Internal("the realtime door was called twice".into())),
        };
        match open(call, draft, charge, request.headers(), self.model.as_ref()).await? {
            Opened::Refused(response) => {
                let ended = Ended::unserved(response.status().as_u16(), None);
                Ok(Reply::Now(response, ended))
            }
            Opened::Session(session) => Ok(Reply::Relay(Box::new(Upgrading { upgrade, session }))),
        }
    }

    fn refuse(&self, error: &GatewayError) -> Response {
        render(error, true)
    }
}

/// A session opened at the backend, the client's upgrade still to answer.
struct Upgrading {
    upgrade: WebSocketUpgrade,
    session: Box<Session>,
}

impl drive::Relay for Upgrading {
    /// The session runs, and ends its draft, in the upgraded connection's task.
    fn respond(self: Box<Self>, ending: Ending, _: Option<super::Deadline>) -> Response {
        let Upgrading { upgrade, session } = *self;
        let limit = ending.gateway().config.ai.limits.max_event_bytes;
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        let headers = answer_headers(&session.candidate, session.soft);
        let mut response = upgrade
            .protocols([SUBPROTOCOL])
            .max_message_size(limit)
            .max_frame_size(limit)
            .read_buffer_size(BUFFER_BYTES)
            .write_buffer_size(BUFFER_BYTES)
            .on_upgrade(move |socket| session.run(socket, ending));
        for (name, value) in headers {
            response.headers_mut().insert(name, value);
        }
        response
    }
}

/// The caller, by `Authorization: Bearer` or, for a browser, by the key in the
/// `openai-insecure-api-key.` subprotocol.
fn authenticate(gateway: &Gateway, headers: &HeaderMap) -> Result<Caller, GatewayError> {
    if headers.contains_key(header::AUTHORIZATION) {
        return Ok(gateway.keys.authenticate(headers)?);
    }
    let Some(key) = headers.get(header::SEC_WEBSOCKET_PROTOCOL).and_then(subprotocol_key) else {
        return Ok(gateway.keys.authenticate(headers)?);
    };
    let mut with_key = headers.clone();
    let mut bearer = HeaderValue::from_str(&format!("Bearer {key}"))
        .map_err(|_| GatewayError::Identity(crate::identity::IdentityError::UnknownKey))?;
    bearer.set_sensitive(true);
    with_key.insert(header::AUTHORIZATION, bearer);
    Ok(gateway.keys.authenticate(&with_key)?)
}

enum Opened {
    Session(Box<Session>),
    /// The backend's own refusal of the handshake (a 4xx), relayed as is.
    Refused(Response),
}

struct Session {
    candidate: Candidate,
    /// The backend's breaker pass: a session the backend drops counts against it.
    pass: Pass,
    upstream: Upstream,
    soft: bool,
}

/// Everything before the upgrade: the request read, routed, a response's allowance
/// reserved (given back once the session runs), the backend's session opened (the
/// route tried in order, `chain`).
async fn open(
    call: Call<'_>,
    draft: &mut Draft,
    charge: &mut Charge,
    headers: &HeaderMap,
    model: Option<&String>,
) -> Result<Opened, GatewayError> {
    let (gateway, caller) = (call.gateway, call.caller);
    let model = model.filter(|m| !m.is_empty()).ok_or_else(|| InvalidRequest {
        message: "GET /v1/realtime needs the model to open a session with: `?model=NAME`".into(),
        param: Some("model"),
    })?;
    InvalidRequest::check_bounded("model", model, crate::call::MAX_MODEL_BYTES)?;
    draft.request(Capability::Realtime, model, None);
    let Asked { sensitive, criticality, residency } = asked(gateway, caller, headers, draft)?;
    let demand = Demand {
        capability: Capability::Realtime,
        prompt_tokens: 0,
        max_tokens: None,
        choices: 1,
        completes: true,
        stream: true,
        sensitive,
        affinity: None,
        prefix: None,
        criticality,
        residency,
        entry: None,
    };
    let Admitted { route, soft, .. } =
        reserve(call, draft, charge, Tokens { demand: &demand, prompt_typical: 0 }).await?;
    let limit = usize::try_from(gateway.config.ai.limits.max_event_bytes).unwrap_or(usize::MAX);
    let door = Connect { gateway, model, limit };
    let served = chain::attempt_chain(gateway, draft, charge, &route, &door).await?;
    match served.value {
        Connected::Refused { status, body } => {
            let mut response = (status, body).into_response();
            for (name, value) in answer_headers(&served.candidate, soft) {
                response.headers_mut().insert(name, value);
            }
            Ok(Opened::Refused(response))
        }
        Connected::Session(upstream) => {
            // The opening's reservation is now the session's (given back as it starts).
            let backend = &served.candidate.backend;
            *charge = std::mem::take(charge).into_turns(gateway, call.caller, call.run, &call.request_id.0, backend);
            Ok(Opened::Session(Box::new(Session {
                candidate: served.candidate,
                pass: served.pass,
                upstream: *upstream,
                soft,
            })))
        }
    }
}

/// The realtime door's attempt: the backend's own WebSocket session opened.
struct Connect<'a> {
    gateway: &'a Gateway,
    /// The model the client asked for.
    model: &'a str,
    /// `ai.limits.max_event_bytes`: the largest message read from the backend.
    limit: usize,
}

impl<'a> chain::Attempt for Connect<'a> {
    type Target = (&'a Endpoint, chain::Reached<'a>);
    /// The model served.
    type Prepared = String;
    type Answer = Connected;

    fn reach(&self, backend: &BackendId) -> Option<(Self::Target, std::time::Duration)> {
        chain::endpoint(self.gateway, backend)
    }

    fn prepare(&self, (endpoint, _): &Self::Target) -> Result<(String, String), GatewayError> {
        let served = endpoint.served_model(self.model);
        Ok((served.clone(), served))
    }

    fn attempt(
        &self,
        (_, client): &Self::Target,
        served: String,
        draft: &Draft,
    ) -> impl std::future::Future<Output = Result<Answered<Connected>, Failure>> + Send {
        let (client, limit): (&UpstreamClient, _) = (client, self.limit);
        let (trace, caller) = (draft.trace(), draft.caller());
        async move {
            match client.connect_realtime(&served, trace, caller, limit).await {
                Ok(upstream) => {
                    Ok(Answered { value: Connected::Session(Box::new(upstream)), outcome: Some(Outcome::Success) })
                }
                // The backend's own refusal (a 4xx): the caller's answer, relayed as is.
                Err(ConnectError::Status { status, body }) if status.is_client_error() => {
                    let outcome = Outcome::Status { status: status.as_u16(), retry_after: None };
                    Ok(Answered { value: Connected::Refused { status, body }, outcome: Some(outcome) })
                }
                Err(ConnectError::Status { status, .. }) => {
                    Err(Failure::Status { status: status.as_u16(), retry_after: None })
                }
                Err(ConnectError::Call(e)) => Err(Failure::Head(e)),
            }
        }
    }
}

/// What a backend answered the session's handshake.
enum Connected {
    Session(Box<Upstream>),
    /// Its own refusal (a 4xx).
    Refused {
        status: http::StatusCode,
        body: Bytes,
    },
}

impl Session {
    /// The session, from the upgrade to its record.
    async fn run(mut self, mut client: WebSocket, mut ending: Ending) {
        let gateway = ending.gateway().clone();
        let open = gateway.sessions.open();
        // The opening's reservation was the check that a response fits: an idle
        // session holds nothing (SPEC §15).
        ending.release_turn().await;
        ending.first_byte();
        let end = self.proxy(&mut client, open.stop.clone(), &mut ending).await;
        if let Some((code, reason)) = rt::close_frame(end) {
            close(&mut client, code, reason).await;
        }
        let upstream_ended = matches!(end, CloseReason::UpstreamClosed | CloseReason::UpstreamError);
        if !upstream_ended {
            let frame = tungstenite::protocol::CloseFrame { code: CloseCode::Normal, reason: "".into() };
            let _ = tokio::time::timeout(CLOSE_GRACE, self.upstream.close(Some(frame))).await;
        }
        if end == CloseReason::UpstreamError {
            self.pass.tell(&Outcome::ConnectionError);
        }
        gateway.metrics.realtime_session_ended(Some(self.candidate.backend.as_str()), end.as_str());
        let status = http::StatusCode::SWITCHING_PROTOCOLS.as_u16();
        let ended = Ended { status, code: end.error_code(), spent: Spent::Session(end), finish_reasons: Vec::new() };
        ending.end(ended).await;
        drop(open);
    }

    /// Forwards messages both ways until one side ends the session.
    async fn proxy(
        &mut self,
        client: &mut WebSocket,
        mut stop: tokio::sync::watch::Receiver<bool>,
        ending: &mut Ending,
    ) -> CloseReason {
        let stopping = async move {
            if stop.wait_for(|stop| *stop).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::pin!(stopping);
        // A client's `response.create` admitted (its allowance held), its
        // `response.created` still to come.
        let mut asked = false;
        // The response running on the allowance held: its id, from its
        // `response.created` to its `response.done`.
        let mut running: Option<String> = None;
        // The responses the gateway refused as they started: being cancelled, their
        // events are not relayed.
        let mut cancelling: Vec<String> = Vec::new();
        loop {
            tokio::select! {
                () = &mut stopping => return CloseReason::Shutdown,
                from_client = client.recv() => {
                    let message = match from_client {
                        None => return CloseReason::ClientClosed,
                        Some(Err(e)) if too_large(&e) => {
                            return CloseReason::MessageTooLarge;
                        }
                        Some(Err(_)) => return CloseReason::ClientClosed,
                        Some(Ok(message)) => message,
                    };
                    // A response asked for while a window is full: refused with an
                    // `error` event, the session kept open (SPEC §14). One asked for
                    // while another runs reserves nothing: the backend refuses it (one
                    // active response at a time), and one it starts all the same is
                    // cancelled as it starts (below).
                    if let Message::Text(text) = &message
                        && running.is_none()
                        && rt::is_response_create(text.as_str())
                    {
                        match admit(ending).await {
                            Ok(()) => asked = true,
                            Err(Refused::Event(event)) => {
                                if client.send(Message::Text(event.into())).await.is_err() {
                                    return CloseReason::ClientClosed;
                                }
                                continue;
                            }
                            Err(Refused::End(reason)) => return reason,
                        }
                    }
                    let message = match message {
                        Message::Text(text) => match rt::with_allowance(text.as_str(), allowance(ending)) {
                            Some(bounded) => tungstenite::Message::Text(bounded.into()),
                            None => match tungstenite::Utf8Bytes::try_from(Bytes::from(text)) {
                                Ok(text) => tungstenite::Message::Text(text),
                                Err(_) => continue,
                            },
                        },
                        Message::Binary(data) => tungstenite::Message::Binary(data),
                        Message::Close(frame) => {
                            let frame = frame.map(|f| tungstenite::protocol::CloseFrame {
                                code: CloseCode::from(f.code),
                                reason: f.reason.as_str().into(),
                            });
                            let _ = tokio::time::timeout(CLOSE_GRACE, self.upstream.close(frame)).await;
                            // Reading on sends the client's WebSocket's own answer to
                            // its close, and sees the connection end.
                            drain(client).await;
                            return CloseReason::ClientClosed;
                        }
                        // Answered by each side's own WebSocket.
                        Message::Ping(_) | Message::Pong(_) => continue,
                    };
                    if self.upstream.send(message).await.is_err() {
                        return CloseReason::UpstreamError;
                    }
                }
                from_upstream = self.upstream.next() => {
                    let message = match from_upstream {
                        None => return CloseReason::UpstreamError,
                        Some(Err(tungstenite::Error::Capacity(_))) => {
                            tracing::warn!(backend = %self.candidate.backend, "realtime backend sent a message over ai.limits.max_event_bytes");
                            return CloseReason::MessageTooLarge;
                        }
                        Some(Err(e)) => {
                            tracing::warn!(backend = %self.candidate.backend, "realtime backend dropped the session: {e}");
                            return CloseReason::UpstreamError;
                        }
                        Some(Ok(message)) => message,
                    };
                    let (message, event) = match message {
                        tungstenite::Message::Text(text) => {
                            // A refused response's events are not relayed; what its
                            // `response.done` reports it used is charged all the same.
                            if let Some(at) = cancelling.iter().position(|id| rt::of_response(text.as_str(), id)) {
                                if let rt::Event::Done { usage, .. } = rt::read_event(text.as_str()) {
                                    cancelling.swap_remove(at);
                                    if let Some(usage) = usage
                                        && let Err(e) = ending.turn(usage, false).await
                                    {
                                        tracing::error!("realtime session: a cancelled response could not be charged: {e}");
                                        return CloseReason::Internal;
                                    }
                                }
                                continue;
                            }
                            let event = rt::read_event(text.as_str());
                            match ws::Utf8Bytes::try_from(Bytes::from(text)) {
                                Ok(text) => (Message::Text(text), event),
                                Err(_) => continue,
                            }
                        }
                        tungstenite::Message::Binary(data) => (Message::Binary(data), rt::Event::Other),
                        tungstenite::Message::Close(frame) => {
                            // The backend's own close, relayed as it is.
                            let frame = frame.map(|f| CloseFrame { code: f.code.into(), reason: f.reason.as_str().into() });
                            let _ = tokio::time::timeout(CLOSE_GRACE, client.send(Message::Close(frame))).await;
                            drain(client).await;
                            return CloseReason::UpstreamClosed;
                        }
                        tungstenite::Message::Ping(_) | tungstenite::Message::Pong(_) | tungstenite::Message::Frame(_) => continue,
                    };
                    let mut charged = false;
                    match event {
                        // A response the client asked for holds its allowance already.
                        // One the backend started on its own (server voice activity
                        // detection) runs only on an allowance reserved now, before any
                        // of it is relayed; refused, it is cancelled and the client told
                        // why, the session kept open (SPEC §14). One that starts while
                        // another runs is cancelled the same way: a session holds one
                        // response's allowance at a time.
                        rt::Event::Created { id } => {
                            let refusal = if running.is_some() {
                                let why = "a response is already running in this session; the gateway runs one at a time";
                                Some(rt::refusal_event(crate::call::ErrorCode::InvalidRequest, why))
                            } else if std::mem::take(&mut asked) {
                                None
                            } else {
                                match admit(ending).await {
                                    Ok(()) => None,
                                    Err(Refused::Event(refusal)) => Some(refusal),
                                    Err(Refused::End(reason)) => return reason,
                                }
                            };
                            match refusal {
                                None => running = Some(id),
                                Some(refusal) => {
                                    let cancel = tungstenite::Message::Text(rt::cancel_event(&id).into());
                                    if self.upstream.send(cancel).await.is_err() {
                                        return CloseReason::UpstreamError;
                                    }
                                    cancelling.push(id);
                                    if client.send(Message::Text(refusal.into())).await.is_err() {
                                        return CloseReason::ClientClosed;
                                    }
                                    continue;
                                }
                            }
                        }
                        // A response is charged before its `response.done` is relayed: a
                        // client that leaves as it ends is billed for it all the same,
                        // and one that reads it finds it in the ledger. The running
                        // response settles the allowance held for it; any other (none
                        // held for it) is charged what it reports, counting no request.
                        // Nothing is reserved for the next one until it is asked for or
                        // started.
                        rt::Event::Done { id, usage } => {
                            let admitted = running.is_some() && (id.is_none() || id == running);
                            if admitted {
                                running = None;
                            }
                            match usage {
                                Some(usage) => {
                                    if let Err(e) = ending.turn(usage, admitted).await {
                                        tracing::error!("realtime session: a response could not be charged: {e}");
                                        return CloseReason::Internal;
                                    }
                                    charged = true;
                                }
                                // A response that reports no usage used nothing billable:
                                // its allowance goes back.
                                None if admitted => ending.release_turn().await,
                                None => {}
                            }
                        }
                        // The backend refused what the client sent before the response
                        // it asked for started (that `response.create` likely): its
                        // allowance goes back, reserved again if the response starts.
                        // While a response runs, the allowance held is that response's,
                        // kept.
                        rt::Event::Error if running.is_none() && std::mem::take(&mut asked) => {
                            ending.release_turn().await
                        }
                        _ => {}
                    }
                    // A client that stops reading holds this send; the stop signal
                    // still ends the session (recorded) rather than leaving it to be
                    // cut when the runtime stops.
                    tokio::select! {
                        biased;
                        sent = client.send(message) => {
                            if sent.is_err() {
                                return CloseReason::ClientClosed;
                            }
                        }
                        () = &mut stopping => return CloseReason::Shutdown,
                    }
                    if charged && let Some(pace) = ending.turns().and_then(|turns| turns.pace) {
                        let event = rt::rate_limits_updated(&pace, crate::budget::period::unix_now());
                        if client.send(Message::Text(event.into())).await.is_err() {
                            return CloseReason::ClientClosed;
                        }
                    }
                }
            }
        }
    }
}

/// Why a response may not run.
enum Refused {
    /// Past a limit (or its run ended): the `error` event the client is told, the
    /// session kept open.
    Event(String),
    /// The session must end: a hard cap reached, or the ledger failing.
    End(CloseReason),
}

/// Holds the allowance of a response about to run, reserved in the current minute.
async fn admit(ending: &mut Ending) -> Result<(), Refused> {
    match ending.ready_turn().await {
        Ok(()) => Ok(()),
        Err(
            refused @ (GatewayError::RateLimited { .. }
            | GatewayError::BackendQuota { .. }
            | GatewayError::RunEnded { .. }
            | GatewayError::InvalidRequest(_)),
        ) => Err(Refused::Event(rt::refusal_event(refused.code(), &refused.to_string()))),
        Err(GatewayError::BudgetExceeded { .. }) => Err(Refused::End(CloseReason::BudgetExceeded)),
        Err(e) => {
            tracing::error!("realtime session: the next response's allowance could not be reserved: {e}");
            Err(Refused::End(CloseReason::Internal))
        }
    }
}

/// The output allowance a session holds: the most a response may be told to write.
fn allowance(ending: &Ending) -> u64 {
    ending.turns().map_or(0, |turns| turns.allowance)
}

/// Sends a close frame to the client and gives it a moment to answer.
async fn close(client: &mut WebSocket, code: u16, reason: &'static str) {
    let frame = CloseFrame { code, reason: ws::Utf8Bytes::from_static(reason) };
    if tokio::time::timeout(CLOSE_GRACE, client.send(Message::Close(Some(frame)))).await.is_ok() {
        drain(client).await;
    }
}

/// Reads what the client still sends until its close arrives (or the grace ends).
async fn drain(client: &mut WebSocket) {
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        while let Some(Ok(message)) = client.recv().await {
            if matches!(message, Message::Close(_)) {
                break;
            }
        }
    })
    .await;
}

fn too_large(error: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(s) = source {
        if matches!(s.downcast_ref::<tungstenite::Error>(), Some(tungstenite::Error::Capacity(_))) {
            return true;
        }
        source = s.source();
    }
    false
}
