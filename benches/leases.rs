//! One tenant's sustained calls per second on a DynamoDB-like ledger, with and without
//! budget leases (`LeasedBudgetStore`), and the hard cap checked at the end.
//!
//! `cargo bench --bench leases` — the inner store is the memory ledger behind a
//! simulation of what caps a tenant on DynamoDB (moto serialises every request and
//! cannot show it):
//! - each item (counter or reservation) absorbs `ITEM_WCU_PER_SEC` (1,000) write units
//!   per second, refilled continuously with at most 100 ms of burst; a transactional
//!   write costs 2 units per item, `record_intent` (one `UpdateItem`) 1;
//! - a transaction touching an item another transaction holds is cancelled
//!   (`TransactionConflict`), and so is one over an item's ceiling (throttled); both
//!   are retried with the adapter's jittered backoff, 12 attempts, then `Busy`;
//! - each request takes `LATENCY_MS` (4 ms), during which its items are held.
//!
//! `ENVIRONMENTS` (4) execution environments, each a `LeasedBudgetStore` (or, without
//! leases, the simulated store itself) with `TASKS` (16) concurrent calls in a loop of
//! reserve + settle on one tenant's three counters (tokens/day, tokens/month, eur/month)
//! for `LEASES_BENCH_SECS` (default 3) seconds. Then a run to the cap: a day budget that
//! runs out, every task going until refused, tracking each call's reservation from its
//! admission to its settlement; it must never pass the cap, and once the leases are
//! flushed the counters must equal the usage settled, to the token.
//!
//! Then the false 429 (`moving`): a tenant whose calls move from one environment to
//! the next while the others sit frozen, under the lease policy before leases had a
//! life of their own and under today's; it prints the refusals while the day had room
//! and the time to the cap.
//!
//! Figures are printed, never asserted; the correctness checks print and exit non-zero.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flexway::budget::period::unix_now;
use flexway::budget::{
    BudgetStore, CounterKey, IntentOutcome, LeasePolicy, LeasedBudgetStore, Line, MemoryBudgetStore, Reservation,
    ReserveOutcome, ReserveRequest, SettleOutcome, StoreError, Swept,
};

const ITEM_WCU_PER_SEC: f64 = 1_000.0;
const BURST_SECS: f64 = 0.1;
const LATENCY_MS: u64 = 4;
const MAX_ATTEMPTS: u32 = 12;
const ENVIRONMENTS: usize = 4;
const TASKS: usize = 16;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

#[derive(Debug)]
struct Item {
    units: f64,
    at: Instant,
    held: bool,
}

/// The memory ledger behind DynamoDB's per-item write ceiling and transaction conflicts.
struct SimulatedDynamoDb {
    inner: MemoryBudgetStore,
    items: Mutex<HashMap<String, Item>>,
    requests: AtomicU64,
    cancelled: AtomicU64,
}

impl SimulatedDynamoDb {
    fn new() -> Self {
        SimulatedDynamoDb {
            inner: MemoryBudgetStore::new(),
            items: Mutex::new(HashMap::new()),
            requests: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
        }
    }

    /// Takes every item for one request, or none (conflict or throttled).
    fn take(&self, items: &[String], cost: f64) -> bool {
        let mut table = self.items.lock().unwrap();
        let now = Instant::now();
        for name in items {
            let item = table.entry(name.clone()).or_insert(Item {
                units: ITEM_WCU_PER_SEC * BURST_SECS,
                at: now,
                held: false,
            });
            item.units = (item.units + now.duration_since(item.at).as_secs_f64() * ITEM_WCU_PER_SEC)
                .min(ITEM_WCU_PER_SEC * BURST_SECS);
            item.at = now;
            if item.held || item.units < cost {
                return false;
            }
        }
        for name in items {
            if let Some(item) = table.get_mut(name) {
                item.held = true;
                item.units -= cost;
            }
        }
        true
    }

    fn release(&self, items: &[String]) {
        let mut table = self.items.lock().unwrap();
        for name in items {
            if let Some(item) = table.get_mut(name) {
                item.held = false;
            }
        }
    }

    /// One write request on `items`, retried like the adapter on conflict or throttle.
    async fn write<T>(
        &self,
        mut items: Vec<String>,
        cost: f64,
        apply: impl std::future::Future<Output = T>,
    ) -> Result<T, StoreError> {
        items.sort();
        items.dedup();
        for attempt in 0..MAX_ATTEMPTS {
            self.requests.fetch_add(1, Ordering::Relaxed);
            if self.take(&items, cost) {
                tokio::time::sleep(Duration::from_millis(LATENCY_MS)).await;
                let result = apply.await;
                self.release(&items);
                return Ok(result);
            }
            self.cancelled.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(LATENCY_MS)).await;
            let cap = 10u64.saturating_mul(1 << attempt.min(6)).min(500);
            tokio::time::sleep(Duration::from_millis(rand::random_range(1..=cap))).await;
        }
        Err(StoreError::Busy("simulated TransactionConflict past the retries".into()))
    }
}

fn reservation_item(request_id: &str) -> String {
    format!("reservation#{request_id}")
}

#[async_trait::async_trait]
impl BudgetStore for SimulatedDynamoDb {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        let mut items: Vec<String> = request.lines.iter().map(|l| l.key.as_str().to_owned()).collect();
        items.push(reservation_item(&request.request_id));
        self.write(items, 2.0, self.inner.reserve(request)).await?
    }
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        let mut items: Vec<String> =
            reservation.lines.iter().chain(actual).map(|(k, _)| k.as_str().to_owned()).collect();
        items.push(reservation_item(&reservation.request_id));
        self.write(items, 2.0, self.inner.settle(reservation, actual)).await?
    }
    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        let items = vec![reservation_item(request_id)];
        self.write(items, 1.0, self.inner.record_intent(request_id, actual)).await?
    }
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        let items = vec![reservation_item(request_id)];
        self.write(items, 1.0, self.inner.renew(request_id, actual, expires_at)).await?
    }
    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        self.inner.sweep(now).await
    }
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(LATENCY_MS)).await;
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

fn key(name: &str) -> CounterKey {
    CounterKey(format!("acme/*/{name}").into())
}

/// One call of the tenant: tokens per day, tokens per month, micro-euros per month.
fn call(id: String, tokens: u64, day_limit: u64) -> ReserveRequest {
    ReserveRequest {
        request_id: id,
        lines: vec![
            Line { key: key("tokens/day"), amount: tokens, limit: Some(day_limit) },
            Line { key: key("tokens/month"), amount: tokens, limit: Some(u64::MAX / 4) },
            Line { key: key("eur/month"), amount: tokens * 5, limit: Some(u64::MAX / 4) },
        ],
        expires_at: unix_now() + 60,
    }
}

fn actual_of(tokens: u64) -> Vec<(CounterKey, u64)> {
    vec![(key("tokens/day"), tokens), (key("tokens/month"), tokens), (key("eur/month"), tokens * 5)]
}

#[derive(Default)]
struct Tally {
    served: AtomicU64,
    refused: AtomicU64,
    errors: AtomicU64,
    /// Reserved amounts in flight plus usage settled, on tokens/day.
    outstanding: AtomicU64,
    peak: AtomicU64,
    usage: AtomicU64,
}

/// `ENVIRONMENTS` × `TASKS` calls in a loop until `stop` (or, with `until_refused`, each
/// task until its first refusal).
async fn drive(
    environments: &[Arc<dyn BudgetStore>],
    day_limit: u64,
    stop: Arc<AtomicBool>,
    until_refused: bool,
) -> Arc<Tally> {
    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for (e, store) in environments.iter().enumerate() {
        for t in 0..TASKS {
            let (store, tally, stop) = (store.clone(), tally.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let tokens = 100 + (i * 7 + t as u64) % 100;
                    let request = call(format!("{e}-{t}-{i}"), tokens, day_limit);
                    match store.reserve(&request).await {
                        Ok(ReserveOutcome::Reserved) => {}
                        Ok(ReserveOutcome::Refused { .. }) => {
                            tally.refused.fetch_add(1, Ordering::Relaxed);
                            if until_refused {
                                return;
                            }
                            continue;
                        }
                        Err(_) => {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                    }
                    let held = tally.outstanding.fetch_add(tokens, Ordering::SeqCst) + tokens;
                    tally.peak.fetch_max(held, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    let used = tokens / 2 + i % 7;
                    tally.outstanding.fetch_sub(tokens - used, Ordering::SeqCst);
                    tally.usage.fetch_add(used, Ordering::SeqCst);
                    // A ticket would leave a settle intent for the sweeper; the bench
                    // retries, so that the ledger can be compared with the usage.
                    while store.settle(&request.reservation(), &actual_of(used)).await.is_err() {
                        tally.errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    tally.served.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    tally
}

type Leased = LeasedBudgetStore<SimulatedDynamoDb>;

/// The environments' stores (and, with leases, the lease stores, to flush them).
fn environments(inner: &Arc<SimulatedDynamoDb>, leases: bool) -> (Vec<Arc<dyn BudgetStore>>, Vec<Arc<Leased>>) {
    if !leases {
        return ((0..ENVIRONMENTS).map(|_| inner.clone() as Arc<dyn BudgetStore>).collect(), Vec::new());
    }
    let leased: Vec<_> =
        (0..ENVIRONMENTS).map(|_| Arc::new(LeasedBudgetStore::new(inner.clone(), LeasePolicy::default()))).collect();
    (leased.iter().map(|l| l.clone() as Arc<dyn BudgetStore>).collect(), leased)
}

async fn run() {
    let secs = env_or("LEASES_BENCH_SECS", 3);
    println!(
        "leases: one tenant, {ENVIRONMENTS} environments x {TASKS} concurrent calls, simulated DynamoDB \
         ({ITEM_WCU_PER_SEC} WCU/s per item, 2 WCU per transactional item write, {LATENCY_MS} ms per request, \
         conflicts cancelled and retried), {secs} s per row"
    );
    println!(
        "{:<14} {:>10} {:>10} {:>10} {:>12} {:>10}",
        "ledger", "calls/s", "requests", "cancelled", "reqs/call", "errors"
    );
    let mut failed = false;
    for leases in [false, true] {
        let inner = Arc::new(SimulatedDynamoDb::new());
        let (stores, leased) = environments(&inner, leases);
        let stop = Arc::new(AtomicBool::new(false));
        let timer = {
            let stop = stop.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(secs)).await;
                stop.store(true, Ordering::Relaxed);
            })
        };
        let start = Instant::now();
        let tally = drive(&stores, u64::MAX / 4, stop, false).await;
        let elapsed = start.elapsed();
        timer.await.unwrap();
        for store in &leased {
            store.flush().await;
        }
        inner.inner.sweep(unix_now() + 86_400).await.unwrap();
        let served = tally.served.load(Ordering::Relaxed);
        let requests = inner.requests.load(Ordering::Relaxed);
        println!(
            "{:<14} {:>10.0} {:>10} {:>10} {:>12.3} {:>10}",
            if leases { "leases" } else { "one per call" },
            served as f64 / elapsed.as_secs_f64(),
            requests,
            inner.cancelled.load(Ordering::Relaxed),
            requests as f64 / served.max(1) as f64,
            tally.errors.load(Ordering::Relaxed),
        );
        let ledger = inner.inner.used(&[key("tokens/day")]).await.unwrap();
        let usage = tally.usage.load(Ordering::SeqCst);
        if ledger != [usage] {
            println!("  VIOLATED: ledger {ledger:?} != usage settled {usage}");
            failed = true;
        }
    }

    // To the cap: 20,000 calls' worth of a day budget, spent by every environment.
    let day_limit = 20_000 * 150;
    let inner = Arc::new(SimulatedDynamoDb::new());
    let (stores, leased) = environments(&inner, true);
    let start = Instant::now();
    let tally = drive(&stores, day_limit, Arc::new(AtomicBool::new(false)), true).await;
    let elapsed = start.elapsed();
    for store in &leased {
        store.flush().await;
    }
    // A lease whose settlement was cancelled past its retries left it as an intent.
    let swept = inner.inner.sweep(unix_now() + 86_400).await.unwrap();
    let ledger = inner.inner.used(&[key("tokens/day")]).await.unwrap()[0];
    let usage = tally.usage.load(Ordering::SeqCst);
    let peak = tally.peak.load(Ordering::SeqCst);
    let live = inner.inner.live_reservations().await.unwrap();
    println!(
        "to the cap (leases): {} calls in {:.2} s, day limit {day_limit}, peak reserved+used {peak} ({}), ledger {ledger}, \
         usage settled {usage} ({}), {live} reservations left, {} errors, leases closed by the sweeper {swept:?}",
        tally.served.load(Ordering::Relaxed),
        elapsed.as_secs_f64(),
        if peak <= day_limit { "cap never passed" } else { "CAP PASSED" },
        if ledger == usage { "equal to the token" } else { "DIFFERENT" },
        tally.errors.load(Ordering::Relaxed),
    );
    if peak > day_limit || ledger != usage || live != 0 {
        failed = true;
    }
    for (name, policy) in [("before", previous_policy()), ("after", lambda_policy())] {
        failed |= moving(name, policy).await;
    }
    if failed {
        std::process::exit(1);
    }
}

/// The lease policy before leases had a life of their own: 64 calls' worth from the
/// first lease, no share of the limit until one was refused, and a life past the call
/// that took it (its expiry, a minute, plus a minute).
fn previous_policy() -> LeasePolicy {
    LeasePolicy { first_calls: 64, share_of_remaining: 1, lease_secs: 120, ..lambda_policy() }
}

/// What the Lambda function runs (`flexway_aws::build_adapters`).
fn lambda_policy() -> LeasePolicy {
    LeasePolicy { intent_every: Duration::ZERO, ..LeasePolicy::default() }
}

/// The false 429: a tenant with a 3,000-token day whose calls (46 tokens each) move
/// from one Lambda environment to the next, as function URLs spread them: 10 calls on
/// the first, 10 on the second, then the third until the cap. The first two are then
/// frozen (no tender runs: nothing renews or returns their leases). A refusal while
/// the day still had room for the call is a false 429; the client retries every
/// 100 ms, for `MOVING_PATIENCE_SECS` (default 30) at most. Prints the false 429s and
/// the time to the cap (or what stayed stranded); true when the cap was passed.
async fn moving(name: &str, policy: LeasePolicy) -> bool {
    const DAY: u64 = 3_000;
    const TOKENS: u64 = 46;
    let patience = Duration::from_secs(env_or("MOVING_PATIENCE_SECS", 30));
    let inner = Arc::new(SimulatedDynamoDb::new());
    let stores: Vec<Leased> = (0..3).map(|_| LeasedBudgetStore::new(inner.clone(), policy.clone())).collect();
    let (mut spent, mut false_429, mut first_false) = (0u64, 0u64, None::<u64>);
    let start = Instant::now();
    let mut i = 0u64;
    loop {
        let environment = (i / 10).min(2) as usize;
        let request = call(format!("moving-{i}"), TOKENS, DAY);
        match stores[environment].reserve(&request).await {
            Ok(ReserveOutcome::Reserved) => {
                stores[environment].settle(&request.reservation(), &actual_of(TOKENS)).await.unwrap();
                spent += TOKENS;
                i += 1;
                continue;
            }
            Ok(ReserveOutcome::Refused { .. }) | Err(_) => {}
        }
        if spent + TOKENS > DAY || start.elapsed() > patience {
            break;
        }
        false_429 += 1;
        first_false.get_or_insert(spent);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = start.elapsed();
    let reached = spent + TOKENS > DAY;
    println!(
        "moving tenant, {name:<6} (slices of {} calls first, {} s life): {false_429} false 429s{}, {}",
        policy.first_calls,
        policy.lease_secs,
        first_false.map(|s| format!(" (the first with {} of {DAY} tokens unspent)", DAY - s)).unwrap_or_default(),
        if reached {
            format!("the cap reached in {:.1} s", elapsed.as_secs_f64())
        } else {
            format!("{} tokens still stranded after {:.0} s", DAY - spent, elapsed.as_secs_f64())
        },
    );
    spent > DAY
}
