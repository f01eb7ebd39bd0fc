//! `CloudWatchAuditSink`: the audit of the serverless shape, in a CloudWatch Logs
//! stream. One log event per record (its JSON line), so `flexway report
//! --log-group` and Logs Insights read records as they are.
//!
//! What must never happen: a record dropped without anyone being told. A batch that
//! CloudWatch refuses is retried with backoff (the stream is re-created if it
//! vanished); after the last attempt `write` returns the error and the caller logs
//! it, records included, to the function's own log. Events CloudWatch accepts the
//! call for but rejects (too old, too new) are an error too.

use std::time::Duration;

use aws_sdk_cloudwatchlogs::Client;
use aws_sdk_cloudwatchlogs::error::DisplayErrorContext;
use aws_sdk_cloudwatchlogs::types::InputLogEvent;
use flexway::audit::{AuditError, AuditRecord, AuditSink};
use tokio::sync::OnceCell;

/// PutLogEvents limits: 10,000 events and 1,048,576 bytes per call, each event
/// counting its UTF-8 size plus 26 bytes.
const MAX_EVENTS: usize = 10_000;
const MAX_BATCH_BYTES: usize = 1_048_576;
const EVENT_OVERHEAD: usize = 26;
const ATTEMPTS: u32 = 4;

pub struct CloudWatchAuditSink {
    client: Client,
    group: String,
    stream: String,
    stream_ready: OnceCell<()>,
}

impl std::fmt::Debug for CloudWatchAuditSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CloudWatchAuditSink")
            .field("group", &self.group)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl CloudWatchAuditSink {
    pub fn new(client: Client, group: impl Into<String>, stream: impl Into<String>) -> Self {
        CloudWatchAuditSink { client, group: group.into(), stream: stream.into(), stream_ready: OnceCell::new() }
    }

    pub fn group(&self) -> &str {
        &self.group
    }

    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// Creates the stream if it is missing (the group must exist: the infrastructure
    /// owns it, with its retention). Called at init, which also warms the connection.
    pub async fn ensure_stream(&self) -> Result<(), AuditError> {
        self.stream_ready.get_or_try_init(|| self.create_stream()).await.map(|_| ())
    }

    /// CreateLogStream, retried with backoff while CloudWatch throttles it (50 calls
    /// per second per account: a burst of cold starts meets that limit).
    async fn create_stream(&self) -> Result<(), AuditError> {
        let mut attempt = 0;
        loop {
            let result =
                self.client.create_log_stream().log_group_name(&self.group).log_stream_name(&self.stream).send().await;
            let e = match result {
                Ok(_) => return Ok(()),
                Err(e) if e.as_service_error().is_some_and(|e| e.is_resource_already_exists_exception()) => {
                    return Ok(());
                }
                Err(e) => e,
            };
            let throttled = e.as_service_error().and_then(|e| e.meta().code()) == Some("ThrottlingException");
            attempt += 1;
            if !throttled || attempt == ATTEMPTS {
                return Err(AuditError::Sink(format!(
                    "cannot create log stream {}/{}: {}",
                    self.group,
                    self.stream,
                    DisplayErrorContext(&e)
                )));
            }
            tokio::time::sleep(Duration::from_millis(100 << (2 * (attempt - 1)))).await;
        }
    }

    async fn put(&self, events: Vec<InputLogEvent>) -> Result<(), AuditError> {
        let mut last = String::new();
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(100 << (2 * (attempt - 1)))).await;
            }
            let result = self
                .client
                .put_log_events()
                .log_group_name(&self.group)
                .log_stream_name(&self.stream)
                .set_log_events(Some(events.clone()))
                .send()
                .await;
            match result {
                Ok(output) => {
                    return match output.rejected_log_events_info() {
                        Some(rejected) => Err(AuditError::Sink(format!(
                            "CloudWatch rejected audit events in {}/{}: {rejected:?}",
                            self.group, self.stream
                        ))),
                        None => Ok(()),
                    };
                }
                Err(e) => {
                    if e.as_service_error().is_some_and(|e| e.is_resource_not_found_exception()) {
                        // The stream was deleted under us: create it again, then retry.
                        let _ = self.create_stream().await;
                    }
                    last = DisplayErrorContext(&e).to_string();
                    tracing::warn!(attempt, error = %last, "PutLogEvents failed; retrying");
                }
            }
        }
        Err(AuditError::Sink(format!(
            "PutLogEvents to {}/{} failed after {ATTEMPTS} attempts: {last}",
            self.group, self.stream
        )))
    }
}

#[async_trait::async_trait]
impl AuditSink for CloudWatchAuditSink {
    /// Concurrent writes are concurrent PutLogEvents: either may land first.
    fn ordered(&self) -> bool {
        false
    }

    /// PutLogEvents over the network.
    fn waits(&self) -> bool {
        true
    }

    async fn write(&self, records: &[AuditRecord]) -> Result<(), AuditError> {
        if records.is_empty() {
            return Ok(());
        }
        self.ensure_stream().await?;
        // One timestamp for the call: events in a batch must be in time order, and
        // records arrive in the order calls ended.
        let timestamp = i64::try_from(flexway::budget::period::unix_now_millis()).unwrap_or(i64::MAX);
        let mut batch = Vec::new();
        let mut bytes = 0;
        for record in records {
            let line = serde_json::to_string(record)
                .map_err(|e| AuditError::Sink(format!("cannot serialize record {}: {e}", record.request_id)))?;
            let size = line.len() + EVENT_OVERHEAD;
            if !batch.is_empty() && (batch.len() == MAX_EVENTS || bytes + size > MAX_BATCH_BYTES) {
                self.put(std::mem::take(&mut batch)).await?;
                bytes = 0;
            }
            let event = InputLogEvent::builder()
                .timestamp(timestamp)
                .message(line)
                .build()
                .map_err(|e| AuditError::Sink(e.to_string()))?;
            batch.push(event);
            bytes += size;
        }
        self.put(batch).await
    }
}
