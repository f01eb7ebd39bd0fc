//! The reconcile function at scale: a month of audit folded as FilterLogEvents hands
//! it over, page by page.
//!
//! `cargo bench --bench reconcile` — a month (November 2026, 30 UTC days) of
//! `BENCH_RECORDS` audit records (default 3,000,000: 50 tenants, 4 backends, 2
//! models each, chained, one in 50 a refusal), each line the real serializer's
//! (`serde_json::to_string(&AuditRecord)`, as `CloudWatchAuditSink` puts it), in
//! pages of `BENCH_PAGE_EVENTS` events (default 10,000, FilterLogEvents' most).
//! Two measures, one after the other:
//!
//! - parse+fold: each line parsed (`parse_record`) and added to the reconciliation's
//!   `GatewayUsage`, a page at a time: the CPU of the fold alone;
//! - the function's read: a fake FilterLogEvents endpoint on loopback answers the
//!   pages, and `flexway_aws::fold_audit` (what the reconcile function runs) reads
//!   them through the AWS SDK's client: its HTTP stack, its parsing of the response,
//!   then the same parse+fold. `BENCH_HOLD=1` reads them with the report's reader
//!   instead (`read_audit_log_group`: every record held, sorted) and reconciles the
//!   whole: the memory the fold saves.
//!
//! Lines and pages are made as they are needed, outside the measured time (the
//! endpoint times its own work, taken off). Prints records per minute and the
//! process's peak RSS (`VmHWM`, the fake endpoint's page buffers included), the
//! bytes of a page, and what pages of at most 1 MiB (FilterLogEvents' other limit)
//! would number, times `BENCH_RTT_MS` (default 300) a round trip.
//!
//! Figures are printed, never asserted: the machine's load decides them.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aws_config::Region;
use aws_sdk_cloudwatchlogs::config::Credentials;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::routing::post;
use flexway::audit::report::{Filter, Unreadables, parse_record};
use flexway::audit::{AuditRecord, BudgetState, ErrorCode, PickReason, Timestamp, sample};
use flexway::config::Metering;
use flexway::reconcile::{GatewayUsage, ProviderUsage};

const DAYS: u64 = 30;
const DAY_MS: u64 = 86_400_000;
const BACKENDS: [(&str, [&str; 2]); 4] = [
    ("openai", ["gpt-4o-2024-08-06", "gpt-4o-mini-2024-07-18"]),
    ("anthropic", ["claude-sonnet-4-5", "claude-haiku-4-5"]),
    ("azure-openai", ["gpt-4o", "o3-mini"]),
    ("mistral", ["mistral-large-2411", "mistral-small-2503"]),
];

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// splitmix64: the same record for the same number, run after run.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn hex64(seed: u64) -> String {
    (0..4).fold(String::with_capacity(64), |mut out, i| {
        let _ = write!(out, "{:016x}", mix(seed ^ i));
        out
    })
}

/// Record `seq` of `total`, spread evenly over the month, as the gateway writes it.
fn record(seq: u64, total: u64, month_ms: i64) -> (i64, AuditRecord) {
    let h = mix(seq);
    let offset = seq * (DAYS * DAY_MS) / total;
    let ts = month_ms + i64::try_from(offset).unwrap();
    let (backend, models) = BACKENDS[(h % 4) as usize];
    let refused = h.is_multiple_of(50);
    let prompt = if refused { 0 } else { 200 + (h >> 16) % 4_000 };
    let completion = if refused { 0 } else { 20 + (h >> 28) % 800 };
    let cost = prompt * 2 + completion * 8;
    let agent = (h >> 24) % 4;
    let record = AuditRecord {
        ts: Timestamp::from_unix_millis(ts).unwrap(),
        request_id: format!("req_{:016x}{:016x}", mix(h), mix(h ^ 1)),
        agent: (agent > 0).then(|| format!("agent-{agent}")),
        model_requested: Some(models[((h >> 8) % 2) as usize].into()),
        model_served: (!refused).then(|| models[((h >> 8) % 2) as usize].into()),
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: ((h >> 40).is_multiple_of(4) && !refused).then_some(prompt / 2),
        status: if refused { 429 } else { 200 },
        error_code: refused.then_some(ErrorCode::BudgetExceeded),
        budget_state: if refused { BudgetState::Exceeded } else { BudgetState::Ok },
        latency_ms: 300 + (h >> 12) % 9_000,
        ttfb_ms: (!refused).then_some(80 + (h >> 20) % 900),
        key_hash: hex64(h >> 50),
        user_hash: (h >> 44).is_multiple_of(2).then(|| hex64(h >> 36)),
        pick_reason: (h >> 48).is_multiple_of(3).then_some(PickReason::Weighted),
        period: Some(format!("2026-11-{:02}", 1 + offset / DAY_MS)),
        chain: Some(format!("{:016x}:{}:{}", mix(seq % 64), seq / 64, hex64(h))),
        ..sample::record(&format!("tenant-{:02}", (h >> 32) % 50), Some(backend), Metering::Local, cost)
    };
    (ts, record)
}

fn status(field: &str) -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap_or("?: ?");
    line.split_whitespace().skip(1).collect::<Vec<_>>().join(" ")
}

fn per_minute(records: u64, elapsed: Duration) -> String {
    let per_minute = records as f64 / elapsed.as_secs_f64() * 60.0;
    format!("{:.1} M records/min", per_minute / 1e6)
}

fn month() -> (Filter, i64, ProviderUsage) {
    let filter = Filter::new(Some("2026-11-01".into()), Some("2026-11-30".into())).unwrap();
    let month_ms = filter.unix_millis().0.unwrap();
    let provider =
        ProviderUsage { backends: BACKENDS.iter().map(|(b, _)| (*b).to_owned()).collect(), ..Default::default() };
    (filter, month_ms, provider)
}

fn main() {
    let total = env_or("BENCH_RECORDS", 3_000_000);
    let page_events = env_or("BENCH_PAGE_EVENTS", 10_000).max(1);
    let hold = env_or("BENCH_HOLD", 0) == 1;
    let pages = total.div_ceil(page_events);
    println!("{total} records over {DAYS} days, {pages} pages of {page_events}; peak RSS before: {}", status("VmHWM"));
    if !hold {
        fold_alone(total, page_events);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(read(total, page_events, hold));
}

/// Each page's lines made, then parsed and folded (timed).
fn fold_alone(total: u64, page_events: u64) {
    let (filter, month_ms, provider) = month();
    let mut usage = GatewayUsage::new(&filter, false);
    let mut unreadable = Unreadables::first(flexway_aws::UNREADABLE_LISTED);
    let mut folding = Duration::ZERO;
    let mut bytes = 0;
    let mut first = 0;
    while first < total {
        let lines: Vec<String> = (first..total.min(first + page_events))
            .map(|seq| serde_json::to_string(&record(seq, total, month_ms).1).unwrap())
            .collect();
        bytes += lines.iter().map(String::len).sum::<usize>();
        let start = Instant::now();
        for (n, line) in lines.iter().enumerate() {
            match parse_record(line) {
                Ok(record) => usage.add(&record),
                Err(why) => unreadable.push(flexway::audit::report::Unreadable { at: format!("event {n}"), why }),
            }
        }
        folding += start.elapsed();
        first += page_events;
    }
    let start = Instant::now();
    let reconciliation = usage.reconcile(&provider);
    folding += start.elapsed();
    let tokens: u64 = reconciliation.backends.iter().map(|b| b.gateway.total()).sum();
    println!(
        "parse+fold: {:.2} s, {}; {} B a line; {} sums, {} rows, {tokens} tokens, {} unreadable; peak RSS {}",
        folding.as_secs_f64(),
        per_minute(total, folding),
        bytes / total as usize,
        usage.sums(),
        reconciliation.rows.len(),
        unreadable.listed().len() as u64 + unreadable.unlisted(),
        status("VmHWM"),
    );
}

/// The fake endpoint's state: the run's shape, and the time and bytes of making pages.
struct Pages {
    total: u64,
    page_events: u64,
    month_ms: i64,
    making_ns: AtomicU64,
    bytes: AtomicU64,
    served: AtomicU64,
}

/// A FilterLogEvents answer: page `nextToken` (the first without one), its events as
/// CloudWatch writes them (Lambda stream names, 56-digit event ids), and the token of
/// the next page unless it is the last.
async fn filter_log_events(
    State(pages): State<Arc<Pages>>,
    body: Bytes,
) -> ([(axum::http::HeaderName, &'static str); 1], Vec<u8>) {
    let start = Instant::now();
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let n: u64 = request["nextToken"].as_str().map_or(0, |t| t.trim_start_matches('p').parse().unwrap());
    let first = n * pages.page_events;
    let last = pages.total.min(first + pages.page_events);
    let mut out = Vec::with_capacity(((last - first) * 1_100) as usize);
    out.extend_from_slice(b"{\"events\":[");
    for seq in first..last {
        let (ts, record) = record(seq, pages.total, pages.month_ms);
        if seq > first {
            out.push(b',');
        }
        let stream =
            format!("2026/11/01/[$LATEST]{:032x}", u128::from(mix(seq % 64)) << 64 | u128::from(mix(seq % 64 + 1)));
        let _ = std::io::Write::write_fmt(
            &mut out,
            format_args!("{{\"logStreamName\":\"{stream}\",\"timestamp\":{ts},\"message\":"),
        );
        serde_json::to_writer(&mut out, &serde_json::to_string(&record).unwrap()).unwrap();
        let id = format!("{:020}{:020}{:016}", ts, mix(seq) % 10u64.pow(19), seq);
        let _ =
            std::io::Write::write_fmt(&mut out, format_args!(",\"ingestionTime\":{},\"eventId\":\"{id}\"}}", ts + 120));
    }
    out.extend_from_slice(b"],\"searchedLogStreams\":[]");
    if last < pages.total {
        let _ = std::io::Write::write_fmt(&mut out, format_args!(",\"nextToken\":\"p{}\"", n + 1));
    }
    out.push(b'}');
    pages.bytes.fetch_add(out.len() as u64, Ordering::Relaxed);
    pages.served.fetch_add(last - first, Ordering::Relaxed);
    pages.making_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    ([(CONTENT_TYPE, "application/x-amz-json-1.1")], out)
}

/// The pages read from the fake endpoint through the SDK, folded (or held, `hold`).
async fn read(total: u64, page_events: u64, hold: bool) {
    let (filter, month_ms, provider) = month();
    let pages = Arc::new(Pages {
        total,
        page_events,
        month_ms,
        making_ns: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
        served: AtomicU64::new(0),
    });
    let app = Router::new().route("/", post(filter_log_events)).with_state(pages.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let sdk = flexway_aws::sdk_loader()
        .region(Region::new("us-east-1"))
        .endpoint_url(format!("http://{addr}"))
        .credentials_provider(Credentials::new("test", "test", None, None, "bench"))
        .load()
        .await;
    let client = aws_sdk_cloudwatchlogs::Client::new(&sdk);

    let start = Instant::now();
    let (label, sums, rows, unreadable) = if hold {
        let (from, to) = filter.unix_millis();
        let read = flexway_aws::read_audit_log_group(&client, "/flexway/audit", from, to, None).await.unwrap();
        let reconciliation = flexway::reconcile::reconcile(&read.records, &provider, &filter, false);
        ("held, then reconciled (BENCH_HOLD=1)", 0, reconciliation.rows.len(), read.unreadable.len() as u64)
    } else {
        let mut usage = GatewayUsage::new(&filter, false);
        let mut unreadable = Unreadables::first(flexway_aws::UNREADABLE_LISTED);
        flexway_aws::fold_audit(&client, "/flexway/audit", &filter, &mut usage, &mut unreadable).await.unwrap();
        let reconciliation = usage.reconcile(&provider);
        let unreadable = unreadable.listed().len() as u64 + unreadable.unlisted();
        ("fold_audit", usage.sums(), reconciliation.rows.len(), unreadable)
    };
    let elapsed = start.elapsed();
    let making = Duration::from_nanos(pages.making_ns.load(Ordering::Relaxed));
    let reading = elapsed.saturating_sub(making);
    let served = pages.served.load(Ordering::Relaxed);
    assert_eq!(served, total, "every page was asked for");
    let bytes = pages.bytes.load(Ordering::Relaxed);
    println!(
        "SDK read + {label}: {:.2} s ({:.2} s of it making the pages, taken off): {:.2} s, {}; {} sums, {rows} rows, \
         {unreadable} unreadable; peak RSS {}",
        elapsed.as_secs_f64(),
        making.as_secs_f64(),
        reading.as_secs_f64(),
        per_minute(total, reading),
        sums,
        status("VmHWM"),
    );
    let per_event = bytes as f64 / total as f64;
    let rtt_ms = env_or("BENCH_RTT_MS", 300);
    let mib_pages = (total as f64 * per_event / 1_048_576.0).ceil();
    println!(
        "a page of {page_events}: {:.1} MB of response ({per_event:.0} B an event); at most 1 MiB a page: {:.0} events, \
         {mib_pages:.0} pages; × {rtt_ms} ms a round trip = {:.0} s of FilterLogEvents (plus the {:.1} s above)",
        per_event * page_events as f64 / 1e6,
        1_048_576.0 / per_event,
        mib_pages * rtt_ms as f64 / 1e3,
        reading.as_secs_f64(),
    );
}
