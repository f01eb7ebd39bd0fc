//! The ledger's rules, written once over a transactional state.
//!
//! The memory store runs them under a mutex, the embedded store inside one database
//! write transaction: the same code decides in both, so they cannot drift apart. A
//! function here either returns `Ok` having applied its whole effect, or an error,
//! and the caller then discards the transaction.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::run::{MAX_CHILDREN, Run, RunEnd};
use super::{
    CounterKey, IntentOutcome, RUN_RETENTION_SECS, ReserveOutcome, ReserveRequest, SettleOutcome, StoreError, Swept,
};

/// Swept reservations are kept this long after their expiry, so that a call that
/// outlived its reservation can still be settled exactly once.
pub const SWEPT_RETENTION_SECS: u64 = 86_400;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredReservation {
    pub lines: Vec<(CounterKey, u64)>,
    pub expires_at: u64,
    /// Refunded by the sweeper; a late settlement charges the actual usage.
    pub swept: bool,
    /// The actual amounts of a settlement that could not be written: the sweeper
    /// charges them instead of refunding. Absent from records written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intent: Option<Vec<(CounterKey, u64)>>,
}

/// What the rules read and write. Implementations are transactional.
pub trait LedgerState {
    fn counter(&mut self, key: &CounterKey) -> Result<u64, StoreError>;
    fn set_counter(&mut self, key: &CounterKey, value: u64) -> Result<(), StoreError>;
    fn reservation(&mut self, request_id: &str) -> Result<Option<StoredReservation>, StoreError>;
    fn put_reservation(&mut self, request_id: &str, reservation: &StoredReservation) -> Result<(), StoreError>;
    fn delete_reservation(&mut self, request_id: &str) -> Result<(), StoreError>;
    fn all_reservations(&mut self) -> Result<Vec<(String, StoredReservation)>, StoreError>;
    /// Every counter held (0 or not).
    fn counter_keys(&mut self) -> Result<Vec<CounterKey>, StoreError>;
    /// Drops a counter: it reads 0 again, and is no longer held.
    fn forget_counter(&mut self, key: &CounterKey) -> Result<(), StoreError>;
    fn run(&mut self, id: &str) -> Result<Option<Run>, StoreError>;
    fn put_run(&mut self, run: &Run) -> Result<(), StoreError>;
    /// Every run held, as `(id, expires_at)`.
    fn run_expiries(&mut self) -> Result<Vec<(String, u64)>, StoreError>;
    fn forget_run(&mut self, id: &str) -> Result<(), StoreError>;
}

/// Stores `run` and names it among its parent's children; `false`, nothing written,
/// when its id is taken or its parent is not stored, has ended or has
/// [`MAX_CHILDREN`] children already.
pub fn create_run(state: &mut impl LedgerState, run: &Run) -> Result<bool, StoreError> {
    if state.run(run.id())?.is_some() {
        return Ok(false);
    }
    if let Some(parent) = run.ancestors.first() {
        let open = |p: &Run| p.ended_at.is_none() && p.children.len() < MAX_CHILDREN;
        let Some(mut parent) = state.run(&parent.id)?.filter(open) else {
            return Ok(false);
        };
        parent.children.push(run.id().to_owned());
        state.put_run(&parent)?;
    }
    state.put_run(run)?;
    Ok(true)
}

/// Ends `id` and every descendant not ended before, at `at`.
pub fn end_run(state: &mut impl LedgerState, id: &str, at: u64) -> Result<RunEnd, StoreError> {
    if state.run(id)?.is_none() {
        return Ok(RunEnd::Unknown);
    }
    let mut ended = Vec::new();
    let mut next = vec![id.to_owned()];
    while let Some(id) = next.pop() {
        let Some(mut run) = state.run(&id)? else { continue };
        next.extend(run.children.iter().cloned());
        if run.ended_at.is_none() {
            run.ended_at = Some(at);
            state.put_run(&run)?;
            ended.push(id);
        }
    }
    Ok(RunEnd::Ended(ended))
}

pub fn reserve(state: &mut impl LedgerState, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
    if state.reservation(&request.request_id)?.is_some() {
        return Ok(ReserveOutcome::Reserved);
    }
    // Lines naming the same counter add up before the limit is checked; limits are
    // checked in line order, so the refusal names the first line that does not fit.
    let mut totals: BTreeMap<&CounterKey, u64> = BTreeMap::new();
    for line in &request.lines {
        let total = totals.entry(&line.key).or_default();
        *total = total.saturating_add(line.amount);
    }
    let mut values = BTreeMap::new();
    for (key, amount) in &totals {
        values.insert(*key, state.counter(key)?.saturating_add(*amount));
    }
    for (index, line) in request.lines.iter().enumerate() {
        if line.limit.is_some_and(|limit| values.get(&line.key).is_some_and(|v| *v > limit)) {
            return Ok(ReserveOutcome::Refused { line: index });
        }
    }
    let next: Vec<(&CounterKey, u64)> = values.into_iter().collect();
    for (key, value) in next {
        state.set_counter(key, value)?;
    }
    let reservation = StoredReservation {
        lines: request.lines.iter().map(|l| (l.key.clone(), l.amount)).collect(),
        expires_at: request.expires_at,
        swept: false,
        intent: None,
    };
    state.put_reservation(&request.request_id, &reservation)?;
    Ok(ReserveOutcome::Reserved)
}

pub fn settle(
    state: &mut impl LedgerState,
    request_id: &str,
    actual: &[(CounterKey, u64)],
) -> Result<SettleOutcome, StoreError> {
    let Some(reservation) = state.reservation(request_id)? else {
        return Ok(SettleOutcome::Unknown);
    };
    let mut deltas: BTreeMap<&CounterKey, (u64, u64)> = BTreeMap::new();
    if !reservation.swept {
        for (key, reserved) in &reservation.lines {
            let delta = deltas.entry(key).or_default();
            delta.1 = delta.1.saturating_add(*reserved);
        }
    }
    for (key, amount) in actual {
        let delta = deltas.entry(key).or_default();
        delta.0 = delta.0.saturating_add(*amount);
    }
    for (key, (add, remove)) in deltas {
        let value = state.counter(key)?;
        state.set_counter(key, value.saturating_add(add).saturating_sub(remove))?;
    }
    state.delete_reservation(request_id)?;
    Ok(if reservation.swept { SettleOutcome::ChargedAfterSweep } else { SettleOutcome::Settled })
}

/// Leaves the settlement's actual amounts on the reservation; no counter moves.
pub fn record_intent(
    state: &mut impl LedgerState,
    request_id: &str,
    actual: &[(CounterKey, u64)],
) -> Result<IntentOutcome, StoreError> {
    let Some(mut reservation) = state.reservation(request_id)? else {
        return Ok(IntentOutcome::Unknown);
    };
    reservation.intent = Some(actual.to_vec());
    state.put_reservation(request_id, &reservation)?;
    Ok(IntentOutcome::Recorded)
}

/// Records `actual` as the intent of a live reservation and moves its expiry.
pub fn renew(
    state: &mut impl LedgerState,
    request_id: &str,
    actual: &[(CounterKey, u64)],
    expires_at: u64,
) -> Result<IntentOutcome, StoreError> {
    let Some(mut reservation) = state.reservation(request_id)?.filter(|r| !r.swept) else {
        return Ok(IntentOutcome::Unknown);
    };
    reservation.intent = Some(actual.to_vec());
    reservation.expires_at = expires_at;
    state.put_reservation(request_id, &reservation)?;
    Ok(IntentOutcome::Recorded)
}

pub fn sweep(state: &mut impl LedgerState, now: u64) -> Result<Swept, StoreError> {
    let mut swept = Swept::default();
    for (request_id, mut reservation) in state.all_reservations()? {
        if reservation.expires_at >= now {
            continue;
        }
        // A settlement that could not be written: charged as that settlement would
        // have (whether or not the reservation was refunded before), never refunded.
        let lease = super::is_lease(&request_id);
        if let Some(actual) = &reservation.intent {
            settle(state, &request_id, actual)?;
            if lease {
                swept.leases += 1
            } else {
                swept.charged += 1
            }
            continue;
        }
        if reservation.swept {
            if reservation.expires_at.saturating_add(SWEPT_RETENTION_SECS) < now {
                state.delete_reservation(&request_id)?;
            }
            continue;
        }
        for (key, reserved) in &reservation.lines {
            let value = state.counter(key)?;
            state.set_counter(key, value.saturating_sub(*reserved))?;
        }
        reservation.swept = true;
        state.put_reservation(&request_id, &reservation)?;
        if lease { swept.leases += 1 } else { swept.refunded += 1 }
    }
    forget_transients(state, now)?;
    Ok(swept)
}

/// Forgets the windows' and runs' counters at their [`CounterKey::forget_at`], and the
/// runs [`RUN_RETENTION_SECS`] past their expiry (after the refunds above, so a refund
/// that touched one does not leave it behind); a day's or a month's counter has no
/// expiry and is kept.
fn forget_transients(state: &mut impl LedgerState, now: u64) -> Result<(), StoreError> {
    for key in state.counter_keys()? {
        if key.forget_at().is_some_and(|at| at < now) {
            state.forget_counter(&key)?;
        }
    }
    for (id, expires_at) in state.run_expiries()? {
        if expires_at.saturating_add(RUN_RETENTION_SECS) < now {
            state.forget_run(&id)?;
        }
    }
    Ok(())
}

pub fn live_reservations(state: &mut impl LedgerState) -> Result<usize, StoreError> {
    Ok(state.all_reservations()?.iter().filter(|(_, r)| !r.swept).count())
}
