//! The request handler: strip the scenario prefix, record, misbehave as asked,
//! then answer like an OpenAI-compatible server.
//!
//! One fallback handler serves every path so that the `/s/<scenario>` prefix
//! works for every endpoint, unknown ones included. Invariant: every request
//! is recorded before anything else happens (delay, hang, error), so a test
//! can always see what the gateway sent, even when the fake never answers.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::RecordedRequest;
use crate::openai::{self, ChatRequest, Meta, Reply};
use crate::scenario::{Scenario, ScenarioError};

/// Before aborting a cut stream, give hyper time to flush the chunks already
/// sent: an error queued right behind data makes it drop the connection with
/// that data still buffered.
const CUT_GRACE: Duration = Duration::from_millis(20);

/// State shared by all requests of one server.
pub(crate) struct Shared {
    recorded: Mutex<Vec<RecordedRequest>>,
    next_id: AtomicU64,
    /// Flipped to `true` once, when the owning `FakeModel` is dropped.
    shutdown: watch::Sender<bool>,
}

impl Shared {
    pub(crate) fn new() -> Arc<Shared> {
        Arc::new(Shared {
            recorded: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
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
    body: Bytes,
) -> Response {
    let (scenario, path) = split_scenario(uri.path());
    let json = serde_json::from_slice::<Value>(&body).ok();
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
    let scenario = match scenario {
        Ok(scenario) => scenario,
        Err(e) => return ApiError::invalid("invalid_scenario", e.to_string()).into_response(),
    };
    let mut response = respond(&shared, &scenario, &method, path, json).await;
    if let Some(seconds) = scenario.retry_after {
        response.headers_mut().insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
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

async fn respond(shared: &Shared, scenario: &Scenario, method: &Method, path: &str, body: Option<Value>) -> Response {
    if scenario.hang {
        shared.wait_for_shutdown().await;
        let message = "fake-model shut down while hanging";
        return ApiError::fake(StatusCode::SERVICE_UNAVAILABLE, message, "shutdown").into_response();
    }
    if let Some(ms) = scenario.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let status = scenario.status.map(|s| StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR));
    if let Some(status) = status.filter(|s| !s.is_success()) {
        let code = status.as_u16();
        let message = format!("fake-model injected status {code}");
        return ApiError::fake(status, message, format!("injected_{code}")).into_response();
    }
    if scenario.garbage {
        return ([(CONTENT_TYPE, "application/json")], "this is not json").into_response();
    }
    let mut response = match (method.as_str(), path) {
        ("POST", "/v1/chat/completions") => chat(shared, scenario, body).into_response(),
        ("POST", "/v1/embeddings") => embeddings(body).into_response(),
        ("GET", "/v1/models") => Json(openai::models()).into_response(),
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

fn chat(shared: &Shared, scenario: &Scenario, body: Option<Value>) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(body)?;
    let model = request.model.clone().ok_or_else(ApiError::missing_model)?;
    let reply = Reply::for_request(&request);
    let meta = Meta {
        id: format!("chatcmpl-fake-{}", shared.next_id.fetch_add(1, Ordering::Relaxed)),
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model,
    };
    if !request.wants_stream() {
        return Ok(Json(openai::completion(&meta, &reply, !scenario.no_usage)).into_response());
    }
    let with_usage = request.wants_usage_chunk() && !scenario.no_usage;
    let chunks = openai::stream_chunks(&meta, &reply, scenario.content_chunks(), with_usage);
    Ok(stream(chunks, scenario))
}

/// Serve the chunks as SSE, each event its own body frame, paced by
/// `chunk_delay_ms`; `cut_after` ends the body with an error instead of
/// `[DONE]`, which hyper turns into an incomplete chunked body.
fn stream(chunks: Vec<Value>, scenario: &Scenario) -> Response {
    let mut frames: Vec<Bytes> = chunks
        .iter()
        .map(|chunk| Bytes::from(format!("data: {chunk}\n\n")))
        .chain([Bytes::from_static(b"data: [DONE]\n\n")])
        .collect();
    let cut = scenario.cut_after.map(|n| n.min(scenario.content_chunks()));
    if let Some(n) = cut {
        frames.truncate(1 + n); // the role chunk, then n content chunks
    }
    let pause = Duration::from_millis(scenario.chunk_delay_ms.unwrap_or(0));
    let (tx, rx) = mpsc::channel::<Result<Bytes, io::Error>>(1);
    tokio::spawn(async move {
        for (i, frame) in frames.into_iter().enumerate() {
            if i > 0 && !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            if tx.send(Ok(frame)).await.is_err() {
                return; // the client went away
            }
        }
        if cut.is_some() {
            tokio::time::sleep(pause.max(CUT_GRACE)).await;
            let abort = io::Error::new(io::ErrorKind::ConnectionAborted, "fake-model: cut_after");
            let _ = tx.send(Err(abort)).await;
        }
    });
    let headers = [(CONTENT_TYPE, "text/event-stream"), (CACHE_CONTROL, "no-cache")];
    (headers, Body::from_stream(ReceiverStream::new(rx))).into_response()
}

fn embeddings(body: Option<Value>) -> Result<Response, ApiError> {
    let request: Value = parse(body)?;
    let model = request["model"].as_str().ok_or_else(ApiError::missing_model)?;
    let inputs = openai::embedding_inputs(&request["input"]).ok_or_else(|| ApiError {
        param: Some("input"),
        ..ApiError::invalid("invalid_request", "input must be a string, strings, or token arrays")
    })?;
    Ok(Json(openai::embeddings(model, &inputs)).into_response())
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
