//! A realtime session's client side: its next event and one response.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

/// A realtime WebSocket session, as `tokio_tungstenite::connect_async` opens it.
pub type Session = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// The next text event, as JSON; a close frame as `{"close": [code, reason]}`, a
/// binary message as `{"binary": len}`. Fails the test after 10 s without one.
pub async fn next_event(session: &mut Session) -> Value {
    loop {
        let message = tokio::time::timeout(Duration::from_secs(10), session.next()).await.unwrap().unwrap().unwrap();
        match message {
            Message::Text(text) => return serde_json::from_str(text.as_str()).unwrap(),
            Message::Close(frame) => return json!({"close": frame.map(|f| (u16::from(f.code), f.reason.to_string()))}),
            Message::Binary(data) => return json!({"binary": data.len()}),
            _ => continue,
        }
    }
}

/// Sends `response.create` and reads up to its `response.done` (or the session's
/// close): that event.
pub async fn one_response(session: &mut Session) -> Value {
    session.send(Message::text(json!({"type": "response.create"}).to_string())).await.unwrap();
    loop {
        let event = next_event(session).await;
        if event["type"] == "response.done" || event.get("close").is_some() {
            return event;
        }
    }
}
