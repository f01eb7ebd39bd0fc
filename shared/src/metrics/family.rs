//! What the registry's families hold: series keyed by their label values, found
//! without allocating once they exist, and fixed-bucket histograms whose buckets are
//! counted without a lock.

use std::hash::BuildHasher as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use foldhash::HashMap;

/// Series of one family, keyed by their label values. The map is keyed by a hash of
/// the values so that finding an existing series needs no allocation.
pub(super) struct Family<V> {
    hasher: foldhash::fast::RandomState,
    series: Mutex<HashMap<u64, Vec<Series<V>>>>,
}

/// A series: its label values (in the family's label order) and its value.
pub(super) type Series<V> = (Box<[String]>, V);

impl<V> Family<V> {
    pub(super) fn new() -> Self {
        Family { hasher: Default::default(), series: Default::default() }
    }

    pub(super) fn with<R>(&self, labels: &[&str], make: impl FnOnce() -> V, update: impl FnOnce(&mut V) -> R) -> R {
        let hash = self.hasher.hash_one(labels);
        let mut series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        let bucket = series.entry(hash).or_default();
        let same = |key: &[String]| key.len() == labels.len() && key.iter().zip(labels).all(|(k, l)| k == l);
        if let Some((_, value)) = bucket.iter_mut().find(|(key, _)| same(key)) {
            return update(value);
        }
        let mut value = make();
        let result = update(&mut value);
        bucket.push((labels.iter().map(|l| (*l).to_owned()).collect(), value));
        result
    }

    /// Every series, sorted by label values, read with `read` under the lock.
    pub(super) fn snapshot<T>(&self, read: impl Fn(&V) -> T) -> Vec<Series<T>> {
        let series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<_> = series.values().flatten().map(|(key, value)| (key.clone(), read(value))).collect();
        drop(series);
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}

/// A fixed-bucket histogram of integer observations (nanoseconds, tokens).
pub(super) struct Histogram {
    bounds: &'static [i64],
    /// Per bucket, not cumulative; the last one is `+Inf`.
    counts: Box<[AtomicU64]>,
    sum: AtomicI64,
}

pub(super) struct HistogramSnapshot {
    pub(super) bounds: &'static [i64],
    /// Cumulative, the last one (`+Inf`) being the count.
    pub(super) cumulative: Vec<u64>,
    pub(super) sum: i64,
}

impl Histogram {
    pub(super) fn new(bounds: &'static [i64]) -> Self {
        Histogram { bounds, counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(), sum: AtomicI64::new(0) }
    }

    pub(super) fn observe(&self, value: i64) {
        // The first bucket whose bound is >= value (`le` is inclusive).
        let index = self.bounds.partition_point(|bound| *bound < value);
        if let Some(count) = self.counts.get(index) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        self.sum.fetch_add(value, Ordering::Relaxed);
    }

    pub(super) fn snapshot(&self) -> HistogramSnapshot {
        let mut running = 0_u64;
        let cumulative = self
            .counts
            .iter()
            .map(|count| {
                running = running.saturating_add(count.load(Ordering::Relaxed));
                running
            })
            .collect();
        HistogramSnapshot { bounds: self.bounds, cumulative, sum: self.sum.load(Ordering::Relaxed) }
    }
}
