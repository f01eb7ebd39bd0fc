//! The first layer every request meets: it is named (`Flexway-Request-Id`), the span
//! that puts its id on every log line of the call is opened, and oversized headers are
//! refused before anything reads them.
//!
//! A tower layer of its own rather than `axum::middleware::from_fn`, whose `Next`
//! clones and boxes the inner service and boxes its future on every request.

use std::convert::Infallible;
use std::future::{Future, Ready};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::extract::Request;
use axum::response::Response;
use futures_util::future::Either;
use http::HeaderValue;
use tower::{Layer, Service};
use tracing::Instrument as _;
use tracing::instrument::Instrumented;

use super::{REQUEST_ID_HEADER, RequestId, envelope_for, headers_too_large, render_in};
use crate::error::GatewayError;

/// Names every request its inner service answers ([`Named`]).
#[derive(Clone, Copy)]
pub(super) struct NameRequests;

impl<S> Layer<S> for NameRequests {
    type Service = Named<S>;

    fn layer(&self, inner: S) -> Named<S> {
        Named { inner }
    }
}

#[derive(Clone)]
pub(super) struct Named<S> {
    inner: S,
}

impl<S> Service<Request> for Named<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Naming<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        let id = RequestId::generate();
        let header = HeaderValue::from_str(&id.0).ok();
        // At ERROR level so that the span is enabled under any filter that lets a line
        // through (`FLEXWAY_LOG=warn` included): a span the filter disabled would leave
        // the warnings of the call without their request id (SPEC §9).
        let span = tracing::error_span!("request", request_id = %id.0);
        let answer = if headers_too_large(request.headers()) {
            let error =
                GatewayError::HeadersTooLarge { max_headers: super::MAX_HEADERS, max_bytes: super::MAX_HEADER_BYTES };
            Either::Left(std::future::ready(Ok(span.in_scope(|| render_in(&error, envelope_for(request.uri()))))))
        } else {
            request.extensions_mut().insert(id);
            let _entered = span.enter();
            Either::Right(self.inner.call(request).instrument(span.clone()))
        };
        Naming { answer, header }
    }
}

pin_project_lite::pin_project! {
    /// The answer, once in, with the request's id.
    pub(super) struct Naming<F> {
        #[pin]
        answer: Either<Ready<Result<Response, Infallible>>, Instrumented<F>>,
        header: Option<HeaderValue>,
    }
}

impl<F: Future<Output = Result<Response, Infallible>>> Future for Naming<F> {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Ok(mut response) = ready!(this.answer.poll(cx));
        if let Some(id) = this.header.take() {
            response.headers_mut().insert(REQUEST_ID_HEADER, id);
        }
        Poll::Ready(Ok(response))
    }
}
