//! Backends of kind `anthropic` (SPEC §3, docs/backends.md): the real binary, an
//! OpenAI-speaking client, and the fake model's Anthropic Messages surface. What the
//! backend receives is read from the fake's record; what the client gets is checked
//! as OpenAI's shapes, and the audit as what was billed.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use flexway_testkit::*;
use serde_json::{Value, json};

/// The fake's Anthropic API base (no `/v1`: the gateway appends `/v1/messages`),
/// behaving as `scenario` says.
fn base(model: &FakeModel, scenario: &str) -> String {
    match scenario {
        "" => format!("http://{}", model.addr()),
        s => format!("http://{}/s/{s}", model.addr()),
    }
}

/// Backend `claude` (anthropic, at `url`), with `more` backends after it (YAML lines
/// indented by four spaces) and `fallback` as its fallback list.
fn claude_config(url: &str, fallback: &str, more: &str) -> String {
    config(&format!(
        "  default_backend: claude\n  backends:\n    claude:\n      kind: anthropic\n      url: {url}\n      \
         auth: {{type: header, name: x-api-key, secret: \"env:CLAUDE_KEY\"}}\n      capabilities: [chat, vision]\n      \
         default_model: claude-test\n      fallback: [{fallback}]\n      \
         price: {{input_per_mtok_eur: 3.0, output_per_mtok_eur: 15.0}}\n{more}"
    ))
}

fn start(url: &str) -> Flexway {
    start_with(url, "", "")
}

fn start_with(url: &str, fallback: &str, more: &str) -> Flexway {
    Flexway::start_with_env(&claude_config(url, fallback, more), &[("CLAUDE_KEY", "sk-ant-test")])
}

/// The `n`-th audit record (from 1) the gateway wrote on stdout, once it is there.
async fn audit(gw: &Flexway, n: usize) -> Value {
    gw.records_until::<Value>(n).await.swap_remove(n - 1)
}

async fn json_of(response: reqwest::Response) -> Value {
    response.json().await.unwrap()
}

#[tokio::test]
async fn a_chat_call_is_sent_as_a_messages_request_and_answered_as_a_chat_completion() {
    let model = FakeModel::start().await.unwrap();
    let gw = start(&base(&model, ""));
    let request = json!({
        "model": "claude-test",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
            ]}
        ],
        "stop": ["NEVER-SAID"],
        "max_tokens": 200,
        "temperature": 0.2,
        "user": "end-user-7"
    });
    let response = gw.chat(KEY, request).await;
    assert_eq!(response.status(), 200);
    let cost = response.headers()["flexway-cost-eur"].to_str().unwrap().to_owned();
    let body = json_of(response).await;
    assert_eq!(body["object"], "chat.completion", "{body}");
    assert_eq!(body["model"], "claude-test");
    let answer = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.starts_with("Hello from fake-model! You said: What is in this picture?"), "{answer}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let usage = &body["usage"];
    let (prompt, completion) = (usage["prompt_tokens"].as_u64().unwrap(), usage["completion_tokens"].as_u64().unwrap());
    assert!(prompt > 0 && completion > 0, "{usage}");

    let sent = &model.requests()[0];
    assert_eq!(sent.path, "/v1/messages");
    assert_eq!(sent.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(sent.header("x-api-key"), Some("sk-ant-test"));
    assert_eq!(sent.header("authorization"), None, "the caller's key never travels");
    let sent = &sent.body;
    assert_eq!(sent["system"], "Be brief.");
    assert_eq!(sent["max_tokens"], 200);
    assert_eq!(sent["stop_sequences"], json!(["NEVER-SAID"]));
    assert_eq!(sent["metadata"], json!({"user_id": "end-user-7"}));
    assert_eq!(
        sent["messages"][0]["content"][1]["source"],
        json!({"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="})
    );

    let audit = audit(&gw, 1).await;
    assert_eq!(
        (audit["prompt_tokens"].as_u64(), audit["completion_tokens"].as_u64()),
        (Some(prompt), Some(completion))
    );
    assert_eq!(audit["backend"], "claude");
    assert_eq!(audit["usage_source"], "reported");
    // 3 € and 15 € per million tokens, in micro-euros.
    let micro = prompt * 3 + completion * 15;
    assert_eq!(cost, format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000));
}

#[tokio::test]
async fn the_allowance_is_always_sent_and_finish_reasons_read_as_openai() {
    let model = FakeModel::start().await.unwrap();
    let gw = start(&base(&model, "words=40"));
    let no_limit = gw.chat(KEY, hello("claude-test")).await;
    assert_eq!(no_limit.status(), 200);
    let sent = model.requests()[0].body["max_tokens"].as_u64();
    assert!(sent.is_some_and(|t| t > 0), "max_tokens is required by the API: {sent:?}");

    let mut cut = hello("claude-test");
    cut["max_completion_tokens"] = json!(5);
    let body = json_of(gw.chat(KEY, cut).await).await;
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    assert_eq!(model.requests()[1].body["max_tokens"], 5);

    let mut stopped = hello("claude-test");
    stopped["stop"] = json!("w3");
    let body = json_of(gw.chat(KEY, stopped).await).await;
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "w1 w2 ");
}

#[tokio::test]
async fn tool_calls_travel_both_ways() {
    let model = FakeModel::start().await.unwrap();
    let gw = start(&base(&model, "tool_use"));
    let tools = json!([{"type": "function", "function": {
        "name": "lookup", "description": "Looks a word up", "parameters": {"type": "object", "properties": {"echo": {"type": "string"}}}
    }}]);
    let ask = json!({"model": "claude-test", "messages": [{"role": "user", "content": "find cats"}], "tools": tools, "tool_choice": "required"});
    let body = json_of(gw.chat(KEY, ask).await).await;
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "lookup");
    let arguments: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"echo": "find cats"}));
    let sent = &model.requests()[0].body;
    assert_eq!(
        sent["tools"][0],
        json!({"name": "lookup", "description": "Looks a word up", "input_schema": {"type": "object", "properties": {"echo": {"type": "string"}}}})
    );
    assert_eq!(sent["tool_choice"], json!({"type": "any"}));

    // The next turn carries the call and its result back.
    let id = call["id"].as_str().unwrap();
    let follow = json!({"model": "claude-test", "tools": tools, "messages": [
        {"role": "user", "content": "find cats"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": id, "content": "cats are felines"}
    ]});
    assert_eq!(gw.chat(KEY, follow).await.status(), 200);
    let messages = model.requests()[1].body["messages"].clone();
    assert_eq!(
        messages[1]["content"][0],
        json!({"type": "tool_use", "id": id, "name": "lookup", "input": {"echo": "find cats"}})
    );
    assert_eq!(
        messages[2],
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": "cats are felines"}]})
    );
}

#[tokio::test]
async fn cached_prompt_tokens_are_billed_and_reported() {
    let model = FakeModel::start().await.unwrap();
    let gw = start(&base(&model, "cache"));
    let body = json_of(gw.chat(KEY, hello("claude-test")).await).await;
    let usage = &body["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 0, "{usage}");
    assert!(usage["prompt_tokens"].as_u64().unwrap() > cached, "the prompt counts every token: {usage}");
    assert_eq!(audit(&gw, 1).await["prompt_tokens"], usage["prompt_tokens"]);
}

#[tokio::test]
async fn a_stream_is_translated_chunk_by_chunk_with_usage_when_asked() {
    let model = FakeModel::start().await.unwrap();
    let gw = start(&base(&model, ""));
    let mut request = hello("claude-test");
    request["stream"] = json!(true);
    request["stream_options"] = json!({"include_usage": true});
    let whole = json_of(gw.chat(KEY, hello("claude-test")).await).await;
    let response = gw.chat(KEY, request.clone()).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let (events, error) = sse_data(response).await;
    assert_eq!(error, None);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"), "{chunks:?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, whole["choices"][0]["message"]["content"].as_str().unwrap());
    assert!(
        chunks.iter().filter(|c| c["choices"][0]["delta"]["content"].is_string()).count() > 2,
        "one chunk per delta"
    );
    let finish: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finish, [&json!("stop")]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage, &whole["usage"], "the same usage as the non-streamed answer");
    assert_eq!(audit(&gw, 2).await["completion_tokens"], usage["completion_tokens"]);
    let sent = &model.requests()[1].body;
    assert_eq!(sent["stream"], true);
    assert!(sent.get("stream_options").is_none(), "an OpenAI field leaked: {sent}");

    // Without include_usage the usage chunk is not shown, and the call is still billed.
    request["stream_options"] = json!(null);
    let (events, _) = sse_data(gw.chat(KEY, request).await).await;
    assert!(events.iter().all(|e| !e.contains("\"usage\"")), "{events:?}");
    assert_eq!(audit(&gw, 3).await["usage_source"], "reported");
}

#[tokio::test]
async fn a_stream_of_tool_calls_carries_the_arguments_in_pieces() {
    let model = FakeModel::start().await.unwrap();
    let gw = start(&base(&model, "tool_use"));
    let request = json!({"model": "claude-test", "stream": true, "messages": [{"role": "user", "content": "find dogs"}],
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]});
    let (events, error) = sse_data(gw.chat(KEY, request).await).await;
    assert_eq!(error, None);
    let chunks: Vec<Value> =
        events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    let calls: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"].get("tool_calls")).collect();
    assert_eq!(calls[0][0]["function"]["name"], "lookup");
    assert!(calls[0][0]["id"].is_string());
    let arguments: String = calls.iter().filter_map(|c| c[0]["function"]["arguments"].as_str()).collect();
    assert_eq!(serde_json::from_str::<Value>(&arguments).unwrap(), json!({"echo": "find dogs"}));
    let finish = chunks.iter().find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("tool_calls"));
}

#[tokio::test]
async fn overloaded_falls_back_and_a_refusal_is_relayed_in_the_openai_envelope() {
    let model = FakeModel::start().await.unwrap();
    let spare = format!("    spare:\n      url: {}\n", model.url());
    let gw = start_with(&base(&model, "status=529"), "spare", &spare);
    let response = gw.chat(KEY, hello("claude-test")).await;
    assert_eq!(response.status(), 200, "529 overloaded is a backend failure: the fallback serves");
    assert_eq!(response.headers()["flexway-backend"], "spare");

    let alone = start(&base(&model, "status=529"));
    let response = alone.chat(KEY, hello("claude-test")).await;
    assert_eq!(response.status(), 503);
    assert_eq!(json_of(response).await["error"]["code"], "upstream_unavailable");

    let refusing = start(&base(&model, "status=400"));
    let response = refusing.chat(KEY, hello("claude-test")).await;
    assert_eq!(response.status(), 400, "a 4xx is the caller's answer, relayed with its status");
    assert_eq!(response.headers()["flexway-cost-eur"], "0.000000");
    let body = json_of(response).await;
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(body["error"]["code"], "invalid_request_error");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
}

#[tokio::test]
async fn an_error_event_falls_back_before_the_first_content_and_breaks_the_stream_after() {
    let model = FakeModel::start().await.unwrap();
    let spare = format!("    spare:\n      url: {}\n", model.url());
    let mut request = hello("claude-test");
    request["stream"] = json!(true);

    let early = start_with(&base(&model, "error_after=0"), "spare", &spare);
    let response = early.chat(KEY, request.clone()).await;
    assert_eq!(response.headers()["flexway-backend"], "spare");
    let (events, error) = sse_data(response).await;
    assert_eq!((events.last().map(String::as_str), error), (Some("[DONE]"), None));

    let late = start(&base(&model, "error_after=2"));
    let (events, _) = sse_data(late.chat(KEY, request).await).await;
    let last = events.last().unwrap();
    assert!(last.contains("upstream_error") && last.contains("Overloaded"), "{events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"), "a broken stream never ends clean");
    let audit = audit(&late, 1).await;
    assert_eq!(audit["error_code"], "upstream_error");
    assert!(audit["completion_tokens"].as_u64().is_some_and(|t| t > 0), "settled on what was relayed: {audit}");
}

#[tokio::test]
async fn what_the_messages_api_cannot_carry_is_refused_before_it_is_sent() {
    let model = FakeModel::start().await.unwrap();
    let gw = start(&base(&model, ""));
    let mut request = hello("claude-test");
    request["n"] = json!(2);
    let response = gw.chat(KEY, request).await;
    assert_eq!(response.status(), 400);
    let body = json_of(response).await;
    assert_eq!((body["error"]["code"].as_str(), body["error"]["param"].as_str()), (Some("invalid_request"), Some("n")));
    assert_eq!(model.request_count(), 0);
}
