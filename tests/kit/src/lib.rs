//! What Flexway's tests share, in one dev-only crate: the real `flexway` binary on
//! port 0, configured from a YAML string, in front of fake model servers on loopback
//! ([`Flexway`]); a gateway served in the test's own process ([`serve_in_process`]);
//! the configs and requests most tests start from; the AWS emulator's SDK
//! configuration ([`emulator`], feature `aws`); a headless browser ([`browser`]); and
//! checked-in generated files ([`golden`]); the infrastructure template as AWS
//! receives it ([`template`]) and the log lines its metric filters read ([`logs`]);
//! a real PostgreSQL with pgvector ([`postgres`]).
//!
//! Its helpers fail a test by panicking, with what was seen.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod browser;
#[cfg(feature = "aws")]
pub mod emulator;
pub mod golden;
#[cfg(feature = "aws")]
pub mod iam;
pub mod logs;
pub mod postgres;
pub mod realtime;
pub mod template;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use fake_model::{FakeModel, Scenario};
use sha2::{Digest, Sha256};

/// The `flexway` binary the tests run: `FLEXWAY_BIN`, or the one cargo built beside
/// the running test (a test runs from `target/<profile>/deps`; cargo builds a
/// package's binaries before its integration tests).
pub fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("FLEXWAY_BIN") {
        return path.into();
    }
    let test = std::env::current_exe().unwrap();
    let profile = test.parent().and_then(Path::parent).expect("a test binary in target/<profile>/deps");
    profile.join(format!("flexway{}", std::env::consts::EXE_SUFFIX))
}

pub const KEY: &str = "sk-test-acme";
pub const AGENT_KEY: &str = "sk-test-acme-bot";
pub const OTHER_KEY: &str = "sk-test-globex";

/// The hex sha256 of a key (what a config lists), or of a configuration's text (what
/// `/healthz` reports).
pub fn sha(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// One tenant, `acme`, with `key`, served by `main` at `url`: what the reload tests
/// write and rewrite.
pub fn reloadable_config(key: &str, url: &str) -> String {
    format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: stdout}}\ntenants:\n  acme:\n    keys:\n      \
         - sha256: {}\nai:\n  default_backend: main\n  backends:\n    main:\n      url: \"{url}\"\n      \
         price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}\n",
        sha(key)
    )
}

/// A running `flexway serve`; killed on drop.
pub struct Flexway {
    child: Child,
    pub url: String,
    pub dir: tempfile::TempDir,
    logs: Arc<Mutex<Vec<String>>>,
    /// What the process wrote on stdout (the `stdout` audit sink), line by line.
    stdout: Arc<Mutex<Vec<String>>>,
}

impl Flexway {
    /// Starts the gateway with `yaml` (written to a temp dir) and extra env vars.
    pub fn start_with_env(yaml: &str, env: &[(&str, &str)]) -> Flexway {
        Self::launch(yaml, env, &[])
    }

    /// Starts the gateway with `yaml` and extra arguments to `flexway serve`.
    pub fn start_with_args(yaml: &str, args: &[&str]) -> Flexway {
        Self::launch(yaml, &[], args)
    }

    /// Both: extra env vars and extra arguments (a `--config` among them replaces
    /// the file written from `yaml`).
    pub fn start_with_env_and_args(yaml: &str, env: &[(&str, &str)], args: &[&str]) -> Flexway {
        Self::launch(yaml, env, args)
    }

    fn launch(yaml: &str, env: &[(&str, &str)], args: &[&str]) -> Flexway {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("flexway.yaml");
        std::fs::write(&config, yaml).unwrap();
        let mut command = Command::new(binary());
        command.arg("serve");
        // A `--config` among `args` names another source (an S3 object).
        if !args.contains(&"--config") {
            command.arg("--config").arg(&config);
        }
        command
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .current_dir(dir.path())
            .env("FLEXWAY_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let lines = stdout.clone();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("flexway listening on ") {
                    let _ = tx.send(addr.to_owned());
                }
                sink.lock().unwrap().push(line);
            }
        });
        let url = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(url) => url,
            Err(_) => {
                let _ = child.kill();
                panic!("flexway did not start: {:?}", logs.lock().unwrap());
            }
        };
        Flexway { child, url, dir, logs, stdout }
    }

    /// The lines written on stdout so far.
    pub fn stdout(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    /// The audit records written so far (the `stdout` sink): its lines that read as `T`.
    pub fn records<T: serde::de::DeserializeOwned>(&self) -> Vec<T> {
        self.stdout().iter().filter_map(|line| serde_json::from_str(line).ok()).collect()
    }

    /// The audit records once there are at least `n` (a record is written as its call
    /// ends, just after its answer), waiting ten seconds at most.
    pub async fn records_until<T: serde::de::DeserializeOwned>(&self, n: usize) -> Vec<T> {
        for _ in 0..1000 {
            let records = self.records();
            if records.len() >= n {
                return records;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("fewer than {n} audit records: {:?}\n{}", self.stdout(), self.logs());
    }

    /// The records of a `file` audit sink at `path` (relative to the gateway's directory)
    /// once it holds at least `n` whole lines, each of which must read as `T`, waiting
    /// `tries` times 10 ms at most.
    pub async fn file_records_until<T: serde::de::DeserializeOwned>(&self, path: &str, n: usize, tries: u32) -> Vec<T> {
        let file = self.dir.path().join(path);
        let whole = || {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            // A line still being written has no newline yet.
            text[..text.rfind('\n').map_or(0, |end| end + 1)].to_owned()
        };
        for _ in 0..tries {
            let text = whole();
            if text.lines().count() >= n {
                return text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("fewer than {n} audit records in {}:\n{}\n{}", file.display(), whole(), self.logs());
    }

    /// The sha256 of the configuration `/healthz` says is served.
    pub async fn served_sha(&self) -> String {
        let health: serde_json::Value =
            client().get(format!("{}/healthz", self.url)).send().await.unwrap().json().await.unwrap();
        health["config_sha256"].as_str().unwrap().to_owned()
    }

    pub fn start(yaml: &str) -> Flexway {
        Self::start_with_env(yaml, &[])
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process's peak resident memory so far (`VmHWM`), in bytes.
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    }

    /// The configuration file it serves.
    pub fn config_path(&self) -> std::path::PathBuf {
        self.dir.path().join("flexway.yaml")
    }

    /// Sends SIGHUP: reload the configuration.
    pub fn hangup(&self) {
        let status = Command::new("kill").args(["-HUP", &self.child.id().to_string()]).status().unwrap();
        assert!(status.success());
    }

    /// Sends SIGINT, as Ctrl-C in a terminal would.
    pub fn interrupt(&self) {
        let status = Command::new("kill").args(["-INT", &self.child.id().to_string()]).status().unwrap();
        assert!(status.success());
    }

    /// The exit status, if the process ends within `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn logs(&self) -> String {
        self.logs.lock().unwrap().join("\n")
    }

    /// The log lines that hold `matches`, once there are at least `n`, waiting five
    /// seconds at most: a thread reads the process's stderr, so a line may be read
    /// after the answer it follows.
    pub async fn log_lines_until(&self, n: usize, matches: impl Fn(&str) -> bool) -> Vec<String> {
        for _ in 0..500 {
            let lines: Vec<String> = self.logs.lock().unwrap().iter().filter(|l| matches(l)).cloned().collect();
            if lines.len() >= n {
                return lines;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("fewer than {n} log lines of the kind asked for:\n{}", self.logs());
    }

    /// The first log line that contains every one of `needles`, waiting for it.
    pub async fn log_line(&self, needles: &[&str]) -> String {
        let mut lines = self.log_lines_until(1, |l| needles.iter().all(|n| l.contains(n))).await;
        lines.swap_remove(0)
    }

    pub fn post(&self, path: &str, key: &str, body: serde_json::Value) -> reqwest::RequestBuilder {
        client().post(format!("{}{path}", self.url)).bearer_auth(key).json(&body)
    }

    pub async fn chat(&self, key: &str, body: serde_json::Value) -> reqwest::Response {
        self.post("/v1/chat/completions", key, body).send().await.unwrap()
    }
}

impl Drop for Flexway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nothing listens on, held for as long as the value lives: bound but
/// never listening, so a connection to it is refused and no other socket (a fake, a
/// gateway, a client's own ephemeral port) can take it meanwhile.
pub struct ClosedPort(tokio::net::TcpSocket);

impl ClosedPort {
    pub fn new() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        Self(socket)
    }

    pub fn port(&self) -> u16 {
        self.0.local_addr().unwrap().port()
    }
}

impl Default for ClosedPort {
    fn default() -> Self {
        Self::new()
    }
}

/// The fake's URL with a scenario prefix written as the fake parses it
/// (`words=500,ignore_limit`), for scenarios a test names by their keys.
pub fn scenario(model: &FakeModel, text: &str) -> String {
    model.url().replace("/v1", &format!("/s/{text}/v1"))
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap()
}

/// Waits, if needed, until the current UTC minute has at least 40 s left: the calls of
/// a test then count in one per-minute window.
pub async fn early_in_a_minute() {
    with_seconds_left_in_the_minute(40).await;
}

/// Waits, if needed, until the current UTC minute has at least `seconds` left.
pub async fn with_seconds_left_in_the_minute(seconds: u64) {
    let second = flexway::budget::period::unix_now() % 60;
    if second > 60 - seconds {
        tokio::time::sleep(Duration::from_secs(60 - second)).await;
    }
}

/// The JSON-RPC answer in an MCP response, which must be a 200: its JSON body, or the
/// SSE event that carries a message with an `id`.
pub async fn json_rpc_answer(response: reqwest::Response) -> serde_json::Value {
    let status = response.status();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    if let Ok(value) = serde_json::from_str::<serde_json::Value>(&text) {
        return value;
    }
    text.lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .filter_map(|data| serde_json::from_str::<serde_json::Value>(data.trim()).ok())
        .find(|message| message.get("id").is_some())
        .unwrap_or_else(|| panic!("no JSON-RPC answer in {text}"))
}

/// A header the answer must carry, as text.
pub fn header<'r>(response: &'r reqwest::Response, name: &str) -> &'r str {
    response.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or_else(|| panic!("no {name} header"))
}

pub fn hello(model: &str) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hello there"}]})
}

/// A config on the memory ledger and the stdout audit, with the given `tenants:` and
/// `ai:` bodies (each indented by two spaces).
fn with_tenants(tenants: &str, ai: &str) -> String {
    format!("version: 1\nstore: {{kind: memory}}\naudit: {{sink: stdout}}\ntenants:\n{tenants}ai:\n{ai}\n")
}

/// A config with one tenant, `acme` (key KEY), its `budgets:` mapping, and the given
/// `ai:` body (indented by two spaces).
pub fn acme_config(budgets: &str, ai: &str) -> String {
    with_tenants(&format!("  acme:\n    keys:\n      - sha256: {}\n    budgets: {budgets}\n", sha(KEY)), ai)
}

/// A config with tenants `acme` (KEY) and `globex` (OTHER_KEY, routed to
/// `globex_backend`), each with `budgets:`, and the given `ai:` body (indented by two
/// spaces).
pub fn two_tenants(budgets: &str, globex_backend: &str, ai: &str) -> String {
    let tenants = format!(
        "  acme:\n    keys:\n      - sha256: {}\n    budgets: {budgets}\n  globex:\n    keys:\n      \
         - sha256: {}\n    budgets: {budgets}\n    backend: {globex_backend}\n",
        sha(KEY),
        sha(OTHER_KEY)
    );
    with_tenants(&tenants, ai)
}

/// A config with tenants `acme` (agent `bot` bound to AGENT_KEY, agent `helper`) and
/// `globex`, and the given `ai:` body (indented by two spaces).
pub fn config(ai: &str) -> String {
    let tenants = format!(
        "  acme:\n    keys:\n      - sha256: {}\n      - {{sha256: {}, agent: bot}}\n    agents:\n      \
         bot: {{}}\n      helper: {{}}\n  globex:\n    keys:\n      - sha256: {}\n",
        sha(KEY),
        sha(AGENT_KEY),
        sha(OTHER_KEY)
    );
    with_tenants(&tenants, ai)
}

/// `ai:` with one backend `main` at `url`.
pub fn one_backend(url: &str) -> String {
    config(&format!(
        "  default_backend: main\n  backends:\n    main:\n      url: {url}\n      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}}\n"
    ))
}

/// Reads an SSE response, returning each event's data in order.
pub async fn sse_data(response: reqwest::Response) -> (Vec<String>, Option<String>) {
    use futures_util::StreamExt;
    let mut body = response.bytes_stream();
    let mut text = String::new();
    let mut error = None;
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(bytes) => text.push_str(&String::from_utf8_lossy(&bytes)),
            Err(e) => {
                error = Some(e.to_string());
                break;
            }
        }
    }
    let events = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.lines().filter_map(|l| l.strip_prefix("data: ")).collect::<Vec<_>>().join("\n"))
        .collect();
    (events, error)
}

/// The gateway `yaml` configures, over `adapters`, served by nothing: for a test that
/// drives its router as a tower service (`ServiceExt::oneshot`).
pub async fn gateway(yaml: &str, adapters: flexway::gateway::Adapters) -> Arc<flexway::Gateway> {
    let env: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let loaded = flexway::config::load_str(yaml, &env).unwrap_or_else(|e| panic!("{e}"));
    let secrets = Arc::new(flexway::secret::LocalSecrets { env });
    Arc::new(flexway::Gateway::new(loaded.config, secrets, adapters).await.unwrap())
}

/// The gateway in-process (same router as `flexway serve`), on a loopback port, with
/// the given adapters, so a test can look into the ledger and the audit afterwards.
pub struct InProcess {
    pub url: String,
    pub gateway: Arc<flexway::Gateway>,
}

pub async fn serve_in_process(yaml: &str, adapters: flexway::gateway::Adapters) -> InProcess {
    serve_router_in_process(yaml, adapters, flexway::http::app).await
}

/// As [`serve_in_process`], with the router `router` makes of the gateway (the
/// serverless shape's `flexway::http::api`, with layers of a test's own).
pub async fn serve_router_in_process(
    yaml: &str,
    adapters: flexway::gateway::Adapters,
    router: impl FnOnce(Arc<flexway::Gateway>) -> axum::Router,
) -> InProcess {
    let gateway = gateway(yaml, adapters).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = router(gateway.clone());
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    InProcess { url, gateway }
}

impl InProcess {
    pub async fn chat(&self, key: &str, body: serde_json::Value) -> reqwest::Response {
        client().post(format!("{}/v1/chat/completions", self.url)).bearer_auth(key).json(&body).send().await.unwrap()
    }

    /// Today's and this month's counters of a tenant (tokens/day, tokens/month, µ€/month).
    pub async fn ledger(&self, tenant: &str, agent: Option<&str>) -> [u64; 3] {
        use flexway::budget::{CounterKey, Period, Unit, period::unix_now};
        let now = unix_now();
        let keys = [
            CounterKey::new(tenant, agent, Unit::Tokens, Period::Day, now),
            CounterKey::new(tenant, agent, Unit::Tokens, Period::Month, now),
            CounterKey::new(tenant, agent, Unit::MicroEur, Period::Month, now),
        ];
        let used = self.gateway.budgets.used(&keys).await.unwrap();
        [used[0], used[1], used[2]]
    }

    pub async fn live_reservations(&self) -> usize {
        self.gateway.budgets.live_reservations().await.unwrap()
    }
}

/// An in-process gateway's audit records (its memory sink) once there are at least
/// `n`, waiting ten seconds at most: a streamed call's record is written as its
/// relay ends, which may be just after the client read its last byte.
pub async fn audit_records_until(
    audit: &flexway::audit::sinks::MemoryAuditSink,
    n: usize,
) -> Vec<flexway::audit::AuditRecord> {
    for _ in 0..1000 {
        let records = audit.records();
        if records.len() >= n {
            return records;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("fewer than {n} audit records: {:?}", audit.records());
}

pub fn memory_adapters() -> (flexway::gateway::Adapters, Arc<flexway::audit::sinks::MemoryAuditSink>) {
    let audit = Arc::new(flexway::audit::sinks::MemoryAuditSink::new());
    let adapters = flexway::gateway::Adapters {
        budgets: Arc::new(flexway::budget::MemoryBudgetStore::new()),
        audit: audit.clone(),
        export: flexway::telemetry::Export::Batched,
        cache: None,
    };
    (adapters, audit)
}

pub fn embedded_adapters(
    path: &std::path::Path,
) -> (flexway::gateway::Adapters, Arc<flexway::audit::sinks::MemoryAuditSink>) {
    let audit = Arc::new(flexway::audit::sinks::MemoryAuditSink::new());
    let adapters = flexway::gateway::Adapters {
        budgets: Arc::new(flexway::budget::EmbeddedBudgetStore::open(path).unwrap()),
        audit: audit.clone(),
        export: flexway::telemetry::Export::Batched,
        cache: None,
    };
    (adapters, audit)
}

/// `calls` calls at once, each made by `open` and held (what it gives kept) once
/// `open` has finished, until all are (or `within` has passed), then let go. The
/// error is how many were open.
pub async fn hold_open<F, Held>(calls: usize, within: Duration, open: impl Fn() -> F) -> Result<(), usize>
where
    F: std::future::Future<Output = Held> + Send + 'static,
    Held: Send + 'static,
{
    let (started, mut arrivals) = tokio::sync::mpsc::channel::<()>(calls);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    for _ in 0..calls {
        let (opening, started, mut stopped) = (open(), started.clone(), stopped.clone());
        tokio::spawn(async move {
            let _held = opening.await;
            started.send(()).await.unwrap();
            let _ = stopped.wait_for(|stop| *stop).await;
        });
    }
    let mut came = 0;
    let all = tokio::time::timeout(within, async {
        while came < calls {
            arrivals.recv().await.unwrap();
            came += 1;
        }
    })
    .await;
    stop.send(true).unwrap();
    all.map_err(|_| came)
}
