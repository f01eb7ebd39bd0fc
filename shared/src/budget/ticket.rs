//! A call's reservation, from the moment it is made to its settlement.
//!
//! A `Ticket` must end in `settle` or `refund`. If the request is dropped before that
//! (the client went away while the handler awaited the backend), `Drop` hands the
//! refund to the runtime, so a cancelled call never holds its budget until expiry.

use std::sync::Arc;

use crate::config::Price;
use crate::money::MicroEur;
use crate::protocol::openai::Usage;

use super::plan::{self, Budget};
use super::{BudgetStore, SettleOutcome};

pub struct Ticket {
    store: Arc<dyn BudgetStore>,
    request_id: String,
    budgets: Vec<Budget>,
    open: bool,
}

impl Ticket {
    pub(crate) fn new(store: Arc<dyn BudgetStore>, request_id: String, budgets: Vec<Budget>) -> Self {
        Ticket { store, request_id, budgets, open: true }
    }

    /// Replaces the reservation by `usage` at the serving backend's `price`.
    /// Returns the call's cost.
    pub async fn settle(mut self, usage: Usage, price: Price) -> MicroEur {
        self.open = false;
        let actual = plan::actual(&self.budgets, usage, price);
        match self.store.settle(&self.request_id, &actual).await {
            Ok(SettleOutcome::Settled | SettleOutcome::ChargedAfterSweep) => {}
            Ok(SettleOutcome::Unknown) => {
                tracing::error!(request_id = %self.request_id, "settlement found no reservation; usage not charged");
            }
            Err(e) => {
                tracing::error!(request_id = %self.request_id, "settlement failed, the sweeper will refund the reservation: {e}");
            }
        }
        plan::cost(usage, price)
    }

    /// Returns the whole reservation: the call failed or was refused before its first
    /// byte reached the client.
    pub async fn refund(mut self) {
        self.open = false;
        refund(self.store.as_ref(), &self.request_id).await;
    }
}

async fn refund(store: &dyn BudgetStore, request_id: &str) {
    if let Err(e) = store.settle(request_id, &[]).await {
        tracing::error!(request_id, "refund failed, the sweeper will refund the reservation: {e}");
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        let store = self.store.clone();
        let request_id = std::mem::take(&mut self.request_id);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { refund(store.as_ref(), &request_id).await });
        }
    }
}
