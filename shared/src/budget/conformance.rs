//! The conformance suite every `BudgetStore` must pass: atomicity, idempotency,
//! refund, expiry, settle intent, concurrency, per-minute windows, runs, and the
//! forgetting of windows and runs past their retention. Written against the port
//! only, so the DynamoDB adapter runs exactly these checks against the emulator.
//!
//! The checks on a failing settlement drive a real `Ticket` over the store wrapped in
//! [`FailingSettles`], which fails `settle` a given number of times and passes every
//! other call through: the store's own intent and sweep do the rest.
//!
//! Each check gets a fresh store from `make` and returns `Err(reason)` on failure;
//! `run_all` collects the failures so one run reports them all.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use super::period::{Period, unix_now};
use super::plan::{Budget, Kind};
use super::run::{self, Run, RunBudget, RunEnd, RunRef};
use super::ticket::{self, Ticket};
use super::{
    BudgetStore, CounterKey, IntentOutcome, Line, RUN_RETENTION_SECS, Reservation, ReserveOutcome, ReserveRequest,
    SettleOutcome, StoreError, Swept, Unit,
};
use crate::call::Usage;
use crate::config::Price;
use crate::money::MicroEur;

/// The suite's clock: its reservations expire around it, and its sweeps name it.
pub const NOW: u64 = 1_795_967_070;

fn key(name: &str) -> CounterKey {
    CounterKey(format!("conformance/{name}").into())
}

fn request(id: &str, lines: &[(&str, u64, Option<u64>)], expires_at: u64) -> ReserveRequest {
    ReserveRequest {
        request_id: id.to_owned(),
        lines: lines.iter().map(|(k, amount, limit)| Line { key: key(k), amount: *amount, limit: *limit }).collect(),
        expires_at,
    }
}

/// The reservation a ticket carries to its settlement: `(counter, amount)` lines.
fn held(id: &str, lines: &[(&str, u64)]) -> Reservation {
    Reservation { request_id: id.to_owned(), lines: lines.iter().map(|(k, amount)| (key(k), *amount)).collect() }
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
    let settle = call!(store.settle(&held("r2", &[("a", 10), ("b", 100)]), &[]));
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
    let outcome = call!(store.settle(&held("s1", &[("a", 100), ("e", 500)]), &[(key("a"), 40), (key("e"), 120)]));
    check(outcome == SettleOutcome::Settled, || format!("expected Settled, got {outcome:?}"))?;
    let got = used(store, &["a", "e"]).await?;
    check(got == [40, 120], || format!("counters after settle: {got:?}"))?;
    let again = call!(store.settle(&held("s1", &[("a", 100), ("e", 500)]), &[(key("a"), 40)]));
    check(again == SettleOutcome::Unknown, || format!("second settle applied: {again:?}"))?;
    let got = used(store, &["a", "e"]).await?;
    check(got == [40, 120], || format!("a second settle moved counters: {got:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 0, || format!("live reservations after settle: {live}"))
}

pub async fn refund_returns_everything(store: &dyn BudgetStore) -> Result<(), String> {
    call!(store.reserve(&request("f1", &[("a", 600, Some(1000)), ("e", 9, Some(10))], NOW + 60)));
    let outcome = call!(store.settle(&held("f1", &[("a", 600), ("e", 9)]), &[]));
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
    check(swept == refunded(1), || format!("swept {swept:?}, expected one refund"))?;
    let got = used(store, &["a"]).await?;
    check(got == [200], || format!("counters after sweep: {got:?}"))?;
    let again = call!(store.sweep(NOW));
    check(again == Swept::default(), || format!("a second sweep closed more: {again:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 1, || format!("live reservations after sweep: {live}"))?;
    // The swept call finishes after all: its real usage is charged, once.
    let late = call!(store.settle(&held("old", &[("a", 300)]), &[(key("a"), 50)]));
    check(late == SettleOutcome::ChargedAfterSweep, || format!("late settle: {late:?}"))?;
    let late_again = call!(store.settle(&held("old", &[("a", 300)]), &[(key("a"), 50)]));
    check(late_again == SettleOutcome::Unknown, || format!("late settle twice: {late_again:?}"))?;
    let got = used(store, &["a"]).await?;
    check(got == [250], || format!("counters after late settle: {got:?}"))
}

fn refunded(n: usize) -> Swept {
    Swept { refunded: n, ..Swept::default() }
}

fn charged(n: usize) -> Swept {
    Swept { charged: n, ..Swept::default() }
}

/// An intent on an expired reservation is charged by the sweeper, never refunded; one
/// on a reservation still running waits for its expiry; either closes it for good.
pub async fn sweep_charges_a_settle_intent_instead_of_refunding(store: &dyn BudgetStore) -> Result<(), String> {
    let nobody = call!(store.record_intent("nobody", &[(key("a"), 1)]));
    check(nobody == IntentOutcome::Unknown, || format!("intent without a reservation: {nobody:?}"))?;
    call!(store.reserve(&request("i1", &[("a", 100, Some(1000)), ("e", 500, None)], NOW - 1)));
    call!(store.reserve(&request("i2", &[("a", 200, Some(1000))], NOW + 600)));
    let recorded = call!(store.record_intent("i1", &[(key("a"), 40), (key("e"), 120)]));
    check(recorded == IntentOutcome::Recorded, || format!("intent: {recorded:?}"))?;
    let recorded = call!(store.record_intent("i2", &[(key("a"), 50)]));
    check(recorded == IntentOutcome::Recorded, || format!("intent on a running reservation: {recorded:?}"))?;
    let got = used(store, &["a", "e", "never"]).await?;
    check(got == [300, 500, 0], || format!("an intent moved counters: {got:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 2, || format!("live reservations with intents: {live}"))?;

    let swept = call!(store.sweep(NOW));
    check(swept == charged(1), || format!("sweep: {swept:?}, expected one charge"))?;
    let got = used(store, &["a", "e"]).await?;
    check(got == [240, 120], || format!("counters after charging the intent: {got:?}"))?;
    let again = call!(store.sweep(NOW));
    check(again == Swept::default(), || format!("a second sweep closed more: {again:?}"))?;
    let late = call!(store.settle(&held("i1", &[("a", 100), ("e", 500)]), &[(key("a"), 40), (key("e"), 120)]));
    check(late == SettleOutcome::Unknown, || format!("settle after the intent was charged: {late:?}"))?;
    let late = call!(store.record_intent("i1", &[(key("a"), 40)]));
    check(late == IntentOutcome::Unknown, || format!("intent after the intent was charged: {late:?}"))?;

    let swept = call!(store.sweep(NOW + 601));
    check(swept == charged(1), || format!("sweep after the second expiry: {swept:?}"))?;
    let got = used(store, &["a", "e"]).await?;
    check(got == [90, 120], || format!("counters after both intents: {got:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 0, || format!("live reservations left: {live}"))
}

/// A renewal moves a live reservation's expiry and leaves its usage so far for the
/// sweeper; it never revives a swept one nor reopens a closed one.
pub async fn renew_moves_the_expiry_of_a_live_reservation_only(store: &dyn BudgetStore) -> Result<(), String> {
    let nobody = call!(store.renew("nobody", &[(key("a"), 1)], NOW + 60));
    check(nobody == IntentOutcome::Unknown, || format!("renewing nothing: {nobody:?}"))?;
    call!(store.reserve(&request("r1", &[("a", 100, Some(1000))], NOW - 1)));
    call!(store.reserve(&request("r2", &[("a", 200, Some(1000))], NOW - 1)));
    let renewed = call!(store.renew("r1", &[(key("a"), 30)], NOW + 60));
    check(renewed == IntentOutcome::Recorded, || format!("renew: {renewed:?}"))?;
    // Renewing again replaces the usage, as an intent does.
    call!(store.renew("r1", &[(key("a"), 40)], NOW + 60));
    let got = used(store, &["a"]).await?;
    check(got == [300], || format!("a renewal moved counters: {got:?}"))?;
    let swept = call!(store.sweep(NOW));
    check(swept == refunded(1), || format!("sweep before the renewed expiry: {swept:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 1, || format!("live reservations after the sweep: {live}"))?;
    let late = call!(store.renew("r2", &[(key("a"), 10)], NOW + 60));
    check(late == IntentOutcome::Unknown, || format!("renewing a swept reservation: {late:?}"))?;
    let swept = call!(store.sweep(NOW + 61));
    check(swept == charged(1), || format!("sweep past the renewed expiry: {swept:?}"))?;
    let got = used(store, &["a"]).await?;
    check(got == [40], || format!("counters after charging the renewed usage: {got:?}"))?;
    let closed = call!(store.renew("r1", &[(key("a"), 50)], NOW + 120));
    check(closed == IntentOutcome::Unknown, || format!("renewing a closed reservation: {closed:?}"))
}

/// The real settlement arrives after all (its first answer was lost): it replaces the
/// reservation once, and the sweeper finds nothing to charge.
pub async fn a_settle_after_its_intent_charges_once(store: &dyn BudgetStore) -> Result<(), String> {
    call!(store.reserve(&request("l1", &[("a", 100, Some(1000)), ("e", 500, None)], NOW - 1)));
    call!(store.record_intent("l1", &[(key("a"), 30), (key("e"), 90)]));
    // Recording again replaces the amounts, never adds to them.
    call!(store.record_intent("l1", &[(key("a"), 40), (key("e"), 120)]));
    let settled = call!(store.settle(&held("l1", &[("a", 100), ("e", 500)]), &[(key("a"), 40), (key("e"), 120)]));
    check(settled == SettleOutcome::Settled, || format!("settle after intent: {settled:?}"))?;
    let got = used(store, &["a", "e"]).await?;
    check(got == [40, 120], || format!("counters after the settle: {got:?}"))?;
    let swept = call!(store.sweep(NOW));
    check(swept == Swept::default(), || format!("sweep after the settle: {swept:?}"))?;
    let got = used(store, &["a", "e"]).await?;
    check(got == [40, 120], || format!("counters after the sweep: {got:?}"))?;
    let again = call!(store.settle(&held("l1", &[("a", 100), ("e", 500)]), &[(key("a"), 40), (key("e"), 120)]));
    check(again == SettleOutcome::Unknown, || format!("second settle: {again:?}"))
}

/// A call that outlived its reservation (refunded by the sweeper) and whose late
/// settlement could not be written either: the next sweep charges the intent in full.
pub async fn an_intent_on_a_swept_reservation_is_charged_by_the_next_sweep(
    store: &dyn BudgetStore,
) -> Result<(), String> {
    call!(store.reserve(&request("s1", &[("a", 100, Some(1000))], NOW - 1)));
    let swept = call!(store.sweep(NOW));
    check(swept == refunded(1), || format!("first sweep: {swept:?}"))?;
    let recorded = call!(store.record_intent("s1", &[(key("a"), 50)]));
    check(recorded == IntentOutcome::Recorded, || format!("intent on a swept reservation: {recorded:?}"))?;
    let swept = call!(store.sweep(NOW + 1));
    check(swept == charged(1), || format!("second sweep: {swept:?}"))?;
    let got = used(store, &["a"]).await?;
    check(got == [50], || format!("counters after charging: {got:?}"))?;
    let late = call!(store.settle(&held("s1", &[("a", 100)]), &[(key("a"), 50)]));
    check(late == SettleOutcome::Unknown, || format!("settle after the charge: {late:?}"))?;
    // Even past the retention of swept reservations, nothing moves again.
    let swept = call!(store.sweep(NOW + 2 * super::ledger::SWEPT_RETENTION_SECS));
    check(swept == Swept::default(), || format!("sweep past retention: {swept:?}"))?;
    let got = used(store, &["a"]).await?;
    check(got == [50], || format!("counters at the end: {got:?}"))
}

/// Every way a call can end, side by side on one counter: the ledger equals the sum of
/// the usage settled, whichever of settle, refund, intent and sweep wrote it.
pub async fn the_ledger_equals_the_usage_whatever_the_path(store: &dyn BudgetStore) -> Result<(), String> {
    let reserve = |id: &'static str, expires_at: u64| async move {
        store.reserve(&request(id, &[("a", 100, Some(10_000))], expires_at)).await.map_err(|e| format!("{id}: {e}"))
    };
    reserve("settled", NOW + 600).await?;
    reserve("refunded", NOW + 600).await?;
    reserve("vanished", NOW - 1).await?;
    reserve("intent", NOW - 1).await?;
    reserve("intent-then-settled", NOW - 1).await?;
    reserve("swept-then-settled", NOW - 1).await?;
    reserve("swept-then-intent", NOW - 1).await?;
    call!(store.settle(&held("settled", &[("a", 100)]), &[(key("a"), 11)]));
    call!(store.settle(&held("refunded", &[("a", 100)]), &[]));
    call!(store.record_intent("intent", &[(key("a"), 13)]));
    call!(store.record_intent("intent-then-settled", &[(key("a"), 17)]));
    call!(store.settle(&held("intent-then-settled", &[("a", 100)]), &[(key("a"), 17)]));
    let swept = call!(store.sweep(NOW));
    check(swept == Swept { refunded: 3, charged: 1, leases: 0 }, || format!("first sweep: {swept:?}"))?;
    call!(store.settle(&held("swept-then-settled", &[("a", 100)]), &[(key("a"), 19)]));
    call!(store.record_intent("swept-then-intent", &[(key("a"), 23)]));
    let swept = call!(store.sweep(NOW + 1));
    check(swept == charged(1), || format!("second sweep: {swept:?}"))?;
    let got = used(store, &["a"]).await?;
    check(got == [11 + 13 + 17 + 19 + 23], || format!("ledger {got:?}, usage settled 83"))?;
    let live = call!(store.live_reservations());
    check(live == 0, || format!("live reservations left: {live}"))
}

/// Settlements and sweeps race over expired reservations that carry intents: each is
/// charged exactly once, by whichever gets there first.
pub async fn settle_and_sweep_charge_an_intent_exactly_once(store: Arc<dyn BudgetStore>) -> Result<(), String> {
    const CALLS: u64 = 16;
    for i in 0..CALLS {
        let id = format!("race-{i}");
        call!(store.reserve(&request(&id, &[("a", 100, Some(10_000))], NOW - 1)));
        call!(store.record_intent(&id, &[(key("a"), 10)]));
    }
    let mut settles = Vec::new();
    let mut sweeps = Vec::new();
    for i in 0..CALLS {
        let settling = store.clone();
        settles.push(tokio::spawn(async move {
            settling.settle(&held(&format!("race-{i}"), &[("a", 100)]), &[(key("a"), 10)]).await
        }));
        if i % 4 == 0 {
            let store = store.clone();
            sweeps.push(tokio::spawn(async move { store.sweep(NOW).await }));
        }
    }
    let (mut settled, mut charged) = (0, 0);
    for task in settles {
        let outcome = task.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
        settled += usize::from(outcome == SettleOutcome::Settled);
    }
    for task in sweeps {
        let swept = task.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
        check(swept.refunded == 0, || format!("a sweep refunded a reservation with an intent: {swept:?}"))?;
        charged += swept.charged;
    }
    check(settled + charged == CALLS as usize, || format!("{settled} settled + {charged} charged for {CALLS} calls"))?;
    let got = used(store.as_ref(), &["a"]).await?;
    check(got == [10 * CALLS], || format!("ledger after the race: {got:?}"))?;
    let live = store.live_reservations().await.map_err(|e| e.to_string())?;
    check(live == 0, || format!("reservations left: {live}"))
}

/// Intents recorded while sweeps run over the same expired reservations: whether an
/// intent lands before the refund or after it, every call ends charged its usage once.
pub async fn intents_recorded_during_sweeps_are_all_charged(store: Arc<dyn BudgetStore>) -> Result<(), String> {
    const CALLS: u64 = 12;
    for i in 0..CALLS {
        call!(store.reserve(&request(&format!("during-{i}"), &[("a", 100, Some(10_000))], NOW - 1)));
    }
    let mut intents = Vec::new();
    let mut sweeps = Vec::new();
    for i in 0..CALLS {
        let recording = store.clone();
        intents.push(tokio::spawn(
            async move { recording.record_intent(&format!("during-{i}"), &[(key("a"), 10)]).await },
        ));
        if i % 4 == 0 {
            let store = store.clone();
            sweeps.push(tokio::spawn(async move { store.sweep(NOW).await }));
        }
    }
    for task in intents {
        let outcome = task.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
        check(outcome == IntentOutcome::Recorded, || format!("intent during sweeps: {outcome:?}"))?;
    }
    for task in sweeps {
        task.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    }
    // Past the retention of swept reservations too: an intent is never dropped with them.
    call!(store.sweep(NOW + 1));
    call!(store.sweep(NOW + 2 * super::ledger::SWEPT_RETENTION_SECS));
    let got = used(store.as_ref(), &["a"]).await?;
    check(got == [10 * CALLS], || format!("ledger after intents and sweeps: {got:?}"))?;
    for i in 0..CALLS {
        let late = call!(store.settle(&held(&format!("during-{i}"), &[("a", 100)]), &[(key("a"), 10)]));
        check(late == SettleOutcome::Unknown, || format!("during-{i} still open after the sweeps: {late:?}"))?;
    }
    Ok(())
}

/// A ticket dropped while its settlement is written (its call cancelled: the client
/// left as the store was asked) settles all the same, on the same amounts, once:
/// whether the write it dropped got in or not.
pub async fn a_ticket_dropped_while_it_settles_is_settled_once(store: Arc<dyn BudgetStore>) -> Result<(), String> {
    let cuts =
        [("cut-before", Slowed::SettleBeforeWrite, [40, 140]), ("cut-after", Slowed::SettleAfterWrite, [80, 280])];
    for (id, slowed, expected) in cuts {
        let slow: Arc<dyn BudgetStore> = Arc::new(Slow::new(store.clone(), slowed));
        let settling = ticket(slow, id).await?.settle(USAGE, PRICE);
        let cut = tokio::time::timeout(Slow::PAUSE / 4, settling).await;
        check(cut.is_err(), || format!("{id}: the settlement was not cut"))?;
        settled(store.as_ref()).await?;
        let got = used(store.as_ref(), &["t", "e"]).await?;
        check(got == expected, || format!("{id}: counters {got:?}, expected {expected:?}"))?;
    }
    Ok(())
}

/// A ticket dropped while its refund is written is refunded all the same.
pub async fn a_ticket_dropped_while_it_refunds_is_refunded(store: Arc<dyn BudgetStore>) -> Result<(), String> {
    let slow: Arc<dyn BudgetStore> = Arc::new(Slow::new(store.clone(), Slowed::SettleBeforeWrite));
    let refunding = ticket(slow, "cut-refund").await?.refund();
    let cut = tokio::time::timeout(Slow::PAUSE / 4, refunding).await;
    check(cut.is_err(), || "the refund was not cut".to_owned())?;
    settled(store.as_ref()).await?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [0, 0], || format!("counters after the refund: {got:?}"))
}

/// Waits (five seconds at most) for no reservation to be live.
async fn settled(store: &dyn BudgetStore) -> Result<(), String> {
    for _ in 0..500 {
        if call!(store.live_reservations()) == 0 {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    Err("a reservation is still live: what a dropped call owed the store was never written".to_owned())
}

/// Which of a store's writes [`Slow`] makes slow, and where the pause falls.
#[derive(Clone, Copy)]
pub enum Slowed {
    /// Settlements (refunds included), paused before the write.
    SettleBeforeWrite,
    /// Settlements, paused after the write (the write in, its answer late).
    SettleAfterWrite,
    /// Reservations, paused after the write.
    ReserveAfterWrite,
}

/// Wraps a store and makes one kind of its writes take [`Slow::PAUSE`]; every other
/// call passes through.
pub struct Slow {
    inner: Arc<dyn BudgetStore>,
    slowed: Slowed,
}

impl Slow {
    pub const PAUSE: std::time::Duration = std::time::Duration::from_millis(200);

    pub fn new(inner: Arc<dyn BudgetStore>, slowed: Slowed) -> Self {
        Slow { inner, slowed }
    }
}

#[async_trait::async_trait]
impl BudgetStore for Slow {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        let outcome = self.inner.reserve(request).await;
        if let Slowed::ReserveAfterWrite = self.slowed {
            tokio::time::sleep(Self::PAUSE).await;
        }
        outcome
    }
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        if let Slowed::SettleBeforeWrite = self.slowed {
            tokio::time::sleep(Self::PAUSE).await;
        }
        let outcome = self.inner.settle(reservation, actual).await;
        if let Slowed::SettleAfterWrite = self.slowed {
            tokio::time::sleep(Self::PAUSE).await;
        }
        outcome
    }
    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        self.inner.record_intent(request_id, actual).await
    }
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        self.inner.renew(request_id, actual, expires_at).await
    }
    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        self.inner.sweep(now).await
    }
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        self.inner.used(keys).await
    }
    async fn live_reservations(&self) -> Result<usize, StoreError> {
        self.inner.live_reservations().await
    }
    async fn create_run(&self, run: &super::run::Run) -> Result<bool, StoreError> {
        self.inner.create_run(run).await
    }
    async fn run(&self, id: &str) -> Result<Option<super::run::Run>, StoreError> {
        self.inner.run(id).await
    }
    async fn end_run(&self, id: &str, at: u64) -> Result<super::run::RunEnd, StoreError> {
        self.inner.end_run(id, at).await
    }
}

/// A reservation whose caller is dropped after the store wrote it and before its
/// answer came (a call cancelled as it was admitted) is refunded, not left held until
/// its expiry; so is one the store failed to answer.
pub async fn a_reservation_dropped_before_its_answer_is_refunded(store: Arc<dyn BudgetStore>) -> Result<(), String> {
    let slow: Arc<dyn BudgetStore> = Arc::new(Slow::new(store.clone(), Slowed::ReserveAfterWrite));
    let asked = request("cut-reserve", &[("t", 100, Some(1000)), ("e", 500, Some(10_000))], NOW + 60);
    let reserving = async {
        let unanswered = ticket::Unanswered::new(&slow, &asked);
        let outcome = slow.reserve(&asked).await;
        unanswered.answered(&outcome);
        outcome
    };
    let cut = tokio::time::timeout(Slow::PAUSE / 4, reserving).await;
    check(cut.is_err(), || "the reservation was not cut".to_owned())?;
    settled(store.as_ref()).await?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [0, 0], || format!("counters after the dropped reservation: {got:?}"))
}

/// Wraps a store and fails its first `failures` settlements (refunds included) with a
/// backend error before they reach it; every other call passes through.
pub struct FailingSettles {
    inner: Arc<dyn BudgetStore>,
    failures: AtomicU32,
}

impl FailingSettles {
    pub fn new(inner: Arc<dyn BudgetStore>, failures: u32) -> Self {
        FailingSettles { inner, failures: AtomicU32::new(failures) }
    }
}

#[async_trait::async_trait]
impl BudgetStore for FailingSettles {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        self.inner.reserve(request).await
    }
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        let request_id = &reservation.request_id;
        let failing = self.failures.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if failing {
            return Err(StoreError::Backend(format!("settle {request_id}: failed on purpose")));
        }
        self.inner.settle(reservation, actual).await
    }
    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        self.inner.record_intent(request_id, actual).await
    }
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        self.inner.renew(request_id, actual, expires_at).await
    }
    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        self.inner.sweep(now).await
    }
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        self.inner.used(keys).await
    }
    async fn live_reservations(&self) -> Result<usize, StoreError> {
        self.inner.live_reservations().await
    }
    async fn create_run(&self, run: &super::run::Run) -> Result<bool, StoreError> {
        self.inner.create_run(run).await
    }
    async fn run(&self, id: &str) -> Result<Option<super::run::Run>, StoreError> {
        self.inner.run(id).await
    }
    async fn end_run(&self, id: &str, at: u64) -> Result<super::run::RunEnd, StoreError> {
        self.inner.end_run(id, at).await
    }
}

/// A ticket over counters `t` (tokens) and `e` (micro-euros), reserved 100 and 500.
/// Its call uses 30 + 10 tokens at 2 and 8 €/Mtok: 40 tokens, 140 µ€.
async fn ticket(store: Arc<dyn BudgetStore>, id: &str) -> Result<Ticket, String> {
    let reserved = request(id, &[("t", 100, Some(1000)), ("e", 500, Some(10_000))], NOW + 60);
    call!(store.reserve(&reserved));
    let budget = |name: &str, unit| Budget {
        name: name.to_owned(),
        key: key(name),
        unit,
        limit: None,
        resets_at: 0,
        kind: Kind::Period,
    };
    Ok(Ticket::new(
        store,
        reserved.reservation(),
        Arc::from([budget("t", Unit::Tokens), budget("e", Unit::MicroEur)]),
        NOW,
    ))
}

const USAGE: Usage = Usage::new(30, 10);
const PRICE: Price = Price {
    input_per_mtok: MicroEur(2_000_000),
    output_per_mtok: MicroEur(8_000_000),
    cached_input_per_mtok: None,
    cache_write_per_mtok: None,
};

/// The ticket carries its reserved lines so that a settlement needs no read; when the
/// sweeper refunded the reservation while the call ran, the store's record decides:
/// the usage alone is charged (never `usage - reserved` a second time), once.
pub async fn a_settle_whose_reservation_was_swept_meanwhile_charges_the_usage_alone(
    store: Arc<dyn BudgetStore>,
) -> Result<(), String> {
    let slow = ticket(store.clone(), "outlived").await?;
    call!(store.reserve(&request("bystander", &[("t", 7, Some(1000))], NOW + 600)));
    let swept = call!(store.sweep(NOW + 61));
    check(swept == refunded(1), || format!("sweep during the call: {swept:?}, expected one refund"))?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [7, 0], || format!("counters after the sweep: {got:?}"))?;
    let cost = slow.settle(USAGE, PRICE).await;
    check(cost == MicroEur(140), || format!("cost {cost:?}"))?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [7 + 40, 140], || format!("counters after the late settle: {got:?}, expected [47, 140]"))?;
    let again = call!(store.settle(&held("outlived", &[("t", 100), ("e", 500)]), &[(key("t"), 40), (key("e"), 140)]));
    check(again == SettleOutcome::Unknown, || format!("a second late settle: {again:?}"))?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [47, 140], || format!("counters after a second late settle: {got:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 1, || format!("live reservations: {live}, expected the bystander only"))
}

/// Lines a caller claims but did not reserve are never trusted: the stored reservation
/// is what a settlement replaces.
pub async fn a_settle_settles_the_stored_lines_not_the_claimed_ones(store: &dyn BudgetStore) -> Result<(), String> {
    call!(store.reserve(&request("claimed", &[("a", 100, Some(1000))], NOW + 60)));
    let outcome = call!(store.settle(&held("claimed", &[("a", 60), ("b", 5)]), &[(key("a"), 40)]));
    check(outcome == SettleOutcome::Settled, || format!("settle: {outcome:?}"))?;
    let got = used(store, &["a", "b"]).await?;
    check(got == [40, 0], || format!("counters after the settle: {got:?}, expected [40, 0]"))
}

/// A settlement that fails less often than the ticket tries is simply written.
pub async fn a_ticket_retries_a_failed_settle(store: Arc<dyn BudgetStore>) -> Result<(), String> {
    let flaky: Arc<dyn BudgetStore> = Arc::new(FailingSettles::new(store.clone(), ticket::ATTEMPTS - 1));
    let cost = ticket(flaky, "retried").await?.settle(USAGE, PRICE).await;
    check(cost == MicroEur(140), || format!("cost {cost:?}"))?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [40, 140], || format!("counters after the retried settle: {got:?}"))?;
    let live = call!(store.live_reservations());
    check(live == 0, || format!("live reservations: {live}"))
}

/// A settlement that cannot be written at all: the reservation keeps its intent, and
/// the sweeper charges the actual usage at expiry instead of refunding.
pub async fn a_ticket_whose_settle_cannot_be_written_is_charged_by_the_sweeper(
    store: Arc<dyn BudgetStore>,
) -> Result<(), String> {
    let down: Arc<dyn BudgetStore> = Arc::new(FailingSettles::new(store.clone(), u32::MAX));
    let cost = ticket(down, "unwritten").await?.settle(USAGE, PRICE).await;
    check(cost == MicroEur(140), || format!("cost {cost:?}"))?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [100, 500], || format!("counters before expiry: {got:?}"))?;
    let swept = call!(store.sweep(NOW));
    check(swept == Swept::default(), || format!("sweep before expiry: {swept:?}"))?;
    let swept = call!(store.sweep(NOW + 61));
    check(swept == charged(1), || format!("sweep after expiry: {swept:?}, expected one charge"))?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [40, 140], || format!("counters after the sweep: {got:?}, expected the usage [40, 140]"))?;
    let late = call!(store.settle(&held("unwritten", &[("t", 100), ("e", 500)]), &[(key("t"), 40), (key("e"), 140)]));
    check(late == SettleOutcome::Unknown, || format!("late settle: {late:?}"))?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [40, 140], || format!("counters after a late settle: {got:?}"))
}

/// A refund that cannot be written records nothing: the sweeper refunds at expiry.
pub async fn a_ticket_whose_refund_cannot_be_written_is_refunded_by_the_sweeper(
    store: Arc<dyn BudgetStore>,
) -> Result<(), String> {
    let down: Arc<dyn BudgetStore> = Arc::new(FailingSettles::new(store.clone(), u32::MAX));
    ticket(down, "unrefunded").await?.refund().await;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [100, 500], || format!("counters before expiry: {got:?}"))?;
    let swept = call!(store.sweep(NOW + 61));
    check(swept == refunded(1), || format!("sweep after expiry: {swept:?}, expected one refund"))?;
    let got = used(store.as_ref(), &["t", "e"]).await?;
    check(got == [0, 0], || format!("counters after the sweep: {got:?}"))
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
        settles.push(tokio::spawn(async move {
            store.settle(&held(&id, &[("cap", 100), ("free", 100)]), &[(key("cap"), 37), (key("free"), 37)]).await
        }));
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

/// The tenant of the suite's windows and runs.
const TENANT: &str = "conformance";

/// `tasks` concurrent reservations of `lines` each (request ids `<name>-<i>`): the ids
/// of those admitted. Any other outcome than Reserved or a refusal on one of the lines
/// `refused_on` is an error.
async fn burst(
    store: &Arc<dyn BudgetStore>,
    name: &str,
    lines: Vec<Line>,
    tasks: usize,
    refused_on: &[usize],
) -> Result<Vec<String>, String> {
    let mut running = Vec::new();
    for i in 0..tasks {
        let (store, lines) = (store.clone(), lines.clone());
        let request_id = format!("{name}-{i}");
        running.push(tokio::spawn(async move {
            let request = ReserveRequest { request_id, lines, expires_at: NOW + 60 };
            let outcome = store.reserve(&request).await;
            (request.request_id, outcome)
        }));
    }
    let mut admitted = Vec::new();
    for task in running {
        let (id, outcome) = task.await.map_err(|e| e.to_string())?;
        match outcome.map_err(|e| e.to_string())? {
            ReserveOutcome::Reserved => admitted.push(id),
            ReserveOutcome::Refused { line } => {
                check(refused_on.contains(&line), || format!("{name}: refused on line {line}"))?
            }
        }
    }
    Ok(admitted)
}

/// A per-minute window (SPEC §14) is a counter like any other: 40 concurrent calls on a
/// window of 5 requests admit exactly 5, and on one of 1,000 tokens, exactly the 10
/// that fit. The windows are the current minute's (by the clock, not [`NOW`]): a
/// store may forget a window an hour past its minute, and DynamoDB does by the clock.
pub async fn concurrent_window_reservations_never_pass_the_limit(store: Arc<dyn BudgetStore>) -> Result<(), String> {
    let now = unix_now();
    let free = Line { key: key("free"), amount: 1, limit: None };
    let requests = CounterKey::window(TENANT, None, Unit::Requests, now);
    let lines = vec![Line { key: requests.clone(), amount: 1, limit: Some(5) }, free.clone()];
    let admitted = burst(&store, "rpm", lines, 40, &[0]).await?;
    check(admitted.len() == 5, || format!("{} calls passed a window of 5 requests", admitted.len()))?;
    let tokens = CounterKey::window(TENANT, Some("bot"), Unit::Tokens, now);
    let lines = vec![Line { key: tokens.clone(), amount: 100, limit: Some(1000) }, free];
    let admitted = burst(&store, "tpm", lines, 40, &[0]).await?;
    check(admitted.len() == 10, || format!("{} calls of 100 passed a window of 1000 tokens", admitted.len()))?;
    let got = call!(store.used(&[requests, tokens, key("free")]));
    check(got == [5, 1000, 15], || format!("counters after the bursts: {got:?}, expected [5, 1000, 15]"))
}

/// A run of the suite's tenant, for its agent `bot`, expiring at `expires_at`: a child
/// of `parent` if given.
fn a_run(tokens: u64, parent: Option<&Run>, expires_at: u64) -> Run {
    Run {
        this: RunRef { id: run::new_id(), budget: RunBudget { tokens: Some(tokens), eur: None }, expires_at },
        tenant: TENANT.to_owned(),
        agent: Some("bot".to_owned()),
        label: Some("conformance".to_owned()),
        ancestors: parent.map(|p| p.chain().cloned().collect()).unwrap_or_default(),
        created_at: NOW,
        ended_at: None,
        children: Vec::new(),
    }
}

fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

/// Runs (SPEC §15) as records: stored once under their id, a child named among its
/// parent's children, never under an ended or unknown parent; ending a run ends its
/// descendants, once.
pub async fn runs_are_created_read_and_ended_with_their_descendants(store: &dyn BudgetStore) -> Result<(), String> {
    let parent = a_run(1000, None, NOW + 3600);
    let created = call!(store.create_run(&parent));
    check(created, || "a new run was not created".to_owned())?;
    let read = call!(store.run(parent.id()));
    check(read.as_ref() == Some(&parent), || format!("read back {read:?}, expected {parent:?}"))?;
    let again = call!(store.create_run(&parent));
    check(!again, || "a run id was taken twice".to_owned())?;

    let child = a_run(300, Some(&parent), NOW + 1800);
    let created = call!(store.create_run(&child));
    check(created, || "a child of an active run was not created".to_owned())?;
    let read = call!(store.run(child.id()));
    check(read.as_ref() == Some(&child), || format!("child read back {read:?}, expected {child:?}"))?;
    let read = call!(store.run(parent.id()));
    let children = read.map(|p| p.children).unwrap_or_default();
    check(children == [child.id().to_owned()], || format!("the parent's children: {children:?}"))?;
    let orphan = a_run(100, Some(&a_run(100, None, NOW + 3600)), NOW + 3600);
    let created = call!(store.create_run(&orphan));
    check(!created, || "a child of a run never stored was created".to_owned())?;
    let none = call!(store.run(orphan.id()));
    check(none.is_none(), || format!("a refused run was stored: {none:?}"))?;

    let ended = call!(store.end_run(parent.id(), NOW + 10));
    let expected = RunEnd::Ended(sorted(vec![parent.id().to_owned(), child.id().to_owned()]));
    let ended = match ended {
        RunEnd::Ended(ids) => RunEnd::Ended(sorted(ids)),
        unknown => unknown,
    };
    check(ended == expected, || format!("ending the parent: {ended:?}, expected {expected:?}"))?;
    for run in [&parent, &child] {
        let read = call!(store.run(run.id()));
        let at = read.as_ref().and_then(|r| r.ended_at);
        check(at == Some(NOW + 10), || format!("{} after the end: {read:?}", run.id()))?;
    }
    for late_parent in [&parent, &child] {
        let late = a_run(100, Some(late_parent), NOW + 600);
        let created = call!(store.create_run(&late));
        check(!created, || format!("a child of the ended {} was created", late_parent.id()))?;
        let none = call!(store.run(late.id()));
        check(none.is_none(), || format!("a refused child was stored: {none:?}"))?;
    }
    let again = call!(store.end_run(parent.id(), NOW + 20));
    check(again == RunEnd::Ended(Vec::new()), || format!("ending it again: {again:?}"))?;
    let read = call!(store.run(child.id()));
    check(read.and_then(|r| r.ended_at) == Some(NOW + 10), || "a second end moved the first's time".to_owned())?;
    let unknown = call!(store.end_run(&run::new_id(), NOW));
    check(unknown == RunEnd::Unknown, || format!("ending an unknown run: {unknown:?}"))
}

/// A call in a child run reserves on the child's counter and its parent's in one
/// reservation: under a concurrent burst of calls in the child and in the parent,
/// neither budget is passed, and the parent's is spent to the end.
pub async fn concurrent_run_reservations_never_pass_the_run_or_its_ancestors(
    store: Arc<dyn BudgetStore>,
) -> Result<(), String> {
    let expires_at = unix_now() + 3600;
    let parent = a_run(500, None, expires_at);
    let child = a_run(300, Some(&parent), expires_at);
    for run in [&parent, &child] {
        let created = call!(store.create_run(run));
        check(created, || format!("run {} not created", run.id()))?;
    }
    let line = |run: &RunRef| Line { key: run.counter(TENANT, Unit::Tokens), amount: 50, limit: run.budget.tokens };
    let in_child: Vec<Line> = child.chain().map(line).collect();
    let in_parent: Vec<Line> = parent.chain().map(line).collect();
    let (store_a, store_b) = (store.clone(), store.clone());
    let (child_calls, parent_calls) = tokio::join!(
        burst(&store_a, "in-child", in_child, 20, &[0, 1]),
        burst(&store_b, "in-parent", in_parent, 20, &[0])
    );
    let (child_calls, parent_calls) = (child_calls?.len() as u64, parent_calls?.len() as u64);
    let counters = [child.this.counter(TENANT, Unit::Tokens), parent.this.counter(TENANT, Unit::Tokens)];
    let got = call!(store.used(&counters));
    check(got == [50 * child_calls, 500], || {
        format!("run counters {got:?} after {child_calls} calls in the child, {parent_calls} in the parent")
    })?;
    check(child_calls + parent_calls == 10, || format!("{child_calls} + {parent_calls} calls fit a budget of 10"))?;
    check(child_calls <= 6, || format!("{child_calls} calls of 50 fit a child budget of 300"))
}

/// A run takes at most [`run::MAX_CHILDREN`] children (its record names them all):
/// one more is refused, nothing written, whoever checked the count before.
pub async fn a_run_takes_at_most_its_most_children(store: &dyn BudgetStore) -> Result<(), String> {
    let parent = a_run(1000, None, NOW + 3600);
    let created = call!(store.create_run(&parent));
    check(created, || "a new run was not created".to_owned())?;
    for n in 0..run::MAX_CHILDREN {
        let created = call!(store.create_run(&a_run(10, Some(&parent), NOW + 600)));
        check(created, || format!("child {n} of {} was refused", run::MAX_CHILDREN))?;
    }
    let one_more = a_run(10, Some(&parent), NOW + 600);
    let created = call!(store.create_run(&one_more));
    check(!created, || format!("child {} was created", run::MAX_CHILDREN + 1))?;
    let none = call!(store.run(one_more.id()));
    check(none.is_none(), || format!("a refused child was stored: {none:?}"))?;
    let read = call!(store.run(parent.id()));
    let children = read.map_or(0, |p| p.children.len());
    check(children == run::MAX_CHILDREN, || format!("the parent names {children} children"))
}

/// A sweep forgets a window's counter an hour past its minute and a run's a day past
/// the run's expiry ([`CounterKey::forget_at`]), and keeps a day's budget counter,
/// whatever its age: a window of two hours ago reads 0 again, the budget what was
/// settled on it.
pub async fn a_sweep_forgets_old_windows_and_runs_and_keeps_budgets(store: &dyn BudgetStore) -> Result<(), String> {
    let long_ago = NOW - 2 * RUN_RETENTION_SECS;
    let window = CounterKey::window(TENANT, None, Unit::Requests, NOW - 2 * 3600);
    let spent = a_run(1000, None, long_ago + 60).this.counter(TENANT, Unit::Tokens);
    let day = CounterKey::new(TENANT, None, Unit::Tokens, Period::Day, long_ago);
    let lines = vec![
        Line { key: window.clone(), amount: 1, limit: Some(5) },
        Line { key: spent.clone(), amount: 40, limit: Some(1000) },
        Line { key: day.clone(), amount: 40, limit: Some(10_000) },
    ];
    let reserving = ReserveRequest { request_id: "long-ago".into(), lines, expires_at: long_ago + 60 };
    let reserved = call!(store.reserve(&reserving));
    check(reserved == ReserveOutcome::Reserved, || format!("reserve: {reserved:?}"))?;
    let actual = [(window.clone(), 1), (spent.clone(), 30), (day.clone(), 30)];
    let settled = call!(store.settle(&reserving.reservation(), &actual));
    check(settled == SettleOutcome::Settled, || format!("settle: {settled:?}"))?;
    let swept = call!(store.sweep(NOW));
    check(swept == Swept::default(), || format!("sweep: {swept:?}, no reservation to close"))?;
    let got = call!(store.used(&[window, spent, day]));
    check(got == [0, 0, 30], || format!("window, run, day after the sweep: {got:?}, expected [0, 0, 30]"))
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
    note(
        "sweep_charges_a_settle_intent_instead_of_refunding",
        sweep_charges_a_settle_intent_instead_of_refunding(&make().await).await,
    );
    note(
        "renew_moves_the_expiry_of_a_live_reservation_only",
        renew_moves_the_expiry_of_a_live_reservation_only(&make().await).await,
    );
    note("a_settle_after_its_intent_charges_once", a_settle_after_its_intent_charges_once(&make().await).await);
    note(
        "an_intent_on_a_swept_reservation_is_charged_by_the_next_sweep",
        an_intent_on_a_swept_reservation_is_charged_by_the_next_sweep(&make().await).await,
    );
    note(
        "the_ledger_equals_the_usage_whatever_the_path",
        the_ledger_equals_the_usage_whatever_the_path(&make().await).await,
    );
    note(
        "settle_and_sweep_charge_an_intent_exactly_once",
        settle_and_sweep_charge_an_intent_exactly_once(Arc::new(make().await)).await,
    );
    note(
        "intents_recorded_during_sweeps_are_all_charged",
        intents_recorded_during_sweeps_are_all_charged(Arc::new(make().await)).await,
    );
    note("a_ticket_retries_a_failed_settle", a_ticket_retries_a_failed_settle(Arc::new(make().await)).await);
    note(
        "a_ticket_whose_settle_cannot_be_written_is_charged_by_the_sweeper",
        a_ticket_whose_settle_cannot_be_written_is_charged_by_the_sweeper(Arc::new(make().await)).await,
    );
    note(
        "a_ticket_whose_refund_cannot_be_written_is_refunded_by_the_sweeper",
        a_ticket_whose_refund_cannot_be_written_is_refunded_by_the_sweeper(Arc::new(make().await)).await,
    );
    note(
        "a_ticket_dropped_while_it_settles_is_settled_once",
        a_ticket_dropped_while_it_settles_is_settled_once(Arc::new(make().await)).await,
    );
    note(
        "a_reservation_dropped_before_its_answer_is_refunded",
        a_reservation_dropped_before_its_answer_is_refunded(Arc::new(make().await)).await,
    );
    note(
        "a_ticket_dropped_while_it_refunds_is_refunded",
        a_ticket_dropped_while_it_refunds_is_refunded(Arc::new(make().await)).await,
    );
    note(
        "a_settle_whose_reservation_was_swept_meanwhile_charges_the_usage_alone",
        a_settle_whose_reservation_was_swept_meanwhile_charges_the_usage_alone(Arc::new(make().await)).await,
    );
    note(
        "a_settle_settles_the_stored_lines_not_the_claimed_ones",
        a_settle_settles_the_stored_lines_not_the_claimed_ones(&make().await).await,
    );
    let shared: Arc<dyn BudgetStore> = Arc::new(make().await);
    note("concurrent_reservations_never_pass_the_cap", concurrent_reservations_never_pass_the_cap(shared).await);
    note(
        "concurrent_window_reservations_never_pass_the_limit",
        concurrent_window_reservations_never_pass_the_limit(Arc::new(make().await)).await,
    );
    note(
        "runs_are_created_read_and_ended_with_their_descendants",
        runs_are_created_read_and_ended_with_their_descendants(&make().await).await,
    );
    note(
        "concurrent_run_reservations_never_pass_the_run_or_its_ancestors",
        concurrent_run_reservations_never_pass_the_run_or_its_ancestors(Arc::new(make().await)).await,
    );
    note("a_run_takes_at_most_its_most_children", a_run_takes_at_most_its_most_children(&make().await).await);
    note(
        "a_sweep_forgets_old_windows_and_runs_and_keeps_budgets",
        a_sweep_forgets_old_windows_and_runs_and_keeps_budgets(&make().await).await,
    );
    failures
}
