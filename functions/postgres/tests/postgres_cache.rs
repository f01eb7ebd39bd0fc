//! The PostgreSQL cache store against a real PostgreSQL 18 with pgvector (tests/kit
//! starts one per test binary, a fresh database per test): the cache conformance
//! suite, what the table holds, and the failures that must be misses, never hangs.
//!
//! `cargo test --release -p flexway-postgres --test postgres_cache -- --ignored bench`
//! measures lookups at 100,000 entries in one partition.
#![cfg(test)]

use std::time::{Duration, Instant};

use flexway::cache::{CacheStore, Entry, Keys, Lookup, Partition, Probe, StoreError, conformance, sha256, unit};
use flexway_postgres::{CONNECT_TIMEOUT, PostgresCacheStore};
use flexway_testkit::postgres;

fn now() -> u64 {
    flexway::budget::period::unix_now()
}

async fn fresh_store() -> (PostgresCacheStore, String) {
    let url = postgres::database();
    let store = PostgresCacheStore::connect(&url).await.unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    (store, url)
}

/// The database name of a kit URL.
fn name(url: &str) -> &str {
    url.rsplit('/').next().unwrap()
}

#[tokio::test]
async fn postgres_store_passes_the_conformance_suite() {
    let (store, _) = fresh_store().await;
    conformance::check(&store).await;
}

#[tokio::test]
async fn connecting_twice_finds_the_schema_and_its_entries() {
    let (store, url) = fresh_store().await;
    let partition = Partition::new("acme", None, "faq", "m", &[0; 32]);
    let probe = Probe { exact: [1; 32], vector: unit(vec![1.0, 2.0, 3.0]), guard: 5 };
    let entry = Entry {
        partition: &partition,
        probe: &probe,
        sealed: flexway::cache::Sealed(vec![9; 30]),
        stored_at: now(),
        expires_at: now() + 60,
        max_entries_per_tenant: 10,
    };
    store.store(entry).await.unwrap();
    let again = PostgresCacheStore::connect(&url).await.unwrap();
    let near = Probe { exact: [2; 32], ..probe.clone() };
    let lookup = Lookup { partition: &partition, probe: &near, threshold: 0.9, stored_since: 0, now: now() };
    let found = again.lookup(&lookup).await.unwrap().expect("the entry, semantically, from a second store");
    assert_eq!(found.exact, [1; 32]);
    assert!((found.similarity - 1.0).abs() < 1e-5, "{}", found.similarity);
    let indexes = postgres::server().psql(name(&url), "SELECT indexname FROM pg_indexes ORDER BY 1");
    assert!(indexes.contains("flexway_cache_entries_hnsw_3\n"), "the index of 3 dimensions: {indexes}");
}

#[tokio::test]
async fn the_table_holds_no_clear_text() {
    let (store, url) = fresh_store().await;
    let keys = Keys::new(b"the master key of this test, 32 bytes or so");
    let plain = b"RECOGNISABLE ANSWER: the launch code is 0000-CAFE-BABE";
    let partition = Partition::new("acme", Some("bot"), "faq", "gpt-4o", &[3; 32]);
    let probe = Probe { exact: sha256(b"what is the launch code?"), vector: unit(vec![0.5; 8]), guard: 77 };
    let sealed = keys.seal(&partition, &probe, plain).unwrap();
    let entry = Entry {
        partition: &partition,
        probe: &probe,
        sealed,
        stored_at: now(),
        expires_at: now() + 60,
        max_entries_per_tenant: 10,
    };
    store.store(entry).await.unwrap();

    let rows = postgres::server().psql(
        name(&url),
        "SELECT encode(partition, 'hex'), tenant, policy, encode(exact, 'hex'), guard, vector::text, \
         encode(sealed, 'hex'), stored_at, expires_at FROM flexway_cache_entries",
    );
    assert_eq!(rows.lines().count(), 1, "{rows}");
    let text = String::from_utf8_lossy(plain);
    let hex: String = plain.iter().map(|b| format!("{b:02x}")).collect();
    for needle in [&text[..], &hex, "RECOGNISABLE", "launch code"] {
        assert!(!rows.contains(needle), "the table holds {needle:?}: {rows}");
    }
    // And what it holds is the answer, for its own partition and keys only.
    let lookup = Lookup { partition: &partition, probe: &probe, threshold: 0.9, stored_since: 0, now: now() };
    let found = store.lookup(&lookup).await.unwrap().expect("the entry");
    assert_eq!(keys.open(&partition, &found.exact, &found.sealed).as_deref(), Some(&plain[..]));
    let other = Partition::new("acme", None, "faq", "gpt-4o", &[3; 32]);
    assert_eq!(keys.open(&other, &found.exact, &found.sealed), None);
}

fn unavailable<T: std::fmt::Debug>(result: Result<T, StoreError>, what: &str) {
    match result {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("{what}: expected Unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn a_server_that_is_gone_is_unavailable_at_once() {
    let url = format!("postgres://postgres@127.0.0.1:{}/nothing", postgres::free_port());
    let started = Instant::now();
    unavailable(PostgresCacheStore::connect(&url).await.map(drop), "connect to a closed port");
    let store = PostgresCacheStore::new(&url).unwrap();
    let partition = Partition::new("acme", None, "faq", "m", &[0; 32]);
    let probe = Probe { exact: [1; 32], vector: unit(vec![1.0, 0.0]), guard: 0 };
    let lookup = Lookup { partition: &partition, probe: &probe, threshold: 0.9, stored_since: 0, now: now() };
    unavailable(store.lookup(&lookup).await, "lookup");
    unavailable(store.purge("acme", None).await, "purge");
    unavailable(store.stats().await, "stats");
    assert!(started.elapsed() < Duration::from_secs(1), "took {:?}", started.elapsed());
}

#[tokio::test]
async fn a_server_that_never_answers_is_unavailable_within_the_connect_timeout() {
    // The kernel accepts the connection; nothing ever answers the startup message.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("postgres://postgres@{}/nothing", silent.local_addr().unwrap());
    let started = Instant::now();
    unavailable(PostgresCacheStore::connect(&url).await.map(drop), "connect to a silent server");
    let took = started.elapsed();
    assert!(took >= CONNECT_TIMEOUT && took < CONNECT_TIMEOUT + Duration::from_secs(1), "took {took:?}");
}

#[tokio::test]
async fn sslmode_require_never_falls_back_to_plain_tcp() {
    // The kit's server speaks no TLS.
    let url = format!("{}?sslmode=require", postgres::database());
    unavailable(PostgresCacheStore::connect(&url).await.map(drop), "sslmode=require without TLS");
    let missing = format!("{url}&sslrootcert=/nonexistent/rds.pem");
    unavailable(PostgresCacheStore::new(&missing).map(drop), "an sslrootcert that cannot be read");
}

#[tokio::test]
async fn a_dropped_connection_is_reopened() {
    let (store, url) = fresh_store().await;
    let partition = Partition::new("acme", None, "faq", "m", &[0; 32]);
    let probe = Probe { exact: [1; 32], vector: None, guard: 0 };
    let entry = Entry {
        partition: &partition,
        probe: &probe,
        sealed: flexway::cache::Sealed(vec![1; 8]),
        stored_at: now(),
        expires_at: now() + 60,
        max_entries_per_tenant: 10,
    };
    store.store(entry).await.unwrap();
    let killed = postgres::server().psql(
        "postgres",
        &format!("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = '{}'", name(&url)),
    );
    assert_eq!(killed.trim(), "2", "the store's two connections (lookups, and the rest)");
    let lookup = Lookup { partition: &partition, probe: &probe, threshold: 0.9, stored_since: 0, now: now() };
    // The first call may still find the connection open and fail (a miss); the next
    // one reconnects.
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        outcomes.push(store.lookup(&lookup).await.map(|found| found.map(|f| f.sealed)));
        if matches!(outcomes.last(), Some(Ok(_))) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(outcomes.len() <= 2, "{outcomes:?}");
    assert!(matches!(outcomes.last(), Some(Ok(Some(_)))), "{outcomes:?}");
}

/// Past 1,024 entries a tenant's eviction runs on one store in 16 (it reads the
/// tenant's newest entries up to its limit): the limit holds within those stores.
#[tokio::test]
async fn a_large_limit_is_kept_within_a_few_stores() {
    let (store, url) = fresh_store().await;
    let partition = Partition::new("acme", None, "faq", "m", &[0; 32]);
    let t = now();
    for n in 0..1300u64 {
        let probe = Probe { exact: sha256(&n.to_be_bytes()), vector: None, guard: 0 };
        let entry = Entry {
            partition: &partition,
            probe: &probe,
            sealed: flexway::cache::Sealed(vec![1; 4]),
            stored_at: t - 2000 + n,
            expires_at: t + 3600,
            max_entries_per_tenant: 1100,
        };
        store.store(entry).await.unwrap();
    }
    let count = postgres::server().psql(name(&url), "SELECT count(*), min(stored_at) FROM flexway_cache_entries");
    let (count, oldest) = count.trim().split_once('|').unwrap();
    let (count, oldest): (u64, u64) = (count.parse().unwrap(), oldest.parse().unwrap());
    assert!((1100..=1116).contains(&count), "{count} entries for a limit of 1100");
    assert_eq!(oldest, t - 2000 + 1300 - count, "the newest are kept");
}

/// Lookups at 100,000 entries of 256 dimensions in one partition, over loopback TCP:
/// exact hits, semantic hits (a stored vector with a little noise, under another
/// exact hash) and stores (each an upsert, the tenant's eviction count and a sweep).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: cargo test --release -p flexway-postgres -- --ignored bench"]
async fn bench_lookups_at_100k_entries_of_256_dimensions() {
    const N: usize = 100_000;
    const DIM: usize = 256;
    const SAMPLES: usize = 2_000;
    let (store, url) = fresh_store().await;
    let db = name(&url);
    let server = postgres::server();
    let partition = Partition::new("bench", None, "faq", "m", &[0; 32]);
    let t = now();
    let probe = |exact: [u8; 32], vector: Vec<f32>| Probe { exact, vector: unit(vector), guard: 0 };
    fn entry<'a>(partition: &'a Partition, probe: &'a Probe, t: u64) -> Entry<'a> {
        Entry {
            partition,
            probe,
            sealed: flexway::cache::Sealed(vec![7; 600]),
            stored_at: t,
            expires_at: t + 3600,
            max_entries_per_tenant: 1_000_000,
        }
    }
    // The rows are inserted by the server (random vectors, exact hash = SHA-256 of the
    // row number, big-endian), then indexed in bulk under the name and definition the
    // store gives the index of 256 dimensions (its first store finds it made): HNSW
    // inserts one by one took 424 s for the same rows on 2 busy cores.
    let loading = Instant::now();
    let id: String = partition.id.iter().map(|b| format!("{b:02x}")).collect();
    server.psql(
        db,
        &format!(
            "SELECT setseed(0.42); INSERT INTO flexway_cache_entries \
             (partition, tenant, policy, exact, guard, vector, sealed, stored_at, expires_at) \
             SELECT '\\x{id}', 'bench', 'faq', sha256(int8send(i)), 0, \
               (SELECT array_agg(random() - 0.5)::vector FROM generate_series(1, {DIM}) WHERE i > 0), \
               decode(repeat('07', 600), 'hex'), {t}, {t} + 3600 \
             FROM generate_series(1, {N}) i"
        ),
    );
    let inserted = loading.elapsed();
    server.psql(
        db,
        "SET maintenance_work_mem = '1GB'; CREATE INDEX flexway_cache_entries_hnsw_256 ON flexway_cache_entries \
         USING hnsw ((vector::vector(256)) vector_cosine_ops) WHERE vector_dims(vector) = 256",
    );
    server.psql(db, "VACUUM ANALYZE flexway_cache_entries");
    eprintln!("inserted {N} rows in {inserted:?}, indexed and vacuumed in {:?}", loading.elapsed() - inserted);
    let first = probe([0; 32], vec![1.0; DIM]);
    store.store(entry(&partition, &first, t)).await.unwrap();

    let mut noise = 0x9e37_79b9_7f4a_7c15u64;
    let mut jitter = move || {
        noise ^= noise << 13;
        noise ^= noise >> 7;
        noise ^= noise << 17;
        (noise >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let vectors: Vec<(u64, Vec<f32>)> = server
        .psql(
            db,
            &format!(
                "SELECT i, (SELECT vector::text FROM flexway_cache_entries WHERE exact = sha256(int8send(i))) \
                 FROM generate_series(1, {N}, {N} / {SAMPLES}) i"
            ),
        )
        .lines()
        .map(|line| {
            let (i, vector) = line.split_once('|').unwrap();
            let vector = vector.trim_matches(['[', ']']).split(',').map(|x| x.parse().unwrap()).collect();
            (i.parse().unwrap(), vector)
        })
        .collect();
    assert_eq!(vectors.len(), SAMPLES);

    let mut exact = Vec::new();
    let mut semantic = Vec::new();
    let (mut exact_hits, mut semantic_hits, mut own) = (0, 0, 0);
    for (i, vector) in &vectors {
        let hash = sha256(&(*i as i64).to_be_bytes());
        let hit = probe(hash, vector.clone());
        let lookup = Lookup { partition: &partition, probe: &hit, threshold: 0.95, stored_since: 0, now: t };
        let started = Instant::now();
        let found = store.lookup(&lookup).await.unwrap();
        exact.push(started.elapsed());
        exact_hits += usize::from(found.is_some_and(|f| f.exact == hash && f.similarity == 1.0));

        let near = probe([0xee; 32], vector.iter().map(|x| x + 0.02 * jitter()).collect());
        let lookup = Lookup { partition: &partition, probe: &near, threshold: 0.95, stored_since: 0, now: t };
        let started = Instant::now();
        let found = store.lookup(&lookup).await.unwrap();
        semantic.push(started.elapsed());
        if let Some(found) = found {
            semantic_hits += 1;
            own += usize::from(found.exact == hash);
        }
    }
    let mut stores = Vec::new();
    for (n, (_, vector)) in vectors.iter().enumerate().take(500) {
        let fresh = probe(sha256(format!("new {n}").as_bytes()), vector.iter().map(|x| x + 0.5 * jitter()).collect());
        let started = Instant::now();
        store.store(entry(&partition, &fresh, t)).await.unwrap();
        stores.push(started.elapsed());
    }
    let report = |what: &str, mut times: Vec<Duration>| {
        times.sort();
        let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
        eprintln!("{what}: n={} p50 {:?} p99 {:?} max {:?}", times.len(), at(0.5), at(0.99), at(1.0));
    };
    report("exact hit", exact);
    report("semantic", semantic);
    report("store (upsert + eviction count + sweep)", stores);
    eprintln!("exact hits {exact_hits}/{SAMPLES}; semantic hits {semantic_hits}/{SAMPLES}, of them its source {own}");
    // The server's statistics say which index the lookups went through (a busy
    // backend flushes them at most once a second, an idle one after 10 s).
    tokio::time::sleep(Duration::from_secs(11)).await;
    let scans = server.psql(
        db,
        "SELECT indexrelname, idx_scan FROM pg_stat_user_indexes WHERE relname = 'flexway_cache_entries' ORDER BY 1",
    );
    eprintln!("index scans:\n{scans}");
    assert_eq!(exact_hits, SAMPLES, "every exact probe hits");
}
