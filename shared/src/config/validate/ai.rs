//! `ai` besides its backends: the default backend, capability overrides, the
//! sensitive header and backend (internal only), the soft budget cap, vision and
//! response limits, affinity, the response cache (`cache.rs`). A header the gateway
//! reads of its caller is never one a backend is forwarded.

use std::collections::BTreeMap;

use super::super::raw::{RawAi, RawBackendKind, RawBudgetPolicy, RawLimits, RawVision};
use super::super::values::{fraction_ppm, https_origin};
use super::super::*;
use super::{Catalog, Checker, DEFAULT_SENSITIVE_HEADER, capability_list};

const DEFAULT_MAX_TOKENS: u32 = 4096;
const DEFAULT_MIN_COMPLETION_TOKENS: u32 = 16;
const DEFAULT_MAX_IMAGE_BYTES: u64 = 8 * 1024 * 1024;
const DEFAULT_MAX_BODY_BYTES: u64 = 24 * 1024 * 1024;
const DEFAULT_MAX_RESPONSE_BYTES: u64 = 64 * 1024 * 1024;
const DEFAULT_MAX_EVENT_BYTES: u64 = 1024 * 1024;

impl Checker<'_> {
    /// `cache_in_doubt`: `ai.cache` lost a value to a shape error (already an error):
    /// what names its policies is not judged.
    pub(super) fn ai(
        &mut self,
        raw: RawAi,
        catalog: &Catalog,
        backends: BTreeMap<BackendId, Backend>,
        cache_in_doubt: bool,
    ) -> Option<Ai> {
        let RawAi {
            default_backend,
            capabilities,
            sensitive_header,
            sensitive_backend,
            budget,
            vision,
            limits,
            affinity,
            cache,
            backends: _,
        } = raw;

        // A configuration of gRPC and REST backends only serves no model call (SPEC §10).
        let grpc_only = !catalog.backends.is_empty()
            && catalog
                .backends
                .values()
                .all(|summary| matches!(summary.kind, RawBackendKind::Grpc | RawBackendKind::Http));
        let default_backend = match default_backend {
            None if grpc_only => Some(BackendId::new("")),
            default_backend => self
                .required(
                    "ai.default_backend",
                    default_backend,
                    "(the backend serving what no override routes elsewhere)",
                )
                .and_then(|b| self.route_target("ai.default_backend", &b, catalog, "the default backend"))
                .map(|(id, _)| id),
        };

        let capabilities = capabilities.unwrap_or_default();
        let capabilities = CapabilityOverrides {
            vision: self.capability_backend("vision", capabilities.vision, Capability::Vision, catalog),
            embeddings: self.capability_backend("embeddings", capabilities.embeddings, Capability::Embeddings, catalog),
            realtime: self.capability_backend("realtime", capabilities.realtime, Capability::Realtime, catalog),
        };

        let sensitive_header =
            self.header("ai.sensitive_header", sensitive_header.as_deref().unwrap_or(DEFAULT_SENSITIVE_HEADER));
        let sensitive_backend = sensitive_backend.and_then(|name| {
            let path = "ai.sensitive_backend";
            let (id, summary) = self.route_target(path, &name, catalog, "the sensitive backend")?;
            if summary.external {
                self.error(
                    path,
                    format!(
                        "sensitive_backend {name} is external; sensitive requests only go to an \
                         internal backend (declared `external: false`; for a pool, all its members)"
                    ),
                );
                return None;
            }
            Some(id)
        });

        let budget = self.budget_policy(budget.unwrap_or_default(), catalog);
        let vision = self.vision(vision.unwrap_or_default());
        let limits = self.limits(limits.unwrap_or_default());
        let affinity = affinity.and_then(|raw| {
            let header = self.required(
                "ai.affinity.header",
                raw.header,
                "(the header carrying the session, e.g. Flexway-Session)",
            )?;
            self.header("ai.affinity.header", &header).map(|header| Affinity { header })
        });
        // The headers the gateway reads of its caller are never passed on.
        let read: Vec<&str> =
            sensitive_header.iter().chain(affinity.as_ref().map(|a| &a.header)).map(String::as_str).collect();
        for (name, backend) in &backends {
            let forwarded = backend.kind.endpoint().map(|e| e.forward_headers.as_slice()).unwrap_or_default();
            for (i, header) in forwarded.iter().enumerate() {
                if read.contains(&header.as_str()) {
                    self.error(
                        format!("ai.backends.{name}.forward_headers[{i}]"),
                        format!(
                            "`{header}` is read by the gateway itself (ai.sensitive_header, ai.affinity.header): \
                             it is never passed on"
                        ),
                    );
                }
            }
        }

        let cache = cache.and_then(|raw| self.cache(raw, catalog, &backends));
        if !cache_in_doubt {
            let rest = self.rest_cache_policies(cache.as_ref(), &backends);
            if let Some(cache) = &cache {
                self.unused_cache_policies(cache, &rest);
            }
        }

        Some(Ai {
            default_backend: default_backend?,
            capabilities,
            sensitive_header: sensitive_header?,
            sensitive_backend,
            budget: budget?,
            vision: vision?,
            limits,
            affinity,
            cache,
            any_quota: backends.values().any(|b| !b.quota.is_none()),
            backends,
            grpc: std::mem::take(&mut self.grpc),
        })
    }

    fn capability_backend(
        &mut self,
        key: &str,
        name: Option<String>,
        needed: Capability,
        catalog: &Catalog,
    ) -> Option<BackendId> {
        let name = name?;
        let path = format!("ai.capabilities.{key}");
        let (id, summary) = self.route_target(&path, &name, catalog, &format!("the {key} backend"))?;
        if !summary.capabilities.contains(&needed) {
            self.error(
                path,
                format!(
                    "backend `{name}` does not serve {} (its capabilities: {})",
                    needed.as_str(),
                    capability_list(&summary.capabilities)
                ),
            );
            return None;
        }
        Some(id)
    }

    fn budget_policy(&mut self, raw: RawBudgetPolicy, catalog: &Catalog) -> Option<BudgetPolicy> {
        let soft = raw.soft.and_then(|soft| {
            let threshold = self
                .required("ai.budget.soft.threshold", soft.threshold, "(a fraction of any budget, e.g. 0.8)")
                .and_then(|t| fraction_ppm(t).map_err(|m| self.error("ai.budget.soft.threshold", m)).ok());
            let backend = self
                .required("ai.budget.soft.backend", soft.backend, "(the cheaper backend)")
                .and_then(|b| self.route_target("ai.budget.soft.backend", &b, catalog, "the soft-cap backend"));
            Some(SoftCap { threshold_ppm: threshold?, backend: backend?.0 })
        });
        let default_max_tokens = raw.default_max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
        if default_max_tokens == 0 {
            self.error("ai.budget.default_max_tokens", "must be greater than zero");
        }
        let min_completion_tokens = raw.min_completion_tokens.unwrap_or(DEFAULT_MIN_COMPLETION_TOKENS);
        if min_completion_tokens > default_max_tokens {
            self.error(
                "ai.budget.min_completion_tokens",
                format!("{min_completion_tokens} is more than default_max_tokens ({default_max_tokens})"),
            );
        }
        Some(BudgetPolicy { soft, default_max_tokens, min_completion_tokens })
    }

    fn limits(&mut self, raw: RawLimits) -> Limits {
        let max_response_bytes = raw.max_response_bytes.unwrap_or(DEFAULT_MAX_RESPONSE_BYTES);
        let max_event_bytes = raw.max_event_bytes.unwrap_or(DEFAULT_MAX_EVENT_BYTES);
        if max_response_bytes == 0 {
            self.error("ai.limits.max_response_bytes", "must be greater than zero");
        }
        if max_event_bytes == 0 {
            self.error("ai.limits.max_event_bytes", "must be greater than zero");
        }
        Limits { max_response_bytes, max_event_bytes }
    }

    fn vision(&mut self, raw: RawVision) -> Option<VisionPolicy> {
        let max_image_bytes = raw.max_image_bytes.unwrap_or(DEFAULT_MAX_IMAGE_BYTES);
        let max_body_bytes = raw.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
        if max_image_bytes == 0 {
            self.error("ai.vision.max_image_bytes", "must be greater than zero");
        }
        if max_body_bytes == 0 {
            self.error("ai.vision.max_body_bytes", "must be greater than zero");
        }
        if max_image_bytes > max_body_bytes {
            self.error(
                "ai.vision.max_image_bytes",
                format!(
                    "{max_image_bytes} is more than max_body_bytes ({max_body_bytes}): an image \
                     travels inside the body"
                ),
            );
        }
        let mut allowed_origins = Vec::new();
        for (i, origin) in raw.allowed_origins.unwrap_or_default().iter().enumerate() {
            match https_origin(origin) {
                Ok(origin) if allowed_origins.contains(&origin) => {}
                Ok(origin) => allowed_origins.push(origin),
                Err(message) => self.error(format!("ai.vision.allowed_origins[{i}]"), message),
            }
        }
        Some(VisionPolicy { max_image_bytes, max_body_bytes, allowed_origins })
    }
}
