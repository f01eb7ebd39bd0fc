//! `pool` and `inference_pool` backends: their members, how a pool picks among them
//! (`pick`, `cache_affinity`, `saturation`, each member's `load`), and an inference
//! pool's endpoint picker and target. A pool never nests, never names itself or a
//! member twice, and is internal only if all its members are.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::super::raw::{
    RawBackendKind, RawCacheAffinity, RawCapability, RawEndpointPicker, RawFailureMode, RawLoad, RawPick,
    RawPoolMember, RawSaturation, RawTarget,
};
use super::super::values::fraction_ppm;
use super::super::*;
use super::{Catalog, Checker, Summary, capability};

/// How often a model server's metrics are read by default, and at the most.
const DEFAULT_LOAD_EVERY: Duration = Duration::from_secs(1);
const MIN_LOAD_EVERY: Duration = Duration::from_millis(100);
const DEFAULT_PREFIX_BYTES: u32 = 4096;
/// An inference pool's target path when none is given.
const DEFAULT_TARGET_PATH: &str = "/v1";

impl Checker<'_> {
    /// An inference pool's `endpoint_picker` and `target`: the picker's settings and
    /// the target's path (`/v1`, no trailing slash).
    pub(super) fn inference_pool(
        &mut self,
        path: &str,
        picker: Option<RawEndpointPicker>,
        target: Option<RawTarget>,
    ) -> Option<(PickerSettings, String)> {
        let picker = self.required(&format!("{path}.endpoint_picker"), picker, "(where the endpoint picker listens)");
        let target = self.required(&format!("{path}.target"), target, "(the model servers' port and path)");
        let (picker, target) = (picker?, target?);
        let url_path = format!("{path}.endpoint_picker.url");
        let url = self.required(&url_path, picker.url, "(the picker's gRPC address, http://host:port)")?;
        let url = match url.parse::<http::Uri>() {
            Ok(uri) if uri.scheme_str() == Some("http") && uri.host().is_some() && uri.path() == "/" => {
                url.trim_end_matches('/').to_owned()
            }
            _ => {
                self.error(
                    url_path,
                    format!(
                        "`{url}` is not an http://host:port address: the picker is spoken to over HTTP/2 \
                         cleartext, as the Inference Extension's pickers serve"
                    ),
                );
                return None;
            }
        };
        let failure_mode = match picker.failure_mode {
            None | Some(RawFailureMode::FailClose) => FailureMode::FailClose,
            Some(RawFailureMode::FailOpen) => FailureMode::FailOpen,
        };
        let port_path = format!("{path}.target.port");
        let port = self.required(&port_path, target.port, "(the model servers' port)")?;
        let Some(port) = u16::try_from(port).ok().filter(|p| *p > 0) else {
            self.error(port_path, "must be a port, 1 to 65535");
            return None;
        };
        let target_path = target.path.unwrap_or_else(|| DEFAULT_TARGET_PATH.to_owned());
        let segments_ok = target_path.starts_with('/')
            && !target_path.contains(['?', '#', ' '])
            && target_path.parse::<http::uri::PathAndQuery>().is_ok();
        if !segments_ok {
            self.error(format!("{path}.target.path"), format!("`{target_path}` is not an absolute path (e.g. /v1)"));
            return None;
        }
        let target_path = target_path.trim_end_matches('/').to_owned();
        Some((PickerSettings { url, failure_mode, port }, target_path))
    }

    /// A pool's `pick`, `cache_affinity` and `saturation`.
    pub(super) fn picking(
        &mut self,
        path: &str,
        pick: Option<RawPick>,
        cache_affinity: Option<RawCacheAffinity>,
        saturation: Option<RawSaturation>,
    ) -> Picking {
        let pick = match pick.unwrap_or(RawPick::Weighted) {
            RawPick::Weighted => Pick::Weighted,
            RawPick::LeastLoaded => Pick::LeastLoaded,
            RawPick::Latency => Pick::Latency,
        };
        let prefix_bytes = cache_affinity.map(|raw| match raw.prefix_bytes {
            Some(n) if !(1..=1 << 20).contains(&n) => {
                self.error(format!("{path}.cache_affinity.prefix_bytes"), "must be between 1 and 1048576");
                DEFAULT_PREFIX_BYTES
            }
            n => n.unwrap_or(DEFAULT_PREFIX_BYTES),
        });
        let saturation = saturation.and_then(|raw| {
            if raw.queue.is_none() && raw.kv_cache.is_none() {
                self.error(format!("{path}.saturation"), "declare `queue`, `kv_cache` or both");
                return None;
            }
            if raw.queue == Some(0) {
                self.error(format!("{path}.saturation.queue"), "must be at least 1");
            }
            let kv_cache_ppm = raw
                .kv_cache
                .and_then(|f| fraction_ppm(f).map_err(|m| self.error(format!("{path}.saturation.kv_cache"), m)).ok());
            Some(Saturation { queue: raw.queue.filter(|q| *q > 0), kv_cache_ppm })
        });
        Picking { pick, prefix_bytes, saturation }
    }

    /// A member's `load`: its metrics URL and how often it is read.
    pub(super) fn load(&mut self, path: &str, raw: RawLoad) -> Option<LoadSource> {
        let url_path = format!("{path}.metrics_url");
        let url = self.required(&url_path, raw.metrics_url, "(the model server's Prometheus endpoint)")?;
        let every = self.duration(&format!("{path}.every"), raw.every.as_ref(), DEFAULT_LOAD_EVERY);
        if every < MIN_LOAD_EVERY {
            self.error(format!("{path}.every"), "must be at least 100ms");
        }
        match url.parse::<http::Uri>() {
            Ok(parsed) if matches!(parsed.scheme_str(), Some("http" | "https")) && parsed.host().is_some() => {
                Some(LoadSource { metrics_url: url, every })
            }
            _ => {
                self.error(url_path, format!("`{url}` is not an http:// or https:// URL"));
                None
            }
        }
    }

    /// Every `load` is read by a pool that picks by load or declares saturation, and
    /// every member such a pool ranks by load says where its load is read (else it
    /// is ranked by the gateway's own calls in flight, which is worth a warning).
    pub(super) fn loads(&mut self, backends: &BTreeMap<BackendId, Backend>) {
        // One prefix key a call: one length for every pool with cache affinity.
        let mut lengths = backends.iter().filter_map(|(name, b)| match &b.kind {
            BackendKind::Pool { picking, .. } => picking.prefix_bytes.map(|n| (name, n)),
            _ => None,
        });
        if let Some((first, n)) = lengths.next()
            && let Some((other, m)) = lengths.find(|(_, m)| *m != n)
        {
            self.error(
                format!("ai.backends.{other}.cache_affinity.prefix_bytes"),
                format!("{m} differs from pool {first}'s {n}: every pool with cache_affinity takes one prefix length"),
            );
        }
        let mut read = BTreeSet::new();
        for (pool, backend) in backends {
            let BackendKind::Pool { members, picking } = &backend.kind else { continue };
            if picking.prefix_bytes.is_some() && picking.saturation.is_none() {
                self.warn(
                    format!("ai.backends.{pool}.cache_affinity"),
                    "without `saturation`, every call that shares a prefix (one system prompt for all) goes to the \
                     member that served it last however loaded it is; declare `saturation` to bound it",
                );
            }
            if picking.pick != Pick::LeastLoaded && picking.saturation.is_none() {
                continue;
            }
            for member in members {
                read.insert(member.backend.clone());
                if backends.get(&member.backend).is_some_and(|b| b.load.is_none()) {
                    self.warn(
                        format!("ai.backends.{}", member.backend),
                        format!(
                            "pool {pool} reads its members' load, and {} declares no `load`: it is ranked by the \
                             gateway's own calls in flight to it",
                            member.backend
                        ),
                    );
                }
            }
        }
        for (name, backend) in backends {
            // On a pool, `load` is already refused as a key of another kind.
            let pool = matches!(backend.kind, BackendKind::Pool { .. });
            if backend.load.is_some() && !read.contains(name) && !pool {
                self.error(
                    format!("ai.backends.{name}.load"),
                    "no pool reads this load: it is read for the members of a pool with `pick: least_loaded` or \
                     `saturation`",
                );
            }
        }
    }

    pub(super) fn members(
        &mut self,
        path: &str,
        pool: &str,
        raw: Option<Vec<RawPoolMember>>,
        catalog: &Catalog,
    ) -> Option<Vec<PoolMember>> {
        let raw = raw.unwrap_or_default();
        if raw.is_empty() {
            self.error(format!("{path}.members"), "a pool needs at least one member");
            return None;
        }
        let mut members: Vec<PoolMember> = Vec::new();
        let mut ok = true;
        for (i, member) in raw.into_iter().enumerate() {
            let item = format!("{path}.members[{i}]");
            let at_least_one = |this: &mut Self, key: &str, value: Option<u32>| match value {
                Some(0) => {
                    this.error(format!("{item}.{key}"), "must be at least 1");
                    None
                }
                other => Some(other.unwrap_or(1)),
            };
            let priority = at_least_one(self, "priority", member.priority);
            let weight = at_least_one(self, "weight", member.weight);
            let backend = self
                .required(&format!("{item}.backend"), member.backend, "(the member backend)")
                .and_then(|name| self.member(&format!("{item}.backend"), pool, &name, &members, catalog));
            match (backend, priority, weight) {
                (Some(backend), Some(priority), Some(weight)) => {
                    members.push(PoolMember { backend, priority, weight });
                }
                _ => ok = false,
            }
        }
        ok.then_some(members)
    }

    fn member(
        &mut self,
        path: &str,
        pool: &str,
        name: &str,
        members: &[PoolMember],
        catalog: &Catalog,
    ) -> Option<BackendId> {
        if name == pool {
            self.error(path, format!("pool {pool} cannot be its own member"));
            return None;
        }
        if members.iter().any(|m| m.backend.as_str() == name) {
            self.error(path, format!("`{name}` is already a member of this pool"));
            return None;
        }
        let (id, summary) = self.route_target(path, name, catalog, "a pool member")?;
        if matches!(summary.kind, RawBackendKind::Pool | RawBackendKind::InferencePool) {
            self.error(path, format!("pools do not nest: `{name}` is itself {}", summary.kind.a_backend()));
            return None;
        }
        Some(id)
    }

    /// What a pool declares about itself must hold for its members.
    pub(super) fn check_pool(
        &mut self,
        path: &str,
        external: Option<bool>,
        declared: Option<&[RawCapability]>,
        members: Option<&[PoolMember]>,
        catalog: &Catalog,
    ) {
        let members: Vec<(&str, &Summary)> = members
            .unwrap_or_default()
            .iter()
            .filter_map(|m| catalog.get(m.backend.as_str()).map(|s| (m.backend.as_str(), s)))
            .collect();
        if external == Some(false)
            && let Some((name, _)) = members.iter().find(|(_, s)| s.external)
        {
            self.error(
                format!("{path}.external"),
                format!(
                    "the pool is declared internal but its member `{name}` is external: a pool \
                     is internal only if all its members are"
                ),
            );
        }
        for &wanted in declared.unwrap_or_default() {
            let wanted = capability(wanted);
            if !members.is_empty() && !members.iter().any(|(_, s)| s.capabilities.contains(&wanted)) {
                self.error(
                    format!("{path}.capabilities"),
                    format!("no member of this pool serves {}", wanted.as_str()),
                );
            }
        }
    }
}
