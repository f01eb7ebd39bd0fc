//! The request handler: strip the scenario prefix, record, misbehave as asked,
//! then answer like an OpenAI-compatible server, or, on `/v1/messages`, like
//! Anthropic's Messages API (its errors in Anthropic's envelope too).
//!
//! One fallback handler serves every path so that the `/s/<scenario>` prefix
//! works for every endpoint, unknown ones included. Invariant: every request
//! is recorded before anything else happens (delay, hang, error), so a test
//! can always see what the gateway sent, even when the fake never answers.
//! Bodies that misbehave over time are fed by a spawned task through a
//! one-slot channel; the large ones (`huge_mb`, `endless_line`) are made frame
//! by frame as the client reads, so the fake's memory stays small. A call first
//! waits for a slot when the server has a [`Capacity`] (see [`crate::load`]);
//! `GET /metrics`, its load page, is the one request not recorded.

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::http::header::{CACHE_CONTROL, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::RecordedRequest;
use crate::anthropic::{self, MessagesRequest};
use crate::load::{Capacity, Load};
use crate::openai::{self, ChatRequest, HUGE_MARK, MAX_CHOICES, Meta, Reply};
use crate::scenario::{Scenario, ScenarioError};

/// Before aborting a cut stream, give hyper time to flush the chunks already
/// sent: an error queued right behind data makes it drop the connection with
/// that data still buffered.
const CUT_GRACE: Duration = Duration::from_millis(20);

/// The frame size of the bodies made on the fly (`huge_mb`, `endless_line`).
const BLOCK: usize = 64 * 1024;
static A_BLOCK: [u8; BLOCK] = [b'a'; BLOCK];
static X_BLOCK: [u8; BLOCK] = [b'x'; BLOCK];

const MALFORMED_EVENT: &[u8] = b"data: {this is not json\n\n";
const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";
const OVERLOADED_EVENT: &[u8] =
    b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";

/// The API a path belongs to, which decides how errors are worded.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dialect {
    OpenAi,
    Anthropic,
}

impl Dialect {
    fn of(path: &str) -> Dialect {
        if path == "/v1/messages" { Dialect::Anthropic } else { Dialect::OpenAi }
    }
}

/// State shared by all requests of one server.
pub(crate) struct Shared {
    recorded: Mutex<Vec<RecordedRequest>>,
    next_id: AtomicU64,
    /// How many requests carrying `flap` arrived so far.
    flaps: AtomicU64,
    /// Flipped to `true` once, when the owning `FakeModel` is dropped.
    shutdown: watch::Sender<bool>,
    /// Its slots and queue, and what `/metrics` reads.
    load: Load,
}

impl Shared {
    pub(crate) fn new(capacity: Option<Capacity>) -> Arc<Shared> {
        Arc::new(Shared {
            load: Load::new(capacity),
            recorded: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            flaps: AtomicU64::new(0),
            shutdown: watch::Sender::new(false),
        })
    }

    pub(crate) fn recorded(&self) -> Vec<RecordedRequest> {
        self.lock().clone()
    }

    pub(crate) fn recorded_count(&self) -> usize {
        self.lock().len()
    }

    pub(crate) fn shut_down(&self) {
        self.shutdown.send_replace(true);
    }

    fn is_shut_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Resolves once `shut_down` has been called.
    pub(crate) async fn wait_for_shutdown(&self) {
        // The sender lives in `self`, so this can only end by the flag.
        let _ = self.shutdown.subscribe().wait_for(|down| *down).await;
    }

    // A test that panicked while holding the lock must not hide the record
    // from the next assertion: recover the data from a poisoned mutex.
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RecordedRequest>> {
        self.recorded.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(crate) async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
    body: Bytes,
) -> Response {
    // A load poll is not a call: answered, never recorded.
    if method == Method::GET && uri.path() == "/metrics" {
        return ([(CONTENT_TYPE, "text/plain; version=0.0.4")], shared.load.metrics()).into_response();
    }
    let (scenario, path) = split_scenario(uri.path());
    // A realtime session records its model (the query's) as its body.
    let model = (path == "/v1/realtime").then(|| realtime_model(&uri));
    let json = match &model {
        Some(model) => Some(serde_json::json!({ "model": model })),
        None => serde_json::from_slice::<Value>(&body).ok(),
    };
    shared.lock().push(RecordedRequest {
        method: method.to_string(),
        path: path.to_owned(),
        headers: headers
            .iter()
            .map(|(name, value)| {
                let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
                (name.as_str().to_owned(), value)
            })
            .collect(),
        body: json.clone().unwrap_or(Value::Null),
    });
    let dialect = Dialect::of(path);
    let scenario = match (scenario, dialect) {
        (Ok(scenario), _) => scenario,
        (Err(e), Dialect::OpenAi) => return ApiError::invalid("invalid_scenario", e.to_string()).into_response(),
        (Err(e), Dialect::Anthropic) => {
            return AnthropicError::new(StatusCode::BAD_REQUEST, e.to_string()).into_response();
        }
    };
    if let Some(model) = model {
        return crate::realtime::respond(scenario, upgrade.ok(), model).await;
    }
    let mut scenario = scenario;
    if method == Method::POST && matches!(path, "/v1/chat/completions" | "/v1/messages" | "/v1/embeddings") {
        // On a server with slots, `delay_ms` is spent in the slot: a long call.
        let held = shared.load.serve(json.as_ref(), scenario.delay_ms.map(Duration::from_millis)).await;
        if held {
            scenario.delay_ms = None;
        }
    }
    let mut response = respond(&shared, &scenario, &method, path, &headers, json).await;
    if let Some(seconds) = scenario.retry_after {
        response.headers_mut().insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// The `model` of a realtime session's query (`?model=NAME`), empty when absent.
fn realtime_model(uri: &Uri) -> String {
    let query = uri.query().unwrap_or_default();
    let model = query.split('&').find_map(|pair| pair.strip_prefix("model=")).unwrap_or_default();
    model.replace("%2F", "/").replace("%3A", ":").replace('+', " ")
}

/// Split `/s/<scenario>/rest` into the scenario and `/rest`; other paths have
/// the default scenario.
fn split_scenario(path: &str) -> (Result<Scenario, ScenarioError>, &str) {
    let Some(rest) = path.strip_prefix("/s/") else {
        return (Ok(Scenario::default()), path);
    };
    let (encoded, inner) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    (encoded.parse(), if inner.is_empty() { "/" } else { inner })
}

async fn respond(
    shared: &Arc<Shared>,
    scenario: &Scenario,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    body: Option<Value>,
) -> Response {
    let dialect = Dialect::of(path);
    // Counted on arrival, so the turns follow the order requests came in.
    let flapping = scenario.flap && shared.flaps.fetch_add(1, Ordering::Relaxed).is_multiple_of(2);
    if scenario.hang {
        shared.wait_for_shutdown().await;
        let message = "fake-model shut down while hanging";
        return fake_error(dialect, StatusCode::SERVICE_UNAVAILABLE, message, "shutdown");
    }
    if let Some(ms) = scenario.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if flapping {
        let message = "fake-model flap: this request fails, the next one succeeds";
        return fake_error(dialect, StatusCode::SERVICE_UNAVAILABLE, message, "flap");
    }
    let status = scenario.status.map(|s| StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR));
    if let Some(status) = status.filter(|s| !s.is_success()) {
        let code = status.as_u16();
        // Anthropic's overloaded answer carries exactly this message.
        let message = match (dialect, code) {
            (Dialect::Anthropic, 529) => "Overloaded".to_owned(),
            _ => format!("fake-model injected status {code}"),
        };
        return fake_error(dialect, status, message, format!("injected_{code}"));
    }
    if scenario.garbage {
        return ([(CONTENT_TYPE, "application/json")], "this is not json").into_response();
    }
    let mut response = match (method.as_str(), path) {
        ("POST", "/v1/chat/completions") => chat(shared, scenario, body).into_response(),
        ("POST", "/v1/embeddings") => embeddings(shared, scenario, body).into_response(),
        ("GET", "/v1/models") => json_answer(shared, scenario, openai::models()),
        ("POST", "/v1/messages") => messages(shared, scenario, headers, body).into_response(),
        (_, "/v1/messages") => {
            let message = format!("{method} is not allowed on {path}");
            AnthropicError::new(StatusCode::METHOD_NOT_ALLOWED, message).into_response()
        }
        (_, "/v1/chat/completions" | "/v1/embeddings" | "/v1/models") => ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            ..ApiError::invalid("method_not_allowed", format!("{method} is not allowed on {path}"))
        }
        .into_response(),
        _ => ApiError {
            status: StatusCode::NOT_FOUND,
            ..ApiError::invalid("not_found", format!("fake-model has no route {method} {path}"))
        }
        .into_response(),
    };
    if let Some(status) = status
        && response.status().is_success()
    {
        *response.status_mut() = status;
    }
    response
}

fn chat(shared: &Arc<Shared>, scenario: &Scenario, body: Option<Value>) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(body)?;
    let model = request.model.clone().ok_or_else(ApiError::missing_model)?;
    if !(1..=MAX_CHOICES).contains(&request.choices()) {
        return Err(ApiError {
            param: Some("n"),
            ..ApiError::invalid("invalid_request", format!("n must be between 1 and {MAX_CHOICES}"))
        });
    }
    if scenario.endless_line {
        return Ok(endless_line(shared, request.wants_stream()));
    }
    let reply = match scenario.huge_mb {
        Some(_) => Reply::huge(&request),
        None => Reply::for_request(&request, scenario),
    };
    let meta = Meta {
        id: format!("chatcmpl-fake-{}", shared.next_id.fetch_add(1, Ordering::Relaxed)),
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model,
    };
    if !request.wants_stream() {
        let completion = openai::completion(&meta, &reply, !scenario.no_usage);
        return Ok(match scenario.huge_mb {
            Some(mib) => {
                let frame = Frame::new(completion.to_string(), Some(mib));
                let body = Feed::body(shared, |feed| async move {
                    feed.send_frame(frame).await;
                });
                ([(CONTENT_TYPE, "application/json")], body).into_response()
            }
            None => json_answer(shared, scenario, completion),
        });
    }
    let with_usage = request.wants_usage_chunk() && !scenario.no_usage;
    let content_chunks = if scenario.huge_mb.is_some() { 1 } else { scenario.content_chunks() };
    let steps = openai::stream_chunks(&meta, &reply, content_chunks, with_usage);
    let frames = steps
        .iter()
        .enumerate()
        .map(|(i, step)| match scenario.malformed_at {
            Some(at) if at == i => Frame::Bytes(Bytes::from_static(MALFORMED_EVENT)),
            _ => {
                let text: String = step.iter().map(|chunk| format!("data: {chunk}\n\n")).collect();
                Frame::new(text, scenario.huge_mb)
            }
        })
        .collect();
    Ok(stream(shared, scenario, frames, content_chunks, Dialect::OpenAi))
}

/// `POST /v1/messages`: validate as Anthropic does, then answer the reply as
/// a `message` or as Anthropic's stream of events.
fn messages(
    shared: &Arc<Shared>,
    scenario: &Scenario,
    headers: &HeaderMap,
    body: Option<Value>,
) -> Result<Response, AnthropicError> {
    if !headers.contains_key("anthropic-version") {
        return Err(AnthropicError::invalid("anthropic-version: header is required"));
    }
    let body = body.ok_or_else(|| AnthropicError::invalid("the request body is not valid JSON"))?;
    let request = MessagesRequest::parse(&body).map_err(AnthropicError::invalid)?;
    if scenario.endless_line {
        return Ok(endless_line(shared, request.stream));
    }
    let n = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = anthropic::Meta {
        id: format!("msg_fake_{n}"),
        tool_use_id: format!("toolu_fake_{n}"),
        model: request.model.clone(),
    };
    let reply = anthropic::Reply::for_request(&request, scenario);
    if !request.stream {
        return Ok(json_answer(shared, scenario, anthropic::message(&meta, &reply)));
    }
    let (steps, content_steps) = anthropic::stream_steps(&meta, &reply, scenario.content_chunks());
    let frames = steps
        .iter()
        .enumerate()
        .map(|(i, step)| {
            let text: String = match (scenario.malformed_at, step.first()) {
                (Some(at), Some((name, _))) if at == i => format!("event: {name}\ndata: {{this is not json\n\n"),
                _ => step.iter().map(|(name, data)| format!("event: {name}\ndata: {data}\n\n")).collect(),
            };
            Frame::Bytes(Bytes::from(text))
        })
        .collect();
    Ok(stream(shared, scenario, frames, content_steps, Dialect::Anthropic))
}

/// How a stream ends after its last frame.
#[derive(Clone, Copy)]
enum End {
    Clean,
    /// `cut_after`: an error, which hyper turns into an incomplete chunked body.
    Cut,
    /// `stall_after`: nothing more, ever.
    Stall,
}

/// Serve a stream's steps as SSE, each step its own body frame, paced by
/// the delays; then, for OpenAI, `[DONE]`; or the end the scenario asks for.
/// Frame 0 opens the stream (the role chunk, Anthropic's `message_start`),
/// the next `content_chunks` frames carry the content.
fn stream(
    shared: &Arc<Shared>,
    scenario: &Scenario,
    mut frames: Vec<Frame>,
    content_chunks: usize,
    dialect: Dialect,
) -> Response {
    // The opening, then at most every content chunk.
    let keep = |n: usize| 1 + n.min(content_chunks);
    let error_after = scenario.error_after.filter(|_| dialect == Dialect::Anthropic);
    let end = match (scenario.cut_after, scenario.stall_after, error_after) {
        (Some(n), _, _) => {
            frames.truncate(keep(n));
            End::Cut
        }
        (None, Some(n), _) => {
            frames.truncate(keep(n));
            End::Stall
        }
        (None, None, Some(n)) => {
            frames.truncate(keep(n));
            frames.push(Frame::Bytes(Bytes::from_static(OVERLOADED_EVENT)));
            End::Clean
        }
        (None, None, None) => {
            if dialect == Dialect::OpenAi && !scenario.no_done {
                frames.push(Frame::Bytes(Bytes::from_static(DONE_EVENT)));
            }
            End::Clean
        }
    };
    let millis = |ms: Option<u64>| Duration::from_millis(ms.unwrap_or(0));
    let pause = millis(scenario.chunk_delay_ms);
    let first_event = millis(scenario.first_event_delay_ms);
    let first_content = millis(scenario.first_content_delay_ms);
    let body = Feed::body(shared, move |feed| async move {
        for (i, frame) in frames.into_iter().enumerate() {
            let wait = match i {
                0 => first_event,
                1 => pause + first_content,
                _ => pause,
            };
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            if !feed.send_frame(frame).await {
                return; // the client went away
            }
        }
        match end {
            End::Clean => {}
            End::Cut => feed.abort("cut_after", pause.max(CUT_GRACE)).await,
            End::Stall => feed.stall().await,
        }
    });
    (sse_headers(), body).into_response()
}

fn sse_headers() -> [(HeaderName, &'static str); 2] {
    [(CONTENT_TYPE, "text/event-stream"), (CACHE_CONTROL, "no-cache")]
}

/// A JSON answer as the scenario shapes it: whole, endless, or half sent
/// under the full `Content-Length` and then cut or stalled.
fn json_answer(shared: &Arc<Shared>, scenario: &Scenario, answer: Value) -> Response {
    if scenario.endless_line {
        return endless_line(shared, false);
    }
    if !scenario.cut_body && !scenario.stall_body {
        return Json(answer).into_response();
    }
    let text = Bytes::from(answer.to_string());
    let length = text.len();
    let half = text.slice(..length / 2);
    let cut = scenario.cut_body;
    let body = Feed::body(shared, move |feed| async move {
        if !feed.send(half).await {
            return;
        }
        if cut {
            feed.abort("cut_body", CUT_GRACE).await;
        } else {
            feed.stall().await;
        }
    });
    ([(CONTENT_TYPE, "application/json".to_owned()), (CONTENT_LENGTH, length.to_string())], body).into_response()
}

/// A first line that never ends: `data: xxx...` as SSE, or `{"id":"xxx...`
/// as JSON, until the client goes away or the server shuts down.
fn endless_line(shared: &Arc<Shared>, sse: bool) -> Response {
    let opening: &'static [u8] = if sse { b"data: " } else { b"{\"id\":\"" };
    let body = Feed::body(shared, move |feed| async move {
        if !feed.send(Bytes::from_static(opening)).await {
            return;
        }
        loop {
            if feed.shared.is_shut_down() {
                return feed.abort("shut down", Duration::ZERO).await;
            }
            if !feed.send(Bytes::from_static(&X_BLOCK)).await {
                return;
            }
        }
    });
    if sse {
        (sse_headers(), body).into_response()
    } else {
        ([(CONTENT_TYPE, "application/json")], body).into_response()
    }
}

/// One piece of a body: bytes at hand, or a huge content made while sending.
enum Frame {
    Bytes(Bytes),
    /// `head`, then `mib` MiB of `a` in [`BLOCK`]s, then `tail`.
    Huge {
        head: Bytes,
        mib: usize,
        tail: Bytes,
    },
}

impl Frame {
    /// `text` as it is, or, with `huge_mb`, split around [`HUGE_MARK`].
    fn new(text: String, huge_mb: Option<usize>) -> Frame {
        let huge = huge_mb.and_then(|mib| text.split_once(HUGE_MARK).map(|(head, tail)| (mib, head, tail)));
        match huge {
            Some((mib, head, tail)) => Frame::Huge {
                head: Bytes::copy_from_slice(head.as_bytes()),
                mib,
                tail: Bytes::copy_from_slice(tail.as_bytes()),
            },
            None => Frame::Bytes(Bytes::from(text)),
        }
    }
}

/// The sending end of a body fed by a spawned task.
struct Feed {
    tx: mpsc::Sender<Result<Bytes, io::Error>>,
    shared: Arc<Shared>,
}

impl Feed {
    /// A body fed by `produce`, spawned. The one-slot channel makes the task
    /// wait for the client to read, so it never runs ahead of it.
    fn body<F, Fut>(shared: &Arc<Shared>, produce: F) -> Body
    where
        F: FnOnce(Feed) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(produce(Feed { tx, shared: Arc::clone(shared) }));
        Body::from_stream(ReceiverStream::new(rx))
    }

    /// Send one body frame; `false` once the client has gone away.
    async fn send(&self, bytes: Bytes) -> bool {
        self.tx.send(Ok(bytes)).await.is_ok()
    }

    async fn send_frame(&self, frame: Frame) -> bool {
        match frame {
            Frame::Bytes(bytes) => self.send(bytes).await,
            Frame::Huge { head, mib, tail } => {
                if !self.send(head).await {
                    return false;
                }
                for _ in 0..mib.saturating_mul(1024 * 1024 / BLOCK) {
                    if !self.send(Bytes::from_static(&A_BLOCK)).await {
                        return false;
                    }
                }
                self.send(tail).await
            }
        }
    }

    /// End the body with an error after `grace`: hyper drops the connection
    /// with the data still buffered if the error comes right behind it.
    async fn abort(self, why: &str, grace: Duration) {
        tokio::time::sleep(grace).await;
        let abort = io::Error::new(io::ErrorKind::ConnectionAborted, format!("fake-model: {why}"));
        let _ = self.tx.send(Err(abort)).await;
    }

    /// Send nothing more while the client waits; abort at shutdown, so the
    /// server does not wait for this body forever.
    async fn stall(self) {
        let shut_down = tokio::select! {
            () = self.shared.wait_for_shutdown() => true,
            () = self.tx.closed() => false,
        };
        if shut_down {
            self.abort("shut down while stalling", Duration::ZERO).await;
        }
    }
}

fn embeddings(shared: &Arc<Shared>, scenario: &Scenario, body: Option<Value>) -> Result<Response, ApiError> {
    let request: Value = parse(body)?;
    let model = request["model"].as_str().ok_or_else(ApiError::missing_model)?;
    let inputs = openai::embedding_inputs(&request["input"]).ok_or_else(|| ApiError {
        param: Some("input"),
        ..ApiError::invalid("invalid_request", "input must be a string, strings, or token arrays")
    })?;
    Ok(json_answer(shared, scenario, openai::embeddings(model, &inputs)))
}

/// Deserialize a JSON body (`None` when it was not JSON at all).
fn parse<T: serde::de::DeserializeOwned>(body: Option<Value>) -> Result<T, ApiError> {
    let body = body.ok_or_else(|| ApiError::invalid("invalid_json", "the request body is not valid JSON"))?;
    serde_json::from_value(body).map_err(|e| ApiError::invalid("invalid_request", format!("invalid request: {e}")))
}

/// A refusal, rendered as the OpenAI error envelope with its status.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    code: String,
    param: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    fn invalid(code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            code: code.to_owned(),
            param: None,
        }
    }

    fn missing_model() -> ApiError {
        ApiError {
            param: Some("model"),
            ..ApiError::invalid("missing_required_parameter", "you must provide a model parameter")
        }
    }

    /// A misbehaviour the scenario asked for.
    fn fake(status: StatusCode, message: impl Into<String>, code: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind: "fake_error", code: code.into(), param: None }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = openai::error(&self.message, self.kind, &self.code, self.param);
        (self.status, Json(body)).into_response()
    }
}

/// A misbehaviour the scenario asked for, worded for the API of the path.
fn fake_error(dialect: Dialect, status: StatusCode, message: impl Into<String>, code: impl Into<String>) -> Response {
    match dialect {
        Dialect::OpenAi => ApiError::fake(status, message, code).into_response(),
        Dialect::Anthropic => AnthropicError::new(status, message).into_response(),
    }
}

/// A refusal in Anthropic's envelope, its error type following the status.
#[derive(Debug)]
struct AnthropicError {
    status: StatusCode,
    message: String,
}

impl AnthropicError {
    fn new(status: StatusCode, message: impl Into<String>) -> AnthropicError {
        AnthropicError { status, message: message.into() }
    }

    /// A 400 `invalid_request_error`.
    fn invalid(message: impl Into<String>) -> AnthropicError {
        AnthropicError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let body = anthropic::error(anthropic::error_type(self.status.as_u16()), &self.message);
        (self.status, Json(body)).into_response()
    }
}
