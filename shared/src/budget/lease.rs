//! `LeasedBudgetStore`: budget leases over any `BudgetStore`, so that one tenant is not
//! capped by the write rate of one counter item (ARCHITECTURE.md, "Scale").
//!
//! A lease is a reservation on the inner store like a call's, made under a lease id:
//! a *slice* of each limited counter, taken with the inner store's one conditional
//! write. Calls are then reserved and settled against the slice in memory, with no
//! write per call. When the lease ends (a call does not fit it, it goes idle, `flush`)
//! it is settled on the inner store with the usage it served: one write, after which
//! the counters hold exactly what the calls used. Unlimited lines (no limit) are
//! counted the same way and written with that settlement.
//!
//! Invariants:
//! - the hard cap holds: a lease is admitted by the same condition as a call
//!   (`used + slice <= limit`), the counters hold every lease's whole slice until it is
//!   settled, and a call is served from a slice only while the slice holds it (and the
//!   call's own condition holds with the lease's usage counted before it, so a tighter
//!   per-call limit, such as admission's soft guard, is kept too);
//! - once a lease is settled (or reclaimed and its owner's late part charged), its
//!   counters moved by the usage of the calls it served, to the token: ledger = audit;
//! - to a caller this is a `BudgetStore` like any other (the conformance suite runs on
//!   it): a call's reserve, settle, intent and sweep follow the ledger's rules, whether
//!   it was served from a lease or, at the edge, reserved directly on the inner store.
//!
//! A lease never strands budget. It has a short life of its own (`lease_secs`, a few
//! seconds, independent of any call's expiry) and is renewed while it serves: each
//! renewal is one write of the lease's own item (`BudgetStore::renew`), which also
//! records the usage served so far. Its owner returns it after `idle` without a call
//! (the tender, [`LeasedBudgetStore::start`], looks every [`LeasePolicy::tend_every`]:
//! a second by default, half an idle period and a quarter of a life at most). An owner
//! that cannot (a process killed, a Lambda environment frozen after its response)
//! stops renewing it: within `lease_secs` it is expired, and any sweep closes it,
//! charging the usage last recorded and giving the unused slice back. Every instance
//! refused a call sweeps the inner store (at most every `reclaim_every`), so the
//! budget a dead or frozen instance held comes back to the one that needs it within
//! seconds, without waiting for the scheduled sweeper. An owner that finds its lease
//! closed (a renewal or its settlement answers `Unknown`) charges what it served after
//! the last recorded usage, on its own, and takes a new lease: nothing lost, nothing
//! counted twice. A call in flight on a live owner keeps its lease renewed however
//! long it runs (a stream), so a lease is never closed under a running call.
//!
//! Slice policy. A slice is a number of calls' worth of the call that takes the lease:
//! the calls its previous lease served in a lease's life at the rate observed (at
//! least `first_calls`, at most `calls_per_lease`), and at most 1/`share_of_remaining`
//! of the limit, or of the budget seen remaining once a lease was refused (one `used`
//! read, remembered for `hint_ttl`). When even one call's worth is more than that
//! share, the call is reserved directly on the inner store (one write per call at the
//! edge: exact, as without leases). So an instance that serves one call every few
//! seconds holds a few calls' worth, one that serves hundreds a second holds enough
//! for a lease's life, and the instances share what is left near the cap.
//!
//! Runs. A call in a run (a line on a run's counter, [`CounterKey::is_run`]) is
//! always reserved directly, one write per call: a run's `GET` reads its counters on
//! the inner store, which then hold no instance's unused slice, and a call's usage
//! from its settlement on (SPEC §15), not a lease's life later.
//!
//! Crash trade-off. What a dead instance's lease is charged is the usage it recorded:
//! its settled calls since the last recording go uncharged (with `intent_every` zero,
//! none: one renewal per settled call, on the instance's own item, which does not
//! contend). Calls in flight at the crash are refunded, as a vanished call is without
//! leases.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::ledger::SWEPT_RETENTION_SECS;
use super::period::unix_now;
use super::{
    BudgetStore, CounterKey, IntentOutcome, Line, Reservation, ReserveOutcome, ReserveRequest, SettleOutcome,
    StoreError, Swept, ticket,
};

/// The request ids of leases on the inner store start with this.
const LEASE_PREFIX: &str = "lease#";

/// Whether a reservation on a store is a budget lease (not a call): sweeps count
/// leases apart, as their normal end.
pub fn is_lease(request_id: &str) -> bool {
    request_id.starts_with(LEASE_PREFIX)
}

/// How big slices are and how long leases live.
#[derive(Debug, Clone)]
pub struct LeasePolicy {
    /// A slice holds at most this many calls' worth of the call that takes the lease.
    pub calls_per_lease: u64,
    /// Calls' worth of the first lease over a set of counters (no rate observed yet).
    pub first_calls: u64,
    /// A slice takes at most 1/`share_of_remaining` of the limit, and of the budget
    /// seen remaining after a refused lease.
    pub share_of_remaining: u64,
    /// A lease's own life on the inner store, in seconds: renewed while it serves.
    pub lease_secs: u64,
    /// An owner returns a lease that served no call for this long.
    pub idle: Duration,
    /// The lease's usage is written (with its renewal) at most this often on a settle.
    pub intent_every: Duration,
    /// How long the remaining budget read at a refused lease is trusted.
    pub hint_ttl: Duration,
    /// A refused instance sweeps the inner store (closing expired leases) at most this
    /// often.
    pub reclaim_every: Duration,
}

impl LeasePolicy {
    pub const DEFAULT: LeasePolicy = LeasePolicy {
        calls_per_lease: 64,
        first_calls: 4,
        share_of_remaining: 8,
        lease_secs: 4,
        idle: Duration::from_secs(2),
        intent_every: Duration::from_secs(1),
        hint_ttl: Duration::from_secs(1),
        reclaim_every: Duration::from_secs(1),
    };

    /// How often the tender looks: often enough to return an idle lease soon after
    /// `idle`, and to renew a busy one long before it expires.
    pub fn tend_every(&self) -> Duration {
        let quarter_life = Duration::from_secs(self.lease_secs.max(1)) / 4;
        (self.idle / 2).min(quarter_life).max(Duration::from_millis(10))
    }
}

impl Default for LeasePolicy {
    fn default() -> Self {
        LeasePolicy::DEFAULT
    }
}

type Amounts = BTreeMap<CounterKey, u64>;

#[derive(Debug)]
struct Lease {
    /// The lease as reserved on the inner store: its id and `(counter, slice)` lines.
    reservation: Reservation,
    /// The limited counters it serves (its key in `State::open`).
    keyset: Vec<CounterKey>,
    /// Per limited counter: the slice, and the limit it was taken under.
    slices: BTreeMap<CounterKey, (u64, u64)>,
    /// Unix seconds: its expiry on the inner store, as last written.
    expires_at: u64,
    /// Actual usage of the calls settled from it (every counter, limited or not).
    settled: Amounts,
    /// The usage last written on the inner store: what a reclaim charges.
    recorded: Amounts,
    /// Reserved amounts of its calls in flight.
    held: Amounts,
    in_flight: usize,
    /// No new call: it is settled when its last call in flight is.
    draining: bool,
    /// A renewal is on its way: one at a time, and never a close meanwhile, so the
    /// owner always knows what the inner store holds.
    renewing: bool,
    written_at: Instant,
    taken_at: Instant,
    active_at: Instant,
    served: u64,
}

impl Lease {
    fn usage(&self, key: &CounterKey) -> u64 {
        self.settled.get(key).copied().unwrap_or(0).saturating_add(self.held.get(key).copied().unwrap_or(0))
    }

    /// Whether a call (its lines merged per counter) fits what is left of the slices,
    /// while the lease is live on the inner store.
    fn fits(&self, merged: &Merged, now: u64) -> bool {
        if self.draining || now >= self.expires_at {
            return false;
        }
        merged.iter().all(|(key, (amount, limit))| {
            let Some(limit) = limit else { return true };
            let Some((slice, leased_under)) = self.slices.get(*key) else { return false };
            let after = self.usage(key).saturating_add(*amount);
            // Within the slice, and the call's own condition with the lease's earlier
            // calls counted: the counter before the lease was at most
            // `leased_under - slice`.
            after <= *slice && leased_under.saturating_sub(*slice).saturating_add(after) <= *limit
        })
    }

    /// Whether its owner may close it now.
    fn closable(&self) -> bool {
        self.in_flight == 0 && !self.renewing
    }
}

#[derive(Debug)]
struct Call {
    lease: u64,
    lines: Vec<(CounterKey, u64)>,
    expires_at: u64,
    swept: bool,
    intent: Option<Vec<(CounterKey, u64)>>,
}

#[derive(Debug)]
struct Hint {
    remaining: u64,
    at: Instant,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    leases: HashMap<u64, Lease>,
    /// The lease serving new calls, per set of limited counters.
    open: HashMap<Vec<CounterKey>, u64>,
    calls: HashMap<String, Call>,
    hints: HashMap<CounterKey, Hint>,
    /// Calls' worth of the next lease per set of counters, from the last one's rate.
    sizes: HashMap<Vec<CounterKey>, u64>,
    reclaimed_at: Option<Instant>,
}

impl State {
    /// Takes a lease out of the state: no new call is served from it.
    fn take(&mut self, number: u64) -> Option<Lease> {
        let lease = self.leases.remove(&number)?;
        if self.open.get(&lease.keyset) == Some(&number) {
            self.open.remove(&lease.keyset);
        }
        Some(lease)
    }

    /// The renewals due at `now`: every lease not being renewed whose life is half
    /// gone, or of which `also` says so; each marked renewing.
    fn renewals(&mut self, now: u64, policy: &LeasePolicy, also: impl Fn(&Lease) -> bool) -> Vec<Write> {
        let due: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| !l.renewing && (l.expires_at.saturating_sub(now) <= policy.lease_secs / 2 || also(l)))
            .map(|(n, _)| *n)
            .collect();
        due.into_iter().filter_map(|n| renewal(self, n, now + policy.lease_secs)).collect()
    }

    /// Takes a lease out to be closed, remembering its rate for the next one.
    fn end(&mut self, number: u64, policy: &LeasePolicy) -> Option<Write> {
        let lease = self.take(number)?;
        let age_ms = lease.taken_at.elapsed().as_millis().max(1);
        let life_ms = u128::from(policy.lease_secs).saturating_mul(1000);
        let at_rate = u128::from(lease.served).saturating_mul(life_ms) / age_ms;
        let next = u64::try_from(at_rate).unwrap_or(u64::MAX).clamp(policy.first_calls.max(1), policy.calls_per_lease);
        self.sizes.insert(lease.keyset.clone(), next);
        Some(close(lease))
    }
}

/// A write to the inner store, decided under the lock and sent after it.
#[derive(Debug)]
enum Write {
    /// Settle a lease on the usage it served (`recorded`: what a reclaim charged).
    Close { lease: Reservation, actual: Vec<(CounterKey, u64)>, recorded: Vec<(CounterKey, u64)> },
    /// Renew a lease, with its usage so far for the sweeper.
    Renew { number: u64, lease_id: String, actual: Vec<(CounterKey, u64)>, expires_at: u64 },
    /// Charge usage whose reservation is gone: a call swept after its lease closed, or
    /// what a reclaimed lease served after its last renewal.
    Charge { request_id: String, actual: Vec<(CounterKey, u64)>, expires_at: u64 },
}

/// A call's lines per counter: the summed amount and the tightest limit.
type Merged<'a> = BTreeMap<&'a CounterKey, (u64, Option<u64>)>;

fn merge(lines: &[Line]) -> Merged<'_> {
    let mut merged: Merged = BTreeMap::new();
    for line in lines {
        let (amount, limit) = merged.entry(&line.key).or_default();
        *amount = amount.saturating_add(line.amount);
        *limit = match (*limit, line.limit) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    merged
}

fn add(into: &mut Amounts, lines: &[(CounterKey, u64)]) {
    for (key, amount) in lines {
        let value = into.entry(key.clone()).or_default();
        *value = value.saturating_add(*amount);
    }
}

fn sub(from: &mut Amounts, lines: &[(CounterKey, u64)]) {
    for (key, amount) in lines {
        if let Some(value) = from.get_mut(key) {
            *value = value.saturating_sub(*amount);
        }
    }
}

fn lines_of(amounts: &Amounts) -> Vec<(CounterKey, u64)> {
    amounts.iter().filter(|(_, v)| **v > 0).map(|(k, v)| (k.clone(), *v)).collect()
}

/// `actual` less `recorded`, per counter.
fn beyond(actual: &[(CounterKey, u64)], recorded: &[(CounterKey, u64)]) -> Vec<(CounterKey, u64)> {
    let mut rest = Amounts::new();
    add(&mut rest, actual);
    sub(&mut rest, recorded);
    lines_of(&rest)
}

/// A `BudgetStore` that serves calls from leased slices of the inner store's budgets.
/// Several instances (processes, Lambda environments) may share one inner store.
pub struct LeasedBudgetStore<S> {
    inner: Arc<S>,
    policy: LeasePolicy,
    /// Names this instance's leases on the inner store.
    instance: String,
    state: Mutex<State>,
    /// One lease taken at a time per instance; calls that fit never wait on it.
    acquiring: tokio::sync::Mutex<()>,
    /// Unix seconds, as the inner store's expiries count them.
    clock: fn() -> u64,
}

impl<S: BudgetStore + 'static> LeasedBudgetStore<S> {
    /// A store with no tender: its leases are renewed and returned only by its calls,
    /// its sweeps and `tend` (tests drive it by hand). Serving uses [`Self::start`].
    pub fn new(inner: Arc<S>, policy: LeasePolicy) -> Self {
        LeasedBudgetStore {
            inner,
            policy,
            instance: uuid::Uuid::new_v4().simple().to_string(),
            state: Mutex::new(State::default()),
            acquiring: tokio::sync::Mutex::new(()),
            clock: unix_now,
        }
    }

    /// The same store on another clock: tests whose reservations expire at fixed
    /// times keep its leases and reclaims on that time.
    pub fn with_clock(self, clock: fn() -> u64) -> Self {
        LeasedBudgetStore { clock, ..self }
    }

    /// The store, with its tender running on the current runtime every
    /// [`LeasePolicy::tend_every`] until the store is dropped.
    pub fn start(inner: Arc<S>, policy: LeasePolicy) -> Arc<Self> {
        let store = Arc::new(Self::new(inner, policy));
        let every = store.policy.tend_every();
        let tended = Arc::downgrade(&store);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(store) = tended.upgrade() else { return };
                store.tend().await;
            }
        });
        store
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// A poisoned lock still holds consistent state: every change under it is made
    /// whole before anything can panic.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Returns the leases idle for `idle`, and renews the others when half their life
    /// is gone or their usage was not written for `intent_every`.
    pub async fn tend(&self) {
        let now = (self.clock)();
        let writes = {
            let mut state = self.state();
            let policy = &self.policy;
            let idle: Vec<u64> = state
                .leases
                .iter()
                .filter(|(_, l)| {
                    l.closable() && (l.draining || l.expires_at <= now || l.active_at.elapsed() >= policy.idle)
                })
                .map(|(n, _)| *n)
                .collect();
            let mut writes: Vec<Write> = idle.iter().filter_map(|n| state.end(*n, policy)).collect();
            // Renewed at half its life, or sooner when it has usage the inner store
            // does not hold yet: what a crash loses is bounded by `intent_every`.
            writes.extend(state.renewals(now, policy, |l| {
                l.written_at.elapsed() >= policy.intent_every && lines_of(&l.settled) != lines_of(&l.recorded)
            }));
            writes
        };
        self.apply(writes).await;
    }

    /// Settles every lease with no call in flight, and ends the others when their last
    /// call is settled: after it, the inner store's counters hold exactly the usage
    /// served (for a shutdown, and for tests and benchmarks that compare the ledger).
    pub async fn flush(&self) {
        let writes = {
            let mut state = self.state();
            state.open.clear();
            for lease in state.leases.values_mut() {
                lease.draining = true;
            }
            let idle: Vec<u64> = state.leases.iter().filter(|(_, l)| l.closable()).map(|(n, _)| *n).collect();
            idle.iter().filter_map(|n| state.end(*n, &self.policy)).collect()
        };
        self.apply(writes).await;
    }

    /// Serves the call from this instance's memory if it can: already reserved
    /// (idempotency), or it fits its lease.
    fn serve_locally(&self, request: &ReserveRequest, merged: &Merged, keyset: &[CounterKey], now: u64) -> bool {
        let mut state = self.state();
        if state.calls.contains_key(&request.request_id) {
            return true;
        }
        let Some(number) = state.open.get(keyset).copied() else { return false };
        let Some(lease) = state.leases.get_mut(&number) else { return false };
        if !lease.fits(merged, now) {
            return false;
        }
        let lines: Vec<(CounterKey, u64)> = request.lines.iter().map(|l| (l.key.clone(), l.amount)).collect();
        add(&mut lease.held, &lines);
        lease.in_flight += 1;
        lease.served += 1;
        lease.active_at = Instant::now();
        state.calls.insert(
            request.request_id.clone(),
            Call { lease: number, lines, expires_at: request.expires_at, swept: false, intent: None },
        );
        true
    }

    /// Ends the lease serving `keyset`: settled now if it can be, else when its last
    /// call is (or its renewal answers).
    fn retire(&self, keyset: &[CounterKey]) -> Vec<Write> {
        let mut state = self.state();
        let Some(number) = state.open.remove(keyset) else { return Vec::new() };
        match state.leases.get_mut(&number) {
            Some(lease) if !lease.closable() => {
                lease.draining = true;
                Vec::new()
            }
            Some(_) => state.end(number, &self.policy).into_iter().collect(),
            None => Vec::new(),
        }
    }

    /// Calls' worth a new slice may hold: the rate observed, within a share of each
    /// limit and of what a recent read says is left (0: reserve the call directly).
    fn calls_for(&self, merged: &Merged, keyset: &[CounterKey]) -> u64 {
        let state = self.state();
        let policy = &self.policy;
        let share = policy.share_of_remaining.max(1);
        let rate = state.sizes.get(keyset).copied().unwrap_or(policy.first_calls).min(policy.calls_per_lease);
        merged
            .iter()
            .filter_map(|(key, (amount, limit))| Some((key, amount.max(&1).saturating_mul(share), (*limit)?)))
            .map(|(key, per_call, limit)| {
                let remaining = state.hints.get(*key).filter(|h| h.at.elapsed() < policy.hint_ttl);
                remaining.map_or(limit, |h| h.remaining.min(limit)) / per_call
            })
            .fold(rate, u64::min)
    }

    /// Reads the limited counters after a refused lease; returns the calls' worth the
    /// slices may hold now.
    async fn read_remaining(&self, merged: &Merged<'_>, keyset: &[CounterKey]) -> Result<u64, StoreError> {
        let limited: Vec<(&CounterKey, u64)> =
            merged.iter().filter_map(|(key, (_, limit))| limit.map(|l| (*key, l))).collect();
        let keys: Vec<CounterKey> = limited.iter().map(|(k, _)| (*k).clone()).collect();
        let used = self.inner.used(&keys).await?;
        {
            let mut state = self.state();
            let at = Instant::now();
            for ((key, limit), used) in limited.iter().zip(used) {
                state.hints.insert((*key).clone(), Hint { remaining: limit.saturating_sub(used), at });
            }
        }
        Ok(self.calls_for(merged, keyset))
    }

    fn spend_hints(&self, amounts: &[(CounterKey, u64)]) {
        let mut state = self.state();
        for (key, amount) in amounts {
            if let Some(hint) = state.hints.get_mut(key) {
                hint.remaining = hint.remaining.saturating_sub(*amount);
            }
        }
    }

    /// Takes a lease of `calls` calls' worth of this call, the call served from it.
    /// `false`: the inner store refused it, nothing was written.
    async fn take_lease(
        &self,
        request: &ReserveRequest,
        merged: &Merged<'_>,
        keyset: &[CounterKey],
        calls: u64,
    ) -> Result<bool, StoreError> {
        let number = {
            let mut state = self.state();
            state.next += 1;
            state.next
        };
        let lines: Vec<Line> = merged
            .iter()
            .filter_map(|(key, (amount, limit))| {
                limit.map(|limit| Line {
                    key: (*key).clone(),
                    amount: amount.saturating_mul(calls),
                    limit: Some(limit),
                })
            })
            .collect();
        let lease = ReserveRequest {
            request_id: format!("{LEASE_PREFIX}{}#{number}", self.instance),
            lines,
            expires_at: (self.clock)().saturating_add(self.policy.lease_secs),
        };
        if self.inner.reserve(&lease).await? != ReserveOutcome::Reserved {
            return Ok(false);
        }
        let reservation = lease.reservation();
        self.spend_hints(&reservation.lines);
        let call: Vec<(CounterKey, u64)> = request.lines.iter().map(|l| (l.key.clone(), l.amount)).collect();
        let mut held = Amounts::new();
        add(&mut held, &call);
        let at = Instant::now();
        let mut state = self.state();
        state.leases.insert(
            number,
            Lease {
                slices: lease.lines.iter().map(|l| (l.key.clone(), (l.amount, l.limit.unwrap_or(u64::MAX)))).collect(),
                keyset: keyset.to_vec(),
                reservation,
                expires_at: lease.expires_at,
                settled: Amounts::new(),
                recorded: Amounts::new(),
                held,
                in_flight: 1,
                draining: false,
                renewing: false,
                written_at: at,
                taken_at: at,
                active_at: at,
                served: 1,
            },
        );
        state.open.insert(keyset.to_vec(), number);
        state.calls.insert(
            request.request_id.clone(),
            Call { lease: number, lines: call, expires_at: request.expires_at, swept: false, intent: None },
        );
        Ok(true)
    }

    /// Sweeps the inner store, which closes the expired leases of instances gone or
    /// frozen, when this instance did not do so within `reclaim_every`. Whether it
    /// closed anything.
    async fn reclaim(&self) -> bool {
        {
            let mut state = self.state();
            if state.reclaimed_at.is_some_and(|at| at.elapsed() < self.policy.reclaim_every) {
                return false;
            }
            state.reclaimed_at = Some(Instant::now());
        }
        match self.inner.sweep((self.clock)()).await {
            // Closing another instance's lease is what a reclaim is for: it frees
            // budget as a refund does.
            Ok(swept) => swept.refunded + swept.charged + swept.leases > 0,
            Err(e) => {
                tracing::warn!(error = %e, "reclaiming expired leases failed");
                false
            }
        }
    }

    /// Replaces a local call's reservation by `actual` (its lease's usage moves), or
    /// charges it alone if its lease is gone. `None`: not a call of this instance's
    /// leases.
    fn finish(
        &self,
        state: &mut State,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        now: u64,
    ) -> Option<(SettleOutcome, Vec<Write>)> {
        let call = state.calls.remove(request_id)?;
        let Some(lease) = state.leases.get_mut(&call.lease) else {
            // A lease ends with its last call in flight, so only a call swept here, or
            // one whose lease was reclaimed under it, outlives its lease: its hold was
            // returned with the lease, its usage is charged on its own.
            let charge = Write::Charge {
                request_id: request_id.to_owned(),
                actual: actual.to_vec(),
                expires_at: call.expires_at,
            };
            return Some((SettleOutcome::ChargedAfterSweep, vec![charge]));
        };
        if !call.swept {
            sub(&mut lease.held, &call.lines);
            lease.in_flight = lease.in_flight.saturating_sub(1);
        }
        add(&mut lease.settled, actual);
        lease.active_at = Instant::now();
        let outcome = if call.swept { SettleOutcome::ChargedAfterSweep } else { SettleOutcome::Settled };
        let mut writes = Vec::new();
        let (closable, draining) = (lease.closable(), lease.draining);
        let due = !lease.renewing && lease.written_at.elapsed() >= self.policy.intent_every;
        if draining && closable {
            writes.extend(state.end(call.lease, &self.policy));
        } else if due {
            writes.extend(renewal(state, call.lease, now + self.policy.lease_secs));
        }
        Some((outcome, writes))
    }

    /// What the inner store answered to a renewal. A lease it no longer holds was
    /// reclaimed (its recorded usage charged, its slice given back): what it served
    /// since is charged now, and its calls in flight are charged on their own.
    fn renewed(
        &self,
        number: u64,
        answer: Result<IntentOutcome, StoreError>,
        actual: Vec<(CounterKey, u64)>,
        expires_at: u64,
    ) -> Vec<Write> {
        let mut state = self.state();
        let Some(lease) = state.leases.get_mut(&number) else { return Vec::new() };
        lease.renewing = false;
        match answer {
            Ok(IntentOutcome::Recorded) => {
                lease.recorded = actual.into_iter().collect();
                lease.expires_at = expires_at;
                lease.written_at = Instant::now();
            }
            Ok(IntentOutcome::Unknown) => {
                let Some(lease) = state.take(number) else { return Vec::new() };
                let (settled, recorded) = (lines_of(&lease.settled), lines_of(&lease.recorded));
                return self.reclaimed(lease.reservation.request_id, &settled, &recorded).into_iter().collect();
            }
            Err(e) => {
                let lease_id = &lease.reservation.request_id;
                tracing::warn!(lease_id, error = %e, "renewing a lease failed; the tender tries again");
            }
        }
        let closable = state.leases.get(&number).is_some_and(|l| l.draining && l.closable());
        if closable { state.end(number, &self.policy).into_iter().collect() } else { Vec::new() }
    }

    /// A lease its owner finds closed (a renewal or its settlement answered
    /// `Unknown`): the sweep that reclaimed it charged the usage `recorded` on it; the
    /// rest of what it `settled` is charged on its own.
    fn reclaimed(
        &self,
        lease_id: String,
        settled: &[(CounterKey, u64)],
        recorded: &[(CounterKey, u64)],
    ) -> Option<Write> {
        tracing::info!(lease_id, "lease reclaimed while its owner was away: what it served since is charged now");
        let rest = beyond(settled, recorded);
        let expires_at = (self.clock)() + self.policy.lease_secs;
        (!rest.is_empty()).then_some(Write::Charge { request_id: lease_id, actual: rest, expires_at })
    }

    async fn apply(&self, writes: Vec<Write>) {
        let inner: &dyn BudgetStore = self.inner.as_ref();
        let mut queue = VecDeque::from(writes);
        while let Some(write) = queue.pop_front() {
            match write {
                Write::Close { lease, actual, recorded } => match ticket::settle(inner, &lease, &actual).await {
                    // Reclaimed meanwhile: the sweep charged what was recorded.
                    Some(SettleOutcome::Unknown) => queue.extend(self.reclaimed(lease.request_id, &actual, &recorded)),
                    Some(SettleOutcome::ChargedAfterSweep) => {
                        let lease_id = lease.request_id;
                        tracing::info!(
                            lease_id,
                            "lease refunded by a sweep while its owner was away; its usage charged now"
                        );
                    }
                    Some(SettleOutcome::Settled) | None => {}
                },
                Write::Renew { number, lease_id, actual, expires_at } => {
                    let answer = inner.renew(&lease_id, &actual, expires_at).await;
                    queue.extend(self.renewed(number, answer, actual, expires_at));
                }
                Write::Charge { request_id, actual, expires_at } => {
                    // A reservation of the usage itself, unlimited, settled on it: the
                    // counters move by `actual`, through the ledger's own rules.
                    let late = ReserveRequest {
                        request_id: format!("{request_id}#late"),
                        lines: actual
                            .iter()
                            .map(|(key, amount)| Line { key: key.clone(), amount: *amount, limit: None })
                            .collect(),
                        expires_at: expires_at.saturating_add(SWEPT_RETENTION_SECS),
                    };
                    match inner.reserve(&late).await {
                        Ok(_) => {
                            ticket::settle(inner, &late.reservation(), &actual).await;
                        }
                        Err(e) => {
                            tracing::error!(request_id, ?actual, error = %e, "a late settlement could not be charged")
                        }
                    }
                }
            }
        }
    }
}

impl<S: BudgetStore + 'static> LeasedBudgetStore<S> {
    /// Serves the call from a lease: the open one, or a new one. `false`: no lease
    /// holds it (the edge), nothing was reserved for it.
    async fn reserve_from_lease(&self, request: &ReserveRequest) -> Result<bool, StoreError> {
        let merged = merge(&request.lines);
        let keyset: Vec<CounterKey> =
            merged.iter().filter(|(_, (_, limit))| limit.is_some()).map(|(k, _)| (*k).clone()).collect();
        if self.serve_locally(request, &merged, &keyset, (self.clock)()) {
            return Ok(true);
        }
        let _acquiring = self.acquiring.lock().await;
        // Another call may have taken a lease while this one waited.
        if self.serve_locally(request, &merged, &keyset, (self.clock)()) {
            return Ok(true);
        }
        let retired = self.retire(&keyset);
        self.apply(retired).await;
        let calls = self.calls_for(&merged, &keyset);
        if calls == 0 {
            return Ok(false);
        }
        if self.take_lease(request, &merged, &keyset, calls).await? {
            return Ok(true);
        }
        let calls = self.read_remaining(&merged, &keyset).await?;
        Ok(calls > 0 && self.take_lease(request, &merged, &keyset, calls).await?)
    }
}

fn close(lease: Lease) -> Write {
    Write::Close { actual: lines_of(&lease.settled), recorded: lines_of(&lease.recorded), lease: lease.reservation }
}

/// Marks the lease renewing, and the renewal: until `expires_at`, with what the
/// sweeper should charge if this instance vanished now (the usage settled, and the
/// intents of its calls whose settlement failed).
fn renewal(state: &mut State, number: u64, expires_at: u64) -> Option<Write> {
    let lease = state.leases.get_mut(&number)?;
    lease.renewing = true;
    let mut actual = lease.settled.clone();
    let lease_id = lease.reservation.request_id.clone();
    for call in state.calls.values().filter(|c| c.lease == number) {
        if let Some(intent) = &call.intent {
            add(&mut actual, intent);
        }
    }
    Some(Write::Renew { number, lease_id, actual: lines_of(&actual), expires_at })
}

#[async_trait::async_trait]
impl<S: BudgetStore + 'static> BudgetStore for LeasedBudgetStore<S> {
    /// A call in a run (a line on a run's counter) is reserved directly on the inner
    /// store, never from a lease: a run's `GET` reads the inner counters, which then
    /// hold no other instance's slice, and its usage as soon as it is settled.
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        if !request.lines.iter().any(|line| line.key.is_run()) && self.reserve_from_lease(request).await? {
            return Ok(ReserveOutcome::Reserved);
        }
        // At the edge: the call's own reservation, exact; once more if the leases of
        // instances gone or frozen were reclaimed meanwhile.
        let mut outcome = self.inner.reserve(request).await?;
        if outcome != ReserveOutcome::Reserved && self.reclaim().await {
            outcome = self.inner.reserve(request).await?;
        }
        if outcome == ReserveOutcome::Reserved {
            self.spend_hints(&request.reservation().lines);
        }
        Ok(outcome)
    }

    /// A call served from a lease settles in memory (its lease's usage moves); one
    /// reserved directly settles on the inner store.
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        let finished = {
            let mut state = self.state();
            self.finish(&mut state, &reservation.request_id, actual, (self.clock)())
        };
        let Some((outcome, writes)) = finished else {
            return self.inner.settle(reservation, actual).await;
        };
        self.apply(writes).await;
        Ok(outcome)
    }

    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        {
            let mut state = self.state();
            if let Some(call) = state.calls.get_mut(request_id) {
                call.intent = Some(actual.to_vec());
                return Ok(IntentOutcome::Recorded);
            }
        }
        self.inner.record_intent(request_id, actual).await
    }

    /// A call served from a lease lives in this instance's memory: its expiry moves
    /// there (its lease is renewed on its own). Any other is renewed on the inner store.
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        {
            let mut state = self.state();
            if let Some(call) = state.calls.get_mut(request_id) {
                if call.swept {
                    return Ok(IntentOutcome::Unknown);
                }
                call.intent = Some(actual.to_vec());
                call.expires_at = expires_at;
                return Ok(IntentOutcome::Recorded);
            }
        }
        self.inner.renew(request_id, actual, expires_at).await
    }

    /// Sweeps this instance's calls by the ledger's rules, settles its expired leases,
    /// then sweeps the inner store (which closes the leases of vanished instances:
    /// charged their recorded usage, or refunded).
    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        let mut swept = Swept::default();
        let writes = {
            let mut state = self.state();
            let expired: Vec<String> =
                state.calls.iter().filter(|(_, c)| c.expires_at < now).map(|(id, _)| id.clone()).collect();
            let mut writes = Vec::new();
            for id in expired {
                let Some(call) = state.calls.get_mut(&id) else { continue };
                if let Some(intent) = call.intent.take() {
                    if let Some((_, more)) = self.finish(&mut state, &id, &intent, now) {
                        writes.extend(more);
                    }
                    swept.charged += 1;
                } else if !call.swept {
                    call.swept = true;
                    let (number, lines) = (call.lease, call.lines.clone());
                    if let Some(lease) = state.leases.get_mut(&number) {
                        sub(&mut lease.held, &lines);
                        lease.in_flight = lease.in_flight.saturating_sub(1);
                    }
                    swept.refunded += 1;
                } else if call.expires_at.saturating_add(SWEPT_RETENTION_SECS) < now {
                    state.calls.remove(&id);
                }
            }
            let ended: Vec<u64> = state
                .leases
                .iter()
                .filter(|(_, l)| l.closable() && (l.draining || l.expires_at < now))
                .map(|(n, _)| *n)
                .collect();
            writes.extend(ended.iter().filter_map(|n| state.end(*n, &self.policy)));
            // A lease still serving is renewed past this sweep's `now` first: the
            // inner sweep closes only the leases of instances gone or frozen.
            writes.extend(state.renewals(now, &self.policy, |_| false));
            writes
        };
        self.apply(writes).await;
        let inner = self.inner.sweep(now).await?;
        swept.refunded += inner.refunded;
        swept.charged += inner.charged;
        swept.leases += inner.leases;
        Ok(swept)
    }

    /// The inner counters as if every lease were settled now: less the unused part of
    /// this instance's slices, plus the usage it has not written yet. Other instances'
    /// leases count whole.
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        let used = self.inner.used(keys).await?;
        let state = self.state();
        Ok(keys
            .iter()
            .zip(used)
            .map(|(key, used)| {
                state.leases.values().fold(used, |value, lease| {
                    let slice = lease.slices.get(key).map_or(0, |(slice, _)| *slice);
                    value.saturating_add(lease.usage(key)).saturating_sub(slice)
                })
            })
            .collect())
    }

    /// Calls live on this instance and on the inner store; its own leases are not
    /// calls.
    async fn live_reservations(&self) -> Result<usize, StoreError> {
        let inner = self.inner.live_reservations().await?;
        let state = self.state();
        let local = state.calls.values().filter(|c| !c.swept).count();
        Ok(inner.saturating_sub(state.leases.len()) + local)
    }
    /// Runs are records, never leased: the inner store holds them.
    async fn create_run(&self, run: &super::Run) -> Result<bool, StoreError> {
        self.inner.create_run(run).await
    }
    async fn run(&self, id: &str) -> Result<Option<super::Run>, StoreError> {
        self.inner.run(id).await
    }
    async fn end_run(&self, id: &str, at: u64) -> Result<super::RunEnd, StoreError> {
        self.inner.end_run(id, at).await
    }
}
