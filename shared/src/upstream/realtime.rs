//! The gateway's own WebSocket to a realtime backend (SPEC §2.3): `{url}/realtime?
//! model=M` over `ws`/`wss`, with the backend's credential and the call's trace
//! context, and nothing of the caller's request (its key least of all) but the
//! headers the backend names in `forward_headers`. TLS is
//! rustls on the `ring` provider with the webpki roots, as for HTTP calls; a backend
//! with `tls` (mTLS) is refused at load for realtime.
//!
//! Memory per session is bounded on this side by `max_message` (one message, one
//! frame) and by small read and write buffers: a session holds at most one message
//! of each direction at a time.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::{Connector, MaybeTlsStream, WebSocketStream, tungstenite};

use super::{CallError, CallerIdentity, UpstreamClient};
use crate::telemetry::{TraceContext, context};

/// A realtime session's connection to its backend.
pub type Upstream = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Read and write buffers of one WebSocket: 16 KiB (tungstenite's default, 128 KiB,
/// would hold half a megabyte per session for nothing: realtime events are small).
pub const BUFFER_BYTES: usize = 16 * 1024;

/// Why a backend did not open the session.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Call(#[from] CallError),
    /// It answered the handshake with a status of its own, not `101`.
    #[error("the backend answered {status} to the WebSocket handshake")]
    Status { status: StatusCode, body: Bytes },
}

impl UpstreamClient {
    /// Opens the backend's realtime session for `model`, within the backend's
    /// `timeout`. `max_message` bounds each message (and frame) read from it.
    pub async fn connect_realtime(
        &self,
        model: &str,
        trace: &TraceContext,
        caller: &CallerIdentity,
        max_message: usize,
    ) -> Result<Upstream, ConnectError> {
        let mut url = reqwest::Url::parse(&format!("{}/realtime", self.base))
            .map_err(|e| CallError::Connect(format!("the backend url cannot carry a WebSocket: {e}")))?;
        let scheme = if url.scheme() == "https" { "wss" } else { "ws" };
        url.set_scheme(scheme).map_err(|()| CallError::Connect("the backend url cannot carry a WebSocket".into()))?;
        url.query_pairs_mut().append_pair("model", model);
        let mut request = url.as_str().into_client_request().map_err(|e| CallError::Connect(e.to_string()))?;
        let headers = request.headers_mut();
        headers.insert(http::header::USER_AGENT, HeaderValue::from_static(super::USER_AGENT));
        if let Some((traceparent, state)) = trace.upstream() {
            headers.insert(context::TRACEPARENT, traceparent);
            if let Some(state) = state {
                headers.insert(context::TRACESTATE, state);
            }
        }
        for (name, value) in self.forwarded(caller) {
            headers.append(name.clone(), value.clone());
        }
        if let Some((name, value)) = self.live.load().credential.header()? {
            headers.insert(name, value);
        }
        let config = WebSocketConfig::default()
            .read_buffer_size(BUFFER_BYTES)
            .write_buffer_size(BUFFER_BYTES)
            .max_message_size(Some(max_message))
            .max_frame_size(Some(max_message));
        let connector = Connector::Rustls(tls_config()?);
        let connecting = tokio_tungstenite::connect_async_tls_with_config(request, Some(config), true, Some(connector));
        match tokio::time::timeout(self.timeout, connecting).await {
            Err(_) => Err(CallError::Timeout(self.timeout).into()),
            Ok(Ok((upstream, _))) => Ok(upstream),
            Ok(Err(tungstenite::Error::Http(response))) => {
                let status = response.status();
                let body = response.into_body().map(Bytes::from).unwrap_or_default();
                Err(ConnectError::Status { status, body })
            }
            Ok(Err(tungstenite::Error::Tls(e))) => Err(CallError::Tls(e.to_string()).into()),
            Ok(Err(e)) => Err(CallError::Connect(e.to_string()).into()),
        }
    }
}

/// One TLS configuration for every realtime backend: `ring`, the webpki roots.
fn tls_config() -> Result<Arc<rustls::ClientConfig>, CallError> {
    static CONFIG: OnceLock<Result<Arc<rustls::ClientConfig>, String>> = OnceLock::new();
    let config =
        CONFIG.get_or_init(|| super::tls_config(super::public_roots(), None).map(Arc::new).map_err(|e| e.to_string()));
    config.clone().map_err(CallError::Tls)
}
