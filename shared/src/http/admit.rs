//! The admit phase as the doors run it, in one place: what a call's headers ask of
//! routing (sensitivity, and for model calls their class and residency) read once and
//! noted on its record; then, for a model call, the call routed and reserved
//! (`admission::admit`) and its reservation noted. A door measures its own request
//! into a [`Demand`]; it never reads these headers or notes these fields itself.

use http::HeaderMap;

use super::RequestId;
use super::record::Draft;
use crate::admission::{Admission, Demand, admit};
use crate::budget::Ticket;
use crate::call::Criticality;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::routing::Residency;

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

/// The call routed and reserved; its period, soft state and (for a call that
/// completes) allowance noted on `draft`.
pub(super) async fn admitted(
    gateway: &Gateway,
    caller: &Caller,
    request_id: &RequestId,
    draft: &mut Draft,
    demand: &Demand,
) -> Result<Admission, GatewayError> {
    let admission = admit(gateway, caller, &request_id.0, demand).await?;
    draft.reserved_on(admission.ticket.period());
    draft.soft(admission.soft);
    if demand.completes {
        draft.allowance(admission.allowance);
    }
    Ok(admission)
}

/// Refunds the reservation of a call that failed before its first byte.
pub(super) async fn refunded(ticket: Ticket, error: GatewayError) -> GatewayError {
    ticket.refund().await;
    error
}
