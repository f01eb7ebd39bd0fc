//! A metered operation's request body (gRPC, REST) until a backend takes it: it stays
//! with the gateway until a backend polls it, so that a backend that fails before
//! taking a byte hands the call to the next one.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use http_body_util::StreamBody;
use hyper::body::Frame;

use crate::upstream::grpc::{BoxError, UpstreamBody};

/// A request body that can be sent upstream as frames, metered on the way.
pub(super) trait Frames: Send + 'static {
    fn frames(self) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> + Send + 'static;
}

/// The request's body until a backend takes it: a send that fails before polling it
/// leaves it here for the next backend; once polled, the call is that backend's.
pub(super) struct Slot<B> {
    /// Where the next send's stream takes the body from. Replaced when a failed send
    /// left the body untaken, so that the failed send's stream, polled late by its
    /// connection, finds nothing rather than the next backend's body.
    current: Mutex<Arc<Mutex<Option<B>>>>,
}

impl<B: Frames> Slot<B> {
    pub fn new(body: B) -> Self {
        Slot { current: Mutex::new(Arc::new(Mutex::new(Some(body)))) }
    }

    /// After a failed send: whether no backend took the body, which is then kept for
    /// the next send only.
    pub fn reclaim(&self) -> bool {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        let body = current.lock().unwrap_or_else(PoisonError::into_inner).take();
        let untaken = body.is_some();
        *current = Arc::new(Mutex::new(body));
        untaken
    }

    /// The body for one send: taken from the slot when first polled.
    pub fn body(&self) -> UpstreamBody {
        let slot = self.current.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let taken =
            futures_util::stream::once(async move { slot.lock().unwrap_or_else(PoisonError::into_inner).take() });
        let bodies = futures_util::StreamExt::map(taken, |body| futures_util::stream::iter(body.map(B::frames)));
        let frames = futures_util::StreamExt::flatten(futures_util::StreamExt::flatten(bodies));
        http_body_util::BodyExt::boxed_unsync(StreamBody::new(frames))
    }
}
