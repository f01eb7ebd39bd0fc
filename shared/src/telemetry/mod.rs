//! OpenTelemetry for each call (SPEC §9): one span with the GenAI semantic-convention
//! attributes and Flexway's own, and the GenAI client metrics
//! (`gen_ai.client.token.usage`, `gen_ai.client.operation.duration`), sent to a
//! collector over OTLP/HTTP with protobuf bodies.
//!
//! On the request path there is only a `try_send`: a finished call hands its
//! [`CallSpan`] (built from its audit record, so neither can carry a prompt or a
//! completion) to a bounded channel, and one exporter task (`export.rs`) folds it into
//! the metrics and batches the spans. A full channel or a failing collector loses
//! telemetry, counted in `flexway_telemetry_dropped_total` /
//! `flexway_telemetry_export_failures_total` and logged at most once a minute; it
//! never fails or slows a call.

pub mod context;
mod export;
pub mod otlp;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, oneshot};

pub use context::TraceContext;

use crate::audit::AuditRecord;
use crate::config::TelemetryConfig;

/// Finished calls waiting for the exporter; past this, they are dropped (counted).
const QUEUE: usize = 8192;
/// How long the end of a call may wait for its telemetry in [`Export::EachCall`].
const EACH_CALL_WAIT: Duration = Duration::from_secs(2);

/// When the exporter sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Export {
    /// Every `export_interval`, or as soon as a batch is full: a long-lived process.
    Batched,
    /// At the end of each call, which waits for it (bounded): a function frozen once
    /// its response ends could not send later.
    EachCall,
}

/// What a finished call tells telemetry: its audit record and what the record does
/// not keep.
#[derive(Debug, Clone)]
pub struct CallSpan {
    pub record: AuditRecord,
    pub trace: TraceContext,
    pub started: SystemTime,
    pub duration: Duration,
    /// The serving backend's kind (`gen_ai.provider.name`), once one was tried.
    pub provider: Option<&'static str>,
    /// The completion allowance per choice sent upstream.
    pub max_tokens: Option<u64>,
    pub finish_reasons: Vec<String>,
    /// Whether a backend's answer settled the call (usage attributes are then set).
    pub served: bool,
}

enum Message {
    Call(Box<CallSpan>),
    Flush(oneshot::Sender<()>),
}

#[derive(Debug, Default)]
struct Counters {
    dropped: AtomicU64,
    export_failures: AtomicU64,
}

/// The exporter's handle, shared by every call; `Telemetry::off()` when not configured.
#[derive(Clone)]
pub struct Telemetry {
    sender: Option<mpsc::Sender<Message>>,
    export: Export,
    counters: Arc<Counters>,
}

#[derive(Debug, thiserror::Error)]
#[error("telemetry: the exporter needs a Tokio runtime to start in")]
pub struct NoRuntime;

impl Telemetry {
    pub fn off() -> Self {
        Telemetry { sender: None, export: Export::Batched, counters: Arc::default() }
    }

    /// Starts the exporter task for `config` (none if `None`).
    pub fn start(config: Option<&TelemetryConfig>, export: Export) -> Result<Self, NoRuntime> {
        let Some(config) = config else {
            return Ok(Telemetry::off());
        };
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| NoRuntime)?;
        let (sender, receiver) = mpsc::channel(QUEUE);
        let counters = Arc::<Counters>::default();
        runtime.spawn(export::run(config.clone(), export, receiver, counters.clone()));
        Ok(Telemetry { sender: Some(sender), export, counters })
    }

    pub fn is_on(&self) -> bool {
        self.sender.is_some()
    }

    /// Hands a finished call to the exporter, never waiting: if the queue is full the
    /// call's telemetry is dropped and counted.
    pub fn record(&self, span: CallSpan) {
        let Some(sender) = &self.sender else {
            return;
        };
        if sender.try_send(Message::Call(Box::new(span))).is_err() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// In [`Export::EachCall`], waits (at most a couple of seconds) until what was
    /// recorded has been sent; in [`Export::Batched`], returns at once.
    pub async fn after_call(&self) {
        if self.export == Export::EachCall {
            self.flush(EACH_CALL_WAIT).await;
        }
    }

    /// Sends what is pending, spans and metrics, waiting at most `wait`.
    pub async fn flush(&self, wait: Duration) {
        let Some(sender) = &self.sender else {
            return;
        };
        let (done, sent) = oneshot::channel();
        if sender.send(Message::Flush(done)).await.is_ok() {
            let _ = tokio::time::timeout(wait, sent).await;
        }
    }

    /// Calls whose telemetry was dropped because the exporter's queue was full.
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Exports the collector refused or that could not reach it.
    pub fn export_failures(&self) -> u64 {
        self.counters.export_failures.load(Ordering::Relaxed)
    }

    /// The two counters in Prometheus' text format, for `/metrics`.
    pub fn render_prometheus(&self, out: &mut String) {
        if !self.is_on() {
            return;
        }
        out.push_str(&format!(
            "# HELP flexway_telemetry_dropped_total Calls whose OpenTelemetry span and metrics were dropped (exporter queue full).\n\
             # TYPE flexway_telemetry_dropped_total counter\n\
             flexway_telemetry_dropped_total {}\n\
             # HELP flexway_telemetry_export_failures_total OTLP exports that failed (collector unreachable or refusing).\n\
             # TYPE flexway_telemetry_export_failures_total counter\n\
             flexway_telemetry_export_failures_total {}\n",
            self.dropped(),
            self.export_failures()
        ));
    }
}
