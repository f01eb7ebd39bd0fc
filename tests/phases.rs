//! The call's phases in process: the gateway's router driven as a tower service
//! (`tower::ServiceExt::oneshot`, no listening socket of the gateway's own), beside
//! the black-box tests that go through `flexway serve`. Time is paused: a backend
//! timeout of a production size (60 s) passes in virtual time, so a test of a stall
//! waits for no clock, and the virtual clock says which deadline ended the call. The
//! model server is real, on loopback: the network is mocked at the edge only.
#![cfg(test)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http;
use flexway::audit::sinks::MemoryAuditSink;
use flexway_testkit::*;
use http_body_util::BodyExt as _;
use serde_json::{Value, json};
use tower::ServiceExt as _;

const TIMEOUT: Duration = Duration::from_secs(60);

struct Case {
    app: axum::Router,
    gateway: Arc<flexway::Gateway>,
    audit: Arc<MemoryAuditSink>,
    model: FakeModel,
}

/// Backend `first` (the scenario, healthy when empty, a 60 s timeout) falling back to `second` (a healthy
/// one) when `fallback` is set, on a 1,000-token daily cap.
async fn case(fault: &str, fallback: bool) -> Case {
    let model = FakeModel::start().await.unwrap();
    let fallback = if fallback { "fallback: [second], " } else { "" };
    let ai = format!(
        "  default_backend: first\n  backends:\n    first: {{url: \"{}\", timeout: 60s, {fallback}price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}\n    second: {{url: \"{}\", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}\n",
        if fault.is_empty() { model.url() } else { scenario(&model, fault) },
        model.url()
    );
    let (adapters, audit) = memory_adapters();
    let gateway = gateway(&acme_config("{tokens_per_day: 1000}", &ai), adapters).await;
    Case { app: flexway::http::app(gateway.clone()), gateway, audit, model }
}

fn chat(key: Option<&str>, body: &Value) -> http::Request<Body> {
    let mut request = http::Request::post("/v1/chat/completions").header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    request.body(Body::from(body.to_string())).unwrap()
}

fn hello_stream(stream: bool) -> Value {
    json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hello there"}]})
}

/// The call's status, headers and body, read whole.
async fn call(case: &Case, request: http::Request<Body>) -> (http::StatusCode, http::HeaderMap, String) {
    let response = case.app.clone().oneshot(request).await.unwrap();
    let (head, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (head.status, head.headers, String::from_utf8(bytes.to_vec()).unwrap())
}

impl Case {
    /// The audit's one record, with nothing reserved left and the ledger equal to it.
    async fn one_record(&self) -> flexway::audit::AuditRecord {
        let records = self.audit.records();
        assert_eq!(records.len(), 1, "{records:?}");
        assert_eq!(self.gateway.budgets.live_reservations().await.unwrap(), 0, "nothing left reserved");
        records[0].clone()
    }
}

/// Identify and admit refuse before any backend is called: no key is a 401, a call
/// whose prompt alone is over the cap a 429, each in the OpenAI envelope, recorded,
/// with nothing reserved.
#[tokio::test(start_paused = true)]
async fn identify_and_admit_refuse_before_any_backend_is_called() {
    let case = case("", false).await;
    let (status, _, body) = call(&case, chat(None, &hello_stream(false))).await;
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status.as_u16(), body["error"]["code"].as_str()), (401, Some("invalid_api_key")), "{body}");

    let greedy = json!({"model": "m", "messages": [{"role": "user", "content": "hello ".repeat(2000)}]});
    let (status, _, body) = call(&case, chat(Some(KEY), &greedy)).await;
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status.as_u16(), body["error"]["code"].as_str()), (429, Some("budget_exceeded")), "{body}");
    assert_eq!(case.model.request_count(), 0, "no backend was called");
    let record = case.one_record().await;
    assert_eq!((record.status, record.prompt_tokens, record.cost_micro_eur), (429, 0, 0));
    assert_eq!(record.error_code.map(|c| c.as_str()), Some("budget_exceeded"));
}

/// Attempt and fall back: a backend that stalls before its answer is in is given its
/// whole timeout (60 s of virtual time), then the next candidate serves; the record
/// names the one that served and bills it once.
#[tokio::test(start_paused = true)]
async fn a_backend_stalled_past_its_timeout_falls_back_after_exactly_that_timeout() {
    let case = case("stall_body", true).await;
    let started = tokio::time::Instant::now();
    let (status, headers, body) = call(&case, chat(Some(KEY), &hello_stream(false))).await;
    let waited = started.elapsed();
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["flexway-backend"], "second");
    assert!(waited >= TIMEOUT, "the stalled backend had its whole timeout: {waited:?}");
    let record = case.one_record().await;
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((record.backend.as_deref(), record.degraded), (Some("second"), true));
    assert_eq!(record.prompt_tokens + record.completion_tokens, body["usage"]["total_tokens"].as_u64().unwrap());
}

/// Relay and settle: a stream that stalls after its first content is ended, at its
/// backend's timeout, with an error event in the stream; what was relayed is billed
/// and the rest of the reservation given back.
#[tokio::test(start_paused = true)]
async fn a_stream_stalled_mid_way_ends_at_its_timeout_billed_for_what_was_sent() {
    let case = case("stall_after=2", false).await;
    let started = tokio::time::Instant::now();
    let (status, _, body) = call(&case, chat(Some(KEY), &hello_stream(true))).await;
    let waited = started.elapsed();
    assert_eq!(status, 200);
    assert!(waited >= TIMEOUT, "ended by the timeout, not before: {waited:?}");
    let events: Vec<&str> =
        body.split("\n\n").filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: "))).collect();
    assert!(events.iter().any(|e| e.contains("\"content\"")), "content was relayed first: {events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_error", "{events:?}");
    let record = case.one_record().await;
    assert_eq!(record.error_code.map(|c| c.as_str()), Some("upstream_error"));
    assert!(record.completion_tokens > 0, "what was relayed is billed: {record:?}");
}
