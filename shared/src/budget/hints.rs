//! Callers last read past their soft threshold: admission routes them soft without a
//! refused write each time (`admission`).

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use foldhash::HashMap;

use super::CounterKey;
use super::plan::{self, Budget};

/// How long a counter read past its soft threshold routes its caller soft without a
/// read. Counters rarely fall back under the threshold within a period (only refunds
/// and settlements below the reservation lower them); this bounds the error when they do.
pub const SOFT_HINT_TTL: Duration = Duration::from_secs(60);
/// Entries kept before expired ones are pruned.
const SOFT_HINTS_MAX: usize = 4096;

/// Counters last read past their soft threshold, and until when that is trusted. Per
/// process (per execution environment on Lambda): a hint, never a guarantee.
#[derive(Debug, Default)]
pub struct SoftHints {
    until: Mutex<HashMap<CounterKey, Instant>>,
}

impl SoftHints {
    pub(crate) fn any(&self, budgets: &[Budget], now: Instant) -> bool {
        let until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        budgets.iter().any(|b| until.get(&b.key).is_some_and(|t| *t > now))
    }

    pub(crate) fn note(&self, budgets: &[Budget], used: &[u64], threshold_ppm: u32, now: Instant) {
        let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        if until.len() >= SOFT_HINTS_MAX {
            until.retain(|_, t| *t > now);
        }
        for (budget, used) in budgets.iter().zip(used) {
            if plan::is_soft(std::slice::from_ref(budget), &[*used], threshold_ppm) {
                until.insert(budget.key.clone(), now + SOFT_HINT_TTL);
            } else {
                until.remove(&budget.key);
            }
        }
    }
}
