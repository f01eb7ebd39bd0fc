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

mod emulator;

use flexway::budget::{
    BudgetStore, CounterKey, IntentOutcome, Line, ReserveOutcome, ReserveRequest, SettleOutcome, conformance,
};
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
            .map(|(k, amount, limit)| Line { key: CounterKey((*k).to_owned()), amount: *amount, limit: *limit })
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
    assert!(counter["ttl"].as_n().is_ok());
    let reservation = get("reservation#design".to_owned()).await;
    assert_eq!(reservation["swept"].as_bool().unwrap(), &false);
    let expires_at: u64 = reservation["expires_at"].as_n().unwrap().parse().unwrap();
    let ttl: u64 = reservation["ttl"].as_n().unwrap().parse().unwrap();
    assert_eq!(ttl, expires_at + 86_400);
    assert!(reservation["lines"].as_s().unwrap().contains(key));
    assert!(!reservation.contains_key("actual"), "no intent unless a settlement failed");

    // A settle intent is one attribute of the reservation item; no counter moves.
    let intent = store.record_intent("design", &[(CounterKey(key.to_owned()), 17)]).await.unwrap();
    assert_eq!(intent, IntentOutcome::Recorded);
    let reservation = get("reservation#design".to_owned()).await;
    let actual: Vec<(String, u64)> = serde_json::from_str(reservation["actual"].as_s().unwrap()).unwrap();
    assert_eq!(actual, [(key.to_owned(), 17)]);
    let ttl: u64 = reservation["ttl"].as_n().unwrap().parse().unwrap();
    assert!(ttl >= expires_at + 30 * 86_400, "a reservation carrying a bill outlives its usual day: ttl {ttl}");
    assert_eq!(get(format!("counter#{key}")).await["used"].as_n().unwrap(), "42");
}
