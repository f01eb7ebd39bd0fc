//! The pacing headers (SPEC §14) on the refusals that come before any reservation: a
//! run not found (404) or ended (409), and a prompt that could never fit a window
//! (400). They say where the caller stands in its windows, read without a write; a
//! caller under no limit gets none. End to end over loopback, as `tests/rates.rs`: the
//! gateway's router with the memory ledger, the fake model server as the backend.
#![cfg(test)]

use flexway::budget::{CounterKey, Unit};
use flexway_testkit::*;
use serde_json::{Value, json};

/// A run id no run has.
const NO_RUN: &str = "run_0123456789abcdef0123456789abcdef";

/// Tenant `acme` under no limit of its own (KEY), its agent `bot` (AGENT_KEY) under
/// 3 requests and 60 tokens a minute; one backend at `url`.
fn limited_agent(url: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys:
      - {{sha256: {key}}}
      - {{sha256: {agent_key}, agent: bot}}
    budgets: {{tokens_per_day: 1000000}}
    agents:
      bot: {{limits: {{requests_per_minute: 3, tokens_per_minute: 60}}}}
ai:
  default_backend: main
  budget: {{default_max_tokens: 20, min_completion_tokens: 10}}
  backends:
    main:
      url: "{url}"
      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}
"#,
        key = sha(KEY),
        agent_key = sha(AGENT_KEY)
    )
}

fn hello() -> Value {
    json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]})
}

fn paced(response: &reqwest::Response) -> bool {
    response
        .headers()
        .keys()
        .any(|k| k.as_str().starts_with("x-ratelimit") || k.as_str().starts_with("anthropic-ratelimit"))
}

/// A chat call of `key` in run `run`.
async fn chat_in(gw: &InProcess, key: &str, run: &str, body: &Value) -> reqwest::Response {
    let url = format!("{}/v1/chat/completions", gw.url);
    client().post(url).bearer_auth(key).header("Flexway-Run", run).json(body).send().await.unwrap()
}

/// The agent's request and token windows in the current minute.
async fn windows(gw: &InProcess) -> Vec<u64> {
    let now = flexway::budget::period::unix_now();
    let keys = [Unit::Requests, Unit::Tokens].map(|unit| CounterKey::window("acme", Some("bot"), unit, now));
    gw.gateway.budgets.used(&keys).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_not_found_or_ended_paces_on_the_windows_as_they_stand() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&limited_agent(&model.url()), adapters).await;
    early_in_a_minute().await;

    let missing = chat_in(&gw, AGENT_KEY, NO_RUN, &hello()).await;
    assert_eq!(missing.status(), 404);
    assert_eq!(header(&missing, "x-ratelimit-limit-requests"), "3");
    assert_eq!(header(&missing, "x-ratelimit-remaining-requests"), "3", "the refused call is not counted");
    assert!(header(&missing, "x-ratelimit-reset-requests").ends_with('s'));
    assert_eq!(header(&missing, "x-ratelimit-limit-tokens"), "60");
    assert_eq!(header(&missing, "x-ratelimit-remaining-tokens"), "60");
    assert_eq!(missing.json::<Value>().await.unwrap()["error"]["code"], "run_not_found");
    assert_eq!(windows(&gw).await, [0, 0], "read, never written");

    // A call served counts; the next refusal says so.
    let served = gw.chat(AGENT_KEY, hello()).await;
    assert_eq!(served.status(), 200);
    let [requests, tokens] = windows(&gw).await[..] else { panic!() };
    assert_eq!(requests, 1);
    let runs = format!("{}/v1/flexway/runs", gw.url);
    let created = client().post(&runs).bearer_auth(AGENT_KEY).json(&json!({"budget": {"tokens": 500}})).send();
    let created = created.await.unwrap();
    assert_eq!(created.status(), 201);
    let id = created.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let ended = client().delete(format!("{runs}/{id}")).bearer_auth(AGENT_KEY).send().await.unwrap();
    assert_eq!(ended.status(), 200);
    let refused = chat_in(&gw, AGENT_KEY, &id, &hello()).await;
    assert_eq!(refused.status(), 409);
    assert_eq!(header(&refused, "x-should-retry"), "false");
    assert_eq!(header(&refused, "x-ratelimit-remaining-requests"), "2");
    assert_eq!(header(&refused, "x-ratelimit-remaining-tokens"), (60 - tokens).to_string());
    assert_eq!(refused.json::<Value>().await.unwrap()["error"]["code"], "run_ended");
    assert_eq!(windows(&gw).await, [requests, tokens], "nothing counted for the refusals");

    // The Messages door paces with Anthropic's headers.
    let messages = client()
        .post(format!("{}/v1/messages", gw.url))
        .header("x-api-key", AGENT_KEY)
        .header("Flexway-Run", NO_RUN)
        .json(&hello())
        .send()
        .await
        .unwrap();
    assert_eq!(messages.status(), 404);
    assert_eq!(header(&messages, "anthropic-ratelimit-requests-limit"), "3");
    assert_eq!(header(&messages, "anthropic-ratelimit-requests-remaining"), "2");
    assert!(header(&messages, "anthropic-ratelimit-tokens-reset").ends_with('Z'));
    assert!(!messages.headers().contains_key("x-ratelimit-limit-requests"));

    // The tenant's other key is under no limit: nothing to pace on.
    let free = chat_in(&gw, KEY, NO_RUN, &hello()).await;
    assert_eq!(free.status(), 404);
    assert!(!paced(&free), "{:?}", free.headers());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_could_never_fit_paces_too() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&limited_agent(&model.url()), adapters).await;
    early_in_a_minute().await;
    let long = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(100)}]});
    let refused = gw.chat(AGENT_KEY, long.clone()).await;
    assert_eq!(refused.status(), 400);
    assert_eq!(header(&refused, "x-should-retry"), "false");
    assert_eq!(header(&refused, "x-ratelimit-limit-tokens"), "60");
    assert_eq!(header(&refused, "x-ratelimit-remaining-tokens"), "60");
    assert_eq!(header(&refused, "x-ratelimit-remaining-requests"), "3");
    let body: Value = refused.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("tokens_per_minute"), "{body}");
    assert_eq!(windows(&gw).await, [0, 0], "read, never written");
    // Under no limit, the same prompt is served, unpaced.
    let free = gw.chat(KEY, long).await;
    assert_eq!(free.status(), 200);
    assert!(!paced(&free), "{:?}", free.headers());
}
