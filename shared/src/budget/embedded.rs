//! `EmbeddedBudgetStore`: the durable local ledger (`store: {kind: embedded, path: ...}`),
//! one redb file, the same rules as every other store (`ledger.rs`).
//!
//! Writes go through one writer thread that commits in groups: it blocks for an
//! operation, drains whatever else is already queued (up to [`MAX_BATCH`]), applies
//! them in arrival order inside one write transaction — each operation's rules see the
//! state the previous ones left — commits once, and only then answers every caller of
//! the batch. One fsync serves many concurrent calls.
//!
//! A call pays one fsync, and a small one: the database is committed without an fsync
//! (redb's `Durability::None`: visible at once to every later read and write, kept in
//! this process's memory), and what each batch wrote (counters' new values,
//! reservations put or removed) is appended to the journal (`<file>.journal`, one JSON
//! line a batch, one `write(2)`). A batch holding a reservation, an intent or a sweep
//! is acknowledged once that line is on disk (`fdatasync` of the journal: one small
//! write where a durable redb commit rewrites about ten pages); a batch of settlements
//! and refunds alone once the line is in the page cache, which a killed process does
//! not lose, and the next synced line or checkpoint carries it to the disk. A
//! checkpoint (a durable redb commit, then the journal emptied) runs every
//! [`CHECKPOINT_EVERY`], past [`CHECKPOINT_BYTES`] of journal, and at close. `open`
//! replays what a dead process left in the journal before anything else: the lines
//! hold values, not operations, so replaying a line twice changes nothing.
//!
//! Invariants:
//! - nothing acknowledged is lost when the process dies: a reservation, intent or sweep
//!   is acknowledged only after the fsync of the journal line that holds it; a
//!   settlement once the journal holds it (a power loss, unlike a killed process, may
//!   take the settlements journaled since the last fsync with the page cache: their
//!   reservations stay held, and the sweeper refunds them at their expiry). If the
//!   journal or the commit fails, every operation of the batch gets the error;
//! - an operation applies whole or not at all: its reads and writes go through an
//!   overlay that reaches the tables only once its rules returned `Ok`; an operation
//!   whose rules fail leaves nothing behind and the rest of the batch proceeds. (redb
//!   refuses a savepoint once a transaction has opened a table, so per-operation
//!   savepoints inside a batch are not available.) A storage error while writing an
//!   overlay aborts the whole batch;
//! - reads (`used`, `live_reservations`) use their own read transaction and see
//!   committed data only: what a caller was told, never what is still in flight.
//!
//! A batch whose journal line was written but whose fsync or commit failed is answered
//! with the error, yet a replay may still apply it: a reservation its caller was refused
//! for is then held until the sweeper refunds it, never a charge that did not happen.
//!
//! A call whose future is dropped after its operation was queued may still apply;
//! retrying is safe because reservations are idempotent on the request id.
//!
//! File layout: `<dir>/ledger.redb` when `path` is a directory or has no extension
//! (the directory is created), else the file `path` itself; the journal beside it.
//! Two tables: `counters` (counter key → value) and `reservations` (request id → JSON
//! `StoredReservation`).

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::Instant;

use redb::{
    Database, Durability, ReadOnlyTable, ReadableDatabase, ReadableTable, Table, TableDefinition, WriteTransaction,
};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::ledger::{self, LedgerState, StoredReservation};
use super::{
    BudgetStore, CounterKey, IntentOutcome, Reservation, ReserveOutcome, ReserveRequest, SettleOutcome, StoreError,
    Swept,
};

const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");
const RESERVATIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("reservations");

/// The most operations one commit carries; more wait for the next one.
pub const MAX_BATCH: usize = 256;

/// A checkpoint at least this often while the journal holds anything.
pub const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// A checkpoint once the journal holds this much.
pub const CHECKPOINT_BYTES: u64 = 4 * 1024 * 1024;

/// The file name used when `open` is given a directory.
pub const FILE_NAME: &str = "ledger.redb";

pub struct EmbeddedBudgetStore {
    db: Arc<Database>,
    file: PathBuf,
    /// `None` only while dropping: closing the channel stops the writer.
    ops: Option<mpsc::Sender<Job>>,
    writer: Option<JoinHandle<()>>,
    commits: Arc<AtomicU64>,
}

impl fmt::Debug for EmbeddedBudgetStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedBudgetStore")
            .field("file", &self.file)
            .field("commits", &self.commits())
            .finish_non_exhaustive()
    }
}

impl EmbeddedBudgetStore {
    /// Creates or opens the ledger at `path` and starts its writer thread.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let file = database_file(path)?;
        let db = Database::create(&file).map_err(|e| backend(format!("open {}: {e}", file.display())))?;
        let (mut journal, left) = Journal::open(&journal_file(&file))?;
        // Both tables exist before the first read transaction looks for them, and what a
        // killed process acknowledged without an fsync is replayed, durably.
        let txn = db.begin_write().map_err(backend)?;
        {
            let mut tables = Tables::open(&txn)?;
            for effects in &left {
                effects.replay(&mut tables)?;
            }
        }
        txn.commit().map_err(backend)?;
        journal.clear()?;
        if !left.is_empty() {
            tracing::info!(batches = left.len(), file = %file.display(), "ledger: journal replayed");
        }

        let db = Arc::new(db);
        let commits = Arc::new(AtomicU64::new(0));
        let (ops, queue) = mpsc::channel();
        let writer = thread::Builder::new()
            .name("flexway-ledger".into())
            .spawn({
                let db = db.clone();
                let commits = commits.clone();
                move || write_loop(&db, &queue, &mut journal, &commits)
            })
            .map_err(|e| backend(format!("start the ledger writer: {e}")))?;
        Ok(Self { db, file, ops: Some(ops), writer: Some(writer), commits })
    }

    /// The database file in use.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Write transactions committed since `open`: fewer than the operations acknowledged
    /// when concurrent calls shared commits.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Queues one operation and waits for the commit that makes it durable.
    async fn submit<T>(&self, job: impl FnOnce(Reply<T>) -> Job) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let ops = self.ops.as_ref().ok_or_else(|| backend("ledger writer stopped"))?;
        ops.send(job(reply)).map_err(|_| backend("ledger writer stopped"))?;
        answer.await.map_err(|_| backend("ledger writer stopped before answering"))?
    }
}

impl Drop for EmbeddedBudgetStore {
    /// Closes the queue and waits for the writer to finish the batch in hand, so the file
    /// is released when the store is gone (a reopen in the same process then succeeds).
    fn drop(&mut self) {
        drop(self.ops.take());
        if let Some(writer) = self.writer.take()
            && writer.join().is_err()
        {
            tracing::error!(file = %self.file.display(), "the ledger writer thread panicked");
        }
    }
}

#[async_trait::async_trait]
impl BudgetStore for EmbeddedBudgetStore {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        let request = request.clone();
        self.submit(|reply| Job::Reserve { request, reply }).await
    }

    /// The reservation is read inside the write transaction: the stored one decides.
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        let (request_id, actual) = (reservation.request_id.clone(), actual.to_vec());
        self.submit(|reply| Job::Settle { request_id, actual, reply }).await
    }

    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        let (request_id, actual) = (request_id.to_owned(), actual.to_vec());
        self.submit(|reply| Job::Intent { request_id, actual, reply }).await
    }

    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        self.submit(|reply| Job::Sweep { now, reply }).await
    }

    /// A read transaction and a few B-tree lookups: microseconds, no fsync, so it runs
    /// on the caller's thread.
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        let mut snapshot = Snapshot::begin(&self.db)?;
        keys.iter().map(|key| snapshot.counter(key)).collect()
    }

    /// Reads every reservation, so it leaves the async worker threads alone.
    async fn live_reservations(&self) -> Result<usize, StoreError> {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || ledger::live_reservations(&mut Snapshot::begin(&db)?))
            .await
            .map_err(|e| backend(format!("live reservations: {e}")))?
    }
}

fn database_file(path: &Path) -> Result<PathBuf, StoreError> {
    let create_dir =
        |dir: &Path| std::fs::create_dir_all(dir).map_err(|e| backend(format!("create {}: {e}", dir.display())));
    if path.is_dir() || path.extension().is_none() {
        create_dir(path)?;
        return Ok(path.join(FILE_NAME));
    }
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
    {
        create_dir(parent)?;
    }
    Ok(path.to_owned())
}

fn journal_file(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".journal");
    PathBuf::from(name)
}

fn backend(error: impl fmt::Display) -> StoreError {
    StoreError::Backend(error.to_string())
}

// ---- the writer ----

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

enum Job {
    Reserve { request: ReserveRequest, reply: Reply<ReserveOutcome> },
    Settle { request_id: String, actual: Vec<(CounterKey, u64)>, reply: Reply<SettleOutcome> },
    Intent { request_id: String, actual: Vec<(CounterKey, u64)>, reply: Reply<IntentOutcome> },
    Sweep { now: u64, reply: Reply<Swept> },
}

impl Job {
    /// A settlement or refund: its batch is acknowledged before the journal's fsync.
    fn deferrable(&self) -> bool {
        matches!(self, Job::Settle { .. })
    }

    /// Runs the operation's rules; its answer waits for the commit.
    fn apply(self, state: &mut impl LedgerState) -> Answer {
        match self {
            Job::Reserve { request, reply } => Answer::Reserve(reply, ledger::reserve(state, &request)),
            Job::Settle { request_id, actual, reply } => {
                Answer::Settle(reply, ledger::settle(state, &request_id, &actual))
            }
            Job::Intent { request_id, actual, reply } => {
                Answer::Intent(reply, ledger::record_intent(state, &request_id, &actual))
            }
            Job::Sweep { now, reply } => Answer::Sweep(reply, ledger::sweep(state, now)),
        }
    }

    /// Answers an operation that was never applied.
    fn fail(self, why: &str) {
        match self {
            Job::Reserve { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
            Job::Settle { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
            Job::Intent { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
            Job::Sweep { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
        }
    }
}

enum Answer {
    Reserve(Reply<ReserveOutcome>, Result<ReserveOutcome, StoreError>),
    Settle(Reply<SettleOutcome>, Result<SettleOutcome, StoreError>),
    Intent(Reply<IntentOutcome>, Result<IntentOutcome, StoreError>),
    Sweep(Reply<Swept>, Result<Swept, StoreError>),
}

impl Answer {
    fn is_ok(&self) -> bool {
        match self {
            Answer::Reserve(_, result) => result.is_ok(),
            Answer::Settle(_, result) => result.is_ok(),
            Answer::Intent(_, result) => result.is_ok(),
            Answer::Sweep(_, result) => result.is_ok(),
        }
    }

    fn send(self, committed: Result<(), &str>) {
        match self {
            Answer::Reserve(reply, result) => deliver(reply, result, committed),
            Answer::Settle(reply, result) => deliver(reply, result, committed),
            Answer::Intent(reply, result) => deliver(reply, result, committed),
            Answer::Sweep(reply, result) => deliver(reply, result, committed),
        }
    }
}

/// An operation that succeeded is acknowledged only if its batch committed; one that
/// failed wrote nothing and reports its own error either way.
fn deliver<T>(reply: Reply<T>, result: Result<T, StoreError>, committed: Result<(), &str>) {
    let result = match (result, committed) {
        (Ok(_), Err(why)) => Err(backend(why)),
        (result, _) => result,
    };
    // The caller may have stopped waiting; its operation stands either way.
    let _ = reply.send(result);
}

fn write_loop(db: &Database, queue: &mpsc::Receiver<Job>, journal: &mut Journal, commits: &AtomicU64) {
    let mut checkpointed = Instant::now();
    loop {
        let first = if journal.is_empty() {
            queue.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected)
        } else {
            queue.recv_timeout(CHECKPOINT_EVERY.saturating_sub(checkpointed.elapsed()))
        };
        let first = match first {
            Ok(job) => job,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                checkpoint(db, journal, &mut checkpointed);
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut jobs = Vec::with_capacity(16);
        jobs.push(first);
        while jobs.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        write_batch(db, jobs, journal, commits);
        if journal.len >= CHECKPOINT_BYTES || checkpointed.elapsed() >= CHECKPOINT_EVERY {
            checkpoint(db, journal, &mut checkpointed);
        }
    }
    // Closing: the file holds everything, and the journal is left empty.
    checkpoint(db, journal, &mut checkpointed);
}

/// A durable commit (it carries every commit made without an fsync before it), then
/// the journal emptied. If either fails, the journal keeps growing and the next
/// checkpoint tries again; at the next open it is replayed.
fn checkpoint(db: &Database, journal: &mut Journal, checkpointed: &mut Instant) {
    *checkpointed = Instant::now();
    if journal.is_empty() {
        return;
    }
    let durable = db.begin_write().map_err(backend).and_then(|txn| txn.commit().map_err(backend));
    if let Err(e) = durable.and_then(|()| journal.clear()) {
        tracing::error!(error = %e, "ledger checkpoint failed; the journal is kept and replayed at the next open");
    }
}

fn write_batch(db: &Database, jobs: Vec<Job>, journal: &mut Journal, commits: &AtomicU64) {
    let sync = !jobs.iter().all(Job::deferrable);
    let mut jobs = jobs.into_iter();
    let mut answers = Vec::with_capacity(jobs.len());
    let committed = apply_and_commit(db, sync, journal, &mut jobs, &mut answers).map_err(|e| e.to_string());
    if committed.is_ok() {
        commits.fetch_add(1, Ordering::Relaxed);
    } else if let Err(why) = &committed {
        tracing::error!(error = %why, operations = answers.len() + jobs.len(), "ledger batch not committed");
    }
    let committed = committed.as_ref().map(|_| ()).map_err(String::as_str);
    for answer in answers {
        answer.send(committed);
    }
    // Left over when the batch aborted before reaching them.
    for job in jobs {
        job.fail(committed.err().unwrap_or("ledger batch aborted"));
    }
}

/// Applies the batch in one transaction, journals what it wrote (synced when `sync`),
/// then commits without an fsync. On error the transaction is dropped, which aborts
/// it: nothing of the batch lands in the database.
fn apply_and_commit(
    db: &Database,
    sync: bool,
    journal: &mut Journal,
    jobs: &mut impl Iterator<Item = Job>,
    answers: &mut Vec<Answer>,
) -> Result<(), StoreError> {
    let mut txn = db.begin_write().map_err(backend)?;
    txn.set_durability(Durability::None).map_err(backend)?;
    let mut effects = Effects::default();
    {
        let mut tables = Tables::open(&txn)?;
        for job in jobs {
            let mut overlay = Overlay::new(&mut tables);
            let answer = job.apply(&mut overlay);
            let applied = answer.is_ok();
            answers.push(answer);
            if applied {
                overlay.write(&mut effects)?;
            }
        }
    }
    journal.append(&effects, sync)?;
    txn.commit().map_err(backend)
}

/// What one batch wrote, as the journal keeps it: values, so that a replay sets them
/// again and a second replay changes nothing. In the order written: a later entry for
/// the same key wins.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Effects {
    #[serde(rename = "c", default, skip_serializing_if = "Vec::is_empty")]
    counters: Vec<(CounterKey, u64)>,
    /// A reservation put, or removed (`null`).
    #[serde(rename = "r", default, skip_serializing_if = "Vec::is_empty")]
    reservations: Vec<(String, Option<StoredReservation>)>,
}

impl Effects {
    fn is_empty(&self) -> bool {
        self.counters.is_empty() && self.reservations.is_empty()
    }

    fn replay(&self, tables: &mut Tables<'_>) -> Result<(), StoreError> {
        for (key, value) in &self.counters {
            tables.counters.insert(key.as_str(), value).map_err(backend)?;
        }
        for (request_id, reservation) in &self.reservations {
            match reservation {
                Some(reservation) => {
                    let bytes = serde_json::to_vec(reservation).map_err(backend)?;
                    tables.reservations.insert(request_id.as_str(), bytes.as_slice()).map_err(backend)?;
                }
                None => {
                    tables.reservations.remove(request_id.as_str()).map_err(backend)?;
                }
            }
        }
        Ok(())
    }
}

/// The journal: what the batches since the last checkpoint wrote, one JSON line each.
struct Journal {
    file: File,
    path: PathBuf,
    len: u64,
}

impl Journal {
    /// Opens (or creates) the journal and reads what it holds. A last line cut short
    /// (no newline: the process died inside its write) was never acknowledged and is
    /// dropped; any other line that does not parse is corruption.
    fn open(path: &Path) -> Result<(Journal, Vec<Effects>), StoreError> {
        let failed = |e: std::io::Error| backend(format!("ledger journal {}: {e}", path.display()));
        let file = std::fs::OpenOptions::new().create(true).append(true).read(true).open(path).map_err(failed)?;
        let mut left = Vec::new();
        let mut reader = BufReader::new(&file);
        let mut line = String::new();
        let mut number = 0;
        loop {
            line.clear();
            if reader.read_line(&mut line).map_err(failed)? == 0 {
                break;
            }
            number += 1;
            if !line.ends_with('\n') {
                tracing::warn!(journal = %path.display(), line = number, "ledger: a journal line cut short, dropped");
                break;
            }
            let effects = serde_json::from_str(&line).map_err(|e| StoreError::Corrupt {
                key: format!("{}:{number}", path.display()),
                detail: e.to_string(),
            })?;
            left.push(effects);
        }
        let len = file.metadata().map_err(failed)?.len();
        Ok((Journal { file, path: path.to_owned(), len }, left))
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One `write(2)` for the batch, then `fdatasync` when `sync`. A batch that wrote
    /// nothing has nothing to journal, but a sync still carries the lines before it.
    fn append(&mut self, effects: &Effects, sync: bool) -> Result<(), StoreError> {
        let failed = |e: std::io::Error| backend(format!("ledger journal {}: {e}", self.path.display()));
        if !effects.is_empty() {
            let mut line = serde_json::to_vec(effects).map_err(backend)?;
            line.push(b'\n');
            self.file.write_all(&line).map_err(failed)?;
            self.len += line.len() as u64;
        }
        if sync && self.len > 0 {
            self.file.sync_data().map_err(failed)?;
        }
        Ok(())
    }

    /// After a durable commit: everything the journal held is in the file.
    fn clear(&mut self) -> Result<(), StoreError> {
        if self.len > 0 {
            self.file.set_len(0).map_err(|e| backend(format!("ledger journal {}: {e}", self.path.display())))?;
            self.len = 0;
        }
        Ok(())
    }
}

struct Tables<'txn> {
    counters: Table<'txn, &'static str, u64>,
    reservations: Table<'txn, &'static str, &'static [u8]>,
}

impl<'txn> Tables<'txn> {
    fn open(txn: &'txn WriteTransaction) -> Result<Self, StoreError> {
        Ok(Self {
            counters: txn.open_table(COUNTERS).map_err(backend)?,
            reservations: txn.open_table(RESERVATIONS).map_err(backend)?,
        })
    }
}

/// One operation's view of the write transaction: reads see the tables under the
/// operation's own pending writes; `write` lands them once the rules returned `Ok`.
struct Overlay<'a, 'txn> {
    tables: &'a mut Tables<'txn>,
    counters: BTreeMap<CounterKey, u64>,
    reservations: BTreeMap<String, Pending>,
}

enum Pending {
    Put(StoredReservation, Vec<u8>),
    Delete,
}

impl<'a, 'txn> Overlay<'a, 'txn> {
    fn new(tables: &'a mut Tables<'txn>) -> Self {
        Self { tables, counters: BTreeMap::new(), reservations: BTreeMap::new() }
    }

    /// Lands the operation's writes in the tables, and adds them to the batch's `effects`.
    fn write(self, effects: &mut Effects) -> Result<(), StoreError> {
        for (key, value) in self.counters {
            self.tables.counters.insert(key.as_str(), value).map_err(backend)?;
            effects.counters.push((key, value));
        }
        for (request_id, pending) in self.reservations {
            match pending {
                Pending::Put(reservation, bytes) => {
                    self.tables.reservations.insert(request_id.as_str(), bytes.as_slice()).map_err(backend)?;
                    effects.reservations.push((request_id, Some(reservation)));
                }
                Pending::Delete => {
                    self.tables.reservations.remove(request_id.as_str()).map_err(backend)?;
                    effects.reservations.push((request_id, None));
                }
            }
        }
        Ok(())
    }
}

impl LedgerState for Overlay<'_, '_> {
    fn counter(&mut self, key: &CounterKey) -> Result<u64, StoreError> {
        match self.counters.get(key) {
            Some(value) => Ok(*value),
            None => read_counter(&self.tables.counters, key),
        }
    }
    fn set_counter(&mut self, key: &CounterKey, value: u64) -> Result<(), StoreError> {
        self.counters.insert(key.clone(), value);
        Ok(())
    }
    fn reservation(&mut self, request_id: &str) -> Result<Option<StoredReservation>, StoreError> {
        match self.reservations.get(request_id) {
            Some(Pending::Put(reservation, _)) => Ok(Some(reservation.clone())),
            Some(Pending::Delete) => Ok(None),
            None => read_reservation(&self.tables.reservations, request_id),
        }
    }
    fn put_reservation(&mut self, request_id: &str, reservation: &StoredReservation) -> Result<(), StoreError> {
        let bytes =
            serde_json::to_vec(reservation).map_err(|e| backend(format!("encode reservation {request_id}: {e}")))?;
        self.reservations.insert(request_id.to_owned(), Pending::Put(reservation.clone(), bytes));
        Ok(())
    }
    fn delete_reservation(&mut self, request_id: &str) -> Result<(), StoreError> {
        self.reservations.insert(request_id.to_owned(), Pending::Delete);
        Ok(())
    }
    fn all_reservations(&mut self) -> Result<Vec<(String, StoredReservation)>, StoreError> {
        let mut all: BTreeMap<String, StoredReservation> =
            read_all_reservations(&self.tables.reservations)?.into_iter().collect();
        for (request_id, pending) in &self.reservations {
            match pending {
                Pending::Put(reservation, _) => all.insert(request_id.clone(), reservation.clone()),
                Pending::Delete => all.remove(request_id),
            };
        }
        Ok(all.into_iter().collect())
    }
}

// ---- reads ----

/// Committed state, read-only: `used` and `live_reservations` run the ledger's reads
/// on it; the ledger's writes never reach it.
struct Snapshot {
    counters: ReadOnlyTable<&'static str, u64>,
    reservations: ReadOnlyTable<&'static str, &'static [u8]>,
}

impl Snapshot {
    fn begin(db: &Database) -> Result<Self, StoreError> {
        let txn = db.begin_read().map_err(backend)?;
        Ok(Self {
            counters: txn.open_table(COUNTERS).map_err(backend)?,
            reservations: txn.open_table(RESERVATIONS).map_err(backend)?,
        })
    }
}

impl LedgerState for Snapshot {
    fn counter(&mut self, key: &CounterKey) -> Result<u64, StoreError> {
        read_counter(&self.counters, key)
    }
    fn set_counter(&mut self, _: &CounterKey, _: u64) -> Result<(), StoreError> {
        Err(backend("write to a read-only snapshot"))
    }
    fn reservation(&mut self, request_id: &str) -> Result<Option<StoredReservation>, StoreError> {
        read_reservation(&self.reservations, request_id)
    }
    fn put_reservation(&mut self, _: &str, _: &StoredReservation) -> Result<(), StoreError> {
        Err(backend("write to a read-only snapshot"))
    }
    fn delete_reservation(&mut self, _: &str) -> Result<(), StoreError> {
        Err(backend("write to a read-only snapshot"))
    }
    fn all_reservations(&mut self) -> Result<Vec<(String, StoredReservation)>, StoreError> {
        read_all_reservations(&self.reservations)
    }
}

fn read_counter(table: &impl ReadableTable<&'static str, u64>, key: &CounterKey) -> Result<u64, StoreError> {
    Ok(table.get(key.as_str()).map_err(backend)?.map_or(0, |value| value.value()))
}

fn read_reservation(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
    request_id: &str,
) -> Result<Option<StoredReservation>, StoreError> {
    match table.get(request_id).map_err(backend)? {
        Some(bytes) => decode(request_id, bytes.value()).map(Some),
        None => Ok(None),
    }
}

fn read_all_reservations(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
) -> Result<Vec<(String, StoredReservation)>, StoreError> {
    let mut all = Vec::new();
    for entry in table.iter().map_err(backend)? {
        let (request_id, bytes) = entry.map_err(backend)?;
        let request_id = request_id.value().to_owned();
        let reservation = decode(&request_id, bytes.value())?;
        all.push((request_id, reservation));
    }
    Ok(all)
}

fn decode(request_id: &str, bytes: &[u8]) -> Result<StoredReservation, StoreError> {
    serde_json::from_slice(bytes)
        .map_err(|e| StoreError::Corrupt { key: format!("reservations/{request_id}"), detail: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Line;

    fn key(name: &str) -> CounterKey {
        CounterKey(format!("batch/{name}"))
    }

    fn reserve(id: &str, amount: u64, limit: u64) -> (Job, oneshot::Receiver<Result<ReserveOutcome, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        let request = ReserveRequest {
            request_id: id.to_owned(),
            lines: vec![Line { key: key("a"), amount, limit: Some(limit) }],
            expires_at: u64::MAX,
        };
        (Job::Reserve { request, reply }, answer)
    }

    fn settle(id: &str, actual: u64) -> (Job, oneshot::Receiver<Result<SettleOutcome, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        (Job::Settle { request_id: id.to_owned(), actual: vec![(key("a"), actual)], reply }, answer)
    }

    /// One batch, applied in order, each operation on the state the previous left, one
    /// commit; the operation that fails in the middle writes nothing and fails nobody else.
    #[tokio::test]
    async fn a_batch_applies_in_order_in_one_commit_and_isolates_a_failing_operation() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBudgetStore::open(dir.path()).unwrap();
        {
            let txn = store.db.begin_write().unwrap();
            txn.open_table(RESERVATIONS).unwrap().insert("corrupt", b"{".as_slice()).unwrap();
            txn.commit().unwrap();
        }
        let (r1, a1) = reserve("r1", 80, 100);
        let (r2, a2) = reserve("r2", 30, 100);
        let (s1, a3) = settle("r1", 10);
        let (bad, a4) = settle("corrupt", 50);
        let (r3, a5) = reserve("r3", 30, 100);
        let commits = AtomicU64::new(0);
        let (mut journal, _) = Journal::open(&dir.path().join("batch.journal")).unwrap();
        write_batch(&store.db, vec![r1, r2, s1, bad, r3], &mut journal, &commits);
        assert!(!journal.is_empty(), "the batch's writes are journaled");

        assert_eq!(commits.load(Ordering::Relaxed), 1);
        assert_eq!(a1.await.unwrap().unwrap(), ReserveOutcome::Reserved);
        assert_eq!(a2.await.unwrap().unwrap(), ReserveOutcome::Refused { line: 0 }, "sees r1");
        assert_eq!(a3.await.unwrap().unwrap(), SettleOutcome::Settled);
        assert!(matches!(a4.await.unwrap(), Err(StoreError::Corrupt { .. })));
        assert_eq!(a5.await.unwrap().unwrap(), ReserveOutcome::Reserved, "sees the settlement of r1");
        assert_eq!(store.used(&[key("a")]).await.unwrap(), [40]);
        assert!(
            matches!(store.live_reservations().await, Err(StoreError::Corrupt { key, .. }) if key == "reservations/corrupt")
        );
    }

    /// Pending writes reach the tables only through `write`.
    #[test]
    fn an_overlay_that_is_not_written_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBudgetStore::open(dir.path()).unwrap();
        let txn = store.db.begin_write().unwrap();
        {
            let mut tables = Tables::open(&txn).unwrap();
            let mut overlay = Overlay::new(&mut tables);
            overlay.set_counter(&key("a"), 7).unwrap();
            overlay
                .put_reservation("x", &StoredReservation { lines: vec![], expires_at: 0, swept: false, intent: None })
                .unwrap();
            assert_eq!(overlay.counter(&key("a")).unwrap(), 7, "an operation reads its own writes");
            assert_eq!(overlay.all_reservations().unwrap().len(), 1);
        }
        txn.commit().unwrap();
        let mut snapshot = Snapshot::begin(&store.db).unwrap();
        assert_eq!(snapshot.counter(&key("a")).unwrap(), 0);
        assert_eq!(snapshot.reservation("x").unwrap(), None);
    }
}
