//! The platform's deadline (SPEC §11): in the serverless shape each invocation has
//! one, and a stream still open a margin before it (`DEADLINE_MARGIN`, or a tenth of
//! the time left if shorter) ends for its client with the in-band `deadline` error,
//! settled on what was relayed and recorded. The
//! Lambda binary sets the deadline from its context; here the serverless router gets
//! one a second away, in front of a slow stream.
#![cfg(test)]

use std::time::{Duration, Instant};

use flexway::audit::UsageSource;
use flexway::http::{DEADLINE_MARGIN, Deadline};
use flexway_testkit::*;
use serde_json::json;

/// The serverless router with every request's deadline `left` from now.
async fn serve_with_deadline(yaml: &str, adapters: flexway::gateway::Adapters, left: Duration) -> InProcess {
    let deadline = Deadline::within(left);
    serve_router_in_process(yaml, adapters, |gateway| flexway::http::api(gateway).layer(axum::Extension(deadline)))
        .await
}

#[tokio::test]
async fn a_stream_open_at_the_deadline_ends_with_the_deadline_error_settled_and_recorded() {
    let model = FakeModel::start().await.unwrap();
    // 40 chunks 100 ms apart: four seconds of stream, far past the cutoff.
    let yaml = acme_config(
        "{tokens_per_day: 100000}",
        &format!(
            "  default_backend: slow\n  backends:\n    slow: {{url: \"{}\", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}",
            scenario(&model, "words=40,chunks=40,chunk_delay_ms=100")
        ),
    );
    let (adapters, audit) = memory_adapters();
    // A second left: the cutoff (a tenth of it before the end) comes 0.9 s into a 4 s stream.
    let gw = serve_with_deadline(&yaml, adapters, Duration::from_secs(1)).await;
    let started = Instant::now();
    let mut request = hello("m");
    request["stream"] = json!(true);
    let response = gw.chat(KEY, request).await;
    assert_eq!(response.status(), 200);
    let (events, _) = sse_data(response).await;
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(3), "the stream ran to its end: {elapsed:?}");

    let last = events.last().unwrap();
    assert!(last.contains("\"code\":\"deadline\""), "{events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"), "a stream cut by the deadline never ends clean");
    let relayed: Vec<&String> = events.iter().filter(|e| e.contains("\"content\":\"w")).collect();
    assert!(!relayed.is_empty() && relayed.len() < 40, "part of the answer was relayed: {}", relayed.len());

    // Recorded and settled before the platform would have cut the call.
    let mut records = audit.records();
    for _ in 0..100 {
        if !records.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        records = audit.records();
    }
    assert_eq!(records.len(), 1);
    let record = &records[0];
    assert_eq!((record.status, record.error_code.map(|c| c.as_str())), (200, Some("deadline")));
    assert_eq!(record.usage_source, UsageSource::Estimated, "settled on what was relayed");
    assert!(record.completion_tokens > 0);
    assert_eq!(gw.live_reservations().await, 0, "no reservation left for the sweeper");
    let [tokens_today, ..] = gw.ledger("acme", None).await;
    assert_eq!(tokens_today, record.prompt_tokens + record.completion_tokens);
}

#[tokio::test]
async fn a_short_deadline_keeps_a_tenth_of_its_time_as_margin() {
    // A function whose timeout is 2 s: the cutoff is 0.2 s before its end, not 3 s
    // (which would end every stream at once).
    let model = FakeModel::start().await.unwrap();
    let url = scenario(&model, "chunks=4,chunk_delay_ms=100");
    let yaml = acme_config(
        "{tokens_per_day: 100000}",
        &format!("  default_backend: quick\n  backends:\n    quick: {{url: \"{url}\"}}"),
    );
    let (adapters, _) = memory_adapters();
    let gw = serve_with_deadline(&yaml, adapters, Duration::from_secs(2)).await;
    let mut request = hello("m");
    request["stream"] = json!(true);
    let (events, error) = sse_data(gw.chat(KEY, request).await).await;
    assert_eq!((events.last().map(String::as_str), error), (Some("[DONE]"), None));
}

#[tokio::test]
async fn a_stream_that_ends_before_the_cutoff_is_untouched() {
    let model = FakeModel::start().await.unwrap();
    let yaml = acme_config(
        "{tokens_per_day: 100000}",
        &format!("  default_backend: quick\n  backends:\n    quick: {{url: \"{}\"}}", model.url()),
    );
    let (adapters, audit) = memory_adapters();
    let gw = serve_with_deadline(&yaml, adapters, DEADLINE_MARGIN + Duration::from_secs(30)).await;
    let mut request = hello("m");
    request["stream"] = json!(true);
    let (events, error) = sse_data(gw.chat(KEY, request).await).await;
    assert_eq!((events.last().map(String::as_str), error), (Some("[DONE]"), None));
    assert_eq!(audit_records_until(&audit, 1).await[0].error_code, None);
}
