//! Budgets that hold (SPEC §6), end to end over loopback: the gateway's router with a
//! real ledger (memory and embedded), the fake model server as the backend.
#![cfg(test)]

use flexway::audit::{BudgetState, UsageSource};
use flexway_testkit::*;
use futures_util::future::join_all;
use serde_json::{Value, json};

/// Tenant `acme` with the given budgets line, one backend at `url` with `price`.
fn budget_config(budgets: &str, backends: &str, default: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys:
      - sha256: {key}
      - {{sha256: {agent_key}, agent: bot}}
    budgets: {budgets}
    agents:
      bot: {{budgets: {{tokens_per_day: 500}}}}
ai:
  default_backend: {default}
  budget: {{default_max_tokens: 100, min_completion_tokens: 10}}
  backends:
{backends}
"#,
        key = sha(KEY),
        agent_key = sha(AGENT_KEY)
    )
}

fn backend(name: &str, url: &str, input: &str, output: &str, extra: &str) -> String {
    format!(
        "    {name}:\n      url: \"{url}\"\n      price: {{input_per_mtok_eur: {input}, output_per_mtok_eur: {output}}}\n{extra}"
    )
}

/// "hello there": 11 bytes + 4 framing + 3 priming = 18 tokens reserved for the
/// prompt, plus max_tokens 100: 118 a call.
const RESERVED_PER_CALL: u64 = 118;

async fn burst(gw: &InProcess) {
    let calls = (0..96).map(|_| {
        gw.chat(KEY, json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]}))
    });
    let responses = join_all(calls).await;
    let mut served_tokens = 0;
    let mut served = 0;
    for response in responses {
        match response.status().as_u16() {
            200 => {
                let body: Value = response.json().await.unwrap();
                served_tokens += body["usage"]["total_tokens"].as_u64().unwrap();
                served += 1;
            }
            429 => {
                assert!(response.headers().contains_key("retry-after"));
                let body: Value = response.json().await.unwrap();
                assert_eq!(body["error"]["code"], "budget_exceeded");
                assert!(body["error"]["message"].as_str().unwrap().contains("tenant acme tokens_per_day"));
            }
            other => panic!("unexpected status {other}"),
        }
    }
    // Every reservation happens before the first settles: the backend takes 1.5 s,
    // room for 96 calls to reach admission on a loaded machine.
    assert_eq!(served, 10, "a cap of 10 reservations served {served} calls");
    assert!(served_tokens <= 10 * RESERVED_PER_CALL);
    let ledger = gw.ledger("acme", None).await;
    assert_eq!(ledger[0], served_tokens, "the ledger equals the sum of settled usage");
    assert_eq!(ledger[1], served_tokens);
    assert_eq!(gw.live_reservations().await, 0, "no reservation left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_never_passes_the_cap_on_the_memory_store() {
    let model = FakeModel::start().await.unwrap();
    let slow = model.scenario_url(&Scenario { delay_ms: Some(1500), ..Default::default() });
    let yaml = budget_config(
        &format!("{{tokens_per_day: {}}}", 10 * RESERVED_PER_CALL),
        &backend("main", &slow, "1", "2", ""),
        "main",
    );
    let (adapters, _) = memory_adapters();
    burst(&serve_in_process(&yaml, adapters).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_never_passes_the_cap_on_the_embedded_store() {
    let model = FakeModel::start().await.unwrap();
    let slow = model.scenario_url(&Scenario { delay_ms: Some(1500), ..Default::default() });
    let yaml = budget_config(
        &format!("{{tokens_per_day: {}}}", 10 * RESERVED_PER_CALL),
        &backend("main", &slow, "1", "2", ""),
        "main",
    );
    let dir = tempfile::tempdir().unwrap();
    let (adapters, _) = embedded_adapters(&dir.path().join("ledger"));
    burst(&serve_in_process(&yaml, adapters).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_backend_never_drains_the_budget() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    let backends = format!("{}{}", backend("down", &failing, "1", "2", ""), backend("up", &model.url(), "1", "2", ""));
    let yaml = budget_config(&format!("{{tokens_per_day: {RESERVED_PER_CALL}, eur_per_month: 1}}"), &backends, "down");
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&yaml, adapters).await;
    for _ in 0..30 {
        let response = gw
            .chat(
                KEY,
                json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]}),
            )
            .await;
        assert_eq!(response.status(), 503);
    }
    assert_eq!(gw.ledger("acme", None).await, [0, 0, 0], "failed calls returned every token and micro-euro");
    assert_eq!(gw.live_reservations().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_budget_is_usable_after_failures() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(502), ..Default::default() });
    // The tenant routes to a failing backend; its agent to a healthy one.
    let backends = format!("{}{}", backend("down", &failing, "1", "2", ""), backend("up", &model.url(), "1", "2", ""));
    let yaml = budget_config(&format!("{{tokens_per_day: {RESERVED_PER_CALL}}}"), &backends, "down")
        .replace("bot: {budgets: {tokens_per_day: 500}}", "bot: {backend: up}");
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&yaml, adapters).await;
    for _ in 0..20 {
        assert_eq!(
            gw.chat(
                KEY,
                json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]})
            )
            .await
            .status(),
            503
        );
    }
    // Exactly the full budget: it fits only if nothing leaked.
    let response = gw
        .chat(
            AGENT_KEY,
            json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]}),
        )
        .await;
    assert_eq!(response.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn euros_settle_at_the_serving_backends_price() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    let backends = format!(
        "{}{}",
        backend("dear", &failing, "10", "40", "      fallback: [cheap]\n"),
        backend("cheap", &model.url(), "0.5", "1.5", "")
    );
    let yaml = budget_config("{eur_per_month: 1}", &backends, "dear");
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&yaml, adapters).await;
    let response = gw.chat(KEY, json!({"model": "m", "messages": [{"role": "user", "content": "price me"}]})).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["flexway-backend"], "cheap");
    let body: Value = response.json().await.unwrap();
    let prompt = body["usage"]["prompt_tokens"].as_u64().unwrap();
    let completion = body["usage"]["completion_tokens"].as_u64().unwrap();
    // 0.5 €/Mtok = 0.5 µ€/token; 1.5 €/Mtok = 1.5 µ€/token; each side rounded up.
    let expected = (prompt * 500_000).div_ceil(1_000_000) + (completion * 1_500_000).div_ceil(1_000_000);
    let ledger = gw.ledger("acme", None).await;
    assert_eq!(ledger[2], expected);
    assert_eq!(ledger[0], prompt + completion);
    let record = audit.records().pop().unwrap();
    assert_eq!(record.cost_micro_eur, expected);
    assert_eq!(record.backend.as_deref(), Some("cheap"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refusing_budget_is_named_with_seconds_to_its_reset() {
    let model = FakeModel::start().await.unwrap();
    let yaml = budget_config(
        "{tokens_per_day: 100000, tokens_per_month: 20}",
        &backend("main", &model.url(), "1", "1", ""),
        "main",
    );
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&yaml, adapters).await;
    let response = gw.chat(KEY, json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]})).await;
    assert_eq!(response.status(), 429);
    let retry_after: u64 = response.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    let now = flexway::budget::period::unix_now();
    let month_end = flexway::budget::Period::Month.end(now);
    assert!(retry_after <= month_end - now && retry_after + 5 >= month_end - now, "Retry-After {retry_after}");
    let body: Value = response.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("tenant acme tokens_per_month"));
    assert_eq!(model.request_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_budget_is_a_sub_limit_inside_its_tenants() {
    let model = FakeModel::start().await.unwrap();
    let yaml = budget_config("{tokens_per_day: 100000}", &backend("main", &model.url(), "1", "1", ""), "main");
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&yaml, adapters).await;
    // The agent's 500 tokens a day hold 4 reservations of 118.
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let r = gw
            .chat(
                AGENT_KEY,
                json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]}),
            )
            .await;
        statuses.push(r.status().as_u16());
    }
    assert!(statuses.iter().all(|s| *s == 200), "settled usage is small, so room comes back: {statuses:?}");
    let agent = gw.ledger("acme", Some("bot")).await;
    let tenant = gw.ledger("acme", None).await;
    assert_eq!(agent[0], tenant[0], "the agent's usage counts in its tenant's budget too");
    let greedy = gw
        .chat(
            AGENT_KEY,
            json!({"model": "m", "max_tokens": 5000, "messages": [{"role": "user", "content": "x ".repeat(600)}]}),
        )
        .await;
    assert_eq!(greedy.status(), 429);
    let body: Value = greedy.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("agent acme/bot tokens_per_day"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completion_allowance_is_clamped_to_what_remains() {
    let model = FakeModel::start().await.unwrap();
    // 18 prompt tokens + at most 50 of completion fit; min_completion_tokens is 10.
    let yaml = budget_config("{tokens_per_day: 68}", &backend("main", &model.url(), "1", "1", ""), "main");
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&yaml, adapters).await;
    let response = gw
        .chat(KEY, json!({"model": "m", "max_tokens": 1000, "messages": [{"role": "user", "content": "hello there"}]}))
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(model.requests()[0].body["max_tokens"], 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_soft_cap_switches_to_the_cheaper_backend_and_says_so() {
    let model = FakeModel::start().await.unwrap();
    let backends =
        format!("{}{}", backend("main", &model.url(), "2", "8", ""), backend("small", &model.url(), "0.1", "0.1", ""));
    let yaml = budget_config("{tokens_per_day: 1000}", &backends, "main").replace(
        "  budget: {default_max_tokens: 100, min_completion_tokens: 10}",
        "  budget: {default_max_tokens: 100, min_completion_tokens: 10, soft: {threshold: 0.005, backend: small}}",
    );
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&yaml, adapters).await;
    let first = gw.chat(KEY, json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]})).await;
    assert_eq!(first.headers()["flexway-backend"], "main");
    assert!(first.headers().get("flexway-budget").is_none());
    // The first call used more than 0.5% of 1000 tokens.
    let second = gw.chat(KEY, json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]})).await;
    assert_eq!(second.status(), 200);
    assert_eq!(second.headers()["flexway-budget"], "soft");
    assert_eq!(second.headers()["flexway-backend"], "small");
    assert_eq!(audit.records().last().unwrap().budget_state, BudgetState::Soft);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_settles_on_its_reported_usage_and_a_broken_one_on_what_was_relayed() {
    let model = FakeModel::start().await.unwrap();
    let cut = model.scenario_url(&Scenario { cut_after: Some(2), ..Default::default() });
    let backends = format!("{}{}", backend("main", &model.url(), "1", "1", ""), backend("cut", &cut, "1", "1", ""));
    let yaml = budget_config("{tokens_per_day: 100000}", &backends, "main")
        .replace("bot: {budgets: {tokens_per_day: 500}}", "bot: {backend: cut}");
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&yaml, adapters).await;
    let streamed = gw
        .chat(KEY, json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hello there"}]}))
        .await;
    let (events, _) = sse_data(streamed).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let after_first = gw.ledger("acme", None).await[0];
    let record = audit.records().pop().unwrap();
    assert_eq!(record.usage_source, UsageSource::Reported);
    assert_eq!(after_first, record.prompt_tokens + record.completion_tokens);
    let broken = gw
        .chat(
            AGENT_KEY,
            json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hello there"}]}),
        )
        .await;
    let _ = sse_data(broken).await;
    // The record (and the settlement) are written when the stream ends.
    let record = audit_records_until(&audit, 2).await[1].clone();
    assert_eq!(record.usage_source, UsageSource::Estimated);
    assert!(record.completion_tokens > 0, "what was relayed is charged");
    assert_eq!(gw.ledger("acme", None).await[0], after_first + record.prompt_tokens + record.completion_tokens);
    assert_eq!(gw.live_reservations().await, 0);
}
