//! `/mcp` through the real gateway (SPEC §17): what the gateway adds to a tool call.
//!
//! `cargo bench --bench mcp` — the fake MCP server (`tests/fake-mcp`, the official
//! Rust SDK's server) in-process, the real `flexway serve` (release) in its own
//! process on the memory ledger; one connection each, one session each, sequential
//! `tools/call echo` (`BENCH_REQUESTS`, default 2,000), p50/p99 from the send to the
//! last byte of:
//! 1. the fake directly;
//! 2. the same through the gateway (identity, policy, the sealed session opened, the
//!    price reserved and settled, the record written);
//!
//! and the p50 the gateway adds (the target: at most 200 µs). Figures are printed,
//! never asserted: the machine's load decides them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::panic)]

use std::time::Instant;

mod common;

use common::pct;
use fake_mcp::FakeMcp;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const KEY: &str = "sk-bench";
const VERSION: &str = "2025-11-25";

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

/// One MCP session on one connection.
struct Session {
    http: reqwest::Client,
    url: String,
    key: Option<&'static str>,
    id: Option<String>,
}

impl Session {
    async fn open(url: String, key: Option<&'static str>) -> Session {
        let http = reqwest::Client::builder().pool_max_idle_per_host(1).build().unwrap();
        let mut session = Session { http, url, key, id: None };
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": VERSION, "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}});
        let response = session.post(&init).send().await.unwrap();
        session.id = response.headers().get("mcp-session-id").map(|v| v.to_str().unwrap().to_owned());
        answer(response).await;
        let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        assert_eq!(session.post(&note).send().await.unwrap().status(), 202);
        session
    }

    fn post(&self, body: &Value) -> reqwest::RequestBuilder {
        let mut request = self
            .http
            .post(&self.url)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", VERSION)
            .json(body);
        if let Some(key) = self.key {
            request = request.bearer_auth(key);
        }
        if let Some(id) = &self.id {
            request = request.header("mcp-session-id", id);
        }
        request
    }

    async fn echo(&self, name: &str, i: usize) {
        let body = json!({"jsonrpc": "2.0", "id": i, "method": "tools/call",
            "params": {"name": name, "arguments": {"text": "hello there"}}});
        let message = answer(self.post(&body).send().await.unwrap()).await;
        assert_eq!(message["result"]["content"][0]["text"], "hello there", "{message}");
    }
}

/// The JSON-RPC answer: the body, or the SSE event that carries it.
async fn answer(response: reqwest::Response) -> Value {
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "{status}: {text}");
    serde_json::from_str(&text).ok().unwrap_or_else(|| {
        text.lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .filter_map(|data| serde_json::from_str::<Value>(data.trim()).ok())
            .find(|message| message.get("id").is_some())
            .unwrap_or_else(|| panic!("no answer in {text}"))
    })
}

async fn measure(label: &str, session: &Session, tool: &str, count: usize) -> Vec<f64> {
    for i in 0..100 {
        session.echo(tool, i).await;
    }
    let mut latencies = Vec::with_capacity(count);
    for i in 0..count {
        let sent = Instant::now();
        session.echo(tool, i).await;
        latencies.push(sent.elapsed().as_secs_f64() * 1e6);
    }
    latencies.sort_by(f64::total_cmp);
    println!("  {label:<28} p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&latencies, 50.0), pct(&latencies, 99.0));
    latencies
}

async fn run() {
    let count: usize = std::env::var("BENCH_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let server = FakeMcp::start().await.unwrap();
    let yaml = format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: file, path: audit.jsonl}}
tenants:
  bench:
    keys: [{{sha256: {key}}}]
    budgets: {{eur_per_month: 1000000}}
ai:
  default_backend: main
  backends:
    main: {{url: "http://127.0.0.1:9/v1", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}
mcp:
  session_key: "file:./session.key"
  servers:
    tools: {{url: "{url}", price: {{per_call_eur: 0.0001}}}}
"#,
        key = hex::encode(Sha256::digest(KEY)),
        url = server.url()
    );
    let gateway = common::Gateway::start_with_files(&yaml, &[("session.key", "0123456789abcdef0123456789abcdef")]);
    let base = gateway.url.trim_end_matches("/v1").to_owned();

    let direct = Session::open(server.url(), None).await;
    let through = Session::open(format!("{base}/mcp"), Some(KEY)).await;
    println!("one connection, one session, {count} sequential tools/call echo each");
    let alone = measure("the fake directly", &direct, "echo", count).await;
    let proxied = measure("through the gateway", &through, "tools__echo", count).await;
    println!(
        "  the gateway adds             p50 {:>7.1} µs  p99 {:>7.1} µs (target: p50 ≤ 200 µs)",
        pct(&proxied, 50.0) - pct(&alone, 50.0),
        pct(&proxied, 99.0) - pct(&alone, 99.0)
    );
    drop(gateway);
}
