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
    fn counter_keys(&mut self) -> Result<Vec<CounterKey>, StoreError> {
        Ok(self.counters.keys().cloned().collect())
    }
    fn forget_counter(&mut self, key: &CounterKey) -> Result<(), StoreError> {
        self.counters.remove(key);
        Ok(())
    }
    fn run(&mut self, id: &str) -> Result<Option<Run>, StoreError> {
        Ok(self.runs.get(id).cloned())
    }
    fn put_run(&mut self, run: &Run) -> Result<(), StoreError> {
        self.runs.insert(run.id().to_owned(), run.clone());
        Ok(())
    }
    fn run_expiries(&mut self) -> Result<Vec<(String, u64)>, StoreError> {
        Ok(self.runs.iter().map(|(id, run)| (id.clone(), run.this.expires_at)).collect())
    }
    fn forget_run(&mut self, id: &str) -> Result<(), StoreError> {
        self.runs.remove(id);
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

    /// A window is kept an hour past its minute, a run's counter and a run a day past
    /// the run's expiry, each forgotten by the first sweep after; a day's budget stays.
    #[tokio::test]
    async fn a_sweep_forgets_windows_an_hour_and_runs_a_day_past_their_expiry() {
        use crate::budget::run::{RunBudget, RunRef};
        use crate::budget::{Line, Period, RUN_RETENTION_SECS, Unit};

        let now = conformance::NOW;
        let store = MemoryBudgetStore::new();
        let run = Run {
            this: RunRef {
                id: "run_1".into(),
                budget: RunBudget { tokens: Some(100), eur: None },
                expires_at: now + 60,
            },
            tenant: "acme".into(),
            agent: None,
            label: None,
            ancestors: vec![],
            created_at: now,
            ended_at: None,
            children: vec![],
        };
        assert!(store.create_run(&run).await.unwrap());
        let window = CounterKey::window("acme", None, Unit::Requests, now);
        let counters = [
            window.clone(),
            run.this.counter("acme", Unit::Tokens),
            CounterKey::new("acme", None, Unit::Tokens, Period::Day, now),
        ];
        let request = ReserveRequest {
            request_id: "r".into(),
            lines: counters.iter().map(|key| Line { key: key.clone(), amount: 7, limit: None }).collect(),
            expires_at: now + 30,
        };
        store.reserve(&request).await.unwrap();
        let actual: Vec<(CounterKey, u64)> = counters.iter().map(|key| (key.clone(), 7)).collect();
        assert_eq!(store.settle(&request.reservation(), &actual).await.unwrap(), SettleOutcome::Settled);

        let window_end = window.expiry().unwrap();
        assert_eq!(window.forget_at(), Some(window_end + 3600), "an hour past its minute");
        store.sweep(window_end + 3600).await.unwrap();
        assert_eq!(store.used(&counters).await.unwrap(), [7, 7, 7], "kept through the hour");
        store.sweep(window_end + 3600 + 1).await.unwrap();
        assert_eq!(store.used(&counters).await.unwrap(), [0, 7, 7], "the window forgotten");
        assert!(store.run("run_1").await.unwrap().is_some());
        store.sweep(now + 60 + RUN_RETENTION_SECS).await.unwrap();
        assert_eq!(store.used(&counters).await.unwrap(), [0, 7, 7], "the run's counter kept through the day");
        store.sweep(now + 60 + RUN_RETENTION_SECS + 1).await.unwrap();
        assert_eq!(store.used(&counters).await.unwrap(), [0, 0, 7], "the run's counter forgotten, the day kept");
        assert_eq!(store.run("run_1").await.unwrap(), None, "the run forgotten");
        let state = store.state.lock().unwrap();
        assert_eq!(state.counters.len(), 1, "forgotten, not set to 0");
    }
}
