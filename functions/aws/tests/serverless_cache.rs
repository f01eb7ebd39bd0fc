//! The DynamoDB cache store against the emulator: the exact-only conformance suite
//! (on a fresh table), the table design as `functions/aws/src/cache.rs` documents it,
//! eviction through the tenant's count, no clear text in the table, and a store that
//! cannot be reached, or hangs, answering `Unavailable` promptly.
#![cfg(test)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use flexway::budget::period::unix_now;
use flexway::cache::{CacheStore, Entry, Keys, Lookup, Partition, Probe, Sealed, Stats, StoreError, conformance};
use flexway_aws::cache::{DynamoDbCacheStore, TENANT_INDEX};
use flexway_testkit::emulator;

async fn fresh_store(sdk: &aws_config::SdkConfig) -> DynamoDbCacheStore {
    let client = aws_sdk_dynamodb::Client::new(sdk);
    let table = emulator::unique("flexway-cache-test");
    DynamoDbCacheStore::create_table(&client, &table).await.expect("create the table");
    let store = DynamoDbCacheStore::new(client, table);
    store.warm().await.expect("the table answers");
    store
}

fn probe(exact: u8) -> Probe {
    Probe { exact: [exact; 32], vector: None, guard: 0 }
}

fn entry<'a>(partition: &'a Partition, probe: &'a Probe, sealed: &[u8], stored_at: u64, max: u64) -> Entry<'a> {
    Entry {
        partition,
        probe,
        sealed: Sealed(sealed.to_vec()),
        stored_at,
        expires_at: stored_at + 3600,
        max_entries_per_tenant: max,
    }
}

async fn lookup(store: &DynamoDbCacheStore, partition: &Partition, probe: &Probe, now: u64) -> Option<Vec<u8>> {
    let lookup = Lookup { partition, probe, threshold: 0.95, stored_since: 0, now };
    store.lookup(&lookup).await.unwrap().map(|found| found.sealed.0)
}

/// Every item of the table, read raw.
async fn scan(sdk: &aws_config::SdkConfig, table: &str) -> Vec<HashMap<String, AttributeValue>> {
    let client = aws_sdk_dynamodb::Client::new(sdk);
    let page = client.scan().table_name(table).send().await.unwrap();
    assert!(page.last_evaluated_key().is_none(), "one page is the whole test table");
    page.items().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamodb_cache_store_passes_the_exact_only_conformance_suite() {
    let sdk = emulator::sdk().await;
    let store = fresh_store(&sdk).await;
    assert!(!store.semantic(), "exact policies only");
    conformance::check_exact_only(&store).await;
}

#[tokio::test]
async fn items_follow_the_documented_table_design() {
    let sdk = emulator::sdk().await;
    let store = fresh_store(&sdk).await;
    let partition = Partition::new("acme", None, "faq", "m", &[3; 32]);
    let probe = Probe { exact: [0xab; 32], vector: Some(vec![1.0]), guard: 77 };
    store.store(entry(&partition, &probe, b"sealed!", 1_000, 10)).await.unwrap();

    let items = scan(&sdk, store.table()).await;
    let item = |pk: &str| items.iter().find(|i| i["pk"].as_s().unwrap() == pk).unwrap_or_else(|| panic!("{pk}"));
    let pk = format!("{}#{}", hex(&partition.id), "ab".repeat(32));
    let stored = item(&pk);
    assert_eq!(stored["tenant"].as_s().unwrap(), "acme");
    assert_eq!(stored["policy"].as_s().unwrap(), "faq");
    assert_eq!(stored["sealed"].as_b().unwrap().as_ref(), b"sealed!");
    assert_eq!(stored["sealed_bytes"].as_n().unwrap(), "7");
    assert_eq!(stored["stored_at"].as_n().unwrap(), "1000");
    assert_eq!(stored["expires_at"].as_n().unwrap(), "4600");
    assert_eq!(stored["guard"].as_n().unwrap(), "77");
    assert_eq!(stored.len(), 8, "no vector, nothing else: {:?}", stored.keys());
    assert_eq!(item("count#acme")["entries"].as_n().unwrap(), "1");
    assert_eq!(items.len(), 2);

    let client = aws_sdk_dynamodb::Client::new(&sdk);
    let described = client.describe_table().table_name(store.table()).send().await.unwrap();
    let table = described.table().unwrap();
    let index = table.global_secondary_indexes().iter().find(|i| i.index_name() == Some(TENANT_INDEX)).unwrap();
    let keys: Vec<_> = index.key_schema().iter().map(|k| (k.attribute_name(), k.key_type().as_str())).collect();
    assert_eq!(keys, [("tenant", "HASH"), ("stored_at", "RANGE")]);
    let ttl = client.describe_time_to_live().table_name(store.table()).send().await.unwrap();
    let ttl = ttl.time_to_live_description().unwrap();
    assert_eq!(ttl.attribute_name(), Some("expires_at"));

    // A replacement keeps the count; a purge takes it down.
    store.store(entry(&partition, &probe, b"again", 1_001, 10)).await.unwrap();
    let items = scan(&sdk, store.table()).await;
    assert_eq!(items.iter().find(|i| i["pk"].as_s().unwrap() == "count#acme").unwrap()["entries"].as_n().unwrap(), "1");
    assert_eq!(lookup(&store, &partition, &probe, 1_002).await.as_deref(), Some(&b"again"[..]));
    assert_eq!(store.purge("acme", None).await.unwrap(), 1);
    let items = scan(&sdk, store.table()).await;
    assert_eq!(items.len(), 1, "the count item alone is left");
    assert_eq!(items[0]["entries"].as_n().unwrap(), "0");
}

/// The count drifts above the truth when DynamoDB's TTL deletes entries (here: deleted
/// behind the store's back): reaching the limit recounts from the index, and evicts
/// nothing that fits.
#[tokio::test]
async fn a_count_above_the_truth_is_recounted_not_obeyed() {
    let sdk = emulator::sdk().await;
    let store = fresh_store(&sdk).await;
    let client = aws_sdk_dynamodb::Client::new(&sdk);
    let partition = Partition::new("acme", None, "faq", "m", &[0; 32]);
    let now = unix_now();
    let probes: Vec<Probe> = (1..=3).map(probe).collect();
    for (i, probe) in probes.iter().enumerate() {
        store.store(entry(&partition, probe, b"x", now + i as u64, 3)).await.unwrap();
    }
    // As TTL would: the first entry deleted, the count not told.
    let first = format!("{}#{}", hex(&partition.id), "01".repeat(32));
    client.delete_item().table_name(store.table()).key("pk", AttributeValue::S(first)).send().await.unwrap();

    let fourth = probe(4);
    store.store(entry(&partition, &fourth, b"x", now + 10, 3)).await.unwrap();
    for probe in [&probes[1], &probes[2], &fourth] {
        assert!(lookup(&store, &partition, probe, now + 20).await.is_some(), "entry {} kept", probe.exact[0]);
    }
    let stats = store.stats().await.unwrap();
    assert_eq!(stats, [Stats { tenant: "acme".into(), policy: "faq".into(), entries: 3, bytes: 3 }]);
    let count = scan(&sdk, store.table()).await.into_iter().find(|i| i["pk"].as_s().unwrap() == "count#acme");
    assert_eq!(count.unwrap()["entries"].as_n().unwrap(), "3", "recounted");

    // Past the limit the expired go first, then the oldest.
    let expired = probe(5);
    let stale = Entry { expires_at: now + 1, ..entry(&partition, &expired, b"x", now + 30, 10) };
    store.store(stale).await.unwrap();
    let sixth = probe(6);
    store.store(entry(&partition, &sixth, b"x", now + 40, 4)).await.unwrap();
    assert_eq!(lookup(&store, &partition, &expired, 0).await, None, "the expired entry was evicted first");
    for probe in [&probes[1], &probes[2], &fourth, &sixth] {
        assert!(lookup(&store, &partition, probe, now + 50).await.is_some(), "entry {} kept", probe.exact[0]);
    }
}

#[tokio::test]
async fn the_table_holds_no_clear_text() {
    let sdk = emulator::sdk().await;
    let store = fresh_store(&sdk).await;
    let keys = Keys::new(b"a master key of thirty-two bytes");
    let secret = "the launch code is PLAINTEXT-7f3a9c";
    let message = "what is the launch code?";
    let partition = Partition::new("acme", Some("bot"), "faq", "gpt-test", &flexway::cache::sha256(b"context"));
    let probe = Probe { exact: flexway::cache::sha256(message.as_bytes()), vector: None, guard: 0 };
    let sealed = keys.seal(&partition, &probe, secret.as_bytes()).unwrap();
    let now = unix_now();
    store.store(Entry { sealed, ..entry(&partition, &probe, b"", now, 10) }).await.unwrap();

    let found = lookup(&store, &partition, &probe, now).await.expect("stored");
    assert_eq!(keys.open(&partition, &probe.exact, &Sealed(found)).unwrap(), secret.as_bytes());
    let items = scan(&sdk, store.table()).await;
    assert_eq!(items.len(), 2);
    for item in &items {
        for (name, value) in item {
            let bytes: &[u8] = match value {
                AttributeValue::S(s) | AttributeValue::N(s) => s.as_bytes(),
                AttributeValue::B(b) => b.as_ref(),
                other => panic!("{name}: an attribute of an unexpected type {other:?}"),
            };
            for clear in [secret, "PLAINTEXT-7f3a9c", message, "gpt-test", "bot"] {
                assert!(!contains(bytes, clear.as_bytes()), "{name} holds {clear:?}");
            }
        }
    }
}

#[tokio::test]
async fn a_store_that_cannot_be_reached_is_unavailable_promptly() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let sdk = flexway_aws::sdk_loader()
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(format!("http://127.0.0.1:{port}"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new("test", "test", None, None, "test"))
        .load()
        .await;
    let store = DynamoDbCacheStore::new(aws_sdk_dynamodb::Client::new(&sdk), "nowhere");
    let partition = Partition::new("acme", None, "faq", "m", &[0; 32]);
    let probe = probe(1);
    let started = Instant::now();
    let lookup = Lookup { partition: &partition, probe: &probe, threshold: 0.95, stored_since: 0, now: 1 };
    assert!(matches!(store.lookup(&lookup).await, Err(StoreError::Unavailable(_))));
    assert!(matches!(store.store(entry(&partition, &probe, b"x", 1, 10)).await, Err(StoreError::Unavailable(_))));
    assert!(matches!(store.purge("acme", None).await, Err(StoreError::Unavailable(_))));
    assert!(matches!(store.stats().await, Err(StoreError::Unavailable(_))));
    assert!(matches!(store.warm().await, Err(StoreError::Unavailable(_))));
    let elapsed = started.elapsed();
    // One retry each, after about 50 ms: not the SDK's default backoff of a second.
    assert!(elapsed < Duration::from_secs(2), "five refused calls took {elapsed:?}");
}

/// A store that accepts connections and never answers: a lookup and a store give up
/// after the store's 2 s, not the 12 s the ledger's client allows.
#[tokio::test]
async fn a_store_that_hangs_is_unavailable_within_two_seconds() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((connection, _)) = listener.accept().await {
            connections.push(connection);
        }
    });
    let sdk = flexway_aws::sdk_loader()
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(format!("http://127.0.0.1:{port}"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new("test", "test", None, None, "test"))
        .load()
        .await;
    let store = DynamoDbCacheStore::new(aws_sdk_dynamodb::Client::new(&sdk), "silent");
    let partition = Partition::new("acme", None, "faq", "m", &[0; 32]);
    let probe = probe(1);
    let lookup = Lookup { partition: &partition, probe: &probe, threshold: 0.95, stored_since: 0, now: 1 };
    let started = Instant::now();
    assert!(matches!(store.lookup(&lookup).await, Err(StoreError::Unavailable(_))));
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(3), "a lookup took {elapsed:?}");
    let started = Instant::now();
    assert!(matches!(store.store(entry(&partition, &probe, b"x", 1, 10)).await, Err(StoreError::Unavailable(_))));
    assert!(started.elapsed() < Duration::from_secs(3), "a store took {:?}", started.elapsed());
    held.abort();
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
