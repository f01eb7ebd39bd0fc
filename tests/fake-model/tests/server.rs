//! The fake model server over real loopback HTTP, driven by reqwest as the
//! gateway would drive it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use fake_model::{FakeModel, Scenario};
use futures_util::StreamExt;
use serde_json::{Value, json};

fn chat_body(user: &str) -> Value {
    json!({
        "model": "fake-chat",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": user},
        ],
    })
}

async fn post(base: &str, path: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new().post(format!("{base}{path}")).json(body).send().await.unwrap()
}

/// The `data:` payloads of an SSE body, in order.
fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| event.strip_prefix("data: ").expect(event).to_owned())
        .collect()
}

fn streamed(extra: Value) -> Value {
    let mut body = chat_body("Say hello to the fake model please");
    body["stream"] = json!(true);
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

async fn stream_events(base: &str, body: &Value) -> Vec<String> {
    let response = post(base, "/chat/completions", body).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    sse_data(&response.text().await.unwrap())
}

#[tokio::test]
async fn chat_returns_a_completion_with_deterministic_usage() {
    let fake = FakeModel::start().await.unwrap();
    let response = post(&fake.url(), "/chat/completions", &chat_body("Say hello to the fake model please")).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();

    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-fake-"));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "fake-chat");
    assert!(body["created"].as_u64().unwrap() > 0);
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "Hello from fake-model! You said: Say hello to the fake model please");
    assert_eq!(choice["finish_reason"], "stop");
    // prompt: 3 + 7 words, plus 3 per message; completion: 12 words.
    assert_eq!(body["usage"], json!({"prompt_tokens": 16, "completion_tokens": 12, "total_tokens": 28}));
}

#[tokio::test]
async fn chat_joins_text_parts_and_keeps_40_characters() {
    let fake = FakeModel::start().await.unwrap();
    let body = json!({
        "model": "fake-vision",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this picture of a lighthouse"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "in great detail please"},
        ]}],
    });
    let body: Value = post(&fake.url(), "/chat/completions", &body).await.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "Hello from fake-model! You said: Describe this picture of a lighthouse in"
    );
    assert_eq!(body["model"], "fake-vision");
    assert_eq!(body["usage"]["prompt_tokens"], 10 + 3);
}

#[tokio::test]
async fn max_tokens_cuts_the_reply_with_finish_reason_length() {
    let fake = FakeModel::start().await.unwrap();
    for limit in ["max_tokens", "max_completion_tokens"] {
        let mut body = chat_body("hi");
        body[limit] = json!(3);
        let body: Value = post(&fake.url(), "/chat/completions", &body).await.json().await.unwrap();
        assert_eq!(body["choices"][0]["message"]["content"], "Hello from fake-model!");
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        assert_eq!(body["usage"]["completion_tokens"], 3);
    }
}

#[tokio::test]
async fn malformed_requests_get_openai_error_envelopes() {
    let fake = FakeModel::start().await.unwrap();
    let response = reqwest::Client::new()
        .post(format!("{}/chat/completions", fake.url()))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "invalid_json");
    assert_eq!(body["error"]["param"], Value::Null);

    let response = post(&fake.url(), "/chat/completions", &json!({"messages": []})).await;
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["param"], "model");
}

#[tokio::test]
async fn stream_sends_role_content_and_finish_chunks_then_done() {
    let fake = FakeModel::start().await.unwrap();
    let events = stream_events(&fake.url(), &streamed(json!({}))).await;

    assert_eq!(events.len(), 1 + 5 + 1 + 1, "{events:#?}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..7].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"] && c.get("usage").is_none()));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks[1..6].iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap()).collect();
    assert_eq!(content, "Hello from fake-model! You said: Say hello to the fake model please");
    assert_eq!(chunks[6]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[6]["choices"][0]["delta"], json!({}));
}

#[tokio::test]
async fn stream_sends_a_usage_chunk_only_when_asked() {
    let fake = FakeModel::start().await.unwrap();
    let asked = streamed(json!({"stream_options": {"include_usage": true}}));
    let scenario = Scenario { chunks: Some(2), ..Default::default() };
    let events = stream_events(&fake.scenario_url(&scenario), &asked).await;

    assert_eq!(events.len(), 1 + 2 + 1 + 1 + 1, "{events:#?}");
    let usage: Value = serde_json::from_str(&events[4]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], json!({"prompt_tokens": 16, "completion_tokens": 12, "total_tokens": 28}));
    assert_eq!(events[5], "[DONE]");

    let not_asked = streamed(json!({"stream_options": {"include_usage": false}}));
    let events = stream_events(&fake.scenario_url(&scenario), &not_asked).await;
    assert_eq!(events.len(), 1 + 2 + 1 + 1);
}

#[tokio::test]
async fn no_usage_suppresses_usage_streamed_or_not() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&Scenario { no_usage: true, ..Default::default() });
    let asked = streamed(json!({"stream_options": {"include_usage": true}}));
    let events = stream_events(&url, &asked).await;
    assert!(events.iter().all(|e| !e.contains("total_tokens")), "{events:#?}");
    assert_eq!(events.last().unwrap(), "[DONE]");

    let body: Value = post(&url, "/chat/completions", &chat_body("hi")).await.json().await.unwrap();
    assert!(body.get("usage").is_none());
}

#[tokio::test]
async fn stream_chunks_are_paced_by_chunk_delay() {
    let fake = FakeModel::start().await.unwrap();
    let scenario = Scenario { chunk_delay_ms: Some(200), chunks: Some(3), ..Default::default() };
    let response = post(&fake.scenario_url(&scenario), "/chat/completions", &streamed(json!({}))).await;

    let mut arrivals = Vec::new();
    let mut body = Vec::new();
    let mut frames = response.bytes_stream();
    while let Some(frame) = frames.next().await {
        body.extend_from_slice(&frame.unwrap());
        arrivals.push(Instant::now());
    }
    let end = Instant::now();
    assert!(arrivals.len() > 1, "the stream arrived in one piece");
    assert!(end - arrivals[0] >= Duration::from_millis(150), "first frame came {:?} before the end", end - arrivals[0]);
    assert_eq!(sse_data(&String::from_utf8(body).unwrap()).len(), 1 + 3 + 1 + 1);
}

#[tokio::test]
async fn cut_after_aborts_the_stream_without_done() {
    let fake = FakeModel::start().await.unwrap();
    let scenario = Scenario { cut_after: Some(2), ..Default::default() };
    let response = post(&fake.scenario_url(&scenario), "/chat/completions", &streamed(json!({}))).await;
    assert_eq!(response.status(), 200);

    let mut body = Vec::new();
    let mut frames = response.bytes_stream();
    let mut failed = false;
    while let Some(frame) = frames.next().await {
        match frame {
            Ok(bytes) => body.extend_from_slice(&bytes),
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    assert!(failed, "the client saw a clean end of body");
    let events = sse_data(&String::from_utf8(body).unwrap());
    assert_eq!(events.len(), 1 + 2, "{events:#?}");
    assert!(!events.iter().any(|e| e == "[DONE]"));
}

#[tokio::test]
async fn injected_status_has_error_envelope_and_retry_after() {
    let fake = FakeModel::start().await.unwrap();
    let scenario = Scenario { status: Some(429), retry_after: Some(7), ..Default::default() };
    let url = fake.scenario_url(&scenario);
    assert!(url.ends_with("/s/status=429,retry_after=7/v1"), "{url}");

    let response = post(&url, "/chat/completions", &chat_body("hi")).await;
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "7");
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body,
        json!({"error": {
            "message": "fake-model injected status 429",
            "type": "fake_error",
            "param": null,
            "code": "injected_429",
        }})
    );

    // The prefix applies to every endpoint.
    let scenario = Scenario { status: Some(503), ..Default::default() };
    let response = reqwest::get(format!("{}/models", fake.scenario_url(&scenario))).await.unwrap();
    assert_eq!(response.status(), 503);
    assert!(response.headers().get("retry-after").is_none());
}

#[tokio::test]
async fn delay_postpones_the_response_head() {
    let fake = FakeModel::start().await.unwrap();
    let scenario = Scenario { delay_ms: Some(300), ..Default::default() };
    let started = Instant::now();
    let response = reqwest::get(format!("{}/models", fake.scenario_url(&scenario))).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(response.status(), 200);
}

#[tokio::test]
async fn garbage_is_a_200_whose_body_is_not_json() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&Scenario { garbage: true, ..Default::default() });
    let response = post(&url, "/chat/completions", &chat_body("hi")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let text = response.text().await.unwrap();
    assert_eq!(text, "this is not json");
    assert!(serde_json::from_str::<Value>(&text).is_err());
}

#[tokio::test]
async fn hang_never_answers_but_other_requests_proceed() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&Scenario { hang: true, ..Default::default() });
    let client = reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap();
    let hanging = client.post(format!("{url}/chat/completions")).json(&chat_body("hi")).send();
    let meanwhile = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        reqwest::get(format!("{}/models", fake.url())).await.unwrap().status()
    };
    let (hung, other) = tokio::join!(hanging, meanwhile);
    assert!(hung.unwrap_err().is_timeout());
    assert_eq!(other, 200);
    assert_eq!(fake.request_count(), 2, "the hanging request is recorded all the same");
}

#[tokio::test]
async fn dropping_the_server_releases_hanging_requests() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&Scenario { hang: true, ..Default::default() });
    let hanging = tokio::spawn(reqwest::get(format!("{url}/models")));
    while fake.request_count() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(fake);
    let answer = tokio::time::timeout(Duration::from_secs(2), hanging).await;
    assert_eq!(answer.unwrap().unwrap().unwrap().status(), 503);
}

#[tokio::test]
async fn embeddings_are_deterministic_per_input() {
    let fake = FakeModel::start().await.unwrap();
    let body = json!({"model": "fake-embed", "input": ["the same text", "other", "the same text"]});
    let response = post(&fake.url(), "/embeddings", &body).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();

    assert_eq!(body["object"], "list");
    assert_eq!(body["model"], "fake-embed");
    assert_eq!(body["usage"], json!({"prompt_tokens": 7, "total_tokens": 7}));
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert_eq!(data[1]["object"], "embedding");
    assert_eq!(data[1]["index"], 1);
    assert_eq!(data[0]["embedding"].as_array().unwrap().len(), 8);
    assert_eq!(data[0]["embedding"], data[2]["embedding"]);
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);

    let single: Value =
        post(&fake.url(), "/embeddings", &json!({"model": "m", "input": "other"})).await.json().await.unwrap();
    assert_eq!(single["data"][0]["embedding"], data[1]["embedding"]);

    let response = post(&fake.url(), "/embeddings", &json!({"model": "m", "input": 3})).await;
    assert_eq!(response.status(), 400);
}

#[tokio::test]
async fn models_lists_the_fake_models() {
    let fake = FakeModel::start().await.unwrap();
    let body: Value = reqwest::get(format!("{}/models", fake.url())).await.unwrap().json().await.unwrap();
    assert_eq!(
        body,
        json!({"object": "list", "data": [
            {"id": "fake-chat", "object": "model", "created": 0, "owned_by": "fake-model"},
            {"id": "fake-embed", "object": "model", "created": 0, "owned_by": "fake-model"},
        ]})
    );
}

#[tokio::test]
async fn records_every_request_in_order_with_headers() {
    let fake = FakeModel::start().await.unwrap();
    let failing = fake.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    let client = reqwest::Client::new();
    client
        .post(format!("{}/chat/completions", fake.url()))
        .bearer_auth("sk-backend")
        .header("X-Custom", "Value")
        .json(&chat_body("hi"))
        .send()
        .await
        .unwrap();
    let response = client.post(format!("{failing}/embeddings")).body("raw").send().await.unwrap();
    assert_eq!(response.status(), 500);
    client.get(format!("{}/models", fake.url())).send().await.unwrap();

    let recorded = fake.requests();
    assert_eq!(fake.request_count(), 3);
    assert_eq!(recorded[0].method, "POST");
    assert_eq!(recorded[0].path, "/v1/chat/completions");
    assert_eq!(recorded[0].header("authorization"), Some("Bearer sk-backend"));
    assert_eq!(recorded[0].header("x-custom"), Some("Value"));
    assert_eq!(recorded[0].body, chat_body("hi"));
    assert_eq!(recorded[1].path, "/v1/embeddings", "recorded without the scenario prefix");
    assert_eq!(recorded[1].body, Value::Null);
    assert_eq!(recorded[2].method, "GET");
    assert_eq!(recorded[2].path, "/v1/models");
}

#[tokio::test]
async fn unknown_routes_and_scenarios_are_refused() {
    let fake = FakeModel::start().await.unwrap();
    let response = reqwest::get(format!("{}/nope", fake.url())).await.unwrap();
    assert_eq!(response.status(), 404);
    let response = reqwest::get(format!("{}/chat/completions", fake.url())).await.unwrap();
    assert_eq!(response.status(), 405);

    let base = fake.url().replace("/v1", "/s/stauts=500/v1");
    let response = reqwest::get(format!("{base}/models")).await.unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_scenario");
}
