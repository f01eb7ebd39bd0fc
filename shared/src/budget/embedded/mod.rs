//! `EmbeddedBudgetStore`: the durable local ledger (`store: {kind: embedded, path: ...,
//! sync: interval | reservation}`), the same rules as every other store (`ledger.rs`),
//! kept in memory, made durable by a journal, and checkpointed into one redb file.
//!
//! Writes are committed in groups by one writer thread (`flexway-ledger`): it waits
//! for an operation (a second at most, to look for a checkpoint due; [`SYNC_EVERY`] at
//! most when the journal holds lines to sync), drains whatever else is already queued
//! (up to [`MAX_BATCH`]), applies them in arrival order — each operation's rules see
//! the state the previous ones left — appends what the batch wrote to the journal
//! (`<file>.journal`: one JSON line a batch, one `write(2)`, values rather than
//! operations), and only then puts the batch in the ledger that reads see.
//!
//! When an operation is acknowledged, and when the journal is synced (`store.sync`,
//! [`LedgerSync`]):
//! - `interval` (the default): every operation (reservation, settlement, refund,
//!   intent, sweep, run created or ended) once its journal line is written, in the
//!   page cache. The writer thread `fdatasync`s the journal at most every
//!   [`SYNC_EVERY`] while it holds lines not yet synced, and never under the writer's
//!   lock: it notes, under the lock, that the lines written so far are being synced,
//!   then syncs its own handle on the file (`try_clone`) while callers keep writing;
//!   lines written during the fsync wait for the next one. A caller whose line is the
//!   first since an fsync tells the thread (one message an fsync at most); the thread's
//!   own batches it knows of. No call waits for an fsync, and none waits behind one;
//! - `reservation`: a settlement or refund once its line is written, whatever else its
//!   batch holds; a reservation, an intent, a sweep or a run once its line is synced
//!   (`fdatasync`: one short write, where a durable redb commit rewrites about ten
//!   pages), one fsync for the batch. A settlement queued with reservations does not
//!   wait for their fsync (it may still wait for the fsync of the batch before it,
//!   which holds the writer's lock: writing it on its caller's thread meanwhile, one
//!   `write(2)` a settlement, cost 7% of the throughput at 64 connections). Lines that
//!   no reservation's fsync followed reach the disk with the next fsync or checkpoint.
//!
//! Operations skip the queue and are written by their caller, on its own thread, as a
//! batch of one, when no batch or checkpoint is being written (the writer's lock and
//! the ledger's are free): with `interval`, every operation but a sweep (which reads
//! every reservation: the writer thread's work), whatever is in flight; with
//! `reservation`, a settlement or refund, and a reservation when the ledger holds no
//! other live reservation (a call alone), fsync included. Handing these to the writer
//! thread and back took two wake-ups each, four a call. Such an operation may pass
//! operations already queued: arrival order holds within a batch. With `reservation`,
//! the fsync of a reservation written so blocks the whole serving thread (`flexway
//! serve` runs one single-threaded runtime per core), every connection on it included,
//! for as long as the disk takes; it happens only when no other budgeted call is in
//! flight in the process, so no other call's reservation waits behind it, but
//! unbudgeted requests and open streams on that thread do. Under concurrency a
//! reservation goes through the queue, where it shares its fsync with the others'.
//!
//! What a crash can lose (docs/guarantees.md says it to users). The journal is synced
//! whole up to a point and read back from its start to its first line that does not
//! read, so after any crash the ledger reopens as it was at one moment: no operation
//! survives an earlier one's loss.
//! - A killed process (`kill -9`, an abort): nothing acknowledged, in either mode. What
//!   it wrote to the journal is in the page cache, which outlives it, and the next
//!   `open` replays it.
//! - A power loss or a kernel crash, with `interval`: the operations acknowledged after
//!   the start of the last fsync that completed, those of about the last
//!   [`SYNC_EVERY`], more when the disk's fsyncs themselves take longer (the next one
//!   starts once the one under way ends). A reservation lost so is a call admitted in those
//!   milliseconds, which the machine's end cut or which the provider served: its cost
//!   is never counted, so a tenant's spend may pass its limits by at most the
//!   allowances of those calls. A settlement lost so leaves its reservation (if synced)
//!   held until the sweeper refunds it at expiry: that call goes uncharged, its
//!   allowance never spent twice. A sweep lost is swept again; a run created or ended
//!   in those milliseconds may be unknown, or not ended, after the restart.
//! - A power loss or a kernel crash, with `reservation`: only the settlements and
//!   refunds journaled since the last fsync. Their reservations were synced and stay
//!   held until the sweeper refunds them at expiry: no limit is passed, and those calls
//!   go uncharged in the ledger (the audit still has them).
//!
//! A checkpoint writes what changed since the last one into the redb file (one durable
//! commit) and empties the journal: every [`CHECKPOINT_EVERY`] while the journal holds
//! anything, past [`CHECKPOINT_BYTES`] of journal (looked at after each of the writer
//! thread's batches and every second), and at close (`Drop`: the writer thread's last
//! batch, then the checkpoint; if it fails, the journal is synced instead). `open`
//! loads the file and replays what a dead process left in the journal: a line sets
//! values, so replaying it twice changes nothing.
//!
//! Invariants:
//! - nothing acknowledged is lost when the process dies: an operation is acknowledged
//!   only once its journal line is written (with `reservation`, a reservation, intent,
//!   sweep or run only after the fsync of that line or, once an fsync failed, the
//!   checkpoint that holds it). If the journal write fails, every operation of the
//!   batch gets the error and the ledger is left as it was; lines reach the journal in
//!   the order of the lock, fsync or not;
//! - an operation applies whole or not at all: its writes are kept apart until its rules
//!   returned `Ok`; an operation whose rules fail leaves nothing behind and the rest of
//!   the batch proceeds;
//! - reads (`used`, `live_reservations`) see no operation before its journal line is
//!   written: a batch reaches the ledger they read once its line is in the journal
//!   (what a replay would find), never while its rules run. With `reservation`, a
//!   reservation may be read there during its fsync, before its caller is answered.
//!   They take a read lock and touch no file;
//! - a record of the file that does not decode fails only the operations that read it
//!   (its reservation's, or any that reads them all), as it would in the file.
//!
//! A failed fsync is not tried again: Linux reports a writeback error once and may drop
//! the pages, so the journal's lines since the last checkpoint may never reach the disk,
//! and a later fsync that succeeds vouches for nothing before it. The ledger is made
//! durable by a checkpoint instead (the whole ledger committed to the file, a new
//! journal). With `interval`, the writer thread runs it at once, nobody waits for it,
//! and both failures are logged. Until a checkpoint succeeds, in either mode, every
//! batch's callers but its settlements' get a checkpoint's outcome (its settlements
//! were answered at the write); such a checkpoint may run on a serving thread, for a
//! call alone. So `interval` falls back to `reservation`'s rule while the journal
//! cannot be synced, and what a power loss may take stays bounded. A reservation
//! whose caller got the error may still be in the ledger: a retry finds it, and is
//! acknowledged only once a checkpoint succeeds; else it is held until the sweeper
//! refunds it, never a charge that did not happen. redb refuses every write after a
//! commit that failed, until the file is opened again: once a checkpoint fails,
//! reservations, intents and sweeps fail until the process restarts (settlements are
//! still journaled, and replayed at the next open).
//!
//! A call whose future is dropped after its operation was queued may still apply;
//! retrying is safe because reservations are idempotent on the request id.
//!
//! File layout: `<dir>/ledger.redb` when `path` is a directory or has no extension
//! (the directory is created), else the file `path` itself; the journal beside it.
//! Three tables: `counters` (counter key → value), `reservations` (request id → JSON
//! `StoredReservation`) and `runs` (run id → JSON `Run`, SPEC §15; a run is created and
//! ended through the writer like a reservation, so `ledger::create_run` and
//! `ledger::end_run` apply whole, durable before their answer). The whole ledger is
//! held in memory: its counters (a few a tenant and agent per day and month, and the
//! per-minute windows and runs' counters, which a sweep forgets an hour past their
//! minute and a day past the run's expiry), its reservations (those in flight, and the
//! swept ones kept a day) and its runs (also forgotten a day past their expiry).

mod checkpoint;
mod journal;
mod state;
mod writer;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, TryLockError, mpsc};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use redb::Database;
use tokio::sync::oneshot;

use self::checkpoint::{checkpoint, journal_epoch};
pub use self::journal::JOURNAL_BYTES;
use self::journal::Journal;
use self::state::{Batch, Ledger};
use self::writer::{Job, Queued, Reply, Writer, write_batch, write_loop};
use super::ledger;
use super::{
    BudgetStore, CounterKey, IntentOutcome, Reservation, ReserveOutcome, ReserveRequest, Run, RunEnd, SettleOutcome,
    StoreError, Swept,
};
pub use crate::config::LedgerSync;

/// The most operations one batch carries; more wait for the next one.
pub const MAX_BATCH: usize = 256;

/// With `sync: interval`, the journal is fsynced at most this often while it holds
/// lines not yet synced (by the writer thread, off every call's path): a power loss or
/// a kernel crash can take the operations acknowledged in about this long before it.
pub const SYNC_EVERY: Duration = Duration::from_millis(5);

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
    ops: Option<mpsc::Sender<Queued>>,
    thread: Option<JoinHandle<()>>,
    syncs: Arc<AtomicU64>,
    sync: LedgerSync,
}

impl fmt::Debug for EmbeddedBudgetStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedBudgetStore")
            .field("file", &self.file)
            .field("sync", &self.sync)
            .field("syncs", &self.syncs())
            .finish_non_exhaustive()
    }
}

impl EmbeddedBudgetStore {
    /// Creates or opens the ledger at `path`, replays its journal, and starts its
    /// writer thread, with the default `sync: interval`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with(path, LedgerSync::default())
    }

    /// [`open`](Self::open), its journal synced as `sync` says (see the module docs).
    pub fn open_with(path: &Path, sync: LedgerSync) -> Result<Self, StoreError> {
        Self::start(path, sync, SYNC_EVERY)
    }

    /// `every`: how often the writer thread syncs the journal (`sync: interval`).
    fn start(path: &Path, sync: LedgerSync, every: Duration) -> Result<Self, StoreError> {
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

        let handle = match sync {
            LedgerSync::Interval => Some(journal.sync_handle()?),
            LedgerSync::Reservation => None,
        };
        let ledger = Arc::new(RwLock::new(ledger));
        let writer = Arc::new(Mutex::new(Writer { journal, db, sync }));
        let syncs = Arc::new(AtomicU64::new(0));
        let (ops, queue) = mpsc::channel();
        let thread = thread::Builder::new()
            .name("flexway-ledger".into())
            .spawn({
                let (ledger, writer, syncs) = (ledger.clone(), writer.clone(), syncs.clone());
                move || write_loop(&writer, &ledger, &queue, &syncs, handle, every)
            })
            .map_err(|e| backend(format!("start the ledger writer: {e}")))?;
        Ok(Self { ledger, writer, file, ops: Some(ops), thread: Some(thread), syncs, sync })
    }

    /// The database file in use.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Journal fsyncs that succeeded since `open` (a batch made durable by a checkpoint
    /// after a failed fsync counts none). With `sync: reservation`, one per batch that
    /// held a reservation, an intent or a sweep, so fewer than the operations
    /// acknowledged when concurrent calls shared a batch, and none for settlements
    /// alone; with `sync: interval`, at most one every [`SYNC_EVERY`], whatever the
    /// operations. A sync at close counts too, when its checkpoint failed.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Writes one operation here, or queues it for the writer thread (see the module
    /// docs), and waits for its answer: a settlement's once its journal line is
    /// written, any other's once it is durable (`sync: reservation`) or written too
    /// (`sync: interval`).
    async fn submit<T>(&self, job: impl FnOnce(Reply<T>) -> Job) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job = job(reply);
        let job = if self.written_here(&job) { self.write_here(job) } else { Some(job) };
        if let Some(job) = job {
            let ops = self.ops.as_ref().ok_or_else(|| backend("ledger writer stopped"))?;
            ops.send(Queued::Op(job)).map_err(|_| backend("ledger writer stopped"))?;
        }
        answer.await.map_err(|_| backend("ledger writer stopped before answering"))?
    }

    /// A settlement; with `sync: interval`, any operation but a sweep (which reads every
    /// reservation: the writer thread's work); with `sync: reservation`, a reservation
    /// while the ledger holds no other. Never waits for a lock: a checkpoint holds the
    /// ledger's through a durable commit.
    fn written_here(&self, job: &Job) -> bool {
        match (self.sync, job) {
            (_, Job::Settle { .. }) => true,
            (_, Job::Sweep { .. }) => false,
            (LedgerSync::Interval, _) => true,
            (LedgerSync::Reservation, Job::Reserve { .. }) => {
                self.ledger.try_read().is_ok_and(|ledger| ledger.live == 0)
            }
            (LedgerSync::Reservation, Job::Intent { .. } | Job::CreateRun { .. } | Job::EndRun { .. }) => false,
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
        let unsynced = writer.journal.unsynced;
        write_batch(&self.ledger, vec![job], &mut writer).sync_and_answer(&mut writer, &self.ledger, &self.syncs);
        // The first line since the journal's last fsync: the writer thread is told one
        // is due (at most one wake-up an fsync).
        let wake = self.sync == LedgerSync::Interval && !unsynced && writer.journal.unsynced;
        drop(writer);
        if wake && let Some(ops) = &self.ops {
            // A writer thread gone is found by the next operation.
            let _ = ops.send(Queued::Unsynced);
        }
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

    /// Through the writer, as a reservation: journaled and synced before its answer.
    async fn create_run(&self, run: &Run) -> Result<bool, StoreError> {
        let run = Box::new(run.clone());
        self.submit(|reply| Job::CreateRun { run, reply }).await
    }

    /// A lookup under a read lock.
    async fn run(&self, id: &str) -> Result<Option<Run>, StoreError> {
        match self.read()?.runs.get(id) {
            Some(stored) => stored.clone().map(Some).map_err(|detail| state::corrupt_run(id, &detail)),
            None => Ok(None),
        }
    }

    async fn end_run(&self, id: &str, at: u64) -> Result<RunEnd, StoreError> {
        let id = id.to_owned();
        self.submit(|reply| Job::EndRun { id, at, reply }).await
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

#[cfg(test)]
mod tests {
    use super::journal::Effects;
    use super::*;
    use crate::budget::Line;
    use crate::budget::ledger::StoredReservation;

    pub(super) fn key(name: &str) -> CounterKey {
        CounterKey(format!("batch/{name}").into())
    }

    fn request(id: &str, amount: u64, limit: u64) -> ReserveRequest {
        ReserveRequest {
            request_id: id.to_owned(),
            lines: vec![Line { key: key("a"), amount, limit: Some(limit) }],
            expires_at: u64::MAX,
        }
    }

    pub(super) fn reserve(
        id: &str,
        amount: u64,
        limit: u64,
    ) -> (Job, oneshot::Receiver<Result<ReserveOutcome, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        (Job::Reserve { request: request(id, amount, limit), reply }, answer)
    }

    pub(super) fn settle(id: &str, actual: u64) -> (Job, oneshot::Receiver<Result<SettleOutcome, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        (Job::Settle { request_id: id.to_owned(), actual: vec![(key("a"), actual)], reply }, answer)
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
        let mut writer = Writer { journal, db, sync: LedgerSync::Reservation };
        let syncs = AtomicU64::new(0);
        write_batch(&ledger, vec![reserve("r1", 80, 100).0], &mut writer).sync_and_answer(&mut writer, &ledger, &syncs);
        let stale = std::fs::read(journal_file(&file)).unwrap();
        write_batch(&ledger, vec![settle("r1", 10).0], &mut writer).sync_and_answer(&mut writer, &ledger, &syncs);
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

    /// A run is journaled like a reservation (replayed from the journal alone), ended
    /// through the writer, and checkpointed into the file; a counter a sweep forgot is
    /// gone from the file too, a budget counter kept.
    #[tokio::test]
    async fn runs_and_forgotten_counters_are_durable() {
        use crate::budget::run::{RunBudget, RunRef};
        use crate::budget::{Line, Period, RUN_RETENTION_SECS, Unit};

        let now = crate::budget::conformance::NOW;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(FILE_NAME);
        let parent = Run {
            this: RunRef {
                id: "run_p".into(),
                budget: RunBudget { tokens: Some(100), eur: None },
                expires_at: now + 60,
            },
            tenant: "acme".into(),
            agent: Some("bot".into()),
            label: None,
            ancestors: vec![],
            created_at: now,
            ended_at: None,
            children: vec![],
        };
        {
            let db = Database::create(&file).unwrap();
            let ledger = RwLock::new(Ledger::load(&db).unwrap());
            let (journal, _) = Journal::open(&journal_file(&file), journal_epoch(&db).unwrap()).unwrap();
            let mut writer = Writer { journal, db, sync: LedgerSync::Reservation };
            let (reply, answer) = oneshot::channel();
            let job = Job::CreateRun { run: Box::new(parent.clone()), reply };
            write_batch(&ledger, vec![job], &mut writer).sync_and_answer(&mut writer, &ledger, &AtomicU64::new(0));
            assert!(answer.await.unwrap().unwrap());
            // Dropped without a checkpoint: the run is in the journal alone.
        }

        let store = EmbeddedBudgetStore::open(dir.path()).unwrap();
        assert_eq!(store.run("run_p").await.unwrap().as_ref(), Some(&parent), "replayed from the journal");
        let child = Run {
            this: RunRef { id: "run_c".into(), ..parent.this.clone() },
            ancestors: vec![parent.this.clone()],
            ..parent.clone()
        };
        assert!(store.create_run(&child).await.unwrap());
        assert_eq!(store.end_run("run_p", now + 5).await.unwrap(), RunEnd::Ended(vec!["run_p".into(), "run_c".into()]));
        let window = CounterKey::window("acme", None, Unit::Requests, now);
        let day = CounterKey::new("acme", None, Unit::Tokens, Period::Day, now);
        let request = ReserveRequest {
            request_id: "r".into(),
            lines: vec![
                Line { key: window.clone(), amount: 1, limit: Some(5) },
                Line { key: day.clone(), amount: 9, limit: None },
            ],
            expires_at: now + 30,
        };
        store.reserve(&request).await.unwrap();
        store.settle(&request.reservation(), &[(window.clone(), 1), (day.clone(), 9)]).await.unwrap();
        drop(store);

        let store = EmbeddedBudgetStore::open(dir.path()).unwrap();
        assert_eq!(store.used(&[window.clone(), day.clone()]).await.unwrap(), [1, 9]);
        let ended = store.run("run_p").await.unwrap().unwrap();
        assert_eq!((ended.ended_at, ended.children), (Some(now + 5), vec!["run_c".to_owned()]));
        assert_eq!(store.run("run_c").await.unwrap().unwrap().ended_at, Some(now + 5));
        store.sweep(window.forget_at().unwrap() + 1).await.unwrap();
        assert_eq!(store.used(&[window.clone(), day.clone()]).await.unwrap(), [0, 9]);
        store.sweep(now + 60 + RUN_RETENTION_SECS + 1).await.unwrap();
        assert_eq!(store.run("run_p").await.unwrap(), None);
        drop(store);

        let store = EmbeddedBudgetStore::open(dir.path()).unwrap();
        let ledger = store.ledger.read().unwrap();
        assert!(!ledger.counters.contains_key(&window), "gone from the file");
        assert_eq!(ledger.counters.get(&day), Some(&9));
        assert!(ledger.runs.is_empty(), "both runs forgotten");
    }

    /// With `sync: reservation`, the caller writes its own reservation only while no
    /// other is live; settlements always. The live count follows puts, sweeps and
    /// removals, and the file.
    #[tokio::test]
    async fn a_reservation_is_written_by_its_caller_only_while_no_other_is_live() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedBudgetStore::open_with(dir.path(), LedgerSync::Reservation).unwrap();
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
            reservations: vec![(id.to_owned(), stored)],
            ..Effects::default()
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
        let reopened = EmbeddedBudgetStore::open_with(dir.path(), LedgerSync::Reservation).unwrap();
        assert_eq!(reopened.ledger.read().unwrap().live, 1);
        assert!(!reopened.written_here(&reserve("next", 1, 100).0));
        drop(reopened);

        // With `sync: interval`, every operation but a sweep, whatever is live.
        let interval = EmbeddedBudgetStore::open(dir.path()).unwrap();
        assert_eq!(interval.ledger.read().unwrap().live, 1);
        assert!(interval.written_here(&reserve("next", 1, 100).0));
        let (reply, _answer) = oneshot::channel();
        assert!(interval.written_here(&Job::Intent { request_id: "kept".into(), actual: vec![], renew: None, reply }));
        let (reply, _answer) = oneshot::channel();
        assert!(!interval.written_here(&Job::Sweep { now: 0, reply }));
    }

    /// With `sync: interval`, a reservation is answered once its line is written, before
    /// any fsync (the writer thread's comes at its own time, here a long one): what a
    /// process killed right after the answer leaves on disk (the file, and the journal
    /// in the page cache) holds it. The fsync follows, off the caller's path.
    #[tokio::test]
    async fn with_sync_interval_a_reservation_is_answered_at_its_write() {
        let dir = tempfile::tempdir().unwrap();
        let every = Duration::from_millis(400);
        let store = EmbeddedBudgetStore::start(&dir.path().join("live"), LedgerSync::Interval, every).unwrap();
        let opened = std::time::Instant::now();
        assert_eq!(store.reserve(&request("r1", 30, 100)).await.unwrap(), ReserveOutcome::Reserved);
        assert_eq!(store.syncs(), 0, "answered before any fsync");
        let killed = dir.path().join("killed");
        std::fs::create_dir(&killed).unwrap();
        std::fs::copy(store.file(), killed.join(FILE_NAME)).unwrap();
        std::fs::copy(journal_file(store.file()), journal_file(&killed.join(FILE_NAME))).unwrap();
        assert!(opened.elapsed() < every, "the test ran too slowly to say anything");

        let copy = EmbeddedBudgetStore::open(&killed).unwrap();
        assert_eq!(copy.used(&[key("a")]).await.unwrap(), [30], "replayed from the journal");
        assert_eq!(copy.live_reservations().await.unwrap(), 1);
        drop(copy);

        let started = std::time::Instant::now();
        while store.syncs() == 0 {
            assert!(started.elapsed() < every * 10, "the writer thread never synced the journal");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(opened.elapsed() >= every, "at most one fsync every {every:?}");
        assert_eq!(store.syncs(), 1, "one fsync for the lines written");
        assert!(!store.writer.lock().unwrap().journal.unsynced);
    }
}
