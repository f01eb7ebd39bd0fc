//! Metering of specialised models' operations (SPEC §10), one implementation for the
//! gRPC methods that carry `(flexway.v1.operation).ai` and the REST operations that
//! carry `x-flexway-ai`:
//! - per call: one call's price reserved before the call, charged when the upstream
//!   served it, refunded otherwise; the body is never read;
//! - per byte: the bytes the call is expected to move reserved before it starts, and
//!   another step reserved whenever more are about to pass than are covered; a step
//!   refused at the cap ends the call, so the cap is never passed; settled on the
//!   bytes that passed.
//!
//! An operation without metering costs nothing, but still counts where calls are
//! counted (SPEC §14, §15): for a caller under a per-minute window or in a run, its
//! reservation is one of zero euros carrying its request (one in each request window,
//! one of its run's calls), settled at the end when the upstream answered (a REST
//! operation: 2xx or 3xx) and refunded otherwise, as a metered call's is. A caller
//! under no window and in no run writes nothing.
//!
//! A call's meter is held in its `Charge` from its first reservation on; the relay
//! reserves its steps as bytes pass, and only the driver's end closes it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::admission::{Reserving, STREAM_RESERVATION_SECS, reserve_eur};
use crate::budget::Run;
use crate::budget::Ticket;
use crate::budget::plan::{self, Pace};
use crate::call::RequestId;
use crate::config::{AiOperation, GrpcMetering};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::money::MicroEur;

/// The response allowance a per-byte call reserves before it starts, and the least it
/// reserves at each step after.
pub const RESPONSE_ALLOWANCE_BYTES: u64 = 4096;
/// The error line of a metered cost that its reservations do not cover: the part
/// beyond them is not charged. It cannot happen while every step is reserved before
/// its bytes pass; the template's metric filter counts it, by this text, if it does.
pub const COST_BEYOND_RESERVATIONS: &str = "metered cost beyond its reservations: not charged";
/// The largest message (gRPC) or chunk (REST) a metered call passes at once: more
/// declared at once ends the call.
pub const MAX_MESSAGE_BYTES: u64 = 4 * 1024 * 1024;

/// Why a metered call must end before its bytes pass.
#[derive(Debug)]
pub enum Stop {
    /// A step refused (the cap, or the ledger).
    Budget(GatewayError),
    /// A message declared larger than [`MAX_MESSAGE_BYTES`].
    TooLarge(u64),
}

/// A call's budget: its reservations, what they cover, and what passed.
pub struct Meter {
    pub gateway: Arc<Gateway>,
    caller: Caller,
    /// The run the call joined: every step counts in it.
    run: Option<Arc<Run>>,
    request_id: String,
    operation: Option<AiOperation>,
    life_secs: u64,
    /// The caller's standing in its windows at the first step.
    pace: Mutex<Option<Pace>>,
    held: tokio::sync::Mutex<Held>,
    /// A step refused at the cap, or a message too large: how the call ends.
    stop: Mutex<Option<Stop>>,
}

#[derive(Default)]
struct Held {
    tickets: Vec<(Ticket, MicroEur)>,
    /// The first reservation's date: the call counts on it.
    period: Option<String>,
    /// Bytes the reservations cover, and bytes admitted.
    covered: u64,
    admitted: u64,
    /// Payload bytes that passed, both directions.
    passed: u64,
    closed: bool,
}

impl Meter {
    pub fn new(
        gateway: Arc<Gateway>,
        caller: Caller,
        run: Option<Arc<Run>>,
        request_id: &RequestId,
        operation: Option<AiOperation>,
        timeout: Duration,
    ) -> Self {
        Meter {
            gateway,
            caller,
            run,
            request_id: request_id.0.clone(),
            pace: Mutex::new(None),
            operation,
            life_secs: timeout.as_secs() + STREAM_RESERVATION_SECS,
            held: tokio::sync::Mutex::new(Held::default()),
            stop: Mutex::new(None),
        }
    }

    /// The caller's standing in its windows at the first step, if one applies.
    pub fn pace(&self) -> Option<Pace> {
        *self.pace.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn per_byte(&self) -> Option<&AiOperation> {
        self.operation.as_ref().filter(|op| op.metering == GrpcMetering::PerByte)
    }

    /// The date the call counts on (its first reservation's), once reserved.
    pub async fn period(&self) -> Option<String> {
        self.held.lock().await.period.clone()
    }

    /// The reservation made before the call: one call's price, or `first_bytes` (what
    /// the request is known to carry) plus the response allowance. Unmetered: a
    /// reservation of nothing that counts the request, only where a window or a run
    /// counts it.
    pub async fn reserve_first(&self, first_bytes: u64) -> Result<(), GatewayError> {
        let Some(operation) = &self.operation else {
            if self.run.is_none() && !plan::limited(&self.gateway.config, &self.caller) {
                return Ok(());
            }
            let mut held = self.held.lock().await;
            return self.step(&mut held, MicroEur(0), 0).await;
        };
        let units = match operation.metering {
            GrpcMetering::PerCall => 1,
            GrpcMetering::PerByte => first_bytes + RESPONSE_ALLOWANCE_BYTES,
        };
        let mut held = self.held.lock().await;
        self.step(&mut held, operation.cost(units), units).await
    }

    /// Reserves `amount`, which covers `units` more.
    async fn step(&self, held: &mut Held, amount: MicroEur, units: u64) -> Result<(), GatewayError> {
        let id = match held.tickets.len() {
            0 => self.request_id.clone(),
            n => format!("{}/{}", self.request_id, n + 1),
        };
        let mut pace = None;
        let who = Reserving { caller: &self.caller, run: self.run.as_deref(), request_id: &id, pace: &mut pace };
        let reserved = reserve_eur(&self.gateway, who, amount, self.life_secs).await;
        if held.tickets.is_empty() && pace.is_some() {
            *self.pace.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = pace;
        }
        let ticket = reserved?;
        held.period.get_or_insert_with(|| ticket.period());
        held.tickets.push((ticket, amount));
        held.covered += units;
        Ok(())
    }

    /// Before `declared` bytes pass (per-byte calls): reserves a step if the
    /// reservations do not cover them. `false`: the call must end ([`Meter::stop`]).
    pub async fn admit(&self, declared: u64) -> bool {
        let Some(operation) = self.per_byte() else { return true };
        if declared > MAX_MESSAGE_BYTES {
            self.stop_with(Stop::TooLarge(declared));
            return false;
        }
        let mut held = self.held.lock().await;
        if held.closed {
            return false;
        }
        if held.admitted + declared > held.covered {
            let missing = held.admitted + declared - held.covered;
            let units = missing.max(RESPONSE_ALLOWANCE_BYTES);
            if let Err(e) = self.step(&mut held, operation.cost(units), units).await {
                drop(held);
                self.stop_with(Stop::Budget(e));
                return false;
            }
        }
        held.admitted += declared;
        true
    }

    /// `payload` bytes passed (per-byte calls).
    pub async fn passed(&self, payload: u64) {
        if payload > 0 && self.per_byte().is_some() {
            let mut held = self.held.lock().await;
            if !held.closed {
                held.passed += payload;
            }
        }
    }

    fn stop_with(&self, stop: Stop) {
        let mut slot = self.stop.lock().unwrap_or_else(PoisonError::into_inner);
        slot.get_or_insert(stop);
    }

    /// Why the call had to end, if it had to (taken once).
    pub fn stop(&self) -> Option<Stop> {
        self.stop.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Whether a call that ended so keeps its request counted (`close` settles on it,
    /// the record's `charged` says it): served per call, answered per byte or unmetered.
    pub fn counts(&self, answered: bool, served: bool) -> bool {
        match self.operation.as_ref().map(|op| op.metering) {
            Some(GrpcMetering::PerCall) => answered && served,
            Some(GrpcMetering::PerByte) | None => answered,
        }
    }

    /// Settles every reservation on the call's cost and returns it: per call when
    /// `served`, per byte on what passed once the upstream `answered`; a refund
    /// otherwise. Once: later calls cost nothing.
    pub async fn close(&self, answered: bool, served: bool) -> MicroEur {
        let mut held = self.held.lock().await;
        if held.closed {
            return MicroEur(0);
        }
        held.closed = true;
        let Some(operation) = &self.operation else {
            // Unmetered: the request its reservation counted stays counted once the
            // upstream answered.
            for (ticket, _) in std::mem::take(&mut held.tickets) {
                if answered { ticket.settle_eur(MicroEur(0)).await } else { ticket.refund().await }
            }
            return MicroEur(0);
        };
        let cost = match operation.metering {
            _ if !answered => operation.cost(0),
            GrpcMetering::PerCall if served => operation.cost(1),
            GrpcMetering::PerCall => MicroEur(0),
            GrpcMetering::PerByte => operation.cost(held.passed),
        };
        // The cost is within what was reserved (each step was reserved before its
        // bytes passed): spread it over the reservations in order.
        let left = spread(&mut held, cost, self.counts(answered, served)).await;
        if left > 0 {
            tracing::error!(request_id = %self.request_id, left, "{COST_BEYOND_RESERVATIONS}");
        }
        MicroEur(cost.0 - left)
    }

    /// Settles every reservation on `cost`, whatever passed, and returns what was
    /// charged: a response cache hit's share of what its entry's call cost (SPEC §16),
    /// nothing having been called upstream. At most what the reservations hold (a
    /// per-byte entry whose answer passed the first reservation's allowance is charged
    /// that much: no step is reserved for bytes that never pass); each is settled at
    /// most at its amount or refunded, once, as [`Meter::close`] does. Once: later
    /// calls cost nothing.
    pub async fn close_at(&self, cost: MicroEur) -> MicroEur {
        let mut held = self.held.lock().await;
        if held.closed {
            return MicroEur(0);
        }
        held.closed = true;
        // A hit is answered: it counts as a request, as a call served upstream does.
        let left = spread(&mut held, cost, true).await;
        MicroEur(cost.0 - left)
    }
}

/// Settles `held`'s reservations on `cost`, in order, each at most at its amount (the
/// rest refunded, but for the first when the call `counted`); the part of `cost`
/// beyond them all.
async fn spread(held: &mut Held, cost: MicroEur, counted: bool) -> u64 {
    let mut left = cost.0;
    for (n, (ticket, amount)) in std::mem::take(&mut held.tickets).into_iter().enumerate() {
        let part = left.min(amount.0);
        left -= part;
        // The first step carries the call's request (in a window, in a run): a call
        // that `counted` keeps it, even at no cost (a tool priced at nothing would
        // otherwise pass any requests_per_minute).
        if part == 0 && !(n == 0 && counted) {
            ticket.refund().await;
        } else {
            ticket.settle_eur(MicroEur(part)).await;
        }
    }
    left
}
