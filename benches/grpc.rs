//! What Flexway adds to a gRPC call, against calling the upstream directly.
//!
//! `cargo bench --bench grpc` — runs the tonic OCR-like server (`tests/fake-grpc`)
//! in-process and the real `flexway serve` (release) as its own process on loopback,
//! memory ledger, file audit, then:
//! 1. unary latency: one HTTP/2 connection, `BENCH_REQUESTS` (default 5,000) calls one
//!    after the other, per-call metered (`Recognize`: a reservation and a settlement
//!    each) and unmetered (`Health`): p50/p99 direct and through the gateway.
//! 2. per-byte metering throughput: a server stream of `BENCH_PAGES` (default 2,000)
//!    messages of 64 KiB (`Pages`, metered per byte: every message counted, a budget
//!    step reserved every 64 KiB), MB/s direct and through the gateway.
//!
//! Figures are printed, never asserted: the machine's load decides them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Instant;

mod common;

use common::pct;
use fake_grpc::pb::ocr_client::OcrClient;
use fake_grpc::pb::{Image, Ping};
use fake_grpc::{DESCRIPTOR_SET, FakeOcr};
use sha2::{Digest, Sha256};
use tonic::Request;
use tonic::transport::Channel;

const KEY: &str = "sk-bench";
const PAGE_BYTES: u32 = 64 * 1024;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

fn authed<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    request
}

async fn run() {
    let count = env_or("BENCH_REQUESTS", 5000) as usize;
    let pages = env_or("BENCH_PAGES", 2000) as u32;
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let set = dir.path().join("ocr.binpb");
    std::fs::write(&set, DESCRIPTOR_SET).unwrap();
    let yaml = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: file, path: audit.jsonl}}\ntenants:\n  bench:\n    keys: [{{sha256: {}}}]\n    budgets: {{eur_per_month: 100000000}}\nai:\n  backends:\n    ocr: {{kind: grpc, url: \"{}\", descriptor_set: \"{}\"}}\n",
        hex::encode(Sha256::digest(KEY)),
        upstream.url(),
        set.display()
    );
    let gateway = common::Gateway::start(&yaml);
    let gateway_url = gateway.url.trim_end_matches("/v1").to_owned();
    let direct = OcrClient::connect(upstream.url()).await.unwrap();
    let via = OcrClient::connect(gateway_url).await.unwrap();

    println!("unary gRPC, one HTTP/2 connection, {count} sequential calls each, memory ledger");
    for (name, metered) in [("Recognize (per call)", true), ("Health (unmetered)", false)] {
        let d = unary(direct.clone(), count, metered).await;
        let g = unary(via.clone(), count, metered).await;
        println!("  {name}");
        println!("    direct   p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&d, 50.0), pct(&d, 99.0));
        println!("    gateway  p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&g, 50.0), pct(&g, 99.0));
        println!(
            "    added    p50 {:>7.1} µs  p99 {:>7.1} µs",
            pct(&g, 50.0) - pct(&d, 50.0),
            pct(&g, 99.0) - pct(&d, 99.0)
        );
    }

    println!("per-byte metered server stream, {pages} messages of {} KiB", PAGE_BYTES / 1024);
    let d = stream(direct, pages).await;
    let g = stream(via, pages).await;
    println!("  direct   {d:>8.1} MB/s");
    println!("  gateway  {g:>8.1} MB/s ({:.0}% of direct)", 100.0 * g / d);
    println!("gateway peak RSS {}", gateway.peak_memory());
}

/// Latencies in µs, sorted, after a warm-up.
async fn unary(mut client: OcrClient<Channel>, count: usize, metered: bool) -> Vec<f64> {
    let call = |client: &mut OcrClient<Channel>| {
        let mut client = client.clone();
        async move {
            if metered {
                client.recognize(authed(Image { data: vec![1; 64], ..Default::default() })).await.unwrap();
            } else {
                client.health(authed(Ping::default())).await.unwrap();
            }
        }
    };
    for _ in 0..200 {
        call(&mut client).await;
    }
    let mut latencies = Vec::with_capacity(count);
    for _ in 0..count {
        let started = Instant::now();
        call(&mut client).await;
        latencies.push(started.elapsed().as_secs_f64() * 1e6);
    }
    latencies.sort_by(f64::total_cmp);
    latencies
}

/// Message payload MB/s (10⁶ bytes) of one server stream.
async fn stream(mut client: OcrClient<Channel>, count: u32) -> f64 {
    let request = Image { count, reply_bytes: PAGE_BYTES, ..Default::default() };
    let started = Instant::now();
    let mut pages = client.pages(authed(request)).await.unwrap().into_inner();
    let mut bytes = 0u64;
    while let Some(page) = pages.message().await.unwrap() {
        bytes += page.text.len() as u64;
    }
    bytes as f64 / 1e6 / started.elapsed().as_secs_f64()
}
