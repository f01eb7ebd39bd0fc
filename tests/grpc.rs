//! gRPC through the gateway (SPEC §10): a real tonic server (the metered OCR-like
//! service of `tests/fake-grpc`, compiled from a .proto that imports
//! `proto/flexway/v1/options.proto`) behind `flexway serve`, called by real tonic
//! clients over HTTP/2 cleartext on the gateway's one listener. Costs are asserted
//! exactly: per call, 2.5 €/thousand = 2,500 µ€; per byte, 0.5 €/thousand = 500 µ€ a
//! message payload byte (the 5-byte prefix not counted), both directions summed.
//!
//! The ledger tests run the same router in-process (`serve_in_process`), so that the
//! counters and live reservations can be read; the rest run the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fake_grpc::pb::ocr_client::OcrClient;
use fake_grpc::pb::{Image, Ping, Text};
use fake_grpc::{DESCRIPTOR_SET, FakeOcr};
use flexway_testkit::*;
use prost::Message;
use tonic::transport::Channel;
use tonic::{Code, Request};

const PER_CALL_MICRO: u64 = 2_500;
const PER_BYTE_MICRO: u64 = 500;

/// The descriptor set, written where a config can name it.
fn descriptor_file(dir: &Path) -> PathBuf {
    let path = dir.join("ocr.binpb");
    std::fs::write(&path, DESCRIPTOR_SET).unwrap();
    path
}

/// A config of gRPC backends only (no `ai.default_backend`), the audit in `audit`.
fn grpc_config(set: &Path, url: &str, budgets: &str, internal: bool, audit: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {audit}
tenants:
  acme:
    keys:
      - sha256: {key}
    budgets: {budgets}
ai:
  backends:
    ocr:
      kind: grpc
      url: {url}
      descriptor_set: {set}
      external: {external}
"#,
        key = sha(KEY),
        set = set.display(),
        external = !internal,
    )
}

async fn client(url: &str) -> OcrClient<Channel> {
    OcrClient::connect(url.to_owned()).await.unwrap()
}

fn authed<T>(message: T, key: &str) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    request
}

fn image(bytes: usize, reply_bytes: u32) -> Image {
    Image { data: vec![7; bytes], reply_bytes, ..Default::default() }
}

fn records(lines: &[String]) -> Vec<serde_json::Value> {
    lines.iter().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).collect()
}

#[tokio::test]
async fn meters_per_call_and_per_byte_exactly_through_flexway_serve() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let audit_file = dir.path().join("audit.jsonl");
    let config = grpc_config(
        &descriptor_file(dir.path()),
        &upstream.url(),
        "{eur_per_month: 100}",
        false,
        &format!("{{sink: file, path: {}}}", audit_file.display()),
    );
    let flexway = Flexway::start(&config);
    let mut ocr = client(&flexway.url).await;

    // Per call: the body is never read, the price is per call.
    let answer = ocr.recognize(authed(image(10_000, 0), KEY)).await.unwrap();
    assert_eq!(answer.get_ref().text, "10000");
    assert_eq!(answer.metadata().get("flexway-backend").unwrap(), "ocr");
    assert_eq!(answer.metadata().get("flexway-cost-eur").unwrap(), "0.002500");
    assert!(answer.metadata().get("flexway-request-id").is_some());

    // Per byte: request and response payloads.
    let request = image(100, 50);
    let request_bytes = request.encoded_len() as u64;
    let answer = ocr.extract(authed(request, KEY)).await.unwrap();
    let response_bytes = answer.get_ref().encoded_len() as u64;
    assert_eq!((request_bytes, response_bytes), (104, 52));
    let per_byte = (request_bytes + response_bytes) * PER_BYTE_MICRO;
    assert_eq!(answer.metadata().get("flexway-cost-eur").unwrap(), "0.078000");

    // Unmetered: proxied, identity still required.
    let pong = ocr.health(authed(Ping { note: "hi".into() }, KEY)).await.unwrap();
    assert_eq!(pong.get_ref().note, "hi");
    assert_eq!(pong.metadata().get("flexway-cost-eur").unwrap(), "0.000000");
    assert_eq!(upstream.calls(), 3);

    let text = wait_for_lines(&audit_file, 3).await;
    let records = records(&text);
    assert_eq!(records.len(), 3, "{text:?}");
    for record in &records {
        assert_eq!(record["operation"], "grpc");
        assert_eq!(record["capability"], "grpc");
        assert_eq!(record["status"], 0);
        assert_eq!(record["backend"], "ocr");
        assert_eq!(record["tenant"], "acme");
        assert_eq!(record["usage_source"], "reported");
    }
    assert_eq!(records[0]["model_requested"], "ocr.v1.Ocr/Recognize");
    assert_eq!(records[0]["feature"], "ocr");
    assert_eq!(records[0]["cost_micro_eur"], PER_CALL_MICRO);
    assert_eq!(records[1]["feature"], "extract");
    assert_eq!(records[1]["cost_micro_eur"], per_byte);
    assert!(records[2].get("feature").is_none(), "{}", records[2]);
    assert_eq!(records[2]["cost_micro_eur"], 0);

    // Metrics carry the feature dimension.
    let metrics =
        flexway_testkit::client().get(format!("{}/metrics", flexway.url)).send().await.unwrap().text().await.unwrap();
    let ocr_calls = r#"flexway_inference_calls_total{tenant="acme",backend="ocr",metered_by="local",capability="grpc",feature="ocr"} 1"#;
    assert!(metrics.contains(ocr_calls), "{metrics}");
    let extract_cost = r#"flexway_inference_cost_eur_total{tenant="acme",backend="ocr",metered_by="local",capability="grpc",feature="extract"} 0.078000"#;
    assert!(metrics.contains(extract_cost), "{metrics}");

    // `flexway report` has the gRPC rows, by feature.
    let report = std::process::Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["report", "--format", "csv", "--audit"])
        .arg(&audit_file)
        .output()
        .unwrap();
    let csv = String::from_utf8(report.stdout).unwrap();
    assert!(
        csv.starts_with("tenant,agent,backend,metered_by,calls,prompt_tokens,completion_tokens,cost_eur,feature\n")
    );
    assert!(csv.contains("acme,-,ocr,local,1,0,0,0.002500,ocr\n"), "{csv}");
    assert!(csv.contains("acme,-,ocr,local,1,0,0,0.078000,extract\n"), "{csv}");
    assert!(csv.contains("acme,-,ocr,local,1,0,0,0.000000,-\n"), "{csv}");
}

async fn wait_for_lines(path: &Path, count: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        if lines.len() >= count || Instant::now() > deadline {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn refuses_a_bad_key_with_unauthenticated_and_records_nothing() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{}", false, "{sink: stdout}");
    let flexway = Flexway::start(&config);
    let mut ocr = client(&flexway.url).await;

    let status = ocr.recognize(authed(image(1, 0), "sk-wrong")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(status.message().contains("invalid_api_key"), "{}", status.message());
    let status = ocr.health(Request::new(Ping::default())).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "unmetered methods need a key too");
    assert_eq!(upstream.calls(), 0);
    // A marker call after them: once its record is in, one for a refused call, written
    // before its refusal was answered, would be in before it.
    ocr.health(authed(Ping::default(), KEY)).await.unwrap();
    let written: Vec<serde_json::Value> = flexway.records_until(1).await;
    assert_eq!(written.len(), 1, "a refused key is not audited: {:?}", flexway.stdout());
    assert_eq!(written[0]["status"], 0, "the marker's record, OK");
}

#[tokio::test]
async fn a_sensitive_call_needs_an_internal_backend() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let set = descriptor_file(dir.path());

    let external = Flexway::start(&grpc_config(&set, &upstream.url(), "{}", false, "{sink: stdout}"));
    let mut ocr = client(&external.url).await;
    let mut request = authed(image(1, 0), KEY);
    request.metadata_mut().insert("flexway-sensitive", "true".parse().unwrap());
    let status = ocr.recognize(request).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains("sensitive_no_internal_backend"), "{}", status.message());
    assert_eq!(upstream.calls(), 0);
    let record = &external.records_until::<serde_json::Value>(1).await[0];
    assert_eq!(record["status"], 7);
    assert_eq!(record["error_code"], "sensitive_no_internal_backend");

    // An unreadable value is refused, never read as false.
    let mut request = authed(image(1, 0), KEY);
    request.metadata_mut().insert("flexway-sensitive", "maybe".parse().unwrap());
    assert_eq!(ocr.recognize(request).await.unwrap_err().code(), Code::InvalidArgument);

    let internal = Flexway::start(&grpc_config(&set, &upstream.url(), "{}", true, "{sink: stdout}"));
    let mut ocr = client(&internal.url).await;
    let mut request = authed(image(3, 0), KEY);
    request.metadata_mut().insert("flexway-sensitive", "true".parse().unwrap());
    assert_eq!(ocr.recognize(request).await.unwrap().get_ref().text, "3");
}

#[tokio::test]
async fn residency_holds_through_the_grpc_door() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let set = descriptor_file(dir.path());
    let yaml = grpc_config(&set, &upstream.url(), "{}", false, "{sink: stdout}")
        .replace("      external: true\n", "      external: true\n      jurisdiction: eu\n");
    let flexway = Flexway::start(&yaml);
    let mut ocr = client(&flexway.url).await;
    let mut request = authed(image(2, 0), KEY);
    request.metadata_mut().insert("flexway-jurisdiction", "EU".parse().unwrap());
    assert_eq!(ocr.recognize(request).await.unwrap().get_ref().text, "2");

    let mut request = authed(image(1, 0), KEY);
    request.metadata_mut().insert("flexway-jurisdiction", "ch".parse().unwrap());
    let status = ocr.recognize(request).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains("residency_unavailable"), "{}", status.message());
    assert_eq!(upstream.calls(), 1, "the ch-bound call was never sent");
    let records = flexway.records_until::<serde_json::Value>(2).await;
    assert_eq!(records[1]["error_code"], "residency_unavailable");
}

#[tokio::test]
async fn refuses_at_the_euro_cap_with_resource_exhausted() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Two calls at 2,500 µ€ fit in 6,000 µ€; the third does not.
    let config =
        grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{eur_per_month: 0.006}", false, "{sink: stdout}");
    let flexway = Flexway::start(&config);
    let mut ocr = client(&flexway.url).await;
    for _ in 0..2 {
        ocr.recognize(authed(image(1, 0), KEY)).await.unwrap();
    }
    let status = ocr.recognize(authed(image(1, 0), KEY)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("budget_exceeded"), "{}", status.message());
    assert_eq!(upstream.calls(), 2, "a refused call never reaches the upstream");
    let records = flexway.records_until::<serde_json::Value>(3).await;
    assert_eq!(records[2]["status"], 8);
    assert_eq!(records[2]["error_code"], "budget_exceeded");
    assert_eq!(records[2]["budget_state"], "exceeded");
    assert_eq!(records[2]["cost_micro_eur"], 0);
    // Unmetered calls still pass: they cost nothing.
    ocr.health(authed(Ping::default(), KEY)).await.unwrap();
}

#[tokio::test]
async fn streams_frame_by_frame_in_all_four_shapes() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config =
        grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{eur_per_month: 100}", false, "{sink: stdout}");
    let flexway = Flexway::start(&config);
    let mut ocr = client(&flexway.url).await;

    // Server streaming: four pages 200 ms apart arrive as they are sent.
    let request = Image { count: 4, delay_ms: 200, reply_bytes: 10, ..Default::default() };
    let mut bytes = request.encoded_len() as u64;
    let started = Instant::now();
    let mut pages = ocr.pages(authed(request, KEY)).await.unwrap().into_inner();
    let mut arrivals = Vec::new();
    while let Some(page) = pages.message().await.unwrap() {
        arrivals.push(started.elapsed());
        bytes += page.encoded_len() as u64;
    }
    assert_eq!(arrivals.len(), 4);
    let spread = arrivals[3] - arrivals[0];
    assert!(spread >= Duration::from_millis(450), "pages arrived together ({arrivals:?}): buffered");
    let trailers = pages.trailers().await.unwrap().unwrap();
    let expected = bytes * PER_BYTE_MICRO;
    assert_eq!(trailers.get("flexway-cost-eur").unwrap().to_str().unwrap(), micro_to_eur(expected));

    // Client streaming: three chunks, one answer.
    let chunks: Vec<Image> = (0..3).map(|_| image(1000, 0)).collect();
    let sent: u64 = chunks.iter().map(|c| c.encoded_len() as u64).sum();
    let answer = ocr.upload(authed(tokio_stream::iter(chunks), KEY)).await.unwrap();
    assert_eq!(answer.get_ref().text, "3000");
    let upload_cost = (sent + answer.get_ref().encoded_len() as u64) * PER_BYTE_MICRO;
    assert_eq!(answer.metadata().get("flexway-cost-eur").unwrap().to_str().unwrap(), micro_to_eur(upload_cost));

    // Bidirectional: each message is answered before the next is sent, which a proxy
    // that buffered either direction would never let happen.
    let (tx, rx) = tokio::sync::mpsc::channel::<Image>(1);
    tx.send(image(5, 0)).await.unwrap();
    let mut answers =
        ocr.converse(authed(tokio_stream::wrappers::ReceiverStream::new(rx), KEY)).await.unwrap().into_inner();
    for (i, size) in [5usize, 6, 7].into_iter().enumerate() {
        let answer: Text = tokio::time::timeout(Duration::from_secs(5), answers.message())
            .await
            .expect("an answer per message, before the next is sent")
            .unwrap()
            .unwrap();
        assert_eq!((answer.text, answer.index), (size.to_string(), i as u32));
        if size < 7 {
            tx.send(image(size + 1, 0)).await.unwrap();
        }
    }
    drop(tx);
    assert!(answers.message().await.unwrap().is_none());
    let trailers = answers.trailers().await.unwrap().unwrap();
    assert_eq!(trailers.get("flexway-cost-eur").unwrap(), "0.001000", "per call: 1 €/thousand");

    let records = flexway.records_until::<serde_json::Value>(3).await;
    let features: Vec<&str> = records.iter().map(|r| r["feature"].as_str().unwrap()).collect();
    assert_eq!(features, ["pages", "upload", "converse"]);
    let costs: Vec<u64> = records.iter().map(|r| r["cost_micro_eur"].as_u64().unwrap()).collect();
    assert_eq!(costs, [expected, upload_cost, 1_000]);
}

/// A server takes only so many streams on one HTTP/2 connection (here 100). More calls
/// at once than that go out on another connection (upstream/lanes.rs) instead of
/// queueing in hyper until a stream ends: here they would wait for the whole test, as
/// every call's one page comes a minute later.
#[tokio::test(flavor = "multi_thread")]
async fn more_calls_at_once_than_one_connection_takes_go_out_on_another() {
    let upstream = FakeOcr::start_allowing(Some(100)).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{}", false, "{sink: stdout}");
    let flexway = Flexway::start(&config);
    let ocr = client(&flexway.url).await;
    let calls = 150;
    let all = hold_open(calls, Duration::from_secs(20), || {
        let mut ocr = ocr.clone();
        async move {
            let request = Image { count: 1, delay_ms: 60_000, ..Default::default() };
            ocr.pages(authed(request, KEY)).await.unwrap()
        }
    })
    .await;
    if let Err(open) = all {
        panic!("{open} of {calls} calls open at once");
    }
    assert!(upstream.connections() >= 2, "{} connection(s) for {calls} calls at once", upstream.connections());
}

fn micro_to_eur(micro: u64) -> String {
    format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

#[tokio::test]
async fn an_upstream_error_status_is_relayed_and_a_per_call_method_is_not_charged() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{}", false, "{sink: stdout}");
    let flexway = Flexway::start(&config);
    let mut ocr = client(&flexway.url).await;
    let failing = Image { fail_with: Code::InvalidArgument as u32, ..Default::default() };
    let status = ocr.recognize(authed(failing, KEY)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "asked to fail");
    let record = &flexway.records_until::<serde_json::Value>(1).await[0];
    assert_eq!(record["status"], 3);
    assert_eq!(record["cost_micro_eur"], 0);
}

// ----- the ledger (in-process: the same router, its counters readable) ------------

async fn in_process(
    url: &str,
    budgets: &str,
) -> (InProcess, std::sync::Arc<flexway::audit::sinks::MemoryAuditSink>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = grpc_config(&descriptor_file(dir.path()), url, budgets, false, "{sink: stdout}");
    let (adapters, audit) = memory_adapters();
    (serve_in_process(&config, adapters).await, audit, dir)
}

#[tokio::test]
async fn refunds_the_reservation_when_the_upstream_is_down() {
    let (_closed, url) = closed_url();
    let (gateway, audit, _dir) = in_process(&url, "{eur_per_month: 100}").await;
    let mut ocr = client(&gateway.url).await;
    let status = ocr.recognize(authed(image(1, 0), KEY)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("upstream_unavailable"), "{}", status.message());
    let status = ocr.extract(authed(image(100, 0), KEY)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let records = audit_records_until(&audit, 2).await;
    assert_eq!(records.iter().map(|r| r.status).collect::<Vec<_>>(), [14, 14]);
    assert_eq!(gateway.ledger("acme", None).await, [0, 0, 0], "refunded in full");
    assert_eq!(gateway.live_reservations().await, 0);
}

#[tokio::test]
async fn a_per_byte_stream_stops_at_the_cap_and_the_ledger_equals_the_audit() {
    let upstream = FakeOcr::start().await.unwrap();
    // 5 €: the first reservation (request + 4 KiB allowance ≈ 2.05 €) and one step
    // more (2.05 €) fit, a third step does not.
    let (gateway, audit, _dir) = in_process(&upstream.url(), "{eur_per_month: 5}").await;
    let mut ocr = client(&gateway.url).await;
    let request = Image { count: 10, reply_bytes: 2000, ..Default::default() };
    let mut bytes = request.encoded_len() as u64;
    let mut pages = ocr.pages(authed(request, KEY)).await.unwrap().into_inner();
    let mut received = 0;
    let status = loop {
        match pages.message().await {
            Ok(Some(page)) => {
                received += 1;
                bytes += page.encoded_len() as u64;
            }
            Ok(None) => panic!("the stream should stop at the cap"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("budget_exceeded"), "{}", status.message());
    assert_eq!(received, 4, "the pages the reservations covered");
    let records = audit_records_until(&audit, 1).await;
    assert_eq!(records[0].cost_micro_eur, bytes * PER_BYTE_MICRO, "charged on what passed");
    assert_eq!(records[0].status, 8);
    let [_, _, eur] = gateway.ledger("acme", None).await;
    assert_eq!(eur, records[0].cost_micro_eur);
    assert!(eur <= 5_000_000);
    assert_eq!(gateway.live_reservations().await, 0);

    // Per call, the ledger holds exactly what the audit says.
    ocr.recognize(authed(image(1, 0), KEY)).await.unwrap();
    let records = audit_records_until(&audit, 2).await;
    let [_, _, eur] = gateway.ledger("acme", None).await;
    assert_eq!(eur, records.iter().map(|r| r.cost_micro_eur).sum::<u64>());
    assert_eq!(gateway.live_reservations().await, 0);
}

#[tokio::test]
async fn a_cancelled_stream_is_recorded_once_and_settled_on_what_passed() {
    let upstream = FakeOcr::start().await.unwrap();
    let (gateway, audit, _dir) = in_process(&upstream.url(), "{eur_per_month: 100}").await;
    let mut ocr = client(&gateway.url).await;
    let request = Image { count: 50, delay_ms: 50, reply_bytes: 10, ..Default::default() };
    let mut pages = ocr.pages(authed(request, KEY)).await.unwrap().into_inner();
    pages.message().await.unwrap().unwrap();
    drop(pages);
    let records = audit_records_until(&audit, 1).await;
    // A marker call: once its record is in, a second one of the call that ended (its
    // relay's task long gone) would be in before it.
    ocr.health(authed(Ping::default(), KEY)).await.unwrap();
    let written = audit_records_until(&audit, 2).await;
    assert_eq!(written.len(), 2, "one record for the cancelled call");
    assert_eq!(written[1].model_requested.as_deref(), Some("ocr.v1.Ocr/Health"), "the marker's");
    assert_eq!(records[0].status, 1, "CANCELLED");
    assert!(records[0].cost_micro_eur > 0);
    let [_, _, eur] = gateway.ledger("acme", None).await;
    assert_eq!(eur, records[0].cost_micro_eur);
    assert_eq!(gateway.live_reservations().await, 0);
}

// ----- gRPC-Web (the serverless shape's protocol, on the same router) ------------

fn framed(message: &impl Message) -> Vec<u8> {
    let payload = message.encode_to_vec();
    let mut out = vec![0];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    out
}

/// A gRPC-Web call to the OCR service's `method` at `url`, `message` its one frame.
fn grpc_web(url: &str, method: &str, message: &impl Message) -> reqwest::RequestBuilder {
    flexway_testkit::client()
        .post(format!("{url}/ocr.v1.Ocr/{method}"))
        .bearer_auth(KEY)
        .header("content-type", "application/grpc-web+proto")
        .header("x-grpc-web", "1")
        .body(framed(message))
}

/// A gRPC-Web answer's frames: its messages (flag 0), in order, and its trailers
/// frame (flag 0x80) as text (empty when there is none).
fn web_frames(body: &[u8]) -> (Vec<&[u8]>, String) {
    let (mut at, mut messages, mut trailers) = (0, Vec::new(), String::new());
    while at + 5 <= body.len() {
        let length = u32::from_be_bytes(body[at + 1..at + 5].try_into().unwrap()) as usize;
        let frame = &body[at + 5..at + 5 + length];
        if body[at] == 0x80 {
            trailers = String::from_utf8_lossy(frame).into_owned();
        } else {
            messages.push(frame);
        }
        at += 5 + length;
    }
    (messages, trailers)
}

#[tokio::test]
async fn serves_grpc_web_unary_and_refuses_client_streaming() {
    let upstream = FakeOcr::start().await.unwrap();
    let (gateway, audit, _dir) = in_process(&upstream.url(), "{eur_per_month: 100}").await;
    let response = grpc_web(&gateway.url, "Recognize", &image(42, 0)).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with("application/grpc-web"));
    let body = response.bytes().await.unwrap();
    let (messages, trailers) = web_frames(&body);
    assert_eq!(messages.len(), 1, "one message, then the trailers frame");
    assert_eq!(Text::decode(messages[0]).unwrap().text, "42");
    assert!(trailers.contains("grpc-status:0\r\n"), "{trailers}");
    assert!(trailers.contains("flexway-cost-eur:0.002500\r\n"), "{trailers}");

    let response = grpc_web(&gateway.url, "Upload", &image(1, 0)).send().await.unwrap();
    assert_eq!(response.headers()["grpc-status"], "12");
    let message = response.headers()["grpc-message"].to_str().unwrap().to_owned();
    assert!(message.contains("gRPC-Web carries unary and server-streaming calls only"), "{message}");
    let records = audit_records_until(&audit, 2).await;
    assert_eq!(records[0].cost_micro_eur, PER_CALL_MICRO);
    assert_eq!(records[1].status, 12);
    assert_eq!(upstream.calls(), 1);
}

/// The serverless shape's deadline (SPEC §11) holds for gRPC-Web as for a chat
/// stream: a server stream still open at the cutoff ends with `DEADLINE_EXCEEDED` in
/// its trailers, settled on the bytes that passed and recorded before the platform
/// would cut the invocation.
#[tokio::test]
async fn a_grpc_web_stream_open_at_the_deadline_ends_settled_and_recorded() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config =
        grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{eur_per_month: 100}", false, "{sink: stdout}");
    let (adapters, audit) = memory_adapters();
    // Three seconds left: the cutoff comes 2.7 s into a stream of 30 pages 200 ms apart
    // (the gateway's start counts, so the first page must come well before it).
    let deadline = flexway::http::Deadline::within(Duration::from_secs(3));
    let gateway =
        serve_router_in_process(&config, adapters, |g| flexway::http::api(g).layer(axum::Extension(deadline))).await;
    let request = Image { count: 30, delay_ms: 200, reply_bytes: 10, ..Default::default() };
    let started = Instant::now();
    let response = grpc_web(&gateway.url, "Pages", &request).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.bytes().await.unwrap();
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(5), "the stream ran to its end: {elapsed:?}");

    let (pages, trailers) = web_frames(&body);
    let pages = pages.len();
    assert!((1..30).contains(&pages), "part of the stream passed: {pages} pages");
    assert!(trailers.contains("grpc-status:4\r\n"), "DEADLINE_EXCEEDED: {trailers}");
    assert!(trailers.contains("deadline"), "{trailers}");

    let records = audit_records_until(&audit, 1).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].status, 4);
    assert_eq!(records[0].error_code, Some(flexway::call::ErrorCode::Deadline));
    assert!(records[0].cost_micro_eur > 0, "what passed is charged");
    assert_eq!(gateway.ledger("acme", None).await[2], records[0].cost_micro_eur, "the ledger equals the audit");
    assert_eq!(gateway.live_reservations().await, 0);
}

/// A client slower than the platform's clock (Lambda throttles a streamed answer to
/// some 2 MB/s): the relay's send waits on the client, not the upstream, and still
/// ends at the cutoff, settled on what passed and recorded, while the client has not
/// read a byte.
#[tokio::test]
async fn a_grpc_web_answer_its_client_does_not_read_ends_at_the_deadline() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config =
        grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{eur_per_month: 100000}", false, "{sink: stdout}");
    let (adapters, audit) = memory_adapters();
    let deadline = flexway::http::Deadline::within(Duration::from_secs(2));
    let gateway =
        serve_router_in_process(&config, adapters, |g| flexway::http::api(g).layer(axum::Extension(deadline))).await;
    // 64 MiB at once (0.5 € a thousand bytes), far more than the sockets between hold.
    let request = Image { count: 1024, delay_ms: 0, reply_bytes: 64 * 1024, ..Default::default() };
    let response = grpc_web(&gateway.url, "Pages", &request).send().await.unwrap();
    assert_eq!(response.status(), 200);
    // Not read: the record comes all the same, by the cutoff (1.8 s).
    let records = audit_records_until(&audit, 1).await;
    assert_eq!(records[0].status, 4);
    assert_eq!(records[0].error_code, Some(flexway::call::ErrorCode::Deadline));
    assert!(records[0].cost_micro_eur > 0, "what passed is charged");
    assert_eq!(gateway.ledger("acme", None).await[2], records[0].cost_micro_eur, "the ledger equals the audit");
    assert_eq!(gateway.live_reservations().await, 0);
    drop(response);
}

/// A client's END_STREAM often comes as an empty DATA frame: passed on as such, an h2
/// upstream counts them as a flood and closes the connection after about a hundred
/// (GOAWAY ENHANCE_YOUR_CALM, `too_many_data_frames`).
#[tokio::test]
async fn many_sequential_calls_share_the_upstream_connection() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config =
        grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{eur_per_month: 1000}", false, "{sink: stdout}");
    let flexway = Flexway::start(&config);
    let mut ocr = client(&flexway.url).await;
    for i in 0..300 {
        let answer = ocr.recognize(authed(image(64, 0), KEY)).await;
        assert!(answer.is_ok(), "call {i}: {answer:?}\n{}", flexway.logs());
    }
    assert_eq!(upstream.calls(), 300);
    assert_eq!(upstream.connections(), 1, "300 sequential calls, one connection to the backend");
}

// ----- fallback and breakers ------------------------------------------------------

/// Two `grpc` backends declaring the same service: `a-down` (first by name, nothing
/// listening, its breaker tripping after 2 failures for a minute) and `b-up`.
fn two_backends(set: &Path, down: &str, up: &str) -> String {
    let set = set.display();
    acme_config(
        "{eur_per_month: 100}",
        &format!(
            "  backends:\n    a-down:\n      kind: grpc\n      url: {down}\n      descriptor_set: {set}\n      \
             circuit_breaker: {{failures: 2, interval: 60s, trip: 60s}}\n    b-up:\n      kind: grpc\n      \
             url: {up}\n      descriptor_set: {set}\n"
        ),
    )
}

/// A URL where nothing listens, for as long as the port is held.
fn closed_url() -> (ClosedPort, String) {
    let closed = ClosedPort::new();
    let url = format!("http://127.0.0.1:{}", closed.port());
    (closed, url)
}

#[tokio::test]
async fn a_call_falls_back_to_the_next_backend_declaring_the_service_and_is_charged_once() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_closed, down) = closed_url();
    let config = two_backends(&descriptor_file(dir.path()), &down, &upstream.url());
    let (adapters, audit) = memory_adapters();
    let gateway = serve_in_process(&config, adapters).await;
    let mut ocr = client(&gateway.url).await;

    // Per call and per byte (whose first message was read before the first attempt).
    let answer = ocr.recognize(authed(image(10, 0), KEY)).await.unwrap();
    assert_eq!(answer.get_ref().text, "10");
    assert_eq!(answer.metadata().get("flexway-backend").unwrap(), "b-up");
    assert_eq!(answer.metadata().get("flexway-degraded").unwrap(), "backend-fallback");
    let request = image(100, 50);
    let request_bytes = request.encoded_len() as u64;
    let answer = ocr.extract(authed(request, KEY)).await.unwrap();
    let response_bytes = answer.get_ref().encoded_len() as u64;
    assert_eq!(answer.metadata().get("flexway-backend").unwrap(), "b-up");
    assert_eq!(upstream.calls(), 2, "each call reached the backend that served it once");

    let records = audit_records_until(&audit, 2).await;
    assert!(records.iter().all(|r| r.backend.as_deref() == Some("b-up") && r.degraded && r.status == 0), "{records:?}");
    let per_byte = (request_bytes + response_bytes) * PER_BYTE_MICRO;
    assert_eq!(records.iter().map(|r| r.cost_micro_eur).collect::<Vec<_>>(), [PER_CALL_MICRO, per_byte]);
    assert_eq!(gateway.ledger("acme", None).await[2], PER_CALL_MICRO + per_byte, "charged once, where it was served");
    assert_eq!(gateway.live_reservations().await, 0);
}

#[tokio::test]
async fn a_grpc_backend_whose_breaker_opened_is_skipped_until_its_trip_ends() {
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The down backend listens on a port that drops each connection: a failure a call.
    let down = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let down_url = format!("http://{}", down.local_addr().unwrap());
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = down.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(socket);
        }
    });
    let config = two_backends(&descriptor_file(dir.path()), &down_url, &upstream.url());
    let (adapters, _audit) = memory_adapters();
    let gateway = serve_in_process(&config, adapters).await;
    let mut ocr = client(&gateway.url).await;
    for _ in 0..6 {
        let answer = ocr.recognize(authed(image(1, 0), KEY)).await.unwrap();
        assert_eq!(answer.metadata().get("flexway-backend").unwrap(), "b-up");
    }
    let tried = accepted.load(std::sync::atomic::Ordering::SeqCst);
    assert!((2..6).contains(&tried), "the down backend is tried until its breaker opens, then skipped: {tried}");
    assert_eq!(upstream.calls(), 6);
    let metrics = client_get(&format!("{}/metrics", gateway.url)).await;
    assert!(metrics.contains(r#"flexway_breaker_state{backend="a-down"} 1"#), "{metrics}");
}

async fn client_get(url: &str) -> String {
    flexway_testkit::client().get(url).send().await.unwrap().text().await.unwrap()
}

/// A tenant's per-minute limit holds on gRPC too (SPEC §14): past it, the call is
/// refused with `RESOURCE_EXHAUSTED` and the window's message, never sent upstream.
#[tokio::test]
async fn a_requests_per_minute_limit_refuses_with_resource_exhausted() {
    let second = flexway::budget::period::unix_now() % 60;
    if second > 50 {
        tokio::time::sleep(std::time::Duration::from_secs(60 - second)).await;
    }
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{}", false, "{sink: stdout}")
        .replace("    budgets: {}\n", "    budgets: {}\n    limits: {requests_per_minute: 2}\n");
    let flexway = Flexway::start(&config);
    let mut ocr = client(&flexway.url).await;
    for _ in 0..2 {
        ocr.recognize(authed(image(1, 0), KEY)).await.unwrap();
    }
    let status = ocr.recognize(authed(image(1, 0), KEY)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("rate_limit_exceeded"), "{}", status.message());
    assert!(status.message().contains("tenant acme requests_per_minute (2)"), "{}", status.message());
    assert_eq!(upstream.calls(), 2, "a refused call never reaches the upstream");
    let records = flexway.records_until::<serde_json::Value>(3).await;
    assert_eq!(records[2]["error_code"], "rate_limit_exceeded");
}

/// An unmetered method costs nothing but still counts in its caller's
/// `requests_per_minute` (SPEC §14: limits hold on every door): past the limit it is
/// refused with `RESOURCE_EXHAUSTED`, never sent upstream, and its record says a rate
/// limit refused it, not a budget (`budget_state` stays `ok`).
#[tokio::test]
async fn an_unmetered_method_counts_in_requests_per_minute() {
    let second = flexway::budget::period::unix_now() % 60;
    if second > 50 {
        tokio::time::sleep(std::time::Duration::from_secs(60 - second)).await;
    }
    let upstream = FakeOcr::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = grpc_config(&descriptor_file(dir.path()), &upstream.url(), "{}", false, "{sink: stdout}")
        .replace("    budgets: {}\n", "    budgets: {}\n    limits: {requests_per_minute: 2}\n");
    let flexway = Flexway::start(&config);
    let mut ocr = client(&flexway.url).await;
    let first = ocr.health(authed(Ping { note: "1".into() }, KEY)).await.unwrap();
    assert_eq!(first.metadata().get("x-ratelimit-limit-requests").unwrap(), "2");
    assert_eq!(first.metadata().get("x-ratelimit-remaining-requests").unwrap(), "1");
    assert_eq!(first.metadata().get("flexway-cost-eur").unwrap(), "0.000000");
    ocr.health(authed(Ping { note: "2".into() }, KEY)).await.unwrap();
    let status = ocr.health(authed(Ping { note: "3".into() }, KEY)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("rate_limit_exceeded"), "{}", status.message());
    assert!(status.message().contains("tenant acme requests_per_minute (2)"), "{}", status.message());
    assert_eq!(upstream.calls(), 2, "a refused call never reaches the upstream");
    let records = flexway.records_until::<serde_json::Value>(3).await;
    assert_eq!(records[2]["status"], 8);
    assert_eq!(records[2]["error_code"], "rate_limit_exceeded");
    assert_eq!(records[2]["budget_state"], "ok", "a rate limit is no budget exceeded: {}", records[2]);
    assert_eq!(records.iter().map(|r| r["cost_micro_eur"].as_u64()).collect::<Vec<_>>(), [Some(0); 3]);
}
