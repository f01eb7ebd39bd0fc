//! The gateway function's memory, as Lambda runs it: the release `flexway-gateway`
//! binary polling `cargo lambda watch`'s Runtime API, called through its function
//! URL, its ledger and audit on the AWS emulator (`AWS_ENDPOINT_URL`), in front of
//! the fake model server and a REST upstream on loopback. Prints the process's peak
//! resident set (`VmHWM`) after init and after each kind of call, the heaviest the
//! serverless tests make and heavier: long streams, a large whole answer, uploads near
//! the function URL's 6 MB request limit. An environment serves one call at a time,
//! so the peak after the heaviest kind is what the function's memory must hold.
//!
//!   cargo bench -p flexway-gateway-fn --bench memory
//!
//! Needs the emulator (`localstack/start`) and cargo-lambda (`.venv/bin`, or
//! `CARGO_LAMBDA`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use fake_model::{FakeModel, Scenario};
use flexway_testkit::emulator;
use sha2::{Digest, Sha256};
use support::{Process, cargo_lambda, free_port, workspace};

const KEY: &str = "sk-bench-memory";

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(run());
}

/// The process's peak resident set so far, in KiB (Linux).
fn peak_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

async fn run() {
    let sdk = emulator::sdk().await;
    let dynamodb = aws_sdk_dynamodb::Client::new(&sdk);
    let logs = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let table = emulator::unique("flexway-ledger-mem");
    flexway_aws::DynamoDbBudgetStore::create_table(&dynamodb, &table).await.unwrap();
    let log_group = emulator::unique("/flexway/audit-mem");
    logs.create_log_group().log_group_name(&log_group).send().await.unwrap();

    let fake = FakeModel::start().await.unwrap();
    let long_stream = fake.scenario_url(&Scenario { chunks: Some(20_000), words: Some(100_000), ..Default::default() });
    let large_answer = fake.scenario_url(&Scenario { words: Some(200_000), ignore_limit: true, ..Default::default() });
    // A REST upstream that reads what it is sent and answers its length.
    let router = axum::Router::new()
        .route("/documents", axum::routing::post(|body: axum::body::Bytes| async move { body.len().to_string() }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let dir = std::env::temp_dir().join(emulator::unique("flexway-mem"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("ocr.yaml"),
        "openapi: 3.0.3\ninfo: {title: OCR, version: '1'}\npaths:\n  /documents:\n    post:\n      \
         x-flexway-ai: {metering: per_byte, price_per_thousand_eur: '0.001', feature: ocr}\n      \
         responses: {'200': {description: ok}}\n",
    )
    .unwrap();
    let config = format!(
        r#"version: 1
store: {{kind: dynamodb, table: {table}}}
audit: {{sink: cloudwatch, log_group: "{log_group}"}}
tenants:
  acme:
    keys: [{{sha256: {key}}}]
    budgets: {{tokens_per_day: 100000000, eur_per_month: 1000}}
  streams:
    keys: [{{sha256: {stream_key}}}]
    backend: stream
  answers:
    keys: [{{sha256: {large_key}}}]
    backend: large
ai:
  default_backend: main
  budget: {{default_max_tokens: 300000}}
  backends:
    main: {{url: "{main}", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}
    stream: {{url: "{long_stream}", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}
    large: {{url: "{large_answer}", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}
    ocr: {{kind: http, url: "{upstream}", contract: ocr.yaml, mount: /apis/ocr}}
"#,
        key = hex::encode(Sha256::digest(KEY.as_bytes())),
        stream_key = hex::encode(Sha256::digest(format!("{KEY}-stream").as_bytes())),
        large_key = hex::encode(Sha256::digest(format!("{KEY}-large").as_bytes())),
        main = fake.url(),
    );
    std::fs::write(dir.join("flexway.yaml"), config).unwrap();

    let port = free_port();
    let mut watch = Command::new(cargo_lambda());
    watch
        .args(["lambda", "watch", "--only-lambda-apis", "--invoke-address", "127.0.0.1"])
        .args(["--invoke-port", &port.to_string()])
        .current_dir(workspace());
    let watch = Process::spawn("cargo lambda watch", watch);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut function = Command::new(env!("CARGO_BIN_EXE_flexway-gateway"));
    function
        .env("AWS_LAMBDA_RUNTIME_API", format!("http://127.0.0.1:{port}/.rt"))
        .env("AWS_LAMBDA_FUNCTION_NAME", "_")
        .env("AWS_LAMBDA_FUNCTION_VERSION", "1")
        .env("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "256")
        .env("FLEXWAY_CONFIG", dir.join("flexway.yaml"))
        // As the template runs it: the audit group is the function's own log.
        .env("AWS_LAMBDA_LOG_GROUP_NAME", &log_group)
        .envs(emulator::process_env())
        .current_dir(&dir);
    let function = Process::spawn("flexway-gateway", function);
    let pid = function.pid();
    let base = format!("http://127.0.0.1:{port}/lambda-url/_");
    let client = reqwest::Client::builder().timeout(Duration::from_secs(600)).build().unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    let quick = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
    while quick.get(format!("{base}/healthz")).send().await.map_or(true, |r| !r.status().is_success()) {
        assert!(Instant::now() < until, "the function did not answer\n{}\n{}", watch.logs(), function.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("{:<58} {:>10}", "after", "peak RSS");
    let report = |what: &str| println!("{what:<58} {:>7} MiB", peak_kib(pid) / 1024);
    report("init and /healthz");

    // Each tenant is served by its own backend: acme by the plain one, `streams` by
    // the long streams, `answers` by the large answers.
    let chat = |tenant: &str, stream: bool| {
        let key = match tenant {
            "acme" => KEY.to_owned(),
            tenant => format!("{KEY}-{tenant}"),
        };
        client.post(format!("{base}/v1/chat/completions")).bearer_auth(key).json(&serde_json::json!({
            "model": "any", "stream": stream, "max_tokens": 250_000,
            "messages": [{"role": "user", "content": "hello there"}]
        }))
    };
    let ok = |response: reqwest::Response, what: &str| {
        assert!(response.status().is_success(), "{what}: {}\n{}", response.status(), function.logs());
        response
    };
    for _ in 0..200 {
        ok(chat("acme", false).send().await.unwrap(), "short call").bytes().await.unwrap();
    }
    report("200 short calls");
    for _ in 0..100 {
        ok(chat("acme", true).send().await.unwrap(), "short stream").bytes().await.unwrap();
    }
    report("100 short streams");
    let mut streamed = 0;
    for _ in 0..3 {
        let body = ok(chat("stream", true).send().await.unwrap(), "long stream").bytes().await.unwrap();
        streamed += body.len();
    }
    report(&format!("3 streams of 20,000 chunks ({} KiB each)", streamed / 3 / 1024));
    let mut answered = 0;
    for _ in 0..3 {
        let body = ok(chat("large", false).send().await.unwrap(), "large answer").bytes().await.unwrap();
        answered += body.len();
    }
    report(&format!("3 whole answers of 200,000 words ({} KiB each)", answered / 3 / 1024));
    // A function URL takes a request of 6 MB at most, its event's JSON included (a
    // text body is carried as is, a binary one in base64); `cargo lambda watch`
    // refuses more than 2 MiB.
    let upload = vec![b'd'; 2 * 1024 * 1024 - 64 * 1024];
    for _ in 0..5 {
        let sent = client.post(format!("{base}/apis/ocr/documents")).bearer_auth(KEY);
        let sent = sent.header("content-type", "text/plain").body(upload.clone());
        let answer = ok(sent.send().await.unwrap(), "upload").text().await.unwrap();
        assert_eq!(answer, upload.len().to_string());
    }
    report("5 uploads of 1.9 MiB to a per-byte REST operation");
    let _ = std::fs::remove_dir_all(&dir);
}
