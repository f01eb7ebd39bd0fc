//! The admit phase as the doors run it, in one place: what a call's headers ask of
//! routing (sensitivity, and for model calls their class and residency) read once and
//! noted on its record; then the call's one reservation ([`reserve`], whatever it
//! asks: a model call routed and reserved by `admission::admit`, a metered
//! operation's first step), noted and held in the call's [`Charge`]. A door measures its own request
//! into a [`Demand`]; it never reads these headers or notes these fields itself.

use std::future::Future;
use std::sync::Arc;

use http::HeaderMap;

use super::drive::Call;
use super::drive::{self, Charge};
use super::record::Draft;
use crate::admission::{Admission, Demand, Reserving, admit};
use crate::call::Criticality;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::metering::Meter;
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

/// What a door asks the ledger for. Each kind reserves into the call's one
/// [`Charge`]; a new kind (a tool call's price, a per-minute window) is one more.
pub(super) trait Ask: Send {
    /// What the door learns of its reservation beyond the charge.
    type Granted;

    /// Reserves: the charge held, and what was granted. What it notes on `draft` is
    /// what only it knows (a model call's soft state and allowance).
    fn reserve(
        self,
        call: Call<'_>,
        draft: &mut Draft,
    ) -> impl Future<Output = Result<(Charge, Self::Granted), GatewayError>> + Send;
}

/// The one reservation of every door: `ask` reserved and held in `charge` (which the
/// driver ends), its period noted on `draft`.
pub(super) async fn reserve<A: Ask>(
    call: Call<'_>,
    draft: &mut Draft,
    charge: &mut Charge,
    ask: A,
) -> Result<A::Granted, GatewayError> {
    let (held, granted) = ask.reserve(call, draft).await?;
    if let Some(period) = held.period().await {
        draft.reserved_on(period);
    }
    *charge = held;
    Ok(granted)
}

/// A model call: routed, then reserved at its route's highest price (`admission`).
pub(super) struct Tokens<'a> {
    pub demand: &'a Demand,
    /// What its settlement counts for the prompt if the backend reports no usage.
    pub prompt_typical: u64,
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

impl Ask for Tokens<'_> {
    type Granted = Admitted;

    /// Its soft state and (for a call that completes) allowance noted on `draft`.
    async fn reserve(self, call: Call<'_>, draft: &mut Draft) -> Result<(Charge, Admitted), GatewayError> {
        let Tokens { demand, prompt_typical } = self;
        let mut pace = None;
        let who = Reserving {
            caller: call.caller,
            run: call.run.map(|r| &**r),
            request_id: &call.request_id.0,
            pace: &mut pace,
        };
        let admitted = admit(call.gateway, who, demand).await;
        draft.pace(pace);
        let Admission { route, ticket, soft, allowance } = admitted?;
        draft.soft(soft);
        if demand.completes {
            draft.allowance(allowance);
        }
        let completion = demand.completes.then(|| allowance.saturating_mul(demand.choices));
        let prompt = demand.prompt_tokens;
        let charge = Charge::Tokens(drive::Tokens {
            ticket,
            prompt,
            prompt_typical,
            allowance: completion,
            quotas: Vec::new(),
            cache: None,
        });
        Ok((charge, Admitted { route, soft, allowance }))
    }
}

/// A metered operation (a gRPC method, a REST operation): one call's price, or its
/// first `bytes` and the response allowance, reserved on its `meter` (`meter.rs`),
/// whose later steps the relay reserves as bytes pass.
pub(super) struct Metered {
    pub meter: Arc<Meter>,
    pub bytes: u64,
}

impl Ask for Metered {
    type Granted = ();

    /// Its first step's standing in the caller's windows noted on `draft`.
    async fn reserve(self, _: Call<'_>, draft: &mut Draft) -> Result<(Charge, ()), GatewayError> {
        let reserved = self.meter.reserve_first(self.bytes).await;
        draft.pace(self.meter.pace());
        reserved?;
        Ok((Charge::Metered(self.meter), ()))
    }
}
