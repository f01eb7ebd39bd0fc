//! The local shape's audit sinks: a JSONL file, stdout, and memory for tests.
//!
//! Invariant: a record is one whole line. Every `write` serializes its records into one
//! buffer and hands it over in one `write_all` under a lock, so lines from concurrent
//! calls never interleave, and the file is opened `O_APPEND` so that a restart (or a
//! second process) only ever adds lines after the existing ones.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use super::{AuditError, AuditRecord, AuditSink};

/// One JSON line per record, `\n`-terminated, in the order given.
fn jsonl(records: &[AuditRecord]) -> Result<Vec<u8>, AuditError> {
    let mut buffer = Vec::with_capacity(records.len() * 512);
    for record in records {
        serde_json::to_writer(&mut buffer, record)
            .map_err(|e| AuditError::Sink(format!("cannot serialize record {}: {e}", record.request_id)))?;
        buffer.push(b'\n');
    }
    Ok(buffer)
}

/// Appends records to a JSONL file (created if missing, never truncated).
///
/// The write is a plain `write(2)` of a few hundred bytes to the page cache, done on
/// the calling task: handing it to tokio's blocking pool (`tokio::fs`) cost two
/// thread hops, about 100 µs a call, for no durability gained.
pub struct FileAuditSink {
    path: PathBuf,
    file: std::sync::Mutex<std::fs::File>,
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
        Ok(FileAuditSink { path, file: std::sync::Mutex::new(file) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[async_trait::async_trait]
impl AuditSink for FileAuditSink {
    async fn write(&self, records: &[AuditRecord]) -> Result<(), AuditError> {
        if records.is_empty() {
            return Ok(());
        }
        let buffer = jsonl(records)?;
        let failed = |e: String| AuditError::Sink(format!("cannot write audit file {}: {e}", self.path.display()));
        let mut file = self.file.lock().map_err(|_| failed("lock poisoned".into()))?;
        // One write per call, O_APPEND: the lines of concurrent calls never interleave.
        file.write_all(&buffer).map_err(|e| failed(e.to_string()))
    }
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
        let buffer = jsonl(records)?;
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
            usage_source: UsageSource::Reported,
            cost_eur: 0.000_150,
            cost_micro_eur: 150,
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
