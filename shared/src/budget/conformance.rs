//! The conformance suite every `BudgetStore` must pass: atomicity, idempotency,
//! refund, expiry, and concurrency. Written against the port only, so the DynamoDB
//! adapter runs exactly these checks against the emulator.
//!
//! Each check gets a fresh store from `make` and returns `Err(reason)` on failure;
//! `run_all` collects the failures so one run reports them all.

use std::future::Future;
use std::sync::Arc;

use super::{BudgetStore, CounterKey, Line, ReserveOutcome, ReserveRequest, SettleOutcome};

const NOW: u64 = 1_795_967_070;

fn key(name: &str) -> CounterKey {
    CounterKey(format!("conformance/{name}"))
}

fn request(id: &str, lines: &[(&str, u64, Option<u64>)], expires_at: u64) -> ReserveRequest {
    ReserveRequest {
        request_id: id.to_owned(),
        lines: lines.iter().map(|(k, amount, limit)| Line { key: key(k), amount: *amount, limit: *limit }).collect(),
        expires_at,
    }
}

fn check(condition: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if condition { Ok(()) } else { Err(what()) }
}

async fn used(store: &dyn BudgetStore, names: &[&str]) -> Result<Vec<u64>, String> {
    let keys: Vec<CounterKey> = names.iter().map(|n| key(n)).collect();
    store.used(&keys).await.map_err(|e| e.to_string())
}

macro_rules! call {
    ($e:expr) => {
        $e.await.map_err(|e| format!("{}: {e}", stringify!($e)))?
    };
}

pub async fn reserve_counts_within_the_limit(store: &dyn BudgetStore) -> Result<(), String> {
    let outcome = call!(store.reserve(&request("r1", &[("a", 100, Some(1000)), ("b", 7, None)], NOW + 60)));
    check(outcome == ReserveOutcome::Reserved, || format!("expected Reserved, got {outcome:?}"))?;
    let got = used(store, &["a", "b", "never"]).await?;
    check(got == [100, 7, 0], || format!("counters after reserve: {got:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 1, || format!("live reservations: {live}"))
}

pub async fn reserve_is_all_or_nothing(store: &dyn BudgetStore) -> Result<(), String> {
    call!(store.reserve(&request("seed", &[("b", 950, Some(1000))], NOW + 60)));
    let outcome = call!(store.reserve(&request("r2", &[("a", 10, Some(1000)), ("b", 100, Some(1000))], NOW + 60)));
    check(outcome == ReserveOutcome::Refused { line: 1 }, || format!("expected Refused on line 1, got {outcome:?}"))?;
    let got = used(store, &["a", "b"]).await?;
    check(got == [0, 950], || format!("a refused reservation moved counters: {got:?}"))?;
    let settle = call!(store.settle("r2", &[]));
    check(settle == SettleOutcome::Unknown, || format!("a refused reservation was stored: {settle:?}"))?;
    let exact = call!(store.reserve(&request("r3", &[("b", 50, Some(1000))], NOW + 60)));
    check(exact == ReserveOutcome::Reserved, || format!("reaching the limit exactly must fit: {exact:?}"))
}

pub async fn reserve_is_idempotent_on_the_request_id(store: &dyn BudgetStore) -> Result<(), String> {
    for _ in 0..3 {
        let outcome = call!(store.reserve(&request("same", &[("a", 100, Some(1000))], NOW + 60)));
        check(outcome == ReserveOutcome::Reserved, || format!("retry not Reserved: {outcome:?}"))?;
    }
    let got = used(store, &["a"]).await?;
    check(got == [100], || format!("a retried reservation counted more than once: {got:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 1, || format!("live reservations: {live}"))
}

pub async fn settle_replaces_the_reservation_once(store: &dyn BudgetStore) -> Result<(), String> {
    call!(store.reserve(&request("s1", &[("a", 100, Some(1000)), ("e", 500, Some(10_000))], NOW + 60)));
    let outcome = call!(store.settle("s1", &[(key("a"), 40), (key("e"), 120)]));
    check(outcome == SettleOutcome::Settled, || format!("expected Settled, got {outcome:?}"))?;
    let got = used(store, &["a", "e"]).await?;
    check(got == [40, 120], || format!("counters after settle: {got:?}"))?;
    let again = call!(store.settle("s1", &[(key("a"), 40)]));
    check(again == SettleOutcome::Unknown, || format!("second settle applied: {again:?}"))?;
    let got = used(store, &["a", "e"]).await?;
    check(got == [40, 120], || format!("a second settle moved counters: {got:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 0, || format!("live reservations after settle: {live}"))
}

pub async fn refund_returns_everything(store: &dyn BudgetStore) -> Result<(), String> {
    call!(store.reserve(&request("f1", &[("a", 600, Some(1000)), ("e", 9, Some(10))], NOW + 60)));
    let outcome = call!(store.settle("f1", &[]));
    check(outcome == SettleOutcome::Settled, || format!("refund: {outcome:?}"))?;
    let got = used(store, &["a", "e"]).await?;
    check(got == [0, 0], || format!("counters after refund: {got:?}"))?;
    let full = call!(store.reserve(&request("f2", &[("a", 1000, Some(1000))], NOW + 60)));
    check(full == ReserveOutcome::Reserved, || format!("the whole budget is usable again: {full:?}"))
}

pub async fn sweep_refunds_expired_reservations_only(store: &dyn BudgetStore) -> Result<(), String> {
    call!(store.reserve(&request("old", &[("a", 300, Some(1000))], NOW - 1)));
    call!(store.reserve(&request("new", &[("a", 200, Some(1000))], NOW + 600)));
    let swept = call!(store.sweep(NOW));
    check(swept == 1, || format!("swept {swept}, expected 1"))?;
    let got = used(store, &["a"]).await?;
    check(got == [200], || format!("counters after sweep: {got:?}"))?;
    let again = call!(store.sweep(NOW));
    check(again == 0, || format!("a second sweep refunded again: {again}"))?;
    let live = call!(store.live_reservations());
    check(live == 1, || format!("live reservations after sweep: {live}"))?;
    // The swept call finishes after all: its real usage is charged, once.
    let late = call!(store.settle("old", &[(key("a"), 50)]));
    check(late == SettleOutcome::ChargedAfterSweep, || format!("late settle: {late:?}"))?;
    let late_again = call!(store.settle("old", &[(key("a"), 50)]));
    check(late_again == SettleOutcome::Unknown, || format!("late settle twice: {late_again:?}"))?;
    let got = used(store, &["a"]).await?;
    check(got == [250], || format!("counters after late settle: {got:?}"))
}

/// 96 concurrent reservations against a cap that fits 10: exactly 10 pass, and after
/// settlement the counter equals the settled usage with no reservation left.
pub async fn concurrent_reservations_never_pass_the_cap(store: Arc<dyn BudgetStore>) -> Result<(), String> {
    let mut tasks = Vec::new();
    for i in 0..96 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("burst-{i}");
            let outcome =
                store.reserve(&request(&id, &[("cap", 100, Some(1000)), ("free", 100, None)], NOW + 60)).await;
            (id, outcome)
        }));
    }
    let mut reserved = Vec::new();
    for task in tasks {
        let (id, outcome) = task.await.map_err(|e| e.to_string())?;
        match outcome.map_err(|e| e.to_string())? {
            ReserveOutcome::Reserved => reserved.push(id),
            ReserveOutcome::Refused { line } => check(line == 0, || format!("refused on line {line}"))?,
        }
    }
    check(reserved.len() == 10, || format!("{} reservations passed a cap that fits 10", reserved.len()))?;
    let got = used(store.as_ref(), &["cap", "free"]).await?;
    check(got == [1000, 1000], || format!("counters after the burst: {got:?}"))?;
    let mut settles = Vec::new();
    for id in reserved {
        let store = store.clone();
        settles.push(tokio::spawn(async move { store.settle(&id, &[(key("cap"), 37), (key("free"), 37)]).await }));
    }
    for settle in settles {
        let outcome = settle.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
        check(outcome == SettleOutcome::Settled, || format!("settle in burst: {outcome:?}"))?;
    }
    let got = used(store.as_ref(), &["cap", "free"]).await?;
    check(got == [370, 370], || format!("ledger after settling the burst: {got:?}"))?;
    let live = store.live_reservations().await.map_err(|e| e.to_string())?;
    check(live == 0, || format!("reservations left: {live}"))
}

/// Runs every check on a fresh store each; returns the failures (empty: conformant).
pub async fn run_all<S, F, Fut>(make: F) -> Vec<String>
where
    S: BudgetStore + 'static,
    F: Fn() -> Fut,
    Fut: Future<Output = S>,
{
    let mut failures = Vec::new();
    let mut note = |name: &str, result: Result<(), String>| {
        if let Err(e) = result {
            failures.push(format!("{name}: {e}"));
        }
    };
    note("reserve_counts_within_the_limit", reserve_counts_within_the_limit(&make().await).await);
    note("reserve_is_all_or_nothing", reserve_is_all_or_nothing(&make().await).await);
    note("reserve_is_idempotent_on_the_request_id", reserve_is_idempotent_on_the_request_id(&make().await).await);
    note("settle_replaces_the_reservation_once", settle_replaces_the_reservation_once(&make().await).await);
    note("refund_returns_everything", refund_returns_everything(&make().await).await);
    note("sweep_refunds_expired_reservations_only", sweep_refunds_expired_reservations_only(&make().await).await);
    let shared: Arc<dyn BudgetStore> = Arc::new(make().await);
    note("concurrent_reservations_never_pass_the_cap", concurrent_reservations_never_pass_the_cap(shared).await);
    failures
}
