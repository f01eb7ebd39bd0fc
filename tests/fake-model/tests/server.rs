//! The fake model server over real loopback HTTP, driven by reqwest as the
//! gateway would drive it.
#![cfg(test)]

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

/// Read a body frame by frame until it ends (`Ok`) or fails (`Err` with what
/// came before the failure).
async fn read_to_end_or_error(response: reqwest::Response) -> Result<Vec<u8>, Vec<u8>> {
    let mut body = Vec::new();
    let mut frames = response.bytes_stream();
    while let Some(frame) = frames.next().await {
        match frame {
            Ok(bytes) => body.extend_from_slice(&bytes),
            Err(_) => return Err(body),
        }
    }
    Ok(body)
}

/// Read a body until it has been silent for `quiet`; `None` if it ended or
/// failed instead of going silent.
async fn read_until_silent(
    frames: &mut (impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    quiet: Duration,
) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        match tokio::time::timeout(quiet, frames.next()).await {
            Err(_silent) => return Some(body),
            Ok(Some(Ok(bytes))) => body.extend_from_slice(&bytes),
            Ok(Some(Err(_)) | None) => return None,
        }
    }
}

fn scenario_from(text: &str) -> Scenario {
    text.parse().unwrap()
}

#[tokio::test]
async fn words_sets_the_reply_length_and_the_limit_still_cuts_it() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("words=500"));
    let body: Value = post(&url, "/chat/completions", &chat_body("hi")).await.json().await.unwrap();
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    let expected: Vec<String> = (1..=500).map(|i| format!("w{i}")).collect();
    assert_eq!(content, expected.join(" "));
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["completion_tokens"], 500);

    let mut limited = chat_body("hi");
    limited["max_tokens"] = json!(10);
    let body: Value = post(&url, "/chat/completions", &limited).await.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], expected[..10].join(" "));
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 10);

    // Streamed, the pieces add up to the same words.
    let events = stream_events(&url, &streamed(json!({"max_completion_tokens": 10}))).await;
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let content: String = chunks[1..6].iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap()).collect();
    assert_eq!(content, expected[..10].join(" "));
    assert_eq!(chunks[6]["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn ignore_limit_overshoots_max_tokens() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("words=500,ignore_limit"));
    let mut body = chat_body("hi");
    body["max_tokens"] = json!(10);
    body["max_completion_tokens"] = json!(20);
    let body: Value = post(&url, "/chat/completions", &body).await.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"].as_str().unwrap().split(' ').count(), 500);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["completion_tokens"], 500);

    // Without `words`, the echo is not cut either.
    let url = fake.scenario_url(&scenario_from("ignore_limit"));
    let mut body = chat_body("hi");
    body["max_tokens"] = json!(3);
    let body: Value = post(&url, "/chat/completions", &body).await.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello from fake-model! You said: hi");
    assert_eq!(body["usage"]["completion_tokens"], 6);
}

#[tokio::test]
async fn n_answers_with_n_choices_and_counts_their_tokens() {
    let fake = FakeModel::start().await.unwrap();
    let mut request = chat_body("Say hello to the fake model please");
    request["n"] = json!(3);
    let body: Value = post(&fake.url(), "/chat/completions", &request).await.json().await.unwrap();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["message"]["content"], "Hello from fake-model! You said: Say hello to the fake model please");
        assert_eq!(choice["finish_reason"], "stop");
    }
    assert_eq!(body["usage"], json!({"prompt_tokens": 16, "completion_tokens": 36, "total_tokens": 52}));

    let events =
        stream_events(&fake.url(), &streamed(json!({"n": 3, "stream_options": {"include_usage": true}}))).await;
    assert_eq!(events.len(), 3 * (1 + 5 + 1) + 1 + 1, "{events:#?}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let (usage, per_choice) = chunks.split_last().unwrap();
    assert_eq!(usage["usage"], json!({"prompt_tokens": 16, "completion_tokens": 36, "total_tokens": 52}));
    for index in 0..3 {
        let mine: Vec<&Value> =
            per_choice.iter().map(|c| &c["choices"][0]).filter(|choice| choice["index"] == index).collect();
        assert_eq!(mine.len(), 1 + 5 + 1, "choice {index}");
        assert_eq!(mine[0]["delta"]["role"], "assistant");
        let content: String = mine[1..6].iter().map(|c| c["delta"]["content"].as_str().unwrap()).collect();
        assert_eq!(content, "Hello from fake-model! You said: Say hello to the fake model please");
        assert_eq!(mine[6]["finish_reason"], "stop");
    }
    assert!(per_choice.iter().all(|c| c["choices"].as_array().unwrap().len() == 1));

    for n in [0, 129] {
        let mut request = chat_body("hi");
        request["n"] = json!(n);
        let response = post(&fake.url(), "/chat/completions", &request).await;
        assert_eq!(response.status(), 400);
        assert_eq!(response.json::<Value>().await.unwrap()["error"]["param"], "n");
    }
}

#[tokio::test]
async fn cut_body_sends_half_the_announced_body_then_aborts() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("cut_body"));
    let response = post(&url, "/chat/completions", &chat_body("hi")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let announced: usize = response.headers()["content-length"].to_str().unwrap().parse().unwrap();
    let received = read_to_end_or_error(response).await.expect_err("the body ended cleanly");

    assert_eq!(received.len(), announced / 2);
    let text = String::from_utf8(received).unwrap();
    assert!(text.starts_with(r#"{"choices":[{"#) || text.starts_with(r#"{"id":"chatcmpl-fake-"#), "{text}");
    // A prefix of a JSON document: it only lacks its end.
    assert!(serde_json::from_str::<Value>(&text).unwrap_err().is_eof(), "{text}");

    // Every JSON answer, not only chat.
    let response = reqwest::get(format!("{url}/models")).await.unwrap();
    assert!(read_to_end_or_error(response).await.is_err());
}

#[tokio::test]
async fn stall_body_sends_half_the_announced_body_then_nothing() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("stall_body"));
    let response = post(&url, "/chat/completions", &chat_body("hi")).await;
    assert_eq!(response.status(), 200);
    let announced: usize = response.headers()["content-length"].to_str().unwrap().parse().unwrap();
    let mut frames = response.bytes_stream();
    let received = read_until_silent(&mut frames, Duration::from_millis(500)).await.expect("the body ended");
    assert_eq!(received.len(), announced / 2);
    assert!(serde_json::from_slice::<Value>(&received).unwrap_err().is_eof());

    // Shutting the server down releases the stalled body, as a failure.
    drop(fake);
    let next = tokio::time::timeout(Duration::from_secs(2), frames.next()).await.unwrap();
    assert!(matches!(next, Some(Err(_))), "{next:?}");
}

#[tokio::test]
async fn first_event_delay_sends_the_head_first() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("first_event_delay_ms=400"));
    let response = post(&url, "/chat/completions", &streamed(json!({}))).await;
    let head_at = Instant::now();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut frames = response.bytes_stream();
    let first = frames.next().await.unwrap().unwrap();
    let waited = head_at.elapsed();
    assert!(waited >= Duration::from_millis(300), "the first event came {waited:?} after the head");
    assert!(first.starts_with(b"data: {"), "{first:?}");
    let first: Value = serde_json::from_str(&sse_data(std::str::from_utf8(&first).unwrap())[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
}

#[tokio::test]
async fn first_content_delay_holds_back_the_first_content_chunk() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("first_content_delay_ms=400"));
    let response = post(&url, "/chat/completions", &streamed(json!({}))).await;
    assert_eq!(response.status(), 200);
    let mut frames = response.bytes_stream();
    let role = tokio::time::timeout(Duration::from_millis(300), frames.next()).await.expect("no role chunk at once");
    let role_at = Instant::now();
    let role = sse_data(std::str::from_utf8(&role.unwrap().unwrap()).unwrap());
    assert_eq!(role.len(), 1, "{role:#?}");
    let role: Value = serde_json::from_str(&role[0]).unwrap();
    assert_eq!(role["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));

    let rest = frames.next().await.unwrap().unwrap();
    let waited = role_at.elapsed();
    assert!(waited >= Duration::from_millis(300), "the first content came {waited:?} after the role chunk");
    let content: Value = serde_json::from_str(&sse_data(std::str::from_utf8(&rest).unwrap())[0]).unwrap();
    assert!(!content["choices"][0]["delta"]["content"].as_str().unwrap().is_empty());
}

#[tokio::test]
async fn stall_after_sends_some_chunks_then_never_ends() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("stall_after=2"));
    let response = post(&url, "/chat/completions", &streamed(json!({}))).await;
    assert_eq!(response.status(), 200);
    let mut frames = response.bytes_stream();
    let received = read_until_silent(&mut frames, Duration::from_millis(500)).await.expect("the stream ended");
    let events = sse_data(&String::from_utf8(received).unwrap());
    assert_eq!(events.len(), 1 + 2, "{events:#?}");
    let chunks: Vec<Value> = events.iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[1..].iter().all(|c| c["choices"][0]["delta"]["content"].is_string()));

    drop(fake);
    let next = tokio::time::timeout(Duration::from_secs(2), frames.next()).await.unwrap();
    assert!(matches!(next, Some(Err(_))), "{next:?}");
}

#[tokio::test]
async fn malformed_at_replaces_one_event_and_the_stream_goes_on() {
    let fake = FakeModel::start().await.unwrap();
    for index in [0, 1, 6] {
        let url = fake.scenario_url(&Scenario { malformed_at: Some(index), ..Default::default() });
        let events = stream_events(&url, &streamed(json!({}))).await;
        assert_eq!(events.len(), 1 + 5 + 1 + 1, "{events:#?}");
        assert_eq!(events[index], "{this is not json");
        assert_eq!(events.last().unwrap(), "[DONE]");
        let parsed = events[..7].iter().filter(|e| serde_json::from_str::<Value>(e).is_ok()).count();
        assert_eq!(parsed, 6, "only event {index} is broken");
    }
}

#[tokio::test]
async fn no_done_ends_the_stream_cleanly_without_done() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("no_done"));
    let response = post(&url, "/chat/completions", &streamed(json!({"stream_options": {"include_usage": true}}))).await;
    let body = read_to_end_or_error(response).await.expect("the stream failed");
    let events = sse_data(&String::from_utf8(body).unwrap());
    assert_eq!(events.len(), 1 + 5 + 1 + 1, "{events:#?}");
    assert!(events.iter().all(|e| serde_json::from_str::<Value>(e).is_ok()), "{events:#?}");
    let usage: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 12);
}

/// Read `limit` bytes of a body that should not end, then drop it.
async fn read_endless(response: reqwest::Response, limit: usize) -> Vec<u8> {
    let mut body = Vec::new();
    let mut frames = response.bytes_stream();
    while body.len() < limit {
        body.extend_from_slice(&frames.next().await.expect("the endless line ended").unwrap());
    }
    body
}

#[tokio::test]
async fn endless_line_never_ends_its_first_line() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("endless_line"));
    let response = post(&url, "/chat/completions", &streamed(json!({}))).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let body = read_endless(response, 1 << 20).await;
    assert!(body.starts_with(b"data: xxxx"));
    assert!(!body.contains(&b'\n'));
    assert!(body[6..].iter().all(|b| *b == b'x'));

    let response = post(&url, "/chat/completions", &chat_body("hi")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    assert!(response.headers().get("content-length").is_none());
    let body = read_endless(response, 1 << 20).await;
    assert!(body.starts_with(br#"{"id":"xxxx"#));
    assert!(!body.contains(&b'\n'));

    // Dropping the readers leaves the server serving.
    let response = post(&fake.url(), "/chat/completions", &chat_body("hi")).await;
    assert_eq!(response.status(), 200);
}

#[tokio::test]
async fn huge_mb_answers_with_megabytes_of_content() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("huge_mb=2"));
    let mut request = chat_body("Say hello to the fake model please");
    request["max_tokens"] = json!(1);
    let response = post(&url, "/chat/completions", &request).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    assert!(response.headers().get("content-length").is_none(), "not chunked");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(content.len(), 2 << 20);
    assert!(content.bytes().all(|b| b == b'a'));
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"], json!({"prompt_tokens": 16, "completion_tokens": 1, "total_tokens": 17}));

    let response = post(&url, "/chat/completions", &streamed(json!({"stream_options": {"include_usage": true}}))).await;
    assert_eq!(response.status(), 200);
    let mut frames = 0;
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(frame) = stream.next().await {
        body.extend_from_slice(&frame.unwrap());
        frames += 1;
    }
    assert!(frames > 2, "the stream came in {frames} frames");
    let events = sse_data(&String::from_utf8(body).unwrap());
    assert_eq!(events.len(), 1 + 1 + 1 + 1 + 1, "role, content, finish, usage, [DONE]");
    let content: Value = serde_json::from_str(&events[1]).unwrap();
    let content = content["choices"][0]["delta"]["content"].as_str().unwrap();
    assert_eq!(content.len(), 2 << 20);
    assert!(content.bytes().all(|b| b == b'a'));
    let usage: Value = serde_json::from_str(&events[3]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 1);
    assert_eq!(events[4], "[DONE]");
}

#[tokio::test]
async fn flap_alternates_failure_and_success() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&scenario_from("flap"));
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(post(&url, "/chat/completions", &chat_body("hi")).await.status().as_u16());
        // Requests without the flag do not take a turn.
        assert_eq!(post(&fake.url(), "/chat/completions", &chat_body("hi")).await.status(), 200);
    }
    assert_eq!(statuses, [503, 200, 503, 200]);

    let response = post(&url, "/chat/completions", &chat_body("hi")).await;
    assert_eq!(response.status(), 503);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "fake_error");
    assert_eq!(body["error"]["code"], "flap");
}
