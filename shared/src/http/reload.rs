//! The local shape's surface, reloadable (SPEC §12): each request is served by the
//! gateway current when it arrives, so a new configuration takes the next call (a
//! revoked key is refused from then on, on a kept-alive connection too) while the
//! calls in flight finish on the gateway they started with, which is dropped with
//! the last of them.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use axum::Router;
use axum::response::Response;
use tower::Service;

use crate::gateway::Gateway;

/// The gateway in use and its surface, swapped together.
pub struct Reloadable {
    current: ArcSwap<(Arc<Gateway>, Router)>,
}

impl Reloadable {
    pub fn new(gateway: Arc<Gateway>) -> Arc<Reloadable> {
        let app = super::app(gateway.clone());
        Arc::new(Reloadable { current: ArcSwap::from_pointee((gateway, app)) })
    }

    /// The gateway new calls go to.
    pub fn gateway(&self) -> Arc<Gateway> {
        self.current.load().0.clone()
    }

    /// Puts `gateway` in use for every call from now on.
    pub fn swap(&self, gateway: Arc<Gateway>) {
        let app = super::app(gateway.clone());
        self.current.store(Arc::new((gateway, app)));
    }

    /// The service a connection serves its requests with.
    pub fn service(self: &Arc<Self>) -> Current {
        Current(self.clone())
    }
}

/// Serves each request with the surface current when it arrives.
#[derive(Clone)]
pub struct Current(Arc<Reloadable>);

impl<B> Service<http::Request<B>> for Current
where
    B: axum::body::HttpBody<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = axum::routing::future::RouteFuture<Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // An axum router is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let mut app = self.0.current.load().1.clone();
        app.call(request)
    }
}
