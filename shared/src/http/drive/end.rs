//! The end of every call, written once (ARCHITECTURE.md, "The driver owns the end
//! too"): what the call holds of the ledger, its [`Charge`], settled on how the call
//! ended, its [`Ended`], then its record written. A door or a relay says how its call
//! ended; it never settles, refunds or finishes a record itself, so what acts when a
//! call ends is written here and holds for every door.
//!
//! Invariants: a charge is settled on what was served or refunded whole, once; the
//! record is written after the settlement, so it carries the cost the ledger took; both
//! in the call's own task. A call cancelled mid-way (its future dropped) still leaves
//! both, through the last-resort guards of the ticket and the draft (`budget::ticket`,
//! `record::Draft`'s `Drop`).

use std::pin::Pin;
use std::sync::Arc;

use futures_util::future::OptionFuture;

use crate::admission::{Reserving, reserve_turn};
use crate::audit::CloseReason;
use crate::budget::plan::Pace;
use crate::budget::{Run, Ticket, plan};
use crate::call::ErrorCode;
use crate::config::{BackendId, Price};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::http::cache::{Capture, Kept, Note, Pending};
use crate::http::chain::QuotaHold;
use crate::http::record::{Draft, UsageSource};
use crate::identity::Caller;
use crate::metering::Meter;
use crate::money::MicroEur;
use crate::protocol::chat::Finish;
use crate::protocol::openai::Usage;

/// What a call holds of the ledger, from its reservation to its end.
#[derive(Default)]
pub(in crate::http) enum Charge {
    /// Nothing reserved (yet): a call refused before its reservation, or an operation
    /// that is not metered.
    #[default]
    None,
    /// A model call's tokens (chat, embeddings, a realtime session before it opens).
    Tokens(Tokens),
    /// An operation metered per call or per byte (gRPC, REST): its reservations.
    Metered(Arc<Meter>),
    /// A realtime session: the allowance of the response running, and what it spent.
    Turns(Box<Turns>),
}

/// A model call's reservation, and what its settlement needs beyond the usage.
pub(in crate::http) struct Tokens {
    pub ticket: Ticket,
    /// The prompt's upper bound in tokens, as reserved.
    pub prompt: u64,
    /// The prompt's typical token count, if the backend reports no usage.
    pub prompt_typical: u64,
    /// The completion tokens the backend was allowed (every choice), if it completes.
    pub allowance: Option<u64>,
    /// What the attempt chain reserved on the provider quotas of the backends it
    /// tried (SPEC §14): empty, without an allocation, when none has a quota.
    pub quotas: Vec<Quota>,
    /// Where the response cache keeps the answer, for a call that missed it (SPEC
    /// §16): stored at the end if the answer is complete.
    pub cache: Option<Box<Pending>>,
}

impl Tokens {
    /// The most tokens the call may count at a backend: its prompt's upper bound and
    /// its completion allowance.
    pub fn bound(&self) -> u64 {
        self.prompt.saturating_add(self.allowance.unwrap_or(0))
    }
}

/// One attempt's reservation on its backend's provider quota (SPEC §14): settled on
/// the call's usage when that backend served, refunded whole otherwise, at the call's
/// end like the call's own ticket (and by the ticket's guard when the call is dropped).
pub(in crate::http) struct Quota {
    pub backend: BackendId,
    pub ticket: Ticket,
    /// The backend's quota windows the ticket holds (for the used-ratio gauge).
    pub windows: Arc<[plan::Budget]>,
}

/// A realtime session's charge: at most one reservation, the allowance of the response
/// running, held from its start to its `response.done` (SPEC §2.3).
pub(in crate::http) struct Turns {
    ticket: Option<Ticket>,
    caller: Caller,
    run: Option<Arc<Run>>,
    /// The caller's standing in its windows after the last reservation.
    pub pace: Option<Pace>,
    request_id: String,
    backend: BackendId,
    price: Price,
    /// The output allowance last reserved: the most a response may be told to write
    /// (what a `session.update` carries while none is held).
    pub allowance: u64,
    /// The session's backend's provider quota, held from its opening (SPEC §14).
    quotas: Vec<Quota>,
    usage: Usage,
    cost: MicroEur,
    responses: u64,
    /// A response of the session counted its request: the session is one call of its
    /// run, counted with it (each response still counts in the windows).
    counted: bool,
    /// Reservations made after the first (each one's id: `req_….N`).
    reservations: u64,
    /// The last response's total: the next one's prompt floor.
    floor: u64,
}

/// How a call ended, as its door or relay saw it.
pub(in crate::http) struct Ended {
    /// The status the call answered (a gRPC status for gRPC, 101 for a session).
    pub status: u16,
    pub code: Option<ErrorCode>,
    pub spent: Spent,
    /// Each choice's finish reason, when the answer gave them.
    pub finish_reasons: Vec<Finish>,
}

/// What a call consumed, as its charge settles it.
pub(in crate::http) enum Spent {
    /// Nothing was served: what was reserved goes back whole.
    Nothing,
    /// A model's answer by `backend`: the usage it reported, or, when it reported none,
    /// an estimate from the completion bytes it wrote; and what the response cache may
    /// keep of it, when the call asked to keep it.
    Tokens { backend: BackendId, usage: Option<Usage>, content_bytes: u64, kept: Option<Box<Kept>> },
    /// An answer from the response cache: `charged` (the policy's share of what the
    /// call that produced it cost, `saved`).
    Cached { charged: MicroEur, saved: MicroEur },
    /// A metered operation: whether the upstream answered, and whether it served the
    /// call (what a per-call price is charged on); and its answer as the relay read it
    /// for the response cache, when the call missed it (a REST operation's).
    Metered { answered: bool, served: bool, kept: Option<Box<Capture>> },
    /// A realtime session, closed for `reason` (its responses settled as they ended).
    Session(CloseReason),
}

impl Ended {
    /// A call that ended with `status` and `code`, nothing served.
    pub fn unserved(status: u16, code: Option<ErrorCode>) -> Ended {
        Ended { status, code, spent: Spent::Nothing, finish_reasons: Vec::new() }
    }
}

impl Charge {
    /// The date the call counts on (its first reservation's), once reserved.
    pub async fn period(&self) -> Option<String> {
        match self {
            Charge::None => None,
            Charge::Tokens(tokens) => Some(tokens.ticket.period()),
            Charge::Metered(meter) => meter.period().await,
            Charge::Turns(turns) => turns.ticket.as_ref().map(Ticket::period),
        }
    }

    /// The most tokens a call may count at a backend's provider quota: a model call's
    /// reserved bound; `None` for a charge that holds no tokens (nothing is counted on
    /// a quota for it: a quota is only a model backend's).
    pub fn quota_bound(&self) -> Option<u64> {
        match self {
            Charge::Tokens(tokens) => Some(tokens.bound()),
            _ => None,
        }
    }

    /// Holds `pending` (a response cache miss) until the call ends; what the attempt
    /// must read of the answer for it.
    pub fn keep_for_cache(&mut self, pending: Option<Box<Pending>>) -> Option<crate::http::dispatch::KeepAs> {
        let Charge::Tokens(tokens) = self else { return None };
        let keep = pending.as_ref().map(|p| p.keep_as());
        tokens.cache = pending;
        keep
    }

    /// Whether the call holds a reservation on `backend`'s quota already.
    pub fn holds_quota(&self, backend: &BackendId) -> bool {
        matches!(self, Charge::Tokens(tokens) if tokens.quotas.iter().any(|q| q.backend == *backend))
    }

    /// Holds a reservation on `backend`'s quota until the call ends. A charge that
    /// holds no tokens refunds it at once (by the ticket's guard): it has none.
    pub fn hold_quota(&mut self, quota: Quota) {
        if let Charge::Tokens(tokens) = self {
            tokens.quotas.push(quota);
        }
    }

    /// The call's charge once its realtime session is open at `backend`: the opening's
    /// reservation is the session's until it gives it back (`Ending::release_turn`).
    pub fn into_turns(
        self,
        gateway: &Gateway,
        caller: &Caller,
        run: Option<&Arc<Run>>,
        request_id: &str,
        backend: &BackendId,
    ) -> Charge {
        let Charge::Tokens(tokens) = self else { return self };
        Charge::Turns(Box::new(Turns {
            allowance: tokens.allowance.unwrap_or_default(),
            ticket: Some(tokens.ticket),
            quotas: tokens.quotas,
            caller: caller.clone(),
            run: run.cloned(),
            pace: None,
            request_id: request_id.to_owned(),
            backend: backend.clone(),
            price: gateway.price(backend),
            usage: Usage::default(),
            cost: MicroEur(0),
            responses: 0,
            counted: false,
            reservations: 0,
            floor: 0,
        }))
    }
}

/// How a call ended, as its answer's headers say it.
pub(in crate::http) struct Closed {
    /// The settled cost (`Flexway-Cost`).
    pub cost: MicroEur,
    /// What the response cache did (`Flexway-Cache`), when a policy applied.
    pub cache: Option<Note>,
}

/// The one end of a call: `charge` settled on `ended`, its answer kept by the response
/// cache if it missed and the answer is complete, then the record written, with the
/// settled cost on it. Returns that cost and the cache's part.
pub(in crate::http) async fn end(gateway: &Gateway, charge: Charge, ended: Ended, mut draft: Draft) -> Closed {
    let Ended { status, code, spent, finish_reasons } = ended;
    if let Spent::Session(reason) = spent {
        draft.closed(reason);
    }
    let cost = match (charge, spent) {
        (Charge::None, _) => MicroEur(0),
        (Charge::Tokens(tokens), Spent::Tokens { backend, usage, content_bytes, kept }) => {
            let estimate = Usage::new(tokens.prompt_typical, plan::typical_tokens(content_bytes));
            let (usage, source) = match usage {
                Some(reported) => {
                    if draft.is_streamed() {
                        // How far the estimate would have been: the streaming
                        // reconciliation delta.
                        draft.drift(estimate.total(), reported.total());
                    }
                    (reported, UsageSource::Reported)
                }
                None => (estimate, UsageSource::Estimated),
            };
            overshoot(gateway, &backend, tokens.allowance, usage);
            let cost = tokens.ticket.settle(usage, gateway.price(&backend)).await;
            draft.usage(usage, source, cost);
            draft.charged();
            end_quotas(gateway, tokens.quotas, Some((&backend, usage))).await;
            // Kept only whole: the call answered 200 with nothing cut, its usage
            // reported or its stream ended properly (`kept` says so for a stream).
            if let (Some(pending), Some(kept)) = (tokens.cache, kept)
                && status == 200
                && code.is_none()
                && (source == UsageSource::Reported || draft.is_streamed())
            {
                let kept = crate::http::cache::store(gateway, *pending, *kept, &backend, usage, cost, &finish_reasons);
                if let Some(note) = Box::pin(kept).await {
                    draft.cache(note);
                }
            }
            cost
        }
        (Charge::Tokens(tokens), Spent::Cached { charged, saved }) => {
            // Nothing was called upstream: the reservation gives way to the policy's
            // share of the entry's cost, in euros only (no token was produced). The
            // call still counts as a request in its windows and its run, whatever
            // `charge` says (a refund would count it only when it costs nothing).
            tokens.ticket.settle_eur(charged).await;
            end_quotas(gateway, tokens.quotas, None).await;
            draft.usage(Usage::default(), UsageSource::Reported, charged);
            draft.charged();
            gateway.metrics.cache_saved(draft.caller_tenant(), saved);
            charged
        }
        (Charge::Tokens(tokens), _) => {
            tokens.ticket.refund().await;
            end_quotas(gateway, tokens.quotas, None).await;
            MicroEur(0)
        }
        (Charge::Metered(meter), Spent::Metered { answered, served, kept }) => {
            let cost = meter.close(answered, served).await;
            draft.usage(Usage::default(), UsageSource::Reported, cost);
            if meter.counts(answered, served) || cost.0 > 0 {
                draft.charged();
            }
            // Kept only whole: a 2xx answer that ended as it should (SPEC §16).
            if let Some(capture) = kept
                && (200..300).contains(&status)
                && code.is_none()
            {
                let (pending, backend, kept) = capture.into_parts();
                let kept = crate::http::cache::store(gateway, pending, kept, &backend, Usage::default(), cost, &[]);
                if let Some(note) = Box::pin(kept).await {
                    draft.cache(note);
                }
            }
            cost
        }
        (Charge::Metered(meter), Spent::Cached { charged, saved }) => {
            // Nothing was called upstream: the reservation settled at the policy's share
            // of the entry's cost (at most what it holds), refunded when that is none.
            let charged = meter.close_at(charged).await;
            draft.usage(Usage::default(), UsageSource::Reported, charged);
            draft.charged();
            gateway.metrics.cache_saved(draft.caller_tenant(), saved);
            charged
        }
        (Charge::Metered(meter), _) => {
            meter.close(false, false).await;
            MicroEur(0)
        }
        (Charge::Turns(turns), _) => {
            let Turns { ticket, usage, cost, quotas, counted, .. } = *turns;
            // The allowance held for a response that never came back.
            if let Some(ticket) = ticket {
                ticket.refund().await;
            }
            // Each response settled its own; what is held is the one still running's,
            // whose usage never came.
            end_quotas(gateway, quotas, None).await;
            draft.usage(usage, UsageSource::Reported, cost);
            if counted {
                draft.charged();
            }
            cost
        }
    };
    if code == Some(ErrorCode::BudgetExceeded) {
        draft.exceeded();
    }
    if !finish_reasons.is_empty() {
        draft.finish_reasons(finish_reasons);
    }
    let cache = draft.cache_note();
    draft.finish(status, code).await;
    Closed { cost, cache }
}

/// Ends the call's provider quota reservations (SPEC §14): the one of the backend that
/// `served` settled on its usage (one request, its total tokens), every other refunded
/// whole (the backend that answered, when nothing was served; a failed attempt's the
/// attempt chain refunded already). The quota's used ratio is read again for the gauge
/// once a backend's is settled, at most once a second a backend (`chain::gauge_due`).
/// Boxed, and only for a call that holds one: a call on backends without a quota keeps
/// these futures out of its own (the driver's future is copied whole as the router
/// boxes it; benches/instructions), and awaits an empty `OptionFuture`, ready at once.
fn end_quotas<'a>(
    gateway: &'a Gateway,
    quotas: Vec<Quota>,
    served: Option<(&'a BackendId, Usage)>,
) -> OptionFuture<Pin<Box<impl Future<Output = ()> + 'a>>> {
    OptionFuture::from((!quotas.is_empty()).then(|| Box::pin(settle_quotas(gateway, quotas, served))))
}

async fn settle_quotas(gateway: &Gateway, quotas: Vec<Quota>, served: Option<(&BackendId, Usage)>) {
    for Quota { backend, ticket, windows } in quotas {
        match served {
            Some((by, usage)) if *by == backend => {
                ticket.settle(usage, gateway.price(&backend)).await;
                if crate::http::chain::gauge_due(&backend) {
                    crate::http::chain::gauge_quota(gateway, &backend, &windows).await;
                }
            }
            _ => ticket.refund().await,
        }
    }
}

/// A session's run, read again: ended (its own `DELETE` or an ancestor's) or expired,
/// it gives no more responses (SPEC §15); the session stays open.
async fn run_active(gateway: &Gateway, run: Option<&Run>) -> Result<(), GatewayError> {
    let Some(run) = run else { return Ok(()) };
    if crate::budget::period::unix_now() >= run.this.expires_at {
        return Err(GatewayError::RunEnded { run: run.id().to_owned(), why: "past its expires_at" });
    }
    if gateway.budgets.run(run.id()).await?.is_none_or(|stored| stored.ended_at.is_some()) {
        return Err(GatewayError::RunEnded { run: run.id().to_owned(), why: "ended" });
    }
    Ok(())
}

/// Counts a backend that wrote past the allowance it was sent: it is charged in full
/// (the tokens were produced).
fn overshoot(gateway: &Gateway, backend: &BackendId, allowance: Option<u64>, usage: Usage) {
    if let Some(allowance) = allowance
        && usage.completion_tokens > allowance
    {
        gateway.metrics.observe_overshoot(backend.as_str(), usage.completion_tokens - allowance);
        tracing::warn!(
            %backend,
            allowance,
            completion_tokens = usage.completion_tokens,
            "the backend wrote past the allowance it was sent; charged in full"
        );
    }
}

/// A call's end still to come, handed to the relay of its answer: the one way a relay
/// ends its call. Dropped unended (its task cancelled), the draft records the call
/// abandoned and the charge's reservations are refunded (the last-resort guards).
pub(in crate::http) struct Ending {
    gateway: Arc<Gateway>,
    draft: Draft,
    charge: Charge,
}

impl Ending {
    pub fn new(gateway: Arc<Gateway>, draft: Draft, charge: Charge) -> Ending {
        Ending { gateway, draft, charge }
    }

    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// The answer's first byte went to the client.
    pub fn first_byte(&mut self) {
        self.draft.first_byte();
    }

    /// How a tool call ended, as the relay of its stream read it (SPEC §17).
    pub fn mcp_status(&mut self, status: crate::audit::McpStatus) {
        self.draft.mcp_status(status);
    }

    /// A realtime session's charge.
    pub fn turns(&self) -> Option<&Turns> {
        match &self.charge {
            Charge::Turns(turns) => Some(turns),
            _ => None,
        }
    }

    /// A realtime response ended having used `usage`, charged (SPEC §2.3): an
    /// `admitted` one (the session's running response) on the allowance held for it;
    /// any other (one refused at its start and cancelled: the backend started it on
    /// its own while none could be reserved, or while another ran) on what it reports,
    /// never refused, counting no request (it was refused before its first byte).
    /// Nothing is reserved ahead for the next one.
    pub async fn turn(&mut self, usage: Usage, admitted: bool) -> Result<(), GatewayError> {
        let Charge::Turns(turns) = &mut self.charge else {
            return Err(GatewayError::Internal("a response outside a session".into()));
        };
        let held = if admitted { turns.ticket.take() } else { None };
        // Its request counts in the windows; in its run, the session's first only.
        let counted_before = turns.counted;
        turns.counted |= held.is_some();
        let ticket = match held {
            Some(ticket) => ticket,
            None => {
                turns.reservations += 1;
                let id = format!("{}.{}", turns.request_id, turns.reservations);
                let who =
                    Reserving { caller: &turns.caller, run: turns.run.as_deref(), request_id: &id, pace: &mut None };
                crate::admission::reserve_used(&self.gateway, who, usage, turns.price).await?
            }
        };
        let cost = if counted_before {
            ticket.settle_past_runs_calls(usage, turns.price).await
        } else {
            ticket.settle(usage, turns.price).await
        };
        if admitted {
            // The response's provider quota, settled on it in the minute it was reserved.
            let held = std::mem::take(&mut turns.quotas);
            end_quotas(&self.gateway, held, Some((&turns.backend, usage))).await;
        }
        turns.usage.prompt_tokens = turns.usage.prompt_tokens.saturating_add(usage.prompt_tokens);
        turns.usage.completion_tokens = turns.usage.completion_tokens.saturating_add(usage.completion_tokens);
        turns.cost = turns.cost.saturating_add(cost);
        turns.responses += 1;
        turns.floor = usage.total();
        // The record holds the session's totals so far, so that a session whose task is
        // dropped before its end (a shutdown) is recorded as the ledger charged it.
        self.draft.usage(turns.usage, UsageSource::Reported, turns.cost);
        if turns.counted {
            self.draft.charged();
        }
        self.gateway.metrics.realtime_response(turns.caller.tenant.as_str(), turns.backend.as_str());
        Ok(())
    }

    /// Gives back the allowance held, if any, and its provider quota: a session holds
    /// nothing while no response runs (SPEC §15).
    pub async fn release_turn(&mut self) {
        let Charge::Turns(turns) = &mut self.charge else { return };
        if let Some(ticket) = turns.ticket.take() {
            ticket.refund().await;
        }
        end_quotas(&self.gateway, std::mem::take(&mut turns.quotas), None).await;
    }

    /// Reserves the next response's allowance, if none is held: on the last
    /// response's total (a realtime response reads the whole conversation so far).
    pub async fn next_turn(&mut self) -> Result<(), GatewayError> {
        let Charge::Turns(turns) = &mut self.charge else {
            return Err(GatewayError::Internal("a response outside a session".into()));
        };
        if turns.ticket.is_some() {
            return Ok(());
        }
        run_active(&self.gateway, turns.run.as_deref()).await?;
        turns.reservations += 1;
        let id = format!("{}.{}", turns.request_id, turns.reservations);
        let who =
            Reserving { caller: &turns.caller, run: turns.run.as_deref(), request_id: &id, pace: &mut turns.pace };
        let (ticket, allowance) = reserve_turn(&self.gateway, who, turns.floor, turns.price).await?;
        // Each response counts on its backend's provider quota in the minute it is
        // reserved, as a call's attempt does (SPEC §14).
        let bound = turns.floor.saturating_add(allowance);
        match crate::http::chain::hold_quota(&self.gateway, &turns.backend, bound, &id).await {
            QuotaHold::Nothing => {}
            QuotaHold::Held(quota) => turns.quotas.push(quota),
            QuotaHold::Refused { rate, retry_after_secs, never } => {
                ticket.refund().await;
                let backend = &turns.backend;
                if never {
                    let message = format!("the next response may count {bound} tokens, more than {backend}'s quota");
                    return Err(crate::call::InvalidRequest::message(message).into());
                }
                let backends = backend.to_string();
                return Err(GatewayError::BackendQuota { backends, kind: rate, retry_after_secs });
            }
        }
        turns.ticket = Some(ticket);
        turns.allowance = allowance;
        Ok(())
    }

    /// Before a response runs (the client asks for it, or the backend starts it on its
    /// own): an allowance held, and, when windows
    /// apply, reserved in the current minute (one held since an earlier minute is given
    /// back and reserved again, so that no response counts in a window past).
    pub async fn ready_turn(&mut self) -> Result<(), GatewayError> {
        let Charge::Turns(turns) = &mut self.charge else {
            return Err(GatewayError::Internal("a response outside a session".into()));
        };
        let now = crate::budget::period::unix_now();
        let stale = turns.ticket.as_ref().is_some_and(|t| t.reserved_at() / 60 != now / 60)
            && !plan::windows_for(&self.gateway.config, &turns.caller, now).is_empty();
        let ended = run_active(&self.gateway, turns.run.as_deref()).await;
        if (stale || ended.is_err())
            && let Some(held) = turns.ticket.take()
        {
            held.refund().await;
            // Its provider quota too: the next allowance holds its own.
            end_quotas(&self.gateway, std::mem::take(&mut turns.quotas), None).await;
        }
        ended?;
        self.next_turn().await
    }

    /// Ends the call (see [`end`]); its cost.
    pub async fn end(self, ended: Ended) -> MicroEur {
        let Ending { gateway, draft, charge } = self;
        end(&gateway, charge, ended, draft).await.cost
    }
}
