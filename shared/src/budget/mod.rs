//! Budgets that hold (SPEC §6): counters, reservations, and the `BudgetStore` port.
//!
//! Every call reserves an upper bound of its cost before the upstream call, in one
//! atomic operation across every counter that applies (tenant and agent; tokens per
//! day, tokens per month, micro-euros per month), and settles afterwards: the real
//! usage replaces the reservation, or the reservation is refunded in full. Invariants:
//! - a reservation is all or nothing: no counter moves unless every limit holds;
//! - reserving twice with one request id reserves once;
//! - a reservation is settled at most once: settle, refund and sweep exclude each
//!   other (a late settlement of a swept reservation charges the real usage and
//!   nothing else, so the ledger still equals the sum of settled usage);
//! - a settlement that cannot be written is never turned into a free call: the ticket
//!   leaves its actual amounts on the reservation (`record_intent`, a write of that
//!   item alone), and the sweeper charges them instead of refunding. Whichever comes
//!   first, the real settle or the sweeper's charge, closes the reservation; the other
//!   finds nothing left to do;
//! - limits come from the config and enter each write as its condition; the store
//!   only counts.

/// The conformance suite of the `BudgetStore` port: for tests only (the
/// `test-support` feature), not part of the library a gateway ships.
#[cfg(any(test, feature = "test-support"))]
pub mod conformance;
pub mod embedded;
mod hints;
pub mod lease;
pub mod ledger;
pub mod memory;
pub mod period;
pub mod plan;
pub mod run;
pub mod ticket;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use embedded::EmbeddedBudgetStore;
pub use hints::{SOFT_HINT_TTL, SoftHints};
pub use lease::{LeasePolicy, LeasedBudgetStore, is_lease};
pub use ledger::{LedgerState, StoredReservation};
pub use memory::MemoryBudgetStore;
pub use period::Period;
pub use run::{Run, RunBudget, RunEnd};
pub use ticket::Ticket;

/// Names one counter: `acme/*/tokens/day/2026-11-29`, `acme/bot/eur/month/2026-11`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CounterKey(pub Arc<str>);

impl CounterKey {
    pub fn new(tenant: &str, agent: Option<&str>, unit: Unit, period: Period, now: u64) -> Self {
        Self::stamped(tenant, agent, unit, period, &period.stamp(now))
    }

    /// The key of the period whose [`Period::stamp`] is `stamp`.
    pub fn stamped(tenant: &str, agent: Option<&str>, unit: Unit, period: Period, stamp: &str) -> Self {
        CounterKey([tenant, agent.unwrap_or("*"), unit.as_str(), period.as_str(), stamp].join("/").into())
    }

    /// A per-minute window's counter (SPEC §14), in the minute that holds `now`:
    /// `acme/*/requests/minute/2026-12-06T09:01`. `holder` is an agent or `*` (the
    /// tenant); a key's limits count under the tenant `~key` (`~key/9f86d081…/…`),
    /// whatever tenant it calls for, and a backend's quota under `~backend`.
    pub fn window(tenant: &str, holder: Option<&str>, unit: Unit, now: u64) -> Self {
        Self::stamped(tenant, holder, unit, Period::Minute, &Period::Minute.stamp(now))
    }

    /// A run's counter (SPEC §15): `acme/~run_…/tokens/run/2026-12-06T10:01:05Z`, the
    /// run's expiry as its stamp.
    pub fn run(tenant: &str, run: &str, unit: Unit, expires_at: u64) -> Self {
        let holder = format!("~{run}");
        CounterKey([tenant, &holder, unit.as_str(), "run", &timestamp(expires_at)].join("/").into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// When the counter stops meaning anything (Unix seconds): a window's at its
    /// minute's end, a run's at the run's expiry; `None` for a budget (a day or a
    /// month is kept, the console and the report read it). A store may forget a
    /// counter at [`CounterKey::forget_at`]: a late settlement then finds it at 0 and
    /// leaves it at 0, having nothing to give back to.
    pub fn expiry(&self) -> Option<u64> {
        let mut parts = self.0.rsplitn(3, '/');
        let (stamp, period) = (parts.next()?, parts.next()?);
        match period {
            "minute" => jiff::civil::DateTime::strptime("%Y-%m-%dT%H:%M", stamp)
                .ok()
                .and_then(|t| jiff::tz::Offset::UTC.to_timestamp(t).ok())
                .and_then(|t| u64::try_from(t.as_second()).ok())
                .map(|start| start + 60),
            "run" => stamp.parse::<jiff::Timestamp>().ok().and_then(|t| u64::try_from(t.as_second()).ok()),
            _ => None,
        }
    }

    /// Whether it is a run's counter ([`CounterKey::run`]).
    pub fn is_run(&self) -> bool {
        self.0.rsplit('/').nth(1) == Some("run")
    }

    /// When a store may forget the counter (Unix seconds): a window
    /// [`WINDOW_RETENTION_SECS`] past its minute, a run's counter
    /// [`RUN_RETENTION_SECS`] past the run's expiry; `None` for a budget, kept.
    pub fn forget_at(&self) -> Option<u64> {
        let retention = if self.is_run() { RUN_RETENTION_SECS } else { WINDOW_RETENTION_SECS };
        self.expiry().map(|expiry| expiry.saturating_add(retention))
    }
}

/// How long a store keeps a window's counter past its minute: an hour, so a stream's
/// late settlement (a call lives 15 minutes at most) still finds its window; nothing
/// reads an older one, and a sweep walks fewer.
pub const WINDOW_RETENTION_SECS: u64 = 3600;

/// How long a store keeps a run, and its counters, past the run's expiry: a day, so a
/// run's `GET` still reads what it spent.
pub const RUN_RETENTION_SECS: u64 = 86_400;

/// `2026-12-06T10:01:05Z`.
fn timestamp(at: u64) -> String {
    let at = i64::try_from(at).ok().and_then(|s| jiff::Timestamp::from_second(s).ok()).unwrap_or(jiff::Timestamp::MAX);
    at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Tokens,
    /// Micro-euros.
    MicroEur,
    /// Calls: a per-minute request window, a run's calls.
    Requests,
}

impl Unit {
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Tokens => "tokens",
            Unit::MicroEur => "eur",
            Unit::Requests => "requests",
        }
    }
}

/// One counter's part of a reservation: the amount, and the limit it must stay under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    pub key: CounterKey,
    pub amount: u64,
    /// `None`: counted, never refused.
    pub limit: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveRequest {
    pub request_id: String,
    pub lines: Vec<Line>,
    /// Unix seconds after which the sweeper refunds the reservation.
    pub expires_at: u64,
}

impl ReserveRequest {
    /// What its settlement needs: the request id and the lines as reserved.
    pub fn reservation(&self) -> Reservation {
        Reservation {
            request_id: self.request_id.clone(),
            lines: self.lines.iter().map(|l| (l.key.clone(), l.amount)).collect(),
        }
    }
}

/// A reservation as its caller made it, carried by the `Ticket` to the settlement, so
/// that a store can settle in one write without reading the reservation first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reservation {
    pub request_id: String,
    /// `(counter, amount)` per line of the `ReserveRequest`, in its order.
    pub lines: Vec<(CounterKey, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveOutcome {
    Reserved,
    /// The line (index into `lines`) whose limit refused; nothing was written.
    Refused {
        line: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleOutcome {
    /// The reservation was replaced by the actual amounts.
    Settled,
    /// The sweeper had refunded it; the actual amounts were charged instead.
    ChargedAfterSweep,
    /// No such reservation: already settled (or never made). Nothing was written.
    Unknown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntentOutcome {
    /// The actual amounts are on the reservation: the sweeper charges them.
    Recorded,
    /// No such reservation: the settlement applied after all (its answer was lost), or
    /// the reservation was already closed. Nothing was written.
    Unknown,
}

/// What one sweep closed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    /// Expired reservations refunded in full.
    pub refunded: usize,
    /// Expired reservations that carried a settle intent, charged its amounts: calls
    /// whose settlement could not be written.
    pub charged: usize,
    /// Expired budget leases closed (charged the usage last recorded on them, their
    /// unused slices returned): the normal end of a lease whose owner stopped
    /// renewing it (gone, frozen), counted apart from failed settlements.
    pub leases: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("budget store: {0}")]
    Backend(String),
    /// Contended past the store's own retries (DynamoDB's `TransactionConflict`,
    /// throttling): the caller may try again in a moment.
    #[error("budget store busy: {0}")]
    Busy(String),
    #[error("budget store: corrupt record {key}: {detail}")]
    Corrupt { key: String, detail: String },
}

/// The ledger. Implementations: `MemoryBudgetStore` (tests), `EmbeddedBudgetStore`
/// (local default, durable), `DynamoDbBudgetStore` (serverless), and
/// `LeasedBudgetStore` over any of them (budget leases: one tenant past one counter
/// item's write rate). All pass `conformance::run_all`.
#[async_trait::async_trait]
pub trait BudgetStore: Send + Sync {
    /// Atomically adds every line's amount, or nothing if any limit would be passed.
    /// Idempotent on `request_id`.
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError>;

    /// Replaces the reservation by `actual` (per counter key; a key absent from
    /// `actual` settles at 0, so `&[]` is a full refund).
    ///
    /// `reservation` is what the caller reserved: a store may write the settlement from
    /// it without reading first (DynamoDB: one transaction), but what the store holds
    /// decides: a reservation swept meanwhile is charged `actual` alone, one already
    /// closed is `Unknown`, and lines that differ from the stored ones are never
    /// trusted (the stored ones are settled).
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError>;

    /// Leaves `actual` (as for `settle`) on the reservation, for the sweeper to charge,
    /// when the settlement itself could not be written. Writes the reservation alone,
    /// never a counter; recording again replaces the amounts. Works on a swept
    /// reservation too (its late settlement failed): the sweeper then charges `actual`.
    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError>;

    /// Renews a live reservation (a budget lease, `lease.rs`): records `actual` as its
    /// intent, as `record_intent` does, and moves its expiry to `expires_at`, in one
    /// write of the reservation alone. `Unknown`, and nothing written, when it is no
    /// longer live: closed, or swept (a swept reservation is never revived).
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError>;

    /// Closes every reservation whose expiry is before `now`: one carrying a settle
    /// intent is settled on it (counters move by actual − reserved, or by actual if it
    /// was already refunded), any other live one is refunded in full.
    async fn sweep(&self, now: u64) -> Result<Swept, StoreError>;

    /// Current values of the counters (0 for a counter never written).
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError>;

    /// Live (unsettled, unswept) reservations: for tests, metrics and operators.
    async fn live_reservations(&self) -> Result<usize, StoreError>;

    /// Stores a new run (SPEC §15) and names it among its parent's children, in one
    /// atomic step. `false`, and nothing written, when its id is taken or its parent
    /// (`run.ancestors[0]`) is not stored, has ended or has [`run::MAX_CHILDREN`]
    /// children already.
    async fn create_run(&self, run: &Run) -> Result<bool, StoreError>;

    /// A run as stored (kept [`RUN_RETENTION_SECS`] past its expiry at least).
    async fn run(&self, id: &str) -> Result<Option<Run>, StoreError>;

    /// Ends a run at `at`, and every descendant not ended before.
    async fn end_run(&self, id: &str, at: u64) -> Result<RunEnd, StoreError>;
}

impl From<StoreError> for crate::error::GatewayError {
    /// A ledger contended past its retries is `ledger_busy` (retry in a second); any
    /// other failure is internal, its detail for the log only.
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Busy(detail) => {
                tracing::warn!("{detail}");
                crate::error::GatewayError::LedgerBusy
            }
            other => crate::error::GatewayError::Internal(other.to_string()),
        }
    }
}
