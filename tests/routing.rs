//! Routing and resilience end to end (SPEC §4, §5, §10): fallback triggers and
//! non-triggers, pools, breakers, the 503 causes, sensitivity, vision refusals.
#![cfg(test)]

use std::time::Duration;

use flexway_testkit::*;
use serde_json::{Value, json};

fn ai(body: &str) -> String {
    config(body)
}

fn backend_of(r: &reqwest::Response) -> String {
    r.headers().get("flexway-backend").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default()
}

async fn outcome(r: reqwest::Response) -> (u16, String, Option<String>, String) {
    let status = r.status().as_u16();
    let cause = r.headers().get("flexway-error-cause").map(|v| v.to_str().unwrap().to_owned());
    let body: Value = r.json().await.unwrap();
    (
        status,
        body["error"]["code"].as_str().unwrap_or("").to_owned(),
        cause,
        body["error"]["message"].as_str().unwrap_or("").to_owned(),
    )
}

#[tokio::test]
async fn falls_back_on_connection_error_and_timeout() {
    let model = FakeModel::start().await.unwrap();
    let hang = model.scenario_url(&Scenario { hang: true, ..Default::default() });
    let refused = ClosedPort::new();
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: refused\n  backends:\n    refused: {{url: \"http://127.0.0.1:{}/v1\", fallback: [slow]}}\n    slow: {{url: \"{hang}\", timeout: 300ms, fallback: [spare]}}\n    spare: {{url: \"{}\"}}\n",
        refused.port(),
        model.url()
    )));
    let r = gw.chat(KEY, hello("m")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(backend_of(&r), "spare");
    assert_eq!(r.headers()["flexway-degraded"], "backend-fallback");
}

#[tokio::test]
async fn never_falls_back_after_the_first_byte() {
    let model = FakeModel::start().await.unwrap();
    let cut = model.scenario_url(&Scenario { cut_after: Some(1), ..Default::default() });
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: main\n  backends:\n    main: {{url: \"{cut}\", fallback: [spare]}}\n    spare: {{url: \"{}\"}}\n",
        model.url()
    )));
    let r = gw.chat(KEY, json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(backend_of(&r), "main");
    let (events, _) = sse_data(r).await;
    assert!(events.last().unwrap().contains("upstream_error"));
    assert_eq!(model.request_count(), 1, "no second backend after the first byte");
}

#[tokio::test]
async fn falls_back_only_to_backends_with_the_capability() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: main\n  capabilities: {{vision: main}}\n  backends:\n    main: {{url: \"{failing}\", capabilities: [chat, vision], fallback: [text-only, seeing]}}\n    text-only: {{url: \"{u}\"}}\n    seeing: {{url: \"{u}\", capabilities: [chat, vision]}}\n",
        u = model.url()
    )));
    let image = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]});
    let r = gw.chat(KEY, image).await;
    assert_eq!(r.status(), 200);
    assert_eq!(backend_of(&r), "seeing");
}

#[tokio::test]
async fn a_pool_prefers_its_best_group_and_says_degraded_below_it() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(503), ..Default::default() });
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: pool\n  backends:\n    pool:\n      kind: pool\n      members:\n        - {{backend: ptu, priority: 1}}\n        - {{backend: payg, priority: 2}}\n    ptu: {{url: \"{failing}\", circuit_breaker: {{failures: 100}}}}\n    payg: {{url: \"{}\"}}\n",
        model.url()
    )));
    for _ in 0..3 {
        let r = gw.chat(KEY, hello("m")).await;
        assert_eq!(backend_of(&r), "payg");
        assert_eq!(r.headers()["flexway-degraded"], "backend-fallback");
    }
    let paths: Vec<String> = model.requests().iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths.len(), 6, "the priority-1 member is tried first every time: {paths:?}");
}

#[tokio::test]
async fn weights_spread_calls_inside_a_priority_group() {
    let a = FakeModel::start().await.unwrap();
    let b = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: pool\n  backends:\n    pool:\n      kind: pool\n      members:\n        - {{backend: a, weight: 3}}\n        - {{backend: b, weight: 1}}\n    a: {{url: \"{}\"}}\n    b: {{url: \"{}\"}}\n",
        a.url(),
        b.url()
    )));
    for _ in 0..400 {
        assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    }
    let share = a.request_count() as f64 / 400.0;
    assert!((0.65..=0.85).contains(&share), "weight 3:1 gave a {share:.2} share");
}

#[tokio::test]
async fn an_exhausted_pool_is_pool_exhausted_naming_its_members() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: pool\n  backends:\n    pool:\n      kind: pool\n      members: [{{backend: x}}, {{backend: y}}]\n    x: {{url: \"{failing}\"}}\n    y: {{url: \"{failing}\"}}\n"
    )));
    let (status, code, cause, message) = outcome(gw.chat(KEY, hello("m")).await).await;
    assert_eq!((status, code.as_str(), cause.as_deref()), (503, "upstream_unavailable", Some("pool_exhausted")));
    assert!(message.contains('x') && message.contains('y'), "{message}");
}

#[tokio::test]
async fn a_breaker_opens_skips_probes_and_closes() {
    let spare = FakeModel::start().await.unwrap();
    // Nothing listens on `port` until the test starts `main` there.
    let closed = ClosedPort::new();
    let port = closed.port();
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: main\n  backends:\n    main:\n      url: http://127.0.0.1:{port}/v1\n      fallback: [spare]\n      circuit_breaker: {{failures: 2, interval: 1m, trip: 1s}}\n    spare: {{url: \"{}\"}}\n",
        spare.url()
    )));
    for _ in 0..2 {
        assert_eq!(backend_of(&gw.chat(KEY, hello("m")).await), "spare");
    }
    // Open: the main backend comes back, but the breaker skips it until the trip ends.
    drop(closed);
    let main = FakeModel::start_on(format!("127.0.0.1:{port}").parse().unwrap()).await.unwrap();
    let skipped = gw.chat(KEY, hello("m")).await;
    assert_eq!(backend_of(&skipped), "spare");
    assert_eq!(main.request_count(), 0, "an open breaker is skipped");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Half-open: one probe; it succeeds and closes the breaker.
    assert_eq!(backend_of(&gw.chat(KEY, hello("m")).await), "main");
    assert_eq!(backend_of(&gw.chat(KEY, hello("m")).await), "main");
    assert_eq!(main.request_count(), 2);
}

#[tokio::test]
async fn every_candidate_open_is_circuit_open() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: main\n  backends:\n    main: {{url: \"{failing}\", circuit_breaker: {{failures: 1, trip: 1m}}}}\n"
    )));
    let (_, _, first, _) = outcome(gw.chat(KEY, hello("m")).await).await;
    assert_eq!(first.as_deref(), Some("upstream_failed"));
    let (status, code, cause, message) = outcome(gw.chat(KEY, hello("m")).await).await;
    assert_eq!((status, code.as_str(), cause.as_deref()), (503, "upstream_unavailable", Some("circuit_open")));
    assert!(message.contains("main"), "{message}");
    assert_eq!(model.request_count(), 1);
}

#[tokio::test]
async fn retry_after_trips_the_breaker_for_that_long_without_fallback_on_the_429() {
    let model = FakeModel::start().await.unwrap();
    let limited = model.scenario_url(&Scenario { status: Some(429), retry_after: Some(1), ..Default::default() });
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: main\n  backends:\n    main: {{url: \"{limited}\", fallback: [spare], circuit_breaker: {{accept_retry_after: true, trip: 1h}}}}\n    spare: {{url: \"{}\"}}\n",
        model.url()
    )));
    let first = gw.chat(KEY, hello("m")).await;
    assert_eq!(first.status(), 429, "a provider 429 is relayed, never a fallback");
    let second = gw.chat(KEY, hello("m")).await;
    assert_eq!(backend_of(&second), "spare", "tripped for the Retry-After");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 429, "exactly the Retry-After, not the 1h trip");
}

fn sensitive_config(model: &FakeModel, pinned: bool) -> String {
    let failing = model.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    let pin = if pinned { "  sensitive_backend: inside\n" } else { "" };
    ai(&format!(
        "  default_backend: outside\n{pin}  backends:\n    outside: {{url: \"{u}\", fallback: [inside-down, outside-2]}}\n    outside-2: {{url: \"{u}\"}}\n    inside-down: {{url: \"{failing}\", external: false}}\n    inside: {{url: \"{u}\", external: false}}\n",
        u = model.url()
    ))
}

#[tokio::test]
async fn a_sensitive_call_is_pinned_to_the_sensitive_backend() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&sensitive_config(&model, true));
    let r = gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Sensitive", "true").send().await.unwrap();
    assert_eq!(backend_of(&r), "inside");
    let plain = gw.chat(KEY, hello("m")).await;
    assert_eq!(backend_of(&plain), "outside", "the header narrows; without it routing is unchanged");
}

#[tokio::test]
async fn a_sensitive_call_without_a_pin_uses_only_the_chains_internal_backends_and_never_falls_out() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&sensitive_config(&model, false));
    let r = gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Sensitive", "1").send().await.unwrap();
    let (status, code, cause, _) = outcome(r).await;
    assert_eq!((status, code.as_str(), cause.as_deref()), (503, "upstream_unavailable", Some("upstream_failed")));
    assert_eq!(model.request_count(), 1, "only the internal backend was called, never an external one");
}

#[tokio::test]
async fn a_sensitive_call_with_no_internal_backend_is_refused() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let r = gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Sensitive", "true").send().await.unwrap();
    let (status, code, _, _) = outcome(r).await;
    assert_eq!((status, code.as_str()), (403, "sensitive_no_internal_backend"));
    let bad =
        gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Sensitive", "perhaps").send().await.unwrap();
    assert_eq!(outcome(bad).await.1, "invalid_request");
    assert_eq!(model.request_count(), 0);
}

#[tokio::test]
async fn a_sensitive_header_repeated_or_folded_is_sensitive_when_any_value_is_true() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&sensitive_config(&model, true));
    let send = |values: &[&'static str]| {
        let mut request = gw.post("/v1/chat/completions", KEY, hello("m"));
        for v in values {
            request = request.header("Flexway-Sensitive", *v);
        }
        request.send()
    };
    assert_eq!(backend_of(&send(&["false", "true"]).await.unwrap()), "inside", "a later true is not ignored");
    assert_eq!(backend_of(&send(&["TRUE", "no"]).await.unwrap()), "inside");
    assert_eq!(backend_of(&send(&["false, yes"]).await.unwrap()), "inside", "a folded list is read item by item");
    assert_eq!(backend_of(&send(&["false", "0"]).await.unwrap()), "outside");
}

#[tokio::test]
async fn an_unreadable_sensitive_header_is_refused_never_read_as_false() {
    let model = FakeModel::start().await.unwrap();
    // One external backend: a value read as false would be served there.
    let gw = Flexway::start(&one_backend(&model.url()));
    let values: [&[u8]; 6] = [b"", b"  ", b"\xff", "tr\u{fa}e".as_bytes(), b"false, maybe", b"false,"];
    for value in values {
        let header = reqwest::header::HeaderValue::from_bytes(value).unwrap();
        let r =
            gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Sensitive", header).send().await.unwrap();
        let (status, code, _, message) = outcome(r).await;
        assert_eq!((status, code.as_str()), (400, "invalid_request"), "{value:?}: {message}");
        assert!(message.contains("flexway-sensitive"), "{message}");
    }
    let r = gw
        .post("/v1/chat/completions", KEY, hello("m"))
        .header("Flexway-Sensitive", "false")
        .header("Flexway-Sensitive", "perhaps")
        .send()
        .await
        .unwrap();
    assert_eq!(outcome(r).await.1, "invalid_request", "one bad copy among good ones");
    let embeddings = gw
        .post("/v1/embeddings", KEY, json!({"model": "m", "input": "x"}))
        .header("Flexway-Sensitive", "")
        .send()
        .await
        .unwrap();
    assert_eq!(outcome(embeddings).await.1, "invalid_request");
    assert_eq!(model.request_count(), 0);
}

fn vision_config(model: &FakeModel) -> String {
    ai(&format!(
        "  default_backend: text\n  capabilities: {{vision: eyes}}\n  vision: {{max_image_bytes: 30, max_body_bytes: 100000, allowed_origins: [\"https://img.example.com\"]}}\n  backends:\n    text: {{url: \"{u}\"}}\n    eyes: {{url: \"{u}\", capabilities: [chat, vision]}}\n",
        u = model.url()
    ))
}

fn with_image(url: &str) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}]})
}

#[tokio::test]
async fn images_go_to_the_vision_backend_within_their_limits() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&vision_config(&model));
    // 40 base64 characters with no padding: exactly 30 bytes.
    let fits = format!("data:image/png;base64,{}", "A".repeat(40));
    let r = gw.chat(KEY, with_image(&fits)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(backend_of(&r), "eyes");
    let remote = gw.chat(KEY, with_image("https://img.example.com/cat.png")).await;
    assert_eq!(remote.status(), 200);
}

#[tokio::test]
async fn each_vision_refusal_has_its_code() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&vision_config(&model));
    let too_big = format!("data:image/png;base64,{}", "A".repeat(44));
    assert_eq!(outcome(gw.chat(KEY, with_image(&too_big)).await).await.1, "image_too_large");
    for url in [
        "https://img.example.com.evil.net/x.png",
        "https://evil.net/?https://img.example.com",
        "http://img.example.com/x.png",
        "https://img.example.com:8443/x.png",
        "file:///etc/passwd",
    ] {
        let (status, code, _, _) = outcome(gw.chat(KEY, with_image(url)).await).await;
        assert_eq!((status, code.as_str()), (400, "image_origin_not_allowed"), "{url}");
    }
    let other_part =
        json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]});
    assert_eq!(outcome(gw.chat(KEY, other_part).await).await.1, "invalid_request");
    assert_eq!(model.request_count(), 0);
}

#[tokio::test]
async fn an_image_with_no_vision_backend_is_capability_unavailable() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let r = gw.chat(KEY, with_image("data:image/png;base64,AAAA")).await;
    let (status, code, _, _) = outcome(r).await;
    assert_eq!((status, code.as_str()), (400, "capability_unavailable"));
}

#[tokio::test]
async fn routing_order_capability_then_sensitivity_then_soft() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&ai(&format!(
        "  default_backend: main\n  capabilities: {{embeddings: embed-ext}}\n  sensitive_backend: inside\n  backends:\n    main: {{url: \"{u}\"}}\n    embed-ext: {{url: \"{u}\", capabilities: [embeddings]}}\n    inside: {{url: \"{u}\", external: false, capabilities: [chat, embeddings]}}\n",
        u = model.url()
    )));
    // The capability override beats the tenant/agent choice...
    let e = gw.post("/v1/embeddings", AGENT_KEY, json!({"model": "e", "input": "x"})).send().await.unwrap();
    assert_eq!(backend_of(&e), "embed-ext");
    // ...and sensitivity beats the capability override.
    let s = gw
        .post("/v1/embeddings", KEY, json!({"model": "e", "input": "x"}))
        .header("Flexway-Sensitive", "true")
        .send()
        .await
        .unwrap();
    assert_eq!(backend_of(&s), "inside");
}
