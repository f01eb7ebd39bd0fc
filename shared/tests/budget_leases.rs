//! Budget leases (`LeasedBudgetStore`): the conformance suite over a memory store, the
//! hard cap with several instances sharing one ledger, slices that shrink near the cap,
//! and a vanished instance's lease charged by the sweeper.
#![cfg(test)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flexway::budget::{
    BudgetStore, CounterKey, IntentOutcome, LeasePolicy, LeasedBudgetStore, Line, MemoryBudgetStore, Reservation,
    ReserveOutcome, ReserveRequest, SettleOutcome, StoreError, Swept, conformance,
};

use conformance::NOW;

fn key(name: &str) -> CounterKey {
    CounterKey(format!("lease/{name}").into())
}

fn request(id: &str, lines: &[(&str, u64, Option<u64>)]) -> ReserveRequest {
    ReserveRequest {
        request_id: id.to_owned(),
        lines: lines.iter().map(|(k, amount, limit)| Line { key: key(k), amount: *amount, limit: *limit }).collect(),
        expires_at: NOW + 60,
    }
}

/// The store's clock stands at `NOW`, where the tests' reservations expire.
fn on_test_clock<S: BudgetStore + 'static>(inner: Arc<S>, policy: LeasePolicy) -> LeasedBudgetStore<S> {
    LeasedBudgetStore::new(inner, policy).with_clock(|| NOW)
}

fn leased(inner: Arc<MemoryBudgetStore>) -> LeasedBudgetStore<MemoryBudgetStore> {
    on_test_clock(inner, LeasePolicy::default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_memory_store_passes_the_conformance_suite() {
    let failures = conformance::run_all(|| async { leased(Arc::new(MemoryBudgetStore::new())) }).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Every lease's intent written at each settle: the strictest crash setting passes too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_store_with_an_intent_per_settle_passes_the_conformance_suite() {
    let policy = LeasePolicy { intent_every: Duration::ZERO, ..LeasePolicy::default() };
    let failures =
        conformance::run_all(|| async { on_test_clock(Arc::new(MemoryBudgetStore::new()), policy.clone()) }).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Four instances of 8 tasks each share one ledger and spend a tenant's budget to the
/// end. The test tracks every call's reservation from its admission to its settlement
/// (added after the store admitted it, replaced by the usage before the store is told):
/// an under-estimate of what the store holds, so it can never pass the cap unless the
/// leases let calls pass it. At the end, once the leases are flushed, the ledger holds
/// the usage settled, to the token, and nothing is left reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_instances_never_pass_the_cap_and_the_ledger_equals_the_usage() {
    const LIMIT: u64 = 200_000;
    let inner = Arc::new(MemoryBudgetStore::new());
    let instances: Vec<Arc<LeasedBudgetStore<MemoryBudgetStore>>> =
        (0..4).map(|_| Arc::new(leased(inner.clone()))).collect();
    let outstanding = Arc::new(AtomicU64::new(0));
    let usage = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (n, store) in instances.iter().enumerate() {
        for t in 0..8 {
            let (store, outstanding, usage) = (store.clone(), outstanding.clone(), usage.clone());
            tasks.push(tokio::spawn(async move {
                let mut served = 0u64;
                for i in 0u64.. {
                    let id = format!("{n}-{t}-{i}");
                    let amount = 50 + (i * 7 + t) % 100;
                    let call = request(&id, &[("day", amount, Some(LIMIT)), ("eur", amount * 3, None)]);
                    if store.reserve(&call).await.unwrap() != ReserveOutcome::Reserved {
                        return served;
                    }
                    let now = outstanding.fetch_add(amount, Ordering::SeqCst) + amount;
                    assert!(now <= LIMIT, "{now} reserved or used past the cap {LIMIT}");
                    tokio::task::yield_now().await;
                    let actual = amount / 2 + i % 3;
                    outstanding.fetch_sub(amount - actual, Ordering::SeqCst);
                    usage.fetch_add(actual, Ordering::SeqCst);
                    let settled = store
                        .settle(&call.reservation(), &[(key("day"), actual), (key("eur"), actual * 3)])
                        .await
                        .unwrap();
                    assert_eq!(settled, SettleOutcome::Settled);
                    served += 1;
                }
                served
            }));
        }
    }
    let mut served = 0;
    for task in tasks {
        served += task.await.unwrap();
    }
    for store in &instances {
        store.flush().await;
    }
    let usage = usage.load(Ordering::SeqCst);
    let ledger = inner.used(&[key("day"), key("eur")]).await.unwrap();
    assert_eq!(ledger, [usage, 3 * usage], "ledger = sum of the usage settled, {served} calls");
    assert_eq!(inner.live_reservations().await.unwrap(), 0, "every lease settled");
    // Refusals start only near the cap: the budget was spent, not stranded in leases.
    assert!(usage >= LIMIT - LIMIT / 20, "usage {usage} of {LIMIT} when refusals began");
}

/// Records the reservations the lease store makes on its inner store.
struct Recording {
    inner: MemoryBudgetStore,
    reserves: Mutex<Vec<(String, u64)>>,
    writes: AtomicU64,
}

#[async_trait::async_trait]
impl BudgetStore for Recording {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        let outcome = self.inner.reserve(request).await?;
        if outcome == ReserveOutcome::Reserved {
            let amount = request.lines.first().map_or(0, |l| l.amount);
            self.reserves.lock().unwrap().push((request.request_id.clone(), amount));
        }
        Ok(outcome)
    }
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.settle(reservation, actual).await
    }
    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.record_intent(request_id, actual).await
    }
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
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
    async fn create_run(&self, run: &flexway::budget::run::Run) -> Result<bool, StoreError> {
        self.inner.create_run(run).await
    }
    async fn run(&self, id: &str) -> Result<Option<flexway::budget::run::Run>, StoreError> {
        self.inner.run(id).await
    }
    async fn end_run(&self, id: &str, at: u64) -> Result<flexway::budget::run::RunEnd, StoreError> {
        self.inner.end_run(id, at).await
    }
}

/// One instance spends a budget of 1,000 calls to the end: a first lease of
/// `first_calls`, then 64 calls' worth at the rate observed while the budget is far,
/// slices of an eighth of what is left near the cap, then one reservation per call;
/// exactly 1,000 calls pass, in far fewer writes than calls.
#[tokio::test]
async fn slices_grow_with_the_rate_and_shrink_near_the_cap_down_to_one_call() {
    let inner = Arc::new(Recording {
        inner: MemoryBudgetStore::new(),
        reserves: Mutex::new(Vec::new()),
        writes: AtomicU64::new(0),
    });
    let store = on_test_clock(inner.clone(), LeasePolicy::default());
    let mut served = 0;
    loop {
        let call = request(&format!("c{served}"), &[("day", 100, Some(100_000))]);
        if store.reserve(&call).await.unwrap() != ReserveOutcome::Reserved {
            break;
        }
        store.settle(&call.reservation(), &[(key("day"), 100)]).await.unwrap();
        served += 1;
    }
    assert_eq!(served, 1000, "the whole budget, not a token more");
    store.flush().await;
    assert_eq!(inner.used(&[key("day")]).await.unwrap(), [100_000]);
    let reserves = inner.reserves.lock().unwrap().clone();
    let slices: Vec<u64> = reserves.iter().map(|(_, amount)| *amount).collect();
    assert_eq!(slices.first(), Some(&400), "the first lease holds `first_calls` calls: {slices:?}");
    assert_eq!(slices.get(1), Some(&6400), "then 64 calls' worth at the rate observed: {slices:?}");
    assert!(slices[1..].windows(2).all(|w| w[1] <= w[0]), "then slices only shrink: {slices:?}");
    let (last_id, last) = reserves.last().unwrap();
    assert!(!last_id.starts_with("lease#") && *last == 100, "the last calls reserve alone: {reserves:?}");
    let writes = inner.writes.load(Ordering::SeqCst);
    assert!(writes < 100, "{writes} writes for 1,000 calls: {slices:?}");
}

/// An instance that vanishes mid-lease stops renewing it: past its own short life (not
/// the calls'), any sweep closes it. With its usage recorded at each renewal the
/// sweeper charges what it served (the call in flight is refunded, as a vanished call
/// is); without a renewal since, the lease is refunded and those calls go uncharged —
/// the bounded loss that `intent_every` sets.
#[tokio::test]
async fn a_vanished_instance_lease_is_charged_by_the_sweeper_seconds_later() {
    for (intent_every, charged) in [(Duration::ZERO, 5 * 10), (Duration::from_secs(3600), 0)] {
        let inner = Arc::new(MemoryBudgetStore::new());
        let policy = LeasePolicy { intent_every, first_calls: 64, ..LeasePolicy::default() };
        let store = on_test_clock(inner.clone(), policy);
        for i in 0..5 {
            let call = request(&format!("v{i}"), &[("day", 100, Some(100_000))]);
            assert_eq!(store.reserve(&call).await.unwrap(), ReserveOutcome::Reserved);
            store.settle(&call.reservation(), &[(key("day"), 10)]).await.unwrap();
        }
        store.reserve(&request("in-flight", &[("day", 100, Some(100_000))])).await.unwrap();
        drop(store);
        assert_eq!(inner.used(&[key("day")]).await.unwrap(), [6400], "the slice is held until the sweep");
        let life = LeasePolicy::default().lease_secs;
        assert_eq!(inner.sweep(NOW + life - 1).await.unwrap(), Swept::default(), "the lease is still live");
        let swept = inner.sweep(NOW + life + 1).await.unwrap();
        // Either way a lease's end, counted apart from failed settlements.
        assert_eq!(swept, Swept { leases: 1, ..Swept::default() }, "intent every {intent_every:?}");
        assert_eq!(inner.used(&[key("day")]).await.unwrap(), [charged], "intent every {intent_every:?}");
        assert_eq!(inner.live_reservations().await.unwrap(), 0);
    }
}

/// A lease is all its calls' counters' slices in one write; unlimited lines are written
/// with the lease's settlement, and a tighter per-call limit (admission's soft guard)
/// keeps a call out of a lease taken under a looser one.
#[tokio::test]
async fn a_call_under_a_tighter_limit_is_not_served_from_a_looser_lease() {
    let inner = Arc::new(MemoryBudgetStore::new());
    let store = leased(inner.clone());
    let first = request("loose", &[("day", 100, Some(100_000)), ("eur", 500, None)]);
    store.reserve(&first).await.unwrap();
    assert_eq!(inner.used(&[key("day"), key("eur")]).await.unwrap(), [400, 0], "`first_calls` calls' worth");
    assert_eq!(store.used(&[key("day"), key("eur")]).await.unwrap(), [100, 500]);
    // Fits the slice, but its own condition says the counter must stand at 50 or less
    // before it: with the lease taken from 0 and 100 used, that cannot be promised.
    let tight = request("tight", &[("day", 100, Some(150))]);
    assert_eq!(store.reserve(&tight).await.unwrap(), ReserveOutcome::Refused { line: 0 });
    store.settle(&first.reservation(), &[(key("day"), 70), (key("eur"), 300)]).await.unwrap();
    store.flush().await;
    assert_eq!(inner.used(&[key("day"), key("eur")]).await.unwrap(), [70, 300]);
    assert_eq!(inner.live_reservations().await.unwrap(), 0);
}

/// Leases on the real clock, short enough for a test: a two-second life, returned
/// after 200 ms without a call, reclaimed by a refused instance at most every 100 ms.
fn short_leases() -> LeasePolicy {
    LeasePolicy {
        lease_secs: 2,
        idle: Duration::from_millis(200),
        reclaim_every: Duration::from_millis(100),
        ..LeasePolicy::default()
    }
}

/// A call on the real clock: 46 tokens reserved on a 3,000-token day.
fn day_call(id: String) -> ReserveRequest {
    ReserveRequest {
        request_id: id,
        lines: vec![Line { key: key("day"), amount: CALL, limit: Some(DAY) }],
        expires_at: flexway::budget::period::unix_now() + 60,
    }
}

const DAY: u64 = 3_000;
const CALL: u64 = 46;

/// Serves calls of `CALL` tokens on `store` until the day is spent but for less than a
/// call; a refusal before that is retried every 50 ms for at most `patience`, the
/// time other instances' leases take to come back. Returns the tokens served.
async fn spend_to_the_cap(store: &dyn BudgetStore, name: &str, spent_elsewhere: u64, patience: Duration) -> u64 {
    let mut served = 0;
    let mut refused_since: Option<std::time::Instant> = None;
    for i in 0.. {
        let call = day_call(format!("{name}-{i}"));
        if store.reserve(&call).await.unwrap() == ReserveOutcome::Reserved {
            refused_since = None;
            served += CALL;
            assert!(spent_elsewhere + served <= DAY, "{} tokens served past the cap {DAY}", spent_elsewhere + served);
            store.settle(&call.reservation(), &[(key("day"), CALL)]).await.unwrap();
            continue;
        }
        if spent_elsewhere + served + CALL > DAY {
            break;
        }
        let since = *refused_since.get_or_insert_with(std::time::Instant::now);
        assert!(
            since.elapsed() < patience,
            "refused with {} of {DAY} tokens unspent for {patience:?}: budget stranded in leases",
            DAY - spent_elsewhere - served
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    served
}

/// The false 429 of long, large leases: three instances share a 3,000-token day and
/// the tenant's calls move from one to the next. Each instance's first call is served
/// at once (no instance holds most of the day), and the last one reaches the cap, all
/// but a call's worth, within a few idle periods of the others going quiet: their
/// leases come back, never stranded. The cap is never passed and the ledger equals the
/// usage once the leases are flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_moving_between_instances_reaches_its_cap_while_the_others_sit_idle() {
    let inner = Arc::new(MemoryBudgetStore::new());
    let instances: Vec<_> = (0..3).map(|_| LeasedBudgetStore::start(inner.clone(), short_leases())).collect();
    let mut spent = 0;
    for (n, store) in instances.iter().enumerate() {
        for i in 0..10 {
            let call = day_call(format!("move-{n}-{i}"));
            let outcome = store.reserve(&call).await.unwrap();
            assert_eq!(outcome, ReserveOutcome::Reserved, "instance {n}, call {i}: {spent} of {DAY} tokens spent");
            store.settle(&call.reservation(), &[(key("day"), CALL)]).await.unwrap();
            spent += CALL;
        }
    }
    // Three seconds: a few idle periods, far less than one of the old leases' life.
    let last = spend_to_the_cap(instances[2].as_ref(), "last", spent, Duration::from_secs(3)).await;
    spent += last;
    assert!(spent + CALL > DAY, "{spent} of {DAY} spent: more than a call's worth left");
    for store in &instances {
        store.flush().await;
    }
    assert_eq!(inner.used(&[key("day")]).await.unwrap(), [spent], "ledger = usage");
    assert_eq!(inner.live_reservations().await.unwrap(), 0, "every lease closed");
}

/// A process killed with calls served from its lease (its usage renewed at each
/// settle) and one in flight: another instance, refused, reclaims the expired lease
/// within its two-second life (plus the clock's second) and spends the day to the
/// cap. The killed one's served usage is charged, its call in flight refunded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_lease_is_charged_and_freed_within_seconds() {
    let inner = Arc::new(MemoryBudgetStore::new());
    let policy = LeasePolicy { intent_every: Duration::ZERO, first_calls: 8, ..short_leases() };
    let killed = LeasedBudgetStore::start(inner.clone(), policy.clone());
    let mut spent = 0;
    for i in 0..3 {
        let call = day_call(format!("killed-{i}"));
        assert_eq!(killed.reserve(&call).await.unwrap(), ReserveOutcome::Reserved);
        killed.settle(&call.reservation(), &[(key("day"), CALL)]).await.unwrap();
        spent += CALL;
    }
    assert_eq!(killed.reserve(&day_call("in-flight".into())).await.unwrap(), ReserveOutcome::Reserved);
    assert_eq!(inner.used(&[key("day")]).await.unwrap(), [8 * CALL], "the killed instance's slice");
    drop(killed);

    let survivor = LeasedBudgetStore::start(inner.clone(), policy);
    let served = spend_to_the_cap(survivor.as_ref(), "survivor", spent, Duration::from_secs(5)).await;
    spent += served;
    assert!(spent + CALL > DAY, "{spent} of {DAY} spent: more than a call's worth left");
    survivor.flush().await;
    assert_eq!(inner.used(&[key("day")]).await.unwrap(), [spent], "the killed one's usage charged, once");
    assert_eq!(inner.live_reservations().await.unwrap(), 0, "the killed one's lease closed");
}

/// A call refused because an instance frozen or gone still holds a lease reclaims
/// that expired lease and is served at once, not on the caller's retry: closing a
/// lease frees budget as a refund does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_refused_for_a_frozen_instances_lease_is_served_once_that_lease_is_reclaimed() {
    let inner = Arc::new(MemoryBudgetStore::new());
    // As on Lambda, each settle records the lease's usage; an hour behind: its lease
    // expired long ago by the others' clock.
    let policy = LeasePolicy { intent_every: Duration::ZERO, ..LeasePolicy::default() };
    let frozen = LeasedBudgetStore::new(inner.clone(), policy).with_clock(|| NOW - 3_600);
    // One call of 40 on a lease of several such calls.
    let call = request("frozen-0", &[("day", 40, Some(1_000))]);
    assert_eq!(frozen.reserve(&call).await.unwrap(), ReserveOutcome::Reserved);
    frozen.settle(&call.reservation(), &[(key("day"), 40)]).await.unwrap();
    let held = inner.used(&[key("day")]).await.unwrap()[0];
    assert!(held > 40 + 1, "no lease taken: {held} of 1,000 held");
    drop(frozen);

    // A call that fits only without the lease's unused part.
    let survivor = leased(inner.clone());
    let amount = 1_000 - held + 1;
    let next = request("survivor-0", &[("day", amount, Some(1_000))]);
    assert_eq!(survivor.reserve(&next).await.unwrap(), ReserveOutcome::Reserved, "refused with the lease reclaimable");
    survivor.settle(&next.reservation(), &[(key("day"), amount)]).await.unwrap();
    survivor.flush().await;
    assert_eq!(inner.used(&[key("day")]).await.unwrap(), [40 + amount], "the frozen call charged, the lease closed");
}

/// A call in a run is reserved on the inner store, never from a lease (SPEC §15: a
/// run's `GET` reads within a second of a call's settlement in every shape): once a
/// call in a run has settled on one instance, and another's on a second, the run's
/// counters on the inner store are the usage, at once, with no slice held, while a
/// call outside any run is still served from a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_a_run_settles_on_the_inner_store_at_once() {
    use flexway::budget::Unit;

    let inner = Arc::new(MemoryBudgetStore::new());
    let (first, second) = (leased(inner.clone()), leased(inner.clone()));
    let [tokens, calls] = [Unit::Tokens, Unit::Requests].map(|unit| CounterKey::run("acme", "run_1", unit, NOW + 600));
    let in_run = |id: &str| ReserveRequest {
        request_id: id.to_owned(),
        lines: vec![
            Line { key: key("day"), amount: 100, limit: Some(100_000) },
            Line { key: tokens.clone(), amount: 100, limit: Some(10_000) },
            Line { key: calls.clone(), amount: 1, limit: None },
        ],
        expires_at: NOW + 60,
    };
    let actual = [(key("day"), 60), (tokens.clone(), 60), (calls.clone(), 1)];

    let call = in_run("run-0");
    assert_eq!(first.reserve(&call).await.unwrap(), ReserveOutcome::Reserved);
    assert_eq!(inner.used(&[tokens.clone(), calls.clone()]).await.unwrap(), [100, 1], "the call's own reservation");
    assert_eq!(first.settle(&call.reservation(), &actual).await.unwrap(), SettleOutcome::Settled);
    assert_eq!(inner.used(&[tokens.clone(), calls.clone()]).await.unwrap(), [60, 1], "settled on the inner store");
    assert_eq!(inner.live_reservations().await.unwrap(), 0, "no lease taken");

    let call = in_run("run-1");
    assert_eq!(second.reserve(&call).await.unwrap(), ReserveOutcome::Reserved);
    assert_eq!(second.settle(&call.reservation(), &actual).await.unwrap(), SettleOutcome::Settled);
    assert_eq!(inner.used(&[tokens.clone(), calls.clone(), key("day")]).await.unwrap(), [120, 2, 120]);

    // Outside a run, the same budget is leased as before.
    let outside = request("outside-0", &[("day", 100, Some(100_000))]);
    assert_eq!(first.reserve(&outside).await.unwrap(), ReserveOutcome::Reserved);
    assert!(inner.used(&[key("day")]).await.unwrap()[0] > 120 + 100, "served from a lease of several calls");
}
