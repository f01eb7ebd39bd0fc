//! The model doors, driven as every door is (`drive/`: identify → begin the record →
//! the door's call → end the record): parse and measure → admit (route + reserve) →
//! dispatch (`dispatch.rs`: with fallback, before the first byte only) → relay
//! (`relay.rs`) → settle. The modules form a chain, each importing only those after it.
//!
//! Fallback happens on a connection error, a 5xx, a timeout, or an answer cut, stalled
//! or invalid before the client's first byte (SPEC §5: a non-streamed answer counts as
//! served once read whole, a stream once its first content arrives), never on a 4xx: a
//! backend's own 4xx (its 429 included) is the caller's answer and is relayed as is.
//! Every identified call ends in exactly one audit record (`record::Draft`), and every
//! reservation is settled or refunded (`budget::Ticket`), on every path below.
//!
//! Chat comes in by three doors (`/v1/chat/completions`, `/v1/responses`,
//! `/v1/messages`): each parses into the same measure and call, and runs the same
//! phases; only the format of the answer differs (`format.rs`).

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};

use super::RequestId;
use super::admit::{Admitted, Asked, Tokens, asked, reserve};
use super::cache::{self, Looked};
use super::dispatch::{Answered, Expect, Served, Shape, dispatch};
use super::drive::{self, Call, Reply, drive};
use super::drive::{Charge, Ended, Spent};
use super::error::{Envelope, render_in};
use super::format::Format;
use super::record::Draft;
use super::relay;
use crate::admission::Demand;
use crate::budget::plan;
use crate::call::Operation;
use crate::config::{BackendId, Capability};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::protocol::chat::Call as ChatCall;
use crate::protocol::messages::MessagesRequest;
use crate::protocol::openai::{ChatRequest, EmbeddingsRequest, ImageRef, InvalidRequest, translate};
use crate::protocol::responses::{self, ResponsesRequest};
use crate::protocol::{Measure, Wire, anthropic, vision};
use crate::routing::Candidate;

use crate::call::headers::{BACKEND as BACKEND_HEADER, BUDGET as BUDGET_HEADER, DEGRADED as DEGRADED_HEADER};

/// The model doors: chat, embeddings, Responses and Messages (the operation says
/// which). Messages callers authenticate with `x-api-key` and are answered in
/// Anthropic's envelope; the others with a Bearer key, in OpenAI's.
struct Model(Operation);

impl drive::Door for Model {
    type Refusal = GatewayError;

    fn operation(&self) -> Operation {
        self.0
    }

    fn identify(&self, gateway: &Gateway, headers: &HeaderMap) -> Result<Caller, GatewayError> {
        Ok(match self.0 {
            Operation::Messages => gateway.keys.authenticate_x_api_key(headers)?,
            _ => gateway.keys.authenticate(headers)?,
        })
    }

    async fn call(
        &mut self,
        call: Call<'_>,
        draft: &mut Draft,
        charge: &mut Charge,
        request: Request,
    ) -> Result<Reply, GatewayError> {
        let (parts, body) = request.into_parts();
        match self.0 {
            Operation::Embeddings => embed(call, draft, charge, &parts.headers, body, None).await,
            op => chat(call, draft, charge, &parts.headers, body, op).await,
        }
    }

    fn refuse(&self, error: &GatewayError) -> Response {
        let envelope = if self.0 == Operation::Messages { Envelope::Anthropic } else { Envelope::OpenAi };
        render_in(error, envelope)
    }
}

pub(super) async fn chat_completions(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    drive(gateway, Model(Operation::Chat), request).await
}

/// `POST /v1/responses` (SPEC §2.1): the chat path, answered in the Responses format.
pub(super) async fn responses(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    drive(gateway, Model(Operation::Responses), request).await
}

/// `POST /v1/messages` (SPEC §2.2): the chat path, answered in Anthropic's format.
pub(super) async fn messages(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    drive(gateway, Model(Operation::Messages), request).await
}

/// `POST /v1/messages/count_tokens`: the gateway's own estimate of the prompt's
/// tokens (the typical one of a settlement without usage: 4 bytes a token, framing,
/// 2,048 an image), never a backend's count. It calls no model, so it is neither
/// budgeted nor audited.
pub(super) async fn count_tokens(State(gateway): State<Arc<Gateway>>, headers: HeaderMap, body: Body) -> Response {
    let counted = async {
        gateway.keys.authenticate_x_api_key(&headers)?;
        let bytes = read_body(body, &headers, gateway.config.ai.vision.max_body_bytes).await?;
        let request = MessagesRequest::parse_count(&bytes)?;
        let m = &request.measure;
        Ok::<_, GatewayError>(plan::prompt_typical(m.prompt_text_bytes, m.message_count, m.images.len() as u64))
    };
    match counted.await {
        Ok(tokens) => axum::Json(serde_json::json!({"input_tokens": tokens})).into_response(),
        Err(e) => render_in(&e, Envelope::Anthropic),
    }
}

pub(super) async fn embeddings(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    drive(gateway, Model(Operation::Embeddings), request).await
}

/// A chat request, by whichever door it came.
enum Inbound {
    Chat(ChatRequest),
    Responses(ResponsesRequest),
    Messages(MessagesRequest),
}

/// What the call phases read of an [`Inbound`] request.
struct View<'a> {
    model: &'a str,
    stream: bool,
    client_wants_usage: bool,
    max_tokens: Option<u64>,
    choices: u64,
    images: &'a [ImageRef],
    prompt_text_bytes: u64,
    message_count: u64,
    user: Option<&'a str>,
}

impl View<'_> {
    fn of(m: &Measure) -> View<'_> {
        View {
            model: &m.model,
            stream: m.stream,
            client_wants_usage: false,
            max_tokens: m.max_tokens,
            choices: 1,
            images: &m.images,
            prompt_text_bytes: m.prompt_text_bytes,
            message_count: m.message_count,
            user: m.user.as_deref(),
        }
    }
}

impl Inbound {
    fn parse(op: Operation, bytes: &[u8]) -> Result<Inbound, InvalidRequest> {
        Ok(match op {
            Operation::Responses => Inbound::Responses(ResponsesRequest::parse(bytes)?),
            Operation::Messages => Inbound::Messages(MessagesRequest::parse(bytes)?),
            _ => Inbound::Chat(ChatRequest::parse(bytes)?),
        })
    }

    fn view(&self) -> View<'_> {
        match self {
            Inbound::Chat(r) => View {
                model: &r.model,
                stream: r.stream,
                client_wants_usage: r.client_wants_usage,
                max_tokens: r.max_tokens,
                choices: r.choices,
                images: &r.images,
                prompt_text_bytes: r.prompt_text_bytes,
                message_count: r.message_count,
                user: r.user.as_deref(),
            },
            Inbound::Responses(r) => View::of(&r.measure),
            Inbound::Messages(r) => View::of(&r.measure),
        }
    }

    /// The response cache's part in the call, when a policy applies to its model (the
    /// call as the gateway reads it, translated once here for chat and Messages).
    #[expect(clippy::too_many_arguments, reason = "the call's parts the cache reads, each once")]
    fn cache_ask(
        &self,
        gateway: &Gateway,
        caller: &Caller,
        headers: &HeaderMap,
        sensitive: bool,
        raw: &[u8],
        translated: &OnceLock<Result<ChatCall, InvalidRequest>>,
        draft: &mut Draft,
    ) -> Option<cache::Ask> {
        // A request the gateway's model cannot read (a backend of the door's own format
        // may still serve it) is not cached: `ask_chat` notes the bypass.
        let (call, modelled, max_tokens) = match self {
            Inbound::Chat(r) => (translated.get_or_init(|| r.call()).as_ref().ok(), cache::CHAT_FIELDS, r.max_tokens),
            Inbound::Messages(r) => {
                (translated.get_or_init(|| r.call()).as_ref().ok(), cache::MESSAGES_FIELDS, r.measure.max_tokens)
            }
            Inbound::Responses(r) => (Some(&r.call), cache::RESPONSES_FIELDS, r.measure.max_tokens),
        };
        let model = self.view().model;
        let view = cache::ChatView { model, call, raw, modelled, max_tokens };
        cache::ask_chat(gateway, caller, headers, sensitive, view, draft)
    }

    /// The format the answer goes back in, by the door it came in by.
    fn format(&self, request_id: &RequestId, gateway: &Gateway) -> Format {
        match self {
            Inbound::Chat(_) => Format::Chat,
            Inbound::Responses(r) => Format::Responses {
                id: responses::response_id(&request_id.0),
                echo: r.echo(),
                limit: gateway.config.ai.limits.max_response_bytes,
            },
            Inbound::Messages(_) => Format::Messages,
        }
    }

    /// The body for a backend of `wire`: the client's own when the formats agree (but
    /// for the model and the allowance), else the call translated (once, for every
    /// candidate that needs it).
    fn body_for(
        &self,
        model: &str,
        wire: Wire,
        allowance: u64,
        translated: &OnceLock<Result<ChatCall, InvalidRequest>>,
    ) -> Result<Vec<u8>, InvalidRequest> {
        let call = || match self {
            Inbound::Chat(r) => translated.get_or_init(|| r.call()).as_ref().map_err(Clone::clone),
            Inbound::Messages(r) => translated.get_or_init(|| r.call()).as_ref().map_err(Clone::clone),
            Inbound::Responses(r) => Ok(&r.call),
        };
        match (self, wire) {
            (Inbound::Chat(r), Wire::OpenAi) => Ok(r.upstream_body(model, allowance)),
            (Inbound::Messages(r), Wire::Anthropic) => Ok(r.upstream_body(model, allowance)),
            (_, Wire::OpenAi) => Ok(translate::request(call()?, model, allowance)),
            (_, Wire::Anthropic) => anthropic::request(call()?, model, allowance),
        }
    }
}

async fn chat(
    call: Call<'_>,
    draft: &mut Draft,
    charge: &mut Charge,
    headers: &HeaderMap,
    body: Body,
    op: Operation,
) -> Result<Reply, GatewayError> {
    let gateway = &**call.gateway;
    let bytes = read_body(body, headers, gateway.config.ai.vision.max_body_bytes).await?;
    let inbound = Inbound::parse(op, &bytes)?;
    let prefix = gateway.config.ai.prefix_bytes().map(|n| prompt_prefix(op, &bytes, n));
    let request = inbound.view();
    let capability = if request.images.is_empty() { Capability::Chat } else { Capability::Vision };
    draft.request(capability, request.model, request.user);
    vision::check_images(request.images, &gateway.config.ai.vision)?;
    let images = request.images.len() as u64;
    let Asked { sensitive, criticality, residency } = asked(gateway, call.caller, headers, draft)?;
    let translated = OnceLock::new();
    // Only for a model a policy names: any other call pays nothing for the cache.
    let cache_ask = match gateway.config.ai.cache.as_ref().is_some_and(|c| c.for_model(request.model).is_some()) {
        true => inbound.cache_ask(gateway, call.caller, headers, sensitive, &bytes, &translated, draft),
        false => None,
    };
    drop(bytes);
    let demand = Demand {
        capability,
        prompt_tokens: plan::prompt_upper_bound(request.prompt_text_bytes, request.message_count, images),
        max_tokens: request.max_tokens,
        choices: request.choices,
        completes: true,
        stream: request.stream,
        sensitive,
        affinity: crate::routing::affinity_key(headers, gateway.config.ai.affinity.as_ref()),
        prefix,
        criticality,
        residency,
        entry: None,
    };
    let prompt_typical = plan::prompt_typical(request.prompt_text_bytes, request.message_count, images);
    let Admitted { route, soft, allowance } =
        reserve(call, draft, charge, Tokens { demand: &demand, prompt_typical }).await?;
    let format = inbound.format(call.request_id, gateway);
    let mut keep = None;
    if let Some(ask) = cache_ask {
        let render = cache::Render {
            format: &format,
            stream: request.stream,
            client_wants_usage: request.client_wants_usage,
            request_id: &call.request_id.0,
            model: request.model,
        };
        match Box::pin(cache::lookup(call, draft, headers, ask, &demand.residency, render)).await {
            Looked::Hit(response, ended) => return Ok(Reply::Now(response, ended)),
            Looked::Miss(pending) => keep = charge.keep_for_cache(pending),
        }
    }
    let body_for = |model: &str, wire: Wire| inbound.body_for(model, wire, allowance, &translated);
    let shape =
        if request.stream { Shape::Stream { client_wants_usage: request.client_wants_usage } } else { Shape::Json };
    let expect = Expect { shape, format: &format, keep };
    let served =
        dispatch(gateway, (&mut *draft, &mut *charge), &route, "/chat/completions", request.model, body_for, expect)
            .await?;
    match served.value {
        Answered::Stream(held) => {
            draft.streaming();
            let headers = answer_headers(&served.candidate, soft);
            let idle_timeout = served.timeout;
            let backend = served.candidate.backend;
            Ok(Reply::Relay(Box::new(relay::Stream { pass: served.pass, held: *held, idle_timeout, headers, backend })))
        }
        Answered::Whole { .. } => complete(served, soft),
    }
}

/// An embeddings call; `entry`: the backend its route starts from, when the gateway
/// names it (a cache policy's `embed` backend: such a call is never itself cached).
pub(super) async fn embed(
    call: Call<'_>,
    draft: &mut Draft,
    charge: &mut Charge,
    headers: &HeaderMap,
    body: Body,
    entry: Option<BackendId>,
) -> Result<Reply, GatewayError> {
    let gateway = &**call.gateway;
    let bytes = read_body(body, headers, gateway.config.ai.vision.max_body_bytes).await?;
    let request = EmbeddingsRequest::parse(&bytes)?;
    draft.request(Capability::Embeddings, &request.model, request.user.as_deref());
    let Asked { sensitive, criticality, residency } = asked(gateway, call.caller, headers, draft)?;
    let cache_ask = match gateway.config.ai.cache.is_some() && entry.is_none() {
        true => cache::ask_embeddings(gateway, call.caller, headers, sensitive, &request.model, &bytes, draft),
        false => None,
    };
    let demand = Demand {
        capability: Capability::Embeddings,
        prompt_tokens: request.input_units,
        max_tokens: None,
        choices: 1,
        completes: false,
        stream: false,
        sensitive,
        affinity: crate::routing::affinity_key(headers, gateway.config.ai.affinity.as_ref()),
        prefix: None,
        criticality,
        residency,
        entry,
    };
    let prompt_typical = plan::typical_tokens(request.input_units);
    let Admitted { route, soft, .. } = reserve(call, draft, charge, Tokens { demand: &demand, prompt_typical }).await?;
    let mut keep = None;
    if let Some(ask) = cache_ask {
        let render = cache::Render {
            format: &Format::Chat,
            stream: false,
            client_wants_usage: false,
            request_id: &call.request_id.0,
            model: &request.model,
        };
        match Box::pin(cache::lookup(call, draft, headers, ask, &demand.residency, render)).await {
            Looked::Hit(response, ended) => return Ok(Reply::Now(response, ended)),
            Looked::Miss(pending) => keep = charge.keep_for_cache(pending),
        }
    }
    let body_for = |model: &str, wire: Wire| match wire {
        Wire::OpenAi => Ok(request.upstream_body(model)),
        // Refused at load: no embeddings capability on a backend of another format.
        Wire::Anthropic => {
            Err(InvalidRequest { message: "embeddings are not served by this backend".into(), param: None })
        }
    };
    let expect = Expect { shape: Shape::Json, format: &Format::Chat, keep };
    let served =
        dispatch(gateway, (&mut *draft, &mut *charge), &route, "/embeddings", &request.model, body_for, expect).await?;
    complete(served, soft)
}

/// The `cache_affinity` key of a chat request: the first `n` bytes of its prompt as
/// sent (the system prompt and the messages, in the order of the door's format),
/// read from the body's own text.
fn prompt_prefix(op: Operation, body: &[u8], n: u32) -> u64 {
    #[derive(serde::Deserialize)]
    struct Prompt<'a> {
        #[serde(borrow)]
        system: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow)]
        instructions: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow)]
        messages: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow)]
        input: Option<&'a serde_json::value::RawValue>,
    }
    let prompt: Prompt = serde_json::from_slice(body).unwrap_or(Prompt {
        system: None,
        instructions: None,
        messages: None,
        input: None,
    });
    let parts = match op {
        Operation::Messages => [prompt.system, prompt.messages],
        Operation::Responses => [prompt.instructions, prompt.input],
        _ => [prompt.messages, None],
    };
    let mut prefix = Vec::with_capacity((n as usize).min(body.len()));
    for part in parts.into_iter().flatten() {
        let left = (n as usize).saturating_sub(prefix.len());
        prefix.extend_from_slice(&part.get().as_bytes()[..left.min(part.get().len())]);
    }
    crate::routing::prefix_key(&prefix)
}

/// The tail every non-streamed answer shares: a backend's own 4xx relayed as is (its
/// call refunded), or the answer (read whole) ended on its usage, or, if it reports
/// none, on the prompt's typical tokens plus those of the completion it wrote.
fn complete(served: Served, soft: bool) -> Result<Reply, GatewayError> {
    let mut headers = answer_headers(&served.candidate, soft);
    let Answered::Whole { status, content_type, retry_after, body, answer, kept } = served.value else {
        return Err(GatewayError::Internal("a stream where an answer was expected".into()));
    };
    let Some(answer) = answer else {
        if let Some(v) = retry_after {
            headers.push(("retry-after", v));
        }
        tracing::info!(backend = %served.candidate.backend, status = status.as_u16(), "backend refused the call");
        // Refunded: the backend's refusal costs the caller nothing, and says so.
        let ended = Ended::unserved(status.as_u16(), None);
        return Ok(Reply::Now(response_with(status, body, content_type, headers), ended));
    };
    let spent = Spent::Tokens {
        backend: served.candidate.backend,
        usage: answer.usage,
        content_bytes: answer.completion_bytes,
        kept,
    };
    let ended = Ended { status: 200, code: None, spent, finish_reasons: answer.finish_reasons };
    let json = HeaderValue::from_static("application/json");
    Ok(Reply::Now(response_with(StatusCode::OK, body, json, headers), ended))
}

/// Reads the body, refusing it as soon as it passes `limit` (never buffering more).
async fn read_body(body: Body, headers: &HeaderMap, limit: u64) -> Result<Bytes, GatewayError> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(GatewayError::BodyTooLarge { limit });
    }
    let max = usize::try_from(limit).unwrap_or(usize::MAX);
    axum::body::to_bytes(body, max).await.map_err(|e| {
        if is_length_limit(&e) {
            GatewayError::BodyTooLarge { limit }
        } else {
            GatewayError::InvalidRequest(InvalidRequest {
                message: format!("could not read the request body: {e}"),
                param: None,
            })
        }
    })
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// The gateway's own headers on an answer, whichever door it goes back by:
/// `Flexway-Backend`; `Flexway-Degraded` when a fallback served; `Flexway-Budget`
/// when the soft cap is reached.
pub(super) fn answer_headers(candidate: &Candidate, soft: bool) -> Vec<(&'static str, HeaderValue)> {
    let mut headers = Vec::new();
    if soft {
        headers.push((BUDGET_HEADER, HeaderValue::from_static("soft")));
    }
    if let Ok(v) = HeaderValue::from_str(candidate.backend.as_str()) {
        headers.push((BACKEND_HEADER, v));
    }
    if candidate.degraded {
        headers.push((DEGRADED_HEADER, HeaderValue::from_static("backend-fallback")));
    }
    headers
}

fn response_with(
    status: StatusCode,
    body: Bytes,
    content_type: HeaderValue,
    extra: Vec<(&'static str, HeaderValue)>,
) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, content_type);
    for (name, value) in extra {
        response.headers_mut().insert(name, value);
    }
    response
}
