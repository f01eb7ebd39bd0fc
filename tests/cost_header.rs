//! `Flexway-Cost-Eur`: a non-streamed answer says what the call cost, the same cost
//! its audit record and the ledger hold.
#![cfg(test)]

use flexway::audit::AuditRecord;
use flexway_testkit::*;
use serde_json::{Value, json};

/// 1.5 € and 2.5 € per million tokens: in micro-euros per million tokens.
const INPUT_PER_MTOK: u64 = 1_500_000;
const OUTPUT_PER_MTOK: u64 = 2_500_000;

fn priced(model: &FakeModel) -> String {
    let refusing = model.scenario_url(&Scenario { status: Some(400), ..Default::default() });
    let ai = format!(
        "  default_backend: chat\n  capabilities: {{embeddings: embed}}\n  backends:\n    chat:\n      url: {u}\n      price: {price}\n    embed:\n      url: {u}\n      capabilities: [embeddings]\n      default_model: fake-embed\n      price: {price}\n    refusing:\n      url: {refusing}\n      price: {price}\n",
        u = model.url(),
        price = "{input_per_mtok_eur: 1.5, output_per_mtok_eur: 2.5}",
    );
    let text = config(&ai).replace("audit: {sink: stdout}", "audit: {sink: file, path: audit.jsonl}");
    // The agent `helper` is served by the backend that refuses.
    text.replace("      helper: {}", "      helper: {backend: refusing}")
}

async fn record_of(gw: &Flexway, request_id: &str) -> AuditRecord {
    for _ in 0..200 {
        let text = std::fs::read_to_string(gw.dir.path().join("audit.jsonl")).unwrap_or_default();
        let found =
            text.lines().map(|l| serde_json::from_str::<AuditRecord>(l).unwrap()).find(|r| r.request_id == request_id);
        if let Some(record) = found {
            return record;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("no audit record for {request_id}");
}

/// The usage × the configured price, each part rounded up to the micro-euro, as euros.
fn priced_usage(usage: &Value) -> String {
    let tokens = |key: &str| usage[key].as_u64().unwrap_or(0);
    let micro = (tokens("prompt_tokens") * INPUT_PER_MTOK).div_ceil(1_000_000)
        + (tokens("completion_tokens") * OUTPUT_PER_MTOK).div_ceil(1_000_000);
    format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

fn cost_header(response: &reqwest::Response) -> String {
    let value = response.headers().get("flexway-cost-eur").unwrap_or_else(|| panic!("{:?}", response.headers()));
    value.to_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_chat_answer_carries_its_settled_cost_in_euros() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&priced(&model));
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.status(), 200);
    let (cost, id) = (cost_header(&response), response.headers()["flexway-request-id"].to_str().unwrap().to_owned());
    let body: Value = response.json().await.unwrap();
    assert!(body["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert_eq!(cost, priced_usage(&body["usage"]));
    let record = record_of(&gw, &id).await;
    assert_eq!(cost, record.cost().to_eur_string());
    assert_ne!(record.cost_micro_eur, 0);
}

#[tokio::test]
async fn an_embeddings_answer_carries_its_settled_cost_in_euros() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&priced(&model));
    let response = gw.post("/v1/embeddings", KEY, json!({"model": "e", "input": ["a b c", "d"]})).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let (cost, id) = (cost_header(&response), response.headers()["flexway-request-id"].to_str().unwrap().to_owned());
    let body: Value = response.json().await.unwrap();
    assert_eq!(cost, priced_usage(&body["usage"]));
    assert_eq!(cost, record_of(&gw, &id).await.cost().to_eur_string());
}

/// A backend's own 4xx is relayed and refunded: it costs nothing, and says so.
#[tokio::test]
async fn a_relayed_refusal_costs_zero() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&priced(&model));
    let response =
        gw.post("/v1/chat/completions", KEY, hello("m")).header("flexway-agent", "helper").send().await.unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(cost_header(&response), "0.000000");
    let id = response.headers()["flexway-request-id"].to_str().unwrap().to_owned();
    assert_eq!(record_of(&gw, &id).await.cost_micro_eur, 0);
}

/// A stream's cost is known after its last byte, once its headers are gone.
#[tokio::test]
async fn a_stream_carries_no_cost_header() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&priced(&model));
    let response =
        gw.chat(KEY, json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("flexway-cost-eur").is_none());
}
