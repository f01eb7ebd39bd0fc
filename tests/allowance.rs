//! The allowance reserved is the allowance sent (SPEC §6): a client that sets no
//! limit, asks for `n` choices, or sends both limit fields can never make a backend
//! write past what was reserved; concurrent bursts on both local stores never pass
//! the hard cap; the ledger equals the audit. The backend writes 500 tokens unless
//! told otherwise (`words=500`).
#![cfg(test)]

use flexway::audit::UsageSource;
use flexway_testkit::*;
use futures_util::future::join_all;
use serde_json::{Value, json};

/// Tenant `acme` capped at `cap` tokens a day; `default_max_tokens` 100.
fn capped(url: &str, cap: u64) -> String {
    acme_config(
        &format!("{{tokens_per_day: {cap}}}"),
        &format!(
            "  default_backend: main\n  budget: {{default_max_tokens: 100, min_completion_tokens: 10}}\n  backends:\n    main: {{url: \"{url}\", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}"
        ),
    )
}

/// Runs `calls` concurrent requests of `body`; returns the tokens served and how many
/// calls were served. Every answer is a 200 or a 429 `budget_exceeded`.
async fn burst(gw: &InProcess, body: Value, calls: usize) -> (u64, usize) {
    let responses = join_all((0..calls).map(|_| gw.chat(KEY, body.clone()))).await;
    let (mut tokens, mut served) = (0, 0);
    for response in responses {
        match response.status().as_u16() {
            200 => {
                let body: Value = response.json().await.unwrap();
                tokens += body["usage"]["total_tokens"].as_u64().unwrap();
                served += 1;
            }
            429 => {
                let body: Value = response.json().await.unwrap();
                assert_eq!(body["error"]["code"], "budget_exceeded");
            }
            other => panic!("unexpected status {other}"),
        }
    }
    (tokens, served)
}

/// The ledger equals the audit, call by call, and no reservation is left.
async fn ledger_equals_audit(gw: &InProcess, audit: &flexway::audit::sinks::MemoryAuditSink, served_tokens: u64) {
    let audited: u64 = audit.records().iter().map(|r| r.prompt_tokens + r.completion_tokens).sum();
    let ledger = gw.ledger("acme", None).await;
    assert_eq!(ledger[0], served_tokens, "the ledger holds what was served");
    assert_eq!(audited, served_tokens, "the audit bills what the ledger holds");
    let micro: u64 = audit.records().iter().map(|r| r.cost_micro_eur).sum();
    assert_eq!(ledger[2], micro);
    assert_eq!(gw.live_reservations().await, 0);
}

async fn never_passes_the_cap(adapters: flexway::gateway::Adapters, audit: &flexway::audit::sinks::MemoryAuditSink) {
    let model = FakeModel::start().await.unwrap();
    let gw = serve_in_process(&capped(&scenario(&model, "words=500,delay_ms=1000"), 1000), adapters).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]});
    let (tokens, served) = burst(&gw, body, 32).await;
    assert!(tokens <= 1000, "a cap of 1,000 tokens served {tokens}");
    assert!(served >= 1);
    // Each call was sent the allowance it reserved: the default, 100, or less where
    // only less fitted (clamped, never under min_completion_tokens).
    let sent: Vec<u64> = model.requests().iter().map(|r| r.body["max_tokens"].as_u64().unwrap()).collect();
    assert!(sent.iter().all(|n| (10..=100).contains(n)), "{sent:?}");
    assert!(sent.contains(&100), "{sent:?}");
    ledger_equals_audit(&gw, audit, tokens).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_max_tokens_the_default_is_sent_and_the_cap_holds_on_the_memory_store() {
    let (adapters, audit) = memory_adapters();
    never_passes_the_cap(adapters, &audit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_max_tokens_the_default_is_sent_and_the_cap_holds_on_the_embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    let (adapters, audit) = embedded_adapters(&dir.path().join("ledger"));
    never_passes_the_cap(adapters, &audit).await;
}

async fn n_choices_are_reserved(adapters: flexway::gateway::Adapters, audit: &flexway::audit::sinks::MemoryAuditSink) {
    let model = FakeModel::start().await.unwrap();
    let gw = serve_in_process(&capped(&scenario(&model, "words=500,delay_ms=1000"), 1000), adapters).await;
    let body = json!({"model": "m", "n": 4, "max_tokens": 50,
        "messages": [{"role": "user", "content": "hello there"}]});
    let (tokens, served) = burst(&gw, body, 16).await;
    assert!(tokens <= 1000, "n = 4 served {tokens} tokens against a cap of 1,000");
    // 18 prompt tokens + 4 × 50 reserved a call: 4 fit in 1,000, and a fifth clamped
    // to what remains if it came before they settled.
    assert!((4..=5).contains(&served), "{served}");
    for request in model.requests() {
        let per_choice = request.body["max_tokens"].as_u64().unwrap();
        assert!((10..=50).contains(&per_choice), "{:?}", request.body);
    }
    ledger_equals_audit(&gw, audit, tokens).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_multiply_the_allowance_on_the_memory_store() {
    let (adapters, audit) = memory_adapters();
    n_choices_are_reserved(adapters, &audit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_multiply_the_allowance_on_the_embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    let (adapters, audit) = embedded_adapters(&dir.path().join("ledger"));
    n_choices_are_reserved(adapters, &audit).await;
}

#[tokio::test]
async fn with_both_limit_fields_the_smaller_governs_and_both_are_rewritten() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    // 18 + 60 = 78 tokens fit in 80; the larger field (500) would not.
    let gw = serve_in_process(&capped(&scenario(&model, "words=500"), 80), adapters).await;
    let body = json!({"model": "m", "max_tokens": 500, "max_completion_tokens": 60,
        "messages": [{"role": "user", "content": "hello there"}]});
    let response = gw.chat(KEY, body).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 60);
    let sent = &model.requests()[0].body;
    assert_eq!((sent["max_tokens"].clone(), sent["max_completion_tokens"].clone()), (json!(60), json!(60)));
    ledger_equals_audit(&gw, &audit, answer["usage"]["total_tokens"].as_u64().unwrap()).await;
}

#[tokio::test]
async fn a_clamped_allowance_is_the_one_sent() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, _audit) = memory_adapters();
    // 18 prompt tokens leave 40 of 58: the default 100 is clamped to 40, and sent.
    let gw = serve_in_process(&capped(&scenario(&model, "words=500"), 58), adapters).await;
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 40);
    assert_eq!(model.requests()[0].body["max_tokens"], 40);
}

#[tokio::test]
async fn a_stream_is_sent_its_allowance_too() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&capped(&scenario(&model, "words=500"), 1000), adapters).await;
    let body = json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hello there"}]});
    let (events, _) = sse_data(gw.chat(KEY, body).await).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(model.requests()[0].body["max_tokens"], 100);
    let records = audit.records();
    assert_eq!((records[0].completion_tokens, records[0].usage_source), (100, UsageSource::Reported));
}

#[tokio::test]
async fn a_backend_that_ignores_its_allowance_is_charged_in_full_and_counted() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&capped(&scenario(&model, "words=500,ignore_limit"), 100_000), adapters).await;
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 500, "the backend overshot its 100");
    ledger_equals_audit(&gw, &audit, answer["usage"]["total_tokens"].as_u64().unwrap()).await;
    let metrics = gw.gateway.metrics.render_prometheus();
    assert!(metrics.contains("flexway_allowance_overshoot_total{backend=\"main\"} 1\n"), "{metrics}");
    assert!(metrics.contains("flexway_allowance_overshoot_tokens_total{backend=\"main\"} 400\n"), "{metrics}");
}

#[tokio::test]
async fn n_out_of_range_is_refused_before_anything_is_reserved() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, _audit) = memory_adapters();
    let gw = serve_in_process(&capped(&model.url(), 1000), adapters).await;
    let body = json!({"model": "m", "n": 0, "messages": [{"role": "user", "content": "x"}]});
    let response = gw.chat(KEY, body).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(
        (error["error"]["code"].clone(), error["error"]["param"].clone()),
        (json!("invalid_request"), json!("n"))
    );
    assert_eq!(gw.ledger("acme", None).await, [0, 0, 0]);
    assert!(model.requests().is_empty());
}
