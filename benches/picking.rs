//! Inference-aware picking against a weighted pool, on model servers of unequal speed.
//!
//! `cargo bench --bench picking` — four fake model servers in-process
//! (`fake_model::Capacity`: 4 slots each; a call holds its slot 20, 20, 40 and 80 ms,
//! a quarter of that when the server's prefix cache, 16 prompts, holds its prompt),
//! behind the real `flexway serve` (release, memory ledger, file audit) as its own
//! process, one pool of the four, equal weights. The same open-loop load for each
//! pick: `BENCH_RATE` calls a second (default 280) for `BENCH_SECS` (default 20),
//! each a conversation drawn at random from 64 with a 5 KB system prompt of its own.
//! With a quarter of its calls found in its cache, the slowest server takes about 60
//! calls a second: a weighted quarter of 280 saturates it while the pool has room for
//! about 670. Printed for `weighted`, `least_loaded` (metrics read every 100 ms) and
//! `least_loaded` + `cache_affinity`, side by side: time to first byte p50/p99 of
//! the calls started after the first second, the throughput served (over the run and
//! the drain of what it left queued), the calls that failed, the share of calls the
//! serving server's prefix cache held, and each server's share of the calls.
//!
//! Figures are printed, never asserted: the machine's load decides them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

mod common;

use common::pct;
use fake_model::{Capacity, FakeModel};
use sha2::{Digest, Sha256};

const KEY: &str = "sk-bench";
const SERVICE_MS: [u64; 4] = [20, 20, 40, 80];
const CONVERSATIONS: usize = 64;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

struct Outcome {
    /// Seconds to the answer's first byte, of the calls measured, sorted.
    ttfb: Vec<f64>,
    served_per_sec: f64,
    failed: usize,
    share: BTreeMap<String, usize>,
    /// The share of calls whose prompt the serving server's prefix cache held.
    cache_hits: f64,
}

async fn run() {
    let rate = env_or("BENCH_RATE", 280);
    let secs = env_or("BENCH_SECS", 20);
    println!(
        "4 servers x 4 slots, {SERVICE_MS:?} ms a call (a quarter on a prefix-cache hit), \
         {rate} calls/s for {secs} s, {CONVERSATIONS} conversations"
    );
    println!("  pick                         ttfb p50   ttfb p99   served/s  failed  cache hits  share a/b/c/d");
    let picks = [
        ("weighted", "      pick: weighted\n"),
        ("least_loaded", "      pick: least_loaded\n"),
        ("least_loaded + affinity", "      pick: least_loaded\n      cache_affinity: {prefix_bytes: 4096}\n"),
    ];
    for (name, pick) in picks {
        let outcome = one_pick(pick, rate, secs).await;
        let share: Vec<String> = ["a", "b", "c", "d"]
            .iter()
            .map(|m| {
                format!(
                    "{:.0}%",
                    100.0 * *outcome.share.get(*m).unwrap_or(&0) as f64 / outcome.ttfb.len().max(1) as f64
                )
            })
            .collect();
        println!(
            "  {name:<26} {:>7.1} ms {:>7.1} ms {:>10.1} {:>7} {:>10.0}%  {}",
            pct(&outcome.ttfb, 50.0) * 1e3,
            pct(&outcome.ttfb, 99.0) * 1e3,
            outcome.served_per_sec,
            outcome.failed,
            outcome.cache_hits * 100.0,
            share.join("/")
        );
    }
}

/// A conversation drawn at random, the same in every run (SplitMix64): a cyclic
/// draw would defeat any LRU cache.
fn splitmix64(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

async fn one_pick(pick: &str, rate: u64, secs: u64) -> Outcome {
    let mut servers = Vec::new();
    for ms in SERVICE_MS {
        let capacity = Capacity {
            slots: 4,
            service: Duration::from_millis(ms),
            cached_service: Duration::from_millis(ms / 4),
            cached_prefixes: 16,
        };
        servers.push(FakeModel::start_with(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), Some(capacity)).await.unwrap());
    }
    let mut yaml = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: file, path: audit.jsonl}}\ntenants:\n  bench:\n    \
         keys: [{{sha256: {}}}]\nai:\n  default_backend: pool\n  backends:\n    pool:\n      kind: pool\n{pick}      \
         members: [{{backend: a}}, {{backend: b}}, {{backend: c}}, {{backend: d}}]\n",
        hex::encode(Sha256::digest(KEY))
    );
    let reads_load = pick.contains("least_loaded");
    for (name, server) in ["a", "b", "c", "d"].iter().zip(&servers) {
        yaml.push_str(&format!(
            "    {name}:\n      url: \"{}\"\n      timeout: 120s\n      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 1}}\n",
            server.url()
        ));
        if reads_load {
            yaml.push_str(&format!("      load: {{metrics_url: \"{}\", every: 100ms}}\n", server.metrics_url()));
        }
    }
    let gateway = common::Gateway::start(&yaml);
    let url = format!("{}/chat/completions", gateway.url);
    let client = reqwest::Client::builder().pool_max_idle_per_host(1024).build().unwrap();
    let prompts: Vec<String> = (0..CONVERSATIONS)
        .map(|n| format!("You are assistant {n}. {}", "Keep to the facts and cite the sources you use. ".repeat(100)))
        .collect();
    // Metrics read at least once before the load starts.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let total = rate * secs;
    let every = Duration::from_secs_f64(1.0 / rate as f64);
    let started = Instant::now();
    let mut calls = Vec::with_capacity(total as usize);
    for i in 0..total {
        tokio::time::sleep_until((started + every * i as u32).into()).await;
        let conversation = (splitmix64(i) % CONVERSATIONS as u64) as usize;
        let body = serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": prompts[conversation]},
                {"role": "user", "content": format!("question {i}")}
            ]
        });
        let request = client.post(&url).bearer_auth(KEY).json(&body);
        calls.push(tokio::spawn(async move {
            let sent = Instant::now();
            let response = request.send().await.ok()?;
            let ttfb = sent.elapsed();
            let ok = response.status().is_success();
            let backend = response.headers().get("flexway-backend")?.to_str().ok()?.to_owned();
            let _ = response.bytes().await;
            ok.then_some((sent, ttfb, backend))
        }));
    }
    let mut outcome =
        Outcome { ttfb: Vec::new(), served_per_sec: 0.0, failed: 0, share: BTreeMap::new(), cache_hits: 0.0 };
    let warm = started + Duration::from_secs(1);
    let mut served = 0;
    for call in calls {
        match call.await.unwrap() {
            Some((sent, ttfb, backend)) => {
                served += 1;
                if sent >= warm {
                    outcome.ttfb.push(ttfb.as_secs_f64());
                    *outcome.share.entry(backend).or_default() += 1;
                }
            }
            None => outcome.failed += 1,
        }
    }
    outcome.served_per_sec = served as f64 / started.elapsed().as_secs_f64();
    outcome.ttfb.sort_by(f64::total_cmp);
    let (mut queries, mut hits) = (0.0, 0.0);
    for server in &servers {
        let page = client.get(server.metrics_url()).send().await.unwrap().text().await.unwrap();
        let read = |name: &str| -> f64 {
            let line = page.lines().find(|l| l.starts_with(name)).unwrap();
            line.rsplit_once(' ').unwrap().1.parse().unwrap()
        };
        queries += read("vllm:prefix_cache_queries_total");
        hits += read("vllm:prefix_cache_hits_total");
    }
    outcome.cache_hits = hits / queries.max(1.0);

    drop(gateway);
    outcome
}
