//! `forward_headers` (SPEC §3): a caller's request header reaches a backend only when
//! that backend names it, through every door (chat, embeddings, Responses, Messages,
//! realtime); the caller's key, the gateway's own headers and every header no backend
//! names never do. The real binary, the fake model server as every backend, which
//! records the headers it received.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use fake_model::RecordedRequest;
use flexway_testkit::*;
use serde_json::json;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// `acme` (KEY) on `oa`, an OpenAI backend that forwards `openai-beta` and
/// `x-team-trace`; `globex` (OTHER_KEY) on `claude`, an Anthropic one that forwards
/// `anthropic-beta`.
fn forwarding(model: &FakeModel) -> String {
    two_tenants(
        "{}",
        "claude",
        &format!(
            "  default_backend: oa\n  backends:\n    oa:\n      url: {openai}\n      \
             capabilities: [chat, embeddings, realtime]\n      forward_headers: [OpenAI-Beta, x-team-trace]\n      \
             price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}}\n    claude:\n      kind: anthropic\n      \
             url: {anthropic}\n      forward_headers: [anthropic-beta]\n      \
             price: {{input_per_mtok_eur: 3.0, output_per_mtok_eur: 15.0}}\n",
            openai = model.url(),
            anthropic = model.base_url(),
        ),
    )
}

/// Every value of `name` the backend received, in order.
fn values<'r>(request: &'r RecordedRequest, name: &str) -> Vec<&'r str> {
    request.headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str()).collect()
}

/// The headers every caller sends: some a backend names, some none does, the key.
fn with_headers(request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    request
        .header("openai-beta", "assistants=v2")
        .header("x-team-trace", "one")
        .header("x-team-trace", "two")
        .header("anthropic-beta", "prompt-caching-2024-07-31")
        .header("x-unlisted", "never")
        .header("flexway-sensitive", "false")
}

/// Checks what `oa` received: its names, every value, and nothing else of the caller's.
fn assert_openai_forwarded(request: &RecordedRequest) {
    assert_eq!(values(request, "openai-beta"), ["assistants=v2"], "{}", request.path);
    assert_eq!(values(request, "x-team-trace"), ["one", "two"], "{}", request.path);
    for never in ["anthropic-beta", "x-unlisted", "flexway-sensitive", "authorization"] {
        assert!(values(request, never).is_empty(), "{} received {never}: {:?}", request.path, request.headers);
    }
}

#[tokio::test]
async fn a_backend_is_sent_the_callers_headers_it_names_and_no_other() {
    let fake = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&forwarding(&fake));

    let calls = [
        ("/v1/chat/completions", hello("m")),
        ("/v1/embeddings", json!({"model": "m", "input": ["a b"]})),
        ("/v1/responses", json!({"model": "m", "input": "hello"})),
    ];
    for (path, body) in calls {
        let response = with_headers(gw.post(path, KEY, body)).send().await.unwrap();
        assert_eq!(response.status(), 200, "{path}: {}", response.text().await.unwrap());
    }
    // The Messages door, to the Anthropic backend: its own name only, and the
    // caller's `x-api-key` never.
    let messages = json!({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]});
    let response = with_headers(client().post(format!("{}/v1/messages", gw.url)))
        .header("x-api-key", OTHER_KEY)
        .json(&messages)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());

    let requests = fake.requests();
    assert_eq!(requests.len(), 4, "{requests:#?}");
    for request in &requests[..3] {
        assert_openai_forwarded(request);
    }
    let anthropic = &requests[3];
    assert_eq!(anthropic.path, "/v1/messages");
    assert_eq!(values(anthropic, "anthropic-beta"), ["prompt-caching-2024-07-31"]);
    for never in ["openai-beta", "x-team-trace", "x-unlisted", "x-api-key", "authorization"] {
        assert!(values(anthropic, never).is_empty(), "the anthropic backend received {never}");
    }
    assert_eq!(values(anthropic, "anthropic-version").len(), 1, "the gateway's own version header, once");
}

#[tokio::test]
async fn a_realtime_backend_is_sent_the_named_headers_with_the_handshake() {
    let fake = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&forwarding(&fake));
    let url = format!("{}/v1/realtime?model=m", gw.url.replacen("http://", "ws://", 1));
    let mut request = url.into_client_request().unwrap();
    let headers = request.headers_mut();
    headers.insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    headers.insert("openai-beta", "realtime=v1".parse().unwrap());
    headers.insert("x-unlisted", "never".parse().unwrap());
    let (client, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    let requests = fake.requests();
    let handshake = requests.iter().find(|r| r.path == "/v1/realtime").expect("the backend's handshake");
    assert_eq!(values(handshake, "openai-beta"), ["realtime=v1"]);
    assert!(values(handshake, "x-unlisted").is_empty());
    assert!(values(handshake, "authorization").is_empty(), "the caller's key never travels");
    drop(client);
}

#[tokio::test]
async fn without_forward_headers_no_header_of_the_callers_travels() {
    let fake = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&fake.url()));
    let response = with_headers(gw.post("/v1/chat/completions", KEY, hello("m"))).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let request = &fake.requests()[0];
    for never in ["openai-beta", "x-team-trace", "anthropic-beta", "x-unlisted", "flexway-sensitive", "authorization"] {
        assert!(values(request, never).is_empty(), "received {never}");
    }
}
