//! The run a call joins (SPEC §15): `Flexway-Run`, read once for every door, noted on
//! the call's record (refused calls included) and checked before anything is
//! reserved: the caller's own (its tenant's and agent's), and active.

use std::sync::Arc;

use http::HeaderMap;

use crate::budget::Run;
use crate::budget::period::unix_now;
pub(super) use crate::budget::run::RUN_HEADER;
use crate::budget::run::{self, RunState};
use crate::call::InvalidRequest;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::http::record::Draft;
use crate::identity::Caller;

pub(super) async fn joined(
    gateway: &Gateway,
    caller: &Caller,
    headers: &HeaderMap,
    draft: &mut Draft,
) -> Result<Option<Arc<Run>>, GatewayError> {
    let mut values = headers.get_all(RUN_HEADER).iter();
    let Some(value) = values.next() else { return Ok(None) };
    let id = value.to_str().ok().filter(|v| run::is_id(v) && values.next().is_none()).ok_or_else(|| {
        InvalidRequest::message(
            "Flexway-Run must name one run, as POST /v1/flexway/runs returned its id (`run_` and 32 hex digits)"
                .to_owned(),
        )
    })?;
    draft.run(id);
    let theirs =
        |r: &Run| r.tenant == caller.tenant.as_str() && r.agent.as_deref() == caller.agent.as_ref().map(|a| a.as_str());
    let Some(run) = gateway.budgets.run(id).await?.filter(theirs) else {
        return Err(GatewayError::RunNotFound { run: id.to_owned() });
    };
    match run.state(unix_now()) {
        RunState::Active => Ok(Some(Arc::new(run))),
        RunState::Ended => Err(GatewayError::RunEnded { run: id.to_owned(), why: "ended" }),
        RunState::Expired => Err(GatewayError::RunEnded { run: id.to_owned(), why: "past its expires_at" }),
    }
}
