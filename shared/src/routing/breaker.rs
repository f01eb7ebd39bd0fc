//! Per-backend circuit breakers (SPEC §5).
//!
//! Each gateway instance keeps its own breakers, so across instances they are
//! approximate: a protection for the backend and for our callers' latency, not a
//! counter anyone reconciles. Time is always passed in (`now`): the state machine is
//! deterministic and testable without sleeping. Calls reach it through one `tower`
//! layer only ([`BreakerLayer`]), which reads the clock.
//!
//! Invariants:
//! - an open breaker admits nobody until its trip ends;
//! - a half-open breaker admits one probe at a time, and a probe that never reports back
//!   (its caller was dropped) does not wedge the breaker: after `trip` another is allowed;
//! - memory per backend is bounded whatever the traffic: the failure-count window keeps
//!   at most `n` instants, the ratio window at most [`RATIO_BUCKETS`] buckets.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use foldhash::HashMap;

use crate::config::{BackendId, BreakerPolicy, BreakerTrigger};

mod layer;

pub use layer::{BreakerLayer, Call, Classify, Pass, Passed, Refused};

/// The ratio window is kept as this many buckets per `interval`: outcomes are counted,
/// not stored, so a busy backend costs no more memory than an idle one. The price is
/// that an outcome may leave the window up to `interval / RATIO_BUCKETS` early.
const RATIO_BUCKETS: u32 = 64;

/// What a call to a backend came to, as the breaker sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// An HTTP answer. `retry_after` is the backend's `Retry-After`, when it sent one.
    Status {
        status: u16,
        retry_after: Option<Duration>,
    },
    ConnectionError,
    Timeout,
}

impl Outcome {
    fn retry_after(self) -> Option<Duration> {
        match self {
            Outcome::Status { retry_after, .. } => retry_after,
            Outcome::Success | Outcome::ConnectionError | Outcome::Timeout => None,
        }
    }

    /// Connection errors and timeouts always count; a status counts when it falls in one
    /// of the policy's ranges. Anything else (a 4xx outside them, say) is the caller's
    /// problem, not the backend's health.
    fn is_failure(self, policy: &BreakerPolicy) -> bool {
        match self {
            Outcome::Success => false,
            Outcome::ConnectionError | Outcome::Timeout => true,
            Outcome::Status { status, .. } => policy.status.iter().any(|&(lo, hi)| (lo..=hi).contains(&status)),
        }
    }
}

/// A breaker's state, as metrics and routing see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }

    /// The value of a state gauge: 0 closed, 1 open, 2 half-open.
    pub fn gauge_value(self) -> u8 {
        match self {
            State::Closed => 0,
            State::Open => 1,
            State::HalfOpen => 2,
        }
    }
}

/// Whether a call may go to a backend now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    Yes,
    /// The breaker is half-open and this call is its one trial: report its outcome.
    Probe,
    /// The breaker is open (or a probe is in flight): skip this backend.
    No,
}

/// The breakers of every declared backend.
pub struct Breakers {
    breakers: Mutex<HashMap<BackendId, Breaker>>,
}

impl Breakers {
    pub fn new(policies: impl IntoIterator<Item = (BackendId, BreakerPolicy)>) -> Self {
        let breakers = policies.into_iter().map(|(backend, policy)| (backend, Breaker::new(policy))).collect();
        Breakers { breakers: Mutex::new(breakers) }
    }

    /// Whether a call may go to `backend`. A `Probe` answer reserves the half-open
    /// breaker's one trial for this caller. An unknown backend is always admitted.
    fn admit(&self, backend: &BackendId, now: Instant) -> Admit {
        self.with(backend, |b| b.admit(now)).unwrap_or(Admit::Yes)
    }

    /// Records the outcome of a call to `backend`. Unknown backends are ignored.
    fn record(&self, backend: &BackendId, outcome: Outcome, now: Instant) {
        self.with(backend, |b| b.record(outcome, now));
    }

    /// The state of `backend`'s breaker (`Closed` for an unknown backend).
    pub fn state(&self, backend: &BackendId, now: Instant) -> State {
        self.with(backend, |b| b.state(now)).unwrap_or(State::Closed)
    }

    /// Every breaker's state, ordered by backend name.
    pub fn states(&self, now: Instant) -> Vec<(BackendId, State)> {
        let mut breakers = self.lock();
        let mut states: Vec<(BackendId, State)> =
            breakers.iter_mut().map(|(backend, b)| (backend.clone(), b.state(now))).collect();
        states.sort_by(|a, b| a.0.cmp(&b.0));
        states
    }

    fn with<T>(&self, backend: &BackendId, f: impl FnOnce(&mut Breaker) -> T) -> Option<T> {
        self.lock().get_mut(backend).map(f)
    }

    /// Takes over, from the breakers of a configuration being replaced, the state of
    /// every backend whose policy is unchanged: a reload neither closes an open
    /// breaker nor forgets the failures counted towards one.
    pub fn carry_from(&self, previous: &Breakers) {
        let previous = previous.lock();
        let mut breakers = self.lock();
        for (backend, breaker) in breakers.iter_mut() {
            if let Some(old) = previous.get(backend).filter(|old| old.policy == breaker.policy) {
                *breaker = old.clone();
            }
        }
    }

    /// A poisoned lock still holds consistent breakers: nothing here panics while
    /// holding it, and a breaker is only ever a protection, so keep going.
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<BackendId, Breaker>> {
        self.breakers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Clone)]
struct Breaker {
    policy: BreakerPolicy,
    phase: Phase,
    window: Window,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Closed,
    Open {
        until: Instant,
    },
    /// `probe`: when the current trial call was admitted, if one is in flight.
    HalfOpen {
        probe: Option<Instant>,
    },
}

impl Breaker {
    fn new(policy: BreakerPolicy) -> Self {
        let window = match policy.trigger {
            BreakerTrigger::Failures(_) => Window::Failures(VecDeque::new()),
            BreakerTrigger::Ratio { .. } => Window::Ratio(VecDeque::new()),
        };
        Breaker { policy, phase: Phase::Closed, window }
    }

    /// Open → half-open once the trip has run its course.
    fn advance(&mut self, now: Instant) {
        if let Phase::Open { until } = self.phase
            && now >= until
        {
            self.phase = Phase::HalfOpen { probe: None };
        }
    }

    fn state(&mut self, now: Instant) -> State {
        self.advance(now);
        match self.phase {
            Phase::Closed => State::Closed,
            Phase::Open { .. } => State::Open,
            Phase::HalfOpen { .. } => State::HalfOpen,
        }
    }

    fn admit(&mut self, now: Instant) -> Admit {
        self.advance(now);
        match self.phase {
            Phase::Closed => Admit::Yes,
            Phase::Open { .. } => Admit::No,
            Phase::HalfOpen { probe: Some(since) } if now.saturating_duration_since(since) < self.policy.trip => {
                Admit::No
            }
            // No probe in flight, or the last one never reported back: a new trial.
            Phase::HalfOpen { .. } => {
                self.phase = Phase::HalfOpen { probe: Some(now) };
                Admit::Probe
            }
        }
    }

    fn record(&mut self, outcome: Outcome, now: Instant) {
        self.advance(now);
        let failure = outcome.is_failure(&self.policy);
        // `Retry-After: 0` asks for nothing: it is not a reason to trip.
        let retry_after = outcome.retry_after().filter(|d| self.policy.accept_retry_after && !d.is_zero());
        match self.phase {
            Phase::Closed => {
                if let Some(wait) = retry_after {
                    self.trip(now, wait);
                    return;
                }
                self.window.prune(now, self.policy.interval);
                self.window.push(now, failure, &self.policy);
                if self.window.should_trip(&self.policy.trigger) {
                    self.trip(now, self.policy.trip);
                }
            }
            Phase::Open { until } => {
                // A straggler admitted before the trip. Only a longer Retry-After matters:
                // an open breaker is never shortened.
                if let Some(wait) = retry_after {
                    self.phase = Phase::Open { until: until.max(later(now, wait)) };
                }
            }
            // Whatever reports while half-open is taken as the trial's answer.
            Phase::HalfOpen { .. } => match retry_after {
                Some(wait) => self.trip(now, wait),
                None if failure => self.trip(now, self.policy.trip),
                None => {
                    self.phase = Phase::Closed;
                    self.window.clear();
                }
            },
        }
    }

    fn trip(&mut self, now: Instant, wait: Duration) {
        self.phase = Phase::Open { until: later(now, wait) };
        self.window.clear();
    }
}

/// `now + wait`, saturating far in the future rather than overflowing `Instant` (a
/// backend may send an absurd `Retry-After`).
fn later(now: Instant, wait: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    now.checked_add(wait).or_else(|| now.checked_add(CENTURY)).unwrap_or(now)
}

/// The recent outcomes a trigger looks at, pruned to the last `interval`.
#[derive(Clone)]
enum Window {
    /// Instants of the most recent failures (at most `n` of them: older ones cannot
    /// change the verdict).
    Failures(VecDeque<Instant>),
    /// Outcome counts in buckets of `interval / RATIO_BUCKETS`, oldest first.
    Ratio(VecDeque<Bucket>),
}

#[derive(Clone)]
struct Bucket {
    start: Instant,
    failures: u64,
    total: u64,
}

impl Window {
    /// Drops what is `interval` old or older.
    fn prune(&mut self, now: Instant, interval: Duration) {
        let expired = |t: Instant| now.saturating_duration_since(t) >= interval;
        match self {
            Window::Failures(instants) => {
                while instants.front().is_some_and(|&t| expired(t)) {
                    instants.pop_front();
                }
            }
            Window::Ratio(buckets) => {
                while buckets.front().is_some_and(|b| expired(b.start)) {
                    buckets.pop_front();
                }
            }
        }
    }

    fn push(&mut self, now: Instant, failure: bool, policy: &BreakerPolicy) {
        match (self, &policy.trigger) {
            (Window::Failures(instants), BreakerTrigger::Failures(n)) => {
                if failure {
                    instants.push_back(now);
                    while instants.len() > threshold(*n) {
                        instants.pop_front();
                    }
                }
            }
            (Window::Ratio(buckets), _) => {
                let width = policy.interval / RATIO_BUCKETS;
                let current = match buckets.back_mut() {
                    Some(last) if now.saturating_duration_since(last.start) <= width => last,
                    _ => {
                        buckets.push_back(Bucket { start: now, failures: 0, total: 0 });
                        let Some(last) = buckets.back_mut() else {
                            return;
                        };
                        last
                    }
                };
                current.total += 1;
                current.failures += u64::from(failure);
            }
            // The window's shape follows the trigger (`Breaker::new`).
            (Window::Failures(_), BreakerTrigger::Ratio { .. }) => {}
        }
    }

    fn should_trip(&self, trigger: &BreakerTrigger) -> bool {
        match (self, trigger) {
            (Window::Failures(instants), BreakerTrigger::Failures(n)) => instants.len() >= threshold(*n),
            (Window::Ratio(buckets), BreakerTrigger::Ratio { ratio_ppm, min_requests }) => {
                let (failures, total) = buckets.iter().fold((0u64, 0u64), |(f, t), b| (f + b.failures, t + b.total));
                // Never trip on successes alone, whatever the configured ratio.
                failures > 0
                    && total >= u64::from(*min_requests)
                    && failures * 1_000_000 >= u64::from(*ratio_ppm) * total
            }
            _ => false,
        }
    }

    fn clear(&mut self) {
        match self {
            Window::Failures(instants) => instants.clear(),
            Window::Ratio(buckets) => buckets.clear(),
        }
    }
}

/// Failures needed to trip; `failures: 0` (refused at load) is read as 1.
fn threshold(n: u32) -> usize {
    usize::try_from(n.max(1)).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);
    const MS: Duration = Duration::from_millis(1);

    fn failures(n: u32) -> BreakerPolicy {
        BreakerPolicy {
            trigger: BreakerTrigger::Failures(n),
            interval: 60 * SEC,
            trip: 30 * SEC,
            status: vec![(500, 599)],
            accept_retry_after: false,
        }
    }

    fn ratio(ratio_ppm: u32, min_requests: u32) -> BreakerPolicy {
        BreakerPolicy { trigger: BreakerTrigger::Ratio { ratio_ppm, min_requests }, ..failures(1) }
    }

    fn status(status: u16) -> Outcome {
        Outcome::Status { status, retry_after: None }
    }

    fn retry(status: u16, after: Duration) -> Outcome {
        Outcome::Status { status, retry_after: Some(after) }
    }

    fn one(policy: BreakerPolicy) -> (Breakers, BackendId) {
        let id = BackendId::new("b");
        (Breakers::new([(id.clone(), policy)]), id)
    }

    /// Open with the default `trip` (30 s) at `t0`: a failure-count breaker of 1.
    fn tripped(t0: Instant) -> (Breakers, BackendId) {
        let (breakers, id) = one(failures(1));
        breakers.record(&id, Outcome::ConnectionError, t0);
        assert_eq!(breakers.state(&id, t0), State::Open);
        (breakers, id)
    }

    #[test]
    fn opens_after_n_failures_within_interval() {
        let (breakers, id) = one(failures(3));
        let t0 = Instant::now();
        breakers.record(&id, status(500), t0);
        breakers.record(&id, Outcome::Timeout, t0 + 10 * SEC);
        assert_eq!(breakers.state(&id, t0 + 10 * SEC), State::Closed);
        assert_eq!(breakers.admit(&id, t0 + 10 * SEC), Admit::Yes);
        breakers.record(&id, Outcome::ConnectionError, t0 + 59 * SEC);
        assert_eq!(breakers.state(&id, t0 + 59 * SEC), State::Open);
        assert_eq!(breakers.admit(&id, t0 + 59 * SEC), Admit::No);
    }

    #[test]
    fn successes_do_not_reset_the_failure_count() {
        let (breakers, id) = one(failures(2));
        let t0 = Instant::now();
        breakers.record(&id, status(502), t0);
        breakers.record(&id, Outcome::Success, t0 + SEC);
        breakers.record(&id, status(200), t0 + 2 * SEC);
        breakers.record(&id, status(502), t0 + 3 * SEC);
        assert_eq!(breakers.state(&id, t0 + 3 * SEC), State::Open);
    }

    #[test]
    fn failures_spread_beyond_interval_do_not_trip() {
        let (breakers, id) = one(failures(3));
        let t0 = Instant::now();
        for k in 0..10u32 {
            // Every 30 s: at most two failures in any 60 s window.
            let t = t0 + 30 * SEC * k;
            breakers.record(&id, status(500), t);
            assert_eq!(breakers.state(&id, t), State::Closed, "failure {k}");
        }
    }

    #[test]
    fn a_failure_exactly_interval_old_has_left_the_window() {
        let (breakers, id) = one(failures(2));
        let t0 = Instant::now();
        breakers.record(&id, status(500), t0);
        breakers.record(&id, status(500), t0 + 60 * SEC);
        assert_eq!(breakers.state(&id, t0 + 60 * SEC), State::Closed);
        breakers.record(&id, status(500), t0 + 60 * SEC + MS);
        assert_eq!(breakers.state(&id, t0 + 60 * SEC + MS), State::Open);
    }

    #[test]
    fn ratio_trigger_waits_for_min_requests() {
        let (breakers, id) = one(ratio(500_000, 4));
        let t0 = Instant::now();
        breakers.record(&id, status(500), t0);
        breakers.record(&id, status(500), t0 + SEC);
        breakers.record(&id, status(500), t0 + 2 * SEC);
        // 3 of 3 failed, but fewer than 4 requests.
        assert_eq!(breakers.state(&id, t0 + 2 * SEC), State::Closed);
        breakers.record(&id, Outcome::Success, t0 + 3 * SEC);
        // 3 of 4 ≥ 50%.
        assert_eq!(breakers.state(&id, t0 + 3 * SEC), State::Open);
    }

    #[test]
    fn ratio_trigger_stays_closed_below_the_ratio() {
        let (breakers, id) = one(ratio(500_000, 4));
        let t0 = Instant::now();
        for k in 0..20u32 {
            let outcome = if k % 3 == 2 { status(503) } else { Outcome::Success };
            breakers.record(&id, outcome, t0 + SEC * k);
        }
        // At most a third failed at any point: 6 of 20 in the end.
        assert_eq!(breakers.state(&id, t0 + 19 * SEC), State::Closed);
    }

    #[test]
    fn ratio_trigger_trips_exactly_at_the_ratio() {
        let (breakers, id) = one(ratio(500_000, 2));
        let t0 = Instant::now();
        breakers.record(&id, Outcome::Success, t0);
        breakers.record(&id, Outcome::Timeout, t0 + SEC);
        assert_eq!(breakers.state(&id, t0 + SEC), State::Open);
    }

    #[test]
    fn ratio_trigger_forgets_outcomes_older_than_interval() {
        let (breakers, id) = one(ratio(500_000, 4));
        let t0 = Instant::now();
        for k in 0..3u32 {
            breakers.record(&id, status(500), t0 + SEC * k);
        }
        // A minute later the three failures have left the window: 1 of 1 < min_requests.
        breakers.record(&id, status(500), t0 + 70 * SEC);
        assert_eq!(breakers.state(&id, t0 + 70 * SEC), State::Closed);
    }

    #[test]
    fn ratio_trigger_never_trips_on_successes() {
        let (breakers, id) = one(ratio(0, 1));
        let t0 = Instant::now();
        breakers.record(&id, Outcome::Success, t0);
        assert_eq!(breakers.state(&id, t0), State::Closed);
    }

    #[test]
    fn counts_5xx_but_not_4xx_by_default() {
        let (breakers, id) = one(failures(1));
        let t0 = Instant::now();
        for code in [400, 401, 404, 422, 429, 499, 200, 301] {
            breakers.record(&id, status(code), t0);
            assert_eq!(breakers.state(&id, t0), State::Closed, "status {code}");
        }
        breakers.record(&id, status(503), t0);
        assert_eq!(breakers.state(&id, t0), State::Open);
    }

    #[test]
    fn custom_status_ranges_decide_what_fails() {
        let policy = BreakerPolicy { status: vec![(502, 504)], ..failures(1) };
        let t0 = Instant::now();
        for (code, counts) in [(500, false), (501, false), (502, true), (503, true), (504, true), (505, false)] {
            let (breakers, id) = one(policy.clone());
            breakers.record(&id, status(code), t0);
            let expected = if counts { State::Open } else { State::Closed };
            assert_eq!(breakers.state(&id, t0), expected, "status {code}");
        }
        // Connection errors and timeouts count whatever the ranges.
        for outcome in [Outcome::ConnectionError, Outcome::Timeout] {
            let (breakers, id) = one(policy.clone());
            breakers.record(&id, outcome, t0);
            assert_eq!(breakers.state(&id, t0), State::Open, "{outcome:?}");
        }
    }

    #[test]
    fn stays_open_for_trip_then_half_opens() {
        let t0 = Instant::now();
        let (breakers, id) = tripped(t0);
        assert_eq!(breakers.admit(&id, t0 + 30 * SEC - MS), Admit::No);
        assert_eq!(breakers.state(&id, t0 + 30 * SEC - MS), State::Open);
        assert_eq!(breakers.state(&id, t0 + 30 * SEC), State::HalfOpen);
        assert_eq!(breakers.admit(&id, t0 + 30 * SEC), Admit::Probe);
    }

    #[test]
    fn half_open_admits_a_single_probe_at_a_time() {
        let t0 = Instant::now();
        let (breakers, id) = tripped(t0);
        let t1 = t0 + 30 * SEC;
        assert_eq!(breakers.admit(&id, t1), Admit::Probe);
        assert_eq!(breakers.admit(&id, t1), Admit::No);
        assert_eq!(breakers.admit(&id, t1 + 10 * SEC), Admit::No);
        assert_eq!(breakers.state(&id, t1 + 10 * SEC), State::HalfOpen);
    }

    #[test]
    fn a_lost_probe_does_not_wedge_the_breaker() {
        let t0 = Instant::now();
        let (breakers, id) = tripped(t0);
        let t1 = t0 + 30 * SEC;
        assert_eq!(breakers.admit(&id, t1), Admit::Probe);
        // The probe's caller went away without recording anything.
        assert_eq!(breakers.admit(&id, t1 + 30 * SEC - MS), Admit::No);
        assert_eq!(breakers.admit(&id, t1 + 30 * SEC), Admit::Probe);
        assert_eq!(breakers.admit(&id, t1 + 30 * SEC), Admit::No);
    }

    #[test]
    fn probe_success_closes_with_a_clean_window() {
        let (breakers, id) = one(failures(2));
        let t0 = Instant::now();
        breakers.record(&id, status(500), t0);
        breakers.record(&id, status(500), t0);
        let t1 = t0 + 30 * SEC;
        assert_eq!(breakers.admit(&id, t1), Admit::Probe);
        breakers.record(&id, Outcome::Success, t1 + SEC);
        assert_eq!(breakers.state(&id, t1 + SEC), State::Closed);
        assert_eq!(breakers.admit(&id, t1 + SEC), Admit::Yes);
        // The failures before the trip are forgotten: one more does not trip.
        breakers.record(&id, status(500), t1 + 2 * SEC);
        assert_eq!(breakers.state(&id, t1 + 2 * SEC), State::Closed);
    }

    #[test]
    fn probe_4xx_counts_as_success() {
        let t0 = Instant::now();
        let (breakers, id) = tripped(t0);
        let t1 = t0 + 30 * SEC;
        assert_eq!(breakers.admit(&id, t1), Admit::Probe);
        breakers.record(&id, status(400), t1);
        assert_eq!(breakers.state(&id, t1), State::Closed);
    }

    #[test]
    fn probe_failure_reopens_for_trip() {
        let t0 = Instant::now();
        let (breakers, id) = tripped(t0);
        let t1 = t0 + 30 * SEC;
        assert_eq!(breakers.admit(&id, t1), Admit::Probe);
        breakers.record(&id, Outcome::Timeout, t1 + 5 * SEC);
        let reopened = t1 + 5 * SEC;
        assert_eq!(breakers.state(&id, reopened), State::Open);
        assert_eq!(breakers.admit(&id, reopened + 30 * SEC - MS), Admit::No);
        assert_eq!(breakers.admit(&id, reopened + 30 * SEC), Admit::Probe);
    }

    #[test]
    fn probe_failure_with_retry_after_reopens_for_that_long() {
        let (breakers, id) = one(BreakerPolicy { accept_retry_after: true, ..failures(1) });
        let t0 = Instant::now();
        breakers.record(&id, status(500), t0);
        let t1 = t0 + 30 * SEC;
        assert_eq!(breakers.admit(&id, t1), Admit::Probe);
        breakers.record(&id, retry(503, 120 * SEC), t1);
        assert_eq!(breakers.state(&id, t1 + 120 * SEC - MS), State::Open);
        assert_eq!(breakers.state(&id, t1 + 120 * SEC), State::HalfOpen);
    }

    #[test]
    fn accept_retry_after_trips_for_exactly_the_given_duration() {
        for code in [429, 503] {
            let (breakers, id) = one(BreakerPolicy { accept_retry_after: true, ..failures(5) });
            let t0 = Instant::now();
            let wait = 7 * SEC;
            breakers.record(&id, retry(code, wait), t0);
            assert_eq!(breakers.state(&id, t0), State::Open, "status {code}");
            assert_eq!(breakers.admit(&id, t0 + wait - MS), Admit::No, "status {code}");
            assert_eq!(breakers.state(&id, t0 + wait - MS), State::Open, "status {code}");
            assert_eq!(breakers.state(&id, t0 + wait), State::HalfOpen, "status {code}");
            assert_eq!(breakers.admit(&id, t0 + wait), Admit::Probe, "status {code}");
        }
    }

    #[test]
    fn retry_after_longer_than_trip_is_honoured() {
        let (breakers, id) = one(BreakerPolicy { accept_retry_after: true, ..failures(5) });
        let t0 = Instant::now();
        breakers.record(&id, retry(429, 3600 * SEC), t0);
        assert_eq!(breakers.state(&id, t0 + 3600 * SEC - MS), State::Open);
        assert_eq!(breakers.state(&id, t0 + 3600 * SEC), State::HalfOpen);
    }

    #[test]
    fn a_late_retry_after_never_shortens_an_open_breaker() {
        let (breakers, id) = one(BreakerPolicy { accept_retry_after: true, ..failures(1) });
        let t0 = Instant::now();
        breakers.record(&id, status(500), t0);
        // A straggler admitted before the trip answers with a short Retry-After.
        breakers.record(&id, retry(503, SEC), t0 + SEC);
        assert_eq!(breakers.state(&id, t0 + 29 * SEC), State::Open);
        // ... and a longer one extends it.
        breakers.record(&id, retry(503, 60 * SEC), t0 + 2 * SEC);
        assert_eq!(breakers.state(&id, t0 + 62 * SEC - MS), State::Open);
        assert_eq!(breakers.state(&id, t0 + 62 * SEC), State::HalfOpen);
    }

    #[test]
    fn an_absurd_retry_after_does_not_overflow() {
        let (breakers, id) = one(BreakerPolicy { accept_retry_after: true, ..failures(1) });
        let t0 = Instant::now();
        breakers.record(&id, retry(503, Duration::MAX), t0);
        assert_eq!(breakers.state(&id, t0 + 3600 * SEC), State::Open);
    }

    #[test]
    fn retry_after_zero_does_not_trip() {
        let (breakers, id) = one(BreakerPolicy { accept_retry_after: true, ..failures(5) });
        let t0 = Instant::now();
        breakers.record(&id, retry(429, Duration::ZERO), t0);
        assert_eq!(breakers.state(&id, t0), State::Closed);
    }

    #[test]
    fn retry_after_is_ignored_unless_accepted() {
        let (breakers, id) = one(failures(2));
        let t0 = Instant::now();
        breakers.record(&id, retry(429, 10 * SEC), t0);
        assert_eq!(breakers.state(&id, t0), State::Closed);
        assert_eq!(breakers.admit(&id, t0), Admit::Yes);
        // A 503 with Retry-After still counts as one failure, and only one.
        breakers.record(&id, retry(503, 10 * SEC), t0 + SEC);
        assert_eq!(breakers.state(&id, t0 + SEC), State::Closed);
        breakers.record(&id, status(503), t0 + 2 * SEC);
        assert_eq!(breakers.state(&id, t0 + 2 * SEC), State::Open);
        // Open for `trip`, not for the Retry-After.
        assert_eq!(breakers.state(&id, t0 + 32 * SEC - MS), State::Open);
        assert_eq!(breakers.state(&id, t0 + 32 * SEC), State::HalfOpen);
    }

    #[test]
    fn unknown_backend_is_admitted_and_ignored() {
        let (breakers, _) = one(failures(1));
        let other = BackendId::new("other");
        let t0 = Instant::now();
        breakers.record(&other, Outcome::ConnectionError, t0);
        assert_eq!(breakers.admit(&other, t0), Admit::Yes);
        assert_eq!(breakers.state(&other, t0), State::Closed);
        assert_eq!(breakers.states(t0), vec![(BackendId::new("b"), State::Closed)]);
    }

    #[test]
    fn states_reports_every_backend_in_name_order() {
        let breakers = Breakers::new([
            (BackendId::new("c"), failures(1)),
            (BackendId::new("a"), failures(1)),
            (BackendId::new("b"), failures(1)),
        ]);
        let t0 = Instant::now();
        breakers.record(&BackendId::new("a"), Outcome::Timeout, t0);
        breakers.record(&BackendId::new("c"), Outcome::Timeout, t0);
        let t1 = t0 + 30 * SEC;
        assert_eq!(breakers.admit(&BackendId::new("c"), t1), Admit::Probe);
        breakers.record(&BackendId::new("a"), Outcome::Timeout, t1);
        let states = breakers.states(t1);
        assert_eq!(
            states,
            vec![
                (BackendId::new("a"), State::Open),
                (BackendId::new("b"), State::Closed),
                (BackendId::new("c"), State::HalfOpen),
            ]
        );
        let gauges: Vec<(&str, u8)> = states.iter().map(|(_, s)| (s.as_str(), s.gauge_value())).collect();
        assert_eq!(gauges, vec![("open", 1), ("closed", 0), ("half_open", 2)]);
    }

    #[test]
    fn failure_window_memory_is_bounded() {
        let (breakers, id) = one(failures(3));
        let t0 = Instant::now();
        // Never trips (one failure per 30 s), however long it runs.
        for k in 0..1000u32 {
            breakers.record(&id, status(500), t0 + 30 * SEC * k);
        }
        let guard = breakers.lock();
        let Some(Window::Failures(instants)) = guard.get(&id).map(|b| &b.window) else {
            unreachable!("a failure-count breaker")
        };
        assert!(instants.len() <= 3, "{} instants kept", instants.len());
    }

    #[test]
    fn ratio_window_memory_is_bounded() {
        let (breakers, id) = one(ratio(900_000, 10));
        let t0 = Instant::now();
        for k in 0..100_000u32 {
            let outcome = if k % 10 == 0 { status(500) } else { Outcome::Success };
            breakers.record(&id, outcome, t0 + MS * k);
        }
        assert_eq!(breakers.state(&id, t0 + MS * 100_000), State::Closed);
        let guard = breakers.lock();
        let Some(Window::Ratio(buckets)) = guard.get(&id).map(|b| &b.window) else { unreachable!("a ratio breaker") };
        assert!(buckets.len() <= RATIO_BUCKETS as usize + 1, "{} buckets kept", buckets.len());
    }
}
