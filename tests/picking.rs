//! Inference-aware choice inside a pool (SPEC §5 `pick`), end to end: the real binary
//! in front of fake model servers that have slots, a queue and a vLLM `/metrics`
//! page. A test makes a server busy by calling it directly with long calls that hold
//! its slots (and queue behind them), and frees it by dropping those calls.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use fake_model::Capacity;
use flexway_testkit::*;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// A model server that runs `slots` calls at once, each in a millisecond.
async fn server(slots: u32) -> FakeModel {
    let capacity = Capacity {
        slots,
        service: Duration::from_millis(1),
        cached_service: Duration::from_millis(1),
        cached_prefixes: 0,
    };
    FakeModel::start_with(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), Some(capacity)).await.unwrap()
}

/// `n` calls straight to `fake` that hold a slot (or wait for one) for a minute,
/// until aborted.
fn occupy(fake: &FakeModel, n: usize) -> Vec<JoinHandle<()>> {
    let url = format!("{}/chat/completions", scenario(fake, "delay_ms=60000"));
    (0..n)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let _ = reqwest::Client::new().post(url).json(&hello("m")).send().await;
            })
        })
        .collect()
}

fn release(calls: Vec<JoinHandle<()>>) {
    for call in calls {
        call.abort();
    }
}

/// Waits until the gateway's `/metrics` has every one of `series` (whole lines).
async fn until_metrics(gw: &Flexway, series: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let text = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
        if series.iter().all(|s| text.lines().any(|line| line == *s)) {
            return;
        }
        assert!(Instant::now() < deadline, "the gateway never saw {series:?}:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A config with `acme` (KEY; agent `bot` on AGENT_KEY, `bot_limits`) and
/// `globex` (OTHER_KEY, `globex_limits`), served by `pool`: `pool_keys` and the
/// members `(name, fake)`, each reading its load every 100 ms when `loads`.
fn pool_config(members: &[(&str, &FakeModel)], pool_keys: &str, loads: bool, limits: [&str; 2]) -> String {
    let [bot, globex] = limits;
    let mut yaml = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: stdout}}\ntenants:\n  acme:\n    keys:\n      \
         - sha256: {}\n      - {{sha256: {}, agent: bot}}\n    agents:\n      bot: {{{bot}}}\n  globex:\n    \
         keys:\n      - sha256: {}\n    {globex}\nai:\n  default_backend: pool\n  backends:\n    pool:\n      \
         kind: pool\n{pool_keys}      members:\n",
        sha(KEY),
        sha(AGENT_KEY),
        sha(OTHER_KEY)
    );
    for (name, _) in members {
        yaml.push_str(&format!("        - {{backend: {name}}}\n"));
    }
    for (name, fake) in members {
        yaml.push_str(&format!(
            "    {name}:\n      url: \"{}\"\n      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 1.0}}\n",
            fake.url()
        ));
        if loads {
            yaml.push_str(&format!("      load: {{metrics_url: \"{}\", every: 100ms}}\n", fake.metrics_url()));
        }
    }
    yaml
}

/// Which member served each of `n` calls made one after the other.
async fn served(gw: &Flexway, n: usize) -> Vec<String> {
    let mut backends = Vec::new();
    for _ in 0..n {
        let response = gw.chat(KEY, hello("m")).await;
        assert_eq!(response.status(), 200);
        backends.push(response.headers()["flexway-backend"].to_str().unwrap().to_owned());
    }
    backends
}

#[tokio::test]
async fn calls_follow_the_least_loaded_member_as_queues_change() {
    let (a, b) = (server(1).await, server(1).await);
    let pool = "      pick: least_loaded\n";
    let gw = Flexway::start(&pool_config(&[("a", &a), ("b", &b)], pool, true, ["", ""]));

    let busy_a = occupy(&a, 3);
    until_metrics(&gw, &["flexway_member_queue{backend=\"a\"} 2", "flexway_member_queue{backend=\"b\"} 0"]).await;
    assert_eq!(served(&gw, 8).await, vec!["b"; 8], "a has two calls queued, b none");

    release(busy_a);
    let busy_b = occupy(&b, 3);
    until_metrics(&gw, &["flexway_member_queue{backend=\"a\"} 0", "flexway_member_queue{backend=\"b\"} 2"]).await;
    assert_eq!(served(&gw, 8).await, vec!["a"; 8], "now b has the queue");
    release(busy_b);

    let records = gw.records_until::<Value>(16).await;
    let served: Vec<&Value> = records.iter().filter(|r| r["status"] == 200).collect();
    assert_eq!(served.len(), 16);
    assert!(served.iter().all(|r| r["pick_reason"] == "least_loaded" && r["criticality"] == "standard"), "{served:?}");
}

#[tokio::test]
async fn a_stale_member_is_ranked_by_the_calls_in_flight() {
    let (a, b) = (server(1).await, server(4).await);
    let pool = "      pick: least_loaded\n";
    let gw = Flexway::start(&pool_config(&[("a", &a), ("b", &b)], pool, true, ["", ""]));
    let busy_a = occupy(&a, 3);
    until_metrics(&gw, &["flexway_member_queue{backend=\"a\"} 2"]).await;
    // a's server stops answering its metrics: its sample ages out after three polls,
    // and a is ranked by the gateway's calls in flight to it (none), like b.
    drop(a);
    release(busy_a);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
        if !text.contains("flexway_member_queue{backend=\"a\"}") {
            break;
        }
        assert!(Instant::now() < deadline, "a's stale sample is still shown:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gw.logs().contains("ranked by calls in flight"), "{}", gw.logs());
}

#[tokio::test]
async fn sheddable_calls_are_refused_when_every_member_is_saturated() {
    let (a, b) = (server(2).await, server(2).await);
    let pool = "      pick: least_loaded\n      saturation: {kv_cache: 0.5}\n";
    let limits = ["max_criticality: sheddable", "max_criticality: sheddable"];
    let gw = Flexway::start(&pool_config(&[("a", &a), ("b", &b)], pool, true, limits));
    let chat = |key: &'static str, class: Option<&'static str>| {
        let mut request = gw.post("/v1/chat/completions", key, hello("m"));
        if let Some(class) = class {
            request = request.header("Flexway-Criticality", class);
        }
        request.send()
    };

    // One slot of two busy on each: every member is saturated, none is full.
    let busy = [occupy(&a, 1), occupy(&b, 1)];
    until_metrics(
        &gw,
        &["flexway_member_kv_cache_ratio{backend=\"a\"} 0.5", "flexway_member_kv_cache_ratio{backend=\"b\"} 0.5"],
    )
    .await;
    let sent_before = a.request_count() + b.request_count();

    let shed = chat(KEY, Some("sheddable")).await.unwrap();
    assert_eq!(shed.status(), 503);
    assert_eq!(shed.headers()["flexway-error-cause"], "saturated");
    assert_eq!(shed.headers()["retry-after"], "1");
    let body: Value = shed.json().await.unwrap();
    assert_eq!(body["error"]["code"], "overloaded", "{body}");
    // max_criticality lowers a class: a tenant's critical call, an agent's default.
    assert_eq!(chat(OTHER_KEY, Some("critical")).await.unwrap().status(), 503, "globex is sheddable at most");
    assert_eq!(chat(AGENT_KEY, None).await.unwrap().status(), 503, "acme's bot is sheddable at most");
    assert_eq!(a.request_count() + b.request_count(), sent_before, "a shed call is never sent");

    for class in [None, Some("standard"), Some("critical"), Some("CRITICAL")] {
        let served = chat(KEY, class).await.unwrap();
        assert_eq!(served.status(), 200, "{class:?} is pushed through");
    }
    let bad = chat(KEY, Some("urgent")).await.unwrap();
    assert_eq!(bad.status(), 400);
    let body: Value = bad.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("Flexway-Criticality"), "{body}");
    for calls in busy {
        release(calls);
    }

    until_metrics(&gw, &["flexway_calls_shed_total{tenant=\"acme\",pool=\"pool\"} 2"]).await;
    until_metrics(&gw, &["flexway_calls_shed_total{tenant=\"globex\",pool=\"pool\"} 1"]).await;
    let records = gw.records_until::<Value>(7).await;
    let shed: Vec<&Value> = records.iter().filter(|r| r["error_code"] == "overloaded").collect();
    assert_eq!(shed.len(), 3, "{records:?}");
    for record in &shed {
        assert_eq!((record["status"].as_u64(), record["criticality"].as_str()), (Some(503), Some("sheddable")));
        assert_eq!(record["cost_micro_eur"], 0, "never billed: {record}");
        assert!(record["backend"].is_null(), "{record}");
    }
    let classes: BTreeSet<&str> =
        records.iter().filter(|r| r["status"] == 200).map(|r| r["criticality"].as_str().unwrap()).collect();
    assert_eq!(classes, BTreeSet::from(["critical", "standard"]));
}

/// A conversation: a system prompt of its own, then `turns` user messages.
fn conversation(n: usize, turns: usize) -> Value {
    let system = format!("You are assistant number {n}. {}", "Answer with care and brevity. ".repeat(12));
    let mut messages = vec![json!({"role": "system", "content": system})];
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!("question {turn}")}));
    }
    json!({"model": "m", "messages": messages})
}

#[tokio::test]
async fn a_conversation_stays_on_one_member_and_prefixes_spread() {
    let fakes =
        [FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap()];
    let members = [("a", &fakes[0]), ("b", &fakes[1]), ("c", &fakes[2])];
    let pool = "      pick: least_loaded\n      cache_affinity: {prefix_bytes: 256}\n";
    let gw = Flexway::start(&pool_config(&members, pool, false, ["", ""]));
    let mut per_member: BTreeMap<String, usize> = BTreeMap::new();
    for n in 0..30 {
        let mut served = BTreeSet::new();
        for turns in 1..=4 {
            let response = gw.chat(KEY, conversation(n, turns)).await;
            assert_eq!(response.status(), 200);
            served.insert(response.headers()["flexway-backend"].to_str().unwrap().to_owned());
        }
        assert_eq!(served.len(), 1, "conversation {n} moved: {served:?}");
        *per_member.entry(served.into_iter().next().unwrap()).or_default() += 1;
    }
    assert_eq!(per_member.len(), 3, "30 prefixes spread over the three members: {per_member:?}");
    let reasons: Vec<String> =
        gw.records_until::<Value>(120).await.iter().map(|r| r["pick_reason"].as_str().unwrap().to_owned()).collect();
    assert_eq!(reasons.len(), 120);
    assert_eq!(
        reasons.iter().filter(|r| *r == "cache_affinity").count(),
        90,
        "every call after a conversation's first"
    );
}

#[tokio::test]
async fn latency_prefers_the_fast_member() {
    let fast = FakeModel::start().await.unwrap();
    let slow = FakeModel::start().await.unwrap();
    // Slow enough that a fast call the machine stalls is still the faster.
    let slow_url = scenario(&slow, "delay_ms=500");
    let yaml = pool_config(&[("fast", &fast), ("slow", &slow)], "      pick: latency\n", false, ["", ""]);
    let gw = Flexway::start(&yaml.replace(&slow.url(), &slow_url));
    let served = served(&gw, 40).await;
    let fast_calls = served.iter().filter(|b| *b == "fast").count();
    assert!(fast_calls >= 36, "the fast member served {fast_calls} of 40: {served:?}");
    assert!(slow.request_count() >= 1, "the slow member was measured too");
    assert!(gw.records_until::<Value>(40).await.iter().all(|r| r["pick_reason"] == "latency"));
}

#[tokio::test]
async fn latency_counts_a_fast_refusal_as_slow() {
    let refusing = FakeModel::start().await.unwrap();
    let slow = FakeModel::start().await.unwrap();
    let yaml = pool_config(&[("refusing", &refusing), ("slow", &slow)], "      pick: latency\n", false, ["", ""]);
    let yaml = yaml
        .replace(&refusing.url(), &scenario(&refusing, "status=429"))
        .replace(&slow.url(), &scenario(&slow, "delay_ms=50"));
    let gw = Flexway::start(&yaml);
    let mut refused = 0;
    for _ in 0..20 {
        let response = gw.chat(KEY, hello("m")).await;
        match response.status().as_u16() {
            429 => refused += 1,
            200 => assert_eq!(response.headers()["flexway-backend"], "slow"),
            other => panic!("status {other}"),
        }
    }
    // A 429 answers at once: timed as an answer, the refusing member would win every
    // draw. Counted as slow as the timeout, it loses them after its first.
    assert!(refused <= 1, "{refused} of 20 calls went to the member that refuses");
}
