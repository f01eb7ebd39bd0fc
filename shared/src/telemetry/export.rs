//! The exporter task: folds each finished call into the two GenAI histograms, batches
//! the sampled spans, and posts both to the collector (`{endpoint}/v1/traces`,
//! `{endpoint}/v1/metrics`). Metrics are cumulative since the process started, one
//! series per attribute set, and sent only when something changed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prost::Message as _;
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;

use super::otlp::{self, KeyValue, kv};
use super::{CallSpan, Counters, Export, Message};
use crate::audit::CallStatus;
use crate::config::TelemetryConfig;

/// Spans per export request at most (a batch is sent as soon as it is full).
const MAX_BATCH: usize = 512;
const POST_TIMEOUT: Duration = Duration::from_secs(10);
/// A collector that stays down is said once a minute in the log, not once a call.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The semantic conventions' advised buckets for `gen_ai.client.token.usage`.
const TOKEN_BOUNDS: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0,
    67108864.0,
];
/// ... and for `gen_ai.client.operation.duration`, in seconds.
const DURATION_BOUNDS: [f64; 14] =
    [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92];

pub(super) async fn run(
    config: TelemetryConfig,
    export: Export,
    mut receiver: mpsc::Receiver<Message>,
    counters: Arc<Counters>,
) {
    let mut exporter = Exporter::new(&config, counters);
    let mut metrics = Metrics::new(unix_nanos(SystemTime::now()));
    let mut batch = Vec::new();
    let mut tick = tokio::time::interval(config.export_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            message = receiver.recv() => match message {
                Some(Message::Call(call)) => {
                    metrics.observe(&call);
                    if call.trace.sampled() {
                        batch.push(span(&call));
                    }
                    if batch.len() >= MAX_BATCH {
                        exporter.spans(std::mem::take(&mut batch)).await;
                    }
                }
                Some(Message::Flush(done)) => {
                    exporter.spans(std::mem::take(&mut batch)).await;
                    exporter.metrics(&mut metrics).await;
                    let _ = done.send(());
                }
                None => {
                    exporter.spans(std::mem::take(&mut batch)).await;
                    exporter.metrics(&mut metrics).await;
                    return;
                }
            },
            _ = tick.tick(), if export == Export::Batched => {
                exporter.spans(std::mem::take(&mut batch)).await;
                exporter.metrics(&mut metrics).await;
            }
        }
    }
}

struct Exporter {
    client: Option<reqwest::Client>,
    traces_url: String,
    metrics_url: String,
    resource: otlp::Resource,
    counters: Arc<Counters>,
    warned: Option<Instant>,
}

impl Exporter {
    fn new(config: &TelemetryConfig, counters: Arc<Counters>) -> Self {
        let client =
            reqwest::Client::builder().timeout(POST_TIMEOUT).user_agent(crate::call::headers::USER_AGENT).build();
        if let Err(e) = &client {
            tracing::error!("telemetry: cannot build the OTLP client, nothing will be exported: {e}");
        }
        let resource = otlp::Resource {
            attributes: vec![
                kv("service.name", "flexway"),
                kv("service.version", env!("CARGO_PKG_VERSION")),
                // Cumulative series of two processes (two Lambda environments) must
                // not be taken for one.
                kv("service.instance.id", uuid::Uuid::new_v4().to_string()),
            ],
            ..Default::default()
        };
        Exporter {
            client: client.ok(),
            traces_url: format!("{}/v1/traces", config.otlp_endpoint),
            metrics_url: format!("{}/v1/metrics", config.otlp_endpoint),
            resource,
            counters,
            warned: None,
        }
    }

    async fn spans(&mut self, spans: Vec<otlp::Span>) {
        if spans.is_empty() {
            return;
        }
        let request = otlp::ExportTraceServiceRequest {
            resource_spans: vec![otlp::ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![otlp::ScopeSpans { scope: Some(scope()), spans, ..Default::default() }],
                ..Default::default()
            }],
        };
        let url = self.traces_url.clone();
        self.post(&url, request.encode_to_vec()).await;
    }

    async fn metrics(&mut self, metrics: &mut Metrics) {
        let Some(metrics) = metrics.take_changed() else {
            return;
        };
        let request = otlp::ExportMetricsServiceRequest {
            resource_metrics: vec![otlp::ResourceMetrics {
                resource: Some(self.resource.clone()),
                scope_metrics: vec![otlp::ScopeMetrics { scope: Some(scope()), metrics, ..Default::default() }],
                ..Default::default()
            }],
        };
        let url = self.metrics_url.clone();
        self.post(&url, request.encode_to_vec()).await;
    }

    async fn post(&mut self, url: &str, body: Vec<u8>) {
        let Some(client) = &self.client else {
            self.counters.export_failures.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let sent =
            client.post(url).header(http::header::CONTENT_TYPE, "application/x-protobuf").body(body).send().await;
        let failure = match sent {
            Ok(response) if response.status().is_success() => return,
            Ok(response) => format!("the collector answered {}", response.status()),
            Err(e) => format!("the collector is unreachable: {e}"),
        };
        self.counters.export_failures.fetch_add(1, Ordering::Relaxed);
        if self.warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
            self.warned = Some(Instant::now());
            tracing::warn!("telemetry: export to {url} failed ({failure}); calls go on, their telemetry is lost");
        }
    }
}

fn scope() -> otlp::InstrumentationScope {
    otlp::InstrumentationScope {
        name: "flexway".to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        ..Default::default()
    }
}

/// `gen_ai.operation.name`: a call through the Responses or the Anthropic Messages
/// door is a chat in the GenAI conventions' words (the audit's `operation` says which
/// door it came by).
fn gen_ai_operation(operation: crate::audit::Operation) -> &'static str {
    use crate::audit::Operation;
    match operation {
        Operation::Responses | Operation::Messages => "chat",
        other => other.as_str(),
    }
}

/// The call's span: named `{operation} {model}`, kind CLIENT (the gateway calls a
/// model), with the GenAI attributes and Flexway's own.
fn span(call: &CallSpan) -> otlp::Span {
    let record = &call.record;
    let operation = gen_ai_operation(record.operation);
    let name = match &record.model_requested {
        Some(model) => format!("{operation} {model}"),
        None => operation.to_owned(),
    };
    let mut attributes = vec![kv("gen_ai.operation.name", operation)];
    if let Some(provider) = call.provider {
        attributes.push(kv("gen_ai.provider.name", provider));
    }
    if let Some(model) = &record.model_requested {
        attributes.push(kv("gen_ai.request.model", model.as_str()));
    }
    if let Some(model) = &record.model_served {
        attributes.push(kv("gen_ai.response.model", model.as_str()));
    }
    if let Some(max_tokens) = call.max_tokens {
        attributes.push(kv("gen_ai.request.max_tokens", max_tokens));
    }
    if call.served {
        attributes.push(kv("gen_ai.usage.input_tokens", record.prompt_tokens));
        attributes.push(kv("gen_ai.usage.output_tokens", record.completion_tokens));
    }
    if !call.finish_reasons.is_empty() {
        attributes.push(kv("gen_ai.response.finish_reasons", call.finish_reasons.clone()));
    }
    attributes.push(match record.call_status() {
        CallStatus::Http(status) => kv("http.response.status_code", u64::from(status)),
        CallStatus::Grpc(code) => kv("rpc.grpc.status_code", u64::from(code)),
    });
    if let Some(code) = &record.error_code {
        attributes.push(kv("error.type", code.as_str()));
    }
    attributes.push(kv("flexway.tenant", record.tenant.as_str()));
    if let Some(agent) = &record.agent {
        attributes.push(kv("flexway.agent", agent.as_str()));
    }
    if let Some(backend) = &record.backend {
        attributes.push(kv("flexway.backend", backend.as_str()));
    }
    attributes.push(kv("flexway.request_id", record.request_id.as_str()));
    attributes.push(kv("flexway.budget_state", record.budget_state.as_str()));
    attributes.push(kv("flexway.cost_eur", record.cost_eur));
    if let Some(reason) = record.pick_reason {
        attributes.push(kv("flexway.pick_reason", reason.as_str()));
    }
    if let Some(class) = record.criticality {
        attributes.push(kv("flexway.criticality", class.as_str()));
    }
    let trace = &call.trace;
    let remote = if trace.parent_span_id.is_some() { otlp::SpanFlags::ContextIsRemoteMask as u32 } else { 0 };
    otlp::Span {
        trace_id: trace.trace_id.to_vec(),
        span_id: trace.span_id.to_vec(),
        trace_state: trace.state.as_ref().and_then(|s| s.to_str().ok()).unwrap_or_default().to_owned(),
        parent_span_id: trace.parent_span_id.map(|p| p.to_vec()).unwrap_or_default(),
        name,
        kind: otlp::SpanKind::Client.into(),
        start_time_unix_nano: unix_nanos(call.started),
        end_time_unix_nano: unix_nanos(call.started + call.duration),
        attributes,
        status: record
            .error_code
            .map(|code| otlp::Status { message: code.as_str().to_owned(), code: otlp::StatusCode::Error.into() }),
        flags: u32::from(trace.flags) | otlp::SpanFlags::ContextHasIsRemoteMask as u32 | remote,
        ..Default::default()
    }
}

/// One histogram series, explicit buckets.
#[derive(Debug, Clone)]
struct Series {
    count: u64,
    sum: f64,
    min: f64,
    max: f64,
    buckets: Vec<u64>,
}

impl Series {
    fn new(bounds: &[f64]) -> Self {
        Series { count: 0, sum: 0.0, min: f64::INFINITY, max: f64::NEG_INFINITY, buckets: vec![0; bounds.len() + 1] }
    }

    fn observe(&mut self, bounds: &[f64], value: f64) {
        self.count += 1;
        self.sum += value;
        self.min = self.min.min(value);
        self.max = self.max.max(value);
        // Buckets are (previous bound, bound], the last one unbounded.
        let bucket = bounds.iter().position(|b| value <= *b).unwrap_or(bounds.len());
        self.buckets[bucket] += 1;
    }
}

type Attributes = Vec<(&'static str, String)>;

/// The two GenAI client histograms, cumulative since `start`.
struct Metrics {
    start: u64,
    tokens: BTreeMap<Attributes, Series>,
    duration: BTreeMap<Attributes, Series>,
    changed: bool,
}

impl Metrics {
    fn new(start: u64) -> Self {
        Metrics { start, tokens: BTreeMap::new(), duration: BTreeMap::new(), changed: false }
    }

    fn observe(&mut self, call: &CallSpan) {
        let record = &call.record;
        let mut common: Attributes = vec![("gen_ai.operation.name", gen_ai_operation(record.operation).to_owned())];
        if let Some(provider) = call.provider {
            common.push(("gen_ai.provider.name", provider.to_owned()));
        }
        if let Some(model) = &record.model_requested {
            common.push(("gen_ai.request.model", model.clone()));
        }
        if let Some(model) = &record.model_served {
            common.push(("gen_ai.response.model", model.clone()));
        }
        common.push(("flexway.tenant", record.tenant.clone()));
        if call.served {
            for (kind, tokens) in [("input", record.prompt_tokens), ("output", record.completion_tokens)] {
                let mut attributes = common.clone();
                attributes.push(("gen_ai.token.type", kind.to_owned()));
                self.tokens
                    .entry(attributes)
                    .or_insert_with(|| Series::new(&TOKEN_BOUNDS))
                    .observe(&TOKEN_BOUNDS, tokens as f64);
            }
        }
        let mut attributes = common;
        if let Some(code) = &record.error_code {
            attributes.push(("error.type", code.as_str().to_owned()));
        }
        let seconds = call.duration.as_secs_f64();
        self.duration
            .entry(attributes)
            .or_insert_with(|| Series::new(&DURATION_BOUNDS))
            .observe(&DURATION_BOUNDS, seconds);
        self.changed = true;
    }

    /// The metrics to send, if anything was observed since the last time.
    fn take_changed(&mut self) -> Option<Vec<otlp::Metric>> {
        if !std::mem::take(&mut self.changed) {
            return None;
        }
        let now = unix_nanos(SystemTime::now());
        let histogram = |series: &BTreeMap<Attributes, Series>, bounds: &[f64]| otlp::Histogram {
            data_points: series
                .iter()
                .map(|(attributes, s)| otlp::HistogramDataPoint {
                    start_time_unix_nano: self.start,
                    time_unix_nano: now,
                    count: s.count,
                    sum: Some(s.sum),
                    bucket_counts: s.buckets.clone(),
                    explicit_bounds: bounds.to_vec(),
                    attributes: attributes.iter().map(|(k, v)| kv(k, v.as_str())).collect::<Vec<KeyValue>>(),
                    min: Some(s.min),
                    max: Some(s.max),
                    ..Default::default()
                })
                .collect(),
            aggregation_temporality: otlp::AggregationTemporality::Cumulative.into(),
        };
        let mut metrics = Vec::new();
        if !self.tokens.is_empty() {
            metrics.push(otlp::Metric {
                name: "gen_ai.client.token.usage".to_owned(),
                description: "Tokens used per call, by token type (input, output)".to_owned(),
                unit: "{token}".to_owned(),
                data: Some(otlp::Data::Histogram(histogram(&self.tokens, &TOKEN_BOUNDS))),
                ..Default::default()
            });
        }
        metrics.push(otlp::Metric {
            name: "gen_ai.client.operation.duration".to_owned(),
            description: "Duration of each call through the gateway".to_owned(),
            unit: "s".to_owned(),
            data: Some(otlp::Data::Histogram(histogram(&self.duration, &DURATION_BOUNDS))),
            ..Default::default()
        });
        Some(metrics)
    }
}

fn unix_nanos(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_calls_span_carries_its_grpc_status_not_an_http_one() {
        let call = |operation, status| {
            let mut record = crate::audit::sample::record("acme", Some("ocr"), crate::config::Metering::Local, 0);
            record.operation = operation;
            record.status = status;
            let trace = crate::telemetry::TraceContext::from_headers(&http::HeaderMap::new(), true);
            let started = SystemTime::now();
            let call = CallSpan {
                record,
                trace,
                started,
                duration: Duration::ZERO,
                provider: None,
                max_tokens: None,
                finish_reasons: Vec::new(),
                served: true,
            };
            span(&call).attributes.into_iter().map(|a| a.key).collect::<Vec<_>>()
        };
        let grpc = call(crate::audit::Operation::Grpc, 14);
        assert!(grpc.iter().any(|k| k == "rpc.grpc.status_code") && !grpc.iter().any(|k| k.starts_with("http.")));
        let chat = call(crate::audit::Operation::Chat, 200);
        assert!(chat.iter().any(|k| k == "http.response.status_code") && !chat.iter().any(|k| k.starts_with("rpc.")));
    }

    #[test]
    fn buckets_hold_values_up_to_their_bound() {
        let bounds = [1.0, 4.0];
        let mut series = Series::new(&bounds);
        for value in [0.0, 1.0, 2.0, 4.0, 5.0] {
            series.observe(&bounds, value);
        }
        assert_eq!(series.buckets, vec![2, 2, 1]);
        assert_eq!((series.count, series.sum, series.min, series.max), (5, 12.0, 0.0, 5.0));
    }
}
