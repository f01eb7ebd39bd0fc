//! The functions' roles against what their code does. Every AWS request each Lambda
//! function's code path sends, over the flows the serverless tests run, is recorded at
//! the SDK's HTTP connector (`flexway_testkit::iam`) and checked, action and resource,
//! against its role in the template as AWS receives it (`infra/transform`: the SAM
//! translator's output), resolved for this run's stack. And the converse: every grant of
//! a role is used by some flow, but for what Lambda itself does with the role
//! ([`LAMBDA_USES`], each with its reason), and no resource is `*` beyond X-Ray.
//!
//! One stack name per run, `S`: the resources are made on the emulator with the names
//! the template gives them (`S-ledger`, `S-cache`, `/S/audit`), and the secrets the bundled config
//! references are the stack's parameters (one in the `NAME-??????` form the docs
//! recommend). The flows call what the binaries call (`build_adapters`,
//! `Gateway::new`, `http::api`, `dynamodb_store`, `reconcile_days`), with the names the
//! template puts in each function's environment.
//!
//! The gateway runs as the stack runs it: its own log group is the audit group, which
//! it reads in `AWS_LAMBDA_LOG_GROUP_NAME` at init. A test cannot set a variable in its
//! own process (`set_var` is unsafe), so the gateway's flows run in a child process,
//! this test run again with the environment Lambda gives the function and [`CHILD`]
//! naming the directory of its config and of what it recorded.
#![cfg(test)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use aws_config::SdkConfig;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use flexway::budget::period::unix_now;
use flexway::budget::{
    BudgetStore, CounterKey, IntentOutcome, LeasePolicy, LeasedBudgetStore, Line, Period, ReserveOutcome,
    ReserveRequest, SettleOutcome, Unit,
};
use flexway::config::{ProcessEnv, Secrets, StoreConfig};
use flexway_aws::{AwsSecretSource, DynamoDbBudgetStore, DynamoDbCacheStore};
use flexway_testkit::iam::{ACCOUNT, Authorization, Recorder};
use flexway_testkit::{FakeModel, emulator, sha};
use serde_json::{Value, json};
use tower::ServiceExt as _;

/// This test's name, as the child process is asked to run it.
const TEST: &str = "each_role_grants_what_its_function_does_and_nothing_more";
/// Set in the child process only: the directory of the bundled config and of what
/// the gateway's flows recorded there.
const CHILD: &str = "FLEXWAY_IAM_GATEWAY_DIR";
const RECORDED: &str = "recorded.json";
const REGION: &str = "us-east-1";

const KEY: &str = "sk-iam-acme";
/// A tenant of a 1,000-token day, its counter brought near the cap by the flow.
const CAPPED: &str = "capped";
const CAPPED_KEY: &str = "sk-iam-capped";
const CAP: u64 = 1000;
const BACKEND_KEY: &str = "sk-backend-from-secrets-manager";
const SPARE_KEY: &str = "sk-spare-from-ssm";
const ADMIN_KEY: &str = "sk-admin-usage-api";

/// The functions of the stack, each checked against its own role.
const FUNCTIONS: [&str; 3] = ["GatewayFunction", "SweeperFunction", "ReconcileFunction"];

/// What Lambda itself does with a function's role, which no code path of ours shows:
/// a role must grant these, and they are the only grants no flow has to use.
const LAMBDA_USES: [(&str, Scope, &str); 4] = [
    (
        "logs:CreateLogStream",
        Scope::OwnLogGroup,
        "Lambda creates the streams of the function's own log group (its LoggingConfig) with the function's role",
    ),
    (
        "logs:PutLogEvents",
        Scope::OwnLogGroup,
        "Lambda delivers what the function prints (stdout, stderr) to its own log group with the function's role",
    ),
    (
        "xray:PutTraceSegments",
        Scope::Traced,
        "Tracing: Active: Lambda sends the function's trace segments with its role (the code has no X-Ray client); \
         X-Ray has no resource-level permissions, hence `*`",
    ),
    ("xray:PutTelemetryRecords", Scope::Traced, "Tracing: Active, as above: the X-Ray telemetry Lambda sends"),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// On the function's own log group (the `Arn` of its LoggingConfig group).
    OwnLogGroup,
    /// On `*`, when the function's tracing is active.
    Traced,
}

/// The AWS requests of one flow of one function.
#[derive(Debug)]
struct Flow {
    function: &'static str,
    name: String,
    calls: Vec<Authorization>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_role_grants_what_its_function_does_and_nothing_more() {
    if let Some(dir) = std::env::var_os(CHILD) {
        gateway_as_lambda_runs_it(Path::new(&dir)).await;
        return;
    }
    let plain = emulator::sdk().await;
    let name = emulator::unique("iam");
    let dir = std::env::temp_dir().join(&name);
    std::fs::create_dir_all(&dir).unwrap();

    let backend_secret = secret(&plain, &format!("{name}-backend"), BACKEND_KEY).await;
    let admin_secret = secret(&plain, &format!("{name}-openai-admin"), ADMIN_KEY).await;
    let parameter = parameter(&plain, &format!("/{name}/spare"), SPARE_KEY).await;
    // As the docs recommend: the secret's name, `??????` for the suffix Secrets Manager adds.
    let (secret_name, _suffix) = backend_secret.rsplit_once('-').unwrap();
    let stack = Stack::transformed(
        &name,
        &[
            ("SecretsManagerArns", format!("{secret_name}-??????")),
            ("SsmParameterArns", parameter.clone()),
            ("UsageApiSecretArns", admin_secret.clone()),
            ("CacheStore", "dynamodb".to_owned()),
        ],
    );
    let table = stack.physical_name("LedgerTable");
    let audit = stack.physical_name("AuditLogGroup");
    assert_eq!([table.as_str(), audit.as_str()], [format!("{name}-ledger"), format!("/{name}/audit")]);
    DynamoDbBudgetStore::create_table(&aws_sdk_dynamodb::Client::new(&plain), &table).await.unwrap();
    let cache_table = stack.physical_name("CacheTable");
    assert_eq!(cache_table, format!("{name}-cache"));
    DynamoDbCacheStore::create_table(&aws_sdk_dynamodb::Client::new(&plain), &cache_table).await.unwrap();
    aws_sdk_cloudwatchlogs::Client::new(&plain).create_log_group().log_group_name(&audit).send().await.unwrap();

    let model = FakeModel::start().await.unwrap();
    let usage_api = fake_usage_api().await;
    let config = dir.join("flexway.yaml");
    let secrets = Referenced { backend: &backend_secret, spare: &parameter, admin: &admin_secret };
    std::fs::write(&config, bundled_config(&table, &audit, &model.url(), &usage_api, &secrets)).unwrap();

    let mut flows = gateway_in_lambdas_environment(&stack, &dir).await;
    let bearer = format!("Bearer {BACKEND_KEY}");
    let sent = model.requests().iter().filter(|r| r.header("authorization") == Some(bearer.as_str())).count();
    assert!(sent >= 2, "the backend was called with the key resolved from Secrets Manager: {sent} calls");
    flows.push(gateway_writing_the_audit(&plain, &config).await);
    flows.push(gateway_caching(&plain, &cache_table).await);
    flows.push(sweeper(&plain, &stack).await);
    flows.push(reconcile(&plain, &stack, &config).await);
    let _ = std::fs::remove_dir_all(&dir);

    let findings = stack.check(&flows);
    assert!(
        findings.is_empty(),
        "the roles of infra/template.yaml and the code disagree:\n- {}",
        findings.join("\n- ")
    );
}

// ----- the flows -------------------------------------------------------------------

/// The secrets the bundled config references, by ARN.
struct Referenced<'a> {
    backend: &'a str,
    spare: &'a str,
    admin: &'a str,
}

/// The config bundled with the functions: the stack's table and audit group; `acme`
/// with room, `capped` with a 1,000-token day; the backend `main` keyed from Secrets
/// Manager (with its provider's usage API, keyed with an admin key the gateway never
/// reads), `spare` from SSM.
fn bundled_config(table: &str, audit: &str, model: &str, usage_api: &str, secrets: &Referenced) -> String {
    format!(
        r#"version: 1
store: {{kind: dynamodb, table: {table}}}
audit: {{sink: cloudwatch, log_group: "{audit}"}}
tenants:
  acme:
    keys: [{{sha256: {acme}}}]
    budgets: {{tokens_per_day: 1000000}}
  {CAPPED}:
    keys: [{{sha256: {capped}}}]
    budgets: {{tokens_per_day: {CAP}}}
ai:
  default_backend: main
  budget: {{default_max_tokens: 200, min_completion_tokens: 100}}
  backends:
    main:
      kind: openai
      url: "{model}"
      auth: {{type: bearer, secret: "{backend}"}}
      fallback: [spare]
      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}
      usage_api: {{kind: openai, secret: "{admin}", url: "{usage_api}"}}
    spare:
      url: "{model}"
      auth: {{type: bearer, secret: "{spare}"}}
      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}
"#,
        acme = sha(KEY),
        capped = sha(CAPPED_KEY),
        backend = secrets.backend,
        spare = secrets.spare,
        admin = secrets.admin,
    )
}

/// Runs the gateway's flows in a child process with the environment the template gives
/// the function and Lambda adds (its log group, from its LoggingConfig): what it
/// recorded.
async fn gateway_in_lambdas_environment(stack: &Stack, dir: &Path) -> Vec<Flow> {
    let mut env = stack.environment("GatewayFunction");
    env.insert("FLEXWAY_CONFIG".into(), dir.join("flexway.yaml").display().to_string());
    env.insert("AWS_LAMBDA_LOG_GROUP_NAME".into(), stack.own_log_group("GatewayFunction"));
    env.insert("AWS_LAMBDA_LOG_STREAM_NAME".into(), "2026/01/01/[$LATEST]0123456789abcdef".into());
    env.insert(CHILD.into(), dir.display().to_string());
    let exe = std::env::current_exe().unwrap();
    let run = move || Command::new(exe).args([TEST, "--exact", "--nocapture"]).envs(env).output();
    let output = tokio::task::spawn_blocking(run).await.unwrap().unwrap();
    assert!(
        output.status.success(),
        "the gateway's flows, in a process with Lambda's environment, failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let recorded: Vec<(String, Vec<Authorization>)> =
        serde_json::from_slice(&std::fs::read(dir.join(RECORDED)).unwrap()).unwrap();
    recorded.into_iter().map(|(name, calls)| Flow { function: "GatewayFunction", name, calls }).collect()
}

/// The child process: the gateway as `functions/gateway/src/main.rs` builds it, with
/// this function's log group its audit group (records printed, no PutLogEvents), and
/// what it sends to AWS in each flow written to `dir`.
async fn gateway_as_lambda_runs_it(dir: &Path) {
    let plain = emulator::sdk().await;
    let (sdk, recorder) = Recorder::install(&plain);
    let mut flows: Vec<(String, Vec<Authorization>)> = Vec::new();

    let path = PathBuf::from(std::env::var("FLEXWAY_CONFIG").unwrap());
    let loaded = flexway::config::load_file(&path, &ProcessEnv).unwrap_or_else(|e| panic!("{e}"));
    let adapters = flexway_aws::build_adapters(&loaded.config, &sdk).await.unwrap();
    let secrets = Arc::new(AwsSecretSource::new(sdk.clone()));
    let gateway = Arc::new(flexway::Gateway::new(loaded.config, secrets, adapters).await.unwrap());
    let app = flexway::http::api(gateway.clone());
    flows.push(("init: the ledger warmed, the secrets resolved".into(), recorder.take()));

    let (status, body) = chat(&app, KEY, false).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    flows.push(("a call".into(), recorder.take()));
    let (status, body) = chat(&app, KEY, true).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("data: [DONE]"), "{body}");
    flows.push(("a streamed call".into(), recorder.take()));

    // Near the cap: earlier calls of the day used 890 tokens, and another environment
    // took a lease of 100 (a call's worth), served 40 and froze. Its clock is a minute
    // behind, so its lease is expired as soon as taken, as it would be seconds after
    // the freeze.
    let StoreConfig::DynamoDb { table } = &gateway.config.store else { panic!("{:?}", gateway.config.store) };
    let ledger = DynamoDbBudgetStore::new(aws_sdk_dynamodb::Client::new(&plain), table);
    let now = unix_now();
    let day = CounterKey::new(CAPPED, None, Unit::Tokens, Period::Day, now);
    let line = |amount| Line { key: day.clone(), amount, limit: Some(CAP) };
    let earlier =
        ReserveRequest { request_id: emulator::unique("earlier"), lines: vec![line(890)], expires_at: now + 60 };
    assert_eq!(ledger.reserve(&earlier).await.unwrap(), ReserveOutcome::Reserved);
    ledger.settle(&earlier.reservation(), &[(day.clone(), 890)]).await.unwrap();
    let other = DynamoDbBudgetStore::new(aws_sdk_dynamodb::Client::new(&sdk), table);
    let policy = LeasePolicy { intent_every: Duration::ZERO, ..LeasePolicy::DEFAULT };
    let frozen = LeasedBudgetStore::new(Arc::new(other), policy).with_clock(|| unix_now() - 60);
    let call = ReserveRequest { request_id: emulator::unique("frozen"), lines: vec![line(100)], expires_at: now + 60 };
    assert_eq!(frozen.reserve(&call).await.unwrap(), ReserveOutcome::Reserved);
    assert_eq!(frozen.settle(&call.reservation(), &[(day.clone(), 40)]).await.unwrap(), SettleOutcome::Settled);
    drop(frozen);
    assert_eq!(ledger.used(std::slice::from_ref(&day)).await.unwrap(), [990], "890 used, 100 leased");
    flows.push(("another environment's lease, left as it froze".into(), recorder.take()));

    // The call cannot fit (200 tokens asked, 100 at least) and is refused; on the way
    // the gateway reclaims the frozen lease: its 40 tokens charged, the 60 it did not
    // use given back, still too few for the call.
    let (status, body) = chat(&app, CAPPED_KEY, false).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let refused = recorder.take();
    let index = format!(":table/{table}/index/{}", flexway_aws::EXPIRY_INDEX);
    assert!(
        refused.iter().any(|a| a.operation == "DynamoDB.Query" && a.resource.ends_with(&index)),
        "the refused call reclaims expired leases with a sweep, which Queries the expiry index: {refused:#?}"
    );
    assert_eq!(ledger.used(&[day]).await.unwrap(), [930], "the frozen lease reclaimed: 40 charged, 60 given back");
    flows.push(("a call refused near its cap, which reclaims the frozen lease".into(), refused));

    // `secrets.refresh`: what the router starts beside the first request that finds it due.
    gateway.refresh_secrets().await;
    let refreshed = recorder.take();
    for operation in ["SecretsManager.GetSecretValue", "SSM.GetParameter"] {
        assert!(refreshed.iter().any(|a| a.operation == operation), "{operation} at the refresh: {refreshed:#?}");
    }
    flows.push(("secrets.refresh".into(), refreshed));

    std::fs::write(dir.join(RECORDED), serde_json::to_vec(&flows).unwrap()).unwrap();
}

/// A gateway whose own log is another group (deployed with `cargo lambda deploy` on the
/// stack's role, without its logging step): it writes the audit group with
/// PutLogEvents.
async fn gateway_writing_the_audit(plain: &SdkConfig, config: &Path) -> Flow {
    let (sdk, recorder) = Recorder::install(plain);
    let loaded = flexway::config::load_file(config, &ProcessEnv).unwrap_or_else(|e| panic!("{e}"));
    let adapters = flexway_aws::build_adapters(&loaded.config, &sdk).await.unwrap();
    let secrets = Arc::new(AwsSecretSource::new(sdk.clone()));
    let gateway = Arc::new(flexway::Gateway::new(loaded.config, secrets, adapters).await.unwrap());
    let (status, body) = chat(&flexway::http::api(gateway), KEY, false).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for _ in 0..100 {
        if recorder.peek().iter().any(|a| a.operation == "Logs.PutLogEvents") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let calls = recorder.take();
    assert!(calls.iter().any(|a| a.operation == "Logs.PutLogEvents"), "the record written: {calls:#?}");
    Flow { function: "GatewayFunction", name: "init and a call, the audit written with PutLogEvents".into(), calls }
}

/// The response cache's DynamoDB store on the stack's cache table, as the gateway
/// calls it (a lookup before a call, a store after it; nothing at init): a miss, an
/// entry stored, a hit, an entry replaced, and a store at the tenant's limit, which
/// evicts the oldest.
async fn gateway_caching(plain: &SdkConfig, table: &str) -> Flow {
    use flexway::cache::{CacheStore, Entry, Lookup, Partition, Probe, Sealed};

    let (sdk, recorder) = Recorder::install(plain);
    let store = DynamoDbCacheStore::new(aws_sdk_dynamodb::Client::new(&sdk), table);
    let partition = Partition::new("acme", None, "faq", "gpt-test", &[0; 32]);
    let (first, second) =
        (Probe { exact: [1; 32], vector: None, guard: 0 }, Probe { exact: [2; 32], vector: None, guard: 0 });
    let now = unix_now();
    let lookup = |probe| Lookup { partition: &partition, probe, threshold: 0.95, stored_since: 0, now };
    let entry = |probe, stored_at| Entry {
        partition: &partition,
        probe,
        sealed: Sealed(vec![7; 40]),
        stored_at,
        expires_at: now + 3600,
        max_entries_per_tenant: 1,
    };
    assert_eq!(store.lookup(&lookup(&first)).await.unwrap(), None);
    store.store(entry(&first, now - 10)).await.unwrap();
    assert!(store.lookup(&lookup(&first)).await.unwrap().is_some());
    store.store(entry(&first, now - 5)).await.unwrap();
    store.store(entry(&second, now)).await.unwrap();
    assert_eq!(store.lookup(&lookup(&first)).await.unwrap(), None, "evicted past max_entries_per_tenant");
    let name = "the response cache: a miss, a store, a hit, a replacement, an eviction".into();
    Flow { function: "GatewayFunction", name, calls: recorder.take() }
}

/// The sweeper as `functions/sweeper/src/main.rs` runs, on the table its environment
/// names: a call that vanished is refunded, one whose settlement could not be written
/// is charged on its intent.
async fn sweeper(plain: &SdkConfig, stack: &Stack) -> Flow {
    let table = stack.environment("SweeperFunction").remove("FLEXWAY_TABLE").unwrap();
    let ledger = DynamoDbBudgetStore::new(aws_sdk_dynamodb::Client::new(plain), &table);
    let now = unix_now();
    let key = CounterKey::new("acme", None, Unit::Tokens, Period::Day, now);
    let (vanished, unwritten) = (emulator::unique("vanished"), emulator::unique("unwritten"));
    for id in [&vanished, &unwritten] {
        let lines = vec![Line { key: key.clone(), amount: 10, limit: None }];
        let expired = ReserveRequest { request_id: id.clone(), lines, expires_at: now - 1 };
        assert_eq!(ledger.reserve(&expired).await.unwrap(), ReserveOutcome::Reserved);
    }
    assert_eq!(ledger.record_intent(&unwritten, &[(key, 7)]).await.unwrap(), IntentOutcome::Recorded);

    let (sdk, recorder) = Recorder::install(plain);
    let store = flexway_aws::dynamodb_store(&sdk, &table).await.unwrap();
    let (swept, _oldest) = store.sweep_reporting_oldest(unix_now()).await.unwrap();
    assert!(swept.refunded >= 1 && swept.charged >= 1, "{swept:?}");
    let name = "a scheduled sweep: a vanished call refunded, an unwritten settlement charged".into();
    Flow { function: "SweeperFunction", name, calls: recorder.take() }
}

/// The reconcile function as `functions/reconcile/src/main.rs` runs, with its
/// environment's audit group and days: the bundled config (forms only), the usage API's
/// admin key resolved from Secrets Manager (the fake refuses any other), the audit read.
async fn reconcile(plain: &SdkConfig, stack: &Stack, config: &Path) -> Flow {
    let mut env = stack.environment("ReconcileFunction");
    let group = env.remove("FLEXWAY_AUDIT_LOG_GROUP").unwrap();
    let days: i32 = env.remove("FLEXWAY_RECONCILE_DAYS").unwrap().parse().unwrap();
    let config = flexway::config::load_file_with(config, &ProcessEnv, Secrets::Check).unwrap().config;
    let (sdk, recorder) = Recorder::install(plain);
    let today = flexway::reconcile::today().parse().unwrap();
    flexway_aws::reconcile_days(&config, &sdk, &group, days, today).await.unwrap_or_else(|e| panic!("{e}"));
    let name = "a daily run: the admin key, the audit read back".into();
    Flow { function: "ReconcileFunction", name, calls: recorder.take() }
}

/// A chat call through the serverless router as a tower service: status and body.
async fn chat(app: &axum::Router, key: &str, stream: bool) -> (StatusCode, String) {
    let body = json!({"model": "gpt-4o", "stream": stream, "messages": [{"role": "user", "content": "hello there"}]});
    let request = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// A provider's usage API (OpenAI's paths) with no usage, for [`ADMIN_KEY`] only.
async fn fake_usage_api() -> String {
    async fn empty(headers: axum::http::HeaderMap) -> Result<axum::Json<Value>, StatusCode> {
        let bearer = format!("Bearer {ADMIN_KEY}");
        if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(bearer.as_str()) {
            return Err(StatusCode::UNAUTHORIZED);
        }
        Ok(axum::Json(json!({"data": [], "has_more": false, "next_page": null})))
    }
    let app = axum::Router::new()
        .route("/v1/organization/usage/completions", axum::routing::get(empty))
        .route("/v1/organization/usage/embeddings", axum::routing::get(empty));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// A new Secrets Manager secret: its ARN.
async fn secret(sdk: &SdkConfig, name: &str, value: &str) -> String {
    let client = aws_sdk_secretsmanager::Client::new(sdk);
    let created = client.create_secret().name(name).secret_string(value).send().await.unwrap();
    created.arn().unwrap().to_owned()
}

/// A new SSM SecureString parameter: its ARN.
async fn parameter(sdk: &SdkConfig, name: &str, value: &str) -> String {
    let client = aws_sdk_ssm::Client::new(sdk);
    let put = client.put_parameter().name(name).value(value);
    put.r#type(aws_sdk_ssm::types::ParameterType::SecureString).send().await.unwrap();
    let got = client.get_parameter().name(name).send().await.unwrap();
    got.parameter().and_then(|p| p.arn()).unwrap().to_owned()
}

// ----- the stack as AWS receives it -------------------------------------------------

/// The transformed template of one stack, with the parameters it was given: its
/// intrinsic functions resolved as CloudFormation would for this stack.
struct Stack {
    name: String,
    template: Value,
    parameters: BTreeMap<String, String>,
}

impl Stack {
    /// `infra/transform` with the stack's parameters (the testkit's: never skipped,
    /// it fails saying how to install the SAM translator).
    fn transformed(name: &str, parameters: &[(&str, String)]) -> Stack {
        let args: Vec<String> = parameters.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let template = flexway_testkit::template::transformed(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let parameters = parameters.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect();
        Stack { name: name.to_owned(), template, parameters }
    }

    fn resource(&self, logical: &str) -> &Value {
        let resource = &self.template["Resources"][logical];
        assert!(resource.is_object(), "the transformed template has no resource {logical}");
        resource
    }

    /// What `Ref` gives for a resource: its name, as the template sets it or as
    /// CloudFormation makes one up (`STACK-Logical-SUFFIX`).
    fn physical_name(&self, logical: &str) -> String {
        let resource = self.resource(logical);
        let property = match resource["Type"].as_str() {
            Some("AWS::DynamoDB::Table") => "TableName",
            Some("AWS::Logs::LogGroup") => "LogGroupName",
            Some("AWS::IAM::Role") => "RoleName",
            Some("AWS::Lambda::Function") => "FunctionName",
            _ => "",
        };
        match resource["Properties"].get(property) {
            Some(name) => text(&self.resolve(name)),
            None => format!("{}-{logical}-GENERATED0", self.name),
        }
    }

    /// `Fn::GetAtt`.
    fn attribute(&self, logical: &str, attribute: &str) -> String {
        let name = self.physical_name(logical);
        match (self.resource(logical)["Type"].as_str().unwrap_or(""), attribute) {
            ("AWS::DynamoDB::Table", "Arn") => format!("arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/{name}"),
            // What CloudFormation gives a log group's Arn: its streams included.
            ("AWS::Logs::LogGroup", "Arn") => format!("arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{name}:*"),
            ("AWS::IAM::Role", "Arn") => format!("arn:aws:iam::{ACCOUNT}:role/{name}"),
            ("AWS::Lambda::Function", "Arn") => format!("arn:aws:lambda:{REGION}:{ACCOUNT}:function:{name}"),
            (kind, _) => panic!("Fn::GetAtt {logical}.{attribute} ({kind}) is not resolved by this test"),
        }
    }

    /// `Ref`: a pseudo parameter, a parameter (given, else its default; a list split
    /// on commas), or a resource's name. `None` for `AWS::NoValue`.
    fn reference(&self, name: &str) -> Option<Value> {
        let pseudo = match name {
            "AWS::NoValue" => return None,
            "AWS::StackName" => Some(self.name.as_str()),
            "AWS::Region" => Some(REGION),
            "AWS::AccountId" => Some(ACCOUNT),
            "AWS::Partition" => Some("aws"),
            "AWS::URLSuffix" => Some("amazonaws.com"),
            _ => None,
        };
        if let Some(value) = pseudo {
            return Some(Value::String(value.to_owned()));
        }
        if let Some(declared) = self.template["Parameters"].get(name) {
            let value = self.parameters.get(name).cloned().unwrap_or_else(|| text(&declared["Default"]));
            return Some(match declared["Type"].as_str() {
                Some("CommaDelimitedList") => Value::Array(value.split(',').map(|v| Value::String(v.into())).collect()),
                _ => Value::String(value),
            });
        }
        Some(Value::String(self.physical_name(name)))
    }

    /// `Fn::Sub`: `${Name}` as `Ref`, `${Name.Attribute}` as `Fn::GetAtt`, `${!x}` as is.
    fn substitute(&self, argument: &Value) -> String {
        let (mut rest, variables) = match argument {
            Value::String(template) => (template.as_str(), None),
            Value::Array(pair) => (pair[0].as_str().unwrap(), Some(&pair[1])),
            other => panic!("Fn::Sub {other}"),
        };
        let mut out = String::new();
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let end = after.find('}').unwrap();
            let variable = &after[..end];
            if let Some(literal) = variable.strip_prefix('!') {
                out.push_str(&format!("${{{literal}}}"));
            } else if let Some(value) = variables.and_then(|v| v.get(variable)) {
                out.push_str(&text(&self.resolve(value)));
            } else if let Some((logical, attribute)) = variable.split_once('.') {
                out.push_str(&self.attribute(logical, attribute));
            } else {
                out.push_str(&text(&self.reference(variable).unwrap_or_default()));
            }
            rest = &after[end + 1..];
        }
        out + rest
    }

    fn condition(&self, name: &str) -> bool {
        let condition = &self.template["Conditions"][name];
        assert!(!condition.is_null(), "no condition {name}");
        self.resolve(condition) == Value::Bool(true)
    }

    /// A value with its intrinsic functions resolved (`Value::Null` for
    /// `AWS::NoValue`, which leaves the list or the object it is in).
    fn resolve(&self, value: &Value) -> Value {
        self.resolved(value).unwrap_or(Value::Null)
    }

    fn resolved(&self, value: &Value) -> Option<Value> {
        let Value::Object(map) = value else {
            return Some(match value {
                Value::Array(items) => Value::Array(items.iter().filter_map(|v| self.resolved(v)).collect()),
                other => other.clone(),
            });
        };
        let intrinsic = map.iter().next().filter(|(key, _)| map.len() == 1 && is_intrinsic(key));
        let Some((function, argument)) = intrinsic else {
            return Some(Value::Object(map.iter().filter_map(|(k, v)| Some((k.clone(), self.resolved(v)?))).collect()));
        };
        let arguments = || argument.as_array().unwrap_or_else(|| panic!("{function}: {argument}"));
        let all = |f: fn(bool, bool) -> bool, start| {
            arguments().iter().map(|a| self.resolve(a) == Value::Bool(true)).fold(start, f)
        };
        Some(match function.as_str() {
            "Ref" => return self.reference(argument.as_str().unwrap()),
            "Condition" => Value::Bool(self.condition(argument.as_str().unwrap())),
            "Fn::GetAtt" => {
                let (logical, attribute) = match argument {
                    Value::String(dotted) => dotted.split_once('.').unwrap(),
                    _ => (arguments()[0].as_str().unwrap(), arguments()[1].as_str().unwrap()),
                };
                Value::String(self.attribute(logical, attribute))
            }
            "Fn::Sub" => Value::String(self.substitute(argument)),
            "Fn::If" => {
                let branch = if self.condition(arguments()[0].as_str().unwrap()) { 1 } else { 2 };
                return self.resolved(&arguments()[branch]);
            }
            "Fn::Join" => {
                let items = self.resolve(&arguments()[1]);
                let items: Vec<String> = items.as_array().into_iter().flatten().map(text).collect();
                Value::String(items.join(arguments()[0].as_str().unwrap()))
            }
            "Fn::Equals" => Value::Bool(text(&self.resolve(&arguments()[0])) == text(&self.resolve(&arguments()[1]))),
            "Fn::Not" => Value::Bool(self.resolve(&arguments()[0]) != Value::Bool(true)),
            "Fn::And" => Value::Bool(all(|a, b| a && b, true)),
            "Fn::Or" => Value::Bool(all(|a, b| a || b, false)),
            other => panic!("{other} is not resolved by this test"),
        })
    }

    /// A function's environment variables, resolved.
    fn environment(&self, function: &str) -> BTreeMap<String, String> {
        let variables = self.resolve(&self.resource(function)["Properties"]["Environment"]["Variables"]);
        variables.as_object().into_iter().flatten().map(|(k, v)| (k.clone(), text(v))).collect()
    }

    /// The group of a function's LoggingConfig: where Lambda delivers its log.
    fn own_log_group(&self, function: &str) -> String {
        text(&self.resolve(&self.resource(function)["Properties"]["LoggingConfig"]["LogGroup"]))
    }

    fn own_log_group_arn(&self, function: &str) -> String {
        let group = &self.resource(function)["Properties"]["LoggingConfig"]["LogGroup"];
        let logical = group["Ref"].as_str().unwrap_or_else(|| panic!("{function}'s log group: {group}"));
        self.attribute(logical, "Arn")
    }

    /// The role a function runs with (`Role: !GetAtt X.Arn`).
    fn role(&self, function: &str) -> String {
        let role = &self.resource(function)["Properties"]["Role"]["Fn::GetAtt"];
        role[0].as_str().unwrap_or_else(|| panic!("{function}'s role: {role}")).to_owned()
    }

    /// A role's statements, resolved. Only what this test can evaluate: inline
    /// policies of `Allow` statements without conditions.
    fn grants(&self, role: &str) -> Vec<Grant> {
        let properties = &self.resource(role)["Properties"];
        for key in ["ManagedPolicyArns", "PermissionsBoundary"] {
            assert!(properties.get(key).is_none(), "{role}: {key} is not evaluated by this test");
        }
        let resources = self.template["Resources"].as_object().unwrap();
        for (logical, resource) in resources {
            let attached = resource["Properties"]["Roles"].as_array().into_iter().flatten().any(|r| r["Ref"] == role);
            assert!(!attached, "{logical} attaches a policy to {role}: not evaluated by this test");
        }
        let mut grants = Vec::new();
        for policy in self.resolve(&properties["Policies"]).as_array().into_iter().flatten() {
            let statements = match &policy["PolicyDocument"]["Statement"] {
                Value::Array(statements) => statements.clone(),
                one => vec![one.clone()],
            };
            for (i, statement) in statements.iter().enumerate() {
                let sid = statement["Sid"].as_str().map_or_else(|| format!("statement {i}"), str::to_owned);
                assert_eq!(statement["Effect"], "Allow", "{role} {sid}: only Allow statements are evaluated");
                for key in ["NotAction", "NotResource", "Condition"] {
                    assert!(statement.get(key).is_none(), "{role} {sid}: {key} is not evaluated by this test");
                }
                grants.push(Grant {
                    sid,
                    actions: strings(&statement["Action"]),
                    resources: strings(&statement["Resource"]),
                });
            }
        }
        grants
    }

    /// Every request of each function allowed by its role; every grant of each role
    /// used by a flow or by Lambda ([`LAMBDA_USES`]), and those Lambda needs present;
    /// no `*` resource beyond X-Ray. What disagrees, one line each.
    fn check(&self, flows: &[Flow]) -> Vec<String> {
        let mut findings = Vec::new();
        for function in FUNCTIONS {
            let role = self.role(function);
            let grants = self.grants(&role);
            let own_log = self.own_log_group_arn(function);
            let traced = self.resource(function)["Properties"]["TracingConfig"]["Mode"] == "Active";
            let flows: Vec<&Flow> = flows.iter().filter(|f| f.function == function).collect();
            assert!(flows.iter().any(|f| !f.calls.is_empty()), "{function}: no flow sent anything");
            eprintln!("{role} ({function}):");
            for flow in &flows {
                eprintln!("  {}:", flow.name);
                let pairs: BTreeSet<(&str, &str, &str)> =
                    flow.calls.iter().map(|a| (a.action.as_str(), a.resource.as_str(), a.operation.as_str())).collect();
                for (action, resource, operation) in pairs {
                    eprintln!("    {action} {resource} ({operation})");
                }
                let mut denied: BTreeMap<&Authorization, usize> = BTreeMap::new();
                for call in flow.calls.iter().filter(|c| !grants.iter().any(|g| g.allows(&c.action, &c.resource))) {
                    *denied.entry(call).or_default() += 1;
                }
                for (call, times) in denied {
                    findings.push(format!(
                        "{role} does not allow {} on {}: {function} needs it for {} ({times}x) in the flow \"{}\"",
                        call.action, call.resource, call.operation, flow.name
                    ));
                }
            }
            // What Lambda does with the role: present, and the only grants left unused.
            let own_stream =
                format!("{}:log-stream:2026/01/01/[$LATEST]0123456789abcdef", own_log.trim_end_matches(":*"));
            let lambda_uses: Vec<(&str, String, &str)> = LAMBDA_USES
                .iter()
                .filter(|(_, scope, _)| *scope == Scope::OwnLogGroup || traced)
                .map(|(action, scope, why)| match scope {
                    Scope::OwnLogGroup => (*action, own_log.clone(), *why),
                    Scope::Traced => (*action, "*".to_owned(), *why),
                })
                .collect();
            for (action, resource, why) in &lambda_uses {
                let needed = if resource == &own_log { own_stream.as_str() } else { resource.as_str() };
                if !grants.iter().any(|g| g.allows(action, needed)) {
                    findings.push(format!("{role} does not allow {action} on {needed}, which Lambda needs: {why}"));
                }
            }
            let calls: Vec<&Authorization> = flows.iter().flat_map(|f| &f.calls).collect();
            for grant in &grants {
                for action in &grant.actions {
                    for resource in &grant.resources {
                        let used =
                            calls.iter().any(|c| matches_action(action, &c.action) && glob(resource, &c.resource));
                        let lambdas =
                            lambda_uses.iter().any(|(a, r, _)| a.eq_ignore_ascii_case(action) && r == resource);
                        if !used && !lambdas {
                            findings.push(format!(
                                "{role} grants {action} on {resource} ({}), which no flow of {function} uses",
                                grant.sid
                            ));
                        }
                        if resource == "*" && !action.to_ascii_lowercase().starts_with("xray:") {
                            findings.push(format!("{role} grants {action} on every resource ({})", grant.sid));
                        }
                    }
                }
            }
        }
        findings
    }
}

/// One statement of a role's policy: it allows each of its actions on each of its
/// resources.
#[derive(Debug)]
struct Grant {
    sid: String,
    actions: Vec<String>,
    resources: Vec<String>,
}

impl Grant {
    fn allows(&self, action: &str, resource: &str) -> bool {
        self.actions.iter().any(|a| matches_action(a, action)) && self.resources.iter().any(|r| glob(r, resource))
    }
}

/// IAM's action match: case-insensitive, with `*` and `?` wildcards.
fn matches_action(pattern: &str, action: &str) -> bool {
    glob(&pattern.to_ascii_lowercase(), &action.to_ascii_lowercase())
}

/// IAM's wildcards: `*` any run of characters (`:` and `/` included), `?` any one.
fn glob(pattern: &str, text: &str) -> bool {
    let (pattern, text): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // Whether the pattern's first i characters match the text's first j, row by row.
    let mut row = vec![false; text.len() + 1];
    row[0] = true;
    for p in &pattern {
        let mut next = vec![false; text.len() + 1];
        next[0] = *p == '*' && row[0];
        for j in 1..=text.len() {
            next[j] = match p {
                '*' => row[j] || next[j - 1],
                '?' => row[j - 1],
                c => row[j - 1] && *c == text[j - 1],
            };
        }
        row = next;
    }
    row[text.len()]
}

fn is_intrinsic(key: &str) -> bool {
    key == "Ref" || key == "Condition" || key.starts_with("Fn::")
}

/// A string, number or boolean as CloudFormation compares and joins them.
fn text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// A statement's `Action` or `Resource`: one, or a list (lists from a `Ref` flattened).
fn strings(value: &Value) -> Vec<String> {
    match value {
        Value::Array(items) => items.iter().flat_map(strings).collect(),
        Value::Null => Vec::new(),
        other => vec![text(other)],
    }
}

#[test]
fn iam_wildcards_match_as_iam_does() {
    let secret = "arn:aws:secretsmanager:us-east-1:123456789012:secret:ptu-west-AbCdEf";
    assert!(glob("arn:aws:secretsmanager:us-east-1:123456789012:secret:ptu-west-??????", secret));
    assert!(!glob("arn:aws:secretsmanager:us-east-1:123456789012:secret:ptu-west-?????", secret));
    let group = "arn:aws:logs:us-east-1:123456789012:log-group:/s/audit:*";
    assert!(glob(group, "arn:aws:logs:us-east-1:123456789012:log-group:/s/audit:log-stream:2026/01/01/[$LATEST]0"));
    assert!(glob(group, "arn:aws:logs:us-east-1:123456789012:log-group:/s/audit:*"));
    assert!(!glob(group, "arn:aws:logs:us-east-1:123456789012:log-group:/s/audit-other:*"));
    let table = "arn:aws:dynamodb:us-east-1:123456789012:table/s-ledger";
    assert!(!glob(table, &format!("{table}/index/expiry")), "a table's ARN does not cover its indexes");
    assert!(matches_action("dynamodb:query", "dynamodb:Query") && matches_action("xray:*", "xray:PutTraceSegments"));
    assert!(!matches_action("dynamodb:Get*", "dynamodb:BatchGetItem"));
}
