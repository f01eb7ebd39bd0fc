//! REST operations (SPEC §10): the real binary in front of a fake REST upstream on
//! loopback, built from the contract the gateway reads. Per call and per byte metered
//! to the micro-euro, unmetered operations proxied, the contract as the allow-list,
//! refunds, a relayed 4xx, sensitivity, a burst on a small euro cap, fallback, a
//! breaker's probe whose client leaves, and the refusals at load.
#![cfg(test)]

use std::sync::{Arc, Mutex};

use axum::extract::{Path, Request};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use flexway::audit::AuditRecord;
use flexway_testkit::*;
use futures_util::StreamExt;
use serde_json::{Value, json};

/// The contract both the gateway and the fake are built from: `/documents` per byte
/// at 0.001 €/thousand bytes (1 µ€ a byte), `/documents/latest` per call at 0.5 €/thousand
/// calls (500 µ€ a call), `/documents/{id}` and `/missing` unmetered, `/pages` per byte
/// (a slow answer), `/fail` per call.
const CONTRACT: &str = r#"
openapi: 3.1.0
info: {title: OCR, version: "1"}
paths:
  /documents:
    post:
      x-flexway-ai: {metering: per_byte, price_per_thousand_eur: "0.001", feature: ocr}
      responses: {"200": {description: ok}}
  /documents/latest:
    get:
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "0.5", feature: ocr-latest}
      responses: {"200": {description: ok}}
  /documents/{id}:
    get: {responses: {"200": {description: ok}}}
    delete: {responses: {"204": {description: gone}}}
  /missing:
    get: {responses: {"404": {description: never there}}}
  /flood:
    get:
      x-flexway-ai: {metering: per_byte, price_per_thousand_eur: "0.0001", feature: flood}
      responses: {"200": {description: ok}}
  /pages:
    get:
      x-flexway-ai: {metering: per_byte, price_per_thousand_eur: "0.001", feature: pages}
      responses: {"200": {description: ok}}
  /fail:
    post:
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "0.5", feature: ocr-latest}
      responses: {"200": {description: ok}}
"#;

/// What the fake upstream saw: method, path and query, and the headers it got.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<(String, String, axum::http::HeaderMap)>>>);

impl Seen {
    fn all(&self) -> Vec<(String, String, axum::http::HeaderMap)> {
        self.0.lock().unwrap().clone()
    }
}

/// The fake: `POST /documents` answers `{"bytes": N}` (what it read), padded to
/// exactly 64 bytes; `GET /documents/latest` and `GET /documents/{id}` answer JSON;
/// `GET /pages` answers 50 chunks of 100 bytes, 50 ms apart; `/missing` is 404,
/// `/fail` 500.
async fn upstream(seen: Seen, fail_all: bool) -> String {
    let log = move |request: &Request| {
        let uri = request.uri();
        let target = uri.path_and_query().map(|p| p.to_string()).unwrap_or_default();
        seen.0.lock().unwrap().push((request.method().to_string(), target, request.headers().clone()));
    };
    let router = axum::Router::new()
        .route(
            "/documents",
            post(|request: Request| async move {
                let mut body = request.into_body().into_data_stream();
                let mut bytes = 0u64;
                while let Some(chunk) = body.next().await {
                    bytes += chunk.unwrap().len() as u64;
                }
                format!("{:<64}", format!("{{\"bytes\": {bytes}}}"))
            }),
        )
        .route("/documents/latest", get(|| async { axum::Json(json!({"latest": true})) }))
        .route("/documents/{id}", get(|Path(id): Path<String>| async move { axum::Json(json!({"id": id})) }))
        .route(
            "/pages",
            get(|| async {
                let pages = futures_util::stream::unfold(0, |n| async move {
                    if n == 50 {
                        return None;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    Some((Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'p'; 100])), n + 1))
                });
                axum::body::Body::from_stream(pages)
            }),
        )
        .route(
            "/flood",
            get(|| async {
                // 64 MiB as fast as it can be read.
                let chunk = bytes::Bytes::from(vec![b'f'; 64 * 1024]);
                let chunks = futures_util::stream::iter((0..1024).map(move |_| Ok::<_, std::io::Error>(chunk.clone())));
                axum::body::Body::from_stream(chunks)
            }),
        )
        .route("/missing", get(|| async { (axum::http::StatusCode::NOT_FOUND, "no such document") }))
        .route("/fail", post(|| async { (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "upstream broke") }))
        .layer(axum::middleware::from_fn(move |request: Request, next: axum::middleware::Next| {
            log(&request);
            async move {
                if fail_all {
                    return (axum::http::StatusCode::SERVICE_UNAVAILABLE, "down").into_response();
                }
                next.run(request).await
            }
        }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

/// A config: acme with `budgets`, and `http` backends as `(name, url, extra keys)`.
fn rest_config(dir: &std::path::Path, budgets: &str, backends: &[(&str, &str, &str)]) -> String {
    acme_config(budgets, &rest_ai(dir, backends))
}

/// The `ai:` body of `http` backends as `(name, url, extra keys)`, their contract
/// written in `dir`.
fn rest_ai(dir: &std::path::Path, backends: &[(&str, &str, &str)]) -> String {
    let contract = dir.join("ocr.yaml");
    std::fs::write(&contract, CONTRACT).unwrap();
    let mut ai = String::from("  backends:\n");
    for (name, url, extra) in backends {
        ai.push_str(&format!(
            "    {name}: {{kind: http, url: \"{url}\", contract: \"{}\", auth: {{type: bearer, secret: \"env:OCR_KEY\"}}{extra}}}\n",
            contract.display()
        ));
    }
    ai
}

fn start(yaml: &str) -> Flexway {
    Flexway::start_with_env(yaml, &[("OCR_KEY", "sk-upstream-ocr")])
}

fn call(gw: &Flexway, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
    client().request(method, format!("{}{path}", gw.url)).bearer_auth(KEY)
}

#[tokio::test]
async fn metered_operations_cost_to_the_micro_euro_and_unmetered_ones_pass_as_they_are() {
    let seen = Seen::default();
    let url = upstream(seen.clone(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = start(&rest_config(dir.path(), "{eur_per_month: 10}", &[("ocr", &url, ", mount: /apis/ocr")]));

    // Per call: 500 µ€, whatever the body.
    let latest = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/latest").send().await.unwrap();
    assert_eq!(latest.status(), 200);
    assert_eq!(latest.headers()["flexway-backend"], "ocr");
    assert_eq!(latest.json::<Value>().await.unwrap(), json!({"latest": true}));

    // Per byte: 10,000 bytes up, 64 down, at 1 µ€ a byte.
    let upload = vec![b'x'; 10_000];
    let ocr = call(&gw, reqwest::Method::POST, "/apis/ocr/documents").body(upload).send().await.unwrap();
    assert_eq!(ocr.status(), 200);
    let text = ocr.text().await.unwrap();
    assert_eq!((text.len(), text.trim()), (64, "{\"bytes\": 10000}"));

    // Unmetered: the path, the query, the backend's key, never the caller's.
    let doc = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/42?lang=fr&x=1")
        .header("x-trace-me", "yes")
        .header("flexway-sensitive", "false")
        .send()
        .await
        .unwrap();
    assert_eq!(doc.json::<Value>().await.unwrap(), json!({"id": "42"}));

    let records = gw.records_until::<AuditRecord>(3).await;
    let by_model = |model: &str| records.iter().find(|r| r.model_requested.as_deref() == Some(model)).unwrap().clone();
    let latest = by_model("GET /documents/latest");
    assert_eq!((latest.cost_micro_eur, latest.feature.as_deref(), latest.status), (500, Some("ocr-latest"), 200));
    assert_eq!(latest.operation.as_str(), "http");
    let ocr = by_model("POST /documents");
    assert_eq!((ocr.cost_micro_eur, ocr.feature.as_deref()), (10_064, Some("ocr")));
    let doc = by_model("GET /documents/{id}");
    assert_eq!((doc.cost_micro_eur, doc.feature.as_deref(), doc.backend.as_deref()), (0, None, Some("ocr")));

    // Metrics carry the feature; the report splits the rows by it.
    let metrics = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
    let ocr_cost = r#"flexway_inference_cost_eur_total{tenant="acme",backend="ocr",metered_by="local",capability="http",feature="ocr"} 0.010064"#;
    assert!(metrics.contains(ocr_cost), "{metrics}");
    let audit = dir.path().join("audit.jsonl");
    std::fs::write(&audit, gw.stdout().join("\n") + "\n").unwrap();
    let report = std::process::Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["report", "--format", "csv", "--audit"])
        .arg(&audit)
        .output()
        .unwrap();
    let csv = String::from_utf8_lossy(&report.stdout);
    assert!(csv.contains("acme,-,ocr,local,1,0,0,0.010064,ocr\n"), "{csv}");
    assert!(csv.contains("acme,-,ocr,local,1,0,0,0.000500,ocr-latest\n"), "{csv}");

    let seen = seen.all();
    let (_, target, headers) = seen.iter().find(|(_, target, _)| target.starts_with("/documents/42")).unwrap();
    assert_eq!(target, "/documents/42?lang=fr&x=1");
    assert_eq!(headers["authorization"], "Bearer sk-upstream-ocr");
    assert_eq!(headers["x-trace-me"], "yes");
    assert!(!headers.contains_key("flexway-sensitive"));
    assert!(seen.iter().all(|(_, _, h)| h["authorization"] != format!("Bearer {KEY}").as_str()));
}

#[tokio::test]
async fn the_contract_is_the_allow_list_and_refusals_are_problem_documents() {
    let seen = Seen::default();
    let url = upstream(seen.clone(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = start(&rest_config(dir.path(), "{eur_per_month: 10}", &[("ocr", &url, ", mount: /apis/ocr")]));

    let unknown = call(&gw, reqwest::Method::GET, "/apis/ocr/admin/users").send().await.unwrap();
    assert_eq!(unknown.status(), 404);
    assert_eq!(unknown.headers()["content-type"], "application/problem+json");
    let problem: Value = unknown.json().await.unwrap();
    assert_eq!(problem["code"], "operation_not_found", "{problem}");

    let wrong = call(&gw, reqwest::Method::PUT, "/apis/ocr/documents/42").send().await.unwrap();
    assert_eq!(wrong.status(), 405);
    assert_eq!(wrong.headers()["allow"], "GET, DELETE");
    assert_eq!(wrong.json::<Value>().await.unwrap()["code"], "method_not_allowed");

    // No key: 401, and no record; a wrong key likewise.
    let anonymous = client().get(format!("{}/apis/ocr/documents/42", gw.url)).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);

    // A relayed 4xx is the upstream's, and costs nothing.
    let missing = call(&gw, reqwest::Method::GET, "/apis/ocr/missing").send().await.unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(missing.text().await.unwrap(), "no such document");

    let records = gw.records_until::<AuditRecord>(3).await;
    let codes: Vec<(u16, Option<&str>)> =
        records.iter().map(|r| (r.status, r.error_code.map(|c| c.as_str()))).collect();
    assert_eq!(codes, [(404, Some("operation_not_found")), (405, Some("method_not_allowed")), (404, None)]);
    assert!(records.iter().all(|r| r.cost_micro_eur == 0));
    // Nothing the contract does not declare reached the upstream.
    let targets: Vec<String> = seen.all().into_iter().map(|(m, t, _)| format!("{m} {t}")).collect();
    assert_eq!(targets, ["GET /missing"]);

    // Matched as the upstream reads it: an encoded literal is that literal (metered),
    // and a path that would move (`..`, `//`, an encoded `/`) is no operation.
    for path in ["/apis/ocr/documents/%2e%2e", "/apis/ocr/documents/..%2Fadmin", "/apis/ocr//documents/42"] {
        let moved = call(&gw, reqwest::Method::DELETE, path).send().await.unwrap();
        assert_eq!(moved.status(), 404, "{path}");
    }
    let encoded = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/lat%65st").send().await.unwrap();
    assert_eq!(encoded.status(), 200);
    let records = gw.records_until::<AuditRecord>(7).await;
    assert_eq!(records[6].cost_micro_eur, 500, "{:?}", records[6]);
    assert_eq!(seen.all().len(), 2, "only the two declared operations reached the upstream");
}

#[tokio::test]
async fn a_failed_upstream_is_refunded_falls_back_and_a_sensitive_call_stays_internal() {
    let (broken, healthy) = (Seen::default(), Seen::default());
    let broken_url = upstream(broken.clone(), true).await;
    let healthy_url = upstream(healthy.clone(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = rest_config(
        dir.path(),
        "{eur_per_month: 10}",
        &[("ocr", &broken_url, ", mount: /apis/ocr"), ("spare", &healthy_url, ", mount: /apis/spare, external: false")],
    );
    let gw = start(&yaml);

    // The mount's backend answers 503: the call goes to the other backend that
    // declares the operation, degraded; it costs one call.
    let served = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/latest").send().await.unwrap();
    assert_eq!(served.status(), 200);
    assert_eq!(served.headers()["flexway-backend"], "spare");
    assert_eq!(served.headers()["flexway-degraded"], "backend-fallback");

    // Sensitive: the external mount's backend is never called.
    let before = broken.all().len();
    let sensitive = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/7").header("flexway-sensitive", "true");
    assert_eq!(sensitive.send().await.unwrap().status(), 200);
    assert_eq!(broken.all().len(), before, "a sensitive call reached an external backend");

    // With the only internal backend unable to serve, a sensitive call is refused.
    let dir2 = tempfile::tempdir().unwrap();
    let only_external =
        start(&rest_config(dir2.path(), "{eur_per_month: 10}", &[("ocr", &healthy_url, ", mount: /apis/ocr")]));
    let refused = call(&only_external, reqwest::Method::GET, "/apis/ocr/documents/7")
        .header("flexway-sensitive", "true")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    assert_eq!(refused.json::<Value>().await.unwrap()["code"], "sensitive_no_internal_backend");

    // A 5xx everywhere: 503, refunded.
    let dir3 = tempfile::tempdir().unwrap();
    let down = start(&rest_config(dir3.path(), "{eur_per_month: 10}", &[("ocr", &broken_url, ", mount: /apis/ocr")]));
    let failed = call(&down, reqwest::Method::POST, "/apis/ocr/fail").send().await.unwrap();
    assert_eq!(failed.status(), 503);
    let records = down.records_until::<AuditRecord>(1).await;
    assert_eq!(
        (records[0].cost_micro_eur, records[0].error_code.map(|c| c.as_str())),
        (0, Some("upstream_unavailable"))
    );

    // Each relay ends its call in a task of its own: the records may come in either
    // order.
    let records = gw.records_until::<AuditRecord>(2).await;
    let fell_back = records.iter().find(|r| r.model_requested.as_deref() == Some("GET /documents/latest")).unwrap();
    assert_eq!(fell_back.cost_micro_eur, 500, "{records:?}");
    assert!(fell_back.degraded);
}

#[tokio::test]
async fn residency_holds_through_the_rest_door() {
    let (us, eu) = (Seen::default(), Seen::default());
    let us_url = upstream(us.clone(), false).await;
    let eu_url = upstream(eu.clone(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = rest_config(
        dir.path(),
        "{eur_per_month: 10}",
        &[
            ("ocr", &us_url, ", mount: /apis/ocr, jurisdiction: us"),
            ("spare", &eu_url, ", mount: /apis/spare, jurisdiction: eu"),
        ],
    );
    let gw = start(&yaml);
    // Through the us mount, a call bound to the eu goes to the eu backend that
    // declares the operation; one bound to ch is refused; none reaches the us.
    let served = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/7").header("flexway-jurisdiction", "eu").send();
    let served = served.await.unwrap();
    assert_eq!((served.status().as_u16(), served.headers()["flexway-backend"].to_str().unwrap()), (200, "spare"));
    let refused = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/7").header("flexway-jurisdiction", "ch").send();
    let refused = refused.await.unwrap();
    assert_eq!(refused.status(), 403);
    assert_eq!(refused.json::<Value>().await.unwrap()["code"], "residency_unavailable");
    assert!(us.all().is_empty(), "a residency-bound call reached the us");
    assert_eq!(eu.all().len(), 1);
}

/// 32 per-call calls at once on a cap of 10 calls' worth: exactly 10 served, the
/// others refused with 429, and the audit's euros equal the cap.
#[tokio::test]
async fn a_burst_on_a_small_euro_cap_never_passes_it() {
    let url = upstream(Seen::default(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = start(&rest_config(dir.path(), "{eur_per_month: 0.005}", &[("ocr", &url, ", mount: /apis/ocr")]));
    let calls = (0..32).map(|_| call(&gw, reqwest::Method::GET, "/apis/ocr/documents/latest").send());
    let statuses: Vec<u16> =
        futures_util::future::join_all(calls).await.into_iter().map(|r| r.unwrap().status().as_u16()).collect();
    let served = statuses.iter().filter(|s| **s == 200).count();
    assert_eq!(served, 10, "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "{statuses:?}");
    let records = gw.records_until::<AuditRecord>(32).await;
    let charged: u64 = records.iter().map(|r| r.cost_micro_eur).sum();
    assert_eq!(charged, 5_000);
    assert_eq!(records.iter().filter(|r| r.error_code.map(|c| c.as_str()) == Some("budget_exceeded")).count(), 22);
}

/// `flexway validate` refuses what a REST backend cannot be, naming the file and the
/// operation.
#[test]
fn load_refuses_bad_mounts_and_contracts() {
    let dir = tempfile::tempdir().unwrap();
    let validate = |yaml: &str| {
        let path = dir.path().join("flexway.yaml");
        std::fs::write(&path, yaml).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_flexway"))
            .args(["validate", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
        )
    };
    let url = "http://127.0.0.1:9";
    for (mount, why) in [
        ("/v1/ocr", "overlaps the gateway's own /v1"),
        ("/metrics", "overlaps the gateway's own /metrics"),
        ("apis/ocr", "not an absolute path"),
        ("/apis/", "not an absolute path"),
    ] {
        let (ok, out) = validate(&rest_config(dir.path(), "{}", &[("ocr", url, &format!(", mount: \"{mount}\""))]));
        assert!(!ok && out.contains(why), "{mount}: {out}");
    }
    let (ok, out) =
        validate(&rest_config(dir.path(), "{}", &[("a", url, ", mount: /apis"), ("b", url, ", mount: /apis/ocr")]));
    assert!(!ok && out.contains("overlaps `/apis`, the mount of backend `a`"), "{out}");

    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "openapi: 3.1.0\ninfo: {title: t, version: '1'}\npaths:\n  /ocr:\n    post:\n      x-flexway-ai: {metering: per_call, feature: ocr}\n",
    )
    .unwrap();
    let yaml = rest_config(dir.path(), "{}", &[("ocr", url, ", mount: /apis/ocr")]).replace("ocr.yaml", "bad.yaml");
    let (ok, out) = validate(&yaml);
    assert!(!ok && out.contains("bad.yaml POST /ocr: x-flexway-ai has no price_per_thousand_eur"), "{out}");
    std::fs::write(&bad, "swagger: '2.0'\n").unwrap();
    let (ok, out) = validate(&yaml);
    assert!(!ok && out.contains("no `openapi` version"), "{out}");
    let (ok, out) = validate(&yaml.replace("bad.yaml", "absent.yaml"));
    assert!(!ok && out.contains("cannot read"), "{out}");
    // Keys of other kinds are refused on an http backend.
    let (ok, out) = validate(&rest_config(dir.path(), "{}", &[("ocr", url, ", mount: /apis/ocr, models: [m]")]));
    assert!(!ok && out.contains("models"), "{out}");
}

/// A large upload streams through in bounded memory: 1 GiB, per byte metered, the
/// gateway's peak RSS far below it.
#[tokio::test]
async fn a_large_upload_streams_in_bounded_memory() {
    let url = upstream(Seen::default(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = start(&rest_config(dir.path(), "{eur_per_month: 5000}", &[("ocr", &url, ", mount: /apis/ocr")]));
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 1024;
    let chunks =
        futures_util::stream::iter((0..CHUNKS).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'p'; CHUNK]))));
    let response = reqwest::Client::new()
        .post(format!("{}/apis/ocr/documents", gw.url))
        .bearer_auth(KEY)
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{}", gw.logs());
    assert_eq!(response.text().await.unwrap().trim(), format!("{{\"bytes\": {}}}", CHUNK * CHUNKS));
    let records = gw.records_until::<AuditRecord>(1).await;
    assert_eq!(records[0].cost_micro_eur, (CHUNK * CHUNKS) as u64 + 64);
    let rss = gw.peak_rss();
    eprintln!("peak RSS after a 1 GiB upload: {} MiB", rss >> 20);
    assert!(rss < 200 << 20, "peak RSS {} MiB", rss >> 20);
}

/// A per-byte upload of unknown length that would pass the cap is cut at the step
/// that is refused: 429, nothing charged (the upstream never answered), and an
/// upload that fits is charged what passed.
#[tokio::test]
async fn a_streamed_upload_is_cut_at_the_cap() {
    let url = upstream(Seen::default(), false).await;
    let dir = tempfile::tempdir().unwrap();
    // 0.02 € = 20,000 µ€ = 20,000 bytes at 1 µ€ a byte.
    let gw = start(&rest_config(dir.path(), "{eur_per_month: 0.02}", &[("ocr", &url, ", mount: /apis/ocr")]));
    let upload = |chunks: usize| {
        let chunks = futures_util::stream::iter(
            (0..chunks).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'u'; 1000]))),
        );
        call(&gw, reqwest::Method::POST, "/apis/ocr/documents").body(reqwest::Body::wrap_stream(chunks)).send()
    };
    let cut = upload(50).await.unwrap();
    assert_eq!(cut.status(), 429);
    assert_eq!(cut.json::<Value>().await.unwrap()["code"], "budget_exceeded");
    let fits = upload(10).await.unwrap();
    assert_eq!(fits.status(), 200);
    let records = gw.records_until::<AuditRecord>(2).await;
    let costs: Vec<(u16, u64)> = records.iter().map(|r| (r.status, r.cost_micro_eur)).collect();
    assert_eq!(costs, [(429, 0), (200, 10_064)]);
}

/// The fake upstream mounted at `/apis/ocr` as backend `ocr` (with `extra` keys),
/// served in process on a memory ledger: acme with 10 € a month.
async fn mounted_ocr(extra: &str) -> (InProcess, Arc<flexway::audit::sinks::MemoryAuditSink>, tempfile::TempDir) {
    let url = upstream(Seen::default(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let contract = dir.path().join("ocr.yaml");
    std::fs::write(&contract, CONTRACT).unwrap();
    let ai = format!(
        "  backends:\n    ocr: {{kind: http, url: \"{url}\", contract: \"{}\", mount: /apis/ocr{extra}}}\n",
        contract.display()
    );
    let (adapters, audit) = memory_adapters();
    (serve_in_process(&acme_config("{eur_per_month: 10}", &ai), adapters).await, audit, dir)
}

/// Reads the first chunk of an answer's body (not empty), then leaves.
async fn read_a_chunk_and_leave(response: reqwest::Response) {
    let mut body = response.bytes_stream();
    assert!(!body.next().await.unwrap().unwrap().is_empty());
}

/// The audit's records once `done` holds of them, or after two seconds.
async fn records_once(
    audit: &flexway::audit::sinks::MemoryAuditSink,
    done: impl Fn(&[AuditRecord]) -> bool,
) -> Vec<AuditRecord> {
    let mut records = audit.records();
    for _ in 0..200 {
        if done(&records) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        records = audit.records();
    }
    records
}

/// A client that leaves mid-answer ends the call in its relay: one record, 499
/// `client_closed_request`, charged for what passed before it left, and the ledger
/// holds exactly that, with no reservation left behind.
#[tokio::test]
async fn a_client_that_leaves_mid_answer_is_recorded_once_and_charged_what_passed() {
    let (gw, audit, _dir) = mounted_ocr("").await;
    let response = client().get(format!("{}/apis/ocr/pages", gw.url)).bearer_auth(KEY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    read_a_chunk_and_leave(response).await;
    let records = records_once(&audit, |records| !records.is_empty()).await;
    assert_eq!(records.len(), 1, "one record");
    let record = &records[0];
    assert_eq!((record.status, record.error_code.map(|c| c.as_str())), (499, Some("client_closed_request")));
    assert!(record.cost_micro_eur > 0 && record.cost_micro_eur < 5_000, "{}", record.cost_micro_eur);
    let [_, _, eur] = gw.ledger("acme", None).await;
    assert_eq!(eur, record.cost_micro_eur);
    assert_eq!(gw.live_reservations().await, 0);
    // Nothing more is written for it: once a marker call's record is in, a second one
    // (its relay's task long gone) would be in before it.
    let marker = client().get(format!("{}/apis/ocr/documents/7", gw.url)).bearer_auth(KEY).send().await.unwrap();
    let _ = marker.bytes().await;
    let written = audit_records_until(&audit, 2).await;
    assert_eq!(written.len(), 2, "one record for the call whose client left");
    assert_eq!(written[1].status, 200, "the marker's");
}

/// A client slower than the platform's clock (Lambda throttles a streamed answer to
/// some 2 MB/s): the relay's send waits on the client, not the upstream, and still
/// ends at the cutoff, settled on what passed and recorded, while the client has not
/// read a byte.
#[tokio::test]
async fn an_answer_its_client_does_not_read_ends_at_the_invocations_deadline() {
    let url = upstream(Seen::default(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let contract = dir.path().join("ocr.yaml");
    std::fs::write(&contract, CONTRACT).unwrap();
    let ai = format!(
        "  backends:\n    ocr: {{kind: http, url: \"{url}\", contract: \"{}\", mount: /apis/ocr}}\n",
        contract.display()
    );
    let (adapters, audit) = memory_adapters();
    let deadline = flexway::http::Deadline::within(std::time::Duration::from_secs(2));
    let gw = serve_router_in_process(&acme_config("{eur_per_month: 10}", &ai), adapters, |g| {
        flexway::http::api(g).layer(axum::Extension(deadline))
    })
    .await;
    let response = client().get(format!("{}/apis/ocr/flood", gw.url)).bearer_auth(KEY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    // Not read: the record comes all the same, by the cutoff (1.8 s).
    let records = audit_records_until(&audit, 1).await;
    assert_eq!(records[0].error_code.map(|c| c.as_str()), Some("deadline"), "{:?}", records[0]);
    assert!(records[0].cost_micro_eur > 0, "what passed is charged");
    assert_eq!(gw.ledger("acme", None).await[2], records[0].cost_micro_eur, "the ledger equals the audit");
    assert_eq!(gw.live_reservations().await, 0);
    // Read now, the answer is cut with an error: it never ends as if it were whole.
    let read = response.bytes().await;
    assert!(read.is_err(), "the client read {} bytes as a whole answer", read.map_or(0, |b| b.len()));
}

/// A client that leaves mid-answer says nothing against the backend, which was
/// answering: when that call was a half-open breaker's one probe, the breaker hears
/// the answer's head (a success) and closes, rather than holding every other call off
/// until the lost probe's `trip` has passed again.
#[tokio::test]
async fn a_probe_whose_client_leaves_mid_answer_still_closes_the_breaker() {
    let (gw, audit, _dir) = mounted_ocr(", circuit_breaker: {failures: 1, trip: 1s}").await;
    let get = |path: &str| client().get(format!("{}/apis/ocr{path}", gw.url)).bearer_auth(KEY).send();

    // One 500 opens the breaker; while it is open, nothing is sent.
    let failed = client().post(format!("{}/apis/ocr/fail", gw.url)).bearer_auth(KEY).send().await.unwrap();
    assert!(failed.status().is_server_error(), "{}", failed.status());
    assert_eq!(get("/documents/latest").await.unwrap().status(), 503, "open");

    // Its trip over, the next call is the probe: its client leaves after a chunk.
    tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    let probe = get("/pages").await.unwrap();
    assert_eq!(probe.status(), 200);
    read_a_chunk_and_leave(probe).await;
    let records = records_once(&audit, |records| records.iter().any(|r| r.status == 499)).await;
    assert!(records.iter().any(|r| r.status == 499), "the probe ended, its client gone");

    // Well within another trip: the breaker closed on the probe.
    let after = get("/documents/latest").await.unwrap();
    assert_eq!(after.status(), 200, "{}", after.text().await.unwrap());
}

/// A REST call under a per-minute limit paces with OpenAI's headers and is refused
/// past it with problem+json 429 (SPEC §14).
#[tokio::test]
async fn a_requests_per_minute_limit_paces_and_refuses_rest_calls() {
    let second = flexway::budget::period::unix_now() % 60;
    if second > 50 {
        tokio::time::sleep(std::time::Duration::from_secs(60 - second)).await;
    }
    let url = upstream(Seen::default(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml =
        rest_config(dir.path(), "{}\n    limits: {requests_per_minute: 2}", &[("ocr", &url, ", mount: /apis/ocr")]);
    let gw = start(&yaml);
    let first = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/latest").send().await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-ratelimit-limit-requests"], "2");
    assert_eq!(first.headers()["x-ratelimit-remaining-requests"], "1");
    assert_eq!(call(&gw, reqwest::Method::GET, "/apis/ocr/documents/latest").send().await.unwrap().status(), 200);
    let refused = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/latest").send().await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["content-type"], "application/problem+json");
    assert_eq!(refused.headers()["x-should-retry"], "true");
    assert_eq!(refused.headers()["x-ratelimit-remaining-requests"], "0");
    assert_eq!(refused.json::<Value>().await.unwrap()["code"], "rate_limit_exceeded");
}

/// An unmetered operation costs nothing but still counts in its caller's
/// `requests_per_minute` (SPEC §14: limits hold on every door): it paces with the
/// same headers, and past the limit it is refused with problem+json 429, never sent
/// upstream.
#[tokio::test]
async fn an_unmetered_operation_counts_in_requests_per_minute() {
    let second = flexway::budget::period::unix_now() % 60;
    if second > 50 {
        tokio::time::sleep(std::time::Duration::from_secs(60 - second)).await;
    }
    let seen = Seen::default();
    let url = upstream(seen.clone(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml =
        rest_config(dir.path(), "{}\n    limits: {requests_per_minute: 2}", &[("ocr", &url, ", mount: /apis/ocr")]);
    let gw = start(&yaml);
    let first = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/1").send().await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-ratelimit-limit-requests"], "2");
    assert_eq!(first.headers()["x-ratelimit-remaining-requests"], "1");
    assert_eq!(call(&gw, reqwest::Method::GET, "/apis/ocr/documents/2").send().await.unwrap().status(), 200);
    let refused = call(&gw, reqwest::Method::GET, "/apis/ocr/documents/3").send().await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["content-type"], "application/problem+json");
    assert_eq!(refused.headers()["x-ratelimit-remaining-requests"], "0");
    assert_eq!(refused.json::<Value>().await.unwrap()["code"], "rate_limit_exceeded");
    assert_eq!(seen.all().len(), 2, "a refused call never reaches the upstream");
    let records = gw.records_until::<AuditRecord>(3).await;
    assert_eq!(records.iter().map(|r| r.cost_micro_eur).collect::<Vec<_>>(), [0, 0, 0]);
    assert_eq!(records[2].error_code.map(|c| c.as_str()), Some("rate_limit_exceeded"));
}

/// An unmetered operation that carries `Flexway-Run` is one of its run's calls (SPEC
/// §15: a run counts every call), and costs it nothing.
#[tokio::test]
async fn an_unmetered_operation_counts_in_its_runs_calls() {
    let url = upstream(Seen::default(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = config(&rest_ai(dir.path(), &[("ocr", &url, ", mount: /apis/ocr")]));
    let (adapters, audit) = memory_adapters();
    let gw = serve_in_process(&unauthenticated(&yaml), adapters).await;
    let runs = format!("{}/v1/flexway/runs", gw.url);
    let created =
        client().post(&runs).bearer_auth(AGENT_KEY).json(&json!({"budget": {"eur": 1}})).send().await.unwrap();
    assert_eq!(created.status(), 201);
    let id = created.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    for n in 0..3 {
        let doc = client()
            .get(format!("{}/apis/ocr/documents/{n}", gw.url))
            .bearer_auth(AGENT_KEY)
            .header("Flexway-Run", &id)
            .send()
            .await
            .unwrap();
        assert_eq!(doc.status(), 200);
        assert_eq!(doc.json::<Value>().await.unwrap(), json!({"id": n.to_string()}));
    }
    let state: Value =
        client().get(format!("{runs}/{id}")).bearer_auth(AGENT_KEY).send().await.unwrap().json().await.unwrap();
    assert_eq!(state["calls"], 3, "{state}");
    assert_eq!(state["spent"]["eur"].as_f64(), Some(0.0), "{state}");
    let records = audit_records_until(&audit, 3).await;
    assert!(records.iter().all(|r| r.run.as_deref() == Some(id.as_str()) && r.cost_micro_eur == 0), "{records:?}");
    assert_eq!(gw.live_reservations().await, 0, "each call's reservation settled");
}

/// `yaml` with its backends' upstream key left out: `OCR_KEY` is set only for the
/// binary [`start`] runs.
fn unauthenticated(yaml: &str) -> String {
    yaml.replace(", auth: {type: bearer, secret: \"env:OCR_KEY\"}", "")
}

/// A memory ledger that counts the reservations asked of it.
#[derive(Default)]
struct Counting {
    inner: flexway::budget::MemoryBudgetStore,
    reserves: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl flexway::budget::BudgetStore for Counting {
    async fn reserve(
        &self,
        request: &flexway::budget::ReserveRequest,
    ) -> Result<flexway::budget::ReserveOutcome, flexway::budget::StoreError> {
        self.reserves.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.reserve(request).await
    }
    async fn settle(
        &self,
        reservation: &flexway::budget::Reservation,
        actual: &[(flexway::budget::CounterKey, u64)],
    ) -> Result<flexway::budget::SettleOutcome, flexway::budget::StoreError> {
        self.inner.settle(reservation, actual).await
    }
    async fn record_intent(
        &self,
        request_id: &str,
        actual: &[(flexway::budget::CounterKey, u64)],
    ) -> Result<flexway::budget::IntentOutcome, flexway::budget::StoreError> {
        self.inner.record_intent(request_id, actual).await
    }
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(flexway::budget::CounterKey, u64)],
        expires_at: u64,
    ) -> Result<flexway::budget::IntentOutcome, flexway::budget::StoreError> {
        self.inner.renew(request_id, actual, expires_at).await
    }
    async fn sweep(&self, now: u64) -> Result<flexway::budget::Swept, flexway::budget::StoreError> {
        self.inner.sweep(now).await
    }
    async fn used(&self, keys: &[flexway::budget::CounterKey]) -> Result<Vec<u64>, flexway::budget::StoreError> {
        self.inner.used(keys).await
    }
    async fn live_reservations(&self) -> Result<usize, flexway::budget::StoreError> {
        self.inner.live_reservations().await
    }
    async fn create_run(&self, run: &flexway::budget::run::Run) -> Result<bool, flexway::budget::StoreError> {
        self.inner.create_run(run).await
    }
    async fn run(&self, id: &str) -> Result<Option<flexway::budget::run::Run>, flexway::budget::StoreError> {
        self.inner.run(id).await
    }
    async fn end_run(&self, id: &str, at: u64) -> Result<flexway::budget::run::RunEnd, flexway::budget::StoreError> {
        self.inner.end_run(id, at).await
    }
}

/// A caller under no per-minute limit and in no run: its unmetered calls write nothing
/// to the ledger (a budget's cap aside: they spend nothing of it); a metered one
/// reserves as it always did.
#[tokio::test]
async fn an_unmetered_operation_outside_limits_and_runs_writes_nothing() {
    let url = upstream(Seen::default(), false).await;
    let dir = tempfile::tempdir().unwrap();
    let ledger = Arc::new(Counting::default());
    let (mut adapters, audit) = memory_adapters();
    adapters.budgets = ledger.clone();
    let yaml = rest_config(dir.path(), "{eur_per_month: 10}", &[("ocr", &url, ", mount: /apis/ocr")]);
    let gw = serve_in_process(&unauthenticated(&yaml), adapters).await;
    let get = |path: &str| client().get(format!("{}/apis/ocr{path}", gw.url)).bearer_auth(KEY).send();
    for n in 0..2 {
        let doc = get(&format!("/documents/{n}")).await.unwrap();
        assert_eq!(doc.status(), 200);
        assert!(doc.headers().get("x-ratelimit-limit-requests").is_none());
    }
    assert_eq!(ledger.reserves.load(std::sync::atomic::Ordering::SeqCst), 0, "unmetered: no reservation");
    assert_eq!(get("/documents/latest").await.unwrap().status(), 200);
    assert_eq!(ledger.reserves.load(std::sync::atomic::Ordering::SeqCst), 1, "metered: its one reservation");
    assert_eq!(audit_records_until(&audit, 3).await.len(), 3);
}
