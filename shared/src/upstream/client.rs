//! One backend's client and its send paths: a JSON POST (over HTTP/1.1, or HTTP/2
//! when the backend's server chose it), a REST operation's streaming request, and a
//! connection opened ahead of the first call. Only the headers the module docs name
//! go upstream; a request is sent again only when nothing of it was sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Uri};
use http_body_util::Full;

use super::alpn::NotH2;
use super::credential::Live;
use super::headers::{Outgoing, RelayHeaders};
use super::tls::tls_failure;
use super::{Answer, AnswerBody, CallError, CallerIdentity, USER_AGENT, describe, grpc, h1};
use crate::protocol::{Wire, anthropic};
use crate::telemetry::{TraceContext, context};

/// The paths the gateway posts to: their URLs are parsed once per backend.
pub(super) const PATHS: [&str; 3] = ["/chat/completions", "/embeddings", anthropic::PATH];

pub struct UpstreamClient {
    pub(super) base: String,
    /// `base` + each of [`PATHS`], parsed.
    pub(super) urls: Vec<(&'static str, Uri)>,
    /// The format the backend speaks (`anthropic-version` goes with Anthropic's).
    pub wire: Wire,
    pub(super) live: ArcSwap<Live>,
    pub timeout: Duration,
    /// A relay's: the names it passes the caller's identity under.
    pub(super) identity_headers: Option<RelayHeaders>,
    /// The caller's headers this backend is sent (`forward_headers`).
    pub(super) forward: Vec<HeaderName>,
    /// Whether the backend's server chose `h2` at the last TLS handshake with it.
    pub(super) speaks_h2: Arc<AtomicBool>,
    /// Where the HTTP/1.1 client connects; `None` for a URL that is neither `http://`
    /// nor `https://` (an inference pool's template).
    pub(super) target: Option<h1::Target>,
    /// An inference pool's: `base` is only its target's path, and each call goes to an
    /// endpoint its picker names ([`Upstreams::at`](super::Upstreams::at)).
    pub(super) template: bool,
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
    pub(super) fn forwarded<'c>(
        &'c self,
        caller: &'c CallerIdentity,
    ) -> impl Iterator<Item = &'c (HeaderName, HeaderValue)> {
        caller.forwarded.iter().filter(|(name, _)| self.forward.contains(name))
    }
}

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
