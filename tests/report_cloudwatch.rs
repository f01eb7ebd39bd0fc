//! `flexway report --log-group`: the real binary reads the audit the serverless shape
//! writes (`CloudWatchAuditSink`) back from a CloudWatch Logs group on the AWS
//! emulator (`AWS_ENDPOINT_URL`, default http://127.0.0.1:4566; `localstack/start`
//! starts one, `scripts/test` does it all). No emulator answering is a failure, never
//! a skip.
// The binary reaches AWS only when built with the `aws` feature (scripts/test builds it).
#![cfg(test)]
#![cfg(feature = "aws")]

use flexway_testkit::emulator;

use std::process::Command;

use aws_sdk_cloudwatchlogs::Client;
use aws_sdk_cloudwatchlogs::types::InputLogEvent;
use flexway::audit::{AuditRecord, AuditSink, sample};
use flexway::budget::period::{Period, unix_now};
use flexway::config::Metering;
use flexway_aws::CloudWatchAuditSink;
use serde_json::Value;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// The binary, with the emulator as its AWS environment (as `scripts/test` exports it).
fn flexway(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_flexway")).args(args).envs(emulator::process_env()).output().unwrap();
    Run {
        code: out.status.code().unwrap(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn report_json(args: &[&str]) -> Value {
    let run = flexway(args);
    assert_eq!(run.code, 0, "flexway {args:?}: {}", run.stderr);
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", run.stdout))
}

/// The UTC date `days` days from now (negative: before), `YYYY-MM-DD`.
fn date(days: i64) -> String {
    Period::Day.stamp(unix_now().saturating_add_signed(days * 86_400))
}

fn record(date: &str, request_id: &str, tenant: &str, backend: &str, metered_by: Metering, cost: u64) -> AuditRecord {
    AuditRecord {
        ts: format!("{date}T12:00:00.000Z").parse().unwrap(),
        request_id: request_id.to_owned(),
        agent: Some("bot".to_owned()),
        model_requested: Some("chat-default".to_owned()),
        model_served: Some("gpt-4.1".to_owned()),
        completion_tokens: 20,
        latency_ms: 120,
        ttfb_ms: Some(40),
        user_hash: None,
        ..sample::record(tenant, Some(backend), metered_by, cost)
    }
}

async fn client() -> Client {
    Client::new(&emulator::sdk().await)
}

async fn fresh_group(client: &Client) -> String {
    let group = emulator::unique("/flexway/report-test");
    client.create_log_group().log_group_name(&group).send().await.expect("create the log group");
    group
}

/// Puts raw lines into `stream` (created here) at `timestamp_ms`.
async fn put_raw(client: &Client, group: &str, stream: &str, timestamp_ms: i64, lines: &[&str]) {
    client.create_log_stream().log_group_name(group).log_stream_name(stream).send().await.unwrap();
    let events =
        lines.iter().map(|line| InputLogEvent::builder().timestamp(timestamp_ms).message(*line).build().unwrap());
    client
        .put_log_events()
        .log_group_name(group)
        .log_stream_name(stream)
        .set_log_events(Some(events.collect()))
        .send()
        .await
        .unwrap();
}

fn cost(total: &Value) -> u64 {
    total["cost_micro_eur"].as_u64().unwrap()
}

#[tokio::test]
async fn the_report_from_a_log_group_bills_local_records_and_shows_upstream_apart() {
    let client = client().await;
    let group = fresh_group(&client).await;
    // The sink stamps each event with the time it writes it (now), so every period
    // asked for here includes today; the records' `ts` are spread around it.
    let (yesterday, today, tomorrow) = (date(-1), date(0), date(1));
    let records = [
        record(&today, "req-1", "acme", "ptu-west", Metering::Local, 500_000),
        record(&today, "req-2", "acme", "payg-north", Metering::Local, 1),
        record(&today, "req-3", "acme", "peer", Metering::Upstream, 7_000_000),
        record(&yesterday, "req-4", "globex", "ptu-west", Metering::Local, 1_500_000),
        record(&tomorrow, "req-5", "acme", "ptu-west", Metering::Local, 250_000),
    ];
    // Two gateway instances, each its own stream, writing in batches.
    let first = CloudWatchAuditSink::new(client.clone(), &group, "gateway-1");
    let second = CloudWatchAuditSink::new(client.clone(), &group, "gateway-2");
    first.write(&records[..2]).await.unwrap();
    second.write(&records[2..4]).await.unwrap();
    first.write(&records[4..]).await.unwrap();

    let local: u64 = records.iter().filter(|r| r.metered_by == Metering::Local).map(|r| r.cost_micro_eur).sum();
    let report = report_json(&["report", "--log-group", &group, "--format", "json"]);
    assert_eq!(cost(&report["local_total"]), local, "{report:#}");
    assert_eq!(report["local_total"]["calls"], 4);
    assert_eq!(cost(&report["upstream_total"]), 7_000_000);
    assert_eq!(report["upstream_total"]["calls"], 1);
    let tenants = report["tenants"].as_array().unwrap();
    let names: Vec<&str> = tenants.iter().map(|t| t["tenant"].as_str().unwrap()).collect();
    assert_eq!(names, ["acme", "globex"]);
    let acme = &tenants[0];
    assert_eq!(cost(&acme["local"]["total"]), 750_001);
    let upstream_rows = acme["upstream"]["rows"].as_array().unwrap();
    assert_eq!(upstream_rows.len(), 1);
    assert_eq!(upstream_rows[0]["backend"], "peer");
    let local_rows = acme["local"]["rows"].as_array().unwrap();
    assert!(!local_rows.is_empty() && local_rows.iter().all(|row| row["metered_by"] == "local"), "{local_rows:?}");
    let per_tenant: u64 = tenants.iter().map(|t| cost(&t["local"]["total"])).sum();
    assert_eq!(per_tenant, local, "the tenants' totals add up to the bill");

    // --from/--to keep the records whose `ts` is in the period (UTC dates, inclusive).
    let day = report_json(&["report", "--log-group", &group, "--from", &today, "--to", &today, "--format", "json"]);
    assert_eq!(day["from"], today.as_str());
    assert_eq!(cost(&day["local_total"]), 500_001, "{day:#}");
    assert_eq!(day["local_total"]["calls"], 2);
    assert_eq!(day["upstream_total"]["calls"], 1);
    let since = report_json(&["report", "--log-group", &group, "--from", &today, "--format", "json"]);
    assert_eq!(cost(&since["local_total"]), 750_001, "{since:#}");
    let until = report_json(&["report", "--log-group", &group, "--to", &today, "--format", "json"]);
    assert_eq!(cost(&until["local_total"]), 2_000_001, "{until:#}");
    let both =
        report_json(&["report", "--log-group", &group, "--from", &yesterday, "--to", &tomorrow, "--format", "json"]);
    assert_eq!(cost(&both["local_total"]), local, "{both:#}");

    // The other formats render the same report.
    let csv = flexway(&["report", "--log-group", &group, "--format", "csv"]);
    assert_eq!(csv.code, 0, "{}", csv.stderr);
    assert_eq!(csv.stdout.lines().count(), 1 + 4, "header and one line per row: {}", csv.stdout);
    let md = flexway(&["report", "--log-group", &group]);
    assert_eq!(md.code, 0, "{}", md.stderr);
    assert!(md.stdout.contains("| **total** | **4** |"), "{}", md.stdout);
}

#[tokio::test]
async fn dates_narrow_the_read_and_lines_that_are_not_audit_are_named() {
    let client = client().await;
    let group = fresh_group(&client).await;
    let today = date(0);
    CloudWatchAuditSink::new(client.clone(), &group, "gateway-1")
        .write(&[record(&today, "req-1", "acme", "ptu-west", Metering::Local, 42)])
        .await
        .unwrap();
    // The function's own lines (the group is also its log group): EMF metrics, a
    // platform line, a JSON log line. Not audit, and skipped.
    let now_ms = i64::try_from(flexway::budget::period::unix_now_millis()).unwrap();
    let own_lines = [
        r#"{"_aws":{"Timestamp":1,"CloudWatchMetrics":[]},"calls":1}"#,
        "START RequestId: 7a52 Version: $LATEST",
        r#"{"timestamp":"2026-12-01T06:00:00Z","level":"INFO","fields":{"message":"flexway gateway ready"}}"#,
    ];
    put_raw(&client, &group, "function", now_ms, &own_lines).await;
    // A record cut short, five days ago: outside a period starting today.
    let cut = r#"{"schema_version":1,"ts":"2026-11-26T10:00:00.000Z","request_id":"req-0","ten"#;
    put_raw(&client, &group, "stray", now_ms - 5 * 86_400_000, &[cut]).await;

    // The report of every readable record, the cut one listed apart, exit 3.
    let run = flexway(&["report", "--log-group", &group, "--format", "json"]);
    assert_eq!(run.code, 3, "{}", run.stderr);
    let stray = client.filter_log_events().log_group_name(&group).log_stream_names("stray").send().await.unwrap();
    let event_id = stray.events()[0].event_id().unwrap();
    let named = format!("unreadable: log group {group}, event {event_id} (stream stray): not an audit record");
    assert!(run.stderr.contains(&named), "names the event: {}", run.stderr);
    let report: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(cost(&report["local_total"]), 42, "{report:#}");

    // A period starting today does not read that event at all.
    let report = report_json(&["report", "--log-group", &group, "--from", &today, "--format", "json"]);
    assert_eq!(cost(&report["local_total"]), 42, "{report:#}");
    assert_eq!(report["local_total"]["calls"], 1);
}

#[tokio::test]
async fn a_record_written_just_after_midnight_counts_on_the_day_its_call_ended() {
    let client = client().await;
    let group = fresh_group(&client).await;
    // A call that ended at 23:59:59.900 two days ago, its event written 200 ms later,
    // on the next day; and one that ended the next day.
    let (day, next) = (date(-2), date(-1));
    let midnight_ms = i64::try_from(unix_now() / 86_400 * 86_400 - 86_400).unwrap() * 1000;
    let mut late = record(&day, "req-late", "acme", "ptu-west", Metering::Local, 7);
    late.ts = format!("{day}T23:59:59.900Z").parse().unwrap();
    let after = record(&next, "req-after", "acme", "ptu-west", Metering::Local, 1_000);
    let lines = [serde_json::to_string(&late).unwrap(), serde_json::to_string(&after).unwrap()];
    put_raw(&client, &group, "gateway-1", midnight_ms + 100, &[lines[0].as_str()]).await;
    put_raw(&client, &group, "gateway-2", midnight_ms + 12 * 3_600_000, &[lines[1].as_str()]).await;

    let on_day = report_json(&["report", "--log-group", &group, "--from", &day, "--to", &day, "--format", "json"]);
    assert_eq!(cost(&on_day["local_total"]), 7, "{on_day:#}");
    let on_next = report_json(&["report", "--log-group", &group, "--from", &next, "--to", &next, "--format", "json"]);
    assert_eq!(cost(&on_next["local_total"]), 1_000, "{on_next:#}");
}

#[tokio::test]
async fn a_missing_log_group_exits_1_naming_it() {
    emulator::sdk().await; // fails with instructions when no emulator answers
    let group = emulator::unique("/flexway/no-such-group");
    let run = flexway(&["report", "--log-group", &group]);
    assert_eq!(run.code, 1, "{}", run.stdout);
    assert!(run.stderr.contains(&group) && run.stderr.contains("does not exist"), "{}", run.stderr);
    assert!(run.stdout.is_empty());
}

/// `--verify` on a log group: the records of a fleet process chaining into
/// CloudWatch with concurrent PutLogEvents (which may land out of order) verify
/// whole; a record put again by someone else, or put with no chain, is a break.
#[tokio::test]
async fn a_chained_audit_in_a_log_group_verifies_and_a_replayed_event_breaks_it() {
    use flexway::audit::chain::ChainedAuditSink;
    let client = client().await;
    let group = fresh_group(&client).await;
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("chain.key");
    std::fs::write(&key_file, "0123456789abcdef0123456789abcdef").unwrap();
    let key = format!("file:{}", key_file.display());
    let today = date(0);
    let sink = std::sync::Arc::new(CloudWatchAuditSink::new(client.clone(), &group, "fleet-1"));
    let chained = ChainedAuditSink::new(sink, b"0123456789abcdef0123456789abcdef");
    let writes = (0..12).map(|i| {
        let record = record(&today, &format!("req-{i}"), "acme", "ptu-west", Metering::Local, 10);
        let chained = &chained;
        async move { chained.write(&[record]).await.unwrap() }
    });
    futures_util::future::join_all(writes).await;

    let run = flexway(&["report", "--log-group", &group, "--verify", "--chain-key", &key, "--format", "json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stderr.contains("verified: 12 record(s) in 1 chain(s), unbroken"), "{}", run.stderr);
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(cost(&report["local_total"]), 120);

    // One of the events put again in another stream, and a record with no chain.
    let events = client.filter_log_events().log_group_name(&group).send().await.unwrap();
    let replayed = events.events()[3].message().unwrap().to_owned();
    let unchained = serde_json::to_string(&record(&today, "req-x", "acme", "ptu-west", Metering::Local, 10)).unwrap();
    let now_ms = i64::try_from(flexway::budget::period::unix_now_millis()).unwrap();
    put_raw(&client, &group, "intruder", now_ms, &[&replayed, &unchained]).await;
    let run = flexway(&["report", "--log-group", &group, "--verify", "--chain-key", &key]);
    assert_eq!(run.code, 4, "{}", run.stderr);
    assert!(run.stderr.contains("(stream intruder): no chain"), "{}", run.stderr);
    assert!(run.stderr.contains("a line moved or repeated"), "{}", run.stderr);
    assert!(run.stderr.contains("error: 2 break(s) in the audit's chain; 12 record(s) verified"), "{}", run.stderr);
}

/// `flexway reconcile --log-group`: the audit read back from the group, set against a
/// provider's CSV, 5% above it.
#[tokio::test]
async fn reconcile_reads_the_audit_from_a_log_group() {
    let client = client().await;
    let group = fresh_group(&client).await;
    let today = date(0);
    let records = [
        record(&today, "req-1", "acme", "ptu-west", Metering::Local, 500_000),
        record(&today, "req-2", "globex", "ptu-west", Metering::Local, 1_500_000),
    ];
    CloudWatchAuditSink::new(client.clone(), &group, "gateway-1").write(&records).await.unwrap();
    // sample's 100 prompt tokens and 20 completion tokens a call: 240; the provider 252.
    let dir = std::env::temp_dir().join(emulator::unique("reconcile"));
    std::fs::create_dir_all(&dir).unwrap();
    let usage = dir.join("usage.csv");
    std::fs::write(
        &usage,
        format!("date,backend,model,input_tokens,output_tokens,cost_eur\n{today},ptu-west,gpt-4.1,210,42,2.1\n"),
    )
    .unwrap();
    let run = flexway(&[
        "reconcile",
        "--log-group",
        &group,
        "--provider-usage",
        usage.to_str().unwrap(),
        "--from",
        &today,
        "--to",
        &today,
        "--chargeback",
        "--format",
        "json",
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let out: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(out["rows"][0]["gateway_input_tokens"], 200, "{out:#}");
    assert!((out["backends"][0]["drift_ratio"].as_f64().unwrap() - 12.0 / 252.0).abs() < 1e-12, "{out:#}");
    let corrected: u64 =
        out["chargeback"].as_array().unwrap().iter().map(|c| c["corrected_cost_micro_eur"].as_u64().unwrap()).sum();
    assert_eq!(corrected, 2_100_000, "the provider's stated cost");
}
