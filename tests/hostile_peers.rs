//! Memory per call stays bounded whatever a backend sends (SPEC §5): the real
//! `flexway serve` in front of a fake that writes an endless SSE line or a huge
//! answer, with the gateway's peak RSS (`VmHWM`) read from /proc.
#![cfg(test)]

use flexway_testkit::*;
use serde_json::{Value, json};

const MIB: u64 = 1024 * 1024;

fn gateway(url: &str, limits: &str) -> Flexway {
    Flexway::start(&config(&format!(
        "  default_backend: main\n{limits}  backends:\n    main: {{url: \"{url}\", timeout: 20s}}\n"
    )))
}

async fn upstream_error(response: reqwest::Response, needle: &str) {
    assert_eq!(response.status(), 502);
    assert!(response.headers().contains_key("flexway-request-id"));
    assert_eq!(response.headers()["flexway-backends-tried"], "main");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_error");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{message}");
}

#[tokio::test]
async fn an_endless_sse_line_is_refused_at_the_event_limit() {
    let model = FakeModel::start().await.unwrap();
    let gw = gateway(&scenario(&model, "endless_line"), "");
    let before = gw.peak_rss();
    let body = json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    upstream_error(gw.chat(KEY, body).await, "max_event_bytes").await;
    let grown = gw.peak_rss().saturating_sub(before);
    // One event is held at most (1 MiB by default), plus a read buffer or two.
    assert!(grown < 16 * MIB, "an endless line grew the gateway by {} MiB", grown / MIB);
}

#[tokio::test]
async fn a_huge_answer_is_refused_at_the_response_limit_not_buffered_whole() {
    let model = FakeModel::start().await.unwrap();
    let limits = "  limits: {max_response_bytes: 8388608}\n";
    let gw = gateway(&scenario(&model, "huge_mb=512"), limits);
    let before = gw.peak_rss();
    upstream_error(gw.chat(KEY, hello("m")).await, "max_response_bytes").await;
    let grown = gw.peak_rss().saturating_sub(before);
    // 8 MiB of answer at most, never the 512 MiB the backend offered.
    assert!(grown < 40 * MIB, "a 512 MiB answer grew the gateway by {} MiB", grown / MIB);
}

#[tokio::test]
async fn a_huge_stream_event_is_refused_and_an_endless_json_body_too() {
    let model = FakeModel::start().await.unwrap();
    let gw = gateway(&scenario(&model, "huge_mb=64"), "");
    let before = gw.peak_rss();
    let body = json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    upstream_error(gw.chat(KEY, body).await, "max_event_bytes").await;
    let endless = gateway(&scenario(&model, "endless_line"), "  limits: {max_response_bytes: 4194304}\n");
    upstream_error(endless.chat(KEY, hello("m")).await, "max_response_bytes").await;
    let grown = gw.peak_rss().saturating_sub(before);
    assert!(grown < 16 * MIB, "a 64 MiB event grew the gateway by {} MiB", grown / MIB);
}

#[tokio::test]
async fn answer_limits_of_zero_are_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flexway.yaml");
    let yaml = config(
        "  default_backend: main\n  limits: {max_response_bytes: 0, max_event_bytes: 0}\n  backends:\n    main: {url: \"http://127.0.0.1:9/v1\"}\n",
    );
    std::fs::write(&path, yaml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["validate", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr) + String::from_utf8_lossy(&out.stdout);
    assert!(stderr.contains("ai.limits.max_response_bytes"), "{stderr}");
    assert!(stderr.contains("ai.limits.max_event_bytes"), "{stderr}");
}

/// A backend that answers every request with `reply` (one response a connection),
/// counting the requests it got.
async fn raw_peer(reply: String) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let reply = reply.clone();
            tokio::spawn(async move {
                let mut request = vec![0; 64 * 1024];
                let _ = socket.read(&mut request).await;
                let _ = socket.write_all(reply.as_bytes()).await;
            });
        }
    });
    (url, hits)
}

/// A backend's redirect is not followed (the request carries the backend's
/// credential): the 307 is relayed with its status, refunded, and the place it points
/// to is never called.
#[tokio::test]
async fn a_backends_redirect_is_relayed_not_followed() {
    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}";
    let (elsewhere, elsewhere_hits) = raw_peer(ok.to_owned()).await;
    let body = r#"{"error": {"message": "moved"}}"#;
    let redirect = format!(
        "HTTP/1.1 307 Temporary Redirect\r\nlocation: {elsewhere}/chat/completions\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let (url, hits) = raw_peer(redirect).await;
    let gw = gateway(&url, "");
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.status(), 307);
    assert!(!response.headers().contains_key("location"));
    assert_eq!(response.headers()["flexway-cost-eur"], "0.000000");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(elsewhere_hits.load(std::sync::atomic::Ordering::SeqCst), 0, "the redirect was followed");
}
