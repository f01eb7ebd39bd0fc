//! The gateway function end to end, as Lambda runs it: the real `flexway-gateway`
//! binary polling the Runtime API of `cargo lambda watch` (its Lambda emulator),
//! called through the emulated function URL in streaming mode, in front of the
//! project's fake model server, with the ledger in the emulated DynamoDB, the audit in
//! the emulated CloudWatch Logs, and the backend's key in an emulated SSM SecureString
//! parameter, resolved at init.
//!
//! `cargo lambda watch --only-lambda-apis` serves the Runtime API and the function URL
//! (`/lambda-url/_/...`); the test starts the binary itself (the one Cargo built for
//! this test) with the environment Lambda gives a function, so the init time is
//! measured from process start and no nested `cargo run` competes for the build lock.
//! cargo-lambda comes from PyPI (`localstack/requirements.txt`); set `CARGO_LAMBDA`
//! to its path if it is not on PATH nor in the workspace's `.venv`.
#![cfg(test)]

#[path = "../../aws/tests/emulator/mod.rs"]
mod emulator;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fake_model::{FakeModel, Scenario};
use flexway::budget::BudgetStore;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};

const KEY: &str = "sk-test-lambda";

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cargo_lambda() -> PathBuf {
    if let Ok(path) = std::env::var("CARGO_LAMBDA") {
        return PathBuf::from(path);
    }
    let venv = workspace().join(".venv/bin/cargo-lambda");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("cargo-lambda")
}

/// A child process in its own process group, killed (group and all) on drop.
struct Process {
    child: Child,
    name: &'static str,
    logs: Arc<Mutex<Vec<String>>>,
}

impl Process {
    fn spawn(name: &'static str, mut command: Command) -> Process {
        use std::os::unix::process::CommandExt;
        command.process_group(0).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = command.spawn().unwrap_or_else(|e| panic!("cannot start {name} ({command:?}): {e}"));
        let logs = Arc::new(Mutex::new(Vec::new()));
        for pipe in [
            child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let logs = logs.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    logs.lock().unwrap().push(line);
                }
            });
        }
        Process { child, name, logs }
    }

    fn logs(&self) -> String {
        format!("--- {} ---\n{}", self.name, self.logs.lock().unwrap().join("\n"))
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("--").arg(format!("-{}", self.child.id())).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn config(table: &str, log_group: &str, backend_url: &str, key_arn: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: dynamodb, table: {table}}}
audit: {{sink: cloudwatch, log_group: "{log_group}", log_stream: gateway-test}}
tenants:
  acme:
    keys:
      - sha256: {key}
    budgets: {{tokens_per_day: 100000, eur_per_month: 5}}
ai:
  default_backend: main
  backends:
    main:
      url: {backend_url}
      auth: {{type: bearer, secret: "{key_arn}"}}
      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}}
"#,
        key = hex::encode(Sha256::digest(KEY.as_bytes())),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_a_chat_completion_through_the_function_url_with_dynamodb_and_cloudwatch() {
    let sdk = emulator::sdk().await;
    let dynamodb = aws_sdk_dynamodb::Client::new(&sdk);
    let logs = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let table = emulator::unique("flexway-ledger-fn");
    flexway_aws::DynamoDbBudgetStore::create_table(&dynamodb, &table).await.unwrap();
    let log_group = emulator::unique("/flexway/audit-fn");
    logs.create_log_group().log_group_name(&log_group).send().await.unwrap();

    // The backend's key, as the template's SsmParameterArns would grant it.
    let ssm = aws_sdk_ssm::Client::new(&sdk);
    let parameter = format!("/flexway/{}", emulator::unique("fn-backend-key"));
    let put = ssm.put_parameter().name(&parameter).value("sk-backend-from-ssm");
    put.r#type(aws_sdk_ssm::types::ParameterType::SecureString).send().await.unwrap();
    let described = ssm.get_parameter().name(&parameter).send().await.unwrap();
    let key_arn = described.parameter().and_then(|p| p.arn()).unwrap().to_owned();

    let fake = FakeModel::start().await.unwrap();
    // A pause between chunks, so that "streamed" is observable on the client side.
    let backend = fake.scenario_url(&Scenario { chunk_delay_ms: Some(150), ..Default::default() });
    let dir = std::env::temp_dir().join(emulator::unique("flexway-fn"));
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("flexway.yaml");
    std::fs::write(&config_path, config(&table, &log_group, &backend, &key_arn)).unwrap();

    // The Lambda emulator: Runtime API + function URLs.
    let port = free_port();
    let mut watch = Command::new(cargo_lambda());
    watch
        .args(["lambda", "watch", "--only-lambda-apis", "--invoke-address", "127.0.0.1"])
        .args(["--invoke-port", &port.to_string()])
        .current_dir(workspace());
    let watch = Process::spawn("cargo lambda watch", watch);
    let base = format!("http://127.0.0.1:{port}/lambda-url/_");
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "cargo lambda watch did not listen\n{}", watch.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The function, with the environment Lambda gives it.
    let started = Instant::now();
    let mut function = Command::new(env!("CARGO_BIN_EXE_flexway-gateway"));
    function
        .env("AWS_LAMBDA_RUNTIME_API", format!("http://127.0.0.1:{port}/.rt"))
        .env("AWS_LAMBDA_FUNCTION_NAME", "_")
        .env("AWS_LAMBDA_FUNCTION_VERSION", "1")
        .env("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "512")
        .env("FLEXWAY_CONFIG", &config_path)
        .env("AWS_ENDPOINT_URL", emulator::endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|_| "test".into()))
        .env("AWS_SECRET_ACCESS_KEY", std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "test".into()))
        .current_dir(&dir);
    let function = Process::spawn("flexway-gateway", function);

    let health = client.get(format!("{base}/healthz")).send().await;
    let first_response = started.elapsed();
    let health = health.unwrap_or_else(|e| panic!("healthz: {e}\n{}\n{}", watch.logs(), function.logs()));
    assert_eq!(health.status(), 200, "{}", function.logs());
    eprintln!("function process start to first response: {first_response:?}");

    let request_started = Instant::now();
    let response = client
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(KEY)
        .json(&serde_json::json!({
            "model": "chat-default",
            "stream": true,
            "messages": [{"role": "user", "content": "hello there"}]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{}", function.logs());
    assert_eq!(response.headers()["content-type"].to_str().unwrap(), "text/event-stream", "{:?}", response.headers());
    let request_id = response.headers()["flexway-request-id"].to_str().unwrap().to_owned();
    assert_eq!(response.headers()["flexway-backend"], "main");

    // Read the body as it arrives, noting when each SSE event completes.
    let mut body = response.bytes_stream();
    let mut buffer = String::new();
    let mut events: Vec<(Duration, String)> = Vec::new();
    while let Some(chunk) = body.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            if let Some(data) = event.trim().strip_prefix("data: ") {
                events.push((request_started.elapsed(), data.to_owned()));
            }
        }
    }
    assert_eq!(events.last().map(|(_, d)| d.as_str()), Some("[DONE]"), "{events:?} {}", function.logs());
    let content: String = events
        .iter()
        .filter(|(_, d)| d.as_str() != "[DONE]")
        .filter_map(|(_, d)| {
            let chunk: serde_json::Value = serde_json::from_str(d).unwrap();
            assert_eq!(chunk["object"], "chat.completion.chunk");
            chunk["choices"][0]["delta"]["content"].as_str().map(str::to_owned)
        })
        .collect();
    assert!(content.contains("hello there"), "relayed content: {content}");
    let sent = fake.requests().last().and_then(|r| r.header("authorization").map(str::to_owned));
    assert_eq!(sent.as_deref(), Some("Bearer sk-backend-from-ssm"), "the key resolved at init");
    // Streamed, not buffered: the first event arrived well before the last.
    let spread = events.last().unwrap().0 - events.first().unwrap().0;
    assert!(
        spread >= Duration::from_millis(450),
        "events arrived together ({spread:?}): the response was buffered\n{events:?}"
    );

    // The ledger moved, and the reservation is settled (inside the invocation).
    let store = flexway_aws::DynamoDbBudgetStore::new(dynamodb.clone(), &table);
    let now = flexway::budget::period::unix_now();
    let day = flexway::budget::CounterKey::new(
        "acme",
        None,
        flexway::budget::Unit::Tokens,
        flexway::budget::Period::Day,
        now,
    );
    let eur = flexway::budget::CounterKey::new(
        "acme",
        None,
        flexway::budget::Unit::MicroEur,
        flexway::budget::Period::Month,
        now,
    );
    let used = store.used(&[day, eur]).await.unwrap();
    assert!(used[0] > 0, "the tokens/day counter did not move: {used:?}");
    assert!(used[1] > 0, "the eur/month counter did not move: {used:?}");
    // The call was settled on the environment's budget lease (build_adapters), whose
    // usage is on its item for the sweeper: the lease is the one reservation left.
    let live = store.live_reservations().await.unwrap();
    assert!(live <= 1, "{live} reservations left behind, more than the environment's lease");

    // The audit record is in the log group, written before the invocation ended.
    let events = logs.filter_log_events().log_group_name(&log_group).send().await.unwrap();
    let records: Vec<serde_json::Value> = events
        .events()
        .iter()
        .map(|e| serde_json::from_str(e.message().unwrap()).unwrap())
        .filter(|r: &serde_json::Value| r["request_id"] == request_id.as_str())
        .collect();
    assert_eq!(records.len(), 1, "audit records for {request_id}: {records:?}\n{}", function.logs());
    let record = &records[0];
    assert_eq!(record["tenant"], "acme");
    assert_eq!(record["backend"], "main");
    assert_eq!(record["status"], 200);
    assert!(record["completion_tokens"].as_u64().unwrap() > 0, "{record}");

    // An error is documented, and streamed too: a bad key gets the OpenAI envelope.
    let refused = client
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("sk-wrong")
        .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    let envelope: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(envelope["error"]["code"], "invalid_api_key");
    let _ = std::fs::remove_dir_all(&dir);
}
