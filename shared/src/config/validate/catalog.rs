//! What every section's references are checked against: a [`Catalog`] of the declared
//! backends, pools resolved, built before any section is judged so that the order of
//! the document never matters. A backend whose entry did not parse is in doubt and
//! never judged; a gRPC or REST backend is never a route target.

use std::collections::{BTreeMap, BTreeSet};

use super::super::raw::{RawBackend, RawBackendKind, RawCapability};
use super::super::*;
use super::{Checker, Unparsed};

/// What routing rules need to know of each declared backend, pools resolved.
pub(super) struct Summary {
    pub(super) kind: RawBackendKind,
    /// External unless declared `external: false`; a pool is also external when any
    /// of its members is.
    pub(super) external: bool,
    pub(super) capabilities: BTreeSet<Capability>,
}

pub(super) struct Catalog {
    pub(super) backends: BTreeMap<String, Summary>,
    /// Backends whose shape was wrong, and the pools they are members of.
    in_doubt: BTreeSet<String>,
    /// `ai` or `ai.backends` itself was of the wrong shape.
    all_in_doubt: bool,
}

impl Catalog {
    pub(super) fn new(backends: &BTreeMap<String, RawBackend>, unparsed: &Unparsed) -> Catalog {
        let mut catalog = BTreeMap::new();
        for (name, raw) in backends {
            let kind = raw.kind.unwrap_or(RawBackendKind::Openai);
            let capabilities = match (kind, &raw.capabilities) {
                (RawBackendKind::Grpc | RawBackendKind::Http, _) => BTreeSet::new(),
                (_, Some(declared)) => declared.iter().map(|&c| capability(c)).collect(),
                (RawBackendKind::Pool, None) => BTreeSet::new(), // the members', below
                (_, None) => BTreeSet::from([Capability::Chat]),
            };
            let external = raw.external.unwrap_or(true);
            catalog.insert(name.clone(), Summary { kind, external, capabilities });
        }
        // Members are never pools (refused below), so one pass resolves every pool.
        // An inference pool's members (its fail-open pool) make it external too.
        for (name, raw) in backends {
            if !matches!(raw.kind, Some(RawBackendKind::Pool | RawBackendKind::InferencePool)) {
                continue;
            }
            let members: Vec<&Summary> = raw
                .members
                .iter()
                .flatten()
                .filter_map(|m| m.backend.as_deref())
                .filter_map(|m| catalog.get(m))
                .filter(|s: &&Summary| !matches!(s.kind, RawBackendKind::Pool | RawBackendKind::InferencePool))
                .collect();
            let any_external = members.iter().any(|m| m.external);
            let union: BTreeSet<Capability> = members.iter().flat_map(|m| m.capabilities.iter().copied()).collect();
            if let Some(pool) = catalog.get_mut(name) {
                pool.external |= any_external;
                if raw.capabilities.is_none() && raw.kind == Some(RawBackendKind::Pool) {
                    pool.capabilities = union;
                }
            }
        }
        // A pool is only as certain as its members.
        let mut in_doubt = unparsed.backends();
        let doubtful_pools: Vec<String> = backends
            .iter()
            .filter(|(_, raw)| {
                let members = raw.members.iter().flatten();
                members.filter_map(|m| m.backend.as_ref()).any(|m| in_doubt.contains(m))
            })
            .map(|(name, _)| name.clone())
            .collect();
        in_doubt.extend(doubtful_pools);
        Catalog { backends: catalog, in_doubt, all_in_doubt: unparsed.all_backends() }
    }

    pub(super) fn get(&self, name: &str) -> Option<&Summary> {
        self.backends.get(name)
    }

    /// Whether `name` may have been declared, or declared otherwise, in entries that
    /// did not parse.
    fn is_in_doubt(&self, name: &str) -> bool {
        self.all_in_doubt || self.in_doubt.contains(name)
    }
}

pub(super) fn capability(raw: RawCapability) -> Capability {
    match raw {
        RawCapability::Chat => Capability::Chat,
        RawCapability::Vision => Capability::Vision,
        RawCapability::Embeddings => Capability::Embeddings,
        RawCapability::Realtime => Capability::Realtime,
    }
}

pub(super) fn capability_list(capabilities: &BTreeSet<Capability>) -> String {
    if capabilities.is_empty() {
        return "none".into();
    }
    capabilities.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(", ")
}

impl Checker<'_> {
    /// A declared backend that HTTP routing may use (not gRPC), for `role`.
    pub(super) fn route_target<'c>(
        &mut self,
        path: &str,
        name: &str,
        catalog: &'c Catalog,
        role: &str,
    ) -> Option<(BackendId, &'c Summary)> {
        if catalog.is_in_doubt(name) {
            return None;
        }
        let Some(summary) = catalog.get(name) else {
            self.error(path, format!("backend `{name}` is not declared under ai.backends"));
            return None;
        };
        if summary.kind == RawBackendKind::Grpc {
            self.error(
                path,
                format!(
                    "backend `{name}` is kind grpc: a gRPC upstream only serves gRPC calls \
                     and cannot be {role}"
                ),
            );
            return None;
        }
        if summary.kind == RawBackendKind::Http {
            self.error(
                path,
                format!(
                    "backend `{name}` is kind http: a REST upstream only serves its contract's operations under \
                     its mount and cannot be {role}"
                ),
            );
            return None;
        }
        Some((BackendId::new(name), summary))
    }
}
