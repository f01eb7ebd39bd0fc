//! `secrets.refresh` in the serverless shape's router (`flexway::http::api`), which
//! refreshes on the request path when due rather than in a task that would outlive an
//! invocation. A `file:` reference stands in for an AWS one (tests/secrets_aws.rs
//! rotates those, on the emulator): the refresh is the same for every reference.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;

/// The serverless router in-process, on a loopback port, with `yaml`.
async fn serverless(yaml: &str) -> String {
    let env: HashMap<String, String> = HashMap::new();
    let loaded = flexway::config::load_str(yaml, &env).unwrap_or_else(|e| panic!("{e}"));
    let (adapters, _) = memory_adapters();
    let secrets = Arc::new(flexway::secret::LocalSecrets { env });
    let gateway = Arc::new(flexway::Gateway::new(loaded.config, secrets, adapters).await.unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, flexway::http::api(gateway)).await });
    url
}

async fn chat(url: &str) -> u16 {
    let response = client().post(format!("{url}/v1/chat/completions")).bearer_auth(KEY).json(&hello("m"));
    response.send().await.unwrap().status().as_u16()
}

fn last_bearer(model: &FakeModel) -> Option<String> {
    model.requests().last().and_then(|r| r.header("authorization").map(str::to_owned))
}

#[tokio::test]
async fn the_serverless_router_refreshes_when_due_and_keeps_the_last_value_on_failure() {
    let model = FakeModel::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("backend-key");
    std::fs::write(&key, "sk-one\n").unwrap();
    let yaml = one_backend(&model.url()).replace(
        "      url:",
        &format!("      auth: {{type: bearer, secret: \"file:{}\"}}\n      url:", key.display()),
    );
    let url = serverless(&yaml.replace("ai:\n", "secrets: {refresh: 1s}\nai:\n")).await;

    assert_eq!(chat(&url).await, 200);
    assert_eq!(last_bearer(&model).as_deref(), Some("Bearer sk-one"));

    // Rotated: not due yet, the value in use stays; once due, the next request
    // refreshes before it is dispatched.
    std::fs::write(&key, "sk-two\n").unwrap();
    assert_eq!(chat(&url).await, 200);
    assert_eq!(last_bearer(&model).as_deref(), Some("Bearer sk-one"));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(chat(&url).await, 200);
    assert_eq!(last_bearer(&model).as_deref(), Some("Bearer sk-two"));

    // Gone at the next refresh: the last value resolved stays in use.
    std::fs::remove_file(&key).unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(chat(&url).await, 200);
    assert_eq!(last_bearer(&model).as_deref(), Some("Bearer sk-two"));
}
