//! Realtime sessions (SPEC §2.3): what the gateway reads of the OpenAI realtime event
//! protocol, and the registry of open sessions. The proxy itself is `http::realtime`.
//!
//! The gateway reads only what it meters and what it bounds: a backend's text message
//! is parsed only when it may be a response's start or end or an `error` (a substring
//! test first), and of those only the type, the response's id and its usage are read
//! (and, while a response refused at its start is being cancelled, which response an
//! event belongs to). A client's text message is parsed only when it may be
//! a `session.update` or a `response.create`, the two events that set how much a
//! response may write: the gateway lowers that limit to the output allowance the
//! session holds (SPEC §2.3), so that no response can write past a hard cap. Every
//! other message, of either side, is forwarded untouched.
//!
//! The registry lets the process stop cleanly: on SIGTERM `flexway serve` asks every
//! open session to close (1001, `shutdown`) and waits for them to settle their budget
//! and write their audit record, so no session is cut without both.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::sync::watch;

use crate::audit::CloseReason;
use crate::protocol::openai::Usage;

/// The close frame the gateway sends the client when `reason` ends its session (code,
/// reason text); `None` when a side closed it itself (the backend's own close frame is
/// relayed as it came).
pub fn close_frame(reason: CloseReason) -> Option<(u16, &'static str)> {
    let code = match reason {
        CloseReason::ClientClosed | CloseReason::UpstreamClosed => return None,
        // "internal error": the backend dropped the session or broke the protocol, or
        // the gateway could not reserve the next response's allowance.
        CloseReason::UpstreamError | CloseReason::Internal => 1011,
        CloseReason::BudgetExceeded => 4429,
        // "message too big", whichever side sent it.
        CloseReason::MessageTooLarge => 1009,
        // "going away".
        CloseReason::Shutdown => 1001,
    };
    Some((code, reason.as_str()))
}

/// What the gateway reads of a backend's event: a response's start and end, and an
/// `error`; every other event is [`Event::Other`], passed on unread.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// `response.created`: a response started, asked for by the client or started by
    /// the backend on its own (server voice activity detection).
    Created {
        id: String,
    },
    /// `response.done`: the response ended, with the usage it reports (none when it
    /// reports none).
    Done {
        id: Option<String>,
        usage: Option<Usage>,
    },
    /// An `error` event (the backend refused something the client sent).
    Error,
    Other,
}

/// Reads a backend's text event (see [`Event`]): parsed only when a substring test says
/// it may be one the gateway reads.
pub fn read_event(text: &str) -> Event {
    #[derive(Deserialize)]
    struct Raw<'a> {
        #[serde(rename = "type", borrow)]
        kind: std::borrow::Cow<'a, str>,
        response: Option<Response>,
    }
    #[derive(Deserialize)]
    struct Response {
        id: Option<String>,
        usage: Option<RealtimeUsage>,
    }
    #[derive(Deserialize)]
    struct RealtimeUsage {
        #[serde(default)]
        input_tokens: u64,
        #[serde(default)]
        output_tokens: u64,
    }
    if !text.contains("response.done") && !text.contains("response.created") && !text.contains("error") {
        return Event::Other;
    }
    let Ok(event) = serde_json::from_str::<Raw<'_>>(text) else { return Event::Other };
    match event.kind.as_ref() {
        "response.created" => match event.response.and_then(|r| r.id) {
            Some(id) => Event::Created { id },
            None => Event::Other,
        },
        "response.done" => {
            let (id, usage) = event.response.map_or((None, None), |r| (r.id, r.usage));
            let usage = usage.map(|u| Usage::new(u.input_tokens, u.output_tokens));
            Event::Done { id, usage }
        }
        "error" => Event::Error,
        _ => Event::Other,
    }
}

/// Whether a backend's event is one of response `id`'s: its `response_id`, or its
/// `response.id`, is `id`.
pub fn of_response(text: &str, id: &str) -> bool {
    #[derive(Deserialize)]
    struct Raw {
        response_id: Option<String>,
        response: Option<Response>,
    }
    #[derive(Deserialize)]
    struct Response {
        id: Option<String>,
    }
    text.contains(id)
        && serde_json::from_str::<Raw>(text)
            .is_ok_and(|e| e.response_id.as_deref() == Some(id) || e.response.and_then(|r| r.id).as_deref() == Some(id))
}

/// The `response.cancel` the gateway sends a backend for response `id`, one it started
/// on its own while no allowance could be reserved for it.
pub fn cancel_event(id: &str) -> String {
    serde_json::json!({"type": "response.cancel", "response_id": id}).to_string()
}

/// Whether a client's event is a `response.create` (what asks for a response, so what
/// must hold an allowance first).
pub fn is_response_create(text: &str) -> bool {
    #[derive(Deserialize)]
    struct Event<'a> {
        #[serde(rename = "type", borrow)]
        kind: std::borrow::Cow<'a, str>,
    }
    text.contains("response.create")
        && serde_json::from_str::<Event<'_>>(text).is_ok_and(|e| e.kind == "response.create")
}

/// OpenAI's `rate_limits.updated` event for a caller's windows (SPEC §14), sent after
/// each `response.done`.
pub fn rate_limits_updated(pace: &crate::budget::plan::Pace, now: u64) -> String {
    let limits: Vec<serde_json::Value> = [("requests", pace.requests), ("tokens", pace.tokens)]
        .into_iter()
        .filter_map(|(name, gauge)| {
            let gauge = gauge?;
            Some(serde_json::json!({
                "name": name,
                "limit": gauge.limit,
                "remaining": gauge.remaining,
                "reset_seconds": gauge.resets_at.saturating_sub(now),
            }))
        })
        .collect();
    serde_json::json!({"type": "rate_limits.updated", "rate_limits": limits}).to_string()
}

/// The `error` event a `response.create` that may not run is answered with (past a
/// limit: `rate_limit_exceeded`; its run ended: `run_ended`): the session stays open,
/// and the client may ask again (once the window turns).
pub fn refusal_event(code: crate::call::ErrorCode, message: &str) -> String {
    serde_json::json!({
        "type": "error",
        "error": {"type": code.as_str(), "code": code.as_str(), "message": message},
    })
    .to_string()
}

/// A client's `session.update` or `response.create` rewritten to carry at most
/// `allowance` output tokens: the limit it sets (`session.max_response_output_tokens`,
/// or `session.max_output_tokens` where the client uses that name;
/// `response.max_output_tokens`) lowered to the allowance when larger, and set to it
/// when absent, `"inf"` or not a count. `None` when the message is left as it is: any
/// other event, a limit already within the allowance, or text that is not such an
/// event (the backend refuses it on its own terms). The event's other fields are kept
/// as the client wrote them (their keys in order).
pub fn with_allowance(text: &str, allowance: u64) -> Option<String> {
    type Fields = BTreeMap<String, Box<RawValue>>;
    if !text.contains("session.update") && !text.contains("response.create") {
        return None;
    }
    let mut event: Fields = serde_json::from_str(text).ok()?;
    let kind: &str = serde_json::from_str(event.get("type")?.get()).ok()?;
    let (object, field) = match kind {
        "session.update" => ("session", "max_response_output_tokens"),
        "response.create" => ("response", "max_output_tokens"),
        _ => return None,
    };
    let mut inner: Fields = match event.get(object) {
        Some(raw) => serde_json::from_str(raw.get()).ok()?,
        None => Fields::new(),
    };
    let field =
        if object == "session" && inner.contains_key("max_output_tokens") { "max_output_tokens" } else { field };
    let asked = inner.get(field).and_then(|raw| serde_json::from_str::<u64>(raw.get()).ok());
    if asked.is_some_and(|asked| asked <= allowance) {
        return None;
    }
    inner.insert(field.to_owned(), RawValue::from_string(allowance.to_string()).ok()?);
    event.insert(object.to_owned(), serde_json::value::to_raw_value(&inner).ok()?);
    serde_json::to_string(&event).ok()
}

/// The key a browser sends in the `openai-insecure-api-key.` subprotocol, if any.
pub fn subprotocol_key(protocols: &http::HeaderValue) -> Option<&str> {
    protocols.to_str().ok()?.split(',').map(str::trim).find_map(|p| p.strip_prefix(SUBPROTOCOL_KEY_PREFIX))
}

/// The subprotocol prefix of a key sent by a browser (which cannot set headers on a
/// WebSocket): `openai-insecure-api-key.<key>`.
pub const SUBPROTOCOL_KEY_PREFIX: &str = "openai-insecure-api-key.";

/// The open sessions of this process, and the signal that asks them to close.
#[derive(Debug)]
pub struct Sessions {
    stop: watch::Sender<bool>,
    open: watch::Sender<usize>,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions { stop: watch::Sender::new(false), open: watch::Sender::new(0) }
    }
}

/// A session counted open until dropped.
#[derive(Debug)]
pub struct Open<'a> {
    sessions: &'a Sessions,
    pub stop: watch::Receiver<bool>,
}

impl Sessions {
    /// Counts a session open; it is asked to close through `stop`.
    pub fn open(&self) -> Open<'_> {
        self.open.send_modify(|n| *n += 1);
        Open { sessions: self, stop: self.stop.subscribe() }
    }

    /// How many sessions are open.
    pub fn count(&self) -> usize {
        *self.open.borrow()
    }

    /// Asks every session to close, and waits up to `within` for them to end
    /// (settled and recorded). Sessions opened after this are closed at once.
    pub async fn close_all(&self, within: Duration) {
        self.stop.send_replace(true);
        let mut open = self.open.subscribe();
        let _ = tokio::time::timeout(within, open.wait_for(|n| *n == 0)).await;
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.sessions.open.send_modify(|n| *n = n.saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_the_gateway_ends_is_closed_with_its_reasons_code() {
        assert_eq!(close_frame(CloseReason::BudgetExceeded), Some((4429, "budget_exceeded")));
        assert_eq!(close_frame(CloseReason::MessageTooLarge), Some((1009, "message_too_large")));
        assert_eq!(close_frame(CloseReason::UpstreamError), Some((1011, "upstream_error")));
        assert_eq!(close_frame(CloseReason::Internal), Some((1011, "internal_error")));
        assert_eq!(close_frame(CloseReason::Shutdown), Some((1001, "shutdown")));
        assert_eq!(close_frame(CloseReason::ClientClosed), None);
        assert_eq!(close_frame(CloseReason::UpstreamClosed), None);
    }

    #[test]
    fn reads_the_start_and_end_of_a_response_and_errors_only() {
        let done = r#"{"type":"response.done","event_id":"e1","response":{"id":"r1","status":"completed",
            "output":[{"type":"message","content":[{"type":"text","text":"response.done"}]}],
            "usage":{"total_tokens":57,"input_tokens":40,"output_tokens":17,"input_token_details":{"audio_tokens":30}}}}"#;
        assert_eq!(read_event(done), Event::Done { id: Some("r1".into()), usage: Some(Usage::new(40, 17)) });
        let delta = r#"{"type":"response.output_text.delta","delta":"the word response.done in a reply"}"#;
        assert_eq!(read_event(delta), Event::Other);
        let cancelled = r#"{"type":"response.done","response":{"id":"r2","status":"cancelled"}}"#;
        assert_eq!(read_event(cancelled), Event::Done { id: Some("r2".into()), usage: None });
        assert_eq!(read_event("response.done, not json"), Event::Other);
        let created = r#"{"type":"response.created","response":{"id":"r3","status":"in_progress"}}"#;
        assert_eq!(read_event(created), Event::Created { id: "r3".into() });
        assert_eq!(read_event(r#"{"type":"error","error":{"code":"x"}}"#), Event::Error);
        assert_eq!(read_event(r#"{"type":"response.output_text.delta","delta":"error"}"#), Event::Other);
    }

    #[test]
    fn knows_the_events_of_a_response() {
        let delta = r#"{"type":"response.output_text.delta","response_id":"r1","delta":"r2"}"#;
        assert!(of_response(delta, "r1"));
        assert!(!of_response(delta, "r2"), "its id only, not its text");
        assert!(of_response(r#"{"type":"response.done","response":{"id":"r1","status":"cancelled"}}"#, "r1"));
        assert!(!of_response(r#"{"type":"conversation.item.created","item":{"id":"r1"}}"#, "r1"));
        let cancel: serde_json::Value = serde_json::from_str(&cancel_event("r1")).unwrap();
        assert_eq!(cancel, serde_json::json!({"type": "response.cancel", "response_id": "r1"}));
    }

    #[test]
    fn the_limits_a_client_sets_are_lowered_to_the_allowance() {
        let rewritten =
            |text: &str| with_allowance(text, 50).map(|t| serde_json::from_str::<serde_json::Value>(&t).unwrap());
        // Absent, "inf", larger, or not a count: the allowance.
        let create = rewritten(r#"{"type":"response.create"}"#).unwrap();
        assert_eq!(create, serde_json::json!({"type": "response.create", "response": {"max_output_tokens": 50}}));
        for limit in [r#""inf""#, "4096", "-1", "12.5", "null"] {
            let text = format!(
                r#"{{"type":"session.update","session":{{"instructions":"Be brief.","max_response_output_tokens":{limit}}}}}"#
            );
            let update = rewritten(&text).unwrap();
            assert_eq!(update["session"]["max_response_output_tokens"], 50, "{limit}");
            assert_eq!(update["session"]["instructions"], "Be brief.", "{limit}");
        }
        let update =
            rewritten(r#"{"type":"session.update","session":{"type":"realtime","max_output_tokens":"inf"}}"#).unwrap();
        assert_eq!(
            update["session"],
            serde_json::json!({"type": "realtime", "max_output_tokens": 50}),
            "the client's own name"
        );
        let update = rewritten(r#"{"type":"session.update"}"#).unwrap();
        assert_eq!(update["session"]["max_response_output_tokens"], 50);
        // Within the allowance, or not one of the two events: untouched.
        assert_eq!(with_allowance(r#"{"type":"response.create","response":{"max_output_tokens":20}}"#, 50), None);
        assert_eq!(with_allowance(r#"{"type":"response.create","response":{"max_output_tokens":50}}"#, 50), None);
        let item = r#"{"type":"conversation.item.create","item":{"content":[{"type":"input_text","text":"response.create"}]}}"#;
        assert_eq!(with_allowance(item, 50), None);
        assert_eq!(with_allowance(r#"{"type":"response.cancel","note":"session.update"}"#, 50), None);
        assert_eq!(with_allowance("response.create, not json", 50), None);
        assert_eq!(with_allowance(r#"{"type":"response.create","response":"not an object"}"#, 50), None);
    }

    #[test]
    fn the_other_fields_keep_their_text() {
        let text = r#"{"type":"response.create","event_id":"e 1","response":{"instructions":"Say \u00e9.","tools":[ {"a" : 1.50} ]}}"#;
        let rewritten = with_allowance(text, 7).unwrap();
        assert_eq!(
            rewritten,
            r#"{"event_id":"e 1","response":{"instructions":"Say \u00e9.","max_output_tokens":7,"tools":[ {"a" : 1.50} ]},"type":"response.create"}"#
        );
    }

    #[test]
    fn finds_the_key_among_the_subprotocols() {
        let offered =
            http::HeaderValue::from_static("realtime, openai-insecure-api-key.sk-123, openai-beta.realtime-v1");
        assert_eq!(subprotocol_key(&offered), Some("sk-123"));
        assert_eq!(subprotocol_key(&http::HeaderValue::from_static("realtime")), None);
    }
}
