//! The audit finance bills from (SPEC §9): one metadata-only record per call, on every
//! outcome, and a chargeback report that equals the ledger.
#![cfg(test)]

use std::sync::Arc;

use flexway::audit::{AuditRecord, BudgetState, Operation, UsageSource};
use flexway_testkit::*;
use serde_json::{Value, json};

const CANARY_KEY: &str = "sk-CANARY-KEY-5b1e0c";
const CANARY_PROMPT: &str = "CANARYPROMPT9d2f";
const CANARY_USER: &str = "CANARY-USER-77aa";

fn audit_config(model: &FakeModel) -> String {
    let cut = model.scenario_url(&Scenario { cut_after: Some(2), ..Default::default() });
    let bare = model.scenario_url(&Scenario { no_usage: true, ..Default::default() });
    let failing = model.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: file, path: audit.jsonl, hash_salt: "env:AUDIT_SALT"}}
tenants:
  acme:
    keys:
      - sha256: {key}
      - {{sha256: {cut_key}, agent: cutter}}
      - {{sha256: {bare_key}, agent: bare}}
      - {{sha256: {fail_key}, agent: failing}}
    budgets: {{tokens_per_day: 100000}}
    agents:
      cutter: {{backend: cut}}
      bare: {{backend: bare}}
      failing: {{backend: failing}}
      tight: {{budgets: {{tokens_per_day: 10}}}}
ai:
  default_backend: main
  backends:
    main: {{url: "{main}", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 3}}}}
    cut: {{url: "{cut}", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 3}}}}
    bare: {{url: "{bare}", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 3}}}}
    failing: {{url: "{failing}"}}
"#,
        key = sha(CANARY_KEY),
        cut_key = sha("sk-cut"),
        bare_key = sha("sk-bare"),
        fail_key = sha("sk-fail"),
        main = model.url(),
    )
}

fn prompt(stream: bool) -> Value {
    json!({"model": "m", "stream": stream, "user": CANARY_USER,
        "messages": [{"role": "user", "content": format!("tell me {CANARY_PROMPT} please")}]})
}

async fn wait_for_records(gw: &Flexway, n: usize) -> Vec<AuditRecord> {
    gw.file_records_until("audit.jsonl", n, 200).await
}

fn request_id(r: &reqwest::Response) -> String {
    r.headers()["flexway-request-id"].to_str().unwrap().to_owned()
}

/// Runs one call of each outcome; returns the request ids in order.
async fn mixed_run(gw: &Flexway) -> Vec<(String, &'static str)> {
    let mut ids = Vec::new();
    let ok = gw.chat(CANARY_KEY, prompt(false)).await;
    assert_eq!(ok.status(), 200);
    ids.push((request_id(&ok), "ok"));
    let _ = ok.text().await;
    let streamed = gw.post("/v1/chat/completions", CANARY_KEY, prompt(true)).send().await.unwrap();
    ids.push((request_id(&streamed), "streamed"));
    let _ = sse_data(streamed).await;
    wait_for_records(gw, 2).await;
    let bare = gw.post("/v1/chat/completions", "sk-bare", prompt(true)).send().await.unwrap();
    ids.push((request_id(&bare), "streamed-no-usage"));
    let _ = sse_data(bare).await;
    wait_for_records(gw, 3).await;
    let limited = gw
        .post("/v1/chat/completions", CANARY_KEY, prompt(false))
        .header("Flexway-Agent", "tight")
        .send()
        .await
        .unwrap();
    assert_eq!(limited.status(), 429);
    ids.push((request_id(&limited), "429"));
    let failed = gw.chat("sk-fail", prompt(false)).await;
    assert_eq!(failed.status(), 503);
    ids.push((request_id(&failed), "5xx"));
    let cut = gw.post("/v1/chat/completions", "sk-cut", prompt(true)).send().await.unwrap();
    ids.push((request_id(&cut), "cut"));
    let _ = sse_data(cut).await;
    wait_for_records(gw, 6).await;
    let invalid = gw
        .post("/v1/chat/completions", CANARY_KEY, json!({"model": CANARY_PROMPT, "messages": "not a list"}))
        .send()
        .await
        .unwrap();
    assert_eq!(invalid.status(), 400);
    ids.push((request_id(&invalid), "400"));
    let unidentified = gw.chat("sk-unknown", prompt(false)).await;
    assert_eq!(unidentified.status(), 401);
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_record_per_call_with_the_right_usage_source() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start_with_env(&audit_config(&model), &[("AUDIT_SALT", "pepper-1")]);
    let ids = mixed_run(&gw).await;
    let records = wait_for_records(&gw, ids.len()).await;
    // A marker call after them all: once its record is in, a second record of any call
    // before it, or one for the bad key, would be in before it.
    let marker = gw.chat(CANARY_KEY, prompt(false)).await;
    assert_eq!(marker.status(), 200);
    let marker_id = request_id(&marker);
    let after = wait_for_records(&gw, ids.len() + 1).await;
    assert_eq!(after.len(), ids.len() + 1, "one record per identified call, none for a bad key");
    assert_eq!(after[ids.len()].request_id, marker_id);
    for ((id, kind), record) in ids.iter().zip(&records) {
        assert_eq!(&record.request_id, id, "{kind}: records are in the order calls ended");
        let expected = match *kind {
            "ok" | "streamed" => (200, None, UsageSource::Reported),
            "streamed-no-usage" => (200, None, UsageSource::Estimated),
            "429" => (429, Some("budget_exceeded"), UsageSource::Reported),
            "5xx" => (503, Some("upstream_unavailable"), UsageSource::Reported),
            "cut" => (200, Some("upstream_error"), UsageSource::Estimated),
            "400" => (400, Some("invalid_request"), UsageSource::Reported),
            other => panic!("{other}"),
        };
        assert_eq!((record.status, record.error_code.map(|c| c.as_str()), record.usage_source), expected, "{kind}");
        assert_eq!(record.tenant, "acme");
        assert_eq!(record.schema_version, 1);
    }
    let ok = &records[0];
    assert!(ok.prompt_tokens > 0 && ok.completion_tokens > 0 && ok.cost_micro_eur > 0);
    assert_eq!(ok.operation, Operation::Chat);
    assert_eq!(ok.backend.as_deref(), Some("main"));
    assert_eq!(ok.budget_state, BudgetState::Ok);
    assert_eq!(records[3].budget_state, BudgetState::Exceeded);
    assert_eq!(records[3].agent.as_deref(), Some("tight"));
    assert!(records[5].completion_tokens > 0, "a broken stream is charged what was relayed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canaries_never_reach_the_audit_or_the_logs() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start_with_env(&audit_config(&model), &[("AUDIT_SALT", "pepper-2")]);
    let ids = mixed_run(&gw).await;
    let _ = wait_for_records(&gw, ids.len()).await;
    let audit = std::fs::read_to_string(gw.dir.path().join("audit.jsonl")).unwrap();
    let logs = gw.logs();
    // The fake model echoes the prompt into its completion: both are covered.
    for canary in [CANARY_PROMPT, CANARY_USER, CANARY_KEY, &sha(CANARY_KEY), "pepper-2"] {
        assert!(!audit.contains(canary), "{canary} reached the audit");
        assert!(!logs.contains(canary), "{canary} reached the logs");
    }
    let first: AuditRecord = serde_json::from_str(audit.lines().next().unwrap()).unwrap();
    assert_eq!(first.key_hash.len(), 64);
    assert!(first.user_hash.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_totals_equal_the_ledger() {
    let model = FakeModel::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let audit_path = dir.path().join("audit.jsonl");
    let adapters = flexway::gateway::Adapters {
        budgets: Arc::new(flexway::budget::EmbeddedBudgetStore::open(&dir.path().join("ledger")).unwrap()),
        audit: Arc::new(flexway::audit::FileAuditSink::open(&audit_path).unwrap()),
        export: flexway::telemetry::Export::Batched,
        cache: None,
    };
    let yaml = audit_config(&model)
        .replace("audit: {sink: file, path: audit.jsonl, hash_salt: \"env:AUDIT_SALT\"}", "audit: {sink: stdout}");
    let gw = serve_in_process(&yaml, adapters).await;
    for i in 0..5 {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "word ".repeat(i + 1)}]});
        assert_eq!(gw.chat(CANARY_KEY, body).await.status(), 200);
    }
    let streamed = client()
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth("sk-bare")
        .json(&prompt(true))
        .send()
        .await
        .unwrap();
    let _ = sse_data(streamed).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["report", "--audit", audit_path.to_str().unwrap(), "--format", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ledger = gw.ledger("acme", None).await;
    let text = report.to_string();
    let total_cost = find_u64(&report, "local_total", "cost_micro_eur").unwrap_or_else(|| panic!("{text}"));
    let prompt = find_u64(&report, "local_total", "prompt_tokens").unwrap();
    let completion = find_u64(&report, "local_total", "completion_tokens").unwrap();
    assert_eq!(total_cost, ledger[2], "report euros = ledger euros");
    assert_eq!(prompt + completion, ledger[0], "report tokens = ledger tokens");

    // Each record carries the date its reservation counted on: the day counter of
    // that date holds exactly the records of that period (one rule for both).
    let text = std::fs::read_to_string(&audit_path).unwrap();
    let records: Vec<flexway::audit::AuditRecord> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut per_period: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    for record in &records {
        let period = record.period.clone().unwrap_or_else(|| panic!("no period: {record:?}"));
        *per_period.entry(period).or_default() += record.prompt_tokens + record.completion_tokens;
    }
    for (period, tokens) in per_period {
        use flexway::budget::{CounterKey, Period, Unit};
        let day = CounterKey::stamped("acme", None, Unit::Tokens, Period::Day, &period);
        assert_eq!(gw.gateway.budgets.used(&[day]).await.unwrap(), [tokens], "the day {period} in the ledger");
    }
}

/// `report[section][field]`, looking one level down too.
fn find_u64(report: &Value, section: &str, field: &str) -> Option<u64> {
    report
        .get(section)
        .and_then(|s| s.get(field).or_else(|| s.get("totals").and_then(|t| t.get(field))))
        .and_then(Value::as_u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_calls_and_cost_with_their_dimensions() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start_with_env(&audit_config(&model), &[("AUDIT_SALT", "pepper-3")]);
    let ids = mixed_run(&gw).await;
    let records = wait_for_records(&gw, ids.len()).await;
    let text = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
    let calls_main =
        r#"flexway_inference_calls_total{tenant="acme",backend="main",metered_by="local",capability="chat"} 2"#;
    assert!(text.contains(calls_main), "{text}");
    let cost: u64 = records.iter().filter(|r| r.backend.as_deref() == Some("main")).map(|r| r.cost_micro_eur).sum();
    let cost_line = format!(
        r#"flexway_inference_cost_eur_total{{tenant="acme",backend="main",metered_by="local",capability="chat"}} {}"#,
        flexway::money::MicroEur(cost).to_eur_string()
    );
    assert!(text.contains(&cost_line), "{cost_line}\n{text}");
    for family in [
        "flexway_gateway_overhead_seconds_count",
        "flexway_time_to_first_byte_seconds_bucket",
        "flexway_budget_remaining",
        "flexway_breaker_state",
        "flexway_usage_drift_tokens",
    ] {
        assert!(text.contains(family), "{family} missing\n{text}");
    }
    for canary in [CANARY_PROMPT, CANARY_USER, CANARY_KEY] {
        assert!(!text.contains(canary));
    }
}

#[tokio::test]
async fn the_stdout_sink_writes_one_json_line_per_call() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    let ok = gw.chat(KEY, hello("m")).await;
    let id = ok.headers()["flexway-request-id"].to_str().unwrap().to_owned();
    assert_eq!(ok.status(), 200);
    let refused = gw.chat(KEY, json!({"model": "m"})).await;
    assert_eq!(refused.status(), 400);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let lines = loop {
        let lines = gw.stdout();
        if lines.len() >= 2 || std::time::Instant::now() > deadline {
            break lines;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(lines.len(), 2, "{lines:?}");
    let first: AuditRecord = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!((first.request_id.as_str(), first.status), (id.as_str(), 200));
    let second: AuditRecord = serde_json::from_str(&lines[1]).unwrap();
    assert_eq!((second.status, second.error_code.map(|c| c.as_str())), (400, Some("invalid_request")));
}

#[tokio::test]
async fn a_record_the_sink_refuses_goes_to_the_log_in_full() {
    let model = FakeModel::start().await.unwrap();
    // Every write to /dev/full fails (ENOSPC): a sink that cannot take the record.
    let yaml = one_backend(&model.url()).replace("audit: {sink: stdout}", "audit: {sink: file, path: /dev/full}");
    let gw = Flexway::start(&yaml);
    let ok = gw.chat(KEY, hello("m")).await;
    assert_eq!(ok.status(), 200, "a failed audit write never fails the call");
    let id = ok.headers()["flexway-request-id"].to_str().unwrap().to_owned();
    let line = gw.log_line(&["audit record not written"]).await;
    // The record is in the line whole, as the audit would have had it.
    let json = &line[line.find("audit_record=").unwrap() + "audit_record=".len()..];
    let json = &json[..=json.rfind('}').unwrap()];
    let record: AuditRecord = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!((record.request_id.as_str(), record.status), (id.as_str(), 200));
    assert!(record.prompt_tokens > 0 && record.completion_tokens > 0);
}

/// `flexway report` with `args`: its exit code and stderr.
fn report(args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flexway")).arg("report").args(args).output().unwrap();
    (out.status.code().unwrap(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `audit.chain_key`: a real gateway, restarted once (two writers), writes a chain
/// that `flexway report --verify` holds whole; a line altered, removed, moved or
/// forged in the file is named by its line number, exit 4.
#[tokio::test]
async fn the_audit_chain_verifies_whole_and_names_each_tampered_line() {
    let model = FakeModel::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("chain.key");
    std::fs::write(&key_file, "a chain key of thirty-two bytes!\n").unwrap();
    let audit = dir.path().join("audit.jsonl");
    let yaml = audit_config(&model).replace(
        "audit: {sink: file, path: audit.jsonl, hash_salt: \"env:AUDIT_SALT\"}",
        &format!("audit: {{sink: file, path: {}, chain_key: \"file:{}\"}}", audit.display(), key_file.display()),
    );
    for run in 0..2 {
        let gw = Flexway::start(&yaml);
        for _ in 0..3 {
            assert_eq!(gw.chat(CANARY_KEY, prompt(run == 1)).await.status(), 200);
        }
        // A failed call is chained like a served one.
        assert_eq!(gw.chat("sk-fail", prompt(false)).await.status(), 503);
        let written = 4 * (run + 1);
        for _ in 0..200 {
            if std::fs::read_to_string(&audit).unwrap_or_default().lines().count() >= written {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
    let text = std::fs::read_to_string(&audit).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 8, "{text}");
    let (path, key) = (audit.to_str().unwrap(), format!("file:{}", key_file.display()));
    let verify = |file: &str| report(&["--audit", file, "--verify", "--chain-key", &key, "--format", "json"]);

    let (code, stderr) = verify(path);
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("verified: 8 record(s) in 2 chain(s), unbroken"), "{stderr}");

    let tampered = |edit: &dyn Fn(&mut Vec<String>)| {
        let mut lines: Vec<String> = lines.iter().map(|l| (*l).to_owned()).collect();
        edit(&mut lines);
        let file = dir.path().join("tampered.jsonl");
        std::fs::write(&file, lines.join("\n") + "\n").unwrap();
        verify(file.to_str().unwrap())
    };
    // A cost lowered by hand.
    let (code, stderr) = tampered(&|l| l[1] = l[1].replacen("\"cost_micro_eur\":", "\"cost_micro_eur\":0", 1));
    assert_eq!(code, 4, "{stderr}");
    assert!(stderr.contains("line 2: chain ") && stderr.contains("seq 1 does not match its MAC"), "{stderr}");
    assert!(stderr.contains("error: 1 break(s)"), "{stderr}");
    // A line removed, then two swapped.
    let (code, stderr) = tampered(&|l| drop(l.remove(5)));
    assert_eq!(code, 4);
    assert!(stderr.contains("line 6: chain ") && stderr.contains("seq 1..=1 missing"), "{stderr}");
    let (code, stderr) = tampered(&|l| l.swap(2, 3));
    assert_eq!(code, 4);
    assert!(stderr.contains("seq 3 after seq 2") || stderr.contains("seq 2 after seq 3"), "{stderr}");
    // A record added by someone without the key: whether unchained or with a copied chain.
    let (code, stderr) = tampered(&|l| {
        let forged = l[0].replace("\"tenant\":\"acme\"", "\"tenant\":\"globex\"");
        l.push(forged.rsplit_once(",\"chain\":").unwrap().0.to_owned() + "}");
    });
    assert_eq!(code, 4);
    assert!(stderr.contains("line 9: no chain"), "{stderr}");

    // The wrong key: nothing verifies; an unset one is an error before any read.
    std::fs::write(&key_file, "not the key the gateway chained with").unwrap();
    let (code, stderr) = verify(path);
    assert_eq!(code, 4);
    assert!(stderr.contains("error: 8 break(s)"), "{stderr}");
    let (code, stderr) = report(&["--audit", path, "--verify", "--chain-key", "env:FLEXWAY_TEST_UNSET_KEY"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("FLEXWAY_TEST_UNSET_KEY"), "{stderr}");
}

/// A chain key anyone could guess is refused at start, named.
#[tokio::test]
async fn a_short_chain_key_stops_the_start() {
    let model = FakeModel::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let yaml = audit_config(&model).replace(
        "audit: {sink: file, path: audit.jsonl, hash_salt: \"env:AUDIT_SALT\"}",
        "audit: {sink: file, path: audit.jsonl, chain_key: \"env:SHORT_KEY\"}",
    );
    std::fs::write(dir.path().join("flexway.yaml"), yaml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["serve", "--config", "flexway.yaml", "--listen", "127.0.0.1:0"])
        .current_dir(dir.path())
        .env("SHORT_KEY", "tiny")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("audit.chain_key: the key is 4 bytes; a chain key is at least 16"), "{stderr}");
}
