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
async fn a_similar_model_embeds_similar_texts_close_and_counts_the_same_tokens() {
    let fake = FakeModel::start().await.unwrap();
    let input = ["What is the capital of France?", "Which city is the capital of France?", "Bake bread"];
    let body = json!({"model": "fake-embed-similar", "input": input});
    let body: Value = post(&fake.url(), "/embeddings", &body).await.json().await.unwrap();

    assert_eq!(body["model"], "fake-embed-similar");
    assert_eq!(body["usage"], json!({"prompt_tokens": 15, "total_tokens": 15}));
    let vectors: Vec<Vec<f32>> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| serde_json::from_value(d["embedding"].clone()).unwrap())
        .collect();
    assert!(vectors.iter().all(|v| v.len() == fake_model::similar::DIMENSIONS));
    assert_eq!(vectors[0], fake_model::similar::embedding(input[0]));
    let cosine = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    assert!(cosine(&vectors[0], &vectors[1]) > cosine(&vectors[0], &vectors[2]));
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

// The Anthropic Messages API: `POST {base}/v1/messages`.

fn anthropic_body(user: &str) -> Value {
    json!({
        "model": "claude-fake",
        "max_tokens": 100,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": user}],
    })
}

async fn post_messages(base: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/v1/messages"))
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", "sk-ant-fake")
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The `(event, data)` pairs of an Anthropic SSE body, in order.
fn sse_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            let (name, data) = event.split_once('\n').expect(event);
            let name = name.strip_prefix("event: ").expect(event);
            let data = data.strip_prefix("data: ").expect(event);
            (name.to_owned(), serde_json::from_str(data).expect(data))
        })
        .collect()
}

async fn messages_stream(base: &str, extra: Value) -> Vec<(String, Value)> {
    let mut body = anthropic_body("Say hello to the fake model please");
    body["stream"] = json!(true);
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    let response = post_messages(base, &body).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    sse_events(&response.text().await.unwrap())
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(name, _)| name.as_str()).collect()
}

#[tokio::test]
async fn messages_echo_in_the_messages_api_shape() {
    let fake = FakeModel::start().await.unwrap();
    assert_eq!(fake.anthropic_url(&Scenario::default()), fake.base_url());
    let response = post_messages(&fake.base_url(), &anthropic_body("Say hello to the fake model please")).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let id = body["id"].as_str().unwrap();
    assert!(id.starts_with("msg_fake_"), "{id}");
    assert_eq!(
        body,
        json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": "claude-fake",
            "content": [{"type": "text", "text": "Hello from fake-model! You said: Say hello to the fake model please"}],
            "stop_reason": "end_turn",
            "stop_sequence": null,
            // input as the OpenAI mode's prompt: system 3 + 3, user 7 + 3.
            "usage": {"input_tokens": 16, "output_tokens": 12, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        })
    );
    let recorded = fake.requests();
    assert_eq!(recorded[0].path, "/v1/messages");
    assert_eq!(recorded[0].header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(recorded[0].header("x-api-key"), Some("sk-ant-fake"));
    assert_eq!(recorded[0].body["max_tokens"], 100);
}

#[tokio::test]
async fn messages_refuse_what_anthropic_refuses_in_its_envelope() {
    let fake = FakeModel::start().await.unwrap();
    let refusal =
        |message: &str| json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}});

    let response = reqwest::Client::new()
        .post(format!("{}/v1/messages", fake.base_url()))
        .json(&anthropic_body("hi"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(response.json::<Value>().await.unwrap(), refusal("anthropic-version: header is required"));

    let cases = [
        ("stream_options", json!({"include_usage": true}), "stream_options: Extra inputs are not permitted"),
        ("n", json!(1), "n: Extra inputs are not permitted"),
        ("max_completion_tokens", json!(5), "max_completion_tokens: Extra inputs are not permitted"),
        ("max_tokens", json!(0), "max_tokens: Input should be greater than or equal to 1"),
        ("max_tokens", json!("5"), "max_tokens: Input should be a valid integer"),
        ("model", json!(7), "model: Input should be a valid string"),
        ("messages", json!([]), "messages: at least one message is required"),
        ("temperature", json!(1.5), "temperature: Input should be less than or equal to 1"),
        ("stop_sequences", json!("END"), "stop_sequences: Input should be a valid list"),
        ("tool_choice", json!({"type": "tool"}), "tool_choice.name: Field required"),
        (
            "tools",
            json!([{"name": "f", "parameters": {"type": "object"}, "strict": true}]),
            "tools.0.parameters: Extra inputs are not permitted",
        ),
        (
            "messages",
            json!([{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]),
            "messages: Unexpected role \"system\". The Messages API accepts a top-level `system` parameter, not \"system\" as an input message role.",
        ),
        (
            "messages",
            json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}]),
            "messages.0.content.0.content.0.type: `tool_use` blocks are not allowed in tool_result content",
        ),
        (
            "messages",
            json!([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "AA"}}]}]),
            "messages.0.content.0.source.media_type: Input should be image/jpeg, image/png, image/gif, image/webp",
        ),
        (
            "messages",
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]),
            "messages.1.content.0.type: `tool_result` blocks are not allowed in assistant content",
        ),
    ];
    for (key, value, message) in cases {
        let mut body = anthropic_body("hi");
        body[key] = value;
        let response = post_messages(&fake.base_url(), &body).await;
        assert_eq!(response.status(), 400, "{key}");
        assert_eq!(response.json::<Value>().await.unwrap(), refusal(message), "{key}");
    }
    let mut body = anthropic_body("hi");
    body.as_object_mut().unwrap().remove("max_tokens");
    let response = post_messages(&fake.base_url(), &body).await;
    assert_eq!(response.json::<Value>().await.unwrap(), refusal("max_tokens: Field required"));
}

#[tokio::test]
async fn messages_cut_at_max_tokens_and_before_a_stop_sequence() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.anthropic_url(&scenario_from("words=50"));
    let mut body = anthropic_body("hi");
    body["max_tokens"] = json!(10);
    let answer: Value = post_messages(&url, &body).await.json().await.unwrap();
    let expected: Vec<String> = (1..=10).map(|i| format!("w{i}")).collect();
    assert_eq!(answer["content"][0]["text"], expected.join(" "));
    assert_eq!(answer["stop_reason"], "max_tokens");
    assert_eq!(answer["stop_sequence"], Value::Null);
    assert_eq!(answer["usage"]["output_tokens"], 10);

    body["stop_sequences"] = json!(["w9", " w4 ", "w99"]);
    let answer: Value = post_messages(&url, &body).await.json().await.unwrap();
    assert_eq!(answer["content"][0]["text"], "w1 w2 w3");
    assert_eq!(answer["stop_reason"], "stop_sequence");
    assert_eq!(answer["stop_sequence"], " w4 ");
    assert_eq!(answer["usage"]["output_tokens"], 3);

    // ignore_limit overshoots, as in the OpenAI mode.
    let url = fake.anthropic_url(&scenario_from("words=50,ignore_limit"));
    body.as_object_mut().unwrap().remove("stop_sequences");
    let answer: Value = post_messages(&url, &body).await.json().await.unwrap();
    assert_eq!(answer["usage"]["output_tokens"], 50);
    assert_eq!(answer["stop_reason"], "end_turn");
}

fn with_tools(user: &str) -> Value {
    let mut body = anthropic_body(user);
    body["tools"] = json!([
        {"name": "get_weather", "description": "The weather", "input_schema": {"type": "object", "properties": {"echo": {"type": "string"}}}},
        {"name": "other", "input_schema": {"type": "object"}},
    ]);
    body
}

#[tokio::test]
async fn tool_use_calls_the_first_tool_with_the_user_text() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.anthropic_url(&scenario_from("tool_use"));
    let answer: Value = post_messages(&url, &with_tools("weather in Paris")).await.json().await.unwrap();
    let n = answer["id"].as_str().unwrap().strip_prefix("msg_fake_").unwrap();
    assert_eq!(
        answer["content"],
        json!([
            {"type": "text", "text": "I'll call get_weather."},
            {"type": "tool_use", "id": format!("toolu_fake_{n}"), "name": "get_weather", "input": {"echo": "weather in Paris"}},
        ])
    );
    assert_eq!(answer["stop_reason"], "tool_use");
    // 3 words of text, 3 of the input's JSON.
    assert_eq!(answer["usage"]["output_tokens"], 6);

    // A forced tool: that one, without a preamble; `none` or no tools: text.
    let mut body = with_tools("weather in Paris");
    body["tool_choice"] = json!({"type": "tool", "name": "other"});
    let answer: Value = post_messages(&url, &body).await.json().await.unwrap();
    assert_eq!(answer["content"].as_array().unwrap().len(), 1);
    assert_eq!(answer["content"][0]["name"], "other");
    body["tool_choice"] = json!({"type": "none"});
    let answer: Value = post_messages(&url, &body).await.json().await.unwrap();
    assert_eq!(answer["stop_reason"], "end_turn");
    let answer: Value = post_messages(&url, &anthropic_body("hi")).await.json().await.unwrap();
    assert_eq!(answer["content"][0]["type"], "text");

    // The tool's result comes back; the echo is still the user's own text.
    let mut body = with_tools("weather in Paris");
    body["messages"] = json!([
        {"role": "user", "content": "weather in Paris"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"echo": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]);
    let answer: Value = post_messages(&fake.base_url(), &body).await.json().await.unwrap();
    assert_eq!(answer["content"][0]["text"], "Hello from fake-model! You said: weather in Paris");
    // system 3 + 3, then 3 + 3, 0 + 3, 1 + 3.
    assert_eq!(answer["usage"]["input_tokens"], 6 + 6 + 3 + 4);
}

#[tokio::test]
async fn cache_reports_cache_tokens() {
    let fake = FakeModel::start().await.unwrap();
    let answer: Value =
        post_messages(&fake.anthropic_url(&scenario_from("cache")), &anthropic_body("hi")).await.json().await.unwrap();
    assert_eq!(
        answer["usage"],
        json!({"input_tokens": 10, "output_tokens": 6, "cache_creation_input_tokens": 2048, "cache_read_input_tokens": 1024})
    );
}

#[tokio::test]
async fn messages_stream_sends_anthropic_events_in_order() {
    let fake = FakeModel::start().await.unwrap();
    let events = messages_stream(&fake.base_url(), json!({})).await;
    let mut expected = vec!["message_start", "content_block_start", "ping"];
    expected.extend(["content_block_delta"; 5]);
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names(&events), expected);
    assert!(events.iter().all(|(name, data)| data["type"] == name.as_str()));

    let message = &events[0].1["message"];
    assert!(message["id"].as_str().unwrap().starts_with("msg_fake_"));
    assert_eq!(message["type"], "message");
    assert_eq!(message["role"], "assistant");
    assert_eq!(message["model"], "claude-fake");
    assert_eq!(message["content"], json!([]));
    assert_eq!(message["stop_reason"], Value::Null);
    assert_eq!(message["stop_sequence"], Value::Null);
    assert_eq!(
        message["usage"],
        json!({"input_tokens": 16, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0})
    );
    assert_eq!(
        events[1].1,
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    );
    let text: String = events[3..8]
        .iter()
        .map(|(_, data)| {
            assert_eq!(data["index"], 0);
            assert_eq!(data["delta"]["type"], "text_delta");
            data["delta"]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(text, "Hello from fake-model! You said: Say hello to the fake model please");
    assert_eq!(events[8].1, json!({"type": "content_block_stop", "index": 0}));
    assert_eq!(
        events[9].1,
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 12}})
    );
    assert_eq!(events[10].1, json!({"type": "message_stop"}));
}

#[tokio::test]
async fn messages_stream_a_tool_call_as_input_json_deltas() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.anthropic_url(&scenario_from("tool_use,chunks=3"));
    let mut body = with_tools("weather in Paris");
    body["stream"] = json!(true);
    let events = sse_events(&post_messages(&url, &body).await.text().await.unwrap());
    let mut expected = vec!["message_start", "content_block_start", "ping"];
    expected.extend(["content_block_delta"; 3]);
    expected.extend(["content_block_stop", "content_block_start"]);
    expected.extend(["content_block_delta"; 3]);
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names(&events), expected);
    let start = &events[7].1;
    assert_eq!(start["index"], 1);
    assert_eq!(start["content_block"]["type"], "tool_use");
    assert!(start["content_block"]["id"].as_str().unwrap().starts_with("toolu_fake_"));
    assert_eq!(start["content_block"]["name"], "get_weather");
    assert_eq!(start["content_block"]["input"], json!({}));
    let partial: String = events[8..11]
        .iter()
        .map(|(_, data)| {
            assert_eq!(data["delta"]["type"], "input_json_delta");
            data["delta"]["partial_json"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&partial).unwrap(), json!({"echo": "weather in Paris"}));
    assert_eq!(events[12].1["delta"]["stop_reason"], "tool_use");
}

#[tokio::test]
async fn error_after_sends_an_overloaded_event_and_ends() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.anthropic_url(&scenario_from("error_after=2"));
    let mut body = anthropic_body("hi");
    body["stream"] = json!(true);
    let response = post_messages(&url, &body).await;
    assert_eq!(response.status(), 200);
    let text = read_to_end_or_error(response).await.expect("the stream failed");
    let text = String::from_utf8(text).unwrap();
    assert!(
        text.ends_with(
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"
        ),
        "{text}"
    );
    let events = sse_events(&text);
    assert_eq!(
        names(&events),
        ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta", "error"]
    );
    assert!(!text.contains("[DONE]"));
}

#[tokio::test]
async fn messages_stream_honours_the_stream_knobs() {
    let fake = FakeModel::start().await.unwrap();
    let mut body = anthropic_body("hi");
    body["stream"] = json!(true);

    let response = post_messages(&fake.anthropic_url(&scenario_from("cut_after=1")), &body).await;
    let received = read_to_end_or_error(response).await.expect_err("the body ended cleanly");
    let events = sse_events(&String::from_utf8(received).unwrap());
    assert_eq!(names(&events), ["message_start", "content_block_start", "ping", "content_block_delta"]);

    let response = post_messages(&fake.anthropic_url(&scenario_from("stall_after=0")), &body).await;
    let mut frames = response.bytes_stream();
    let received = read_until_silent(&mut frames, Duration::from_millis(300)).await.expect("the stream ended");
    assert_eq!(
        names(&sse_events(&String::from_utf8(received).unwrap())),
        ["message_start", "content_block_start", "ping"]
    );

    let response = post_messages(&fake.anthropic_url(&scenario_from("malformed_at=1")), &body).await;
    let text = response.text().await.unwrap();
    assert!(text.contains("event: content_block_delta\ndata: {this is not json\n\n"), "{text}");
    assert!(text.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"), "{text}");
}

#[tokio::test]
async fn injected_statuses_answer_in_anthropics_envelope() {
    let fake = FakeModel::start().await.unwrap();
    let cases = [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "api_error"),
        (529, "overloaded_error"),
    ];
    for (status, kind) in cases {
        let scenario = Scenario { status: Some(status), retry_after: Some(3), ..Default::default() };
        let url = fake.anthropic_url(&scenario);
        assert!(url.ends_with(&format!("/s/status={status},retry_after=3")), "{url}");
        let response = post_messages(&url, &anthropic_body("hi")).await;
        assert_eq!(response.status(), status);
        assert_eq!(response.headers()["retry-after"], "3");
        let message =
            if status == 529 { "Overloaded".to_owned() } else { format!("fake-model injected status {status}") };
        assert_eq!(
            response.json::<Value>().await.unwrap(),
            json!({"type": "error", "error": {"type": kind, "message": message}}),
            "{status}"
        );
    }
    // The OpenAI paths keep their own envelope.
    let url = fake.scenario_url(&scenario_from("status=529"));
    let body: Value = post(&url, "/chat/completions", &chat_body("hi")).await.json().await.unwrap();
    assert_eq!(body["error"]["code"], "injected_529");
    assert_eq!(body["error"]["message"], "fake-model injected status 529");
}
