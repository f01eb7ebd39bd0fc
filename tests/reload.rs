//! Reloading the configuration without dropping a call (SPEC §12), on the real binary:
//! SIGHUP and `--watch`, a revoked key, a stream across a reload, an invalid file,
//! and many reloads under load.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use flexway_testkit::*;
use serde_json::Value;

const NEW_KEY: &str = "sk-test-acme-rotated";

/// Waits until `/healthz` reports a configuration other than `before`.
async fn until_reloaded(gw: &Flexway, before: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = gw.served_sha().await;
        if now != before {
            return now;
        }
        assert!(Instant::now() < deadline, "never reloaded: {}", gw.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_revoked_key_is_refused_from_the_next_call_on_the_same_connection() {
    let model = FakeModel::start().await.unwrap();
    let first = reloadable_config(KEY, &model.url());
    let gw = Flexway::start(&first);
    assert_eq!(gw.served_sha().await, sha(&first), "/healthz names the configuration served");
    // One client: its connection is kept alive across the reload.
    let http = client();
    let call = |key: &'static str| {
        http.post(format!("{}/v1/chat/completions", gw.url)).bearer_auth(key).json(&hello("m")).send()
    };
    assert_eq!(call(KEY).await.unwrap().status(), 200);
    assert_eq!(call(NEW_KEY).await.unwrap().status(), 401);

    let second = reloadable_config(NEW_KEY, &model.url());
    std::fs::write(gw.config_path(), &second).unwrap();
    gw.hangup();
    assert_eq!(until_reloaded(&gw, &sha(&first)).await, sha(&second));
    assert_eq!(call(KEY).await.unwrap().status(), 401, "the revoked key, at once");
    assert_eq!(call(NEW_KEY).await.unwrap().status(), 200);
    let metrics = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("flexway_config_reloads_total{outcome=\"ok\"} 1"), "{metrics}");
    // The metrics went on across the reload.
    assert!(metrics.contains("flexway_inference_calls_total{tenant=\"acme\",backend=\"main\""), "{metrics}");
}

#[tokio::test]
async fn a_stream_in_flight_across_a_reload_ends_and_is_recorded() {
    let model = FakeModel::start().await.unwrap();
    let url = scenario(&model, "words=60,chunk_delay_ms=200");
    let first = reloadable_config(KEY, &url);
    let gw = Flexway::start(&first);
    let mut body = hello("m");
    body["stream"] = true.into();
    let response = gw.chat(KEY, body).await;
    assert_eq!(response.status(), 200);
    let reader = tokio::spawn(sse_data(response));
    tokio::time::sleep(Duration::from_millis(150)).await;
    std::fs::write(gw.config_path(), reloadable_config(NEW_KEY, &url)).unwrap();
    gw.hangup();
    until_reloaded(&gw, &sha(&first)).await;
    assert!(!reader.is_finished(), "the stream is still going when the reload is in use");
    let (events, error) = reader.await.unwrap();
    assert_eq!((events.last().map(String::as_str), error), (Some("[DONE]"), None), "{events:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    let record = loop {
        let found = gw.stdout().iter().filter_map(|l| serde_json::from_str::<Value>(l).ok()).next();
        if let Some(record) = found {
            break record;
        }
        assert!(Instant::now() < deadline, "no audit record");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!((record["status"].as_u64(), record["tenant"].as_str()), (Some(200), Some("acme")));
    assert!(record["completion_tokens"].as_u64().unwrap() >= 60, "{record}");
}

#[tokio::test]
async fn an_invalid_file_leaves_the_running_configuration_serving() {
    let model = FakeModel::start().await.unwrap();
    let first = reloadable_config(KEY, &model.url());
    let gw = Flexway::start(&first);
    std::fs::write(gw.config_path(), "version: 1\ntenants: {acme: {keys: [{sha256: nothex}]}}\n").unwrap();
    gw.hangup();
    let deadline = Instant::now() + Duration::from_secs(10);
    // One line per error, each logged on its own: wait for both, not the first.
    let every_error_logged = |logs: &str| logs.contains("tenants.acme.keys[0].sha256") && logs.contains(": ai");
    while !every_error_logged(&gw.logs()) {
        assert!(Instant::now() < deadline, "every error logged: {}", gw.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gw.served_sha().await, sha(&first));
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    let metrics = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("flexway_config_reloads_total{outcome=\"failed\"} 1"), "{metrics}");

    // What only a restart can change is refused too, naming it.
    let moved =
        reloadable_config(KEY, &model.url()).replace("store: {kind: memory}", "store: {kind: embedded, path: x}");
    std::fs::write(gw.config_path(), moved).unwrap();
    gw.hangup();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gw.logs().contains("`store` changed: it takes a restart") {
        assert!(Instant::now() < deadline, "{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gw.served_sha().await, sha(&first));
}

#[tokio::test]
async fn watch_picks_up_a_change_of_the_file() {
    let model = FakeModel::start().await.unwrap();
    let first = reloadable_config(KEY, &model.url());
    let gw = Flexway::start_with_args(&first, &["--watch", "100ms"]);
    // The same bytes written again are no change. The watcher is given a few of its
    // polls to see them before the next write, so that the two are not one change.
    std::fs::write(gw.config_path(), &first).unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = reloadable_config(NEW_KEY, &model.url());
    std::fs::write(gw.config_path(), &second).unwrap();
    assert_eq!(until_reloaded(&gw, &sha(&first)).await, sha(&second));
    assert_eq!(gw.chat(NEW_KEY, hello("m")).await.status(), 200);
    // Lines are read in order: once the second file's reload is in the log, a reload of
    // the same bytes, however late, would be before it.
    let second_sha = sha(&second);
    gw.log_line(&["configuration reloaded", &second_sha]).await;
    let reloads = gw.logs().matches("configuration reloaded").count();
    assert_eq!(reloads, 1, "the same bytes were reloaded: {}", gw.logs());
}

#[tokio::test]
async fn a_thousand_reloads_under_load_lose_no_call_and_no_record() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let model = FakeModel::start().await.unwrap();
    let a = reloadable_config(KEY, &model.url());
    let b = a.replace("output_per_mtok_eur: 2", "output_per_mtok_eur: 3");
    let gw = Flexway::start(&a);
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (url, stop) = (gw.url.clone(), stop.clone());
        tokio::spawn(async move {
            let http = client();
            let mut statuses = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let call = http.post(format!("{url}/v1/chat/completions")).bearer_auth(KEY).json(&hello("m"));
                statuses.push(call.send().await.map(|r| r.status().as_u16()).unwrap_or(0));
            }
            statuses
        })
    };
    let mut current = sha(&a);
    let mut rss_early = 0;
    for reload in 1..=1000 {
        std::fs::write(gw.config_path(), if reload % 2 == 1 { &b } else { &a }).unwrap();
        gw.hangup();
        current = until_reloaded(&gw, &current).await;
        if reload == 100 {
            rss_early = rss(&gw);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let statuses = load.await.unwrap();
    assert!(statuses.len() > 100, "calls were in flight throughout: {}", statuses.len());
    assert!(statuses.iter().all(|s| *s == 200), "every call served: {statuses:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while gw.stdout().iter().filter(|l| l.starts_with('{')).count() < statuses.len() {
        assert!(Instant::now() < deadline, "a record lost");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Each replaced gateway is dropped with its last call: memory does not grow with
    // the reloads (a gateway leaked a reload would show here as tens of megabytes).
    let rss_late = rss(&gw);
    eprintln!("1000 reloads, {} calls; RSS {rss_early} KiB after 100, {rss_late} KiB after 1000", statuses.len());
    assert!(rss_late < rss_early + 8 * 1024, "RSS grew from {rss_early} KiB to {rss_late} KiB");
}

/// Resident memory now, in KiB.
fn rss(gw: &Flexway) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", gw.pid())).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}
