//! The response cache (SPEC §16): what a store keeps, how an entry is sealed, and the
//! port every store implements ([`CacheStore`]: embedded here, PostgreSQL and
//! DynamoDB in their adapters). The driver looks an answer up after admission and
//! stores one at the call's end (`http/cache.rs`); a store only ever sees sealed
//! bytes, hashes, a vector and a tenant's name.
//!
//! Invariants: an entry is served only within its hard partition (tenant or agent,
//! policy, requested model, everything in the request but its last user message),
//! which the [`Partition`] hash covers and the sealing binds (the partition and the
//! exact hash are the AEAD's associated data: an entry moved to another partition
//! fails to open). A semantic hit also needs the same [`guard`] (numbers and
//! negations) as the message it answers. A store that fails is a miss, never an error.

pub mod guard;
pub mod seal;

pub mod embedded;

#[cfg(any(test, feature = "test-support"))]
pub mod conformance;

use async_trait::async_trait;
use sha2::{Digest, Sha256};

pub use seal::{Keys, Sealed};

/// A hard partition: entries are only ever compared within one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The tenant whose entries these are (purge, stats and eviction go by it).
    pub tenant: String,
    /// The policy they are kept under (purge and stats go by it too).
    pub policy: String,
    /// SHA-256 of tenant, agent (scope `agent`), policy, requested model and the
    /// request's context hash.
    pub id: [u8; 32],
}

impl Partition {
    /// The partition of a call of `tenant` (and `agent`, for a policy scoped to
    /// agents) under `policy`, asking for `model`, whose request but its last user
    /// message hashes to `context`.
    pub fn new(tenant: &str, agent: Option<&str>, policy: &str, model: &str, context: &[u8; 32]) -> Partition {
        let mut hash = Sha256::new();
        for part in [tenant, agent.unwrap_or(""), policy, model] {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part.as_bytes());
        }
        hash.update([u8::from(agent.is_some())]);
        hash.update(context);
        Partition { tenant: tenant.to_owned(), policy: policy.to_owned(), id: hash.finalize().into() }
    }
}

/// What a lookup asks of a partition.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    /// SHA-256 of the last user message (the request's whole key, for an exact
    /// policy's embeddings or REST call).
    pub exact: [u8; 32],
    /// The message's embedding, unit length (semantic policies); `None`: exact only.
    pub vector: Option<Vec<f32>>,
    /// The fingerprint of the message's numbers and negations ([`guard::of`]): a
    /// semantic hit needs the same.
    pub guard: u64,
}

/// A lookup: the best entry of `partition` for `probe`, alive at `now`.
#[derive(Debug, Clone)]
pub struct Lookup<'a> {
    pub partition: &'a Partition,
    pub probe: &'a Probe,
    /// The least cosine similarity a semantic match needs.
    pub threshold: f32,
    /// Only entries stored at or after this (`Cache-Control: max-age`), Unix seconds.
    pub stored_since: u64,
    /// Unix seconds: entries expired by then are never served.
    pub now: u64,
}

/// An entry as a lookup finds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    pub sealed: Sealed,
    /// The exact hash the entry was stored under (the probe's own for an exact match,
    /// the stored message's for a semantic one): it opens the sealed bytes.
    pub exact: [u8; 32],
    /// 1.0 for an exact match; the cosine of the two embeddings otherwise.
    pub similarity: f32,
    pub stored_at: u64,
}

/// An entry to keep.
#[derive(Debug, Clone)]
pub struct Entry<'a> {
    pub partition: &'a Partition,
    pub probe: &'a Probe,
    pub sealed: Sealed,
    pub stored_at: u64,
    pub expires_at: u64,
    /// The most entries its tenant keeps in this store: the oldest go first past it.
    pub max_entries_per_tenant: u64,
}

/// A tenant's entries of one policy in a store.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub tenant: String,
    pub policy: String,
    pub entries: u64,
    /// What its sealed entries weigh (vectors not counted).
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached, read or written (counted, served as a miss).
    #[error("cache store unavailable: {0}")]
    Unavailable(String),
    /// What the store holds cannot be read back.
    #[error("cache store corrupt: {0}")]
    Corrupt(String),
}

/// Where entries are kept. Every method is one round trip at most; none ever returns
/// another tenant's entry.
#[async_trait]
pub trait CacheStore: Send + Sync {
    /// The entry of `lookup.partition` that answers `lookup.probe`: the one whose
    /// exact hash is the probe's, else (with a vector) the most similar at or above
    /// the threshold with the same guard; never an expired one.
    async fn lookup(&self, lookup: &Lookup<'_>) -> Result<Option<Found>, StoreError>;

    /// Keeps `entry` (replacing one of the same partition and exact hash), evicting
    /// its tenant's oldest past `entry.max_entries_per_tenant`.
    async fn store(&self, entry: Entry<'_>) -> Result<(), StoreError>;

    /// Drops every entry of `tenant` (of `policy` only, if given); how many there were.
    async fn purge(&self, tenant: &str, policy: Option<&str>) -> Result<u64, StoreError>;

    /// The live entries of each tenant and policy, ordered by tenant then policy.
    async fn stats(&self) -> Result<Vec<Stats>, StoreError>;

    /// Whether it compares embeddings (`false`: exact policies only).
    fn semantic(&self) -> bool {
        true
    }
}

/// How long a lookup or a store may take before it counts as a failing store.
pub const STORE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// After a store fails, how long calls pass it by (each a miss, counted) before one
/// tries it again: a store down costs its calls nothing, not a timeout each.
pub const STORE_BACKOFF_SECS: u64 = 5;

/// The response cache of a gateway: its store, the tenants' keys, and whether the
/// store failed lately.
pub struct ResponseCache {
    pub store: std::sync::Arc<dyn CacheStore>,
    keys: Keys,
    /// Unix seconds until which the store is passed by (it failed last).
    failing_until: std::sync::atomic::AtomicU64,
}

impl ResponseCache {
    pub fn new(store: std::sync::Arc<dyn CacheStore>, master_key: &[u8]) -> ResponseCache {
        ResponseCache { store, keys: Keys::new(master_key), failing_until: Default::default() }
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// `operation` on the store, bounded by [`STORE_TIMEOUT`]; `Err(operation)` when it
    /// fails, times out, or the store failed within the last [`STORE_BACKOFF_SECS`].
    pub async fn call<T>(
        &self,
        operation: &'static str,
        future: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, &'static str> {
        use std::sync::atomic::Ordering;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if now < self.failing_until.load(Ordering::Relaxed) {
            return Err(operation);
        }
        let failed = match tokio::time::timeout(STORE_TIMEOUT, future).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {STORE_TIMEOUT:?}"),
        };
        tracing::warn!("response cache: {operation}: {failed}; misses for {STORE_BACKOFF_SECS} s");
        self.failing_until.store(now + STORE_BACKOFF_SECS, Ordering::Relaxed);
        Err(operation)
    }
}

/// A store that could not be opened (unreachable, unwritable, corrupt: SPEC §16): the
/// gateway starts anyway, and every lookup and store fails with the reason, counted
/// and served as a miss.
pub struct Failed(pub String);

#[async_trait]
impl CacheStore for Failed {
    async fn lookup(&self, _: &Lookup<'_>) -> Result<Option<Found>, StoreError> {
        Err(StoreError::Unavailable(self.0.clone()))
    }

    async fn store(&self, _: Entry<'_>) -> Result<(), StoreError> {
        Err(StoreError::Unavailable(self.0.clone()))
    }

    async fn purge(&self, _: &str, _: Option<&str>) -> Result<u64, StoreError> {
        Err(StoreError::Unavailable(self.0.clone()))
    }

    async fn stats(&self) -> Result<Vec<Stats>, StoreError> {
        Err(StoreError::Unavailable(self.0.clone()))
    }
}

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// `vector` scaled to unit length; `None` for an empty or zero vector, or one with a
/// value that is not finite.
pub fn unit(mut vector: Vec<f32>) -> Option<Vec<f32>> {
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if vector.is_empty() || !norm.is_finite() || norm == 0.0 {
        return None;
    }
    vector.iter_mut().for_each(|x| *x /= norm);
    Some(vector)
}

/// The cosine of two unit vectors of one length (16 accumulators, so it vectorises
/// without fast-math).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (mut x, mut y) = (a.chunks_exact(16), b.chunks_exact(16));
    for (x, y) in (&mut x).zip(&mut y) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let rest: f32 = x.remainder().iter().zip(y.remainder()).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + rest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_of_a_partition_changes_it() {
        let context = [7; 32];
        let base = Partition::new("acme", None, "faq", "m", &context);
        for other in [
            Partition::new("initech", None, "faq", "m", &context),
            Partition::new("acme", Some("bot"), "faq", "m", &context),
            Partition::new("acme", None, "other", "m", &context),
            Partition::new("acme", None, "faq", "m2", &context),
            Partition::new("acme", None, "faq", "m", &[8; 32]),
            // Lengths are framed: "ac" + "mefaq" is not "acme" + "faq".
            Partition::new("ac", None, "mefaq", "m", &context),
        ] {
            assert_ne!(base.id, other.id, "{other:?}");
        }
        assert_eq!(base, Partition::new("acme", None, "faq", "m", &context));
    }

    #[test]
    fn a_unit_vector_has_length_one_and_its_cosine_with_itself_is_one() {
        let v = unit((0..37).map(|i| i as f32 - 11.0).collect()).unwrap();
        assert!((cosine(&v, &v) - 1.0).abs() < 1e-5);
        let w = unit((0..37).map(|i| if i == 3 { 1.0 } else { 0.0 }).collect()).unwrap();
        assert!((cosine(&v, &w) - v[3]).abs() < 1e-6);
        assert_eq!(unit(vec![0.0; 4]), None);
        assert_eq!(unit(vec![f32::NAN, 1.0]), None);
    }
}
