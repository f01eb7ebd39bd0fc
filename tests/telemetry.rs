//! OpenTelemetry (SPEC §9): each call's span and the GenAI metrics, sent over OTLP/HTTP
//! to a collector on loopback that decodes them with the protocol's official types.
//! Attributes are checked exactly against the call's audit record and response
//! headers; the prompt and the completion (canaries) never appear in what is sent; a
//! collector that fails never fails a call.

#![cfg(test)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use fake_model::FakeModel;
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value::Value};
use opentelemetry_proto::tonic::metrics::v1::{Metric, metric::Data};
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use serde_json::json;

use flexway_testkit::{AGENT_KEY, ClosedPort, KEY, client, memory_adapters, serve_in_process};

const CANARY: &str = "CANARY-prompt-7f3a9";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

/// A collector: what it was sent, raw, per path; `status` is what it answers.
#[derive(Clone, Default)]
struct Collector {
    traces: Arc<Mutex<Vec<Bytes>>>,
    metrics: Arc<Mutex<Vec<Bytes>>>,
}

impl Collector {
    async fn start(status: StatusCode) -> (Collector, String) {
        let collector = Collector::default();
        let app = Router::new()
            .route(
                "/v1/traces",
                post(move |State(c): State<Collector>, body: Bytes| async move {
                    c.traces.lock().unwrap().push(body);
                    status
                }),
            )
            .route(
                "/v1/metrics",
                post(move |State(c): State<Collector>, body: Bytes| async move {
                    c.metrics.lock().unwrap().push(body);
                    status
                }),
            )
            .with_state(collector.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (collector, url)
    }

    fn spans(&self) -> Vec<Span> {
        self.traces
            .lock()
            .unwrap()
            .iter()
            .flat_map(|body| ExportTraceServiceRequest::decode(body.clone()).unwrap().resource_spans)
            .flat_map(|r| r.scope_spans)
            .flat_map(|s| s.spans)
            .collect()
    }

    /// The metrics of the last export (cumulative: it holds everything so far).
    fn last_metrics(&self) -> Vec<Metric> {
        let bodies = self.metrics.lock().unwrap();
        let Some(last) = bodies.last() else { return Vec::new() };
        ExportMetricsServiceRequest::decode(last.clone())
            .unwrap()
            .resource_metrics
            .into_iter()
            .flat_map(|r| r.scope_metrics)
            .flat_map(|s| s.metrics)
            .collect()
    }

    fn everything_sent(&self) -> Vec<u8> {
        let mut all = Vec::new();
        for body in self.traces.lock().unwrap().iter().chain(self.metrics.lock().unwrap().iter()) {
            all.extend_from_slice(body);
        }
        all
    }

    async fn wait_for_spans(&self, n: usize) -> Vec<Span> {
        for _ in 0..100 {
            let spans = self.spans();
            if spans.len() >= n {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the collector received {} spans, expected {n}", self.spans().len());
    }
}

/// Tenant `acme` (AGENT_KEY is bound to its agent `bot`), one backend, and the
/// collector.
fn yaml(fake: &FakeModel, collector: &str, interval: &str) -> String {
    let ai = format!(
        "  default_backend: main\n  budget: {{default_max_tokens: 64}}\n  backends:\n    main:\n      url: {}\n      \
         price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}}\n",
        fake.url()
    );
    format!(
        "{}telemetry: {{otlp_endpoint: \"{collector}\", export_interval: {interval}}}\n",
        flexway_testkit::config(&ai)
    )
}

fn value(v: &AnyValue) -> serde_json::Value {
    match &v.value {
        Some(Value::StringValue(s)) => json!(s),
        Some(Value::IntValue(i)) => json!(i),
        Some(Value::DoubleValue(d)) => json!(d),
        Some(Value::BoolValue(b)) => json!(b),
        Some(Value::ArrayValue(a)) => a.values.iter().map(value).collect(),
        other => panic!("unexpected attribute value {other:?}"),
    }
}

fn attributes(kvs: &[KeyValue]) -> serde_json::Map<String, serde_json::Value> {
    kvs.iter().map(|kv| (kv.key.clone(), value(kv.value.as_ref().unwrap()))).collect()
}

#[tokio::test]
async fn each_call_is_one_span_with_the_genai_attributes_and_its_trace_continued() {
    let fake = FakeModel::start().await.unwrap();
    let (collector, collector_url) = Collector::start(StatusCode::OK).await;
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&yaml(&fake, &collector_url, "100ms"), adapters).await;

    let response = client()
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(AGENT_KEY)
        .header("traceparent", format!("00-{TRACE_ID}-{PARENT_ID}-01"))
        .header("tracestate", "vendor=opaque")
        .json(&json!({"model": "m", "user": "end-user-42", "messages": [{"role": "user", "content": CANARY}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let request_id = response.headers()["flexway-request-id"].to_str().unwrap().to_owned();
    let answer: serde_json::Value = response.json().await.unwrap();
    assert!(answer["choices"][0]["message"]["content"].as_str().unwrap().contains(CANARY));

    let spans = collector.wait_for_spans(1).await;
    assert_eq!(spans.len(), 1);
    let span = &spans[0];
    let record = audit.records().into_iter().next().unwrap();
    assert_eq!(span.name, "chat m");
    assert_eq!(span.kind, SpanKind::Client as i32);
    assert_eq!(hex::encode(&span.trace_id), TRACE_ID);
    assert_eq!(hex::encode(&span.parent_span_id), PARENT_ID);
    assert_eq!(span.trace_state, "vendor=opaque");
    assert!(span.end_time_unix_nano > span.start_time_unix_nano);
    assert_eq!(span.status, None);
    let expected = json!({
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "m",
        "gen_ai.response.model": "m",
        "gen_ai.request.max_tokens": 64,
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "gen_ai.response.finish_reasons": ["stop"],
        "http.response.status_code": 200,
        "flexway.tenant": "acme",
        "flexway.agent": "bot",
        "flexway.backend": "main",
        "flexway.request_id": request_id,
        "flexway.budget_state": "ok",
        "flexway.cost_eur": record.cost_eur,
        "flexway.criticality": "standard",
    });
    assert_eq!(serde_json::Value::Object(attributes(&span.attributes)), expected);
    assert!(record.prompt_tokens > 0 && record.completion_tokens > 0 && record.cost_eur > 0.0);

    // The backend was called as a child of the gateway's span, in the caller's trace.
    let upstream = fake.requests().into_iter().next().unwrap();
    let traceparent = upstream.header("traceparent").unwrap();
    assert_eq!(traceparent, format!("00-{TRACE_ID}-{}-01", hex::encode(&span.span_id)));
    assert_eq!(upstream.header("tracestate"), Some("vendor=opaque"));

    // Never a prompt, a completion, a key or an end user's identifier.
    let sent = collector.everything_sent();
    for secret in [CANARY, AGENT_KEY, "end-user-42", "Hello from fake-model"] {
        assert!(!sent.windows(secret.len()).any(|w| w == secret.as_bytes()), "{secret} was exported");
    }
}

#[tokio::test]
async fn streams_failures_and_the_genai_metrics() {
    let fake = FakeModel::start().await.unwrap();
    let (collector, collector_url) = Collector::start(StatusCode::OK).await;
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&yaml(&fake, &collector_url, "100ms"), adapters).await;

    let stream = json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": CANARY}]});
    let response = gw.chat(KEY, stream).await;
    assert_eq!(response.status(), 200);
    let (events, error) = flexway_testkit::sse_data(response).await;
    assert_eq!(error, None);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    // A refusal after identification is a span too, marked as an error.
    let refused = gw.chat(KEY, json!({"model": "m", "messages": []})).await;
    let refused_status = refused.status().as_u16();
    assert_eq!(refused_status, 400);

    let spans = collector.wait_for_spans(2).await;
    let records = audit.records();
    assert_eq!(records.len(), 2);
    let streamed = spans.iter().find(|s| s.status.is_none()).unwrap();
    let streamed_record = records.iter().find(|r| r.status == 200).unwrap();
    let attrs = attributes(&streamed.attributes);
    // No incoming traceparent: a new trace, the gateway's span its root.
    assert!(streamed.parent_span_id.is_empty());
    assert_eq!(attrs["gen_ai.response.finish_reasons"], json!(["stop"]));
    assert_eq!(attrs["gen_ai.usage.output_tokens"], json!(streamed_record.completion_tokens));
    assert_eq!(attrs["flexway.request_id"], json!(streamed_record.request_id));

    let failed = spans.iter().find(|s| s.status.is_some()).unwrap();
    let failed_record = records.iter().find(|r| r.status != 200).unwrap();
    let status = failed.status.as_ref().unwrap();
    assert_eq!(status.code, 2, "STATUS_CODE_ERROR");
    assert_eq!(Some(status.message.as_str()), failed_record.error_code.map(|c| c.as_str()));
    let attrs = attributes(&failed.attributes);
    assert_eq!(attrs["error.type"], json!(failed_record.error_code));
    assert_eq!(attrs["http.response.status_code"], json!(refused_status));
    assert!(!attrs.contains_key("gen_ai.usage.input_tokens"), "nothing was consumed");

    // Metrics: cumulative histograms, exported within the interval.
    let mut metrics = Vec::new();
    for _ in 0..100 {
        metrics = collector.last_metrics();
        let calls: u64 = duration_points(&metrics).iter().map(|(_, count, _)| count).sum();
        if calls >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let durations = duration_points(&metrics);
    assert_eq!(durations.iter().map(|(_, count, _)| count).sum::<u64>(), 2);
    assert!(durations.iter().any(|(attrs, _, _)| attrs.get("error.type") == Some(&json!(failed_record.error_code))));
    let tokens = metrics.iter().find(|m| m.name == "gen_ai.client.token.usage").unwrap();
    assert_eq!(tokens.unit, "{token}");
    let Some(Data::Histogram(histogram)) = &tokens.data else { panic!("token usage is not a histogram") };
    assert_eq!(histogram.aggregation_temporality, 2, "cumulative");
    let sum_of = |kind: &str| -> f64 {
        histogram
            .data_points
            .iter()
            .filter(|p| attributes(&p.attributes)["gen_ai.token.type"] == json!(kind))
            .map(|p| p.sum.unwrap())
            .sum()
    };
    assert_eq!(sum_of("input"), streamed_record.prompt_tokens as f64);
    assert_eq!(sum_of("output"), streamed_record.completion_tokens as f64);
    for point in &histogram.data_points {
        assert_eq!(point.bucket_counts.len(), point.explicit_bounds.len() + 1);
        assert_eq!(point.bucket_counts.iter().sum::<u64>(), point.count);
        assert_eq!(attributes(&point.attributes)["gen_ai.provider.name"], json!("openai"));
    }
    let sent = collector.everything_sent();
    assert!(!sent.windows(CANARY.len()).any(|w| w == CANARY.as_bytes()));
}

/// `gen_ai.client.operation.duration`'s points: attributes, count, sum (seconds).
fn duration_points(metrics: &[Metric]) -> Vec<(serde_json::Map<String, serde_json::Value>, u64, f64)> {
    let Some(metric) = metrics.iter().find(|m| m.name == "gen_ai.client.operation.duration") else {
        return Vec::new();
    };
    assert_eq!(metric.unit, "s");
    let Some(Data::Histogram(histogram)) = &metric.data else { panic!("duration is not a histogram") };
    histogram.data_points.iter().map(|p| (attributes(&p.attributes), p.count, p.sum.unwrap())).collect()
}

#[tokio::test]
async fn a_failing_collector_never_fails_a_call() {
    let fake = FakeModel::start().await.unwrap();
    // One collector that refuses everything, one address where nothing listens.
    let (refusing, refusing_url) = Collector::start(StatusCode::SERVICE_UNAVAILABLE).await;
    let held = ClosedPort::new();
    let closed = format!("http://127.0.0.1:{}", held.port());
    for endpoint in [refusing_url, closed] {
        let (adapters, audit) = memory_adapters();
        let gw = serve_in_process(&yaml(&fake, &endpoint, "50ms"), adapters).await;
        for _ in 0..5 {
            let response = gw.chat(KEY, flexway_testkit::hello("m")).await;
            assert_eq!(response.status(), 200, "{endpoint}");
        }
        assert_eq!(audit.records().len(), 5);
        let mut failures = 0;
        for _ in 0..100 {
            failures = gw.gateway.telemetry.export_failures();
            if failures > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(failures > 0, "{endpoint}: the failed exports are counted");
        let metrics = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("flexway_telemetry_export_failures_total "), "{metrics}");
    }
    assert!(!refusing.spans().is_empty(), "the refusing collector was sent the spans");
}

#[tokio::test]
async fn a_function_sends_each_calls_telemetry_before_the_call_ends() {
    let fake = FakeModel::start().await.unwrap();
    let (collector, collector_url) = Collector::start(StatusCode::OK).await;
    let (mut adapters, _audit) = memory_adapters();
    adapters.export = flexway::telemetry::Export::EachCall;
    // An interval no test waits for: only the end of each call sends.
    let gw = serve_in_process(&yaml(&fake, &collector_url, "1h"), adapters).await;
    for n in 1..=3 {
        let response = gw.chat(KEY, flexway_testkit::hello("m")).await;
        assert_eq!(response.status(), 200);
        let _ = response.bytes().await.unwrap();
        assert_eq!(collector.spans().len(), n, "sent before the answer returned");
        let calls: u64 = duration_points(&collector.last_metrics()).iter().map(|(_, count, _)| count).sum();
        assert_eq!(calls, n as u64);
    }
}

#[tokio::test]
async fn without_telemetry_the_callers_trace_context_goes_upstream_unchanged() {
    let fake = FakeModel::start().await.unwrap();
    let (adapters, _audit) = memory_adapters();
    let gw = serve_in_process(&flexway_testkit::one_backend(&fake.url()), adapters).await;
    let traceparent = format!("00-{TRACE_ID}-{PARENT_ID}-01");
    let response = client()
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(KEY)
        .header("traceparent", &traceparent)
        .json(&flexway_testkit::hello("m"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let upstream = fake.requests().into_iter().next().unwrap();
    assert_eq!(upstream.header("traceparent"), Some(traceparent.as_str()));
    // And none is invented without one.
    let _ = gw.chat(KEY, flexway_testkit::hello("m")).await;
    assert_eq!(fake.requests()[1].header("traceparent"), None);
}
