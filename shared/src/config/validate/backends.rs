//! Backends: each kind's keys, references between backends, pools.
//!
//! A key that belongs to another kind is refused naming both kinds; a gRPC backend
//! never enters HTTP routing (its descriptor set is read here) (no fallback, pool or override may name it); a pool
//! never nests and is internal only if all its members are.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::super::descriptor;
use super::super::raw::{
    RawAuth, RawAuthKind, RawBackend, RawBackendKind, RawBreaker, RawCacheAffinity, RawCapability, RawEndpointPicker,
    RawFailureMode, RawIdentityHeaders, RawLoad, RawMetering, RawPick, RawPoolMember, RawPrice, RawSaturation,
    RawSecret, RawTarget, RawTls, RawUsageApi, RawUsageApiKind,
};
use super::super::values::{base_url, fraction_ppm, micro_eur, secret_ref, status_range};
use super::super::*;
use super::{Catalog, Checker, DEFAULT_SENSITIVE_HEADER, GATEWAY_HEADERS, RESERVED_HEADERS, Summary, capability};
use crate::call::headers::CREDENTIALS;

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a model server's metrics are read by default, and at the most.
const DEFAULT_LOAD_EVERY: Duration = Duration::from_secs(1);
const MIN_LOAD_EVERY: Duration = Duration::from_millis(100);
const DEFAULT_PREFIX_BYTES: u32 = 4096;
/// A descriptor set larger than this is not one an operator meant.
const MAX_DESCRIPTOR_SET_BYTES: u64 = 16 * 1024 * 1024;

const HTTP_KINDS: &[RawBackendKind] = &[RawBackendKind::Openai, RawBackendKind::Anthropic, RawBackendKind::Relay];
/// The kinds that serve model calls themselves: models, aliases, forwarded headers.
const CHAT_KINDS: &[RawBackendKind] =
    &[RawBackendKind::Openai, RawBackendKind::Anthropic, RawBackendKind::Relay, RawBackendKind::InferencePool];
/// The kinds with TLS towards an HTTP endpoint.
const TLS_KINDS: &[RawBackendKind] = &[
    RawBackendKind::Openai,
    RawBackendKind::Anthropic,
    RawBackendKind::Relay,
    RawBackendKind::Http,
    RawBackendKind::Grpc,
];
/// The kinds with credentials towards an HTTP endpoint.
const AUTH_KINDS: &[RawBackendKind] = &[
    RawBackendKind::Openai,
    RawBackendKind::Anthropic,
    RawBackendKind::Relay,
    RawBackendKind::Http,
    RawBackendKind::InferencePool,
];
const ROUTABLE_KINDS: &[RawBackendKind] = &[
    RawBackendKind::Openai,
    RawBackendKind::Anthropic,
    RawBackendKind::Relay,
    RawBackendKind::InferencePool,
    RawBackendKind::Pool,
];
const ENDPOINT_KINDS: &[RawBackendKind] = &[
    RawBackendKind::Openai,
    RawBackendKind::Anthropic,
    RawBackendKind::Relay,
    RawBackendKind::Grpc,
    RawBackendKind::Http,
];
/// The kinds that process data somewhere: every one but `pool`.
const JURISDICTION_KINDS: &[RawBackendKind] = &[
    RawBackendKind::Openai,
    RawBackendKind::Anthropic,
    RawBackendKind::Relay,
    RawBackendKind::Grpc,
    RawBackendKind::Http,
    RawBackendKind::InferencePool,
];
const POOL_KINDS: &[RawBackendKind] = &[RawBackendKind::Pool, RawBackendKind::InferencePool];
/// An inference pool's target path when none is given.
const DEFAULT_TARGET_PATH: &str = "/v1";
/// An OpenAPI contract larger than this is not one an operator meant.
const MAX_CONTRACT_BYTES: u64 = 16 * 1024 * 1024;
/// The paths the gateway serves itself: no REST mount may overlap them.
const GATEWAY_PATHS: [&str; 4] = ["/v1", "/metrics", "/healthz", "/console"];

fn kind_list(kinds: &[RawBackendKind]) -> String {
    kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
}

impl Checker<'_> {
    pub(super) fn backend(&mut self, name: &str, raw: RawBackend, catalog: &Catalog) -> Option<Backend> {
        let path = format!("ai.backends.{name}");
        let kind = raw.kind.unwrap_or(RawBackendKind::Openai);
        self.refuse_foreign_keys(&path, kind, &raw);
        let has_tls = raw.tls.is_some();
        let summary = catalog.get(name)?;

        let RawBackend {
            kind: _,
            url,
            auth,
            tls,
            price,
            models,
            aliases,
            default_model,
            capabilities,
            external,
            fallback,
            timeout,
            circuit_breaker,
            members,
            metering,
            identity_headers,
            descriptor_set,
            contract,
            mount,
            forward_headers,
            pick,
            cache_affinity,
            saturation,
            load,
            usage_api,
            jurisdiction,
            endpoint_picker,
            target,
        } = raw;

        // In the order keys are usually written, so errors read top to bottom.
        let backend_kind = match kind {
            RawBackendKind::Openai | RawBackendKind::Anthropic | RawBackendKind::Relay => {
                let endpoint = EndpointKeys { url, auth, tls, models, aliases, default_model, forward_headers };
                self.http_backend(&path, name, kind, endpoint, metering, identity_headers)
            }
            RawBackendKind::Grpc => {
                let url = self.url(&path, kind, url.as_deref());
                let tls = self.client_tls(&path, tls, url.as_deref());
                let read = self.descriptor_set(&path, name, descriptor_set);
                let (descriptor_set, services) = read?;
                self.grpc.insert(BackendId::new(name), Arc::new(services));
                Some(BackendKind::Grpc { url: url?, descriptor_set, tls: tls? })
            }
            RawBackendKind::Http => {
                let keys = EndpointKeys {
                    url,
                    auth,
                    tls,
                    models: None,
                    aliases: None,
                    default_model: None,
                    forward_headers: None,
                };
                let endpoint = self.endpoint(&path, kind, keys);
                let mount = self.mount(&path, mount);
                let contract = self.contract(&path, contract);
                Some(BackendKind::Http { endpoint: endpoint?, mount: mount?, contract: Arc::new(contract?) })
            }
            RawBackendKind::Pool => {
                let members = self.members(&path, name, members, catalog);
                let declared = capabilities.as_deref();
                self.check_pool(&path, external, declared, members.as_deref(), catalog);
                let picking = self.picking(&path, pick, cache_affinity, saturation);
                members.map(|members| BackendKind::Pool { members, picking })
            }
            RawBackendKind::InferencePool => {
                let auth = self.auth(&format!("{path}.auth"), auth);
                let forward_headers =
                    self.forward_headers(&format!("{path}.forward_headers"), forward_headers, auth.as_ref());
                let (picker, target_path) = self.inference_pool(&path, endpoint_picker, target)?;
                let members = match members {
                    None => Some(Vec::new()),
                    Some(_) if picker.failure_mode == FailureMode::FailClose => {
                        self.error(
                            format!("{path}.members"),
                            "used only when the picker cannot answer and `endpoint_picker.failure_mode` is                              fail_open; with fail_close they would never serve",
                        );
                        None
                    }
                    raw => self.members(&path, name, raw, catalog),
                };
                if picker.failure_mode == FailureMode::FailOpen && members.as_ref().is_some_and(Vec::is_empty) {
                    self.warn(
                        format!("{path}.endpoint_picker.failure_mode"),
                        "fail_open without `members`: a call the picker cannot answer goes to the pool's                          fallbacks, or is refused (503 picker_unavailable)",
                    );
                }
                self.check_pool(&path, external, None, members.as_deref(), catalog);
                let endpoint = Endpoint {
                    url: target_path,
                    auth: auth?,
                    tls: None,
                    models: models.unwrap_or_default(),
                    aliases: aliases.unwrap_or_default(),
                    default_model,
                    forward_headers: forward_headers?,
                };
                Some(BackendKind::InferencePool { endpoint, picker, members: members? })
            }
        };
        let price = self.backend_price(&path, name, kind, price);
        if capabilities.as_ref().is_some_and(Vec::is_empty) {
            self.error(
                format!("{path}.capabilities"),
                "list at least one of chat, vision, embeddings, realtime (or leave it out: default [chat])",
            );
        }
        let realtime = capabilities.as_ref().is_some_and(|c| c.contains(&RawCapability::Realtime));
        if realtime && matches!(kind, RawBackendKind::Anthropic | RawBackendKind::Relay | RawBackendKind::InferencePool)
        {
            self.error(
                format!("{path}.capabilities"),
                format!(
                    "realtime sessions speak OpenAI's realtime protocol to an `openai` backend; {} does not serve them",
                    kind.a_backend()
                ),
            );
        }
        if realtime && has_tls {
            self.error(
                format!("{path}.tls"),
                "a client certificate (mTLS) is not built for realtime sessions: serve realtime from a backend \
                 without `tls`",
            );
        }
        if kind == RawBackendKind::Anthropic
            && capabilities.as_ref().is_some_and(|c| c.contains(&RawCapability::Embeddings))
        {
            self.error(
                format!("{path}.capabilities"),
                "an anthropic backend serves chat and vision: the Messages API has no embeddings",
            );
        }
        let fallback = self.fallback(&format!("{path}.fallback"), name, fallback, catalog);
        let timeout = self.duration(&format!("{path}.timeout"), timeout.as_ref(), DEFAULT_TIMEOUT);
        let circuit_breaker = self.breaker(&format!("{path}.circuit_breaker"), circuit_breaker);
        let load = load.and_then(|raw| self.load(&format!("{path}.load"), raw));
        let usage_api = usage_api.and_then(|raw| self.usage_api(&format!("{path}.usage_api"), raw));
        let jurisdiction =
            jurisdiction.and_then(|label| super::jurisdiction(self, &format!("{path}.jurisdiction"), &label));

        Some(Backend {
            name: BackendId::new(name),
            kind: backend_kind?,
            external: summary.external,
            capabilities: summary.capabilities.clone(),
            price,
            fallback,
            timeout,
            circuit_breaker,
            load,
            jurisdiction,
            usage_api,
        })
    }

    /// An inference pool's `endpoint_picker` and `target`: the picker's settings and
    /// the target's path (`/v1`, no trailing slash).
    fn inference_pool(
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
                        "`{url}` is not an http://host:port address: the picker is spoken to over HTTP/2                          cleartext, as the Inference Extension's pickers serve"
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
    fn picking(
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
    fn load(&mut self, path: &str, raw: RawLoad) -> Option<LoadSource> {
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

    /// A backend's `usage_api`: its kind, admin key and base URL.
    fn usage_api(&mut self, path: &str, raw: RawUsageApi) -> Option<UsageApi> {
        let kind = self.required(&format!("{path}.kind"), raw.kind, "(openai or anthropic)");
        let secret_path = format!("{path}.secret");
        let secret = self.required(&secret_path, raw.secret, "(the admin key's reference)");
        // Its form only: the gateway never reads an admin key, so an unset one must
        // not stop a start; `reconcile --fetch` and `validate --resolve-secrets`
        // resolve it.
        let secret = secret.and_then(|raw| secret_ref(&raw.0).map_err(|m| self.error(&secret_path, m)).ok());
        let kind = match kind? {
            RawUsageApiKind::Openai => UsageApiKind::Openai,
            RawUsageApiKind::Anthropic => UsageApiKind::Anthropic,
        };
        let url = match raw.url {
            None => kind.default_url().to_owned(),
            Some(url) => match url.parse::<http::Uri>() {
                Ok(parsed) if matches!(parsed.scheme_str(), Some("http" | "https")) && parsed.host().is_some() => {
                    url.trim_end_matches('/').to_owned()
                }
                _ => {
                    self.error(format!("{path}.url"), format!("`{url}` is not an http:// or https:// URL"));
                    return None;
                }
            },
        };
        Some(UsageApi { kind, secret: secret?, url })
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

    /// REST mounts (SPEC §10): none over the gateway's own paths, none over another
    /// (one mount a prefix of the other, by whole segments).
    pub(super) fn mounts(&mut self, backends: &BTreeMap<BackendId, Backend>) {
        let within = |inner: &str, outer: &str| {
            inner == outer || inner.strip_prefix(outer).is_some_and(|rest| rest.starts_with('/'))
        };
        let mounts: Vec<(&BackendId, &str)> = backends
            .iter()
            .filter_map(|(name, b)| match &b.kind {
                BackendKind::Http { mount, .. } => Some((name, mount.as_str())),
                _ => None,
            })
            .collect();
        for (i, (name, mount)) in mounts.iter().enumerate() {
            let path = format!("ai.backends.{name}.mount");
            if let Some(own) = GATEWAY_PATHS.iter().find(|own| within(mount, own) || within(own, mount)) {
                self.error(&path, format!("`{mount}` overlaps the gateway's own {own}"));
            }
            for (other, other_mount) in &mounts[..i] {
                if within(mount, other_mount) || within(other_mount, mount) {
                    self.error(&path, format!("`{mount}` overlaps `{other_mount}`, the mount of backend `{other}`"));
                }
            }
        }
    }

    /// An `openai`, `anthropic` or `relay` backend.
    fn http_backend(
        &mut self,
        path: &str,
        name: &str,
        kind: RawBackendKind,
        endpoint: EndpointKeys,
        metering: Option<RawMetering>,
        identity_headers: Option<RawIdentityHeaders>,
    ) -> Option<BackendKind> {
        let endpoint = self.endpoint(path, kind, endpoint);
        match kind {
            RawBackendKind::Anthropic => endpoint.map(BackendKind::Anthropic),
            RawBackendKind::Relay => {
                let metering = match metering.unwrap_or(RawMetering::Local) {
                    RawMetering::Upstream => Metering::Upstream,
                    RawMetering::Local => {
                        self.warn(
                            path,
                            format!(
                                "relay {name} is metered locally (metering: local): if the \
                                 upstream Flexway meters too, its calls are counted twice; set \
                                 metering: upstream"
                            ),
                        );
                        Metering::Local
                    }
                };
                if let Some(url) = endpoint.as_ref().map(|e| &e.url).filter(|url| url.ends_with("/v1")) {
                    self.warn(
                        format!("{path}.url"),
                        format!(
                            "relay {name}: url is the other Flexway's base and the gateway appends /v1 \
                             ({url}/v1/chat/completions); leave /v1 out"
                        ),
                    );
                }
                let identity_headers = self.identity_headers(path, name, identity_headers);
                Some(BackendKind::Relay { endpoint: endpoint?, metering, identity_headers: identity_headers? })
            }
            _ => endpoint.map(BackendKind::OpenAi),
        }
    }

    /// The price of an endpoint; pools and gRPC backends are priced elsewhere.
    fn backend_price(&mut self, path: &str, name: &str, kind: RawBackendKind, price: Option<RawPrice>) -> Price {
        let price_path = format!("{path}.price");
        match (kind, price) {
            (RawBackendKind::Pool, Some(_)) => {
                self.warn(price_path, "not used: a call through a pool is priced at the member that served it");
                Price::default()
            }
            (RawBackendKind::Grpc, Some(_)) => {
                self.warn(
                    price_path,
                    "not used: gRPC methods are priced by their (flexway.v1.operation) option \
                     in the descriptor_set",
                );
                Price::default()
            }
            (RawBackendKind::Http, Some(_)) => {
                self.warn(price_path, "not used: REST operations are priced by their x-flexway-ai in the contract");
                Price::default()
            }
            (_, Some(price)) => self.price(&price_path, price),
            (RawBackendKind::Pool | RawBackendKind::Grpc | RawBackendKind::Http, None) => Price::default(),
            (_, None) => {
                self.warn(
                    path,
                    format!(
                        "backend {name} declares no price: its calls cost 0 € and never count \
                         against a euro budget"
                    ),
                );
                Price::default()
            }
        }
    }

    /// Keys that belong to other kinds of backend are refused, naming the kind.
    fn refuse_foreign_keys(&mut self, path: &str, kind: RawBackendKind, raw: &RawBackend) {
        let keys: [(&str, bool, &[RawBackendKind]); 23] = [
            ("url", raw.url.is_some(), ENDPOINT_KINDS),
            ("auth", raw.auth.is_some(), AUTH_KINDS),
            ("tls", raw.tls.is_some(), TLS_KINDS),
            ("models", raw.models.is_some(), CHAT_KINDS),
            ("aliases", raw.aliases.is_some(), CHAT_KINDS),
            ("default_model", raw.default_model.is_some(), CHAT_KINDS),
            ("capabilities", raw.capabilities.is_some(), ROUTABLE_KINDS),
            ("fallback", raw.fallback.is_some(), ROUTABLE_KINDS),
            ("members", raw.members.is_some(), POOL_KINDS),
            ("endpoint_picker", raw.endpoint_picker.is_some(), &[RawBackendKind::InferencePool]),
            ("target", raw.target.is_some(), &[RawBackendKind::InferencePool]),
            ("metering", raw.metering.is_some(), &[RawBackendKind::Relay]),
            ("identity_headers", raw.identity_headers.is_some(), &[RawBackendKind::Relay]),
            ("descriptor_set", raw.descriptor_set.is_some(), &[RawBackendKind::Grpc]),
            ("contract", raw.contract.is_some(), &[RawBackendKind::Http]),
            ("mount", raw.mount.is_some(), &[RawBackendKind::Http]),
            ("forward_headers", raw.forward_headers.is_some(), CHAT_KINDS),
            ("pick", raw.pick.is_some(), &[RawBackendKind::Pool]),
            ("cache_affinity", raw.cache_affinity.is_some(), &[RawBackendKind::Pool]),
            ("saturation", raw.saturation.is_some(), &[RawBackendKind::Pool]),
            ("load", raw.load.is_some(), HTTP_KINDS),
            ("usage_api", raw.usage_api.is_some(), &[RawBackendKind::Openai, RawBackendKind::Anthropic]),
            ("jurisdiction", raw.jurisdiction.is_some(), JURISDICTION_KINDS),
        ];
        let here = kind.a_backend();
        for (key, present, kinds) in keys {
            if !kinds.contains(&kind) {
                let applies_to = format!("kind {}", kind_list(kinds));
                self.refuse(path, key, present, &here, &applies_to);
            }
        }
    }

    fn price(&mut self, path: &str, raw: RawPrice) -> Price {
        let mut per_mtok = |key: &str, eur: Option<f64>| {
            let key_path = format!("{path}.{key}");
            let eur = self.required(&key_path, eur, "(euros per million tokens)")?;
            micro_eur(eur).map_err(|m| self.error(&key_path, m)).ok()
        };
        let input = per_mtok("input_per_mtok_eur", raw.input_per_mtok_eur);
        let output = per_mtok("output_per_mtok_eur", raw.output_per_mtok_eur);
        let mut optional = |key: &str, eur: Option<f64>| {
            let eur = eur?;
            micro_eur(eur).map_err(|m| self.error(format!("{path}.{key}"), m)).ok()
        };
        let cached_input_per_mtok = optional("cached_input_per_mtok_eur", raw.cached_input_per_mtok_eur);
        let cache_write_per_mtok = optional("cache_write_per_mtok_eur", raw.cache_write_per_mtok_eur);
        Price {
            input_per_mtok: input.unwrap_or_default(),
            output_per_mtok: output.unwrap_or_default(),
            cached_input_per_mtok,
            cache_write_per_mtok,
        }
    }

    fn fallback(&mut self, path: &str, name: &str, raw: Option<Vec<String>>, catalog: &Catalog) -> Vec<BackendId> {
        let mut fallback: Vec<BackendId> = Vec::new();
        for (i, target) in raw.unwrap_or_default().into_iter().enumerate() {
            let item = format!("{path}[{i}]");
            if target == name {
                self.error(item, format!("backend {name} cannot fall back to itself"));
            } else if fallback.iter().any(|f| f.as_str() == target) {
                self.error(item, format!("`{target}` is listed twice"));
            } else if let Some((id, _)) = self.route_target(&item, &target, catalog, "a fallback target") {
                fallback.push(id);
            }
        }
        fallback
    }

    fn breaker(&mut self, path: &str, raw: Option<RawBreaker>) -> BreakerPolicy {
        let defaults = BreakerPolicy::default();
        let Some(raw) = raw else { return defaults };
        let key = |k: &str| format!("{path}.{k}");

        if raw.failures == Some(0) {
            self.error(key("failures"), "must be at least 1");
        }
        if raw.min_requests == Some(0) {
            self.error(key("min_requests"), "must be at least 1");
        }
        let trigger = match (raw.failures, raw.failure_ratio, raw.min_requests) {
            (None, None, None) => defaults.trigger.clone(),
            (Some(failures), None, None) => BreakerTrigger::Failures(failures),
            (Some(_), Some(_), _) => {
                self.error(path, "give either `failures` or `failure_ratio` with `min_requests`, not both");
                defaults.trigger.clone()
            }
            (_, None, Some(_)) => {
                self.error(key("min_requests"), "goes with `failure_ratio`, which is missing");
                defaults.trigger.clone()
            }
            (None, Some(_), None) => {
                self.error(
                    key("min_requests"),
                    "required with `failure_ratio` (the requests to see before a ratio means \
                     anything)",
                );
                defaults.trigger.clone()
            }
            (None, Some(ratio), Some(min_requests)) => match fraction_ppm(ratio) {
                Ok(ratio_ppm) => BreakerTrigger::Ratio { ratio_ppm, min_requests },
                Err(message) => {
                    self.error(key("failure_ratio"), message);
                    defaults.trigger.clone()
                }
            },
        };
        let interval = self.duration(&key("interval"), raw.interval.as_ref(), defaults.interval);
        let trip = self.duration(&key("trip"), raw.trip.as_ref(), defaults.trip);
        let status = match raw.status {
            None => defaults.status.clone(),
            Some(list) => list
                .iter()
                .enumerate()
                .filter_map(|(i, s)| status_range(s).map_err(|m| self.error(format!("{path}.status[{i}]"), m)).ok())
                .collect(),
        };
        BreakerPolicy {
            trigger,
            interval,
            trip,
            status,
            accept_retry_after: raw.accept_retry_after.unwrap_or(defaults.accept_retry_after),
        }
    }

    /// `url` of an endpoint or grpc backend: parsed, scheme checked, trailing slash
    /// stripped. A gRPC URL is stored as http(s), the scheme gRPC runs over.
    fn url(&mut self, path: &str, kind: RawBackendKind, url: Option<&str>) -> Option<String> {
        let url_path = format!("{path}.url");
        let url = self.required(&url_path, url, &format!("for {}", kind.a_backend()))?;
        let parsed = base_url(url).map_err(|m| self.error(&url_path, m)).ok()?;
        let scheme = match (parsed.scheme.as_str(), kind) {
            ("http" | "https", _) => parsed.scheme.clone(),
            ("grpc", RawBackendKind::Grpc) => "http".to_owned(),
            ("grpcs", RawBackendKind::Grpc) => "https".to_owned(),
            ("grpc" | "grpcs", _) => {
                self.error(url_path, "a gRPC upstream must be declared kind: grpc");
                return None;
            }
            (other, _) => {
                self.error(url_path, format!("scheme `{other}` is not supported: use http:// or https://"));
                return None;
            }
        };
        Some(parsed.with_scheme(&scheme))
    }

    fn endpoint(&mut self, path: &str, kind: RawBackendKind, keys: EndpointKeys) -> Option<Endpoint> {
        let EndpointKeys { url, auth, tls, models, aliases, default_model, forward_headers } = keys;
        let url = self.url(path, kind, url.as_deref());
        let auth = self.auth(&format!("{path}.auth"), auth);
        let forward_headers = self.forward_headers(&format!("{path}.forward_headers"), forward_headers, auth.as_ref());
        let tls = self.client_tls(path, tls, url.as_deref())?;
        Some(Endpoint {
            url: url?,
            auth: auth?,
            tls,
            models: models.unwrap_or_default(),
            aliases: aliases.unwrap_or_default(),
            default_model,
            forward_headers: forward_headers?,
        })
    }

    /// The caller's headers a backend is sent: each a header name, listed once, and
    /// none that would carry a credential (the caller's key, a cookie, the backend's
    /// own auth header), frame or route the request (RFC 9110 §7.6.1, and the body's
    /// type), or say something only the gateway may say (its own `flexway-` headers,
    /// the trace context, the format's version, a WebSocket's handshake). The
    /// sensitivity and affinity headers are checked once `ai` is read.
    fn forward_headers(&mut self, path: &str, raw: Option<Vec<String>>, auth: Option<&Auth>) -> Option<Vec<String>> {
        let mut names: Vec<String> = Vec::new();
        let mut valid = true;
        for (i, raw_name) in raw.unwrap_or_default().iter().enumerate() {
            let at = format!("{path}[{i}]");
            let Some(name) = self.header(&at, raw_name) else {
                valid = false;
                continue;
            };
            let own_auth = matches!(auth, Some(Auth::Header { name: own, .. }) if own.eq_ignore_ascii_case(&name));
            let refusal = if CREDENTIALS.contains(&name.as_str()) || own_auth {
                Some("carries a credential: a caller's secret never reaches a backend")
            } else if RESERVED_HEADERS.contains(&name.as_str()) || GATEWAY_HEADERS.contains(&name.as_str()) {
                Some("is written by the gateway itself (or holds for one hop only)")
            } else if name.starts_with("flexway-") || name.starts_with("sec-websocket-") {
                Some("is the gateway's own: it is never passed on")
            } else if names.contains(&name) {
                Some("is listed twice")
            } else {
                None
            };
            match refusal {
                Some(why) => {
                    self.error(at, format!("`{name}` {why}"));
                    valid = false;
                }
                None => names.push(name),
            }
        }
        valid.then_some(names)
    }

    fn auth(&mut self, path: &str, raw: Option<RawAuth>) -> Option<Auth> {
        let Some(RawAuth { kind, secret, name, path: file }) = raw else {
            return Some(Auth::None);
        };
        let kind = self.required(&format!("{path}.type"), kind, "(none | bearer | header | token_file)")?;
        let here = format!("auth type {}", kind.name());
        let (needs_secret, needs_name, needs_path) = match kind {
            RawAuthKind::None => (false, false, false),
            RawAuthKind::Bearer => (true, false, false),
            RawAuthKind::Header => (true, true, false),
            RawAuthKind::TokenFile => (false, false, true),
        };
        self.refuse(path, "secret", secret.is_some() && !needs_secret, &here, "types bearer and header");
        self.refuse(path, "name", name.is_some() && !needs_name, &here, "type header");
        self.refuse(path, "path", file.is_some() && !needs_path, &here, "type token_file");

        let with = format!("(with auth type {})", kind.name());
        match kind {
            RawAuthKind::None => Some(Auth::None),
            RawAuthKind::Bearer => {
                let secret = self.required(&format!("{path}.secret"), secret, &with)?;
                Some(Auth::Bearer { secret: self.secret(&format!("{path}.secret"), &secret)? })
            }
            RawAuthKind::Header => {
                let name = self
                    .required(&format!("{path}.name"), name, &with)
                    .and_then(|n| self.sent_header(&format!("{path}.name"), &n));
                let secret = self
                    .required(&format!("{path}.secret"), secret, &with)
                    .and_then(|s| self.secret(&format!("{path}.secret"), &s));
                Some(Auth::Header { name: name?, secret: secret? })
            }
            // Not checked for existence: a projected token appears and rotates at run
            // time, and it is re-read at every call.
            RawAuthKind::TokenFile => self
                .non_empty(&format!("{path}.path"), file, "(the token file)")
                .map(|file| Auth::TokenFile { path: file.into() }),
        }
    }

    /// A client certificate and key (both, or no `tls`), and an optional CA: secret
    /// references to PEM text, resolvable now as every secret is (a warning under
    /// [`Secrets::Check`]). The PEM itself is parsed when the client is built.
    fn tls(&mut self, path: &str, raw: RawTls) -> Option<Tls> {
        let mut reference = |key: &str, value: Option<RawSecret>, required: &str| {
            let key_path = format!("{path}.{key}");
            let value = self.required(&key_path, value, required)?;
            self.secret(&key_path, &value)
        };
        let cert = reference("cert", raw.cert, "(the client certificate goes with its key)");
        let key = reference("key", raw.key, "(the client key goes with its certificate)");
        let ca = match raw.ca {
            Some(ca) => Some(reference("ca", Some(ca), "(a CA bundle)")?),
            None => None,
        };
        Some(Tls { cert: cert?, key: key?, ca })
    }

    /// The names a relay sends the caller's identity under. Left out, the names a
    /// receiving Flexway reads (`Flexway-Tenant`, `Flexway-Agent`, and the default
    /// `ai.sensitive_header`); declared, only the names given.
    fn identity_headers(&mut self, path: &str, name: &str, raw: Option<RawIdentityHeaders>) -> Option<IdentityHeaders> {
        let Some(raw) = raw else {
            return Some(IdentityHeaders {
                tenant: Some(TENANT_HEADER.to_owned()),
                agent: Some(AGENT_HEADER.to_owned()),
                sensitive: Some(DEFAULT_SENSITIVE_HEADER.to_ascii_lowercase()),
            });
        };
        let mut ok = true;
        let mut header = |key: &str, value: Option<String>| match value {
            None => None,
            Some(v) => {
                let parsed = self.sent_header(&format!("{path}.identity_headers.{key}"), &v);
                ok &= parsed.is_some();
                parsed
            }
        };
        let headers = IdentityHeaders {
            tenant: header("tenant", raw.tenant),
            agent: header("agent", raw.agent),
            sensitive: header("sensitive", raw.sensitive),
        };
        let names: Vec<&String> = [&headers.tenant, &headers.agent, &headers.sensitive].into_iter().flatten().collect();
        let distinct: BTreeSet<&String> = names.iter().copied().collect();
        if distinct.len() != names.len() {
            self.error(format!("{path}.identity_headers"), "tenant, agent and sensitive must be different headers");
            ok = false;
        }
        // The receiving Flexway reads fixed names: another one is sent for nothing.
        for (key, declared, read) in
            [("tenant", &headers.tenant, TENANT_HEADER), ("agent", &headers.agent, AGENT_HEADER)]
        {
            if declared.as_deref().is_some_and(|d| d != read) {
                self.warn(
                    format!("{path}.identity_headers.{key}"),
                    format!("relay {name} sends the {key} under a name a receiving Flexway does not read ({read})"),
                );
            }
        }
        ok.then_some(headers)
    }

    /// `mount`: an absolute path of segments, without a trailing `/` (overlaps with
    /// the gateway's own paths and other mounts are checked once all are read).
    fn mount(&mut self, path: &str, raw: Option<String>) -> Option<String> {
        let key_path = format!("{path}.mount");
        let mount =
            self.non_empty(&key_path, raw, "for an http backend (where its operations are served, e.g. /apis/ocr)")?;
        let segments_ok = mount.starts_with('/')
            && mount.len() > 1
            && !mount.ends_with('/')
            && mount[1..]
                .split('/')
                .all(|s| !s.is_empty() && s != "." && s != ".." && !s.contains(['{', '}', '?', '#']));
        if !segments_ok {
            self.error(key_path, format!("`{mount}` is not an absolute path of segments (e.g. /apis/ocr)"));
            return None;
        }
        Some(mount)
    }

    /// The contract, read now: the operations served and how each is metered. Every
    /// refusal names the file and the operation.
    fn contract(&mut self, path: &str, raw: Option<String>) -> Option<Contract> {
        let key_path = format!("{path}.contract");
        let file = self.non_empty(&key_path, raw, "for an http backend (its OpenAPI 3.0 or 3.1 contract)")?;
        let text = match std::fs::metadata(&file) {
            Ok(meta) if meta.len() > MAX_CONTRACT_BYTES => {
                self.error(
                    key_path,
                    format!("{file} is {} bytes, more than a contract needs ({MAX_CONTRACT_BYTES})", meta.len()),
                );
                return None;
            }
            _ => match std::fs::read_to_string(&file) {
                Ok(text) => text,
                Err(e) => {
                    self.error(key_path, format!("cannot read {file}: {e}"));
                    return None;
                }
            },
        };
        match super::super::contract::read(&text) {
            Ok(contract) => Some(contract),
            Err(reasons) => {
                for reason in reasons {
                    self.error(&key_path, format!("{file} {reason}"));
                }
                None
            }
        }
    }

    /// The descriptor set, read now: what the backend serves and how each method is
    /// metered. A file that cannot be used is an error. One that does not exist is a
    /// warning, because the set is often built and shipped apart from the config (the
    /// SPEC's example names one): the gateway itself does not start without it
    /// (`Gateway::new`).
    fn descriptor_set(&mut self, path: &str, name: &str, raw: Option<String>) -> Option<(PathBuf, GrpcServices)> {
        let key_path = format!("{path}.descriptor_set");
        let file =
            self.non_empty(&key_path, raw, "for a grpc backend (the FileDescriptorSet of the services it serves)")?;
        let bytes = match std::fs::metadata(&file).and_then(|meta| {
            if meta.len() > MAX_DESCRIPTOR_SET_BYTES {
                return Ok(Err(format!(
                    "{file} is {} bytes, more than a descriptor set needs ({MAX_DESCRIPTOR_SET_BYTES})",
                    meta.len()
                )));
            }
            if !meta.is_file() {
                return Ok(Err(format!("{file} is not a file")));
            }
            std::fs::read(&file).map(Ok)
        }) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let message = format!(
                    "{file} does not exist: gRPC calls to backend {name} will be refused until it does \
                     (flexway serve and the Lambda function do not start without it)"
                );
                self.warn(&key_path, message);
                return Some((PathBuf::from(file), GrpcServices::default()));
            }
            Err(e) => Err(format!("{file} cannot be read: {e}")),
            Ok(result) => result,
        };
        let bytes = bytes.map_err(|message| self.error(&key_path, message)).ok()?;
        if bytes.is_empty() {
            self.error(&key_path, format!("{file} is empty: it must be a serialized FileDescriptorSet"));
            return None;
        }
        match descriptor::services(&bytes) {
            Ok(services) => Some((PathBuf::from(file), services)),
            Err(reasons) => {
                for reason in reasons {
                    self.error(&key_path, format!("{file}: {reason}"));
                }
                None
            }
        }
    }

    /// A backend's `tls` (its client certificate), refused towards an `http://` url,
    /// where it would never be presented. `None` on an error; `Some(None)` without.
    fn client_tls(&mut self, path: &str, tls: Option<RawTls>, url: Option<&str>) -> Option<Option<Tls>> {
        let Some(tls) = tls else { return Some(None) };
        let tls = self.tls(&format!("{path}.tls"), tls)?;
        if url.is_some_and(|url| url.starts_with("http://")) {
            self.error(
                format!("{path}.tls"),
                "a client certificate is presented over TLS only: this backend's url is http://, so it would \
                 never be sent; write https:// or remove `tls`",
            );
            return None;
        }
        Some(Some(tls))
    }

    fn members(
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
    fn check_pool(
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

/// The keys of an HTTP endpoint, taken together out of a raw backend.
struct EndpointKeys {
    url: Option<String>,
    auth: Option<RawAuth>,
    tls: Option<RawTls>,
    models: Option<Vec<String>>,
    aliases: Option<BTreeMap<String, String>>,
    default_model: Option<String>,
    forward_headers: Option<Vec<String>>,
}
