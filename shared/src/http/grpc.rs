//! gRPC through the gateway (SPEC §10): a generic, frame-level proxy, with no stubs of
//! the upstream's services. The phases are those of an HTTP call: authenticate →
//! route (the `kind: grpc` backends whose descriptor set declares the service;
//! internal ones only for a sensitive call) → reserve → call → relay frame by frame,
//! metering on the way → settle → record.
//!
//! Metering, from the method's `(flexway.v1.operation).ai` option:
//! - `PER_CALL`: one call's price is reserved before the call and charged when the
//!   upstream answers with status OK (refunded otherwise); the body is never read.
//! - `PER_BYTE`: the payload bytes of request and response messages (each message's
//!   5-byte prefix excluded), rounded up to the micro-euro over the whole call. Before
//!   the call the gateway reserves the request message's bytes (unary and server
//!   streaming: its prefix is read first) plus [`RESPONSE_ALLOWANCE_BYTES`]; whenever
//!   a message's prefix says more bytes are coming than are reserved, it reserves
//!   another step (that message's bytes or the allowance, whichever is larger) before
//!   the message passes. A step refused at the cap ends the call with
//!   `RESOURCE_EXHAUSTED` (`budget_exceeded`): the cap is never passed. The call is
//!   settled on the bytes that passed, or refunded whole when the upstream never
//!   answered.
//! - no option: proxied unmetered (identity still required); it still counts in its
//!   caller's request windows and its run's calls (a reservation of nothing).
//!
//! Invariants: exactly one audit record per identified call, whatever happens (the
//! client cancels, the upstream drops: the record is written, and the reservations
//! settled, when the response ends or is dropped); nothing is buffered beyond one
//! frame, and no message over [`MAX_MESSAGE_BYTES`] passes a metered call. gRPC-Web
//! (the serverless shape: a function URL buffers request bodies) serves unary and
//! server-streaming methods only; client and bidirectional streaming are refused.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, header};
use http_body_util::BodyExt;
use hyper::body::Frame;

use super::admit::sensitive_and_residency;
use super::admit::{Metered, reserve};
use super::byte_relay::{self, Next, Open, Read, Relayed};
use super::chain::{self, Answered, Failure};
use super::drive::{self, Call, Reply, drive};
use super::drive::{Charge, Ended, Ending, Spent};
use super::forward::{returned_headers, upstream_headers};
use super::models::answer_headers;
use super::record::Draft;
use super::slot::{Frames, Slot};
use crate::call::{ErrorCode, Operation};
use crate::config::{BackendId, BackendKind, Capability, GrpcMetering, GrpcMethod};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::metering::{Meter, Stop};
use crate::protocol::grpc::{Code, MessageCounter, encode_message, status_of, web_trailers_frame};
use crate::routing::breaker::{Outcome, Pass};
use crate::routing::{Candidate, Declared, Residency, Route};
use crate::upstream::CallError;
use crate::upstream::body::Fault;
use crate::upstream::grpc::{BoxError, GrpcClient, UpstreamBody};

pub use crate::metering::{MAX_MESSAGE_BYTES, RESPONSE_ALLOWANCE_BYTES};
/// The settled cost, in the trailers (euros, `0.002500`).
pub const COST_TRAILER: &str = "flexway-cost-eur";

/// Whether a request is gRPC or gRPC-Web (by its content type).
pub(super) fn is_grpc(headers: &HeaderMap) -> bool {
    content_type(headers).starts_with("application/grpc")
}

fn content_type(headers: &HeaderMap) -> &str {
    headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default()
}

/// Native gRPC (HTTP/2, trailers) or gRPC-Web (trailers in the body).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Native,
    Web,
}

impl Flavor {
    fn of(headers: &HeaderMap) -> Result<Flavor, Refusal> {
        let kind = content_type(headers).split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        if kind.starts_with("application/grpc-web-text") {
            return Err(Refusal::new(
                Code::Unimplemented,
                ErrorCode::InvalidRequest,
                "gRPC-Web text (base64) is not served: send application/grpc-web+proto",
            ));
        }
        Ok(if kind.starts_with("application/grpc-web") { Flavor::Web } else { Flavor::Native })
    }

    fn content_type(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            Flavor::Native => "application/grpc",
            Flavor::Web => "application/grpc-web+proto",
        })
    }
}

/// A gRPC status the gateway answers itself, with the SPEC's code in its message.
#[derive(Debug)]
struct Refusal {
    code: Code,
    error_code: ErrorCode,
    message: String,
}

impl Refusal {
    fn new(code: Code, error_code: ErrorCode, message: impl Into<String>) -> Self {
        Refusal { code, error_code, message: message.into() }
    }

    /// `budget_exceeded: budget exceeded: tenant acme eur_per_month; ...`
    fn text(&self) -> String {
        format!("{}: {}", self.error_code, self.message)
    }
}

impl From<Stop> for Refusal {
    fn from(stop: Stop) -> Self {
        match stop {
            Stop::Budget(error) => Refusal::from(error),
            Stop::TooLarge(declared) => too_large(declared),
        }
    }
}

impl From<GatewayError> for Refusal {
    fn from(error: GatewayError) -> Self {
        let message = match &error {
            GatewayError::Internal(detail) => {
                tracing::error!("{detail}");
                crate::error::INTERNAL_MESSAGE.to_owned()
            }
            other => other.to_string(),
        };
        let error_code = error.code();
        Refusal { code: Code::of(error_code), error_code, message }
    }
}

/// A call's answer made of its status alone ("trailers-only").
fn refused(flavor: Flavor, refusal: &Refusal) -> Response {
    let mut response = Response::new(Body::empty());
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, flavor.content_type());
    headers.insert("grpc-status", HeaderValue::from(refusal.code.number()));
    if let Ok(message) = HeaderValue::from_str(&encode_message(&refusal.text())) {
        headers.insert("grpc-message", message);
    }
    response
}

pub(super) async fn handle(gateway: Arc<Gateway>, request: Request) -> Response {
    match Flavor::of(request.headers()) {
        Ok(flavor) => drive(gateway, Grpc { flavor }, request).await,
        Err(refusal) => refused(Flavor::Web, &refusal),
    }
}

/// The gRPC door: native gRPC or gRPC-Web, answered in its flavor.
struct Grpc {
    flavor: Flavor,
}

impl drive::Refusal for Refusal {
    /// A budget's refusal is `budget_state: exceeded`, as on the HTTP doors; a rate
    /// limit's or a message too large, `RESOURCE_EXHAUSTED` too, is not.
    fn noted(&self, draft: &mut Draft) -> (u16, ErrorCode) {
        if self.error_code == ErrorCode::BudgetExceeded {
            draft.exceeded();
        }
        (self.code.number(), self.error_code)
    }
}

impl drive::Door for Grpc {
    type Refusal = Refusal;

    fn operation(&self) -> Operation {
        Operation::Grpc
    }

    fn identify(&self, gateway: &Gateway, headers: &HeaderMap) -> Result<Caller, Refusal> {
        gateway.keys.authenticate(headers).map_err(|e| Refusal::from(GatewayError::from(e)))
    }

    async fn call(
        &mut self,
        call: Call<'_>,
        draft: &mut Draft,
        charge: &mut Charge,
        request: Request,
    ) -> Result<Reply, Refusal> {
        draft.abandoned_as(Code::Cancelled.number(), ErrorCode::Cancelled);
        let rpc = request.uri().path().trim_start_matches('/').to_owned();
        // The method is the call's model in its record: bounded like a model name.
        crate::call::InvalidRequest::check_bounded("model", &rpc, crate::call::MAX_MODEL_BYTES)
            .map_err(|e| Refusal::from(GatewayError::from(e)))?;
        draft.request(Capability::Grpc, &rpc, None);
        let proxied = proxied(call, draft, charge, self.flavor, &rpc, request).await?;
        Ok(Reply::Relay(Box::new(proxied)))
    }

    fn refuse(&self, refusal: &Refusal) -> Response {
        refused(self.flavor, refusal)
    }
}

/// An answered call, and what relays its body.
struct Proxied {
    response: http::Response<crate::upstream::AnswerBody>,
    relay: Relay,
}

impl drive::Relay for Proxied {
    fn respond(self: Box<Self>, ending: Ending, deadline: Option<super::Deadline>) -> Response {
        let Proxied { response, relay } = *self;
        relay.respond(response, ending, deadline.map(super::Deadline::cutoff))
    }
}

async fn proxied(
    call: Call<'_>,
    draft: &mut Draft,
    charge: &mut Charge,
    flavor: Flavor,
    rpc: &str,
    request: Request,
) -> Result<Proxied, Refusal> {
    let Call { gateway, caller, request_id, run } = call;
    let (parts, mut body) = request.into_parts();
    let (sensitive, residency) = sensitive_and_residency(gateway, caller, &parts.headers, draft)?;
    let (route, method) = method_route(gateway, rpc, sensitive, &residency)?;
    if let Some(first) = route.candidates.first() {
        draft.trying(first, rpc);
    }
    if let Some(operation) = &method.operation {
        draft.feature(&operation.feature);
    }
    if flavor == Flavor::Web && method.client_streaming {
        return Err(Refusal::new(
            Code::Unimplemented,
            ErrorCode::InvalidRequest,
            format!(
                "/{rpc} is a client or bidirectional streaming method: gRPC-Web carries unary and \
                 server-streaming calls only (a function URL buffers the request body); call it with native \
                 gRPC (flexway serve)"
            ),
        ));
    }

    // Reserve: a per-byte call's first request message is measured first (its prefix).
    // The reservation outlives every backend the call may try.
    let timeouts = route.candidates.iter().map(|c| gateway.timeout(&c.backend)).sum();
    let meter = Arc::new(Meter::new(
        gateway.clone(),
        caller.clone(),
        run.cloned(),
        request_id,
        method.operation.clone(),
        timeouts,
    ));
    let mut pending = VecDeque::new();
    let first = match &method.operation {
        Some(op) if op.metering == GrpcMetering::PerByte && !method.client_streaming => {
            let (frames, first) = peek_first_message(&mut body).await?;
            pending = frames;
            first
        }
        _ => 0,
    };
    if first > MAX_MESSAGE_BYTES {
        return Err(too_large(first));
    }
    reserve(call, draft, charge, Metered { meter: meter.clone(), bytes: first }).await?;

    // Attempt the route: a backend that fails before taking a byte of the request
    // (unreachable, timed out, not answering gRPC) gives the call to the next one.
    let slot = Slot::new(RequestBody::new(body, pending, meter.clone()));
    let headers = upstream_headers(&parts.headers, &gateway.config.ai.sensitive_header, draft.trace());
    let door = SendCall { gateway, rpc, headers: &headers, flavor, slot };
    let served = match chain::attempt_chain(gateway, draft, charge, &route, &door).await {
        Ok(served) => served,
        // A budget step refused while the request went out is why the call ended.
        Err(e) => return Err(meter.stop().map_or_else(|| Refusal::from(e), Refusal::from)),
    };
    draft.first_byte();
    let relay = Relay { flavor, candidate: served.candidate, pass: served.pass, meter };
    Ok(Proxied { response: served.value, relay })
}

/// The gRPC door's attempt: the call sent to one upstream, its request body taken
/// from the slot as the upstream reads it.
struct SendCall<'a> {
    gateway: &'a Gateway,
    rpc: &'a str,
    headers: &'a HeaderMap,
    flavor: Flavor,
    slot: Slot<RequestBody>,
}

impl<'a> chain::Attempt for SendCall<'a> {
    /// The upstream's URL, its `timeout` and the client it is called through.
    type Target = (&'a str, Duration, Arc<GrpcClient>);
    type Prepared = ();
    type Answer = http::Response<crate::upstream::AnswerBody>;

    fn reach(&self, backend: &BackendId) -> Option<(Self::Target, Duration)> {
        match self.gateway.config.ai.backends.get(backend).map(|b| &b.kind) {
            Some(BackendKind::Grpc { url, .. }) => {
                let timeout = self.gateway.timeout(backend);
                Some(((url.as_str(), timeout, self.gateway.upstreams.grpc(backend)), timeout))
            }
            _ => None,
        }
    }

    fn prepare(&self, _: &Self::Target) -> Result<(String, ()), GatewayError> {
        Ok((self.rpc.to_owned(), ()))
    }

    async fn attempt(
        &self,
        (url, timeout, client): &Self::Target,
        (): (),
        _: &Draft,
    ) -> Result<Answered<Self::Answer>, Failure> {
        // Once the upstream took part of the body, the call cannot go elsewhere.
        let failed = |failure: Failure| {
            if self.slot.reclaim() { failure } else { Failure::AfterSend(Box::new(failure)) }
        };
        let upstream = upstream_request(url, self.rpc, self.headers, self.flavor, self.slot.body())
            .map_err(|detail| Failure::Head(CallError::Connect(detail)))?;
        match tokio::time::timeout(*timeout, client.send(upstream)).await {
            Err(_) => Err(failed(Failure::Head(CallError::Timeout(*timeout)))),
            Ok(Err(e)) => Err(failed(Failure::Head(CallError::Connect(root_cause(&e))))),
            Ok(Ok(response)) if response.status() != http::StatusCode::OK => {
                let detail = format!("answered HTTP {}, not a gRPC response", response.status());
                Err(failed(Failure::Body(Fault::Invalid(detail))))
            }
            Ok(Ok(response)) => Ok(Answered { value: response, outcome: Some(Outcome::Success) }),
        }
    }
}

/// The route of `rpc` (`package.Service/Method`) and its method: the router's route of
/// the service (the `kind: grpc` backends that declare it, by name). The first's
/// method is the call's; the others that declare it metered the
/// same way are its fallbacks, tried while no byte of the request has gone upstream (a
/// fallback that meters it otherwise is left out: a call is metered as it was
/// reserved).
fn method_route(
    gateway: &Gateway,
    rpc: &str,
    sensitive: bool,
    residency: &Residency,
) -> Result<(Route, GrpcMethod), Refusal> {
    let (service, name) = rpc.split_once('/').filter(|(s, m)| !s.is_empty() && !m.is_empty()).ok_or_else(|| {
        Refusal::new(Code::Unimplemented, ErrorCode::InvalidRequest, format!("`/{rpc}` is not a gRPC method path"))
    })?;
    let declared = gateway.router.route_operation(Declared::Service(service), sensitive, residency)?;
    let Some(mut route) = declared else {
        return Err(Refusal::new(
            Code::Unimplemented,
            ErrorCode::UnknownService,
            format!("no grpc backend's descriptor set declares the service `{service}`"),
        ));
    };
    let ai = &gateway.config.ai;
    let services = |backend: &BackendId| ai.grpc.get(backend).filter(|s| s.services.contains_key(service));
    let method_of = |candidate: &Candidate| services(&candidate.backend).and_then(|s| s.method(service, name));
    let method = route.candidates.first().and_then(method_of).cloned().ok_or_else(|| {
        Refusal::new(
            Code::Unimplemented,
            ErrorCode::UnknownService,
            format!("the service `{service}` has no method `{name}`"),
        )
    })?;
    route.candidates.retain(|c| method_of(c).is_some_and(|m| m.operation == method.operation));
    Ok((route, method))
}

fn too_large(declared: u64) -> Refusal {
    Refusal::new(
        Code::ResourceExhausted,
        ErrorCode::MessageTooLarge,
        format!("a message of {declared} bytes is larger than the {MAX_MESSAGE_BYTES} bytes a metered call passes"),
    )
}

fn root_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

/// Reads the request until the first message's prefix (5 bytes) is in: its declared
/// length, and the frames read, to send on first. At most one frame more than the
/// prefix is held.
async fn peek_first_message(body: &mut Body) -> Result<(VecDeque<Frame<Bytes>>, u64), Refusal> {
    let mut frames = VecDeque::new();
    let mut counter = MessageCounter::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            Refusal::new(Code::Cancelled, ErrorCode::ClientClosedRequest, format!("could not read the request: {e}"))
        })?;
        let declared = frame.data_ref().map(|data| counter.feed(data).declared).unwrap_or_default();
        frames.push_back(frame);
        if let Some(first) = declared.first() {
            return Ok((frames, *first));
        }
    }
    Ok((frames, 0))
}

/// The request sent upstream, as native gRPC: the caller's metadata as the one policy
/// lets it go (`forward.rs`), `headers`.
fn upstream_request(
    url: &str,
    rpc: &str,
    headers: &HeaderMap,
    flavor: Flavor,
    body: UpstreamBody,
) -> Result<http::Request<UpstreamBody>, String> {
    let uri: http::Uri = format!("{url}/{rpc}").parse().map_err(|e| format!("upstream URI: {e}"))?;
    let mut request = http::Request::builder()
        .method(http::Method::POST)
        .uri(uri)
        .version(http::Version::HTTP_2)
        .body(body)
        .map_err(|e| format!("upstream request: {e}"))?;
    let out = request.headers_mut();
    out.clone_from(headers);
    // A gRPC body is a stream of messages: its length is the frames'.
    out.remove(header::CONTENT_LENGTH);
    if flavor == Flavor::Web {
        // `application/grpc-web+proto` → `application/grpc+proto`.
        let native = content_type(headers).replacen("application/grpc-web", "application/grpc", 1);
        if let Ok(value) = HeaderValue::from_str(&native) {
            out.insert(header::CONTENT_TYPE, value);
        }
        out.remove("x-grpc-web");
        out.remove("x-user-agent");
    }
    out.insert(header::TE, HeaderValue::from_static("trailers"));
    Ok(request)
}

// ----- the two directions -------------------------------------------------------------

/// The caller's request body on its way upstream: frames as they come, metered.
struct RequestBody {
    body: Body,
    pending: VecDeque<Frame<Bytes>>,
    meter: Arc<Meter>,
    counter: MessageCounter,
}

impl RequestBody {
    fn new(body: Body, pending: VecDeque<Frame<Bytes>>, meter: Arc<Meter>) -> Self {
        RequestBody { body, pending, meter, counter: MessageCounter::default() }
    }
}

impl Frames for RequestBody {
    /// The frames sent upstream, metered on the way.
    fn frames(self) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> + Send + 'static {
        futures_util::stream::try_unfold(self, |mut this| async move {
            let frame = loop {
                let frame = match this.pending.pop_front() {
                    Some(frame) => frame,
                    None => match this.body.frame().await {
                        None => return Ok(None),
                        Some(frame) => frame.map_err(|e| Box::new(e) as BoxError)?,
                    },
                };
                // An empty DATA frame (a client's END_STREAM) is not passed on: an h2
                // server counts empty frames as a flood (GOAWAY ENHANCE_YOUR_CALM).
                if frame.data_ref().is_none_or(|data| !data.is_empty()) {
                    break frame;
                }
            };
            if let Some(data) = frame.data_ref()
                && this.meter.per_byte().is_some()
            {
                let seen = this.counter.feed(data);
                for declared in seen.declared {
                    if !this.meter.admit(declared).await {
                        return Err(BoxError::from("the call was refused a budget step"));
                    }
                }
                this.meter.passed(seen.payload).await;
            }
            Ok(Some((frame, this)))
        })
    }
}

/// What relays the answer's body: metering, the final status, the record.
struct Relay {
    flavor: Flavor,
    /// The backend that answered, and its breaker's pass (a stream that breaks counts
    /// against it).
    candidate: Candidate,
    pass: Pass,
    meter: Arc<Meter>,
}

/// What a gRPC answer's frames mean: messages metered on the way, and its status in
/// its trailers (the call ends when they come, or when the client leaves: CANCELLED).
struct Relaying {
    counter: MessageCounter,
    meter: Arc<Meter>,
    flavor: Flavor,
    /// `grpc-status` of a trailers-only answer (in its headers).
    status_in_headers: Option<u16>,
    pass: Pass,
}

impl Relay {
    fn respond(
        self,
        upstream: http::Response<crate::upstream::AnswerBody>,
        ending: Ending,
        cutoff: Option<tokio::time::Instant>,
    ) -> Response {
        let (parts, body) = upstream.into_parts();
        let mut response = Response::new(Body::empty());
        returned_headers(&parts.headers, response.headers_mut());
        response.headers_mut().remove(header::CONTENT_LENGTH);
        if self.flavor == Flavor::Web {
            let native = content_type(&parts.headers).replacen("application/grpc", "application/grpc-web", 1);
            let value = HeaderValue::from_str(&native).unwrap_or_else(|_| self.flavor.content_type());
            response.headers_mut().insert(header::CONTENT_TYPE, value);
        }
        for (name, value) in answer_headers(&self.candidate, false) {
            response.headers_mut().insert(name, value);
        }
        let relaying = Relaying {
            counter: MessageCounter::default(),
            meter: self.meter,
            pass: self.pass,
            flavor: self.flavor,
            status_in_headers: status_of(&parts.headers),
        };
        byte_relay::relay(relaying, body, ending, cutoff, response)
    }
}

/// How an answer still open at the invocation's deadline ends.
fn deadline_refusal() -> Refusal {
    Refusal::new(Code::DeadlineExceeded, ErrorCode::Deadline, "the invocation's deadline came before the answer ended")
}

impl byte_relay::Answer for Relaying {
    async fn next(&mut self, open: &mut Open, read: Read) -> Next {
        let frame = match read {
            Read::Frame(frame) => frame,
            Read::End => return self.finish(open, None).await,
            Read::Deadline => {
                // Ended as a chat stream is (SPEC §11): its status in the trailers,
                // settled on what passed and recorded before the platform cuts it.
                tracing::warn!("gRPC answer still open at the invocation's deadline: ended");
                return self.finish(open, Some(deadline_refusal())).await;
            }
            Read::Broken(e) => {
                tracing::warn!("gRPC upstream stream: {e}");
                self.pass.tell(&Outcome::ConnectionError);
                let refusal = self.meter.stop().map(Refusal::from).unwrap_or_else(|| {
                    Refusal::new(Code::Unavailable, ErrorCode::UpstreamError, format!("the upstream stream broke: {e}"))
                });
                return self.finish(open, Some(refusal)).await;
            }
        };
        if let Some(data) = frame.data_ref() {
            if data.is_empty() {
                // Not relayed: an h2 peer counts empty DATA frames as a flood.
                return Next::Skip;
            }
            if self.meter.per_byte().is_some() {
                let seen = self.counter.feed(data);
                for declared in seen.declared {
                    if !self.meter.admit(declared).await {
                        let refusal = self.meter.stop().map(Refusal::from);
                        return self.finish(open, refusal).await;
                    }
                }
                self.meter.passed(seen.payload).await;
            }
            return Next::Send(Ok(frame));
        }
        match frame.into_trailers() {
            Ok(trailers) => {
                // A step refused on the request side ends the call with its refusal.
                if let Some(refusal) = self.meter.stop().map(Refusal::from) {
                    return self.finish(open, Some(refusal)).await;
                }
                let status = status_of(&trailers).unwrap_or(Code::Unknown.number());
                self.trailers(open, trailers, status, None).await
            }
            Err(_) => Next::Skip,
        }
    }

    async fn deadline(&mut self, open: &mut Open) -> Option<Relayed> {
        match self.finish(open, Some(deadline_refusal())).await {
            Next::Send(trailers) => Some(trailers),
            Next::Skip | Next::Ended => None,
        }
    }

    /// What passed before the client left is charged. Its breaker is told nothing: a
    /// client leaving says nothing of the backend.
    async fn left(&mut self, open: &mut Open) {
        open.end(ended(Code::Cancelled.number(), Some(ErrorCode::Cancelled))).await;
    }
}

/// How a gRPC call that the upstream answered ended: charged per call when its status
/// is OK, per byte on what passed.
fn ended(status: u16, code: Option<ErrorCode>) -> Ended {
    let spent = Spent::Metered { answered: true, served: status == Code::Ok.number(), kept: None };
    Ended { status, code, spent, finish_reasons: Vec::new() }
}

impl Relaying {
    /// The stream ended without trailers (or the gateway ends it with `refusal`).
    async fn finish(&mut self, open: &mut Open, refusal: Option<Refusal>) -> Next {
        if let Some(refusal) = refusal.or_else(|| self.meter.stop().map(Refusal::from)) {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", HeaderValue::from(refusal.code.number()));
            if let Ok(message) = HeaderValue::from_str(&encode_message(&refusal.text())) {
                trailers.insert("grpc-message", message);
            }
            return self.trailers(open, trailers, refusal.code.number(), Some(refusal.error_code)).await;
        }
        if let Some(status) = self.status_in_headers {
            // Trailers-only: the status was in the headers, already relayed.
            open.end(ended(status, None)).await;
            return Next::Ended;
        }
        let refusal =
            Refusal::new(Code::Internal, ErrorCode::UpstreamError, "the upstream ended the call without a status");
        Box::pin(self.finish(open, Some(refusal))).await
    }

    /// Settles and records the call, then hands the client its trailers (gRPC-Web: as
    /// the body's last frame): the record is written before the response ends.
    async fn trailers(
        &mut self,
        open: &mut Open,
        mut trailers: HeaderMap,
        status: u16,
        error_code: Option<ErrorCode>,
    ) -> Next {
        let cost = open.end(ended(status, error_code)).await;
        if let Ok(value) = HeaderValue::from_str(&cost.to_eur_string()) {
            trailers.insert(COST_TRAILER, value);
        }
        Next::Send(Ok(match self.flavor {
            Flavor::Native => Frame::trailers(trailers),
            Flavor::Web => Frame::data(web_trailers_frame(&trailers)),
        }))
    }
}
