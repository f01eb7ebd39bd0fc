//! `LeasedBudgetStore`: budget leases over any `BudgetStore`, so that one tenant is not
//! capped by the write rate of one counter item (ARCHITECTURE.md, "Scale").
//!
//! A lease is a reservation on the inner store like a call's, made under a lease id:
//! a *slice* of each limited counter, taken with the inner store's one conditional
//! write. Calls are then reserved and settled against the slice in memory, with no
//! write per call. When the lease ends (a call does not fit it, it nears its expiry,
//! the sweep, `flush`) it is settled on the inner store with the usage it served: one
//! write, after which the counters hold exactly what the calls used. Unlimited lines
//! (no limit) are counted the same way and written with that settlement.
//!
//! Invariants:
//! - the hard cap holds: a lease is admitted by the same condition as a call
//!   (`used + slice <= limit`), the counters hold every lease's whole slice until it is
//!   settled, and a call is served from a slice only while the slice holds it (and the
//!   call's own condition holds with the lease's usage counted before it, so a tighter
//!   per-call limit, such as admission's soft guard, is kept too);
//! - once a lease is settled, its counters moved by the usage of the calls it served,
//!   to the token: ledger = audit;
//! - to a caller this is a `BudgetStore` like any other (the conformance suite runs on
//!   it): a call's reserve, settle, intent and sweep follow the ledger's rules, whether
//!   it was served from a lease or, at the edge, reserved directly on the inner store.
//!
//! Slice policy. A slice is a number of calls' worth of the call that takes the lease:
//! `calls_per_lease` (64) at most, and at most 1/`share_of_remaining` (1/8) of the
//! budget seen remaining on each line, so slices shrink as a budget nears its cap and
//! the instances share what is left. The remaining budget is read only when a lease
//! is refused (one `used` read), and remembered for `hint_ttl`; when even one call's
//! worth is more than that share, the call is reserved directly on the inner store
//! (one write per call at the edge: exact, as without leases). Near the cap a call
//! may be refused while another instance's lease still holds unused budget: at most
//! a few calls' worth per instance, returned when that lease ends.
//!
//! Crash trade-off. An instance that dies (or a Lambda environment frozen past the
//! lease's expiry) leaves its lease on the inner store. Its usage so far is recorded
//! on the lease as a settle intent (`record_intent`: one write of the lease's own item,
//! never of a counter) at most every `intent_every` (1 s), so the sweeper *charges*
//! the lease at its expiry instead of refunding it. What is lost is bounded: the usage
//! of the calls that instance settled since its last intent goes uncharged (with
//! `intent_every` zero, none: one intent write per call, on the instance's own item,
//! which does not contend). Calls in flight at the crash are refunded, as a vanished
//! call is without leases. A lease lives `lease_secs` past the expiry of the call that
//! took it and serves only calls that expire before it does, so the sweeper never
//! closes a lease under a running call.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::ledger::SWEPT_RETENTION_SECS;
use super::{
    BudgetStore, CounterKey, IntentOutcome, Line, Reservation, ReserveOutcome, ReserveRequest, SettleOutcome,
    StoreError, Swept, ticket,
};

/// How big slices are and how long leases live.
#[derive(Debug, Clone)]
pub struct LeasePolicy {
    /// A slice holds at most this many calls' worth of the call that takes the lease.
    pub calls_per_lease: u64,
    /// A slice takes at most 1/`share_of_remaining` of the budget seen remaining.
    pub share_of_remaining: u64,
    /// A lease expires this long after the call that took it.
    pub lease_secs: u64,
    /// The lease's usage is recorded as its settle intent at most this often.
    pub intent_every: Duration,
    /// How long the remaining budget read at a refused lease is trusted.
    pub hint_ttl: Duration,
}

impl Default for LeasePolicy {
    fn default() -> Self {
        LeasePolicy {
            calls_per_lease: 64,
            share_of_remaining: 8,
            lease_secs: 60,
            intent_every: Duration::from_secs(1),
            hint_ttl: Duration::from_secs(1),
        }
    }
}

type Amounts = BTreeMap<CounterKey, u64>;

#[derive(Debug)]
struct Lease {
    /// The lease as reserved on the inner store: its id and `(counter, slice)` lines.
    reservation: Reservation,
    /// Per limited counter: the slice, and the limit it was taken under.
    slices: BTreeMap<CounterKey, (u64, u64)>,
    expires_at: u64,
    /// Actual usage of the calls settled from it (every counter, limited or not).
    settled: Amounts,
    /// Reserved amounts of its calls in flight.
    held: Amounts,
    in_flight: usize,
    /// No new call: it is settled when its last call in flight is.
    draining: bool,
    intent_at: Instant,
}

impl Lease {
    fn usage(&self, key: &CounterKey) -> u64 {
        self.settled.get(key).copied().unwrap_or(0).saturating_add(self.held.get(key).copied().unwrap_or(0))
    }

    /// Whether a call (its lines merged per counter) fits what is left of the slices.
    fn fits(&self, merged: &Merged, expires_at: u64) -> bool {
        if self.draining || expires_at > self.expires_at {
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
}

/// A write to the inner store, decided under the lock and sent after it.
#[derive(Debug)]
enum Write {
    /// Settle a lease on the usage it served.
    Close { lease: Reservation, actual: Vec<(CounterKey, u64)> },
    /// Leave a lease's usage so far on it, for the sweeper.
    Intent { lease_id: String, actual: Vec<(CounterKey, u64)> },
    /// Charge the late settlement of a call swept after its lease was closed.
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

/// A `BudgetStore` that serves calls from leased slices of the inner store's budgets.
/// Several instances (processes, Lambda environments) may share one inner store.
pub struct LeasedBudgetStore<S> {
    inner: std::sync::Arc<S>,
    policy: LeasePolicy,
    /// Names this instance's leases on the inner store.
    instance: String,
    state: Mutex<State>,
    /// One lease taken at a time per instance; calls that fit never wait on it.
    acquiring: tokio::sync::Mutex<()>,
}

impl<S: BudgetStore + 'static> LeasedBudgetStore<S> {
    pub fn new(inner: std::sync::Arc<S>, policy: LeasePolicy) -> Self {
        LeasedBudgetStore {
            inner,
            policy,
            instance: uuid::Uuid::new_v4().simple().to_string(),
            state: Mutex::new(State::default()),
            acquiring: tokio::sync::Mutex::new(()),
        }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// A poisoned lock still holds consistent state: every change under it is made
    /// whole before anything can panic.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Settles every lease with no call in flight, and ends the others when their last
    /// call is settled: after it, the inner store's counters hold exactly the usage
    /// served (for a shutdown, and for tests and benchmarks that compare the ledger).
    pub async fn flush(&self) {
        let writes = {
            let mut state = self.state();
            state.open.clear();
            let idle: Vec<u64> = state.leases.iter().filter(|(_, l)| l.in_flight == 0).map(|(n, _)| *n).collect();
            for lease in state.leases.values_mut() {
                lease.draining = true;
            }
            idle.iter().filter_map(|n| state.leases.remove(n)).map(close).collect()
        };
        self.apply(writes).await;
    }

    /// Serves the call from this instance's memory if it can: already reserved
    /// (idempotency), or it fits its lease.
    fn serve_locally(&self, request: &ReserveRequest, merged: &Merged, keyset: &[CounterKey]) -> bool {
        let mut state = self.state();
        if state.calls.contains_key(&request.request_id) {
            return true;
        }
        let Some(number) = state.open.get(keyset).copied() else { return false };
        let Some(lease) = state.leases.get_mut(&number) else { return false };
        if !lease.fits(merged, request.expires_at) {
            return false;
        }
        let lines: Vec<(CounterKey, u64)> = request.lines.iter().map(|l| (l.key.clone(), l.amount)).collect();
        add(&mut lease.held, &lines);
        lease.in_flight += 1;
        state.calls.insert(
            request.request_id.clone(),
            Call { lease: number, lines, expires_at: request.expires_at, swept: false, intent: None },
        );
        true
    }

    /// Ends the lease serving `keyset`: settled now if idle, else when its last call is.
    fn retire(&self, keyset: &[CounterKey]) -> Vec<Write> {
        let mut state = self.state();
        let Some(number) = state.open.remove(keyset) else { return Vec::new() };
        match state.leases.get_mut(&number) {
            Some(lease) if lease.in_flight > 0 => {
                lease.draining = true;
                Vec::new()
            }
            Some(_) => state.leases.remove(&number).map(close).into_iter().collect(),
            None => Vec::new(),
        }
    }

    /// Calls' worth a new slice may hold: the most, unless a recent read says the
    /// budget left is short (0: reserve the call directly).
    fn calls_for(&self, merged: &Merged) -> u64 {
        let state = self.state();
        let ttl = self.policy.hint_ttl;
        merged
            .iter()
            .filter(|(_, (_, limit))| limit.is_some())
            .filter_map(|(key, (amount, _))| {
                let hint = state.hints.get(*key).filter(|h| h.at.elapsed() < ttl)?;
                let per_call = amount.max(&1).saturating_mul(self.policy.share_of_remaining.max(1));
                Some(hint.remaining / per_call)
            })
            .fold(self.policy.calls_per_lease, u64::min)
    }

    /// Reads the limited counters after a refused lease; returns the calls' worth the
    /// slices may hold now.
    async fn read_remaining(&self, merged: &Merged<'_>) -> Result<u64, StoreError> {
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
        Ok(self.calls_for(merged))
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
            request_id: format!("lease#{}#{number}", self.instance),
            lines,
            expires_at: request.expires_at.saturating_add(self.policy.lease_secs),
        };
        if self.inner.reserve(&lease).await? != ReserveOutcome::Reserved {
            return Ok(false);
        }
        let reservation = lease.reservation();
        self.spend_hints(&reservation.lines);
        let call: Vec<(CounterKey, u64)> = request.lines.iter().map(|l| (l.key.clone(), l.amount)).collect();
        let mut held = Amounts::new();
        add(&mut held, &call);
        let mut state = self.state();
        state.leases.insert(
            number,
            Lease {
                slices: lease.lines.iter().map(|l| (l.key.clone(), (l.amount, l.limit.unwrap_or(u64::MAX)))).collect(),
                reservation,
                expires_at: lease.expires_at,
                settled: Amounts::new(),
                held,
                in_flight: 1,
                draining: false,
                intent_at: Instant::now(),
            },
        );
        state.open.insert(keyset.to_vec(), number);
        state.calls.insert(
            request.request_id.clone(),
            Call { lease: number, lines: call, expires_at: request.expires_at, swept: false, intent: None },
        );
        Ok(true)
    }

    /// Replaces a local call's reservation by `actual` (its lease's usage moves), or
    /// charges it alone if it was swept. `None`: not a call of this instance's leases.
    fn finish(
        &self,
        state: &mut State,
        request_id: &str,
        actual: &[(CounterKey, u64)],
    ) -> Option<(SettleOutcome, Vec<Write>)> {
        let call = state.calls.remove(request_id)?;
        let Some(lease) = state.leases.get_mut(&call.lease) else {
            // Only a swept call outlives its lease (a lease ends with its last call in
            // flight): its late settlement is charged on its own.
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
        let outcome = if call.swept { SettleOutcome::ChargedAfterSweep } else { SettleOutcome::Settled };
        let mut writes = Vec::new();
        if lease.draining && lease.in_flight == 0 {
            writes.extend(state.leases.remove(&call.lease).map(close));
        } else if lease.intent_at.elapsed() >= self.policy.intent_every {
            lease.intent_at = Instant::now();
            writes.push(intent(state, call.lease));
        }
        Some((outcome, writes))
    }

    async fn apply(&self, writes: Vec<Write>) {
        let inner: &dyn BudgetStore = self.inner.as_ref();
        for write in writes {
            match write {
                Write::Close { lease, actual } => ticket::settle(inner, &lease, &actual).await,
                Write::Intent { lease_id, actual } => {
                    if let Err(e) = inner.record_intent(&lease_id, &actual).await {
                        tracing::warn!(lease_id, error = %e, "recording a lease's usage failed; the next settle tries again");
                    }
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
                        Ok(_) => ticket::settle(inner, &late.reservation(), &actual).await,
                        Err(e) => {
                            tracing::error!(request_id, ?actual, error = %e, "a late settlement could not be charged")
                        }
                    }
                }
            }
        }
    }
}

fn close(lease: Lease) -> Write {
    Write::Close { actual: lines_of(&lease.settled), lease: lease.reservation }
}

/// What the sweeper should charge if this instance vanished now: the usage settled,
/// and the intents of its calls (in flight or swept) whose settlement failed.
fn intent(state: &State, number: u64) -> Write {
    let mut actual = Amounts::new();
    let lease_id = match state.leases.get(&number) {
        Some(lease) => {
            actual.clone_from(&lease.settled);
            lease.reservation.request_id.clone()
        }
        None => String::new(),
    };
    for call in state.calls.values().filter(|c| c.lease == number) {
        if let Some(intent) = &call.intent {
            add(&mut actual, intent);
        }
    }
    Write::Intent { lease_id, actual: lines_of(&actual) }
}

#[async_trait::async_trait]
impl<S: BudgetStore + 'static> BudgetStore for LeasedBudgetStore<S> {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        let merged = merge(&request.lines);
        let keyset: Vec<CounterKey> =
            merged.iter().filter(|(_, (_, limit))| limit.is_some()).map(|(k, _)| (*k).clone()).collect();
        if self.serve_locally(request, &merged, &keyset) {
            return Ok(ReserveOutcome::Reserved);
        }
        let _acquiring = self.acquiring.lock().await;
        // Another call may have taken a lease while this one waited.
        if self.serve_locally(request, &merged, &keyset) {
            return Ok(ReserveOutcome::Reserved);
        }
        let retired = self.retire(&keyset);
        self.apply(retired).await;
        let mut calls = self.calls_for(&merged);
        if calls > 0 {
            if self.take_lease(request, &merged, &keyset, calls).await? {
                return Ok(ReserveOutcome::Reserved);
            }
            calls = self.read_remaining(&merged).await?;
            if calls > 0 && self.take_lease(request, &merged, &keyset, calls).await? {
                return Ok(ReserveOutcome::Reserved);
            }
        }
        // At the edge: the call's own reservation, exact.
        let outcome = self.inner.reserve(request).await?;
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
            self.finish(&mut state, &reservation.request_id, actual)
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
                    if let Some((_, more)) = self.finish(&mut state, &id, &intent) {
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
                .filter(|(_, l)| l.in_flight == 0 && (l.draining || l.expires_at < now))
                .map(|(n, _)| *n)
                .collect();
            state.open.retain(|_, n| !ended.contains(n));
            writes.extend(ended.iter().filter_map(|n| state.leases.remove(n)).map(close));
            writes
        };
        self.apply(writes).await;
        let inner = self.inner.sweep(now).await?;
        swept.refunded += inner.refunded;
        swept.charged += inner.charged;
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
}
