//! gRPC-Web through the gateway function (SPEC §10, the serverless shape): the real
//! `flexway-gateway` binary polling the Runtime API of `cargo lambda watch`, called
//! through the emulated function URL by a gRPC-Web client (HTTP/1.1, each message
//! length-prefixed, the trailers in the body's last frame), in front of the tonic
//! server of `tests/fake-grpc`. The ledger is in memory and the audit in a file: no
//! AWS service is involved, so the test needs no emulator.
//!
//! A function URL buffers the request body, so client and bidirectional streaming
//! cannot work there: they are refused with UNIMPLEMENTED, which this test checks too.
#![cfg(test)]

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use fake_grpc::pb::{Image, Text};
use fake_grpc::web::{self, Frame};
use fake_grpc::{DESCRIPTOR_SET, FakeOcr};
use futures_util::StreamExt;
use prost::Message;
use sha2::{Digest, Sha256};
use support::{Process, cargo_lambda, free_port, workspace};

const KEY: &str = "sk-test-grpc-web";

/// One call's answer: its messages (with when each arrived) and its trailers block.
struct Answer {
    headers: reqwest::header::HeaderMap,
    messages: Vec<(Duration, Vec<u8>)>,
    trailers: Option<String>,
}

async fn call(client: &reqwest::Client, base: &str, method: &str, key: &str, body: Vec<u8>) -> Answer {
    let started = Instant::now();
    let response = client
        .post(format!("{base}/ocr.v1.Ocr/{method}"))
        .bearer_auth(key)
        .header("content-type", web::CONTENT_TYPE)
        .header("x-grpc-web", "1")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let headers = response.headers().clone();
    let mut reader = web::Reader::default();
    let mut answer = Answer { headers, messages: Vec::new(), trailers: None };
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        for frame in reader.push(&chunk.unwrap()) {
            match frame {
                Frame::Message(bytes) => answer.messages.push((started.elapsed(), bytes)),
                Frame::Trailers(block) => answer.trailers = Some(block),
            }
        }
    }
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_grpc_web_through_the_function_url() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let set = dir.path().join("ocr.binpb");
    std::fs::write(&set, DESCRIPTOR_SET).unwrap();
    let audit = dir.path().join("audit.jsonl");
    let config = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: file, path: {audit}}}\ntenants:\n  acme:\n    keys:\n      \
         - sha256: {key}\n    budgets: {{eur_per_month: 50}}\nai:\n  backends:\n    ocr:\n      kind: grpc\n      \
         url: {url}\n      descriptor_set: {set}\n",
        audit = audit.display(),
        key = hex::encode(Sha256::digest(KEY.as_bytes())),
        url = upstream.url(),
        set = set.display(),
    );
    let config_path = dir.path().join("flexway.yaml");
    std::fs::write(&config_path, config).unwrap();

    let port = free_port();
    let mut watch = Command::new(cargo_lambda());
    watch
        .args(["lambda", "watch", "--only-lambda-apis", "--invoke-address", "127.0.0.1"])
        .args(["--invoke-port", &port.to_string()])
        .current_dir(workspace());
    let watch = Process::spawn("cargo lambda watch", watch);
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "cargo lambda watch did not listen\n{}", watch.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut function = Command::new(env!("CARGO_BIN_EXE_flexway-gateway"));
    function
        .env("AWS_LAMBDA_RUNTIME_API", format!("http://127.0.0.1:{port}/.rt"))
        .env("AWS_LAMBDA_FUNCTION_NAME", "_")
        .env("AWS_LAMBDA_FUNCTION_VERSION", "1")
        .env("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "512")
        .env("FLEXWAY_CONFIG", &config_path)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .current_dir(dir.path());
    let function = Process::spawn("flexway-gateway", function);
    let base = format!("http://127.0.0.1:{port}/lambda-url/_");
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let logs = || format!("{}\n{}", watch.logs(), function.logs());

    // Unary, per call: the message, then the trailers frame with the status and cost.
    let image = Image { data: vec![1; 42], ..Default::default() };
    let answer = call(&client, &base, "Recognize", KEY, web::frame(&image)).await;
    let trailers = answer.trailers.clone().unwrap_or_else(|| panic!("no trailers frame\n{}", logs()));
    assert!(trailers.contains("grpc-status:0\r\n"), "{trailers}\n{}", logs());
    assert!(trailers.contains("flexway-cost-eur:0.002500\r\n"), "{trailers}");
    assert_eq!(Text::decode(answer.messages[0].1.as_slice()).unwrap().text, "42");
    assert_eq!(answer.headers["flexway-backend"], "ocr");

    // Server streaming, per byte: pages relayed as they come, not buffered.
    let pages = Image { count: 4, delay_ms: 250, reply_bytes: 8, ..Default::default() };
    let mut bytes = pages.encoded_len() as u64;
    let answer = call(&client, &base, "Pages", KEY, web::frame(&pages)).await;
    assert_eq!(answer.messages.len(), 4, "{}", logs());
    bytes += answer.messages.iter().map(|(_, m)| m.len() as u64).sum::<u64>();
    let spread = answer.messages[3].0 - answer.messages[0].0;
    assert!(spread >= Duration::from_millis(500), "pages arrived together ({spread:?}): buffered");
    let cost = format!("flexway-cost-eur:0.{:06}\r\n", bytes * 500);
    assert!(answer.trailers.as_deref().unwrap().contains(&cost), "{:?} {cost}", answer.trailers);

    // Client streaming cannot cross a function URL: refused, clearly.
    let answer = call(&client, &base, "Upload", KEY, web::frame(&image)).await;
    assert_eq!(answer.headers["grpc-status"], "12");
    let message = answer.headers["grpc-message"].to_str().unwrap();
    assert!(message.contains("gRPC-Web carries unary and server-streaming calls only"), "{message}");

    // A bad key.
    let answer = call(&client, &base, "Recognize", "sk-wrong", web::frame(&image)).await;
    assert_eq!(answer.headers["grpc-status"], "16");
    assert!(answer.headers["grpc-message"].to_str().unwrap().contains("invalid_api_key"));

    // One record per identified call, written inside its invocation.
    let text = std::fs::read_to_string(&audit).unwrap();
    let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 3, "{text}");
    let statuses: Vec<u64> = records.iter().map(|r| r["status"].as_u64().unwrap()).collect();
    assert_eq!(statuses, [0, 0, 12]);
    assert!(records.iter().all(|r| r["operation"] == "grpc"));
    assert_eq!(records[0]["cost_micro_eur"], 2_500);
    assert_eq!(records[1]["cost_micro_eur"], bytes * 500);
    assert_eq!(upstream.calls(), 2);
}
