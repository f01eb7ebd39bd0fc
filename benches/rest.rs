//! What Flexway adds to a REST operation (SPEC §10, `kind: http`), against calling
//! the upstream directly.
//!
//! `cargo bench --bench rest` — an axum upstream in-process and the real `flexway
//! serve` (release) as its own process on loopback, memory ledger, file audit, then:
//! 1. latency: `BENCH_REQUESTS` (default 5,000) sequential calls on one kept-alive
//!    connection, per-call metered (`GET /documents/latest`: a reservation and a
//!    settlement each) and unmetered (`GET /documents/{id}`): p50/p99 direct and
//!    through the gateway.
//! 2. per-byte metering throughput: `BENCH_UPLOAD_MIB` (default 512) MiB uploaded to
//!    `POST /documents` (metered per byte, no Content-Length: a budget step reserved
//!    for every chunk past the reservations), MB/s direct and through the gateway.
//!
//! Figures are printed, never asserted: the machine's load decides them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Instant;

mod common;

use common::pct;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};

const KEY: &str = "sk-bench";
const CONTRACT: &str = r#"
openapi: 3.1.0
info: {title: OCR, version: "1"}
paths:
  /documents:
    post:
      x-flexway-ai: {metering: per_byte, price_per_thousand_eur: "0.000001", feature: ocr}
      responses: {"200": {description: ok}}
  /documents/latest:
    get:
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "0.5", feature: ocr-latest}
      responses: {"200": {description: ok}}
  /documents/{id}:
    get: {responses: {"200": {description: ok}}}
"#;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn upstream() -> String {
    use axum::routing::{get, post};
    let router = axum::Router::new()
        .route(
            "/documents",
            post(|body: axum::body::Body| async move {
                let mut stream = body.into_data_stream();
                let mut bytes = 0usize;
                while let Some(chunk) = stream.next().await {
                    bytes += chunk.unwrap().len();
                }
                bytes.to_string()
            }),
        )
        .route("/documents/latest", get(|| async { r#"{"latest":true}"# }))
        .route("/documents/{id}", get(|| async { r#"{"id":"42"}"# }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

async fn run() {
    let count = env_or("BENCH_REQUESTS", 5000) as usize;
    let upload_mib = env_or("BENCH_UPLOAD_MIB", 512) as usize;
    let upstream = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let contract = dir.path().join("ocr.yaml");
    std::fs::write(&contract, CONTRACT).unwrap();
    let yaml = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: file, path: audit.jsonl}}\ntenants:\n  bench:\n    keys: [{{sha256: {}}}]\n    budgets: {{eur_per_month: 100000000}}\nai:\n  backends:\n    ocr: {{kind: http, url: \"{upstream}\", contract: \"{}\", mount: /apis/ocr}}\n",
        hex::encode(Sha256::digest(KEY)),
        contract.display()
    );
    let gateway = common::Gateway::start(&yaml);
    let via = format!("{}/apis/ocr", gateway.url.trim_end_matches("/v1"));
    let client = reqwest::Client::builder().pool_max_idle_per_host(1).build().unwrap();

    println!("REST operations, one kept-alive connection, {count} sequential calls each, memory ledger");
    for (name, path) in [
        ("GET /documents/latest (per call)", "/documents/latest"),
        ("GET /documents/{id} (unmetered)", "/documents/42"),
    ] {
        let d = latencies(&client, &format!("{upstream}{path}"), count).await;
        let g = latencies(&client, &format!("{via}{path}"), count).await;
        println!("  {name}");
        println!("    direct   p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&d, 50.0), pct(&d, 99.0));
        println!("    gateway  p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&g, 50.0), pct(&g, 99.0));
        println!(
            "    added    p50 {:>7.1} µs  p99 {:>7.1} µs",
            pct(&g, 50.0) - pct(&d, 50.0),
            pct(&g, 99.0) - pct(&d, 99.0)
        );
    }

    println!("per-byte metered upload, {upload_mib} MiB in 64 KiB chunks, no Content-Length");
    let d = upload(&client, &format!("{upstream}/documents"), upload_mib).await;
    let g = upload(&client, &format!("{via}/documents"), upload_mib).await;
    println!("  direct   {d:>8.1} MB/s");
    println!("  gateway  {g:>8.1} MB/s ({:.0}% of direct)", 100.0 * g / d);
    println!("gateway peak RSS {}", gateway.peak_memory());
}

/// Latencies in µs, sorted, after a warm-up.
async fn latencies(client: &reqwest::Client, url: &str, count: usize) -> Vec<f64> {
    let call = || async {
        let response = client.get(url).bearer_auth(KEY).send().await.unwrap();
        assert!(response.status().is_success(), "{url}: {}", response.status());
        response.bytes().await.unwrap();
    };
    for _ in 0..200 {
        call().await;
    }
    let mut latencies = Vec::with_capacity(count);
    for _ in 0..count {
        let started = Instant::now();
        call().await;
        latencies.push(started.elapsed().as_secs_f64() * 1e6);
    }
    latencies.sort_by(f64::total_cmp);
    latencies
}

/// Upload MB/s (10⁶ bytes) of `mib` MiB.
async fn upload(client: &reqwest::Client, url: &str, mib: usize) -> f64 {
    const CHUNK: usize = 64 * 1024;
    let chunks = futures_util::stream::iter(
        (0..mib * 16).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![7u8; CHUNK]))),
    );
    let started = Instant::now();
    let response = client.post(url).bearer_auth(KEY).body(reqwest::Body::wrap_stream(chunks)).send().await.unwrap();
    let received: usize = response.text().await.unwrap().trim().parse().unwrap();
    assert_eq!(received, mib * 16 * CHUNK);
    (mib * 16 * CHUNK) as f64 / 1e6 / started.elapsed().as_secs_f64()
}
