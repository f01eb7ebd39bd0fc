//! The README's first command: `scripts/demo` serves `config/demo.yaml` in front of the
//! fake model server, and a newcomer calls it with `sk-flexway-demo` as "Calling it"
//! shows. Here the demo's own config, read from its file, changes only where a test
//! must: the backends' port (the fake listens on a free one) and the salt's path (the
//! gateway runs in a temp dir, where the relative ledger and audit paths land too).
#![cfg(test)]

use flexway::audit::{AuditRecord, Operation, UsageSource};
use flexway_testkit::*;
use serde_json::{Value, json};

const DEMO_KEY: &str = "sk-flexway-demo";
const DEMO_UPSTREAM: &str = "http://127.0.0.1:8081/v1";
const DEMO_SALT: &str = "\"file:config/demo-salt\"";

/// `config/demo.yaml` pointed at `model`, its salt file named by an absolute path.
fn demo_config(model: &FakeModel) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let yaml = std::fs::read_to_string(format!("{root}/config/demo.yaml")).unwrap();
    assert_eq!(yaml.matches(DEMO_UPSTREAM).count(), 2, "both demo backends at {DEMO_UPSTREAM}:\n{yaml}");
    assert_eq!(yaml.matches(DEMO_SALT).count(), 1, "the demo salt at {DEMO_SALT}:\n{yaml}");
    yaml.replace(DEMO_UPSTREAM, &model.url()).replace(DEMO_SALT, &format!("\"file:{root}/config/demo-salt\""))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_calls_answer_from_the_demo_and_land_in_its_audit() {
    let model = FakeModel::start().await.unwrap();
    let gateway = Flexway::start(&demo_config(&model));
    let hello = json!({"model": "chat-default", "messages": [{"role": "user", "content": "Hello!"}]});

    // The README's first curl.
    let response = gateway.chat(DEMO_KEY, hello.clone()).await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "flexway-backend"), "demo-chat");
    // 4 prompt tokens at 1 €/Mtok and 6 completion tokens at 4 €/Mtok: 28 µ€.
    assert_eq!(header(&response, "flexway-cost-eur"), "0.000028");
    let chat_id = header(&response, "flexway-request-id").to_owned();
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello from fake-model! You said: Hello!");
    assert_eq!(body["usage"], json!({"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}));

    // Streamed, chunk by chunk.
    let mut streamed = hello;
    streamed["stream"] = json!(true);
    let response = gateway.post("/v1/chat/completions", DEMO_KEY, streamed).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let (events, error) = sse_data(response).await;
    assert_eq!(error, None);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(text, "Hello from fake-model! You said: Hello!");

    // The SDK's embeddings and models calls.
    let response =
        gateway.post("/v1/embeddings", DEMO_KEY, json!({"model": "anything", "input": "hello"})).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "flexway-backend"), "demo-embed");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["data"][0]["embedding"].as_array().unwrap().len(), 8);
    assert_eq!(body["usage"]["prompt_tokens"], 1);
    let response = client().get(format!("{}/v1/models", gateway.url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let models: Value = response.json().await.unwrap();
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["chat-default", "fake-chat", "fake-embed"], "{models}");

    // The Responses API, then the `anthropic` SDK's call: its key as `x-api-key`.
    let response = gateway
        .post("/v1/responses", DEMO_KEY, json!({"model": "chat-default", "input": "Hello!"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["output"][0]["content"][0]["text"], "Hello from fake-model! You said: Hello!");
    let response = client()
        .post(format!("{}/v1/messages", gateway.url))
        .header("x-api-key", DEMO_KEY)
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"model": "chat-default", "max_tokens": 200, "messages": [{"role": "user", "content": "Hello!"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["content"][0]["text"], "Hello from fake-model! You said: Hello!");

    // One record per call, the models list aside (a streamed call's is written as its
    // relay ends, so the file's order is not the calls').
    let records: Vec<AuditRecord> = gateway.file_records_until("flexway-audit.jsonl", 5, 1000).await;
    let mut operations: Vec<&str> = records.iter().map(|r| r.operation.as_str()).collect();
    operations.sort_unstable();
    assert_eq!(operations, ["chat", "chat", "embeddings", "messages", "responses"], "{records:?}");
    let chat = records.iter().find(|r| r.request_id == chat_id).unwrap();
    assert_eq!(chat.tenant, "demo");
    assert_eq!(chat.operation, Operation::Chat);
    assert_eq!(chat.model_requested.as_deref(), Some("chat-default"));
    assert_eq!(chat.model_served.as_deref(), Some("fake-chat"));
    assert_eq!(chat.backend.as_deref(), Some("demo-chat"));
    assert_eq!((chat.prompt_tokens, chat.completion_tokens, chat.cost_micro_eur), (4, 6, 28));
    assert_eq!((chat.status, chat.usage_source), (200, UsageSource::Reported));
    let embed = records.iter().find(|r| r.operation == Operation::Embeddings).unwrap();
    assert_eq!((embed.backend.as_deref(), embed.model_served.as_deref()), (Some("demo-embed"), Some("fake-embed")));
    // The ledger and the audit where the demo puts them, and the key never in the
    // audit, only its salted hash.
    assert!(gateway.dir.path().join("flexway-ledger").exists());
    let audit = std::fs::read_to_string(gateway.dir.path().join("flexway-audit.jsonl")).unwrap();
    assert!(!audit.contains(DEMO_KEY) && !audit.contains(&sha(DEMO_KEY)));
}
