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
pub mod grpc;
mod h1;
pub mod lanes;
pub mod realtime;

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use foldhash::HashMap;
use http::{HeaderName, HeaderValue, Method, Uri};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use self::alpn::{Negotiated, NotH2, Noting};
use self::grpc::GrpcClient;
use self::lanes::Lanes;
pub use self::lanes::{AnswerBody, BodyError};
use crate::config::{
    AgentId, Auth, BackendId, BackendKind, Config, Endpoint, IdentityHeaders, SecretRef, TenantId, Tls,
};
use crate::protocol::{Wire, anthropic};
use crate::secret::{Resolved, Secret, SecretError};
use crate::telemetry::{TraceContext, context};

/// How many serving threads call the backends: each gets its own clients (connection
/// pools). Set once by `flexway serve` before the gateway is built; 1 otherwise.
static SERVING_THREADS: AtomicUsize = AtomicUsize::new(1);

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

/// The paths the gateway posts to: their URLs are parsed once per backend.
const PATHS: [&str; 3] = ["/chat/completions", "/embeddings", anthropic::PATH];

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
    /// A grpc backend's descriptor set that loading only warned about (it may be
    /// shipped apart from the config): a gateway does not start without it.
    #[error("ai.backends.{backend}.descriptor_set: {} does not exist: a gateway with a grpc backend starts only with its descriptor set", path.display())]
    MissingDescriptorSet { backend: BackendId, path: std::path::PathBuf },
    /// A chain key anyone could guess is no key.
    #[error("audit.chain_key: the key is {len} bytes; a chain key is at least 16 (32 random bytes is the usual)")]
    ShortChainKey { len: usize },
    #[error(transparent)]
    Telemetry(#[from] crate::telemetry::NoRuntime),
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

#[derive(Clone)]
enum Credential {
    None,
    Header(HeaderName, HeaderValue),
    TokenFile(PathBuf),
}

impl Credential {
    /// The header this credential sends, if any.
    fn header(&self) -> Result<Option<(HeaderName, HeaderValue)>, CallError> {
        match self {
            Credential::None => Ok(None),
            Credential::Header(name, value) => Ok(Some((name.clone(), value.clone()))),
            Credential::TokenFile(path) => {
                // A few bytes from a projected token file: read in place, not on the
                // blocking pool (two thread hops for a microsecond's work).
                let token = std::fs::read_to_string(path)
                    .map_err(|e| CallError::Credential(format!("token_file {}: {e}", path.display())))?;
                let mut value = HeaderValue::from_str(&format!("Bearer {}", token.trim())).map_err(|_| {
                    CallError::Credential(format!("token_file {}: not a valid header value", path.display()))
                })?;
                value.set_sensitive(true);
                Ok(Some((http::header::AUTHORIZATION, value)))
            }
        }
    }
}

/// A backend's HTTP client (cheap to clone: its pool is shared).
type Http = Client<Noting<HttpsConnector<HttpConnector>>, Full<Bytes>>;

/// A backend's client for requests whose bodies stream (REST operations).
type Streaming = Client<Noting<HttpsConnector<HttpConnector>>, grpc::UpstreamBody>;

/// A lane's clients, over one connector (see the module docs).
struct Clients {
    /// HTTP/2 only, for a backend whose server chose `h2` at the last handshake.
    h2: Http,
    /// For a body that streams (a `kind: http` backend's operations): TLS chooses the
    /// version (ALPN); HTTP/1.1 over plain TCP.
    streaming: Streaming,
}

/// A backend's answer, its head read; `body.rs` reads the rest.
pub type Answer = http::Response<AnswerBody>;

pub struct UpstreamClient {
    base: String,
    /// `base` + each of [`PATHS`], parsed.
    urls: Vec<(&'static str, Uri)>,
    /// The format the backend speaks (`anthropic-version` goes with Anthropic's).
    pub wire: Wire,
    live: ArcSwap<Live>,
    pub timeout: Duration,
    /// A relay's: the names it passes the caller's identity under.
    identity_headers: Option<RelayHeaders>,
    /// The caller's headers this backend is sent (`forward_headers`).
    forward: Vec<HeaderName>,
    /// Whether the backend's server chose `h2` at the last TLS handshake with it.
    speaks_h2: Arc<AtomicBool>,
    /// Where the HTTP/1.1 client connects; `None` for a URL that is neither `http://`
    /// nor `https://` (an inference pool's template).
    target: Option<h1::Target>,
    /// An inference pool's: `base` is only its target's path, and each call goes to an
    /// endpoint its picker names ([`Upstreams::at`]).
    template: bool,
}

/// Who a call is for, as a relay passes it on: the caller's tenant and agent, and
/// whether the request is sensitive (`ai.sensitive_header`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallerIdentity {
    pub tenant: TenantId,
    pub agent: Option<AgentId>,
    pub sensitive: bool,
    /// The caller's headers that some backend forwards ([`Upstreams::forwardable`]);
    /// each backend is sent those it names. Empty when no backend forwards any.
    pub forwarded: Vec<(HeaderName, HeaderValue)>,
}

/// A relay's `identity_headers`, as header names; one left out is not sent.
struct RelayHeaders {
    tenant: Option<HeaderName>,
    agent: Option<HeaderName>,
    sensitive: Option<HeaderName>,
}

impl RelayHeaders {
    fn new(name: &BackendId, declared: &IdentityHeaders) -> Result<Self, SetupError> {
        let parse = |header: &Option<String>| {
            header
                .as_deref()
                .map(|h| HeaderName::from_bytes(h.as_bytes()))
                .transpose()
                .map_err(|_| SetupError::BadIdentityHeader { backend: name.clone() })
        };
        Ok(RelayHeaders {
            tenant: parse(&declared.tenant)?,
            agent: parse(&declared.agent)?,
            sensitive: parse(&declared.sensitive)?,
        })
    }

    /// The headers that say who the call is for. A name that cannot be a header value
    /// fails the call: sent without it, the call would be billed to the relay's own
    /// tenant at the other end.
    fn values(&self, caller: &CallerIdentity) -> Result<Vec<(HeaderName, HeaderValue)>, CallError> {
        let value = |what: &str, text: &str| {
            HeaderValue::from_str(text)
                .map_err(|_| CallError::Credential(format!("the {what} `{text}` cannot be sent in a header")))
        };
        let sensitive = HeaderValue::from_static(if caller.sensitive { "true" } else { "false" });
        let mut headers = Vec::new();
        if let Some(name) = &self.tenant {
            headers.push((name.clone(), value("tenant", caller.tenant.as_str())?));
        }
        if let (Some(name), Some(agent)) = (&self.agent, &caller.agent) {
            headers.push((name.clone(), value("agent", agent.as_str())?));
        }
        if let Some(name) = &self.sensitive {
            headers.push((name.clone(), sensitive));
        }
        Ok(headers)
    }
}

/// What a backend's secrets built: the clients (its own when it has `tls`) and the
/// credential, replaced together by a refresh.
struct Live {
    transport: Transport,
    credential: Credential,
    /// The values they were built from, to tell whether a refresh brought new ones.
    material: Material,
}

/// A backend's resolved secrets.
#[derive(Clone, PartialEq, Eq)]
struct Material {
    auth: Option<Secret>,
    tls: Option<TlsMaterial>,
}

/// A backend's connections, each serving thread's (see the module docs): its HTTP/1.1
/// pool (plain, or TLS with one client configuration), and its lanes of HTTP/2 and
/// streaming clients.
#[derive(Clone)]
struct Transport {
    h1: Vec<Arc<h1::Pool>>,
    lanes: Vec<Arc<Lanes<Clients>>>,
}

impl Transport {
    fn h1(&self) -> &Arc<h1::Pool> {
        &self.h1[SERVING_THREAD.with(Cell::get) % self.h1.len()]
    }

    fn lanes(&self) -> &Lanes<Clients> {
        &self.lanes[SERVING_THREAD.with(Cell::get) % self.lanes.len()]
    }

    /// Each thread's pools and lanes over `tls`.
    fn over(tls: &rustls::ClientConfig, negotiated: &Arc<Negotiated>, threads: usize) -> Transport {
        Transport {
            h1: (0..threads).map(|_| Arc::new(h1::Pool::tls(tls.clone()))).collect(),
            lanes: (0..threads).map(|_| lanes(tls.clone(), negotiated)).collect(),
        }
    }
}

#[derive(Clone, PartialEq, Eq)]
struct TlsMaterial {
    cert: Secret,
    key: Secret,
    ca: Option<Secret>,
}

impl UpstreamClient {
    /// POSTs a JSON body to `{url}{path}` (`{url}/v1{path}` for a relay) and waits for
    /// the response head. The call's trace context goes with it (W3C `traceparent`,
    /// `tracestate`), and to a relay, who the call is for.
    pub async fn post_json(
        &self,
        path: &str,
        body: Vec<u8>,
        trace: &TraceContext,
        caller: &CallerIdentity,
    ) -> Result<Answer, CallError> {
        let uri = match self.urls.iter().find(|(known, _)| *known == path) {
            Some((_, uri)) => uri.clone(),
            None => format!("{}{}", self.base, path)
                .parse::<Uri>()
                .map_err(|e| CallError::Connect(format!("the backend url with {path}: {e}")))?,
        };
        let mut headers = Outgoing(Vec::with_capacity(8));
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(http::header::ACCEPT, HeaderValue::from_static("*/*"));
        headers.insert(http::header::USER_AGENT, HeaderValue::from_static(USER_AGENT));
        if self.wire == Wire::Anthropic {
            headers.insert(HeaderName::from_static("anthropic-version"), HeaderValue::from_static(anthropic::VERSION));
        }
        if let Some((traceparent, state)) = trace.upstream() {
            headers.insert(HeaderName::from_static(context::TRACEPARENT), traceparent);
            if let Some(state) = state {
                headers.insert(HeaderName::from_static(context::TRACESTATE), state);
            }
        }
        if let Some(names) = &self.identity_headers {
            for (name, value) in names.values(caller)? {
                headers.insert(name, value);
            }
        }
        for (name, value) in self.forwarded(caller) {
            headers.0.push((name.clone(), value.clone()));
        }
        let live = self.live.load();
        if let Some((name, value)) = live.credential.header()? {
            headers.insert(name, value);
        }
        let deadline = tokio::time::Instant::now() + self.timeout;
        let target = self.target.as_ref().ok_or_else(|| CallError::Connect(format!("{}: not a URL", self.base)))?;
        if !self.speaks_h2.load(Ordering::Relaxed)
            && let Some(answer) =
                self.over_h1(&live, target, &h1::request(target, &uri, &headers.0, &body), deadline).await?
        {
            return Ok(answer);
        }
        // Kept for HTTP/1.1 should the handshake choose it (the body's bytes shared).
        let (body, again) = (Bytes::from(body), headers.clone());
        let mut h2_request = http::Request::new(Full::new(body.clone()));
        *h2_request.method_mut() = Method::POST;
        *h2_request.uri_mut() = uri.clone();
        *h2_request.headers_mut() = headers.into_map();
        let (lane, seat) = live.transport.lanes().seat();
        match tokio::time::timeout_at(deadline, lane.client.h2.request(h2_request)).await {
            // The server chose HTTP/1.1 at this call's handshake, or at the one it
            // waited for (alpn.rs): the request was never sent, and goes over HTTP/1.1.
            Ok(Err(e))
                if e.is_connect() && (cause::<NotH2>(&e).is_some() || !self.speaks_h2.load(Ordering::Relaxed)) =>
            {
                drop(seat);
                let request = h1::request(target, &uri, &again.0, &body);
                let answer = self.over_h1(&live, target, &request, deadline).await?;
                answer.ok_or_else(|| {
                    CallError::Connect("the backend's server changes its HTTP version at each handshake".into())
                })
            }
            Err(_) => Err(CallError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(send_error(&e)),
            Ok(Ok(response)) => Ok(response.map(|body| AnswerBody::new(body, seat))),
        }
    }

    /// Sends `request` over HTTP/1.1 through this thread's pool; `None` when the TLS
    /// handshake chose HTTP/2 (nothing was sent).
    async fn over_h1(
        &self,
        live: &Live,
        target: &h1::Target,
        request: &[u8],
        deadline: tokio::time::Instant,
    ) -> Result<Option<Answer>, CallError> {
        match tokio::time::timeout_at(deadline, live.transport.h1().post(target, request)).await {
            Err(_) => Err(CallError::Timeout(self.timeout)),
            Ok(Err(h1::Error::SpeaksH2)) => Ok(None),
            Ok(Err(e)) => Err(h1_error(&e)),
            Ok(Ok(response)) => Ok(Some(response.map(AnswerBody::plain))),
        }
    }

    /// Sends a REST operation's request (`kind: http`): `path_and_query` below the
    /// backend's `url`, the headers given plus the backend's credential, the body as
    /// it streams. The answer's head is awaited within the backend's `timeout`; its
    /// body is the upstream's, unread.
    pub async fn send_streaming(
        &self,
        method: Method,
        path_and_query: &str,
        mut headers: http::HeaderMap,
        body: grpc::UpstreamBody,
    ) -> Result<Answer, CallError> {
        let uri: Uri = format!("{}{path_and_query}", self.base)
            .parse()
            .map_err(|e| CallError::Connect(format!("{}{path_and_query}: {e}", self.base)))?;
        let live = self.live.load();
        if let Some((name, value)) = live.credential.header()? {
            headers.insert(name, value);
        }
        let mut request = http::Request::new(body);
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.headers_mut() = headers;
        let (lane, seat) = live.transport.lanes().seat();
        match tokio::time::timeout(self.timeout, lane.client.streaming.request(request)).await {
            Err(_) => Err(CallError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(send_error(&e)),
            Ok(Ok(response)) => Ok(response.map(|body| AnswerBody::new(body, seat))),
        }
    }

    /// Opens a connection to the backend ahead of its first call (Lambda's init, where
    /// the first call would otherwise wait for the handshakes): a TCP connection (and
    /// its TLS session) goes into this thread's HTTP/1.1 pool with nothing sent. A
    /// backend whose server chose HTTP/2 is connected by a `HEAD` of the base URL,
    /// without the credential or any caller's header, through the HTTP/2 client the
    /// calls use; its answer, whatever the status, is read and dropped, and the
    /// connection stays pooled.
    pub async fn preconnect(&self) -> Result<(), CallError> {
        let Some(target) = self.target.as_ref().filter(|_| !self.template) else {
            return Ok(());
        };
        let live = self.live.load();
        if !self.speaks_h2.load(Ordering::Relaxed) {
            match live.transport.h1().warm(target).await {
                Err(h1::Error::SpeaksH2) => {}
                warmed => return warmed.map_err(|e| h1_error(&e)),
            }
        }
        let uri: Uri = self.base.parse().map_err(|e| CallError::Connect(format!("{}: {e}", self.base)))?;
        let mut head = http::Request::new(Full::new(Bytes::new()));
        *head.method_mut() = Method::HEAD;
        *head.uri_mut() = uri;
        let (lane, _seat) = live.transport.lanes().seat();
        let answer = lane.client.h2.request(head).await.map_err(|e| send_error(&e))?;
        // The answer's end hands the connection back to its pool.
        let _ = http_body_util::BodyExt::collect(answer.into_body()).await;
        Ok(())
    }

    /// The caller's headers this backend names in `forward_headers`, every value of each.
    /// The caller's headers this backend's `forward_headers` lets through.
    fn forwarded<'c>(&'c self, caller: &'c CallerIdentity) -> impl Iterator<Item = &'c (HeaderName, HeaderValue)> {
        caller.forwarded.iter().filter(|(name, _)| self.forward.contains(name))
    }
}

/// An upstream call's headers, in the order they are written: a few, so a list. A
/// `HeaderMap`, built and dropped only for `h1::request` to write it out, was ~900
/// instructions a call; one is made only for HTTP/2.
#[derive(Clone)]
struct Outgoing(Vec<(HeaderName, HeaderValue)>);

impl Outgoing {
    /// Sets `name` to `value`, replacing any value it had (as `HeaderMap::insert`).
    fn insert(&mut self, name: HeaderName, value: HeaderValue) {
        self.0.retain(|(held, _)| *held != name);
        self.0.push((name, value));
    }

    fn into_map(self) -> http::HeaderMap {
        let mut map = http::HeaderMap::with_capacity(self.0.len());
        for (name, value) in self.0 {
            map.append(name, value);
        }
        map
    }
}

pub(crate) use crate::call::headers::USER_AGENT;

/// A request that got no answer: a TLS failure as rustls names it, else the
/// connection error as hyper tells it.
fn send_error(e: &hyper_util::client::legacy::Error) -> CallError {
    match cause::<rustls::Error>(e) {
        Some(tls) => CallError::Tls(tls_failure(tls)),
        None => CallError::Connect(describe(e)),
    }
}

/// A request the HTTP/1.1 client got no answer to: a TLS failure (the handshake, or an
/// alert the backend sent after it) as rustls names it, else what went wrong.
fn h1_error(e: &h1::Error) -> CallError {
    let tls = match e {
        h1::Error::Tls(io) | h1::Error::Io(io) => cause::<rustls::Error>(io),
        _ => None,
    };
    match (tls, e) {
        (Some(tls), _) => CallError::Tls(tls_failure(tls)),
        (None, h1::Error::Tls(io)) => CallError::Tls(io.to_string()),
        (None, e) => CallError::Connect(describe(e)),
    }
}

/// The first error of type `T` down `e`'s sources, `e` included. An I/O error's
/// `source()` skips the error it wraps (hyper's, tokio-rustls's do so): it is opened
/// with `get_ref`.
fn cause<'e, T: std::error::Error + 'static>(e: &'e (dyn std::error::Error + 'static)) -> Option<&'e T> {
    let mut next = Some(e);
    while let Some(error) = next {
        if let Some(found) = error.downcast_ref::<T>() {
            return Some(found);
        }
        next = match error.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref) {
            Some(inner) => Some(inner),
            None => error.source(),
        };
    }
    None
}

/// rustls's words, and where to look: the CA that should sign the backend's
/// certificate, or the client certificate the backend refused.
fn tls_failure(error: &rustls::Error) -> String {
    use rustls::AlertDescription as Alert;
    match error {
        rustls::Error::InvalidCertificate(_) => {
            format!("{error}: the backend's certificate is not trusted (its `tls.ca`, or the system roots)")
        }
        rustls::Error::AlertReceived(
            Alert::CertificateRequired
            | Alert::BadCertificate
            | Alert::UnknownCA
            | Alert::CertificateUnknown
            | Alert::CertificateExpired
            | Alert::CertificateRevoked
            | Alert::UnsupportedCertificate
            | Alert::AccessDenied,
        ) => format!("{error}: the backend refused the client certificate (its `tls.cert` and `tls.key`)"),
        other => other.to_string(),
    }
}

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

/// Every endpoint backend's client.
pub struct Upstreams {
    clients: HashMap<BackendId, UpstreamClient>,
    /// Each serving thread's connections over the public roots, shared by every
    /// `https://` backend without a `tls` of its own.
    shared: Transport,
    /// Each serving thread's pool of plain HTTP/1.1 connections, shared by every plain
    /// backend and every endpoint a picker names.
    pools: Vec<Arc<h1::Pool>>,
    /// Every name some backend's `forward_headers` lists.
    forwardable: Vec<HeaderName>,
    /// What the backends' servers chose at their TLS handshakes.
    negotiated: Arc<Negotiated>,
    /// The `grpc` backends' client over the public roots (h2c towards `http://`).
    grpc_shared: Arc<GrpcClient>,
    /// A `grpc` backend with `tls`: its own client.
    grpc_own: HashMap<BackendId, ArcSwap<OwnGrpc>>,
}

/// A `grpc` backend's own client, and the TLS material it was made with.
struct OwnGrpc {
    client: Arc<GrpcClient>,
    material: TlsMaterial,
}

impl Upstreams {
    /// Every endpoint backend's client, from its secrets resolved in `secrets`.
    pub fn new(config: &Config, secrets: &Resolved) -> Result<Self, SetupError> {
        Self::build(config, secrets, None)
    }

    /// The clients of a reloaded configuration (SPEC §12), over `previous`'s
    /// connection pools: a backend the reload leaves where it was keeps its pooled
    /// connections (and, with unchanged `tls`, its own client); one it removes is
    /// drained by the pools' idle timeout.
    pub fn reloaded(config: &Config, secrets: &Resolved, previous: &Upstreams) -> Result<Self, SetupError> {
        Self::build(config, secrets, Some(previous))
    }

    fn build(config: &Config, secrets: &Resolved, previous: Option<&Upstreams>) -> Result<Self, SetupError> {
        let threads = SERVING_THREADS.load(Ordering::Relaxed);
        let (shared, pools, negotiated, grpc_shared) = match previous {
            Some(previous) => (
                previous.shared.clone(),
                previous.pools.clone(),
                previous.negotiated.clone(),
                previous.grpc_shared.clone(),
            ),
            None => {
                let tls = tls_config(public_roots(), None).map_err(|e| SetupError::Client(e.to_string()))?;
                let negotiated = Arc::new(Negotiated::default());
                let shared = Transport::over(&tls, &negotiated, threads);
                let pools: Vec<_> = (0..threads).map(|_| Arc::new(h1::Pool::default())).collect();
                (shared, pools, negotiated, Arc::new(GrpcClient::new(tls)))
            }
        };
        let mut grpc_own = HashMap::default();
        for (name, backend) in &config.ai.backends {
            let BackendKind::Grpc { tls: Some(tls), .. } = &backend.kind else { continue };
            let material = tls_material(name, tls, secrets)?;
            let before = previous.and_then(|p| p.grpc_own.get(name)).map(ArcSwap::load_full);
            let own = match before {
                Some(before) if before.material == material => before,
                _ => Arc::new(OwnGrpc::new(name, tls, material)?),
            };
            grpc_own.insert(name.clone(), ArcSwap::new(own));
        }
        let mut clients = HashMap::default();
        let mut forwardable: Vec<HeaderName> = Vec::new();
        for (name, backend) in &config.ai.backends {
            let Some(endpoint) = backend.kind.endpoint() else {
                continue;
            };
            let material = material(name, endpoint, secrets)?;
            let base = endpoint.url.trim_end_matches('/');
            let uri = base.parse::<Uri>().ok();
            let https = uri.as_ref().filter(|uri| uri.scheme() == Some(&http::uri::Scheme::HTTPS));
            // HTTP/1.1 over the plain pools, or the TLS ones of the public roots.
            let h1 = if https.is_some() { shared.h1.clone() } else { pools.clone() };
            let kept = Transport { h1, ..shared.clone() };
            // A backend with its own TLS client keeps it when its material is the same.
            let before = previous.and_then(|p| p.clients.get(name)).map(|c| c.live.load_full());
            let live = match &before {
                Some(before) if before.material == material => {
                    Live::build(name, endpoint, material, Some(before), &before.transport, &negotiated)?
                }
                _ => Live::build(name, endpoint, material, None, &kept, &negotiated)?,
            };
            // A relay's url is the other Flexway's base: its API is under `/v1`.
            let (base, identity_headers) = match &backend.kind {
                BackendKind::Relay { identity_headers, .. } => {
                    (format!("{base}/v1"), Some(RelayHeaders::new(name, identity_headers)?))
                }
                _ => (base.to_owned(), None),
            };
            let wire = match backend.kind {
                BackendKind::Anthropic(_) => Wire::Anthropic,
                _ => Wire::OpenAi,
            };
            let live = ArcSwap::from_pointee(live);
            let urls = PATHS.iter().filter_map(|path| Some((*path, format!("{base}{path}").parse().ok()?))).collect();
            // Only TLS chooses a version: a plain `http://` backend keeps a flag of its
            // own, never set, whatever an `https://` one at the same authority chose.
            let authority = https.and_then(Uri::authority).map(|a| a.as_str().to_owned());
            let speaks_h2 = authority.map_or_else(Arc::default, |authority| negotiated.speaks_h2(&authority));
            let timeout = backend.timeout;
            let template = matches!(backend.kind, BackendKind::InferencePool { .. });
            let target = match https {
                Some(uri) => h1::Target::tls(uri, speaks_h2.clone()),
                None => uri.as_ref().and_then(h1::Target::of),
            };
            let forward: Vec<HeaderName> = endpoint
                .forward_headers
                .iter()
                .map(|h| {
                    HeaderName::from_bytes(h.as_bytes())
                        .map_err(|_| SetupError::BadForwardHeader { backend: name.clone() })
                })
                .collect::<Result<_, _>>()?;
            for header in &forward {
                if !forwardable.contains(header) {
                    forwardable.push(header.clone());
                }
            }
            let client = UpstreamClient {
                base,
                urls,
                wire,
                live,
                timeout,
                identity_headers,
                forward,
                speaks_h2,
                target,
                template,
            };
            clients.insert(name.clone(), client);
        }
        Ok(Upstreams { clients, shared, pools, forwardable, negotiated, grpc_shared, grpc_own })
    }

    /// The client a `grpc` backend is called through: its own with `tls`, else the
    /// shared one.
    pub fn grpc(&self, name: &BackendId) -> Arc<GrpcClient> {
        self.grpc_own.get(name).map_or_else(|| self.grpc_shared.clone(), |own| own.load().client.clone())
    }

    /// The client of `endpoint` (`ip:port`), named by the picker of the inference pool
    /// `pool`: called at `http://{endpoint}{path}` with the pool's credential,
    /// forwarded headers and timeout, over the plain connections every thread pools
    /// (a connection to it is reused by the next call it is named for). `None` when
    /// `pool` is not an inference pool or `endpoint` makes no URL.
    pub fn at(&self, pool: &BackendId, endpoint: &str) -> Option<UpstreamClient> {
        let template = self.clients.get(pool).filter(|c| c.template)?;
        let base = format!("http://{endpoint}{}", template.base);
        let uri = base.parse::<Uri>().ok()?;
        let target = h1::Target::of(&uri)?;
        let urls = PATHS.iter().filter_map(|path| Some((*path, format!("{base}{path}").parse().ok()?))).collect();
        Some(UpstreamClient {
            base,
            urls,
            wire: Wire::OpenAi,
            // An inference pool has no `tls` (the config refuses it): its HTTP/1.1 pools
            // are the plain ones its endpoints are called over.
            live: ArcSwap::new(template.live.load_full()),
            timeout: template.timeout,
            identity_headers: None,
            forward: template.forward.clone(),
            speaks_h2: Arc::default(),
            target: Some(target),
            template: false,
        })
    }

    /// Opens a connection to every endpoint backend at once, each given at most
    /// `within`; one that fails or takes longer is logged and left to its first call.
    pub async fn preconnect(&self, within: Duration) {
        let each = self.clients.iter().map(|(name, client)| async move {
            match tokio::time::timeout(within, client.preconnect()).await {
                Ok(Ok(())) => tracing::debug!(backend = %name, "connected ahead of the first call"),
                Ok(Err(e)) => tracing::info!(backend = %name, "not connected ahead of the first call: {e}"),
                Err(_) => tracing::info!(backend = %name, "not connected ahead of the first call within {within:?}"),
            }
        });
        futures_util::future::join_all(each).await;
    }

    /// The caller's headers some backend forwards, each value of each: what a call
    /// keeps of its request's headers for the backends it may reach.
    pub fn forwardable(&self, headers: &http::HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
        let mut kept = Vec::new();
        for name in &self.forwardable {
            for value in headers.get_all(name) {
                kept.push((name.clone(), value.clone()));
            }
        }
        kept
    }

    pub fn get(&self, name: &BackendId) -> Option<&UpstreamClient> {
        self.clients.get(name)
    }

    /// Puts the values of a refresh in use, backend by backend: a backend whose
    /// references all resolved, to values that differ from those in use, gets a new
    /// credential (and a new client if its TLS material changed). A backend with a
    /// reference missing from `secrets` (its refresh failed, and was logged), or whose
    /// new values do not build, keeps what it has. Returns the backends updated.
    pub fn refresh(&self, config: &Config, secrets: &Resolved) -> Vec<BackendId> {
        let mut updated = Vec::new();
        for (name, client) in &self.clients {
            let Some(endpoint) = config.ai.backends.get(name).and_then(|b| b.kind.endpoint()) else {
                continue;
            };
            let Ok(material) = material(name, endpoint, secrets) else {
                continue;
            };
            let current = client.live.load();
            if material == current.material {
                continue;
            }
            match Live::build(name, endpoint, material, Some(&current), &current.transport, &self.negotiated) {
                Ok(live) => {
                    client.live.store(Arc::new(live));
                    updated.push(name.clone());
                }
                Err(e) => tracing::error!("secret refresh: {e}; the backend keeps its current credential"),
            }
        }
        for (name, own) in &self.grpc_own {
            let Some(tls) = config.ai.backends.get(name).and_then(|b| b.kind.tls()) else { continue };
            let Ok(material) = tls_material(name, tls, secrets) else { continue };
            if material == own.load().material {
                continue;
            }
            match OwnGrpc::new(name, tls, material) {
                Ok(new) => {
                    own.store(Arc::new(new));
                    updated.push(name.clone());
                }
                Err(e) => tracing::error!("secret refresh: {e}; the backend keeps its current client"),
            }
        }
        updated
    }
}

/// A backend's secrets, taken from those resolved (each reference named by its path
/// when it is missing).
fn material(name: &BackendId, endpoint: &Endpoint, secrets: &Resolved) -> Result<Material, SetupError> {
    let get = |key: &str, reference: &SecretRef| {
        secrets.get(reference).cloned().ok_or_else(|| SetupError::Secret {
            path: format!("ai.backends.{name}.{key}"),
            source: SecretError::Unavailable { reference: reference.to_string(), detail: "not resolved".into() },
        })
    };
    let auth = match &endpoint.auth {
        Auth::Bearer { secret } | Auth::Header { secret, .. } => Some(get("auth.secret", secret)?),
        Auth::None | Auth::TokenFile { .. } => None,
    };
    let tls = endpoint.tls.as_ref().map(|tls| tls_material(name, tls, secrets)).transpose()?;
    Ok(Material { auth, tls })
}

/// A backend's TLS material, taken from those resolved.
fn tls_material(name: &BackendId, tls: &Tls, secrets: &Resolved) -> Result<TlsMaterial, SetupError> {
    let get = |key: &str, reference: &SecretRef| {
        secrets.get(reference).cloned().ok_or_else(|| SetupError::Secret {
            path: format!("ai.backends.{name}.{key}"),
            source: SecretError::Unavailable { reference: reference.to_string(), detail: "not resolved".into() },
        })
    };
    Ok(TlsMaterial {
        cert: get("tls.cert", &tls.cert)?,
        key: get("tls.key", &tls.key)?,
        ca: tls.ca.as_ref().map(|ca| get("tls.ca", ca)).transpose()?,
    })
}

impl OwnGrpc {
    fn new(name: &BackendId, tls: &Tls, material: TlsMaterial) -> Result<OwnGrpc, SetupError> {
        let client = Arc::new(GrpcClient::new(client_tls(name, tls, &material)?));
        Ok(OwnGrpc { client, material })
    }
}

impl Live {
    /// The clients and credential `material` makes. Connections of its own are made
    /// for new TLS material (none in `previous`, or different); otherwise `keep`
    /// serves: the shared ones at start, the backend's current ones on a refresh (its
    /// connections stay open).
    fn build(
        name: &BackendId,
        endpoint: &Endpoint,
        material: Material,
        previous: Option<&Live>,
        keep: &Transport,
        negotiated: &Arc<Negotiated>,
    ) -> Result<Live, SetupError> {
        let transport = match (&endpoint.tls, &material.tls) {
            (Some(tls), Some(pem)) if previous.is_none_or(|p| p.material.tls.as_ref() != Some(pem)) => {
                Transport::over(&client_tls(name, tls, pem)?, negotiated, keep.lanes.len())
            }
            _ => keep.clone(),
        };
        let credential = credential(name, &endpoint.auth, material.auth.as_ref())?;
        Ok(Live { transport, credential, material })
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

/// The roots a backend's certificate is checked against without a `tls.ca`.
fn public_roots() -> rustls::RootCertStore {
    rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() }
}

/// rustls on the `ring` provider, with a client certificate when `identity` is given.
fn tls_config(
    roots: rustls::RootCertStore,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<rustls::ClientConfig, rustls::Error> {
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    match identity {
        Some((certs, key)) => builder.with_client_auth_cert(certs, key),
        None => Ok(builder.with_no_client_auth()),
    }
}

/// The TLS configuration of a backend's `tls` (mTLS): its client certificate and key,
/// and its CA bundle in place of the system roots. Errors name the reference and what
/// is wrong with its PEM, never the PEM (the key is a secret).
fn client_tls(name: &BackendId, tls: &Tls, pem: &TlsMaterial) -> Result<rustls::ClientConfig, SetupError> {
    let err = |detail: String| SetupError::Tls { backend: name.clone(), detail };
    // Both read apart first, so that an error says which one is wrong.
    if !pem_holds(pem.cert.expose(), &["CERTIFICATE"]) {
        return Err(err(format!("tls.cert ({}) holds no PEM certificate", tls.cert)));
    }
    if !pem_holds(pem.key.expose(), &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"]) {
        return Err(err(format!("tls.key ({}) holds no PEM private key", tls.key)));
    }
    let pair = |detail: String| err(format!("tls.cert and tls.key ({}, {}): {detail}", tls.cert, tls.key));
    let certs = CertificateDer::pem_slice_iter(pem.cert.expose().as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pair(e.to_string()))?;
    let key = PrivateKeyDer::from_pem_slice(pem.key.expose().as_bytes()).map_err(|e| pair(e.to_string()))?;
    let roots = match (&tls.ca, &pem.ca) {
        (Some(reference), Some(ca)) => {
            let bundle = CertificateDer::pem_slice_iter(ca.expose().as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| err(format!("tls.ca ({reference}): {e}")))?;
            let mut roots = rustls::RootCertStore::empty();
            let (added, _) = roots.add_parsable_certificates(bundle);
            if added == 0 {
                return Err(err(format!("tls.ca ({reference}) holds no PEM certificate")));
            }
            roots
        }
        _ => public_roots(),
    };
    tls_config(roots, Some((certs, key))).map_err(|e| pair(e.to_string()))
}

/// Whether `pem` has a block of one of these labels (`-----BEGIN <label>-----`).
fn pem_holds(pem: &str, labels: &[&str]) -> bool {
    labels.iter().any(|label| pem.contains(&format!("-----BEGIN {label}-----")))
}

/// The header a backend's auth sends, from its secret (`None` for `none` and
/// `token_file`, which has no secret to resolve).
fn credential(name: &BackendId, auth: &Auth, secret: Option<&Secret>) -> Result<Credential, SetupError> {
    let sensitive = |value: String| {
        HeaderValue::from_str(&value)
            .map(|mut v| {
                v.set_sensitive(true);
                v
            })
            .map_err(|_| SetupError::BadCredential { backend: name.clone() })
    };
    Ok(match (auth, secret) {
        (Auth::None, _) => Credential::None,
        (Auth::TokenFile { path }, _) => Credential::TokenFile(path.clone()),
        (Auth::Bearer { .. }, Some(secret)) => {
            Credential::Header(http::header::AUTHORIZATION, sensitive(format!("Bearer {}", secret.expose()))?)
        }
        (Auth::Header { name: header, .. }, Some(secret)) => {
            let header = HeaderName::from_bytes(header.as_bytes())
                .map_err(|_| SetupError::BadCredential { backend: name.clone() })?;
            Credential::Header(header, sensitive(secret.expose().to_owned())?)
        }
        (Auth::Bearer { .. } | Auth::Header { .. }, None) => {
            return Err(SetupError::BadCredential { backend: name.clone() });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(backends: &str) -> Config {
        let yaml = format!("version: 1\nai:\n  default_backend: a\n  backends:\n{backends}");
        crate::config::load_str(&yaml, &std::collections::HashMap::<String, String>::new()).unwrap().config
    }

    #[test]
    fn outgoing_headers_are_set_as_a_header_map_sets_them() {
        let value = HeaderValue::from_static;
        let mut headers = Outgoing(Vec::new());
        headers.insert(http::header::USER_AGENT, value("flexway"));
        headers.insert(http::header::ACCEPT, value("*/*"));
        headers.0.push((HeaderName::from_static("anthropic-beta"), value("a")));
        headers.0.push((HeaderName::from_static("anthropic-beta"), value("b")));
        // A later value of a name set before replaces it (a credential, an identity
        // header), as `HeaderMap::insert` does; repeated forwarded values stay.
        headers.insert(http::header::USER_AGENT, value("relay"));
        let names: Vec<(&str, &[u8])> = headers.0.iter().map(|(n, v)| (n.as_str(), v.as_bytes())).collect();
        assert_eq!(
            names,
            [("accept", &b"*/*"[..]), ("anthropic-beta", b"a"), ("anthropic-beta", b"b"), ("user-agent", b"relay")]
        );
        let map = headers.into_map();
        assert_eq!(map.get_all("anthropic-beta").iter().count(), 2);
        assert_eq!(map["user-agent"], "relay");
    }

    #[tokio::test]
    async fn a_reload_keeps_the_connection_pools() {
        let grpc = "    g: {kind: grpc, url: 'grpcs://g.example', descriptor_set: /nonexistent/g.binpb}\n";
        let before =
            config(&format!("    a: {{url: 'http://127.0.0.1:9/v1'}}\n    b: {{url: 'https://b.example/v1'}}\n{grpc}"));
        let old = Upstreams::new(&before, &Resolved::default()).unwrap();
        let after = config(&format!(
            "    a: {{url: 'http://127.0.0.1:9/v1'}}\n    c: {{url: 'http://127.0.0.1:10/v1'}}\n{grpc}"
        ));
        let new = Upstreams::reloaded(&after, &Resolved::default(), &old).unwrap();
        assert!(new.pools.iter().zip(&old.pools).all(|(n, o)| Arc::ptr_eq(n, o)), "plain connections kept");
        assert!(new.shared.lanes.iter().zip(&old.shared.lanes).all(|(n, o)| Arc::ptr_eq(n, o)), "TLS connections kept");
        assert!(new.shared.h1.iter().zip(&old.shared.h1).all(|(n, o)| Arc::ptr_eq(n, o)), "TLS pools kept");
        let g = BackendId::new("g");
        assert!(Arc::ptr_eq(&new.grpc(&g), &old.grpc(&g)), "gRPC connections kept");
        assert!(new.get(&BackendId::new("c")).is_some() && new.get(&BackendId::new("b")).is_none());
        let fresh = Upstreams::new(&after, &Resolved::default()).unwrap();
        assert!(!Arc::ptr_eq(&fresh.pools[0], &old.pools[0]), "a start makes its own");
    }
}
