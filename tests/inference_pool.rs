//! `kind: inference_pool` (SPEC §5, Gateway API Inference Extension), end to end: the
//! real binary asks a fake `ext_proc` endpoint picker on loopback which fake model
//! server serves each call, calls it, falls back to the next endpoint named, and
//! fails closed or open when the picker cannot answer.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use fake_grpc::picker::{FakePicker, Picks};
use flexway_testkit::*;
use serde_json::Value;

/// A config whose default backend is the inference pool `pool`, asking `picker` (in
/// `failure_mode`), its endpoints called on `port` at `path`, then `rest`: more keys
/// of the pool (indented six spaces) and other backends.
fn pool_config(picker: &FakePicker, failure_mode: &str, port: u16, path: &str, rest: &str) -> String {
    acme_config(
        "{}",
        &format!(
            "  default_backend: pool\n  backends:\n    pool:\n      kind: inference_pool\n      \
             endpoint_picker: {{url: \"{}\", failure_mode: {failure_mode}}}\n      \
             target: {{port: {port}, path: \"{path}\"}}\n      models: [llama]\n      \
             price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 1.0}}\n{rest}",
            picker.url(),
        ),
    )
}

#[tokio::test]
async fn the_picker_s_choice_is_honoured_and_sent_the_call() {
    let (a, b) = (FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap());
    // `a` named by address alone: it takes the target's port.
    let picker = FakePicker::start(Picks::Header(format!("127.0.0.1, {}", b.addr()))).await.unwrap();
    let gw = Flexway::start(&pool_config(&picker, "fail_close", a.addr().port(), "/v1", ""));

    for _ in 0..3 {
        let response = gw.post("/v1/chat/completions", KEY, hello("llama")).send().await;
        let Ok(response) = response else { panic!("{}", gw.logs()) };
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["flexway-backend"], "pool");
        assert!(response.headers().get("flexway-degraded").is_none());
    }
    assert_eq!((a.request_count(), b.request_count()), (3, 0), "the first endpoint named serves");
    let sent = &a.requests()[0];
    assert_eq!(sent.path, "/v1/chat/completions");

    let seen = picker.seen();
    assert_eq!(seen.len(), 3, "asked once a call");
    let body: Value = serde_json::from_slice(&seen[0].body).unwrap();
    assert_eq!(body["model"], "llama", "the picker reads the call's body as the pool is sent it");
    let header = |name: &str| seen[0].headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    assert_eq!(header(":path").as_deref(), Some(&b"/chat/completions"[..]));
    assert!(header("x-request-id").is_some());
    assert!(header("authorization").is_none(), "the caller's key never reaches the picker");

    let records = gw.records_until::<Value>(3).await;
    assert!(records.iter().all(|r| r["backend"] == "pool" && r["pick_reason"] == "picker"), "{records:?}");
    assert!(records.iter().all(|r| r["cost_micro_eur"].as_u64().unwrap() > 0), "billed at the pool's price");
}

#[tokio::test]
async fn the_next_endpoint_named_serves_when_the_first_fails() {
    let model = FakeModel::start().await.unwrap();
    let closed = ClosedPort::new();
    let dead = closed.port();
    let picker = FakePicker::start(Picks::Header(format!("127.0.0.1:{dead}, {}", model.addr()))).await.unwrap();
    let gw = Flexway::start(&pool_config(&picker, "fail_close", 1, "/v1", ""));
    let response = gw.chat(KEY, hello("llama")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["flexway-degraded"], "backend-fallback", "served by a fallback endpoint");
    assert_eq!(model.request_count(), 1);
    let records = gw.records_until::<Value>(1).await;
    assert_eq!(records[0]["pick_reason"], "fallback");
    assert_eq!(records[0]["degraded"], true);
    drop(gw);

    // Every endpoint named fails (the target's path makes the fakes answer 500): at
    // most three are tried, each once, and the pool is exhausted.
    let fakes = [FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap()];
    let named = format!("{}, {}, 127.0.0.1:{dead}, {}", fakes[0].addr(), fakes[1].addr(), model.addr());
    let picker = FakePicker::start(Picks::Header(named)).await.unwrap();
    let gw = Flexway::start(&pool_config(&picker, "fail_close", 1, "/s/status=500/v1", ""));
    let response = gw.chat(KEY, hello("llama")).await;
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["flexway-error-cause"], "pool_exhausted");
    assert_eq!([fakes[0].request_count(), fakes[1].request_count()], [1, 1]);
    assert_eq!(model.request_count(), 1, "the fourth endpoint named is not tried");
    // Each endpoint's failure is logged once, naming it.
    let failures = gw.log_lines_until(3, |l| l.contains("WARN") && l.contains("backend=pool")).await;
    let logs = gw.logs();
    assert_eq!(failures.len(), 3, "{logs}");
    for (line, endpoint) in failures.iter().zip([fakes[0].addr(), fakes[1].addr()]) {
        assert!(line.contains(&format!("endpoint=\"{endpoint}\"")), "{logs}");
    }
}

#[tokio::test]
async fn a_picker_that_cannot_answer_fails_the_pool_closed() {
    let model = FakeModel::start().await.unwrap();
    let failing = FakePicker::start(Picks::Fail).await.unwrap();
    let gw = Flexway::start(&pool_config(&failing, "fail_close", model.addr().port(), "/v1", ""));
    let response = gw.chat(KEY, hello("llama")).await;
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["flexway-error-cause"], "picker_unavailable");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_unavailable");
    assert!(body["error"]["message"].as_str().unwrap().contains("endpoint picker"), "{body}");
    let records = gw.records_until::<Value>(1).await;
    assert_eq!(records[0]["status"], 503);
    assert_eq!(records[0]["cost_micro_eur"], 0, "nothing sent, nothing billed");
    drop(gw);

    // One that never answers is given a second, then the pool's fallback serves.
    let hanging = FakePicker::start(Picks::Hang).await.unwrap();
    let fallback = format!(
        "      fallback: [spare]\n    spare:\n      url: \"{}\"\n      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 1.0}}\n",
        model.url()
    );
    let gw = Flexway::start(&pool_config(&hanging, "fail_close", model.addr().port(), "/v1", &fallback));
    let started = Instant::now();
    let response = gw.chat(KEY, hello("llama")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["flexway-backend"], "spare");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(model.request_count(), 1, "only the fallback was called");
}

#[tokio::test]
async fn a_picker_that_cannot_answer_leaves_its_members_to_serve_when_open() {
    let (member, picked) = (FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap());
    let members = format!(
        "      members: [{{backend: m}}]\n    m:\n      url: \"{}\"\n      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 1.0}}\n",
        member.url()
    );
    let failing = FakePicker::start(Picks::Fail).await.unwrap();
    let gw = Flexway::start(&pool_config(&failing, "fail_open", picked.addr().port(), "/v1", &members));
    let response = gw.chat(KEY, hello("llama")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["flexway-backend"], "m");
    assert_eq!(member.request_count(), 1);
    drop(gw);

    // While the picker answers, the members are not used.
    let answering = FakePicker::start(Picks::Metadata(picked.addr().to_string())).await.unwrap();
    let gw = Flexway::start(&pool_config(&answering, "fail_open", 1, "/v1", &members));
    let response = gw.chat(KEY, hello("llama")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["flexway-backend"], "pool");
    assert_eq!((picked.request_count(), member.request_count()), (1, 1), "named in the envoy.lb metadata");
}
