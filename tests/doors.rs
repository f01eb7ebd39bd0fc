//! The two other front doors (SPEC §2.1, §2.2): `POST /v1/responses` and `POST
//! /v1/messages` (with `count_tokens`), each served by an OpenAI backend and by an
//! Anthropic one, through the chat path's phases: the real binary (or its router in
//! process, to read the ledger), the fake model server as every backend.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use flexway_testkit::*;
use futures_util::future::join_all;
use serde_json::{Value, json};

/// Tenant `acme` (KEY) routed to `openai` (an OpenAI backend), tenant `globex`
/// (OTHER_KEY) to `claude` (an Anthropic one); `scenario` shapes both.
fn two_kinds(model: &FakeModel, scenario: &str, budgets: &str) -> String {
    let (openai, anthropic) = match scenario {
        "" => (model.url(), model.base_url()),
        s => (format!("http://{}/s/{s}/v1", model.addr()), format!("http://{}/s/{s}", model.addr())),
    };
    two_tenants(
        budgets,
        "claude",
        &format!(
            "  default_backend: openai\n  vision: {{allowed_origins: [\"https://img.example.com\"]}}\n  backends:\n    \
             openai:\n      url: {openai}\n      capabilities: [chat, vision]\n      default_model: gpt-fake\n      \
             price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}}\n    claude:\n      kind: anthropic\n      \
             url: {anthropic}\n      capabilities: [chat, vision]\n      default_model: claude-fake\n      \
             price: {{input_per_mtok_eur: 3.0, output_per_mtok_eur: 15.0}}\n"
        ),
    )
}

fn messages_call(gw: &Flexway, key: &str, body: Value) -> reqwest::RequestBuilder {
    client().post(format!("{}/v1/messages", gw.url)).header("x-api-key", key).json(&body)
}

/// The `event:` names and data of an SSE body.
async fn events(response: reqwest::Response) -> Vec<(String, Value)> {
    let text = response.text().await.unwrap();
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap_or_default().to_owned();
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or("null");
            (name, serde_json::from_str(data).unwrap_or(Value::Null))
        })
        .collect()
}

#[tokio::test]
async fn a_responses_call_is_translated_for_each_backend_kind_and_audited_as_responses() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "", "{}"));
    for (key, backend, served) in [(KEY, "openai", "gpt-fake"), (OTHER_KEY, "claude", "claude-fake")] {
        let body =
            json!({"model": "anything", "instructions": "Be brief.", "input": "hello doors", "max_output_tokens": 50});
        let response = gw.post("/v1/responses", key, body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["flexway-backend"], backend);
        let request_id = response.headers()["flexway-request-id"].to_str().unwrap().to_owned();
        let body: Value = response.json().await.unwrap();
        assert_eq!((body["object"].as_str(), body["status"].as_str()), (Some("response"), Some("completed")), "{body}");
        assert_eq!(body["id"], format!("resp_{}", request_id.trim_start_matches("req_")));
        assert_eq!(body["model"], served);
        let text = body["output"][0]["content"][0]["text"].as_str().unwrap();
        assert!(text.contains("hello doors"), "{body}");
        assert!(body["usage"]["input_tokens"].as_u64().unwrap() > 0);
    }
    let sent = model.requests();
    assert_eq!(sent[0].path, "/v1/chat/completions");
    assert_eq!(sent[0].body["messages"][0], json!({"role": "system", "content": "Be brief."}));
    assert_eq!(sent[0].body["max_completion_tokens"], 50, "max_output_tokens is the allowance sent");
    assert_eq!(sent[1].path, "/v1/messages");
    assert_eq!((sent[1].body["system"].as_str(), sent[1].body["max_tokens"].as_u64()), (Some("Be brief."), Some(50)));
    let records = gw.records_until::<Value>(2).await;
    for record in &records {
        assert_eq!(record["operation"], "responses");
        assert_eq!(record["usage_source"], "reported");
        assert!(record["cost_micro_eur"].as_u64().unwrap() > 0);
    }
}

#[tokio::test]
async fn a_streamed_response_is_the_responses_event_sequence_ending_with_usage() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "chunks=3", "{}"));
    for key in [KEY, OTHER_KEY] {
        let body = json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "stream doors"}]}], "stream": true});
        let response = gw.post("/v1/responses", key, body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let events = events(response).await;
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            &names[..4],
            ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        );
        assert_eq!(names.last(), Some(&"response.completed"), "{names:?}");
        let text: String = events
            .iter()
            .filter(|(n, _)| n == "response.output_text.delta")
            .map(|(_, d)| d["delta"].as_str().unwrap())
            .collect();
        assert!(text.contains("stream doors"), "{text}");
        let completed = &events.last().unwrap().1["response"];
        assert_eq!(completed["output"][0]["content"][0]["text"], text.as_str());
        assert!(completed["usage"]["output_tokens"].as_u64().unwrap() > 0, "{completed}");
        let numbers: Vec<u64> = events.iter().map(|(_, d)| d["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
    }
    let records = gw.records_until::<Value>(2).await;
    assert!(
        records.iter().all(|r| r["operation"] == "responses" && r["usage_source"] == "reported" && r["status"] == 200)
    );
}

#[tokio::test]
async fn a_function_call_round_trip_goes_through_the_responses_door() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "tool_use", "{}"));
    let tools = json!([{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {"echo": {"type": "string"}}}}]);
    for key in [KEY, OTHER_KEY] {
        let first = json!({"model": "m", "input": "find cats", "tools": tools});
        let body: Value = gw.post("/v1/responses", key, first).send().await.unwrap().json().await.unwrap();
        let call = body["output"].as_array().unwrap().iter().find(|i| i["type"] == "function_call").unwrap().clone();
        assert_eq!(call["name"], "lookup", "{body}");
        assert!(call["arguments"].as_str().unwrap().contains("find cats"));
        let follow = json!({"model": "m", "tools": tools, "input": [
            {"role": "user", "content": "find cats"},
            call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "felines"}
        ]});
        let response = gw.post("/v1/responses", key, follow).send().await.unwrap();
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    }
    let sent = model.requests();
    let tool_message = &sent[1].body["messages"][2];
    assert_eq!((tool_message["role"].as_str(), tool_message["content"].as_str()), (Some("tool"), Some("felines")));
    let result = &sent[3].body["messages"][2]["content"][0];
    assert_eq!((result["type"].as_str(), result["content"].as_str()), (Some("tool_result"), Some("felines")));
}

#[tokio::test]
async fn the_messages_door_is_native_for_an_anthropic_backend_and_translated_for_openai() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "", "{}"));
    let request = json!({
        "model": "claude-x", "max_tokens": 64, "top_k": 5,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "hello messages"}]
    });
    for (key, path) in [(OTHER_KEY, "/v1/messages"), (KEY, "/v1/chat/completions")] {
        let response = messages_call(&gw, key, request.clone()).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.unwrap();
        assert_eq!((body["type"].as_str(), body["role"].as_str()), (Some("message"), Some("assistant")), "{body}");
        assert!(body["content"][0]["text"].as_str().unwrap().contains("hello messages"));
        assert_eq!(body["stop_reason"], "end_turn");
        assert!(
            body["usage"]["input_tokens"].as_u64().unwrap() > 0 && body["usage"]["output_tokens"].as_u64().unwrap() > 0
        );
        assert_eq!(model.requests().last().unwrap().path, path);
    }
    let native = &model.requests()[0].body;
    assert_eq!(native["top_k"], 5, "the native request keeps the client's fields");
    assert_eq!(native["system"][0]["cache_control"]["type"], "ephemeral");
    assert_eq!((native["model"].as_str(), native["max_tokens"].as_u64()), (Some("claude-fake"), Some(64)));
    let translated = &model.requests()[1].body;
    assert_eq!(translated["messages"][0], json!({"role": "system", "content": "Be brief."}));
    let records = gw.records_until::<Value>(2).await;
    assert!(records.iter().all(|r| r["operation"] == "messages" && r["usage_source"] == "reported"), "{records:?}");
}

#[tokio::test]
async fn a_streamed_message_is_anthropic_s_event_sequence_from_either_backend() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "chunks=4", "{}"));
    for key in [OTHER_KEY, KEY] {
        let body = json!({"model": "m", "max_tokens": 64, "stream": true, "messages": [{"role": "user", "content": "stream messages"}]});
        let response =
            client().post(format!("{}/v1/messages", gw.url)).bearer_auth(key).json(&body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let events = events(response).await;
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).filter(|n| *n != "ping").collect();
        assert_eq!(names.first(), Some(&"message_start"));
        assert_eq!(&names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"], "{names:?}");
        let text: String = events
            .iter()
            .filter(|(n, _)| n == "content_block_delta")
            .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
            .collect();
        assert!(text.contains("stream messages"), "{text}");
        let delta = &events.iter().find(|(n, _)| n == "message_delta").unwrap().1;
        assert_eq!(delta["delta"]["stop_reason"], "end_turn");
        assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
    }
    let records = gw.records_until::<Value>(2).await;
    assert!(
        records.iter().all(|r| r["operation"] == "messages" && r["usage_source"] == "reported" && r["status"] == 200)
    );
}

#[tokio::test]
async fn a_stream_broken_mid_way_ends_with_the_door_s_own_error_event() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "malformed_at=2", "{}"));
    let messages = json!({"model": "m", "max_tokens": 64, "stream": true, "messages": [{"role": "user", "content": "hello there"}]});
    let events_of = |response| events(response);
    let got = events_of(messages_call(&gw, KEY, messages).send().await.unwrap()).await;
    let (name, error) = got.last().unwrap();
    assert_eq!(name, "error");
    assert_eq!(error["type"], "error");
    assert!(error["error"]["message"].as_str().unwrap().starts_with("upstream_error: "), "{error}");
    assert!(!got.iter().any(|(n, _)| n == "message_stop"));
    let responses = json!({"model": "m", "input": "hello there", "stream": true});
    let got = events_of(gw.post("/v1/responses", KEY, responses).send().await.unwrap()).await;
    let (name, error) = got.last().unwrap();
    assert_eq!((name.as_str(), error["code"].as_str()), ("error", Some("upstream_error")), "{error}");
    let records = gw.records_until::<Value>(2).await;
    assert!(records.iter().all(|r| r["error_code"] == "upstream_error"), "{records:?}");
}

#[tokio::test]
async fn refusals_come_in_each_door_s_own_envelope() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "", "{tokens_per_day: 1}"));
    for (field, value) in [
        ("store", json!(true)),
        ("previous_response_id", json!("resp_1")),
        ("background", json!(true)),
        ("tools", json!([{"type": "web_search"}])),
    ] {
        let mut body = json!({"model": "m", "input": "x"});
        body[field] = value;
        let response = gw.post("/v1/responses", KEY, body).send().await.unwrap();
        assert_eq!(response.status(), 400);
        let body: Value = response.json().await.unwrap();
        assert_eq!(
            (body["error"]["code"].as_str(), body["error"]["param"].as_str()),
            (Some("invalid_request"), Some(field)),
            "{body}"
        );
    }
    let hello = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    let response = messages_call(&gw, "sk-wrong", hello.clone()).send().await.unwrap();
    assert_eq!(response.status(), 401);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "authentication_error");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("invalid_api_key: "), "{body}");
    let response = messages_call(&gw, KEY, hello).send().await.unwrap();
    assert_eq!(response.status(), 429);
    assert!(response.headers().contains_key("retry-after"));
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("budget_exceeded: "), "{body}");
    let response = gw.post("/v1/responses", KEY, json!({"model": "m", "input": "hi"})).send().await.unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.json::<Value>().await.unwrap()["error"]["code"], "budget_exceeded");
    let remote = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://evil.example.net/a.png"}}]}]});
    let body: Value = messages_call(&gw, OTHER_KEY, remote).send().await.unwrap().json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().starts_with("image_origin_not_allowed: "), "{body}");
    let remote = json!({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://evil.example.net/a.png"}]}]});
    let body: Value = gw.post("/v1/responses", KEY, remote).send().await.unwrap().json().await.unwrap();
    assert_eq!(body["error"]["code"], "image_origin_not_allowed");
    // Every identified call has its record: 4 + 1 + 1 + 2 (the bad key has none).
    let records = gw.records_until::<Value>(8).await;
    assert_eq!(records.len(), 8);
    assert_eq!(records.iter().filter(|r| r["operation"] == "messages").count(), 2);
    assert!(model.requests().is_empty(), "nothing refused reached a backend");
}

#[tokio::test]
async fn a_backend_refusal_reaches_the_client_in_its_door_s_envelope() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "status=429,retry_after=7", "{}"));
    let hello = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    for key in [KEY, OTHER_KEY] {
        let response = messages_call(&gw, key, hello.clone()).send().await.unwrap();
        assert_eq!(response.status(), 429);
        assert_eq!(response.headers()["retry-after"], "7");
        let body: Value = response.json().await.unwrap();
        assert_eq!(
            (body["type"].as_str(), body["error"]["type"].as_str()),
            (Some("error"), Some("rate_limit_error")),
            "{body}"
        );
        let response = gw.post("/v1/responses", key, json!({"model": "m", "input": "hi"})).send().await.unwrap();
        assert_eq!(response.status(), 429);
        let body: Value = response.json().await.unwrap();
        assert!(body["error"]["message"].is_string(), "{body}");
    }
}

#[tokio::test]
async fn a_door_falls_back_before_the_first_byte() {
    let model = FakeModel::start().await.unwrap();
    let down = model.anthropic_url(&Scenario { status: Some(529), ..Default::default() });
    let yaml = config(&format!(
        "  default_backend: claude\n  backends:\n    claude:\n      kind: anthropic\n      url: {down}\n      default_model: c\n      \
         fallback: [openai]\n    openai:\n      url: {}\n      default_model: g\n",
        model.url()
    ));
    let gw = Flexway::start(&yaml);
    for stream in [false, true] {
        let hello =
            json!({"model": "m", "max_tokens": 10, "stream": stream, "messages": [{"role": "user", "content": "hi"}]});
        let response = messages_call(&gw, KEY, hello).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["flexway-backend"], "openai");
        assert_eq!(response.headers()["flexway-degraded"], "backend-fallback");
        let body = response.text().await.unwrap();
        let served = if stream { "event: message_stop" } else { "Hello from fake-model" };
        assert!(body.contains(served), "{body}");
        let response =
            gw.post("/v1/responses", KEY, json!({"model": "m", "input": "hi", "stream": stream})).send().await.unwrap();
        assert_eq!(
            (response.status().as_u16(), response.headers()["flexway-backend"].to_str().unwrap()),
            (200, "openai")
        );
    }
}

#[tokio::test]
async fn count_tokens_is_the_gateway_s_estimate_in_anthropic_s_format() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "", "{}"));
    let body = json!({"model": "m", "system": "Be brief.", "messages": [{"role": "user", "content": "hello there, how are you"}]});
    let response = client()
        .post(format!("{}/v1/messages/count_tokens", gw.url))
        .header("x-api-key", KEY)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let counted: Value = response.json().await.unwrap();
    // 33 bytes of text at 4 a token (9), 4 framing tokens for the system prompt and
    // for the message, 3 priming.
    assert_eq!(counted, json!({"input_tokens": 20}));
    let response = client().post(format!("{}/v1/messages/count_tokens", gw.url)).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 401);
    assert!(model.requests().is_empty(), "counting calls no backend");
}

/// "hello there": 11 bytes + 4 framing + 3 priming = 18 tokens reserved for the
/// prompt, plus the 100 the client allows: 118 a call, through either door.
const RESERVED_PER_CALL: u64 = 118;

/// 96 concurrent calls through `path` against a cap of 10 calls' reservations.
async fn burst(path: &str, body: Value, key_header: &'static str) {
    let model = FakeModel::start().await.unwrap();
    let slow = model.scenario_url(&Scenario { delay_ms: Some(1500), ..Default::default() });
    let yaml = acme_config(
        &format!("{{tokens_per_day: {}}}", 10 * RESERVED_PER_CALL),
        &format!("  default_backend: main\n  backends:\n    main:\n      url: {slow}\n"),
    );
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&yaml, adapters).await;
    let calls = (0..96).map(|_| {
        let request = client().post(format!("{}{path}", gw.url)).json(&body);
        let request =
            if key_header == "x-api-key" { request.header("x-api-key", KEY) } else { request.bearer_auth(KEY) };
        request.send()
    });
    let mut served = 0;
    for response in join_all(calls).await {
        let response = response.unwrap();
        match response.status().as_u16() {
            200 => served += 1,
            429 => assert!(response.headers().contains_key("retry-after")),
            other => panic!("unexpected status {other}: {}", response.text().await.unwrap()),
        }
    }
    assert_eq!(served, 10, "a cap of 10 reservations served {served} calls");
    let ledger = gw.ledger("acme", None).await;
    assert!(ledger[0] <= 10 * RESERVED_PER_CALL, "{ledger:?}");
    let records = audit_records_until(&audit, 96).await;
    assert_eq!(records.len(), 96, "one record a call");
    let settled: u64 = records.iter().map(|r| r.prompt_tokens + r.completion_tokens).sum();
    assert_eq!(ledger[0], settled, "the ledger is the sum of the settled usage");
    assert_eq!(gw.live_reservations().await, 0, "no reservation left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_burst_never_passes_the_cap() {
    burst("/v1/responses", json!({"model": "m", "input": "hello there", "max_output_tokens": 100}), "bearer").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_burst_never_passes_the_cap() {
    let body = json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]});
    burst("/v1/messages", body, "x-api-key").await;
}

/// The Lambda function serves `flexway::http::api`: the doors are on that router too.
#[tokio::test]
async fn the_serverless_router_serves_both_doors() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let gw = serve_router_in_process(&two_kinds(&model, "", "{}"), adapters, flexway::http::api).await;
    let responses =
        client().post(format!("{}/v1/responses", gw.url)).bearer_auth(KEY).json(&json!({"model": "m", "input": "hi"}));
    assert_eq!(responses.send().await.unwrap().status(), 200);
    let messages = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    let messages = client().post(format!("{}/v1/messages", gw.url)).header("x-api-key", OTHER_KEY).json(&messages);
    assert_eq!(messages.send().await.unwrap().status(), 200);
    let counted = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let counted = client().post(format!("{}/v1/messages/count_tokens", gw.url)).header("x-api-key", KEY).json(&counted);
    assert_eq!(counted.send().await.unwrap().status(), 200);
    let operations: Vec<_> = audit.records().iter().map(|r| r.operation.as_str()).collect();
    assert_eq!(operations, ["responses", "messages"]);
}

#[tokio::test]
async fn the_messages_paths_answer_every_error_in_anthropic_s_envelope() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&two_kinds(&model, "", "{}"));
    for (method, path, status) in [
        (reqwest::Method::GET, "/v1/messages", 405),
        (reqwest::Method::POST, "/v1/messages/batches", 404),
        (reqwest::Method::GET, "/v1/messages/count_tokens", 405),
    ] {
        let response = client().request(method, format!("{}{path}", gw.url)).send().await.unwrap();
        assert_eq!(response.status(), status, "{path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["type"], "error", "{path}: {body}");
        assert!(body["error"]["type"].is_string() && body["error"]["message"].is_string(), "{body}");
    }
    let malformed = messages_call(&gw, KEY, json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}));
    let response = malformed.send().await.unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("invalid_request: `max_tokens`"), "{body}");
}
