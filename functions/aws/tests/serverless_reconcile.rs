//! The serverless shape's reconciliation against the emulator: audit records in a
//! CloudWatch Logs group (one event each, at the record's time), a provider's usage API
//! on loopback answering as OpenAI's does (two pages), and the drift out as the EMF
//! lines the reconcile function prints and the template's alarm reads.
#![cfg(test)]

use flexway_testkit::emulator;

use aws_sdk_cloudwatchlogs::types::InputLogEvent;
use axum::extract::Query;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use axum::{Json, Router};
use flexway::audit::{AuditRecord, sample};
use flexway::config::{Metering, ProcessEnv, Secrets};
use flexway::reconcile::Date;
use serde_json::{Value, json};

const KEY: &str = "sk-admin-reconcile-test";

/// Two tenants on `openai` on the day before `today`: 1000/200 tokens each.
fn records(yesterday: Date) -> Vec<AuditRecord> {
    ["acme", "globex"]
        .iter()
        .enumerate()
        .map(|(i, tenant)| AuditRecord {
            ts: format!("{yesterday}T1{i}:00:00Z").parse().unwrap(),
            request_id: format!("req-{i}"),
            model_served: Some("gpt-4o".into()),
            prompt_tokens: 1000,
            completion_tokens: 200,
            ..sample::record(tenant, Some("openai"), Metering::Local, 500_000)
        })
        .collect()
}

/// OpenAI's usage: 5% above the gateway, over two pages (completions), none for
/// embeddings.
async fn usage(
    headers: HeaderMap,
    Query(query): Query<Vec<(String, String)>>,
    day: i64,
    path: &'static str,
) -> Result<Json<Value>, StatusCode> {
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(&format!("Bearer {KEY}")) {
        return Err(StatusCode::UNAUTHORIZED);
    }
    let page = query.iter().find(|(k, _)| k == "page").map(|(_, v)| v.as_str());
    let bucket = |input: u64| {
        json!({"start_time": day, "end_time": day + 86_400, "results": [
        {"object": "organization.usage.completions.result", "input_tokens": input, "output_tokens": input / 5, "model": "gpt-4o"}]})
    };
    Ok(Json(match (path, page) {
        ("embeddings", _) => json!({"data": [], "has_more": false, "next_page": null}),
        (_, None) => json!({"data": [bucket(1050)], "has_more": true, "next_page": "page_2"}),
        (_, Some("page_2")) => json!({"data": [bucket(1050)], "has_more": false, "next_page": null}),
        _ => return Err(StatusCode::BAD_REQUEST),
    }))
}

async fn fake_openai(day: i64) -> String {
    let app = Router::new()
        .route("/v1/organization/usage/completions", get(move |h, q| usage(h, q, day, "completions")))
        .route("/v1/organization/usage/embeddings", get(move |h, q| usage(h, q, day, "embeddings")));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

#[tokio::test]
async fn the_drift_of_the_last_days_leaves_as_emf_for_the_alarm() {
    let sdk = emulator::sdk().await;
    let client = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let group = emulator::unique("/flexway/audit-reconcile");
    client.create_log_group().log_group_name(&group).send().await.unwrap();
    let today: Date = flexway::reconcile::today().parse().unwrap();
    let yesterday = today.yesterday().unwrap();
    // Each event at its record's time, as a gateway writes it at the call's end.
    client.create_log_stream().log_group_name(&group).log_stream_name("gateway-1").send().await.unwrap();
    let records = records(yesterday);
    let events = records.iter().map(|record| {
        let line = serde_json::to_string(record).unwrap();
        InputLogEvent::builder().timestamp(record.ts.unix_millis()).message(line).build().unwrap()
    });
    let put = client.put_log_events().log_group_name(&group).log_stream_name("gateway-1");
    put.set_log_events(Some(events.collect())).send().await.unwrap();

    let day_start = jiff::tz::Offset::UTC.to_timestamp(yesterday.at(0, 0, 0, 0)).unwrap().as_second();
    let base = fake_openai(day_start).await;
    let key_file = std::env::temp_dir().join(emulator::unique("openai-admin-key"));
    std::fs::write(&key_file, KEY).unwrap();
    let config = format!(
        "version: 1\nai:\n  default_backend: openai\n  backends:\n    openai:\n      kind: openai\n      \
         url: http://127.0.0.1:9/v1\n      default_model: gpt-4o\n      \
         usage_api: {{kind: openai, secret: \"file:{}\", url: \"{base}\"}}\ntenants:\n  acme:\n    keys: [{{sha256: \"{}\"}}]\n",
        key_file.display(),
        "ab".repeat(32)
    );
    let config = flexway::config::load_str_with(&config, &ProcessEnv, Secrets::Check).unwrap().config;

    let done = flexway_aws::reconcile_days(&config, &sdk, &group, 3, today).await.unwrap();
    let _ = std::fs::remove_file(&key_file);
    assert_eq!(done.unreadable, Vec::<String>::new());
    let backend = &done.reconciliation.backends[0];
    assert_eq!((backend.gateway.total(), backend.provider.total()), (2400, 2520), "both pages, both records");
    assert!((backend.drift_ratio.unwrap() - 5.0 / 105.0).abs() < 1e-12);

    let lines = flexway_aws::drift_lines(&done.reconciliation, "Flexway/test", 1_700_000_000_000);
    assert_eq!(lines.len(), 1);
    let line: Value = serde_json::from_str(&lines[0]).unwrap();
    let directive = &line["_aws"]["CloudWatchMetrics"][0];
    assert_eq!(directive["Namespace"], "Flexway/test");
    assert_eq!(directive["Dimensions"], json!([["backend"], []]), "per backend, and one series for the alarm");
    assert_eq!(directive["Metrics"][0]["Name"], flexway_aws::DRIFT_METRIC);
    assert_eq!(line["backend"], "openai");
    assert!((line[flexway_aws::DRIFT_METRIC].as_f64().unwrap() - 5.0 / 105.0).abs() < 1e-12);
}
