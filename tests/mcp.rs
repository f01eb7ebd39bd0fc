//! `/mcp` (SPEC §17), end to end over loopback: the gateway (in process, or the
//! binary) in front of real MCP servers (`tests/fake-mcp`, on the official Rust SDK),
//! spoken to as an agent's client does (plain JSON-RPC over HTTP: `initialize`,
//! `notifications/initialized`, `tools/list`, `tools/call`, with `Mcp-Session-Id` and
//! `MCP-Protocol-Version`). What each test holds: a burst never passes a euro budget
//! and the ledger is the audit's sum; the caller's credential never goes upstream; a
//! tool the caller may not call is invisible and answered as an unknown one; a server
//! that is down is left out; a server that forgot its session is re-initialized once;
//! a session opened on one process continues on another; a call's record and charge
//! follow how it ended.
#![cfg(test)]

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fake_mcp::FakeMcp;
use flexway_testkit::*;
use futures_util::future::join_all;
use serde_json::{Value, json};

const VERSION: &str = "2025-11-25";
/// What the servers that require a credential require (the gateway's own `auth`).
const UPSTREAM_TOKEN: &str = "upstream-secret";

/// An agent's MCP client, as little of one as the tests need: one session, its
/// headers on every request.
struct Agent {
    http: reqwest::Client,
    url: String,
    key: String,
    sensitive: bool,
    session: Option<String>,
    /// The next request's id: unique in the session, as JSON-RPC requires.
    ids: AtomicU64,
}

impl Agent {
    fn new(gateway: &str, key: &str) -> Agent {
        Agent {
            http: client(),
            url: format!("{gateway}/mcp"),
            key: key.into(),
            sensitive: false,
            session: None,
            ids: AtomicU64::new(1),
        }
    }

    fn sensitive(mut self) -> Agent {
        self.sensitive = true;
        self
    }

    fn post(&self, body: &Value) -> reqwest::RequestBuilder {
        let mut request = self
            .http
            .post(&self.url)
            .bearer_auth(&self.key)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", VERSION)
            .json(body);
        if let Some(session) = &self.session {
            request = request.header("mcp-session-id", session);
        }
        if self.sensitive {
            request = request.header("flexway-sensitive", "true");
        }
        request
    }

    /// `initialize` then `notifications/initialized`; keeps the session id.
    async fn initialize(&mut self) {
        let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": VERSION, "capabilities": {},
            "clientInfo": {"name": "flexway-tests", "version": "1"}}});
        let response = self.post(&body).send().await.unwrap();
        let session = response.headers().get("mcp-session-id").map(|v| v.to_str().unwrap().to_owned());
        let init = json_rpc_answer(response).await;
        assert_eq!(init["result"]["protocolVersion"], VERSION, "{init}");
        self.session = Some(session.unwrap_or_else(|| panic!("no Mcp-Session-Id for {init}")));
        let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        let accepted = self.post(&note).send().await.unwrap();
        assert_eq!(accepted.status(), 202, "notifications/initialized");
    }

    /// Every tool's name, all pages read.
    async fn tools(&self) -> Vec<String> {
        let mut names = Vec::new();
        let mut cursor: Option<Value> = None;
        loop {
            let id = self.ids.fetch_add(1, Ordering::Relaxed);
            let params = cursor.as_ref().map(|c| json!({"cursor": c})).unwrap_or_else(|| json!({}));
            let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/list", "params": params});
            let list = json_rpc_answer(self.post(&body).send().await.unwrap()).await;
            let tools = list["result"]["tools"].as_array().unwrap_or_else(|| panic!("no tools in {list}"));
            names.extend(tools.iter().map(|t| t["name"].as_str().unwrap().to_owned()));
            cursor = list["result"].get("nextCursor").filter(|c| !c.is_null()).cloned();
            if cursor.is_none() {
                break;
            }
        }
        names.sort();
        names
    }

    /// `tools/call`: its JSON-RPC answer.
    async fn call(&self, name: &str, arguments: Value) -> Value {
        json_rpc_answer(self.call_response(name, arguments).await).await
    }

    async fn call_response(&self, name: &str, arguments: Value) -> reqwest::Response {
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}});
        self.post(&body).send().await.unwrap()
    }
}

fn text_of(answer: &Value) -> &str {
    answer["result"]["content"][0]["text"].as_str().unwrap_or_else(|| panic!("no text in {answer}"))
}

/// A config with `servers` (the body of `mcp.servers`, indented by four spaces),
/// tenant `acme` (its key, and agent `bot`'s) with `budgets` and `narrowing` (its
/// `mcp:`, or empty), and an `ai` section no test calls.
fn mcp_config(servers: &str, budgets: &str, narrowing: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys:
      - sha256: {key}
      - {{sha256: {agent_key}, agent: bot}}
    budgets: {budgets}
    agents:
      bot: {{budgets: {{eur_per_month: 1}}}}
    {narrowing}
ai:
  default_backend: main
  backends:
    main: {{url: "http://127.0.0.1:9/v1", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}
mcp:
  servers:
{servers}"#,
        key = sha(KEY),
        agent_key = sha(AGENT_KEY),
    )
}

/// The gateway's credential for the servers that require one, as a `file:` reference
/// (an in-process gateway resolves no environment variable).
fn token_file(dir: &Path) -> String {
    let path = dir.join("upstream-token");
    std::fs::write(&path, UPSTREAM_TOKEN).unwrap();
    format!("file:{}", path.display())
}

/// The audit records of `operation: mcp`, as JSON, once there are `n`.
async fn mcp_records(audit: &flexway::audit::sinks::MemoryAuditSink, n: usize) -> Vec<Value> {
    for _ in 0..1000 {
        let records: Vec<Value> = audit
            .records()
            .iter()
            .map(|r| serde_json::to_value(r).unwrap())
            .filter(|r| r["operation"] == "mcp")
            .collect();
        if records.len() >= n {
            return records;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("fewer than {n} mcp records: {:?}", audit.records());
}

/// What one call costs in the burst, and the budget that allows exactly `ALLOWED`.
const PRICE_MICRO_EUR: u64 = 10_000;
const ALLOWED: u64 = 5;
const BURST: usize = 50;

/// 50 calls at once in one session under `eur_per_month` for 5: exactly 5 served,
/// the others refused with `budget_exceeded` before they reach the server; the ledger
/// and the audit both say 5 × the price.
async fn burst_under_a_euro_budget(
    adapters: flexway::gateway::Adapters,
    audit: &flexway::audit::sinks::MemoryAuditSink,
) {
    let server = FakeMcp::start().await.unwrap();
    let servers = format!("    tools: {{url: \"{}\", price: {{per_call_eur: 0.01}}}}\n", server.url());
    let gw = serve_in_process(&mcp_config(&servers, "{eur_per_month: 0.05}", ""), adapters).await;
    let mut agent = Agent::new(&gw.url, KEY);
    agent.initialize().await;

    let answers = join_all((0..BURST).map(|_| agent.call("tools__slow", json!({"ms": 100})))).await;
    let mut served = 0;
    for answer in &answers {
        if answer.get("result").is_some() {
            assert_eq!(text_of(answer), "slept 100 ms");
            served += 1;
        } else {
            assert_eq!(answer["error"]["data"]["flexway_code"], "budget_exceeded", "{answer}");
            assert!(answer["error"]["code"].is_i64(), "{answer}");
        }
    }
    assert_eq!(served, ALLOWED, "a budget for {ALLOWED} calls served {served}");
    assert_eq!(server.calls("slow"), ALLOWED, "a refused call never reaches the server");
    assert_eq!(gw.ledger("acme", None).await[2], ALLOWED * PRICE_MICRO_EUR, "the month's µ€");
    assert_eq!(gw.live_reservations().await, 0, "no reservation left");

    let records = mcp_records(audit, BURST).await;
    assert_eq!(records.len(), BURST, "one record per tools/call");
    let charged: u64 = records.iter().map(|r| r["cost_micro_eur"].as_u64().unwrap()).sum();
    assert_eq!(charged, ALLOWED * PRICE_MICRO_EUR, "the audit's sum is the ledger's");
    let ok = records.iter().filter(|r| r["mcp_status"] == "ok").count() as u64;
    assert_eq!(ok, ALLOWED);
    for refused in records.iter().filter(|r| r["mcp_status"] != "ok") {
        assert_eq!(refused["mcp_status"], "error", "{refused}");
        assert_eq!(refused["error_code"], "budget_exceeded", "{refused}");
        assert_eq!(refused["cost_micro_eur"], 0, "{refused}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_never_passes_a_euro_budget_on_the_embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    let (adapters, audit) = embedded_adapters(&dir.path().join("ledger"));
    burst_under_a_euro_budget(adapters, &audit).await;
}

/// The same on DynamoDB (the emulator `scripts/test` starts), the fleet's ledger.
#[cfg(feature = "aws")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_never_passes_a_euro_budget_on_dynamodb() {
    let sdk = flexway_testkit::emulator::sdk().await;
    let dynamodb = aws_sdk_dynamodb::Client::new(&sdk);
    let table = flexway_testkit::emulator::unique("flexway-mcp-burst");
    flexway_aws::DynamoDbBudgetStore::create_table(&dynamodb, &table).await.unwrap();
    let audit = std::sync::Arc::new(flexway::audit::sinks::MemoryAuditSink::new());
    let adapters = flexway::gateway::Adapters {
        budgets: std::sync::Arc::new(flexway_aws::DynamoDbBudgetStore::new(dynamodb, table)),
        audit: audit.clone(),
        export: flexway::telemetry::Export::Batched,
        cache: None,
    };
    burst_under_a_euro_budget(adapters, &audit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_caller_credential_never_goes_upstream_the_server_auth_does() {
    let guarded = FakeMcp::start_requiring(UPSTREAM_TOKEN).await.unwrap();
    let open = FakeMcp::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let servers = format!(
        "    guarded: {{url: \"{}\", auth: {{type: bearer, secret: \"{}\"}}}}\n    open: {{url: \"{}\"}}\n",
        guarded.url(),
        token_file(dir.path()),
        open.url()
    );
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&mcp_config(&servers, "{eur_per_month: 1}", ""), adapters).await;
    let mut agent = Agent::new(&gw.url, KEY);
    agent.initialize().await;

    let guarded_saw = agent.call("guarded__whoami", json!({})).await;
    assert_eq!(text_of(&guarded_saw), format!("Bearer {UPSTREAM_TOKEN}"));
    let open_saw = agent.call("open__whoami", json!({})).await;
    assert_eq!(text_of(&open_saw), "(none)", "a server without auth gets no Authorization at all");
    assert!(!guarded_saw.to_string().contains(KEY) && !open_saw.to_string().contains(KEY));
    assert_eq!((guarded.calls("whoami"), open.calls("whoami")), (1, 1));
}

/// A tool the caller may not call — denied by its server's globs, by its tenant's, or
/// on an external server for a sensitive caller — is not listed, and calling it is
/// answered exactly as calling a tool that does not exist, without reaching a server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_tool_is_invisible_and_answered_as_an_unknown_one() {
    let internal = FakeMcp::start().await.unwrap();
    let external = FakeMcp::start().await.unwrap();
    let servers = format!(
        "    local: {{url: \"{}\", external: false, tools: {{deny: [\"fa*\"]}}}}\n    ext: {{url: \"{}\", external: true}}\n",
        internal.url(),
        external.url()
    );
    let narrowing = "mcp: {tools: {deny: [\"local__sl?w\"]}}";
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&mcp_config(&servers, "{eur_per_month: 1}", narrowing), adapters).await;

    let mut agent = Agent::new(&gw.url, KEY);
    agent.initialize().await;
    let all = ["add", "echo", "explode", "fail", "slow", "whoami"];
    let mut expected: Vec<String> = all.iter().map(|t| format!("ext__{t}")).collect();
    expected.extend(["add", "echo", "explode", "whoami"].iter().map(|t| format!("local__{t}")));
    assert_eq!(agent.tools().await, expected, "local__fail (server deny) and local__slow (tenant deny) are absent");

    let mut sensitive = Agent::new(&gw.url, KEY).sensitive();
    sensitive.initialize().await;
    let internal_only: Vec<String> =
        ["add", "echo", "explode", "whoami"].iter().map(|t| format!("local__{t}")).collect();
    assert_eq!(sensitive.tools().await, internal_only, "a sensitive caller sees no external server");

    let unknown = agent.call("local__nope", json!({})).await;
    assert_eq!(unknown["error"]["code"], -32602, "{unknown}");
    for (caller, denied) in [(&agent, "local__fail"), (&agent, "local__slow"), (&sensitive, "ext__echo")] {
        let refused = caller.call(denied, json!({"text": "x", "ms": 1})).await;
        let unknown = format!("{}__no_such_tool", denied.split("__").next().unwrap());
        let as_unknown = caller.call(&unknown, json!({})).await;
        let shape = |answer: &Value, name: &str| {
            let mut answer = answer.clone();
            answer["id"] = json!("ID");
            answer.to_string().replace(name, "NAME")
        };
        assert_eq!(shape(&refused, denied), shape(&as_unknown, &unknown), "{denied} is answered as an unknown tool");
        assert_eq!(refused["error"]["code"], -32602);
    }
    assert_eq!(internal.calls("fail") + internal.calls("slow") + external.calls("echo"), 0);
    // The same tools stay callable where they are allowed.
    assert_eq!(text_of(&agent.call("ext__echo", json!({"text": "allowed"})).await), "allowed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_down_is_left_out_of_the_list() {
    let up = FakeMcp::start().await.unwrap();
    let closed = ClosedPort::new();
    let servers = format!(
        "    up: {{url: \"{}\"}}\n    down: {{url: \"http://127.0.0.1:{}/mcp\", timeout: 2s}}\n",
        up.url(),
        closed.port()
    );
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&mcp_config(&servers, "{eur_per_month: 1}", ""), adapters).await;
    let mut agent = Agent::new(&gw.url, KEY);
    agent.initialize().await;
    let tools = agent.tools().await;
    assert_eq!(tools.len(), 6, "{tools:?}");
    assert!(tools.iter().all(|t| t.starts_with("up__")), "{tools:?}");
    assert_eq!(text_of(&agent.call("up__echo", json!({"text": "still here"})).await), "still here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_forgot_its_session_is_reinitialized_once_transparently() {
    let server = FakeMcp::start().await.unwrap();
    let servers = format!("    tools: {{url: \"{}\"}}\n", server.url());
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&mcp_config(&servers, "{eur_per_month: 1}", ""), adapters).await;
    let mut agent = Agent::new(&gw.url, KEY);
    agent.initialize().await;
    assert_eq!(text_of(&agent.call("tools__echo", json!({"text": "before"})).await), "before");
    let opened = server.initializations();
    assert!(opened >= 1, "the gateway opened its upstream session");

    server.forget().await;
    assert_eq!(text_of(&agent.call("tools__echo", json!({"text": "after"})).await), "after");
    assert_eq!(server.initializations(), opened + 1, "re-initialized once");
    assert_eq!(server.calls("echo"), 2, "the call was sent once to the forgotten session's 404, once after");
}

/// A session id is sealed state: the second process of one configuration serves the
/// session the first opened, upstream session included (no new `initialize`); a
/// tampered id is 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_opened_on_one_process_is_continued_on_another() {
    let server = FakeMcp::start_requiring(UPSTREAM_TOKEN).await.unwrap();
    let servers = format!(
        "    tools: {{url: \"{}\", auth: {{type: bearer, secret: \"env:UPSTREAM_TOKEN\"}}}}\n  session_key: \"env:MCP_SESSION_KEY\"\n",
        server.url()
    );
    let yaml = mcp_config(&servers, "{eur_per_month: 1}", "");
    let env = [("UPSTREAM_TOKEN", UPSTREAM_TOKEN), ("MCP_SESSION_KEY", "a-key-both-processes-share-0123456789")];
    let first = Flexway::start_with_env(&yaml, &env);
    let second = Flexway::start_with_env(&yaml, &env);

    let mut agent = Agent::new(&first.url, KEY);
    agent.initialize().await;
    assert_eq!(text_of(&agent.call("tools__echo", json!({"text": "on the first"})).await), "on the first");
    let opened = server.initializations();

    let mut moved = Agent::new(&second.url, KEY);
    moved.session = agent.session.clone();
    moved.ids = AtomicU64::new(1000);
    assert_eq!(text_of(&moved.call("tools__echo", json!({"text": "on the second"})).await), "on the second");
    assert_eq!(server.initializations(), opened, "the upstream session travelled with the id");
    assert_eq!(server.calls("echo"), 2);
    let records = second.records_until::<Value>(1).await;
    assert_eq!(records[0]["operation"], "mcp", "{records:?}");
    assert_eq!(records[0]["tenant"], "acme");

    let mut tampered: Vec<char> = agent.session.clone().unwrap().chars().collect();
    let middle = tampered.len() / 2;
    tampered[middle] = if tampered[middle] == 'A' { 'B' } else { 'A' };
    moved.session = Some(tampered.into_iter().collect());
    let refused = moved.call_response("tools__echo", json!({"text": "x"})).await;
    assert_eq!(refused.status(), 404, "a tampered session id");
    assert_eq!(server.calls("echo"), 2);
}

/// One record per call: `operation: mcp`, its server and tool, how it ended and what
/// it cost; a result (one with `isError: true` too) is charged, an error refunded; the
/// arguments and the result are never in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_is_audited_and_charged_by_how_it_ended() {
    let server = FakeMcp::start().await.unwrap();
    let servers =
        format!("    tools: {{url: \"{}\", price: {{per_call_eur: 0.001, tools: {{add: 0.002}}}}}}\n", server.url());
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&mcp_config(&servers, "{eur_per_month: 1}", ""), adapters).await;
    let mut agent = Agent::new(&gw.url, AGENT_KEY);
    agent.initialize().await;

    assert_eq!(text_of(&agent.call("tools__echo", json!({"text": "a-secret-argument"})).await), "a-secret-argument");
    assert_eq!(text_of(&agent.call("tools__add", json!({"a": 40, "b": 2})).await), "42");
    let failed = agent.call("tools__fail", json!({})).await;
    assert_eq!(failed["result"]["isError"], true, "{failed}");
    let exploded = agent.call("tools__explode", json!({})).await;
    assert!(exploded.get("error").is_some() && exploded.get("result").is_none(), "{exploded}");

    let records = mcp_records(&audit, 4).await;
    let seen: Vec<(String, String, u64)> = records
        .iter()
        .map(|r| {
            assert_eq!(r["mcp_server"], "tools", "{r}");
            assert_eq!((r["tenant"].as_str(), r["agent"].as_str()), (Some("acme"), Some("bot")), "{r}");
            let micro = r["cost_micro_eur"].as_u64().unwrap();
            assert_eq!(r["cost_eur"].as_f64().unwrap(), micro as f64 / 1e6, "{r}");
            assert!(!r.to_string().contains("a-secret-argument"), "an argument reached the audit: {r}");
            (r["tool"].as_str().unwrap().to_owned(), r["mcp_status"].as_str().unwrap().to_owned(), micro)
        })
        .collect();
    let expected =
        [("echo", "ok", 1_000), ("add", "ok", 2_000), ("fail", "tool_error", 1_000), ("explode", "error", 0)];
    let expected: Vec<(String, String, u64)> =
        expected.iter().map(|(t, s, c)| (t.to_string(), s.to_string(), *c)).collect();
    assert_eq!(seen, expected);
    assert_eq!(gw.ledger("acme", Some("bot")).await[2], 4_000, "the agent's month: charged, the error refunded");
    assert_eq!(gw.ledger("acme", None).await[2], 4_000, "the tenant's month");
    assert_eq!(gw.live_reservations().await, 0);
}
