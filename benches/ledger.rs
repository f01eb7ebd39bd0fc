//! What a durable ledger costs: reserve+settle throughput and latency, memory store
//! against the embedded (journal fsync, redb checkpoints) store, in each of its
//! `sync` modes (`interval`, the default: the journal synced every few ms off the
//! calls' path; `reservation`: a reservation answered after its line's fsync).
//!
//! `cargo bench --bench ledger` — for each store, 1 and 64 concurrent tasks each loop
//! reserve then settle (each timed) on the same tenant's counters for
//! `LEDGER_BENCH_SECS` (default 3) seconds. Prints pairs/s, reserve and settle
//! p50/p99, and for the embedded store how many operations each fsync carried
//! (`embedded`: `sync: interval`; `emb/resv`: `sync: reservation`).
//!
//! Figures are printed, never asserted: the machine's disk and load decide them.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use flexway::budget::{BudgetStore, CounterKey, EmbeddedBudgetStore, Line, MemoryBudgetStore, ReserveRequest};
use flexway::config::LedgerSync;

const NOW: u64 = 1_795_967_070;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

struct Row {
    store: &'static str,
    tasks: usize,
    pairs: u64,
    elapsed: Duration,
    reserve: Vec<Duration>,
    settle: Vec<Duration>,
    commits: Option<u64>,
}

async fn run() {
    let secs = env_or("LEDGER_BENCH_SECS", 3);
    let duration = Duration::from_secs(secs);
    let dir = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    for tasks in [1, 64] {
        rows.push(measure("memory", Arc::new(MemoryBudgetStore::new()), None, tasks, duration).await);
        for (name, sync) in [("embedded", LedgerSync::Interval), ("emb/resv", LedgerSync::Reservation)] {
            let path = dir.path().join(format!("ledger-{name}-{tasks}").replace('/', "-"));
            let store = Arc::new(EmbeddedBudgetStore::open_with(&path, sync).unwrap());
            rows.push(measure(name, store.clone(), Some(store), tasks, duration).await);
        }
    }

    println!("ledger: reserve+settle pairs, {secs} s per row, temp dir {}", dir.path().display());
    println!(
        "{:<9} {:>5} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>14}",
        "store", "tasks", "pairs/s", "ops/s", "reserve p50", "reserve p99", "settle p50", "settle p99", "ops per fsync"
    );
    for row in &rows {
        let rate = row.pairs as f64 / row.elapsed.as_secs_f64();
        let per_commit =
            row.commits.map_or_else(|| "-".to_owned(), |c| format!("{:.1}", (2 * row.pairs) as f64 / c.max(1) as f64));
        println!(
            "{:<9} {:>5} {:>12.0} {:>12.0} {:>12} {:>12} {:>12} {:>12} {:>14}",
            row.store,
            row.tasks,
            rate,
            2.0 * rate,
            micros(percentile(&row.reserve, 0.50)),
            micros(percentile(&row.reserve, 0.99)),
            micros(percentile(&row.settle, 0.50)),
            micros(percentile(&row.settle, 0.99)),
            per_commit
        );
    }
}

/// `tasks` loops of reserve + settle, each timed, until `duration` has passed.
async fn measure(
    name: &'static str,
    store: Arc<dyn BudgetStore>,
    embedded: Option<Arc<EmbeddedBudgetStore>>,
    tasks: usize,
    duration: Duration,
) -> Row {
    let commits_before = embedded.as_ref().map(|s| s.syncs());
    let start = Instant::now();
    let deadline = start + duration;
    let workers: Vec<_> = (0..tasks)
        .map(|task| {
            let store = store.clone();
            tokio::spawn(async move {
                let (mut reserves, mut settles) = (Vec::new(), Vec::new());
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let request = request(task, n);
                    let sent = Instant::now();
                    store.reserve(&request).await.unwrap();
                    reserves.push(sent.elapsed());
                    let actual: Vec<(CounterKey, u64)> =
                        request.lines.iter().map(|l| (l.key.clone(), l.amount / 3)).collect();
                    let sent = Instant::now();
                    store.settle(&request.reservation(), &actual).await.unwrap();
                    settles.push(sent.elapsed());
                    n += 1;
                }
                (reserves, settles)
            })
        })
        .collect();
    let (mut reserve, mut settle) = (Vec::new(), Vec::new());
    for worker in workers {
        let (reserves, settles) = worker.await.unwrap();
        reserve.extend(reserves);
        settle.extend(settles);
    }
    let elapsed = start.elapsed();
    reserve.sort_unstable();
    settle.sort_unstable();
    let commits = embedded.as_ref().zip(commits_before).map(|(s, before)| s.syncs() - before);
    Row { store: name, tasks, pairs: reserve.len() as u64, elapsed, reserve, settle, commits }
}

/// What admission reserves for one call: tenant and agent, tokens per day and month,
/// micro-euros per month, under limits that never refuse here.
fn request(task: usize, n: u64) -> ReserveRequest {
    let key = |s: &str| CounterKey(format!("bench/{s}").into());
    let line = |k: &str, amount: u64| Line { key: key(k), amount, limit: Some(u64::MAX / 2) };
    ReserveRequest {
        request_id: format!("bench-{task}-{n}"),
        lines: vec![
            line("*/tokens/day/2026-11-29", 4_096),
            line("*/tokens/month/2026-11", 4_096),
            line("*/eur/month/2026-11", 12_288),
            line("bot/tokens/day/2026-11-29", 4_096),
            line("bot/eur/month/2026-11", 12_288),
        ],
        expires_at: NOW + 600,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn micros(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}
