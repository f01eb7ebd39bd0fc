//! Realtime sessions through the real `flexway` binary: the latency Flexway adds to a
//! WebSocket message, and 1,000 concurrent sessions (memory, completion).
//!
//! `cargo bench --bench realtime` — starts the fake realtime upstream in-process and
//! `flexway serve` (release build) as its own process with the in-memory ledger and a
//! file audit, then:
//! 1. echo round trips on one session (a 200-byte text event sent, the backend's echo
//!    received), 2,000 straight to the fake upstream and 2,000 through Flexway: p50/p99
//!    of each; a round trip crosses the gateway twice, so the added time per message
//!    is half the difference;
//! 2. 1,000 sessions opened at once through Flexway, each then running 10 responses
//!    (`response.create` → `response.done`, charged), 100 ms apart: how many complete,
//!    the gateway's resident memory with all 1,000 open, minus before, per session,
//!    and its peak.
//!
//! Figures are printed, never asserted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::panic)]

use std::time::{Duration, Instant};

mod common;

use common::pct;
use fake_model::FakeModel;
use futures_util::{SinkExt, StreamExt};
use sha2::{Digest, Sha256};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

const KEY: &str = "sk-bench";
const SESSIONS: usize = 1000;
const RESPONSES: usize = 10;

type Client = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn run() {
    let model = FakeModel::start().await.unwrap();
    let yaml = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: file, path: audit.jsonl}}\ntenants:\n  bench:\n    keys: [{{sha256: {}}}]\nai:\n  default_backend: rt\n  backends:\n    rt: {{url: \"{}\", capabilities: [chat, realtime], price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 1}}}}\n",
        hex::encode(Sha256::digest(KEY)),
        model.url()
    );
    let process = common::Gateway::start(&yaml);
    let direct = model.url().replacen("http://", "ws://", 1);
    let gateway = process.url.replacen("http://", "ws://", 1);

    let straight = round_trips(&direct, 2000).await;
    let through = round_trips(&gateway, 2000).await;
    println!("echo round trips on one session (200-byte text event), 2,000 each");
    println!("  direct   p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&straight, 50.0), pct(&straight, 99.0));
    println!("  gateway  p50 {:>7.1} µs  p99 {:>7.1} µs", pct(&through, 50.0), pct(&through, 99.0));
    println!(
        "  added per message (half a round trip)  p50 {:>6.1} µs  p99 {:>6.1} µs",
        (pct(&through, 50.0) - pct(&straight, 50.0)) / 2.0,
        (pct(&through, 99.0) - pct(&straight, 99.0)) / 2.0
    );

    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = process.rss_kib();
    let started = Instant::now();
    let opening: Vec<_> = (0..SESSIONS).map(|_| tokio::spawn(open(gateway.clone()))).collect();
    let mut clients = Vec::with_capacity(SESSIONS);
    for task in opening {
        if let Ok(Some(client)) = task.await {
            clients.push(client);
        }
    }
    let opened = clients.len();
    let open_for = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let with_all_open = process.rss_kib();
    let running: Vec<_> = clients.into_iter().map(|client| tokio::spawn(responses(client))).collect();
    let mut completed = 0;
    let mut worst = Duration::ZERO;
    for task in running {
        if let Ok(Some(slowest)) = task.await {
            completed += 1;
            worst = worst.max(slowest);
        }
    }
    println!("{SESSIONS} concurrent realtime sessions through the gateway");
    println!("  opened {opened}/{SESSIONS} in {:.2} s", open_for.as_secs_f64());
    println!("  completed {completed}/{SESSIONS} ({RESPONSES} charged responses each, 100 ms apart)");
    println!("  slowest response round trip: {} ms", worst.as_millis());
    println!(
        "  gateway resident memory: {} KiB before, {} KiB with all open: {:.1} KiB a session; peak {}",
        before,
        with_all_open,
        with_all_open.saturating_sub(before) as f64 / opened.max(1) as f64,
        process.peak_memory()
    );
}

async fn connect(base: &str) -> Option<Client> {
    let mut request = format!("{base}/realtime?model=m").into_client_request().ok()?;
    request.headers_mut().insert("authorization", format!("Bearer {KEY}").parse().ok()?);
    let (mut client, _) = tokio_tungstenite::connect_async(request).await.ok()?;
    client.next().await?.ok()?; // session.created
    Some(client)
}

async fn open(base: String) -> Option<Client> {
    connect(&base).await
}

async fn round_trips(base: &str, count: usize) -> Vec<f64> {
    let mut client = connect(base).await.unwrap();
    let event = format!(r#"{{"type":"conversation.item.create","item":{{"text":"{}"}}}}"#, "x".repeat(150));
    let mut out = Vec::with_capacity(count);
    for _ in 0..count + 100 {
        let sent = Instant::now();
        client.send(Message::text(event.clone())).await.unwrap();
        client.next().await.unwrap().unwrap();
        out.push(sent.elapsed().as_secs_f64() * 1e6);
    }
    let _ = client.close(None).await;
    let mut out = out.split_off(100); // warm-up dropped
    out.sort_by(f64::total_cmp);
    out
}

/// Runs the responses of one session; its slowest response, or None if it failed.
async fn responses(mut client: Client) -> Option<Duration> {
    let mut slowest = Duration::ZERO;
    for _ in 0..RESPONSES {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let sent = Instant::now();
        client.send(Message::text(r#"{"type":"response.create"}"#)).await.ok()?;
        loop {
            match client.next().await?.ok()? {
                Message::Text(text) if text.as_str().contains("\"response.done\"") => break,
                Message::Close(_) => return None,
                _ => {}
            }
        }
        slowest = slowest.max(sent.elapsed());
    }
    let _ = client.close(None).await;
    Some(slowest)
}
