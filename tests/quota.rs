//! Provider quotas (SPEC §14), end to end over loopback: the gateway's router with the
//! memory ledger, fake model servers as the backends. A backend at its quota is passed
//! over like one whose breaker is open; when every candidate is, the call is 429
//! `backend_quota`. Windows are UTC minutes, so each test starts early in one
//! ([`early_in_a_minute`]).
#![cfg(test)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flexway::budget::period::unix_now;
use flexway::budget::{
    BudgetStore, CounterKey, IntentOutcome, MemoryBudgetStore, Reservation, ReserveOutcome, ReserveRequest,
    SettleOutcome, StoreError, Swept, Unit,
};
use flexway_testkit::*;
use futures_util::future::join_all;
use serde_json::{Value, json};

/// Tenant `acme` (its key [`KEY`]) and the backends `backends` (YAML lines under
/// `ai.backends`), `default` serving.
fn quota_config(default: &str, backends: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  acme:
    keys: [{{sha256: {key}}}]
    budgets: {{tokens_per_day: 1000000}}
ai:
  default_backend: {default}
  budget: {{default_max_tokens: 100, min_completion_tokens: 10}}
  backends:
{backends}"#,
        key = sha(KEY)
    )
}

/// A pool of `a` then `b` (a lower priority), with these quotas.
fn pool(a_url: &str, a_quota: &str, b_url: &str, b_quota: &str) -> String {
    quota_config(
        "pool",
        &format!(
            "    pool:\n      kind: pool\n      members:\n        - {{backend: a, priority: 1}}\n        \
             - {{backend: b, priority: 2}}\n    a: {{url: \"{a_url}\"{a_quota}}}\n    b: {{url: \"{b_url}\"{b_quota}}}\n"
        ),
    )
}

/// Asserts that `Retry-After` is the whole seconds from the refusal to its UTC
/// minute's end (SPEC §14): `60 - now % 60` for a `now` between the clock read
/// `before` and `after` the call, within a second.
fn assert_retry_after_is_the_minutes_rest(retry: u64, before: u64, after: u64) {
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    let rests: Vec<u64> = (before..=after).map(|now| 60 - now % 60).collect();
    assert!(rests.iter().any(|rest| rest.abs_diff(retry) <= 1), "Retry-After {retry}, the minute's rest {rests:?}");
}

fn hello() -> Value {
    json!({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hello there"}]})
}

fn header<'r>(response: &'r reqwest::Response, name: &str) -> Option<&'r str> {
    response.headers().get(name).and_then(|v| v.to_str().ok())
}

/// `backend`'s quota counters in the current minute: requests, tokens.
async fn quota_used(gw: &InProcess, backend: &str) -> [u64; 2] {
    let now = unix_now();
    let keys = [
        CounterKey::window("~backend", Some(backend), Unit::Requests, now),
        CounterKey::window("~backend", Some(backend), Unit::Tokens, now),
    ];
    let used = gw.gateway.budgets.used(&keys).await.unwrap();
    [used[0], used[1]]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_at_its_quota_is_passed_over_then_every_one_is_429() {
    let (first, second) = (FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap());
    let (adapters, audit) = memory_adapters();
    let yaml =
        pool(&first.url(), ", quota: {requests_per_minute: 2}", &second.url(), ", quota: {requests_per_minute: 1}");
    let gw = serve_in_process(&yaml, adapters).await;
    early_in_a_minute().await;

    for _ in 0..2 {
        let response = gw.chat(KEY, hello()).await;
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "flexway-backend"), Some("a"));
        assert_eq!(header(&response, "flexway-degraded"), None);
    }
    // a's two requests are used: the third call goes to b, as a fallback.
    let third = gw.chat(KEY, hello()).await;
    assert_eq!(third.status(), 200);
    assert_eq!(header(&third, "flexway-backend"), Some("b"));
    assert_eq!(header(&third, "flexway-degraded"), Some("backend-fallback"));
    assert_eq!((first.request_count(), second.request_count()), (2, 1));
    let records = audit_records_until(&audit, 3).await;
    let record = serde_json::to_value(&records[2]).unwrap();
    assert_eq!(record["skipped"], json!([{"backend": "a", "cause": "quota"}]), "{record}");
    assert_eq!(record["backend"], "b");
    assert_eq!(record["degraded"], true);
    assert!(serde_json::to_value(&records[0]).unwrap().get("skipped").is_none(), "absent when nothing was skipped");

    // Both at their quota: 429, to the minute's end, and nothing sent.
    let before = unix_now();
    let refused = gw.chat(KEY, hello()).await;
    let after = unix_now();
    assert_eq!(refused.status(), 429);
    assert_eq!(header(&refused, "flexway-error-cause"), Some("backend_quota"));
    assert_eq!(header(&refused, "x-should-retry"), Some("true"));
    let retry: u64 = header(&refused, "retry-after").unwrap().parse().unwrap();
    assert_retry_after_is_the_minutes_rest(retry, before, after);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert_eq!((first.request_count(), second.request_count()), (2, 1));
    let records = audit_records_until(&audit, 4).await;
    let record = serde_json::to_value(&records[3]).unwrap();
    assert_eq!(record["status"], 429);
    assert_eq!(
        record["skipped"],
        json!([{"backend": "a", "cause": "quota"}, {"backend": "b", "cause": "quota"}]),
        "{record}"
    );
    assert_eq!(gw.live_reservations().await, 0, "every quota reservation ended with its call");
    assert_eq!(quota_used(&gw, "a").await[0], 2);

    // The console shows each backend's quota use this minute, from the ledger.
    let overview = flexway::console::overview(&gw.gateway, "", 1).await.unwrap();
    let quota = |name: &str| {
        let row = overview.backends.iter().find(|b| b.backend == name).unwrap();
        row.quota.iter().map(|q| (q.kind, q.used, q.limit)).collect::<Vec<_>>()
    };
    assert_eq!(quota("a"), [("requests", 2, 2)]);
    assert_eq!(quota("b"), [("requests", 1, 1)]);
    assert_eq!(quota("pool"), [], "no quota, no row");

    let metrics = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains(r#"flexway_backend_quota_used_ratio{backend="a",kind="requests"} 1"#),
        "{}",
        metrics.lines().filter(|l| l.contains("quota")).collect::<Vec<_>>().join("\n")
    );
}

/// A burst never sends a backend more calls than its quota: the reservation is atomic
/// in the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_never_sends_a_backend_more_than_its_quota() {
    let model = FakeModel::start().await.unwrap();
    let slow = model.scenario_url(&Scenario { delay_ms: Some(300), ..Default::default() });
    let (adapters, _) = memory_adapters();
    let yaml = quota_config("main", &format!("    main: {{url: \"{slow}\", quota: {{requests_per_minute: 3}}}}\n"));
    let gw = serve_in_process(&yaml, adapters).await;
    early_in_a_minute().await;
    let responses = join_all((0..16).map(|_| gw.chat(KEY, hello()))).await;
    let statuses: Vec<u16> = responses.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 3, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 13, "{statuses:?}");
    assert_eq!(model.request_count(), 3, "the backend got more than its quota");
    assert_eq!(gw.live_reservations().await, 0);
}

/// Tokens are counted at the call's bound while it runs and settled on its usage; a
/// failed attempt gives its quota back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_settles_on_usage_and_a_failed_attempt_is_refunded() {
    let (failing, serving) = (FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap());
    let broken = failing.scenario_url(&Scenario { status: Some(500), ..Default::default() });
    let (adapters, audit) = memory_adapters();
    let quota = ", quota: {requests_per_minute: 100, tokens_per_minute: 100000}";
    let yaml = pool(&broken, quota, &serving.url(), quota);
    let gw = serve_in_process(&yaml, adapters).await;
    early_in_a_minute().await;

    let response = gw.chat(KEY, hello()).await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "flexway-backend"), Some("b"));
    assert_eq!(failing.request_count(), 1, "a was tried");
    let record = audit_records_until(&audit, 1).await.remove(0);
    assert_eq!(quota_used(&gw, "a").await, [0, 0], "the failed attempt's quota is refunded");
    assert_eq!(
        quota_used(&gw, "b").await,
        [1, record.prompt_tokens + record.completion_tokens],
        "the serving backend's quota is settled on its usage"
    );

    // A stream settles the same way, when it ends.
    let mut streamed = hello();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let response = gw.chat(KEY, streamed).await;
    assert_eq!(response.status(), 200);
    let _ = sse_data(response).await;
    let records = audit_records_until(&audit, 2).await;
    let used: u64 = records.iter().map(|r| r.prompt_tokens + r.completion_tokens).sum();
    assert_eq!(quota_used(&gw, "a").await, [0, 0]);
    assert_eq!(quota_used(&gw, "b").await, [2, used]);
    assert_eq!(gw.live_reservations().await, 0);
}

/// A memory ledger that fails every provider quota reservation (its id
/// `<request id>/quota/<backend>`) when `fail_quotas`, and counts the reads of
/// `backend`'s quota windows.
struct Ledger {
    inner: MemoryBudgetStore,
    fail_quotas: bool,
    backend: &'static str,
    quota_reads: AtomicUsize,
}

impl Ledger {
    fn new(fail_quotas: bool, backend: &'static str) -> Arc<Ledger> {
        Arc::new(Ledger { inner: MemoryBudgetStore::new(), fail_quotas, backend, quota_reads: AtomicUsize::new(0) })
    }

    fn quota_reads(&self) -> usize {
        self.quota_reads.load(Ordering::SeqCst)
    }

    /// A gateway's adapters over this ledger.
    fn adapters(self: &Arc<Self>) -> flexway::gateway::Adapters {
        let (mut adapters, _) = memory_adapters();
        adapters.budgets = self.clone();
        adapters
    }
}

#[async_trait::async_trait]
impl BudgetStore for Ledger {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        if self.fail_quotas && request.request_id.contains("/quota/") {
            return Err(StoreError::Backend("the ledger is unavailable".into()));
        }
        self.inner.reserve(request).await
    }
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        self.inner.settle(reservation, actual).await
    }
    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        self.inner.record_intent(request_id, actual).await
    }
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        self.inner.renew(request_id, actual, expires_at).await
    }
    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        self.inner.sweep(now).await
    }
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        let window = format!("~backend/{}/", self.backend);
        if keys.iter().any(|k| k.0.contains(&window)) {
            self.quota_reads.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.used(keys).await
    }
    async fn live_reservations(&self) -> Result<usize, StoreError> {
        self.inner.live_reservations().await
    }
    async fn create_run(&self, run: &flexway::budget::run::Run) -> Result<bool, StoreError> {
        self.inner.create_run(run).await
    }
    async fn run(&self, id: &str) -> Result<Option<flexway::budget::run::Run>, StoreError> {
        self.inner.run(id).await
    }
    async fn end_run(&self, id: &str, at: u64) -> Result<flexway::budget::run::RunEnd, StoreError> {
        self.inner.end_run(id, at).await
    }
}

/// The quota only steers: a ledger that fails to reserve on it does not fail the call
/// (the call's own reservation holds), the backend is tried without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_failing_on_a_quota_fails_open() {
    let model = FakeModel::start().await.unwrap();
    let ledger = Ledger::new(true, "main");
    let url = model.url();
    let yaml = quota_config("main", &format!("    main: {{url: \"{url}\", quota: {{requests_per_minute: 1}}}}\n"));
    let gw = serve_in_process(&yaml, ledger.adapters()).await;
    early_in_a_minute().await;
    for _ in 0..2 {
        let response = gw.chat(KEY, hello()).await;
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    }
    assert_eq!(model.request_count(), 2, "nothing counted on the quota: it cannot refuse");
    assert_eq!(quota_used(&gw, "main").await, [0, 0]);
    assert_eq!(gw.live_reservations().await, 0);
}

/// A 429 `backend_quota` says which rate refused in its OpenAI `type`, as a caller's
/// own window's 429 does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokens_quota_refusing_is_type_tokens() {
    let model = FakeModel::start().await.unwrap();
    let (adapters, _) = memory_adapters();
    // The first call holds its 38 tokens while the backend answers: the second's 38 do
    // not fit what is left of 60.
    let url = model.scenario_url(&Scenario { delay_ms: Some(500), ..Default::default() });
    let quota = "quota: {requests_per_minute: 100, tokens_per_minute: 60}";
    let gw =
        serve_in_process(&quota_config("main", &format!("    main: {{url: \"{url}\", {quota}}}\n")), adapters).await;
    early_in_a_minute().await;
    let first = gw.chat(KEY, hello());
    let second = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        gw.chat(KEY, hello()).await
    };
    let (first, refused) = tokio::join!(first, second);
    assert_eq!(first.status(), 200);
    assert_eq!(refused.status(), 429);
    assert_eq!(header(&refused, "flexway-error-cause"), Some("backend_quota"));
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["type"], "tokens", "{body}");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert_eq!(model.request_count(), 1, "the refused call was never sent");
}

/// A settlement reads its backend's quota for the gauge at most once a second; a
/// refusal and the console read it always.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quota_gauge_is_read_at_most_once_a_second_a_backend() {
    let model = FakeModel::start().await.unwrap();
    // A name of its own: the sampling is the process's, other tests' backends apart.
    let ledger = Ledger::new(false, "sampled");
    let url = model.url();
    let quota = "quota: {requests_per_minute: 6}";
    let yaml = quota_config("sampled", &format!("    sampled: {{url: \"{url}\", {quota}}}\n"));
    let gw = serve_in_process(&yaml, ledger.adapters()).await;
    early_in_a_minute().await;
    let started = Instant::now();
    for _ in 0..6 {
        assert_eq!(gw.chat(KEY, hello()).await.status(), 200);
    }
    let reads = ledger.quota_reads();
    let seconds = started.elapsed().as_secs() as usize;
    assert!((1..=seconds + 1).contains(&reads), "{reads} reads for 6 settlements in {seconds} s");

    // The seventh is refused: its read sets the gauge to full, whenever the last was.
    assert_eq!(gw.chat(KEY, hello()).await.status(), 429);
    assert_eq!(ledger.quota_reads(), reads + 1);
    let metrics = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"flexway_backend_quota_used_ratio{backend="sampled",kind="requests"} 1"#));
    flexway::console::overview(&gw.gateway, "", 1).await.unwrap();
    assert_eq!(ledger.quota_reads(), reads + 2, "the console reads the quota when it loads");
}

/// A call larger than a backend's whole tokens quota is passed over there (no minute
/// could hold it), and where no backend could ever hold it, it is 400, not a 429 the
/// SDKs would retry forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_larger_than_every_quota_is_400_and_another_member_serves_it_if_it_can() {
    let (first, second) = (FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap());
    // "hello there" reserves 18 prompt tokens and 20 of allowance: 38, over a's 30.
    let small = ", quota: {tokens_per_minute: 30}";
    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&pool(&first.url(), small, &second.url(), ""), adapters).await;
    let served = gw.chat(KEY, hello()).await;
    assert_eq!(served.status(), 200);
    assert_eq!(header(&served, "flexway-backend"), Some("b"));
    assert_eq!(header(&served, "flexway-degraded"), Some("backend-fallback"));
    assert_eq!(quota_used(&gw, "a").await, [0, 0], "nothing reserved where it could never fit");

    let (adapters, _) = memory_adapters();
    let gw = serve_in_process(&pool(&first.url(), small, &second.url(), small), adapters).await;
    let refused = gw.chat(KEY, hello()).await;
    assert_eq!(refused.status(), 400);
    assert_eq!(header(&refused, "x-should-retry"), Some("false"));
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_request");
    assert!(body["error"]["message"].as_str().unwrap().contains("38 tokens"), "{body}");
    let fits = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hello there"}]});
    assert_eq!(gw.chat(KEY, fits).await.status(), 200, "28 tokens fit a's 30");
}
