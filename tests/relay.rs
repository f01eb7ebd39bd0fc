//! `kind: relay` (SPEC §8), both sides: two real `flexway serve` processes chained,
//! an edge whose backend is a relay to a central, the central in front of fake models.
//! The edge passes its caller's identity on under its declared header names and
//! nothing of its caller's own headers; the central believes them only from its
//! `relay_peer` key, refuses a tenant it does not declare, keeps a sensitive call on
//! its internal backends, and its refusals (a 429 included) reach the edge's client
//! as they were.
#![cfg(test)]

use flexway_testkit::*;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// The edge's credential at the central: a key of the central's tenant `edge`,
/// marked `relay_peer: true`.
const PEER_KEY: &str = "sk-test-edge-peer";
/// A tenant the edge declares and the central does not.
const INITECH_KEY: &str = "sk-test-initech";
/// A tenant of the edge whose own (local) budget is tiny.
const CAPPED_KEY: &str = "sk-test-capped";
const PRICE: &str = "price: {input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}";

/// The central: `acme` (agent `helper`), `globex` (a budget no call fits), the edge's
/// tenant with its relay peer key; an external default backend and an internal one
/// for sensitive calls.
fn central_config(external: &str, internal: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys: [{{sha256: {key}}}]
    agents: {{helper: {{}}}}
  globex:
    keys: [{{sha256: {other}}}]
    budgets: {{tokens_per_day: 5}}
  edge:
    keys: [{{sha256: {peer}, relay_peer: true}}]
ai:
  default_backend: ext
  sensitive_backend: internal
  backends:
    ext: {{url: "{external}", {PRICE}}}
    internal: {{url: "{internal}", external: false, {PRICE}}}
"#,
        key = sha(KEY),
        other = sha(OTHER_KEY),
        peer = sha(PEER_KEY),
    )
}

/// The edge: `acme` (agents `helper` and `edge-only`, the latter unknown to the
/// central), `globex`, `initech` (unknown to the central), `capped`; one backend, a
/// relay to `central` metered upstream, internal, with the peer key as its auth and
/// `identity_headers` left out (the defaults).
fn edge_config(central: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys: [{{sha256: {key}}}]
    agents: {{helper: {{}}, edge-only: {{}}}}
  globex:
    keys: [{{sha256: {other}}}]
  initech:
    keys: [{{sha256: {initech}}}]
  capped:
    keys: [{{sha256: {capped}}}]
    budgets: {{tokens_per_day: 5}}
ai:
  default_backend: central
  backends:
    central:
      kind: relay
      url: "{central}"
      external: false
      auth: {{type: bearer, secret: "env:CENTRAL_KEY"}}
      metering: upstream
      price: {{input_per_mtok_eur: 2.0, output_per_mtok_eur: 8.0}}
"#,
        key = sha(KEY),
        other = sha(OTHER_KEY),
        initech = sha(INITECH_KEY),
        capped = sha(CAPPED_KEY),
    )
}

struct Chain {
    external: FakeModel,
    internal: FakeModel,
    central: Flexway,
    edge: Flexway,
}

async fn chain() -> Chain {
    let external = FakeModel::start().await.unwrap();
    let internal = FakeModel::start().await.unwrap();
    let central = Flexway::start(&central_config(&external.url(), &internal.url()));
    let edge = Flexway::start_with_env(&edge_config(&central.url), &[("CENTRAL_KEY", PEER_KEY)]);
    Chain { external, internal, central, edge }
}

/// What the audit's `key_hash` is for a key, with no `hash_salt`.
fn key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(Sha256::digest(key.as_bytes())))
}

async fn error_body(response: reqwest::Response) -> Value {
    let body: Value = response.json().await.unwrap();
    assert!(body["error"]["code"].is_string(), "{body}");
    body
}

#[tokio::test]
async fn the_tenant_and_agent_the_edge_asserts_are_the_centrals_and_both_audits_agree_on_the_tokens() {
    let c = chain().await;
    let r = c
        .edge
        .post("/v1/chat/completions", KEY, hello("m"))
        .header("flexway-agent", "helper")
        .header("x-secret-thing", "do-not-forward")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["flexway-backend"], "central");
    let central = c.central.records_until::<Value>(1).await;
    let edge = c.edge.records_until::<Value>(1).await;
    let (central, edge) = (&central[0], &edge[0]);

    // The call is the asserted tenant's and agent's at the central, by the peer's key.
    assert_eq!((central["tenant"].as_str(), central["agent"].as_str()), (Some("acme"), Some("helper")));
    assert_eq!(central["key_hash"], key_hash(PEER_KEY));
    assert_eq!((central["backend"].as_str(), central["metered_by"].as_str()), (Some("ext"), Some("local")));
    // The edge bills nothing of it: metered upstream, where it is paid.
    assert_eq!((edge["tenant"].as_str(), edge["agent"].as_str()), (Some("acme"), Some("helper")));
    assert_eq!((edge["backend"].as_str(), edge["metered_by"].as_str()), (Some("central"), Some("upstream")));
    assert_eq!(edge["key_hash"], key_hash(KEY));
    // Same tokens on both sides, each settled at its own price.
    assert!(central["completion_tokens"].as_u64().unwrap() > 0, "{central}");
    for field in ["prompt_tokens", "completion_tokens", "usage_source"] {
        assert_eq!(edge[field], central[field], "{field}");
    }
    assert!(edge["cost_micro_eur"].as_u64().unwrap() > central["cost_micro_eur"].as_u64().unwrap());
    // The edge's metrics carry the same split as its audit.
    let metrics = client().get(format!("{}/metrics", c.edge.url)).send().await.unwrap().text().await.unwrap();
    let calls =
        r#"flexway_inference_calls_total{tenant="acme",backend="central",metered_by="upstream",capability="chat"} 1"#;
    assert!(metrics.lines().any(|l| l == calls), "{metrics}");

    // Nothing of the client's own headers went past the edge.
    let seen = &c.external.requests()[0];
    assert_eq!(seen.path, "/v1/chat/completions");
    assert_eq!(seen.header("x-secret-thing"), None);
    assert_eq!(seen.header("authorization"), None);
    assert_eq!(c.internal.request_count(), 0);
}

#[tokio::test]
async fn a_streamed_call_through_the_relay_is_metered_on_the_same_tokens_at_both_ends() {
    let c = chain().await;
    let body = json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hello there"}]});
    let r = c.edge.post("/v1/chat/completions", KEY, body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (events, error) = sse_data(r).await;
    assert_eq!(error, None);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    // The usage chunk the edge asked the central for is not shown to this client.
    assert!(events.iter().all(|e| !e.contains("\"usage\":{")), "{events:?}");
    let central = c.central.records_until::<Value>(1).await;
    let edge = c.edge.records_until::<Value>(1).await;
    assert_eq!(edge[0]["usage_source"], "reported");
    assert_eq!(edge[0]["metered_by"], "upstream");
    for field in ["prompt_tokens", "completion_tokens"] {
        assert_eq!(edge[0][field], central[0][field], "{field}");
    }
}

#[tokio::test]
async fn identity_headers_from_a_key_that_is_not_a_relay_peer_are_ignored() {
    let c = chain().await;
    for asserted in ["globex", "nobody-declares-this"] {
        let r = c.central.post("/v1/chat/completions", KEY, hello("m")).header("flexway-tenant", asserted).send().await;
        assert_eq!(r.unwrap().status(), 200, "{asserted}");
    }
    let central = c.central.records_until::<Value>(2).await;
    for record in &central {
        assert_eq!(record["tenant"], "acme", "{record}");
        assert_eq!(record["key_hash"], key_hash(KEY));
    }
}

#[tokio::test]
async fn a_tenant_or_agent_the_central_does_not_declare_is_refused_and_the_edge_relays_the_refusal() {
    let c = chain().await;
    let r = c.edge.chat(INITECH_KEY, hello("m")).await;
    assert_eq!(r.status(), 403);
    assert_eq!(r.headers()["flexway-backend"], "central");
    assert_eq!(r.headers()["flexway-cost-eur"], "0.000000");
    let body = error_body(r).await;
    assert_eq!(body["error"]["code"], "unknown_tenant");
    assert!(body["error"]["message"].as_str().unwrap().contains("initech"), "{body}");

    // An agent the edge declares under acme but the central does not: §7 at the central.
    let r = c.edge.post("/v1/chat/completions", KEY, hello("m")).header("flexway-agent", "edge-only").send().await;
    let r = r.unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(error_body(r).await["error"]["code"], "unknown_agent");

    assert_eq!(c.external.request_count() + c.internal.request_count(), 0);
    let edge = c.edge.records_until::<Value>(2).await;
    assert_eq!((edge[0]["tenant"].as_str(), edge[0]["status"].as_u64()), (Some("initech"), Some(403)));
    assert_eq!(edge[0]["cost_micro_eur"], 0);
    assert_eq!((edge[1]["agent"].as_str(), edge[1]["status"].as_u64()), (Some("edge-only"), Some(403)));
}

#[tokio::test]
async fn a_sensitive_call_relayed_by_the_edge_stays_on_the_centrals_internal_backends() {
    let c = chain().await;
    let r = c.edge.post("/v1/chat/completions", KEY, hello("m")).header("flexway-sensitive", "true").send().await;
    assert_eq!(r.unwrap().status(), 200);
    assert_eq!(c.external.request_count(), 0, "a sensitive prompt reached the external backend");
    assert_eq!(c.internal.request_count(), 1);
    let central = c.central.records_until::<Value>(1).await;
    assert_eq!(central[0]["backend"], "internal");

    // The same call, not sensitive, goes to the central's default (external) backend.
    assert_eq!(c.edge.chat(KEY, hello("m")).await.status(), 200);
    assert_eq!((c.external.request_count(), c.internal.request_count()), (1, 1));
}

#[tokio::test]
async fn the_centrals_budget_429_reaches_the_edges_client_as_it_was() {
    let c = chain().await;
    let r = c.edge.chat(OTHER_KEY, hello("m")).await;
    assert_eq!(r.status(), 429);
    let retry_after = r.headers()["retry-after"].to_str().unwrap().to_owned();
    let body = error_body(r).await;
    assert_eq!(body["error"]["code"], "budget_exceeded");
    // The central's own words: its budget, and the Retry-After it computed.
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.ends_with(&format!("it resets in {retry_after} s")), "{message} vs {retry_after}");
    assert!(retry_after.parse::<u64>().unwrap() > 0);
    assert_eq!(c.external.request_count(), 0);
    let edge = c.edge.records_until::<Value>(1).await;
    assert_eq!((edge[0]["tenant"].as_str(), edge[0]["status"].as_u64()), (Some("globex"), Some(429)));
    assert_eq!(edge[0]["metered_by"], "upstream");
}

#[tokio::test]
async fn the_edges_own_hard_cap_still_holds_with_metering_upstream() {
    let c = chain().await;
    let r = c.edge.chat(CAPPED_KEY, hello("m")).await;
    assert_eq!(r.status(), 429);
    assert_eq!(error_body(r).await["error"]["code"], "budget_exceeded");
    let edge = c.edge.records_until::<Value>(1).await;
    assert_eq!((edge[0]["tenant"].as_str(), edge[0]["budget_state"].as_str()), (Some("capped"), Some("exceeded")));
    // Refused at the edge: the central never heard of it.
    assert!(c.central.stdout().is_empty());
    assert_eq!(c.external.request_count() + c.internal.request_count(), 0);
}

/// What a relay sends, seen by a fake model standing where the central would be.
#[tokio::test]
async fn a_relay_sends_the_identity_only_under_its_declared_names_and_none_of_the_callers_headers() {
    let model = FakeModel::start().await.unwrap();
    let base = model.url().trim_end_matches("/v1").to_owned();
    let ai = format!(
        r#"  default_backend: full
  capabilities: {{embeddings: full}}
  backends:
    full:
      kind: relay
      url: "{base}/"
      auth: {{type: bearer, secret: "env:CENTRAL_KEY"}}
      metering: upstream
      external: false
      capabilities: [chat, embeddings]
      {PRICE}
    partial:
      kind: relay
      url: "{base}"
      metering: upstream
      identity_headers: {{tenant: Flexway-Tenant}}
      {PRICE}
"#
    );
    // globex's calls go to `partial`.
    let yaml = config(&ai).replace(
        &format!("      - sha256: {}\n", sha(OTHER_KEY)),
        &format!("      - sha256: {}\n    backend: partial\n", sha(OTHER_KEY)),
    );
    let gw = Flexway::start_with_env(&yaml, &[("CENTRAL_KEY", PEER_KEY)]);
    let client_headers = |request: reqwest::RequestBuilder| {
        request
            .header("flexway-sensitive", "no")
            .header("x-secret-thing", "do-not-forward")
            .header("cookie", "session=do-not-forward")
            .header("x-forwarded-for", "10.9.8.7")
    };
    let chat = gw.post("/v1/chat/completions", KEY, hello("m")).header("flexway-agent", "helper");
    assert_eq!(client_headers(chat).send().await.unwrap().status(), 200, "{}", gw.logs());
    let embed = gw.post("/v1/embeddings", AGENT_KEY, json!({"model": "e", "input": "hello"}));
    assert_eq!(client_headers(embed).send().await.unwrap().status(), 200);
    let partial = gw.post("/v1/chat/completions", OTHER_KEY, hello("m"));
    assert_eq!(client_headers(partial).send().await.unwrap().status(), 200);
    let sensitive = gw.post("/v1/chat/completions", KEY, hello("m")).header("flexway-sensitive", "true");
    assert_eq!(sensitive.send().await.unwrap().status(), 200);

    let seen = model.requests();
    let paths: Vec<&str> = seen.iter().map(|r| r.path.as_str()).collect();
    assert_eq!(paths, ["/v1/chat/completions", "/v1/embeddings", "/v1/chat/completions", "/v1/chat/completions"]);
    let identity = |i: usize| {
        ["flexway-tenant", "flexway-agent", "flexway-sensitive"].map(|name| seen[i].header(name).map(str::to_owned))
    };
    let some = |s: &str| Some(s.to_owned());
    assert_eq!(identity(0), [some("acme"), some("helper"), some("false")]);
    assert_eq!(identity(1), [some("acme"), some("bot"), some("false")]);
    assert_eq!(identity(2), [some("globex"), None, None]);
    assert_eq!(identity(3), [some("acme"), None, some("true")]);
    assert_eq!(seen[0].header("authorization"), Some(format!("Bearer {PEER_KEY}").as_str()));
    assert_eq!(seen[2].header("authorization"), None);
    // Only what the gateway itself writes: none of the client's headers, its key included.
    let own = ["host", "content-type", "content-length", "accept", "user-agent", "authorization", "traceparent"];
    for request in &seen {
        for (name, value) in &request.headers {
            let ours = own.contains(&name.as_str()) || name.starts_with("flexway-");
            assert!(ours, "the relay sent `{name}: {value}`");
            assert!(!value.contains(KEY) && !value.contains("do-not-forward") && !value.contains("10.9.8.7"));
        }
    }
}
