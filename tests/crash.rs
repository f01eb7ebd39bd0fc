//! The embedded ledger across process deaths: the real binary, killed with SIGKILL.

use std::time::{Duration, Instant};

use flexway::budget::{BudgetStore, CounterKey, EmbeddedBudgetStore, Period, Unit, period::unix_now};
use flexway_testkit::*;
use serde_json::{Value, json};

fn config(ledger: &std::path::Path, url: &str, tokens_per_day: u64) -> String {
    config_synced(ledger, url, tokens_per_day, "interval")
}

/// `sync`: the embedded ledger's `store.sync`.
fn config_synced(ledger: &std::path::Path, url: &str, tokens_per_day: u64, sync: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: embedded, path: "{ledger}", sync: {sync}}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys: [{{sha256: {key}}}]
    budgets: {{tokens_per_day: {tokens_per_day}}}
ai:
  default_backend: main
  budget: {{default_max_tokens: 100, min_completion_tokens: 100}}
  backends:
    main: {{url: "{url}", timeout: 1s}}
"#,
        ledger = ledger.display(),
        key = sha(KEY)
    )
}

fn call() -> serde_json::Value {
    json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_held_by_a_killed_process_is_refunded_after_restart() {
    let model = FakeModel::start().await.unwrap();
    let hang = model.scenario_url(&Scenario { hang: true, ..Default::default() });
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger");
    // Room for exactly one call (18 prompt + 100 completion tokens).
    let first = Flexway::start(&config(&ledger, &hang, 118));
    let url = first.url.clone();
    let in_flight = tokio::spawn(async move {
        client().post(format!("{url}/v1/chat/completions")).bearer_auth(KEY).json(&call()).send().await
    });
    while model.request_count() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(first); // SIGKILL mid-call: nothing settles, nothing refunds.
    assert!(in_flight.await.unwrap().is_err(), "the call died with the process");

    let second = Flexway::start(&config(&ledger, &model.url(), 118));
    let refused = second.chat(KEY, call()).await;
    assert_eq!(refused.status(), 429, "the dead call's reservation survived the crash");
    let started = Instant::now();
    loop {
        let response = second.chat(KEY, call()).await;
        if response.status() == 200 {
            break;
        }
        assert_eq!(response.status(), 429);
        assert!(started.elapsed() < Duration::from_secs(40), "the sweeper never refunded the reservation");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    second.log_line(&["sweeper refunded expired reservations"]).await;
}

/// Whatever `store.sync` says: a kill loses nothing acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_ledger_keeps_its_counters_across_restarts() {
    let model = FakeModel::start().await.unwrap();
    for sync in ["interval", "reservation"] {
        let dir = tempfile::tempdir().unwrap();
        let ledger = dir.path().join("ledger");
        let mut used = 0;
        for _ in 0..2 {
            let gw = Flexway::start(&config_synced(&ledger, &model.url(), 100_000, sync));
            let response = gw.chat(KEY, call()).await;
            assert_eq!(response.status(), 200);
            let body: Value = response.json().await.unwrap();
            used += body["usage"]["total_tokens"].as_u64().unwrap();
            drop(gw); // SIGKILL: what was acknowledged must be on disk.
        }
        let store = EmbeddedBudgetStore::open(&ledger).unwrap();
        let key = CounterKey::new("acme", None, Unit::Tokens, Period::Day, unix_now());
        assert_eq!(store.used(&[key]).await.unwrap(), [used], "sync: {sync}");
        assert_eq!(store.live_reservations().await.unwrap(), 0, "sync: {sync}");
    }
}
