//! A backend's connections: each serving thread's HTTP/1.1 pool and its lanes of
//! hyper clients (HTTP/2 only, and streaming). A call goes through the clients of the
//! thread it runs on, so that no call wakes another thread; none follows a redirect,
//! and none retries but a request a pooled connection closed before it was sent.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::alpn::{Negotiated, Noting};
use super::grpc;
use super::h1;
use super::lanes::Lanes;

/// How many serving threads call the backends: each gets its own clients (connection
/// pools). Set once by `flexway serve` before the gateway is built; 1 otherwise.
pub(super) static SERVING_THREADS: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    /// This thread's place among the serving threads (0 elsewhere).
    static SERVING_THREAD: Cell<usize> = const { Cell::new(0) };
}

/// Gives every backend `threads` clients, one per serving thread; for the gateways
/// built after it.
pub fn set_serving_threads(threads: usize) {
    SERVING_THREADS.store(threads.max(1), Ordering::Relaxed);
}

/// Marks the current thread as serving thread `index` (of [`set_serving_threads`]).
pub fn enter_serving_thread(index: usize) {
    SERVING_THREAD.with(|slot| slot.set(index));
}

/// A backend's HTTP client (cheap to clone: its pool is shared).
type Http = Client<Noting<HttpsConnector<HttpConnector>>, Full<Bytes>>;

/// A backend's client for requests whose bodies stream (REST operations).
type Streaming = Client<Noting<HttpsConnector<HttpConnector>>, grpc::UpstreamBody>;

/// A lane's clients, over one connector (see the module docs).
pub(super) struct Clients {
    /// HTTP/2 only, for a backend whose server chose `h2` at the last handshake.
    pub(super) h2: Http,
    /// For a body that streams (a `kind: http` backend's operations): TLS chooses the
    /// version (ALPN); HTTP/1.1 over plain TCP.
    pub(super) streaming: Streaming,
}

/// A backend's connections, each serving thread's (see the module docs): its HTTP/1.1
/// pool (plain, or TLS with one client configuration), and its lanes of HTTP/2 and
/// streaming clients.
#[derive(Clone)]
pub(super) struct Transport {
    pub(super) h1: Vec<Arc<h1::Pool>>,
    pub(super) lanes: Vec<Arc<Lanes<Clients>>>,
}

impl Transport {
    pub(super) fn h1(&self) -> &Arc<h1::Pool> {
        &self.h1[SERVING_THREAD.with(Cell::get) % self.h1.len()]
    }

    pub(super) fn lanes(&self) -> &Lanes<Clients> {
        &self.lanes[SERVING_THREAD.with(Cell::get) % self.lanes.len()]
    }

    /// Each thread's pools and lanes over `tls`.
    pub(super) fn over(tls: &rustls::ClientConfig, negotiated: &Arc<Negotiated>, threads: usize) -> Transport {
        Transport {
            h1: (0..threads).map(|_| Arc::new(h1::Pool::tls(tls.clone()))).collect(),
            lanes: (0..threads).map(|_| lanes(tls.clone(), negotiated)).collect(),
        }
    }
}

/// A lane's clients over `tls`, noting in `negotiated` what each handshake chose. No
/// redirect is followed (hyper follows none) and no request is retried but one a
/// pooled connection closed before sending it: a backend's answer, a 3xx included, is
/// the answer; trying again is the route's business (fallback before the first byte,
/// SPEC §5).
fn http_clients(tls: rustls::ClientConfig, negotiated: &Arc<Negotiated>) -> Clients {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_all_versions()
        .wrap_connector(tcp);
    let builder = |h2_only| {
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .http2_only(h2_only);
        builder
    };
    let connector = |h2_only| Noting { inner: https.clone(), negotiated: negotiated.clone(), h2_only };
    Clients { h2: builder(true).build(connector(true)), streaming: builder(false).build(connector(false)) }
}

/// Lanes of clients over `tls`.
fn lanes(tls: rustls::ClientConfig, negotiated: &Arc<Negotiated>) -> Arc<Lanes<Clients>> {
    let negotiated = negotiated.clone();
    Arc::new(Lanes::new(move || http_clients(tls.clone(), &negotiated)))
}
