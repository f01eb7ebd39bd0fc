//! Backends: the keys every kind shares (price, fallback, circuit breaker, timeout,
//! capabilities, jurisdiction, usage API); each kind's own keys are read in its file
//! (`endpoint`, `pools`, `grpc`, `rest`).
//!
//! A key that belongs to another kind is refused naming both kinds; a gRPC backend
//! never enters HTTP routing (no fallback, pool or override may name it); a pool
//! never nests and is internal only if all its members are.

use std::sync::Arc;
use std::time::Duration;

use super::super::raw::{
    RawBackend, RawBackendKind, RawBreaker, RawCapability, RawPrice, RawUsageApi, RawUsageApiKind,
};
use super::super::values::{fraction_ppm, micro_eur, secret_ref, status_range};
use super::super::*;
use super::endpoint::EndpointKeys;
use super::{Catalog, Checker};

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

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
const POOL_KINDS: &[RawBackendKind] = &[RawBackendKind::Pool, RawBackendKind::InferencePool];
/// Every kind but `pool`: the kinds a call is sent to under their own name, so that
/// process data somewhere (a jurisdiction) and have their own timeout and breaker; a
/// pool's calls go to its members, under theirs.
const TRIED_KINDS: &[RawBackendKind] = &[
    RawBackendKind::Openai,
    RawBackendKind::Anthropic,
    RawBackendKind::Relay,
    RawBackendKind::Grpc,
    RawBackendKind::Http,
    RawBackendKind::InferencePool,
];

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
            quota,
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
                            "used only when the picker cannot answer and `endpoint_picker.failure_mode` is \
                             fail_open; with fail_close they would never serve",
                        );
                        None
                    }
                    raw => self.members(&path, name, raw, catalog),
                };
                if picker.failure_mode == FailureMode::FailOpen && members.as_ref().is_some_and(Vec::is_empty) {
                    self.warn(
                        format!("{path}.endpoint_picker.failure_mode"),
                        "fail_open without `members`: a call the picker cannot answer goes to the pool's \
                         fallbacks, or is refused (503 picker_unavailable)",
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
        let quota = self.rates(&format!("{path}.quota"), quota);

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
            quota,
        })
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

    /// The price of an endpoint; pools, gRPC and REST backends are priced elsewhere, and
    /// a `price` on them, which nothing would read, is refused.
    fn backend_price(&mut self, path: &str, name: &str, kind: RawBackendKind, price: Option<RawPrice>) -> Price {
        let price_path = format!("{path}.price");
        match (kind, price) {
            (RawBackendKind::Pool, Some(_)) => {
                self.error(price_path, "a pool has no price: a call through it is priced at the member that served it");
                Price::default()
            }
            (RawBackendKind::Grpc, Some(_)) => {
                self.error(
                    price_path,
                    "a grpc backend has no price: its methods are priced by their (flexway.v1.operation) \
                     option in the descriptor_set",
                );
                Price::default()
            }
            (RawBackendKind::Http, Some(_)) => {
                self.error(
                    price_path,
                    "an http backend has no price: its operations are priced by their x-flexway-ai in the contract",
                );
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
        let keys: [(&str, bool, &[RawBackendKind]); 26] = [
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
            ("jurisdiction", raw.jurisdiction.is_some(), TRIED_KINDS),
            ("quota", raw.quota.is_some(), CHAT_KINDS),
            ("timeout", raw.timeout.is_some(), TRIED_KINDS),
            ("circuit_breaker", raw.circuit_breaker.is_some(), TRIED_KINDS),
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
}
