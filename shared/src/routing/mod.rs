//! Routing: which backends may serve a call, in which order (SPEC §4, §5).
//!
//! The choice is declarative: default, then the tenant's and the agent's overrides,
//! then the capability override, sensitivity, and the soft-cap switch. Neither
//! latency, content nor the requested model chooses. The result is an ordered chain
//! of endpoint backends: pools expanded (best priority group first, weighted order
//! inside a group), then the declared fallbacks, each backend at most once, each able
//! to serve the request's capability. Invariant: a sensitive call's chain holds only
//! internal backends (the header narrows routing, never widens it).
//!
//! Session affinity (`ai.affinity`, off by default): a call carrying a session value
//! orders each pool's priority groups by weighted rendezvous hashing of that value
//! instead of at random, so the same session starts at the same member while the
//! pool is unchanged; a member that is unhealthy (breaker open, failing) is passed by
//! the dispatcher as usual, to the session's next member in the same order. Adding a
//! member moves only the sessions that now rank it first (about 1/n of them).

pub mod breaker;
pub mod endpoint_picker;
pub mod pick;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rand::Rng;

use crate::call::{Criticality, PickReason};
use crate::config::{Backend, BackendId, BackendKind, Capability, Config, FailureMode, PoolMember};
use crate::error::GatewayError;
use crate::identity::Caller;
use pick::Loads;

/// What routing needs to know about a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRequest {
    pub capability: Capability,
    /// The sensitivity header was true: internal backends only.
    pub sensitive: bool,
    /// A budget reached its soft threshold: switch to the soft backend.
    pub soft: bool,
    /// The session's affinity key ([`affinity_key`]), when `ai.affinity` is on and the
    /// call carries its header: pools order their members by it.
    pub affinity: Option<u64>,
    /// The hash of the prompt's first bytes ([`prefix_key`]), when a pool has
    /// `cache_affinity`.
    pub prefix: Option<u64>,
    /// The call's class, already lowered to its caller's `max_criticality`.
    pub criticality: Criticality,
    /// Where it may be processed.
    pub residency: Residency,
    /// The backend the route starts from, named by the gateway itself (a cache
    /// policy's `embed` backend), before any other step; the filters still apply.
    pub entry: Option<BackendId>,
}

/// The jurisdictions a call may be processed in (SPEC §4): its tenant's and agent's
/// `residency`, narrowed by its `Flexway-Jurisdiction` header. A filter on every
/// routing step, like sensitivity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Residency(Option<BTreeSet<String>>);

impl Residency {
    /// The request header that narrows a call's jurisdictions.
    pub const HEADER: &str = "flexway-jurisdiction";
    /// No restriction.
    pub const ANY: Residency = Residency(None);

    /// The caller's residency (`Config::limits`), narrowed by the header: a
    /// comma-separated list, its lines read as one list. A value that is not such a
    /// list is refused, never read as no restriction.
    pub fn of_call(
        caller: Option<&BTreeSet<String>>,
        headers: &http::HeaderMap,
    ) -> Result<Residency, crate::call::InvalidRequest> {
        let mut asked = BTreeSet::new();
        let mut present = false;
        for value in headers.get_all(Self::HEADER) {
            present = true;
            for label in value.to_str().unwrap_or("\u{0}").split(',').map(str::trim) {
                if !crate::config::is_jurisdiction(label) {
                    return Err(crate::call::InvalidRequest {
                        message: "Flexway-Jurisdiction must be a comma-separated list of jurisdictions (letters, \
                                  digits, `.`, `_`, `-`)"
                            .into(),
                        param: None,
                    });
                }
                asked.insert(label.to_ascii_lowercase());
            }
        }
        Ok(Residency(match (caller, present) {
            (Some(bound), true) => Some(bound.intersection(&asked).cloned().collect()),
            (None, true) => Some(asked),
            (bound, false) => bound.cloned(),
        }))
    }

    /// Whether `backend` may serve: any backend without a restriction; otherwise one
    /// whose jurisdiction is allowed.
    pub fn allows(&self, backend: &Backend) -> bool {
        match &self.0 {
            None => true,
            Some(allowed) => backend.jurisdiction.as_ref().is_some_and(|j| allowed.contains(j)),
        }
    }

    /// Whether an answer produced in `jurisdiction` may serve the call (a cached one:
    /// SPEC §16), by the rule of [`Residency::allows`].
    pub fn allows_jurisdiction(&self, jurisdiction: Option<&str>) -> bool {
        match &self.0 {
            None => true,
            Some(allowed) => jurisdiction.is_some_and(|j| allowed.contains(j)),
        }
    }

    pub fn is_any(&self) -> bool {
        self.0.is_none()
    }

    /// The refusal when nothing allowed can serve.
    pub fn unavailable(&self) -> GatewayError {
        let allowed = match &self.0 {
            Some(set) if !set.is_empty() => set.iter().cloned().collect::<Vec<_>>().join(", "),
            _ => "none: the caller's residency and Flexway-Jurisdiction share no jurisdiction".into(),
        };
        GatewayError::ResidencyUnavailable { allowed }
    }
}

/// The key of a prompt's beginning for `cache_affinity`: a stable hash of its first
/// `prefix_bytes` bytes, or of the whole prompt if shorter.
pub fn prefix_key(prompt: &[u8]) -> u64 {
    mix(fnv1a(prompt))
}

/// The affinity key of a call: a stable 64-bit hash of the value of the affinity
/// header (the first one, if repeated), `None` when affinity is off or the header is
/// absent or empty. Stable across processes and releases, so that every instance of a
/// fleet sends a session to the same member.
pub fn affinity_key(headers: &http::HeaderMap, affinity: Option<&crate::config::Affinity>) -> Option<u64> {
    let value = headers.get(affinity?.header.as_str())?.as_bytes();
    (!value.is_empty()).then(|| mix(fnv1a(value)))
}

/// FNV-1a, 64 bits: a stable hash of a few bytes (names, session values).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// SplitMix64's finaliser: spreads the bits of a hash evenly.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Weighted rendezvous score of `member` for the session `key`: `weight / -ln(u)`,
/// `u` uniform in (0, 1) from the pair's hash. The member with the highest score
/// serves; each member wins a share of sessions proportional to its weight.
fn rendezvous_score(key: u64, member: &PoolMember) -> f64 {
    let hash = mix(key ^ fnv1a(member.backend.as_str().as_bytes()));
    // 53 bits, and never 0: u in (0, 1].
    let unit = ((hash >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let ln = -unit.ln();
    if ln <= 0.0 { f64::INFINITY } else { f64::from(member.weight.max(1)) / ln }
}

/// What declares an operation, for its route ([`Router::route_operation`]).
#[derive(Debug, Clone, Copy)]
pub enum Declared<'a> {
    /// A gRPC service: the `kind: grpc` backends whose descriptor set declares it.
    Service(&'a str),
    /// A REST operation under `owner`'s mount: the owner, then every `kind: http`
    /// backend whose contract declares the same operation metered the same way.
    Rest { owner: &'a BackendId, operation: &'a crate::config::contract::RestOperation },
}

/// The candidates for a call, in order.
#[derive(Debug, Clone)]
pub struct Route {
    pub candidates: Vec<Candidate>,
    /// The entry was a pool (an exhausted route is `pool_exhausted`).
    pub via_pool: bool,
    /// The prompt's prefix key, remembered for the pool a member serves from
    /// ([`Router::served`]).
    pub prefix: Option<u64>,
    /// The call counted in flight to its first candidate from its admission on
    /// ([`Route::hold_first`]), until the dispatch takes it over.
    pub held: Held,
}

/// A call in flight to a pool member before it is sent: the calls routed while it
/// reserves its budget (a DynamoDB write) see it, instead of all picking the member
/// it picked.
#[derive(Debug, Clone, Default)]
pub struct Held(Arc<std::sync::Mutex<Option<pick::InFlight>>>);

impl Held {
    /// The guard, once: the dispatch holds it for the first candidate it tries.
    pub fn take(&self) -> Option<pick::InFlight> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }
}

impl Route {
    /// Counts the call in flight to its first candidate, if a pool member, from now.
    pub fn hold_first(&self, loads: &Loads) {
        let guard = self.candidates.first().and_then(|c| loads.start(&c.backend));
        *self.held.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = guard;
    }
}

/// One backend the dispatcher may try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub backend: BackendId,
    /// Served by a fallback or a lower-priority pool member: `Flexway-Degraded`.
    pub degraded: bool,
    /// Why it would serve (the audit's `pick_reason`); `None` for a backend outside
    /// any pool that is not a fallback.
    pub reason: Option<PickReason>,
    /// The pool it is a member of, in this route.
    pub pool: Option<BackendId>,
    /// The inference pool whose `members` it is of: tried only when that pool's
    /// picker could not answer and its `failure_mode` is `fail_open`.
    pub fail_open_of: Option<BackendId>,
}

impl Candidate {
    /// A backend outside any pool: the first one chosen, or a fallback.
    pub fn fallback_unless(backend: BackendId, first: bool) -> Self {
        let reason = (!first).then_some(PickReason::Fallback);
        Candidate { backend, degraded: !first, reason, pool: None, fail_open_of: None }
    }
}

pub struct Router {
    config: Arc<Config>,
    /// The pool members' load, read by `pick` and `saturation`.
    pub loads: Loads,
    /// Each inference pool's endpoint picker.
    pickers: BTreeMap<BackendId, (endpoint_picker::EndpointPicker, FailureMode)>,
}

impl Router {
    /// The router of `config`; its endpoint pickers' channels are made now and
    /// connected at their first call (within a Tokio runtime, as they run on it).
    pub fn new(config: Arc<Config>) -> Result<Self, endpoint_picker::PickerError> {
        let mut pickers = BTreeMap::new();
        for (name, backend) in &config.ai.backends {
            if let BackendKind::InferencePool { picker: settings, .. } = &backend.kind {
                let picker =
                    endpoint_picker::EndpointPicker::new(&settings.url, endpoint_picker::TIMEOUT, settings.port)?;
                pickers.insert(name.clone(), (picker, settings.failure_mode));
            }
        }
        Ok(Router { loads: Loads::new(&config), config, pickers })
    }

    /// The endpoint picker of `backend` when it is an inference pool, and what a call
    /// does when it cannot answer.
    pub fn picker(&self, backend: &BackendId) -> Option<&(endpoint_picker::EndpointPicker, FailureMode)> {
        self.pickers.get(backend)
    }

    /// A candidate of `route` served: its pool remembers the prompt's prefix for it.
    pub fn served(&self, route: &Route, candidate: &Candidate) {
        if let (Some(prefix), Some(pool)) = (route.prefix, &candidate.pool) {
            self.loads.served_prefix(pool, prefix, &candidate.backend);
        }
    }

    /// The backend this caller's routing starts from, before expansion: default,
    /// tenant, agent, capability override, sensitivity, then the soft-cap switch.
    pub fn entry_backend(&self, caller: &Caller, request: &RouteRequest) -> &BackendId {
        let ai = &self.config.ai;
        let capability = request.capability;
        let serves = |b: &BackendId| self.backend(b).is_some_and(|b| b.capabilities.contains(&capability));
        if let Some((entry, _)) = request.entry.as_ref().and_then(|e| ai.backends.get_key_value(e)) {
            return entry;
        }
        if request.sensitive
            && let Some(pinned) = &ai.sensitive_backend
        {
            return pinned;
        }
        if request.soft {
            let switch = ai.budget.soft.as_ref().map(|s| &s.backend);
            // Never to an external backend for a sensitive request.
            let allowed = |b: &&BackendId| {
                serves(b) && (!request.sensitive || self.is_internal(b)) && self.reaches(b, &request.residency)
            };
            if let Some(backend) = switch.filter(allowed) {
                return backend;
            }
        }
        let override_for = match capability {
            Capability::Chat | Capability::Grpc | Capability::Http => None,
            Capability::Vision => ai.capabilities.vision.as_ref(),
            Capability::Embeddings => ai.capabilities.embeddings.as_ref(),
            Capability::Realtime => ai.capabilities.realtime.as_ref(),
        };
        if let Some(backend) = override_for {
            return backend;
        }
        let tenant = self.config.tenants.get(&caller.tenant);
        let agent_backend =
            caller.agent.as_ref().and_then(|a| tenant.and_then(|t| t.agents.get(a))).and_then(|a| a.backend.as_ref());
        agent_backend.or_else(|| tenant.and_then(|t| t.backend.as_ref())).unwrap_or(&ai.default_backend)
    }

    /// The ordered chain of candidates for a model call: its entry backend expanded
    /// (pools, fallbacks), then the filters every route goes through ([`Router::filter`]).
    pub fn route(&self, caller: &Caller, request: &RouteRequest) -> Result<Route, GatewayError> {
        let entry = self.entry_backend(caller, request);
        let via_pool = self
            .backend(entry)
            .is_some_and(|b| matches!(b.kind, BackendKind::Pool { .. } | BackendKind::InferencePool { .. }));
        let mut candidates = Vec::new();
        let order = Order { affinity: request.affinity, prefix: request.prefix };
        self.expand(entry, false, &mut candidates, &mut BTreeSet::new(), &mut rand::rng(), order);
        let picked = candidates.first().map(|c| (c.pool.clone(), c.reason));
        let capability = request.capability;
        let serves = |b: &Backend| b.capabilities.contains(&capability);
        let unserved = || GatewayError::CapabilityUnavailable { capability: capability.as_str() };
        self.filter(&mut candidates, serves, request.sensitive, &request.residency, unserved)?;
        // A fail-open member serves only when its inference pool was asked first (the
        // set built only for a route that has one: most have none).
        if candidates.iter().any(|c| c.fail_open_of.is_some()) {
            let kept: BTreeSet<BackendId> = candidates.iter().map(|c| c.backend.clone()).collect();
            candidates.retain(|c| c.fail_open_of.as_ref().is_none_or(|pool| kept.contains(pool)));
        }
        // The pool's pick ordered members a filter may have removed: the first left
        // of its group is the pick, not a fallback.
        if let (Some(first), Some((pool, reason))) = (candidates.first_mut(), picked)
            && first.pool.is_some()
            && first.pool == pool
            && !first.degraded
        {
            first.reason = reason;
        }
        Ok(Route { candidates, via_pool, prefix: request.prefix, held: Held::default() })
    }

    /// The route of an operation: the backends that declare it, in order, through the
    /// same filters as a model call's; `None` when no backend declares it. A REST
    /// operation is its mount's backend's, the others its fallbacks; a gRPC method is
    /// the first left's.
    pub fn route_operation(
        &self,
        declared: Declared<'_>,
        sensitive: bool,
        residency: &Residency,
    ) -> Result<Option<Route>, GatewayError> {
        let backends = &self.config.ai.backends;
        let (serving, owner): (Vec<&BackendId>, _) = match declared {
            Declared::Service(service) => {
                let declares = |name: &&BackendId| {
                    self.config.ai.grpc.get(*name).is_some_and(|s| s.services.contains_key(service))
                        && backends.get(*name).is_some_and(|b| matches!(b.kind, BackendKind::Grpc { .. }))
                };
                (self.config.ai.grpc.keys().filter(declares).collect(), None)
            }
            Declared::Rest { owner, operation } => {
                let declares = |name: &&BackendId| match backends.get(*name).map(|b| &b.kind) {
                    Some(BackendKind::Http { contract, .. }) => contract
                        .declared(&operation.method, &operation.path)
                        .is_some_and(|declared| declared.ai == operation.ai),
                    _ => false,
                };
                let others = backends.keys().filter(|name| *name != owner);
                (std::iter::once(owner).chain(others).filter(declares).collect(), Some(owner))
            }
        };
        if serving.is_empty() {
            return Ok(None);
        }
        let serving = serving.into_iter().cloned().collect();
        self.route_listed(serving, owner, sensitive, residency).map(Some)
    }

    /// `serving`, in order, through the filters; `owner`'s if it has one, else the
    /// first left's, the others its fallbacks.
    fn route_listed(
        &self,
        serving: Vec<BackendId>,
        owner: Option<&BackendId>,
        sensitive: bool,
        residency: &Residency,
    ) -> Result<Route, GatewayError> {
        let mut candidates: Vec<_> =
            serving.into_iter().map(|backend| Candidate::fallback_unless(backend, false)).collect();
        let unserved = || GatewayError::SensitiveNoInternalBackend;
        self.filter(&mut candidates, |_| true, sensitive, residency, unserved)?;
        for (i, candidate) in candidates.iter_mut().enumerate() {
            let own = owner.map_or(i == 0, |owner| *owner == candidate.backend);
            candidate.degraded = !own;
            candidate.reason = (!own).then_some(PickReason::Fallback);
        }
        Ok(Route { candidates, via_pool: false, prefix: None, held: Held::default() })
    }

    /// The filters that never bend, in order, for every route: the backends that
    /// `serve` the call; for a sensitive call, only internal ones
    /// (`sensitive_no_internal_backend` when none is left); `unserved` when nothing
    /// serves it; then only those its residency allows.
    fn filter(
        &self,
        candidates: &mut Vec<Candidate>,
        serves: impl Fn(&Backend) -> bool,
        sensitive: bool,
        residency: &Residency,
        unserved: impl FnOnce() -> GatewayError,
    ) -> Result<(), GatewayError> {
        candidates.retain(|c| self.backend(&c.backend).is_some_and(&serves));
        if sensitive {
            candidates.retain(|c| self.is_internal(&c.backend));
            if candidates.is_empty() {
                return Err(GatewayError::SensitiveNoInternalBackend);
            }
        }
        if candidates.is_empty() {
            return Err(unserved());
        }
        if !residency.is_any() {
            candidates.retain(|c| self.backend(&c.backend).is_some_and(|b| residency.allows(b)));
            if candidates.is_empty() {
                return Err(residency.unavailable());
            }
        }
        Ok(())
    }

    /// A sheddable call is refused when its route enters a pool with `saturation`
    /// and every member of it left to serve, `available` (its breaker not open), is
    /// saturated. The pool's fallbacks outside it are for failures, not for load.
    pub fn shed(&self, route: &Route, available: impl Fn(&BackendId) -> bool) -> Result<(), GatewayError> {
        let Some(pool) = route.candidates.first().and_then(|c| c.pool.clone()).filter(|_| route.via_pool) else {
            return Ok(());
        };
        let Some(BackendKind::Pool { picking, .. }) = self.backend(&pool).map(|b| &b.kind) else { return Ok(()) };
        let Some(bound) = picking.saturation else { return Ok(()) };
        let mut members = route
            .candidates
            .iter()
            .filter(|c| c.pool.as_ref() == Some(&pool) && available(&c.backend))
            .map(|c| &c.backend)
            .peekable();
        if members.peek().is_some() && self.loads.all_saturated(members, &bound) {
            return Err(GatewayError::Overloaded { pool });
        }
        Ok(())
    }

    /// Whether `name`, or a member of it when it is a pool, may serve a call bound
    /// by `residency`.
    fn reaches(&self, name: &BackendId, residency: &Residency) -> bool {
        match self.backend(name).map(|b| (b, &b.kind)) {
            Some((_, BackendKind::Pool { members, .. })) => members.iter().any(|m| self.reaches(&m.backend, residency)),
            Some((pool, BackendKind::InferencePool { members, .. })) => {
                residency.allows(pool) || members.iter().any(|m| self.reaches(&m.backend, residency))
            }
            Some((backend, _)) => residency.allows(backend),
            None => false,
        }
    }

    fn is_internal(&self, name: &BackendId) -> bool {
        self.backend(name).is_some_and(|b| !b.external)
    }

    fn backend(&self, name: &BackendId) -> Option<&Backend> {
        self.config.ai.backends.get(name)
    }

    /// Appends `name` (a pool's members in order) then its fallbacks, depth first.
    fn expand(
        &self,
        name: &BackendId,
        degraded: bool,
        chain: &mut Vec<Candidate>,
        seen: &mut BTreeSet<BackendId>,
        rng: &mut impl Rng,
        order: Order,
    ) {
        if !seen.insert(name.clone()) {
            return;
        }
        let Some(backend) = self.backend(name) else {
            return;
        };
        match &backend.kind {
            BackendKind::Pool { members, picking } => {
                let best = members.iter().map(|m| m.priority).min().unwrap_or(1);
                let base = match order.affinity {
                    Some(key) => affinity_order(members, key),
                    None => pool_order(members, rng),
                };
                let prefix = order.prefix.filter(|_| picking.prefix_bytes.is_some());
                let (members, reason) = self.loads.order(name, picking, base, prefix, rng);
                for (i, member) in members.iter().enumerate() {
                    if seen.insert(member.backend.clone()) {
                        chain.push(Candidate {
                            backend: member.backend.clone(),
                            degraded: degraded || member.priority > best,
                            reason: Some(if i == 0 && !degraded { reason } else { PickReason::Fallback }),
                            pool: Some(name.clone()),
                            fail_open_of: None,
                        });
                    }
                }
                // Members' own fallbacks come after every member.
                for member in members {
                    for fallback in self.backend(&member.backend).map(|b| b.fallback.as_slice()).unwrap_or_default() {
                        self.expand(fallback, true, chain, seen, rng, Order::default());
                    }
                }
            }
            BackendKind::InferencePool { picker, members, .. } => {
                let reason = if degraded { PickReason::Fallback } else { PickReason::Picker };
                let pool = Candidate { reason: Some(reason), ..Candidate::fallback_unless(name.clone(), !degraded) };
                chain.push(pool);
                // Its members, as a plain weighted pool, for when its picker cannot answer.
                if picker.failure_mode == FailureMode::FailOpen {
                    let best = members.iter().map(|m| m.priority).min().unwrap_or(1);
                    for (i, member) in pool_order(members, rng).into_iter().enumerate() {
                        if seen.insert(member.backend.clone()) {
                            chain.push(Candidate {
                                backend: member.backend.clone(),
                                degraded: degraded || member.priority > best,
                                reason: Some(if i == 0 && !degraded {
                                    PickReason::Weighted
                                } else {
                                    PickReason::Fallback
                                }),
                                pool: None,
                                fail_open_of: Some(name.clone()),
                            });
                        }
                    }
                }
            }
            BackendKind::Grpc { .. } => {}
            _ => chain.push(Candidate::fallback_unless(name.clone(), !degraded)),
        }
        for fallback in &backend.fallback {
            self.expand(fallback, true, chain, seen, rng, order);
        }
    }

    /// Client-facing model names this caller can reach (SPEC §2, `GET /v1/models`).
    pub fn reachable_models(&self, caller: &Caller) -> Vec<String> {
        let mut names = Vec::new();
        let mut seen_backends = BTreeSet::new();
        let mut backends = Vec::new();
        let residency = Residency(self.config.limits(&caller.tenant, caller.agent.as_ref()).1.cloned());
        for capability in [Capability::Chat, Capability::Vision, Capability::Embeddings, Capability::Realtime] {
            let mut chain = Vec::new();
            self.expand(
                self.entry_backend(
                    caller,
                    &RouteRequest {
                        capability,
                        sensitive: false,
                        soft: false,
                        affinity: None,
                        prefix: None,
                        criticality: Criticality::Standard,
                        residency: residency.clone(),
                        entry: None,
                    },
                ),
                false,
                &mut chain,
                &mut BTreeSet::new(),
                &mut rand::rng(),
                Order::default(),
            );
            for candidate in chain {
                if !self.backend(&candidate.backend).is_some_and(|b| residency.allows(b)) {
                    continue;
                }
                if seen_backends.insert(candidate.backend.clone()) {
                    backends.push(candidate.backend);
                }
            }
        }
        for name in backends {
            let Some(endpoint) = self.backend(&name).and_then(|b| b.kind.endpoint()) else {
                continue;
            };
            for model in endpoint.client_names() {
                if !names.iter().any(|n| n == model) {
                    names.push(model.to_owned());
                }
            }
        }
        names
    }
}

/// How pools order their members: at random by weight, or by a session's affinity.
#[derive(Debug, Clone, Copy, Default)]
struct Order {
    affinity: Option<u64>,
    prefix: Option<u64>,
}

/// Members by priority group (1 first); inside a group, by the session's weighted
/// rendezvous score, highest first (ties, which need equal hashes, by name).
fn affinity_order(members: &[PoolMember], key: u64) -> Vec<&PoolMember> {
    let mut order: Vec<(&PoolMember, f64)> = members.iter().map(|m| (m, rendezvous_score(key, m))).collect();
    order.sort_by(|(a, sa), (b, sb)| {
        a.priority.cmp(&b.priority).then(sb.total_cmp(sa)).then_with(|| a.backend.cmp(&b.backend))
    });
    order.into_iter().map(|(m, _)| m).collect()
}

/// Members by priority group (1 first); inside a group, a weighted random order.
fn pool_order<'a>(members: &'a [PoolMember], rng: &mut impl Rng) -> Vec<&'a PoolMember> {
    let mut priorities: Vec<u32> = members.iter().map(|m| m.priority).collect();
    priorities.sort_unstable();
    priorities.dedup();
    let mut order = Vec::with_capacity(members.len());
    for priority in priorities {
        let mut group: Vec<&PoolMember> = members.iter().filter(|m| m.priority == priority).collect();
        while !group.is_empty() {
            let total: u64 = group.iter().map(|m| u64::from(m.weight.max(1))).sum();
            let mut pick = rng.random_range(0..total);
            let index = group
                .iter()
                .position(|m| {
                    let w = u64::from(m.weight.max(1));
                    if pick < w {
                        true
                    } else {
                        pick -= w;
                        false
                    }
                })
                .unwrap_or(0);
            order.push(group.remove(index));
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn member(name: &str, priority: u32, weight: u32) -> PoolMember {
        PoolMember { backend: BackendId::new(name), priority, weight }
    }

    #[test]
    fn pool_order_puts_priority_groups_first() {
        let members = [member("b", 2, 3), member("a", 1, 1), member("c", 2, 1)];
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..50 {
            let order = pool_order(&members, &mut rng);
            assert_eq!(order[0].backend.as_str(), "a");
            assert_eq!(order.len(), 3);
        }
    }

    fn first_of(members: &[PoolMember], key: u64) -> String {
        affinity_order(members, key)[0].backend.to_string()
    }

    fn session(n: u64) -> u64 {
        let mut headers = http::HeaderMap::new();
        headers.insert("flexway-session", format!("session-{n}").parse().unwrap());
        let affinity = crate::config::Affinity { header: "flexway-session".into() };
        affinity_key(&headers, Some(&affinity)).unwrap()
    }

    #[test]
    fn affinity_sends_a_session_to_the_same_member_every_time() {
        let members = [member("a", 1, 1), member("b", 1, 1), member("c", 1, 1), member("d", 2, 1)];
        for n in 0..200 {
            let first = first_of(&members, session(n));
            assert_ne!(first, "d", "a lower priority group never comes first");
            for _ in 0..5 {
                assert_eq!(first_of(&members, session(n)), first);
            }
            let order = affinity_order(&members, session(n));
            assert_eq!(order.len(), 4);
            assert_eq!(order[3].backend.as_str(), "d");
        }
    }

    #[test]
    fn affinity_spreads_sessions_by_weight() {
        let members = [member("a", 1, 3), member("b", 1, 1)];
        let on_a = (0..4000).filter(|n| first_of(&members, session(*n)) == "a").count();
        // Expected 3,000 of 4,000 sessions; within 5%.
        assert!((2850..=3150).contains(&on_a), "a first for {on_a} sessions");
    }

    #[test]
    fn adding_a_member_moves_only_the_sessions_it_takes() {
        let three = [member("a", 1, 1), member("b", 1, 1), member("c", 1, 1)];
        let four = [member("a", 1, 1), member("b", 1, 1), member("c", 1, 1), member("d", 1, 1)];
        let mut moved = 0;
        for n in 0..4000 {
            let (before, after) = (first_of(&three, session(n)), first_of(&four, session(n)));
            if before != after {
                assert_eq!(after, "d", "a session only ever moves to the new member");
                moved += 1;
            }
        }
        // About a quarter (1,000) move: to the new member, none between the old ones.
        assert!((850..=1150).contains(&moved), "{moved} sessions moved");
    }

    #[test]
    fn no_affinity_without_the_header_or_the_config() {
        let affinity = crate::config::Affinity { header: "flexway-session".into() };
        let mut headers = http::HeaderMap::new();
        assert_eq!(affinity_key(&headers, Some(&affinity)), None);
        headers.insert("flexway-session", "".parse().unwrap());
        assert_eq!(affinity_key(&headers, Some(&affinity)), None, "an empty value is no session");
        headers.insert("flexway-session", "s1".parse().unwrap());
        assert_eq!(affinity_key(&headers, None), None, "off unless configured");
        assert!(affinity_key(&headers, Some(&affinity)).is_some());
    }

    #[test]
    fn pool_order_spreads_by_weight_inside_a_group() {
        let members = [member("b", 1, 3), member("c", 1, 1)];
        let mut rng = StdRng::seed_from_u64(42);
        let firsts = (0..1000).filter(|_| pool_order(&members, &mut rng)[0].backend.as_str() == "b").count();
        // Expected 750 of a thousand picks; within 10%.
        assert!((675..=825).contains(&firsts), "b first {firsts} times");
    }

    fn set(labels: &[&str]) -> BTreeSet<String> {
        labels.iter().map(|l| l.to_string()).collect()
    }

    fn headers(values: &[&str]) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        for value in values {
            headers.append(Residency::HEADER, value.parse().unwrap());
        }
        headers
    }

    #[test]
    fn residency_is_the_callers_narrowed_by_the_header() {
        let of = |caller: Option<&[&str]>, values: &[&str]| {
            let caller = caller.map(set);
            Residency::of_call(caller.as_ref(), &headers(values)).map(|r| r.0)
        };
        assert_eq!(of(None, &[]), Ok(None), "no restriction");
        assert_eq!(of(Some(&["eu", "ch"]), &[]), Ok(Some(set(&["eu", "ch"]))));
        assert_eq!(of(None, &["EU, ch"]), Ok(Some(set(&["eu", "ch"]))), "the header alone restricts");
        assert_eq!(of(None, &["eu", "ch"]), Ok(Some(set(&["eu", "ch"]))), "its lines are one list");
        assert_eq!(of(Some(&["eu"]), &["eu, us"]), Ok(Some(set(&["eu"]))), "it never widens");
        assert_eq!(of(Some(&["eu"]), &["us"]), Ok(Some(set(&[]))), "nothing left: nothing serves");
        for bad in ["", "eu,", "e u", "eu;ch", &"x".repeat(65)] {
            assert!(of(None, &[bad]).is_err(), "`{bad}` is refused, never read as no restriction");
        }
    }

    #[test]
    fn only_a_listed_jurisdiction_serves_a_bound_call() {
        let config = crate::config::load_str(
            "version: 1\nai:\n  default_backend: eu\n  backends:\n    eu: {url: 'http://e/v1', jurisdiction: EU}\n    \
             anywhere: {url: 'http://a/v1'}\n",
            &std::collections::HashMap::<String, String>::new(),
        )
        .unwrap()
        .config;
        let (eu, anywhere) = (&config.ai.backends["eu"], &config.ai.backends["anywhere"]);
        let bound = Residency(Some(set(&["eu"])));
        assert!(bound.allows(eu) && !bound.allows(anywhere), "a backend without a jurisdiction never serves it");
        assert!(Residency::ANY.allows(eu) && Residency::ANY.allows(anywhere));
        let refusal = Residency(Some(set(&[]))).unavailable().to_string();
        assert!(refusal.contains("share no jurisdiction"), "{refusal}");
    }

    fn router(yaml_backends: &str) -> Router {
        let yaml =
            format!("version: 1\ntenants:\n  acme: {{}}\nai:\n  default_backend: pool\n  backends:\n{yaml_backends}");
        let config =
            crate::config::load_str(&yaml, &std::collections::HashMap::<String, String>::new()).unwrap().config;
        Router::new(Arc::new(config)).unwrap()
    }

    fn request(criticality: Criticality, residency: Residency) -> RouteRequest {
        RouteRequest {
            capability: Capability::Chat,
            sensitive: false,
            soft: false,
            affinity: None,
            prefix: None,
            criticality,
            residency,
            entry: None,
        }
    }

    fn acme() -> Caller {
        Caller {
            tenant: crate::config::TenantId::new("acme"),
            agent: None,
            key_sha256: [0; 32],
            relay_peer: false,
            key_limits: Default::default(),
        }
    }

    #[test]
    fn a_member_whose_breaker_is_open_does_not_keep_a_pool_from_shedding() {
        let router = router(
            "    pool: {kind: pool, saturation: {queue: 1}, members: [{backend: a}, {backend: b}]}\n    \
             a: {url: 'http://a/v1'}\n    b: {url: 'http://b/v1'}\n",
        );
        let _busy = router.loads.start(&BackendId::new("b"));
        let route = router.route(&acme(), &request(Criticality::Sheddable, Residency::ANY)).unwrap();
        assert!(router.shed(&route, |_| true).is_ok(), "a is idle");
        let shed = router.shed(&route, |b| b.as_str() != "a").unwrap_err();
        assert_eq!(shed.code(), crate::call::ErrorCode::Overloaded, "a is down, b saturated");
        assert!(router.shed(&route, |_| false).is_ok(), "none available: the chain says why, not shedding");
    }

    #[test]
    fn an_operation_route_goes_through_the_model_routes_filters() {
        let router = router(
            "    pool: {kind: pool, members: [{backend: a}]}\n    a: {url: 'http://a/v1', jurisdiction: us}\n    \
             b: {url: 'http://b/v1', jurisdiction: eu, external: false}\n    c: {url: 'http://c/v1', jurisdiction: \
             eu}\n",
        );
        let (a, b, c) = (BackendId::new("a"), BackendId::new("b"), BackendId::new("c"));
        let serving = || vec![a.clone(), b.clone(), c.clone()];
        let routed = |route: &Route| -> Vec<(String, bool)> {
            route.candidates.iter().map(|c| (c.backend.to_string(), c.degraded)).collect()
        };
        let eu = Residency(Some(set(&["eu"])));
        // No owner (a gRPC method): the first left is the call's own backend.
        let route = router.route_listed(serving(), None, false, &eu).unwrap();
        assert_eq!(routed(&route), vec![("b".to_owned(), false), ("c".to_owned(), true)]);
        // An owner (a REST mount): the others are fallbacks, even when it is filtered out.
        let route = router.route_listed(serving(), Some(&a), false, &eu).unwrap();
        assert_eq!(routed(&route), vec![("b".to_owned(), true), ("c".to_owned(), true)]);
        let route = router.route_listed(serving(), Some(&c), false, &Residency::ANY).unwrap();
        assert_eq!(routed(&route), vec![("a".to_owned(), true), ("b".to_owned(), true), ("c".to_owned(), false)]);
        // Sensitive: internal ones only; then residency.
        let route = router.route_listed(serving(), None, true, &Residency::ANY).unwrap();
        assert_eq!(routed(&route), vec![("b".to_owned(), false)]);
        let us = Residency(Some(set(&["us"])));
        let refused = router.route_listed(serving(), None, true, &us).unwrap_err();
        assert_eq!(refused.code(), crate::call::ErrorCode::ResidencyUnavailable);
        let refused = router.route_listed(vec![a.clone(), c.clone()], None, true, &Residency::ANY).unwrap_err();
        assert_eq!(refused.code(), crate::call::ErrorCode::SensitiveNoInternalBackend);
    }

    #[test]
    fn the_first_member_a_filter_leaves_is_the_pick_not_a_fallback() {
        let router = router(
            "    pool: {kind: pool, pick: least_loaded, members: [{backend: a}, {backend: b}]}\n    \
             a: {url: 'http://a/v1', jurisdiction: us}\n    b: {url: 'http://b/v1', jurisdiction: eu}\n",
        );
        let _busy = router.loads.start(&BackendId::new("b"));
        let eu = Residency(Some(set(&["eu"])));
        let route = router.route(&acme(), &request(Criticality::Standard, eu)).unwrap();
        let first = &route.candidates[0];
        assert_eq!((first.backend.as_str(), first.reason), ("b", Some(PickReason::LeastLoaded)));
        assert!(!first.degraded);
    }

    #[tokio::test]
    async fn an_inference_pool_is_one_candidate_then_its_open_members_each_filtered() {
        let router = router(
            "    pool:\n      kind: inference_pool\n      endpoint_picker: {url: 'http://127.0.0.1:9', failure_mode: \
             fail_open}\n      target: {port: 8000}\n      jurisdiction: eu\n      members: [{backend: a}, {backend: \
             b}]\n      fallback: [c]\n    a: {url: 'http://a/v1', jurisdiction: us}\n    \
             b: {url: 'http://b/v1', jurisdiction: eu}\n    c: {url: 'http://c/v1', jurisdiction: us}\n",
        );
        let names = |route: &Route| route.candidates.iter().map(|c| c.backend.to_string()).collect::<Vec<_>>();
        let route = router.route(&acme(), &request(Criticality::Standard, Residency::ANY)).unwrap();
        assert_eq!(names(&route)[0], "pool");
        assert_eq!(route.candidates[0].reason, Some(PickReason::Picker));
        assert_eq!(names(&route)[3], "c", "the members, then the pool's fallbacks");
        let pool = Some(BackendId::new("pool"));
        assert!(route.candidates[1..3].iter().all(|c| c.fail_open_of == pool && c.pool.is_none()));
        assert!(route.via_pool);

        let eu = router.route(&acme(), &request(Criticality::Standard, Residency(Some(set(&["eu"]))))).unwrap();
        assert_eq!(names(&eu), ["pool", "b"], "residency filters the pool, its members and fallbacks alike");
        // Without the pool, its members have nothing to fail open from.
        let us = router.route(&acme(), &request(Criticality::Standard, Residency(Some(set(&["us"]))))).unwrap();
        assert_eq!(names(&us), ["c"]);
    }

    #[test]
    fn a_routed_call_counts_before_it_is_sent_so_the_next_one_goes_elsewhere() {
        let router = router(
            "    pool: {kind: pool, pick: least_loaded, members: [{backend: a}, {backend: b}]}\n    \
             a: {url: 'http://a/v1'}\n    b: {url: 'http://b/v1'}\n",
        );
        let first = router.route(&acme(), &request(Criticality::Standard, Residency::ANY)).unwrap();
        first.hold_first(&router.loads);
        let picked = first.candidates[0].backend.clone();
        let second = router.route(&acme(), &request(Criticality::Standard, Residency::ANY)).unwrap();
        assert_ne!(second.candidates[0].backend, picked, "the first call, still reserving, counts");
        let taken = first.held.take();
        assert!(taken.is_some() && first.held.take().is_none(), "the dispatch takes it once");
        drop((taken, first));
        assert_eq!(router.loads.seen(&picked).in_flight, 0);
    }
}
