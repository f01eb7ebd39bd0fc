//! REST operations through the gateway (SPEC §10): a `kind: http` backend's contract
//! served under its mount. The phases are those of every call: authenticate → match
//! the operation (the contract is the allow-list: 404 `operation_not_found`, 405
//! `method_not_allowed` with `Allow`) → route (the mount's backend, then the other
//! `http` backends that declare the same operation metered the same way; internal
//! ones only for a sensitive call) → reserve → forward, bodies streaming both ways →
//! settle → record (`operation: http`).
//!
//! Metering is the gRPC methods' ([`super::meter`]): per call, charged when the
//! upstream answered 2xx or 3xx; per byte, the request's and the response's body
//! bytes, the request's `Content-Length` (when sent) and an allowance reserved ahead
//! and a step reserved before any chunk that would pass the reservations, so the cap
//! is never passed (a step refused ends the call: the request is cut, or the response
//! ends short). A 4xx is relayed as it came, and nothing is charged; a 5xx or a
//! connection error before the answer goes to the next backend when the request body
//! was not taken yet (always for a request without a body), and is refunded. An
//! operation without `x-flexway-ai` costs nothing, and still counts in its caller's
//! request windows and its run's calls.
//!
//! An operation whose `x-flexway-ai` names a cache policy (SPEC §16, exact, GET and
//! POST) is looked up after its reservation: the key is its method, its path and query
//! below the mount and its body, read whole first up to the policy's
//! `max_entry_bytes` (a longer one is a bypass, and goes upstream as it came). A hit
//! is the stored status, `Content-Type` and body, charged what the policy's `charge`
//! says; a miss's 2xx answer is read for the cache as it is relayed, and kept at the
//! end if it ended whole within that size.
//!
//! Invariants: one audit record per identified call, written when the answer ends or
//! is dropped; nothing is buffered beyond one chunk (but a cached operation's request
//! body and its answer, each up to the policy's `max_entry_bytes`); nothing the
//! contract does not declare is forwarded; the caller's credentials and Flexway's own
//! headers never reach the upstream.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, Method, header};
use http_body_util::BodyExt;
use hyper::body::Frame;

use super::Deadline;
use super::admit::sensitive_and_residency;
use super::admit::{Metered, reserve};
use super::byte_relay::{self, Next, Open, Read, Relayed};
use super::cache::{self, Capture, Looked, Pending, RestView};
use super::chain::{self, Answered, Failure};
use super::drive::{self, Call, Reply, drive};
use super::drive::{Charge, Ended, Ending, Spent};
use super::forward::{returned_headers, upstream_headers};
use super::models::answer_headers;
use super::record::Draft;
use super::render;
use super::slot::{Frames, Slot};
use crate::call::{ErrorCode, Operation};
use crate::config::contract::{Matched, RestOperation};
use crate::config::{BackendId, BackendKind, Capability};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::metering::{MAX_MESSAGE_BYTES, Meter, Stop};
use crate::routing::breaker::{Outcome, Pass};
use crate::routing::{Candidate, Declared};
use crate::upstream::grpc::{BoxError, UpstreamBody};

/// The `kind: http` backend whose mount holds `path`, and the path below the mount.
pub(super) fn mounted<'a>(gateway: &'a Gateway, path: &'a str) -> Option<(BackendId, &'a str)> {
    gateway.config.ai.backends.iter().find_map(|(name, backend)| match &backend.kind {
        BackendKind::Http { mount, .. } => {
            let below = path.strip_prefix(mount.as_str())?;
            (below.is_empty() || below.starts_with('/')).then(|| (name.clone(), below))
        }
        _ => None,
    })
}

pub(super) async fn handle(gateway: Arc<Gateway>, request: Request, owner: BackendId, below: String) -> Response {
    drive(gateway, Rest { owner, below }, request).await
}

/// The REST door: a path under the mount of the backend that owns it.
struct Rest {
    owner: BackendId,
    /// The path below the mount.
    below: String,
}

impl drive::Door for Rest {
    type Refusal = GatewayError;

    fn operation(&self) -> Operation {
        Operation::Http
    }

    fn identify(&self, gateway: &Gateway, headers: &HeaderMap) -> Result<Caller, GatewayError> {
        Ok(gateway.keys.authenticate(headers)?)
    }

    async fn call(
        &mut self,
        call: Call<'_>,
        draft: &mut Draft,
        charge: &mut Charge,
        request: Request,
    ) -> Result<Reply, GatewayError> {
        proxied(call, draft, charge, &self.owner, &self.below, request).await
    }

    fn refuse(&self, error: &GatewayError) -> Response {
        render(error, false)
    }
}

/// An answered call, and what relays its body.
struct Proxied {
    response: crate::upstream::Answer,
    relay: Relay,
}

impl drive::Relay for Proxied {
    fn respond(self: Box<Self>, ending: Ending, deadline: Option<Deadline>) -> Response {
        let Proxied { response, relay } = *self;
        relay.respond(response, ending, deadline.map(|d| d.cutoff()))
    }
}

fn stopped(stop: Stop) -> GatewayError {
    match stop {
        Stop::Budget(error) => error,
        Stop::TooLarge(bytes) => GatewayError::Internal(format!("a chunk of {bytes} bytes passed the chunk bound")),
    }
}

pub(super) async fn proxied(
    call: Call<'_>,
    draft: &mut Draft,
    charge: &mut Charge,
    owner: &BackendId,
    below: &str,
    request: Request,
) -> Result<Reply, GatewayError> {
    let Call { gateway, caller, request_id, run } = call;
    let (parts, body) = request.into_parts();
    let operation = operation(gateway, owner, &parts.method, below)?;
    let model = format!("{} {}", operation.method, operation.path);
    draft.request(Capability::Http, &model, None);
    if let Some(ai) = &operation.ai {
        draft.feature(&ai.feature);
    }
    let (sensitive, residency) = sensitive_and_residency(gateway, caller, &parts.headers, draft)?;
    let declared = Declared::Rest { owner, operation: &operation };
    let route = gateway.router.route_operation(declared, sensitive, &residency)?.ok_or_else(|| {
        GatewayError::Internal(format!("backend {owner}'s contract does not declare its own operation"))
    })?;
    let path_and_query = match parts.uri.query() {
        Some(query) => format!("{below}?{query}"),
        None => below.to_owned(),
    };

    // The response cache's part: the body read whole first, when an entry may hold it.
    let policy = operation.ai.as_ref().and_then(|ai| ai.cache.as_deref());
    let cached = policy.and_then(|name| Some((name, gateway.config.ai.cache.as_ref()?.policies.get(name)?)));
    let (body, ask) = match cached {
        Some((name, policy)) => {
            let (body, whole) = read_for_cache(body, &parts.headers, policy.max_entry_bytes).await?;
            // The partition's "model": the operation, and whose mount it is under (two
            // mounts may declare the same template).
            let model = format!("{owner} {model}");
            let view = RestView {
                model: &model,
                method: &parts.method,
                path_and_query: &path_and_query,
                body: whole.as_deref(),
            };
            (body, cache::ask_rest(gateway, caller, &parts.headers, sensitive, name, view, draft))
        }
        None => (body, None),
    };

    // Reserve: a per-byte call's request is as long as it says, when it says.
    let timeouts = route.candidates.iter().map(|c| gateway.timeout(&c.backend)).sum();
    let meter =
        Arc::new(Meter::new(gateway.clone(), caller.clone(), run.cloned(), request_id, operation.ai.clone(), timeouts));
    // A body's length: its header, or what the body itself knows (a Lambda event's
    // body is whole, and comes without the header).
    let length = content_length(&parts.headers).or_else(|| hyper::body::Body::size_hint(&body).exact());
    reserve(call, draft, charge, Metered { meter: meter.clone(), bytes: length.unwrap_or(0) }).await?;
    let mut pending = None;
    if let Some(ask) = ask {
        match Box::pin(cache::lookup_rest(call, draft, &parts.headers, ask, &residency)).await {
            Looked::Hit(response, ended) => return Ok(Reply::Now(response, ended)),
            Looked::Miss(miss) => pending = miss,
        }
    }

    let bodyless = length == Some(0) || hyper::body::Body::is_end_stream(&body);
    let slot = Slot::new(RequestBody { body, meter: meter.clone() });
    let headers = upstream_headers(&parts.headers, &gateway.config.ai.sensitive_header, draft.trace());
    let door = SendOperation {
        gateway,
        method: &parts.method,
        path_and_query: &path_and_query,
        headers: &headers,
        slot,
        bodyless,
        model,
    };
    let served = match chain::attempt_chain(gateway, draft, charge, &route, &door).await {
        Ok(served) => served,
        // A budget step refused while the request went out is why the call ended.
        Err(e) => return Err(meter.stop().map_or(e, stopped)),
    };
    draft.first_byte();
    let relay = Relay { candidate: served.candidate, pass: served.pass, meter, pending };
    Ok(Reply::Relay(Box::new(Proxied { response: served.value, relay })))
}

/// The request's body, and its bytes when it came whole within `limit` (what the cache
/// key reads); otherwise the body as it came (what was read of it first, then the
/// rest), so that the upstream gets the same bytes.
async fn read_for_cache(body: Body, headers: &HeaderMap, limit: u64) -> Result<(Body, Option<Bytes>), GatewayError> {
    if hyper::body::Body::is_end_stream(&body) {
        return Ok((body, Some(Bytes::new())));
    }
    if content_length(headers).or_else(|| hyper::body::Body::size_hint(&body).exact()).is_some_and(|n| n > limit) {
        return Ok((body, None));
    }
    let mut body = body;
    let mut read: Vec<Frame<Bytes>> = Vec::new();
    let mut bytes = 0u64;
    let mut whole = true;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            GatewayError::from(crate::call::InvalidRequest::message(format!("could not read the request body: {e}")))
        })?;
        match frame.data_ref() {
            Some(data) => bytes += data.len() as u64,
            // Trailers: the request is relayed as it came, not cached.
            None => whole = false,
        }
        read.push(frame);
        if bytes > limit || !whole {
            whole = false;
            break;
        }
    }
    if whole {
        let mut all = bytes::BytesMut::with_capacity(usize::try_from(bytes).unwrap_or(0));
        for frame in read {
            if let Ok(data) = frame.into_data() {
                all.extend_from_slice(&data);
            }
        }
        let all = all.freeze();
        return Ok((Body::from(all.clone()), Some(all)));
    }
    let rest = http_body_util::BodyStream::new(body);
    let frames = futures_util::StreamExt::chain(futures_util::stream::iter(read.into_iter().map(Ok)), rest);
    Ok((Body::new(http_body_util::StreamBody::new(frames)), None))
}

/// The operation `method below` calls in the owner's contract, or the refusal.
fn operation(
    gateway: &Gateway,
    owner: &BackendId,
    method: &Method,
    below: &str,
) -> Result<RestOperation, GatewayError> {
    let Some(BackendKind::Http { contract, mount, .. }) = gateway.config.ai.backends.get(owner).map(|b| &b.kind) else {
        return Err(GatewayError::Internal(format!("backend {owner} is not a kind http backend")));
    };
    let path = format!("{mount}{below}");
    match contract.find(method, below) {
        Matched::Operation(operation) => Ok(operation.clone()),
        Matched::NotFound => {
            Err(GatewayError::OperationNotFound { method: method.to_string(), path, backend: owner.clone() })
        }
        Matched::MethodNotAllowed(allow) => Err(GatewayError::OperationMethodNotAllowed {
            method: method.to_string(),
            path,
            backend: owner.clone(),
            allow: allow.iter().map(Method::as_str).collect::<Vec<_>>().join(", "),
        }),
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// The REST door's attempt: the operation sent to one upstream.
struct SendOperation<'a> {
    gateway: &'a Gateway,
    method: &'a Method,
    path_and_query: &'a str,
    headers: &'a HeaderMap,
    slot: Slot<RequestBody>,
    /// A request without a body goes again to a fallback whatever the first did.
    bodyless: bool,
    model: String,
}

impl chain::Attempt for SendOperation<'_> {
    type Target = BackendId;
    type Prepared = ();
    type Answer = crate::upstream::Answer;

    fn reach(&self, backend: &BackendId) -> Option<(BackendId, Duration)> {
        let http =
            matches!(self.gateway.config.ai.backends.get(backend).map(|b| &b.kind), Some(BackendKind::Http { .. }));
        http.then(|| (backend.clone(), self.gateway.timeout(backend)))
    }

    fn prepare(&self, _: &BackendId) -> Result<(String, ()), GatewayError> {
        Ok((self.model.clone(), ()))
    }

    async fn attempt(&self, backend: &BackendId, (): (), _: &Draft) -> Result<Answered<Self::Answer>, Failure> {
        let Some(client) = self.gateway.upstreams.get(backend) else {
            let detail = format!("backend {backend} has no client");
            return Err(Failure::Head(crate::upstream::CallError::Connect(detail)));
        };
        // Once the upstream took part of the body, the call cannot go elsewhere.
        let failed = |failure: Failure| {
            if self.bodyless || self.slot.reclaim() { failure } else { Failure::AfterSend(Box::new(failure)) }
        };
        let body: UpstreamBody = if self.bodyless {
            http_body_util::Empty::new().map_err(|never| match never {}).boxed_unsync()
        } else {
            self.slot.body()
        };
        let sent = client.send_streaming(self.method.clone(), self.path_and_query, self.headers.clone(), body).await;
        match sent {
            Err(e) => Err(failed(Failure::Head(e))),
            Ok(answer) if answer.status().is_server_error() => {
                Err(failed(Failure::Status { status: answer.status().as_u16(), retry_after: None }))
            }
            // The breaker hears of it when the answer ends (`Relaying`).
            Ok(answer) => Ok(Answered { value: answer, outcome: None }),
        }
    }
}

/// The caller's request body on its way upstream, chunk by chunk, metered per byte.
struct RequestBody {
    body: Body,
    meter: Arc<Meter>,
}

impl Frames for RequestBody {
    fn frames(self) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> + Send + 'static {
        futures_util::stream::try_unfold(self, |mut this| async move {
            let Some(frame) = this.body.frame().await else { return Ok(None) };
            let frame = frame.map_err(|e| Box::new(e) as BoxError)?;
            if let Some(data) = frame.data_ref() {
                let bytes = data.len() as u64;
                // A body that came whole (a Lambda event's) is admitted a bounded
                // piece at a time.
                let mut left = bytes;
                while left > 0 {
                    let piece = left.min(MAX_MESSAGE_BYTES);
                    if !this.meter.admit(piece).await {
                        return Err(BoxError::from("the call was refused a budget step"));
                    }
                    left -= piece;
                }
                this.meter.passed(bytes).await;
            }
            Ok(Some((frame, this)))
        })
    }
}

/// What relays the answer's body: metering, the breaker's outcome, the record.
struct Relay {
    candidate: Candidate,
    pass: Pass,
    meter: Arc<Meter>,
    /// Where the response cache keeps the answer, when the call missed it.
    pending: Option<Box<Pending>>,
}

impl Relay {
    fn respond(
        self,
        upstream: crate::upstream::Answer,
        ending: Ending,
        cutoff: Option<tokio::time::Instant>,
    ) -> Response {
        let (parts, body) = upstream.into_parts();
        let mut response = Response::new(Body::empty());
        *response.status_mut() = parts.status;
        returned_headers(&parts.headers, response.headers_mut());
        for (name, value) in answer_headers(&self.candidate, false) {
            response.headers_mut().insert(name, value);
        }
        let status = parts.status.as_u16();
        let backend = self.candidate.backend;
        let capture = self.pending.and_then(|p| Capture::new(p, backend, status, &parts.headers)).map(Box::new);
        let relaying = Relaying {
            status,
            served: (200..400).contains(&status),
            meter: self.meter,
            pass: Some(self.pass),
            capture,
        };
        byte_relay::relay(relaying, body, ending, cutoff, response)
    }
}

/// What a REST answer's chunks mean: metered on the way when it served the call; the
/// call ends when its body does, or when the client leaves (499
/// `client_closed_request`).
struct Relaying {
    status: u16,
    /// 2xx or 3xx: what is charged.
    served: bool,
    meter: Arc<Meter>,
    pass: Option<Pass>,
    /// The answer as the client got it, for the response cache (a miss's 2xx answer,
    /// until it passes what an entry may hold).
    capture: Option<Box<Capture>>,
}

impl byte_relay::Answer for Relaying {
    async fn next(&mut self, open: &mut Open, read: Read) -> Next {
        let frame = match read {
            Read::Frame(frame) => frame,
            Read::End => {
                self.finish(open, Outcome::Status { status: self.status, retry_after: None }, None).await;
                return Next::Ended;
            }
            Read::Deadline => {
                tracing::warn!("REST answer still open at the invocation's deadline: ended");
                self.finish(open, Outcome::Success, Some(ErrorCode::Deadline)).await;
                return Next::Send(Err(BoxError::from("the invocation's deadline")));
            }
            Read::Broken(e) => {
                tracing::warn!("REST upstream answer broke: {e}");
                self.finish(open, Outcome::ConnectionError, Some(ErrorCode::UpstreamError)).await;
                return Next::Send(Err(BoxError::from(format!("the upstream's answer broke: {e}"))));
            }
        };
        if let Some(data) = frame.data_ref() {
            let bytes = data.len() as u64;
            if self.served && self.meter.per_byte().is_some() {
                if !self.meter.admit(bytes).await {
                    // The cap: the answer ends short (the client sees it cut).
                    let code = match self.meter.stop() {
                        Some(Stop::Budget(e)) => e.code(),
                        _ => ErrorCode::MessageTooLarge,
                    };
                    self.finish(open, Outcome::Success, Some(code)).await;
                    return Next::Send(Err(BoxError::from("the call's budget step was refused")));
                }
                self.meter.passed(bytes).await;
            }
            if let Some(capture) = self.capture.as_mut()
                && !capture.push(data)
            {
                self.capture = None;
            }
        }
        // The last chunk: the call is settled and recorded before the client has it
        // all (a client that stops reading at its length leaves then).
        if open.body_ended() {
            self.finish(open, Outcome::Status { status: self.status, retry_after: None }, None).await;
        }
        Next::Send(Ok(frame))
    }

    /// The body is cut with an error, not ended as if it were complete.
    async fn deadline(&mut self, open: &mut Open) -> Option<Relayed> {
        self.finish(open, Outcome::Success, Some(ErrorCode::Deadline)).await;
        Some(Err(BoxError::from("the invocation's deadline")))
    }

    /// What passed before the client left is charged, as it was served. Its breaker
    /// hears how the answer's head counted, as a chat stream's does: a client leaving
    /// says nothing against a backend that was answering (and a half-open breaker's
    /// probe is not lost).
    async fn left(&mut self, open: &mut Open) {
        let outcome = Outcome::Status { status: self.status, retry_after: None };
        self.finish(open, outcome, Some(ErrorCode::ClientClosedRequest)).await;
    }
}

impl Relaying {
    /// Tells the breaker how the answer ended (an answer served, 2xx or 3xx, that ends
    /// as it should is a success; a relayed 4xx counts as its policy says), then ends
    /// the call: what passed is charged when the answer served it.
    async fn finish(&mut self, open: &mut Open, outcome: Outcome, code: Option<ErrorCode>) {
        if let Some(pass) = self.pass.take() {
            let outcome =
                if self.served && matches!(outcome, Outcome::Status { .. }) { Outcome::Success } else { outcome };
            pass.tell(&outcome);
        }
        let status = if code == Some(ErrorCode::ClientClosedRequest) { 499 } else { self.status };
        let spent = Spent::Metered { answered: self.served, served: self.served, kept: self.capture.take() };
        open.end(Ended { status, code, spent, finish_reasons: Vec::new() }).await;
    }
}
