//! `infra/smoke`, the check run after a deploy: it passes against a gateway that
//! serves (`flexway serve`, the same router as the function), and fails, saying why,
//! against one whose function could not start (502) or an answer that is not the
//! gateway's.
#![cfg(test)]

use std::process::{Command, Output};

use axum::http::StatusCode;
use flexway_testkit::*;

/// `infra/smoke URL`, with `FLEXWAY_KEY` only when given.
async fn smoke(url: &str, key: Option<&str>) -> Output {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/infra/smoke");
    let mut command = Command::new("bash");
    command.arg(script).arg(url).env_remove("FLEXWAY_KEY");
    if let Some(key) = key {
        command.env("FLEXWAY_KEY", key);
    }
    tokio::task::spawn_blocking(move || command.output().unwrap()).await.unwrap()
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// A server that answers every request with `status` and `body`, as a function URL
/// whose function failed its init answers 502 to every call.
async fn answering(status: StatusCode, body: &'static str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().fallback(move || async move { (status, body) });
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::test]
async fn passes_against_a_gateway_that_serves() {
    let gateway = Flexway::start(&one_backend("http://127.0.0.1:9/v1"));
    // The function URL's form: a trailing slash.
    let output = smoke(&format!("{}/", gateway.url), Some(KEY)).await;
    let said = text(&output);
    assert!(output.status.success(), "{said}");
    assert!(said.contains("ok: a bad key: 401 invalid_api_key"), "{said}");
    assert!(said.contains("ok: GET /v1/models without a key: 401"), "{said}");
    assert!(said.contains("ok: GET /v1/models with FLEXWAY_KEY: 200"), "{said}");

    // Without a key it checks what it can, and says what it skipped.
    let output = smoke(&format!("{}/v1", gateway.url), None).await;
    let said = text(&output);
    assert!(output.status.success(), "{said}");
    assert!(said.contains("skipped") && said.contains("FLEXWAY_KEY"), "{said}");

    // A key the config does not declare fails the authenticated call.
    let output = smoke(&gateway.url, Some("sk-not-declared")).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_saying_502_against_a_function_that_cannot_start() {
    let url = answering(StatusCode::BAD_GATEWAY, "{\"message\":\"Internal Server Error\"}").await;
    let output = smoke(&url, Some(KEY)).await;
    let said = text(&output);
    assert_eq!(output.status.code(), Some(1), "{said}");
    let failed: Vec<&str> = said.lines().filter(|l| l.starts_with("FAILED:")).collect();
    assert_eq!(failed.len(), 3, "each check fails: {said}");
    assert!(failed.iter().all(|l| l.contains("502") && l.contains("secret")), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_without_the_gateway_envelope_fails() {
    let url = answering(StatusCode::UNAUTHORIZED, "Unauthorized").await;
    let output = smoke(&url, None).await;
    let said = text(&output);
    assert_eq!(output.status.code(), Some(1), "{said}");
    assert!(said.contains("without the error envelope"), "{said}");
}
