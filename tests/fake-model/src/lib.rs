//! An OpenAI- and Anthropic-compatible fake model server for Flexway's tests
//! and README demo.
//!
//! It answers `POST /v1/chat/completions` (streamed or not), `POST
//! /v1/embeddings`, `GET /v1/models`, Anthropic's `POST /v1/messages`
//! (streamed or not) and realtime sessions (`GET /v1/realtime`, a WebSocket:
//! see [`realtime`]) deterministically, records every request it receives,
//! and misbehaves on demand: a [`Scenario`] encoded in a
//! path prefix of the backend URL (`/s/status=503,retry_after=7/v1`) injects
//! statuses (steady or flapping), delays, hangs, long or overshooting replies,
//! cut, stalled or malformed streams and bodies, endless lines, huge answers
//! or garbage. The prefix is the only channel because the gateway forwards
//! none of its caller's headers (the W3C trace context aside). Chat honours `n`
//! like OpenAI.
//!
//! `/v1/messages` validates like Anthropic (the `anthropic-version` header,
//! the Messages API's fields and no other: an OpenAI field leaking through a
//! translation is a 400) and answers in Anthropic's shapes: a `message`, or
//! its event stream from `message_start` to `message_stop`; errors, injected
//! statuses included, in Anthropic's envelope with Anthropic's error types
//! (`status=529` is `overloaded_error`). The reply is the chat's (echo or
//! `words`, cut at `max_tokens`), cut before any of its `stop_sequences`;
//! the scenario keys `tool_use` and `error_after` are for it alone,
//! and usage is always sent (`no_usage` does not apply). An Anthropic backend
//! is configured with the base URL without `/v1`: [`FakeModel::anthropic_url`].
//!
//! `/v1/embeddings` answers eight numbers per input that only tell equal texts
//! apart, except for a model whose name contains `similar` (`fake-embed-similar`):
//! 256 numbers that put texts of similar spelling close ([`similar`]), for the
//! response cache's semantic mode. Usage counts words either way.
//!
//! With a [`Capacity`] ([`FakeModel::start_with`]) it stands for a model server
//! under load: calls wait for one of its slots, and `GET /metrics` shows its
//! queue as vLLM does ([`load`]).
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use fake_model::{FakeModel, Scenario};
//! let fake = FakeModel::start().await?;
//! let healthy = fake.url(); // http://127.0.0.1:PORT/v1
//! let failing = fake.scenario_url(&Scenario { status: Some(503), ..Default::default() });
//! let anthropic = fake.base_url(); // http://127.0.0.1:PORT, + /v1/messages
//! let overloaded = fake.anthropic_url(&Scenario { status: Some(529), ..Default::default() });
//! # Ok(()) }
//! ```

mod anthropic;
pub mod load;
mod openai;
pub mod realtime;
mod scenario;
mod server;
pub mod similar;

use axum::serve::ListenerExt;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use tokio::net::TcpSocket;

pub use load::Capacity;
pub use scenario::{Scenario, ScenarioError};
use server::Shared;

/// One request as the fake received it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    pub method: String,
    /// The path after the scenario prefix, e.g. `/v1/chat/completions` or
    /// `/v1/messages`.
    pub path: String,
    /// Every header, names lower-cased, in the order received.
    pub headers: Vec<(String, String)>,
    /// The body as JSON; `Null` when empty or not JSON.
    pub body: serde_json::Value,
}

impl RecordedRequest {
    /// The first value of a header, by its lower-case name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// A running fake server. It serves in a tokio task until dropped; on drop
/// it stops accepting and releases hanging requests.
pub struct FakeModel {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FakeModel {
    /// Serve on a free loopback port.
    pub async fn start() -> std::io::Result<FakeModel> {
        Self::start_on(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await
    }

    /// Serve on `addr` (port 0 picks a free port).
    pub async fn start_on(addr: SocketAddr) -> std::io::Result<FakeModel> {
        Self::start_with(addr, None).await
    }

    /// Serve on `addr` as a model server of `capacity`: calls beyond its slots
    /// wait in its queue, and `GET /metrics` shows it (see [`load`]).
    pub async fn start_with(addr: SocketAddr, capacity: Option<Capacity>) -> std::io::Result<FakeModel> {
        // A long accept queue: a gateway opening thousands of upstream connections at
        // once (the streams bench) would overflow tokio's default of 1,024 and wait
        // for SYN retries (1, 3, 7, 15, 31 s), which is this server's limit, not the
        // gateway's. The kernel caps it at `net.core.somaxconn`.
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        let listener = socket.listen(16_384)?;
        let addr = listener.local_addr()?;
        // Small SSE frames must leave at once, not wait for Nagle.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let shared = Shared::new(capacity);
        let app = app(Arc::clone(&shared));
        let stopping = Arc::clone(&shared);
        tokio::spawn(async move {
            let stop = async move { stopping.wait_for_shutdown().await };
            // Serving only ends on shutdown, when nobody is left to tell.
            let _ = axum::serve(listener, app).with_graceful_shutdown(stop).await;
        });
        Ok(FakeModel { addr, shared })
    }

    /// The address actually bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The OpenAI base URL of well-behaved answers: `http://ADDR/v1`.
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The OpenAI base URL that behaves as `scenario` says:
    /// `http://ADDR/s/<scenario>/v1` (plain [`FakeModel::url`] for the default).
    pub fn scenario_url(&self, scenario: &Scenario) -> String {
        match scenario.to_string() {
            encoded if encoded.is_empty() => self.url(),
            encoded => format!("http://{}/s/{encoded}/v1", self.addr),
        }
    }

    /// Its vLLM-style load page: `http://ADDR/metrics`.
    pub fn metrics_url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }

    /// The server's base URL, without `/v1`: `http://ADDR`. An Anthropic
    /// backend's `url` is this, the client appending `/v1/messages`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The Anthropic base URL (no `/v1`) that behaves as `scenario` says:
    /// `http://ADDR/s/<scenario>` (plain [`FakeModel::base_url`] for the
    /// default).
    pub fn anthropic_url(&self, scenario: &Scenario) -> String {
        match scenario.to_string() {
            encoded if encoded.is_empty() => self.base_url(),
            encoded => format!("http://{}/s/{encoded}", self.addr),
        }
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.recorded()
    }

    /// How many requests were received so far.
    pub fn request_count(&self) -> usize {
        self.shared.recorded_count()
    }
}

impl Drop for FakeModel {
    fn drop(&mut self) {
        self.shared.shut_down();
    }
}

/// The fake's HTTP surface, with its own (unobservable) request record; for
/// mounting in another server or driving with `tower::ServiceExt::oneshot`.
pub fn router() -> Router {
    app(Shared::new(None))
}

fn app(shared: Arc<Shared>) -> Router {
    Router::new().fallback(server::handle).with_state(shared)
}
