//! `flexway report`: the real binary turns a JSONL audit into a chargeback table.
#![cfg(test)]

use std::path::Path;
use std::process::Command;

use flexway::audit::{AuditRecord, sample};
use flexway::config::Metering;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn flexway(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_flexway")).args(args).output().unwrap();
    Run {
        code: out.status.code().unwrap(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn record(ts: &str, tenant: &str, agent: Option<&str>, backend: &str, metered_by: Metering, cost: u64) -> AuditRecord {
    AuditRecord {
        ts: ts.parse().unwrap(),
        request_id: format!("req-{ts}"),
        agent: agent.map(Into::into),
        model_served: Some("gpt-4o".into()),
        prompt_tokens: 1_000,
        completion_tokens: 200,
        latency_ms: 350,
        ttfb_ms: Some(80),
        key_hash: "0".repeat(64),
        user_hash: None,
        ..sample::record(tenant, Some(backend), metered_by, cost)
    }
}

/// acme: 2 calls by `bot` on ptu-west (0.5 € + 0.25 €), 1 without agent on payg-north
/// (0.000001 €), 1 relayed to a peer that meters it (7 €, not billed here);
/// globex: 1 call on ptu-west (1.5 €), on the last day.
fn audit_file(dir: &Path) -> String {
    let records = [
        record("2025-03-01T08:00:00Z", "acme", Some("bot"), "ptu-west", Metering::Local, 500_000),
        record("2025-03-01T09:00:00.123Z", "acme", Some("bot"), "ptu-west", Metering::Local, 250_000),
        record("2025-03-02T10:00:00Z", "acme", None, "payg-north", Metering::Local, 1),
        record("2025-03-02T11:00:00Z", "acme", Some("bot"), "peer", Metering::Upstream, 7_000_000),
        record("2025-03-03T23:59:59Z", "globex", None, "ptu-west", Metering::Local, 1_500_000),
    ];
    let mut text = String::new();
    for r in &records {
        text.push_str(&serde_json::to_string(r).unwrap());
        text.push('\n');
    }
    text.push('\n'); // a trailing blank line is tolerated
    let path = dir.join("audit.jsonl");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn markdown_is_the_default_with_totals_and_upstream_apart() {
    let dir = tempfile::tempdir().unwrap();
    let audit = audit_file(dir.path());
    let run = flexway(&["report", "--audit", &audit]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let md = &run.stdout;
    assert!(md.contains("| bot | ptu-west | 2 | 2000 | 400 | 0.750000 |"), "{md}");
    assert!(md.contains("| **total** | | **3** | **3000** | **600** | **0.750001** |"), "{md}");
    assert!(md.contains("| acme | 3 | 3000 | 600 | 0.750001 |"), "{md}");
    assert!(md.contains("| globex | 1 | 1000 | 200 | 1.500000 |"), "{md}");
    assert!(md.contains("| **total** | **4** | **4000** | **800** | **2.250001** |"), "{md}");
    // The upstream-metered call is shown, in its own table, and in no local total.
    let upstream = md.find("Metered upstream (billed where it is paid").unwrap();
    assert!(md[upstream..].contains("| bot | peer | 1 | 1000 | 200 | 7.000000 |"), "{md}");
    assert!(!md.contains("7.750001") && !md.contains("9.250001"), "upstream cost billed locally: {md}");
}

#[test]
fn csv_lists_rows_with_upstream_after_local() {
    let dir = tempfile::tempdir().unwrap();
    let audit = audit_file(dir.path());
    let run = flexway(&["report", "--audit", &audit, "--format", "csv"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(
        lines,
        vec![
            "tenant,agent,backend,metered_by,calls,prompt_tokens,completion_tokens,cost_eur",
            "acme,-,payg-north,local,1,1000,200,0.000001",
            "acme,bot,ptu-west,local,2,2000,400,0.750000",
            "globex,-,ptu-west,local,1,1000,200,1.500000",
            "acme,bot,peer,upstream,1,1000,200,7.000000",
        ]
    );
}

#[test]
fn json_carries_exact_totals() {
    let dir = tempfile::tempdir().unwrap();
    let audit = audit_file(dir.path());
    let run = flexway(&["report", "--audit", &audit, "--format", "json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let report: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["local_total"]["cost_micro_eur"], 2_250_001);
    assert_eq!(report["local_total"]["cost_eur"], "2.250001");
    assert_eq!(report["local_total"]["calls"], 4);
    assert_eq!(report["upstream_total"]["cost_micro_eur"], 7_000_000);
    let acme = &report["tenants"][0];
    assert_eq!(acme["tenant"], "acme");
    assert_eq!(acme["local"]["total"]["cost_micro_eur"], 750_001);
    assert_eq!(acme["upstream"]["rows"].as_array().unwrap().len(), 1);
    assert_eq!(acme["upstream"]["rows"][0]["metered_by"], "upstream");
    let local_rows = acme["local"]["rows"].as_array().unwrap();
    assert!(!local_rows.is_empty() && local_rows.iter().all(|row| row["metered_by"] == "local"), "{local_rows:?}");
}

#[test]
fn date_bounds_are_inclusive() {
    let dir = tempfile::tempdir().unwrap();
    let audit = audit_file(dir.path());
    let run = flexway(&["report", "--audit", &audit, "--from", "2025-03-02", "--to", "2025-03-03", "--format", "json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let report: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["from"], "2025-03-02");
    assert_eq!(report["local_total"]["calls"], 2);
    assert_eq!(report["local_total"]["cost_micro_eur"], 1_500_001);
    assert_eq!(report["upstream_total"]["calls"], 1);

    let run = flexway(&["report", "--audit", &audit, "--to", "2025-03-01", "--format", "csv"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.stdout.lines().count(), 2, "{}", run.stdout);
}

/// Reading a log group itself is tested against the AWS emulator
/// (`tests/report_cloudwatch.rs`); these need none.
#[test]
fn a_log_group_with_bad_dates_is_a_usage_error_before_any_call() {
    let run = flexway(&["report", "--log-group", "/flexway/audit", "--to", "2025-02-30"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("2025-02-30"), "{}", run.stderr);
}

#[test]
#[cfg(not(feature = "aws"))]
fn without_the_aws_feature_a_log_group_is_refused_with_how_to_build_it() {
    let run = flexway(&["report", "--log-group", "/flexway/audit"]);
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(run.stderr.contains("--features aws"), "{}", run.stderr);
    assert!(run.stdout.is_empty());
}

#[test]
#[cfg(feature = "aws")]
fn an_unreachable_aws_endpoint_exits_1_with_the_reason() {
    let closed = flexway_testkit::ClosedPort::new();
    let port = closed.port();
    let out = Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["report", "--log-group", "/flexway/audit"])
        .env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"))
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot read log group /flexway/audit"), "{stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn exactly_one_source_is_required() {
    assert_eq!(flexway(&["report"]).code, 2);
    let both = flexway(&["report", "--audit", "a.jsonl", "--log-group", "g"]);
    assert_eq!(both.code, 2, "{}", both.stderr);
}

#[test]
fn bad_dates_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let audit = audit_file(dir.path());
    let run = flexway(&["report", "--audit", &audit, "--from", "03/01/2025"]);
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("03/01/2025"), "{}", run.stderr);
    let run = flexway(&["report", "--audit", &audit, "--from", "2025-03-02", "--to", "2025-03-01"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
}

#[test]
fn an_unreadable_line_is_listed_apart_and_the_report_still_comes_out_with_exit_3() {
    let dir = tempfile::tempdir().unwrap();
    let audit = audit_file(dir.path());
    let whole = flexway(&["report", "--audit", &audit, "--format", "json"]);
    assert_eq!(whole.code, 0, "{}", whole.stderr);
    let mut text = std::fs::read_to_string(&audit).unwrap();
    let first_line = text.lines().next().unwrap().to_owned();
    text.push_str("{\"tenant\": \"acme\"}\n");
    text.push_str(&first_line[..first_line.len() / 2]);
    text.push('\n');
    std::fs::write(&audit, text).unwrap();
    let run = flexway(&["report", "--audit", &audit, "--format", "json"]);
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert_eq!(run.stdout, whole.stdout, "the totals of the readable records, the unreadable ones apart");
    assert!(
        run.stderr.contains("unreadable: ") && run.stderr.contains("audit.jsonl: line 7: not an audit record"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("audit.jsonl: line 8: not an audit record"), "{}", run.stderr);
    assert!(run.stderr.contains("2 unreadable line(s)"), "{}", run.stderr);

    let missing = flexway(&["report", "--audit", dir.path().join("none.jsonl").to_str().unwrap()]);
    assert_eq!(missing.code, 1);
    assert!(missing.stderr.contains("none.jsonl"), "{}", missing.stderr);
}
