//! The fake realtime upstream: `GET /v1/realtime?model=M` upgraded to a WebSocket
//! that speaks enough of OpenAI's realtime event protocol for the gateway's tests.
//!
//! On open it sends `session.created`. A `response.create` is answered with
//! `response.created`, one `response.output_text.delta` per output token, and
//! `response.done` whose `usage` reports `input_tokens` (default 20) input tokens
//! and `words` (default 5) output tokens, or fewer when it was told a lower limit,
//! as a real server obeys one:
//! the `response.create`'s `response.max_output_tokens`, else the last
//! `session.update`'s `session.max_response_output_tokens` (or `max_output_tokens`);
//! `"inf"` lifts it, and `ignore_limit` makes it write `words` whatever it was told.
//! An `input_audio_buffer.commit` starts a response on its own, as a server with
//! voice activity detection does (bounded by the session's limit only).
//! A `response.create` whose `response.metadata` has `fake_hold` leaves its response
//! running after its deltas, its `response.done` sent when `{"type":"fake.finish"}`
//! comes; while it runs, a `response.create` is refused with an `error` event
//! (`conversation_already_has_active_response`), as a real server refuses a second
//! active response (not one out of band, `response.conversation: "none"`: that one
//! runs all the same). One whose metadata has `fake_silent` is never answered.
//! `{"type":"fake.close","code":C,"reason":R}` makes it close the
//! session with that code and reason. Every other text message (a `session.update`
//! included), and every binary one, is echoed back unchanged, so a test sees what the
//! gateway forwarded.
//!
//! Scenario keys: `status` refuses the handshake with that status; `delay_ms`
//! delays it; `cut_after=N` drops the TCP connection (no close frame) when the
//! (N+1)th `response.create` arrives, after N complete responses; `huge_mb=N`
//! answers a `response.create` with one text message of N MiB first.

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::scenario::Scenario;

/// Input tokens each response reports.
pub const INPUT_TOKENS: u64 = 20;
/// Output tokens each response reports unless `words` says otherwise.
pub const OUTPUT_TOKENS: u64 = 5;

pub(crate) async fn respond(scenario: Scenario, upgrade: Option<WebSocketUpgrade>, model: String) -> Response {
    if let Some(ms) = scenario.delay_ms {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    if let Some(status) = scenario.status.and_then(|s| StatusCode::from_u16(s).ok()).filter(|s| !s.is_success()) {
        let body = json!({"error": {"message": format!("fake-model injected status {}", status.as_u16()),
            "type": "fake", "param": null, "code": format!("injected_{}", status.as_u16())}});
        return (status, axum::Json(body)).into_response();
    }
    let Some(upgrade) = upgrade else {
        let body = json!({"error": {"message": "/v1/realtime is a WebSocket", "type": "invalid_request_error",
            "param": null, "code": "not_websocket"}});
        return (StatusCode::BAD_REQUEST, axum::Json(body)).into_response();
    };
    upgrade.max_message_size(64 << 20).on_upgrade(move |socket| session(socket, scenario, model))
}

async fn session(mut socket: WebSocket, scenario: Scenario, model: String) {
    let created = json!({"type": "session.created", "event_id": "evt_fake_0", "session": {"model": model}});
    if socket.send(text(&created)).await.is_err() {
        return;
    }
    let mut responses = 0usize;
    // The output limit the last `session.update` set, if any.
    let mut session_limit: Option<u64> = None;
    // A `fake_hold` response still running: its id and output tokens.
    let mut running: Option<(String, u64)> = None;
    while let Some(Ok(message)) = socket.recv().await {
        let reply = match message {
            Message::Text(body) => {
                let event: Value = serde_json::from_str(body.as_str()).unwrap_or(Value::Null);
                match event["type"].as_str() {
                    Some("session.update") => {
                        let session = &event["session"];
                        let limit =
                            session.get("max_response_output_tokens").or_else(|| session.get("max_output_tokens"));
                        if let Some(limit) = limit {
                            session_limit = limit.as_u64();
                        }
                        Message::Text(body)
                    }
                    Some(kind @ ("response.create" | "input_audio_buffer.commit")) => {
                        if scenario.cut_after == Some(responses) {
                            // Dropped without a close frame: the connection is cut.
                            return;
                        }
                        let metadata = &event["response"]["metadata"];
                        if kind == "response.create" && metadata.get("fake_silent").is_some() {
                            continue;
                        }
                        let out_of_band = event["response"]["conversation"] == "none";
                        if running.is_some() && !out_of_band {
                            let error = json!({"type": "error", "error": {"type": "invalid_request_error",
                                "code": "conversation_already_has_active_response",
                                "message": "Conversation already has an active response in progress"}});
                            if socket.send(text(&error)).await.is_err() {
                                return;
                            }
                            continue;
                        }
                        responses += 1;
                        let asked =
                            (kind == "response.create").then(|| event["response"]["max_output_tokens"].as_u64());
                        let limit = asked.flatten().or(session_limit);
                        let words = scenario.words.map_or(OUTPUT_TOKENS, |w| w as u64);
                        let output = match limit {
                            Some(limit) if !scenario.ignore_limit => words.min(limit),
                            _ => words,
                        };
                        let id = format!("resp_fake_{responses}");
                        if start_response(&mut socket, &scenario, &id, output).await.is_err() {
                            return;
                        }
                        if kind == "response.create" && metadata.get("fake_hold").is_some() {
                            running = Some((id, output));
                        } else if end_response(&mut socket, &scenario, &id, output).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Some("fake.finish") => {
                        if let Some((id, output)) = running.take()
                            && end_response(&mut socket, &scenario, &id, output).await.is_err()
                        {
                            return;
                        }
                        continue;
                    }
                    Some("fake.close") => {
                        let code = event["code"].as_u64().and_then(|c| u16::try_from(c).ok()).unwrap_or(1000);
                        let reason = Utf8Bytes::from(event["reason"].as_str().unwrap_or_default());
                        let _ = socket.send(Message::Close(Some(CloseFrame { code, reason }))).await;
                        // Wait for the other side's close, as a server does.
                        while let Some(Ok(message)) = socket.recv().await {
                            if matches!(message, Message::Close(_)) {
                                break;
                            }
                        }
                        return;
                    }
                    _ => Message::Text(body),
                }
            }
            Message::Binary(data) => Message::Binary(data),
            Message::Close(_) => return,
            Message::Ping(_) | Message::Pong(_) => continue,
        };
        if socket.send(reply).await.is_err() {
            return;
        }
    }
}

/// A response's `response.created` and its deltas.
async fn start_response(socket: &mut WebSocket, scenario: &Scenario, id: &str, output: u64) -> Result<(), axum::Error> {
    if let Some(mb) = scenario.huge_mb {
        let huge = format!(r#"{{"type":"response.output_text.delta","delta":"{}"}}"#, "a".repeat(mb << 20));
        socket.send(Message::Text(huge.into())).await?;
    }
    socket.send(text(&json!({"type": "response.created", "response": {"id": id, "status": "in_progress"}}))).await?;
    for i in 0..output {
        let delta = json!({"type": "response.output_text.delta", "response_id": id, "delta": format!("w{} ", i + 1)});
        socket.send(text(&delta)).await?;
    }
    Ok(())
}

/// A response's `response.done`, with its usage.
async fn end_response(socket: &mut WebSocket, scenario: &Scenario, id: &str, output: u64) -> Result<(), axum::Error> {
    let input = scenario.input_tokens.unwrap_or(INPUT_TOKENS);
    let done = json!({"type": "response.done", "response": {"id": id, "status": "completed",
        "usage": {"total_tokens": input + output, "input_tokens": input, "output_tokens": output}}});
    socket.send(text(&done)).await
}

fn text(event: &Value) -> Message {
    Message::Text(event.to_string().into())
}
