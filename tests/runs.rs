//! Runs (SPEC §15), end to end over loopback: the runs API and calls that join a run
//! with `Flexway-Run`, on the gateway's router with a real ledger (the main tests on
//! both the memory and the embedded store), the fake model server as the backend, and
//! the audit read from the memory sink.
#![cfg(test)]

use fake_mcp::FakeMcp;
use flexway::audit::{AuditRecord, Timestamp};
use flexway::call::Operation;
use flexway_testkit::realtime::{Session, next_event, one_response};
use flexway_testkit::*;
use futures_util::future::join_all;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// Tenants `acme` (agent `bot` bound to AGENT_KEY, agent `helper`, the unbound KEY)
/// and `globex` (OTHER_KEY); one backend at `url` (chat, embeddings and realtime),
/// calls allowed 20 completion tokens.
fn runs_config(url: &str) -> String {
    config(&format!(
        "  default_backend: main\n  budget: {{default_max_tokens: 20, min_completion_tokens: 5}}\n  backends:\n    \
         main:\n      url: {url}\n      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}}\n      \
         capabilities: [chat, embeddings, realtime]\n"
    ))
}

/// The ledger a test's gateway counts in.
#[derive(Clone, Copy)]
enum Store {
    Memory,
    Embedded,
}

/// Each test named runs once on each store: `name::memory`, `name::embedded`.
macro_rules! on_each_store {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$name(super::Store::Memory).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn embedded() {
                super::$name(super::Store::Embedded).await;
            }
        }
    )*};
}

on_each_store!(
    concurrent_calls_never_pass_a_run_budget_and_get_reads_what_the_audit_says,
    a_runs_get_matches_the_audits_total_for_it,
    a_call_on_every_http_door_counts_in_its_run,
    a_child_is_held_inside_its_parent_and_ends_with_it,
    three_sub_agents_in_parallel_draw_on_their_planners_run,
);

struct Runs {
    gw: InProcess,
    audit: std::sync::Arc<flexway::audit::sinks::MemoryAuditSink>,
    _model: FakeModel,
    /// The embedded store's directory, kept while the gateway runs.
    _ledger: Option<tempfile::TempDir>,
}

/// A gateway on the memory store whose backend answers after `delay_ms`.
async fn start(delay_ms: u64) -> Runs {
    start_on(Store::Memory, delay_ms).await
}

/// A gateway on `store` whose backend answers after `delay_ms`, so that calls sent
/// together all reserve before the first settles.
async fn start_on(store: Store, delay_ms: u64) -> Runs {
    start_with(store, delay_ms, None).await
}

/// As [`start_on`], with `tools`, when given, as MCP server `tools`: its tools at
/// 0.001 € a call, `echo` at nothing.
async fn start_with(store: Store, delay_ms: u64, tools: Option<&FakeMcp>) -> Runs {
    let model = FakeModel::start().await.unwrap();
    let url = model.scenario_url(&Scenario { delay_ms: Some(delay_ms), ..Default::default() });
    let (adapters, audit, ledger) = match store {
        Store::Memory => {
            let (adapters, audit) = memory_adapters();
            (adapters, audit, None)
        }
        Store::Embedded => {
            let dir = tempfile::tempdir().unwrap();
            let (adapters, audit) = embedded_adapters(&dir.path().join("ledger"));
            (adapters, audit, Some(dir))
        }
    };
    let mut yaml = runs_config(&url);
    if let Some(server) = tools {
        let price = "{per_call_eur: 0.001, tools: {echo: 0}}";
        yaml.push_str(&format!("mcp:\n  servers:\n    tools: {{url: \"{}\", price: {price}}}\n", server.url()));
    }
    let gw = serve_in_process(&yaml, adapters).await;
    Runs { gw, audit, _model: model, _ledger: ledger }
}

impl Runs {
    fn runs(&self) -> String {
        format!("{}/v1/flexway/runs", self.gw.url)
    }

    async fn create(&self, key: &str, body: Value) -> (u16, Value) {
        self.create_raw(key, &body.to_string()).await
    }

    /// A new run's body as written (a number serde_json would write otherwise).
    async fn create_raw(&self, key: &str, body: &str) -> (u16, Value) {
        let (status, text) = self.create_text(key, body).await;
        (status, serde_json::from_str(&text).unwrap())
    }

    /// The answer's text: euros as the gateway wrote them, before a float reads them.
    async fn create_text(&self, key: &str, body: &str) -> (u16, String) {
        let response = client()
            .post(self.runs())
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }

    /// A run `bot` starts, checked created.
    async fn start_run(&self, body: Value) -> Value {
        let (status, run) = self.create(AGENT_KEY, body).await;
        assert_eq!(status, 201, "{run}");
        run
    }

    async fn get(&self, key: &str, id: &str) -> (u16, Value) {
        let response = client().get(format!("{}/{id}", self.runs())).bearer_auth(key).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    async fn delete(&self, key: &str, id: &str) -> (u16, Value) {
        let response = client().delete(format!("{}/{id}", self.runs())).bearer_auth(key).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    /// A chat call of `bot` in run `id`.
    async fn chat_in(&self, id: &str) -> reqwest::Response {
        self.call_in("/v1/chat/completions", id, hello("m")).await
    }

    /// A call of `bot` to `path` in run `id` (`/v1/messages` with Anthropic's key
    /// header, the others with a bearer token).
    async fn call_in(&self, path: &str, id: &str, body: Value) -> reqwest::Response {
        let request = client().post(format!("{}{path}", self.gw.url)).header("Flexway-Run", id).json(&body);
        let request = match path {
            "/v1/messages" => request.header("x-api-key", AGENT_KEY),
            _ => request.bearer_auth(AGENT_KEY),
        };
        request.send().await.unwrap()
    }

    /// A realtime session of `bot` in run `id`, opened (its `session.created` read).
    async fn session_in(&self, id: &str) -> Session {
        let url = format!("{}/v1/realtime?model=m", self.gw.url.replacen("http://", "ws://", 1));
        let mut request = url.into_client_request().unwrap();
        request.headers_mut().insert("authorization", format!("Bearer {AGENT_KEY}").parse().unwrap());
        request.headers_mut().insert("flexway-run", id.parse().unwrap());
        let (mut session, _) = tokio_tungstenite::connect_async(request).await.unwrap();
        assert_eq!(next_event(&mut session).await["type"], "session.created");
        session
    }

    /// An MCP session of `bot` (`initialize`, `notifications/initialized`): its id.
    async fn mcp_session(&self) -> String {
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": MCP_VERSION, "capabilities": {}, "clientInfo": {"name": "runs", "version": "1"}}});
        let response = self.mcp_post(None, None, &init).await;
        let session = response.headers()["mcp-session-id"].to_str().unwrap().to_owned();
        assert!(json_rpc_answer(response).await.get("result").is_some());
        let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        assert!(self.mcp_post(Some(&session), None, &initialized).await.status().is_success());
        session
    }

    /// `tools/call` of `tool` in `session`, by `bot` in run `id`: its JSON-RPC answer.
    async fn tool_in(&self, session: &str, id: &str, tool: &str, arguments: Value) -> Value {
        let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments}});
        json_rpc_answer(self.mcp_post(Some(session), Some(id), &call).await).await
    }

    async fn mcp_post(&self, session: Option<&str>, run: Option<&str>, body: &Value) -> reqwest::Response {
        let mut request = client()
            .post(format!("{}/mcp", self.gw.url))
            .bearer_auth(AGENT_KEY)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", MCP_VERSION)
            .json(body);
        if let Some(session) = session {
            request = request.header("mcp-session-id", session);
        }
        if let Some(run) = run {
            request = request.header("flexway-run", run);
        }
        request.send().await.unwrap()
    }
}

const MCP_VERSION: &str = "2025-11-25";

/// `flexway report --by run --format json` over `records` (written to an audit file):
/// run `id`'s row of locally billed calls.
fn report_row(records: &[AuditRecord], id: &str) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    std::fs::write(&audit, records.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect::<String>())
        .unwrap();
    let report = std::process::Command::new(binary())
        .args(["report", "--by", "run", "--format", "json", "--audit"])
        .arg(&audit)
        .output()
        .unwrap();
    assert!(report.status.success(), "{}", String::from_utf8_lossy(&report.stderr));
    let report: Value = serde_json::from_slice(&report.stdout).unwrap();
    let rows = report["local"]["rows"].as_array().unwrap();
    let mine: Vec<&Value> = rows.iter().filter(|row| row["run"] == id).collect();
    assert_eq!(mine.len(), 1, "one row for run {id}: {report}");
    mine[0].clone()
}

/// Asserts that run `id`'s `GET` and its row in `flexway report --by run` say the same
/// calls, tokens and euros, and gives the `GET`.
async fn get_matches_the_report(runs: &Runs, records: &[AuditRecord], id: &str) -> Value {
    let (status, state) = runs.get(AGENT_KEY, id).await;
    assert_eq!(status, 200, "{state}");
    let row = report_row(records, id);
    let tokens = row["prompt_tokens"].as_u64().unwrap() + row["completion_tokens"].as_u64().unwrap();
    assert_eq!(
        (state["calls"].as_u64(), state["spent"]["tokens"].as_u64(), micro(&state["spent"]["eur"])),
        (row["calls"].as_u64(), Some(tokens), row["cost_micro_eur"].as_u64().unwrap()),
        "GET {state} and the report's row {row}"
    );
    assert_eq!((row["tenant"].as_str(), row["agent"].as_str()), (Some("acme"), Some("bot")), "{row}");
    state
}

/// Euros as the API writes them (a JSON number, six places) in micro-euros.
fn micro(eur: &Value) -> u64 {
    (eur.as_f64().unwrap() * 1e6).round() as u64
}

/// Seconds from now to a run's `expires_at` (RFC 3339).
fn seconds_left(run: &Value) -> i64 {
    let expires: Timestamp = run["expires_at"].as_str().unwrap().parse().unwrap();
    (expires.unix_millis() - Timestamp::now().unix_millis()) / 1000
}

fn of_run<'a>(records: &'a [AuditRecord], id: &str) -> Vec<&'a AuditRecord> {
    records.iter().filter(|r| r.run.as_deref() == Some(id)).collect()
}

/// Asserts a refusal's status and OpenAI error code, and gives its message.
async fn refused(response: reqwest::Response, status: u16, code: &str) -> String {
    assert_eq!(response.status(), status);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
    body["error"]["message"].as_str().unwrap().to_owned()
}

async fn concurrent_calls_never_pass_a_run_budget_and_get_reads_what_the_audit_says(store: Store) {
    let runs = start_on(store, 1000).await;
    let run = runs.start_run(json!({"budget": {"tokens": 150}, "ttl": "15m", "label": "triage"})).await;
    let id = run["id"].as_str().unwrap();
    assert!(id.starts_with("run_"), "{run}");
    assert_eq!(run["budget"], json!({"tokens": 150}));
    assert_eq!(run["label"], "triage");
    let left = seconds_left(&run);
    assert!((890..=900).contains(&left), "15m from now: {left} s");

    // Each call reserves its prompt (18 tokens) and 20 completion tokens: 150 holds
    // three whole calls and a fourth clamped, never the twelve.
    let responses = join_all((0..12).map(|_| runs.chat_in(id))).await;
    let mut served = 0;
    let mut refusals = 0;
    for response in responses {
        if response.status() == 200 {
            served += 1;
            continue;
        }
        assert!(response.headers().get("retry-after").is_none(), "a run never resets");
        assert_eq!(response.headers().get("x-should-retry").unwrap(), "false");
        let message = refused(response, 429, "budget_exceeded").await;
        assert!(message.contains(id), "the refusal names the run: {message}");
        refusals += 1;
    }
    assert!(served >= 1 && refusals >= 1, "{served} served, {refusals} refused");

    let records = audit_records_until(&runs.audit, 12).await;
    let mine = of_run(&records, id);
    assert_eq!(mine.len(), 12, "every call that named the run is recorded with it, refused ones included");
    let tokens: u64 = mine.iter().map(|r| r.prompt_tokens + r.completion_tokens).sum();
    let cost: u64 = mine.iter().map(|r| r.cost_micro_eur).sum();
    assert!(tokens > 0 && tokens <= 150, "spent {tokens} of 150");

    let (status, state) = runs.get(AGENT_KEY, id).await;
    assert_eq!(status, 200, "{state}");
    assert_eq!(state["state"], "active");
    assert_eq!(state["spent"]["tokens"], tokens, "{state}");
    assert_eq!(micro(&state["spent"]["eur"]), cost, "{state}");
    assert_eq!(state["remaining"]["tokens"], 150 - tokens);
    assert!(state["remaining"].get("eur").is_none(), "no euro budget, nothing remains of one");
    assert_eq!(state["calls"], served, "{state}");
    assert_eq!(state["children"], json!([]));
    assert_eq!(state["label"], "triage");
    assert_eq!(runs.gw.live_reservations().await, 0);

    // `flexway report --by run` totals the run as GET does: its served calls, the
    // refused ones recorded with it but no calls of it.
    get_matches_the_report(&runs, &records, id).await;
}

/// A run's `GET` and `flexway report --by run` agree on its calls (those charged to
/// it, whatever they cost: a refusal and a refunded tool call are recorded with the
/// run but are not its calls, a tool of no price is one, a realtime session of two
/// responses is one), its tokens and its euros, to the micro-euro.
async fn a_runs_get_matches_the_audits_total_for_it(store: Store) {
    let tools = FakeMcp::start().await.unwrap();
    let runs = start_with(store, 0, Some(&tools)).await;
    let run = runs.start_run(json!({"budget": {"tokens": 160, "eur": 1}})).await;
    let id = run["id"].as_str().unwrap();

    // One session, two responses: one call of the run, two requests.
    let mut session = runs.session_in(id).await;
    assert_eq!(one_response(&mut session).await["type"], "response.done");
    assert_eq!(one_response(&mut session).await["type"], "response.done");
    session.close(None).await.unwrap();
    // A tool of no price, served: a call at 0 €; a tool with no result: refunded.
    let mcp = runs.mcp_session().await;
    let echoed = runs.tool_in(&mcp, id, "tools__echo", json!({"text": "hi"})).await;
    assert_eq!(echoed["result"]["content"][0]["text"], "hi", "{echoed}");
    let exploded = runs.tool_in(&mcp, id, "tools__explode", json!({})).await;
    assert!(exploded.get("error").is_some(), "{exploded}");

    let mut served = 0;
    loop {
        let response = runs.chat_in(id).await;
        if response.status() != 200 {
            refused(response, 429, "budget_exceeded").await;
            break;
        }
        served += 1;
        assert!(served < 10, "the run's 160 tokens never refused");
    }
    assert!(served >= 1, "a chat call fits after the session");
    refused(runs.chat_in(id).await, 429, "budget_exceeded").await;
    // A call of no run is in the audit too, in no run's row.
    assert_eq!(runs.gw.chat(AGENT_KEY, hello("m")).await.status(), 200);
    let records = audit_records_until(&runs.audit, served + 6).await;
    let mine = of_run(&records, id);
    assert_eq!(mine.len(), served + 5, "the session, the tool calls and the refusals are recorded with the run");
    let charged = |operation: Operation| -> Vec<(Option<bool>, u64)> {
        mine.iter().filter(|r| r.operation == operation).map(|r| (r.charged, r.cost_micro_eur)).collect()
    };
    assert_eq!(charged(Operation::Mcp), [(Some(true), 0), (Some(false), 0)], "echo served free, explode refunded");
    let session = charged(Operation::Realtime);
    assert!(matches!(session[..], [(Some(true), cost)] if cost > 0), "one record, charged: {session:?}");
    let chats: Vec<Option<bool>> = mine.iter().filter(|r| r.operation == Operation::Chat).map(|r| r.charged).collect();
    let mut expected = vec![Some(true); served];
    expected.extend([Some(false); 2]);
    assert_eq!(chats, expected, "the served chat calls charged, the refusals not");

    let state = get_matches_the_report(&runs, &records, id).await;
    assert_eq!(state["calls"], served + 2, "the chat calls, the session and the free tool call: {state}");
    let spent = state["spent"]["tokens"].as_u64().unwrap();
    assert!(spent > 0 && spent <= 160, "{state}");
    assert!(micro(&state["spent"]["eur"]) > 0, "{state}");
}

/// `Flexway-Run` is read on every HTTP door: a Responses, a Messages and an embeddings
/// call each count in the run, as a chat call does.
async fn a_call_on_every_http_door_counts_in_its_run(store: Store) {
    let runs = start_on(store, 0).await;
    let run = runs.start_run(json!({"budget": {"tokens": 10000, "eur": 1}})).await;
    let id = run["id"].as_str().unwrap();
    let calls = [
        ("/v1/responses", json!({"model": "m", "input": "hello", "max_output_tokens": 20})),
        ("/v1/messages", json!({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]})),
        ("/v1/embeddings", json!({"model": "m", "input": "hello"})),
    ];
    for (path, body) in calls {
        let response = runs.call_in(path, id, body).await;
        assert_eq!(response.status(), 200, "{path}: {}", response.text().await.unwrap());
    }
    let records = audit_records_until(&runs.audit, 3).await;
    let mine = of_run(&records, id);
    let operations: Vec<Operation> = mine.iter().map(|r| r.operation).collect();
    assert_eq!(operations, [Operation::Responses, Operation::Messages, Operation::Embeddings]);
    assert!(mine.iter().all(|r| r.prompt_tokens > 0 && r.cost_micro_eur > 0), "{mine:?}");

    let state = get_matches_the_report(&runs, &records, id).await;
    assert_eq!(state["calls"], 3, "{state}");
    let tokens: u64 = mine.iter().map(|r| r.prompt_tokens + r.completion_tokens).sum();
    let cost: u64 = mine.iter().map(|r| r.cost_micro_eur).sum();
    assert_eq!((state["spent"]["tokens"].as_u64(), micro(&state["spent"]["eur"])), (Some(tokens), cost), "{state}");
    assert_eq!(state["remaining"]["tokens"], 10000 - tokens);
}

async fn a_child_is_held_inside_its_parent_and_ends_with_it(store: Store) {
    let runs = start_on(store, 0).await;
    let (status, text) = runs.create_text(AGENT_KEY, r#"{"budget": {"tokens": 100, "eur": 0.5}, "ttl": "10m"}"#).await;
    assert_eq!(status, 201, "{text}");
    assert!(text.contains(r#""eur":0.500000"#), "euros written from micro-euros, as a number: {text}");
    let parent: Value = serde_json::from_str(&text).unwrap();
    let parent_id = parent["id"].as_str().unwrap();
    let child = runs.start_run(json!({"budget": {"tokens": 10000}, "ttl": "1h", "parent": parent_id})).await;
    let child_id = child["id"].as_str().unwrap();
    assert_eq!(child["parent"], parent_id);
    assert_eq!(child["expires_at"], parent["expires_at"], "a child lives no longer than its parent");

    // The child's budget is far above the parent's: the parent's refuses.
    let mut served = 0;
    let message = loop {
        let response = runs.chat_in(child_id).await;
        if response.status() != 200 {
            break refused(response, 429, "budget_exceeded").await;
        }
        served += 1;
        assert!(served < 10, "the parent's 100 tokens never refused");
    };
    assert!(message.contains(parent_id), "the parent's budget refused: {message}");
    assert!(served >= 1);
    let (_, child_state) = runs.get(AGENT_KEY, child_id).await;
    let (_, parent_state) = runs.get(AGENT_KEY, parent_id).await;
    let spent = child_state["spent"]["tokens"].as_u64().unwrap();
    assert!(spent > 0 && spent <= 100, "{child_state}");
    assert_eq!(parent_state["spent"]["tokens"], spent, "the child's calls count in the parent's tokens");
    assert_eq!(parent_state["children"], json!([child_id]));
    assert_eq!(child_state["calls"], served);

    // Ending the parent ends the child: its next call is refused, and no new child.
    let (status, ended) = runs.delete(AGENT_KEY, parent_id).await;
    assert_eq!(status, 200, "{ended}");
    assert_eq!(ended["state"], "ended");
    assert_eq!(ended["spent"], parent_state["spent"]);
    assert_eq!(runs.get(AGENT_KEY, child_id).await.1["state"], "ended");
    let message = refused(runs.chat_in(child_id).await, 409, "run_ended").await;
    assert!(message.contains(child_id), "{message}");
    let (status, body) = runs.create(AGENT_KEY, json!({"budget": {"tokens": 5}, "parent": parent_id})).await;
    assert_eq!((status, body["error"]["code"].as_str()), (409, Some("run_ended")), "{body}");
    let (status, again) = runs.delete(AGENT_KEY, parent_id).await;
    assert_eq!((status, again["state"].as_str()), (200, Some("ended")), "ending twice is no error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_its_tenants_and_agents_alone() {
    let runs = start(0).await;
    let run = runs.start_run(json!({"budget": {"eur": "0.01"}})).await;
    let id = run["id"].as_str().unwrap();
    let unknown = format!("run_{}", "0".repeat(32));
    for (key, id) in [(OTHER_KEY, id), (KEY, id), (AGENT_KEY, unknown.as_str()), (AGENT_KEY, "not-a-run")] {
        let (status, body) = runs.get(key, id).await;
        assert_eq!((status, body["error"]["code"].as_str()), (404, Some("run_not_found")), "{key} {id}: {body}");
        let (status, body) = runs.delete(key, id).await;
        assert_eq!((status, body["error"]["code"].as_str()), (404, Some("run_not_found")), "{key} {id}: {body}");
    }
    let as_other = |key: &str| {
        client()
            .post(format!("{}/v1/chat/completions", runs.gw.url))
            .bearer_auth(key)
            .header("Flexway-Run", id)
            .json(&hello("m"))
            .send()
    };
    refused(as_other(OTHER_KEY).await.unwrap(), 404, "run_not_found").await;
    // Another tenant's run as a parent is not found either.
    let (status, body) = runs.create(OTHER_KEY, json!({"budget": {"tokens": 5}, "parent": id})).await;
    assert_eq!(status, 400, "globex's key names no agent: {body}");
    let (status, body) = runs.create(KEY, json!({"budget": {"tokens": 5}, "parent": id})).await;
    assert_eq!(status, 400, "{body}");
    let helper = client()
        .post(runs.runs())
        .bearer_auth(KEY)
        .header("Flexway-Agent", "helper")
        .json(&json!({"budget": {"tokens": 5}, "parent": id}))
        .send()
        .await
        .unwrap();
    refused(helper, 404, "run_not_found").await;
    // Still intact for its owner.
    let (status, state) = runs.get(AGENT_KEY, id).await;
    assert_eq!((status, state["state"].as_str()), (200, Some("active")), "{state}");
    assert_eq!(micro(&state["remaining"]["eur"]), 10_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_run_is_refused_what_it_cannot_be() {
    let runs = start(0).await;
    let bad = [
        (json!({"budget": {"tokens": 5}, "ttl": "25h"}), "ttl"),
        (json!({"budget": {"tokens": 5}, "ttl": "90"}), "ttl"),
        (json!({"budget": {"tokens": 5}, "ttl": "0s"}), "ttl"),
        (json!({"budget": {}}), "budget"),
        (json!({"budget": {"tokens": 0}}), "budget"),
        (json!({"budget": {"eur": -1}}), "budget"),
        (json!({"budget": {"eur": "1,5"}}), "budget"),
        (json!({"budget": {"tokens": 5}, "label": "x".repeat(257)}), "label"),
        (json!({"budget": {"tokens": 5}, "parent": "run_1"}), "parent"),
    ];
    for (body, param) in bad {
        let (status, answer) = runs.create(AGENT_KEY, body.clone()).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(answer["error"]["code"], "invalid_request");
        assert_eq!(answer["error"]["param"], param, "{body}: {answer}");
    }
    for body in
        [json!({"budget": {"tokens": 5}, "deadline": "1h"}), json!({"budget": {"tokens": 5, "usd": 1}}), json!([])]
    {
        let (status, answer) = runs.create(AGENT_KEY, body.clone()).await;
        assert_eq!((status, answer["error"]["code"].as_str()), (400, Some("invalid_request")), "{body}: {answer}");
    }
    // Euros are read as written, never through a float: an exponent is refused.
    let (status, answer) = runs.create_raw(AGENT_KEY, r#"{"budget": {"eur": 1e-3}}"#).await;
    assert_eq!((status, answer["error"]["param"].as_str()), (400, Some("budget")), "{answer}");
    let (status, answer) = runs.create_raw(AGENT_KEY, r#"{"budget": {"eur": 0.0000015}}"#).await;
    assert_eq!((status, micro(&answer["budget"]["eur"])), (201, 2), "rounded half up: {answer}");
    let (status, answer) = runs.create(KEY, json!({"budget": {"tokens": 5}})).await;
    assert_eq!(status, 400);
    assert!(answer["error"]["message"].as_str().unwrap().contains("Flexway-Agent"), "{answer}");

    // The longest and the default lives, and an agent named in the header.
    let day = runs.start_run(json!({"budget": {"tokens": 5}, "ttl": "24h"})).await;
    let plain = runs.start_run(json!({"budget": {"eur": 2}})).await;
    assert!((86_390..=86_400).contains(&seconds_left(&day)), "{day}");
    assert!((3_590..=3_600).contains(&seconds_left(&plain)), "an hour by default: {plain}");
    assert_eq!(micro(&plain["budget"]["eur"]), 2_000_000);
    let named = client()
        .post(runs.runs())
        .bearer_auth(KEY)
        .header("Flexway-Agent", "helper")
        .json(&json!({"budget": {"tokens": 5}}))
        .send()
        .await
        .unwrap();
    assert_eq!(named.status(), 201);
    let named: Value = named.json().await.unwrap();
    let named = format!("{}/{}", runs.runs(), named["id"].as_str().unwrap());
    let as_helper = client().get(&named).bearer_auth(KEY).header("Flexway-Agent", "helper").send().await.unwrap();
    assert_eq!(as_helper.status(), 200);
    let as_bot = client().get(&named).bearer_auth(AGENT_KEY).send().await.unwrap();
    assert_eq!(as_bot.status(), 404, "helper's run is not bot's");
}

/// docs/budgets.md's worked example, scaled down: a planner's run and three sub-agents'
/// child runs calling in parallel. The children together may ask for more than the
/// parent holds; each draws on it as it goes, and the parent's budget stops them all.
async fn three_sub_agents_in_parallel_draw_on_their_planners_run(store: Store) {
    let runs = start_on(store, 50).await;
    let planner = runs.start_run(json!({"budget": {"tokens": 300}, "ttl": "15m", "label": "planner"})).await;
    let planner_id = planner["id"].as_str().unwrap().to_owned();
    let mut children = Vec::new();
    for _ in 0..3 {
        let child = runs.start_run(json!({"budget": {"tokens": 120}, "parent": planner_id})).await;
        children.push(child["id"].as_str().unwrap().to_owned());
    }
    // Each sub-agent calls until it is refused.
    let sub_agent = |id: String| {
        let runs = &runs;
        async move {
            let mut served = 0u64;
            loop {
                let response = runs.chat_in(&id).await;
                if response.status() != 200 {
                    return (served, refused(response, 429, "budget_exceeded").await);
                }
                served += 1;
            }
        }
    };
    let ended = join_all(children.iter().cloned().map(sub_agent)).await;
    assert!(
        ended.iter().any(|(_, message)| message.contains(&planner_id)),
        "the planner's budget stopped a sub-agent: {ended:?}"
    );
    let mut children_spent = 0;
    for id in &children {
        let (_, state) = runs.get(AGENT_KEY, id).await;
        let spent = state["spent"]["tokens"].as_u64().unwrap();
        assert!(spent <= 120, "a child within its own budget: {state}");
        children_spent += spent;
    }
    let (_, parent) = runs.get(AGENT_KEY, &planner_id).await;
    assert!(parent["spent"]["tokens"].as_u64().unwrap() <= 300, "{parent}");
    assert_eq!(parent["spent"]["tokens"], children_spent, "the planner's run spent what its sub-agents did");
    let served: u64 = ended.iter().map(|(served, _)| served).sum();
    assert_eq!(parent["calls"], served, "its calls are its children's");
    assert_eq!(parent["children"].as_array().unwrap().len(), 3);
    let records = audit_records_until(&runs.audit, usize::try_from(served).unwrap() + 3).await;
    let audited: u64 =
        children.iter().flat_map(|id| of_run(&records, id)).map(|r| r.prompt_tokens + r.completion_tokens).sum();
    assert_eq!(audited, children_spent, "the ledger and the audit agree, to the token");

    // The planner ends the run: its sub-agents' next calls are refused.
    assert_eq!(runs.delete(AGENT_KEY, &planner_id).await.0, 200);
    for id in &children {
        refused(runs.chat_in(id).await, 409, "run_ended").await;
    }
    assert_eq!(runs.gw.live_reservations().await, 0);
}

/// A run has at most `MAX_ANCESTORS` ancestors and `MAX_CHILDREN` children: each
/// level adds three lines to every call's one reservation (one DynamoDB transaction),
/// and a run's record names its children. A deeper or a wider run is refused at
/// creation with 400 `invalid_request` naming the cap, and what was created is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_refused_past_the_deepest_nesting_and_the_most_children() {
    use flexway::budget::run::{MAX_ANCESTORS, MAX_CHILDREN};

    let runs = start(0).await;
    let mut deepest = runs.start_run(json!({"budget": {"tokens": 1000}})).await;
    for _ in 0..MAX_ANCESTORS {
        deepest = runs.start_run(json!({"budget": {"tokens": 1000}, "parent": deepest["id"]})).await;
    }
    let (status, answer) = runs.create(AGENT_KEY, json!({"budget": {"tokens": 5}, "parent": deepest["id"]})).await;
    assert_eq!((status, answer["error"]["code"].as_str()), (400, Some("invalid_request")), "{answer}");
    assert_eq!(answer["error"]["param"], "parent");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains(&format!("at most {MAX_ANCESTORS} ancestors")), "{message}");
    // The deepest run still serves a call: every ancestor's lines fit one reservation.
    assert_eq!(runs.chat_in(deepest["id"].as_str().unwrap()).await.status(), 200);

    let parent = runs.start_run(json!({"budget": {"tokens": 1000}})).await;
    let child = json!({"budget": {"tokens": 5}, "parent": parent["id"]});
    for batch in 0..MAX_CHILDREN / 32 {
        let created = join_all((0..32).map(|_| runs.create(AGENT_KEY, child.clone()))).await;
        assert!(created.iter().all(|(status, _)| *status == 201), "batch {batch}: {created:?}");
    }
    let (status, answer) = runs.create(AGENT_KEY, child).await;
    assert_eq!((status, answer["error"]["code"].as_str()), (400, Some("invalid_request")), "{answer}");
    assert_eq!(answer["error"]["param"], "parent");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains(&format!("at most {MAX_CHILDREN} children")), "{message}");
    let (_, parent) = runs.get(AGENT_KEY, parent["id"].as_str().unwrap()).await;
    assert_eq!(parent["children"].as_array().unwrap().len(), MAX_CHILDREN);
}
