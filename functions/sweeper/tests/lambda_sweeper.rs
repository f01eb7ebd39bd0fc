//! The sweeper function as Lambda runs it: the real `flexway-sweeper` binary polling
//! the Runtime API of `cargo lambda watch --only-lambda-apis`, invoked with an
//! EventBridge scheduled event, refunding an expired reservation in the emulated
//! DynamoDB, charging one that carries a settle intent, and leaving a live one alone.
#![cfg(test)]

use flexway_testkit::emulator;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flexway::budget::{BudgetStore, CounterKey, IntentOutcome, Line, ReserveOutcome, ReserveRequest};
use flexway_aws::DynamoDbBudgetStore;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cargo_lambda() -> PathBuf {
    if let Ok(path) = std::env::var("CARGO_LAMBDA") {
        return PathBuf::from(path);
    }
    let venv = workspace().join(".venv/bin/cargo-lambda");
    if venv.exists() { venv } else { PathBuf::from("cargo-lambda") }
}

/// Killed with its process group on drop; its stderr (the function's log) kept.
struct Process(Child, std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Process {
    fn spawn(mut command: Command) -> Process {
        use std::io::BufRead;
        use std::os::unix::process::CommandExt;
        command.process_group(0).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = command.spawn().unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (stderr, kept) = (child.stderr.take().unwrap(), lines.clone());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                kept.lock().unwrap().push(line);
            }
        });
        Process(child, lines)
    }

    fn log(&self) -> Vec<String> {
        self.1.lock().unwrap().clone()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("--").arg(format!("-{}", self.0.id())).status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn reservation(id: &str, amount: u64, expires_at: u64) -> ReserveRequest {
    ReserveRequest {
        request_id: id.to_owned(),
        lines: vec![Line { key: CounterKey("acme/*/tokens/day/2026-11-29".into()), amount, limit: Some(1000) }],
        expires_at,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_event_refunds_expired_reservations_and_charges_settle_intents() {
    let sdk = emulator::sdk().await;
    let client = aws_sdk_dynamodb::Client::new(&sdk);
    let table = emulator::unique("flexway-ledger-sweeper");
    DynamoDbBudgetStore::create_table(&client, &table).await.unwrap();
    let store = DynamoDbBudgetStore::new(client, &table);
    let now = flexway::budget::period::unix_now();
    assert_eq!(store.reserve(&reservation("vanished", 300, now - 5)).await.unwrap(), ReserveOutcome::Reserved);
    assert_eq!(store.reserve(&reservation("running", 200, now + 600)).await.unwrap(), ReserveOutcome::Reserved);
    assert_eq!(store.reserve(&reservation("unwritten", 100, now - 5)).await.unwrap(), ReserveOutcome::Reserved);
    let actual = [(CounterKey("acme/*/tokens/day/2026-11-29".into()), 40)];
    assert_eq!(store.record_intent("unwritten", &actual).await.unwrap(), IntentOutcome::Recorded);
    // The lease of an environment that stopped renewing it 30 s ago, 25 tokens used.
    let lease = "lease#frozen#1";
    assert_eq!(store.reserve(&reservation(lease, 250, now - 30)).await.unwrap(), ReserveOutcome::Reserved);
    let used_on_lease = [(CounterKey("acme/*/tokens/day/2026-11-29".into()), 25)];
    assert_eq!(store.record_intent(lease, &used_on_lease).await.unwrap(), IntentOutcome::Recorded);

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut watch = Command::new(cargo_lambda());
    watch
        .args(["lambda", "watch", "--only-lambda-apis", "--invoke-address", "127.0.0.1"])
        .args(["--invoke-port", &port.to_string()])
        .current_dir(workspace());
    let _watch = Process::spawn(watch);
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "cargo lambda watch did not listen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut function = Command::new(env!("CARGO_BIN_EXE_flexway-sweeper"));
    function
        .env("AWS_LAMBDA_RUNTIME_API", format!("http://127.0.0.1:{port}/.rt"))
        .env("AWS_LAMBDA_FUNCTION_NAME", "_")
        .env("AWS_LAMBDA_FUNCTION_VERSION", "1")
        .env("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "256")
        .env("FLEXWAY_TABLE", &table)
        .env("AWS_ENDPOINT_URL", emulator::endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|_| "test".into()))
        .env("AWS_SECRET_ACCESS_KEY", std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "test".into()));
    let function = Process::spawn(function);

    // What EventBridge sends on `rate(1 minute)`.
    let event = serde_json::json!({
        "version": "0", "id": "53dc4d37-cffa-4f76-80c9-8b7d4a4d2eaa",
        "detail-type": "Scheduled Event", "source": "aws.events", "account": "123456789012",
        "time": "2026-11-29T16:00:00Z", "region": "us-east-1",
        "resources": ["arn:aws:events:us-east-1:123456789012:rule/flexway-sweeper"], "detail": {}
    });
    let response = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/2015-03-31/functions/_/invocations"))
        .timeout(Duration::from_secs(60))
        .json(&event)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    let lag = body["lag_secs"].as_u64().unwrap();
    assert!((30..60).contains(&lag), "the oldest expired reservation waited ~30 s: {body}");
    assert_eq!(body, serde_json::json!({"refunded": 1, "charged": 1, "leases": 1, "lag_secs": lag}));
    let used = store.used(&[CounterKey("acme/*/tokens/day/2026-11-29".into())]).await.unwrap();
    assert_eq!(
        used,
        [200 + 40 + 25],
        "the vanished call refunded, the unwritten settlement charged, the lease charged its usage, the running one held"
    );
    // The line the template's metric filters read, as the function printed it: the
    // stack's filters count this run's charge, its refund and its lag, and no error.
    let printed =
        function.log().into_iter().find(|l| l.contains("swept expired reservations")).expect("the sweep's line");
    let template = flexway_testkit::template::transformed(&[]);
    let pattern =
        |filter: &str| template["Resources"][filter]["Properties"]["FilterPattern"].as_str().unwrap().to_owned();
    for filter in ["SweeperChargesFilter", "SweeperRefundsFilter", "SweeperLagFilter"] {
        assert!(flexway_testkit::logs::matches(&pattern(filter), &printed), "{filter}: {printed}");
    }
    assert!(!flexway_testkit::logs::matches(&pattern("SweeperLoggedErrorsFilter"), &printed), "{printed}");
    let line: serde_json::Value = serde_json::from_str(&printed).unwrap();
    let fields = &line["fields"];
    assert_eq!((fields["refunded"].as_u64(), fields["charged"].as_u64()), (Some(1), Some(1)), "{line}");
    assert_eq!((fields["leases"].as_u64(), fields["lag_secs"].as_u64()), (Some(1), Some(lag)), "{line}");
    assert_eq!(store.live_reservations().await.unwrap(), 1);
}
