//! The ledger held in memory, as its journal has it (`Ledger`), and one batch's view
//! of it (`Batch`): an operation's writes are kept only once its rules returned `Ok`,
//! so an operation applies whole or not at all.

use std::collections::BTreeMap;

use foldhash::{HashMap, HashSet};

use super::journal::Effects;
use crate::budget::ledger::{LedgerState, StoredReservation};
use crate::budget::{CounterKey, Run, StoreError};

/// A reservation as the ledger holds it: decoded, or what did not decode.
pub(super) type Stored = Result<StoredReservation, String>;

/// A run as the ledger holds it: decoded, or what did not decode.
pub(super) type StoredRun = Result<Run, String>;

/// The ledger as its journal has it: the file's content and every batch written to the
/// journal since (a batch in its fsync included), with what changed since the last
/// checkpoint.
#[derive(Default)]
pub(super) struct Ledger {
    pub(super) counters: HashMap<CounterKey, u64>,
    pub(super) reservations: HashMap<String, Stored>,
    pub(super) runs: HashMap<String, StoredRun>,
    /// Counters set or forgotten since the last checkpoint.
    pub(super) changed_counters: HashSet<CounterKey>,
    pub(super) changed_reservations: HashSet<String>,
    pub(super) changed_runs: HashSet<String>,
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
            match (self.counters.get_mut(&key), value) {
                (Some(counter), Some(value)) => *counter = value,
                (None, Some(value)) => _ = self.counters.insert(key.clone(), value),
                (_, None) => _ = self.counters.remove(&key),
            }
            self.changed_counters.insert(key);
        }
        for (id, run) in effects.runs {
            match run {
                Some(run) => _ = self.runs.insert(id.clone(), Ok(run)),
                None => _ = self.runs.remove(&id),
            }
            self.changed_runs.insert(id);
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
    /// A run's latest write in `effects.runs`.
    runs: HashMap<String, usize>,
    /// `None`: forgotten.
    op_counters: Vec<(CounterKey, Option<u64>)>,
    op_reservations: Vec<(String, Option<StoredReservation>)>,
    op_runs: Vec<(String, Option<Run>)>,
    /// The writes kept, in order: what the journal line says.
    effects: Effects,
}

impl<'l> Batch<'l> {
    pub(super) fn new(ledger: &'l Ledger) -> Self {
        Batch {
            ledger,
            counters: HashMap::default(),
            reservations: HashMap::default(),
            runs: HashMap::default(),
            op_counters: Vec::new(),
            op_reservations: Vec::new(),
            op_runs: Vec::new(),
            effects: Effects::default(),
        }
    }

    /// Keeps the operation's writes if it `applied`, else drops them.
    pub(super) fn end_operation(&mut self, applied: bool) {
        if !applied {
            self.op_counters.clear();
            self.op_reservations.clear();
            self.op_runs.clear();
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
        for (id, run) in self.op_runs.drain(..) {
            self.runs.insert(id.clone(), self.effects.runs.len());
            self.effects.runs.push((id, run));
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

    fn write_counter(&mut self, key: &CounterKey, value: Option<u64>) {
        match self.op_counters.iter_mut().find(|(k, _)| k == key) {
            Some((_, pending)) => *pending = value,
            None => self.op_counters.push((key.clone(), value)),
        }
    }

    fn write_run(&mut self, id: &str, run: Option<Run>) {
        match self.op_runs.iter_mut().find(|(pending, _)| pending == id) {
            Some((_, pending)) => *pending = run,
            None => self.op_runs.push((id.to_owned(), run)),
        }
    }
}

impl LedgerState for Batch<'_> {
    fn counter(&mut self, key: &CounterKey) -> Result<u64, StoreError> {
        let op = self.op_counters.iter().find(|(k, _)| k == key).map(|(_, value)| *value);
        let pending = op.or_else(|| self.counters.get(key).map(|&at| self.effects.counters[at].1));
        let value = match pending {
            Some(pending) => pending,
            None => self.ledger.counters.get(key).copied(),
        };
        Ok(value.unwrap_or(0))
    }
    fn set_counter(&mut self, key: &CounterKey, value: u64) -> Result<(), StoreError> {
        self.write_counter(key, Some(value));
        Ok(())
    }
    fn counter_keys(&mut self) -> Result<Vec<CounterKey>, StoreError> {
        let mut keys: HashSet<CounterKey> = self.ledger.counters.keys().cloned().collect();
        // In order: a later write of the same counter wins.
        for (key, pending) in self.effects.counters.iter().chain(&self.op_counters) {
            match pending {
                Some(_) => keys.insert(key.clone()),
                None => keys.remove(key),
            };
        }
        Ok(keys.into_iter().collect())
    }
    fn forget_counter(&mut self, key: &CounterKey) -> Result<(), StoreError> {
        self.write_counter(key, None);
        Ok(())
    }
    fn run(&mut self, id: &str) -> Result<Option<Run>, StoreError> {
        let op = self.op_runs.iter().find(|(pending, _)| pending == id).map(|(_, run)| run);
        if let Some(pending) = op.or_else(|| self.runs.get(id).map(|&at| &self.effects.runs[at].1)) {
            return Ok(pending.clone());
        }
        match self.ledger.runs.get(id) {
            Some(stored) => stored.clone().map(Some).map_err(|detail| corrupt_run(id, &detail)),
            None => Ok(None),
        }
    }
    fn put_run(&mut self, run: &Run) -> Result<(), StoreError> {
        self.write_run(run.id(), Some(run.clone()));
        Ok(())
    }
    /// A run that does not decode is left out: it is kept as the file has it.
    fn run_expiries(&mut self) -> Result<Vec<(String, u64)>, StoreError> {
        let mut all: HashMap<&str, u64> = HashMap::default();
        for (id, stored) in &self.ledger.runs {
            if let Ok(run) = stored {
                all.insert(id, run.this.expires_at);
            }
        }
        // In order: a later write of the same run wins.
        for (id, pending) in self.effects.runs.iter().chain(&self.op_runs) {
            match pending {
                Some(run) => all.insert(id, run.this.expires_at),
                None => all.remove(id.as_str()),
            };
        }
        Ok(all.into_iter().map(|(id, expires_at)| (id.to_owned(), expires_at)).collect())
    }
    fn forget_run(&mut self, id: &str) -> Result<(), StoreError> {
        self.write_run(id, None);
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

pub(super) fn corrupt_run(id: &str, detail: &str) -> StoreError {
    StoreError::Corrupt { key: format!("runs/{id}"), detail: detail.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::super::tests::key;
    use super::*;
    use crate::budget::run::{RunBudget, RunRef};

    /// An operation's writes reach the batch only when it applied.
    #[test]
    fn an_operation_that_fails_leaves_nothing() {
        let ledger = Ledger::default();
        let mut batch = Batch::new(&ledger);
        batch.set_counter(&key("a"), 7).unwrap();
        batch
            .put_reservation("x", &StoredReservation { lines: vec![], expires_at: 0, swept: false, intent: None })
            .unwrap();
        let run = Run {
            this: RunRef { id: "run_x".into(), budget: RunBudget::default(), expires_at: 9 },
            tenant: "acme".into(),
            agent: None,
            label: None,
            ancestors: vec![],
            created_at: 0,
            ended_at: None,
            children: vec![],
        };
        batch.put_run(&run).unwrap();
        assert_eq!(batch.counter(&key("a")).unwrap(), 7, "an operation reads its own writes");
        assert_eq!(batch.all_reservations().unwrap().len(), 1);
        assert_eq!(batch.run("run_x").unwrap(), Some(run.clone()));
        assert_eq!(batch.run_expiries().unwrap(), [("run_x".to_owned(), 9)]);
        batch.end_operation(false);
        assert_eq!(batch.counter(&key("a")).unwrap(), 0);
        assert_eq!(batch.reservation("x").unwrap(), None);
        assert_eq!(batch.run("run_x").unwrap(), None);
        assert!(batch.effects().is_empty());
    }

    /// A counter or a run forgotten reads as never written, in the batch and once
    /// applied; written again afterwards, it is back.
    #[test]
    fn a_forgotten_counter_or_run_is_gone_and_may_come_back() {
        let mut ledger = Ledger::default();
        ledger.counters.insert(key("a"), 5);
        ledger.counters.insert(key("b"), 6);
        let mut batch = Batch::new(&ledger);
        batch.forget_counter(&key("a")).unwrap();
        batch.end_operation(true);
        assert_eq!(batch.counter(&key("a")).unwrap(), 0, "not the ledger's 5");
        assert_eq!(batch.counter_keys().unwrap(), [key("b")]);
        batch.set_counter(&key("b"), 7).unwrap();
        batch.forget_counter(&key("b")).unwrap();
        batch.end_operation(true);
        assert!(batch.counter_keys().unwrap().is_empty());
        let effects = batch.effects();
        ledger.apply(effects);
        assert!(ledger.counters.is_empty());
        assert!(ledger.changed_counters.contains(&key("a")) && ledger.changed_counters.contains(&key("b")));

        let mut batch = Batch::new(&ledger);
        batch.set_counter(&key("a"), 1).unwrap();
        batch.end_operation(true);
        ledger.apply(batch.effects());
        assert_eq!(ledger.counters.get(&key("a")), Some(&1));
    }
}
