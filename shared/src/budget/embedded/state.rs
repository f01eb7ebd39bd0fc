//! The ledger held in memory, as its journal has it (`Ledger`), and one batch's view
//! of it (`Batch`): an operation's writes are kept only once its rules returned `Ok`,
//! so an operation applies whole or not at all.

use std::collections::BTreeMap;

use foldhash::{HashMap, HashSet};

use super::journal::Effects;
use crate::budget::ledger::{LedgerState, StoredReservation};
use crate::budget::{CounterKey, StoreError};

/// A reservation as the ledger holds it: decoded, or what did not decode.
pub(super) type Stored = Result<StoredReservation, String>;

/// The ledger as its journal has it: the file's content and every batch written to the
/// journal since (a batch in its fsync included), with what changed since the last
/// checkpoint.
#[derive(Default)]
pub(super) struct Ledger {
    pub(super) counters: HashMap<CounterKey, u64>,
    pub(super) reservations: HashMap<String, Stored>,
    pub(super) changed_counters: HashSet<CounterKey>,
    pub(super) changed_reservations: HashSet<String>,
    /// The reservations the file holds (as of the last checkpoint).
    pub(super) in_file: HashSet<String>,
    /// The reservations held and not swept: the calls in flight, give or take those
    /// whose process died (until the sweeper gets to them).
    pub(super) live: usize,
}

pub(super) fn is_live(stored: Option<&Stored>) -> bool {
    matches!(stored, Some(Ok(reservation)) if !reservation.swept)
}

impl Ledger {
    /// A batch's writes (journaled first, or replayed from the journal).
    pub(super) fn apply(&mut self, effects: Effects) {
        for (key, value) in effects.counters {
            // A counter is set far more often than made: the map keeps the key it has.
            match self.counters.get_mut(&key) {
                Some(counter) => *counter = value,
                None => _ = self.counters.insert(key.clone(), value),
            }
            self.changed_counters.insert(key);
        }
        for (request_id, reservation) in effects.reservations {
            let was_live = is_live(self.reservations.get(&request_id));
            let now_live = reservation.as_ref().is_some_and(|r| !r.swept);
            match reservation {
                Some(reservation) => _ = self.reservations.insert(request_id.clone(), Ok(reservation)),
                None => _ = self.reservations.remove(&request_id),
            }
            match (was_live, now_live) {
                (false, true) => self.live += 1,
                (true, false) => self.live = self.live.saturating_sub(1),
                _ => {}
            }
            self.changed_reservations.insert(request_id);
        }
    }
}

/// One batch's view of the ledger: its operations' writes over it, the current
/// operation's over those, kept only if its rules return `Ok`. The writes kept are its
/// effects, in order; the maps only say where each key's latest write is among them, so
/// that a reservation is not cloned into a map beside its effects (a batch is mostly
/// one operation of a few writes).
pub(super) struct Batch<'l> {
    ledger: &'l Ledger,
    /// A counter's latest write in `effects.counters`.
    counters: HashMap<CounterKey, usize>,
    /// A reservation's latest write in `effects.reservations`.
    reservations: HashMap<String, usize>,
    op_counters: Vec<(CounterKey, u64)>,
    op_reservations: Vec<(String, Option<StoredReservation>)>,
    /// The writes kept, in order: what the journal line says.
    effects: Effects,
}

impl<'l> Batch<'l> {
    pub(super) fn new(ledger: &'l Ledger) -> Self {
        Batch {
            ledger,
            counters: HashMap::default(),
            reservations: HashMap::default(),
            op_counters: Vec::new(),
            op_reservations: Vec::new(),
            effects: Effects::default(),
        }
    }

    /// Keeps the operation's writes if it `applied`, else drops them.
    pub(super) fn end_operation(&mut self, applied: bool) {
        if !applied {
            self.op_counters.clear();
            self.op_reservations.clear();
            return;
        }
        for (key, value) in self.op_counters.drain(..) {
            self.counters.insert(key.clone(), self.effects.counters.len());
            self.effects.counters.push((key, value));
        }
        for (request_id, reservation) in self.op_reservations.drain(..) {
            self.reservations.insert(request_id.clone(), self.effects.reservations.len());
            self.effects.reservations.push((request_id, reservation));
        }
    }

    pub(super) fn effects(self) -> Effects {
        self.effects
    }

    /// The batch's pending write of a reservation, if it has one (`Some(None)`: removed).
    fn pending(&self, request_id: &str) -> Option<&Option<StoredReservation>> {
        let op = self.op_reservations.iter().find(|(id, _)| id == request_id).map(|(_, pending)| pending);
        op.or_else(|| self.reservations.get(request_id).map(|&at| &self.effects.reservations[at].1))
    }

    fn put(&mut self, request_id: &str, reservation: Option<StoredReservation>) {
        match self.op_reservations.iter_mut().find(|(id, _)| id == request_id) {
            Some((_, pending)) => *pending = reservation,
            None => self.op_reservations.push((request_id.to_owned(), reservation)),
        }
    }
}

impl LedgerState for Batch<'_> {
    // TEMPORARY (being written): runs on the embedded store.
    fn run(&mut self, _: &str) -> Result<Option<crate::budget::Run>, StoreError> {
        Err(StoreError::Backend("runs: not yet on the embedded store".into()))
    }
    fn put_run(&mut self, _: &crate::budget::Run) -> Result<(), StoreError> {
        Err(StoreError::Backend("runs: not yet on the embedded store".into()))
    }
    fn counter(&mut self, key: &CounterKey) -> Result<u64, StoreError> {
        let op = self.op_counters.iter().find(|(k, _)| k == key).map(|(_, value)| *value);
        let value = op
            .or_else(|| self.counters.get(key).map(|&at| self.effects.counters[at].1))
            .or_else(|| self.ledger.counters.get(key).copied());
        Ok(value.unwrap_or(0))
    }
    fn set_counter(&mut self, key: &CounterKey, value: u64) -> Result<(), StoreError> {
        match self.op_counters.iter_mut().find(|(k, _)| k == key) {
            Some((_, pending)) => *pending = value,
            None => self.op_counters.push((key.clone(), value)),
        }
        Ok(())
    }
    fn reservation(&mut self, request_id: &str) -> Result<Option<StoredReservation>, StoreError> {
        if let Some(pending) = self.pending(request_id) {
            return Ok(pending.clone());
        }
        match self.ledger.reservations.get(request_id) {
            Some(stored) => stored.clone().map(Some).map_err(|detail| corrupt(request_id, &detail)),
            None => Ok(None),
        }
    }
    fn put_reservation(&mut self, request_id: &str, reservation: &StoredReservation) -> Result<(), StoreError> {
        self.put(request_id, Some(reservation.clone()));
        Ok(())
    }
    fn delete_reservation(&mut self, request_id: &str) -> Result<(), StoreError> {
        self.put(request_id, None);
        Ok(())
    }
    fn all_reservations(&mut self) -> Result<Vec<(String, StoredReservation)>, StoreError> {
        let mut all: BTreeMap<String, StoredReservation> = BTreeMap::new();
        for (request_id, stored) in &self.ledger.reservations {
            let reservation = stored.as_ref().map_err(|detail| corrupt(request_id, detail))?;
            all.insert(request_id.clone(), reservation.clone());
        }
        // In order: a later write of the same reservation wins.
        for (request_id, pending) in self.effects.reservations.iter().chain(&self.op_reservations) {
            match pending {
                Some(reservation) => all.insert(request_id.clone(), reservation.clone()),
                None => all.remove(request_id),
            };
        }
        Ok(all.into_iter().collect())
    }
}

fn corrupt(request_id: &str, detail: &str) -> StoreError {
    StoreError::Corrupt { key: format!("reservations/{request_id}"), detail: detail.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::super::tests::key;
    use super::*;

    /// An operation's writes reach the batch only when it applied.
    #[test]
    fn an_operation_that_fails_leaves_nothing() {
        let ledger = Ledger::default();
        let mut batch = Batch::new(&ledger);
        batch.set_counter(&key("a"), 7).unwrap();
        batch
            .put_reservation("x", &StoredReservation { lines: vec![], expires_at: 0, swept: false, intent: None })
            .unwrap();
        assert_eq!(batch.counter(&key("a")).unwrap(), 7, "an operation reads its own writes");
        assert_eq!(batch.all_reservations().unwrap().len(), 1);
        batch.end_operation(false);
        assert_eq!(batch.counter(&key("a")).unwrap(), 0);
        assert_eq!(batch.reservation("x").unwrap(), None);
        assert!(batch.effects().is_empty());
    }
}
