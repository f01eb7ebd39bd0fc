//! Upstream calls: one HTTP client per backend, with its authentication.
//!
//! The request sent upstream is built from nothing: a JSON body, a content type, the
//! call's trace context, the backend's own credential, the version header of the
//! format it speaks (`anthropic-version`) — and for a relay (another Flexway, SPEC
//! §8), the caller's tenant, agent and sensitivity under the header names its
//! `identity_headers` declares, and only those. Of the caller's own headers only
//! those a backend names in `forward_headers` travel (an `anthropic-beta`, say): the
//! config refuses a credential there, so the caller's key can never reach a backend.
//!
//! A backend's secrets (its auth secret, its TLS material) are resolved before the
//! gateway starts and again every `secrets.refresh`: each backend's credential and
//! client sit behind an `ArcSwap`, replaced whole when a refresh brings new values, so
//! a request uses one consistent set and a rotated key is picked up without a
//! restart. A refresh that fails keeps the last good set. `token_file` is apart: it is
//! re-read at every call (a projected workload-identity token rotates under our feet).
//!
//! Connection pools are per serving thread: `flexway serve` serves calls on one
//! single-threaded runtime per core ([`set_serving_threads`], [`enter_serving_thread`]),
//! and a connection's task runs on the runtime that opened it, so each thread calls
//! through clients of its own and no call wakes another thread. Elsewhere (the Lambda
//! function, tests) there is one client per backend.
//!
//! HTTP/1.1 has one path, `http://` or `https://`: the gateway's own client ([`h1`]),
//! on the caller's task, without hyper's ~29 KB a connection (10,000 streams: a 165 MB
//! peak against 357 MB through hyper's client), over rustls for `https://` (`ring`;
//! the webpki roots, or a backend's own `tls.ca`). Its TLS handshake offers `h2`: a
//! backend whose server chooses it is called through hyper-util's HTTP/2 client from
//! then on, where streams share a connection ([`alpn`]). Neither follows a redirect,
//! and both retry nothing but a request that a pooled connection closed before it was
//! sent (or whose handshake chose the other version: nothing was sent).
//!
//! hyper's pool keeps one HTTP/2 connection to a backend, whose server takes only so
//! many streams on it: a serving thread calls through [`lanes`], one client and
//! another with its own connections whenever each already has 100 calls in flight. A
//! lane's HTTP/2 client speaks HTTP/2 only: calls to a backend wait for the connection
//! being opened instead of each opening one. A REST operation's request, whose body
//! streams, goes through the lane's other client, which lets TLS choose.

mod alpn;
pub mod body;
mod client;
mod credential;
pub mod grpc;
mod h1;
mod headers;
pub mod lanes;
pub mod realtime;
mod tls;
mod transport;
mod upstreams;

use std::time::Duration;

pub use self::client::UpstreamClient;
pub use self::headers::CallerIdentity;
pub use self::lanes::{AnswerBody, BodyError};
// The realtime client's TLS: the public roots, as every shared client's.
use self::tls::{public_roots, tls_config};
pub use self::transport::{enter_serving_thread, set_serving_threads};
pub use self::upstreams::Upstreams;
use crate::config::BackendId;
use crate::secret::SecretError;

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A reference that did not resolve, named by its path in the document.
    #[error("{path}: {source}")]
    Secret { path: String, source: SecretError },
    #[error("backend `{backend}`: the credential is not a valid header value")]
    BadCredential { backend: BackendId },
    #[error("backend `{backend}`: an identity header is not a valid header name")]
    BadIdentityHeader { backend: BackendId },
    #[error("backend `{backend}`: a forwarded header is not a valid header name")]
    BadForwardHeader { backend: BackendId },
    #[error("backend `{backend}`: TLS: {detail}")]
    Tls { backend: BackendId, detail: String },
    #[error("HTTP client: {0}")]
    Client(String),
}

/// Why a backend did not answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("connection failed: {0}")]
    Connect(String),
    /// The TLS handshake failed: what an operator fixes in the backend's `tls`.
    #[error("TLS handshake failed: {0}")]
    Tls(String),
    #[error("credential unavailable: {0}")]
    Credential(String),
}

/// A backend's answer, its head read; `body.rs` reads the rest.
pub type Answer = http::Response<AnswerBody>;

pub(crate) use crate::call::headers::USER_AGENT;

/// An error and its sources, in one line (`client error (Connect): tcp connect
/// error: Connection refused`).
pub(crate) fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message = format!("{message}: {s}");
        source = s.source();
    }
    message
}
