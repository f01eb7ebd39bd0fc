//! What each backend's server chose by ALPN, remembered so that a burst of calls to an
//! HTTP/2 backend shares its connections from the start.
//!
//! hyper-util's pool shares one connection to a host, and while that connection is
//! being opened, a client told to speak HTTP/2 only makes every other call to the host
//! wait for it. A client that lets TLS choose the version cannot know before the
//! handshake ends: every call that comes meanwhile opens a connection of its own,
//! dropped once the first is pooled. A lane starts with an empty pool, so under a
//! ramp of streams each new lane went through this: in `cargo bench --bench streams`,
//! 10,000 streams to an HTTP/2 backend opened 10,000 TLS connections to keep about a
//! hundred. Now a burst opens one a lane; a first burst to a backend waits for the
//! first handshake (`super::h1::conn::connect`) to learn what it speaks.
//!
//! So each TLS handshake notes what it chose, by the backend's authority: the HTTP/1.1
//! client's (`super::h1`, which offers `h2` and, when the server chooses it, closes
//! the connection unused), and the HTTP/2-only client's connector ([`Noting`]). A call
//! to a backend whose last handshake chose `h2` goes through its lane's HTTP/2-only
//! client, the others through the HTTP/1.1 client. A later handshake that chooses
//! otherwise turns the backend back to HTTP/1.1: the HTTP/2-only client's connector
//! drops that connection before any request is sent on it ([`NotH2`]), and the call
//! goes again through the HTTP/1.1 client (`UpstreamClient::post_json`), as do the
//! calls that were waiting for that connection. The flags are kept by authority, for
//! `https://` URLs only: a plain `http://` backend always speaks HTTP/1.1.
//!
//! A lane's HTTP/2-only client has a pool of its own: the first call to a backend that
//! speaks `h2` makes two handshakes, the HTTP/1.1 client's that learns it and the
//! HTTP/2 client's that carries the call.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::Connection;
use tower::Service;

/// Whether each authority's server chose `h2` at the last TLS handshake with it.
#[derive(Default)]
pub(crate) struct Negotiated {
    hosts: Mutex<HashMap<String, Arc<AtomicBool>>>,
}

impl Negotiated {
    /// The flag for `authority` (`host:port` as the URL spells it), false until a
    /// handshake with it chooses `h2`. Read on every call, set at each connect.
    pub fn speaks_h2(&self, authority: &str) -> Arc<AtomicBool> {
        let mut hosts = self.hosts.lock().unwrap_or_else(PoisonError::into_inner);
        hosts.entry(authority.to_owned()).or_default().clone()
    }
}

/// A connector that notes in [`Negotiated`] what each TLS connection it opens chose;
/// for an HTTP/2-only client (`h2_only`), a connection on which the server chose
/// otherwise is a connect error.
#[derive(Clone)]
pub(crate) struct Noting<C> {
    pub inner: C,
    pub negotiated: Arc<Negotiated>,
    pub h2_only: bool,
}

type BoxError = Box<dyn StdError + Send + Sync>;
type Connecting<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

/// What an HTTP/2-only client's connect says when the server chose HTTP/1.1.
#[derive(Debug, thiserror::Error)]
#[error("the backend's server did not choose h2 at the TLS handshake")]
pub(crate) struct NotH2;

impl<C> Service<Uri> for Noting<C>
where
    C: Service<Uri>,
    C::Response: Connection,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Connecting<C::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let noted = match (uri.scheme(), uri.authority()) {
            (Some(scheme), Some(authority)) if *scheme == http::uri::Scheme::HTTPS => {
                Some(self.negotiated.speaks_h2(authority.as_str()))
            }
            _ => None,
        };
        let h2_only = self.h2_only;
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let io = connecting.await.map_err(Into::into)?;
            if let Some(speaks_h2) = noted {
                let h2 = io.connected().is_negotiated_h2();
                speaks_h2.store(h2, Ordering::Relaxed);
                if h2_only && !h2 {
                    return Err(NotH2.into());
                }
            }
            Ok(io)
        })
    }
}
