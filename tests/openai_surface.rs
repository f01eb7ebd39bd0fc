//! The OpenAI surface end to end: the real binary, a fake model server on loopback.

use std::time::{Duration, Instant};

use flexway_testkit::*;
use futures_util::StreamExt;
use serde_json::{Value, json};

#[tokio::test]
async fn serves_a_chat_completion_with_request_id_and_backend_headers() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let response = gw.chat(KEY, hello("fake-chat")).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers()["flexway-request-id"].to_str().unwrap().starts_with("req_"));
    assert_eq!(response.headers()["flexway-backend"], "main");
    assert!(response.headers().get("flexway-degraded").is_none());
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert!(body["choices"][0]["message"]["content"].as_str().unwrap().contains("hello there"));
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn every_response_carries_a_distinct_request_id() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let mut ids = std::collections::BTreeSet::new();
    for path in ["/healthz", "/v1/models", "/nope", "/v1/nope"] {
        let r = client().get(format!("{}{path}", gw.url)).bearer_auth(KEY).send().await.unwrap();
        ids.insert(r.headers()["flexway-request-id"].to_str().unwrap().to_owned());
    }
    let r = gw.chat("wrong-key", hello("m")).await;
    ids.insert(r.headers()["flexway-request-id"].to_str().unwrap().to_owned());
    assert_eq!(ids.len(), 5);
}

#[tokio::test]
async fn the_callers_key_never_travels_upstream() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    assert_eq!(gw.chat(KEY, hello("fake-chat")).await.status(), 200);
    let seen = &model.requests()[0];
    assert_eq!(seen.path, "/v1/chat/completions");
    for (name, value) in &seen.headers {
        assert!(!value.contains(KEY), "caller key leaked upstream in header {name}");
    }
    assert!(seen.headers.iter().all(|(n, _)| n != "authorization"), "auth: none sends no Authorization");
    assert!(!seen.body.to_string().contains(KEY));
}

#[tokio::test]
async fn streams_chunk_by_chunk_as_the_upstream_produces_them() {
    let model = FakeModel::start().await.unwrap();
    let slow = model.scenario_url(&Scenario { chunk_delay_ms: Some(300), chunks: Some(4), ..Default::default() });
    let gw = Flexway::start(&one_backend(&slow));
    let started = Instant::now();
    let response = gw
        .chat(KEY, json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "one two three"}]}))
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.bytes_stream();
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.unwrap();
        arrivals.push(started.elapsed());
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let first = arrivals[0];
    let last = *arrivals.last().unwrap();
    // The upstream takes >= 4 x 300 ms; the first chunk must not wait for the end.
    assert!(last >= Duration::from_millis(1000), "stream ended after {last:?}");
    assert!(last - first >= Duration::from_millis(800), "first chunk at {first:?}, last at {last:?}: buffered");
    assert!(arrivals.len() >= 4, "expected several body frames, got {}", arrivals.len());
    assert!(text.trim_end().ends_with("data: [DONE]"));
}

#[tokio::test]
async fn hides_the_usage_chunk_from_a_client_that_did_not_ask() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let response =
        gw.chat(KEY, json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]})).await;
    let (events, error) = sse_data(response).await;
    assert!(error.is_none());
    assert_eq!(events.last().unwrap(), "[DONE]");
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        assert!(chunk["usage"].is_null(), "usage shown to a client that did not ask: {event}");
    }
    // ... while the backend was asked for it.
    assert_eq!(model.requests()[0].body["stream_options"]["include_usage"], true);
}

#[tokio::test]
async fn shows_the_usage_chunk_to_a_client_that_asked() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let body = json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hi"}]});
    let (events, _) = sse_data(gw.chat(KEY, body).await).await;
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(usage["choices"].as_array().unwrap().is_empty());
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn a_mid_stream_break_ends_with_an_error_event_not_done() {
    let model = FakeModel::start().await.unwrap();
    let cut = model.scenario_url(&Scenario { cut_after: Some(2), ..Default::default() });
    let gw = Flexway::start(&one_backend(&cut));
    let response =
        gw.chat(KEY, json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(response.status(), 200);
    let (events, transport_error) = sse_data(response).await;
    assert!(transport_error.is_none(), "the gateway ends its stream cleanly with an error event");
    assert!(!events.iter().any(|e| e == "[DONE]"), "a broken stream must not end with [DONE]: {events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_error");
    let content_chunks = events.iter().filter(|e| e.contains("\"content\"")).count();
    assert!(content_chunks >= 2, "the chunks before the cut were relayed: {events:?}");
}

#[tokio::test]
async fn serves_embeddings_through_the_embeddings_backend() {
    let model = FakeModel::start().await.unwrap();
    let ai = format!(
        "  default_backend: chat\n  capabilities: {{embeddings: embed}}\n  backends:\n    chat:\n      url: {u}\n    embed:\n      url: {u}\n      capabilities: [embeddings]\n      default_model: fake-embed\n",
        u = model.url()
    );
    let gw = Flexway::start(&config(&ai));
    let response =
        gw.post("/v1/embeddings", KEY, json!({"model": "anything", "input": ["a b", "c"]})).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["flexway-backend"], "embed");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    assert_eq!(model.requests()[0].body["model"], "fake-embed");
}

#[tokio::test]
async fn embeddings_without_an_embeddings_backend_is_capability_unavailable() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let response = gw.post("/v1/embeddings", KEY, json!({"model": "e", "input": "x"})).send().await.unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "capability_unavailable");
    assert_eq!(model.request_count(), 0);
}

#[tokio::test]
async fn healthz_answers_json() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let response = client().get(format!("{}/healthz", gw.url)).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["status"], "ok");
}
