//! Admission: the route and reserve phases of an inference call (SPEC §4, §6).
//!
//! Reads the caller's counters once, decides the soft cap, builds the candidate
//! chain, and reserves an upper bound of the call's cost at the highest price in that
//! chain, clamping the completion allowance when only that makes the call fit. A call
//! that passes admission holds a `Ticket`; one that does not has written nothing.

use crate::budget::plan::{self, Allowance, Budget};
use crate::budget::{ReserveOutcome, ReserveRequest, Ticket, period::unix_now};
use crate::config::Capability;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::routing::{Route, RouteRequest};

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

pub async fn admit(
    gateway: &Gateway,
    caller: &Caller,
    request_id: &str,
    demand: &Demand,
) -> Result<Admission, GatewayError> {
    let now = unix_now();
    let config = &gateway.config;
    let budgets = plan::budgets_for(config, &caller.tenant, caller.agent.as_ref().map(|a| a.as_str()), now);
    let keys: Vec<_> = budgets.iter().map(|b| b.key.clone()).collect();
    let used = gateway.budgets.used(&keys).await.map_err(|e| GatewayError::Internal(e.to_string()))?;
    for (budget, used) in budgets.iter().zip(&used) {
        if let Some(limit) = budget.limit {
            gateway.metrics.set_budget_remaining(
                caller.tenant.as_str(),
                &budget.name,
                limit.saturating_sub(*used) as f64,
            );
        }
    }
    let soft = config.ai.budget.soft.as_ref().is_some_and(|s| plan::is_soft(&budgets, &used, s.threshold_ppm));
    let route = gateway
        .router
        .route(caller, &RouteRequest { capability: demand.capability, sensitive: demand.sensitive, soft })?;
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
    let planned = plan::plan(&budgets, &used, demand.prompt_tokens, allowance, price)
        .map_err(|index| exceeded(&budgets[index], now))?;
    let mut life: u64 = route.candidates.iter().map(|c| gateway.timeout(&c.backend).as_secs() + 1).sum();
    life += if demand.stream { STREAM_RESERVATION_SECS } else { RESERVATION_GRACE_SECS };
    let request =
        ReserveRequest { request_id: request_id.to_owned(), lines: planned.lines.clone(), expires_at: now + life };
    match gateway.budgets.reserve(&request).await.map_err(|e| GatewayError::Internal(e.to_string()))? {
        ReserveOutcome::Reserved => {}
        // Lines are the budgets, in order.
        ReserveOutcome::Refused { line } => return Err(exceeded(&budgets[line], now)),
    }
    Ok(Admission {
        route,
        ticket: Ticket::new(gateway.budgets.clone(), request.reservation(), budgets),
        soft,
        allowance: planned.per_choice,
    })
}

fn exceeded(budget: &Budget, now: u64) -> GatewayError {
    GatewayError::BudgetExceeded {
        budget: budget.name.clone(),
        retry_after_secs: budget.resets_at.saturating_sub(now).max(1),
    }
}
