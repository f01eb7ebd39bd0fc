//! `EmbeddedBudgetStore`: the durable local ledger (`store: {kind: embedded, path: ...}`),
//! the same rules as every other store (`ledger.rs`), kept in memory, made durable by a
//! journal, and checkpointed into one redb file.
//!
//! Writes are committed in groups by one writer thread (`flexway-ledger`): it waits
//! for an operation (a second at most, to look for a checkpoint due), drains whatever
//! else is already queued (up to [`MAX_BATCH`]), applies them in arrival order — each
//! operation's rules see the state the previous ones left — appends what the batch
//! wrote to the journal (`<file>.journal`: one JSON line a batch, one `write(2)`,
//! values rather than operations), and only then puts the batch in the ledger that
//! reads see. It answers the batch's settlements and refunds at once, and the rest
//! after the journal's fsync: a settlement queued with reservations does not wait for
//! their fsync (it may still wait for the fsync of the batch before it, which holds the
//! writer's lock: writing it on its caller's thread meanwhile, one `write(2)` a
//! settlement, cost 7% of the throughput at 64 connections).
//!
//! Two operations skip the queue and are written by their caller, on its own thread,
//! as a batch of one, when no batch or checkpoint is being written (the writer's lock
//! and the ledger's are free): a settlement or refund, which waits for no fsync, and a
//! reservation when the ledger holds no other live reservation (a call alone), fsync
//! included. Handing these to the writer thread and back took two wake-ups each, four
//! a call. Such an operation may pass operations already queued: arrival
//! order holds within a batch. The fsync of a reservation written so blocks the whole
//! serving thread (`flexway serve` runs one single-threaded runtime per core), every
//! connection on it included, for as long as the disk takes; it happens only when no
//! other budgeted call is in flight in the process, so no other call's reservation
//! waits behind it, but unbudgeted requests and open streams on that thread do. Under
//! concurrency a reservation goes through the queue, where it shares its fsync with
//! the others'.
//!
//! A call pays one fsync, and a small one: a reservation, an intent or a sweep is
//! answered once its journal line is on disk (`fdatasync`: one short write, where a
//! durable redb commit rewrites about ten pages); a settlement or refund once its line
//! is in the page cache, whatever else its batch holds, which a killed process does not
//! lose, and the next synced line or checkpoint carries it to the disk. A checkpoint
//! writes what changed since the last one into the redb file (one durable commit) and
//! empties the journal: every [`CHECKPOINT_EVERY`] while the journal holds anything,
//! past [`CHECKPOINT_BYTES`] of journal (looked at after each of the writer thread's
//! batches and every second), and at close. `open` loads the file and replays
//! what a dead process left in the journal: a line sets values, so replaying it twice
//! changes nothing.
//!
//! Invariants:
//! - nothing acknowledged is lost when the process dies: a reservation, intent or sweep
//!   is acknowledged only after the fsync of the journal line that holds it (or, once
//!   an fsync failed, the checkpoint that holds it); a
//!   settlement once the journal holds it (a power loss, unlike a killed process, may
//!   take the settlements journaled since the last fsync with the page cache: their
//!   reservations stay held, and the sweeper refunds them at their expiry). If the
//!   journal write fails, every operation of the batch gets the error and the ledger is
//!   left as it was; lines reach the journal in the order of the lock, fsync or not;
//! - an operation applies whole or not at all: its writes are kept apart until its rules
//!   returned `Ok`; an operation whose rules fail leaves nothing behind and the rest of
//!   the batch proceeds;
//! - reads (`used`, `live_reservations`) see no operation before its journal line is
//!   written: a batch reaches the ledger they read once its line is in the journal
//!   (what a replay would find), never while its rules run. A reservation may be read
//!   there during its fsync, before its caller is answered. They take a read lock and
//!   touch no file;
//! - a record of the file that does not decode fails only the operations that read it
//!   (its reservation's, or any that reads them all), as it would in the file.
//!
//! A failed fsync is not tried again: Linux reports a writeback error once and may drop
//! the pages, so the journal's lines since the last checkpoint may never reach the disk,
//! and a later fsync that succeeds vouches for nothing before it. The batch, already in
//! the ledger, is made durable by a checkpoint instead (the whole ledger committed to
//! the file, a new journal), and so is every batch after it until a checkpoint
//! succeeds; its callers get the checkpoint's outcome (its settlements were answered at
//! the write). Such a checkpoint may run on a serving thread, for a call alone. A
//! reservation whose caller got the error may still be in the ledger: a retry finds it,
//! and is acknowledged only once a checkpoint succeeds; else it is held until the
//! sweeper refunds it, never a charge that did not happen. redb refuses every write
//! after a commit that failed, until the file is opened again: once a checkpoint fails,
//! reservations, intents and sweeps fail until the process restarts (settlements are
//! still journaled, and replayed at the next open).
//!
//! A call whose future is dropped after its operation was queued may still apply;
//! retrying is safe because reservations are idempotent on the request id.
//!
//! File layout: `<dir>/ledger.redb` when `path` is a directory or has no extension
//! (the directory is created), else the file `path` itself; the journal beside it.
//! Two tables: `counters` (counter key → value) and `reservations` (request id → JSON
//! `StoredReservation`). The whole ledger is held in memory: its counters (a few a
//! tenant and agent per day and month) and its reservations (those in flight, and the
//! swept ones kept a day).

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, TryLockError, mpsc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use foldhash::{HashMap, HashSet};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::ledger::{self, LedgerState, StoredReservation};
use super::{
    BudgetStore, CounterKey, IntentOutcome, Reservation, ReserveOutcome, ReserveRequest, SettleOutcome, StoreError,
    Swept,
};
use crate::json;

const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");
const RESERVATIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("reservations");
/// `journal_epoch`: the epoch of the journal that follows the file's content, written
/// by each checkpoint with it. Absent from files written before it existed.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const JOURNAL_EPOCH: &str = "journal_epoch";

/// The most operations one batch carries; more wait for the next one.
pub const MAX_BATCH: usize = 256;

/// A checkpoint at least this often while the journal holds anything.
pub const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// A checkpoint once the journal holds this much.
pub const CHECKPOINT_BYTES: u64 = 4 * 1024 * 1024;

/// The file name used when `open` is given a directory.
pub const FILE_NAME: &str = "ledger.redb";

pub struct EmbeddedBudgetStore {
    ledger: Arc<RwLock<Ledger>>,
    /// Held to write a batch or a checkpoint: by the writer thread, or by a caller
    /// writing its own operation.
    writer: Arc<Mutex<Writer>>,
    file: PathBuf,
    /// `None` only while dropping: closing the channel stops the writer.
    ops: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    syncs: Arc<AtomicU64>,
}

/// What a batch is written with.
struct Writer {
    journal: Journal,
    db: Database,
}

impl fmt::Debug for EmbeddedBudgetStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedBudgetStore")
            .field("file", &self.file)
            .field("syncs", &self.syncs())
            .finish_non_exhaustive()
    }
}

impl EmbeddedBudgetStore {
    /// Creates or opens the ledger at `path`, replays its journal, and starts its
    /// writer thread.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let file = database_file(path)?;
        let db = Database::create(&file).map_err(|e| backend(format!("open {}: {e}", file.display())))?;
        let mut ledger = Ledger::load(&db)?;
        let (mut journal, left) = Journal::open(&journal_file(&file), journal_epoch(&db)?)?;
        // What a dead process acknowledged is in the file before anything is served.
        if !left.is_empty() {
            let batches = left.len();
            for effects in left {
                ledger.apply(effects);
            }
            checkpoint(&db, &mut ledger, &mut journal)?;
            tracing::info!(batches, file = %file.display(), "ledger: journal replayed");
        }

        let ledger = Arc::new(RwLock::new(ledger));
        let writer = Arc::new(Mutex::new(Writer { journal, db }));
        let syncs = Arc::new(AtomicU64::new(0));
        let (ops, queue) = mpsc::channel();
        let thread = thread::Builder::new()
            .name("flexway-ledger".into())
            .spawn({
                let (ledger, writer, syncs) = (ledger.clone(), writer.clone(), syncs.clone());
                move || write_loop(&writer, &ledger, &queue, &syncs)
            })
            .map_err(|e| backend(format!("start the ledger writer: {e}")))?;
        Ok(Self { ledger, writer, file, ops: Some(ops), thread: Some(thread), syncs })
    }

    /// The database file in use.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Journal fsyncs that succeeded since `open` (a batch made durable by a checkpoint
    /// after a failed fsync counts none): one per batch that held a reservation, an intent or
    /// a sweep, so fewer than the operations acknowledged when concurrent calls shared
    /// a batch, and none for settlements alone.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Writes one operation here, or queues it for the writer thread (see the module
    /// docs), and waits for its answer: a settlement's once its journal line is
    /// written, any other's once it is durable.
    async fn submit<T>(&self, job: impl FnOnce(Reply<T>) -> Job) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job = job(reply);
        let job = if self.written_here(&job) { self.write_here(job) } else { Some(job) };
        if let Some(job) = job {
            let ops = self.ops.as_ref().ok_or_else(|| backend("ledger writer stopped"))?;
            ops.send(job).map_err(|_| backend("ledger writer stopped"))?;
        }
        answer.await.map_err(|_| backend("ledger writer stopped before answering"))?
    }

    /// A settlement, or a reservation while the ledger holds no other. Never waits for
    /// a lock: a checkpoint holds the ledger's through a durable commit.
    fn written_here(&self, job: &Job) -> bool {
        match job {
            Job::Settle { .. } => true,
            Job::Reserve { .. } => self.ledger.try_read().is_ok_and(|ledger| ledger.live == 0),
            Job::Intent { .. } | Job::Sweep { .. } => false,
        }
    }

    /// Writes `job` as a batch of its own if no batch is being written; else gives it
    /// back, for the queue. A writer thread that died leaves the journal without its
    /// checkpoints: every operation then fails, as it would in the queue.
    fn write_here(&self, job: Job) -> Option<Job> {
        if self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
            return Some(job);
        }
        let mut writer = match self.writer.try_lock() {
            Ok(writer) => writer,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return Some(job),
        };
        write_batch(&self.ledger, vec![job], &mut writer.journal).sync_and_answer(
            &mut writer,
            &self.ledger,
            &self.syncs,
        );
        None
    }

    fn read(&self) -> Result<std::sync::RwLockReadGuard<'_, Ledger>, StoreError> {
        self.ledger.read().map_err(|_| backend("ledger lock poisoned"))
    }
}

impl Drop for EmbeddedBudgetStore {
    /// Closes the queue and waits for the writer to finish the batch in hand and its
    /// last checkpoint, so the file is released when the store is gone (a reopen in the
    /// same process then succeeds).
    fn drop(&mut self) {
        drop(self.ops.take());
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
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

    /// The reservation is read by whoever writes the batch: the stored one decides.
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
        self.submit(|reply| Job::Intent { request_id, actual, renew: None, reply }).await
    }

    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        let (request_id, actual) = (request_id.to_owned(), actual.to_vec());
        self.submit(|reply| Job::Intent { request_id, actual, renew: Some(expires_at), reply }).await
    }

    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        self.submit(|reply| Job::Sweep { now, reply }).await
    }

    /// A few lookups under a read lock.
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        let ledger = self.read()?;
        Ok(keys.iter().map(|key| ledger.counters.get(key).copied().unwrap_or(0)).collect())
    }

    async fn live_reservations(&self) -> Result<usize, StoreError> {
        ledger::live_reservations(&mut Batch::new(&*self.read()?))
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
    Reserve {
        request: ReserveRequest,
        reply: Reply<ReserveOutcome>,
    },
    Settle {
        request_id: String,
        actual: Vec<(CounterKey, u64)>,
        reply: Reply<SettleOutcome>,
    },
    /// `renew`: the new expiry of a renewed reservation (else a plain intent).
    Intent {
        request_id: String,
        actual: Vec<(CounterKey, u64)>,
        renew: Option<u64>,
        reply: Reply<IntentOutcome>,
    },
    Sweep {
        now: u64,
        reply: Reply<Swept>,
    },
}

impl Job {
    /// Runs the operation's rules; its answer waits for the commit.
    fn apply(self, state: &mut impl LedgerState) -> Answer {
        match self {
            Job::Reserve { request, reply } => Answer::Reserve(reply, ledger::reserve(state, &request)),
            Job::Settle { request_id, actual, reply } => {
                Answer::Settle(reply, ledger::settle(state, &request_id, &actual))
            }
            Job::Intent { request_id, actual, renew: None, reply } => {
                Answer::Intent(reply, ledger::record_intent(state, &request_id, &actual))
            }
            Job::Intent { request_id, actual, renew: Some(expires_at), reply } => {
                Answer::Intent(reply, ledger::renew(state, &request_id, &actual, expires_at))
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
    /// Any but a settlement's or refund's, which is sent once its line is written.
    fn waits_for_sync(&self) -> bool {
        !matches!(self, Answer::Settle(..))
    }

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

fn write_loop(writer: &Mutex<Writer>, ledger: &RwLock<Ledger>, queue: &mpsc::Receiver<Job>, syncs: &AtomicU64) {
    let lock = || writer.lock().unwrap_or_else(PoisonError::into_inner);
    let mut checkpointed = Instant::now();
    loop {
        // Callers write into the journal too, without waking this thread: it looks
        // every period whether the journal holds anything to checkpoint.
        let wait = CHECKPOINT_EVERY.saturating_sub(checkpointed.elapsed());
        let first = match queue.recv_timeout(wait) {
            Ok(job) => Some(job),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut writer = lock();
        if let Some(first) = first {
            let mut jobs = Vec::with_capacity(16);
            jobs.push(first);
            while jobs.len() < MAX_BATCH {
                match queue.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
            write_batch(ledger, jobs, &mut writer.journal).sync_and_answer(&mut writer, ledger, syncs);
        }
        if writer.journal.len >= CHECKPOINT_BYTES || checkpointed.elapsed() >= CHECKPOINT_EVERY {
            checkpointed = Instant::now();
            checkpoint_logged(ledger, &mut writer);
        }
    }
    // Closing: the file holds everything, and the journal is left empty.
    checkpoint_logged(ledger, &mut lock());
}

fn checkpoint_logged(ledger: &RwLock<Ledger>, writer: &mut Writer) {
    if writer.journal.is_empty() {
        return;
    }
    if let Err(e) = checkpoint_held(ledger, writer) {
        tracing::error!(error = %e, "ledger checkpoint failed; the journal is kept and replayed at the next open");
    }
}

/// A checkpoint, by the holder of the writer's lock.
fn checkpoint_held(ledger: &RwLock<Ledger>, writer: &mut Writer) -> Result<(), StoreError> {
    let mut ledger = ledger.write().map_err(|_| backend("ledger lock poisoned"))?;
    checkpoint(&writer.db, &mut ledger, &mut writer.journal)
}

/// Writes what changed since the last checkpoint into the file (one durable commit),
/// then empties the journal. On error nothing is forgotten: the changes stay marked
/// and the journal keeps growing until a checkpoint succeeds.
fn checkpoint(db: &Database, ledger: &mut Ledger, journal: &mut Journal) -> Result<(), StoreError> {
    let txn = db.begin_write().map_err(backend)?;
    {
        // The journal's next epoch, which `clear` below starts: only its lines follow
        // what this commit holds, whatever older lines the disk still has.
        txn.open_table(META).map_err(backend)?.insert(JOURNAL_EPOCH, journal.epoch + 1).map_err(backend)?;
        let mut counters = txn.open_table(COUNTERS).map_err(backend)?;
        for key in &ledger.changed_counters {
            let value = ledger.counters.get(key).copied().unwrap_or(0);
            counters.insert(key.as_str(), value).map_err(backend)?;
        }
        let mut reservations = txn.open_table(RESERVATIONS).map_err(backend)?;
        for request_id in &ledger.changed_reservations {
            match ledger.reservations.get(request_id) {
                Some(Ok(reservation)) => {
                    let bytes = serde_json::to_vec(reservation).map_err(backend)?;
                    reservations.insert(request_id.as_str(), bytes.as_slice()).map_err(backend)?;
                }
                // A record that did not decode is left as the file has it.
                Some(Err(_)) => {}
                // Most calls reserve and settle between two checkpoints: their
                // reservation never reached the file, and nothing is removed.
                None if !ledger.in_file.contains(request_id) => {}
                None => {
                    reservations.remove(request_id.as_str()).map_err(backend)?;
                }
            }
        }
    }
    txn.commit().map_err(backend)?;
    let changed = std::mem::take(&mut ledger.changed_reservations);
    for request_id in changed {
        if ledger.reservations.contains_key(&request_id) {
            ledger.in_file.insert(request_id);
        } else {
            ledger.in_file.remove(&request_id);
        }
    }
    ledger.changed_counters.clear();
    journal.clear()
}

/// Writes a batch: applies its operations over the ledger, writes its journal line (one
/// `pwrite(2)`), puts it in the ledger, and answers its settlements and refunds, which
/// wait for no fsync. The fsync and the other answers follow
/// ([`Written::sync_and_answer`]).
fn write_batch(ledger: &RwLock<Ledger>, jobs: Vec<Job>, journal: &mut Journal) -> Written {
    let mut jobs = jobs.into_iter();
    let mut answers = Vec::with_capacity(jobs.len());
    let written = apply_and_write(ledger, journal, &mut jobs, &mut answers).map_err(|e| e.to_string());
    if let Err(why) = &written {
        tracing::error!(error = %why, operations = answers.len() + jobs.len(), "ledger batch not written");
    }
    let failed = written.as_ref().err().map(String::as_str);
    // Left over when the batch aborted before reaching them.
    for job in jobs {
        job.fail(failed.unwrap_or("ledger batch aborted"));
    }
    let (waiting, settled): (Vec<_>, Vec<_>) = answers.into_iter().partition(Answer::waits_for_sync);
    for answer in settled {
        answer.send(failed.map_or(Ok(()), Err));
    }
    Written { answers: waiting, failed: written.err() }
}

/// A batch written and in the ledger, whose fsync and answers are still to come.
#[must_use = "its callers wait for their answers"]
struct Written {
    /// Those of its reservations, intents and sweeps: the batch needs an fsync if any.
    answers: Vec<Answer>,
    failed: Option<String>,
}

impl Written {
    /// Makes the batch durable (when it needs it) and answers the batch's callers.
    fn sync_and_answer(self, writer: &mut Writer, ledger: &RwLock<Ledger>, syncs: &AtomicU64) {
        let synced = match self.failed {
            Some(why) => Err(why),
            None if self.answers.is_empty() => Ok(()),
            None => make_durable(writer, ledger, syncs),
        };
        let synced = synced.as_ref().map(|_| ()).map_err(String::as_str);
        for answer in self.answers {
            answer.send(synced);
        }
    }
}

/// Makes every line written so far durable: the journal's fsync or, once an fsync of
/// it failed (see the module docs), a checkpoint, which commits the whole ledger to the
/// file and starts the journal afresh.
fn make_durable(writer: &mut Writer, ledger: &RwLock<Ledger>, syncs: &AtomicU64) -> Result<(), String> {
    if !writer.journal.failed {
        match writer.journal.sync() {
            Ok(()) => {
                syncs.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            Err(e) => {
                tracing::error!(error = %e, "ledger journal fsync failed; the ledger is checkpointed instead");
                writer.journal.failed = true;
            }
        }
    }
    checkpoint_held(ledger, writer).map_err(|e| e.to_string())
}

/// Applies the batch over the ledger, writes its journal line, and only then puts it
/// in the ledger. On error the batch is dropped: the ledger is left as it was.
fn apply_and_write(
    ledger: &RwLock<Ledger>,
    journal: &mut Journal,
    jobs: &mut impl Iterator<Item = Job>,
    answers: &mut Vec<Answer>,
) -> Result<(), StoreError> {
    let effects = {
        let read = ledger.read().map_err(|_| backend("ledger lock poisoned"))?;
        let mut batch = Batch::new(&read);
        for job in jobs {
            let answer = job.apply(&mut batch);
            let applied = answer.is_ok();
            answers.push(answer);
            batch.end_operation(applied);
        }
        batch.effects()
    };
    journal.write(&effects)?;
    ledger.write().map_err(|_| backend("ledger lock poisoned"))?.apply(effects);
    Ok(())
}

/// The epoch of the journal that follows the file's content (`None`: a file from before
/// it was kept, or that never had a checkpoint).
fn journal_epoch(db: &Database) -> Result<Option<u64>, StoreError> {
    let txn = db.begin_read().map_err(backend)?;
    let meta = txn.open_table(META).map_err(backend)?;
    Ok(meta.get(JOURNAL_EPOCH).map_err(backend)?.map(|epoch| epoch.value()))
}

/// A reservation as the ledger holds it: decoded, or what did not decode.
type Stored = Result<StoredReservation, String>;

/// The ledger as its journal has it: the file's content and every batch written to the
/// journal since (a batch in its fsync included), with what changed since the last
/// checkpoint.
#[derive(Default)]
struct Ledger {
    counters: HashMap<CounterKey, u64>,
    reservations: HashMap<String, Stored>,
    changed_counters: HashSet<CounterKey>,
    changed_reservations: HashSet<String>,
    /// The reservations the file holds (as of the last checkpoint).
    in_file: HashSet<String>,
    /// The reservations held and not swept: the calls in flight, give or take those
    /// whose process died (until the sweeper gets to them).
    live: usize,
}

fn is_live(stored: Option<&Stored>) -> bool {
    matches!(stored, Some(Ok(reservation)) if !reservation.swept)
}

impl Ledger {
    /// Everything the file holds (creating its tables on a new file).
    fn load(db: &Database) -> Result<Ledger, StoreError> {
        let txn = db.begin_write().map_err(backend)?;
        txn.open_table(COUNTERS).map_err(backend)?;
        txn.open_table(RESERVATIONS).map_err(backend)?;
        txn.open_table(META).map_err(backend)?;
        txn.commit().map_err(backend)?;
        let txn = db.begin_read().map_err(backend)?;
        let mut ledger = Ledger::default();
        for entry in txn.open_table(COUNTERS).map_err(backend)?.iter().map_err(backend)? {
            let (key, value) = entry.map_err(backend)?;
            ledger.counters.insert(CounterKey(key.value().into()), value.value());
        }
        for entry in txn.open_table(RESERVATIONS).map_err(backend)?.iter().map_err(backend)? {
            let (request_id, bytes) = entry.map_err(backend)?;
            let stored = serde_json::from_slice(bytes.value()).map_err(|e| e.to_string());
            ledger.in_file.insert(request_id.value().to_owned());
            ledger.live += usize::from(is_live(Some(&stored)));
            ledger.reservations.insert(request_id.value().to_owned(), stored);
        }
        Ok(ledger)
    }

    /// A batch's writes (journaled first, or replayed from the journal).
    fn apply(&mut self, effects: Effects) {
        for (key, value) in effects.counters {
            // A counter is set far more often than made: the map keeps the key it has.
            match self.counters.get_mut(&key) {
                Some(counter) => *counter = value,
                None => _ = self.counters.insert(key.clone(), value),
            }
            self.changed_counters.insert(key);
        }
        for (request_id, reservation) in effects.reservations {
            let was_live = is_live(self.reservations.get(&request_id));
            let now_live = reservation.as_ref().is_some_and(|r| !r.swept);
            match reservation {
                Some(reservation) => _ = self.reservations.insert(request_id.clone(), Ok(reservation)),
                None => _ = self.reservations.remove(&request_id),
            }
            match (was_live, now_live) {
                (false, true) => self.live += 1,
                (true, false) => self.live = self.live.saturating_sub(1),
                _ => {}
            }
            self.changed_reservations.insert(request_id);
        }
    }
}

/// One batch's view of the ledger: its operations' writes over it, the current
/// operation's over those, kept only if its rules return `Ok`. The writes kept are its
/// effects, in order; the maps only say where each key's latest write is among them, so
/// that a reservation is not cloned into a map beside its effects (a batch is mostly
/// one operation of a few writes).
struct Batch<'l> {
    ledger: &'l Ledger,
    /// A counter's latest write in `effects.counters`.
    counters: HashMap<CounterKey, usize>,
    /// A reservation's latest write in `effects.reservations`.
    reservations: HashMap<String, usize>,
    op_counters: Vec<(CounterKey, u64)>,
    op_reservations: Vec<(String, Option<StoredReservation>)>,
    /// The writes kept, in order: what the journal line says.
    effects: Effects,
}

impl<'l> Batch<'l> {
    fn new(ledger: &'l Ledger) -> Self {
        Batch {
            ledger,
            counters: HashMap::default(),
            reservations: HashMap::default(),
            op_counters: Vec::new(),
            op_reservations: Vec::new(),
            effects: Effects::default(),
        }
    }

    /// Keeps the operation's writes if it `applied`, else drops them.
    fn end_operation(&mut self, applied: bool) {
        if !applied {
            self.op_counters.clear();
            self.op_reservations.clear();
            return;
        }
        for (key, value) in self.op_counters.drain(..) {
            self.counters.insert(key.clone(), self.effects.counters.len());
            self.effects.counters.push((key, value));
        }
        for (request_id, reservation) in self.op_reservations.drain(..) {
            self.reservations.insert(request_id.clone(), self.effects.reservations.len());
            self.effects.reservations.push((request_id, reservation));
        }
    }

    fn effects(self) -> Effects {
        self.effects
    }

    /// The batch's pending write of a reservation, if it has one (`Some(None)`: removed).
    fn pending(&self, request_id: &str) -> Option<&Option<StoredReservation>> {
        let op = self.op_reservations.iter().find(|(id, _)| id == request_id).map(|(_, pending)| pending);
        op.or_else(|| self.reservations.get(request_id).map(|&at| &self.effects.reservations[at].1))
    }

    fn put(&mut self, request_id: &str, reservation: Option<StoredReservation>) {
        match self.op_reservations.iter_mut().find(|(id, _)| id == request_id) {
            Some((_, pending)) => *pending = reservation,
            None => self.op_reservations.push((request_id.to_owned(), reservation)),
        }
    }
}

impl LedgerState for Batch<'_> {
    fn counter(&mut self, key: &CounterKey) -> Result<u64, StoreError> {
        let op = self.op_counters.iter().find(|(k, _)| k == key).map(|(_, value)| *value);
        let value = op
            .or_else(|| self.counters.get(key).map(|&at| self.effects.counters[at].1))
            .or_else(|| self.ledger.counters.get(key).copied());
        Ok(value.unwrap_or(0))
    }
    fn set_counter(&mut self, key: &CounterKey, value: u64) -> Result<(), StoreError> {
        match self.op_counters.iter_mut().find(|(k, _)| k == key) {
            Some((_, pending)) => *pending = value,
            None => self.op_counters.push((key.clone(), value)),
        }
        Ok(())
    }
    fn reservation(&mut self, request_id: &str) -> Result<Option<StoredReservation>, StoreError> {
        if let Some(pending) = self.pending(request_id) {
            return Ok(pending.clone());
        }
        match self.ledger.reservations.get(request_id) {
            Some(stored) => stored.clone().map(Some).map_err(|detail| corrupt(request_id, &detail)),
            None => Ok(None),
        }
    }
    fn put_reservation(&mut self, request_id: &str, reservation: &StoredReservation) -> Result<(), StoreError> {
        self.put(request_id, Some(reservation.clone()));
        Ok(())
    }
    fn delete_reservation(&mut self, request_id: &str) -> Result<(), StoreError> {
        self.put(request_id, None);
        Ok(())
    }
    fn all_reservations(&mut self) -> Result<Vec<(String, StoredReservation)>, StoreError> {
        let mut all: BTreeMap<String, StoredReservation> = BTreeMap::new();
        for (request_id, stored) in &self.ledger.reservations {
            let reservation = stored.as_ref().map_err(|detail| corrupt(request_id, detail))?;
            all.insert(request_id.clone(), reservation.clone());
        }
        // In order: a later write of the same reservation wins.
        for (request_id, pending) in self.effects.reservations.iter().chain(&self.op_reservations) {
            match pending {
                Some(reservation) => all.insert(request_id.clone(), reservation.clone()),
                None => all.remove(request_id),
            };
        }
        Ok(all.into_iter().collect())
    }
}

fn corrupt(request_id: &str, detail: &str) -> StoreError {
    StoreError::Corrupt { key: format!("reservations/{request_id}"), detail: detail.to_owned() }
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
}

/// The journal: what the batches since the last checkpoint wrote, one JSON line each,
/// written in place into a file allocated ahead ([`JOURNAL_BYTES`] of zeros), so that
/// a line's `fdatasync` flushes its data and no file size (on a virtio disk an
/// append's fdatasync took twice an overwrite's). Every line carries the journal's
/// epoch, which a checkpoint advances before the next line is written over the old
/// ones from the start, and commits to the file with what it holds: the journal is the
/// run of lines from the start in that epoch. What follows it (zeros, the lines of an
/// earlier epoch, a line cut short or damaged by a power loss) ends it, and an earlier
/// epoch at the start (the new epoch's first line not yet on disk) is no journal at
/// all: its lines are older than the file, and may lack the ones a failed fsync lost.
/// A file from before the epoch was committed with it takes the first line's epoch.
struct Journal {
    file: File,
    path: PathBuf,
    epoch: u64,
    /// Where the next line goes; the bytes of this epoch.
    len: u64,
    /// Lines of this epoch (the epoch's marker line aside).
    lines: usize,
    /// An fsync failed since the last checkpoint: the lines before it may be lost, and
    /// only a checkpoint makes the ledger durable.
    failed: bool,
}

/// The journal file's size, allocated at open: twice the size that calls a checkpoint.
pub const JOURNAL_BYTES: u64 = 2 * CHECKPOINT_BYTES;

/// The journal is allocated a page a write (see `Journal::open`).
const PAGE: u64 = 4096;

/// A journal line: the batch's writes, under the journal's epoch.
#[derive(Serialize, Deserialize)]
struct Line<E> {
    #[serde(rename = "e", default)]
    epoch: u64,
    #[serde(flatten)]
    effects: E,
}

impl Journal {
    /// Opens (or creates and allocates) the journal and reads the lines of its epoch,
    /// `expected` if the file names one.
    fn open(path: &Path, expected: Option<u64>) -> Result<(Journal, Vec<Effects>), StoreError> {
        let failed = |e: std::io::Error| backend(format!("ledger journal {}: {e}", path.display()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .read(true)
            .open(path)
            .map_err(failed)?;
        let mut left = Vec::new();
        let mut epoch = expected;
        let mut reader = BufReader::new(&file);
        let mut text = String::new();
        let mut number = 0;
        loop {
            text.clear();
            match reader.read_line(&mut text) {
                Ok(0) => break,
                Ok(_) => {}
                // Zeros and an earlier epoch's bytes after the end need not be UTF-8.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => break,
                Err(e) => return Err(failed(e)),
            }
            number += 1;
            let line: Option<Line<Effects>> = text.strip_suffix('\n').and_then(|t| serde_json::from_str(t).ok());
            // Zeros, a line cut short, or the rest of an earlier epoch's line: the end.
            let Some(line) = line else {
                tracing::debug!(journal = %path.display(), line = number, "ledger: the journal ends");
                break;
            };
            if epoch.is_some_and(|e| e != line.epoch) {
                if number == 1 {
                    tracing::info!(journal = %path.display(), epoch = line.epoch, ?expected, "ledger: the journal's lines are older than the file");
                }
                break;
            }
            epoch = Some(line.epoch);
            // An epoch's marker line writes nothing.
            if !line.effects.is_empty() {
                left.push(line.effects);
            }
        }
        let size = file.metadata().map_err(failed)?.len();
        if size < JOURNAL_BYTES {
            // Zeros written, not a hole: the blocks exist before the first line's fsync.
            // A page at a time: the page cache keeps a write's pages in folios the size
            // of the write, and every later line written into a large folio walks all of
            // its blocks (on ext4, one 8 MiB write made each line's
            // pwrite cost 15 µs of CPU instead of 6, and its fdatasync 73-80 instead of
            // 59-65).
            let page = [0; PAGE as usize];
            let mut at = size;
            while at < JOURNAL_BYTES {
                let end = ((at / PAGE + 1) * PAGE).min(JOURNAL_BYTES);
                std::os::unix::fs::FileExt::write_all_at(&file, &page[..(end - at) as usize], at).map_err(failed)?;
                at = end;
            }
            file.sync_all().map_err(failed)?;
        }
        let journal = Journal {
            file,
            path: path.to_owned(),
            epoch: epoch.unwrap_or(0),
            len: 0,
            lines: left.len(),
            failed: false,
        };
        Ok((journal, left))
    }

    fn is_empty(&self) -> bool {
        self.lines == 0
    }

    fn write_at(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        std::os::unix::fs::FileExt::write_all_at(&self.file, bytes, self.len)
            .map_err(|e| backend(format!("ledger journal {}: {e}", self.path.display())))?;
        self.len += bytes.len() as u64;
        Ok(())
    }

    /// One `pwrite(2)` for the batch; a batch that wrote nothing has nothing to journal.
    fn write(&mut self, effects: &Effects) -> Result<(), StoreError> {
        if !effects.is_empty() {
            let mut line = Vec::with_capacity(512);
            encode(self.epoch, effects, &mut line);
            self.write_at(&line)?;
            self.lines += 1;
        }
        Ok(())
    }

    /// `fdatasync` of the lines written so far, if there are any: a batch that wrote
    /// nothing still waits for the lines before it.
    fn sync(&self) -> Result<(), StoreError> {
        if self.lines == 0 {
            return Ok(());
        }
        self.file.sync_data().map_err(|e| backend(format!("ledger journal {} fsync: {e}", self.path.display())))
    }

    /// After a checkpoint: a new epoch, whose marker line (no writes) starts the file,
    /// so that the lines before it are no longer read.
    fn clear(&mut self) -> Result<(), StoreError> {
        self.epoch += 1;
        self.len = 0;
        self.lines = 0;
        self.failed = false;
        let mut marker = Vec::new();
        encode(self.epoch, &Effects::default(), &mut marker);
        self.write_at(&marker)
    }
}

/// A journal line, `\n` included: the bytes `serde_json` makes of a [`Line`] (a test
/// holds them equal; `Journal::open` reads them with it), written by hand
/// ([`crate::json`]).
fn encode(epoch: u64, effects: &Effects, line: &mut Vec<u8>) {
    line.push(b'{');
    json::key!(line, "e");
    json::number(line, epoch);
    if !effects.counters.is_empty() {
        line.push(b',');
        json::key!(line, "c");
        amounts(line, &effects.counters);
    }
    if !effects.reservations.is_empty() {
        line.push(b',');
        json::key!(line, "r");
        line.push(b'[');
        for (i, (request_id, reservation)) in effects.reservations.iter().enumerate() {
            if i > 0 {
                line.push(b',');
            }
            line.push(b'[');
            json::string(line, request_id);
            line.push(b',');
            match reservation {
                None => line.extend_from_slice(b"null"),
                Some(reservation) => {
                    line.push(b'{');
                    json::key!(line, "lines");
                    amounts(line, &reservation.lines);
                    line.push(b',');
                    json::key!(line, "expires_at");
                    json::number(line, reservation.expires_at);
                    line.push(b',');
                    json::key!(line, "swept");
                    json::boolean(line, reservation.swept);
                    if let Some(intent) = &reservation.intent {
                        line.push(b',');
                        json::key!(line, "intent");
                        amounts(line, intent);
                    }
                    line.push(b'}');
                }
            }
            line.push(b']');
        }
        line.push(b']');
    }
    line.extend_from_slice(b"}\n");
}

/// `[["key",amount],...]`
fn amounts(line: &mut Vec<u8>, amounts: &[(CounterKey, u64)]) {
    line.push(b'[');
    for (i, (key, amount)) in amounts.iter().enumerate() {
        if i > 0 {
            line.push(b',');
        }
        line.push(b'[');
        json::string(line, key.as_str());
        line.push(b',');
        json::number(line, *amount);
        line.push(b']');
    }
    line.push(b']');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Line;

    fn key(name: &str) -> CounterKey {
        CounterKey(format!("batch/{name}").into())
    }

    fn request(id: &str, amount: u64, limit: u64) -> ReserveRequest {
        ReserveRequest {
            request_id: id.to_owned(),
            lines: vec![Line { key: key("a"), amount, limit: Some(limit) }],
            expires_at: u64::MAX,
        }
    }

    fn reserve(id: &str, amount: u64, limit: u64) -> (Job, oneshot::Receiver<Result<ReserveOutcome, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        (Job::Reserve { request: request(id, amount, limit), reply }, answer)
    }

    fn settle(id: &str, actual: u64) -> (Job, oneshot::Receiver<Result<SettleOutcome, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        (Job::Settle { request_id: id.to_owned(), actual: vec![(key("a"), actual)], reply }, answer)
    }

    /// One batch, applied in order, each operation on the state the previous left, one
    /// journal line; the operation that fails in the middle writes nothing and fails
    /// nobody else. Its settlements are answered once the line is written, the rest once
    /// it is synced.
    #[tokio::test]
    async fn a_batch_applies_in_order_in_one_line_and_isolates_a_failing_operation() {
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = Ledger::default();
        ledger.reservations.insert("corrupt".into(), Err("not JSON".into()));
        let ledger = RwLock::new(ledger);
        let (r1, mut a1) = reserve("r1", 80, 100);
        let (r2, a2) = reserve("r2", 30, 100);
        let (s1, mut a3) = settle("r1", 10);
        let (bad, mut a4) = settle("corrupt", 50);
        let (r3, mut a5) = reserve("r3", 30, 100);
        let syncs = AtomicU64::new(0);
        let (journal, _) = Journal::open(&dir.path().join("batch.journal"), None).unwrap();
        let mut writer = Writer { journal, db: Database::create(dir.path().join("batch.redb")).unwrap() };
        let first = write_batch(&ledger, vec![r1, r2, s1, bad, r3], &mut writer.journal);

        assert_eq!(a3.try_recv().unwrap().unwrap(), SettleOutcome::Settled, "before the fsync");
        assert!(matches!(a4.try_recv().unwrap(), Err(StoreError::Corrupt { .. })));
        assert!(a1.try_recv().is_err() && a5.try_recv().is_err(), "reservations wait for the fsync");
        first.sync_and_answer(&mut writer, &ledger, &syncs);
        assert_eq!(syncs.load(Ordering::Relaxed), 1);
        let (s3, mut a6) = settle("r3", 5);
        write_batch(&ledger, vec![s3], &mut writer.journal).sync_and_answer(&mut writer, &ledger, &syncs);
        assert_eq!(a6.try_recv().unwrap().unwrap(), SettleOutcome::Settled);
        assert_eq!(syncs.load(Ordering::Relaxed), 1, "a settlement alone syncs nothing");
        drop(writer);

        assert_eq!(a1.await.unwrap().unwrap(), ReserveOutcome::Reserved);
        assert_eq!(a2.await.unwrap().unwrap(), ReserveOutcome::Refused { line: 0 }, "sees r1");
        assert_eq!(a5.await.unwrap().unwrap(), ReserveOutcome::Reserved, "sees the settlement of r1");
        let ledger = ledger.into_inner().unwrap();
        assert_eq!(ledger.counters[&key("a")], 15);
        assert!(!ledger.reservations.contains_key("r1") && !ledger.reservations.contains_key("r3"), "settled");
        assert_eq!(ledger.reservations["corrupt"], Err("not JSON".to_owned()), "left as it was");

        let (_, lines) = Journal::open(&dir.path().join("batch.journal"), None).unwrap();
        assert_eq!(lines.len(), 2, "one line a batch");
        let mut lines = lines.into_iter();
        let mut replayed = Ledger::default();
        replayed.apply(lines.next().unwrap());
        assert_eq!(replayed.counters[&key("a")], 40, "the first batch's line");
        assert_eq!(replayed.reservations.keys().collect::<Vec<_>>(), [&"r3".to_owned()]);
        replayed.apply(lines.next().unwrap());
        assert_eq!(replayed.counters, ledger.counters);
        assert!(replayed.reservations.is_empty());
    }

    /// A journal whose fsync fails (/dev/null takes writes and refuses `fdatasync`): a
    /// batch's settlement is answered at the write, its reservation once a checkpoint put
    /// the whole ledger in the file, and so on for the next batch, whose fsync fails too.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_failed_fsync_is_made_good_by_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("ledger.redb")).unwrap();
        let ledger = RwLock::new(Ledger::load(&db).unwrap());
        let file = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null").unwrap();
        let journal = Journal { file, path: "/dev/null".into(), epoch: 0, len: 0, lines: 0, failed: false };
        let mut writer = Writer { journal, db };
        let syncs = AtomicU64::new(0);

        let (r1, mut a1) = reserve("r1", 80, 100);
        write_batch(&ledger, vec![r1], &mut writer.journal).sync_and_answer(&mut writer, &ledger, &syncs);
        assert_eq!(a1.try_recv().unwrap().unwrap(), ReserveOutcome::Reserved);
        assert_eq!(syncs.load(Ordering::Relaxed), 0, "no fsync succeeded");
        assert!(!writer.journal.failed && writer.journal.is_empty(), "a checkpoint started a new journal");
        let file = Ledger::load(&writer.db).unwrap();
        assert_eq!(file.counters[&key("a")], 80);
        assert!(file.in_file.contains("r1"));

        let (s1, mut a2) = settle("r1", 10);
        let (r2, mut a3) = reserve("r2", 30, 100);
        let written = write_batch(&ledger, vec![s1, r2], &mut writer.journal);
        assert_eq!(a2.try_recv().unwrap().unwrap(), SettleOutcome::Settled, "at the write");
        assert!(a3.try_recv().is_err());
        written.sync_and_answer(&mut writer, &ledger, &syncs);
        assert_eq!(a3.try_recv().unwrap().unwrap(), ReserveOutcome::Reserved);
        let file = Ledger::load(&writer.db).unwrap();
        assert_eq!(file.counters[&key("a")], 40);
        assert_eq!(file.in_file.iter().collect::<Vec<_>>(), [&"r2".to_owned()]);
    }

    /// A checkpoint names the journal's epoch in the file: a journal whose new epoch's
    /// first line never reached the disk (a power loss, or an fsync that failed) is not
    /// replayed over the file, though its older lines say otherwise (here the
    /// reservation the file has settled, without its settlement's line).
    #[tokio::test]
    async fn a_journal_older_than_the_file_is_not_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(FILE_NAME);
        let db = Database::create(&file).unwrap();
        let ledger = RwLock::new(Ledger::load(&db).unwrap());
        let (journal, left) = Journal::open(&journal_file(&file), journal_epoch(&db).unwrap()).unwrap();
        assert!(left.is_empty());
        let mut writer = Writer { journal, db };
        let syncs = AtomicU64::new(0);
        write_batch(&ledger, vec![reserve("r1", 80, 100).0], &mut writer.journal).sync_and_answer(
            &mut writer,
            &ledger,
            &syncs,
        );
        let stale = std::fs::read(journal_file(&file)).unwrap();
        write_batch(&ledger, vec![settle("r1", 10).0], &mut writer.journal).sync_and_answer(
            &mut writer,
            &ledger,
            &syncs,
        );
        checkpoint(&writer.db, &mut ledger.write().unwrap(), &mut writer.journal).unwrap();
        drop(writer);
        std::fs::write(journal_file(&file), &stale).unwrap();

        let store = EmbeddedBudgetStore::open(dir.path()).unwrap();
        assert_eq!(store.used(&[key("a")]).await.unwrap(), [10], "the file's, not the stale line's 80");
        assert_eq!(store.live_reservations().await.unwrap(), 0);
        store.reserve(&request("r2", 90, 100)).await.unwrap();
        drop(store);
        let again = EmbeddedBudgetStore::open(dir.path()).unwrap();
        assert_eq!(again.used(&[key("a")]).await.unwrap(), [100], "reserved on the file's figure, kept at close");
    }

    /// The caller writes its own reservation only while no other is live; settlements
    /// always. The live count follows puts, sweeps and removals, and the file.
    #[tokio::test]
    async fn a_reservation_is_written_by_its_caller_only_while_no_other_is_live() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBudgetStore::open(dir.path()).unwrap();
        let (alone, _) = reserve("alone", 10, 100);
        assert!(store.written_here(&alone));
        store.reserve(&request("held", 10, 100)).await.unwrap();
        let (second, _) = reserve("second", 10, 100);
        assert!(!store.written_here(&second), "another call holds a reservation");
        assert!(store.written_here(&settle("held", 4).0));
        store.settle(&Reservation { request_id: "held".into(), lines: vec![(key("a"), 10)] }, &[]).await.unwrap();
        assert!(store.written_here(&second));

        let reservation = |swept| StoredReservation { lines: vec![], expires_at: 0, swept, intent: None };
        let effects = |id: &str, stored: Option<StoredReservation>| Effects {
            counters: vec![],
            reservations: vec![(id.to_owned(), stored)],
        };
        let mut ledger = Ledger::default();
        ledger.apply(effects("x", Some(reservation(false))));
        ledger.apply(effects("y", Some(reservation(false))));
        ledger.apply(effects("x", Some(reservation(false))));
        assert_eq!(ledger.live, 2, "a put over a live one counts once");
        ledger.apply(effects("x", Some(reservation(true))));
        assert_eq!(ledger.live, 1, "swept");
        ledger.apply(effects("x", None));
        ledger.apply(effects("y", None));
        assert_eq!(ledger.live, 0);
        ledger.apply(effects("z", None));
        assert_eq!(ledger.live, 0, "removing what is not there");

        // Reopened, a reservation the file holds is live.
        store.reserve(&request("kept", 10, 100)).await.unwrap();
        drop(store);
        let reopened = EmbeddedBudgetStore::open(dir.path()).unwrap();
        assert_eq!(reopened.ledger.read().unwrap().live, 1);
        assert!(!reopened.written_here(&reserve("next", 1, 100).0));
    }

    /// The bytes a journal line is written as are those a replay reads, whatever binary
    /// wrote them: an empty list left out, a removed reservation as `null`.
    #[test]
    fn a_journal_line_is_written_in_the_format_replay_reads() {
        let reservation = StoredReservation { lines: vec![(key("a"), 40)], expires_at: 9, swept: false, intent: None };
        let effects = Effects {
            counters: vec![(key("a"), 40)],
            reservations: vec![("r1".into(), Some(reservation)), ("r0".into(), None)],
        };
        let written = |epoch: u64, effects: &Effects| {
            let mut line = Vec::new();
            encode(epoch, effects, &mut line);
            String::from_utf8(line).unwrap()
        };
        let line = written(7, &effects);
        assert_eq!(
            line,
            "{\"e\":7,\"c\":[[\"batch/a\",40]],\"r\":[[\"r1\",{\"lines\":[[\"batch/a\",40]],\"expires_at\":9,\"swept\":false}],[\"r0\",null]]}\n"
        );
        let read: super::Line<Effects> = serde_json::from_str(line.trim_end()).unwrap();
        assert_eq!(read.epoch, 7);
        assert_eq!(format!("{:?}", read.effects), format!("{effects:?}"));
        assert_eq!(written(8, &Effects::default()), "{\"e\":8}\n");

        // Whatever the effects, the same bytes as serde_json's: names that need escaping,
        // a swept reservation, an intent, large numbers.
        let odd = CounterKey("t\"q\\/\u{1}/é/tokens/day/2026-12-02".into());
        let effects = Effects {
            counters: vec![(odd.clone(), u64::MAX), (key("b"), 0)],
            reservations: vec![
                ("id \"x\"\n".into(), None),
                (
                    "r2".into(),
                    Some(StoredReservation {
                        lines: vec![(odd.clone(), 1), (key("b"), 2)],
                        expires_at: 1_764_000_000,
                        swept: true,
                        intent: Some(vec![(odd, 3)]),
                    }),
                ),
            ],
        };
        let serde = serde_json::to_string(&super::Line { epoch: u64::MAX, effects: &effects }).unwrap();
        assert_eq!(written(u64::MAX, &effects), serde + "\n");
    }

    /// A journal shorter than its size (new, or cut short) is allocated to it, the
    /// allocation starting where the file ends, whatever its length: its lines are
    /// read and kept, zeros follow.
    #[test]
    fn a_short_journal_is_allocated_to_its_size_with_its_lines_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.redb.journal");
        let mut lines = Vec::new();
        encode(5, &Effects { counters: vec![(key("a"), 40)], reservations: Vec::new() }, &mut lines);
        for length in [0, lines.len(), lines.len() + 5000] {
            let mut content = lines.clone();
            content.resize(length.max(lines.len()), 0);
            content.truncate(length);
            std::fs::write(&path, &content).unwrap();
            let (journal, left) = Journal::open(&path, Some(5)).unwrap();
            assert_eq!(left.len(), usize::from(length > 0), "{length} bytes");
            assert_eq!(journal.lines, left.len());
            let file = std::fs::read(&path).unwrap();
            assert_eq!(file.len() as u64, JOURNAL_BYTES);
            assert_eq!(&file[..length], &content[..]);
            assert!(file[length..].iter().all(|b| *b == 0));
        }
    }

    /// An operation's writes reach the batch only when it applied.
    #[test]
    fn an_operation_that_fails_leaves_nothing() {
        let ledger = Ledger::default();
        let mut batch = Batch::new(&ledger);
        batch.set_counter(&key("a"), 7).unwrap();
        batch
            .put_reservation("x", &StoredReservation { lines: vec![], expires_at: 0, swept: false, intent: None })
            .unwrap();
        assert_eq!(batch.counter(&key("a")).unwrap(), 7, "an operation reads its own writes");
        assert_eq!(batch.all_reservations().unwrap().len(), 1);
        batch.end_operation(false);
        assert_eq!(batch.counter(&key("a")).unwrap(), 0);
        assert_eq!(batch.reservation("x").unwrap(), None);
        assert!(batch.effects().is_empty());
    }
}
