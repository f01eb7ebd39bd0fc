//! Realtime sessions over WebSocket (SPEC §2.3), end to end: the real `flexway`
//! binary (or, where a test reads the ledger, the same router in process) in front of
//! the fake realtime upstream, a tokio-tungstenite client on the other side.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use flexway::audit::{AuditRecord, BudgetState, CloseReason, Operation};
use flexway::budget::MemoryBudgetStore;
use flexway::budget::conformance::{Slow, Slowed};
use flexway_testkit::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

use flexway_testkit::realtime::{Session as Client, next_event, one_response};

/// `acme` with `budgets`, one backend `rt` at `url` serving chat and realtime
/// (1 € / 2 € per million tokens), allowances of 50 tokens (at least 10).
fn realtime_config(url: &str, budgets: &str, extra_ai: &str) -> String {
    acme_config(
        budgets,
        &format!(
            "  default_backend: rt\n  budget: {{default_max_tokens: 50, min_completion_tokens: 10}}\n{extra_ai}  backends:\n    rt:\n      url: \"{url}\"\n      capabilities: [chat, realtime]\n      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}}\n"
        ),
    )
}

enum Auth<'a> {
    Bearer(&'a str),
    /// The browser's way: `realtime, openai-insecure-api-key.<key>`.
    Subprotocol(&'a str),
}

fn ws_url(base: &str, model: &str) -> String {
    format!("{}/v1/realtime?model={model}", base.replacen("http://", "ws://", 1))
}

async fn connect(
    base: &str,
    model: &str,
    auth: Auth<'_>,
) -> Result<(Client, tungstenite::http::Response<Option<Vec<u8>>>), tungstenite::Error> {
    let mut request = ws_url(base, model).into_client_request().unwrap();
    match auth {
        Auth::Bearer(key) => {
            request.headers_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
        }
        Auth::Subprotocol(key) => {
            let offered = format!("realtime, openai-insecure-api-key.{key}, openai-beta.realtime-v1");
            request.headers_mut().insert("sec-websocket-protocol", offered.parse().unwrap());
        }
    }
    tokio_tungstenite::connect_async(request).await
}

/// Reads until the session's close frame: its code and reason.
async fn close_frame(client: &mut Client) -> (u16, String) {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), client.next()).await.unwrap() {
            Some(Ok(Message::Close(Some(frame)))) => return (u16::from(frame.code), frame.reason.to_string()),
            Some(Ok(Message::Close(None))) | None => panic!("closed without a close frame"),
            Some(Ok(_)) => continue,
            Some(Err(e)) => panic!("no close frame: {e}"),
        }
    }
}

#[tokio::test]
async fn frames_pass_both_ways_untouched_and_the_session_is_one_audit_record() {
    let fake = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&realtime_config(&fake.url(), "{}", ""));
    let (mut client, response) = connect(&gw.url, "gpt-realtime", Auth::Bearer(KEY)).await.unwrap();
    assert_eq!(response.headers()["flexway-backend"], "rt");
    assert!(response.headers().contains_key("flexway-request-id"));
    let created = next_event(&mut client).await;
    assert_eq!(created["type"], "session.created");
    assert_eq!(created["session"]["model"], "gpt-realtime");

    // Text and binary messages reach the backend and come back byte for byte.
    let text = r#"{"type":"conversation.item.create","item":{"type":"message","content":[{"type":"input_text","text":"héllo"}]}}"#;
    client.send(Message::text(text)).await.unwrap();
    match client.next().await.unwrap().unwrap() {
        Message::Text(echo) => assert_eq!(echo.as_str(), text),
        other => panic!("{other:?}"),
    }
    let audio: Vec<u8> = (0..=255).cycle().take(40_000).collect();
    client.send(Message::binary(audio.clone())).await.unwrap();
    match client.next().await.unwrap().unwrap() {
        Message::Binary(echo) => assert_eq!(echo.as_ref(), audio.as_slice()),
        other => panic!("{other:?}"),
    }
    for _ in 0..2 {
        let done = one_response(&mut client).await;
        assert_eq!(done["response"]["usage"]["output_tokens"], 5, "{done}");
    }
    client.close(None).await.unwrap();

    let records = gw.records_until::<AuditRecord>(1).await;
    assert_eq!(records.len(), 1, "one record for the whole session: {records:?}");
    let record = &records[0];
    assert_eq!(record.operation, Operation::Realtime);
    assert_eq!(record.capability.as_str(), "realtime");
    assert_eq!(record.status, 101);
    assert_eq!(record.close_reason, Some(CloseReason::ClientClosed));
    assert_eq!(record.error_code, None);
    assert_eq!((record.prompt_tokens, record.completion_tokens), (40, 10));
    // 40 × 1 € + 10 × 2 € per million tokens.
    assert_eq!(record.cost_micro_eur, 60);
    assert_eq!(record.backend.as_deref(), Some("rt"));
    assert_eq!(record.model_requested.as_deref(), Some("gpt-realtime"));
    let line = &gw.stdout()[0];
    assert!(!line.contains("héllo") && !line.contains(KEY), "metadata only: {line}");
    let sent = fake.requests();
    assert_eq!(sent[0].path, "/v1/realtime");
    assert_eq!(sent[0].body["model"], "gpt-realtime");
    assert!(sent[0].header("authorization").is_none(), "the caller's key never goes upstream");
}

#[tokio::test]
async fn a_browser_authenticates_with_the_subprotocol_and_gets_realtime_back() {
    let fake = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&realtime_config(&fake.url(), "{}", ""));
    let (mut client, response) = connect(&gw.url, "m", Auth::Subprotocol(KEY)).await.unwrap();
    assert_eq!(response.headers()["sec-websocket-protocol"], "realtime", "the key's subprotocol is never echoed");
    assert_eq!(next_event(&mut client).await["type"], "session.created");
    one_response(&mut client).await;
    client.close(None).await.unwrap();
    let records = gw.records_until::<AuditRecord>(1).await;
    assert_eq!(records[0].tenant, "acme");
    assert_eq!((records[0].prompt_tokens, records[0].completion_tokens), (20, 5));

    for refused in [Auth::Bearer("sk-wrong"), Auth::Subprotocol("sk-wrong")] {
        match connect(&gw.url, "m", refused).await {
            Err(tungstenite::Error::Http(response)) => {
                assert_eq!(response.status(), 401);
                let body: Value = serde_json::from_slice(response.body().as_deref().unwrap()).unwrap();
                assert_eq!(body["error"]["code"], "invalid_api_key");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn a_session_over_budget_is_refused_with_a_plain_429_before_the_upgrade() {
    let fake = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&realtime_config(&fake.url(), "{tokens_per_day: 5}", ""));
    match connect(&gw.url, "m", Auth::Bearer(KEY)).await {
        Err(tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 429);
            assert!(response.headers().contains_key("retry-after"));
            let body: Value = serde_json::from_slice(response.body().as_deref().unwrap()).unwrap();
            assert_eq!(body["error"]["code"], "budget_exceeded");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fake.request_count(), 0, "the backend is never called");
    let records = gw.records_until::<AuditRecord>(1).await;
    assert_eq!((records[0].status, records[0].budget_state), (429, BudgetState::Exceeded));
    assert_eq!(records[0].operation, Operation::Realtime);
}

#[tokio::test]
async fn each_response_is_charged_as_it_passes_and_the_hard_cap_closes_the_session_with_4429() {
    let fake = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    // Each response: 20 + 5 tokens. Each allowance is the last total (the next
    // prompt's floor) plus 50, clamped down to 10: after four responses (100 tokens)
    // 30 remain, less than 25 + 10, so the next response.create ends the session.
    let gw = serve_in_process(&realtime_config(&fake.url(), "{tokens_per_day: 130}", ""), adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    for n in 1..=3 {
        let done = one_response(&mut client).await;
        assert_eq!(done["type"], "response.done", "response {n}: {done}");
        assert!(gw.ledger("acme", None).await[0] <= 130, "used and reserved together stay under the cap");
    }
    let done = one_response(&mut client).await;
    assert_eq!(done["type"], "response.done", "the response that reached the cap is delivered whole");
    assert_eq!(one_response(&mut client).await["close"], json!([4429, "budget_exceeded"]));

    let records = audit_records_until(&audit, 1).await;
    let record = &records[0];
    assert_eq!(record.close_reason, Some(CloseReason::BudgetExceeded));
    assert_eq!(record.error_code.map(|c| c.as_str()), Some("budget_exceeded"));
    assert_eq!(record.budget_state, BudgetState::Exceeded);
    assert_eq!((record.prompt_tokens, record.completion_tokens), (80, 20));
    let [day, month, eur] = gw.ledger("acme", None).await;
    assert_eq!((day, month, eur), (100, 100, record.cost_micro_eur), "the ledger is the sum of the responses");
    assert_eq!(gw.live_reservations().await, 0, "nothing left reserved");

    // 30 tokens remain: a new session opens on an allowance clamped to them, and is
    // closed when it asks for a second response; then nothing fits and the next one is
    // refused.
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    assert_eq!(one_response(&mut client).await["type"], "response.done");
    assert_eq!(one_response(&mut client).await["close"][0], 4429);
    audit_records_until(&audit, 2).await;
    assert_eq!(gw.ledger("acme", None).await[0], 125);
    match connect(&gw.url, "m", Auth::Bearer(KEY)).await {
        Err(tungstenite::Error::Http(response)) => assert_eq!(response.status(), 429),
        other => panic!("{other:?}"),
    }
    assert_eq!(gw.live_reservations().await, 0);
}

/// Runs responses on `client` until the gateway closes it: each response's output
/// tokens, and the close frame.
async fn responses_until_closed(client: &mut Client, create: &Value) -> (Vec<u64>, (u16, String)) {
    let mut outputs = Vec::new();
    loop {
        if client.send(Message::text(create.to_string())).await.is_err() {
            return (outputs, close_frame(client).await);
        }
        loop {
            let event = next_event(client).await;
            if event["type"] == "response.done" {
                outputs.push(event["response"]["usage"]["output_tokens"].as_u64().unwrap());
                break;
            }
            if let Some(close) = event.get("close") {
                let (code, reason): (u16, String) = serde_json::from_value(close.clone()).unwrap();
                return (outputs, (code, reason));
            }
        }
    }
}

#[tokio::test]
async fn a_response_is_told_the_allowance_held_and_no_session_passes_a_hard_cap() {
    let fake = FakeModel::start().await.unwrap();
    // A backend that writes 500 tokens a response unless told less, and reads none
    // (so what the ledger holds is what the gateway bounds: the output).
    let url = fake.scenario_url(&Scenario { words: Some(500), input_tokens: Some(0), ..Default::default() });
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&realtime_config(&url, "{tokens_per_day: 200}", ""), adapters).await;

    // The client's own limits, each larger than the allowance of 50 or absent.
    let (mut a, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    let (mut b, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    let (mut c, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    for client in [&mut a, &mut b, &mut c] {
        assert_eq!(next_event(client).await["type"], "session.created");
    }
    let update = json!({"type": "session.update", "session": {"instructions": "Be brief.", "max_response_output_tokens": "inf"}});
    a.send(Message::text(update.to_string())).await.unwrap();
    let echoed = next_event(&mut a).await;
    assert_eq!(echoed["session"], json!({"instructions": "Be brief.", "max_response_output_tokens": 50}));
    let bare = json!({"type": "response.create"});
    let large = json!({"type": "response.create", "response": {"max_output_tokens": 4096}});
    let ((out_a, close_a), (out_b, close_b), (out_c, close_c)) = tokio::join!(
        responses_until_closed(&mut a, &bare),
        responses_until_closed(&mut b, &large),
        responses_until_closed(&mut c, &bare),
    );
    for (outputs, close) in [(&out_a, close_a), (&out_b, close_b), (&out_c, close_c)] {
        assert!(outputs.iter().all(|&o| o <= 50), "no response writes past the allowance: {outputs:?}");
        assert_eq!(close, (4429, "budget_exceeded".to_owned()));
    }
    let records = audit_records_until(&audit, 3).await;
    let used = gw.ledger("acme", None).await[0];
    assert!(used <= 200, "the hard cap of 200 tokens is never passed: {used}");
    let served: u64 = out_a.iter().chain(&out_b).chain(&out_c).sum();
    assert_eq!(used, served, "the ledger holds what was served");
    assert_eq!(records.iter().map(|r| r.completion_tokens).sum::<u64>(), served, "and the audit too");
    assert_eq!(gw.live_reservations().await, 0);

    // Later sessions, one after the other, stop at the cap the same way.
    let mut refused = false;
    for _ in 0..10 {
        let (mut client, _) = match connect(&gw.url, "m", Auth::Bearer(KEY)).await {
            Ok(opened) => opened,
            Err(tungstenite::Error::Http(response)) => {
                assert_eq!(response.status(), 429);
                refused = true;
                break;
            }
            Err(e) => panic!("{e}"),
        };
        next_event(&mut client).await;
        let (outputs, close) = responses_until_closed(&mut client, &bare).await;
        assert!(outputs.iter().all(|&o| o <= 50), "{outputs:?}");
        assert_eq!(close.0, 4429);
    }
    assert!(refused, "a session opens only while an allowance fits");
    assert!(gw.ledger("acme", None).await[0] <= 200);
    assert_eq!(gw.live_reservations().await, 0);
}

#[tokio::test]
async fn a_backend_that_drops_the_session_closes_the_clients_with_1011_upstream_error() {
    let fake = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let url = fake.scenario_url(&Scenario { cut_after: Some(1), ..Default::default() });
    let gw = serve_in_process(&realtime_config(&url, "{tokens_per_day: 100000}", ""), adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    assert_eq!(one_response(&mut client).await["type"], "response.done");
    client.send(Message::text(json!({"type": "response.create"}).to_string())).await.unwrap();
    assert_eq!(close_frame(&mut client).await, (1011, "upstream_error".to_owned()));

    let records = audit_records_until(&audit, 1).await;
    assert_eq!(records[0].close_reason, Some(CloseReason::UpstreamError));
    assert_eq!(records[0].error_code.map(|c| c.as_str()), Some("upstream_error"));
    assert_eq!((records[0].prompt_tokens, records[0].completion_tokens), (20, 5), "what was served is charged");
    assert_eq!(gw.ledger("acme", None).await[0], 25);
    assert_eq!(gw.live_reservations().await, 0);
    assert_eq!(fake.request_count(), 1, "no retry, no failover inside a session");
}

#[tokio::test]
async fn a_backends_own_close_is_relayed_with_its_code_and_reason() {
    let fake = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&realtime_config(&fake.url(), "{}", ""), adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    client
        .send(Message::text(json!({"type": "fake.close", "code": 4000, "reason": "session expired"}).to_string()))
        .await
        .unwrap();
    assert_eq!(close_frame(&mut client).await, (4000, "session expired".to_owned()));
    let records = audit_records_until(&audit, 1).await;
    assert_eq!(records[0].close_reason, Some(CloseReason::UpstreamClosed));
    assert_eq!(records[0].error_code, None);
}

/// A response is charged before its `response.done` is relayed: a client that reads
/// the event finds the response in the ledger (and one that leaves as it ends is
/// billed all the same), however slow the ledger.
#[tokio::test]
async fn a_response_is_in_the_ledger_when_its_done_event_arrives() {
    let fake = FakeModel::start().await.unwrap();
    let (mut adapters, audit) = memory_adapters();
    // Settlements that take 200 ms: what the client reads right after an event shows
    // whether the charge came before it.
    adapters.budgets = Arc::new(Slow::new(Arc::new(MemoryBudgetStore::new()), Slowed::SettleBeforeWrite));
    let gw = serve_in_process(&realtime_config(&fake.url(), "{tokens_per_day: 100000}", ""), adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    for n in 1..=3 {
        assert_eq!(one_response(&mut client).await["type"], "response.done");
        // Each response: 20 + 5 tokens settled, and nothing held for the next one.
        assert_eq!(gw.ledger("acme", None).await[0], 25 * n, "response {n}");
        assert_eq!(gw.live_reservations().await, 0, "an idle session holds nothing");
    }
    drop(client);
    let records = audit_records_until(&audit, 1).await;
    assert_eq!((records[0].prompt_tokens, records[0].completion_tokens), (60, 15));
    assert_eq!(gw.ledger("acme", None).await[0], 75);
}

#[tokio::test]
async fn a_client_that_vanishes_leaves_nothing_reserved_and_one_record() {
    let fake = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&realtime_config(&fake.url(), "{tokens_per_day: 100000}", ""), adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    assert_eq!(gw.live_reservations().await, 0, "the session just opened holds nothing");
    one_response(&mut client).await;
    assert_eq!(gw.live_reservations().await, 0, "nor once its response is done");
    drop(client); // no close frame: the TCP connection just ends
    let records = audit_records_until(&audit, 1).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].close_reason, Some(CloseReason::ClientClosed));
    assert_eq!(gw.live_reservations().await, 0);
    assert_eq!(gw.ledger("acme", None).await[0], 25);
}

#[tokio::test]
async fn a_message_over_the_limit_closes_the_session_with_1009() {
    let fake = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let limits = "  limits: {max_event_bytes: 65536}\n";
    let gw = serve_in_process(&realtime_config(&fake.url(), "{}", limits), adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    let _ = client.send(Message::text("x".repeat(100_000))).await;
    assert_eq!(close_frame(&mut client).await.0, 1009);
    let records = audit_records_until(&audit, 1).await;
    assert_eq!(records[0].close_reason, Some(CloseReason::MessageTooLarge));

    // From the backend: one huge event.
    let url = fake.scenario_url(&Scenario { huge_mb: Some(1), ..Default::default() });
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&realtime_config(&url, "{}", limits), adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    client.send(Message::text(json!({"type": "response.create"}).to_string())).await.unwrap();
    assert_eq!(close_frame(&mut client).await, (1009, "message_too_large".to_owned()));
    let records = audit_records_until(&audit, 1).await;
    assert_eq!(records[0].close_reason, Some(CloseReason::MessageTooLarge));
}

/// A backend's own refusal of the handshake is the caller's answer, relayed before
/// any upgrade: its reservation given back, and the answer says it cost nothing, as
/// every whole answer from a model does.
#[tokio::test]
async fn a_handshake_the_backend_refuses_is_relayed_and_costs_nothing() {
    let fake = FakeModel::start().await.unwrap();
    let url = fake.scenario_url(&Scenario { status: Some(403), ..Default::default() });
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&realtime_config(&url, "{}", ""), adapters).await;
    match connect(&gw.url, "m", Auth::Bearer(KEY)).await {
        Err(tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 403);
            assert_eq!(response.headers()["flexway-cost-eur"], "0.000000");
            assert!(response.headers().contains_key("flexway-backend"));
        }
        other => panic!("{other:?}"),
    }
    let records = audit_records_until(&audit, 1).await;
    assert_eq!((records[0].status, records[0].cost_micro_eur), (403, 0));
    assert_eq!(gw.ledger("acme", None).await, [0, 0, 0]);
    assert_eq!(gw.live_reservations().await, 0);
}

#[tokio::test]
async fn without_a_realtime_backend_the_session_is_refused_before_the_upgrade() {
    let fake = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&fake.url()));
    match connect(&gw.url, "m", Auth::Bearer(KEY)).await {
        Err(tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 400);
            let body: Value = serde_json::from_slice(response.body().as_deref().unwrap()).unwrap();
            assert_eq!(body["error"]["code"], "capability_unavailable");
        }
        other => panic!("{other:?}"),
    }
    // A backend that is down: 503 before the upgrade, never a session.
    let gw = Flexway::start(&realtime_config("http://127.0.0.1:9", "{}", ""));
    match connect(&gw.url, "m", Auth::Bearer(KEY)).await {
        Err(tungstenite::Error::Http(response)) => assert_eq!(response.status(), 503),
        other => panic!("{other:?}"),
    }
    // Not a WebSocket request, or no model: 400 in the OpenAI envelope.
    let plain = client().get(format!("{}/v1/realtime?model=m", gw.url)).bearer_auth(KEY).send().await.unwrap();
    assert_eq!(plain.status(), 400);
    match connect(&gw.url, "", Auth::Bearer(KEY)).await {
        Err(tungstenite::Error::Http(response)) => assert_eq!(response.status(), 400),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn stopping_the_gateway_closes_open_sessions_with_1001_and_records_them() {
    let fake = FakeModel::start().await.unwrap();
    let mut gw = Flexway::start(&realtime_config(&fake.url(), "{}", ""));
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    one_response(&mut client).await;
    gw.interrupt();
    assert_eq!(close_frame(&mut client).await, (1001, "shutdown".to_owned()));
    assert!(gw.wait_exit(Duration::from_secs(15)).is_some_and(|s| s.success()), "{}", gw.logs());
    let records = gw.records_until::<AuditRecord>(1).await;
    assert_eq!(records[0].close_reason, Some(CloseReason::Shutdown));
    assert_eq!((records[0].prompt_tokens, records[0].completion_tokens), (20, 5));
}

/// A client that stops reading holds the session's send to it: stopping the gateway
/// still ends the session, records it and exits, rather than the session being cut,
/// its record lost, when the runtime stops.
#[tokio::test]
async fn stopping_the_gateway_ends_a_session_whose_client_reads_nothing() {
    let fake = FakeModel::start().await.unwrap();
    // One 32 MiB message a response, far more than the sockets between hold.
    let url = scenario(&fake, "huge_mb=32");
    let limits = "  limits: {max_event_bytes: 67108864}\n";
    let mut gw = Flexway::start(&realtime_config(&url, "{}", limits));
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    client.send(Message::text(json!({"type": "response.create"}).to_string())).await.unwrap();
    // The gateway is sending the message the client does not read.
    tokio::time::sleep(Duration::from_millis(500)).await;
    gw.interrupt();
    assert!(gw.wait_exit(Duration::from_secs(8)).is_some_and(|s| s.success()), "{}", gw.logs());
    let records = gw.records_until::<AuditRecord>(1).await;
    assert_eq!(records[0].close_reason, Some(CloseReason::Shutdown), "{:?}", records[0]);
    drop(client);
}

#[tokio::test]
async fn the_serverless_shape_refuses_realtime_with_a_clear_error() {
    let fake = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let gw = serve_router_in_process(&realtime_config(&fake.url(), "{}", ""), adapters, flexway::http::api).await;
    match connect(&gw.url, "m", Auth::Bearer(KEY)).await {
        Err(tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 501);
            let body: Value = serde_json::from_slice(response.body().as_deref().unwrap()).unwrap();
            assert_eq!(body["error"]["code"], "realtime_unavailable");
            assert!(body["error"]["message"].as_str().unwrap().contains("WebSocket"), "{body}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn validate_warns_about_realtime_backends_in_the_serverless_shape() {
    let yaml = realtime_config("https://rt.example.net/v1", "{}", "")
        .replace("store: {kind: memory}", "store: {kind: dynamodb, table: ledger}");
    let env: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let loaded = flexway::config::load_str(&yaml, &env).unwrap();
    let warning = loaded.warnings.iter().map(ToString::to_string).find(|w| w.contains("realtime"));
    assert!(warning.as_deref().is_some_and(|w| w.contains("WebSocket")), "{:?}", loaded.warnings);
    let local = flexway::config::load_str(&realtime_config("https://rt.example.net/v1", "{}", ""), &env).unwrap();
    assert!(!local.warnings.iter().any(|w| w.to_string().contains("realtime")));
}

#[test]
fn only_what_is_built_loads_for_realtime() {
    let env: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let anthropic = realtime_config("https://rt.example.net", "{}", "").replace(
        "      capabilities: [chat, realtime]\n",
        "      kind: anthropic\n      capabilities: [chat, realtime]\n",
    );
    let error = flexway::config::load_str(&anthropic, &env).map(|_| ()).unwrap_err().to_string();
    assert!(error.contains("ai.backends.rt.capabilities") && error.contains("realtime"), "{error}");
    let mtls = realtime_config("https://rt.example.net/v1", "{}", "").replace(
        "      capabilities: [chat, realtime]\n",
        "      capabilities: [chat, realtime]\n      tls: {cert: \"env:C\", key: \"env:K\"}\n",
    );
    let error = flexway::config::load_str(&mtls, &env).map(|_| ()).unwrap_err().to_string();
    assert!(error.contains("ai.backends.rt.tls"), "{error}");
    let override_chat = realtime_config("https://rt.example.net/v1", "{}", "")
        .replace("      capabilities: [chat, realtime]\n", "      capabilities: [chat]\n");
    let override_chat =
        override_chat.replace("  default_backend: rt\n", "  default_backend: rt\n  capabilities: {realtime: rt}\n");
    let error = flexway::config::load_str(&override_chat, &env).map(|_| ()).unwrap_err().to_string();
    assert!(error.contains("ai.capabilities.realtime"), "{error}");
}

/// Each response counts in the caller's windows (SPEC §14): `rate_limits.updated`
/// follows each `response.done`, and a response past a limit never runs: a
/// `response.create` is answered with an `error` event, a response the backend starts
/// on its own is cancelled and the client told the same, the session kept open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_paces_its_responses_and_stays_open_past_a_limit() {
    let fake = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    // Each response reserves its allowance (one request) as it is asked for or
    // started: two responses fit a minute's two requests.
    with_seconds_left_in_the_minute(20).await;
    let yaml = realtime_config(&fake.url(), "{}\n    limits: {requests_per_minute: 2}", "");
    let gw = serve_in_process(&yaml, adapters).await;
    let (mut client, response) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    assert_eq!(response.headers()["x-ratelimit-remaining-requests"], "1", "the opening checks that one fits");
    next_event(&mut client).await;
    let window = || {
        let at = flexway::budget::period::unix_now();
        flexway::budget::CounterKey::window("acme", None, flexway::budget::Unit::Requests, at)
    };
    assert_eq!(gw.gateway.budgets.used(&[window()]).await.unwrap()[0], 0, "and holds nothing once open");
    assert_eq!(one_response(&mut client).await["type"], "response.done");
    let updated = next_event(&mut client).await;
    assert_eq!(updated["type"], "rate_limits.updated", "{updated}");
    assert_eq!(updated["rate_limits"][0]["name"], "requests");
    assert_eq!(updated["rate_limits"][0]["remaining"], 1, "{updated}");
    assert_eq!(one_response(&mut client).await["type"], "response.done");
    let updated = next_event(&mut client).await;
    assert_eq!(updated["rate_limits"][0]["remaining"], 0, "{updated}");
    // The window is full: the third response is refused, the session stays open.
    client.send(Message::text(json!({"type": "response.create"}).to_string())).await.unwrap();
    let refused = next_event(&mut client).await;
    assert_eq!(refused["type"], "error", "{refused}");
    assert_eq!(refused["error"]["code"], "rate_limit_exceeded");
    // A response the backend starts on its own (voice activity detection) is refused
    // as it starts: cancelled upstream, none of its events relayed, the client told.
    // (The fake backend echoes the `response.cancel` once it has sent the whole
    // response: it ignores it.)
    client.send(Message::text(json!({"type": "input_audio_buffer.commit"}).to_string())).await.unwrap();
    let refused = next_event(&mut client).await;
    assert_eq!(refused["type"], "error", "{refused}");
    assert_eq!(refused["error"]["code"], "rate_limit_exceeded");
    let cancel = next_event(&mut client).await;
    assert_eq!(cancel, json!({"type": "response.cancel", "response_id": "resp_fake_3"}), "nothing of it came between");
    assert_eq!(gw.gateway.budgets.used(&[window()]).await.unwrap()[0], 2, "two responses ran, the limit held");
    // What the cancelled response still reported using (here all of it: the fake ran
    // it whole) is charged, as tokens, not as a request.
    assert_eq!(gw.ledger("acme", None).await[0], 75);
    let item = json!({"type": "conversation.item.create", "item": {"type": "message"}});
    client.send(Message::text(item.to_string())).await.unwrap();
    assert_eq!(next_event(&mut client).await, item, "the session is still open");
    client.close(None).await.unwrap();
    for _ in 0..100 {
        if gw.live_reservations().await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gw.live_reservations().await, 0, "nothing left reserved");
}

/// No allowance is held across a minute: the opening's is given back at once, and a
/// response reserves its own when the client asks for it, so it counts in the minute it
/// runs (SPEC §14).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_counts_in_the_minute_it_runs() {
    use flexway::budget::{CounterKey, Unit, period::unix_now};
    let fake = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = realtime_config(&fake.url(), "{}\n    limits: {requests_per_minute: 100}", "");
    let gw = serve_in_process(&yaml, adapters).await;
    // Open the session in one minute, ask for its first response in the next.
    let second = unix_now() % 60;
    if second < 57 {
        tokio::time::sleep(Duration::from_secs(57 - second)).await;
    }
    let opened_at = unix_now();
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    let window = |at: u64| CounterKey::window("acme", None, Unit::Requests, at);
    assert_eq!(gw.gateway.budgets.used(&[window(opened_at)]).await.unwrap()[0], 0, "the opening's, given back");
    tokio::time::sleep(Duration::from_secs(60 - unix_now() % 60 + 1)).await;
    assert_eq!(one_response(&mut client).await["type"], "response.done");
    let now = unix_now();
    assert_ne!(now / 60, opened_at / 60);
    let used = gw.gateway.budgets.used(&[window(opened_at), window(now)]).await.unwrap();
    assert_eq!(used, [0, 1], "counted in the minute it ran, nothing held for the next");
}

/// A session in a run gives no more responses once the run is ended (SPEC §15): its
/// next `response.create` is answered with an `error` event `run_ended`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_in_an_ended_run_runs_no_more_responses() {
    let fake = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = realtime_config(&fake.url(), "{}", "").replace(
        &format!("      - sha256: {}\n", sha(KEY)),
        &format!("      - {{sha256: {}, agent: bot}}\n    agents: {{bot: {{}}}}\n", sha(KEY)),
    );
    let gw = serve_in_process(&yaml, adapters).await;
    let runs = format!("{}/v1/flexway/runs", gw.url);
    let run: Value = client()
        .post(&runs)
        .bearer_auth(KEY)
        .json(&json!({"budget": {"tokens": 1000}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = run["id"].as_str().unwrap();
    let mut request = ws_url(&gw.url, "m").into_client_request().unwrap();
    request.headers_mut().insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    request.headers_mut().insert("flexway-run", id.parse().unwrap());
    let (mut session, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    next_event(&mut session).await;
    let state: Value =
        client().get(format!("{runs}/{id}")).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
    assert_eq!(state["spent"]["tokens"], 0, "a session just opened holds nothing in its run: {state}");
    assert_eq!(one_response(&mut session).await["type"], "response.done");
    let state: Value =
        client().get(format!("{runs}/{id}")).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
    // The response's 25 tokens, and nothing held while the session is idle (SPEC §15).
    assert_eq!(state["spent"]["tokens"], 25, "the response counted in the run, nothing more: {state}");
    assert_eq!(client().delete(format!("{runs}/{id}")).bearer_auth(KEY).send().await.unwrap().status(), 200);
    session.send(Message::text(json!({"type": "response.create"}).to_string())).await.unwrap();
    let refused = next_event(&mut session).await;
    assert_eq!(refused["type"], "error", "{refused}");
    assert_eq!(refused["error"]["code"], "run_ended");
}

/// A session is one call of its run however many responses it has (its one record
/// `charged`), while each response counts as a request in the caller's windows
/// (SPEC §14, §15): the run's `GET` and the audit count the same calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_one_call_of_its_run_and_each_response_a_request() {
    use flexway::budget::{CounterKey, Unit, period::unix_now};
    let fake = FakeModel::start().await.unwrap();
    let (adapters, audit) = memory_adapters();
    let second = unix_now() % 60;
    if second > 50 {
        tokio::time::sleep(Duration::from_secs(60 - second)).await;
    }
    let yaml = realtime_config(&fake.url(), "{}\n    limits: {requests_per_minute: 100}", "").replace(
        &format!("      - sha256: {}\n", sha(KEY)),
        &format!("      - {{sha256: {}, agent: bot}}\n    agents: {{bot: {{}}}}\n", sha(KEY)),
    );
    let gw = serve_in_process(&yaml, adapters).await;
    let runs = format!("{}/v1/flexway/runs", gw.url);
    let created = client().post(&runs).bearer_auth(KEY).json(&json!({"budget": {"tokens": 1000}})).send().await;
    let run: Value = created.unwrap().json().await.unwrap();
    let id = run["id"].as_str().unwrap();
    let mut request = ws_url(&gw.url, "m").into_client_request().unwrap();
    request.headers_mut().insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    request.headers_mut().insert("flexway-run", id.parse().unwrap());
    let (mut session, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    next_event(&mut session).await;
    let opened_at = unix_now();
    assert_eq!(one_response(&mut session).await["type"], "response.done");
    assert_eq!(one_response(&mut session).await["type"], "response.done");
    let window = CounterKey::window("acme", None, Unit::Requests, opened_at);
    assert_eq!(gw.gateway.budgets.used(&[window]).await.unwrap(), [2], "each response is a request");
    let state: Value =
        client().get(format!("{runs}/{id}")).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
    assert_eq!(state["calls"], 1, "the session is one call of the run: {state}");
    session.close(None).await.unwrap();
    let records = audit_records_until(&audit, 1).await;
    let record = &records[0];
    assert_eq!((record.operation, record.run.as_deref(), record.charged), (Operation::Realtime, Some(id), Some(true)));
    assert_eq!(state["spent"]["tokens"], record.prompt_tokens + record.completion_tokens, "{state}");
}

/// A session's responses count on its backend's provider quota each in the minute it
/// is reserved (SPEC §14): at the quota, the session stays open and a response.create
/// is answered with an `error` event, never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_response_counts_on_the_backends_provider_quota() {
    use flexway::budget::{CounterKey, Unit, period::unix_now};
    with_seconds_left_in_the_minute(20).await;
    let fake = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = realtime_config(&fake.url(), "{}", "").replace(
        "      capabilities: [chat, realtime]\n",
        "      capabilities: [chat, realtime]\n      quota: {requests_per_minute: 2}\n",
    );
    assert!(yaml.contains("quota:"), "{yaml}");
    let gw = serve_in_process(&yaml, adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    let quota = CounterKey::window("~backend", Some("rt"), Unit::Requests, unix_now());
    assert_eq!(one_response(&mut client).await["type"], "response.done");
    assert_eq!(one_response(&mut client).await["type"], "response.done", "the second response's quota was held");
    assert_eq!(
        gw.gateway.budgets.used(std::slice::from_ref(&quota)).await.unwrap()[0],
        2,
        "two responses, two requests"
    );
    client.send(Message::text(json!({"type": "response.create"}).to_string())).await.unwrap();
    let refused = next_event(&mut client).await;
    assert_eq!(refused["type"], "error", "{refused}");
    assert_eq!(refused["error"]["code"], "rate_limit_exceeded");
    assert_eq!(gw.gateway.budgets.used(&[quota]).await.unwrap()[0], 2, "the refused response counted nothing");
    client.close(None).await.unwrap();
}

/// Reads events until one of type `kind` (or a close): it.
async fn event_of(client: &mut Client, kind: &str) -> Value {
    loop {
        let event = next_event(client).await;
        if event["type"] == kind || event.get("close").is_some() {
            return event;
        }
    }
}

/// A `response.create` sent while a response runs reserves nothing of its own: the
/// backend refuses it (one active response at a time), and the running response keeps
/// the allowance held for it: counted in the window and on the provider quota while
/// it runs, settled on its own usage at its `response.done` (SPEC §14).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_asked_for_while_one_runs_leaves_the_running_one_counted() {
    use flexway::budget::{CounterKey, Unit, period::unix_now};
    with_seconds_left_in_the_minute(20).await;
    let fake = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = realtime_config(&fake.url(), "{}\n    limits: {requests_per_minute: 2}", "").replace(
        "      capabilities: [chat, realtime]\n",
        "      capabilities: [chat, realtime]\n      quota: {requests_per_minute: 10}\n",
    );
    assert!(yaml.contains("quota:"), "{yaml}");
    let gw = serve_in_process(&yaml, adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    let now = unix_now();
    let keys = [
        CounterKey::window("acme", None, Unit::Requests, now),
        CounterKey::window("~backend", Some("rt"), Unit::Requests, now),
    ];
    // A response that runs until the test says `fake.finish`.
    let held = json!({"type": "response.create", "response": {"metadata": {"fake_hold": "1"}}});
    client.send(Message::text(held.to_string())).await.unwrap();
    assert_eq!(event_of(&mut client, "response.created").await["response"]["id"], "resp_fake_1");
    assert_eq!(gw.gateway.budgets.used(&keys).await.unwrap(), [1, 1], "the running response's allowance");
    for _ in 0..3 {
        client.send(Message::text(json!({"type": "response.create"}).to_string())).await.unwrap();
        let refused = event_of(&mut client, "error").await;
        assert_eq!(refused["error"]["code"], "conversation_already_has_active_response", "{refused}");
        assert_eq!(
            gw.gateway.budgets.used(&keys).await.unwrap(),
            [1, 1],
            "the backend's refusal gives back nothing the running response holds"
        );
    }
    client.send(Message::text(json!({"type": "fake.finish"}).to_string())).await.unwrap();
    let done = event_of(&mut client, "response.done").await;
    assert_eq!(done["response"]["id"], "resp_fake_1", "{done}");
    let updated = next_event(&mut client).await;
    assert_eq!(updated["rate_limits"][0]["remaining"], 1, "{updated}");
    assert_eq!(gw.gateway.budgets.used(&keys).await.unwrap(), [1, 1], "settled on its ticket: one request");
    assert_eq!(gw.ledger("acme", None).await[0], 25, "its 20 + 5 tokens");
    assert_eq!(gw.live_reservations().await, 0, "nothing held once it is done");
    // The limit still holds: one more response, then none.
    assert_eq!(one_response(&mut client).await["type"], "response.done");
    client.send(Message::text(json!({"type": "response.create"}).to_string())).await.unwrap();
    let refused = event_of(&mut client, "error").await;
    assert_eq!(refused["error"]["code"], "rate_limit_exceeded", "{refused}");
    assert_eq!(gw.gateway.budgets.used(&keys).await.unwrap(), [2, 2]);
    client.close(None).await.unwrap();
}

/// An allowance reserved in one minute and not yet used when the next response is
/// asked for in the next minute is given back whole, its provider quota included: the
/// response counts in the minute it runs, once (SPEC §14).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowance_reserved_again_in_a_new_minute_gives_back_its_quota() {
    use flexway::budget::{CounterKey, Unit, period::unix_now};
    let fake = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = realtime_config(&fake.url(), "{}\n    limits: {requests_per_minute: 100}", "").replace(
        "      capabilities: [chat, realtime]\n",
        "      capabilities: [chat, realtime]\n      quota: {requests_per_minute: 10}\n",
    );
    let gw = serve_in_process(&yaml, adapters).await;
    // Ask for the first response at second 55 of a minute, again in the next.
    tokio::time::sleep(Duration::from_secs((55 + 60 - unix_now() % 60) % 60)).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    let first = unix_now();
    let keys = |at: u64| {
        [
            CounterKey::window("acme", None, Unit::Requests, at),
            CounterKey::window("~backend", Some("rt"), Unit::Requests, at),
        ]
    };
    // A `response.create` the backend never answers: its allowance stays held.
    let silent = json!({"type": "response.create", "response": {"metadata": {"fake_silent": "1"}}});
    client.send(Message::text(silent.to_string())).await.unwrap();
    for _ in 0..100 {
        if gw.gateway.budgets.used(&keys(first)).await.unwrap() == [1, 1] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gw.gateway.budgets.used(&keys(first)).await.unwrap(), [1, 1], "held in the first minute");
    tokio::time::sleep(Duration::from_secs(60 - unix_now() % 60 + 1)).await;
    assert_eq!(one_response(&mut client).await["type"], "response.done");
    let now = unix_now();
    assert_ne!(now / 60, first / 60);
    assert_eq!(gw.gateway.budgets.used(&keys(first)).await.unwrap(), [0, 0], "the first minute's, given back");
    assert_eq!(gw.gateway.budgets.used(&keys(now)).await.unwrap(), [1, 1], "one request, on one quota hold");
    client.close(None).await.unwrap();
}

/// A response that starts while another runs (here one out of band, which the backend
/// runs alongside) holds no allowance of its own: it is cancelled as it starts, none of
/// its events relayed, the client told; what it reports using is charged as tokens,
/// not as a request, and the running response keeps its own allowance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_starts_while_another_runs_is_cancelled() {
    use flexway::budget::{CounterKey, Unit, period::unix_now};
    with_seconds_left_in_the_minute(20).await;
    let fake = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    let yaml = realtime_config(&fake.url(), "{}\n    limits: {requests_per_minute: 5}", "");
    let gw = serve_in_process(&yaml, adapters).await;
    let (mut client, _) = connect(&gw.url, "m", Auth::Bearer(KEY)).await.unwrap();
    next_event(&mut client).await;
    let window = [CounterKey::window("acme", None, Unit::Requests, unix_now())];
    let held = json!({"type": "response.create", "response": {"metadata": {"fake_hold": "1"}}});
    client.send(Message::text(held.to_string())).await.unwrap();
    assert_eq!(event_of(&mut client, "response.created").await["response"]["id"], "resp_fake_1");
    for _ in 0..5 {
        assert_eq!(next_event(&mut client).await["type"], "response.output_text.delta");
    }
    let out_of_band = json!({"type": "response.create", "response": {"conversation": "none"}});
    client.send(Message::text(out_of_band.to_string())).await.unwrap();
    let refused = next_event(&mut client).await;
    assert_eq!(refused["type"], "error", "{refused}");
    assert_eq!(refused["error"]["code"], "invalid_request", "{refused}");
    // The fake ran the second response whole and then echoes the cancel: nothing of
    // it came between.
    let cancel = next_event(&mut client).await;
    assert_eq!(cancel, json!({"type": "response.cancel", "response_id": "resp_fake_2"}));
    assert_eq!(gw.gateway.budgets.used(&window).await.unwrap(), [1], "the running response's, nothing more");
    assert_eq!(gw.ledger("acme", None).await[0], 50 + 25, "the running one's allowance, the cancelled one's tokens");
    client.send(Message::text(json!({"type": "fake.finish"}).to_string())).await.unwrap();
    let done = event_of(&mut client, "response.done").await;
    assert_eq!(done["response"]["id"], "resp_fake_1", "{done}");
    assert_eq!(gw.gateway.budgets.used(&window).await.unwrap(), [1], "settled on its own ticket");
    assert_eq!(gw.ledger("acme", None).await[0], 50);
    assert_eq!(gw.live_reservations().await, 0);
    client.close(None).await.unwrap();
}
