//! What a lookup in the embedded cache store costs at 100,000 entries of one partition
//! (SPEC §16: an exact hit far under 300 µs, a semantic lookup within 1 ms at p99).
//!
//! `cargo bench --bench cache` — fills one partition with `CACHE_BENCH_ENTRIES`
//! (default 100,000) entries of 256-dimension unit vectors of low rank (a 32-dimension
//! Gaussian latent projected to 256, plus noise: closer to sentence embeddings than
//! i.i.d. vectors) and 512 sealed bytes each, then times 2,000 lookups of each kind
//! after 200 of warm-up: an exact hit, a semantic hit (a stored vector plus noise,
//! cosine ≈ 0.97 to it) and a semantic miss (a fresh vector of the same distribution).
//! Prints p50/p99, how many semantic hits found their entry, the file's size and how
//! long opening (replaying) it takes.
//!
//! Figures are printed, never asserted: the machine and its load decide them.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use flexway::cache::embedded::EmbeddedCacheStore;
use flexway::cache::{CacheStore, Entry, Lookup, Partition, Probe, Sealed, cosine, sha256, unit};

const DIM: usize = 256;
const LATENT: usize = 32;
/// The noise added to each coordinate of a projected latent.
const NOISE: f32 = 0.5;
/// The noise that takes a stored vector to a cosine of about 0.97 with it:
/// `1 / sqrt(1 + DIM σ²) ≈ 0.97`.
const NEAR: f32 = 0.0157;
const QUERIES: usize = 2000;
const WARM_UP: usize = 200;
const THRESHOLD: f32 = 0.95;

/// SplitMix64, with Gaussian draws (Box-Muller): the bench needs no crate and is
/// the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }

    fn gaussian(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}

/// Unit vectors of rank `LATENT` plus noise.
struct Data {
    rng: Rng,
    projection: Vec<f32>,
}

impl Data {
    fn new(seed: u64) -> Data {
        let mut rng = Rng(seed);
        let scale = 1.0 / (LATENT as f32).sqrt();
        let projection = (0..DIM * LATENT).map(|_| rng.gaussian() * scale).collect();
        Data { rng, projection }
    }

    fn vector(&mut self) -> Vec<f32> {
        let latent: Vec<f32> = (0..LATENT).map(|_| self.rng.gaussian()).collect();
        let v = self
            .projection
            .chunks_exact(LATENT)
            .map(|row| row.iter().zip(&latent).map(|(p, z)| p * z).sum::<f32>() + NOISE * self.rng.gaussian())
            .collect();
        unit(v).unwrap()
    }

    fn near(&mut self, v: &[f32]) -> Vec<f32> {
        unit(v.iter().map(|x| x + NEAR * self.rng.gaussian()).collect()).unwrap()
    }
}

fn exact(i: usize) -> [u8; 32] {
    sha256(&(i as u64).to_le_bytes())
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn micros(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn run() {
    let entries = env_or("CACHE_BENCH_ENTRIES", 100_000);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache");
    let partition = Partition::new("acme", None, "faq", "m", &[0; 32]);
    let now = flexway::budget::period::unix_now();
    let mut data = Data::new(53);
    let mut rng = Rng(7);

    let store = EmbeddedCacheStore::open(&path).unwrap();
    let mut stored = Vec::with_capacity(entries);
    let fill = Instant::now();
    for i in 0..entries {
        let vector = data.vector();
        let probe = Probe { exact: exact(i), vector: Some(vector), guard: 0 };
        let sealed = Sealed((0..512).map(|_| rng.next() as u8).collect());
        let entry = Entry {
            partition: &partition,
            probe: &probe,
            sealed,
            stored_at: now,
            expires_at: now + 86_400,
            max_entries_per_tenant: u64::MAX,
        };
        store.store(entry).await.unwrap();
        stored.push(probe.vector.unwrap_or_default());
    }
    let fill = fill.elapsed();

    let mut picks = Rng(11);
    let mut pick = || (picks.next() % entries as u64) as usize;
    let exact_probes: Vec<(usize, Probe)> = (0..WARM_UP + QUERIES)
        .map(|_| pick())
        .map(|i| (i, Probe { exact: exact(i), vector: None, guard: 0 }))
        .collect();
    let near_probes: Vec<(usize, Probe)> = (0..WARM_UP + QUERIES)
        .map(|_| pick())
        .map(|i| (i, Probe { exact: [0xff; 32], vector: Some(data.near(&stored[i])), guard: 0 }))
        .collect();
    let far_probes: Vec<(usize, Probe)> = (0..WARM_UP + QUERIES)
        .map(|_| (0, Probe { exact: [0xfe; 32], vector: Some(data.vector()), guard: 0 }))
        .collect();
    let near_cosine =
        near_probes.iter().map(|(i, p)| cosine(&stored[*i], p.vector.as_deref().unwrap_or(&[]))).sum::<f32>()
            / near_probes.len() as f32;
    // How close an unrelated query comes (by brute force, on a few): how hard a miss is.
    let far_best = far_probes[..20]
        .iter()
        .map(|(_, p)| {
            let q = p.vector.as_deref().unwrap_or(&[]);
            stored.iter().map(|v| cosine(q, v)).fold(f32::MIN, f32::max)
        })
        .sum::<f32>()
        / 20.0;

    let mut rows = Vec::new();
    for (what, probes, expect_found) in [
        ("exact hit", &exact_probes, true),
        ("semantic hit", &near_probes, true),
        ("semantic miss", &far_probes, false),
    ] {
        let mut times = Vec::with_capacity(QUERIES);
        let mut right = 0;
        for (n, (i, probe)) in probes.iter().enumerate() {
            let lookup = Lookup { partition: &partition, probe, threshold: THRESHOLD, stored_since: 0, now };
            let start = Instant::now();
            let found = store.lookup(&lookup).await.unwrap();
            let took = start.elapsed();
            if n >= WARM_UP {
                times.push(took);
                let ok = match found {
                    Some(found) => expect_found && found.exact == exact(*i),
                    None => !expect_found,
                };
                right += usize::from(ok);
            }
        }
        times.sort();
        rows.push((what, percentile(&times, 0.5), percentile(&times, 0.9), percentile(&times, 0.99), right));
    }
    drop(store);

    let size = std::fs::metadata(&path).unwrap().len();
    let mut opens = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        let store = EmbeddedCacheStore::open(&path).unwrap();
        opens.push(start.elapsed());
        drop(store);
    }
    opens.sort();

    // Other work on the machine shows in the tail: say how busy it was.
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    println!("load average {} on {cpus} CPUs", load.split(' ').take(3).collect::<Vec<_>>().join(" "));
    println!(
        "cache: embedded store, one partition of {entries} entries, {DIM} dims (rank {LATENT} + noise), 512 B sealed"
    );
    println!("fill: {:.2} s ({:.1} µs a store)", fill.as_secs_f64(), fill.as_secs_f64() * 1e6 / entries as f64);
    println!(
        "semantic hit queries: mean cosine {near_cosine:.3} to their entry; miss queries: mean best cosine {far_best:.3}"
    );
    println!("{:<14} {:>12} {:>12} {:>12} {:>12}", "lookup", "p50", "p90", "p99", "right");
    for (what, p50, p90, p99, right) in rows {
        let right = format!("{right}/{QUERIES}");
        println!("{what:<14} {:>12} {:>12} {:>12} {right:>12}", micros(p50), micros(p90), micros(p99));
    }
    println!(
        "file: {:.1} MiB; open (replay): {:.0} ms (median of 3)",
        size as f64 / (1 << 20) as f64,
        opens[1].as_secs_f64() * 1e3
    );
}
