//! Admission: the route and reserve phases of an inference call (SPEC §4, §6).
//!
//! Decides the soft cap, builds the candidate chain, and reserves an upper bound of the
//! call's cost at the highest price in that chain, clamping the completion allowance
//! when only that makes the call fit. A call that passes admission holds a `Ticket`;
//! one that does not has written nothing.
//!
//! The counters are not read on the way (one store write per admitted call): the first
//! reservation assumes the counters leave room for the whole allowance and stand below
//! the soft threshold, and its conditions check exactly that (each limited line's
//! limit is tightened to "still under the soft threshold before this call"). Only when
//! a condition refuses are the counters read, and the call decided again as if they
//! had been read first: soft cap, route, clamped allowance, or the refusal. A caller
//! found past its soft threshold is remembered for a while, so its next calls
//! go straight to the soft route without a refused write each (`budget::SoftHints`). The
//! `flexway_budget_remaining` gauge is set from those reads: it moves near the soft
//! threshold and the caps, not on every call.

use std::sync::Arc;
use std::time::Instant;

use crate::budget::plan::{self, Allowance, Budget, Kind, Pace};
use crate::budget::ticket::reserve_guarded;
use crate::budget::{ReserveOutcome, ReserveRequest, Run, Ticket, period::unix_now};
use crate::call::Criticality;
use crate::config::Capability;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::routing::breaker::State as BreakerState;
use crate::routing::{Residency, Route, RouteRequest};

/// Extra life of a reservation beyond the chain's timeouts, before the sweeper may
/// refund it.
pub const RESERVATION_GRACE_SECS: u64 = 10;
/// A stream's reservation outlives its backend timeouts (which bound each wait, not
/// the whole stream): a live stream is not swept under a running call.
pub const STREAM_RESERVATION_SECS: u64 = 15 * 60;
/// What a call asks of the budgets.
#[derive(Debug, Clone)]
pub struct Demand {
    pub capability: Capability,
    /// Upper bound of the prompt's tokens.
    pub prompt_tokens: u64,
    /// The client's `max_completion_tokens`/`max_tokens`; `None` takes the default.
    pub max_tokens: Option<u64>,
    /// `n`: each choice may write the whole allowance.
    pub choices: u64,
    /// Chat completes; embeddings only read.
    pub completes: bool,
    pub stream: bool,
    /// The sensitivity header was true.
    pub sensitive: bool,
    /// The session's affinity key (`routing::affinity_key`), if any.
    pub affinity: Option<u64>,
    /// The prompt's prefix key (`routing::prefix_key`), when a pool has
    /// `cache_affinity`.
    pub prefix: Option<u64>,
    /// The call's class ([`criticality`]).
    pub criticality: Criticality,
    /// Where it may be processed ([`residency`]).
    pub residency: Residency,
    /// The backend its route starts from, when the gateway names it (a cache
    /// policy's `embed` backend); `None`: the caller's routing.
    pub entry: Option<crate::config::BackendId>,
}

pub struct Admission {
    pub route: Route,
    pub ticket: Ticket,
    /// `Flexway-Budget: soft`.
    pub soft: bool,
    /// The completion allowance of each choice: what was reserved, and what must be
    /// sent upstream (the client's limit, the default, or a clamped one).
    pub allowance: u64,
}

/// One decision of admission: from counters read (`used`), or assumed at 0 with
/// `guard` holding the reservation under the soft threshold (`threshold_ppm`).
struct Decision<'a> {
    budgets: &'a Arc<[Budget]>,
    used: &'a [u64],
    soft: bool,
    guard: Option<u32>,
}

enum Decided {
    Admitted(Admission),
    /// A line's condition refused; nothing was written.
    Refused(usize),
}

/// Who reserves, and where a call's window standing goes (`x-ratelimit-*`): set
/// whenever a window applies, on an admission and on a refusal alike.
pub struct Reserving<'a> {
    pub caller: &'a Caller,
    /// The run the call joined (`Flexway-Run`), read and checked by the driver.
    pub run: Option<&'a Run>,
    pub request_id: &'a str,
    pub pace: &'a mut Option<Pace>,
}

pub async fn admit(gateway: &Gateway, who: Reserving<'_>, demand: &Demand) -> Result<Admission, GatewayError> {
    let Reserving { caller, run, request_id, pace } = who;
    let now = unix_now();
    let config = &gateway.config;
    let budgets = plan::counters_for(config, caller, run, now);
    let threshold = config.ai.budget.soft.as_ref().map(|s| s.threshold_ppm);
    let unread = vec![0; budgets.len()];
    let assumed_soft = threshold
        .is_some_and(|t| plan::is_soft(&budgets, &unread, t) || gateway.soft_hints.any(&budgets, Instant::now()));
    let first =
        Decision { budgets: &budgets, used: &unread, soft: assumed_soft, guard: threshold.filter(|_| !assumed_soft) };
    let refused = match decide(gateway, caller, request_id, demand, &first, now).await? {
        Decided::Admitted(admission) => {
            if budgets.iter().any(Budget::is_window) {
                *pace = paced(gateway, &budgets).await;
            }
            return Ok(admission);
        }
        Decided::Refused(line) => line,
    };
    // A window refused: no clamp makes room in it, the call waits for the next minute.
    if budgets[refused].is_window() {
        *pace = paced(gateway, &budgets).await;
        return Err(refusal(gateway, caller, &budgets[refused], now));
    }
    // A limit or the soft threshold refused: read the counters and decide again.
    let keys: Vec<_> = budgets.iter().map(|b| b.key.clone()).collect();
    let used = gateway.budgets.used(&keys).await?;
    *pace = Pace::of(budgets.iter(), &used);
    for (budget, used) in budgets.iter().zip(&used) {
        if !budget.is_period() {
            continue;
        }
        if let Some(limit) = budget.limit {
            gateway.metrics.set_budget_remaining(
                caller.tenant.as_str(),
                &budget.name,
                limit.saturating_sub(*used) as f64,
            );
        }
    }
    let soft = threshold.is_some_and(|t| plan::is_soft(&budgets, &used, t));
    if let Some(t) = threshold {
        gateway.soft_hints.note(&budgets, &used, t, Instant::now());
    }
    let read = Decision { budgets: &budgets, used: &used, soft, guard: None };
    match decide(gateway, caller, request_id, demand, &read, now).await? {
        Decided::Admitted(admission) => {
            *pace = paced(gateway, &budgets).await;
            Ok(admission)
        }
        // Lines are the budgets, in order.
        Decided::Refused(line) => {
            *pace = paced(gateway, &budgets).await;
            Err(refusal(gateway, caller, &budgets[line], now))
        }
    }
}

/// The caller's standing in its windows, read after its reservation (one read of the
/// window counters, only when a window applies; where a call is admitted, that is
/// tested before, so that a call under no limit builds no future for it). Best effort:
/// a read that fails costs the answer its pacing headers, never the call (its
/// reservation is made).
async fn paced(gateway: &Gateway, budgets: &[Budget]) -> Option<Pace> {
    let windows = || budgets.iter().filter(|b| b.is_window());
    let keys: Vec<_> = windows().map(|b| b.key.clone()).collect();
    if keys.is_empty() {
        return None;
    }
    match gateway.budgets.used(&keys).await {
        Ok(used) => Pace::of(windows(), &used),
        Err(e) => {
            tracing::warn!("the windows could not be read for the pacing headers: {e}");
            None
        }
    }
}

async fn decide(
    gateway: &Gateway,
    caller: &Caller,
    request_id: &str,
    demand: &Demand,
    decision: &Decision<'_>,
    now: u64,
) -> Result<Decided, GatewayError> {
    let config = &gateway.config;
    let budgets = decision.budgets;
    let route = gateway.router.route(
        caller,
        &RouteRequest {
            capability: demand.capability,
            sensitive: demand.sensitive,
            soft: decision.soft,
            affinity: demand.affinity,
            prefix: demand.prefix,
            criticality: demand.criticality,
            residency: demand.residency.clone(),
            entry: demand.entry.clone(),
        },
    )?;
    if demand.criticality == Criticality::Sheddable {
        let now = std::time::Instant::now();
        let available = |b: &crate::config::BackendId| gateway.breakers.state(b, now) != BreakerState::Open;
        if let Err(refused) = gateway.router.shed(&route, available) {
            if let GatewayError::Overloaded { pool } = &refused {
                gateway.metrics.shed(caller.tenant.as_str(), pool.as_str());
            }
            return Err(refused);
        }
    }
    // Seen by the calls routed while this one reserves (after the shedding, which
    // must not count the call against itself).
    route.hold_first(&gateway.router.loads);
    let price = plan::highest_price(route.candidates.iter().map(|c| gateway.price(&c.backend)));
    let allowance = if demand.completes {
        let default = u64::from(config.ai.budget.default_max_tokens);
        Allowance {
            per_choice: demand.max_tokens.unwrap_or(default),
            choices: demand.choices,
            min_per_choice: u64::from(config.ai.budget.min_completion_tokens),
        }
    } else {
        Allowance::NONE
    };
    // Refused here only when even the counters' lowest value could not hold the call.
    let planned = plan::plan(budgets, decision.used, demand.prompt_tokens, allowance, price)
        .map_err(|index| unplanned(gateway, caller, &budgets[index], demand.prompt_tokens, now))?;
    let mut lines = planned.lines;
    if let Some(threshold_ppm) = decision.guard {
        for (line, budget) in lines.iter_mut().zip(budgets.iter()) {
            if budget.is_period() {
                line.limit = line.limit.map(|limit| under_soft(limit, line.amount, threshold_ppm));
            }
        }
    }
    let mut life: u64 = route.candidates.iter().map(|c| gateway.attempt_time(&c.backend).as_secs() + 1).sum();
    life += if demand.stream { STREAM_RESERVATION_SECS } else { RESERVATION_GRACE_SECS };
    let request = ReserveRequest { request_id: request_id.to_owned(), lines, expires_at: now + life };
    let outcome = reserve_guarded(&gateway.budgets, &request).await;
    match outcome? {
        ReserveOutcome::Reserved => Ok(Decided::Admitted(Admission {
            route,
            ticket: Ticket::new(gateway.budgets.clone(), request.reservation(), Arc::clone(budgets), now),
            soft: decision.soft,
            allowance: planned.per_choice,
        })),
        ReserveOutcome::Refused { line } => Ok(Decided::Refused(line)),
    }
}

/// The allowance of a realtime session's next response (SPEC §2.3), at the price of
/// the backend the session is pinned to: `prompt` tokens (a realtime response reads
/// the whole conversation so far, so the last response's total is the next one's
/// floor) plus the completion allowance (`ai.budget.default_max_tokens`, clamped down
/// to `min_completion_tokens` when only that fits). As for a call, the counters are
/// read only when the first write is refused. `Err(BudgetExceeded)` when no allowance
/// fits: the session ends there. No routing: a session never moves.
pub async fn reserve_turn(
    gateway: &Gateway,
    who: Reserving<'_>,
    prompt: u64,
    price: crate::config::Price,
) -> Result<(Ticket, u64), GatewayError> {
    let Reserving { caller, run, request_id, pace } = who;
    let now = unix_now();
    let config = &gateway.config;
    let budgets = plan::counters_for(config, caller, run, now);
    let allowance = Allowance {
        per_choice: u64::from(config.ai.budget.default_max_tokens),
        choices: 1,
        min_per_choice: u64::from(config.ai.budget.min_completion_tokens),
    };
    let mut used = vec![0; budgets.len()];
    let mut read = false;
    loop {
        let planned = plan::plan(&budgets, &used, prompt, allowance, price)
            .map_err(|i| unplanned(gateway, caller, &budgets[i], prompt, now))?;
        let expires_at = now + STREAM_RESERVATION_SECS;
        let request = ReserveRequest { request_id: request_id.to_owned(), lines: planned.lines, expires_at };
        let outcome = reserve_guarded(&gateway.budgets, &request).await;
        match outcome? {
            ReserveOutcome::Reserved => {
                if budgets.iter().any(Budget::is_window) {
                    *pace = paced(gateway, &budgets).await;
                }
                let ticket = Ticket::new(gateway.budgets.clone(), request.reservation(), budgets, now);
                return Ok((ticket, planned.per_choice));
            }
            ReserveOutcome::Refused { line } if read || budgets[line].is_window() => {
                *pace = paced(gateway, &budgets).await;
                return Err(refusal(gateway, caller, &budgets[line], now));
            }
            // A limit refused: read the counters, and plan again (clamped) on them.
            ReserveOutcome::Refused { .. } => {
                let keys: Vec<_> = budgets.iter().map(|b| b.key.clone()).collect();
                used = gateway.budgets.used(&keys).await?;
                read = true;
            }
        }
    }
}

/// A reservation of `usage` that no limit refuses: for what was used without one (a
/// realtime response the backend started on its own while none could be reserved, and
/// that was cancelled), so its tokens and cost are charged like any other's. Counted,
/// never refused; no request is counted (it was refused before its first byte).
pub async fn reserve_used(
    gateway: &Gateway,
    who: Reserving<'_>,
    usage: crate::call::Usage,
    price: crate::config::Price,
) -> Result<Ticket, GatewayError> {
    let Reserving { caller, run, request_id, .. } = who;
    let now = unix_now();
    let counters = plan::counters_for(&gateway.config, caller, run, now);
    let budgets: Arc<[Budget]> = counters.iter().filter(|b| b.unit != crate::budget::Unit::Requests).cloned().collect();
    let lines = plan::actual(&budgets, usage, price)
        .into_iter()
        .map(|(key, amount)| crate::budget::Line { key, amount, limit: None })
        .collect();
    let request = ReserveRequest { request_id: request_id.to_owned(), lines, expires_at: now + RESERVATION_GRACE_SECS };
    let outcome = reserve_guarded(&gateway.budgets, &request).await;
    outcome?;
    Ok(Ticket::new(gateway.budgets.clone(), request.reservation(), budgets, now))
}

/// A call's class and where it may be processed (SPEC §5, §4): the class its
/// `Flexway-Criticality` asks for (default `standard`) lowered to its caller's
/// `max_criticality`, and its caller's `residency` narrowed by its
/// `Flexway-Jurisdiction`. An unreadable header is refused, never read as no limit.
pub fn limits(
    config: &crate::config::Config,
    caller: &Caller,
    headers: &http::HeaderMap,
) -> Result<(Criticality, Residency), crate::call::InvalidRequest> {
    let (max_criticality, bound) = config.limits(&caller.tenant, caller.agent.as_ref());
    Ok((Criticality::asked(headers)?.min(max_criticality), Residency::of_call(bound, headers)?))
}

/// Where a call that has no class (gRPC, REST) may be processed: as [`limits`].
pub fn residency(
    config: &crate::config::Config,
    caller: &Caller,
    headers: &http::HeaderMap,
) -> Result<Residency, crate::call::InvalidRequest> {
    Residency::of_call(config.limits(&caller.tenant, caller.agent.as_ref()).1, headers)
}

/// The limit a line reserved under the assumption "not soft" must stay under: the
/// counter before this call below the soft threshold (`plan::is_soft`: soft when
/// `used × 10⁶ ≥ limit × threshold_ppm`), and the limit itself after it.
fn under_soft(limit: u64, amount: u64, threshold_ppm: u32) -> u64 {
    let soft_at = (u128::from(limit) * u128::from(threshold_ppm)).div_ceil(1_000_000);
    let highest_unsoft = u64::try_from(soft_at).unwrap_or(u64::MAX).saturating_sub(1);
    limit.min(highest_unsoft.saturating_add(amount))
}

/// Reserves `amount` micro-euros (and no tokens) on every budget of the caller: a
/// gRPC call's reservation (SPEC §10), one atomic write, refused whole at a hard cap.
/// `request_id` names the reservation (a call may hold several: `req_..`, `req_../2`).
pub async fn reserve_eur(
    gateway: &Gateway,
    who: Reserving<'_>,
    amount: crate::money::MicroEur,
    life_secs: u64,
) -> Result<Ticket, GatewayError> {
    let Reserving { caller, run, request_id, pace } = who;
    let now = unix_now();
    let budgets = plan::counters_for(&gateway.config, caller, run, now);
    // The call's first step counts as one request in every request window (and one of
    // its run's calls); later steps (`name/2`, ...) count euros only.
    let first = !request_id.contains('/');
    let lines = budgets
        .iter()
        .map(|b| {
            let amount = match b.unit {
                crate::budget::Unit::MicroEur => amount.0,
                crate::budget::Unit::Requests if first => 1,
                _ => 0,
            };
            // A line that adds nothing is counted, never refused: a counter already
            // past its cap (a realtime response may pass one) refuses what costs,
            // not an unmetered call or a tool of no price.
            crate::budget::Line { key: b.key.clone(), amount, limit: b.limit.filter(|_| amount > 0) }
        })
        .collect();
    let request = ReserveRequest { request_id: request_id.to_owned(), lines, expires_at: now + life_secs };
    let outcome = reserve_guarded(&gateway.budgets, &request).await;
    let outcome = outcome?;
    // What a client paces on is its call's first step (a later one is the same call).
    if first && budgets.iter().any(Budget::is_window) {
        *pace = paced(gateway, &budgets).await;
    }
    match outcome {
        ReserveOutcome::Reserved => Ok(Ticket::new(gateway.budgets.clone(), request.reservation(), budgets, now)),
        ReserveOutcome::Refused { line } => Err(refusal(gateway, caller, &budgets[line], now)),
    }
}

/// The refusal of a call that `budget`'s limit did not let through: a budget's or a
/// run's `budget_exceeded`, a window's `rate_limit_exceeded` (counted per holder).
fn refusal(gateway: &Gateway, caller: &Caller, budget: &Budget, now: u64) -> GatewayError {
    let until_reset = budget.resets_at.saturating_sub(now).max(1);
    match budget.kind {
        Kind::Period => {
            GatewayError::BudgetExceeded { budget: budget.name.clone(), retry_after_secs: Some(until_reset) }
        }
        Kind::Run => GatewayError::BudgetExceeded { budget: budget.name.clone(), retry_after_secs: None },
        Kind::Window(rate) => {
            gateway.metrics.rate_limited(caller.tenant.as_str(), &budget.name, rate.as_str());
            GatewayError::RateLimited {
                holder: budget.name.clone(),
                kind: rate,
                limit: budget.limit.unwrap_or(0),
                retry_after_secs: until_reset.min(60),
            }
        }
    }
}

/// A call that no state of `budget`'s counter could hold: beyond a budget or a run,
/// that is its refusal; beyond a window's whole limit, it could never pass (400).
fn unplanned(gateway: &Gateway, caller: &Caller, budget: &Budget, prompt: u64, now: u64) -> GatewayError {
    match budget.kind {
        Kind::Window(rate) => crate::call::InvalidRequest::message(format!(
            "this request can never fit {} {rate} of {}: its prompt is up to {prompt} tokens, and with the minimum \
             completion it needs more than the whole window",
            budget.name,
            budget.limit.unwrap_or(0)
        ))
        .into(),
        _ => refusal(gateway, caller, budget, now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{CounterKey, Unit};

    fn budget(limit: u64) -> Budget {
        Budget {
            name: "b".into(),
            key: CounterKey("k".into()),
            unit: Unit::Tokens,
            limit: Some(limit),
            resets_at: 0,
            kind: Kind::Period,
        }
    }

    /// The tightened condition (`used <= limit' - amount`) admits exactly the counters
    /// `plan::is_soft` calls not soft, and never more than the limit.
    #[test]
    fn the_soft_guard_admits_exactly_the_counters_under_the_threshold() {
        for (limit, ppm, amount) in [(1000, 800_000, 10), (1000, 800_001, 10), (7, 500_000, 1), (1000, 800_000, 900)] {
            let guarded = under_soft(limit, amount, ppm);
            for used in 0..=limit {
                let fits = used <= guarded - amount.min(guarded);
                let expected = !plan::is_soft(&[budget(limit)], &[used], ppm) && used + amount <= limit;
                assert_eq!(fits, expected, "limit {limit} ppm {ppm} amount {amount} used {used}");
            }
        }
    }
}
