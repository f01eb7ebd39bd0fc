//! Per-minute limits (SPEC §14), end to end over loopback: the gateway's router with a
//! real ledger (memory and embedded), the fake model server as the backend. Windows are
//! UTC minutes, so each burst starts early in one ([`early_in_a_minute`]).
#![cfg(test)]

use flexway_testkit::*;
use futures_util::future::join_all;
use serde_json::{Value, json};

/// Tenant `acme` with `limits` on the tenant, an agent `bot` (its key bound) with
/// `agent_limits`, and one backend at `url`.
fn rates_config(limits: &str, agent_limits: &str, key_limits: &str, url: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys:
      - {{sha256: {key}{key_limits}}}
      - {{sha256: {agent_key}, agent: bot}}
    {limits}
    budgets: {{tokens_per_day: 1000000}}
    agents:
      bot: {{{agent_limits}}}
ai:
  default_backend: main
  budget: {{default_max_tokens: 100, min_completion_tokens: 10}}
  backends:
    main:
      url: "{url}"
      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}
      capabilities: [chat, embeddings]
"#,
        key = sha(KEY),
        agent_key = sha(AGENT_KEY)
    )
}

fn hello() -> Value {
    json!({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hello there"}]})
}

async fn requests_burst(gw: &InProcess) {
    early_in_a_minute().await;
    let before = unix_now();
    let responses = join_all((0..24).map(|_| gw.chat(KEY, hello()))).await;
    let after = unix_now();
    let mut served = 0;
    for response in responses {
        match response.status().as_u16() {
            200 => {
                served += 1;
                assert_eq!(header(&response, "x-ratelimit-limit-requests"), "5");
                let remaining: u64 = header(&response, "x-ratelimit-remaining-requests").parse().unwrap();
                assert!(remaining < 5, "remaining counts the call answered: {remaining}");
                assert!(header(&response, "x-ratelimit-reset-requests").ends_with('s'));
            }
            429 => {
                let retry: u64 = header(&response, "retry-after").parse().unwrap();
                assert_retry_after_is_the_minutes_rest(retry, before, after);
                assert_eq!(header(&response, "x-should-retry"), "true");
                assert_eq!(header(&response, "flexway-error-cause"), "requests_per_minute");
                assert_eq!(header(&response, "x-ratelimit-remaining-requests"), "0");
                let body: Value = response.json().await.unwrap();
                assert_eq!(body["error"]["code"], "rate_limit_exceeded");
                assert_eq!(body["error"]["type"], "requests");
                assert!(body["error"]["message"].as_str().unwrap().contains("tenant acme"), "{body}");
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!(served, 5, "a limit of 5 requests a minute served {served}");
    assert_eq!(gw.live_reservations().await, 0, "no reservation left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_never_passes_requests_per_minute_on_the_memory_store() {
    let model = FakeModel::start().await.unwrap();
    let slow = model.scenario_url(&Scenario { delay_ms: Some(300), ..Default::default() });
    let (adapters, _) = memory_adapters();
    let yaml = rates_config("limits: {requests_per_minute: 5}", "", "", &slow);
    requests_burst(&serve_in_process(&yaml, adapters).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_never_passes_requests_per_minute_on_the_embedded_store() {
    let model = FakeModel::start().await.unwrap();
    let slow = model.scenario_url(&Scenario { delay_ms: Some(300), ..Default::default() });
    let dir = tempfile::tempdir().unwrap();
    let (adapters, _) = embedded_adapters(&dir.path().join("ledger"));
    let yaml = rates_config("limits: {requests_per_minute: 5}", "", "", &slow);
    requests_burst(&serve_in_process(&yaml, adapters).await).await;
}

/// Tokens are reserved at the call's upper bound and settled to what it used: a burst
/// never passes the window, and what one call did not use is there for the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_per_minute_holds_under_a_burst_and_settles_to_usage() {
    let model = FakeModel::start().await.unwrap();
    let slow = model.scenario_url(&Scenario { delay_ms: Some(300), ..Default::default() });
    let (adapters, _) = memory_adapters();
    // "hello there": 18 prompt tokens reserved plus 20 of allowance, 38 a call.
    let yaml = rates_config("limits: {tokens_per_minute: 200}", "", "", &slow);
    let gw = serve_in_process(&yaml, adapters).await;
    early_in_a_minute().await;
    let responses = join_all((0..16).map(|_| gw.chat(KEY, hello()))).await;
    let mut used = 0;
    let mut served = 0;
    for response in responses {
        match response.status().as_u16() {
            200 => {
                served += 1;
                assert_eq!(header(&response, "x-ratelimit-limit-tokens"), "200");
                let body: Value = response.json().await.unwrap();
                used += body["usage"]["total_tokens"].as_u64().unwrap();
            }
            429 => {
                assert_eq!(header(&response, "flexway-error-cause"), "tokens_per_minute");
                let body: Value = response.json().await.unwrap();
                assert_eq!(body["error"]["type"], "tokens");
            }
            other => panic!("unexpected status {other}"),
        }
    }
    // Five reservations of 38 fit in 200 at once; none more while they are held.
    assert_eq!(served, 5, "served {served}");
    let key = flexway::budget::CounterKey::window("acme", None, flexway::budget::Unit::Tokens, unix_now());
    let window = gw.gateway.budgets.used(&[key]).await.unwrap()[0];
    assert_eq!(window, used, "the window holds what the calls used, not what they reserved");
    // Settled below the reservations: the room they gave back serves the next call.
    assert_eq!(gw.chat(KEY, hello()).await.status(), 200);
}

fn unix_now() -> u64 {
    flexway::budget::period::unix_now()
}

/// Asserts that `Retry-After` is the whole seconds from the refusal to its UTC
/// minute's end (SPEC §14): `60 - now % 60` for a `now` between the clock read
/// `before` and `after` the call, within a second.
fn assert_retry_after_is_the_minutes_rest(retry: u64, before: u64, after: u64) {
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    let rests: Vec<u64> = (before..=after).map(|now| 60 - now % 60).collect();
    assert!(rests.iter().any(|rest| rest.abs_diff(retry) <= 1), "Retry-After {retry}, the minute's rest {rests:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_can_never_fit_is_400_and_the_allowance_is_clamped_to_the_window() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = rates_config("limits: {tokens_per_minute: 60}", "", "", &model.url());
    let gw = serve_in_process(&yaml, adapters).await;
    let long = "x".repeat(100);
    let refused = gw.chat(KEY, json!({"model": "m", "messages": [{"role": "user", "content": long}]})).await;
    assert_eq!(refused.status(), 400);
    assert_eq!(header(&refused, "x-should-retry"), "false");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_request");
    assert!(body["error"]["message"].as_str().unwrap().contains("tokens_per_minute"), "{body}");
    // 18 prompt tokens and max_tokens 100 do not fit 60: the allowance sent is clamped
    // to the window's 42, as a budget clamps it, not refused.
    early_in_a_minute().await;
    let clamped = gw
        .chat(KEY, json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]}));
    assert_eq!(clamped.await.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_and_a_key_are_held_to_their_own_limits_inside_the_tenants() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = rates_config(
        "limits: {requests_per_minute: 10}",
        "limits: {requests_per_minute: 2}",
        ", limits: {requests_per_minute: 3}",
        &model.url(),
    );
    let gw = serve_in_process(&yaml, adapters).await;
    early_in_a_minute().await;
    let agent = outcomes(&gw, AGENT_KEY, 3).await;
    assert_eq!(agent[..2], [None, None], "{agent:?}");
    assert!(agent[2].as_deref().is_some_and(|m| m.contains("agent acme/bot requests_per_minute (2)")), "{agent:?}");
    let key = outcomes(&gw, KEY, 4).await;
    assert_eq!(key[..3], [None, None, None], "{key:?}");
    let label = flexway::budget::plan::key_label(&sha256(KEY));
    assert!(key[3].as_deref().is_some_and(|m| m.contains(&format!("key {label} requests_per_minute"))), "{key:?}");
    // The tenant's window counted all five.
    let counter = flexway::budget::CounterKey::window("acme", None, flexway::budget::Unit::Requests, unix_now());
    assert_eq!(gw.gateway.budgets.used(&[counter]).await.unwrap()[0], 5);
}

/// `n` calls one after the other: `None` for each served, the message of each 429.
async fn outcomes(gw: &InProcess, key: &str, n: usize) -> Vec<Option<String>> {
    let mut out = Vec::new();
    for _ in 0..n {
        let response = gw.chat(key, hello()).await;
        out.push(match response.status().as_u16() {
            200 => None,
            429 => Some(response.json::<Value>().await.unwrap()["error"]["message"].as_str().unwrap().to_owned()),
            other => panic!("unexpected status {other}"),
        });
    }
    out
}

fn sha256(key: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes()).into()
}

/// The Messages door paces with Anthropic's headers; embeddings count in the same
/// window; a caller under no limit gets no pacing header at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_http_door_counts_in_the_window_and_says_so_in_its_own_headers() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = rates_config("", "limits: {requests_per_minute: 3}", "", &model.url());
    let gw = serve_in_process(&yaml, adapters).await;
    early_in_a_minute().await;
    let messages = client()
        .post(format!("{}/v1/messages", gw.url))
        .header("x-api-key", AGENT_KEY)
        .json(&json!({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(messages.status(), 200);
    assert_eq!(header(&messages, "anthropic-ratelimit-requests-limit"), "3");
    assert_eq!(header(&messages, "anthropic-ratelimit-requests-remaining"), "2");
    assert!(header(&messages, "anthropic-ratelimit-requests-reset").ends_with('Z'));
    assert!(!messages.headers().contains_key("x-ratelimit-limit-requests"));
    let embeddings = client()
        .post(format!("{}/v1/embeddings", gw.url))
        .bearer_auth(AGENT_KEY)
        .json(&json!({"model": "m", "input": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(embeddings.status(), 200);
    assert_eq!(header(&embeddings, "x-ratelimit-remaining-requests"), "1");
    let responses = client()
        .post(format!("{}/v1/responses", gw.url))
        .bearer_auth(AGENT_KEY)
        .json(&json!({"model": "m", "input": "hello", "max_output_tokens": 20}))
        .send()
        .await
        .unwrap();
    assert_eq!(responses.status(), 200);
    assert_eq!(header(&responses, "x-ratelimit-remaining-requests"), "0");
    let refused = gw.chat(AGENT_KEY, hello()).await;
    assert_eq!(refused.status(), 429);
    // The tenant has no limit of its own: its other key is not paced.
    let free = gw.chat(KEY, hello()).await;
    assert_eq!(free.status(), 200);
    assert!(!free.headers().keys().any(|k| k.as_str().starts_with("x-ratelimit")), "{:?}", free.headers());
}

/// A refusal the same request can never pass says so: `budget_exceeded` carries
/// `x-should-retry: false` (and a window's 429 `true`, above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_exceeded_tells_the_sdks_not_to_retry() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = rates_config("", "", "", &model.url()).replace("tokens_per_day: 1000000", "tokens_per_day: 20");
    let gw = serve_in_process(&yaml, adapters).await;
    let refused = gw.chat(KEY, hello()).await;
    assert_eq!(refused.status(), 429);
    assert_eq!(header(&refused, "x-should-retry"), "false");
    let unknown = gw.chat("not-a-key", hello()).await;
    assert_eq!(unknown.status(), 401);
    assert_eq!(header(&unknown, "x-should-retry"), "false");
}
