//! The attempt phase, written once for every door: the route tried in order until one
//! backend's answer is in, before a byte reached the client (SPEC §5).
//!
//! A candidate whose breaker is open is skipped; one that is admitted gets a
//! [`Pass`], and its outcome reaches its breaker through that pass only: here for
//! every failure and every answer read whole, or later, by the door, when a stream or
//! a session ends. A failure falls back to the next candidate when another backend
//! could do better ([`Failure::retryable`]); one that no backend could (the request
//! cannot be carried) ends the call with its own error. When no candidate served, the
//! error names every backend tried or skipped, and why ([`unserved`]).
//!
//! What an attempt is differs by door (an HTTP request and its answer held, a
//! WebSocket handshake); how a failure counts does not: [`Failure`] is the one
//! classification the fallback, the breakers and the audit read.

use std::future::Future;
use std::time::{Duration, Instant};

use super::record::Draft;
use crate::config::{BackendId, Endpoint};
use crate::error::{Attempts, GatewayError, UnavailableCause};
use crate::gateway::Gateway;
use crate::routing::breaker::{Outcome, Pass};
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
}

impl Failure {
    /// Whether another backend could serve where this one failed: nothing reached the
    /// client yet, and the request can go again.
    pub fn retryable(&self) -> bool {
        !matches!(self, Failure::AfterSend(_))
    }

    /// The failure itself, whether or not the request went out.
    fn cause(&self) -> &Failure {
        match self {
            Failure::AfterSend(failure) => failure.cause(),
            failure => failure,
        }
    }

    /// How the failure counts for the backend's breaker; `None` when it says nothing
    /// of the backend's health (our own credential file is missing).
    pub fn breaker_outcome(&self) -> Option<Outcome> {
        match self.cause() {
            Failure::Status { status, retry_after } => {
                Some(Outcome::Status { status: *status, retry_after: *retry_after })
            }
            Failure::Head(CallError::Timeout(_)) => Some(Outcome::Timeout),
            Failure::Head(CallError::Connect(_) | CallError::Tls(_)) => Some(Outcome::ConnectionError),
            Failure::Head(CallError::Credential(_)) => None,
            Failure::Body(fault) => Some(fault_outcome(fault)),
            Failure::AfterSend(_) => None,
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
            Failure::AfterSend(_) => {}
        }
    }
}

/// How an answer's failure after its head counts for the backend's breaker: a stall
/// is a timeout, a cut or invalid answer a broken connection. Also how a stream that
/// breaks after its first byte counts.
pub(super) fn fault_outcome(fault: &Fault) -> Outcome {
    match fault {
        Fault::Timeout => Outcome::Timeout,
        Fault::Cut(_) | Fault::Invalid(_) => Outcome::ConnectionError,
    }
}

/// A backend's answer, in before a byte reached the client.
pub(super) struct Answered<T> {
    pub value: T,
    /// What the breaker is told now; `None` when the door tells it through the pass
    /// once the answer ends (a stream, a session).
    pub outcome: Option<Outcome>,
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

    /// Sends it, up to the answer being in (or failing).
    fn attempt(
        &self,
        target: &Self::Target,
        prepared: Self::Prepared,
        draft: &Draft,
    ) -> impl Future<Output = Result<Answered<Self::Answer>, Failure>> + Send;
}

/// Tries `route` in order until a backend's answer is in. A candidate the door
/// reaches is tried if its breaker admits it: prepared, named in the call's draft,
/// attempted, its wait timed.
pub(super) async fn attempt_chain<A: Attempt>(
    gateway: &Gateway,
    draft: &mut Draft,
    route: &Route,
    door: &A,
) -> Result<Served<A::Answer>, GatewayError> {
    let mut attempts = Attempts::default();
    let mut last: Option<(BackendId, Failure)> = None;
    for candidate in &route.candidates {
        let backend = &candidate.backend;
        let Some((target, timeout)) = door.reach(backend) else {
            continue;
        };
        let Some(pass) = gateway.breakers.pass(backend, Instant::now()) else {
            attempts.skipped.push(backend.clone());
            continue;
        };
        let (model, prepared) = door.prepare(&target)?;
        attempts.tried.push(backend.clone());
        draft.trying(candidate, &model);
        let sent = Instant::now();
        let result = door.attempt(&target, prepared, draft).await;
        draft.waited(sent.elapsed());
        match result {
            Ok(Answered { value, outcome }) => {
                if let Some(outcome) = outcome {
                    pass.record(&gateway.breakers, outcome);
                }
                return Ok(Served { candidate: candidate.clone(), value, pass, timeout });
            }
            Err(failure) => {
                failure.log(backend);
                if let Some(outcome) = failure.breaker_outcome() {
                    pass.record(&gateway.breakers, outcome);
                }
                let retryable = failure.retryable();
                last = Some((backend.clone(), failure));
                if !retryable {
                    break;
                }
            }
        }
    }
    Err(unserved(route, attempts, last))
}

/// How an HTTP door reaches an endpoint backend: its settings and its client.
pub(super) fn endpoint<'g>(
    gateway: &'g Gateway,
    backend: &BackendId,
) -> Option<((&'g Endpoint, &'g UpstreamClient), Duration)> {
    let endpoint = gateway.config.ai.backends.get(backend).and_then(|b| b.kind.endpoint())?;
    let client = gateway.upstreams.get(backend)?;
    Some(((endpoint, client), client.timeout))
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
    use super::*;

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
        let route = |via_pool| Route { candidates: Vec::new(), via_pool };
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
