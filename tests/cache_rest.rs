//! The response cache on REST operations (SPEC §16: `x-flexway-ai: {cache: POLICY}`,
//! exact, GET and POST), end to end over loopback: the gateway's router with the
//! embedded cache store in a temporary file, in front of a fake REST upstream that
//! counts the requests it gets (a hit is one it never saw).
#![cfg(test)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::{Path, Request};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use flexway::audit::{AuditRecord, CacheOutcome};
use flexway::cache::embedded::EmbeddedCacheStore;
use flexway_testkit::*;

const CACHE_KEY: &str = "0123456789abcdef0123456789abcdef";

/// Every operation per call at 1 €/thousand calls (1,000 µ€ a call): `/documents/{id}`
/// and `/documents` under `faq` (charge none), `/summaries` under `half` (a hit costs
/// half its entry's call), `/uploads` under `small` (entries of 64 bytes at most).
const CONTRACT: &str = r#"
openapi: 3.1.0
info: {title: OCR, version: "1"}
paths:
  /documents/{id}:
    get:
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "1", feature: f, cache: faq}
      responses: {"200": {description: ok}}
  /documents:
    post:
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "1", feature: f, cache: faq}
      responses: {"201": {description: read}}
  /summaries:
    post:
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "1", feature: f, cache: half}
      responses: {"200": {description: ok}}
  /uploads:
    post:
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "1", feature: f, cache: small}
      responses: {"200": {description: ok}}
"#;

const OCR_JSON: &str = "application/vnd.ocr+json";

/// The fake: `GET /documents/{id}` answers `{"id": ID, "query": QUERY}` (`missing` is
/// 404, `broken` 500); `POST /documents` answers 201 with what it read; `/summaries`
/// and `/uploads` answer how many bytes they read.
async fn upstream(count: Arc<AtomicUsize>) -> String {
    let router = axum::Router::new()
        .route(
            "/documents/{id}",
            get(|Path(id): Path<String>, request: Request| async move {
                let query = request.uri().query().unwrap_or("").to_owned();
                match id.as_str() {
                    "missing" => (axum::http::StatusCode::NOT_FOUND, "no such document").into_response(),
                    "broken" => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "upstream broke").into_response(),
                    _ => {
                        let body = format!(r#"{{"id": "{id}", "query": "{query}"}}"#);
                        ([(axum::http::header::CONTENT_TYPE, OCR_JSON)], body).into_response()
                    }
                }
            }),
        )
        .route(
            "/documents",
            post(|body: String| async move {
                (
                    axum::http::StatusCode::CREATED,
                    [(axum::http::header::CONTENT_TYPE, OCR_JSON)],
                    format!("read: {body}"),
                )
            }),
        )
        .route("/summaries", post(|body: bytes::Bytes| async move { format!("{} bytes", body.len()) }))
        .route("/uploads", post(|body: bytes::Bytes| async move { format!("{} bytes", body.len()) }))
        .layer(axum::middleware::from_fn(move |request: Request, next: axum::middleware::Next| {
            count.fetch_add(1, Ordering::SeqCst);
            next.run(request)
        }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

/// Tenants `acme` (KEY) and `globex` (OTHER_KEY), the `ocr` backend at `url` mounted
/// at `/apis/ocr`, the cache in `dir`.
fn config(url: &str, dir: &std::path::Path) -> String {
    let contract = dir.join("ocr.yaml");
    std::fs::write(&contract, CONTRACT).unwrap();
    let key = dir.join("cache.key");
    std::fs::write(&key, CACHE_KEY).unwrap();
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys: [{{sha256: {key_acme}}}]
  globex:
    keys: [{{sha256: {key_globex}}}]
ai:
  backends:
    ocr: {{kind: http, url: "{url}", contract: "{contract}", mount: /apis/ocr}}
  cache:
    store: {{kind: embedded, path: "{path}"}}
    key: "file:{key}"
    policies:
      faq: {{mode: exact, ttl: 1h}}
      half: {{mode: exact, ttl: 1h, charge: 0.5}}
      small: {{mode: exact, ttl: 1h, max_entry_bytes: 64}}
"#,
        key_acme = sha(KEY),
        key_globex = sha(OTHER_KEY),
        contract = contract.display(),
        path = dir.join("cache.db").display(),
        key = key.display(),
    )
}

struct Setup {
    upstream: Arc<AtomicUsize>,
    gw: InProcess,
    audit: Arc<flexway::audit::sinks::MemoryAuditSink>,
    _dir: tempfile::TempDir,
}

async fn setup() -> Setup {
    let upstream = Arc::new(AtomicUsize::new(0));
    let url = self::upstream(upstream.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let (mut adapters, audit) = memory_adapters();
    adapters.cache = Some(Arc::new(EmbeddedCacheStore::open(&dir.path().join("cache.db")).unwrap()));
    let gw = serve_in_process(&config(&url, dir.path()), adapters).await;
    Setup { upstream, gw, audit, _dir: dir }
}

/// What the client got: status, `Content-Type`, `Flexway-Cache` and body.
#[derive(Debug, PartialEq)]
struct Got {
    status: u16,
    content_type: String,
    cache: String,
    body: String,
}

impl Setup {
    async fn send(&self, request: reqwest::RequestBuilder) -> Got {
        let response = request.send().await.unwrap();
        let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_owned());
        let (content_type, cache) =
            (header("content-type").unwrap_or_default(), header("flexway-cache").unwrap_or_default());
        let status = response.status().as_u16();
        Got { status, content_type, cache, body: response.text().await.unwrap() }
    }

    async fn get(&self, key: &str, path: &str) -> Got {
        self.send(client().get(format!("{}/apis/ocr{path}", self.gw.url)).bearer_auth(key)).await
    }

    async fn post(&self, key: &str, path: &str, body: impl Into<reqwest::Body>) -> Got {
        self.send(client().post(format!("{}/apis/ocr{path}", self.gw.url)).bearer_auth(key).body(body)).await
    }

    fn upstream_count(&self) -> usize {
        self.upstream.load(Ordering::SeqCst)
    }

    async fn records(&self, n: usize) -> Vec<AuditRecord> {
        audit_records_until(&self.audit, n).await
    }
}

/// `got`, a hit, is what `first` was (status, content type, body).
fn same_answer(got: &Got, first: &Got) {
    assert!(got.cache.starts_with("hit; similarity=1.000; age="), "{got:?}");
    assert_eq!((got.status, &got.content_type, &got.body), (first.status, &first.content_type, &first.body));
}

#[tokio::test]
async fn a_get_is_served_again_for_the_same_path_and_query_only() {
    let s = setup().await;
    let first = s.get(KEY, "/documents/42?lang=fr").await;
    assert_eq!((first.status, first.cache.as_str()), (200, "miss"), "{first:?}");
    assert_eq!(first.body, r#"{"id": "42", "query": "lang=fr"}"#);
    assert_eq!(first.content_type, OCR_JSON);
    assert_eq!(s.upstream_count(), 1);

    let again = s.get(KEY, "/documents/42?lang=fr").await;
    same_answer(&again, &first);
    assert_eq!(s.upstream_count(), 1, "a hit calls no upstream");

    // Another query, another path: their own entries.
    let other_query = s.get(KEY, "/documents/42?lang=en").await;
    assert_eq!(
        (other_query.cache.as_str(), other_query.body.as_str()),
        ("miss", r#"{"id": "42", "query": "lang=en"}"#)
    );
    let other_path = s.get(KEY, "/documents/43?lang=fr").await;
    assert_eq!(other_path.cache, "miss");
    assert_eq!(s.upstream_count(), 3);

    let records = s.records(4).await;
    let stored = &records[0];
    assert_eq!((stored.cache, stored.cost_micro_eur, stored.status), (Some(CacheOutcome::Stored), 1_000, 200));
    let hit = &records[1];
    assert_eq!((hit.cache, hit.cache_similarity, hit.status), (Some(CacheOutcome::Hit), Some(1.0), 200));
    assert_eq!(hit.cost_micro_eur, 0, "charge: none by default");
    assert_eq!(hit.cost_saved_micro_eur, Some(1_000), "what the entry's call cost");
    assert_eq!((hit.operation.as_str(), hit.model_requested.as_deref()), ("http", Some("GET /documents/{id}")));
    assert_eq!(hit.feature.as_deref(), Some("f"));
    assert_eq!(s.gw.live_reservations().await, 0, "the hit's reservation was given back");
    let metrics = client().get(format!("{}/metrics", s.gw.url)).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains(r#"flexway_cache_lookups_total{tenant="acme",policy="faq",outcome="hit"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_post_is_served_again_for_the_same_body_and_tenant_only() {
    let s = setup().await;
    let first = s.post(KEY, "/documents", "page one").await;
    assert_eq!((first.status, first.cache.as_str(), first.body.as_str()), (201, "miss", "read: page one"));
    let again = s.post(KEY, "/documents", "page one").await;
    same_answer(&again, &first);
    assert_eq!(s.upstream_count(), 1);

    let other_body = s.post(KEY, "/documents", "page two").await;
    assert_eq!((other_body.cache.as_str(), other_body.body.as_str()), ("miss", "read: page two"));
    let other_tenant = s.post(OTHER_KEY, "/documents", "page one").await;
    assert_eq!((other_tenant.status, other_tenant.cache.as_str()), (201, "miss"), "never another tenant's entry");
    assert_eq!(s.upstream_count(), 3);
    // globex's own entry serves globex.
    let globex_again = s.post(OTHER_KEY, "/documents", "page one").await;
    same_answer(&globex_again, &other_tenant);
    assert_eq!(s.upstream_count(), 3);

    let records = s.records(5).await;
    let outcomes: Vec<_> = records.iter().map(|r| (r.tenant.as_str(), r.cache)).collect();
    assert_eq!(
        outcomes,
        [
            ("acme", Some(CacheOutcome::Stored)),
            ("acme", Some(CacheOutcome::Hit)),
            ("acme", Some(CacheOutcome::Stored)),
            ("globex", Some(CacheOutcome::Stored)),
            ("globex", Some(CacheOutcome::Hit)),
        ]
    );
}

#[tokio::test]
async fn an_error_is_never_kept() {
    let s = setup().await;
    for n in 1..=2 {
        let missing = s.get(KEY, "/documents/missing").await;
        assert_eq!((missing.status, missing.cache.as_str()), (404, "miss"), "{missing:?}");
        assert_eq!(missing.body, "no such document");
        let broken = s.get(KEY, "/documents/broken").await;
        assert!(broken.status >= 500, "{broken:?}");
        assert_eq!(s.upstream_count(), 2 * n, "each went upstream");
    }
    let records = s.records(4).await;
    assert!(records.iter().all(|r| r.cache == Some(CacheOutcome::Miss)), "{records:?}");
    assert!(records.iter().all(|r| r.cost_micro_eur == 0), "a 4xx or a 5xx is not charged");
    assert_eq!(s.gw.live_reservations().await, 0);
}

#[tokio::test]
async fn a_hit_costs_the_policys_share_of_its_entrys_call() {
    let s = setup().await;
    let first = s.post(KEY, "/summaries", "a long text").await;
    assert_eq!((first.status, first.body.as_str()), (200, "11 bytes"));
    let again = s.post(KEY, "/summaries", "a long text").await;
    same_answer(&again, &first);
    let records = s.records(2).await;
    assert_eq!(records[0].cost_micro_eur, 1_000);
    let hit = &records[1];
    assert_eq!((hit.cache, hit.cost_micro_eur, hit.cost_saved_micro_eur), (Some(CacheOutcome::Hit), 500, Some(1_000)));
    assert_eq!(s.gw.live_reservations().await, 0);
}

#[tokio::test]
async fn a_body_larger_than_an_entry_goes_upstream_whole_and_is_not_kept() {
    let s = setup().await;
    // Sent with its length, then without (a stream the gateway reads past the bound).
    let sized = s.post(KEY, "/uploads", vec![b'x'; 1_000]).await;
    assert_eq!((sized.status, sized.cache.as_str(), sized.body.as_str()), (200, "bypass", "1000 bytes"));
    let chunks = futures_util::stream::iter((0..10).map(|_| Ok::<_, std::io::Error>(vec![b'y'; 100])));
    let streamed = s.post(KEY, "/uploads", reqwest::Body::wrap_stream(chunks)).await;
    assert_eq!((streamed.cache.as_str(), streamed.body.as_str()), ("bypass", "1000 bytes"), "the same bytes upstream");
    // A small one is kept; its answer fits an entry.
    let small = s.post(KEY, "/uploads", "tiny").await;
    assert_eq!((small.cache.as_str(), small.body.as_str()), ("miss", "4 bytes"));
    same_answer(&s.post(KEY, "/uploads", "tiny").await, &small);
    assert_eq!(s.upstream_count(), 3);
    let records = s.records(4).await;
    assert_eq!(records[0].cache, Some(CacheOutcome::Bypass));
    assert_eq!(records[1].cache, Some(CacheOutcome::Bypass));
    assert_eq!(records[0].cost_micro_eur, 1_000, "a bypass is charged as any call");
}

#[tokio::test]
async fn cache_control_is_heard_on_a_rest_call() {
    let s = setup().await;
    let url = format!("{}/apis/ocr/documents/7", s.gw.url);
    let with = |value: &str| client().get(&url).bearer_auth(KEY).header("cache-control", value.to_owned());
    // no-store: not kept; no-cache: not served, kept.
    assert_eq!(s.send(with("no-store")).await.cache, "miss");
    assert_eq!(s.send(with("no-cache")).await.cache, "miss");
    assert_eq!(s.upstream_count(), 2);
    assert!(s.get(KEY, "/documents/7").await.cache.starts_with("hit"));
    assert_eq!(s.upstream_count(), 2);
    let records = s.records(3).await;
    assert_eq!(records[0].cache, Some(CacheOutcome::Miss), "no-store: never kept");
    assert_eq!(records[1].cache, Some(CacheOutcome::Stored));
}
