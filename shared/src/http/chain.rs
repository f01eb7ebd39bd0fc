//! The attempt phase, written once for every door: the route tried in order until one
//! backend's answer is in, before a byte reached the client (SPEC §5).
//!
//! Each candidate is a call through the breaker layer ([`BreakerLayer`]): a candidate
//! whose breaker is open is skipped without a call; the layer tells the breaker how
//! every failure and every answer read whole counted ([`Classify`]), and hands back a
//! [`Pass`] through which the door tells it how a stream or a session ended. A
//! failure falls back to the next candidate when another backend could do better
//! ([`Failure::retryable`]); one that no backend could (the request cannot be
//! carried) ends the call with its own error. When no candidate served, the error
//! names every backend tried or skipped, and why ([`unserved`]).
//!
//! A backend with a provider quota (SPEC §14) is reserved on before it is tried: one
//! request and the call's token bound in its per-minute windows, its own reservation
//! held in the call's [`Charge`]: refunded as soon as its attempt fails (the charge
//! holds only the quota of the backend that may still serve), else ended with the call
//! (settled on the usage). A quota that refuses passes the backend over as an open
//! breaker does; when every candidate was passed over for its quota, the call is 429
//! `backend_quota`, its `type` the rate that refused last. A ledger that fails to
//! reserve fails open: the backend is tried without a reservation (the call's own
//! reservation holds; a quota only steers).
//!
//! What an attempt is differs by door (an HTTP request and its answer held, a
//! WebSocket handshake); how a failure counts does not: [`Failure`] is the one
//! classification the fallback, the breakers and the audit read.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use tower::{Layer as _, Service as _};
use tracing::Instrument as _;

use super::drive::{Charge, Quota as HeldQuota};
use super::record::Draft;
use crate::admission::STREAM_RESERVATION_SECS;
use crate::audit::SkipCause;
use crate::budget::period::unix_now;
use crate::budget::plan::{self, Budget, Kind, Rate};
use crate::budget::ticket::reserve_guarded;
use crate::budget::{Line, Period, ReserveOutcome, ReserveRequest, Ticket, Unit};
use crate::call::PickReason;
use crate::config::{BackendId, Endpoint, FailureMode};
use crate::error::{Attempts, GatewayError, UnavailableCause};
use crate::gateway::Gateway;
use crate::routing::breaker::{BreakerLayer, Call, Classify, Outcome, Pass, Passed, Refused};
use crate::routing::endpoint_picker::{self, EndpointPicker, PickerError};
use crate::routing::{Candidate, Route};
use crate::upstream::body::Fault;
use crate::upstream::{CallError, UpstreamClient};

/// Why one attempt at one backend failed, before anything reached the client.
#[derive(Debug)]
pub(super) enum Failure {
    /// A status that is the backend's failure, not the caller's answer (a 5xx).
    Status { status: u16, retry_after: Option<Duration> },
    /// No answer came: the connection, TLS, the backend's timeout, or our own
    /// credential file.
    Head(CallError),
    /// The answer began and failed before the first byte: cut, stalled or invalid.
    Body(Fault),
    /// A failure after the backend took part of a request that cannot be sent twice
    /// (a gRPC call's streamed body): no other backend can take the call.
    AfterSend(Box<Failure>),
    /// An inference pool's endpoint picker could not answer: nothing was sent.
    Picker(PickerError),
    /// An inference pool's picker named no endpoint this door can call: nothing was
    /// sent.
    Unreached,
    /// The call ends with this error, nothing sent: the request cannot be carried in
    /// this backend's format (the caller's error).
    Request(Box<GatewayError>),
    /// The backend's provider quota is reached for the minute, which ends in
    /// `retry_after_secs`: `rate` refused. Passed over, nothing sent.
    Quota { rate: Rate, retry_after_secs: u64, never: bool },
}

impl Failure {
    /// Whether another backend could serve where this one failed: nothing reached the
    /// client yet, and the request can go again.
    pub fn retryable(&self) -> bool {
        !matches!(self, Failure::AfterSend(_) | Failure::Request(_))
    }

    /// The failure itself, whether or not the request went out.
    fn cause(&self) -> &Failure {
        match self {
            Failure::AfterSend(failure) => failure.cause(),
            failure => failure,
        }
    }

    /// Whether the backend timed out (504 when it was the last one tried).
    fn is_timeout(&self) -> bool {
        matches!(self.cause(), Failure::Head(CallError::Timeout(_)) | Failure::Body(Fault::Timeout))
    }

    /// Says in the log what went wrong with `backend`.
    fn log(&self, backend: &BackendId) {
        match self.cause() {
            Failure::Status { status, .. } => tracing::warn!(backend = %backend, status, "backend failed"),
            Failure::Head(CallError::Timeout(after)) => tracing::warn!(backend = %backend, ?after, "backend timed out"),
            Failure::Head(e @ (CallError::Connect(_) | CallError::Tls(_))) => {
                tracing::warn!(backend = %backend, "backend unreachable: {e}");
            }
            Failure::Head(e @ CallError::Credential(_)) => tracing::error!(backend = %backend, "{e}"),
            Failure::Body(fault) => {
                tracing::warn!(backend = %backend, "backend answer failed before the first byte: {fault}");
            }
            Failure::AfterSend(_) | Failure::Unreached | Failure::Request(_) => {}
            Failure::Quota { .. } => tracing::debug!(backend = %backend, "backend at its provider quota"),
            Failure::Picker(e) => tracing::warn!(backend = %backend, "{e}"),
        }
    }
}

/// The one classification: fallback reads [`Failure::retryable`], the breaker layer
/// this, the audit the error each becomes ([`unserved`]).
impl Classify for Failure {
    /// How the failure counts for the backend's breaker; `None` when it says nothing
    /// of the backend's health (our own credential file is missing, nothing was sent).
    fn breaker_outcome(&self) -> Option<Outcome> {
        match self.cause() {
            Failure::Status { status, retry_after } => {
                Some(Outcome::Status { status: *status, retry_after: *retry_after })
            }
            Failure::Head(CallError::Timeout(_)) => Some(Outcome::Timeout),
            Failure::Head(CallError::Connect(_) | CallError::Tls(_)) => Some(Outcome::ConnectionError),
            Failure::Head(CallError::Credential(_)) => None,
            Failure::Body(fault) => fault.breaker_outcome(),
            Failure::AfterSend(_)
            | Failure::Picker(_)
            | Failure::Unreached
            | Failure::Request(_)
            | Failure::Quota { .. } => None,
        }
    }
}

/// How an answer's failure after its head counts for the backend's breaker: a stall
/// is a timeout, a cut or invalid answer a broken connection. Also how a stream that
/// breaks after its first byte counts.
impl Classify for Fault {
    fn breaker_outcome(&self) -> Option<Outcome> {
        Some(match self {
            Fault::Timeout => Outcome::Timeout,
            Fault::Cut(_) | Fault::Invalid(_) => Outcome::ConnectionError,
        })
    }
}

/// A backend's answer, in before a byte reached the client.
pub(super) struct Answered<T> {
    pub value: T,
    /// What the breaker is told now; `None` when the door tells it through the pass
    /// once the answer ends (a stream, a session).
    pub outcome: Option<Outcome>,
}

impl<T> Classify for Answered<T> {
    fn breaker_outcome(&self) -> Option<Outcome> {
        self.outcome
    }
}

/// The candidate that served, its answer, and its breaker's pass.
pub(super) struct Served<T> {
    pub candidate: Candidate,
    pub value: T,
    pub pass: Pass,
    /// The serving backend's `timeout`.
    pub timeout: Duration,
}

/// One door's attempt at one backend: how it reaches a backend of its kind, what it
/// prepares for it, and the attempt itself. The door knows its transport; the chain
/// knows the order, the breakers and what a failure means.
pub(super) trait Attempt {
    /// How the door reaches one backend (its settings, its client).
    type Target;
    /// What is sent to it.
    type Prepared;
    /// What it answered, once in.
    type Answer;

    /// The backend as this door reaches it, and its `timeout`; `None` when it cannot
    /// (not a backend of the door's kind).
    fn reach(&self, backend: &BackendId) -> Option<(Self::Target, Duration)>;

    /// What is sent to the target, and the model it serves. An error is the caller's
    /// (a request this backend's format cannot carry): the call ends with it.
    fn prepare(&self, target: &Self::Target) -> Result<(String, Self::Prepared), GatewayError>;

    /// The target that calls `endpoint` (`ip:port`), named by the picker of the
    /// inference pool `pool`, as `target` (the pool reached) would be called. `None`:
    /// this door cannot call a picked endpoint.
    fn at(&self, pool: &BackendId, target: &Self::Target, endpoint: &str) -> Option<Self::Target> {
        let _ = (pool, target, endpoint);
        None
    }

    /// What an endpoint picker is asked about a call prepared so: the path the call
    /// takes at the backend, and the body it sends. `None`: this door's calls do not
    /// go through a picker.
    fn question<'p>(&'p self, prepared: &'p Self::Prepared) -> Option<(&'p str, &'p [u8])> {
        let _ = prepared;
        None
    }

    /// Sends it, up to the answer being in (or failing).
    fn attempt(
        &self,
        target: &Self::Target,
        prepared: Self::Prepared,
        draft: &Draft,
    ) -> impl Future<Output = Result<Answered<Self::Answer>, Failure>> + Send;
}

/// Tries `route` in order until a backend's answer is in. Each candidate the door
/// reaches is one call through the breaker layer ([`BreakerLayer`]): skipped when its
/// breaker is open, else taken in turn ([`take_turn`]), and its breaker told how it
/// went by the layer alone. Its provider quota's reservation, if it has one, is held
/// in `charge` (see the module docs).
pub(super) async fn attempt_chain<A: Attempt>(
    gateway: &Gateway,
    draft: &mut Draft,
    charge: &mut Charge,
    route: &Route,
    door: &A,
) -> Result<Served<A::Answer>, GatewayError> {
    let mut attempts = Attempts::default();
    let mut last: Option<(BackendId, Failure)> = None;
    // The candidates passed over for their provider quota, when the soonest window
    // ends, and the rate that refused last (the 429's `type`).
    let mut at_quota: Vec<BackendId> = Vec::new();
    let mut quota_retry = 60;
    let mut quota_rate = Rate::Requests;
    // Whether every quota that passed a candidate over is smaller than the call itself.
    let mut only_never = true;
    // The inference pools whose picker could not answer, under `fail_open`.
    let mut opened: Vec<&BackendId> = Vec::new();
    for (i, candidate) in route.candidates.iter().enumerate() {
        if candidate.fail_open_of.as_ref().is_some_and(|pool| !opened.contains(&pool)) {
            continue;
        }
        // Counted in flight since its admission: the first candidate, if tried.
        let held = if i == 0 { route.held.take() } else { None };
        let backend = &candidate.backend;
        let Some((target, timeout)) = door.reach(backend) else {
            continue;
        };
        // Once a candidate was passed over for its quota, the one that serves is a
        // fallback (`Flexway-Degraded`), a pool's next member included.
        let fallback;
        let candidate = if at_quota.is_empty() || candidate.degraded {
            candidate
        } else {
            fallback = Candidate { degraded: true, reason: Some(PickReason::Fallback), ..candidate.clone() };
            &fallback
        };
        let turn = Turn {
            gateway,
            route,
            door,
            candidate,
            target,
            timeout,
            draft: &mut *draft,
            charge: &mut *charge,
            attempts: &mut attempts,
        };
        let in_flight = held.or_else(|| gateway.router.loads.start(backend));
        let call = Call { backend: backend.clone(), in_flight, request: turn };
        let mut guarded = BreakerLayer::new(gateway.breakers.clone()).layer(tower::service_fn(take_turn::<A>));
        // Made ready, then called where it is awaited: `oneshot` would move the turn's
        // future (the attempt's inside it, kilobytes) once more, 400 instructions a
        // call (benches/instructions).
        let answer = match std::future::poll_fn(|cx| guarded.poll_ready(cx)).await {
            Ok(()) => guarded.call(call).await,
            Err(refused) => Err(refused),
        };
        let failure = match answer {
            Ok(Passed { answer: Answered { value: (candidate, value), .. }, pass }) => {
                return Ok(Served { candidate, value, pass, timeout });
            }
            Err(Refused::Open) => {
                draft.skipped(backend, SkipCause::CircuitOpen);
                attempts.skipped.push(backend.clone());
                continue;
            }
            Err(Refused::Failed(failure)) => failure,
        };
        // This backend will not serve: its quota is not its to hold any longer.
        refund_quota(charge, backend).await;
        match failure {
            Failure::Request(error) => return Err(*error),
            Failure::Quota { rate, retry_after_secs, never } => {
                draft.skipped(backend, SkipCause::Quota);
                at_quota.push(backend.clone());
                quota_retry = quota_retry.min(retry_after_secs);
                quota_rate = rate;
                only_never &= never;
            }
            Failure::Unreached => {}
            Failure::Picker(e) => {
                // Only a pool with a picker fails so: its mode is there.
                let mode = gateway.router.picker(backend).map_or(FailureMode::FailClose, |(_, mode)| *mode);
                tracing::warn!(backend = %backend, failure_mode = ?mode, "{e}");
                if mode == FailureMode::FailOpen {
                    opened.push(backend);
                }
                last = Some((backend.clone(), Failure::Picker(e)));
            }
            failure => {
                let retryable = failure.retryable();
                last = Some((backend.clone(), failure));
                if !retryable {
                    break;
                }
            }
        }
    }
    // Every candidate passed over, and only for its quota: a wait, not an outage.
    if last.is_none() && attempts.tried.is_empty() && attempts.skipped.is_empty() && !at_quota.is_empty() {
        let backends = at_quota.iter().map(BackendId::as_str).collect::<Vec<_>>().join(", ");
        // No minute could ever hold it there: a wait would never end (400, no retry).
        if only_never {
            let bound = charge.quota_bound().unwrap_or_default();
            return Err(crate::call::InvalidRequest::message(format!(
                "this call may count {bound} tokens, more than the whole tokens_per_minute quota of {backends}: \
                 no backend that could serve it ever could"
            ))
            .into());
        }
        return Err(GatewayError::BackendQuota { backends, kind: quota_rate, retry_after_secs: quota_retry });
    }
    Err(unserved(route, attempts, last))
}

/// One candidate's turn: what the breaker layer's inner service is asked.
struct Turn<'a, A: Attempt> {
    gateway: &'a Gateway,
    route: &'a Route,
    door: &'a A,
    candidate: &'a Candidate,
    target: A::Target,
    /// The backend's `timeout`.
    timeout: Duration,
    draft: &'a mut Draft,
    charge: &'a mut Charge,
    attempts: &'a mut Attempts,
}

/// A candidate admitted by its breaker, attempted: prepared, then sent; an inference
/// pool endpoint by endpoint, as its picker names them ([`pick`]). The answer comes
/// with the candidate that served it (a pool's later endpoint serves degraded).
/// Only the pool's failure as a whole is the answer: one model server's is the
/// picker's to route around.
async fn take_turn<A: Attempt>(turn: Turn<'_, A>) -> Result<Answered<(Candidate, A::Answer)>, Failure> {
    let Turn { gateway, route, door, candidate, target, timeout, draft, charge, attempts } = turn;
    let (model, prepared) = door.prepare(&target).map_err(|e| Failure::Request(Box::new(e)))?;
    if gateway.config.ai.any_quota {
        reserve_quota(gateway, charge, &candidate.backend, draft.request_id()).await?;
    }
    let Some((picker, _)) = gateway.router.picker(&candidate.backend) else {
        let one = One { candidate: candidate.clone(), target, model, prepared, timeout };
        let Answered { value, outcome } = try_one(gateway, draft, route, door, one, attempts).await?;
        return Ok(Answered { value: (candidate.clone(), value), outcome });
    };
    let endpoints = pick(picker, door, draft, &prepared).await.map_err(Failure::Picker)?;
    let mut endpoint_failure = None;
    let mut first = Some((model, prepared));
    for (j, endpoint) in endpoints.iter().take(endpoint_picker::MAX_TRIED).enumerate() {
        let Some(target) = door.at(&candidate.backend, &target, endpoint) else { continue };
        // What is sent does not depend on the endpoint: prepared once, but for the
        // body a failed attempt took.
        let (model, prepared) = match first.take() {
            Some(prepared) => prepared,
            None => door.prepare(&target).map_err(|e| Failure::Request(Box::new(e)))?,
        };
        let mut served_by = candidate.clone();
        if j > 0 {
            served_by.degraded = true;
            served_by.reason = Some(PickReason::Fallback);
        }
        let one = One { candidate: served_by.clone(), target, model, prepared, timeout };
        // The attempt's failure is logged once, by `try_one`, naming the endpoint.
        let attempt = try_one(gateway, draft, route, door, one, attempts)
            .instrument(tracing::warn_span!("picked", endpoint = endpoint.as_str()));
        match attempt.await {
            Ok(Answered { value, outcome }) => return Ok(Answered { value: (served_by, value), outcome }),
            Err(failure) if failure.retryable() => endpoint_failure = Some(failure),
            Err(failure) => return Err(failure),
        }
    }
    Err(endpoint_failure.unwrap_or(Failure::Unreached))
}

/// Reserves one request and the call's token bound on `backend`'s provider quota
/// windows (SPEC §14), as its own reservation (`<request id>/quota/<backend>`) held in
/// `charge` until the call ends. Nothing, not even an allocation, for a backend without
/// a quota, for a charge that holds no tokens, or when the call holds this backend's
/// quota already (a backend the route names twice). `Failure::Quota` when a window
/// refuses. A ledger that fails fails open: logged, and the backend is tried without a
/// reservation on its quota (the call's own reservation holds; a quota only steers).
async fn reserve_quota(
    gateway: &Gateway,
    charge: &mut Charge,
    backend: &BackendId,
    request_id: &str,
) -> Result<(), Failure> {
    let Some(bound) = charge.quota_bound() else { return Ok(()) };
    if charge.holds_quota(backend) {
        return Ok(());
    }
    match hold_quota(gateway, backend, bound, request_id).await {
        QuotaHold::Nothing => Ok(()),
        QuotaHold::Held(quota) => {
            charge.hold_quota(quota);
            Ok(())
        }
        QuotaHold::Refused { rate, retry_after_secs, never } => Err(Failure::Quota { rate, retry_after_secs, never }),
    }
}

/// What reserving on a backend's provider quota gave.
pub(super) enum QuotaHold {
    /// Nothing to hold: the backend has no quota, or the ledger failed (a quota only
    /// steers: the call goes on without it, logged).
    Nothing,
    Held(HeldQuota),
    /// A window of the quota is full until the minute's end, or (`never`) smaller
    /// than the call's bound: no minute can hold it.
    Refused {
        rate: Rate,
        retry_after_secs: u64,
        never: bool,
    },
}

/// Reserves one request and `bound` tokens on `backend`'s provider quota windows
/// (SPEC §14), as a reservation of its own (`<id>/quota/<backend>`): a call's
/// attempt, or a realtime session's response.
pub(super) async fn hold_quota(gateway: &Gateway, backend: &BackendId, bound: u64, id: &str) -> QuotaHold {
    let Some(settings) = gateway.config.ai.backends.get(backend).filter(|b| !b.quota.is_none()) else {
        return QuotaHold::Nothing;
    };
    let now = unix_now();
    let retry_after_secs = Period::Minute.end(now).saturating_sub(now).clamp(1, 60);
    if settings.quota.tokens_per_minute.is_some_and(|limit| bound > limit) {
        return QuotaHold::Refused { rate: Rate::Tokens, retry_after_secs, never: true };
    }
    let windows: Arc<[Budget]> = plan::quota_for(settings, now).into();
    let lines = windows
        .iter()
        .map(|w| Line { key: w.key.clone(), amount: if w.unit == Unit::Requests { 1 } else { bound }, limit: w.limit })
        .collect();
    // A stream's reservation outlives its backend's timeout, as the call's does.
    let expires_at = now + gateway.attempt_time(backend).as_secs() + STREAM_RESERVATION_SECS;
    let request = ReserveRequest { request_id: format!("{id}/quota/{backend}"), lines, expires_at };
    let outcome = reserve_guarded(&gateway.budgets, &request).await;
    match outcome {
        Ok(ReserveOutcome::Reserved) => {
            let ticket = Ticket::new(gateway.budgets.clone(), request.reservation(), Arc::clone(&windows), now);
            QuotaHold::Held(HeldQuota { backend: backend.clone(), ticket, windows })
        }
        Ok(ReserveOutcome::Refused { line }) => {
            gauge_quota(gateway, backend, &windows).await;
            let rate = match windows.get(line).map(|w| w.kind) {
                Some(Kind::Window(rate)) => rate,
                _ => Rate::Requests,
            };
            QuotaHold::Refused { rate, retry_after_secs, never: false }
        }
        // `Unanswered` refunds what the failed call may have written all the same.
        Err(e) => {
            tracing::warn!(backend = %backend, "provider quota not reserved, the ledger failed: {e}; tried without it");
            QuotaHold::Nothing
        }
    }
}

/// Refunds `backend`'s quota reservation, if the call holds one, now that its attempt
/// failed: only the quota of a backend that may still serve stays held while a
/// fallback serves (a stream may last minutes). Boxed, and only for a call that holds
/// one: a call on backends without a quota keeps the refund's future out of its own.
async fn refund_quota(charge: &mut Charge, backend: &BackendId) {
    let Charge::Tokens(tokens) = charge else { return };
    let Some(i) = tokens.quotas.iter().position(|q| q.backend == *backend) else { return };
    let quota = tokens.quotas.swap_remove(i);
    Box::pin(quota.ticket.refund()).await;
}

/// How often a settlement reads a backend's quota windows again for the gauge, at most.
const GAUGE_EVERY: Duration = Duration::from_secs(1);

/// The backends whose quota was read for the gauge after a settlement, and when (at
/// most [`GAUGED_BACKENDS`] of them: past that the map starts over, costing a read each).
static GAUGED: LazyLock<Mutex<HashMap<BackendId, Instant>>> = LazyLock::new(Mutex::default);
const GAUGED_BACKENDS: usize = 1024;

/// Whether `backend`'s quota gauge is due a read after a settlement: not read in the
/// last [`GAUGE_EVERY`]. A settlement on a busy backend then costs no ledger read but
/// once a second; a refusal and the console read always.
pub(super) fn gauge_due(backend: &BackendId) -> bool {
    let Ok(mut gauged) = GAUGED.lock() else { return true };
    match gauged.get(backend) {
        Some(at) if at.elapsed() < GAUGE_EVERY => false,
        _ => {
            if gauged.len() >= GAUGED_BACKENDS && !gauged.contains_key(backend) {
                gauged.clear();
            }
            gauged.insert(backend.clone(), Instant::now());
            true
        }
    }
}

/// Sets `flexway_backend_quota_used_ratio` from a read of `backend`'s quota windows
/// (a refusal, a settlement when [`gauge_due`]: not every call's hot path). A failed
/// read leaves it.
pub(super) async fn gauge_quota(gateway: &Gateway, backend: &BackendId, windows: &[Budget]) {
    let keys: Vec<_> = windows.iter().map(|w| w.key.clone()).collect();
    let Ok(used) = gateway.budgets.used(&keys).await else { return };
    for (window, used) in windows.iter().zip(used) {
        if let (Kind::Window(rate), Some(limit)) = (window.kind, window.limit) {
            let ratio = if limit == 0 { 1.0 } else { used as f64 / limit as f64 };
            gateway.metrics.set_backend_quota_used(backend.as_str(), rate.as_str(), ratio);
        }
    }
}

/// One attempt at one target: what it is sent and as which candidate.
struct One<A: Attempt> {
    candidate: Candidate,
    target: A::Target,
    model: String,
    prepared: A::Prepared,
    timeout: Duration,
}

/// Attempts `one`, up to its answer being in: named in the draft, its wait timed and
/// told to `latency` picking.
async fn try_one<A: Attempt>(
    gateway: &Gateway,
    draft: &mut Draft,
    route: &Route,
    door: &A,
    one: One<A>,
    attempts: &mut Attempts,
) -> Result<Answered<A::Answer>, Failure> {
    let One { candidate, target, model, prepared, timeout } = one;
    let backend = &candidate.backend;
    let loads = &gateway.router.loads;
    attempts.tried.push(backend.clone());
    draft.trying(&candidate, &model);
    let sent = Instant::now();
    let result = door.attempt(&target, prepared, draft).await;
    let waited = sent.elapsed();
    draft.waited(waited);
    match result {
        Ok(answered) => {
            // A stream is told a success at its end; a relayed 4xx (a 429) is no
            // answer: it counts for `latency` as a timeout would, and remembers no
            // prefix.
            let ok = match answered.outcome {
                None | Some(Outcome::Success) => true,
                Some(Outcome::Status { status, .. }) => (200..300).contains(&status),
                Some(Outcome::ConnectionError | Outcome::Timeout) => false,
            };
            if ok {
                loads.observe_latency(backend, waited);
                gateway.router.served(route, &candidate);
            } else {
                loads.observe_latency(backend, timeout.max(waited));
            }
            Ok(answered)
        }
        Err(failure) => {
            failure.log(backend);
            // A failure is as slow as the timeout, whenever it came: a member that
            // fails fast never wins `latency`.
            loads.observe_latency(backend, timeout.max(waited));
            Err(failure)
        }
    }
}

/// Asks an inference pool's picker which endpoints serve the call: the request's
/// body as the pool would be sent it, with the headers Envoy would send (method,
/// path, content type) and the call's request id.
async fn pick<A: Attempt>(
    picker: &EndpointPicker,
    door: &A,
    draft: &Draft,
    prepared: &A::Prepared,
) -> Result<Vec<String>, PickerError> {
    let Some((path, body)) = door.question(prepared) else {
        return Err(PickerError::Failed("this door cannot ask an endpoint picker".into()));
    };
    let mut headers = http::HeaderMap::with_capacity(2);
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    if let Ok(id) = http::HeaderValue::from_str(draft.request_id()) {
        headers.insert("x-request-id", id);
    }
    picker.pick(path, &headers, body).await
}

/// How an HTTP door reaches an endpoint backend: its settings and its client.
pub(super) fn endpoint<'g>(
    gateway: &'g Gateway,
    backend: &BackendId,
) -> Option<((&'g Endpoint, Reached<'g>), Duration)> {
    let endpoint = gateway.config.ai.backends.get(backend).and_then(|b| b.kind.endpoint())?;
    let client = gateway.upstreams.get(backend)?;
    Some(((endpoint, Reached::Configured(client)), client.timeout))
}

/// The client an HTTP door calls: a configured backend's, or one made for an
/// endpoint an inference pool's picker named.
pub(super) enum Reached<'g> {
    Configured(&'g UpstreamClient),
    Picked(Box<UpstreamClient>),
}

impl std::ops::Deref for Reached<'_> {
    type Target = UpstreamClient;

    fn deref(&self) -> &UpstreamClient {
        match self {
            Reached::Configured(client) => client,
            Reached::Picked(client) => client,
        }
    }
}

/// The error of a call no candidate served: 504 when the last backend tried timed out,
/// 502 when its answer was invalid, else 503 with its cause (every candidate skipped
/// for an open breaker, a pool exhausted, or the backends tried failed), naming a TLS
/// failure (a certificate to fix, not a backend down).
fn unserved(route: &Route, attempts: Attempts, last: Option<(BackendId, Failure)>) -> GatewayError {
    let last = last.map(|(backend, failure)| match failure {
        Failure::AfterSend(cause) => (backend, *cause),
        failure => (backend, failure),
    });
    match last {
        Some((backend, failure)) if failure.is_timeout() => GatewayError::UpstreamTimeout { backend, attempts },
        Some((backend, Failure::Body(Fault::Invalid(detail)))) => {
            GatewayError::UpstreamError { backend, detail, attempts }
        }
        Some((backend, Failure::Picker(_))) => GatewayError::UpstreamUnavailable {
            cause: UnavailableCause::PickerUnavailable,
            attempts,
            last_failure: Some(format!("backend `{backend}`: its endpoint picker could not answer")),
        },
        last => {
            let cause = if attempts.tried.is_empty() && !attempts.skipped.is_empty() {
                UnavailableCause::CircuitOpen
            } else if route.via_pool {
                UnavailableCause::PoolExhausted
            } else {
                UnavailableCause::UpstreamFailed
            };
            let last_failure = match last {
                Some((backend, Failure::Head(e @ CallError::Tls(_)))) => Some(format!("backend `{backend}`: {e}")),
                _ => None,
            };
            GatewayError::UpstreamUnavailable { cause, attempts, last_failure }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::call::{InvalidRequest, Operation, RequestId};

    /// A door whose attempts answer as scripted, in order, noting each backend tried.
    #[derive(Default)]
    struct Scripted {
        answers: Mutex<VecDeque<Result<&'static str, Failure>>>,
        tried: Mutex<Vec<String>>,
        /// A backend whose request cannot be prepared (the caller's error).
        unpreparable: Option<&'static str>,
    }

    impl Scripted {
        fn answering(answers: Vec<Result<&'static str, Failure>>) -> Scripted {
            Scripted { answers: Mutex::new(answers.into()), ..Scripted::default() }
        }

        fn tried(&self) -> Vec<String> {
            self.tried.lock().unwrap().clone()
        }
    }

    impl Attempt for Scripted {
        type Target = BackendId;
        type Prepared = ();
        type Answer = &'static str;

        fn reach(&self, backend: &BackendId) -> Option<(BackendId, Duration)> {
            (backend.as_str() != "elsewhere").then(|| (backend.clone(), Duration::from_secs(1)))
        }

        fn prepare(&self, target: &BackendId) -> Result<(String, ()), GatewayError> {
            if self.unpreparable == Some(target.as_str()) {
                return Err(InvalidRequest { message: "not for this format".into(), param: Some("n") }.into());
            }
            Ok(("model".to_owned(), ()))
        }

        async fn attempt(&self, target: &BackendId, (): (), _: &Draft) -> Result<Answered<&'static str>, Failure> {
            self.tried.lock().unwrap().push(target.to_string());
            let next = self.answers.lock().unwrap().pop_front().expect("a scripted answer for each attempt");
            next.map(|value| Answered { value, outcome: Some(Outcome::Success) })
        }
    }

    /// A gateway with backends `a` (its breaker trips on one failure), `b`, `c` and
    /// `elsewhere`, and a call's draft.
    async fn gateway() -> (Arc<Gateway>, Draft) {
        let (gateway, _) = crate::http::testing::gateway().await;
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static("Bearer k"));
        let caller = gateway.keys.authenticate(&headers).unwrap();
        let draft = Draft::begin(&gateway, &RequestId::generate(), &caller, Operation::Chat, &headers);
        (gateway, draft)
    }

    fn route(names: &[&str]) -> Route {
        let candidates = names
            .iter()
            .enumerate()
            .map(|(i, name)| Candidate::fallback_unless(BackendId::new(name), i == 0))
            .collect();
        Route { candidates, via_pool: false, prefix: None, held: Default::default() }
    }

    fn status(status: u16) -> Failure {
        Failure::Status { status, retry_after: None }
    }

    #[tokio::test]
    async fn the_route_is_tried_in_order_until_one_answers() {
        let (gateway, mut draft) = gateway().await;
        let door = Scripted::answering(vec![Err(status(503)), Ok("from c")]);
        let served =
            attempt_chain(&gateway, &mut draft, &mut Charge::None, &route(&["elsewhere", "a", "c", "b"]), &door)
                .await
                .unwrap();
        assert_eq!((served.value, served.candidate.backend.as_str()), ("from c", "c"));
        assert!(served.candidate.degraded);
        assert_eq!(door.tried(), ["a", "c"], "a candidate the door cannot reach is passed over; b is never tried");
    }

    #[tokio::test]
    async fn a_failure_opens_the_breaker_and_the_next_call_skips_that_backend() {
        let (gateway, mut draft) = gateway().await;
        let door = Scripted::answering(vec![Err(status(500)), Ok("from b")]);
        attempt_chain(&gateway, &mut draft, &mut Charge::None, &route(&["a", "b"]), &door).await.unwrap();
        let door = Scripted::answering(vec![Ok("from b")]);
        let served = attempt_chain(&gateway, &mut draft, &mut Charge::None, &route(&["a", "b"]), &door).await.unwrap();
        assert_eq!((served.value, door.tried()), ("from b", vec!["b".to_owned()]));
        // With only that backend, nothing is tried: 503 circuit_open, naming it.
        let door = Scripted::default();
        match attempt_chain(&gateway, &mut draft, &mut Charge::None, &route(&["a"]), &door).await {
            Err(GatewayError::UpstreamUnavailable { cause: UnavailableCause::CircuitOpen, attempts, .. }) => {
                assert_eq!(attempts.skipped, [BackendId::new("a")]);
            }
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("served"),
        }
        assert!(door.tried().is_empty());
    }

    #[tokio::test]
    async fn a_failure_after_the_request_went_out_ends_the_call_there() {
        let (gateway, mut draft) = gateway().await;
        let sent = Failure::AfterSend(Box::new(Failure::Head(CallError::Timeout(Duration::from_secs(1)))));
        let door = Scripted::answering(vec![Err(sent)]);
        let error =
            attempt_chain(&gateway, &mut draft, &mut Charge::None, &route(&["b", "c"]), &door).await.err().unwrap();
        assert!(matches!(error, GatewayError::UpstreamTimeout { .. }), "{error}");
        assert_eq!(door.tried(), ["b"], "c never gets a request b took part of");
    }

    #[tokio::test]
    async fn a_request_the_backend_cannot_carry_ends_the_call_before_any_attempt() {
        let (gateway, mut draft) = gateway().await;
        let door = Scripted { unpreparable: Some("b"), ..Scripted::answering(vec![Ok("from c")]) };
        let error =
            attempt_chain(&gateway, &mut draft, &mut Charge::None, &route(&["b", "c"]), &door).await.err().unwrap();
        assert!(matches!(error, GatewayError::InvalidRequest(_)), "{error}");
        assert!(door.tried().is_empty());
    }

    /// A gateway whose backend `q` has a quota of one request a minute, beside `b`.
    async fn quota_gateway() -> Arc<Gateway> {
        use sha2::Digest;
        let yaml = format!(
            "version: 1\ntenants:\n  acme:\n    keys: [{{sha256: {}}}]\nai:\n  default_backend: q\n  backends:\n    \
             q: {{url: 'http://127.0.0.1:9/v1', quota: {{requests_per_minute: 1, tokens_per_minute: 1000}}}}\n    \
             b: {{url: 'http://127.0.0.1:9/v1'}}\n",
            hex::encode(sha2::Sha256::digest(b"k"))
        );
        let env = std::collections::HashMap::<String, String>::new();
        let loaded = crate::config::load_str(&yaml, &env).unwrap();
        let adapters = crate::gateway::Adapters {
            budgets: Arc::new(crate::budget::MemoryBudgetStore::new()),
            audit: Arc::new(crate::audit::sinks::MemoryAuditSink::new()),
            export: crate::telemetry::Export::Batched,
            cache: None,
        };
        let secrets = Arc::new(crate::secret::LocalSecrets { env });
        Arc::new(Gateway::new(loaded.config, secrets, adapters).await.unwrap())
    }

    /// A model call's charge reserving `prompt` + `allowance` tokens (its own ticket
    /// holds nothing).
    fn tokens(gateway: &Gateway, prompt: u64, allowance: u64) -> Charge {
        let ticket = Ticket::new(gateway.budgets.clone(), Default::default(), Arc::from([]), 0);
        Charge::Tokens(super::super::drive::Tokens {
            ticket,
            prompt,
            prompt_typical: prompt,
            allowance: Some(allowance),
            quotas: Vec::new(),
            cache: None,
        })
    }

    /// Two members of one priority group: neither is a fallback by its place.
    fn group(names: &[&str]) -> Route {
        let mut route = route(names);
        for candidate in &mut route.candidates {
            candidate.degraded = false;
            candidate.reason = Some(PickReason::Weighted);
        }
        route
    }

    #[tokio::test]
    async fn a_backend_at_its_quota_is_passed_over_and_the_next_serves_as_a_fallback() {
        let gateway = quota_gateway().await;
        let now = unix_now();
        let q = gateway.config.ai.backends.get(&BackendId::new("q")).unwrap();
        let keys: Vec<_> = plan::quota_for(q, now).iter().map(|w| w.key.clone()).collect();
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static("Bearer k"));
        let caller = gateway.keys.authenticate(&headers).unwrap();
        let draft = || Draft::begin(&gateway, &RequestId::generate(), &caller, Operation::Chat, &headers);

        // The first call takes q's one request: its quota holds one request and its bound.
        let (mut first, mut charge) = (draft(), tokens(&gateway, 10, 20));
        let door = Scripted::answering(vec![Ok("from q")]);
        let served = attempt_chain(&gateway, &mut first, &mut charge, &group(&["q", "b"]), &door).await.unwrap();
        assert_eq!((served.value, served.candidate.degraded), ("from q", false));
        assert!(charge.holds_quota(&BackendId::new("q")));
        assert_eq!(gateway.budgets.used(&keys).await.unwrap(), [1, 30]);

        // The next is passed over to b, which serves as a fallback; nothing held of q.
        let (mut second, mut other) = (draft(), tokens(&gateway, 10, 20));
        let door = Scripted::answering(vec![Ok("from b")]);
        let served = attempt_chain(&gateway, &mut second, &mut other, &group(&["q", "b"]), &door).await.unwrap();
        assert_eq!(door.tried(), ["b"]);
        assert_eq!(served.candidate.backend.as_str(), "b");
        assert!(served.candidate.degraded, "Flexway-Degraded after a quota skip");
        assert_eq!(served.candidate.reason, Some(PickReason::Fallback));
        assert!(!other.holds_quota(&BackendId::new("q")));

        // With q alone: 429, to the minute's end.
        let door = Scripted::default();
        match attempt_chain(&gateway, &mut draft(), &mut tokens(&gateway, 10, 20), &route(&["q"]), &door).await {
            Err(GatewayError::BackendQuota { backends, kind, retry_after_secs }) => {
                assert_eq!(backends, "q");
                assert_eq!(kind, Rate::Requests, "its one request is taken; its tokens would fit");
                assert!((1..=60).contains(&retry_after_secs), "{retry_after_secs}");
            }
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("served"),
        }
        assert!(door.tried().is_empty());
        // A charge dropped unended (its call cancelled) gives q's quota back.
        drop(charge);
        for _ in 0..100 {
            if gateway.budgets.used(&keys).await.unwrap() == [0, 0] {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(gateway.budgets.used(&keys).await.unwrap(), [0, 0]);
        drop(first);
    }

    #[tokio::test]
    async fn a_failed_attempt_gives_its_quota_back_before_the_fallback_serves() {
        let gateway = quota_gateway().await;
        let q = gateway.config.ai.backends.get(&BackendId::new("q")).unwrap();
        let keys: Vec<_> = plan::quota_for(q, unix_now()).iter().map(|w| w.key.clone()).collect();
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static("Bearer k"));
        let caller = gateway.keys.authenticate(&headers).unwrap();
        let mut draft = Draft::begin(&gateway, &RequestId::generate(), &caller, Operation::Chat, &headers);
        let mut charge = tokens(&gateway, 10, 20);
        let door = Scripted::answering(vec![Err(status(503)), Ok("from b")]);
        let served = attempt_chain(&gateway, &mut draft, &mut charge, &route(&["q", "b"]), &door).await.unwrap();
        assert_eq!((served.value, door.tried()), ("from b", vec!["q".to_owned(), "b".to_owned()]));
        // While b serves (a stream may last minutes), q's window holds nothing of it.
        assert!(!charge.holds_quota(&BackendId::new("q")));
        assert_eq!(gateway.budgets.used(&keys).await.unwrap(), [0, 0]);
        assert_eq!(gateway.budgets.live_reservations().await.unwrap(), 0);
    }

    #[test]
    fn a_failure_is_retried_until_the_request_went_out_and_counts_but_our_own_credential() {
        let failures = [
            (
                Failure::Status { status: 503, retry_after: None },
                Some(Outcome::Status { status: 503, retry_after: None }),
            ),
            (Failure::Head(CallError::Timeout(Duration::from_secs(1))), Some(Outcome::Timeout)),
            (Failure::Head(CallError::Connect("refused".into())), Some(Outcome::ConnectionError)),
            (Failure::Head(CallError::Tls("unknown issuer".into())), Some(Outcome::ConnectionError)),
            (Failure::Head(CallError::Credential("no token file".into())), None),
            (Failure::Body(Fault::Timeout), Some(Outcome::Timeout)),
            (Failure::Body(Fault::Cut("reset".into())), Some(Outcome::ConnectionError)),
            (Failure::Body(Fault::Invalid("not json".into())), Some(Outcome::ConnectionError)),
        ];
        for (failure, outcome) in failures {
            assert!(failure.retryable(), "{failure:?}");
            assert_eq!(failure.breaker_outcome(), outcome, "{failure:?}");
            // Once the backend took part of a request that cannot go twice, the same
            // failure ends the call, and still counts.
            let sent = Failure::AfterSend(Box::new(failure));
            assert!(!sent.retryable(), "{sent:?}");
            assert_eq!(sent.breaker_outcome(), outcome, "{sent:?}");
        }
    }

    #[test]
    fn the_last_failure_says_which_error_the_caller_gets() {
        let route = |via_pool| Route { candidates: Vec::new(), via_pool, prefix: None, held: Default::default() };
        let tried =
            |names: &[&str]| Attempts { tried: names.iter().copied().map(BackendId::new).collect(), skipped: vec![] };
        let b = || BackendId::new("b");
        let timeout = unserved(&route(false), tried(&["a", "b"]), Some((b(), Failure::Body(Fault::Timeout))));
        assert!(matches!(timeout, GatewayError::UpstreamTimeout { .. }), "{timeout}");
        let invalid = unserved(&route(false), tried(&["b"]), Some((b(), Failure::Body(Fault::Invalid("x".into())))));
        assert!(matches!(invalid, GatewayError::UpstreamError { .. }), "{invalid}");
        let status = Failure::Status { status: 500, retry_after: None };
        let failed = unserved(&route(true), tried(&["b"]), Some((b(), status)));
        assert!(
            matches!(failed, GatewayError::UpstreamUnavailable { cause: UnavailableCause::PoolExhausted, .. }),
            "{failed}"
        );
        let skipped = Attempts { tried: vec![], skipped: vec![b()] };
        let open = unserved(&route(false), skipped, None);
        assert!(
            matches!(open, GatewayError::UpstreamUnavailable { cause: UnavailableCause::CircuitOpen, .. }),
            "{open}"
        );
        let tls = unserved(&route(false), tried(&["b"]), Some((b(), Failure::Head(CallError::Tls("bad cert".into())))));
        assert!(tls.to_string().contains("backend `b`: "), "{tls}");
    }
}
