//! Residency (SPEC §4), end to end: the real binary in front of fake backends that
//! stand in different jurisdictions. A residency-bound call never reaches a backend
//! outside its jurisdictions, whichever step would have sent it there: a pool member,
//! a fallback, the soft-cap switch, an agent's override.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use flexway_testkit::*;
use serde_json::Value;

/// The backends, each a fake of its own: `us-1` and `eu-1` in `pool` (us first),
/// `eu-1` falling back to `us-2`, `cheap-us` the soft-cap backend, `ch-1` in `ch`.
struct Backends {
    us1: FakeModel,
    eu1: FakeModel,
    us2: FakeModel,
    cheap: FakeModel,
    ch1: FakeModel,
}

impl Backends {
    async fn start() -> Backends {
        Backends {
            us1: FakeModel::start().await.unwrap(),
            eu1: FakeModel::start().await.unwrap(),
            us2: FakeModel::start().await.unwrap(),
            cheap: FakeModel::start().await.unwrap(),
            ch1: FakeModel::start().await.unwrap(),
        }
    }

    fn outside_eu(&self) -> usize {
        self.us1.request_count() + self.us2.request_count() + self.cheap.request_count() + self.ch1.request_count()
    }
}

/// `acme` (KEY) bound to `eu`, its agent `bot` (AGENT_KEY) routed to `ch-1`; `globex`
/// (OTHER_KEY) unbound. `eu1_url` serves `eu-1`.
fn config(b: &Backends, eu1_url: &str) -> String {
    let backend = |name: &str, url: &str, jurisdiction: &str, extra: &str| {
        format!(
            "    {name}:\n      url: \"{url}\"\n      jurisdiction: {jurisdiction}\n{extra}      \
             price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 1.0}}\n"
        )
    };
    format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: stdout}}\ntenants:\n  acme:\n    keys:\n      \
         - sha256: {}\n      - {{sha256: {}, agent: bot}}\n    residency: [eu]\n    \
         budgets: {{tokens_per_day: 100000}}\n    agents:\n      bot: {{backend: ch-1}}\n  globex:\n    keys:\n      \
         - sha256: {}\nai:\n  default_backend: pool\n  budget: {{soft: {{threshold: 0.0001, backend: cheap-us}}}}\n  \
         backends:\n    pool:\n      kind: pool\n      members: [{{backend: us-1}}, {{backend: eu-1, priority: 2}}]\n\
         {}{}{}{}{}",
        sha(KEY),
        sha(AGENT_KEY),
        sha(OTHER_KEY),
        backend("us-1", &b.us1.url(), "us", ""),
        backend("eu-1", eu1_url, "EU", "      fallback: [us-2]\n"),
        backend("us-2", &b.us2.url(), "us", ""),
        backend("cheap-us", &b.cheap.url(), "us", ""),
        backend("ch-1", &b.ch1.url(), "ch", ""),
    )
}

async fn call(gw: &Flexway, key: &str, jurisdiction: Option<&str>) -> reqwest::Response {
    let mut request = gw.post("/v1/chat/completions", key, hello("m"));
    if let Some(jurisdiction) = jurisdiction {
        request = request.header("Flexway-Jurisdiction", jurisdiction);
    }
    request.send().await.unwrap()
}

async fn refused(response: reqwest::Response, status: u16, code: &str) -> String {
    assert_eq!(response.status(), status);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
    body["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_bound_tenant_is_served_only_in_its_jurisdictions_whatever_the_step() {
    let b = Backends::start().await;
    let gw = Flexway::start(&config(&b, &b.eu1.url()));
    // Past the first call acme is over its soft threshold: the switch to cheap-us is
    // skipped, as the pool's first member is.
    for _ in 0..6 {
        let served = call(&gw, KEY, None).await;
        assert_eq!(served.status(), 200);
        assert_eq!(served.headers()["flexway-backend"], "eu-1");
    }
    assert_eq!(b.outside_eu(), 0, "nothing left the eu");
    let globex = call(&gw, OTHER_KEY, None).await;
    assert_eq!(globex.headers()["flexway-backend"], "us-1", "an unbound tenant takes the pool's first member");

    // The agent's override lands outside acme's residency: refused, never sent.
    let message = refused(call(&gw, AGENT_KEY, None).await, 403, "residency_unavailable").await;
    assert!(message.contains("eu"), "{message}");
    assert_eq!(b.ch1.request_count(), 0);

    // A record is written as its call ends, just after its answer: wait for the last.
    let records = gw.records_until::<Value>(8).await;
    let soft = records.iter().filter(|r| r["tenant"] == "acme" && r["budget_state"] == "soft").count();
    assert!(soft >= 5, "acme was past its soft threshold, so the switch was there to skip: {records:?}");
    let refusal = records.iter().find(|r| r["error_code"] == "residency_unavailable").unwrap();
    assert_eq!((refusal["status"].as_u64(), refusal["cost_micro_eur"].as_u64()), (Some(403), Some(0)));
}

#[tokio::test]
async fn a_failing_compliant_backend_never_falls_back_outside() {
    let b = Backends::start().await;
    let gw = Flexway::start(&config(&b, &scenario(&b.eu1, "status=503")));
    let message = refused(call(&gw, KEY, None).await, 503, "upstream_unavailable").await;
    assert!(!message.is_empty());
    assert_eq!(b.eu1.request_count(), 1, "the compliant member was tried");
    assert_eq!(b.outside_eu(), 0, "neither the pool's us member nor eu-1's us fallback");
    // Unbound, the same failure falls back as usual.
    let globex = call(&gw, OTHER_KEY, Some("eu, us")).await;
    assert_eq!(globex.status(), 200);
}

#[tokio::test]
async fn the_header_only_narrows() {
    let b = Backends::start().await;
    let gw = Flexway::start(&config(&b, &b.eu1.url()));
    let narrowed = call(&gw, OTHER_KEY, Some("EU")).await;
    assert_eq!(narrowed.headers()["flexway-backend"], "eu-1", "an unbound caller may narrow itself");
    refused(call(&gw, OTHER_KEY, Some("ch")).await, 403, "residency_unavailable").await;
    let message = refused(call(&gw, KEY, Some("us")).await, 403, "residency_unavailable").await;
    assert!(message.contains("share no jurisdiction"), "never widened: {message}");
    let both = call(&gw, KEY, Some("us, eu")).await;
    assert_eq!(both.headers()["flexway-backend"], "eu-1");
    for bad in ["", "eu;us", "eu,"] {
        refused(call(&gw, KEY, Some(bad)).await, 400, "invalid_request").await;
    }
    assert_eq!(b.us1.request_count() + b.us2.request_count() + b.cheap.request_count(), 0);
}
