//! The embedded (redb) ledger: the conformance suite, durability across a restart, and
//! group commit.
#![cfg(test)]
// The group-commit test prints the fsyncs it took, for whoever runs it by hand.
#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::sync::Arc;

use flexway::budget::{
    BudgetStore, CounterKey, EmbeddedBudgetStore, IntentOutcome, Line, Reservation, ReserveOutcome, ReserveRequest,
    SettleOutcome, Swept, conformance,
};
use flexway::config::LedgerSync;

const NOW: u64 = 1_795_967_070;

fn key(name: &str) -> CounterKey {
    CounterKey(format!("embedded/{name}").into())
}

fn request(id: &str, lines: &[(&str, u64, Option<u64>)], expires_at: u64) -> ReserveRequest {
    ReserveRequest {
        request_id: id.to_owned(),
        lines: lines.iter().map(|(k, amount, limit)| Line { key: key(k), amount: *amount, limit: *limit }).collect(),
        expires_at,
    }
}

/// The reservation a ticket carries to its settlement.
fn held(id: &str, lines: &[(&str, u64)]) -> Reservation {
    Reservation { request_id: id.to_owned(), lines: lines.iter().map(|(k, amount)| (key(k), *amount)).collect() }
}

/// A directory that outlives the test's stores (removed when the returned guard drops).
fn fresh_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flexway-ledger");
    (dir, path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_store_passes_the_conformance_suite() {
    for sync in [LedgerSync::Interval, LedgerSync::Reservation] {
        let dirs = std::sync::Mutex::new(Vec::new());
        let failures = conformance::run_all(|| {
            let (dir, path) = fresh_dir();
            dirs.lock().unwrap().push(dir);
            async move { EmbeddedBudgetStore::open_with(&path, sync).unwrap() }
        })
        .await;
        assert!(failures.is_empty(), "sync {sync:?}: {failures:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opens_a_directory_as_ledger_redb_and_a_file_path_as_is() {
    let (_dir, path) = fresh_dir();
    let store = EmbeddedBudgetStore::open(&path).unwrap();
    assert_eq!(store.file(), path.join("ledger.redb"));
    assert!(path.join("ledger.redb").is_file());
    drop(store);

    let file = path.join("nested").join("budgets.redb");
    let store = EmbeddedBudgetStore::open(&file).unwrap();
    assert_eq!(store.file(), file);
    assert!(file.is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_survive_a_restart() {
    let (_dir, path) = fresh_dir();
    let counted = [key("a"), key("b")];
    {
        let store = EmbeddedBudgetStore::open(&path).unwrap();
        let reserved =
            store.reserve(&request("done", &[("a", 100, Some(1000)), ("b", 5, None)], NOW + 60)).await.unwrap();
        assert_eq!(reserved, ReserveOutcome::Reserved);
        let settled =
            store.settle(&held("done", &[("a", 100), ("b", 5)]), &[(key("a"), 40), (key("b"), 2)]).await.unwrap();
        assert_eq!(settled, SettleOutcome::Settled);
        store.reserve(&request("live", &[("a", 300, Some(1000))], NOW + 60)).await.unwrap();
        store.reserve(&request("stale", &[("b", 7, None)], NOW - 1)).await.unwrap();
        assert_eq!(store.used(&counted).await.unwrap(), [340, 9]);
    }

    let store = EmbeddedBudgetStore::open(&path).unwrap();
    assert_eq!(store.used(&counted).await.unwrap(), [340, 9], "counters after reopening");
    assert_eq!(store.live_reservations().await.unwrap(), 2, "reservations after reopening");
    assert_eq!(
        store.settle(&held("done", &[("a", 100), ("b", 5)]), &[(key("a"), 40)]).await.unwrap(),
        SettleOutcome::Unknown,
        "settled before the restart"
    );
    assert_eq!(store.settle(&held("live", &[("a", 300)]), &[(key("a"), 120)]).await.unwrap(), SettleOutcome::Settled);
    assert_eq!(store.sweep(NOW).await.unwrap().refunded, 1, "the expired reservation is swept after the restart");
    assert_eq!(store.used(&counted).await.unwrap(), [160, 2]);
    assert_eq!(store.live_reservations().await.unwrap(), 0);
}

/// The actual amounts of a settlement that could not be written are on disk: a restart
/// in between does not turn the call into a refund.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_intent_survives_a_restart() {
    let (_dir, path) = fresh_dir();
    {
        let store = EmbeddedBudgetStore::open(&path).unwrap();
        store.reserve(&request("unwritten", &[("a", 100, Some(1000))], NOW - 1)).await.unwrap();
        let recorded = store.record_intent("unwritten", &[(key("a"), 40)]).await.unwrap();
        assert_eq!(recorded, IntentOutcome::Recorded);
    }
    let store = EmbeddedBudgetStore::open(&path).unwrap();
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [100], "the reservation still holds");
    assert_eq!(store.sweep(NOW).await.unwrap(), Swept { charged: 1, ..Swept::default() });
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [40], "the intent is charged, not refunded");
}

/// Reservations written before settle intents existed carry no `intent` field: they
/// still read, settle and sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_written_before_intents_existed_still_sweep() {
    let (_dir, path) = fresh_dir();
    drop(EmbeddedBudgetStore::open(&path).unwrap());
    {
        let db = redb::Database::create(path.join("ledger.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let counters: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("counters");
            txn.open_table(counters).unwrap().insert("embedded/a", 300).unwrap();
            let table: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("reservations");
            let mut table = txn.open_table(table).unwrap();
            let old = format!(r#"{{"lines":[["embedded/a",100]],"expires_at":{},"swept":false}}"#, NOW - 1);
            table.insert("old", old.as_bytes()).unwrap();
            let settled = format!(r#"{{"lines":[["embedded/a",200]],"expires_at":{},"swept":false}}"#, NOW + 60);
            table.insert("settled", settled.as_bytes()).unwrap();
        }
        txn.commit().unwrap();
    }
    let store = EmbeddedBudgetStore::open(&path).unwrap();
    assert_eq!(store.settle(&held("settled", &[("a", 200)]), &[(key("a"), 20)]).await.unwrap(), SettleOutcome::Settled);
    assert_eq!(store.sweep(NOW).await.unwrap(), Swept { refunded: 1, ..Swept::default() });
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [20]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_concurrent_ops_share_fsyncs() {
    let (_dir, path) = fresh_dir();
    let store = Arc::new(EmbeddedBudgetStore::open_with(&path, LedgerSync::Reservation).unwrap());
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .reserve(&request(&format!("many-{i}"), &[("shared", 3, Some(600)), ("free", 1, None)], NOW + 60))
                    .await
            })
        })
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap().unwrap(), ReserveOutcome::Reserved);
    }
    assert_eq!(store.used(&[key("shared"), key("free")]).await.unwrap(), [600, 200]);
    assert_eq!(store.live_reservations().await.unwrap(), 200);
    let syncs = store.syncs();
    assert!(syncs < 200, "200 concurrent reserves took {syncs} fsyncs: no batching happened");
    println!("200 concurrent reserves in {syncs} fsyncs");
    // The cap is now reached exactly: one more is refused and writes nothing.
    let refused = store
        .reserve(&request("one-too-many", &[("free", 1, None), ("shared", 1, Some(600))], NOW + 60))
        .await
        .unwrap();
    assert_eq!(refused, ReserveOutcome::Refused { line: 1 });
    assert_eq!(store.used(&[key("shared"), key("free")]).await.unwrap(), [600, 200]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_record_fails_only_the_operations_that_read_it() {
    // The operations that read the corrupt record fail and write nothing; the others,
    // possibly batched with them, commit.
    let (_dir, path) = fresh_dir();
    {
        let store = EmbeddedBudgetStore::open(&path).unwrap();
        store.reserve(&request("good", &[("a", 10, None)], NOW + 60)).await.unwrap();
    }
    {
        let db = redb::Database::create(path.join("ledger.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let table: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("reservations");
            let mut table = txn.open_table(table).unwrap();
            table.insert("broken", b"not json".as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }
    let store = Arc::new(EmbeddedBudgetStore::open(&path).unwrap());
    let broken = {
        let store = store.clone();
        tokio::spawn(async move { store.settle(&held("broken", &[("a", 5)]), &[(key("a"), 5)]).await })
    };
    let fine: Vec<_> = (0..20)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(
                async move { store.reserve(&request(&format!("fine-{i}"), &[("a", 1, None)], NOW + 60)).await },
            )
        })
        .collect();
    let error = broken.await.unwrap().unwrap_err();
    assert!(error.to_string().contains("corrupt record reservations/broken"), "{error}");
    for task in fine {
        assert_eq!(task.await.unwrap().unwrap(), ReserveOutcome::Reserved);
    }
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [30], "the failed settle moved a counter");
    assert!(store.sweep(NOW).await.is_err(), "sweep reads every record, the corrupt one included");
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [30]);
}

/// Copies what a process killed now would leave on disk: the database file as its last
/// durable commit wrote it (a commit without an fsync lives in the process's memory
/// only) and the settle journal, which is in the page cache.
fn leave_as_killed(store: &EmbeddedBudgetStore, to: &std::path::Path, with_journal: bool) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    let file = to.join("ledger.redb");
    std::fs::copy(store.file(), &file).unwrap();
    if with_journal {
        std::fs::copy(journal(store.file()), journal(&file)).unwrap();
    }
    file
}

fn journal(file: &std::path::Path) -> PathBuf {
    PathBuf::from(format!("{}.journal", file.display()))
}

/// The database is committed without an fsync; the journal holds what was acknowledged
/// (with `sync: reservation`, a reservation once synced; a settlement, and with
/// `sync: interval` any operation, once written). A kill before the next checkpoint
/// loses nothing: the journal is replayed at open, and replaying it again changes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_was_acknowledged_before_a_checkpoint_survives_a_kill() {
    for sync in [LedgerSync::Reservation, LedgerSync::Interval] {
        acknowledged_survives_a_kill(sync).await;
    }
}

async fn acknowledged_survives_a_kill(sync: LedgerSync) {
    let (dir, path) = fresh_dir();
    let store = EmbeddedBudgetStore::open_with(&path, sync).unwrap();
    store.reserve(&request("call", &[("a", 100, Some(1000))], NOW + 60)).await.unwrap();
    let settled = store.settle(&held("call", &[("a", 100)]), &[(key("a"), 40)]).await.unwrap();
    assert_eq!(settled, SettleOutcome::Settled);
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [40], "visible at once");
    if sync == LedgerSync::Reservation {
        assert_eq!(store.syncs(), 1, "one fsync for the call: its reservation's");
    }

    // Without the journal, the file alone holds neither: no database fsync was paid.
    let unjournaled = leave_as_killed(&store, &dir.path().join("file-only"), false);
    let killed = leave_as_killed(&store, &dir.path().join("killed"), true);
    let kept_journal = std::fs::read(journal(&killed)).unwrap();
    drop(store);
    let reopened = EmbeddedBudgetStore::open(&path).unwrap();
    assert_eq!(reopened.used(&[key("a")]).await.unwrap(), [40], "made durable at close");
    drop(reopened);

    let file_only = EmbeddedBudgetStore::open(&unjournaled).unwrap();
    assert_eq!(file_only.used(&[key("a")]).await.unwrap(), [0]);
    assert_eq!(file_only.live_reservations().await.unwrap(), 0);
    drop(file_only);

    let replayed = EmbeddedBudgetStore::open(&killed).unwrap();
    assert_eq!(replayed.used(&[key("a")]).await.unwrap(), [40], "the journal replayed");
    assert_eq!(replayed.live_reservations().await.unwrap(), 0);
    drop(replayed);
    // Killed again right after its replay committed, before the journal was emptied.
    std::fs::write(journal(&killed), &kept_journal).unwrap();
    let again = EmbeddedBudgetStore::open(&killed).unwrap();
    assert_eq!(again.used(&[key("a")]).await.unwrap(), [40], "a second replay changes nothing");
}

/// A checkpoint (every `CHECKPOINT_EVERY` while the journal holds anything) puts
/// everything in the database file and empties the journal. These calls are alone on
/// the ledger, so their callers wrote the journal lines, waking no thread: the writer
/// thread finds them on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_puts_everything_in_the_file() {
    let (dir, path) = fresh_dir();
    let store = EmbeddedBudgetStore::open(&path).unwrap();
    store.reserve(&request("first", &[("a", 100, Some(1000))], NOW + 60)).await.unwrap();
    store.settle(&held("first", &[("a", 100)]), &[(key("a"), 30)]).await.unwrap();
    store.reserve(&request("second", &[("a", 100, Some(1000))], NOW + 60)).await.unwrap();
    // The file alone, without the journal, once a checkpoint has run.
    let started = std::time::Instant::now();
    let file = loop {
        let file = leave_as_killed(&store, &dir.path().join("killed"), false);
        let copy = EmbeddedBudgetStore::open(&file).unwrap();
        let done = copy.used(&[key("a")]).await.unwrap() == [130];
        drop(copy);
        if done {
            break file;
        }
        assert!(started.elapsed() < flexway::budget::embedded::CHECKPOINT_EVERY * 10, "no checkpoint");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let reopened = EmbeddedBudgetStore::open(&file).unwrap();
    assert_eq!(reopened.used(&[key("a")]).await.unwrap(), [130], "the settlement and the second reservation");
    assert_eq!(reopened.live_reservations().await.unwrap(), 1);
    drop(reopened);

    // A reservation the file holds leaves it at the checkpoint after its settlement.
    store.settle(&held("second", &[("a", 100)]), &[(key("a"), 20)]).await.unwrap();
    let started = std::time::Instant::now();
    loop {
        let file = leave_as_killed(&store, &dir.path().join("settled"), false);
        let copy = EmbeddedBudgetStore::open(&file).unwrap();
        if copy.live_reservations().await.unwrap() == 0 {
            assert_eq!(copy.used(&[key("a")]).await.unwrap(), [50]);
            break;
        }
        drop(copy);
        assert!(started.elapsed() < flexway::budget::embedded::CHECKPOINT_EVERY * 10, "no checkpoint");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The journal is the run of lines from its start in the epoch the file names (its
/// last checkpoint started it): a last line cut short (the process died inside its
/// write) was never acknowledged, the lines of an earlier epoch after it were
/// checkpointed already, and an earlier epoch at the start is older than the file.
/// None is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_ends_at_a_line_cut_short_or_an_earlier_epoch() {
    let (_dir, path) = fresh_dir();
    let file = {
        let store = EmbeddedBudgetStore::open(&path).unwrap();
        store.reserve(&request("call", &[("a", 100, Some(1000))], NOW + 60)).await.unwrap();
        store.file().to_owned()
    };
    // The epoch the close's checkpoint started, in the marker line it wrote.
    let epoch = || {
        let journal = std::fs::read(journal(&file)).unwrap();
        let first = journal.split(|b| *b == b'\n').next().unwrap();
        serde_json::from_slice::<serde_json::Value>(first).unwrap()["e"].as_u64().unwrap()
    };
    let e = epoch();
    let line = format!(r#"{{"e":{e},"c":[["embedded/a",40]],"r":[["call",null]]}}"#);
    std::fs::write(journal(&file), format!("{line}\n{{\"e\":{e},\"c\":[[\"embedded/a\",9")).unwrap();
    let store = EmbeddedBudgetStore::open(&file).unwrap();
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [40]);
    assert_eq!(store.live_reservations().await.unwrap(), 0);
    drop(store);

    // A line setting the counter to `value`, in `epoch`.
    let counter = |epoch: u64, value: u64| format!(r#"{{"e":{epoch},"c":[["embedded/a",{value}]]}}"#);
    let e = epoch();
    std::fs::write(journal(&file), format!("{}\n{}\n", counter(e, 55), counter(e - 1, 999))).unwrap();
    let store = EmbeddedBudgetStore::open(&file).unwrap();
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [55], "the earlier epoch's line is not replayed");
    drop(store);

    let e = epoch();
    std::fs::write(journal(&file), format!("{}\n", counter(e - 1, 999))).unwrap();
    let store = EmbeddedBudgetStore::open(&file).unwrap();
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [55], "a journal older than the file is not replayed");
}

/// With `sync: reservation`, a call alone on the ledger is written by its caller, on
/// its own thread: its reservation (fsync included) and its settlement are answered
/// within the first poll, where the writer thread would answer later, from another
/// thread. A reservation made while another call holds one goes through the writer
/// thread and shares its fsync.
#[tokio::test(flavor = "current_thread")]
async fn a_call_alone_is_written_on_its_own_thread() {
    use futures_util::FutureExt;
    let (_dir, path) = fresh_dir();
    let store = EmbeddedBudgetStore::open_with(&path, LedgerSync::Reservation).unwrap();
    for round in 0..3 {
        let id = format!("alone-{round}");
        let reserved = store.reserve(&request(&id, &[("a", 10, Some(1000))], NOW + 60)).now_or_never();
        assert_eq!(reserved.map(Result::unwrap), Some(ReserveOutcome::Reserved), "round {round}");
        let settled = store.settle(&held(&id, &[("a", 10)]), &[(key("a"), 4)]).now_or_never();
        assert_eq!(settled.map(Result::unwrap), Some(SettleOutcome::Settled), "round {round}");
    }
    assert_eq!(store.syncs(), 3, "one fsync a call: its reservation's");

    // Two calls in flight: the second reservation goes through the writer thread's
    // queue, and the ledger is as exact.
    store.reserve(&request("first", &[("a", 10, Some(1000))], NOW + 60)).await.unwrap();
    let second = request("second", &[("a", 10, Some(1000))], NOW + 60);
    assert_eq!(store.reserve(&second).await.unwrap(), ReserveOutcome::Reserved);
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [12 + 20]);
    assert_eq!(store.live_reservations().await.unwrap(), 2);
    assert_eq!(store.syncs(), 5);
}

/// With `sync: interval` (the default), every call is written by its caller whatever
/// else is in flight, answered within the first poll without an fsync; the writer
/// thread syncs the journal on its own, at most every `SYNC_EVERY`.
#[tokio::test(flavor = "current_thread")]
async fn with_sync_interval_calls_are_written_on_their_own_thread_and_synced_after() {
    use futures_util::FutureExt;
    let (_dir, path) = fresh_dir();
    let store = EmbeddedBudgetStore::open(&path).unwrap();
    let started = std::time::Instant::now();
    // The writer thread holds the writer's lock for a moment around its fsync, and a
    // call that meets it then queues: of three attempts, one sees its three calls
    // answered at once (with `sync: reservation`, none would: others are live).
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut at_once = 0;
        for round in 0..3 {
            let id = format!("held-{attempts}-{round}");
            let call = request(&id, &[("a", 10, Some(1000))], NOW + 60);
            let mut reserving = Box::pin(store.reserve(&call));
            match (&mut reserving).now_or_never() {
                Some(reserved) => {
                    assert_eq!(reserved.unwrap(), ReserveOutcome::Reserved, "{id}");
                    at_once += 1;
                }
                None => assert_eq!(reserving.await.unwrap(), ReserveOutcome::Reserved, "{id}"),
            }
        }
        if at_once == 3 {
            break;
        }
        assert!(attempts < 3, "no attempt had its three calls answered at once");
    }
    assert_eq!(store.live_reservations().await.unwrap(), 3 * attempts, "each written while others were live");
    let settled = store.settle(&held("held-1-0", &[("a", 10)]), &[(key("a"), 4)]).await;
    assert_eq!(settled.unwrap(), SettleOutcome::Settled);
    while store.syncs() == 0 {
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "the journal was never synced");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let every = flexway::budget::embedded::SYNC_EVERY;
    let most = 1 + started.elapsed().as_nanos() / every.as_nanos();
    assert!(u128::from(store.syncs()) <= most, "{} fsyncs in {:?}", store.syncs(), started.elapsed());
    assert_eq!(store.used(&[key("a")]).await.unwrap(), [4 + 10 * (3 * attempts as u64 - 1)]);
}
