//! The HTTP surface (SPEC §2), built once for both shapes: `flexway serve` runs it
//! with `axum::serve`, the Lambda function with `lambda_http`'s streaming runner.

mod admit;
mod byte_relay;
pub mod cache;
mod chain;
mod console;
mod dispatch;
mod drive;
mod error;
mod format;
mod forward;
pub mod grpc;
mod mcp;
mod models;
mod named;
mod realtime;
mod record;
mod relay;
mod reload;
mod rest;
mod runs;
mod slot;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{HeaderMap, HeaderValue, Method, Uri};
use serde_json::json;
use tower::util::MapRequestLayer;

pub use error::{ApiError, Envelope, render, render_in};

use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::protocol::openai::model_list;

pub use crate::call::RequestId;
pub use crate::call::headers::REQUEST_ID as REQUEST_ID_HEADER;

/// When the platform ends the call, if it does (a Lambda function's deadline): a
/// request extension the serverless binary sets. A stream still open a margin before
/// it ends for its client with the in-band `deadline` error, settled on what was
/// relayed and recorded (SPEC §11), instead of being cut by the platform with nothing
/// settled. The margin is [`DEADLINE_MARGIN`], or a tenth of the time the call had
/// when it arrived if that is shorter (a function whose timeout is a few seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    at: std::time::Instant,
    margin: std::time::Duration,
}

/// Time kept before a [`Deadline`] to settle the call and write its record.
pub const DEADLINE_MARGIN: std::time::Duration = std::time::Duration::from_secs(3);

impl Deadline {
    /// A deadline `left` from now.
    pub fn within(left: std::time::Duration) -> Deadline {
        Deadline { at: std::time::Instant::now() + left, margin: DEADLINE_MARGIN.min(left / 10) }
    }

    /// The deadline given in milliseconds since the Unix epoch (as Lambda's context
    /// gives it), on this process's monotonic clock; `None` for one that is not in the
    /// future, which no invocation being served can have (`cargo lambda watch` sends
    /// its timeout, `600000`, where Lambda sends the instant).
    pub fn from_unix_millis(deadline_ms: u64) -> Option<Deadline> {
        let now_ms = crate::budget::period::unix_now_millis();
        let left = deadline_ms.checked_sub(now_ms).filter(|left| *left > 0)?;
        Some(Deadline::within(std::time::Duration::from_millis(left)))
    }

    /// When a stream must end: the margin before the deadline.
    pub fn cutoff(self) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.at.checked_sub(self.margin).unwrap_or(self.at))
    }
}

/// `future`'s output, unless `cutoff` (a [`Deadline::cutoff`]) comes first: `None`
/// then. No cutoff (the local shape), no limit. A future of its own rather than an
/// `async fn`, which held `future` and moved it again to await it: 300 instructions
/// a 12-event stream more when the chat relay called it (benches/instructions).
pub(super) fn before<F: std::future::Future>(cutoff: Option<tokio::time::Instant>, future: F) -> Before<F> {
    match cutoff {
        None => Before::Unlimited { future },
        Some(at) => Before::Until { timeout: tokio::time::timeout_at(at, future) },
    }
}

pin_project_lite::pin_project! {
    /// A future's output, or `None` at a cutoff ([`before`]).
    #[project = BeforeProjection]
    pub(super) enum Before<F> {
        Unlimited { #[pin] future: F },
        Until { #[pin] timeout: tokio::time::Timeout<F> },
    }
}

impl<F: std::future::Future> std::future::Future for Before<F> {
    type Output = Option<F::Output>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        match self.project() {
            BeforeProjection::Unlimited { future } => future.poll(cx).map(Some),
            BeforeProjection::Until { timeout } => timeout.poll(cx).map(Result::ok),
        }
    }
}

pub use reload::{Current, Reloadable};

/// The local shape's surface: the API plus `GET /metrics` (Prometheus).
pub fn app(gateway: Arc<Gateway>) -> Router {
    let routes = api_routes().route("/v1/realtime", get(realtime::session)).route("/metrics", get(metrics));
    finish(routes.merge(console::routes()), gateway)
}

/// The serverless shape's surface: the API only (metrics leave as CloudWatch EMF).
/// Secrets are refreshed when a request finds them due, beside it
/// ([`Gateway::refresh_secrets_if_due`]): no timer runs between invocations. (A
/// `map_request` layer: `middleware::from_fn` would box the inner service and its
/// future on every request.)
pub fn api(gateway: Arc<Gateway>) -> Router {
    let routes = api_routes().route("/v1/realtime", get(realtime_unavailable));
    let refreshing = gateway.clone();
    let refresh = MapRequestLayer::new(move |request: Request| {
        refreshing.refresh_secrets_if_due();
        request
    });
    finish(routes.layer(refresh), gateway)
}

/// The serverless shape's answer to `GET /v1/realtime`: a function URL cannot hold a
/// WebSocket, said plainly (501 `realtime_unavailable`), before anything else.
async fn realtime_unavailable() -> Response {
    render(&GatewayError::RealtimeUnavailable, true)
}

fn api_routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/v1/chat/completions", post(models::chat_completions))
        .route("/v1/responses", post(models::responses))
        .route("/v1/messages", post(models::messages))
        .route("/v1/messages/count_tokens", post(models::count_tokens))
        .route("/v1/embeddings", post(models::embeddings))
        .route("/v1/models", get(models))
        .route("/healthz", get(healthz))
        .merge(runs::routes())
        .merge(mcp::routes())
}

fn finish(routes: Router<Arc<Gateway>>, gateway: Arc<Gateway>) -> Router {
    routes
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(named::NameRequests)
        .with_state(gateway)
}

async fn metrics(State(gateway): State<Arc<Gateway>>) -> Response {
    let now = std::time::Instant::now();
    for (backend, state) in gateway.breakers.states(now) {
        gateway.metrics.set_breaker_state(backend.as_str(), state);
    }
    gateway.metrics.set_realtime_open(gateway.sessions.count());
    // The cache's entries, counted by its store at most once a minute.
    crate::console::count_cache_entries(&gateway, crate::budget::period::unix_now()).await;
    for (backend, seen) in gateway.router.loads.snapshot() {
        let sample = seen.sample.map(|s| (s.waiting, f64::from(s.kv_ppm) / 1e6));
        gateway.metrics.set_member_load(backend.as_str(), sample, seen.in_flight);
    }
    let mut text = gateway.metrics.render_prometheus();
    gateway.telemetry.render_prometheus(&mut text);
    let mut response = text.into_response();
    response.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}

/// The request headers the gateway reads: in bytes, names and values summed (SDKs
/// send a few hundred), and in number, a repeated name counted each time (hyper's
/// own default count). Checked in the request-id layer so that both shapes refuse
/// with the documented envelope and a request id; the local shape's transport
/// ceilings sit above these (`flexway serve`), so that this check answers first.
pub const MAX_HEADER_BYTES: usize = 32 * 1024;
pub const MAX_HEADERS: usize = 100;

fn headers_too_large(headers: &HeaderMap) -> bool {
    headers.len() > MAX_HEADERS
        || headers.iter().map(|(name, value)| name.as_str().len() + value.len()).sum::<usize>() > MAX_HEADER_BYTES
}

async fn healthz(State(gateway): State<Arc<Gateway>>) -> Response {
    let body = json!({
        "status": "ok",
        "version": env!("CARGO_PKG_VERSION"),
        "backends": gateway.config.ai.backends.len(),
        "tenants": gateway.config.tenants.len(),
        "config_sha256": gateway.config.sha256,
    });
    Json(body).into_response()
}

async fn models(State(gateway): State<Arc<Gateway>>, headers: HeaderMap) -> Result<Response, ApiError> {
    let caller = gateway.keys.authenticate(&headers)?;
    let names = gateway.router.reachable_models(&caller);
    Ok(Json(model_list(names.iter().map(String::as_str))).into_response())
}

/// The envelope of errors on a path: Anthropic's on the Messages door (SPEC §2.2),
/// OpenAI's elsewhere under `/v1`, problem details everywhere else.
fn envelope_for(uri: &Uri) -> Envelope {
    let path = uri.path();
    if path == "/v1/messages" || path.starts_with("/v1/messages/") {
        Envelope::Anthropic
    } else if path == "/v1" || path.starts_with("/v1/") {
        Envelope::OpenAi
    } else {
        Envelope::Problem
    }
}

/// gRPC calls (`/package.Service/Method`, `application/grpc*`) go to the gRPC proxy,
/// paths under a REST mount to its backend's contract; anything else unrouted is a 404.
async fn fallback(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    if grpc::is_grpc(request.headers()) {
        return grpc::handle(gateway, request).await;
    }
    if let Some((owner, below)) = rest::mounted(&gateway, request.uri().path()) {
        let below = below.to_owned();
        return rest::handle(gateway.clone(), request, owner, below).await;
    }
    not_found(request.method().clone(), request.uri().clone()).await
}

async fn not_found(method: Method, uri: Uri) -> Response {
    let error = GatewayError::NotFound { method: method.to_string(), path: uri.path().to_owned() };
    render_in(&error, envelope_for(&uri))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let error = GatewayError::MethodNotAllowed { method: method.to_string(), path: uri.path().to_owned() };
    render_in(&error, envelope_for(&uri))
}

/// What the `http` module's unit tests share.
#[cfg(test)]
mod testing {
    use std::sync::Arc;

    use crate::audit::sinks::MemoryAuditSink;
    use crate::gateway::Gateway;

    /// A gateway with backends `a` (its breaker trips on one failure), `b`, `c` and
    /// `elsewhere` (none listening), the key `k` for tenant `acme`, and its audit.
    pub async fn gateway() -> (Arc<Gateway>, Arc<MemoryAuditSink>) {
        let audit = Arc::new(MemoryAuditSink::new());
        (gateway_writing_to(audit.clone()).await, audit)
    }

    /// The same gateway, its audit written to `audit`.
    pub async fn gateway_writing_to(audit: Arc<dyn crate::audit::AuditSink>) -> Arc<Gateway> {
        use sha2::Digest;
        let yaml = format!(
            "version: 1\ntenants:\n  acme:\n    keys: [{{sha256: {}}}]\nai:\n  default_backend: a\n  backends:\n    \
             a: {{url: 'http://127.0.0.1:9/v1', circuit_breaker: {{failures: 1, trip: 60s}}}}\n    \
             b: {{url: 'http://127.0.0.1:9/v1'}}\n    c: {{url: 'http://127.0.0.1:9/v1'}}\n    \
             elsewhere: {{url: 'http://127.0.0.1:9/v1'}}\n",
            hex::encode(sha2::Sha256::digest(b"k"))
        );
        let env = std::collections::HashMap::<String, String>::new();
        let loaded = crate::config::load_str(&yaml, &env).unwrap();
        let adapters = crate::gateway::Adapters {
            budgets: Arc::new(crate::budget::MemoryBudgetStore::new()),
            audit,
            export: crate::telemetry::Export::Batched,
            cache: None,
        };
        let secrets = Arc::new(crate::secret::LocalSecrets { env });
        Arc::new(Gateway::new(loaded.config, secrets, adapters).await.unwrap())
    }
}

#[cfg(test)]
mod deadline_tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_deadline_keeps_three_seconds_or_a_tenth_of_the_time_left() {
        let now_ms = crate::budget::period::unix_now_millis();
        let cutoff_in = |left_ms: u64| {
            let deadline = Deadline::from_unix_millis(now_ms + left_ms).unwrap();
            deadline.cutoff().saturating_duration_since(tokio::time::Instant::now())
        };
        let long = cutoff_in(900_000);
        assert!(long > Duration::from_secs(896) && long <= Duration::from_secs(897), "{long:?}");
        let short = cutoff_in(2_000);
        assert!(short > Duration::from_millis(1_700) && short <= Duration::from_millis(1_800), "{short:?}");
    }

    #[test]
    fn a_deadline_that_is_not_in_the_future_is_none() {
        assert_eq!(Deadline::from_unix_millis(600_000), None, "cargo lambda watch's timeout, not an instant");
        assert_eq!(Deadline::from_unix_millis(crate::budget::period::unix_now_millis().saturating_sub(1)), None);
    }
}
