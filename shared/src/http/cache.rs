//! The response cache on the driver (SPEC §16): what a call asks of it (its policy,
//! partition and probe, read once from the parsed request), the lookup after
//! admission and before the attempt chain (a hit ends the call there, rendered in the
//! door's format, streamed or not), and what the end stores (`drive/end.rs`, the one
//! place: a complete answer only).
//!
//! A store that fails is a miss, counted; a semantic policy's embedding is a call of
//! its own through the driver (`/v1/embeddings` to the policy's `embed` backend),
//! priced, charged to the caller and recorded like any.

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::drive::{Ended, Spent};
use super::format::Format;
use super::record::Draft;
use crate::cache::{Lookup, Partition, Probe, ResponseCache};
use crate::config::{CacheMode, CachePolicy, CacheScope};
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::money::MicroEur;
use crate::protocol::chat::{Call as ChatCall, Completion, Delta, Finish, Part, Role, Tokens};
use crate::protocol::{Wire, unix_seconds};
use crate::routing::Residency;

/// The response header that says what the cache did (SPEC §16).
pub const CACHE_HEADER: &str = "flexway-cache";

/// The hashes of `ask` as its store keeps them: blinded under the master key.
fn blind(cache: &ResponseCache, ask: &mut Ask) {
    let keys = cache.keys();
    ask.partition.id = keys.blind(&ask.partition.id);
    ask.probe.exact = keys.blind(&ask.probe.exact);
    let guard = keys.blind(&ask.probe.guard.to_be_bytes());
    ask.probe.guard =
        u64::from_be_bytes([guard[0], guard[1], guard[2], guard[3], guard[4], guard[5], guard[6], guard[7]]);
}

/// The door of a semantic policy's embedding call: a call of its own through the
/// driver (reserved, charged, recorded), for the caller already identified by the call
/// it serves, routed from the policy's `embed` backend.
struct EmbedDoor {
    caller: Caller,
    entry: crate::config::BackendId,
}

impl super::drive::Door for EmbedDoor {
    type Refusal = crate::error::GatewayError;

    fn operation(&self) -> crate::call::Operation {
        crate::call::Operation::Embeddings
    }

    fn identify(&self, _: &Gateway, _: &HeaderMap) -> Result<Caller, crate::error::GatewayError> {
        Ok(self.caller.clone())
    }

    async fn call(
        &mut self,
        call: super::drive::Call<'_>,
        draft: &mut Draft,
        charge: &mut super::drive::Charge,
        request: axum::extract::Request,
    ) -> Result<super::drive::Reply, crate::error::GatewayError> {
        draft.feature("cache_embed");
        let (parts, body) = request.into_parts();
        super::models::embed(call, draft, charge, &parts.headers, body, Some(self.entry.clone())).await
    }

    fn refuse(&self, error: &crate::error::GatewayError) -> Response {
        super::error::render_in(error, super::error::Envelope::OpenAi)
    }
}

/// The largest embeddings answer read back (3,072 numbers as JSON are ~70 KB).
const MAX_EMBEDDING_BYTES: usize = 4 << 20;

/// `message`'s embedding by the policy's `embed` backend and model, unit length;
/// `None` when the call failed (a miss). The caller's own headers that shape a call go
/// with it (sensitivity, jurisdiction, class, run), never its credentials. Its future
/// is boxed behind `dyn`: an embeddings call is itself a door's call, whose future
/// would otherwise contain this one's.
fn embedding<'a>(
    call: super::drive::Call<'a>,
    headers: &'a HeaderMap,
    policy: &'a CachePolicy,
    message: &'a str,
) -> std::pin::Pin<Box<dyn Future<Output = Option<Vec<f32>>> + Send + 'a>> {
    Box::pin(embedding_call(call, headers, policy, message))
}

async fn embedding_call(
    call: super::drive::Call<'_>,
    headers: &HeaderMap,
    policy: &CachePolicy,
    message: &str,
) -> Option<Vec<f32>> {
    let embed = policy.embed.as_ref()?;
    let body = json!({"model": embed.model, "input": message}).to_string();
    let mut request = axum::extract::Request::builder()
        .method(http::Method::POST)
        .uri("/v1/embeddings")
        .body(Body::from(body))
        .ok()?;
    let skip = [header::AUTHORIZATION, header::CONTENT_LENGTH, header::CONTENT_TYPE, header::CACHE_CONTROL];
    for (name, value) in headers {
        if !skip.contains(name) && name.as_str() != "x-api-key" {
            request.headers_mut().append(name.clone(), value.clone());
        }
    }
    request.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    request.extensions_mut().insert(super::RequestId(format!("{}.embed", call.request_id.0)));
    let door = EmbedDoor { caller: call.caller.clone(), entry: embed.backend.clone() };
    let response = Box::pin(super::drive::drive(call.gateway.clone(), door, request)).await;
    if !response.status().is_success() {
        return None;
    }
    let bytes = axum::body::to_bytes(response.into_body(), MAX_EMBEDDING_BYTES).await.ok()?;
    #[derive(Deserialize)]
    struct Answer {
        data: Vec<Datum>,
    }
    #[derive(Deserialize)]
    struct Datum {
        embedding: Vec<f32>,
    }
    let answer: Answer = serde_json::from_slice(&bytes).ok()?;
    crate::cache::unit(answer.data.into_iter().next()?.embedding)
}

/// What the cache did for a call, as its record and its `Flexway-Cache` say it.
#[derive(Debug, Clone, PartialEq)]
pub enum Note {
    Hit {
        similarity: f32,
        age_s: u64,
        saved: MicroEur,
    },
    Miss,
    Stored,
    Bypass,
    /// The caller's tenant or agent has `cache: off`.
    Off,
}

impl Note {
    pub fn as_str(&self) -> &'static str {
        match self {
            Note::Hit { .. } => "hit",
            Note::Miss => "miss",
            Note::Stored => "stored",
            Note::Bypass => "bypass",
            Note::Off => "off",
        }
    }

    /// The `Flexway-Cache` value: `hit; similarity=0.973; age=120`, `miss`, ...
    pub fn header(&self) -> HeaderValue {
        match self {
            Note::Hit { similarity, age_s, .. } => {
                HeaderValue::from_str(&format!("hit; similarity={similarity:.3}; age={age_s}"))
                    .unwrap_or(HeaderValue::from_static("hit"))
            }
            Note::Off => HeaderValue::from_static("bypass"),
            other => HeaderValue::from_static(other.as_str()),
        }
    }
}

/// A cacheable call, from its door's parse to its end.
pub(super) struct Ask {
    policy_name: String,
    policy: Arc<CachePolicy>,
    partition: Partition,
    probe: Probe,
    /// The last user message's text, for a semantic policy's embedding and guard.
    message: String,
    /// `Cache-Control: no-cache` not sent: the call may be served from the cache.
    read: bool,
    /// `Cache-Control: no-store` not sent: its answer may be kept.
    write: bool,
    /// `Cache-Control: max-age=N`.
    max_age: Option<u64>,
    /// The completion tokens the caller allows (an entry that took more is not served).
    max_tokens: Option<u64>,
    /// Whether this is an embeddings call (an entry of another kind is never served).
    kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Chat,
    Embeddings,
    /// A REST operation's answer (`x-flexway-ai: {cache: POLICY}`).
    Rest,
}

/// What a miss carries to the end: where its answer would be kept.
pub(in crate::http) struct Pending {
    ask: Ask,
}

impl Pending {
    /// What the attempt reads of the answer for the cache.
    pub(in crate::http) fn keep_as(&self) -> super::dispatch::KeepAs {
        match self.ask.kind {
            Kind::Chat => super::dispatch::KeepAs::Text { limit: self.ask.policy.max_entry_bytes },
            // A REST answer is read by its relay ([`Capture`]), never by the dispatch.
            Kind::Embeddings | Kind::Rest => super::dispatch::KeepAs::Body,
        }
    }

    /// The most bytes an answer kept under this entry may have.
    pub(in crate::http) fn limit(&self) -> u64 {
        self.ask.policy.max_entry_bytes
    }
}

/// An answer the end may keep, read from what the backend sent.
pub(in crate::http) enum Kept {
    /// The text of a one-choice answer without a tool call.
    Chat(String),
    /// An embeddings answer as the backend sent it (JSON).
    Body(Bytes),
    /// A REST operation's answer: its status, its `Content-Type` and its whole body.
    Rest { status: u16, content_type: Option<String>, body: Bytes },
}

/// A REST answer on its way to the client, read for the cache by its relay when the
/// call missed: given up past the policy's `max_entry_bytes`; kept by the end only if
/// the answer ended whole.
pub(in crate::http) struct Capture {
    pending: Box<Pending>,
    backend: crate::config::BackendId,
    status: u16,
    content_type: Option<String>,
    body: bytes::BytesMut,
}

impl Capture {
    /// The capture of an answer by `backend` with `status` and `headers`; `None` when
    /// it could not be kept (not 2xx).
    pub(in crate::http) fn new(
        pending: Box<Pending>,
        backend: crate::config::BackendId,
        status: u16,
        headers: &HeaderMap,
    ) -> Option<Capture> {
        let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_owned);
        // The upstream's own word: an answer it says is private, or not to be kept, or
        // that sets a cookie (one client's), is not kept; nor a part of one (206).
        let directives = headers.get_all(header::CACHE_CONTROL).iter().filter_map(|v| v.to_str().ok());
        let forbidden = directives
            .flat_map(|v| v.split(','))
            .any(|d| matches!(d.trim().to_ascii_lowercase().as_str(), "no-store" | "private" | "no-cache"));
        let whole = (200..300).contains(&status) && status != 206;
        let keepable = whole && !forbidden && !headers.contains_key(header::SET_COOKIE);
        keepable.then(|| Capture { pending, backend, status, content_type, body: Default::default() })
    }

    /// `data` passed to the client; `false` once the answer is larger than an entry may
    /// be (the capture is then given up).
    pub(in crate::http) fn push(&mut self, data: &[u8]) -> bool {
        if (self.body.len() + data.len()) as u64 > self.pending.limit() {
            return false;
        }
        self.body.extend_from_slice(data);
        true
    }

    /// What the end stores: the entry, the backend that answered, and the answer.
    pub(in crate::http) fn into_parts(self) -> (Pending, crate::config::BackendId, Kept) {
        let Capture { pending, backend, status, content_type, body } = self;
        (*pending, backend, Kept::Rest { status, content_type, body: body.freeze() })
    }
}

/// What the call's door does after the lookup.
#[expect(clippy::large_enum_variant, reason = "returned once by a cached call's lookup, then taken apart")]
pub(super) enum Looked {
    /// Call the backends; keep the answer at the end if `Some`.
    Miss(Option<Box<Pending>>),
    /// The answer, and how the call ends.
    Hit(Response, Ended),
}

/// What a sealed entry holds, as JSON: never written anywhere in clear.
#[derive(Serialize, Deserialize)]
struct Plain {
    kind: Kind,
    backend: String,
    jurisdiction: Option<String>,
    /// What the call that produced it was charged, micro-euros.
    cost: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    /// The answer's text (chat), or the backend's body (embeddings, REST: UTF-8 only).
    text: String,
    /// A REST answer's status and `Content-Type` (absent for the model doors').
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    content_type: Option<String>,
}

/// The cache's view of a chat call: the request as the gateway reads it, with the
/// body's own fields that [`ChatCall`] does not model (`response_format`, `seed`, ...),
/// each of which changes the answer and so the partition.
pub(super) struct ChatView<'a> {
    pub model: &'a str,
    /// `None`: the request does not read as the gateway's model (not cached).
    pub call: Option<&'a ChatCall>,
    pub raw: &'a [u8],
    /// The top-level fields the door's parse already reads into `call` (or that do not
    /// change the answer: `stream`, `user`, ...).
    pub modelled: &'static [&'static str],
    pub max_tokens: Option<u64>,
}

/// The body fields each door reads into the call (or which never change the answer).
pub(super) const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "tools",
    "tool_choice",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "n",
    "user",
];
pub(super) const MESSAGES_FIELDS: &[&str] = &[
    "model",
    "system",
    "messages",
    "tools",
    "tool_choice",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "stream",
    "metadata",
];
pub(super) const RESPONSES_FIELDS: &[&str] = &[
    "model",
    "instructions",
    "input",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "user",
    "store",
];

/// The cache's part in a chat call asking for `view.model`: `None` when no policy
/// applies (nothing noted, nothing done); a bypass or `off` is noted on `draft`.
pub(super) fn ask_chat(
    gateway: &Gateway,
    caller: &Caller,
    headers: &HeaderMap,
    sensitive: bool,
    view: ChatView<'_>,
    draft: &mut Draft,
) -> Option<Ask> {
    let cache = gateway.config.ai.cache.as_ref()?;
    let (name, policy) = cache.for_model(view.model)?;
    let (policy_name, policy) = (name.to_owned(), policy.clone());
    if let Some(note) = excluded(gateway, caller, sensitive, &policy) {
        return noted(draft, gateway, caller, &policy_name, note);
    }
    let Some((context, message, exact)) = chat_key(&view) else {
        // More than one choice, or a last message that is not the user's words: not
        // an answer the cache can hold.
        return noted(draft, gateway, caller, &policy_name, Note::Bypass);
    };
    let control = CacheControl::read(headers);
    if !control.read && !control.write {
        return noted(draft, gateway, caller, &policy_name, Note::Bypass);
    }
    let partition = partition(caller, &policy_name, &policy, view.model, &context);
    let guard = crate::cache::guard::of(&message);
    Some(Ask {
        policy_name,
        policy,
        partition,
        probe: Probe { exact, vector: None, guard },
        message,
        read: control.read,
        write: control.write,
        max_age: control.max_age,
        max_tokens: view.max_tokens,
        kind: Kind::Chat,
    })
}

/// The cache's part in an embeddings call (exact only: the whole request is the key).
pub(super) fn ask_embeddings(
    gateway: &Gateway,
    caller: &Caller,
    headers: &HeaderMap,
    sensitive: bool,
    model: &str,
    raw: &[u8],
    draft: &mut Draft,
) -> Option<Ask> {
    let cache = gateway.config.ai.cache.as_ref()?;
    let (name, policy) = cache.for_model(model)?;
    let (policy_name, policy) = (name.to_owned(), policy.clone());
    if let Some(note) = excluded(gateway, caller, sensitive, &policy) {
        return noted(draft, gateway, caller, &policy_name, note);
    }
    let control = CacheControl::read(headers);
    let body: Map<String, Value> = serde_json::from_slice(raw).ok()?;
    if policy.mode != CacheMode::Exact || (!control.read && !control.write) {
        return noted(draft, gateway, caller, &policy_name, Note::Bypass);
    }
    // Everything that shapes the vectors: the input, `dimensions`, `encoding_format`.
    let kept: Map<String, Value> = body.into_iter().filter(|(k, _)| k != "model" && k != "user").collect();
    let exact = crate::cache::sha256(&canonical(&Value::Object(kept)));
    let partition = partition(caller, &policy_name, &policy, model, &[0; 32]);
    Some(Ask::exact(policy_name, policy, partition, exact, control, Kind::Embeddings))
}

/// A REST call the cache may answer: its operation (`model`, its `METHOD /path`
/// template) and what it asks of it.
pub(super) struct RestView<'a> {
    pub model: &'a str,
    pub method: &'a http::Method,
    /// The path below the mount, and the query.
    pub path_and_query: &'a str,
    /// The request's body, read whole; `None` when it is longer than an entry may be.
    pub body: Option<&'a [u8]>,
}

/// The cache's part in a call to a REST operation whose contract names `policy_name`
/// (exact only: the method, the path and query, and the body are the key); `None`
/// when no policy applies, or it is bypassed (noted on `draft`).
pub(super) fn ask_rest(
    gateway: &Gateway,
    caller: &Caller,
    headers: &HeaderMap,
    sensitive: bool,
    policy_name: &str,
    view: RestView<'_>,
    draft: &mut Draft,
) -> Option<Ask> {
    let cache = gateway.config.ai.cache.as_ref()?;
    let policy = cache.policies.get(policy_name)?.clone();
    let policy_name = policy_name.to_owned();
    if let Some(note) = excluded(gateway, caller, sensitive, &policy) {
        return noted(draft, gateway, caller, &policy_name, note);
    }
    let control = CacheControl::read(headers);
    // A part of a resource is not the answer to its whole: not cached.
    let ranged = headers.contains_key(header::RANGE);
    let Some(body) =
        view.body.filter(|_| policy.mode == CacheMode::Exact && (control.read || control.write) && !ranged)
    else {
        return noted(draft, gateway, caller, &policy_name, Note::Bypass);
    };
    let exact = rest_key(view.method.as_str(), view.path_and_query, &negotiated(headers), body);
    let partition = partition(caller, &policy_name, &policy, view.model, &[0; 32]);
    Some(Ask::exact(policy_name, policy, partition, exact, control, Kind::Rest))
}

impl Ask {
    /// The ask of an exact-only call (embeddings, REST): its whole request is `exact`,
    /// with no message to embed, no guard and no completion allowance to check.
    fn exact(
        policy_name: String,
        policy: Arc<CachePolicy>,
        partition: Partition,
        exact: [u8; 32],
        control: CacheControl,
        kind: Kind,
    ) -> Ask {
        Ask {
            policy_name,
            policy,
            partition,
            probe: Probe { exact, vector: None, guard: 0 },
            message: String::new(),
            read: control.read,
            write: control.write,
            max_age: control.max_age,
            max_tokens: None,
            kind,
        }
    }
}

/// The request headers that choose among an operation's answers (its format, its
/// language, its encoding, what the body is), as they came: part of a REST key.
fn negotiated(headers: &HeaderMap) -> Vec<u8> {
    let mut chosen = Vec::new();
    for name in [header::CONTENT_TYPE, header::ACCEPT, header::ACCEPT_LANGUAGE, header::ACCEPT_ENCODING] {
        for value in headers.get_all(&name) {
            chosen.extend_from_slice(name.as_str().as_bytes());
            chosen.push(b':');
            chosen.extend_from_slice(value.as_bytes());
            chosen.push(b'\n');
        }
    }
    chosen
}

/// A REST call's exact key: its method, path and query, the headers that choose its
/// answer, and body, each prefixed by its length so that no two requests hash alike
/// by moving bytes across a boundary.
fn rest_key(method: &str, path_and_query: &str, negotiated: &[u8], body: &[u8]) -> [u8; 32] {
    let mut framed = Vec::with_capacity(method.len() + path_and_query.len() + negotiated.len() + body.len() + 32);
    for part in [method.as_bytes(), path_and_query.as_bytes(), negotiated, body] {
        framed.extend_from_slice(&(part.len() as u64).to_le_bytes());
        framed.extend_from_slice(part);
    }
    crate::cache::sha256(&framed)
}

/// Why a policy does not apply to this caller's call, if it does not.
fn excluded(gateway: &Gateway, caller: &Caller, sensitive: bool, policy: &CachePolicy) -> Option<Note> {
    let tenant = gateway.config.tenants.get(&caller.tenant)?;
    let agent = caller.agent.as_ref().and_then(|a| tenant.agents.get(a));
    if tenant.cache_off || agent.is_some_and(|a| a.cache_off) {
        return Some(Note::Off);
    }
    // Every store runs in the operator's own account: internal for `sensitive: allow`.
    (sensitive && !policy.sensitive_allowed).then_some(Note::Bypass)
}

fn noted(draft: &mut Draft, gateway: &Gateway, caller: &Caller, policy: &str, note: Note) -> Option<Ask> {
    gateway.metrics.cache_lookup(caller.tenant.as_str(), policy, note.as_str());
    draft.cache(note);
    None
}

fn partition(caller: &Caller, name: &str, policy: &CachePolicy, model: &str, context: &[u8; 32]) -> Partition {
    let agent = match policy.scope {
        CacheScope::Agent => caller.agent.as_ref().map(|a| a.as_str()),
        CacheScope::Tenant => None,
    };
    // Vectors of two embedding models are not comparable: a policy that changes its
    // `embed` starts a partition of its own.
    let model = match &policy.embed {
        Some(embed) => format!("{model}\u{0}{}\u{0}{}", embed.backend, embed.model),
        None => model.to_owned(),
    };
    Partition::new(caller.tenant.as_str(), agent, name, &model, context)
}

/// The request's context hash (everything but the last user message), that message's
/// text and its exact hash; `None` when the call cannot be cached.
fn chat_key(view: &ChatView<'_>) -> Option<([u8; 32], String, [u8; 32])> {
    let call = view.call?;
    let (last, earlier) = call.messages.split_last()?;
    if call.choices != 1 || last.role != Role::User {
        return None;
    }
    let mut text = String::new();
    for part in &last.parts {
        match part {
            Part::Text(t) => {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(t);
            }
            Part::Image(_) => {}
            Part::ToolCall(_) | Part::ToolResult { .. } => return None,
        }
    }
    let exact = crate::cache::sha256(&canonical(&json!(last.parts.iter().map(part).collect::<Vec<_>>())));
    let extra: Map<String, Value> = serde_json::from_slice::<Map<String, Value>>(view.raw)
        .ok()?
        .into_iter()
        .filter(|(k, _)| !view.modelled.contains(&k.as_str()))
        .collect();
    // What an entry does not keep cannot be asked of it: log probabilities, audio.
    let asks_more = |key: &str| extra.get(key).is_some_and(|v| !v.is_null() && *v != Value::Bool(false));
    if ["logprobs", "top_logprobs", "audio", "modalities", "prediction"].into_iter().any(asks_more) {
        return None;
    }
    // The last message's images are compared by content, never by meaning: a semantic
    // match of its text alone must not serve another picture's answer.
    let images: Vec<Value> = last.parts.iter().filter(|p| matches!(p, Part::Image(_))).map(part).collect();
    let context = json!({
        "last_images": images,
        "system": call.system,
        "turns": earlier.iter().map(|m| json!([m.role == Role::User, m.parts.iter().map(part).collect::<Vec<_>>()])).collect::<Vec<_>>(),
        "tools": call.tools.iter().map(|t| json!([t.name, t.description, t.parameters])).collect::<Vec<_>>(),
        "tool_choice": call.tool_choice.as_ref().map(|c| format!("{c:?}")),
        "stop": call.stop,
        "temperature": call.temperature,
        "top_p": call.top_p,
        "extra": extra,
    });
    Some((crate::cache::sha256(&canonical(&context)), text, exact))
}

/// A message part as the cache hashes it: an image by the hash of its content.
fn part(part: &Part) -> Value {
    use crate::protocol::chat::Image;
    match part {
        Part::Text(t) => json!({"text": t}),
        Part::Image(Image::Data { media_type, base64 }) => {
            json!({"image": hex::encode(crate::cache::sha256(base64.as_bytes())), "type": media_type})
        }
        Part::Image(Image::Url(url)) => json!({"image_url": hex::encode(crate::cache::sha256(url.as_bytes()))}),
        Part::ToolCall(c) => json!({"call": [c.id, c.name, c.arguments]}),
        Part::ToolResult { call_id, content } => json!({"result": [call_id, content]}),
    }
}

/// JSON with its object keys sorted (serde_json's map is ordered by key), so that two
/// requests that differ only in the order of their fields hash alike.
fn canonical(value: &Value) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// `Cache-Control` as the caller sent it (SPEC §16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CacheControl {
    read: bool,
    write: bool,
    max_age: Option<u64>,
}

impl CacheControl {
    fn read(headers: &HeaderMap) -> CacheControl {
        let mut control = CacheControl { read: true, write: true, max_age: None };
        for value in headers.get_all(header::CACHE_CONTROL) {
            for directive in value.to_str().unwrap_or("").split(',').map(str::trim) {
                let lower = directive.to_ascii_lowercase();
                match lower.split_once('=') {
                    None if lower == "no-cache" => control.read = false,
                    None if lower == "no-store" => control.write = false,
                    Some(("max-age", n)) => match n.trim_matches('"').parse::<u64>() {
                        Ok(n) => control.max_age = Some(control.max_age.map_or(n, |m| m.min(n))),
                        // A max-age that is not a number serves nothing stale: none.
                        Err(_) => control.read = false,
                    },
                    _ => {}
                }
            }
        }
        control
    }
}

/// What a hit needs to be rendered in the caller's format.
pub(super) struct Render<'a> {
    pub format: &'a Format,
    pub stream: bool,
    pub client_wants_usage: bool,
    pub request_id: &'a str,
    pub model: &'a str,
}

/// The lookup, after the call's reservation and before its attempt chain. A store
/// that fails, an entry that does not open, one its caller's residency excludes or one
/// longer than its allowance: a miss.
pub(super) async fn lookup(
    call: super::drive::Call<'_>,
    draft: &mut Draft,
    headers: &HeaderMap,
    ask: Ask,
    residency: &Residency,
    render: Render<'_>,
) -> Looked {
    looked_up(call, draft, headers, ask, residency, |plain| rendered(plain, &render)).await
}

/// The lookup of a REST call (see [`lookup`]): a hit is the stored answer, its status,
/// `Content-Type` and body.
pub(super) async fn lookup_rest(
    call: super::drive::Call<'_>,
    draft: &mut Draft,
    headers: &HeaderMap,
    ask: Ask,
    residency: &Residency,
) -> Looked {
    looked_up(call, draft, headers, ask, residency, rest_rendered).await
}

async fn looked_up(
    call: super::drive::Call<'_>,
    draft: &mut Draft,
    headers: &HeaderMap,
    ask: Ask,
    residency: &Residency,
    render: impl FnOnce(&Plain) -> Response,
) -> Looked {
    let gateway = &**call.gateway;
    let Some(cache) = gateway.cache.as_ref() else {
        return Looked::Miss(None);
    };
    let tenant = call.caller.tenant.as_str();
    let mut ask = ask;
    blind(cache, &mut ask);
    if ask.read {
        match find(call, headers, cache, &mut ask).await {
            Ok(Some((plain, similarity, stored_at)))
                if residency.allows_jurisdiction(plain.jurisdiction.as_deref())
                    && ask.max_tokens.is_none_or(|max| plain.completion_tokens <= max) =>
            {
                let now = unix_seconds();
                let saved = MicroEur(plain.cost);
                let age_s = now.saturating_sub(stored_at);
                gateway.metrics.cache_lookup(tenant, &ask.policy_name, "hit");
                let charged = MicroEur(
                    u64::try_from(u128::from(plain.cost) * u128::from(ask.policy.charge_ppm) / 1_000_000)
                        .unwrap_or(u64::MAX),
                );
                let note = Note::Hit { similarity, age_s, saved };
                let response = render(&plain);
                draft.cache(note);
                let finish = if ask.kind == Kind::Chat { vec![Finish::Stop] } else { Vec::new() };
                let status = response.status().as_u16();
                let ended =
                    Ended { status, code: None, spent: Spent::Cached { charged, saved }, finish_reasons: finish };
                return Looked::Hit(response, ended);
            }
            Ok(_) => gateway.metrics.cache_lookup(tenant, &ask.policy_name, "miss"),
            Err(operation) => {
                gateway.metrics.cache_lookup(tenant, &ask.policy_name, "error");
                gateway.metrics.cache_store_failed(operation);
            }
        }
    } else {
        gateway.metrics.cache_lookup(tenant, &ask.policy_name, "miss");
    }
    draft.cache(Note::Miss);
    Looked::Miss(ask.write.then(|| Box::new(Pending { ask })))
}

/// The entry of the call's partition that answers it, opened; `Err` with what failed
/// (`lookup`, `embed`) when the store or the embedding call did.
async fn find(
    call: super::drive::Call<'_>,
    headers: &HeaderMap,
    cache: &ResponseCache,
    ask: &mut Ask,
) -> Result<Option<(Plain, f32, u64)>, &'static str> {
    let now = unix_seconds();
    let stored_since = ask.max_age.map_or(0, |age| now.saturating_sub(age));
    let threshold = ask.policy.threshold;
    let lookup = Lookup { partition: &ask.partition, probe: &ask.probe, threshold, stored_since, now };
    // The exact entry first: a byte-equal message needs no embedding.
    let found = cache.call("lookup", cache.store.lookup(&lookup)).await?;
    let found = match (found, ask.policy.mode) {
        (Some(found), _) => Some(found),
        (None, CacheMode::Semantic) if cache.store.semantic() => {
            let Some(vector) = embedding(call, headers, &ask.policy, &ask.message).await else {
                return Err("embed");
            };
            ask.probe.vector = Some(vector);
            let lookup = Lookup { partition: &ask.partition, probe: &ask.probe, threshold, stored_since, now };
            cache.call("lookup", cache.store.lookup(&lookup)).await?
        }
        (None, _) => None,
    };
    let Some(found) = found else { return Ok(None) };
    let Some(plain) = cache.keys().open(&ask.partition, &found.exact, &found.sealed) else {
        return Ok(None);
    };
    let plain: Plain = serde_json::from_slice(&plain).map_err(|_| "lookup")?;
    Ok((plain.kind == ask.kind).then_some((plain, found.similarity, found.stored_at)))
}

/// A hit, in the caller's format: a whole answer, or a well-formed stream of it.
fn rendered(plain: &Plain, render: &Render<'_>) -> Response {
    let (content_type, body) = match plain.kind {
        Kind::Embeddings => ("application/json", Bytes::from(plain.text.clone())),
        Kind::Rest => return rest_rendered(plain),
        Kind::Chat => {
            let id = format!("chatcmpl-{}", render.request_id);
            let tokens = Tokens { input: plain.prompt_tokens, output: plain.completion_tokens, ..Tokens::default() };
            if render.stream {
                let mut writer = render.format.writer(Wire::OpenAi, render.client_wants_usage);
                let deltas = vec![
                    Delta::Start { id, model: render.model.to_owned() },
                    Delta::Text(plain.text.clone()),
                    Delta::Finish(Finish::Stop),
                    Delta::Usage(tokens),
                    Delta::Done,
                ];
                let body = writer.write(&Bytes::new(), deltas).unwrap_or_default();
                ("text/event-stream", body)
            } else {
                let completion = Completion {
                    id,
                    model: render.model.to_owned(),
                    text: Some(plain.text.clone()),
                    tool_calls: Vec::new(),
                    finish: Some(Finish::Stop),
                    usage: Some(tokens),
                };
                ("application/json", Bytes::from(render.format.render(&completion).to_string()))
            }
        }
    };
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A REST hit: the stored status, `Content-Type` and body.
fn rest_rendered(plain: &Plain) -> Response {
    let mut response = Response::new(Body::from(plain.text.clone()));
    *response.status_mut() = plain.status.and_then(|s| StatusCode::from_u16(s).ok()).unwrap_or(StatusCode::OK);
    if let Some(value) = plain.content_type.as_deref().and_then(|v| HeaderValue::from_str(v).ok()) {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    response
}

/// At the call's end: keeps `kept` under `pending` if it is a complete answer (SPEC
/// §16: 2xx, one choice finished by `stop`, no tool call, usage reported or the
/// stream ended properly, within `max_entry_bytes`). `Some(Note::Stored)` when kept.
pub(in crate::http) async fn store(
    gateway: &Gateway,
    pending: Pending,
    kept: Kept,
    backend: &crate::config::BackendId,
    usage: crate::call::Usage,
    cost: MicroEur,
    finish_reasons: &[Finish],
) -> Option<Note> {
    let cache = gateway.cache.as_ref()?;
    let Pending { ask } = pending;
    let (kind, text, status, content_type) = match kept {
        // An empty answer (a refusal, audio) is no answer to serve again.
        Kept::Chat(text) if finish_reasons == [Finish::Stop] && !text.is_empty() => (Kind::Chat, text, None, None),
        Kept::Chat(_) => return None,
        Kept::Body(body) => (Kind::Embeddings, String::from_utf8(body.to_vec()).ok()?, None, None),
        // A REST answer is kept 2xx only, and as UTF-8 text (a binary one is not kept).
        Kept::Rest { status, content_type, body } if (200..300).contains(&status) => {
            (Kind::Rest, String::from_utf8(body.to_vec()).ok()?, Some(status), content_type)
        }
        Kept::Rest { .. } => return None,
    };
    if text.len() as u64 > ask.policy.max_entry_bytes {
        return None;
    }
    let jurisdiction = gateway.config.ai.backends.get(backend).and_then(|b| b.jurisdiction.clone());
    let plain = Plain {
        kind,
        backend: backend.to_string(),
        jurisdiction,
        cost: cost.0,
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        text,
        status,
        content_type,
    };
    let bytes = serde_json::to_vec(&plain).ok()?;
    let sealed = cache.keys().seal(&ask.partition, &ask.probe, &bytes)?;
    let now = unix_seconds();
    let entry = crate::cache::Entry {
        partition: &ask.partition,
        probe: &ask.probe,
        sealed,
        stored_at: now,
        expires_at: now.saturating_add(ask.policy.ttl.as_secs().max(1)),
        max_entries_per_tenant: ask.policy.max_entries_per_tenant,
    };
    match cache.call("store", cache.store.store(entry)).await {
        Ok(()) => {
            gateway.metrics.cache_stored(&ask.partition.tenant, &ask.policy_name);
            Some(Note::Stored)
        }
        Err(operation) => {
            gateway.metrics.cache_store_failed(operation);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn control(values: &[&str]) -> CacheControl {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(header::CACHE_CONTROL, HeaderValue::from_str(v).unwrap());
        }
        CacheControl::read(&headers)
    }

    #[test]
    fn cache_control_is_read_as_the_caller_wrote_it() {
        assert_eq!(control(&[]), CacheControl { read: true, write: true, max_age: None });
        assert_eq!(control(&["no-cache"]), CacheControl { read: false, write: true, max_age: None });
        assert_eq!(control(&["No-Store"]), CacheControl { read: true, write: false, max_age: None });
        assert_eq!(control(&["no-cache, no-store"]), CacheControl { read: false, write: false, max_age: None });
        assert_eq!(control(&["max-age=60", "max-age=30"]).max_age, Some(30));
        assert!(!control(&["max-age=soon"]).read, "an unreadable max-age serves nothing from the cache");
    }

    #[test]
    fn a_rest_key_tells_its_parts_apart() {
        let key = rest_key("POST", "/documents?lang=fr", b"", b"page");
        assert_eq!(key, rest_key("POST", "/documents?lang=fr", b"", b"page"));
        assert_ne!(key, rest_key("GET", "/documents?lang=fr", b"", b"page"));
        assert_ne!(key, rest_key("POST", "/documents?lang=en", b"", b"page"));
        assert_ne!(key, rest_key("POST", "/documents?lang=fr", b"", b"page two"));
        // Bytes moved across a boundary make another key.
        assert_ne!(rest_key("POST", "/a", b"", b"bc"), rest_key("POST", "/ab", b"", b"c"));
        // The answer's format and language are chosen by headers: part of the key.
        let mut headers = HeaderMap::new();
        headers.insert(header::ACCEPT, HeaderValue::from_static("application/xml"));
        assert_ne!(key, rest_key("POST", "/documents?lang=fr", &negotiated(&headers), b"page"));
    }

    #[test]
    fn a_hits_header_says_its_similarity_and_age() {
        let hit = Note::Hit { similarity: 0.97312, age_s: 120, saved: MicroEur(5) };
        assert_eq!(hit.header(), "hit; similarity=0.973; age=120");
        assert_eq!(Note::Stored.header(), "stored");
        assert_eq!(Note::Off.as_str(), "off");
    }
}
