//! The DynamoDB ledger against the emulator: the same conformance suite as the memory
//! and embedded stores (each check on a fresh table), plus the DynamoDB-specific
//! paths the suite does not reach.
//!
//! What this does not show: concurrency under DynamoDB's own rules. The emulator
//! (`localstack/moto_serial.py`) applies one request at a time, because moto's
//! transactions are not atomic under concurrent requests. So the suite's "96
//! concurrent reservations" check sends its requests concurrently but they are
//! applied serially here: it proves the conditions and the all-or-nothing writes,
//! not behaviour under real contention (`TransactionConflict` retries), which only
//! real DynamoDB or LocalStack can show.
#![cfg(test)]

use flexway_testkit::emulator;

use std::sync::{Arc, Mutex};

use aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use flexway::admission::{Demand, admit};
use flexway::budget::{
    BudgetStore, CounterKey, IntentOutcome, LeasePolicy, LeasedBudgetStore, Line, ReserveOutcome, ReserveRequest,
    SettleOutcome, conformance,
};
use flexway::config::{Capability, Price, TenantId};
use flexway::identity::Caller;
use flexway::protocol::openai::Usage;
use flexway_aws::DynamoDbBudgetStore;

async fn fresh_store(sdk: &aws_config::SdkConfig) -> DynamoDbBudgetStore {
    let client = aws_sdk_dynamodb::Client::new(sdk);
    let table = emulator::unique("flexway-ledger-test");
    DynamoDbBudgetStore::create_table(&client, &table).await.expect("create the table");
    let store = DynamoDbBudgetStore::new(client, table);
    store.warm().await.expect("the table answers");
    store
}

fn request(id: &str, lines: &[(&str, u64, Option<u64>)]) -> ReserveRequest {
    ReserveRequest {
        request_id: id.to_owned(),
        lines: lines
            .iter()
            .map(|(k, amount, limit)| Line { key: CounterKey((*k).into()), amount: *amount, limit: *limit })
            .collect(),
        expires_at: flexway::budget::period::unix_now() + 60,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamodb_store_passes_the_conformance_suite() {
    let sdk = emulator::sdk().await;
    let failures = conformance::run_all(|| fresh_store(&sdk)).await;
    assert!(failures.is_empty(), "conformance failures:\n{}", failures.join("\n"));
}

/// Budget leases over the DynamoDB ledger (what `build_adapters` runs): the same suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leased_dynamodb_store_passes_the_conformance_suite() {
    let sdk = emulator::sdk().await;
    let failures = conformance::run_all(|| async {
        LeasedBudgetStore::new(Arc::new(fresh_store(&sdk).await), LeasePolicy::default())
            .with_clock(|| conformance::NOW)
    })
    .await;
    assert!(failures.is_empty(), "conformance failures:\n{}", failures.join("\n"));
}

#[tokio::test]
async fn refuses_a_line_larger_than_its_limit_without_writing() {
    let sdk = emulator::sdk().await;
    let store = fresh_store(&sdk).await;
    let outcome = store.reserve(&request("big", &[("t/a", 5, Some(100)), ("t/b", 101, Some(100))])).await.unwrap();
    assert_eq!(outcome, ReserveOutcome::Refused { line: 1 });
    let keys = [CounterKey("t/a".into()), CounterKey("t/b".into())];
    assert_eq!(store.used(&keys).await.unwrap(), [0, 0]);
    assert_eq!(store.live_reservations().await.unwrap(), 0);
}

#[tokio::test]
async fn lines_naming_one_counter_add_up_in_one_transaction() {
    let sdk = emulator::sdk().await;
    let store = fresh_store(&sdk).await;
    let dup = request("dup", &[("t/a", 60, Some(100)), ("t/a", 30, Some(100))]);
    let outcome = store.reserve(&dup).await.unwrap();
    assert_eq!(outcome, ReserveOutcome::Reserved);
    let refused = store.reserve(&request("dup2", &[("t/a", 6, Some(100)), ("t/a", 5, Some(100))])).await.unwrap();
    assert_eq!(refused, ReserveOutcome::Refused { line: 0 });
    let keys = [CounterKey("t/a".into())];
    assert_eq!(store.used(&keys).await.unwrap(), [90]);
    assert_eq!(
        store.settle(&dup.reservation(), &[(CounterKey("t/a".into()), 10)]).await.unwrap(),
        SettleOutcome::Settled
    );
    assert_eq!(store.used(&keys).await.unwrap(), [10]);
}

#[tokio::test]
async fn items_follow_the_documented_table_design() {
    let sdk = emulator::sdk().await;
    let store = fresh_store(&sdk).await;
    let key = "acme/*/tokens/day/2026-11-29";
    store.reserve(&request("design", &[(key, 42, Some(1000))])).await.unwrap();
    let client = aws_sdk_dynamodb::Client::new(&sdk);
    let get = |pk: String| {
        let client = client.clone();
        let table = store.table().to_owned();
        async move {
            client
                .get_item()
                .table_name(table)
                .key("pk", aws_sdk_dynamodb::types::AttributeValue::S(pk))
                .consistent_read(true)
                .send()
                .await
                .unwrap()
                .item
                .expect("item exists")
        }
    };
    let counter = get(format!("counter#{key}")).await;
    assert_eq!(counter["used"].as_n().unwrap(), "42");
    let counter_ttl: u64 = counter["ttl"].as_n().unwrap().parse().unwrap();
    let reservation = get("reservation#design".to_owned()).await;
    assert_eq!(reservation["swept"].as_bool().unwrap(), &false);
    let expires_at: u64 = reservation["expires_at"].as_n().unwrap().parse().unwrap();
    let ttl: u64 = reservation["ttl"].as_n().unwrap().parse().unwrap();
    // Never deleted before its counters: a sweeper down for days still refunds it.
    assert_eq!(ttl, (expires_at + 86_400).max(counter_ttl));
    assert!(ttl >= counter_ttl, "the reservation outlives its counters: {ttl} < {counter_ttl}");
    assert!(reservation["lines"].as_s().unwrap().contains(key));
    assert!(!reservation.contains_key("actual"), "no intent unless a settlement failed");

    // A settle intent is one attribute of the reservation item; no counter moves.
    let intent = store.record_intent("design", &[(CounterKey(key.into()), 17)]).await.unwrap();
    assert_eq!(intent, IntentOutcome::Recorded);
    let reservation = get("reservation#design".to_owned()).await;
    let actual: Vec<(String, u64)> = serde_json::from_str(reservation["actual"].as_s().unwrap()).unwrap();
    assert_eq!(actual, [(key.to_owned(), 17)]);
    let ttl: u64 = reservation["ttl"].as_n().unwrap().parse().unwrap();
    assert!(ttl >= expires_at + 30 * 86_400, "a reservation carrying a bill outlives its usual day: ttl {ttl}");
    assert_eq!(get(format!("counter#{key}")).await["used"].as_n().unwrap(), "42");
}

/// A window's counter carries the table's `ttl` an hour past its minute, a run's
/// counters and item a day past the run's expiry (DynamoDB deletes them), a day's
/// budget its own; a run's children
/// and end are attributes of its item, written by `create_run` and `end_run`.
#[tokio::test]
async fn windows_expire_an_hour_and_runs_a_day_past_their_expiry() {
    use flexway::budget::run::{Run, RunBudget, RunRef};
    use flexway::budget::{Period, RUN_RETENTION_SECS, RunEnd, Unit};

    let sdk = emulator::sdk().await;
    let store = fresh_store(&sdk).await;
    let now = flexway::budget::period::unix_now();
    let parent = Run {
        this: RunRef { id: "run_p".into(), budget: RunBudget { tokens: Some(500), eur: None }, expires_at: now + 600 },
        tenant: "acme".into(),
        agent: None,
        label: None,
        ancestors: vec![],
        created_at: now,
        ended_at: None,
        children: vec![],
    };
    let child = Run {
        this: RunRef { id: "run_c".into(), ..parent.this.clone() },
        ancestors: vec![parent.this.clone()],
        ..parent.clone()
    };
    assert!(store.create_run(&parent).await.unwrap());
    assert!(store.create_run(&child).await.unwrap());
    let window = CounterKey::window("acme", None, Unit::Requests, now);
    let spent = parent.this.counter("acme", Unit::Tokens);
    let day = CounterKey::new("acme", None, Unit::Tokens, Period::Day, now);
    let call = ReserveRequest {
        request_id: "windowed".into(),
        lines: [&window, &spent, &day].map(|key| Line { key: key.clone(), amount: 1, limit: Some(500) }).to_vec(),
        expires_at: now + 60,
    };
    assert_eq!(store.reserve(&call).await.unwrap(), ReserveOutcome::Reserved);

    let client = aws_sdk_dynamodb::Client::new(&sdk);
    let get = |pk: String| {
        let (client, table) = (client.clone(), store.table().to_owned());
        async move {
            let key = aws_sdk_dynamodb::types::AttributeValue::S(pk);
            let item = client.get_item().table_name(table).key("pk", key).consistent_read(true).send().await;
            item.unwrap().item.expect("item exists")
        }
    };
    let ttl = |item: &std::collections::HashMap<String, aws_sdk_dynamodb::types::AttributeValue>| -> u64 {
        item["ttl"].as_n().unwrap().parse().unwrap()
    };
    let window_ttl = ttl(&get(format!("counter#{}", window.as_str())).await);
    assert_eq!(window_ttl, window.expiry().unwrap() + 3600);
    assert_eq!(ttl(&get(format!("counter#{}", spent.as_str())).await), now + 600 + RUN_RETENTION_SECS);
    let day_ttl = ttl(&get(format!("counter#{}", day.as_str())).await);
    assert!(day_ttl >= Period::Day.end(now) + 35 * 86_400, "a day's budget keeps its 35 days: {day_ttl}");

    let item = get("run#run_p".to_owned()).await;
    assert_eq!(ttl(&item), now + 600 + RUN_RETENTION_SECS);
    let children: Vec<&str> = item["children"].as_l().unwrap().iter().map(|c| c.as_s().unwrap().as_str()).collect();
    assert_eq!(children, ["run_c"]);
    assert!(!item.contains_key("ended_at"));
    assert_eq!(store.end_run("run_p", now + 5).await.unwrap(), RunEnd::Ended(vec!["run_p".into(), "run_c".into()]));
    for id in ["run_p", "run_c"] {
        assert_eq!(get(format!("run#{id}")).await["ended_at"].as_n().unwrap(), &(now + 5).to_string());
    }
    assert_eq!(store.run("run_c").await.unwrap().unwrap().ended_at, Some(now + 5));
}

/// Records the DynamoDB operation of every request the client sends (its
/// `X-Amz-Target`, attempts included): what a call really costs on the wire.
#[derive(Debug, Clone, Default)]
struct Operations(Arc<Mutex<Vec<String>>>);

impl Operations {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl Intercept for Operations {
    fn name(&self) -> &'static str {
        "CountOperations"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let target = context.request().headers().get("x-amz-target").unwrap_or("?");
        let operation = target.rsplit('.').next().unwrap_or(target).to_owned();
        self.0.lock().unwrap().push(operation);
        Ok(())
    }
}

/// A gateway on a fresh ledger table whose client counts its operations; tenant
/// `acme` has the three budgets, agent `bot` none of its own.
async fn counted_gateway(soft: &str) -> (flexway::Gateway, DynamoDbBudgetStore, Operations) {
    counted_gateway_on(soft, |store| Arc::new(store)).await
}

/// The same, its ledger the store `wrap` makes of the counted DynamoDB store.
async fn counted_gateway_on(
    soft: &str,
    wrap: impl FnOnce(DynamoDbBudgetStore) -> Arc<dyn BudgetStore>,
) -> (flexway::Gateway, DynamoDbBudgetStore, Operations) {
    let sdk = emulator::sdk().await;
    let plain = aws_sdk_dynamodb::Client::new(&sdk);
    let table = emulator::unique("flexway-ledger-cost");
    DynamoDbBudgetStore::create_table(&plain, &table).await.expect("create the table");
    let operations = Operations::default();
    let config = aws_sdk_dynamodb::config::Builder::from(&sdk).interceptor(operations.clone()).build();
    let store = DynamoDbBudgetStore::new(aws_sdk_dynamodb::Client::from_conf(config), &table);
    let yaml = format!(
        r#"version: 1
store: {{kind: dynamodb, table: {table}}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys: [{{sha256: {key}}}]
    budgets: {{tokens_per_day: 100000, tokens_per_month: 1000000, eur_per_month: 50}}
ai:
  default_backend: main
  budget: {{default_max_tokens: 100, min_completion_tokens: 10{soft}}}
  backends:
    main: {{url: "http://127.0.0.1:9", price: {{input_per_mtok_eur: 2, output_per_mtok_eur: 8}}}}
    small: {{url: "http://127.0.0.1:9", price: {{input_per_mtok_eur: 0.1, output_per_mtok_eur: 0.1}}}}
"#,
        key = flexway::identity::key_sha256_hex("sk-cost"),
    );
    let env: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let loaded = flexway::config::load_str(&yaml, &env).unwrap_or_else(|e| panic!("{e}"));
    let secrets = Arc::new(flexway::secret::LocalSecrets { env });
    let adapters = flexway::gateway::Adapters {
        budgets: wrap(store.clone()),
        audit: Arc::new(flexway::audit::StdoutAuditSink),
        export: flexway::telemetry::Export::EachCall,
        cache: None,
    };
    let gateway = flexway::Gateway::new(loaded.config, secrets, adapters).await.unwrap();
    operations.take();
    (gateway, store, operations)
}

fn acme() -> Caller {
    Caller {
        tenant: TenantId::new("acme"),
        agent: None,
        key_sha256: [0; 32],
        relay_peer: false,
        key_limits: Default::default(),
    }
}

const CHAT: Demand = Demand {
    capability: Capability::Chat,
    prompt_tokens: 50,
    max_tokens: Some(100),
    choices: 1,
    completes: true,
    stream: false,
    sensitive: false,
    affinity: None,
    prefix: None,
    criticality: flexway::call::Criticality::Standard,
    residency: flexway::routing::Residency::ANY,
    entry: None,
};

/// One served call through the real admission and ticket: what it sends to DynamoDB.
async fn served_call(gateway: &flexway::Gateway, id: &str) -> bool {
    let caller = acme();
    let who = flexway::admission::Reserving { caller: &caller, run: None, request_id: id, pace: &mut None };
    let admission = admit(gateway, who, &CHAT).await.unwrap();
    let price = Price {
        input_per_mtok: flexway::money::MicroEur(2_000_000),
        output_per_mtok: flexway::money::MicroEur(8_000_000),
        ..Price::default()
    };
    admission.ticket.settle(Usage::new(40, 60), price).await;
    admission.soft
}

/// A served call costs its reservation and its settlement, two
/// `TransactWriteItems`, and not one read (no BatchGetItem of the counters before
/// reserving, no GetItem of the reservation before settling).
#[tokio::test]
async fn a_served_call_costs_two_transactions_and_no_read() {
    let (gateway, store, operations) = counted_gateway("").await;
    for i in 0..3 {
        assert!(!served_call(&gateway, &format!("call-{i}")).await);
        assert_eq!(operations.take(), ["TransactWriteItems", "TransactWriteItems"], "call {i}");
    }
    // The ledger holds the usage: 3 calls of 100 tokens, nothing left reserved.
    let day = flexway::budget::plan::budgets_for(
        &gateway.config,
        &TenantId::new("acme"),
        None,
        flexway::budget::period::unix_now(),
    );
    assert_eq!(store.used(&[day[0].key.clone()]).await.unwrap(), [300]);
    assert_eq!(store.live_reservations().await.unwrap(), 0);
}

/// With budget leases (as `build_adapters` wires the DynamoDB ledger), the first call
/// takes a lease (one transaction) and the next ones write no counter: they are served
/// from its slice, each leaving the lease's usage on the lease's item. Ending the lease is one transaction, after which the counters hold
/// exactly the usage of the calls.
#[tokio::test]
async fn served_calls_on_a_lease_write_no_counter_until_it_ends() {
    let leased = Arc::new(std::sync::OnceLock::new());
    let (gateway, store, operations) = counted_gateway_on("", |store| {
        // One lease for every call: 64 calls' worth from the first.
        let policy = LeasePolicy { intent_every: std::time::Duration::ZERO, first_calls: 64, ..LeasePolicy::default() };
        let lease = Arc::new(LeasedBudgetStore::new(Arc::new(store), policy));
        let _ = leased.set(lease.clone());
        lease
    })
    .await;
    let leased = leased.get().unwrap();
    assert!(!served_call(&gateway, "first").await);
    assert_eq!(operations.take(), ["TransactWriteItems", "UpdateItem"], "the lease with the first call, its usage");
    for i in 0..20 {
        assert!(!served_call(&gateway, &format!("call-{i}")).await);
    }
    let sent = operations.take();
    assert_eq!(sent, vec!["UpdateItem"; 20], "each call: the lease's usage on its own item, no counter");
    leased.flush().await;
    assert_eq!(operations.take(), ["TransactWriteItems"], "the lease settled");
    let day = flexway::budget::plan::budgets_for(
        &gateway.config,
        &TenantId::new("acme"),
        None,
        flexway::budget::period::unix_now(),
    );
    assert_eq!(store.used(&[day[0].key.clone()]).await.unwrap(), [21 * 100]);
    assert_eq!(store.live_reservations().await.unwrap(), 0);
}

/// Past the soft threshold the first call reads (its guarded reservation is refused,
/// the counters are read, it is decided again); the next ones go soft directly: two
/// transactions again.
#[tokio::test]
async fn past_the_soft_threshold_only_the_first_call_reads() {
    // 0.1% of 100,000 tokens a day: the first call (150 reserved) crosses it.
    let (gateway, _store, operations) = counted_gateway(", soft: {threshold: 0.001, backend: small}").await;
    assert!(!served_call(&gateway, "under").await);
    assert_eq!(operations.take(), ["TransactWriteItems", "TransactWriteItems"]);
    assert!(served_call(&gateway, "crossing").await, "the counters are past the threshold");
    assert_eq!(
        operations.take(),
        ["TransactWriteItems", "GetItem", "BatchGetItem", "TransactWriteItems", "TransactWriteItems"],
        "refused by the soft guard, read, reserved soft, settled"
    );
    assert!(served_call(&gateway, "soft").await);
    assert_eq!(operations.take(), ["TransactWriteItems", "TransactWriteItems"]);
}

/// The sweeper and `live_reservations` Query the sparse expiry index, never Scan.
#[tokio::test]
async fn the_sweeper_queries_the_expiry_index_and_never_scans() {
    let (_gateway, store, operations) = counted_gateway("").await;
    let mut expired = request("expired", &[("t/a", 5, Some(100))]);
    expired.expires_at = flexway::budget::period::unix_now() - 1;
    store.reserve(&expired).await.unwrap();
    operations.take();
    assert_eq!(store.sweep(flexway::budget::period::unix_now()).await.unwrap().refunded, 1);
    let sent = operations.take();
    let queries = sent.iter().filter(|o| *o == "Query").count();
    assert_eq!(queries, 16, "one Query per shard: {sent:?}");
    assert_eq!(sent.len(), queries + 1, "and one refund transaction: {sent:?}");
    assert_eq!(store.live_reservations().await.unwrap(), 0);
    let sent = operations.take();
    assert!(!sent.is_empty() && sent.iter().all(|o| o == "Query"), "live_reservations: {sent:?}");
}

/// A ledger endpoint that accepts connections and never answers: the SDK's timeouts
/// (`flexway_aws::sdk_timeouts`) end the write with an error instead of holding the
/// call for as long as the function may run.
#[tokio::test]
async fn a_write_to_a_ledger_that_never_answers_gives_up_with_an_error() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    let sdk = flexway_aws::sdk_loader()
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(format!("http://{address}"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new("test", "test", None, None, "hung"))
        .load()
        .await;
    let store = DynamoDbBudgetStore::new(aws_sdk_dynamodb::Client::new(&sdk), "hung");
    let hung = request("hung", &[("t/a", 5, Some(100))]);
    let reserve = store.reserve(&hung);
    // Far past the operation timeout (12 s): only a missing timeout reaches it.
    let outcome = tokio::time::timeout(std::time::Duration::from_secs(60), reserve).await;
    let error = outcome.expect("the SDK's timeouts end the write").unwrap_err();
    assert!(error.to_string().contains("TransactWriteItems"), "{error}");
    held.abort();
}

/// The client request token of each TransactWriteItems request sent.
#[derive(Clone, Default, Debug)]
struct Tokens(Arc<Mutex<Vec<Option<String>>>>);

impl Intercept for Tokens {
    fn name(&self) -> &'static str {
        "RecordTransactionTokens"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let request = context.request();
        if request.headers().get("x-amz-target").is_some_and(|t| t.ends_with("TransactWriteItems")) {
            let body: serde_json::Value = serde_json::from_slice(request.body().bytes().unwrap_or_default())?;
            let token = body["ClientRequestToken"].as_str().map(str::to_owned);
            self.0.lock().unwrap().push(token);
        }
        Ok(())
    }
}

/// Each transaction carries a client request token of its own, which the SDK fills
/// in (the API marks it an idempotency token) and keeps across its retries: the SDK
/// timeouts (`flexway_aws::sdk_timeouts`) rely on it, so that a retried attempt that
/// was applied (its answer lost to a timeout) is answered as applied, not refused.
#[tokio::test]
async fn each_transaction_carries_a_token_of_its_own() {
    let sdk = emulator::sdk().await;
    let plain = aws_sdk_dynamodb::Client::new(&sdk);
    let table = emulator::unique("flexway-ledger-tokens");
    DynamoDbBudgetStore::create_table(&plain, &table).await.unwrap();
    let tokens = Tokens::default();
    let config = aws_sdk_dynamodb::config::Builder::from(&sdk).interceptor(tokens.clone()).build();
    let store = DynamoDbBudgetStore::new(aws_sdk_dynamodb::Client::from_conf(config), &table);
    let call = request("tokened", &[("t/a", 5, Some(100))]);
    assert_eq!(store.reserve(&call).await.unwrap(), ReserveOutcome::Reserved);
    store.settle(&call.reservation(), &[(CounterKey("t/a".into()), 3)]).await.unwrap();
    let sent = tokens.0.lock().unwrap().clone();
    assert_eq!(sent.len(), 2, "the reservation and the settlement: {sent:?}");
    let sent: Vec<String> = sent.into_iter().map(|t| t.expect("a ClientRequestToken")).collect();
    assert!(sent.iter().all(|t| (1..=36).contains(&t.len())), "DynamoDB takes 1 to 36 characters: {sent:?}");
    assert_ne!(sent[0], sent[1], "a token per transaction");
}

/// A reservation item the sweep cannot read (damaged by hand, written by a newer
/// version) is logged and left for the next sweep: the other expired reservations
/// are still closed, and the sweep does not fail.
#[tokio::test]
async fn one_item_the_sweep_cannot_read_does_not_stop_it() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let sdk = emulator::sdk().await;
    let store = fresh_store(&sdk).await;
    let now = flexway::budget::period::unix_now();
    let mut expired = request("expired", &[("t/a", 5, Some(100))]);
    expired.expires_at = now - 1;
    store.reserve(&expired).await.unwrap();
    let client = aws_sdk_dynamodb::Client::new(&sdk);
    client
        .put_item()
        .table_name(store.table())
        .item("pk", AttributeValue::S("reservation#damaged".into()))
        .item("lines", AttributeValue::S("not json".into()))
        .item("expires_at", AttributeValue::N((now - 2).to_string()))
        .item("swept", AttributeValue::Bool(false))
        .item(flexway_aws::EXPIRY_SHARD, AttributeValue::S("live#00".into()))
        .send()
        .await
        .unwrap();
    let swept = store.sweep(now).await.expect("the sweep goes past the damaged item");
    assert_eq!(swept.refunded, 1, "the readable reservation is refunded: {swept:?}");
    assert_eq!(store.used(&[CounterKey("t/a".into())]).await.unwrap(), [0]);
}
