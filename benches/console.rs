//! The console at 200 tenants: page weight, time to serve, time to render.
//!
//! `cargo bench --bench console` — the real `flexway serve` (release, memory ledger)
//! with `BENCH_TENANTS` tenants (default 200; every fourth with an agent of its own
//! budgets), a fake model server in-process, and a call for each tenant first. Then
//! `/console` (page 1 of 50 tenants, and the last page) and `/console/data.json`,
//! 50 times each with the console key as `Authorization: Bearer`: bytes, and the
//! time to the whole answer p50/p99. With Debian's `chromedriver` on the PATH (or
//! `CHROMEDRIVER`), a headless Chromium signs in and loads page 1 twenty times: the
//! navigation's duration to `load` p50/p99, as the browser's Navigation Timing says.
//!
//! Figures are printed, never asserted: the machine's load decides them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use flexway_testkit::browser;
mod common;

use common::pct;
use fake_model::FakeModel;
use sha2::{Digest, Sha256};

const CONSOLE_KEY: &str = "sk-console-bench";

fn sha(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn run() {
    let tenants: usize = std::env::var("BENCH_TENANTS").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let model = FakeModel::start().await.unwrap();
    let mut yaml = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: file, path: audit.jsonl}}\nconsole:\n  keys:\n    \
         - sha256: {}\nai:\n  default_backend: main\n  budget: {{soft: {{threshold: 0.8, backend: main}}}}\n  \
         backends:\n    main:\n      url: \"{}\"\n      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}\n\
         tenants:\n",
        sha(CONSOLE_KEY),
        model.url()
    );
    for i in 0..tenants {
        yaml.push_str(&format!(
            "  team-{i:03}:\n    keys: [{{sha256: {}}}]\n    budgets: {{tokens_per_day: {}, tokens_per_month: 10000000, \
             eur_per_month: 50}}\n",
            sha(&format!("sk-team-{i}")),
            100 + i * 50
        ));
        if i % 4 == 0 {
            yaml.push_str("    agents:\n      bot: {budgets: {tokens_per_day: 5000}}\n");
        }
    }
    let gateway = common::Gateway::start(&yaml);
    let base = gateway.url.trim_end_matches("/v1").to_owned();
    let http = reqwest::Client::new();
    for i in 0..tenants {
        let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]});
        let _ = http
            .post(format!("{}/chat/completions", gateway.url))
            .bearer_auth(format!("sk-team-{i}"))
            .json(&body)
            .send()
            .await
            .unwrap();
    }
    println!("{tenants} tenants ({} agents with budgets), one call each", tenants.div_ceil(4));
    let last_page = tenants.div_ceil(50);
    for (what, path) in [
        ("/console, page 1", "/console".to_owned()),
        ("/console, last page", format!("/console?page={last_page}")),
        ("/console/data.json", "/console/data.json".to_owned()),
        ("/console/data.json, all pages' tenants filtered to one", "/console/data.json?q=team-199".to_owned()),
    ] {
        let (mut times, mut bytes) = (Vec::new(), 0);
        for _ in 0..50 {
            let started = Instant::now();
            let response = http.get(format!("{base}{path}")).bearer_auth(CONSOLE_KEY).send().await.unwrap();
            assert!(response.status().is_success(), "{path}: {}", response.status());
            bytes = response.bytes().await.unwrap().len();
            times.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{what:<55} {:>7.1} KiB  served in p50 {:.2} ms, p99 {:.2} ms",
            bytes as f64 / 1024.0,
            pct(&times, 50.0),
            pct(&times, 99.0)
        );
    }

    let driver = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
    if std::process::Command::new(&driver).arg("--version").output().is_err() {
        println!("browser: no chromedriver ({driver}): render time not measured");
        return;
    }
    let browser = browser::Browser::start().await;
    browser.go(&format!("{base}/console")).await;
    browser.type_into("#key", CONSOLE_KEY).await;
    browser.click("#sign-in").await;
    browser.source_with("id=\"backends\"").await;
    let mut loads = Vec::new();
    for _ in 0..20 {
        browser.go(&format!("{base}/console")).await;
        let timing = browser
            .run("const n = performance.getEntriesByType('navigation')[0]; return [n.duration, n.domContentLoadedEventEnd, n.transferSize];")
            .await;
        loads.push(timing[0].as_f64().unwrap_or(f64::NAN));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    loads.sort_by(f64::total_cmp);
    println!(
        "browser: page 1 in headless Chromium, request to load event   p50 {:.1} ms, p99 {:.1} ms",
        pct(&loads, 50.0),
        pct(&loads, 99.0)
    );
    browser.quit().await;
}
