//! The fake as a model server under load: a few slots, a queue in front of them,
//! a prefix cache, and a vLLM-style `/metrics` page that tells it all.
//!
//! A call (`POST` chat, messages or embeddings) waits in the queue for a slot,
//! holds it for its service time (a model server's prefill: a prompt whose first
//! [`PREFIX_BYTES`] it served before takes [`Capacity::cached_service`]), then
//! answers as usual. So answers slow as the queue fills, and `/metrics` shows
//! `vllm:num_requests_waiting`, `vllm:num_requests_running` and
//! `vllm:kv_cache_usage_perc` (the share of slots in use) as they change. Without
//! a [`Capacity`] every call runs at once and the page shows the calls running.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::Semaphore;

/// The prompt bytes the fake's prefix cache keys on.
pub const PREFIX_BYTES: usize = 4096;

/// How much a fake model server serves at once, and how fast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Calls it runs at once; the others wait in its queue.
    pub slots: u32,
    /// How long a call holds its slot before its answer starts.
    pub service: Duration,
    /// The same for a prompt whose first bytes it served lately.
    pub cached_service: Duration,
    /// How many prompt prefixes its cache holds; the least recently used goes.
    pub cached_prefixes: usize,
}

/// The server's load: its slots, who waits, who runs, what prompts it has seen.
pub(crate) struct Load {
    capacity: Option<Capacity>,
    slots: Option<Semaphore>,
    waiting: AtomicU32,
    running: AtomicU32,
    /// The cached prefixes, the most recently used last.
    prefixes: Mutex<VecDeque<u64>>,
    /// Calls whose prompt was looked up in the prefix cache, and those found.
    queries: AtomicU64,
    hits: AtomicU64,
}

/// Counts one up while it lives.
struct Counted<'a>(&'a AtomicU32);

impl<'a> Counted<'a> {
    fn new(counter: &'a AtomicU32) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Counted(counter)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Load {
    pub(crate) fn new(capacity: Option<Capacity>) -> Self {
        Load {
            capacity,
            slots: capacity.map(|c| Semaphore::new(c.slots.max(1) as usize)),
            waiting: AtomicU32::new(0),
            running: AtomicU32::new(0),
            prefixes: Mutex::new(VecDeque::new()),
            queries: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        }
    }

    /// Waits for a slot and holds it for the call's service time, or for `hold`
    /// when given (a scenario's `delay_ms`: a long call); whether it did (the
    /// server has slots). A call dropped while it waits (its client gone) leaves
    /// the queue, and one dropped in its slot frees it.
    pub(crate) async fn serve(&self, body: Option<&Value>, hold: Option<Duration>) -> bool {
        let (Some(capacity), Some(slots)) = (self.capacity, &self.slots) else { return false };
        let cached = body.and_then(prefix_key).is_some_and(|key| self.remember(key, capacity.cached_prefixes));
        let permit = {
            let _waiting = Counted::new(&self.waiting);
            slots.acquire().await
        };
        let _running = Counted::new(&self.running);
        let service = if cached { capacity.cached_service } else { capacity.service };
        tokio::time::sleep(hold.unwrap_or(service)).await;
        drop(permit);
        true
    }

    /// Whether the prefix is in the cache; makes it the most recently used.
    fn remember(&self, key: u64, room: usize) -> bool {
        let mut cached = self.prefixes.lock().unwrap_or_else(PoisonError::into_inner);
        let hit = cached.iter().position(|k| *k == key).and_then(|at| cached.remove(at)).is_some();
        self.queries.fetch_add(1, Ordering::Relaxed);
        if hit {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        cached.push_back(key);
        while cached.len() > room {
            cached.pop_front();
        }
        hit
    }

    /// The Prometheus page a vLLM server would show.
    pub(crate) fn metrics(&self) -> String {
        let waiting = self.waiting.load(Ordering::Relaxed);
        let running = self.running.load(Ordering::Relaxed);
        let used = self.capacity.map_or(0.0, |c| f64::from(running) / f64::from(c.slots.max(1)));
        let (queries, hits) = (self.queries.load(Ordering::Relaxed), self.hits.load(Ordering::Relaxed));
        format!(
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{model_name=\"fake\"}} {waiting}\n\
             # HELP vllm:num_requests_running Number of requests in model execution batches.\n\
             # TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{{model_name=\"fake\"}} {running}\n\
             # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
             # TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{{model_name=\"fake\"}} {used}\n\
             # HELP vllm:prefix_cache_queries_total Prompts looked up in the prefix cache (calls, not tokens).\n\
             # TYPE vllm:prefix_cache_queries_total counter\n\
             vllm:prefix_cache_queries_total{{model_name=\"fake\"}} {queries}\n\
             # HELP vllm:prefix_cache_hits_total Prompts found in the prefix cache (calls, not tokens).\n\
             # TYPE vllm:prefix_cache_hits_total counter\n\
             vllm:prefix_cache_hits_total{{model_name=\"fake\"}} {hits}\n"
        )
    }
}

/// The key of a prompt's first bytes: its messages (or input) as JSON text.
fn prefix_key(body: &Value) -> Option<u64> {
    let prompt = body.get("messages").or_else(|| body.get("input"))?.to_string();
    let mut end = prompt.len().min(PREFIX_BYTES);
    while !prompt.is_char_boundary(end) {
        end -= 1;
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    prompt[..end].hash(&mut hasher);
    Some(hasher.finish())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;

    fn parse(page: &str, name: &str) -> f64 {
        let line = page.lines().find(|l| l.starts_with(name)).unwrap();
        line.rsplit_once(' ').unwrap().1.parse().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn calls_beyond_the_slots_wait_and_the_page_says_so() {
        let service = Duration::from_millis(100);
        let capacity = Capacity { slots: 2, service, cached_service: Duration::from_millis(10), cached_prefixes: 2 };
        let load = Arc::new(Load::new(Some(capacity)));
        let body = |n: u32| json!({ "messages": [{ "role": "user", "content": format!("call {n}") }] });
        let calls: Vec<_> = (0..5)
            .map(|n| {
                let load = Arc::clone(&load);
                tokio::spawn(async move { load.serve(Some(&body(n)), None).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(1)).await;
        let page = load.metrics();
        assert_eq!(parse(&page, "vllm:num_requests_waiting"), 3.0);
        assert_eq!(parse(&page, "vllm:num_requests_running"), 2.0);
        assert_eq!(parse(&page, "vllm:kv_cache_usage_perc"), 1.0);
        let started = tokio::time::Instant::now();
        for call in calls {
            call.await.unwrap();
        }
        assert_eq!(started.elapsed().as_millis(), 299, "three rounds of two slots");
        assert_eq!(parse(&load.metrics(), "vllm:num_requests_waiting"), 0.0);
        let again = tokio::time::Instant::now();
        assert!(load.serve(Some(&body(4)), None).await);
        assert_eq!(again.elapsed(), Duration::from_millis(10), "a prefix seen lately is served from cache");
        let forgotten = tokio::time::Instant::now();
        load.serve(Some(&body(2)), None).await;
        assert_eq!(forgotten.elapsed(), service, "call 2 was pushed out by 3 and 4 (two prefixes fit)");
        let page = load.metrics();
        assert_eq!(parse(&page, "vllm:prefix_cache_queries_total"), 7.0);
        assert_eq!(parse(&page, "vllm:prefix_cache_hits_total"), 1.0);
        let held = tokio::time::Instant::now();
        load.serve(None, Some(Duration::from_secs(3))).await;
        assert_eq!(held.elapsed(), Duration::from_secs(3), "a long call holds its slot as long as asked");
    }

    #[tokio::test(start_paused = true)]
    async fn without_capacity_nothing_waits() {
        let load = Load::new(None);
        let started = tokio::time::Instant::now();
        assert!(!load.serve(None, Some(Duration::from_secs(3))).await, "the delay is the scenario's to spend");
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(parse(&load.metrics(), "vllm:num_requests_waiting"), 0.0);
    }
}
