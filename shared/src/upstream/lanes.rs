//! Lanes: a set of clients of one kind, each with its own connection pool; a call takes
//! the first with room, and a new one is added when none has.
//!
//! hyper-util's pool keeps one HTTP/2 connection to a host, and a server takes only so
//! many streams on one connection (its `SETTINGS_MAX_CONCURRENT_STREAMS`: 128 for
//! nginx and AWS's load balancers, 250 for Go's servers): past that, hyper queues the
//! calls until a stream ends. A lane carries at most [`CALLS_PER_LANE`] calls at once
//! (100, the floor RFC 9113 asks servers to allow), so no connection is asked for more
//! streams than that. A call holds its [`Seat`] until its answer's body is dropped
//! ([`AnswerBody`]). A lane counts every call through it, whatever the backend, so a
//! connection carries at most as many streams as its lane has calls. Lanes are never
//! removed: an idle lane's connections close after its pool's idle timeout.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};

/// The calls a lane carries at once before the next call takes another lane.
pub const CALLS_PER_LANE: usize = 100;

pub(crate) struct Lanes<C> {
    /// Builds a client with a pool of its own.
    make: Box<dyn Fn() -> C + Send + Sync>,
    lanes: Mutex<Vec<Arc<Lane<C>>>>,
}

pub(crate) struct Lane<C> {
    pub client: C,
    in_flight: Arc<AtomicUsize>,
}

/// A call's place on a lane, given back when it is dropped.
pub struct Seat(Arc<AtomicUsize>);

impl Drop for Seat {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<C> Lanes<C> {
    pub fn new(make: impl Fn() -> C + Send + Sync + 'static) -> Lanes<C> {
        let first = Arc::new(Lane { client: make(), in_flight: Arc::default() });
        Lanes { make: Box::new(make), lanes: Mutex::new(vec![first]) }
    }

    /// The first lane with room, a new lane when none has, and the call's seat on it.
    pub fn seat(&self) -> (Arc<Lane<C>>, Seat) {
        let mut lanes = self.lanes.lock().unwrap_or_else(PoisonError::into_inner);
        let lane = match lanes.iter().find(|lane| lane.in_flight.load(Ordering::Relaxed) < CALLS_PER_LANE) {
            Some(lane) => lane.clone(),
            None => {
                let lane = Arc::new(Lane { client: (self.make)(), in_flight: Arc::default() });
                lanes.push(lane.clone());
                lane
            }
        };
        lane.in_flight.fetch_add(1, Ordering::Relaxed);
        let seat = Seat(lane.in_flight.clone());
        (lane, seat)
    }
}

/// A backend's answer body: hyper's, for a call through a lane (which keeps its seat
/// while this lives), or the gateway's own client's, for a plain `http://` backend.
pub struct AnswerBody {
    body: Inner,
    _seat: Option<Seat>,
}

enum Inner {
    Pooled(Incoming),
    Plain(super::h1::Body),
}

/// Why an answer's body could not be read, as its client tells it.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(transparent)]
    Pooled(#[from] hyper::Error),
    #[error(transparent)]
    Plain(#[from] super::h1::Error),
}

impl AnswerBody {
    pub(crate) fn new(body: Incoming, seat: Seat) -> AnswerBody {
        AnswerBody { body: Inner::Pooled(body), _seat: Some(seat) }
    }

    pub(crate) fn plain(body: super::h1::Body) -> AnswerBody {
        AnswerBody { body: Inner::Plain(body), _seat: None }
    }
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match &mut self.body {
            Inner::Pooled(body) => Pin::new(body).poll_frame(cx).map(|f| f.map(|f| f.map_err(Into::into))),
            Inner::Plain(body) => Pin::new(body).poll_frame(cx).map(|f| f.map(|f| f.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.body {
            Inner::Pooled(body) => body.is_end_stream(),
            Inner::Plain(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.body {
            Inner::Pooled(body) => body.size_hint(),
            Inner::Plain(body) => body.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl<C> Lanes<C> {
        fn count(&self) -> usize {
            self.lanes.lock().unwrap_or_else(PoisonError::into_inner).len()
        }
    }

    fn in_flight<C>(lane: &Lane<C>) -> usize {
        lane.in_flight.load(Ordering::Relaxed)
    }

    #[test]
    fn a_call_takes_a_new_lane_only_when_every_lane_is_full() {
        let made = Arc::new(AtomicUsize::new(0));
        let counter = made.clone();
        let lanes = Lanes::new(move || counter.fetch_add(1, Ordering::Relaxed));
        let mut calls: Vec<_> = (0..CALLS_PER_LANE).map(|_| lanes.seat()).collect();
        assert_eq!((lanes.count(), made.load(Ordering::Relaxed)), (1, 1));
        assert!(calls.iter().all(|(lane, _)| lane.client == 0));

        let (overflow, _seat) = lanes.seat();
        assert_eq!((lanes.count(), overflow.client), (2, 1));

        // A call that ends gives its seat back: the next call rides the first lane again.
        let (first, _) = calls.pop().unwrap();
        let (again, _seat) = lanes.seat();
        assert!(Arc::ptr_eq(&again, &first));
        assert_eq!(lanes.count(), 2);
        assert_eq!((in_flight(&first), in_flight(&overflow)), (CALLS_PER_LANE, 1));
    }
}
