//! The breakers as one `tower` layer around a call to a backend, as linkerd2-proxy
//! layers its own: the only place a breaker admits a call or hears how one went.
//!
//! The layer admits the call ([`Guarded::call`]), or refuses it at once without
//! calling the service inside ([`Refused::Open`]); it tells the breaker how the
//! answer or the failure counts ([`Classify`]) as soon as the service inside ends.
//! An answer that says nothing yet (a stream, a session) is told later, when it ends,
//! through the [`Pass`] the layer hands back with it, as linkerd classifies a
//! response body at its end.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use pin_project_lite::pin_project;
use tower::{Layer, Service};

use super::{Admit, Breakers, Outcome};
use crate::config::BackendId;
use crate::routing::pick::InFlight;

/// How an answer or a failure counts for its backend's breaker: the one
/// classification. `None`: it says nothing (yet) of the backend's health.
pub trait Classify {
    fn breaker_outcome(&self) -> Option<Outcome>;
}

impl Classify for Outcome {
    fn breaker_outcome(&self) -> Option<Outcome> {
        Some(*self)
    }
}

/// A call to one backend, as the layer takes it.
pub struct Call<R> {
    pub backend: BackendId,
    /// Counted in flight to the backend for as long as the call's pass lives.
    pub in_flight: Option<InFlight>,
    pub request: R,
}

/// An admitted call's answer, and the pass its later end is told through.
pub struct Passed<T> {
    pub answer: T,
    pub pass: Pass,
}

/// Why the layer gives no answer.
#[derive(Debug)]
pub enum Refused<E> {
    /// The backend's breaker is open (or its one half-open probe is out): nothing
    /// was called.
    Open,
    /// The call was made and failed; the breaker has been told.
    Failed(E),
}

/// An admitted call, until it ends: what the end of an answer that said nothing
/// when it came in (a stream, a session) is told through. A half-open breaker's pass
/// is its one probe; a pass never told (its call dropped) does not wedge it.
pub struct Pass {
    backend: BackendId,
    breakers: Arc<Breakers>,
    /// The call counted in flight to a pool member for as long as the pass lives
    /// (the whole call, a stream's included).
    _in_flight: Option<InFlight>,
}

impl std::fmt::Debug for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pass").field("backend", &self.backend).finish_non_exhaustive()
    }
}

impl Pass {
    /// Tells the backend's breaker how the answer ended.
    pub fn tell(&self, end: &impl Classify) {
        if let Some(outcome) = end.breaker_outcome() {
            self.breakers.record(&self.backend, outcome, Instant::now());
        }
    }
}

/// Puts the breakers of a gateway around a service that calls a backend.
#[derive(Clone)]
pub struct BreakerLayer {
    breakers: Arc<Breakers>,
}

impl BreakerLayer {
    pub fn new(breakers: Arc<Breakers>) -> Self {
        BreakerLayer { breakers }
    }
}

impl<S> Layer<S> for BreakerLayer {
    type Service = Guarded<S>;

    fn layer(&self, inner: S) -> Guarded<S> {
        Guarded { inner, breakers: self.breakers.clone() }
    }
}

/// A service whose calls are admitted and heard by their backend's breaker.
pub struct Guarded<S> {
    inner: S,
    breakers: Arc<Breakers>,
}

impl<S, R> Service<Call<R>> for Guarded<S>
where
    S: Service<R>,
    S::Response: Classify,
    S::Error: Classify,
{
    type Response = Passed<S::Response>;
    type Error = Refused<S::Error>;
    type Future = Heard<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Refused::Failed)
    }

    fn call(&mut self, call: Call<R>) -> Heard<S::Future> {
        let Call { backend, in_flight, request } = call;
        if self.breakers.admit(&backend, Instant::now()) == Admit::No {
            return Heard { inner: None, pass: None };
        }
        let pass = Pass { backend, breakers: self.breakers.clone(), _in_flight: in_flight };
        Heard { inner: Some(self.inner.call(request)), pass: Some(pass) }
    }
}

pin_project! {
    /// An admitted call's future: its breaker told how it went once it ends. A
    /// refused one ends at once.
    pub struct Heard<F> {
        #[pin]
        inner: Option<F>,
        pass: Option<Pass>,
    }
}

impl<F, T, E> Future for Heard<F>
where
    F: Future<Output = Result<T, E>>,
    T: Classify,
    E: Classify,
{
    type Output = Result<Passed<T>, Refused<E>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Some(inner) = this.inner.as_pin_mut() else {
            return Poll::Ready(Err(Refused::Open));
        };
        let result = ready!(inner.poll(cx));
        // Polled again after its end (which a caller may not do), it is refused.
        let Some(pass) = this.pass.take() else {
            return Poll::Ready(Err(Refused::Open));
        };
        Poll::Ready(match result {
            Ok(answer) => {
                pass.tell(&answer);
                Ok(Passed { answer, pass })
            }
            Err(failure) => {
                pass.tell(&failure);
                Err(Refused::Failed(failure))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tower::ServiceExt as _;

    use super::*;
    use crate::config::{BreakerPolicy, BreakerTrigger};
    use crate::routing::breaker::State;

    /// An answer or a failure that counts as scripted.
    #[derive(Debug)]
    struct Counts(Option<Outcome>);

    impl Classify for Counts {
        fn breaker_outcome(&self) -> Option<Outcome> {
            self.0
        }
    }

    /// A backend `b` whose breaker trips on one failure, for 30 s.
    fn breakers() -> (Arc<Breakers>, BackendId) {
        let policy = BreakerPolicy {
            trigger: BreakerTrigger::Failures(1),
            interval: Duration::from_secs(60),
            trip: Duration::from_secs(30),
            status: vec![(500, 599)],
            accept_retry_after: false,
        };
        let b = BackendId::new("b");
        (Arc::new(Breakers::new([(b.clone(), policy)])), b)
    }

    fn call(backend: &BackendId, answer: Result<Option<Outcome>, Option<Outcome>>) -> Call<Result<Counts, Counts>> {
        let request = answer.map(Counts).map_err(Counts);
        Call { backend: backend.clone(), in_flight: None, request }
    }

    /// A backend that answers what each call scripts, counting its calls.
    fn backend(calls: &AtomicUsize) -> impl Service<Result<Counts, Counts>, Response = Counts, Error = Counts> + '_ {
        tower::service_fn(move |scripted: Result<Counts, Counts>| {
            calls.fetch_add(1, Ordering::Relaxed);
            std::future::ready(scripted)
        })
    }

    #[tokio::test]
    async fn a_failure_is_heard_and_the_open_breaker_refuses_without_calling() {
        let (breakers, b) = breakers();
        let calls = AtomicUsize::new(0);
        let layer = BreakerLayer::new(breakers.clone());
        let failed = layer.layer(backend(&calls)).oneshot(call(&b, Err(Some(Outcome::ConnectionError)))).await;
        assert!(matches!(failed, Err(Refused::Failed(Counts(Some(Outcome::ConnectionError))))));
        assert_eq!(breakers.state(&b, Instant::now()), State::Open);
        let refused = layer.layer(backend(&calls)).oneshot(call(&b, Ok(Some(Outcome::Success)))).await;
        assert!(matches!(refused, Err(Refused::Open)));
        assert_eq!(calls.load(Ordering::Relaxed), 1, "the open breaker's backend is never called");
    }

    #[tokio::test]
    async fn an_answer_that_says_nothing_yet_is_told_through_its_pass() {
        let (breakers, b) = breakers();
        let calls = AtomicUsize::new(0);
        let layer = BreakerLayer::new(breakers.clone());
        let Ok(passed) = layer.layer(backend(&calls)).oneshot(call(&b, Ok(None))).await else {
            panic!("admitted and answered");
        };
        assert_eq!(breakers.state(&b, Instant::now()), State::Closed, "a stream's head says nothing");
        passed.pass.tell(&Outcome::Timeout);
        assert_eq!(breakers.state(&b, Instant::now()), State::Open, "its end does");
    }

    #[tokio::test]
    async fn a_failure_that_says_nothing_of_the_backend_is_not_counted() {
        let (breakers, b) = breakers();
        let calls = AtomicUsize::new(0);
        let layer = BreakerLayer::new(breakers.clone());
        let failed = layer.layer(backend(&calls)).oneshot(call(&b, Err(None))).await;
        assert!(matches!(failed, Err(Refused::Failed(Counts(None)))));
        assert_eq!(breakers.state(&b, Instant::now()), State::Closed);
    }
}
