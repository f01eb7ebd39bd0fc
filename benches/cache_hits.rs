//! The response cache through the real gateway (SPEC §16 "Speed"): what a hit costs a
//! caller end to end, and what a miss adds.
//!
//! `cargo bench --bench cache_hits` — the fake model server in-process, the real
//! `flexway serve` (release) in its own process on the memory ledger with an embedded
//! cache store; one connection, sequential calls (`BENCH_REQUESTS`, default 3,000
//! each), p50/p99 from the send to the last byte of:
//! 1. a model no policy names (the gateway's own path, a backend call);
//! 2. an exact hit (the same request again: no backend call);
//! 3. a semantic hit (another wording of a stored message: one embeddings call to
//!    the fake, the lookup, no chat call);
//! 4. a semantic miss that is stored (a new message each time: the embeddings call,
//!    the lookup, the chat call, the store) against 1.
//!
//! Figures are printed, never asserted: the machine's load decides them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Instant;

mod common;

use common::pct;
use fake_model::FakeModel;
use sha2::{Digest, Sha256};

const KEY: &str = "sk-bench";

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn run() {
    let count: usize = std::env::var("BENCH_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(3000);
    let model = FakeModel::start().await.unwrap();
    let yaml = format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: file, path: audit.jsonl}}
tenants:
  bench:
    keys: [{{sha256: {key}}}]
ai:
  default_backend: fake
  backends:
    fake: {{url: "{url}", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}, capabilities: [chat, embeddings]}}
  cache:
    store: {{kind: embedded, path: ./cache.db}}
    key: "file:./cache.key"
    policies:
      exact: {{mode: exact, ttl: 1h}}
      near: {{mode: semantic, ttl: 1h, threshold: 0.9, embed: {{backend: fake, model: fake-embed-similar}}}}
    models: {{cached: exact, near: near}}
"#,
        key = hex::encode(Sha256::digest(KEY)),
        url = model.url()
    );
    let gateway = common::Gateway::start_with_files(&yaml, &[("cache.key", "0123456789abcdef0123456789abcdef")]);
    let client = reqwest::Client::builder().pool_max_idle_per_host(1).build().unwrap();
    let url = format!("{}/chat/completions", gateway.url);
    let call = |model: &str, text: String| {
        let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}]});
        let request = client.post(&url).bearer_auth(KEY).json(&body);
        async move {
            let response = request.send().await.unwrap();
            assert!(response.status().is_success(), "{}", response.status());
            let cache = response.headers().get("flexway-cache").map(|v| v.to_str().unwrap().to_owned());
            response.bytes().await.unwrap();
            cache.unwrap_or_default()
        }
    };
    let measure = |label: &'static str, model: &'static str, text: fn(usize) -> String, expect: &'static str| {
        let call = &call;
        async move {
            for i in 0..100 {
                call(model, text(count + i)).await;
            }
            let mut latencies = Vec::with_capacity(count);
            for i in 0..count {
                let sent = Instant::now();
                let cache = call(model, text(i)).await;
                latencies.push(sent.elapsed().as_secs_f64() * 1e6);
                assert!(cache.starts_with(expect), "{label}: {cache}");
            }
            latencies.sort_by(f64::total_cmp);
            println!("  {label:<38} p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&latencies, 50.0), pct(&latencies, 99.0));
            latencies
        }
    };
    // The entries the hits are served from.
    call("cached", "What are your opening hours?".into()).await;
    call("near", "What is the capital of France?".into()).await;
    println!("one connection, {count} sequential calls each, embedded cache store");
    let uncached = measure("no policy (backend call)", "m", |i| format!("question number {i}"), "").await;
    measure("exact hit", "cached", |_| "What are your opening hours?".into(), "hit").await;
    measure("semantic hit (+ embeddings call)", "near", |_| "So what is the capital of France?".into(), "hit").await;
    let missed = measure("semantic miss, stored", "near", |i| format!("tell me about item {i}"), "stored").await;
    println!(
        "  a semantic miss adds                    p50 {:>7.1} µs  p99 {:>7.1} µs (the embeddings call, the lookup, the store)",
        pct(&missed, 50.0) - pct(&uncached, 50.0),
        pct(&missed, 99.0) - pct(&uncached, 99.0)
    );
    drop(gateway);
}
