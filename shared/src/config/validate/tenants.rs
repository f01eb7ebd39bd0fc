//! `tenants` and `console`: each tenant's keys, agents, budgets, backend, criticality,
//! residency and `cache: off`. No two keys share a hash, and a tenant's key never
//! opens the console; an agent is held to its tenant's limits, narrowed here once.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::super::raw::{
    RawAgent, RawBudgets, RawCacheSwitch, RawConsole, RawCriticality, RawKey, RawRates, RawTenant,
};
use super::super::values::{key_hash, micro_eur};
use super::super::*;
use super::{Catalog, Checker, McpDeclared, jurisdiction};

impl Checker<'_> {
    pub(super) fn tenants(
        &mut self,
        raw: BTreeMap<String, RawTenant>,
        catalog: &Catalog,
        mcp: &McpDeclared,
        cache_declared: bool,
    ) -> BTreeMap<TenantId, Tenant> {
        let relay_peer_declared =
            raw.values().flat_map(|t| t.keys.iter().flatten()).any(|k| k.relay_peer == Some(true));
        let mut seen_keys: HashMap<[u8; 32], String> = HashMap::new();
        let mut tenants = BTreeMap::new();
        for (name, tenant) in raw {
            let path = format!("tenants.{name}");
            let RawTenant { keys, budgets, limits, backend, agents, max_criticality, residency, cache, mcp: narrowing } =
                tenant;

            let agents: BTreeMap<AgentId, Agent> = agents
                .unwrap_or_default()
                .into_iter()
                .map(|(agent, raw)| {
                    let agent_path = format!("{path}.agents.{agent}");
                    (AgentId::new(&agent), self.agent(&agent_path, raw, catalog, mcp, cache_declared))
                })
                .collect();

            let keys = keys.unwrap_or_default();
            if keys.is_empty() && !relay_peer_declared {
                self.warn(&path, format!("tenant {name} has no keys: nobody can call as it"));
            }
            let keys: Vec<KeyEntry> = keys
                .into_iter()
                .enumerate()
                .filter_map(|(i, key)| {
                    let key_path = format!("{path}.keys[{i}]");
                    self.key(&key_path, key, &path, &agents, &mut seen_keys)
                })
                .collect();

            let budgets = self.budgets(&format!("{path}.budgets"), budgets);
            let limits = self.rates(&format!("{path}.limits"), limits);
            let backend = backend.and_then(|b| {
                self.route_target(&format!("{path}.backend"), &b, catalog, "a tenant's backend").map(|(id, _)| id)
            });
            let id = TenantId::new(&name);
            let max_criticality = criticality(max_criticality);
            let residency = residency.and_then(|list| self.residency(&format!("{path}.residency"), list));
            let cache_off = self.cache_switch(&format!("{path}.cache"), cache, cache_declared);
            let narrowing = self.mcp_narrowing(&format!("{path}.mcp"), narrowing, mcp);
            self.agents_within_servers(&path, &narrowing, &agents);
            // An agent is held to its tenant's limits too: its own are narrowed here,
            // once, so that a call reads one set.
            let mut agents = agents;
            for agent in agents.values_mut() {
                agent.max_criticality = agent.max_criticality.min(max_criticality);
                agent.cache_off |= cache_off;
                agent.residency = match (&residency, agent.residency.take()) {
                    (Some(of_tenant), Some(own)) => Some(of_tenant.intersection(&own).cloned().collect()),
                    (of_tenant, own) => own.or_else(|| of_tenant.clone()),
                };
            }
            let tenant = Tenant {
                name: id.clone(),
                keys,
                budgets,
                limits,
                backend,
                agents,
                max_criticality,
                residency,
                cache_off,
                mcp: narrowing,
            };
            tenants.insert(id, tenant);
        }
        tenants
    }

    /// One key of a tenant; `seen` holds every key hash met so far, with its path.
    fn key(
        &mut self,
        path: &str,
        raw: RawKey,
        tenant_path: &str,
        agents: &BTreeMap<AgentId, Agent>,
        seen: &mut HashMap<[u8; 32], String>,
    ) -> Option<KeyEntry> {
        let hash_path = format!("{path}.sha256");
        let hex = self.required(&hash_path, raw.sha256, "(the key's SHA-256)")?;
        let hash = key_hash(&hex).map_err(|m| self.error(&hash_path, m)).ok()?;
        if let Some(first) = seen.get(&hash) {
            let message = format!("the same key is already declared at {first}: a key belongs to one tenant, once");
            self.error(hash_path, message);
            return None;
        }
        seen.insert(hash, path.to_owned());
        let agent = match raw.agent {
            Some(agent) if !agents.contains_key(agent.as_str()) => {
                let message = format!("agent `{agent}` is not declared under {tenant_path}.agents");
                self.error(format!("{path}.agent"), message);
                return None;
            }
            other => other.map(AgentId::new),
        };
        let limits = self.rates(&format!("{path}.limits"), raw.limits);
        Some(KeyEntry { sha256: hash, agent, relay_peer: raw.relay_peer.unwrap_or(false), limits })
    }

    /// The console's keys: at least one, each once, none a tenant's (a tenant's key
    /// never opens the console).
    pub(super) fn console(&mut self, raw: RawConsole, tenants: &BTreeMap<TenantId, Tenant>) -> Option<ConsoleConfig> {
        let raw = raw.keys.unwrap_or_default();
        if raw.is_empty() {
            self.error("console.keys", "list at least one key (or leave `console` out: no console)");
            return None;
        }
        let mut keys: Vec<[u8; 32]> = Vec::new();
        for (i, key) in raw.into_iter().enumerate() {
            let path = format!("console.keys[{i}].sha256");
            let Some(hex) = self.required(&path, key.sha256, "(the key's SHA-256)") else { continue };
            let Ok(hash) = key_hash(&hex).map_err(|m| self.error(&path, m)) else { continue };
            if keys.contains(&hash) {
                self.error(path, "listed twice");
            } else if let Some(tenant) = tenants.values().find(|t| t.keys.iter().any(|k| k.sha256 == hash)) {
                let message = format!("is a key of tenant {}: a tenant's key never opens the console", tenant.name);
                self.error(path, message);
            } else {
                keys.push(hash);
            }
        }
        Some(ConsoleConfig { keys })
    }

    /// Whether `cache: off` is set; refused where no `ai.cache` is declared, which it
    /// could not change.
    fn cache_switch(&mut self, path: &str, raw: Option<RawCacheSwitch>, cache_declared: bool) -> bool {
        let off = raw == Some(RawCacheSwitch::Off);
        if off && !cache_declared {
            self.error(path, "there is no `ai.cache` section, so nothing is cached: declare ai.cache, or remove this");
        }
        off
    }

    fn agent(
        &mut self,
        path: &str,
        raw: RawAgent,
        catalog: &Catalog,
        mcp: &McpDeclared,
        cache_declared: bool,
    ) -> Agent {
        let backend = raw.backend.and_then(|b| {
            self.route_target(&format!("{path}.backend"), &b, catalog, "an agent's backend").map(|(id, _)| id)
        });
        let max_criticality = criticality(raw.max_criticality);
        let residency = raw.residency.and_then(|list| self.residency(&format!("{path}.residency"), list));
        Agent {
            backend,
            budgets: self.budgets(&format!("{path}.budgets"), raw.budgets),
            limits: self.rates(&format!("{path}.limits"), raw.limits),
            max_criticality,
            residency,
            cache_off: self.cache_switch(&format!("{path}.cache"), raw.cache, cache_declared),
            mcp: self.mcp_narrowing(&format!("{path}.mcp"), raw.mcp, mcp),
        }
    }

    /// A warning for each residency-bound tenant or agent whose default chain (its
    /// backend, its pools' members, their fallbacks) holds no backend in its
    /// jurisdictions: its calls would all be refused with `residency_unavailable`.
    pub(super) fn residency_chains(&mut self, tenants: &BTreeMap<TenantId, Tenant>, ai: &Ai) {
        for (name, tenant) in tenants {
            let entry = tenant.backend.as_ref().unwrap_or(&ai.default_backend);
            let mut callers = vec![(format!("tenants.{name}"), tenant.residency.as_ref(), entry)];
            for (agent_name, agent) in &tenant.agents {
                // The tenant's own warning covers an agent bound and routed as it is.
                if agent.residency == tenant.residency && agent.backend.is_none() {
                    continue;
                }
                let entry = agent.backend.as_ref().unwrap_or(entry);
                callers.push((format!("tenants.{name}.agents.{agent_name}"), agent.residency.as_ref(), entry));
            }
            for (path, residency, entry) in callers {
                let Some(allowed) = residency else { continue };
                let mut chain = BTreeSet::new();
                chain_of(ai, entry, &mut chain);
                let in_allowed = |b: &&BackendId| {
                    ai.backends.get(*b).and_then(|b| b.jurisdiction.as_ref()).is_some_and(|j| allowed.contains(j))
                };
                let compliant = chain.iter().any(in_allowed);
                if !compliant {
                    let list = allowed.iter().cloned().collect::<Vec<_>>().join(", ");
                    self.warn(
                        format!("{path}.residency"),
                        format!(
                            "no backend of its default chain (from {entry}) is in [{list}]: its calls will be refused \
                             with residency_unavailable"
                        ),
                    );
                }
            }
        }
    }

    /// A `residency` list: at least one jurisdiction, each a label.
    fn residency(&mut self, path: &str, list: Vec<String>) -> Option<BTreeSet<String>> {
        if list.is_empty() {
            self.error(path, "list at least one jurisdiction (or leave it out: no restriction)");
            return None;
        }
        let labels: Vec<_> =
            list.iter().enumerate().map(|(i, label)| jurisdiction(self, &format!("{path}[{i}]"), label)).collect();
        labels.into_iter().collect()
    }

    /// Per-minute rates: each one given at least 1 (a limit of 0 would refuse every
    /// call, which is not a rate), and at least one given.
    pub(super) fn rates(&mut self, path: &str, raw: Option<RawRates>) -> Rates {
        let Some(RawRates { requests_per_minute, tokens_per_minute }) = raw else {
            return Rates::default();
        };
        if requests_per_minute.is_none() && tokens_per_minute.is_none() {
            self.error(path, "give requests_per_minute, tokens_per_minute or both (or leave it out: no limit)");
        }
        let mut positive = |key: &str, value: Option<u64>| match value {
            Some(0) => {
                self.error(format!("{path}.{key}"), "must be at least 1: a limit of 0 would refuse every call");
                None
            }
            other => other,
        };
        Rates {
            requests_per_minute: positive("requests_per_minute", requests_per_minute),
            tokens_per_minute: positive("tokens_per_minute", tokens_per_minute),
        }
    }

    fn budgets(&mut self, path: &str, raw: Option<RawBudgets>) -> Budgets {
        let Some(raw) = raw else {
            return Budgets::default();
        };
        let eur_per_month = raw
            .eur_per_month
            .and_then(|eur| micro_eur(eur).map_err(|m| self.error(format!("{path}.eur_per_month"), m)).ok());
        Budgets { tokens_per_day: raw.tokens_per_day, tokens_per_month: raw.tokens_per_month, eur_per_month }
    }
}

/// Every backend a call entering at `entry` may reach: pool members and fallbacks,
/// recursively.
fn chain_of<'a>(ai: &'a Ai, entry: &'a BackendId, seen: &mut BTreeSet<&'a BackendId>) {
    if !seen.insert(entry) {
        return;
    }
    let Some(backend) = ai.backends.get(entry) else { return };
    if let BackendKind::Pool { members, .. } | BackendKind::InferencePool { members, .. } = &backend.kind {
        for member in members {
            chain_of(ai, &member.backend, seen);
        }
    }
    for fallback in &backend.fallback {
        chain_of(ai, fallback, seen);
    }
}

/// A declared `max_criticality`; none is no limit.
fn criticality(raw: Option<RawCriticality>) -> Criticality {
    match raw {
        None | Some(RawCriticality::Critical) => Criticality::Critical,
        Some(RawCriticality::Standard) => Criticality::Standard,
        Some(RawCriticality::Sheddable) => Criticality::Sheddable,
    }
}
