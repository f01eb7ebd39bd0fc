//! Latency Flexway adds over calling the model server directly, and its throughput.
//!
//! `cargo bench --bench overhead` — runs the fake model server in-process and the
//! real `flexway serve` (release) as its own process on loopback (`BENCH_STORE=embedded`
//! for the durable ledger; memory by default), then:
//! 1. one connection, non-streamed chat, a fixed rate (default 500 req/s, 5,000
//!    requests) straight to the fake server, then through the gateway: p50/p99 of each
//!    and of the difference. Latency is measured from the send; the lag between the
//!    scheduled and the actual send (tokio's timer has a 1 ms tick) is reported apart,
//!    so a stall that delays the following requests is visible, not hidden.
//! 2. throughput through the gateway at 64 concurrent connections for 5 s.
//!
//! Figures are printed, never asserted: the machine's load decides them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod common;

use common::pct;
use fake_model::FakeModel;
use sha2::{Digest, Sha256};

const KEY: &str = "sk-bench";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn run() {
    let rate = env_or("BENCH_RATE", 500);
    let count = env_or("BENCH_REQUESTS", 5000) as usize;
    let model = FakeModel::start().await.unwrap();
    let store = std::env::var("BENCH_STORE").unwrap_or_else(|_| "memory".to_owned());
    let store = match store.as_str() {
        "embedded" => "{kind: embedded, path: ./ledger}".to_owned(),
        _ => "{kind: memory}".to_owned(),
    };
    let yaml = format!(
        "version: 1\nstore: {store}\naudit: {{sink: file, path: audit.jsonl}}\ntenants:\n  bench:\n    keys: [{{sha256: {}}}]\n    budgets: {{tokens_per_day: 1000000000000, eur_per_month: 1000000}}\nai:\n  default_backend: fake\n  backends:\n    fake: {{url: \"{}\", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}\n",
        hex::encode(Sha256::digest(KEY)),
        model.url()
    );
    // The gateway is the real binary in its own process, as in production.
    let gateway = common::Gateway::start(&yaml);
    let gateway_url = gateway.url.clone();

    let body = serde_json::json!({"model": "fake-chat", "messages": [{"role": "user", "content": "benchmark prompt of a few words"}]});
    let direct = fixed_rate(&model.url(), &body, rate, count).await;
    let via = fixed_rate(&gateway_url, &body, rate, count).await;
    println!("non-streamed chat, one connection, {rate} req/s, {count} requests each, store {store}");
    println!("  direct   p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&direct, 50.0), pct(&direct, 99.0));
    println!("  gateway  p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&via, 50.0), pct(&via, 99.0));
    println!(
        "  added    p50 {:>7.1} µs  p99 {:>7.1} µs",
        pct(&via, 50.0) - pct(&direct, 50.0),
        pct(&via, 99.0) - pct(&direct, 99.0)
    );

    let seconds = env_or("BENCH_SECONDS", 5);
    let rps = throughput(&gateway_url, &body, 64, Duration::from_secs(seconds)).await;
    println!("throughput through the gateway, 64 connections, {seconds} s: {rps:.0} req/s");
    drop(gateway);
}

async fn fixed_rate(base: &str, body: &serde_json::Value, rate: u64, count: usize) -> Vec<f64> {
    let client = reqwest::Client::builder().pool_max_idle_per_host(1).build().unwrap();
    let url = format!("{base}/chat/completions");
    let payload = serde_json::to_vec(body).unwrap();
    let send =
        || client.post(&url).bearer_auth(KEY).header("content-type", "application/json").body(payload.clone()).send();
    for _ in 0..200 {
        send().await.unwrap().bytes().await.unwrap();
    }
    let interval = Duration::from_nanos(1_000_000_000 / rate.max(1));
    let start = Instant::now();
    let mut latencies = Vec::with_capacity(count);
    let mut worst_lag = Duration::ZERO;
    for i in 0..count {
        let scheduled = start + interval * i as u32;
        tokio::time::sleep_until(scheduled.into()).await;
        let sent = Instant::now();
        worst_lag = worst_lag.max(sent.saturating_duration_since(scheduled + Duration::from_millis(1)));
        let response = send().await.unwrap();
        assert!(response.status().is_success());
        response.bytes().await.unwrap();
        latencies.push(sent.elapsed().as_secs_f64() * 1e6);
    }
    println!("  ({base}: worst send lag beyond the timer tick {worst_lag:?})");
    latencies.sort_by(f64::total_cmp);
    latencies
}

async fn throughput(base: &str, body: &serde_json::Value, connections: usize, duration: Duration) -> f64 {
    let client = reqwest::Client::new();
    let url = Arc::new(format!("{base}/chat/completions"));
    let payload = bytes::Bytes::from(serde_json::to_vec(body).unwrap());
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (client, url, payload, done) = (client.clone(), url.clone(), payload.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let r = client
                    .post(url.as_str())
                    .bearer_auth(KEY)
                    .header("content-type", "application/json")
                    .body(payload.clone())
                    .send()
                    .await;
                if let Ok(r) = r
                    && r.status().is_success()
                    && r.bytes().await.is_ok()
                {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / duration.as_secs_f64()
}
