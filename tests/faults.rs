//! Faults after the response head (SPEC §5, §11): the gateway's router over loopback,
//! a memory ledger and audit to look into, and the fake model server misbehaving.
//!
//! For each fault: the status the client sees, `Flexway-Degraded`, whether it fell
//! back, the failing backend's breaker, the ledger (exact: the served call's usage,
//! nothing for an attempt that never reached the client), and one audit record.
#![cfg(test)]

use std::time::Instant;

use flexway::audit::UsageSource;
use flexway::config::BackendId;
use flexway::metrics::BreakerState;
use flexway_testkit::*;
use serde_json::{Value, json};

/// Backend `bad` (the scenario, 1 s timeout, a breaker that opens on one failure)
/// falling back to `good` when `fallback` is set.
fn config_for(bad: &str, good: &str, fallback: bool) -> String {
    let fallback = if fallback { "fallback: [good], " } else { "" };
    let ai = format!(
        r#"  default_backend: bad
  backends:
    bad: {{url: "{bad}", timeout: 1s, {fallback}price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}},
           circuit_breaker: {{failures: 1, interval: 1m, trip: 1m}}}}
    good: {{url: "{good}", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}"#
    );
    acme_config("{tokens_per_day: 100000}", &ai)
}

struct Case {
    gw: InProcess,
    audit: std::sync::Arc<flexway::audit::sinks::MemoryAuditSink>,
    _model: FakeModel,
}

async fn start(fault: &str, fallback: bool) -> Case {
    let model = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&config_for(&scenario(&model, fault), &model.url(), fallback), adapters).await;
    Case { gw, audit, _model: model }
}

impl Case {
    fn breaker(&self, backend: &str) -> BreakerState {
        self.gw.gateway.breakers.state(&BackendId::new(backend), Instant::now())
    }

    /// The one audit record, and the ledger equal to its tokens; no reservation left.
    async fn one_record(&self) -> flexway::audit::AuditRecord {
        let records = self.audit.records();
        assert_eq!(records.len(), 1, "{records:?}");
        let record = records[0].clone();
        let ledger = self.gw.ledger("acme", None).await;
        assert_eq!(ledger[0], record.prompt_tokens + record.completion_tokens, "ledger = audit: {record:?}");
        assert_eq!(ledger[2], record.cost_micro_eur, "euros ledger = audit");
        assert_eq!(self.gw.live_reservations().await, 0);
        record
    }
}

fn chat(stream: bool) -> Value {
    json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hello there"}]})
}

fn header<'a>(response: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    response.headers().get(name).map(|v| v.to_str().unwrap())
}

/// A fault before the client's first byte falls back: the answer is `good`'s, whole.
async fn falls_back(fault: &str, stream: bool) {
    let case = start(fault, true).await;
    let response = case.gw.chat(KEY, chat(stream)).await;
    assert_eq!(response.status(), 200, "{fault}");
    assert_eq!(header(&response, "flexway-backend"), Some("good"), "{fault}");
    assert_eq!(header(&response, "flexway-degraded"), Some("backend-fallback"), "{fault}");
    let tokens = if stream {
        let (events, error) = sse_data(response).await;
        assert_eq!(error, None, "{fault}");
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{fault}: {events:?}");
        assert!(events.iter().all(|e| !e.contains("\"error\"") && !e.contains("not json")), "{fault}: {events:?}");
        None
    } else {
        let body: Value = response.json().await.unwrap();
        Some(body["usage"]["total_tokens"].as_u64().unwrap())
    };
    assert_eq!(case.breaker("bad"), BreakerState::Open, "{fault}: the failure counted");
    let record = case.one_record().await;
    assert_eq!((record.status, record.backend.as_deref(), record.degraded), (200, Some("good"), true), "{fault}");
    assert_eq!(record.error_code, None);
    assert_eq!(record.usage_source, UsageSource::Reported, "{fault}");
    if let Some(tokens) = tokens {
        assert_eq!(record.prompt_tokens + record.completion_tokens, tokens, "billed what good served, once");
    }
}

#[tokio::test]
async fn a_non_streamed_body_cut_half_way_falls_back() {
    falls_back("cut_body", false).await;
}

#[tokio::test]
async fn a_non_streamed_body_that_stalls_falls_back() {
    falls_back("stall_body", false).await;
}

#[tokio::test]
async fn a_garbage_answer_falls_back() {
    falls_back("garbage", false).await;
}

#[tokio::test]
async fn a_stream_whose_first_event_is_late_falls_back() {
    falls_back("first_event_delay_ms=2000", true).await;
}

#[tokio::test]
async fn a_stream_whose_first_token_is_late_falls_back() {
    // The role chunk comes at once; the first content does not within the timeout.
    falls_back("first_content_delay_ms=2000", true).await;
}

#[tokio::test]
async fn a_stream_cut_before_its_first_content_falls_back() {
    falls_back("cut_after=0", true).await;
}

#[tokio::test]
async fn a_stream_stalled_before_its_first_content_falls_back() {
    falls_back("stall_after=0", true).await;
}

#[tokio::test]
async fn a_malformed_first_event_falls_back() {
    falls_back("malformed_at=0", true).await;
}

/// A fault after the client's first byte: no fallback; an in-band error event and no
/// `[DONE]`; the breaker counts it; settled on what was relayed and recorded.
async fn breaks_mid_stream(fault: &str) {
    let case = start(fault, true).await;
    let response = case.gw.chat(KEY, chat(true)).await;
    assert_eq!(response.status(), 200, "{fault}");
    assert_eq!(header(&response, "flexway-backend"), Some("bad"), "{fault}");
    assert_eq!(header(&response, "flexway-degraded"), None, "{fault}");
    let (events, _) = sse_data(response).await;
    assert!(!events.iter().any(|e| e == "[DONE]"), "{fault}: a broken stream never ends clean: {events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_error", "{fault}");
    assert!(events.iter().any(|e| e.contains("\"content\":\"Hello")), "{fault}: content was relayed first");
    assert_eq!(case.breaker("bad"), BreakerState::Open, "{fault}: a failure after the first byte counts");
    let record = case.one_record().await;
    assert_eq!((record.status, record.backend.as_deref()), (200, Some("bad")), "{fault}");
    assert_eq!(record.error_code.map(|c| c.as_str()), Some("upstream_error"), "{fault}");
    assert!(record.completion_tokens > 0, "{fault}: what was relayed is billed");
}

#[tokio::test]
async fn a_stream_cut_after_its_first_content_ends_with_an_error_event() {
    breaks_mid_stream("cut_after=2").await;
}

#[tokio::test]
async fn a_stream_that_stalls_mid_way_ends_with_an_error_event() {
    breaks_mid_stream("stall_after=2").await;
}

#[tokio::test]
async fn a_malformed_event_mid_stream_ends_with_an_error_event_not_done() {
    breaks_mid_stream("malformed_at=2").await;
}

#[tokio::test]
async fn a_stream_without_done_ends_with_an_error_event() {
    let case = start("no_done", true).await;
    let response = case.gw.chat(KEY, chat(true)).await;
    assert_eq!(response.status(), 200);
    let (events, _) = sse_data(response).await;
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_error");
    assert_eq!(case.breaker("bad"), BreakerState::Open);
    let record = case.one_record().await;
    assert_eq!(record.error_code.map(|c| c.as_str()), Some("upstream_error"));
    // The usage chunk came before the end: the settlement is exact.
    assert_eq!(record.usage_source, UsageSource::Reported);
}

#[tokio::test]
async fn without_a_fallback_a_cut_body_is_503_refunded_and_recorded() {
    let case = start("cut_body", false).await;
    let response = case.gw.chat(KEY, chat(false)).await;
    assert_eq!(response.status(), 503);
    assert_eq!(header(&response, "flexway-error-cause"), Some("upstream_failed"));
    assert_eq!(header(&response, "flexway-backends-tried"), Some("bad"));
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_unavailable");
    let record = case.one_record().await;
    assert_eq!((record.status, record.prompt_tokens, record.cost_micro_eur), (503, 0, 0), "refunded in full");
}

#[tokio::test]
async fn a_timeout_after_a_fallback_is_504_naming_every_backend_tried() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let stall = scenario(&model, "stall_body");
    let hang = scenario(&model, "hang");
    let yaml = config(&format!(
        "  default_backend: first\n  backends:\n    first: {{url: \"{stall}\", timeout: 300ms, fallback: [second]}}\n    second: {{url: \"{hang}\", timeout: 300ms}}\n"
    ));
    let gw = serve_in_process(&yaml, adapters).await;
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.status(), 504);
    assert_eq!(header(&response, "flexway-backends-tried"), Some("first, second"));
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_timeout");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("tried: first, second"), "{message}");
    let records = audit.records();
    assert_eq!(records.len(), 1);
    assert_eq!((records[0].status, records[0].backend.as_deref()), (504, Some("second")));
    assert_eq!(gw.ledger("acme", None).await, [0, 0, 0]);
}

#[tokio::test]
async fn a_flapping_backend_is_taken_out_of_rotation() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let flap = scenario(&model, "flap");
    let yaml = config(&format!(
        "  default_backend: flappy\n  backends:\n    flappy: {{url: \"{flap}\", fallback: [steady], circuit_breaker: {{failures: 2, interval: 1m, trip: 1m}}}}\n    steady: {{url: \"{}\"}}\n",
        model.url()
    ));
    let gw = serve_in_process(&yaml, adapters).await;
    let mut served_by = Vec::new();
    for _ in 0..6 {
        let response = gw.chat(KEY, hello("m")).await;
        assert_eq!(response.status(), 200, "every call is served, by one or the other");
        served_by.push(header(&response, "flexway-backend").unwrap().to_owned());
    }
    // 503 (fallback), 200, 503 (fallback: the second failure trips), then skipped.
    assert_eq!(served_by, ["steady", "flappy", "steady", "steady", "steady", "steady"]);
    let state = gw.gateway.breakers.state(&BackendId::new("flappy"), Instant::now());
    assert_eq!(state, BreakerState::Open);
    assert_eq!(audit.records().len(), 6, "one record per call");
}
