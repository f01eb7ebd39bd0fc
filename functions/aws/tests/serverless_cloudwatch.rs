//! The CloudWatch Logs audit sink against the emulator: records go in as one JSON
//! event each and come back intact with GetLogEvents and FilterLogEvents.
#![cfg(test)]

use flexway_testkit::emulator;

use flexway::audit::{AuditRecord, AuditSink, SCHEMA_VERSION, sample};
use flexway::config::Metering;
use flexway_aws::CloudWatchAuditSink;

fn record(request_id: &str, tenant: &str) -> AuditRecord {
    AuditRecord {
        ts: "2026-11-29T15:44:30.123Z".parse().unwrap(),
        request_id: request_id.to_owned(),
        agent: None,
        model_requested: Some("chat-default".to_owned()),
        model_served: Some("gpt-4.1".to_owned()),
        prompt_tokens: 12,
        completion_tokens: 34,
        latency_ms: 120,
        ttfb_ms: Some(40),
        user_hash: None,
        ..sample::record(tenant, Some("ptu-west"), Metering::Local, 296)
    }
}

async fn fresh_group(client: &aws_sdk_cloudwatchlogs::Client) -> String {
    let group = emulator::unique("/flexway/audit-test");
    client.create_log_group().log_group_name(&group).send().await.expect("create the log group");
    group
}

#[tokio::test]
async fn records_are_readable_back_with_get_and_filter_log_events() {
    let sdk = emulator::sdk().await;
    let client = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let group = fresh_group(&client).await;
    let sink = CloudWatchAuditSink::new(client.clone(), &group, "gateway-1");
    sink.ensure_stream().await.unwrap();
    // The stream exists already: a second sink on it must not fail.
    CloudWatchAuditSink::new(client.clone(), &group, "gateway-1").ensure_stream().await.unwrap();

    let written = vec![record("req-1", "acme"), record("req-2", "acme"), record("req-3", "globex")];
    sink.write(&written[..2]).await.unwrap();
    sink.write(&written[2..]).await.unwrap();
    sink.write(&[]).await.unwrap();

    let events = client
        .get_log_events()
        .log_group_name(&group)
        .log_stream_name("gateway-1")
        .start_from_head(true)
        .send()
        .await
        .unwrap();
    let read: Vec<AuditRecord> =
        events.events().iter().map(|e| serde_json::from_str(e.message().unwrap()).unwrap()).collect();
    assert_eq!(read, written, "one event per record, in order, unchanged");

    let filtered = client.filter_log_events().log_group_name(&group).filter_pattern("globex").send().await.unwrap();
    let ids: Vec<String> = filtered
        .events()
        .iter()
        .map(|e| serde_json::from_str::<AuditRecord>(e.message().unwrap()).unwrap().request_id)
        .collect();
    assert_eq!(ids, ["req-3"]);
}

#[tokio::test]
async fn creates_the_stream_on_first_write() {
    let sdk = emulator::sdk().await;
    let client = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let group = fresh_group(&client).await;
    let sink = CloudWatchAuditSink::new(client.clone(), &group, "lazy");
    sink.write(&[record("req-lazy", "acme")]).await.unwrap();
    let streams = client.describe_log_streams().log_group_name(&group).send().await.unwrap();
    let names: Vec<&str> = streams.log_streams().iter().filter_map(|s| s.log_stream_name()).collect();
    assert_eq!(names, ["lazy"]);
}

#[tokio::test]
async fn a_failed_put_is_returned_not_dropped() {
    let sdk = emulator::sdk().await;
    let client = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let sink = CloudWatchAuditSink::new(client, emulator::unique("/flexway/no-such-group"), "s");
    let error = sink.write(&[record("req-lost", "acme")]).await.unwrap_err();
    assert!(error.to_string().contains("no-such-group"), "{error}");
}

// `read_audit_log_group`: what `flexway report --log-group` reads.

async fn put_raw(
    client: &aws_sdk_cloudwatchlogs::Client,
    group: &str,
    stream: &str,
    timestamp_ms: i64,
    lines: &[String],
) {
    client.create_log_stream().log_group_name(group).log_stream_name(stream).send().await.unwrap();
    let events = lines.iter().map(|line| {
        aws_sdk_cloudwatchlogs::types::InputLogEvent::builder().timestamp(timestamp_ms).message(line).build().unwrap()
    });
    client
        .put_log_events()
        .log_group_name(group)
        .log_stream_name(stream)
        .set_log_events(Some(events.collect()))
        .send()
        .await
        .unwrap();
}

fn now_ms() -> i64 {
    i64::try_from(flexway::budget::period::unix_now_millis()).unwrap()
}

#[tokio::test]
async fn the_reader_reads_every_page_of_every_stream_in_time_order() {
    let sdk = emulator::sdk().await;
    let client = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let group = fresh_group(&client).await;
    // FilterLogEvents returns at most 10,000 events a page: one more takes two pages.
    let many: Vec<AuditRecord> = (0..10_001).map(|i| record(&format!("req-{i}"), "acme")).collect();
    let later = CloudWatchAuditSink::new(client.clone(), &group, "gateway-later");
    let earlier = vec![record("req-early-1", "globex"), record("req-early-2", "globex")];
    let start = now_ms() - 60_000;
    let lines: Vec<String> = earlier.iter().map(|r| serde_json::to_string(r).unwrap()).collect();
    put_raw(&client, &group, "gateway-earlier", start, &lines).await;
    later.write(&many).await.unwrap();

    let read = flexway_aws::read_audit_log_group(&client, &group, None, None, None).await.unwrap().records;
    assert_eq!(read.len(), 10_003);
    assert_eq!(read[..2], earlier[..], "the earlier stream first, by event time");
    assert_eq!(read[2..], many[..], "all pages, in the order written");

    // Bounds are on event timestamps, both inclusive.
    let first_only = flexway_aws::read_audit_log_group(&client, &group, None, Some(start), None).await.unwrap();
    assert_eq!(first_only.records, earlier);
    let rest = flexway_aws::read_audit_log_group(&client, &group, Some(start + 1), None, None).await.unwrap();
    assert_eq!(rest.records.len(), 10_001);
}

#[tokio::test]
async fn the_reader_skips_the_functions_own_lines_and_lists_a_damaged_record() {
    let sdk = emulator::sdk().await;
    let client = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let group = fresh_group(&client).await;
    let now = now_ms();
    let good = serde_json::to_string(&record("req-1", "acme")).unwrap();
    let emf = r#"{"_aws":{"Timestamp":1,"CloudWatchMetrics":[]},"tenant":"acme","calls":1}"#.to_owned();
    let log = r#"{"level":"info","fields":{"message":"hello"}}"#.to_owned();
    put_raw(&client, &group, "ok", now, &[good, emf, "END RequestId: 7a52".to_owned(), log]).await;
    let read = flexway_aws::read_audit_log_group(&client, &group, None, None, None).await.unwrap();
    assert_eq!(read.records.iter().map(|r| r.request_id.as_str()).collect::<Vec<_>>(), ["req-1"]);
    assert!(read.unreadable.is_empty(), "{:?}", read.unreadable);

    let mut newer = serde_json::to_value(record("req-2", "acme")).unwrap();
    newer["schema_version"] = serde_json::json!(SCHEMA_VERSION + 1);
    let mut damaged = serde_json::to_value(record("req-3", "acme")).unwrap();
    damaged["prompt_tokens"] = serde_json::json!("many");
    put_raw(&client, &group, "newer", now + 1, &[newer.to_string()]).await;
    put_raw(&client, &group, "other", now + 2, &[damaged.to_string()]).await;
    put_raw(&client, &group, "after", now + 3, &[serde_json::to_string(&record("req-4", "acme")).unwrap()]).await;
    let read = flexway_aws::read_audit_log_group(&client, &group, None, None, None).await.unwrap();
    let served: Vec<&str> = read.records.iter().map(|r| r.request_id.as_str()).collect();
    assert_eq!(served, ["req-1", "req-4"], "the read goes past unreadable events");
    let [newer, damaged] = read.unreadable.as_slice() else { panic!("{:?}", read.unreadable) };
    assert!(newer.why.contains("is newer than this flexway understands"), "{newer}");
    assert!(newer.at.contains("(stream newer)"), "{newer}");
    let events = client.filter_log_events().log_group_name(&group).log_stream_names("other").send().await.unwrap();
    let event_id = events.events()[0].event_id().unwrap();
    assert_eq!(damaged.at, format!("event {event_id} (stream other)"), "names the event");
    assert!(damaged.why.starts_with("not an audit record"), "{damaged}");

    let missing = emulator::unique("/flexway/no-such-group");
    let error = flexway_aws::read_audit_log_group(&client, &missing, None, None, None).await.unwrap_err();
    assert!(matches!(error, flexway_aws::AuditReadError::GroupNotFound { .. }), "{error}");
}

/// A cold start that cannot warm its resources (a log group or table not there yet, a
/// throttled CreateLogStream) still starts; the first call that needs them says why.
#[tokio::test]
async fn a_cold_start_that_cannot_warm_its_resources_still_starts() {
    let sdk = emulator::sdk().await;
    let yaml = format!(
        "version: 1\nstore: {{kind: dynamodb, table: {table}}}\naudit: {{sink: cloudwatch, log_group: {group}}}\n\
         tenants: {{acme: {{keys: [{{sha256: {key}}}]}}}}\nai:\n  default_backend: main\n  backends:\n    main: {{url: 'http://127.0.0.1:9/v1'}}\n",
        table = emulator::unique("no-such-table"),
        group = emulator::unique("no-such-group"),
        key = "a".repeat(64),
    );
    let env = std::collections::HashMap::new();
    let config = flexway::config::load_str(&yaml, &env).unwrap().config;
    let adapters = flexway_aws::build_adapters(&config, &sdk).await.expect("init does not fail for warming");
    let record = flexway::audit::sample::record("acme", Some("main"), flexway::config::Metering::Local, 0);
    let error = adapters.audit.write(&[record]).await.expect_err("the group is missing");
    assert!(error.to_string().contains("no-such-group"), "{error}");
}
