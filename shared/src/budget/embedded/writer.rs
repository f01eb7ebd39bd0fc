//! Group commit: the writer thread (`flexway-ledger`) takes the queued operations a
//! batch at a time, applies them in arrival order over the ledger, journals the batch
//! in one line, and answers its settlements and refunds at the write, the rest after
//! the fsync (or, once an fsync failed, a checkpoint) with `sync: reservation`, at the
//! write too with `sync: interval`, where the thread syncs the journal on its own clock
//! (`SYNC_EVERY`), off the writer's lock. A batch whose line is not written leaves the
//! ledger as it was and fails every operation in it.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError, RwLock, mpsc};
use std::time::{Duration, Instant};

use redb::Database;
use tokio::sync::oneshot;

use super::checkpoint::{checkpoint_held, checkpoint_logged};
use super::journal::Journal;
use super::journal::sync_data;
use super::state::{Batch, Ledger};
use super::{CHECKPOINT_BYTES, CHECKPOINT_EVERY, MAX_BATCH, backend};
use crate::budget::ledger::{self, LedgerState};
use crate::budget::{
    CounterKey, IntentOutcome, ReserveOutcome, ReserveRequest, Run, RunEnd, SettleOutcome, StoreError, Swept,
};
use crate::config::LedgerSync;

/// What a batch is written with.
pub(super) struct Writer {
    pub(super) journal: Journal,
    pub(super) db: Database,
    /// Whether a batch's operations other than settlements wait for its fsync
    /// (`Reservation`) or are answered at its write (`Interval`).
    pub(super) sync: LedgerSync,
}

/// What the writer thread's queue carries.
pub(super) enum Queued {
    Op(Job),
    /// `sync: interval`: a caller wrote the first line since the journal's last fsync;
    /// the next one is due.
    Unsynced,
}

pub(super) type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

pub(super) enum Job {
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
    CreateRun {
        run: Box<Run>,
        reply: Reply<bool>,
    },
    EndRun {
        id: String,
        at: u64,
        reply: Reply<RunEnd>,
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
            Job::CreateRun { run, reply } => Answer::CreateRun(reply, ledger::create_run(state, &run)),
            Job::EndRun { id, at, reply } => Answer::EndRun(reply, ledger::end_run(state, &id, at)),
        }
    }

    /// Answers an operation that was never applied.
    fn fail(self, why: &str) {
        match self {
            Job::Reserve { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
            Job::Settle { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
            Job::Intent { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
            Job::Sweep { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
            Job::CreateRun { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
            Job::EndRun { reply, .. } => deliver(reply, Err(backend(why)), Ok(())),
        }
    }
}

enum Answer {
    Reserve(Reply<ReserveOutcome>, Result<ReserveOutcome, StoreError>),
    Settle(Reply<SettleOutcome>, Result<SettleOutcome, StoreError>),
    Intent(Reply<IntentOutcome>, Result<IntentOutcome, StoreError>),
    Sweep(Reply<Swept>, Result<Swept, StoreError>),
    CreateRun(Reply<bool>, Result<bool, StoreError>),
    EndRun(Reply<RunEnd>, Result<RunEnd, StoreError>),
}

impl Answer {
    /// With `sync: reservation`, any but a settlement's or refund's, which is sent once
    /// its line is written; with `sync: interval`, none while the journal's fsyncs
    /// succeed. Once one failed and no checkpoint has succeeded since (`failed`), the
    /// journal is synced no more, so those wait for a checkpoint in either mode: the
    /// lines a power loss may take stay bounded, and a ledger that cannot be made
    /// durable refuses reservations rather than acknowledge them.
    fn waits_for_sync(&self, sync: LedgerSync, failed: bool) -> bool {
        (sync == LedgerSync::Reservation || failed) && !matches!(self, Answer::Settle(..))
    }

    fn is_ok(&self) -> bool {
        match self {
            Answer::Reserve(_, result) => result.is_ok(),
            Answer::Settle(_, result) => result.is_ok(),
            Answer::Intent(_, result) => result.is_ok(),
            Answer::Sweep(_, result) => result.is_ok(),
            Answer::CreateRun(_, result) => result.is_ok(),
            Answer::EndRun(_, result) => result.is_ok(),
        }
    }

    fn send(self, committed: Result<(), &str>) {
        match self {
            Answer::Reserve(reply, result) => deliver(reply, result, committed),
            Answer::Settle(reply, result) => deliver(reply, result, committed),
            Answer::Intent(reply, result) => deliver(reply, result, committed),
            Answer::Sweep(reply, result) => deliver(reply, result, committed),
            Answer::CreateRun(reply, result) => deliver(reply, result, committed),
            Answer::EndRun(reply, result) => deliver(reply, result, committed),
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

/// The writer thread: batches of queued operations, checkpoints, and with
/// `sync: interval` (`file`: its own handle on the journal) the journal's fsync, at
/// most every `every` while it holds lines not yet synced.
pub(super) fn write_loop(
    writer: &Mutex<Writer>,
    ledger: &RwLock<Ledger>,
    queue: &mpsc::Receiver<Queued>,
    syncs: &AtomicU64,
    file: Option<File>,
    every: Duration,
) {
    let lock = || writer.lock().unwrap_or_else(PoisonError::into_inner);
    let mut checkpointed = Instant::now();
    let mut synced = Instant::now();
    // Lines may wait for an fsync: this thread wrote one, or a caller said so.
    let mut due = false;
    loop {
        // Callers write into the journal too, without waking this thread but for the
        // first line since an fsync: it looks every period whether the journal holds
        // anything to checkpoint.
        let mut wait = CHECKPOINT_EVERY.saturating_sub(checkpointed.elapsed());
        if due {
            wait = wait.min(every.saturating_sub(synced.elapsed()));
        }
        let first = match queue.recv_timeout(wait) {
            Ok(Queued::Op(job)) => Some(job),
            Ok(Queued::Unsynced) => {
                due = true;
                None
            }
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut held = lock();
        if let Some(first) = first {
            let mut jobs = Vec::with_capacity(16);
            jobs.push(first);
            while jobs.len() < MAX_BATCH {
                match queue.try_recv() {
                    Ok(Queued::Op(job)) => jobs.push(job),
                    Ok(Queued::Unsynced) => due = true,
                    Err(_) => break,
                }
            }
            write_batch(ledger, jobs, &mut held).sync_and_answer(&mut held, ledger, syncs);
            // With `sync: reservation` lines left unsynced (settlements) wait for the
            // next reservation's fsync or checkpoint.
            due |= file.is_some() && held.journal.unsynced;
        }
        if held.journal.len >= CHECKPOINT_BYTES || checkpointed.elapsed() >= CHECKPOINT_EVERY {
            checkpointed = Instant::now();
            checkpoint_logged(ledger, &mut held);
        }
        drop(held);
        if let Some(file) = &file
            && due
            && synced.elapsed() >= every
        {
            synced = Instant::now();
            due = false;
            sync_unlocked(writer, ledger, file, syncs);
        }
    }
    // Closing: the file holds everything, and the journal is left empty; if that
    // checkpoint failed, the journal is synced instead.
    let mut held = lock();
    checkpoint_logged(ledger, &mut held);
    if held.journal.unsynced && !held.journal.failed {
        match held.journal.sync() {
            Ok(()) => _ = syncs.fetch_add(1, Ordering::Relaxed),
            Err(e) => tracing::error!(error = %e, "ledger journal fsync at close failed"),
        }
    }
}

/// `sync: interval`: the fsync of the lines written so far, on the writer thread's own
/// handle, without the writer's lock (callers keep writing meanwhile: their lines wait
/// for the next one). A failed fsync is not tried again (see the module docs): the
/// ledger is checkpointed at once instead, and the journal is synced no more until a
/// checkpoint succeeds. Nobody waits for it: a failure is logged.
fn sync_unlocked(writer: &Mutex<Writer>, ledger: &RwLock<Ledger>, file: &File, syncs: &AtomicU64) {
    let path = {
        let mut held = writer.lock().unwrap_or_else(PoisonError::into_inner);
        if !held.journal.unsynced || held.journal.failed {
            return;
        }
        held.journal.unsynced = false;
        held.journal.path.clone()
    };
    match sync_data(file, &path) {
        Ok(()) => _ = syncs.fetch_add(1, Ordering::Relaxed),
        Err(e) => {
            tracing::error!(error = %e, "ledger journal fsync failed; the ledger is checkpointed instead");
            let mut held = writer.lock().unwrap_or_else(PoisonError::into_inner);
            held.journal.failed = true;
            checkpoint_logged(ledger, &mut held);
        }
    }
}

/// Writes a batch: applies its operations over the ledger, writes its journal line (one
/// `pwrite(2)`), puts it in the ledger, and answers the operations that wait for no
/// fsync (settlements and refunds; with `sync: interval`, all). The fsync and the other
/// answers follow ([`Written::sync_and_answer`]).
pub(super) fn write_batch(ledger: &RwLock<Ledger>, jobs: Vec<Job>, writer: &mut Writer) -> Written {
    let mut jobs = jobs.into_iter();
    let mut answers = Vec::with_capacity(jobs.len());
    let written = apply_and_write(ledger, &mut writer.journal, &mut jobs, &mut answers).map_err(|e| e.to_string());
    if let Err(why) = &written {
        tracing::error!(error = %why, operations = answers.len() + jobs.len(), "ledger batch not written");
    }
    let failed = written.as_ref().err().map(String::as_str);
    // Left over when the batch aborted before reaching them.
    for job in jobs {
        job.fail(failed.unwrap_or("ledger batch aborted"));
    }
    let failed_sync = writer.journal.failed;
    let (waiting, settled): (Vec<_>, Vec<_>) =
        answers.into_iter().partition(|a| a.waits_for_sync(writer.sync, failed_sync));
    for answer in settled {
        answer.send(failed.map_or(Ok(()), Err));
    }
    Written { answers: waiting, failed: written.err() }
}

/// A batch written and in the ledger, whose fsync and answers are still to come.
#[must_use = "its callers wait for their answers"]
pub(super) struct Written {
    /// Those of its reservations, intents and sweeps with `sync: reservation`: the batch
    /// needs an fsync if any.
    answers: Vec<Answer>,
    failed: Option<String>,
}

impl Written {
    /// Makes the batch durable (when it needs it) and answers the batch's callers.
    pub(super) fn sync_and_answer(self, writer: &mut Writer, ledger: &RwLock<Ledger>, syncs: &AtomicU64) {
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

#[cfg(test)]
mod tests {
    use super::super::tests::{key, reserve, settle};
    use super::*;

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
        let db = Database::create(dir.path().join("batch.redb")).unwrap();
        let mut writer = Writer { journal, db, sync: LedgerSync::Reservation };
        let first = write_batch(&ledger, vec![r1, r2, s1, bad, r3], &mut writer);

        assert_eq!(a3.try_recv().unwrap().unwrap(), SettleOutcome::Settled, "before the fsync");
        assert!(matches!(a4.try_recv().unwrap(), Err(StoreError::Corrupt { .. })));
        assert!(a1.try_recv().is_err() && a5.try_recv().is_err(), "reservations wait for the fsync");
        first.sync_and_answer(&mut writer, &ledger, &syncs);
        assert_eq!(syncs.load(Ordering::Relaxed), 1);
        let (s3, mut a6) = settle("r3", 5);
        write_batch(&ledger, vec![s3], &mut writer).sync_and_answer(&mut writer, &ledger, &syncs);
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

    /// A new ledger file in `dir`, loaded, and a writer whose journal is /dev/null,
    /// which takes writes and refuses `fdatasync`.
    #[cfg(target_os = "linux")]
    fn failing_fsync(dir: &std::path::Path, sync: LedgerSync) -> (RwLock<Ledger>, Writer) {
        let db = Database::create(dir.join("ledger.redb")).unwrap();
        let ledger = RwLock::new(Ledger::load(&db).unwrap());
        let file = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null").unwrap();
        let journal =
            Journal { file, path: "/dev/null".into(), epoch: 0, len: 0, lines: 0, failed: false, unsynced: false };
        (ledger, Writer { journal, db, sync })
    }

    /// A journal whose fsync fails (/dev/null takes writes and refuses `fdatasync`): a
    /// batch's settlement is answered at the write, its reservation once a checkpoint put
    /// the whole ledger in the file, and so on for the next batch, whose fsync fails too.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_failed_fsync_is_made_good_by_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, mut writer) = failing_fsync(dir.path(), LedgerSync::Reservation);
        let syncs = AtomicU64::new(0);

        let (r1, mut a1) = reserve("r1", 80, 100);
        write_batch(&ledger, vec![r1], &mut writer).sync_and_answer(&mut writer, &ledger, &syncs);
        assert_eq!(a1.try_recv().unwrap().unwrap(), ReserveOutcome::Reserved);
        assert_eq!(syncs.load(Ordering::Relaxed), 0, "no fsync succeeded");
        assert!(!writer.journal.failed && writer.journal.is_empty(), "a checkpoint started a new journal");
        let file = Ledger::load(&writer.db).unwrap();
        assert_eq!(file.counters[&key("a")], 80);
        assert!(file.in_file.contains("r1"));

        let (s1, mut a2) = settle("r1", 10);
        let (r2, mut a3) = reserve("r2", 30, 100);
        let written = write_batch(&ledger, vec![s1, r2], &mut writer);
        assert_eq!(a2.try_recv().unwrap().unwrap(), SettleOutcome::Settled, "at the write");
        assert!(a3.try_recv().is_err());
        written.sync_and_answer(&mut writer, &ledger, &syncs);
        assert_eq!(a3.try_recv().unwrap().unwrap(), ReserveOutcome::Reserved);
        let file = Ledger::load(&writer.db).unwrap();
        assert_eq!(file.counters[&key("a")], 40);
        assert_eq!(file.in_file.iter().collect::<Vec<_>>(), [&"r2".to_owned()]);
    }

    /// With `sync: interval`, a reservation is answered at its write, and the writer
    /// thread's fsync, which fails here (/dev/null), is made good by a checkpoint that
    /// nobody waits for.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn with_sync_interval_a_failed_fsync_is_made_good_by_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, writer) = failing_fsync(dir.path(), LedgerSync::Interval);
        let handle = writer.journal.file.try_clone().unwrap();
        let writer = Mutex::new(writer);
        let syncs = AtomicU64::new(0);

        let (r1, mut a1) = reserve("r1", 80, 100);
        let written = write_batch(&ledger, vec![r1], &mut writer.lock().unwrap());
        assert_eq!(a1.try_recv().unwrap().unwrap(), ReserveOutcome::Reserved, "at the write");
        written.sync_and_answer(&mut writer.lock().unwrap(), &ledger, &syncs);
        assert!(writer.lock().unwrap().journal.unsynced);
        assert!(Ledger::load(&writer.lock().unwrap().db).unwrap().counters.is_empty(), "in the journal alone");

        sync_unlocked(&writer, &ledger, &handle, &syncs);
        assert_eq!(syncs.load(Ordering::Relaxed), 0, "no fsync succeeded");
        let writer = writer.into_inner().unwrap();
        assert!(!writer.journal.failed && writer.journal.is_empty(), "a checkpoint started a new journal");
        assert_eq!(Ledger::load(&writer.db).unwrap().counters[&key("a")], 80);
    }

    /// With `sync: interval`, once an fsync failed and no checkpoint has succeeded
    /// since, the journal is synced no more: a reservation then waits for a checkpoint,
    /// as with `sync: reservation`, so that nothing acknowledged is left to the page
    /// cache alone for longer than the interval.
    #[tokio::test]
    async fn with_sync_interval_a_failed_journal_makes_reservations_wait_for_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("ledger.redb")).unwrap();
        let ledger = RwLock::new(Ledger::load(&db).unwrap());
        let (mut journal, _) = Journal::open(&dir.path().join("ledger.journal"), None).unwrap();
        journal.failed = true;
        let mut writer = Writer { journal, db, sync: LedgerSync::Interval };
        let syncs = AtomicU64::new(0);

        let (r1, mut a1) = reserve("r1", 80, 100);
        let written = write_batch(&ledger, vec![r1], &mut writer);
        assert!(a1.try_recv().is_err(), "not answered at the write");
        written.sync_and_answer(&mut writer, &ledger, &syncs);
        assert_eq!(a1.try_recv().unwrap().unwrap(), ReserveOutcome::Reserved);
        assert!(!writer.journal.failed, "the checkpoint succeeded");
        assert_eq!(Ledger::load(&writer.db).unwrap().counters[&key("a")], 80, "in the file before its answer");

        let (r2, mut a2) = reserve("r2", 10, 100);
        let _ = write_batch(&ledger, vec![r2], &mut writer);
        assert_eq!(a2.try_recv().unwrap().unwrap(), ReserveOutcome::Reserved, "at the write again");
    }
}
