//! Runs (SPEC §15): a budget for one agent run, held in the ledger.
//!
//! A run is a record (who owns it, its budget, its life, its ancestors, its children)
//! and three counters (`tokens`, `eur`, `calls`, keyed by [`CounterKey::run`]). A call
//! that names a run reserves on the run's counters and each ancestor's, in the same
//! atomic reservation as its tenant's and agent's budgets: a run holds nothing while
//! idle, so an abandoned one strands nothing. A child's record carries its ancestors'
//! budgets and expiries (they never change after creation), so a call reads one
//! record; ending a run ends its descendants too, each record written.

use serde::{Deserialize, Serialize};

use super::{CounterKey, Unit};
use crate::money::MicroEur;

/// The longest a run may live, and the life of one created without a `ttl`.
pub const MAX_TTL_SECS: u64 = 24 * 3600;
pub const DEFAULT_TTL_SECS: u64 = 3600;

/// The most ancestors a run may have: each adds three lines to every reservation of a
/// call in the run, and a reservation is one DynamoDB transaction (100 items at most).
pub const MAX_ANCESTORS: usize = 8;

/// The most children a run may have: its record names them all, and a DynamoDB item
/// holds 400 KB at most.
pub const MAX_CHILDREN: usize = 256;

/// A run's budget: at least one of the two.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunBudget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eur: Option<MicroEur>,
}

/// A run as a call in it needs it: its id, budget and expiry (its counters' keys).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRef {
    pub id: String,
    pub budget: RunBudget,
    pub expires_at: u64,
}

impl RunRef {
    /// One of its counters.
    pub fn counter(&self, tenant: &str, unit: Unit) -> CounterKey {
        CounterKey::run(tenant, &self.id, unit, self.expires_at)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    #[serde(flatten)]
    pub this: RunRef,
    pub tenant: String,
    /// The agent it was started for: only that agent's calls may join it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Its parent first, then the parent's parent, and so on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ancestors: Vec<RunRef>,
    pub created_at: u64,
    /// Set by `DELETE` (its own or an ancestor's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<String>,
}

/// What a run's state is at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    Active,
    Ended,
    Expired,
}

impl RunState {
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Active => "active",
            RunState::Ended => "ended",
            RunState::Expired => "expired",
        }
    }
}

impl Run {
    pub fn id(&self) -> &str {
        &self.this.id
    }

    pub fn state(&self, now: u64) -> RunState {
        if self.ended_at.is_some() {
            RunState::Ended
        } else if now >= self.this.expires_at {
            RunState::Expired
        } else {
            RunState::Active
        }
    }

    /// The run and its ancestors, nearest first: what a call in it must fit.
    pub fn chain(&self) -> impl Iterator<Item = &RunRef> {
        std::iter::once(&self.this).chain(&self.ancestors)
    }
}

/// What ending a run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// These runs (it and its descendants not ended before) are ended now.
    Ended(Vec<String>),
    /// No such run.
    Unknown,
}

/// The header a call joins a run with, on every door (gRPC: its `flexway-run` metadata).
pub const RUN_HEADER: &str = "flexway-run";

/// A new run id: `run_` and 32 hex digits of randomness.
pub fn new_id() -> String {
    let uuid = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
    format!("run_{}", uuid.simple())
}

/// Whether `text` has the shape of a run id (what a store may be asked for).
pub fn is_id(text: &str) -> bool {
    text.strip_prefix("run_").is_some_and(|hex| hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}
