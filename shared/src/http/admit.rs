//! The admit phase as the doors run it, in one place: what a call's headers ask of
//! routing (sensitivity, and for model calls their class and residency) read once and
//! noted on its record; then, for a model call, the call routed and reserved
//! (`admission::admit`), its reservation noted and held in the call's [`Charge`]. A door measures its own request
//! into a [`Demand`]; it never reads these headers or notes these fields itself.

use http::HeaderMap;

use super::drive::Call;
use super::end::{Charge, Tokens};
use super::record::Draft;
use crate::admission::{Admission, Demand, admit};
use crate::call::Criticality;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::routing::{Residency, Route};

/// What a model call's headers ask of routing.
pub(super) struct Asked {
    /// The sensitivity header was true.
    pub sensitive: bool,
    /// `Flexway-Criticality`, lowered to the caller's `max_criticality`.
    pub criticality: Criticality,
    /// Where the call may be processed (the caller's and `Flexway-Jurisdiction`).
    pub residency: Residency,
}

/// A model call's sensitivity, class and residency, each noted on `draft`.
pub(super) fn asked(
    gateway: &Gateway,
    caller: &Caller,
    headers: &HeaderMap,
    draft: &mut Draft,
) -> Result<Asked, GatewayError> {
    let sensitive = sensitivity(gateway, headers, draft)?;
    let (criticality, residency) = crate::admission::limits(&gateway.config, caller, headers)?;
    draft.criticality(criticality);
    Ok(Asked { sensitive, criticality, residency })
}

/// A metered operation's (gRPC, REST) sensitivity and residency: it has no class.
pub(super) fn sensitive_and_residency(
    gateway: &Gateway,
    caller: &Caller,
    headers: &HeaderMap,
    draft: &mut Draft,
) -> Result<(bool, Residency), GatewayError> {
    let sensitive = sensitivity(gateway, headers, draft)?;
    Ok((sensitive, crate::admission::residency(&gateway.config, caller, headers)?))
}

fn sensitivity(gateway: &Gateway, headers: &HeaderMap, draft: &mut Draft) -> Result<bool, GatewayError> {
    let sensitive = crate::identity::sensitivity(headers, &gateway.config.ai.sensitive_header)?;
    draft.sensitive(sensitive);
    Ok(sensitive)
}

/// A model call routed and reserved.
pub(super) struct Admitted {
    pub route: Route,
    /// `Flexway-Budget: soft`.
    pub soft: bool,
    /// The completion allowance of each choice: what was reserved, and what must be
    /// sent upstream.
    pub allowance: u64,
}

/// The call routed and reserved, its reservation held in `charge`; its period, soft
/// state and (for a call that completes) allowance noted on `draft`. `prompt_typical`
/// is what its settlement counts for the prompt if the backend reports no usage.
pub(super) async fn admitted(
    call: Call<'_>,
    draft: &mut Draft,
    charge: &mut Charge,
    demand: &Demand,
    prompt_typical: u64,
) -> Result<Admitted, GatewayError> {
    let Admission { route, ticket, soft, allowance } =
        admit(call.gateway, call.caller, &call.request_id.0, demand).await?;
    draft.reserved_on(ticket.period());
    draft.soft(soft);
    if demand.completes {
        draft.allowance(allowance);
    }
    let completion = demand.completes.then(|| allowance.saturating_mul(demand.choices));
    *charge = Charge::Tokens(Tokens { ticket, prompt_typical, allowance: completion });
    Ok(Admitted { route, soft, allowance })
}
