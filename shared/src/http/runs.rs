//! The runs API (SPEC §15): `POST /v1/flexway/runs` starts a run for the caller's
//! agent, `GET /v1/flexway/runs/{id}` says what it spent, `DELETE` ends it and its
//! descendants.
//!
//! A run is its tenant's and agent's alone: anyone else asking for it, or for an
//! unknown id, gets the same 404 `run_not_found`, never told which. Amounts of euros
//! are read and written as JSON decimals without a float: the ledger counts integer
//! micro-euros ([`MicroEur::parse_eur`], [`MicroEur::to_eur_string`]).

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::ApiError;
use crate::budget::period::unix_now;
use crate::budget::run::{self, DEFAULT_TTL_SECS, MAX_ANCESTORS, MAX_CHILDREN, MAX_TTL_SECS, RunRef, RunState};
use crate::budget::{Run, RunBudget, RunEnd, Unit};
use crate::call::InvalidRequest;
use crate::config::parse_duration;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::money::MicroEur;

/// The longest `label` a run may carry.
pub const MAX_LABEL_BYTES: usize = 256;
/// A run's request body is a few fields: anything past this is not one.
const MAX_BODY_BYTES: usize = 16 * 1024;
/// New ids tried when one is taken (32 random hex digits: never in practice).
const ID_ATTEMPTS: usize = 3;

pub(super) fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/v1/flexway/runs", post(create))
        .route("/v1/flexway/runs/{id}", axum::routing::get(show).delete(end))
}

/// `POST /v1/flexway/runs`'s body; any other field is refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewRun<'a> {
    #[serde(borrow)]
    budget: NewBudget<'a>,
    #[serde(default)]
    ttl: Option<String>,
    #[serde(default)]
    parent: Option<String>,
    #[serde(default)]
    label: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewBudget<'a> {
    #[serde(default)]
    tokens: Option<u64>,
    /// A JSON number (`0.5`) or string (`"0.5"`) of euros, kept as written.
    #[serde(default, borrow)]
    eur: Option<&'a RawValue>,
}

async fn create(State(gateway): State<Arc<Gateway>>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let caller = gateway.keys.authenticate(&headers)?;
    let Some(agent) = caller.agent.as_ref().map(|a| a.as_str().to_owned()) else {
        return Err(invalid(
            "a run belongs to an agent: call with a key bound to one, or name one in Flexway-Agent",
            None,
        ));
    };
    let body = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| invalid(&format!("the body of a new run is at most {MAX_BODY_BYTES} bytes of JSON"), None))?;
    let asked: NewRun<'_> =
        serde_json::from_slice(&body).map_err(|e| invalid(&format!("the body is not a new run: {e}"), None))?;
    let budget = budget(&asked.budget)?;
    let ttl = ttl_secs(asked.ttl.as_deref())?;
    if let Some(label) = &asked.label {
        InvalidRequest::check_bounded("label", label, MAX_LABEL_BYTES)?;
    }
    let now = unix_now();
    let mut expires_at = now.saturating_add(ttl);
    let mut ancestors = Vec::new();
    if let Some(parent) = &asked.parent {
        if !run::is_id(parent) {
            return Err(invalid("`parent` must be a run's id (`run_` and 32 hex digits)", Some("parent")));
        }
        let parent = active(&gateway, &caller, parent).await?;
        if parent.ancestors.len() >= MAX_ANCESTORS {
            let (id, depth) = (parent.id(), parent.ancestors.len() + 1);
            let message = format!("a run has at most {MAX_ANCESTORS} ancestors: a child of {id} would have {depth}");
            return Err(invalid(&message, Some("parent")));
        }
        if parent.children.len() >= MAX_CHILDREN {
            return Err(too_many_children(parent.id()));
        }
        expires_at = expires_at.min(parent.this.expires_at);
        ancestors.push(parent.this.clone());
        ancestors.extend(parent.ancestors.iter().cloned());
    }
    for _ in 0..ID_ATTEMPTS {
        let run = Run {
            this: RunRef { id: run::new_id(), budget, expires_at },
            tenant: caller.tenant.as_str().to_owned(),
            agent: Some(agent.clone()),
            label: asked.label.clone(),
            ancestors: ancestors.clone(),
            created_at: now,
            ended_at: None,
            children: Vec::new(),
        };
        if gateway.budgets.create_run(&run).await? {
            let created = Created {
                id: run.id(),
                expires_at: rfc3339(expires_at),
                budget: Amounts::of(&budget),
                parent: run.ancestors.first().map(|p| p.id.as_str()),
                label: run.label.as_deref(),
            };
            return Ok((StatusCode::CREATED, Json(created)).into_response());
        }
        // Refused: its id is taken (try another), or its parent ended or was given
        // its last child meanwhile.
        if gateway.budgets.run(run.id()).await?.is_none()
            && let Some(parent) = run.ancestors.first()
        {
            let stored = gateway.budgets.run(&parent.id).await?;
            if stored.is_some_and(|p| p.ended_at.is_none() && p.children.len() >= MAX_CHILDREN) {
                return Err(too_many_children(&parent.id));
            }
            return Err(GatewayError::RunEnded { run: parent.id.clone(), why: "ended" }.into());
        }
    }
    Err(GatewayError::Internal(format!("{ID_ATTEMPTS} new run ids were all taken")).into())
}

async fn show(
    State(gateway): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let caller = gateway.keys.authenticate(&headers)?;
    let run = theirs(&gateway, &caller, &id).await?;
    Ok(Json(Status::of(&gateway, &run).await?).into_response())
}

async fn end(
    State(gateway): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let caller = gateway.keys.authenticate(&headers)?;
    let run = theirs(&gateway, &caller, &id).await?;
    if gateway.budgets.end_run(run.id(), unix_now()).await? == RunEnd::Unknown {
        return Err(not_found(&id));
    }
    let run = theirs(&gateway, &caller, &id).await?;
    Ok(Json(Status::of(&gateway, &run).await?).into_response())
}

/// The caller's run `id` (its tenant's and agent's), or 404 whatever the reason.
async fn theirs(gateway: &Gateway, caller: &Caller, id: &str) -> Result<Run, ApiError> {
    if !run::is_id(id) {
        return Err(not_found(id));
    }
    let agent = caller.agent.as_ref().map(|a| a.as_str());
    gateway
        .budgets
        .run(id)
        .await?
        .filter(|r| r.tenant == caller.tenant.as_str() && r.agent.as_deref() == agent)
        .ok_or_else(|| not_found(id))
}

/// The caller's run `id`, active: a parent for a new run.
async fn active(gateway: &Gateway, caller: &Caller, id: &str) -> Result<Run, ApiError> {
    let run = theirs(gateway, caller, id).await?;
    match run.state(unix_now()) {
        RunState::Active => Ok(run),
        RunState::Ended => Err(GatewayError::RunEnded { run: id.to_owned(), why: "ended" }.into()),
        RunState::Expired => Err(GatewayError::RunEnded { run: id.to_owned(), why: "past its expires_at" }.into()),
    }
}

fn not_found(id: &str) -> ApiError {
    GatewayError::RunNotFound { run: id.to_owned() }.into()
}

fn too_many_children(parent: &str) -> ApiError {
    let message = format!("a run has at most {MAX_CHILDREN} children: run {parent} has them already");
    invalid(&message, Some("parent"))
}

fn invalid(message: &str, param: Option<&'static str>) -> ApiError {
    GatewayError::InvalidRequest(InvalidRequest { message: message.to_owned(), param }).into()
}

/// The budget asked: at least one of tokens and euros, each above zero.
fn budget(asked: &NewBudget<'_>) -> Result<RunBudget, ApiError> {
    let eur = match asked.eur {
        None => None,
        Some(raw) => {
            let text = serde_json::from_str::<&str>(raw.get()).unwrap_or(raw.get());
            let eur = MicroEur::parse_eur(text).map_err(|e| invalid(&format!("`budget.eur`: {e}"), Some("budget")))?;
            Some(eur)
        }
    };
    if asked.tokens == Some(0) || eur == Some(MicroEur(0)) {
        return Err(invalid("a run's budget must be above zero", Some("budget")));
    }
    if asked.tokens.is_none() && eur.is_none() {
        return Err(invalid("a run's budget needs `tokens`, `eur` or both", Some("budget")));
    }
    Ok(RunBudget { tokens: asked.tokens, eur })
}

/// The run's life in whole seconds (a fraction of one rounds up): 1 h unless asked,
/// at most 24 h.
fn ttl_secs(asked: Option<&str>) -> Result<u64, ApiError> {
    let Some(text) = asked else { return Ok(DEFAULT_TTL_SECS) };
    let ttl = parse_duration(text).map_err(|e| invalid(&format!("`ttl`: {e}"), Some("ttl")))?;
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    if secs == 0 || secs > MAX_TTL_SECS {
        return Err(invalid(&format!("`ttl` is {text}: a run lives from 1s to 24h"), Some("ttl")));
    }
    Ok(secs)
}

/// `2026-12-06T10:01:05Z`.
fn rfc3339(at: u64) -> String {
    i64::try_from(at)
        .ok()
        .and_then(|s| jiff::Timestamp::from_second(s).ok())
        .unwrap_or(jiff::Timestamp::MAX)
        .to_string()
}

/// Euros as a JSON number with six decimals (`0.001500`), written from micro-euros.
struct Euros(MicroEur);

impl Serialize for Euros {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let number = RawValue::from_string(self.0.to_eur_string()).map_err(serde::ser::Error::custom)?;
        number.serialize(serializer)
    }
}

#[derive(Serialize)]
struct Amounts {
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    eur: Option<Euros>,
}

impl Amounts {
    fn of(budget: &RunBudget) -> Amounts {
        Amounts { tokens: budget.tokens, eur: budget.eur.map(Euros) }
    }
}

#[derive(Serialize)]
struct Created<'a> {
    id: &'a str,
    expires_at: String,
    budget: Amounts,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    label: Option<&'a str>,
}

/// What `GET` (and `DELETE`) answer.
#[derive(Serialize)]
struct Status<'a> {
    id: &'a str,
    state: &'static str,
    budget: Amounts,
    spent: Amounts,
    remaining: Amounts,
    calls: u64,
    children: &'a [String],
    expires_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    label: Option<&'a str>,
}

impl<'a> Status<'a> {
    /// The run as stored, its counters read now: `spent` is what its calls (and its
    /// descendants', on the limits they share) settled, and what calls in flight hold.
    async fn of(gateway: &Gateway, run: &'a Run) -> Result<Status<'a>, GatewayError> {
        let keys = [Unit::Tokens, Unit::MicroEur, Unit::Requests].map(|unit| run.this.counter(&run.tenant, unit));
        let used = gateway.budgets.used(&keys).await?;
        let [tokens, micro_eur, calls] = [0, 1, 2].map(|i| used.get(i).copied().unwrap_or(0));
        let budget = run.this.budget;
        Ok(Status {
            id: run.id(),
            state: run.state(unix_now()).as_str(),
            budget: Amounts::of(&budget),
            spent: Amounts { tokens: Some(tokens), eur: Some(Euros(MicroEur(micro_eur))) },
            remaining: Amounts {
                tokens: budget.tokens.map(|limit| limit.saturating_sub(tokens)),
                eur: budget.eur.map(|limit| Euros(MicroEur(limit.0.saturating_sub(micro_eur)))),
            },
            calls,
            children: &run.children,
            expires_at: rfc3339(run.this.expires_at),
            parent: run.ancestors.first().map(|p| p.id.as_str()),
            label: run.label.as_deref(),
        })
    }
}
