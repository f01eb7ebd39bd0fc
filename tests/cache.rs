//! The response cache (SPEC §16), end to end over loopback: the gateway's router with
//! the embedded cache store in a temporary file, the fake model server as the backend
//! (its request count says whether a call went upstream). The PostgreSQL and DynamoDB
//! stores pass the same conformance suite in their own crates.
#![cfg(test)]

use std::sync::Arc;

use flexway::audit::{AuditRecord, CacheOutcome};
use flexway::cache::embedded::EmbeddedCacheStore;
use flexway_testkit::*;
use serde_json::{Value, json};

const CACHE_KEY: &str = "0123456789abcdef0123456789abcdef";

/// Tenants `acme` (KEY, agent `bot` on AGENT_KEY, agent `quiet` with `cache: off`) and
/// `globex` (OTHER_KEY), one backend at `url`, and the cache in `dir`: `faq-model`
/// exact, `near-model` semantic (the fake's `similar` embeddings), `bot-model` exact
/// and scoped to agents, `text-embedding` exact for embeddings.
fn cache_config(url: &str, dir: &std::path::Path, ttl: &str) -> String {
    let key = dir.join("cache.key");
    std::fs::write(&key, CACHE_KEY).unwrap();
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys:
      - {{sha256: {key_acme}}}
      - {{sha256: {key_bot}, agent: bot}}
      - {{sha256: {key_quiet}, agent: quiet}}
    agents:
      bot: {{}}
      quiet: {{cache: off}}
  globex:
    keys: [{{sha256: {key_globex}}}]
ai:
  default_backend: main
  budget: {{default_max_tokens: 200, min_completion_tokens: 10}}
  backends:
    main:
      url: "{url}"
      price: {{input_per_mtok_eur: 1000, output_per_mtok_eur: 2000}}
      capabilities: [chat, embeddings]
      external: false
  cache:
    store: {{kind: embedded, path: "{path}"}}
    key: "file:{key}"
    policies:
      faq: {{mode: exact, ttl: {ttl}}}
      near: {{mode: semantic, ttl: {ttl}, threshold: 0.9, embed: {{backend: main, model: fake-embed-similar}}}}
      per-agent: {{mode: exact, ttl: {ttl}, scope: agent}}
      vectors: {{mode: exact, ttl: {ttl}}}
    models: {{faq-model: faq, near-model: near, bot-model: per-agent, text-embedding: vectors}}
"#,
        key_acme = sha(KEY),
        key_bot = sha(AGENT_KEY),
        key_quiet = sha(QUIET_KEY),
        key_globex = sha(OTHER_KEY),
        path = dir.join("cache.db").display(),
        key = key.display(),
    )
}

const QUIET_KEY: &str = "sk-test-acme-quiet";

struct Setup {
    model: FakeModel,
    gw: InProcess,
    audit: Arc<flexway::audit::sinks::MemoryAuditSink>,
    dir: tempfile::TempDir,
}

async fn setup_with(ttl: &str, store: Option<Arc<dyn flexway::cache::CacheStore>>) -> Setup {
    let model = FakeModel::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut adapters, audit) = memory_adapters();
    let store = store.unwrap_or_else(|| Arc::new(EmbeddedCacheStore::open(&dir.path().join("cache.db")).unwrap()));
    adapters.cache = Some(store);
    let gw = serve_in_process(&cache_config(&model.url(), dir.path(), ttl), adapters).await;
    Setup { model, gw, audit, dir }
}

async fn setup() -> Setup {
    setup_with("1h", None).await
}

/// The stores the tests below run on: the embedded one always; PostgreSQL (a real
/// server with pgvector, `tests/kit`) with the `postgres` feature; DynamoDB (the
/// emulator `scripts/test` starts) with `aws`. The gateway's config names the
/// embedded store: the store a gateway runs on is its adapters'.
#[derive(Debug, Clone, Copy)]
enum Store {
    Embedded,
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "aws")]
    DynamoDb,
}

impl Store {
    async fn open(self) -> Option<Arc<dyn flexway::cache::CacheStore>> {
        match self {
            Store::Embedded => None,
            #[cfg(feature = "postgres")]
            Store::Postgres => {
                let url = flexway_testkit::postgres::database();
                Some(Arc::new(flexway_postgres::PostgresCacheStore::connect(&url).await.unwrap()))
            }
            #[cfg(feature = "aws")]
            Store::DynamoDb => {
                let sdk = flexway_testkit::emulator::sdk().await;
                let client = aws_sdk_dynamodb::Client::new(&sdk);
                let table = flexway_testkit::emulator::unique("flexway-cache-e2e");
                flexway_aws::cache::DynamoDbCacheStore::create_table(&client, &table).await.unwrap();
                Some(Arc::new(flexway_aws::cache::DynamoDbCacheStore::new(client, table)))
            }
        }
    }

    async fn setup(self, ttl: &str) -> Setup {
        let store = self.open().await;
        setup_with(ttl, store).await
    }
}

/// One test a store for each `async fn name(store: Store)`.
macro_rules! on_every_store {
    ($($name:ident),* $(,)?) => {
        mod embedded {
            $(#[tokio::test]
            async fn $name() {
                super::$name(super::Store::Embedded).await
            })*
        }
        #[cfg(feature = "postgres")]
        mod postgres {
            $(#[tokio::test]
            async fn $name() {
                super::$name(super::Store::Postgres).await
            })*
        }
        #[cfg(feature = "aws")]
        mod dynamodb {
            $(#[tokio::test]
            async fn $name() {
                super::$name(super::Store::DynamoDb).await
            })*
        }
    };
}

/// The semantic tests: on the stores that compare embeddings (DynamoDB keeps exact
/// entries only, and its semantic policies are refused at load).
mod semantic {
    #[tokio::test]
    async fn embedded() {
        super::a_semantic_hit_needs_a_close_meaning_the_same_numbers_and_the_same_negations(super::Store::Embedded)
            .await
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn postgres() {
        super::a_semantic_hit_needs_a_close_meaning_the_same_numbers_and_the_same_negations(super::Store::Postgres)
            .await
    }
}

on_every_store!(
    an_exact_hit_is_served_without_a_backend_and_costs_what_charge_says,
    entries_are_hit_only_within_their_partition,
    streamed_and_whole_calls_are_served_from_one_entry_in_every_door,
    no_error_refusal_cut_or_tool_call_is_ever_stored,
    cache_control_is_honoured,
    an_entry_expires_after_its_ttl,
    an_embeddings_call_is_served_again_from_its_exact_entry,
    a_purge_empties_a_tenant_and_stats_count_what_is_left,
);

fn ask(model: &str, text: &str) -> Value {
    json!({"model": model, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]})
}

impl Setup {
    async fn post(&self, path: &str, key: &str, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut request = client().post(format!("{}{path}", self.gw.url)).bearer_auth(key).json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.send().await.unwrap()
    }

    /// A chat call; its `Flexway-Cache` and its body.
    async fn chat(&self, key: &str, body: &Value, headers: &[(&str, &str)]) -> (String, Value) {
        let response = self.post("/v1/chat/completions", key, body, headers).await;
        assert_eq!(response.status(), 200);
        let cache = header(&response, "flexway-cache");
        (cache, response.json().await.unwrap())
    }

    /// The records once there are `n`.
    async fn records(&self, n: usize) -> Vec<AuditRecord> {
        audit_records_until(&self.audit, n).await
    }
}

fn header(response: &reqwest::Response, name: &str) -> String {
    response.headers().get(name).map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default()
}

fn text(body: &Value) -> &str {
    body["choices"][0]["message"]["content"].as_str().unwrap()
}

async fn an_exact_hit_is_served_without_a_backend_and_costs_what_charge_says(store: Store) {
    let s = store.setup("1h").await;
    let (first, answer) = s.chat(KEY, &ask("faq-model", "What are your opening hours?"), &[]).await;
    assert_eq!(first, "stored");
    let upstream = s.model.request_count();
    let (second, again) = s.chat(KEY, &ask("faq-model", "What are your opening hours?"), &[]).await;
    assert!(second.starts_with("hit; similarity=1.000; age="), "{second}");
    assert_eq!(s.model.request_count(), upstream, "a hit calls no backend");
    assert_eq!(text(&again), text(&answer));
    assert_eq!(again["usage"], answer["usage"], "the entry's usage, as the answer said it");
    assert_eq!(again["model"], "faq-model", "the model the caller asked for");
    let records = s.records(2).await;
    assert_eq!(records[0].cache, Some(CacheOutcome::Stored));
    let hit = &records[1];
    assert_eq!((hit.cache, hit.cache_similarity, hit.status), (Some(CacheOutcome::Hit), Some(1.0), 200));
    assert_eq!(hit.cost_micro_eur, 0, "charge: none by default");
    assert_eq!(hit.cost_saved_micro_eur, Some(records[0].cost_micro_eur));
    assert!(records[0].cost_micro_eur > 0);
    assert_eq!((hit.prompt_tokens, hit.completion_tokens), (0, 0), "nothing was produced");
    assert_eq!(s.gw.live_reservations().await, 0, "the hit's reservation was given back");
    let metrics = client().get(format!("{}/metrics", s.gw.url)).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains(r#"flexway_cache_lookups_total{tenant="acme",policy="faq",outcome="hit"} 1"#),
        "{metrics}"
    );
}

async fn entries_are_hit_only_within_their_partition(store: Store) {
    let s = store.setup("1h").await;
    let base = ask("faq-model", "Where is the office?");
    assert_eq!(s.chat(KEY, &base, &[]).await.0, "stored");
    let mut other_system = base.clone();
    other_system["messages"][0]["content"] = "be verbose".into();
    let mut with_tools = base.clone();
    with_tools["tools"] = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    with_tools["tool_choice"] = "none".into();
    let mut warmer = base.clone();
    warmer["temperature"] = json!(0.9);
    let mut formatted = base.clone();
    formatted["response_format"] = json!({"type": "json_object"});
    let mut earlier_turn = base.clone();
    earlier_turn["messages"] = json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Where is the office?"}
    ]);
    for (what, key, body) in [
        ("another tenant", OTHER_KEY, &base),
        ("another system prompt", KEY, &other_system),
        ("other tools", KEY, &with_tools),
        ("another temperature", KEY, &warmer),
        ("another response_format", KEY, &formatted),
        ("another earlier turn", KEY, &earlier_turn),
    ] {
        let (cache, _) = s.chat(key, body, &[]).await;
        assert_ne!(&cache[..3], "hit", "{what} hit: {cache}");
    }
    // The same request again, by a key of the same tenant's agent: the tenant's.
    assert!(s.chat(AGENT_KEY, &base, &[]).await.0.starts_with("hit"));
    // Scoped to agents: the agent's entry is not the tenant's.
    assert_eq!(s.chat(AGENT_KEY, &ask("bot-model", "status?"), &[]).await.0, "stored");
    assert_eq!(s.chat(KEY, &ask("bot-model", "status?"), &[]).await.0, "stored");
    assert!(s.chat(AGENT_KEY, &ask("bot-model", "status?"), &[]).await.0.starts_with("hit"));
}

async fn streamed_and_whole_calls_are_served_from_one_entry_in_every_door(store: Store) {
    let s = store.setup("1h").await;
    // Stored from a stream...
    let mut streamed = ask("faq-model", "Tell me about the refund policy");
    streamed["stream"] = true.into();
    let response = s.post("/v1/chat/completions", KEY, &streamed, &[]).await;
    assert_eq!(header(&response, "flexway-cache"), "miss", "a stream's headers leave before its end");
    let (events, error) = sse_data(response).await;
    assert_eq!((events.last().map(String::as_str), error), (Some("[DONE]"), None));
    let streamed_text: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(s.records(1).await[0].cache, Some(CacheOutcome::Stored));
    // ...served whole,
    let (cache, whole) = s.chat(KEY, &ask("faq-model", "Tell me about the refund policy"), &[]).await;
    assert!(cache.starts_with("hit"), "{cache}");
    assert_eq!(text(&whole), streamed_text);
    // ...streamed again, well-formed, with usage when asked,
    streamed["stream_options"] = json!({"include_usage": true});
    let response = s.post("/v1/chat/completions", KEY, &streamed, &[]).await;
    assert!(header(&response, "flexway-cache").starts_with("hit"));
    assert_eq!(header(&response, "content-type"), "text/event-stream");
    let (events, _) = sse_data(response).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events.iter().filter_map(|e| serde_json::from_str(e).ok()).collect();
    let replayed: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_owned)).collect();
    assert_eq!(replayed, streamed_text);
    assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"] == "stop"));
    assert!(chunks.iter().any(|c| c["usage"]["completion_tokens"].as_u64().is_some()), "{events:?}");
    // ...and in the Responses and Messages formats.
    let responses =
        json!({"model": "faq-model", "instructions": "be brief", "input": "Tell me about the refund policy"});
    let response = s.post("/v1/responses", KEY, &responses, &[]).await;
    assert!(header(&response, "flexway-cache").starts_with("hit"));
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["output"][0]["content"][0]["text"], streamed_text.as_str(), "{body}");
    let messages = json!({"model": "faq-model", "system": "be brief", "max_tokens": 200,
        "messages": [{"role": "user", "content": "Tell me about the refund policy"}]});
    let response = client()
        .post(format!("{}/v1/messages", s.gw.url))
        .header("x-api-key", KEY)
        .json(&messages)
        .send()
        .await
        .unwrap();
    assert!(header(&response, "flexway-cache").starts_with("hit"));
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        (body["content"][0]["text"].as_str(), body["stop_reason"].as_str()),
        (Some(&*streamed_text), Some("end_turn"))
    );
}

async fn no_error_refusal_cut_or_tool_call_is_ever_stored(store: Store) {
    let s = store.setup("1h").await;
    let cases: Vec<(&str, Value, &str)> = vec![
        ("a 5xx", ask("faq-model", "q1"), "status=500"),
        ("the backend's own refusal", ask("faq-model", "q2"), "status=400"),
        (
            "a truncated answer",
            {
                let mut body = ask("faq-model", "q3");
                body["max_tokens"] = 10.into();
                body
            },
            "words=50",
        ),
        (
            "a tool call",
            {
                let mut body = ask("faq-model", "q4");
                body["tools"] =
                    json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
                body
            },
            "tool_use",
        ),
        (
            "a stream cut mid-way",
            {
                let mut body = ask("faq-model", "q5");
                body["stream"] = true.into();
                body
            },
            "cut_after=2",
        ),
        (
            "several choices",
            {
                let mut body = ask("faq-model", "q6");
                body["n"] = 2.into();
                body
            },
            "words=3",
        ),
    ];
    for (what, body, scenario_text) in &cases {
        let yaml_url = scenario(&s.model, scenario_text);
        // Each case on a backend answering that way: a gateway of its own over the same store.
        let (mut adapters, _) = memory_adapters();
        adapters.cache = s.gw.gateway.cache.as_ref().map(|c| c.store.clone());
        let gw = serve_in_process(&cache_config(&yaml_url, s.dir.path(), "1h"), adapters).await;
        for attempt in 0..2 {
            let response = client()
                .post(format!("{}/v1/chat/completions", gw.url))
                .bearer_auth(KEY)
                .json(body)
                .send()
                .await
                .unwrap();
            let cache = header(&response, "flexway-cache");
            assert!(!cache.starts_with("hit") && cache != "stored", "{what}, call {attempt}: {cache}");
            let _ = response.bytes().await;
        }
    }
    let stats = s.gw.gateway.cache.as_ref().unwrap().store.stats().await.unwrap();
    assert!(stats.is_empty(), "nothing kept: {stats:?}");
}

async fn cache_control_is_honoured(store: Store) {
    let s = store.setup("1h").await;
    let body = ask("faq-model", "How do I reset my password?");
    assert_eq!(s.chat(KEY, &body, &[("cache-control", "no-store")]).await.0, "miss", "no-store keeps nothing");
    assert_eq!(s.chat(KEY, &body, &[]).await.0, "stored");
    let upstream = s.model.request_count();
    assert_eq!(s.chat(KEY, &body, &[("cache-control", "no-cache")]).await.0, "stored", "no-cache goes upstream");
    assert_eq!(s.model.request_count(), upstream + 1);
    assert_eq!(s.chat(KEY, &body, &[("cache-control", "no-cache, no-store")]).await.0, "bypass");
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    assert_eq!(s.chat(KEY, &body, &[("cache-control", "max-age=1")]).await.0, "stored", "too old for the caller");
    assert!(s.chat(KEY, &body, &[("cache-control", "max-age=60")]).await.0.starts_with("hit"));
}

async fn an_entry_expires_after_its_ttl(store: Store) {
    let s = store.setup("1s").await;
    let body = ask("faq-model", "Is the shop open on Sunday?");
    assert_eq!(s.chat(KEY, &body, &[]).await.0, "stored");
    assert!(s.chat(KEY, &body, &[]).await.0.starts_with("hit"));
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    assert_eq!(s.chat(KEY, &body, &[]).await.0, "stored", "expired: served upstream and kept again");
}

#[tokio::test]
async fn the_store_file_holds_no_prompt_and_no_answer_in_clear() {
    let s = setup().await;
    let secret_question = "What is the door code of the Zanzibar warehouse?";
    let (_, answer) = s.chat(KEY, &ask("faq-model", secret_question), &[]).await;
    let answer = text(&answer).to_owned();
    assert!(answer.contains("Zanzibar"), "the fake echoes the question: {answer}");
    let bytes = std::fs::read(s.dir.path().join("cache.db")).unwrap();
    assert!(!bytes.is_empty());
    let clear = |needle: &str| bytes.windows(needle.len()).any(|w| w == needle.as_bytes());
    assert!(!clear("Zanzibar") && !clear("door code") && !clear("be brief"), "clear text at rest");
}

#[tokio::test]
async fn a_failing_store_serves_misses_and_is_counted() {
    let store: Arc<dyn flexway::cache::CacheStore> = Arc::new(flexway::cache::Failed("disk gone".into()));
    let s = setup_with("1h", Some(store)).await;
    let body = ask("faq-model", "anything");
    for _ in 0..2 {
        assert_eq!(s.chat(KEY, &body, &[]).await.0, "miss");
    }
    let metrics = client().get(format!("{}/metrics", s.gw.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"outcome="error"} 2"#), "{metrics}");
}

async fn a_semantic_hit_needs_a_close_meaning_the_same_numbers_and_the_same_negations(store: Store) {
    let s = store.setup("1h").await;
    assert_eq!(s.chat(KEY, &ask("near-model", "What is the capital of France?"), &[]).await.0, "stored");
    let upstream_chats = || s.model.requests().iter().filter(|r| r.path.ends_with("/chat/completions")).count();
    let chats = upstream_chats();
    let (cache, _) = s.chat(KEY, &ask("near-model", "So what is the capital of France?"), &[]).await;
    let similarity: f64 = cache.strip_prefix("hit; similarity=").unwrap()[..5].parse().unwrap();
    assert!((0.9..1.0).contains(&similarity), "{cache}");
    assert_eq!(upstream_chats(), chats);
    assert_eq!(s.chat(KEY, &ask("near-model", "What is 2+2?"), &[]).await.0, "stored");
    assert_eq!(s.chat(KEY, &ask("near-model", "What is 2+3?"), &[]).await.0, "stored", "numbers differ");
    assert_eq!(s.chat(KEY, &ask("near-model", "Is Paris in France?"), &[]).await.0, "stored");
    assert_eq!(s.chat(KEY, &ask("near-model", "Is Paris not in France?"), &[]).await.0, "stored", "a negation");
    // Each lookup's embedding is a call of its own: recorded and charged.
    let records = s.records(12).await;
    let embeds: Vec<_> = records.iter().filter(|r| r.feature.as_deref() == Some("cache_embed")).collect();
    assert!(embeds.len() >= 5, "{records:?}");
    assert!(embeds.iter().all(|r| r.status == 200 && r.cost_micro_eur > 0 && r.tenant == "acme"));
}

#[tokio::test]
async fn a_tenant_or_agent_can_turn_it_off_and_sensitive_calls_bypass_it() {
    let s = setup().await;
    let body = ask("faq-model", "What is the warranty?");
    assert_eq!(s.chat(QUIET_KEY, &body, &[]).await.0, "bypass");
    assert_eq!(s.chat(QUIET_KEY, &body, &[]).await.0, "bypass");
    assert_eq!(s.chat(KEY, &body, &[("flexway-sensitive", "true")]).await.0, "bypass");
    let records = s.records(3).await;
    assert_eq!(
        records.iter().map(|r| r.cache).collect::<Vec<_>>(),
        [Some(CacheOutcome::Off), Some(CacheOutcome::Off), Some(CacheOutcome::Bypass)]
    );
    // A model no policy names: no cache at all.
    let response = s.post("/v1/chat/completions", KEY, &ask("m", "hi"), &[]).await;
    assert_eq!(header(&response, "flexway-cache"), "");
}

async fn an_embeddings_call_is_served_again_from_its_exact_entry(store: Store) {
    let s = store.setup("1h").await;
    let body = json!({"model": "text-embedding", "input": ["alpha", "beta"]});
    let first = s.post("/v1/embeddings", KEY, &body, &[]).await;
    assert_eq!(header(&first, "flexway-cache"), "stored");
    let first: Value = first.json().await.unwrap();
    let upstream = s.model.request_count();
    let second = s.post("/v1/embeddings", KEY, &body, &[]).await;
    assert!(header(&second, "flexway-cache").starts_with("hit"));
    assert_eq!(second.json::<Value>().await.unwrap()["data"], first["data"]);
    assert_eq!(s.model.request_count(), upstream);
    let other = json!({"model": "text-embedding", "input": ["alpha", "gamma"]});
    assert_eq!(header(&s.post("/v1/embeddings", KEY, &other, &[]).await, "flexway-cache"), "stored");
}

#[tokio::test]
async fn a_model_no_policy_names_is_served_as_before_whatever_its_request() {
    let s = setup().await;
    // A legacy `function` message: the gateway's model does not read it, a backend of
    // the door's own format does. With the cache configured, it is still relayed.
    let body = json!({"model": "m", "messages": [
        {"role": "function", "name": "f", "content": "42"},
        {"role": "user", "content": "and then?"}
    ]});
    let response = s.post("/v1/chat/completions", KEY, &body, &[]).await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    // The same request under a policy is not cached, never refused.
    let mut cached = body.clone();
    cached["model"] = "faq-model".into();
    let response = s.post("/v1/chat/completions", KEY, &cached, &[]).await;
    assert_eq!((response.status().as_u16(), header(&response, "flexway-cache")), (200, "bypass".to_owned()));
}

async fn a_purge_empties_a_tenant_and_stats_count_what_is_left(store: Store) {
    let s = store.setup("1h").await;
    for question in ["one?", "two?"] {
        assert_eq!(s.chat(KEY, &ask("faq-model", question), &[]).await.0, "stored");
    }
    assert_eq!(s.chat(OTHER_KEY, &ask("faq-model", "one?"), &[]).await.0, "stored");
    let cache = &s.gw.gateway.cache.as_ref().unwrap().store;
    let counts = |stats: Vec<flexway::cache::Stats>| {
        stats.into_iter().map(|r| (r.tenant, r.policy, r.entries)).collect::<Vec<_>>()
    };
    let both = vec![("acme".to_owned(), "faq".to_owned(), 2), ("globex".to_owned(), "faq".to_owned(), 1)];
    assert_eq!(counts(cache.stats().await.unwrap()), both);
    assert_eq!(cache.purge("acme", Some("near")).await.unwrap(), 0, "another policy's");
    assert_eq!(cache.purge("acme", None).await.unwrap(), 2);
    assert_eq!(counts(cache.stats().await.unwrap()), vec![("globex".to_owned(), "faq".to_owned(), 1)]);
    assert_eq!(s.chat(KEY, &ask("faq-model", "one?"), &[]).await.0, "stored", "purged: upstream again");
    assert!(s.chat(OTHER_KEY, &ask("faq-model", "one?"), &[]).await.0.starts_with("hit"), "another tenant's kept");
}

#[tokio::test]
async fn flexway_cache_stats_and_purge_read_the_configured_store() {
    use flexway::cache::{CacheStore, Entry, Partition, Probe, Sealed};
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("flexway.yaml");
    std::fs::write(&config, cache_config("http://127.0.0.1:9/v1", dir.path(), "1h")).unwrap();
    let now = flexway::budget::period::unix_now();
    {
        let store = EmbeddedCacheStore::open(&dir.path().join("cache.db")).unwrap();
        for (tenant, policy, n) in [("acme", "faq", 3u8), ("acme", "near", 1), ("globex", "faq", 2)] {
            let partition = Partition::new(tenant, None, policy, "m", &[0; 32]);
            for i in 0..n {
                let probe = Probe { exact: [i; 32], vector: None, guard: 0 };
                let sealed = Sealed(vec![7; 10]);
                let entry = Entry {
                    partition: &partition,
                    probe: &probe,
                    sealed,
                    stored_at: now,
                    expires_at: now + 3600,
                    max_entries_per_tenant: 100,
                };
                store.store(entry).await.unwrap();
            }
        }
        // A running gateway holds the file: the command says so, and changes nothing.
        let held =
            std::process::Command::new(binary()).args(["cache", "stats", "--config"]).arg(&config).output().unwrap();
        assert!(!held.status.success());
        assert!(String::from_utf8_lossy(&held.stderr).contains("in use by a running gateway"), "{held:?}");
    }
    let run = |args: &[&str]| {
        let out = std::process::Command::new(binary()).args(args).arg("--config").arg(&config).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let rows = |text: &str| {
        text.lines().skip(1).map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>()).collect::<Vec<_>>()
    };
    assert_eq!(
        rows(&run(&["cache", "stats"])),
        [["acme", "faq", "3", "30"], ["acme", "near", "1", "10"], ["globex", "faq", "2", "20"]]
    );
    assert!(run(&["cache", "purge", "--tenant", "acme", "--policy", "near"]).contains("removed 1 "));
    assert!(run(&["cache", "purge", "--tenant", "acme"]).contains("removed 3 "));
    assert_eq!(rows(&run(&["cache", "stats"])), [["globex", "faq", "2", "20"]]);
}

#[tokio::test]
async fn an_entry_is_never_served_where_the_callers_residency_excludes_its_producer() {
    let model = FakeModel::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut adapters, _) = memory_adapters();
    adapters.cache = Some(Arc::new(EmbeddedCacheStore::open(&dir.path().join("cache.db")).unwrap()));
    // `main` is in the US; its fallback `eu` in the EU.
    let url = model.url();
    let yaml = cache_config(&url, dir.path(), "1h").replace(
        "      external: false\n",
        &format!(
            "      external: false\n      jurisdiction: us\n      fallback: [eu]\n    eu:\n      url: \"{url}\"\n      \
             price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}\n      jurisdiction: eu\n"
        ),
    );
    let gw = serve_in_process(&yaml, adapters).await;
    let call = |headers: &'static [(&'static str, &'static str)]| {
        let mut request = client().post(format!("{}/v1/chat/completions", gw.url)).bearer_auth(KEY);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.json(&ask("faq-model", "Where is my parcel?")).send()
    };
    let first = call(&[]).await.unwrap();
    assert_eq!((header(&first, "flexway-backend"), header(&first, "flexway-cache")), ("main".into(), "stored".into()));
    // Produced in the US: not for a call that must stay in the EU.
    let eu_only = call(&[("flexway-jurisdiction", "eu")]).await.unwrap();
    assert_eq!(eu_only.status(), 200);
    assert_eq!(header(&eu_only, "flexway-backend"), "eu");
    assert!(!header(&eu_only, "flexway-cache").starts_with("hit"), "a US answer served in the EU");
}
