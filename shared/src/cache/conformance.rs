//! The conformance suite every [`CacheStore`](super::CacheStore) passes: exact hits,
//! hard partitions, semantic matching (best above the threshold, the guard, entries
//! without a vector, vectors of another dimension), expiry, max-age, replacement,
//! eviction per tenant, purge and stats. Written against the port only, so every store
//! (embedded, PostgreSQL, DynamoDB) runs exactly these checks.
//!
//! Each check uses tenants of its own (`conf-<check>-…`), so they all run on one
//! fresh, empty store and do not see each other's entries. A failure panics with what
//! was expected and what came back: this is test code.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::{CacheStore, Entry, Found, Lookup, Partition, Probe, Sealed, Stats, unit};
use crate::budget::period::unix_now;

/// The dimension of the suite's vectors: not a multiple of 64 on purpose.
const DIM: usize = 20;

/// Runs every check on `store`, which must be fresh and empty.
pub async fn check(store: &dyn CacheStore) {
    assert!(store.semantic(), "a store whose semantic() is false runs check_exact_only");
    let now = unix_now();
    exact_hit(store, now).await;
    exact_match_wins_over_a_closer_vector(store, now).await;
    partitions_are_hard(store, now).await;
    semantic_returns_the_best_above_the_threshold(store, now).await;
    semantic_needs_the_same_guard(store, now).await;
    an_entry_without_a_vector_is_no_semantic_candidate(store, now).await;
    another_dimension_is_a_miss(store, now).await;
    expired_entries_are_never_served(store, now).await;
    expired_semantic_entries_are_never_served(store, now).await;
    stored_since_filters(store, now).await;
    store_replaces_the_same_exact_hash(store, now).await;
    eviction_drops_the_tenants_oldest(store, now).await;
    purge_by_tenant_and_policy(store, now).await;
    stats_per_tenant_and_policy(store, now).await;
}

/// Runs every check but the semantic ones on `store` (fresh, empty), whose
/// `semantic()` is false: a probe's vector never finds another exact hash.
pub async fn check_exact_only(store: &dyn CacheStore) {
    assert!(!store.semantic(), "a semantic store runs check");
    let now = unix_now();
    exact_hit(store, now).await;
    partitions_are_hard(store, now).await;
    a_vector_finds_nothing_without_the_exact_hash(store, now).await;
    expired_entries_are_never_served(store, now).await;
    stored_since_filters(store, now).await;
    store_replaces_the_same_exact_hash(store, now).await;
    eviction_drops_the_tenants_oldest(store, now).await;
    purge_by_tenant_and_policy(store, now).await;
    stats_per_tenant_and_policy(store, now).await;
}

/// A partition of `tenant` under `policy` for model `m`, empty context.
fn partition(tenant: &str, policy: &str) -> Partition {
    Partition::new(tenant, None, policy, "m", &[0; 32])
}

fn probe(exact: u8, vector: Option<Vec<f32>>, guard: u64) -> Probe {
    Probe { exact: [exact; 32], vector, guard }
}

/// The unit vector whose cosine with [`axis`] is `cosine` (its other component on a
/// second axis, and a little on every axis past the second, which both share).
fn at(cosine: f32) -> Vec<f32> {
    let mut v = vec![0.0; DIM];
    v[0] = cosine;
    v[1] = (1.0 - cosine * cosine).max(0.0).sqrt();
    v
}

/// The first axis: the suite's probes.
fn axis() -> Vec<f32> {
    unit(at(1.0)).unwrap()
}

/// A recognisable blob of `len` bytes.
fn sealed(tag: u8, len: usize) -> Sealed {
    Sealed((0..len).map(|i| tag ^ i as u8).collect())
}

struct Put<'a> {
    partition: &'a Partition,
    probe: Probe,
    sealed: Sealed,
    stored_at: u64,
    expires_at: u64,
    max: u64,
}

impl<'a> Put<'a> {
    /// An entry stored at `now`, expiring an hour later, with no eviction in sight.
    fn new(partition: &'a Partition, probe: Probe, sealed: Sealed, now: u64) -> Put<'a> {
        Put { partition, probe, sealed, stored_at: now, expires_at: now + 3600, max: u64::MAX }
    }
}

async fn put(store: &dyn CacheStore, put: Put<'_>) {
    let entry = Entry {
        partition: put.partition,
        probe: &put.probe,
        sealed: put.sealed,
        stored_at: put.stored_at,
        expires_at: put.expires_at,
        max_entries_per_tenant: put.max,
    };
    let what = format!("store {:?} in {}/{}", entry.probe.exact[0], put.partition.tenant, put.partition.policy);
    store.store(entry).await.unwrap_or_else(|e| panic!("{what}: {e}"));
}

/// What a lookup of `probe` in `partition` at `now` finds, with a threshold and a
/// max-age floor.
async fn find(
    store: &dyn CacheStore,
    partition: &Partition,
    probe: &Probe,
    threshold: f32,
    stored_since: u64,
    now: u64,
) -> Option<Found> {
    let lookup = Lookup { partition, probe, threshold, stored_since, now };
    store.lookup(&lookup).await.unwrap_or_else(|e| panic!("lookup in {}/{}: {e}", partition.tenant, partition.policy))
}

/// [`find`] with threshold 0.95 and no max-age.
async fn get(store: &dyn CacheStore, partition: &Partition, probe: &Probe, now: u64) -> Option<Found> {
    find(store, partition, probe, 0.95, 0, now).await
}

/// The stats of the tenants whose name starts with `prefix`.
async fn stats_of(store: &dyn CacheStore, prefix: &str) -> Vec<Stats> {
    let all = store.stats().await.unwrap_or_else(|e| panic!("stats: {e}"));
    let mut sorted = all.clone();
    sorted.sort_by(|a, b| (&a.tenant, &a.policy).cmp(&(&b.tenant, &b.policy)));
    assert_eq!(all, sorted, "stats are ordered by tenant, then policy");
    all.into_iter().filter(|s| s.tenant.starts_with(prefix)).collect()
}

fn stats(tenant: &str, policy: &str, entries: u64, bytes: u64) -> Stats {
    Stats { tenant: tenant.to_owned(), policy: policy.to_owned(), entries, bytes }
}

async fn exact_hit(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-exact", "faq");
    put(store, Put { stored_at: now - 5, ..Put::new(&p, probe(1, None, 0), sealed(1, 40), now) }).await;
    let found = get(store, &p, &probe(1, None, 0), now).await;
    assert_eq!(
        found,
        Some(Found { sealed: sealed(1, 40), exact: [1; 32], similarity: 1.0, stored_at: now - 5 }),
        "exact hit"
    );
    assert_eq!(get(store, &p, &probe(2, None, 0), now).await, None, "another exact hash is a miss");

    // An exact match needs neither the vector nor the guard the entry was stored with.
    put(store, Put::new(&p, probe(3, Some(axis()), 7), sealed(3, 41), now)).await;
    let found = get(store, &p, &probe(3, Some(unit(at(0.0)).unwrap()), 9), now).await;
    assert_eq!(
        found,
        Some(Found { sealed: sealed(3, 41), exact: [3; 32], similarity: 1.0, stored_at: now }),
        "exact hit, another vector"
    );
    let found = get(store, &p, &probe(3, None, 7), now).await;
    assert_eq!(found.map(|f| f.sealed), Some(sealed(3, 41)), "exact hit of an entry stored with a vector");
}

async fn exact_match_wins_over_a_closer_vector(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-exact-wins", "faq");
    put(store, Put::new(&p, probe(1, Some(unit(at(0.96)).unwrap()), 0), sealed(1, 10), now)).await;
    put(store, Put::new(&p, probe(2, Some(axis()), 0), sealed(2, 10), now)).await;
    let found = get(store, &p, &probe(1, Some(axis()), 0), now).await;
    assert_eq!(
        found,
        Some(Found { sealed: sealed(1, 10), exact: [1; 32], similarity: 1.0, stored_at: now }),
        "the exact match first"
    );
}

async fn partitions_are_hard(store: &dyn CacheStore, now: u64) {
    let context = [0; 32];
    let base = Partition::new("conf-hard", None, "faq", "m", &context);
    put(store, Put::new(&base, probe(1, Some(axis()), 0), sealed(1, 10), now)).await;
    let same = probe(1, Some(axis()), 0);
    assert!(get(store, &base, &same, now).await.is_some(), "its own partition hits");
    for (what, other) in [
        ("another tenant", Partition::new("conf-hard-other", None, "faq", "m", &context)),
        ("an agent partition", Partition::new("conf-hard", Some("bot"), "faq", "m", &context)),
        ("another policy", Partition::new("conf-hard", None, "faq2", "m", &context)),
        ("another model", Partition::new("conf-hard", None, "faq", "m2", &context)),
        ("another context", Partition::new("conf-hard", None, "faq", "m", &[1; 32])),
    ] {
        assert_eq!(find(store, &other, &same, 0.0, 0, now).await, None, "{what} never hits");
    }
    // And the other way round: an agent's entry is not its tenant's.
    let agent = Partition::new("conf-hard-agent", Some("bot"), "faq", "m", &context);
    put(store, Put::new(&agent, probe(1, Some(axis()), 0), sealed(2, 10), now)).await;
    let tenant = Partition::new("conf-hard-agent", None, "faq", "m", &context);
    assert_eq!(find(store, &tenant, &same, 0.0, 0, now).await, None, "an agent's entry from the tenant");
    let bot2 = Partition::new("conf-hard-agent", Some("bot2"), "faq", "m", &context);
    assert_eq!(find(store, &bot2, &same, 0.0, 0, now).await, None, "an agent's entry from another agent");
}

async fn semantic_returns_the_best_above_the_threshold(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-semantic", "faq");
    for (exact, cosine) in [(1, 0.96), (2, 0.99), (3, 0.97), (4, 0.5), (5, -0.9)] {
        put(store, Put::new(&p, probe(exact, Some(unit(at(cosine)).unwrap()), 3), sealed(exact, 12), now)).await;
    }
    let q = probe(99, Some(axis()), 3);
    let found = get(store, &p, &q, now).await.expect("a semantic hit at 0.99");
    assert_eq!(found.sealed, sealed(2, 12), "the best of those above the threshold");
    assert_eq!(found.exact, [2; 32], "the exact hash it was stored under, not the probe's");
    assert!((found.similarity - 0.99).abs() < 1e-4, "similarity {} (expected 0.99)", found.similarity);
    assert_eq!(found.stored_at, now);
    assert_eq!(find(store, &p, &q, 0.995, 0, now).await, None, "below the threshold is a miss");
    let found = find(store, &p, &q, 0.99, 0, now).await.map(|f| f.sealed);
    assert_eq!(found, Some(sealed(2, 12)), "at the threshold (0.99) is a hit");

    // A closer probe elsewhere: the best is another entry.
    let near = probe(98, Some(unit(at(0.96)).unwrap()), 3);
    let found = get(store, &p, &near, now).await.expect("a semantic hit at 1.0");
    assert_eq!(found.sealed, sealed(1, 12));
    assert!((found.similarity - 1.0).abs() < 1e-4, "similarity {}", found.similarity);
}

async fn semantic_needs_the_same_guard(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-guard", "faq");
    put(store, Put::new(&p, probe(1, Some(axis()), 11), sealed(1, 12), now)).await;
    assert_eq!(get(store, &p, &probe(2, Some(axis()), 12), now).await, None, "another guard at cosine 1.0");
    let found = get(store, &p, &probe(2, Some(axis()), 11), now).await.map(|f| f.sealed);
    assert_eq!(found, Some(sealed(1, 12)), "the same guard hits");

    // The best with the probe's guard, not the best overall.
    put(store, Put::new(&p, probe(3, Some(unit(at(0.97)).unwrap()), 12), sealed(3, 12), now)).await;
    let found = get(store, &p, &probe(2, Some(axis()), 12), now).await.expect("a hit with guard 12");
    assert_eq!(found.sealed, sealed(3, 12));
    assert!((found.similarity - 0.97).abs() < 1e-4, "similarity {}", found.similarity);
}

async fn an_entry_without_a_vector_is_no_semantic_candidate(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-novector", "faq");
    put(store, Put::new(&p, probe(1, None, 0), sealed(1, 12), now)).await;
    let found = find(store, &p, &probe(2, Some(axis()), 0), -1.0, 0, now).await;
    assert_eq!(found, None, "an entry stored without a vector, at threshold -1");
}

async fn another_dimension_is_a_miss(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-dimension", "faq");
    put(store, Put::new(&p, probe(1, Some(axis()), 0), sealed(1, 12), now)).await;
    let mut shorter = axis();
    shorter.truncate(8);
    assert_eq!(find(store, &p, &probe(2, Some(shorter), 0), -1.0, 0, now).await, None, "a shorter vector");
    let mut longer = axis();
    longer.resize(DIM + 70, 0.0);
    assert_eq!(find(store, &p, &probe(2, Some(longer), 0), -1.0, 0, now).await, None, "a longer vector");
    let found = get(store, &p, &probe(1, Some(vec![1.0]), 0), now).await.map(|f| f.sealed);
    assert_eq!(found, Some(sealed(1, 12)), "an exact match whatever the probe's vector");
}

async fn a_vector_finds_nothing_without_the_exact_hash(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-exact-only", "faq");
    put(store, Put::new(&p, probe(1, Some(axis()), 0), sealed(1, 12), now)).await;
    let found = find(store, &p, &probe(2, Some(axis()), 0), -1.0, 0, now).await;
    assert_eq!(found, None, "an exact-only store never matches a vector");
    assert!(get(store, &p, &probe(1, Some(axis()), 0), now).await.is_some(), "its exact hash hits");
}

async fn expired_entries_are_never_served(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-expiry", "faq");
    put(store, Put { expires_at: now + 100, ..Put::new(&p, probe(1, None, 0), sealed(1, 12), now) }).await;
    put(store, Put { expires_at: now - 1, ..Put::new(&p, probe(2, None, 0), sealed(2, 12), now - 50) }).await;
    assert!(get(store, &p, &probe(1, None, 0), now + 99).await.is_some(), "alive one second before its expiry");
    assert_eq!(get(store, &p, &probe(1, None, 0), now + 100).await, None, "expires_at == now is expired");
    assert_eq!(get(store, &p, &probe(2, None, 0), now).await, None, "expired before now");
    let expected = vec![stats("conf-expiry", "faq", 1, 12)];
    assert_eq!(stats_of(store, "conf-expiry").await, expected, "stats count live entries only");
}

async fn expired_semantic_entries_are_never_served(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-expiry-semantic", "faq");
    put(store, Put { expires_at: now, ..Put::new(&p, probe(1, Some(axis()), 0), sealed(1, 12), now - 50) }).await;
    put(store, Put::new(&p, probe(2, Some(unit(at(0.97)).unwrap()), 0), sealed(2, 12), now)).await;
    let found = get(store, &p, &probe(3, Some(axis()), 0), now).await.expect("the live entry at 0.97");
    assert_eq!(found.sealed, sealed(2, 12), "the expired entry at cosine 1.0 is not served");
}

async fn stored_since_filters(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-max-age", "faq");
    put(store, Put { stored_at: now - 100, ..Put::new(&p, probe(1, Some(axis()), 0), sealed(1, 12), now) }).await;
    let exact = probe(1, None, 0);
    assert!(find(store, &p, &exact, 0.95, now - 100, now).await.is_some(), "stored exactly at stored_since");
    assert_eq!(find(store, &p, &exact, 0.95, now - 99, now).await, None, "stored before stored_since");
    if store.semantic() {
        let near = probe(2, Some(axis()), 0);
        assert!(find(store, &p, &near, 0.95, now - 100, now).await.is_some(), "a semantic hit within max-age");
        assert_eq!(find(store, &p, &near, 0.95, now - 99, now).await, None, "a semantic hit past max-age");
    }
}

async fn store_replaces_the_same_exact_hash(store: &dyn CacheStore, now: u64) {
    let p = partition("conf-replace", "faq");
    put(store, Put { stored_at: now - 10, ..Put::new(&p, probe(1, Some(axis()), 0), sealed(1, 30), now) }).await;
    put(store, Put::new(&p, probe(1, Some(axis()), 0), sealed(2, 17), now)).await;
    let found = get(store, &p, &probe(1, None, 0), now).await;
    assert_eq!(
        found,
        Some(Found { sealed: sealed(2, 17), exact: [1; 32], similarity: 1.0, stored_at: now }),
        "the new value"
    );
    if store.semantic() {
        let found = get(store, &p, &probe(9, Some(axis()), 0), now).await.map(|f| f.sealed);
        assert_eq!(found, Some(sealed(2, 17)), "the new value, semantically");
    }
    // The same exact hash in another partition is another entry.
    let q = partition("conf-replace", "other");
    put(store, Put::new(&q, probe(1, None, 0), sealed(3, 5), now)).await;
    let found = get(store, &p, &probe(1, None, 0), now).await.map(|f| f.sealed);
    assert_eq!(found, Some(sealed(2, 17)), "another partition's entry replaced nothing");
    let expected = vec![stats("conf-replace", "faq", 1, 17), stats("conf-replace", "other", 1, 5)];
    assert_eq!(stats_of(store, "conf-replace").await, expected, "one entry left");
}

async fn eviction_drops_the_tenants_oldest(store: &dyn CacheStore, now: u64) {
    let a = partition("conf-evict", "faq");
    let b = Partition::new("conf-evict", None, "faq", "m", &[1; 32]);
    let bystander = partition("conf-evict-bystander", "faq");
    // The bystander's entries are older than all, and kept past any count of theirs.
    for exact in 1..=3 {
        put(store, Put { stored_at: now - 1000, ..Put::new(&bystander, probe(exact, None, 0), sealed(exact, 8), now) })
            .await;
    }
    fn entry(partition: &Partition, exact: u8, stored_at: u64) -> Put<'_> {
        let put = Put::new(partition, probe(exact, None, 0), sealed(exact, 10), stored_at);
        Put { max: 3, ..put }
    }
    put(store, entry(&a, 1, now - 40)).await;
    put(store, entry(&b, 2, now - 10)).await;
    put(store, entry(&a, 3, now - 30)).await;
    let alive =
        async |partition: &Partition, exact: u8| get(store, partition, &probe(exact, None, 0), now).await.is_some();
    assert!(alive(&a, 1).await && alive(&b, 2).await && alive(&a, 3).await, "3 entries of 3 are kept");
    put(store, entry(&b, 4, now - 20)).await;
    assert!(!alive(&a, 1).await, "the oldest (stored 40 s ago) is evicted past 3");
    assert!(alive(&b, 2).await && alive(&a, 3).await && alive(&b, 4).await, "the other 3 stay");
    put(store, entry(&a, 5, now)).await;
    assert!(!alive(&a, 3).await, "then the one stored 30 s ago");
    assert!(alive(&b, 2).await && alive(&b, 4).await && alive(&a, 5).await, "the newest 3 stay");
    for exact in 1..=3 {
        assert!(alive(&bystander, exact).await, "another tenant's entry {exact} is untouched");
    }
    let expected = vec![stats("conf-evict", "faq", 3, 30), stats("conf-evict-bystander", "faq", 3, 24)];
    assert_eq!(stats_of(store, "conf-evict").await, expected);
}

async fn purge_by_tenant_and_policy(store: &dyn CacheStore, now: u64) {
    let a1 = partition("conf-purge-a", "one");
    let a1b = Partition::new("conf-purge-a", None, "one", "m2", &[0; 32]);
    let a2 = partition("conf-purge-a", "two");
    let b1 = partition("conf-purge-b", "one");
    put(store, Put::new(&a1, probe(1, None, 0), sealed(1, 10), now)).await;
    put(store, Put::new(&a1b, probe(2, Some(axis()), 0), sealed(2, 10), now)).await;
    put(store, Put::new(&a2, probe(3, None, 0), sealed(3, 10), now)).await;
    put(store, Put::new(&b1, probe(4, None, 0), sealed(4, 10), now)).await;

    let purged = store.purge("conf-purge-a", Some("one")).await.unwrap_or_else(|e| panic!("purge: {e}"));
    assert_eq!(purged, 2, "conf-purge-a's entries of policy one (two partitions)");
    assert_eq!(get(store, &a1, &probe(1, None, 0), now).await, None);
    assert_eq!(get(store, &a1b, &probe(2, None, 0), now).await, None);
    assert!(get(store, &a2, &probe(3, None, 0), now).await.is_some(), "another policy of the tenant stays");
    assert!(get(store, &b1, &probe(4, None, 0), now).await.is_some(), "another tenant's same policy stays");

    let purged = store.purge("conf-purge-a", None).await.unwrap_or_else(|e| panic!("purge: {e}"));
    assert_eq!(purged, 1, "the rest of conf-purge-a");
    assert_eq!(get(store, &a2, &probe(3, None, 0), now).await, None);
    assert!(get(store, &b1, &probe(4, None, 0), now).await.is_some(), "another tenant stays");
    assert_eq!(store.purge("conf-purge-a", None).await.unwrap_or_else(|e| panic!("purge: {e}")), 0, "nothing left");
    assert_eq!(store.purge("conf-purge-nobody", None).await.unwrap_or_else(|e| panic!("purge: {e}")), 0);
    assert_eq!(stats_of(store, "conf-purge").await, vec![stats("conf-purge-b", "one", 1, 10)]);

    // The purged entry can be stored again.
    put(store, Put::new(&a1, probe(1, None, 0), sealed(5, 3), now)).await;
    let found = get(store, &a1, &probe(1, None, 0), now).await.map(|f| f.sealed);
    assert_eq!(found, Some(sealed(5, 3)));
}

async fn stats_per_tenant_and_policy(store: &dyn CacheStore, now: u64) {
    // Stored out of order: the stats come sorted.
    let zb = partition("conf-stats-z", "b");
    let za = partition("conf-stats-z", "a");
    let za2 = Partition::new("conf-stats-z", Some("bot"), "a", "m", &[0; 32]);
    let ab = partition("conf-stats-a", "b");
    put(store, Put::new(&zb, probe(1, None, 0), sealed(1, 100), now)).await;
    put(store, Put::new(&za, probe(1, None, 0), sealed(2, 7), now)).await;
    put(store, Put::new(&za2, probe(2, Some(axis()), 0), sealed(3, 30), now)).await;
    put(store, Put::new(&ab, probe(1, None, 0), sealed(4, 1), now)).await;
    put(store, Put { expires_at: now - 1, ..Put::new(&ab, probe(2, None, 0), sealed(5, 50), now - 10) }).await;
    let expected =
        vec![stats("conf-stats-a", "b", 1, 1), stats("conf-stats-z", "a", 2, 37), stats("conf-stats-z", "b", 1, 100)];
    assert_eq!(stats_of(store, "conf-stats").await, expected, "per (tenant, policy), live entries only");
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use async_trait::async_trait;

    use super::super::{StoreError, cosine};
    use super::*;

    /// The port's rules written as plainly as possible: the suite's own check (a store
    /// that does what the port says passes it).
    #[derive(Default)]
    struct Naive {
        entries: Mutex<Vec<Kept>>,
        semantic: bool,
    }

    struct Kept {
        partition: Partition,
        probe: Probe,
        sealed: Sealed,
        stored_at: u64,
        expires_at: u64,
    }

    impl Kept {
        fn found(&self, similarity: f32) -> Found {
            Found { sealed: self.sealed.clone(), exact: self.probe.exact, similarity, stored_at: self.stored_at }
        }
    }

    #[async_trait]
    impl CacheStore for Naive {
        async fn lookup(&self, lookup: &Lookup<'_>) -> Result<Option<Found>, StoreError> {
            let entries = self.entries.lock().unwrap();
            let alive = entries.iter().filter(|e| {
                e.partition.id == lookup.partition.id && e.expires_at > lookup.now && e.stored_at >= lookup.stored_since
            });
            if let Some(e) = alive.clone().find(|e| e.probe.exact == lookup.probe.exact) {
                return Ok(Some(e.found(1.0)));
            }
            let (Some(q), true) = (&lookup.probe.vector, self.semantic) else { return Ok(None) };
            let best = alive
                .filter(|e| e.probe.guard == lookup.probe.guard)
                .filter_map(|e| Some((e, e.probe.vector.as_ref().filter(|v| v.len() == q.len())?)))
                .map(|(e, v)| (e, cosine(q, v)))
                .filter(|(_, similarity)| *similarity >= lookup.threshold)
                .max_by(|a, b| a.1.total_cmp(&b.1));
            Ok(best.map(|(e, similarity)| e.found(similarity)))
        }

        async fn store(&self, entry: Entry<'_>) -> Result<(), StoreError> {
            let mut entries = self.entries.lock().unwrap();
            entries.retain(|e| (e.partition.id, e.probe.exact) != (entry.partition.id, entry.probe.exact));
            let tenant = entry.partition.tenant.clone();
            entries.push(Kept {
                partition: entry.partition.clone(),
                probe: entry.probe.clone(),
                sealed: entry.sealed,
                stored_at: entry.stored_at,
                expires_at: entry.expires_at,
            });
            let of_tenant = |e: &&Kept| e.partition.tenant == tenant;
            while entries.iter().filter(of_tenant).count() as u64 > entry.max_entries_per_tenant {
                let oldest = entries.iter().enumerate().filter(|(_, e)| of_tenant(e)).min_by_key(|(_, e)| e.stored_at);
                let index = oldest.unwrap().0;
                entries.remove(index);
            }
            Ok(())
        }

        async fn purge(&self, tenant: &str, policy: Option<&str>) -> Result<u64, StoreError> {
            let mut entries = self.entries.lock().unwrap();
            let before = entries.len();
            entries.retain(|e| e.partition.tenant != tenant || policy.is_some_and(|p| e.partition.policy != p));
            Ok((before - entries.len()) as u64)
        }

        async fn stats(&self) -> Result<Vec<Stats>, StoreError> {
            let now = unix_now();
            let mut by: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
            for e in self.entries.lock().unwrap().iter().filter(|e| e.expires_at > now) {
                let slot = by.entry((e.partition.tenant.clone(), e.partition.policy.clone())).or_default();
                *slot = (slot.0 + 1, slot.1 + e.sealed.0.len() as u64);
            }
            Ok(by
                .into_iter()
                .map(|((tenant, policy), (entries, bytes))| Stats { tenant, policy, entries, bytes })
                .collect())
        }

        fn semantic(&self) -> bool {
            self.semantic
        }
    }

    #[tokio::test]
    async fn a_store_that_follows_the_port_passes() {
        check(&Naive { semantic: true, ..Naive::default() }).await;
        check_exact_only(&Naive::default()).await;
    }
}
