//! Inference-aware choice inside a pool (SPEC §5 `pick`): what the gateway knows of
//! each member's load, and the order it gives the members of a priority group.
//!
//! Priority groups, capabilities, sensitivity and breakers keep their say: `pick`
//! only orders the members of each group (the first is tried first, the others are
//! its fallbacks before the first byte). What it reads, off the request path:
//! - a member's model-server metrics (`load`), polled every `every` by a task of its
//!   own: queue depth, then KV-cache use, then the gateway's own calls in flight rank
//!   it (`least_loaded`); a member whose sample is missing or older than three polls
//!   is ranked by its calls in flight alone, as if they were its queue;
//! - each member's time to first byte, as a peak-EWMA (`latency`: the better of two
//!   members drawn by weight, its cost the EWMA times its calls in flight plus one);
//! - which member served a prompt prefix last (`cache_affinity`), in a bounded table
//!   per pool, so the model server's prefix cache is hit.
//!
//! Saturation (a pool's `saturation`) is judged on the same sample: a member is
//! saturated when its queue (or, without a fresh sample, its calls in flight) or its
//! KV-cache use reaches the pool's bound.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use rand::Rng;

use crate::call::PickReason;
use crate::config::{BackendId, BackendKind, Config, LoadSource, Pick, Picking, PoolMember, Saturation};

/// How many prefixes a pool remembers; the oldest is forgotten first.
const AFFINITY_ENTRIES: usize = 16_384;
/// The decay time of a member's latency EWMA.
const LATENCY_DECAY: Duration = Duration::from_secs(10);
/// A metrics page larger than this is not a model server's.
const MAX_METRICS_BYTES: usize = 4 << 20;

/// What the gateway knows of the load of every pool member, shared by all calls.
#[derive(Default)]
pub struct Loads {
    members: HashMap<BackendId, Arc<Member>>,
    /// Prefix → the member that served it last, per pool with `cache_affinity`.
    affinity: HashMap<BackendId, Mutex<PrefixTable>>,
}

/// One member's load, as last seen.
struct Member {
    in_flight: AtomicU32,
    /// The last sample read, when, and the calls in flight then.
    sample: Mutex<Option<(Sample, Instant, u32)>>,
    /// A sample older than this (three polls) is stale.
    stale_after: Option<Duration>,
    latency: Mutex<PeakEwma>,
}

/// A model server's load, read from its metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Requests waiting in its queue.
    pub waiting: u32,
    /// Requests it is running.
    pub running: u32,
    /// KV-cache use, in parts per million (0 when the server does not say).
    pub kv_ppm: u32,
}

/// A member's load as one call's routing sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seen {
    /// A fresh sample, if any.
    pub sample: Option<Sample>,
    pub in_flight: u32,
    /// How many more calls the gateway has in flight to it than when the sample was
    /// read: sent since, and not yet in the sample.
    pub sent_since: u32,
}

impl Seen {
    /// The queue as the sample read it plus the calls sent since; without a fresh
    /// sample, the calls in flight.
    pub fn queue(&self) -> u32 {
        self.sample.map_or(self.in_flight, |s| s.waiting.saturating_add(self.sent_since))
    }

    /// Queue depth, then KV-cache use, then calls in flight: lower is less loaded.
    fn rank(&self) -> (u32, u32, u32) {
        (self.queue(), self.sample.map_or(0, |s| s.kv_ppm), self.in_flight)
    }

    pub fn saturated(&self, bound: &Saturation) -> bool {
        let kv = self.sample.map_or(0, |s| s.kv_ppm);
        bound.queue.is_some_and(|q| self.queue() >= q) || bound.kv_cache_ppm.is_some_and(|k| kv >= k)
    }
}

/// A call counted in flight to a member until it is dropped (the call's end).
pub struct InFlight(Arc<Member>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InFlight")
    }
}

impl Loads {
    /// The members of every pool of `config`, and the prefix tables of the pools with
    /// `cache_affinity`.
    pub fn new(config: &Config) -> Self {
        let mut loads = Loads::default();
        for (name, backend) in &config.ai.backends {
            let BackendKind::Pool { members, picking } = &backend.kind else { continue };
            for member in members {
                let load = config.ai.backends.get(&member.backend).and_then(|b| b.load.as_ref());
                loads.members.entry(member.backend.clone()).or_insert_with(|| {
                    Arc::new(Member {
                        in_flight: AtomicU32::new(0),
                        sample: Mutex::new(None),
                        stale_after: load.map(|l| l.every * 3),
                        latency: Mutex::new(PeakEwma::default()),
                    })
                });
            }
            if picking.prefix_bytes.is_some() {
                loads.affinity.insert(name.clone(), Mutex::new(PrefixTable::default()));
            }
        }
        loads
    }

    /// Starts one task per member with a `load`, reading its metrics every `every`
    /// for as long as these loads exist (call it inside a Tokio runtime).
    pub fn start_polling(&self, config: &Config) {
        for (name, member) in &self.members {
            let Some(source) = config.ai.backends.get(name).and_then(|b| b.load.clone()) else { continue };
            let member = Arc::downgrade(member);
            tokio::spawn(poll(name.clone(), member, source));
        }
    }

    /// Counts a call in flight to `backend` (a pool member) until the guard drops.
    pub fn start(&self, backend: &BackendId) -> Option<InFlight> {
        let member = self.members.get(backend)?;
        member.in_flight.fetch_add(1, Ordering::Relaxed);
        Some(InFlight(member.clone()))
    }

    /// A member's time to first byte (or to its failure by timeout).
    pub fn observe_latency(&self, backend: &BackendId, elapsed: Duration) {
        if let Some(member) = self.members.get(backend) {
            member.latency.lock().unwrap_or_else(PoisonError::into_inner).observe(elapsed, Instant::now());
        }
    }

    /// `prefix` was served by `member` of `pool`: its next calls go there first.
    pub fn served_prefix(&self, pool: &BackendId, prefix: u64, member: &BackendId) {
        if let Some(table) = self.affinity.get(pool) {
            table.lock().unwrap_or_else(PoisonError::into_inner).insert(prefix, member.clone());
        }
    }

    /// A member's load as routing sees it now.
    pub fn seen(&self, backend: &BackendId) -> Seen {
        let Some(member) = self.members.get(backend) else {
            return Seen::default();
        };
        let in_flight = member.in_flight.load(Ordering::Relaxed);
        match member.fresh_sample(Instant::now()) {
            Some((sample, then)) => {
                Seen { sample: Some(sample), in_flight, sent_since: in_flight.saturating_sub(then) }
            }
            None => Seen { sample: None, in_flight, sent_since: 0 },
        }
    }

    /// Every member's load, for `/metrics`.
    pub fn snapshot(&self) -> Vec<(BackendId, Seen)> {
        let mut all: Vec<_> = self.members.keys().map(|name| (name.clone(), self.seen(name))).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// The members of `pool` in the order they are tried: priority groups first (as
    /// `base` gave them, a weighted random or a session's order), each group ordered
    /// by the pool's pick; and why the first one is first.
    pub fn order<'a>(
        &self,
        pool: &BackendId,
        picking: &Picking,
        mut base: Vec<&'a PoolMember>,
        prefix: Option<u64>,
        rng: &mut impl Rng,
    ) -> (Vec<&'a PoolMember>, PickReason) {
        let mut reason = match picking.pick {
            Pick::Weighted => PickReason::Weighted,
            Pick::LeastLoaded => PickReason::LeastLoaded,
            Pick::Latency => PickReason::Latency,
        };
        let now = Instant::now();
        for members in base.chunk_by_mut(|a, b| a.priority == b.priority) {
            match picking.pick {
                Pick::Weighted => {}
                // Stable: members that rank alike keep their weighted order.
                // Ranked once each: a load read anew at each comparison could change
                // mid-sort, and an inconsistent order may panic the sort.
                Pick::LeastLoaded => members.sort_by_cached_key(|m| self.seen(&m.backend).rank()),
                Pick::Latency => self.power_of_two(members, now, rng),
            }
        }
        let remembered = prefix
            .zip(self.affinity.get(pool))
            .and_then(|(prefix, table)| table.lock().unwrap_or_else(PoisonError::into_inner).get(prefix).cloned());
        if let Some(remembered) = remembered
            && let Some(at) = base.iter().position(|m| m.backend == remembered)
            && base[at].priority == base[0].priority
            && !picking.saturation.is_some_and(|s| self.seen(&remembered).saturated(&s))
        {
            let member = base.remove(at);
            base.insert(0, member);
            reason = PickReason::CacheAffinity;
        }
        (base, reason)
    }

    /// Latency: of the first two members (drawn by weight), the one whose peak-EWMA
    /// time to first byte times its calls in flight plus one is lower goes first.
    fn power_of_two(&self, members: &mut [&PoolMember], now: Instant, rng: &mut impl Rng) {
        if members.len() < 2 {
            return;
        }
        let cost = |m: &PoolMember| {
            self.members.get(&m.backend).map_or(0.0, |member| {
                let ewma = member.latency.lock().unwrap_or_else(PoisonError::into_inner).estimate(now);
                ewma * f64::from(member.in_flight.load(Ordering::Relaxed) + 1)
            })
        };
        let (a, b) = (cost(members[0]), cost(members[1]));
        // Equal costs (both unmeasured) are an even draw, so both get measured.
        if b < a || (b == a && rng.random_bool(0.5)) {
            members.swap(0, 1);
        }
    }

    /// Whether every member of `members` is saturated under `bound`.
    pub fn all_saturated<'a>(&self, mut members: impl Iterator<Item = &'a BackendId>, bound: &Saturation) -> bool {
        members.all(|m| self.seen(m).saturated(bound))
    }
}

impl Member {
    /// The sample, if fresh, and the calls in flight when it was read.
    fn fresh_sample(&self, now: Instant) -> Option<(Sample, u32)> {
        let stale_after = self.stale_after?;
        let (sample, at, in_flight) = (*self.sample.lock().unwrap_or_else(PoisonError::into_inner))?;
        (now.saturating_duration_since(at) <= stale_after).then_some((sample, in_flight))
    }

    fn store(&self, sample: Sample, at: Instant) {
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        *self.sample.lock().unwrap_or_else(PoisonError::into_inner) = Some((sample, at, in_flight));
    }
}

/// A member's time to first byte: jumps to a slower observation at once (its peak),
/// decays towards faster ones with time (Finagle's and Linkerd's peak-EWMA).
#[derive(Debug, Default)]
struct PeakEwma {
    /// Seconds; 0 before the first observation.
    value: f64,
    at: Option<Instant>,
}

impl PeakEwma {
    fn observe(&mut self, elapsed: Duration, now: Instant) {
        let rtt = elapsed.as_secs_f64();
        self.value = match self.at {
            None => rtt,
            Some(_) if rtt > self.value => rtt,
            Some(at) => {
                let w = (-now.saturating_duration_since(at).as_secs_f64() / LATENCY_DECAY.as_secs_f64()).exp();
                self.value * w + rtt * (1.0 - w)
            }
        };
        self.at = Some(now);
    }

    /// The estimate decays while nothing is observed, so a member left alone after a
    /// slow spell is tried again.
    fn estimate(&self, now: Instant) -> f64 {
        let idle = self.at.map_or(0.0, |at| now.saturating_duration_since(at).as_secs_f64());
        self.value * (-idle / LATENCY_DECAY.as_secs_f64()).exp()
    }
}

/// Prefix → member, bounded: the oldest entry is forgotten first.
#[derive(Default)]
struct PrefixTable {
    map: HashMap<u64, BackendId>,
    order: VecDeque<u64>,
}

impl PrefixTable {
    fn get(&self, prefix: u64) -> Option<&BackendId> {
        self.map.get(&prefix)
    }

    fn insert(&mut self, prefix: u64, member: BackendId) {
        if self.map.insert(prefix, member).is_none() {
            self.order.push_back(prefix);
            if self.order.len() > AFFINITY_ENTRIES
                && let Some(oldest) = self.order.pop_front()
            {
                self.map.remove(&oldest);
            }
        }
    }
}

/// Reads `source` every `source.every` into `member`, until the member is gone. A
/// failed read keeps nothing: the sample ages out and the member is ranked by its
/// calls in flight.
async fn poll(backend: BackendId, member: Weak<Member>, source: LoadSource) {
    let client = match reqwest::Client::builder().timeout(source.every.max(Duration::from_secs(1))).build() {
        Ok(client) => client,
        Err(e) => {
            tracing::error!(backend = %backend, "load: no HTTP client: {e}");
            return;
        }
    };
    let mut every = tokio::time::interval(source.every);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        every.tick().await;
        let Some(member) = member.upgrade() else { return };
        match read_metrics(&client, &source.metrics_url).await {
            Ok(sample) => {
                member.store(sample, Instant::now());
                failing = false;
            }
            Err(e) if !failing => {
                tracing::warn!(backend = %backend, url = %source.metrics_url, "load: {e}; ranked by calls in flight");
                failing = true;
            }
            Err(_) => {}
        }
    }
}

async fn read_metrics(client: &reqwest::Client, url: &str) -> Result<Sample, String> {
    let mut response = client.get(url).send().await.map_err(|e| format!("metrics unreachable: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("metrics answered {}", response.status()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| format!("metrics cut: {e}"))? {
        if body.len() + chunk.len() > MAX_METRICS_BYTES {
            return Err("metrics page over 4 MiB".into());
        }
        body.extend_from_slice(&chunk);
    }
    parse_metrics(&String::from_utf8_lossy(&body)).ok_or_else(|| "no vLLM, SGLang or TGI queue series".into())
}

/// The load in a Prometheus text page: vLLM's, SGLang's or TGI's series, summed over
/// their label sets (a server with several models). `None` when no queue series is
/// there: the page is not a model server's.
pub fn parse_metrics(text: &str) -> Option<Sample> {
    let (mut waiting, mut running, mut kv) = (None::<f64>, 0.0_f64, 0.0_f64);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).unwrap_or(line.len());
        let name = &line[..name_end];
        let rest = match line[name_end..].strip_prefix('{') {
            Some(labelled) => labelled.rsplit_once('}').map_or("", |(_, value)| value),
            None => &line[name_end..],
        };
        let Some(value) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        if !value.is_finite() || value < 0.0 {
            continue;
        }
        match name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" | "tgi_queue_size" => {
                *waiting.get_or_insert(0.0) += value;
            }
            "vllm:num_requests_running" | "sglang:num_running_reqs" | "tgi_batch_current_size" => running += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => kv = kv.max(value),
            _ => {}
        }
    }
    let clamp = |v: f64| v.min(f64::from(u32::MAX)) as u32;
    Some(Sample {
        waiting: clamp(waiting?),
        running: clamp(running),
        kv_ppm: (kv.min(1.0) * 1_000_000.0).round() as u32,
    })
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn reads_vllm_sglang_and_tgi_series() {
        let vllm = "# HELP vllm:num_requests_waiting waiting\n\
            vllm:num_requests_waiting{model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{model_name=\"m\"} 5\n\
            vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.42\n";
        assert_eq!(parse_metrics(vllm), Some(Sample { waiting: 3, running: 5, kv_ppm: 420_000 }));
        let sglang = "sglang:num_queue_reqs{name=\"a\"} 7\nsglang:token_usage{name=\"a\"} 0.9\n";
        assert_eq!(parse_metrics(sglang), Some(Sample { waiting: 7, running: 0, kv_ppm: 900_000 }));
        assert_eq!(parse_metrics("tgi_queue_size 2 1700000000\n"), Some(Sample { waiting: 2, running: 0, kv_ppm: 0 }));
        let two_models =
            "vllm:num_requests_waiting{model_name=\"a\"} 1\nvllm:num_requests_waiting{model_name=\"b\"} 2\n";
        assert_eq!(parse_metrics(two_models).map(|s| s.waiting), Some(3));
        assert_eq!(parse_metrics("process_cpu_seconds_total 4\n"), None, "not a model server");
        assert_eq!(parse_metrics("tgi_queue_size NaN\n"), None);
    }

    fn member(name: &str, priority: u32) -> PoolMember {
        PoolMember { backend: BackendId::new(name), priority, weight: 1 }
    }

    fn loads(names: &[&str], every: Option<Duration>) -> Loads {
        let mut loads = Loads::default();
        for name in names {
            loads.members.insert(
                BackendId::new(name),
                Arc::new(Member {
                    in_flight: AtomicU32::new(0),
                    sample: Mutex::new(None),
                    stale_after: every.map(|e| e * 3),
                    latency: Mutex::new(PeakEwma::default()),
                }),
            );
        }
        loads
    }

    fn names(order: &[&PoolMember]) -> Vec<String> {
        order.iter().map(|m| m.backend.to_string()).collect()
    }

    #[test]
    fn least_loaded_ranks_queue_then_kv_cache_then_calls_in_flight() {
        let loads = loads(&["a", "b", "c", "d"], Some(Duration::from_secs(1)));
        let now = Instant::now();
        let sample = |waiting, kv_ppm| Sample { waiting, running: 0, kv_ppm };
        loads.members[&BackendId::new("a")].store(sample(4, 0), now);
        loads.members[&BackendId::new("b")].store(sample(1, 800_000), now);
        loads.members[&BackendId::new("c")].store(sample(1, 100_000), now);
        loads.members[&BackendId::new("d")].store(sample(0, 0), now);
        let _calls: Vec<_> = (0..2).map(|_| loads.start(&BackendId::new("d"))).collect();
        let members = [member("a", 1), member("b", 1), member("c", 1), member("d", 2)];
        let picking = Picking { pick: Pick::LeastLoaded, ..Picking::default() };
        let (order, reason) =
            loads.order(&BackendId::new("p"), &picking, members.iter().collect(), None, &mut StdRng::seed_from_u64(1));
        assert_eq!(names(&order), ["c", "b", "a", "d"], "a lower priority group stays last, however idle");
        assert_eq!(reason, PickReason::LeastLoaded);
    }

    #[test]
    fn a_stale_sample_leaves_the_calls_in_flight_to_rank() {
        let loads = loads(&["a", "b"], Some(Duration::from_millis(100)));
        let long_ago = Instant::now() - Duration::from_secs(1);
        loads.members[&BackendId::new("a")].store(Sample { waiting: 0, running: 0, kv_ppm: 0 }, long_ago);
        let _three: Vec<_> = (0..3).map(|_| loads.start(&BackendId::new("a"))).collect();
        let _one = loads.start(&BackendId::new("b"));
        assert_eq!(loads.seen(&BackendId::new("a")), Seen { sample: None, in_flight: 3, sent_since: 0 });
        let members = [member("a", 1), member("b", 1)];
        let picking = Picking { pick: Pick::LeastLoaded, ..Picking::default() };
        let (order, _) =
            loads.order(&BackendId::new("p"), &picking, members.iter().collect(), None, &mut StdRng::seed_from_u64(1));
        assert_eq!(names(&order), ["b", "a"]);
        drop(_three);
        assert_eq!(loads.seen(&BackendId::new("a")).in_flight, 0, "a call's end counts it out");
    }

    #[test]
    fn saturation_reads_the_queue_the_kv_cache_or_else_the_calls_in_flight() {
        let bound = Saturation { queue: Some(8), kv_cache_ppm: Some(900_000) };
        let fresh = |waiting, kv_ppm| Seen {
            sample: Some(Sample { waiting, running: 30, kv_ppm }),
            in_flight: 50,
            sent_since: 0,
        };
        assert!(!fresh(7, 899_999).saturated(&bound), "running calls and ours are not its queue");
        assert!(fresh(8, 0).saturated(&bound));
        assert!(fresh(0, 900_000).saturated(&bound));
        assert!(Seen { sample: None, in_flight: 8, sent_since: 0 }.saturated(&bound));
        assert!(!Seen { sample: None, in_flight: 7, sent_since: 0 }.saturated(&bound));
        let sent = Seen { sample: Some(Sample { waiting: 6, running: 30, kv_ppm: 0 }), in_flight: 50, sent_since: 2 };
        assert!(sent.saturated(&bound), "calls sent since the sample count into its queue");
    }

    #[test]
    fn calls_sent_since_the_sample_spread_the_next_ones() {
        let loads = loads(&["a", "b"], Some(Duration::from_secs(1)));
        let now = Instant::now();
        loads.members[&BackendId::new("a")].store(Sample { waiting: 0, running: 0, kv_ppm: 0 }, now);
        loads.members[&BackendId::new("b")].store(Sample { waiting: 1, running: 0, kv_ppm: 0 }, now);
        let members = [member("a", 1), member("b", 1)];
        let picking = Picking { pick: Pick::LeastLoaded, ..Picking::default() };
        let mut rng = StdRng::seed_from_u64(2);
        let mut firsts = Vec::new();
        let mut calls = Vec::new();
        for _ in 0..4 {
            let (order, _) = loads.order(&BackendId::new("p"), &picking, members.iter().collect(), None, &mut rng);
            firsts.push(order[0].backend.to_string());
            calls.push(loads.start(&order[0].backend));
        }
        // a: 0 queued, then 1 sent, equal to b's 1 queued: its call in flight breaks the tie.
        assert_eq!(firsts.iter().filter(|m| *m == "a").count(), 2, "{firsts:?}");
        assert_eq!(firsts[0], "a");
    }

    #[test]
    fn latency_prefers_the_faster_of_two_and_measures_the_unmeasured() {
        let loads = loads(&["fast", "slow"], None);
        loads.observe_latency(&BackendId::new("fast"), Duration::from_millis(20));
        loads.observe_latency(&BackendId::new("slow"), Duration::from_millis(400));
        let members = [member("slow", 1), member("fast", 1)];
        let picking = Picking { pick: Pick::Latency, ..Picking::default() };
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..20 {
            let (order, reason) = loads.order(&BackendId::new("p"), &picking, members.iter().collect(), None, &mut rng);
            assert_eq!((names(&order)[0].as_str(), reason), ("fast", PickReason::Latency));
        }
        // Twenty calls in flight make the fast one costlier than the slow one.
        let _busy: Vec<_> = (0..20).map(|_| loads.start(&BackendId::new("fast"))).collect();
        let (order, _) = loads.order(&BackendId::new("p"), &picking, members.iter().collect(), None, &mut rng);
        assert_eq!(names(&order)[0], "slow");
        let unmeasured = self::loads(&["x", "y"], None);
        let members = [member("x", 1), member("y", 1)];
        let firsts = (0..200)
            .filter(|_| {
                let (order, _) =
                    unmeasured.order(&BackendId::new("p"), &picking, members.iter().collect(), None, &mut rng);
                order[0].backend.as_str() == "x"
            })
            .count();
        assert!((60..=140).contains(&firsts), "x first {firsts} times of 200");
    }

    #[test]
    fn the_peak_is_taken_at_once_and_forgotten_slowly() {
        let mut ewma = PeakEwma::default();
        let t0 = Instant::now();
        ewma.observe(Duration::from_millis(100), t0);
        ewma.observe(Duration::from_millis(900), t0 + Duration::from_millis(10));
        assert!((ewma.estimate(t0) - 0.9).abs() < 1e-9);
        ewma.observe(Duration::from_millis(100), t0 + Duration::from_secs(10));
        let after = ewma.estimate(t0);
        assert!(after > 0.1 && after < 0.9, "{after}");
    }

    #[test]
    fn a_remembered_prefix_leads_its_group_unless_saturated() {
        let mut loads = loads(&["a", "b"], Some(Duration::from_secs(1)));
        loads.affinity.insert(BackendId::new("p"), Mutex::new(PrefixTable::default()));
        let pool = BackendId::new("p");
        let members = [member("a", 1), member("b", 1)];
        let bound = Saturation { queue: Some(2), kv_cache_ppm: None };
        let picking = Picking { pick: Pick::LeastLoaded, prefix_bytes: Some(4096), saturation: Some(bound) };
        let mut rng = StdRng::seed_from_u64(5);
        let _one = loads.start(&BackendId::new("b"));
        let first = |loads: &Loads, rng: &mut StdRng| {
            let (order, reason) = loads.order(&pool, &picking, members.iter().collect(), Some(42), rng);
            (order[0].backend.to_string(), reason)
        };
        assert_eq!(first(&loads, &mut rng), ("a".into(), PickReason::LeastLoaded));
        loads.served_prefix(&pool, 42, &BackendId::new("b"));
        assert_eq!(first(&loads, &mut rng), ("b".into(), PickReason::CacheAffinity));
        let _more = loads.start(&BackendId::new("b"));
        assert_eq!(first(&loads, &mut rng), ("a".into(), PickReason::LeastLoaded), "b is saturated");
    }

    #[test]
    fn the_prefix_table_forgets_its_oldest_first() {
        let mut table = PrefixTable::default();
        for prefix in 0..(AFFINITY_ENTRIES as u64 + 10) {
            table.insert(prefix, BackendId::new("m"));
        }
        assert_eq!(table.map.len(), AFFINITY_ENTRIES);
        assert!(table.get(0).is_none() && table.get(9).is_none() && table.get(10).is_some());
    }
}
