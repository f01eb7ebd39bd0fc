//! The local shape's audit sinks: a JSONL file, stdout, and memory for tests.
//!
//! Invariant: a record is one whole line. Every `write` serializes its records into one
//! buffer and hands it over in one `write_all` under a lock, so lines from concurrent
//! calls never interleave, and the file is opened `O_APPEND` so that a restart (or a
//! second process) only ever adds lines after the existing ones.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use super::{AuditError, AuditRecord, AuditSink, ErrorCode};
use crate::json;

/// One JSON line per record, `\n`-terminated, in the order given.
fn jsonl(records: &[AuditRecord]) -> Vec<u8> {
    let mut buffer = Vec::with_capacity(records.len() * 640);
    for record in records {
        line(record, &mut buffer);
    }
    buffer
}

/// A record's line: the bytes serde_json makes of it (a test holds them equal; readers
/// parse it with serde), written by hand ([`crate::json`]): serde_json's escaping of
/// each name and value was ~5,500 instructions a call.
pub(super) fn line(record: &AuditRecord, out: &mut Vec<u8>) {
    out.push(b'{');
    json::key!(out, "schema_version");
    json::number(out, record.schema_version.into());
    json::next!(out, "ts");
    json::string(out, &record.ts.to_string());
    json::next!(out, "request_id");
    json::string(out, &record.request_id);
    json::next!(out, "tenant");
    json::string(out, &record.tenant);
    json::next!(out, "agent");
    json::option(out, record.agent.as_deref());
    json::next!(out, "operation");
    json::string(out, record.operation.as_str());
    json::next!(out, "capability");
    json::string(out, record.capability.as_str());
    json::next!(out, "model_requested");
    json::option(out, record.model_requested.as_deref());
    json::next!(out, "model_served");
    json::option(out, record.model_served.as_deref());
    json::next!(out, "backend");
    json::option(out, record.backend.as_deref());
    json::next!(out, "metered_by");
    json::string(out, record.metered_by.as_str());
    json::next!(out, "prompt_tokens");
    json::number(out, record.prompt_tokens);
    json::next!(out, "completion_tokens");
    json::number(out, record.completion_tokens);
    if let Some(cached) = record.cached_tokens {
        json::next!(out, "cached_tokens");
        json::number(out, cached);
    }
    if let Some(written) = record.cache_write_tokens {
        json::next!(out, "cache_write_tokens");
        json::number(out, written);
    }
    json::next!(out, "usage_source");
    json::string(out, record.usage_source.as_str());
    json::next!(out, "cost_eur");
    // serde_json's own float writer (and `null` for what is not finite).
    let _ = serde_json::to_writer(&mut *out, &record.cost_eur);
    json::next!(out, "cost_micro_eur");
    json::number(out, record.cost_micro_eur);
    if let Some(charged) = record.charged {
        json::next!(out, "charged");
        json::boolean(out, charged);
    }
    json::next!(out, "status");
    json::number(out, record.status.into());
    json::next!(out, "error_code");
    json::option(out, record.error_code.map(ErrorCode::as_str));
    json::next!(out, "degraded");
    json::boolean(out, record.degraded);
    json::next!(out, "budget_state");
    json::string(out, record.budget_state.as_str());
    json::next!(out, "latency_ms");
    json::number(out, record.latency_ms);
    json::next!(out, "ttfb_ms");
    match record.ttfb_ms {
        Some(ms) => json::number(out, ms),
        None => out.extend_from_slice(b"null"),
    }
    json::next!(out, "key_hash");
    json::string(out, &record.key_hash);
    json::next!(out, "user_hash");
    json::option(out, record.user_hash.as_deref());
    if let Some(reason) = record.close_reason {
        json::next!(out, "close_reason");
        json::string(out, reason.as_str());
    }
    if let Some(feature) = &record.feature {
        json::next!(out, "feature");
        json::string(out, feature);
    }
    if let Some(reason) = record.pick_reason {
        json::next!(out, "pick_reason");
        json::string(out, reason.as_str());
    }
    if let Some(class) = record.criticality {
        json::next!(out, "criticality");
        json::string(out, class.as_str());
    }
    if let Some(period) = &record.period {
        json::next!(out, "period");
        json::string(out, period);
    }
    if let Some(run) = &record.run {
        json::next!(out, "run");
        json::string(out, run);
    }
    // Rare fields, or floats: serde_json writes their values.
    if !record.skipped.is_empty() {
        json::next!(out, "skipped");
        let _ = serde_json::to_writer(&mut *out, &record.skipped);
    }
    if let Some(cache) = record.cache {
        json::next!(out, "cache");
        let _ = serde_json::to_writer(&mut *out, &cache);
    }
    if let Some(similarity) = record.cache_similarity {
        json::next!(out, "cache_similarity");
        let _ = serde_json::to_writer(&mut *out, &similarity);
    }
    if let Some(age) = record.cache_age_s {
        json::next!(out, "cache_age_s");
        json::number(out, age);
    }
    if let Some(saved) = record.cost_saved_eur {
        json::next!(out, "cost_saved_eur");
        let _ = serde_json::to_writer(&mut *out, &saved);
    }
    if let Some(saved) = record.cost_saved_micro_eur {
        json::next!(out, "cost_saved_micro_eur");
        json::number(out, saved);
    }
    if let Some(server) = &record.mcp_server {
        json::next!(out, "mcp_server");
        json::string(out, server);
    }
    if let Some(tool) = &record.tool {
        json::next!(out, "tool");
        json::string(out, tool);
    }
    if let Some(status) = record.mcp_status {
        json::next!(out, "mcp_status");
        json::string(out, status.as_str());
    }
    if let Some(chain) = &record.chain {
        json::next!(out, "chain");
        json::string(out, chain);
    }
    out.extend_from_slice(b"}\n");
}

/// Appends records to a JSONL file (created if missing, never truncated).
///
/// The write is a plain `write(2)` to the page cache, done on the calling task:
/// handing it to tokio's blocking pool (`tokio::fs`) cost two thread hops, about 100
/// µs a call, for no durability gained. Calls that end together share one: each
/// queues its lines, lets the other tasks its thread has ready run once (so that the
/// calls ending with it queue theirs), then writes whatever is queued unless another
/// did. A call returns once its lines are in the file, as when each made its own
/// write: a `kill -9` after a call answered never loses its record. Under a chained
/// audit (`audit.chain_key`) the chain's lock holds each write to its turn, so
/// nothing is shared there.
pub struct FileAuditSink {
    path: PathBuf,
    /// Held while writing: who holds it writes a batch, the others wait for it.
    file: std::sync::Mutex<std::fs::File>,
    queue: std::sync::Mutex<Queue>,
}

/// Lines queued for the next write, and which writes are done.
#[derive(Default)]
struct Queue {
    lines: Vec<u8>,
    /// Writes queued so far, and written (or failed) so far: `done <= queued`, and
    /// the write numbered `n` is done once `done >= n`.
    queued: u64,
    done: u64,
    /// The batches that failed, until each of their writes has read so.
    failed: Vec<Failed>,
}

/// A batch whose write failed: the first and last writes it held, why, and how many
/// of them have yet to read their outcome.
struct Failed {
    first: u64,
    last: u64,
    why: String,
    unread: u64,
}

impl Queue {
    /// Write `ticket`'s outcome, read once (each write reads its own exactly once).
    fn outcome(&mut self, ticket: u64) -> Result<(), String> {
        let Some(at) = self.failed.iter().position(|f| (f.first..=f.last).contains(&ticket)) else {
            return Ok(());
        };
        let failed = &mut self.failed[at];
        failed.unread -= 1;
        let why = failed.why.clone();
        if failed.unread == 0 {
            self.failed.swap_remove(at);
        }
        Err(why)
    }
}

impl std::fmt::Debug for FileAuditSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileAuditSink").field("path", &self.path).finish_non_exhaustive()
    }
}

impl FileAuditSink {
    /// Opens `path` for appending, creating it if it does not exist. Fails now, at
    /// startup, rather than on the first call, when the file cannot be written.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, AuditError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
            .map_err(|e| AuditError::Sink(format!("cannot open audit file {}: {e}", path.display())))?;
        Ok(FileAuditSink { path, file: std::sync::Mutex::new(file), queue: std::sync::Mutex::default() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes everything queued, unless a write already took write `ticket`'s lines;
    /// its outcome either way.
    fn flush(&self, ticket: u64) -> Result<(), String> {
        let mut file = self.file.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (lines, first, last) = {
            let mut queue = self.queue();
            if queue.done >= ticket {
                return queue.outcome(ticket);
            }
            (std::mem::take(&mut queue.lines), queue.done + 1, queue.queued)
        };
        // One write, O_APPEND: the lines of concurrent calls never interleave.
        let written = file.write_all(&lines);
        let mut queue = self.queue();
        queue.done = last;
        if let Err(e) = written {
            queue.failed.push(Failed { first, last, why: e.to_string(), unread: last - first + 1 });
        }
        if queue.lines.is_empty() {
            // The buffer's room serves the next batch.
            let mut lines = lines;
            lines.clear();
            queue.lines = lines;
        }
        queue.outcome(ticket)
    }
}

#[async_trait::async_trait]
impl AuditSink for FileAuditSink {
    async fn write(&self, records: &[AuditRecord]) -> Result<(), AuditError> {
        if records.is_empty() {
            return Ok(());
        }
        let ticket = {
            let mut queue = self.queue();
            for record in records {
                line(record, &mut queue.lines);
            }
            queue.queued += 1;
            queue.queued
        };
        let mut queued = Queued { sink: self, ticket, records, read: false };
        yield_once().await;
        queued.flush().map_err(|e| AuditError::Sink(format!("cannot write audit file {}: {e}", self.path.display())))
    }
}

/// A write queued: flushed once, by its call, or when its call is dropped while it
/// waits its turn (a client that left): the lines are written then, and a failure
/// logged with the records, since no caller is left to do so.
struct Queued<'a> {
    sink: &'a FileAuditSink,
    ticket: u64,
    records: &'a [AuditRecord],
    read: bool,
}

impl Queued<'_> {
    fn flush(&mut self) -> Result<(), String> {
        self.read = true;
        self.sink.flush(self.ticket)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if !self.read
            && let Err(why) = self.flush()
        {
            let why = format!("cannot write audit file {}: {why}", self.sink.path.display());
            for record in self.records {
                super::not_written(record, &why);
            }
        }
    }
}

/// Pending once, its task woken at once: the runtime polls the tasks already ready
/// before this one again.
async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if std::mem::replace(&mut yielded, true) {
            return std::task::Poll::Ready(());
        }
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

/// Writes records as JSON lines to the process's stdout (a container's log stream).
#[derive(Debug, Default, Clone, Copy)]
pub struct StdoutAuditSink;

#[async_trait::async_trait]
impl AuditSink for StdoutAuditSink {
    async fn write(&self, records: &[AuditRecord]) -> Result<(), AuditError> {
        if records.is_empty() {
            return Ok(());
        }
        let buffer = jsonl(records);
        // The lock keeps other writers to stdout from splitting our lines.
        let mut out = std::io::stdout().lock();
        out.write_all(&buffer)
            .and_then(|()| out.flush())
            .map_err(|e| AuditError::Sink(format!("cannot write audit to stdout: {e}")))
    }
}

/// Keeps records in memory, for tests.
#[derive(Debug, Default)]
pub struct MemoryAuditSink {
    records: std::sync::Mutex<Vec<AuditRecord>>,
}

impl MemoryAuditSink {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every record written so far, in order.
    pub fn records(&self) -> Vec<AuditRecord> {
        self.records.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

#[async_trait::async_trait]
impl AuditSink for MemoryAuditSink {
    async fn write(&self, records: &[AuditRecord]) -> Result<(), AuditError> {
        self.records.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(records);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::audit::{BudgetState, Operation, SCHEMA_VERSION, UsageSource};
    use crate::config::{Capability, Metering};

    fn record(n: u64) -> AuditRecord {
        AuditRecord {
            schema_version: SCHEMA_VERSION,
            ts: format!("2025-03-01T10:00:{:02}Z", n % 60).parse().unwrap(),
            request_id: format!("req-{n}"),
            tenant: "acme".into(),
            agent: n.is_multiple_of(2).then(|| "billing-bot".into()),
            operation: Operation::Chat,
            capability: Capability::Chat,
            model_requested: Some("gpt-4o".into()),
            model_served: Some("gpt-4o-2024-08-06".into()),
            backend: Some("ptu-west".into()),
            metered_by: Metering::Local,
            prompt_tokens: 100 + n,
            completion_tokens: 50,
            cached_tokens: None,
            cache_write_tokens: None,
            usage_source: UsageSource::Reported,
            cost_eur: 0.000_150,
            cost_micro_eur: 150,
            charged: None,
            status: 200,
            error_code: None,
            degraded: false,
            budget_state: BudgetState::Ok,
            latency_ms: 420,
            ttfb_ms: Some(120),
            key_hash: "ab".repeat(32),
            user_hash: None,
            close_reason: None,
            feature: None,
            pick_reason: None,
            criticality: None,
            period: None,
            run: None,
            skipped: Vec::new(),
            cache: None,
            cache_similarity: None,
            cache_age_s: None,
            cost_saved_eur: None,
            cost_saved_micro_eur: None,
            mcp_server: None,
            tool: None,
            mcp_status: None,
            chain: None,
        }
    }

    /// Every field, each kind of value (absent options, escapes, each enum's every
    /// name, costs serde_json writes in exponent form): the same bytes as serde_json's.
    #[test]
    fn a_line_is_what_serde_json_writes() {
        use crate::audit::{CacheOutcome, CloseReason, McpStatus};
        use crate::call::{Criticality, PickReason};
        let mut records = vec![record(1), record(2)];
        let operations = [
            Operation::Chat,
            Operation::Embeddings,
            Operation::Grpc,
            Operation::Realtime,
            Operation::Responses,
            Operation::Messages,
        ];
        let capabilities =
            [Capability::Chat, Capability::Vision, Capability::Embeddings, Capability::Realtime, Capability::Grpc];
        let reasons = [
            CloseReason::ClientClosed,
            CloseReason::UpstreamClosed,
            CloseReason::UpstreamError,
            CloseReason::BudgetExceeded,
            CloseReason::MessageTooLarge,
            CloseReason::Shutdown,
            CloseReason::Internal,
        ];
        let costs = [0.0, 1e-6, 0.000_150, 12_345.678_901, 1e21, f64::NAN];
        for (i, operation) in operations.into_iter().enumerate() {
            let mut r = record(10 + i as u64);
            r.operation = operation;
            r.capability = capabilities[i % capabilities.len()];
            r.metered_by = if i % 2 == 0 { Metering::Upstream } else { Metering::Local };
            r.usage_source = if i % 2 == 0 { UsageSource::Estimated } else { UsageSource::Reported };
            r.budget_state = [BudgetState::Ok, BudgetState::Soft, BudgetState::Exceeded][i % 3];
            r.close_reason = Some(reasons[i]);
            r.feature = Some(format!("feature-{i}"));
            r.cached_tokens = (i % 2 == 0).then_some(1024 + i as u64);
            r.cache_write_tokens = (i % 3 == 0).then_some(2048);
            r.pick_reason = Some(PickReason::ALL[i % PickReason::ALL.len()]);
            r.criticality = Some(Criticality::ALL[i % Criticality::ALL.len()]);
            r.period = Some(format!("2026-11-{:02}", 20 + i));
            r.run = (i % 2 == 1).then(|| format!("run \"{i}\""));
            r.charged = [None, Some(true), Some(false)][i % 3];
            if i % 3 == 1 {
                let cause = [crate::audit::SkipCause::CircuitOpen, crate::audit::SkipCause::Quota][i % 2];
                r.skipped = vec![crate::audit::Skipped { backend: format!("b-{i}"), cause }];
            }
            r.cache = Some(
                [CacheOutcome::Hit, CacheOutcome::Miss, CacheOutcome::Stored, CacheOutcome::Bypass, CacheOutcome::Off]
                    [i % 5],
            );
            if i % 5 == 0 {
                (r.cache_similarity, r.cache_age_s) = (Some([1.0, 0.973][i % 2]), Some(120 + i as u64));
                (r.cost_saved_eur, r.cost_saved_micro_eur) = (Some(costs[i]), Some(19_000 + i as u64));
            }
            if i % 2 == 1 {
                r.mcp_server = Some(format!("search-{i}"));
                r.tool = Some(format!("deep_\"search\" {i}"));
                r.mcp_status = Some([McpStatus::Ok, McpStatus::ToolError, McpStatus::Error][i % 3]);
            }
            r.chain = (i % 2 == 0).then(|| format!("0123456789abcdef:{i}:{}", "ef".repeat(32)));
            r.cost_eur = costs[i];
            r.error_code = Some(ErrorCode::UpstreamError);
            r.user_hash = Some("cd".repeat(32));
            r.ttfb_ms = None;
            r.degraded = true;
            r.status = 499;
            r.model_requested = None;
            records.push(r);
        }
        let mut odd = record(99);
        odd.tenant = "quote \" back \\ tab \t é".into();
        odd.agent = Some("\u{1}".into());
        odd.close_reason = Some(CloseReason::Internal);
        odd.prompt_tokens = u64::MAX;
        records.push(odd);
        for r in &records {
            let mut written = Vec::new();
            line(r, &mut written);
            let mut serde = serde_json::to_vec(r).unwrap();
            serde.push(b'\n');
            assert_eq!(String::from_utf8(written).unwrap(), String::from_utf8(serde).unwrap());
        }
    }

    fn read_back(path: &Path) -> Vec<AuditRecord> {
        let text = std::fs::read_to_string(path).unwrap();
        assert!(text.ends_with('\n'), "every line is terminated");
        text.lines().map(|line| serde_json::from_str(line).unwrap()).collect()
    }

    #[tokio::test]
    async fn file_sink_lines_parse_back_to_equal_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let sink = FileAuditSink::open(&path).unwrap();
        let written = vec![record(1), record(2), record(3)];
        sink.write(&written).await.unwrap();
        assert_eq!(read_back(&path), written);
    }

    #[tokio::test]
    async fn file_sink_appends_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        FileAuditSink::open(&path).unwrap().write(&[record(1)]).await.unwrap();
        let reopened = FileAuditSink::open(&path).unwrap();
        reopened.write(&[record(2)]).await.unwrap();
        reopened.write(&[]).await.unwrap();
        reopened.write(&[record(3)]).await.unwrap();
        assert_eq!(read_back(&path), vec![record(1), record(2), record(3)]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_writes_give_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let sink = Arc::new(FileAuditSink::open(&path).unwrap());
        let mut tasks = Vec::new();
        for task in 0..16_u64 {
            let sink = Arc::clone(&sink);
            tasks.push(tokio::spawn(async move {
                for call in 0..25_u64 {
                    // Batches of 1..=3 records, so that a call's records must stay together.
                    let base = task * 1000 + call * 10;
                    let batch: Vec<_> = (0..=(call % 3)).map(|i| record(base + i)).collect();
                    sink.write(&batch).await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let records = read_back(&path);
        // Per task: 9 batches of 1, 8 of 2, 8 of 3.
        assert_eq!(records.len(), 16 * 49);
        // A batch's records are adjacent: request ids base, base+1, ... in order.
        let ids: Vec<u64> = records.iter().map(|r| r.request_id.trim_start_matches("req-").parse().unwrap()).collect();
        for pair in ids.windows(2) {
            if pair[1] % 10 != 0 {
                assert_eq!(pair[1], pair[0] + 1, "batch split: {pair:?}");
            }
        }
    }

    /// Writes that share a failed batch each get the failure; the next batch is
    /// tried again.
    #[tokio::test]
    async fn every_write_of_a_failed_batch_is_told() {
        let sink = Arc::new(FileAuditSink::open("/dev/full").unwrap());
        let writes: Vec<_> = (0..8_u64)
            .map(|n| {
                let sink = Arc::clone(&sink);
                tokio::spawn(async move { sink.write(&[record(n)]).await })
            })
            .collect();
        for write in writes {
            let error = write.await.unwrap().unwrap_err();
            assert!(error.to_string().contains("/dev/full"), "{error}");
        }
        assert!(sink.write(&[record(9)]).await.is_err(), "a later write fails on its own");
        let queue = sink.queue();
        assert_eq!((queue.queued, queue.done), (9, 9));
        assert!(queue.failed.is_empty(), "each write read its failure, and the failures went with them");
    }

    /// A write dropped while it waits its turn (its call's client left) still
    /// reaches the file.
    #[tokio::test]
    async fn a_write_dropped_while_queued_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let sink = FileAuditSink::open(&path).unwrap();
        let records = [record(1)];
        let mut write = sink.write(&records);
        // Polled once: queued, then pending at its turn; then dropped.
        assert!(futures_util::poll!(&mut write).is_pending());
        drop(write);
        assert_eq!(read_back(&path), vec![record(1)]);
        let queue = sink.queue();
        assert_eq!((queue.queued, queue.done), (1, 1));
    }

    #[test]
    fn open_fails_on_an_unwritable_path() {
        let dir = tempfile::tempdir().unwrap();
        let error = FileAuditSink::open(dir.path().join("missing-dir/audit.jsonl")).unwrap_err();
        assert!(error.to_string().contains("missing-dir"), "{error}");
    }

    #[tokio::test]
    async fn memory_sink_keeps_records_in_order() {
        let sink = MemoryAuditSink::new();
        sink.write(&[record(1)]).await.unwrap();
        sink.write(&[record(2), record(3)]).await.unwrap();
        assert_eq!(sink.records(), vec![record(1), record(2), record(3)]);
    }
}
