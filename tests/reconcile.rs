//! `flexway reconcile`: the real binary sets a JSONL audit against the provider's
//! usage (an export file, or its usage API served by a fake on loopback that answers
//! and pages as OpenAI's and Anthropic's do).
#![cfg(test)]

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, put};
use axum::{Json, Router};
use flexway::audit::{AuditRecord, sample};
use flexway::config::Metering;
use serde_json::{Value, json};

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{}", self.stdout, self.stderr))
    }
}

fn flexway(args: &[&str]) -> Run {
    flexway_env(args, &[])
}

fn flexway_env(args: &[&str], env: &[(&str, &str)]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_flexway")).args(args).envs(env.iter().copied()).output().unwrap();
    Run {
        code: out.status.code().unwrap(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn record(
    ts: &str,
    tenant: &str,
    agent: Option<&str>,
    backend: &str,
    model: &str,
    tokens: (u64, u64),
    cost: u64,
) -> AuditRecord {
    AuditRecord {
        ts: ts.parse().unwrap(),
        request_id: format!("req-{ts}"),
        agent: agent.map(Into::into),
        model_served: Some(model.into()),
        prompt_tokens: tokens.0,
        completion_tokens: tokens.1,
        ..sample::record(tenant, Some(backend), Metering::Local, cost)
    }
}

fn write_audit(dir: &Path, records: &[AuditRecord], extra: &str) -> String {
    let mut text: String = records.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
    text.push_str(extra);
    let path = dir.join("audit.jsonl");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Two tenants on `openai`, model gpt-4o: acme's bot twice on 2026-11-02 (1000/200
/// tokens, 0.5 € and 0.25 €), globex once on 2026-11-03 (1000/200, 1.5 €): 3,600
/// tokens and 2.25 € metered.
fn two_tenants() -> Vec<AuditRecord> {
    vec![
        record("2026-11-02T08:00:00Z", "acme", Some("bot"), "openai", "gpt-4o", (1000, 200), 500_000),
        record("2026-11-02T09:00:00Z", "acme", Some("bot"), "openai", "gpt-4o", (1000, 200), 250_000),
        record("2026-11-03T10:00:00Z", "globex", None, "openai", "gpt-4o", (1000, 200), 1_500_000),
    ]
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn a_provider_five_percent_above_gives_a_drift_of_5_in_105_and_a_chargeback_scaled_by_1_05() {
    let dir = tempfile::tempdir().unwrap();
    let audit = write_audit(dir.path(), &two_tenants(), "");
    // 5% above on every day, in tokens and in cost (2.25 € × 1.05 = 2.3625 €).
    let usage = write(
        dir.path(),
        "usage.csv",
        "date,backend,model,input_tokens,output_tokens,cost_eur\n\
         2026-11-02,openai,gpt-4o,2100,420,0.7875\n\
         2026-11-03,openai,gpt-4o,1050,210,1.575\n",
    );
    let run =
        flexway(&["reconcile", "--audit", &audit, "--provider-usage", &usage, "--chargeback", "--format", "json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let out = run.json();
    let rows = out["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{out:#}");
    assert_eq!(
        (&rows[0]["date"], &rows[0]["gateway_input_tokens"], &rows[0]["provider_input_tokens"]),
        (&json!("2026-11-02"), &json!(2000), &json!(2100))
    );
    for key in ["backend", "model", "gateway_output_tokens", "provider_output_tokens", "drift_ratio"] {
        assert!(rows[0].get(key).is_some(), "row key {key}: {out:#}");
    }
    assert!(close(rows[1]["drift_ratio"].as_f64().unwrap(), 5.0 / 105.0), "{out:#}");
    let backend = &out["backends"][0];
    assert_eq!((&backend["backend"], &backend["growing"]), (&json!("openai"), &json!(false)));
    assert!(close(backend["drift_ratio"].as_f64().unwrap(), 5.0 / 105.0), "{out:#}");

    let chargeback = out["chargeback"].as_array().unwrap();
    let pick = |tenant: &str| chargeback.iter().find(|c| c["tenant"] == tenant).unwrap();
    assert_eq!((&pick("acme")["agent"], &pick("acme")["backend"]), (&json!("bot"), &json!("openai")));
    assert_eq!(
        (pick("acme")["cost_micro_eur"].as_u64(), pick("acme")["corrected_cost_micro_eur"].as_u64()),
        (Some(750_000), Some(787_500))
    );
    assert_eq!(pick("globex")["corrected_cost_micro_eur"].as_u64(), Some(1_575_000));
    assert!(close(pick("globex")["corrected_cost_eur"].as_f64().unwrap(), 1.575));
    assert!(close(pick("globex")["cost_eur"].as_f64().unwrap(), 1.5));
    let total: u64 = chargeback.iter().map(|c| c["corrected_cost_micro_eur"].as_u64().unwrap()).sum();
    assert_eq!(total, 2_362_500, "the corrected total is the provider's");

    // Without the provider's cost, the tokens' ratio scales: the same 1.05.
    let tokens_only = write(
        dir.path(),
        "tokens.csv",
        "date,backend,model,input_tokens,output_tokens\n2026-11-02,openai,gpt-4o,2100,420\n2026-11-03,openai,gpt-4o,1050,210\n",
    );
    let run =
        flexway(&["reconcile", "--audit", &audit, "--provider-usage", &tokens_only, "--chargeback", "--format", "csv"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.starts_with("tenant,agent,backend,cost_eur,corrected_cost_eur,drift_ratio\n"), "{}", run.stdout);
    assert!(run.stdout.contains("acme,bot,openai,0.750000,0.787500,0.047619\n"), "{}", run.stdout);
    assert!(run.stdout.contains("globex,-,openai,1.500000,1.575000,0.047619\n"), "{}", run.stdout);

    // The document people read states the drift above the corrected chargeback.
    let run = flexway(&["reconcile", "--audit", &audit, "--provider-usage", &usage, "--chargeback"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("| openai | 3600 | 3780 | 180 | 0.047619 | no |"), "{}", run.stdout);
    assert!(run.stdout.contains("- openai: drift 0.047619; each share scaled by the provider's stated cost (2.250000 € metered, 2.362500 € corrected)."), "{}", run.stdout);
    assert!(run.stdout.contains("| acme | bot | openai | 0.750000 | 0.787500 |"), "{}", run.stdout);
}

#[test]
fn provider_exports_of_openai_and_anthropic_read_with_a_model_the_gateway_never_saw() {
    let dir = tempfile::tempdir().unwrap();
    let mut records = two_tenants();
    records.push(record("2026-11-02T11:00:00Z", "acme", None, "claude", "claude-sonnet-4-5", (3000, 100), 9_000));
    records.push(record("2026-11-02T12:00:00Z", "acme", None, "local-vllm", "llama", (10, 10), 0));
    let audit = write_audit(dir.path(), &records, "");
    // OpenAI's organization usage API: buckets of Unix seconds, cached tokens inside
    // the input. 2026-11-02 00:00 UTC is 1793577600.
    let openai = json!({"object": "page", "has_more": false, "next_page": null, "data": [
        {"object": "bucket", "start_time": 1_793_577_600_u64, "end_time": 1_793_664_000_u64, "results": [
            {"object": "organization.usage.completions.result", "input_tokens": 2000, "output_tokens": 400,
             "input_cached_tokens": 0, "num_model_requests": 2, "model": "gpt-4o"}]},
        {"object": "bucket", "start_time": 1_793_664_000_u64, "end_time": 1_793_750_400_u64, "results": [
            {"object": "organization.usage.completions.result", "input_tokens": 1000, "output_tokens": 200,
             "num_model_requests": 1, "model": "gpt-4o"}]}]});
    let openai = write(dir.path(), "openai.json", &openai.to_string());
    let run = flexway(&[
        "reconcile",
        "--audit",
        &audit,
        "--provider-usage",
        &openai,
        "--backend",
        "openai",
        "--format",
        "json",
    ]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let out = run.json();
    assert_eq!(out["backends"][0]["drift_ratio"], json!(0.0), "{out:#}");
    assert_eq!(out["not_compared"], json!(["claude", "local-vllm"]), "backends the export does not cover");

    // Anthropic's usage report: cache reads and writes counted apart, summed into the
    // input; a model the gateway never routed to is shown, not dropped.
    let anthropic = json!({"has_more": false, "next_page": null, "data": [
        {"starting_at": "2026-11-02T00:00:00Z", "ending_at": "2026-11-03T00:00:00Z", "results": [
            {"uncached_input_tokens": 1000, "cache_read_input_tokens": 1500,
             "cache_creation": {"ephemeral_5m_input_tokens": 500, "ephemeral_1h_input_tokens": 0},
             "output_tokens": 100, "model": "claude-sonnet-4-5", "service_tier": "standard"},
            {"uncached_input_tokens": 40, "cache_read_input_tokens": 0, "output_tokens": 2,
             "model": "claude-haiku-4-5"}]}]});
    let anthropic = write(dir.path(), "anthropic.json", &anthropic.to_string());
    let run = flexway(&[
        "reconcile",
        "--audit",
        &audit,
        "--provider-usage",
        &anthropic,
        "--backend",
        "claude",
        "--format",
        "json",
    ]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let out = run.json();
    let rows = out["rows"].as_array().unwrap();
    let sonnet = rows.iter().find(|r| r["model"] == "claude-sonnet-4-5").unwrap();
    assert_eq!((&sonnet["provider_input_tokens"], &sonnet["provider_cached_tokens"]), (&json!(3000), &json!(1500)));
    assert_eq!((&sonnet["seen_by"], &sonnet["drift_ratio"]), (&json!("both"), &json!(0.0)));
    let unseen = rows.iter().find(|r| r["model"] == "claude-haiku-4-5").expect("the unseen model is listed");
    assert_eq!(
        (&unseen["seen_by"], &unseen["gateway_input_tokens"], &unseen["drift_ratio"]),
        (&json!("provider"), &json!(0), &json!(1.0))
    );
    // The reverse: what the gateway saw and the provider does not show.
    let csv = write(dir.path(), "gone.csv", "date,model,input_tokens,output_tokens\n2026-11-02,gpt-4o,2000,400\n");
    let run =
        flexway(&["reconcile", "--audit", &audit, "--provider-usage", &csv, "--backend", "openai", "--format", "csv"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("2026-11-03,openai,gpt-4o,1000,200,0,0,0,0,-,gateway\n"), "{}", run.stdout);
}

#[test]
fn unreadable_lines_on_either_side_are_listed_and_the_run_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let audit = write_audit(dir.path(), &two_tenants(), "{\"schema_version\": 1, \"cut\n");
    let usage = write(
        dir.path(),
        "usage.csv",
        "date,backend,model,input_tokens,output_tokens\n2026-11-02,openai,gpt-4o,2100,420\n2026-11-03,openai,gpt-4o,many,210\n",
    );
    let run = flexway(&["reconcile", "--audit", &audit, "--provider-usage", &usage, "--format", "json"]);
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert!(run.stderr.contains("unreadable: audit: ") && run.stderr.contains("audit.jsonl: line 4"), "{}", run.stderr);
    assert!(
        run.stderr.contains("unreadable: provider usage: ")
            && run.stderr.contains("usage.csv: line 3: input_tokens \"many\""),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("2 unreadable line(s)"), "{}", run.stderr);
    assert_eq!(run.json()["rows"].as_array().unwrap().len(), 2, "the readable rest is reconciled");

    // A push that fails ends the run, and the unreadable lines are still named first.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nowhere = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let args = ["reconcile", "--audit", &audit, "--provider-usage", &usage, "--format", "json", "--push", &nowhere];
    let run = flexway(&args);
    assert_ne!(run.code, 0, "{}", run.stderr);
    assert!(run.stderr.contains("--push"), "{}", run.stderr);
    assert!(run.stderr.contains("audit.jsonl: line 4") && run.stderr.contains("usage.csv: line 3"), "{}", run.stderr);
}

#[test]
fn usage_errors_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let audit = write_audit(dir.path(), &two_tenants(), "");
    let json = write(dir.path(), "o.json", "{\"data\": []}");
    let run = flexway(&["reconcile", "--audit", &audit, "--provider-usage", &json]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("--backend"), "{}", run.stderr);
    let run = flexway(&["reconcile", "--audit", &audit, "--fetch"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("--from"), "{}", run.stderr);
}

#[test]
fn a_drift_that_grows_from_one_day_to_the_next_is_flagged() {
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<AuditRecord> = (1..=3)
        .map(|day| record(&format!("2026-11-0{day}T08:00:00Z"), "acme", None, "openai", "gpt-4o", (900, 100), 1000))
        .collect();
    let audit = write_audit(dir.path(), &records, "");
    // 1000 tokens a day metered; the provider counts 1010, 1030, 1060.
    let usage = write(
        dir.path(),
        "usage.csv",
        "date,backend,model,input_tokens,output_tokens\n2026-11-01,openai,gpt-4o,910,100\n\
         2026-11-02,openai,gpt-4o,930,100\n2026-11-03,openai,gpt-4o,960,100\n",
    );
    let run = flexway(&["reconcile", "--audit", &audit, "--provider-usage", &usage, "--format", "json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let out = run.json();
    assert_eq!(out["backends"][0]["growing"], json!(true), "{out:#}");
    assert_eq!(out["backends"][0]["periods"].as_array().unwrap().len(), 3);
    assert!(run.stderr.contains("warning: openai: the drift grew"), "{}", run.stderr);
}

// ---------------------------------------------------------------------------------
// The providers' usage APIs and a Pushgateway, faked on loopback.

#[derive(Default)]
struct Seen {
    /// Each request's query string, in order.
    queries: Vec<String>,
    pushed: Vec<(String, String)>,
}

type Shared = Arc<Mutex<Seen>>;

const OPENAI_KEY: &str = "sk-admin-openai-test";
const ANTHROPIC_KEY: &str = "sk-ant-admin-test";

/// OpenAI's completions usage: two pages of one daily bucket each, the second
/// reached with `page=` the first's `next_page`.
async fn openai_completions(
    State(seen): State<Shared>,
    headers: HeaderMap,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<Json<Value>, StatusCode> {
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(&format!("Bearer {OPENAI_KEY}")) {
        return Err(StatusCode::UNAUTHORIZED);
    }
    let q = |name: &str| query.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    seen.lock().unwrap().queries.push(format!("{query:?}"));
    if q("start_time").as_deref() != Some("1793577600") || q("bucket_width").as_deref() != Some("1d") {
        return Err(StatusCode::BAD_REQUEST);
    }
    let bucket = |start: u64, input: u64| {
        json!({"object": "bucket", "start_time": start, "end_time": start + 86_400, "results": [
            {"object": "organization.usage.completions.result", "input_tokens": input, "output_tokens": input / 5,
             "input_cached_tokens": 0, "num_model_requests": 1, "model": "gpt-4o"}]})
    };
    Ok(Json(match q("page").as_deref() {
        None => {
            json!({"object": "page", "data": [bucket(1_793_577_600, 2100)], "has_more": true, "next_page": "page_AAAA"})
        }
        Some("page_AAAA") => {
            json!({"object": "page", "data": [bucket(1_793_664_000, 1050)], "has_more": false, "next_page": null})
        }
        Some(_) => return Err(StatusCode::BAD_REQUEST),
    }))
}

async fn openai_embeddings(headers: HeaderMap) -> Result<Json<Value>, StatusCode> {
    if headers.get("authorization").is_none() {
        return Err(StatusCode::UNAUTHORIZED);
    }
    Ok(Json(json!({"object": "page", "data": [], "has_more": false, "next_page": null})))
}

/// Anthropic's usage report, paged the same way, keyed by `x-api-key`.
async fn anthropic_messages(
    State(seen): State<Shared>,
    headers: HeaderMap,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<Json<Value>, StatusCode> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    if header("x-api-key").as_deref() != Some(ANTHROPIC_KEY) || header("anthropic-version").is_none() {
        return Err(StatusCode::UNAUTHORIZED);
    }
    seen.lock().unwrap().queries.push(format!("{query:?}"));
    let page = query.iter().find(|(k, _)| k == "page").map(|(_, v)| v.as_str());
    let result = |model: &str| json!({"uncached_input_tokens": 2900, "cache_read_input_tokens": 100, "output_tokens": 100, "model": model});
    Ok(Json(match page {
        None => json!({"data": [{"starting_at": "2026-11-02T00:00:00Z", "ending_at": "2026-11-03T00:00:00Z",
                                 "results": [result("claude-sonnet-4-5")]}], "has_more": true, "next_page": "page_MjAy"}),
        Some("page_MjAy") => {
            json!({"data": [{"starting_at": "2026-11-03T00:00:00Z", "ending_at": "2026-11-04T00:00:00Z",
                                 "results": [result("claude-opus-4-1")]}], "has_more": false, "next_page": null})
        }
        Some(_) => return Err(StatusCode::BAD_REQUEST),
    }))
}

async fn pushgateway(State(seen): State<Shared>, uri: axum::http::Uri, body: String) -> StatusCode {
    seen.lock().unwrap().pushed.push((uri.path().to_owned(), body));
    StatusCode::OK
}

async fn fake_apis() -> (String, Shared) {
    let seen = Shared::default();
    let app = Router::new()
        .route("/v1/organization/usage/completions", get(openai_completions))
        .route("/v1/organization/usage/embeddings", get(openai_embeddings))
        .route("/v1/organizations/usage_report/messages", get(anthropic_messages))
        .route("/metrics/job/{job}", put(pushgateway))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), seen)
}

fn fetch_config(dir: &Path, base: &str) -> String {
    write(
        dir,
        "flexway.yaml",
        &format!(
            "version: 1\nai:\n  default_backend: openai\n  backends:\n    openai:\n      kind: openai\n      url: http://127.0.0.1:9/v1\n      \
             default_model: gpt-4o\n      usage_api: {{kind: openai, secret: env:OPENAI_ADMIN_KEY, url: \"{base}\"}}\n    \
             claude:\n      kind: anthropic\n      url: http://127.0.0.1:9\n      default_model: claude-sonnet-4-5\n      \
             usage_api: {{kind: anthropic, secret: env:ANTHROPIC_ADMIN_KEY, url: \"{base}\"}}\n\
             tenants:\n  acme:\n    keys: [{{sha256: \"{}\"}}]\n",
            "ab".repeat(32)
        ),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn fetch_follows_every_page_of_both_usage_apis_and_pushes_the_drift() {
    let (base, seen) = fake_apis().await;
    let dir = tempfile::tempdir().unwrap();
    let mut records = two_tenants();
    records.push(record("2026-11-02T11:00:00Z", "acme", None, "claude", "claude-sonnet-4-5", (3000, 100), 9_000));
    let audit = write_audit(dir.path(), &records, "");
    let config = fetch_config(dir.path(), &base);
    let args = [
        "reconcile",
        "--audit",
        &audit,
        "--fetch",
        "--config",
        &config,
        "--from",
        "2026-11-02",
        "--to",
        "2026-11-03",
        "--format",
        "json",
        "--chargeback",
        "--push",
        &base,
    ]
    .map(str::to_owned);
    let run = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        flexway_env(&args, &[("OPENAI_ADMIN_KEY", OPENAI_KEY), ("ANTHROPIC_ADMIN_KEY", ANTHROPIC_KEY)])
    })
    .await
    .unwrap();
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(!run.stderr.contains(OPENAI_KEY) && !run.stdout.contains(OPENAI_KEY), "an admin key never printed");
    let out = run.json();
    let backend =
        |name: &str| out["backends"].as_array().unwrap().iter().find(|b| b["backend"] == name).unwrap().clone();
    // Both OpenAI pages read: 5% above the gateway on both days.
    assert!(close(backend("openai")["drift_ratio"].as_f64().unwrap(), 5.0 / 105.0), "{out:#}");
    assert_eq!(backend("openai")["provider_tokens"], json!(3780));
    // Both Anthropic pages: the second page's model the gateway never saw is listed.
    let rows = out["rows"].as_array().unwrap();
    let opus = rows.iter().find(|r| r["model"] == "claude-opus-4-1").expect("second page read");
    assert_eq!((&opus["seen_by"], &opus["date"]), (&json!("provider"), &json!("2026-11-03")));
    let total: u64 = out["chargeback"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["backend"] == "openai")
        .map(|c| c["corrected_cost_micro_eur"].as_u64().unwrap())
        .sum();
    assert_eq!(total, 2_362_500);

    let seen = seen.lock().unwrap();
    assert!(seen.queries.iter().filter(|q| q.contains("page_AAAA")).count() == 1, "{:?}", seen.queries);
    assert!(seen.queries.iter().filter(|q| q.contains("page_MjAy")).count() == 1, "{:?}", seen.queries);
    let (path, body) = seen.pushed.first().expect("the drift was pushed");
    assert_eq!(path, "/metrics/job/flexway_reconcile");
    assert!(body.contains("# TYPE flexway_reconciliation_drift_ratio gauge"), "{body}");
    let line = body.lines().find(|l| l.starts_with("flexway_reconciliation_drift_ratio{backend=\"openai\"} ")).unwrap();
    let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(close(value, 5.0 / 105.0), "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_admin_key_fails_the_fetch_without_printing_it() {
    let (base, _) = fake_apis().await;
    let dir = tempfile::tempdir().unwrap();
    let audit = write_audit(dir.path(), &two_tenants(), "");
    let config = fetch_config(dir.path(), &base);
    let args =
        ["reconcile", "--audit", &audit, "--fetch", "--config", &config, "--from", "2026-11-02", "--backend", "openai"]
            .map(str::to_owned);
    let run = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        flexway_env(&args, &[("OPENAI_ADMIN_KEY", "sk-wrong-key")])
    })
    .await
    .unwrap();
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(run.stderr.contains("openai") && run.stderr.contains("401"), "{}", run.stderr);
    assert!(!run.stderr.contains("sk-wrong-key"), "{}", run.stderr);
}
