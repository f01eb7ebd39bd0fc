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

use flexway_testkit::emulator;
mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use fake_model::{FakeModel, Scenario};
use flexway::budget::BudgetStore;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use support::{Process, cargo_lambda, free_port, workspace};

const KEY: &str = "sk-test-lambda";

/// The gateway's config on the emulated table and audit group, in front of one
/// backend (with its key from `key_secret`, a secret reference, when given).
fn config(table: &str, log_group: &str, backend_url: &str, key_secret: Option<&str>) -> String {
    let auth = key_secret.map(|s| format!("\n      auth: {{type: bearer, secret: \"{s}\"}}")).unwrap_or_default();
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
      url: {backend_url}{auth}
      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}}
"#,
        key = hex::encode(Sha256::digest(KEY.as_bytes())),
    )
}

/// A fresh ledger table and audit group on the emulator.
struct Resources {
    dynamodb: aws_sdk_dynamodb::Client,
    logs: aws_sdk_cloudwatchlogs::Client,
    table: String,
    log_group: String,
}

impl Resources {
    async fn new() -> Resources {
        let sdk = emulator::sdk().await;
        let dynamodb = aws_sdk_dynamodb::Client::new(&sdk);
        let logs = aws_sdk_cloudwatchlogs::Client::new(&sdk);
        let table = emulator::unique("flexway-ledger-fn");
        flexway_aws::DynamoDbBudgetStore::create_table(&dynamodb, &table).await.unwrap();
        let log_group = emulator::unique("/flexway/audit-fn");
        logs.create_log_group().log_group_name(&log_group).send().await.unwrap();
        Resources { dynamodb, logs, table, log_group }
    }

    /// acme's tokens/day and eur/month counters.
    async fn used(&self) -> Vec<u64> {
        let store = flexway_aws::DynamoDbBudgetStore::new(self.dynamodb.clone(), &self.table);
        let now = flexway::budget::period::unix_now();
        let counter = |unit, period| flexway::budget::CounterKey::new("acme", None, unit, period, now);
        use flexway::budget::{Period, Unit};
        store.used(&[counter(Unit::Tokens, Period::Day), counter(Unit::MicroEur, Period::Month)]).await.unwrap()
    }

    /// acme's counters once the sweeper has closed the environment's budget lease, as
    /// it does when the environment is gone (the lease item carries its usage): what
    /// the calls used, to the token and the micro-euro.
    async fn used_once_leases_are_swept(&self) -> Vec<u64> {
        let store = flexway_aws::DynamoDbBudgetStore::new(self.dynamodb.clone(), &self.table);
        store.sweep(flexway::budget::period::unix_now() + 3600).await.unwrap();
        self.used().await
    }
}

/// `cargo lambda watch` and the gateway function polling it, as Lambda runs them.
struct Function {
    watch: Process,
    function: Process,
    base: String,
    client: reqwest::Client,
    started: Instant,
    dir: PathBuf,
}

impl Function {
    /// Starts the emulator, then the function with `config` and the environment
    /// Lambda gives a function plus `env`. With `deadline`, each invocation's
    /// deadline is that long after it is handed over, as Lambda sends it
    /// ([`deadline_proxy`]); without, the emulator's own (which the gateway ignores).
    async fn start(config: &str, env: &[(&str, &str)], deadline: Option<Duration>) -> Function {
        let dir = std::env::temp_dir().join(emulator::unique("flexway-fn"));
        std::fs::create_dir_all(&dir).unwrap();
        let config_path = dir.join("flexway.yaml");
        std::fs::write(&config_path, config).unwrap();

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
        let deadline_at = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline_at, "cargo lambda watch did not listen\n{}", watch.logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let runtime = format!("http://127.0.0.1:{port}");
        let runtime = match deadline {
            Some(left) => deadline_proxy(runtime, left).await,
            None => runtime,
        };

        // The function, with the environment Lambda gives it.
        let started = Instant::now();
        let mut function = Command::new(env!("CARGO_BIN_EXE_flexway-gateway"));
        function
            .env("AWS_LAMBDA_RUNTIME_API", format!("{runtime}/.rt"))
            .env("AWS_LAMBDA_FUNCTION_NAME", "_")
            .env("AWS_LAMBDA_FUNCTION_VERSION", "1")
            .env("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "512")
            .env("FLEXWAY_CONFIG", &config_path)
            .envs(emulator::process_env())
            .envs(env.iter().copied())
            .current_dir(&dir);
        let function = Process::spawn("flexway-gateway", function);
        Function { watch, function, base, client, started, dir }
    }

    fn logs(&self) -> String {
        format!("{}\n{}", self.watch.logs(), self.function.logs())
    }

    /// The function's own output lines (stdout and stderr), as Lambda collects them.
    fn output(&self) -> Vec<String> {
        self.function.logs.lock().unwrap().clone()
    }

    /// Waits (up to 10 s) for an output line that `wanted` accepts.
    async fn output_line(&self, what: &str, wanted: impl Fn(&str) -> bool) -> String {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(line) = self.output().into_iter().find(|line| wanted(line)) {
                return line;
            }
            assert!(Instant::now() < until, "no output line: {what}\n{}", self.logs());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The audit record of `request_id` the function printed.
    async fn printed_record(&self, request_id: &str) -> flexway::audit::AuditRecord {
        let id = format!(r#""request_id":"{request_id}""#);
        let line = self
            .output_line(&format!("the record of {request_id}"), |line| {
                line.starts_with(r#"{"schema_version""#) && line.contains(&id)
            })
            .await;
        serde_json::from_str(&line).unwrap()
    }

    fn chat(&self, stream: bool) -> reqwest::RequestBuilder {
        self.client.post(format!("{}/v1/chat/completions", self.base)).bearer_auth(KEY).json(&serde_json::json!({
            "model": "chat-default",
            "stream": stream,
            "messages": [{"role": "user", "content": "hello there"}]
        }))
    }
}

impl Drop for Function {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The Runtime API as Lambda serves it: `cargo lambda watch` sends its timeout
/// (`lambda-runtime-deadline-ms: 600000`) where Lambda sends an instant, in
/// milliseconds since the Unix epoch. This proxy between the function and the
/// emulator passes every request and response through as it flows (streams stay
/// streams) and rewrites each next invocation's deadline to `left` from now. Returns
/// its base URL.
async fn deadline_proxy(runtime: String, left: Duration) -> String {
    use axum::body::Body;
    use axum::http::header::{HOST, TRANSFER_ENCODING};
    let client = reqwest::Client::new();
    let forward = move |request: axum::extract::Request| {
        let (client, runtime) = (client.clone(), runtime.clone());
        async move {
            let (parts, body) = request.into_parts();
            let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
            let mut headers = parts.headers;
            headers.remove(HOST);
            headers.remove(TRANSFER_ENCODING);
            let sent = client
                .request(parts.method, format!("{runtime}{path}"))
                .headers(headers)
                .body(reqwest::Body::wrap_stream(body.into_data_stream()))
                .send()
                .await;
            // The emulator stopped (the test is over): the function's poll fails.
            let Ok(sent) = sent else {
                return axum::http::Response::builder().status(502).body(Body::empty()).unwrap();
            };
            let next = path.ends_with("/invocation/next");
            let mut response = axum::http::Response::builder().status(sent.status());
            for (name, value) in sent.headers() {
                if name != TRANSFER_ENCODING && !(next && name == "lambda-runtime-deadline-ms") {
                    response = response.header(name, value);
                }
            }
            if next {
                let at = flexway::budget::period::unix_now_millis() + left.as_millis() as u64;
                response = response.header("lambda-runtime-deadline-ms", at.to_string());
            }
            response.body(Body::from_stream(sent.bytes_stream())).unwrap()
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, axum::Router::new().fallback(forward)).await });
    format!("http://{address}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_a_chat_completion_through_the_function_url_with_dynamodb_and_cloudwatch() {
    let resources = Resources::new().await;
    let Resources { logs, table, log_group, .. } = &resources;

    // The backend's key, as the template's SsmParameterArns would grant it.
    let sdk = emulator::sdk().await;
    let ssm = aws_sdk_ssm::Client::new(&sdk);
    let parameter = format!("/flexway/{}", emulator::unique("fn-backend-key"));
    let put = ssm.put_parameter().name(&parameter).value("sk-backend-from-ssm");
    put.r#type(aws_sdk_ssm::types::ParameterType::SecureString).send().await.unwrap();
    let described = ssm.get_parameter().name(&parameter).send().await.unwrap();
    let key_arn = described.parameter().and_then(|p| p.arn()).unwrap().to_owned();

    let fake = FakeModel::start().await.unwrap();
    // A pause between chunks, so that "streamed" is observable on the client side.
    let backend = fake.scenario_url(&Scenario { chunk_delay_ms: Some(150), ..Default::default() });
    let function = Function::start(&config(table, log_group, &backend, Some(&key_arn)), &[], None).await;
    let (client, base) = (&function.client, &function.base);

    let health = client.get(format!("{base}/healthz")).send().await;
    let first_response = function.started.elapsed();
    let health = health.unwrap_or_else(|e| panic!("healthz: {e}\n{}", function.logs()));
    assert_eq!(health.status(), 200, "{}", function.logs());
    eprintln!("function process start to first response: {first_response:?}");

    let request_started = Instant::now();
    let response = function.chat(true).send().await.unwrap();
    assert_eq!(response.status(), 200, "{}", function.logs());
    assert_eq!(response.headers()["content-type"].to_str().unwrap(), "text/event-stream", "{:?}", response.headers());
    let request_id = response.headers()["flexway-request-id"].to_str().unwrap().to_owned();
    assert_eq!(response.headers()["flexway-backend"], "main");

    let events = sse_events(response, request_started).await;
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
    let used = resources.used().await;
    assert!(used[0] > 0, "the tokens/day counter did not move: {used:?}");
    assert!(used[1] > 0, "the eur/month counter did not move: {used:?}");
    // The call was settled on the environment's budget lease (build_adapters), whose
    // usage is on its item for the sweeper: the lease is the one reservation left.
    let store = flexway_aws::DynamoDbBudgetStore::new(resources.dynamodb.clone(), table);
    let live = store.live_reservations().await.unwrap();
    assert!(live <= 1, "{live} reservations left behind, more than the environment's lease");

    // The audit record is in the log group, written before the invocation ended.
    let events = logs.filter_log_events().log_group_name(log_group).send().await.unwrap();
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
}

/// The data of each SSE event of a response as it completes, with when it did.
async fn sse_events(response: reqwest::Response, since: Instant) -> Vec<(Duration, String)> {
    let mut body = response.bytes_stream();
    let mut buffer = String::new();
    let mut events = Vec::new();
    while let Some(chunk) = body.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            if let Some(data) = event.lines().find_map(|line| line.strip_prefix("data: ")) {
                events.push((since.elapsed(), data.to_owned()));
            }
        }
    }
    events
}

/// The function's output lines put into `group` as Lambda delivers a function's log
/// (one event per line, one stream per environment).
async fn deliver(logs: &aws_sdk_cloudwatchlogs::Client, group: &str, lines: &[String]) {
    use aws_sdk_cloudwatchlogs::types::InputLogEvent;
    let stream = "2026/12/01/[1]environment";
    logs.create_log_stream().log_group_name(group).log_stream_name(stream).send().await.unwrap();
    let now = i64::try_from(flexway::budget::period::unix_now_millis()).unwrap();
    let events = lines.iter().map(|line| InputLogEvent::builder().timestamp(now).message(line).build().unwrap());
    let put = logs.put_log_events().log_group_name(group).log_stream_name(stream);
    put.set_log_events(Some(events.collect())).send().await.unwrap();
}

/// The template's shape: the function's own log group is the audit group. The
/// gateway prints each record (no PutLogEvents between the answer and the client),
/// Lambda delivers its output to the group, and `flexway report`'s reader finds
/// exactly the calls among the function's other lines, chained (`audit.chain_key`)
/// through the EMF lines printed between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_goes_through_the_functions_own_log_when_that_is_the_audit_group() {
    let resources = Resources::new().await;
    let Resources { logs, table, log_group, .. } = &resources;
    let fake = FakeModel::start().await.unwrap();
    let chain_key = "a chain key for the lambda test";
    let own = [
        ("AWS_LAMBDA_LOG_GROUP_NAME", log_group.as_str()),
        ("AWS_LAMBDA_LOG_STREAM_NAME", "env-1"),
        ("FLEXWAY_CHAIN_KEY", chain_key),
    ];
    let config = config(table, log_group, &fake.url(), None)
        .replace("log_stream: gateway-test}", "log_stream: gateway-test, chain_key: \"env:FLEXWAY_CHAIN_KEY\"}");
    let function = Function::start(&config, &own, None).await;

    let mut request_ids = Vec::new();
    for stream in [false, true] {
        let response = function.chat(stream).send().await.unwrap();
        assert_eq!(response.status(), 200, "{}", function.logs());
        request_ids.push(response.headers()["flexway-request-id"].to_str().unwrap().to_owned());
        let _ = response.bytes().await.unwrap();
    }
    for id in &request_ids {
        function.printed_record(id).await;
    }
    // The function wrote nothing to the group itself: no stream, no event.
    let streams = logs.describe_log_streams().log_group_name(log_group).send().await.unwrap();
    assert!(streams.log_streams().is_empty(), "the function called the Logs API: {streams:?}");

    deliver(logs, log_group, &function.output()).await;
    let mut verifier = flexway::audit::chain::Verifier::new(chain_key.as_bytes(), true);
    let read = flexway_aws::read_audit_log_group(logs, log_group, None, None, Some(&mut verifier)).await.unwrap();
    let records = read.records;
    let read: Vec<&str> = records.iter().map(|r| r.request_id.as_str()).collect();
    assert_eq!(read, request_ids, "one record per call, in order, among {:?}", function.output());
    let verdict = verifier.finish();
    assert_eq!((verdict.verified, verdict.chains), (2, 1), "{:?}", verdict.breaks);
    assert!(verdict.breaks.is_empty(), "{:?}", verdict.breaks);
    let used = resources.used_once_leases_are_swept().await;
    let tokens: u64 = records.iter().map(|r| r.prompt_tokens + r.completion_tokens).sum();
    let cost: u64 = records.iter().map(|r| r.cost_micro_eur).sum();
    assert_eq!(used, [tokens, cost], "the ledger equals the audit");
}

/// SPEC §11 under the Lambda emulator: a stream still open near the invocation's
/// deadline ends with the in-band `deadline` error, settled on what was relayed and
/// recorded, before the platform would cut it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_open_at_the_invocations_deadline_ends_with_the_deadline_error_settled_and_recorded() {
    let resources = Resources::new().await;
    let Resources { table, log_group, .. } = &resources;
    let fake = FakeModel::start().await.unwrap();
    // 40 chunks, 250 ms apart: 10 s, far past a 4 s deadline (cut at 3.6 s).
    let slow = Scenario { chunks: Some(40), chunk_delay_ms: Some(250), ..Default::default() };
    let backend = fake.scenario_url(&slow);
    let own = [("AWS_LAMBDA_LOG_GROUP_NAME", log_group.as_str())];
    let function = Function::start(&config(table, log_group, &backend, None), &own, Some(Duration::from_secs(4))).await;

    let started = Instant::now();
    let response = function.chat(true).send().await.unwrap();
    assert_eq!(response.status(), 200, "{}", function.logs());
    let request_id = response.headers()["flexway-request-id"].to_str().unwrap().to_owned();
    let events = sse_events(response, started).await;
    let (at, last) = events.last().unwrap_or_else(|| panic!("no events\n{}", function.logs()));
    assert!(last.contains(r#""code":"deadline""#), "{events:?}\n{}", function.logs());
    assert!(!events.iter().any(|(_, e)| e == "[DONE]"), "a stream cut by the deadline never ends clean");
    assert!(*at < Duration::from_secs(4), "ended at {at:?}, not before the deadline");
    assert!(events.len() > 3, "content was relayed before the cut: {events:?}");

    let record = function.printed_record(&request_id).await;
    assert_eq!((record.status, record.error_code.map(|c| c.as_str())), (200, Some("deadline")), "{record:?}");
    assert!(record.completion_tokens > 0, "settled on what was relayed: {record:?}");
    let used = resources.used_once_leases_are_swept().await;
    assert_eq!(used, [record.prompt_tokens + record.completion_tokens, record.cost_micro_eur], "{record:?}");
}

/// An audit group the function cannot write (here: it does not exist): the call is
/// answered, and its record goes to the function's log in full, at error (a function
/// that writes another group than its own log's, with PutLogEvents).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_audit_group_refuses_is_kept_in_full_in_the_functions_log() {
    let resources = Resources::new().await;
    let Resources { table, .. } = &resources;
    let fake = FakeModel::start().await.unwrap();
    let missing = emulator::unique("/flexway/no-such-audit");
    let function = Function::start(&config(table, &missing, &fake.url(), None), &[], None).await;

    let response = function.chat(false).send().await.unwrap();
    assert_eq!(response.status(), 200, "{}", function.logs());
    let request_id = response.headers()["flexway-request-id"].to_str().unwrap().to_owned();
    let line = function.output_line("audit record not written", |line| line.contains("audit record not written")).await;
    let logged: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert!(logged["fields"]["message"].as_str().unwrap().starts_with("audit record not written"), "{line}");
    let record: flexway::audit::AuditRecord =
        serde_json::from_str(logged["fields"]["audit_record"].as_str().unwrap()).unwrap();
    assert_eq!(record.request_id, request_id);
    assert_eq!(record.status, 200);
    assert_eq!(
        resources.used_once_leases_are_swept().await,
        [record.prompt_tokens + record.completion_tokens, record.cost_micro_eur]
    );
}

/// The same function behind API Gateway (the template's `GatewayApi`: a REST API whose
/// `{proxy+}` method invokes it with InvokeWithResponseStream, `ResponseTransferMode:
/// STREAM`): a REST proxy event for `/v1/chat/completions` on stage `live`, invoked on
/// the emulator's invoke path. The function answers in streaming mode, the stage kept
/// out of the path (`AWS_LAMBDA_HTTP_IGNORE_STAGE_IN_PATH`, set by the template: without
/// it the router sees `/live/v1/chat/completions`, a 404), and the events arrive apart:
/// streamed, not buffered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_a_chat_completion_through_an_api_gateway_rest_event() {
    let resources = Resources::new().await;
    let fake = FakeModel::start().await.unwrap();
    let backend = fake.scenario_url(&Scenario { chunk_delay_ms: Some(150), ..Default::default() });
    let config = config(&resources.table, &resources.log_group, &backend, None);
    let function = Function::start(&config, &[("AWS_LAMBDA_HTTP_IGNORE_STAGE_IN_PATH", "true")], None).await;
    let body = serde_json::json!({
        "model": "chat-default",
        "stream": true,
        "messages": [{"role": "user", "content": "hello there"}]
    });
    let host = "abc123.execute-api.us-east-1.amazonaws.com";
    let headers = serde_json::json!({
        "authorization": format!("Bearer {KEY}"),
        "content-type": "application/json",
        "host": host,
    });
    let multi: serde_json::Map<String, serde_json::Value> =
        headers.as_object().unwrap().iter().map(|(k, v)| (k.clone(), serde_json::json!([v]))).collect();
    let event = serde_json::json!({
        "resource": "/{proxy+}",
        "path": "/v1/chat/completions",
        "httpMethod": "POST",
        "headers": headers,
        "multiValueHeaders": multi,
        "queryStringParameters": null,
        "multiValueQueryStringParameters": null,
        "pathParameters": {"proxy": "v1/chat/completions"},
        "stageVariables": null,
        "requestContext": {
            "resourcePath": "/{proxy+}",
            "httpMethod": "POST",
            "path": "/live/v1/chat/completions",
            "stage": "live",
            "requestId": "c6af9ac6-7b61-11e6-9a41-93e8deadbeef",
            "accountId": "123456789012",
            "apiId": "abc123",
            "domainName": host,
            "protocol": "HTTP/1.1",
            "requestTimeEpoch": 1_764_000_000_000_u64,
            "identity": {"sourceIp": "127.0.0.1", "userAgent": "openai-python"},
        },
        "body": body.to_string(),
        "isBase64Encoded": false,
    });
    // The emulator reads the function's streamed answer as API Gateway does (the
    // status and headers as JSON, eight NUL bytes, then the body as written) and
    // passes it on as an HTTP response, piece by piece.
    let invoke = function.base.replace("/lambda-url/_", "/2015-03-31/functions/_/invocations");
    let started = Instant::now();
    let response = function.client.post(&invoke).json(&event).send().await.unwrap();
    assert_eq!(response.status(), 200, "the stage kept out of the path: {}", function.logs());
    let headers = response.headers();
    assert_eq!(headers["lambda-runtime-function-response-mode"], "streaming", "{headers:?}");
    assert_eq!(headers["content-type"], "text/event-stream", "{headers:?}");
    assert_eq!(headers["flexway-backend"], "main", "{headers:?}");
    assert!(headers.contains_key("flexway-request-id"), "{headers:?}");
    let events = sse_events(response, started).await;
    assert_eq!(events.last().map(|(_, d)| d.as_str()), Some("[DONE]"), "{events:?} {}", function.logs());
    let content: String = events
        .iter()
        .filter(|(_, d)| d.as_str() != "[DONE]")
        .filter_map(|(_, d)| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect();
    assert!(content.contains("hello there"), "relayed content: {content}");
    let spread = events.last().unwrap().0 - events.first().unwrap().0;
    assert!(spread >= Duration::from_millis(450), "events arrived together ({spread:?}): buffered\n{events:?}");
}

/// REST operations (SPEC §10) in the serverless shape: the function serves a `kind:
/// http` backend's mount through the function URL and through an API Gateway REST
/// event, metered on the emulated ledger, and refuses what its contract does not
/// declare with a problem document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_rest_operations_through_the_function_url_and_api_gateway() {
    let resources = Resources::new().await;
    let router = axum::Router::new()
        .route("/documents/latest", axum::routing::get(|| async { r#"{"latest":true}"# }))
        .route("/documents", axum::routing::post(|body: String| async move { format!("{:<16}", body.len()) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let dir = tempfile::tempdir().unwrap();
    let contract = dir.path().join("ocr.yaml");
    std::fs::write(
        &contract,
        "openapi: 3.0.3\ninfo: {title: OCR, version: '1'}\npaths:\n  /documents/latest:\n    get:\n      \
         x-flexway-ai: {metering: per_call, price_per_thousand_eur: '0.5', feature: ocr}\n      responses: \
         {'200': {description: ok}}\n  /documents:\n    post:\n      x-flexway-ai: {metering: per_byte, \
         price_per_thousand_eur: '0.001', feature: ocr}\n      responses: {'200': {description: ok}}\n",
    )
    .unwrap();
    let config = format!(
        "version: 1\nstore: {{kind: dynamodb, table: {}}}\naudit: {{sink: cloudwatch, log_group: \"{}\", log_stream: rest}}\n\
         tenants:\n  acme:\n    keys:\n      - sha256: {}\n    budgets: {{eur_per_month: 5}}\nai:\n  backends:\n    \
         ocr: {{kind: http, url: \"{upstream}\", contract: \"{}\", mount: /apis/ocr}}\n",
        resources.table,
        resources.log_group,
        hex::encode(Sha256::digest(KEY.as_bytes())),
        contract.display()
    );
    let function = Function::start(&config, &[("AWS_LAMBDA_HTTP_IGNORE_STAGE_IN_PATH", "true")], None).await;

    // The function URL: a per-call operation, then one the contract does not declare.
    let latest = function.client.get(format!("{}/apis/ocr/documents/latest", function.base)).bearer_auth(KEY);
    let latest = latest.send().await.unwrap();
    assert_eq!(latest.status(), 200, "{}", function.logs());
    assert_eq!(latest.headers()["flexway-backend"], "ocr");
    assert_eq!(latest.text().await.unwrap(), r#"{"latest":true}"#);
    let unknown = function.client.get(format!("{}/apis/ocr/admin", function.base)).bearer_auth(KEY);
    let unknown = unknown.send().await.unwrap();
    assert_eq!(unknown.status(), 404);
    assert_eq!(unknown.headers()["content-type"], "application/problem+json");

    // API Gateway REST: a per-byte upload of 1,000 bytes, answered with 16.
    let host = "abc123.execute-api.us-east-1.amazonaws.com";
    let headers =
        serde_json::json!({"authorization": format!("Bearer {KEY}"), "content-type": "text/plain", "host": host});
    let multi: serde_json::Map<String, serde_json::Value> =
        headers.as_object().unwrap().iter().map(|(k, v)| (k.clone(), serde_json::json!([v]))).collect();
    let event = serde_json::json!({
        "resource": "/{proxy+}",
        "path": "/apis/ocr/documents",
        "httpMethod": "POST",
        "headers": headers,
        "multiValueHeaders": multi,
        "queryStringParameters": null,
        "multiValueQueryStringParameters": null,
        "pathParameters": {"proxy": "apis/ocr/documents"},
        "stageVariables": null,
        "requestContext": {
            "resourcePath": "/{proxy+}",
            "httpMethod": "POST",
            "path": "/live/apis/ocr/documents",
            "stage": "live",
            "requestId": "c6af9ac6-7b61-11e6-9a41-93e8deadbee1",
            "accountId": "123456789012",
            "apiId": "abc123",
            "domainName": host,
            "protocol": "HTTP/1.1",
            "requestTimeEpoch": 1_764_000_000_000_u64,
            "identity": {"sourceIp": "127.0.0.1", "userAgent": "curl"},
        },
        "body": "d".repeat(1000),
        "isBase64Encoded": false,
    });
    let invoke = function.base.replace("/lambda-url/_", "/2015-03-31/functions/_/invocations");
    let uploaded = function.client.post(&invoke).json(&event).send().await.unwrap();
    assert_eq!(uploaded.status(), 200, "{}", function.logs());
    assert_eq!(uploaded.text().await.unwrap().trim(), "1000");

    // 500 µ€ for the call, 1,016 µ€ for the bytes; nothing for the refusal.
    let used = resources.used_once_leases_are_swept().await;
    assert_eq!(used[1], 1_516, "{}", function.logs());
}

/// SPEC §11 for a REST operation: an answer still streaming near the invocation's
/// deadline is ended by the gateway before the platform would cut it, charged on the
/// bytes that passed and recorded with `deadline`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rest_answer_open_at_the_invocations_deadline_is_ended_settled_and_recorded() {
    let resources = Resources::new().await;
    // 40 chunks of 100 bytes, 250 ms apart: 10 s, far past a 4 s deadline.
    let slow = || async {
        let chunks = futures_util::stream::iter(0..40).then(|_| async {
            tokio::time::sleep(Duration::from_millis(250)).await;
            Ok::<_, std::io::Error>(vec![b's'; 100])
        });
        axum::body::Body::from_stream(chunks)
    };
    let router = axum::Router::new().route("/pages", axum::routing::get(slow));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let dir = tempfile::tempdir().unwrap();
    let contract = dir.path().join("pages.yaml");
    std::fs::write(
        &contract,
        "openapi: 3.1.0\ninfo: {title: pages, version: '1'}\npaths:\n  /pages:\n    get:\n      x-flexway-ai: \
         {metering: per_byte, price_per_thousand_eur: '0.001', feature: pages}\n",
    )
    .unwrap();
    let config = format!(
        "version: 1\nstore: {{kind: dynamodb, table: {}}}\naudit: {{sink: cloudwatch, log_group: \"{}\", log_stream: rest}}\n\
         tenants:\n  acme:\n    keys:\n      - sha256: {}\n    budgets: {{eur_per_month: 5}}\nai:\n  backends:\n    \
         pages: {{kind: http, url: \"{upstream}\", contract: \"{}\", mount: /apis/pages}}\n",
        resources.table,
        resources.log_group,
        hex::encode(Sha256::digest(KEY.as_bytes())),
        contract.display()
    );
    let function = Function::start(&config, &[], Some(Duration::from_secs(4))).await;
    let started = Instant::now();
    let response = function.client.get(format!("{}/apis/pages/pages", function.base)).bearer_auth(KEY);
    let response = response.send().await.unwrap();
    assert_eq!(response.status(), 200, "{}", function.logs());
    let mut body = response.bytes_stream();
    let mut relayed = 0u64;
    while let Some(Ok(chunk)) = body.next().await {
        relayed += chunk.len() as u64;
    }
    let ended = started.elapsed();
    assert!(ended < Duration::from_secs(4), "ended at {ended:?}, not before the deadline");
    assert!(relayed > 0 && relayed < 4_000, "{relayed} bytes read");

    let mut records = Vec::new();
    for _ in 0..50 {
        let read = flexway_aws::read_audit_log_group(&resources.logs, &resources.log_group, None, None, None).await;
        records = read.unwrap().records;
        if !records.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let record = records.first().unwrap_or_else(|| panic!("no record\n{}", function.logs()));
    assert_eq!(record.error_code.map(|c| c.as_str()), Some("deadline"), "{record:?}");
    // Per byte at 1 µ€ a byte: the whole chunks that passed (the emulator appends the
    // function's error to what the client reads), as the ledger holds them.
    let cost = record.cost_micro_eur;
    assert!(cost > 0 && cost % 100 == 0 && cost <= relayed, "{cost} µ€ for {relayed} bytes read: {record:?}");
    assert_eq!(resources.used_once_leases_are_swept().await[1], cost);
}
