//! A call's reservation, from the moment it is made to its settlement.
//!
//! A `Ticket` must end in `settle` or `refund`. If the request is dropped before that
//! (the client went away while the handler awaited the backend), `Drop` hands the
//! refund to the runtime, so a cancelled call never holds its budget until expiry. A
//! ticket stays open until the store has answered its settlement or refund: dropped
//! while one is written (a server cancels a call wherever it waits when its client
//! leaves), it hands the same write to the runtime, which the store answers `Unknown`
//! if the first got in; so a usage known is never turned into a refund.
//!
//! A settlement that cannot be written is never turned into a free call (SPEC §6). The
//! ticket tries it [`ATTEMPTS`] times; if every attempt fails, it leaves the actual
//! amounts on the reservation (`BudgetStore::record_intent`: one write of that item,
//! none of the hot counters), tried as many times, and the sweeper charges them when
//! the reservation expires instead of refunding it. Only if that fails too does the
//! call go uncharged: the error log then carries the request id and the amounts.
//!
//! A refund that cannot be written records nothing: the sweeper's default for an
//! expired reservation is the refund, so the outcome is the same, only later (the
//! budget stays held until the reservation expires).
//!
//! Either way the hot path is unchanged: when the store answers, a call writes its
//! reservation and its settlement, nothing else. The ticket carries the reserved lines
//! (`Reservation`), so the settlement is written without reading the reservation
//! first; the store reads it only when its write's condition fails (a sweep got there
//! first, or the reservation is gone).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::call::Usage;
use crate::config::Price;
use crate::money::MicroEur;

use super::plan::{self, Budget};
use super::{
    BudgetStore, CounterKey, IntentOutcome, Reservation, ReserveOutcome, ReserveRequest, SettleOutcome, StoreError,
};

/// Tries at a settlement, at its intent, and at a refund, each. Stores retry contention
/// themselves; these cover a store that fails outright for a moment.
pub const ATTEMPTS: u32 = 3;
/// The pause before the second try; it doubles before each next one (25 ms, 50 ms).
const FIRST_PAUSE: Duration = Duration::from_millis(25);

pub struct Ticket {
    store: Arc<dyn BudgetStore>,
    reservation: Reservation,
    budgets: Arc<[Budget]>,
    /// Unix seconds the budgets' periods were taken at.
    reserved_at: u64,
    open: bool,
}

impl Ticket {
    /// `reservation` is what was reserved (`ReserveRequest::reservation`); `budgets`
    /// price the settlement; `reserved_at` is the time their periods were taken at.
    pub(crate) fn new(
        store: Arc<dyn BudgetStore>,
        reservation: Reservation,
        budgets: Arc<[Budget]>,
        reserved_at: u64,
    ) -> Self {
        Ticket { store, reservation, budgets, reserved_at, open: true }
    }

    /// The UTC date (`YYYY-MM-DD`) the call counts on: its day and month budgets are
    /// that date's and its month's, and the audit record carries it (`period`) for
    /// the report, so that a call reserved before midnight and ended after it counts
    /// in one period everywhere.
    pub fn period(&self) -> String {
        super::Period::Day.stamp(self.reserved_at)
    }

    /// Unix seconds at which it was reserved: what its windows' minute is.
    pub fn reserved_at(&self) -> u64 {
        self.reserved_at
    }

    /// Replaces the reservation by `usage` at the serving backend's `price`.
    /// Returns the call's cost.
    pub async fn settle(self, usage: Usage, price: Price) -> MicroEur {
        let actual = plan::actual(&self.budgets, usage, price);
        Settling { ticket: self, actual }.write().await;
        plan::cost(usage, price)
    }

    /// As [`Ticket::settle`], counting no call of a run (nor of its ancestors): a
    /// realtime response after the one that counted its session, which is one call of
    /// its run (SPEC §15). It still counts as a request in every window.
    pub async fn settle_past_runs_calls(self, usage: Usage, price: Price) -> MicroEur {
        let mut actual = plan::actual(&self.budgets, usage, price);
        for ((_, amount), budget) in actual.iter_mut().zip(self.budgets.iter()) {
            if budget.kind == plan::Kind::Run && budget.unit == super::Unit::Requests {
                *amount = 0;
            }
        }
        Settling { ticket: self, actual }.write().await;
        plan::cost(usage, price)
    }

    /// Replaces the reservation by `cost` in micro-euros and no tokens: a gRPC call,
    /// priced per call or per byte (SPEC §10). A request it counted (its first step's,
    /// in a window or a run's calls) stays counted.
    pub async fn settle_eur(self, cost: MicroEur) {
        let reserved = self.reservation.lines.iter().map(|(_, amount)| *amount);
        let actual: Vec<(CounterKey, u64)> = self
            .budgets
            .iter()
            .zip(reserved)
            .map(|(b, reserved)| {
                let amount = match b.unit {
                    super::Unit::MicroEur => cost.0,
                    super::Unit::Requests => reserved,
                    super::Unit::Tokens => 0,
                };
                (b.key.clone(), amount)
            })
            .collect();
        Settling { ticket: self, actual }.write().await;
    }

    /// Returns the whole reservation: the call failed or was refused before its first
    /// byte reached the client.
    pub async fn refund(mut self) {
        refund(self.store.as_ref(), &self.reservation).await;
        self.open = false;
    }
}

/// A ticket whose settlement on `actual` is being written: dropped before the store
/// answers, it hands the same write to the runtime (see the module docs).
struct Settling {
    ticket: Ticket,
    actual: Vec<(CounterKey, u64)>,
}

impl Settling {
    async fn write(mut self) {
        settle_call(self.ticket.store.as_ref(), &self.ticket.reservation, &self.actual).await;
        self.ticket.open = false;
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        if !self.ticket.open {
            return;
        }
        // Settled here, never refunded by the ticket's own drop.
        self.ticket.open = false;
        let store = self.ticket.store.clone();
        let reservation = std::mem::take(&mut self.ticket.reservation);
        let actual = std::mem::take(&mut self.actual);
        // `Unknown` here is the dropped write's own success.
        on_runtime(async move {
            settle(store.as_ref(), &reservation, &actual).await;
        });
    }
}

/// A reservation asked of the store and not answered yet: refunded if its call is
/// dropped before the store answers, or if the store fails, so that a reservation
/// written all the same (its answer lost, its call cancelled as it waited) is never
/// left held until its expiry. Made before `BudgetStore::reserve`, told its answer
/// after (no future of its own on the hot path).
pub(crate) struct Unanswered<'a> {
    store: &'a Arc<dyn BudgetStore>,
    request: &'a ReserveRequest,
    armed: bool,
}

/// Reserves `request` on `store`, the reservation refunded (in the background) if
/// this is dropped, or the store fails, before it answers: what every reservation of
/// a call goes through.
pub(crate) async fn reserve_guarded(
    store: &Arc<dyn BudgetStore>,
    request: &ReserveRequest,
) -> Result<ReserveOutcome, StoreError> {
    let unanswered = Unanswered::new(store, request);
    let outcome = store.reserve(request).await;
    unanswered.answered(&outcome);
    outcome
}

impl<'a> Unanswered<'a> {
    pub(crate) fn new(store: &'a Arc<dyn BudgetStore>, request: &'a ReserveRequest) -> Self {
        Unanswered { store, request, armed: true }
    }

    /// The store's answer: only a failure leaves the refund to be made.
    pub(crate) fn answered<T>(mut self, outcome: &Result<T, StoreError>) {
        self.armed = outcome.is_err();
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, reservation) = (self.store.clone(), self.request.reservation());
        on_runtime(async move { refund(store.as_ref(), &reservation).await });
    }
}

async fn settle_call(store: &dyn BudgetStore, reservation: &Reservation, actual: &[(CounterKey, u64)]) {
    if settle(store, reservation, actual).await == Some(SettleOutcome::Unknown) {
        let request_id = reservation.request_id.as_str();
        tracing::error!(request_id, "settlement found no reservation; usage not charged");
    }
}

/// Settles `reservation` on `actual`, tried [`ATTEMPTS`] times, else leaves `actual` on
/// it as a settle intent for the sweeper (see the module docs). Also closes budget
/// leases (`lease.rs`): a lease is a reservation like a call's.
///
/// The store's answer when it gave one plainly; `None` when the settlement fell back
/// to its intent, or when a failed attempt may have been written after all. A caller
/// decides what `Unknown` means: a call's usage went uncharged, a lease was reclaimed.
pub(crate) async fn settle(
    store: &dyn BudgetStore,
    reservation: &Reservation,
    actual: &[(CounterKey, u64)],
) -> Option<SettleOutcome> {
    let request_id = reservation.request_id.as_str();
    let mut failed: Option<StoreError> = None;
    for attempt in 0..ATTEMPTS {
        pause(attempt).await;
        match store.settle(reservation, actual).await {
            Ok(outcome @ (SettleOutcome::Settled | SettleOutcome::ChargedAfterSweep)) => return Some(outcome),
            Ok(SettleOutcome::Unknown) if failed.is_none() => return Some(SettleOutcome::Unknown),
            Ok(SettleOutcome::Unknown) => {
                // A failed attempt may have been written all the same (its answer lost).
                tracing::warn!(
                    request_id,
                    "settlement found no reservation after a failed attempt: that attempt was written, or the \
                     reservation was closed meanwhile"
                );
                return None;
            }
            Err(e) => {
                tracing::warn!(request_id, attempt, error = %e, "settlement failed");
                failed = Some(e);
            }
        }
    }
    let settle_error = failed.map(|e| e.to_string()).unwrap_or_default();
    for attempt in 0..ATTEMPTS {
        pause(attempt).await;
        match store.record_intent(request_id, actual).await {
            Ok(IntentOutcome::Recorded) => {
                tracing::warn!(
                    request_id,
                    ?actual,
                    error = %settle_error,
                    "settle intent recorded: the settlement could not be written, its actual amounts are on the \
                     reservation and the sweeper charges them at its expiry"
                );
                return None;
            }
            Ok(IntentOutcome::Unknown) => {
                tracing::warn!(
                    request_id,
                    "settle intent found no reservation: a failed settlement attempt was written, or the \
                     reservation was closed meanwhile"
                );
                return None;
            }
            Err(e) => tracing::warn!(request_id, attempt, error = %e, "recording the settle intent failed"),
        }
    }
    tracing::error!(
        request_id,
        ?actual,
        error = %settle_error,
        "settlement and its intent could not be written: the sweeper will refund the reservation and the call \
         goes uncharged in the ledger"
    );
    None
}

async fn refund(store: &dyn BudgetStore, reservation: &Reservation) {
    let request_id = reservation.request_id.as_str();
    for attempt in 0..ATTEMPTS {
        pause(attempt).await;
        match store.settle(reservation, &[]).await {
            Ok(_) => return,
            Err(e) if attempt + 1 == ATTEMPTS => {
                tracing::error!(request_id, error = %e, "refund failed, the sweeper will refund the reservation at its expiry");
            }
            Err(e) => tracing::warn!(request_id, attempt, error = %e, "refund failed"),
        }
    }
}

/// A dropped guard's write, handed to the runtime it was dropped on. Dropped outside
/// any runtime, it has nowhere to run: the reservation is then the sweeper's at its
/// expiry (a refund, or the settle intent recorded).
fn on_runtime(write: impl Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(write);
    }
}

/// Nothing before the first try; then `FIRST_PAUSE`, doubling.
async fn pause(attempt: u32) {
    if attempt > 0 {
        tokio::time::sleep(FIRST_PAUSE * (1 << (attempt - 1).min(8))).await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        let store = self.store.clone();
        let reservation = std::mem::take(&mut self.reservation);
        on_runtime(async move { refund(store.as_ref(), &reservation).await });
    }
}
