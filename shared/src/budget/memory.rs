//! `MemoryBudgetStore`: the ledger in a mutex. For tests and for deployments that
//! accept losing counters on restart (`store: {kind: memory}`).

use std::sync::Mutex;

use foldhash::HashMap;

use super::ledger::{self, LedgerState, StoredReservation};
use super::{
    BudgetStore, CounterKey, IntentOutcome, Reservation, ReserveOutcome, ReserveRequest, Run, RunEnd, SettleOutcome,
    StoreError, Swept,
};

#[derive(Debug, Default)]
struct State {
    counters: HashMap<CounterKey, u64>,
    reservations: HashMap<String, StoredReservation>,
    runs: HashMap<String, Run>,
}

impl LedgerState for State {
    fn counter(&mut self, key: &CounterKey) -> Result<u64, StoreError> {
        Ok(self.counters.get(key).copied().unwrap_or(0))
    }
    fn set_counter(&mut self, key: &CounterKey, value: u64) -> Result<(), StoreError> {
        // A counter is set far more often than made: the map keeps the key it has.
        match self.counters.get_mut(key) {
            Some(counter) => *counter = value,
            None => _ = self.counters.insert(key.clone(), value),
        }
        Ok(())
    }
    fn reservation(&mut self, request_id: &str) -> Result<Option<StoredReservation>, StoreError> {
        Ok(self.reservations.get(request_id).cloned())
    }
    fn put_reservation(&mut self, request_id: &str, reservation: &StoredReservation) -> Result<(), StoreError> {
        self.reservations.insert(request_id.to_owned(), reservation.clone());
        Ok(())
    }
    fn delete_reservation(&mut self, request_id: &str) -> Result<(), StoreError> {
        self.reservations.remove(request_id);
        Ok(())
    }
    fn all_reservations(&mut self) -> Result<Vec<(String, StoredReservation)>, StoreError> {
        Ok(self.reservations.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
    fn run(&mut self, id: &str) -> Result<Option<Run>, StoreError> {
        Ok(self.runs.get(id).cloned())
    }
    fn put_run(&mut self, run: &Run) -> Result<(), StoreError> {
        self.runs.insert(run.id().to_owned(), run.clone());
        Ok(())
    }
}

#[derive(Debug, Default)]
pub struct MemoryBudgetStore {
    state: Mutex<State>,
}

impl MemoryBudgetStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// The rules check before they write and writes to memory cannot fail, so each
    /// rule applies whole or not at all under the lock.
    fn transact<T>(&self, f: impl FnOnce(&mut State) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let mut guard = self.state.lock().map_err(|_| StoreError::Backend("memory store lock poisoned".into()))?;
        f(&mut guard)
    }
}

#[async_trait::async_trait]
impl BudgetStore for MemoryBudgetStore {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        self.transact(|s| ledger::reserve(s, request))
    }
    /// The reservation is read under the lock: the stored one decides.
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        self.transact(|s| ledger::settle(s, &reservation.request_id, actual))
    }
    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        self.transact(|s| ledger::record_intent(s, request_id, actual))
    }
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        self.transact(|s| ledger::renew(s, request_id, actual, expires_at))
    }
    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        self.transact(|s| ledger::sweep(s, now))
    }
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        self.transact(|s| keys.iter().map(|k| s.counter(k)).collect())
    }
    async fn live_reservations(&self) -> Result<usize, StoreError> {
        self.transact(ledger::live_reservations)
    }
    async fn create_run(&self, run: &Run) -> Result<bool, StoreError> {
        self.transact(|s| ledger::create_run(s, run))
    }
    async fn run(&self, id: &str) -> Result<Option<Run>, StoreError> {
        self.transact(|s| s.run(id))
    }
    async fn end_run(&self, id: &str, at: u64) -> Result<RunEnd, StoreError> {
        self.transact(|s| ledger::end_run(s, id, at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::conformance;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory_store_passes_the_conformance_suite() {
        let failures = conformance::run_all(|| async { MemoryBudgetStore::new() }).await;
        assert!(failures.is_empty(), "{failures:#?}");
    }
}
