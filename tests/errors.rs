//! Every error code reachable on the local shape, in its documented envelope.
#![cfg(test)]

use flexway_testkit::*;
use serde_json::{Value, json};

async fn envelope(response: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(response.status(), status);
    assert!(response.headers().contains_key("flexway-request-id"));
    assert_eq!(response.headers()["content-type"], "application/json");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(body["error"]["type"].is_string());
    assert!(body["error"].as_object().unwrap().contains_key("param"));
    body
}

#[tokio::test]
async fn missing_or_unknown_key_is_invalid_api_key() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let no_key = client().post(format!("{}/v1/chat/completions", gw.url)).json(&hello("m")).send().await.unwrap();
    envelope(no_key, 401, "invalid_api_key").await;
    envelope(gw.chat("sk-nope", hello("m")).await, 401, "invalid_api_key").await;
    let models = client().get(format!("{}/v1/models", gw.url)).bearer_auth("sk-nope").send().await.unwrap();
    envelope(models, 401, "invalid_api_key").await;
    assert_eq!(model.request_count(), 0);
}

#[tokio::test]
async fn malformed_requests_are_invalid_request() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let raw = client()
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    envelope(raw, 400, "invalid_request").await;
    let body =
        envelope(gw.chat(KEY, json!({"messages": [{"role": "user", "content": "x"}]})).await, 400, "invalid_request")
            .await;
    assert_eq!(body["error"]["param"], "model");
    let part =
        json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]});
    envelope(gw.chat(KEY, part).await, 400, "invalid_request").await;
    assert_eq!(model.request_count(), 0);
}

#[tokio::test]
async fn unknown_paths_use_the_envelope_under_v1_and_problem_json_elsewhere() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let v1 = client().get(format!("{}/v1/completions", gw.url)).send().await.unwrap();
    envelope(v1, 404, "not_found").await;
    let other = client().get(format!("{}/admin", gw.url)).send().await.unwrap();
    assert_eq!(other.status(), 404);
    assert_eq!(other.headers()["content-type"], "application/problem+json");
    let problem: Value = other.json().await.unwrap();
    assert_eq!(problem["status"], 404);
    assert!(problem["type"].is_string() && problem["title"].is_string() && problem["detail"].is_string());
    let wrong_method = client().get(format!("{}/v1/chat/completions", gw.url)).send().await.unwrap();
    envelope(wrong_method, 405, "method_not_allowed").await;
    let wrong_health = client().post(format!("{}/healthz", gw.url)).send().await.unwrap();
    assert_eq!(wrong_health.status(), 405);
    assert_eq!(wrong_health.headers()["content-type"], "application/problem+json");
}

#[tokio::test]
async fn an_undeclared_agent_is_unknown_agent() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let r = gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Agent", "ghost").send().await.unwrap();
    envelope(r, 403, "unknown_agent").await;
    let rebind =
        gw.post("/v1/chat/completions", AGENT_KEY, hello("m")).header("Flexway-Agent", "helper").send().await.unwrap();
    envelope(rebind, 403, "unknown_agent").await;
    assert_eq!(model.request_count(), 0);
}

#[tokio::test]
async fn an_oversized_body_is_body_too_large() {
    let model = FakeModel::start().await.unwrap();
    let ai = format!(
        "  default_backend: main\n  vision: {{max_image_bytes: 1000, max_body_bytes: 2000}}\n  backends:\n    main:\n      url: {}\n",
        model.url()
    );
    let gw = Flexway::start(&config(&ai));
    let big = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(5000)}]});
    envelope(gw.chat(KEY, big).await, 413, "body_too_large").await;
    // Without a Content-Length the limit is enforced while reading.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = (0..10).map(|_| Ok(vec![b' '; 500])).collect();
    let streamed = client()
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(KEY)
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    envelope(streamed, 413, "body_too_large").await;
    assert_eq!(model.request_count(), 0);
}

#[tokio::test]
async fn a_backend_4xx_is_relayed_as_is_without_fallback() {
    let model = FakeModel::start().await.unwrap();
    let limited = model.scenario_url(&Scenario { status: Some(429), retry_after: Some(7), ..Default::default() });
    let ai = format!(
        "  default_backend: main\n  backends:\n    main:\n      url: {limited}\n      fallback: [spare]\n    spare:\n      url: {}\n",
        model.url()
    );
    let gw = Flexway::start(&config(&ai));
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "7");
    assert_eq!(response.headers()["flexway-backend"], "main");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "injected_429", "the backend's own body, untouched");
    assert_eq!(model.request_count(), 1, "no fallback on a 4xx");
}

#[tokio::test]
async fn a_failing_backend_is_upstream_unavailable_naming_cause_and_backends() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    let ai = format!(
        "  default_backend: main\n  backends:\n    main:\n      url: {failing}\n      fallback: [down]\n    down:\n      url: http://127.0.0.1:9/v1\n"
    );
    let gw = Flexway::start(&config(&ai));
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.headers()["flexway-error-cause"], "upstream_failed");
    let body = envelope(response, 503, "upstream_unavailable").await;
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("main") && message.contains("down"), "{message}");
}

#[tokio::test]
async fn a_fallback_serves_when_the_first_backend_fails_and_says_degraded() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(502), ..Default::default() });
    let ai = format!(
        "  default_backend: main\n  backends:\n    main:\n      url: {failing}\n      fallback: [spare]\n    spare:\n      url: {}\n",
        model.url()
    );
    let gw = Flexway::start(&config(&ai));
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["flexway-backend"], "spare");
    assert_eq!(response.headers()["flexway-degraded"], "backend-fallback");
}

#[tokio::test]
async fn a_hanging_backend_is_upstream_timeout() {
    let model = FakeModel::start().await.unwrap();
    let hang = model.scenario_url(&Scenario { hang: true, ..Default::default() });
    let ai = format!("  default_backend: main\n  backends:\n    main:\n      url: {hang}\n      timeout: 300ms\n");
    let gw = Flexway::start(&config(&ai));
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.headers()["flexway-backends-tried"], "main");
    envelope(response, 504, "upstream_timeout").await;
}

#[tokio::test]
async fn a_garbage_answer_is_upstream_error() {
    let model = FakeModel::start().await.unwrap();
    let garbage = model.scenario_url(&Scenario { garbage: true, ..Default::default() });
    let gw = Flexway::start(&one_backend(&garbage));
    envelope(gw.chat(KEY, hello("m")).await, 502, "upstream_error").await;
}

#[tokio::test]
async fn an_unreadable_or_ambiguous_agent_header_is_unknown_agent() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    // Not readable text: not UTF-8, empty, a control character.
    for value in [&b"\xffbot"[..], b"", b"  ", "\u{85}helper".as_bytes()] {
        let header = reqwest::header::HeaderValue::from_bytes(value).unwrap();
        let r = gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Agent", header).send().await.unwrap();
        envelope(r, 403, "unknown_agent").await;
    }
    let twice = |key: &'static str, first: &'static str, second: &'static str| {
        gw.post("/v1/chat/completions", key, hello("m"))
            .header("Flexway-Agent", first)
            .header("Flexway-Agent", second)
            .send()
    };
    let body = envelope(twice(KEY, "helper", "bot").await.unwrap(), 403, "unknown_agent").await;
    assert!(body["error"]["message"].as_str().unwrap().contains("more than once"), "{body}");
    envelope(twice(AGENT_KEY, "bot", "helper").await.unwrap(), 403, "unknown_agent").await;
    assert_eq!(model.request_count(), 0);
    // The same agent named twice (a proxy copying the header) is one agent.
    assert_eq!(twice(KEY, "helper", "helper").await.unwrap().status(), 200);
    // A declared agent with a non-ASCII name can be named: UTF-8 is readable text.
    let ai = format!("  default_backend: main\n  backends:\n    main:\n      url: {}\n", model.url());
    let yaml = config(&ai).replace("      helper: {}\n", "      helper: {}\n      équipe: {}\n");
    let gw = Flexway::start(&yaml);
    let header = reqwest::header::HeaderValue::from_bytes("équipe".as_bytes()).unwrap();
    let r = gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Agent", header).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

/// A header of 64 KiB: over the gateway's 32 KiB, under the transport's ceilings.
fn big_header() -> String {
    "x".repeat(64 * 1024)
}

#[tokio::test]
async fn oversized_headers_are_headers_too_large_in_the_envelope_with_a_request_id() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let v1 = gw.post("/v1/chat/completions", KEY, hello("m")).header("x-big", big_header()).send().await.unwrap();
    envelope(v1, 431, "headers_too_large").await;
    // Past hyper's default read buffer (~400 KiB), still the envelope.
    let huge = "x".repeat(1024 * 1024);
    let v1 = gw.post("/v1/chat/completions", KEY, hello("m")).header("x-huge", huge).send().await.unwrap();
    envelope(v1, 431, "headers_too_large").await;
    let health = client().get(format!("{}/healthz", gw.url)).header("x-big", big_header()).send().await.unwrap();
    assert_eq!(health.status(), 431);
    assert!(health.headers().contains_key("flexway-request-id"));
    assert_eq!(health.headers()["content-type"], "application/problem+json");
    let problem: Value = health.json().await.unwrap();
    assert_eq!((problem["status"].as_u64(), problem["code"].as_str()), (Some(431), Some("headers_too_large")));
    // Small headers add up: the limit is on their total.
    let mut many = gw.post("/v1/chat/completions", KEY, hello("m"));
    for i in 0..40 {
        many = many.header(format!("x-filler-{i}"), "y".repeat(1000));
    }
    envelope(many.send().await.unwrap(), 431, "headers_too_large").await;
    // Under the limit, the same connection pool still serves.
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    assert_eq!(model.request_count(), 1);
}

#[tokio::test]
async fn oversized_headers_over_http2_get_the_envelope_too() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let h2 = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
    let ok = h2.post(format!("{}/v1/chat/completions", gw.url)).bearer_auth(KEY).json(&hello("m")).send().await;
    let ok = ok.unwrap();
    assert_eq!((ok.version(), ok.status().as_u16()), (reqwest::Version::HTTP_2, 200));
    let big = h2
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(KEY)
        .json(&hello("m"))
        .header("x-big", big_header());
    envelope(big.send().await.unwrap(), 431, "headers_too_large").await;
    // HTTP/2 sets no count of its own: the gateway's 100 applies.
    let mut many = h2.post(format!("{}/v1/chat/completions", gw.url)).bearer_auth(KEY).json(&hello("m"));
    for i in 0..120 {
        many = many.header(format!("x-filler-{i}"), "y");
    }
    envelope(many.send().await.unwrap(), 431, "headers_too_large").await;
    assert_eq!(model.request_count(), 1);
}

#[tokio::test]
async fn a_backend_failure_is_logged_with_the_request_id() {
    let model = FakeModel::start().await.unwrap();
    let failing = model.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    // At `warn` too: the request span must not be filtered out with the info lines.
    for level in ["info", "warn"] {
        let gw = Flexway::start_with_env(&one_backend(&failing), &[("FLEXWAY_LOG", level)]);
        let response = gw.chat(KEY, hello("m")).await;
        assert_eq!(response.status(), 503);
        let id = response.headers()["flexway-request-id"].to_str().unwrap().to_owned();
        // As a field, greppable: no colour codes in a piped log.
        let field = format!("request_id={id}");
        gw.log_line(&["backend failed", &field]).await;
        gw.log_line(&["no backend could serve", &field]).await;
        // Another call's lines carry its own id, not this one's.
        let other = gw.chat(KEY, hello("m")).await;
        let other_id = other.headers()["flexway-request-id"].to_str().unwrap().to_owned();
        let line = gw.log_line(&["no backend could serve", &other_id]).await;
        assert!(!line.contains(&id), "{line}");
    }
}

#[tokio::test]
async fn a_model_or_user_too_long_for_the_audit_is_invalid_request_through_every_door() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let long_model = "m".repeat(257);
    let long_user = "u".repeat(1025);
    let messages = json!([{"role": "user", "content": "hi"}]);
    let refused = [
        ("/v1/chat/completions", json!({"model": long_model, "messages": messages}), "model"),
        ("/v1/chat/completions", json!({"model": "m", "user": long_user, "messages": messages}), "user"),
        ("/v1/embeddings", json!({"model": long_model, "input": "x"}), "model"),
        ("/v1/embeddings", json!({"model": "m", "user": long_user, "input": "x"}), "user"),
        ("/v1/responses", json!({"model": long_model, "input": "x"}), "model"),
        ("/v1/responses", json!({"model": "m", "user": long_user, "input": "x"}), "user"),
    ];
    for (path, body, param) in refused {
        let body = envelope(gw.post(path, KEY, body).send().await.unwrap(), 400, "invalid_request").await;
        assert_eq!(body["error"]["param"], param, "{path}: {body}");
    }
    // The Messages door, in Anthropic's envelope.
    for (body, what) in [
        (json!({"model": long_model, "max_tokens": 5, "messages": messages}), "model"),
        (json!({"model": "m", "max_tokens": 5, "metadata": {"user_id": long_user}, "messages": messages}), "metadata"),
    ] {
        let response = gw.post("/v1/messages", KEY, body).send().await.unwrap();
        assert_eq!(response.status(), 400, "{what}");
        let body: Value = response.json().await.unwrap();
        assert!(body["error"]["message"].as_str().unwrap().starts_with("invalid_request: "), "{body}");
    }
    assert_eq!(model.request_count(), 0, "nothing too long reaches a backend");
    // At the bounds, served.
    let at_bounds = json!({"model": "m".repeat(256), "user": "u".repeat(1024), "messages": messages});
    assert_eq!(gw.post("/v1/chat/completions", KEY, at_bounds).send().await.unwrap().status(), 200);
}
