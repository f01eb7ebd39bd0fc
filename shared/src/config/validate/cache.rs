//! `ai.cache` (SPEC §16): the store, the key entries are sealed under, the policies,
//! and the model names each applies to; and what refers to a policy from elsewhere
//! (a REST operation's `x-flexway-ai: {cache: POLICY}`). A semantic policy needs an
//! embedding backend and a store that compares vectors (not DynamoDB); an embeddings
//! model and a REST operation are cached in exact mode only.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::super::raw::{
    RawCache, RawCacheEmbed, RawCacheMode, RawCachePolicy, RawCacheScope, RawCacheSensitive, RawCacheStore,
    RawCacheStoreKind, RawCharge,
};
use super::super::*;
use super::{Catalog, Checker, capability_list};

const DEFAULT_THRESHOLD: f32 = 0.95;
const DEFAULT_MAX_ENTRY_BYTES: u64 = 256 * 1024;
/// SPEC §16 gives none: enough for a busy tenant's day of distinct questions, small
/// enough that an embedded store stays a file of a few hundred MiB per tenant.
const DEFAULT_MAX_ENTRIES_PER_TENANT: u64 = 100_000;
const PPM: u32 = 1_000_000;

impl Checker<'_> {
    /// `ai.cache`, or `None` when it has an error (reported).
    pub(super) fn cache(
        &mut self,
        raw: RawCache,
        catalog: &Catalog,
        backends: &BTreeMap<BackendId, Backend>,
    ) -> Option<Cache> {
        let RawCache { store, key, policies, models } = raw;
        let store = self
            .required("ai.cache.store", store, "(where entries are kept: {kind: embedded, path: ...})")
            .and_then(|store| self.cache_store(store));
        let key = self
            .required("ai.cache.key", key, "(the secret reference of the key entries are sealed under)")
            .and_then(|key| self.secret("ai.cache.key", &key));

        let raw_policies = policies.unwrap_or_default();
        if raw_policies.is_empty() {
            self.error("ai.cache.policies", "declare at least one policy (or leave ai.cache out: nothing is cached)");
        }
        let declared: BTreeSet<String> = raw_policies.keys().cloned().collect();
        let mut policies = BTreeMap::new();
        let mut complete = true;
        for (name, raw) in raw_policies {
            match self.cache_policy(&name, raw, catalog) {
                Some(policy) => {
                    policies.insert(name, Arc::new(policy));
                }
                None => complete = false,
            }
        }
        if let Some(CacheStoreConfig::DynamoDb { .. }) = &store {
            for (name, policy) in &policies {
                if policy.mode == CacheMode::Semantic {
                    self.error(
                        format!("ai.cache.policies.{name}.mode"),
                        "semantic policies need the embedded or postgres store; DynamoDB keeps exact entries only \
                         (make this policy exact, or change ai.cache.store)",
                    );
                    complete = false;
                }
            }
        }

        let embeddings_models = embeddings_models(backends);
        let mut mapped = BTreeMap::new();
        for (model, policy) in models.unwrap_or_default() {
            let path = format!("ai.cache.models.{model}");
            if model.trim().is_empty() {
                self.error(&path, "must not be empty: the model name a caller sends");
                complete = false;
                continue;
            }
            if !declared.contains(&policy) {
                let message =
                    format!("policy `{policy}` is not declared under ai.cache.policies ({})", list(&declared));
                self.error(&path, message);
                complete = false;
                continue;
            }
            let semantic = policies.get(&policy).is_some_and(|p| p.mode == CacheMode::Semantic);
            if semantic && let Some(backend) = embeddings_models.get(model.as_str()) {
                self.error(
                    &path,
                    format!(
                        "`{model}` is an embeddings model (backend `{backend}` serves it): embeddings are cached in \
                         exact mode only; map it to an exact policy"
                    ),
                );
                complete = false;
                continue;
            }
            mapped.insert(model, policy);
        }

        if !complete {
            return None;
        }
        Some(Cache { store: store?, key: key?, policies, models: mapped })
    }

    fn cache_store(&mut self, raw: RawCacheStore) -> Option<CacheStoreConfig> {
        let RawCacheStore { kind, path, url, table } = raw;
        let parent = "ai.cache.store";
        let kind = self.required("ai.cache.store.kind", kind, "(embedded | postgres | dynamodb)")?;
        let (has_path, has_url, has_table) = (path.is_some(), url.is_some(), table.is_some());
        match kind {
            RawCacheStoreKind::Embedded => {
                self.refuse(parent, "url", has_url, "cache store kind embedded", "kind postgres");
                self.refuse(parent, "table", has_table, "cache store kind embedded", "kind dynamodb");
                let path = self.non_empty("ai.cache.store.path", path, "(the cache file of kind embedded)")?;
                Some(CacheStoreConfig::Embedded { path: path.into() })
            }
            RawCacheStoreKind::Postgres => {
                self.refuse(parent, "path", has_path, "cache store kind postgres", "kind embedded");
                self.refuse(parent, "table", has_table, "cache store kind postgres", "kind dynamodb");
                let url = self.required(
                    "ai.cache.store.url",
                    url,
                    "(the secret reference of the PostgreSQL URL of kind postgres)",
                )?;
                let url = self.secret("ai.cache.store.url", &url)?;
                Some(CacheStoreConfig::Postgres { url })
            }
            RawCacheStoreKind::Dynamodb => {
                self.refuse(parent, "path", has_path, "cache store kind dynamodb", "kind embedded");
                self.refuse(parent, "url", has_url, "cache store kind dynamodb", "kind postgres");
                let table = self.non_empty("ai.cache.store.table", table, "(the DynamoDB table of kind dynamodb)")?;
                Some(CacheStoreConfig::DynamoDb { table })
            }
        }
    }

    fn cache_policy(&mut self, name: &str, raw: RawCachePolicy, catalog: &Catalog) -> Option<CachePolicy> {
        let path = format!("ai.cache.policies.{name}");
        let at = |key: &str| format!("{path}.{key}");
        let RawCachePolicy {
            mode,
            ttl,
            threshold,
            embed,
            scope,
            charge,
            max_entry_bytes,
            max_entries_per_tenant,
            sensitive,
        } = raw;
        let named = is_policy_name(name);
        if !named {
            self.error(
                &path,
                format!(
                    "`{name}` is not a policy name: 1 to 64 letters, digits, `.`, `_` or `-` (it labels metrics and \
                     `flexway cache purge --policy`)"
                ),
            );
        }
        let mode = self.required(&at("mode"), mode, "(exact | semantic)");
        let ttl =
            self.required(&at("ttl"), ttl, "(how long an entry serves, e.g. 1h)").and_then(|ttl| match parse_duration(
                &ttl.0,
            ) {
                Ok(ttl) if ttl.is_zero() => {
                    self.error(at("ttl"), "must be longer than zero");
                    None
                }
                Ok(ttl) => Some(ttl),
                Err(message) => {
                    self.error(at("ttl"), message);
                    None
                }
            });

        let (threshold, embed) = match mode {
            Some(RawCacheMode::Exact) => {
                let here = "mode exact (the last user message byte for byte)";
                self.refuse(&path, "threshold", threshold.is_some(), here, "mode semantic");
                self.refuse(&path, "embed", embed.is_some(), here, "mode semantic");
                let valid = threshold.is_none() && embed.is_none();
                (valid.then_some(DEFAULT_THRESHOLD), valid.then_some(None))
            }
            Some(RawCacheMode::Semantic) => {
                let threshold = match threshold {
                    None => Some(DEFAULT_THRESHOLD),
                    Some(t) if t > 0.0 && t <= 1.0 => Some(t as f32),
                    Some(t) => {
                        let message = format!("must be a cosine similarity greater than 0 and at most 1 (got {t})");
                        self.error(at("threshold"), message);
                        None
                    }
                };
                let embed = self
                    .required(
                        &at("embed"),
                        embed,
                        "for mode semantic ({backend, model}: what embeds the last user message)",
                    )
                    .and_then(|embed| self.cache_embed(&at("embed"), embed, catalog));
                (threshold, embed.map(Some))
            }
            None => (None, None),
        };

        let scope = match scope {
            None | Some(RawCacheScope::Tenant) => CacheScope::Tenant,
            Some(RawCacheScope::Agent) => CacheScope::Agent,
        };
        let charge_ppm = match charge {
            None => Some(0),
            Some(RawCharge(text)) => charge_ppm(&text).map_err(|message| self.error(at("charge"), message)).ok(),
        };
        let max_entry_bytes = max_entry_bytes.unwrap_or(DEFAULT_MAX_ENTRY_BYTES);
        if max_entry_bytes == 0 {
            self.error(at("max_entry_bytes"), "must be greater than zero");
        }
        let max_entries_per_tenant = max_entries_per_tenant.unwrap_or(DEFAULT_MAX_ENTRIES_PER_TENANT);
        if max_entries_per_tenant == 0 {
            self.error(at("max_entries_per_tenant"), "must be at least 1 (or map no model to this policy)");
        }
        if !named || max_entry_bytes == 0 || max_entries_per_tenant == 0 {
            return None;
        }
        Some(CachePolicy {
            mode: match mode? {
                RawCacheMode::Exact => CacheMode::Exact,
                RawCacheMode::Semantic => CacheMode::Semantic,
            },
            ttl: ttl?,
            threshold: threshold?,
            embed: embed?,
            scope,
            charge_ppm: charge_ppm?,
            max_entry_bytes,
            max_entries_per_tenant,
            sensitive_allowed: sensitive == Some(RawCacheSensitive::Allow),
        })
    }

    fn cache_embed(&mut self, path: &str, raw: RawCacheEmbed, catalog: &Catalog) -> Option<CacheEmbed> {
        let model =
            self.non_empty(&format!("{path}.model"), raw.model, "(the embedding model, e.g. text-embedding-3-small)");
        let backend_path = format!("{path}.backend");
        let name = self.non_empty(&backend_path, raw.backend, "(a backend serving embeddings)")?;
        let (backend, summary) =
            self.route_target(&backend_path, &name, catalog, "a cache policy's embedding backend")?;
        if !summary.capabilities.contains(&Capability::Embeddings) {
            self.error(
                backend_path,
                format!(
                    "backend `{name}` does not serve embeddings (its capabilities: {}): a semantic policy embeds \
                     through a backend declaring `capabilities: [embeddings]`",
                    capability_list(&summary.capabilities)
                ),
            );
            return None;
        }
        Some(CacheEmbed { backend, model: model? })
    }

    /// The REST operations naming a cache policy (`x-flexway-ai: {cache: POLICY}`):
    /// a declared policy, of mode exact. Answers the policies they name.
    pub(super) fn rest_cache_policies(
        &mut self,
        cache: Option<&Cache>,
        backends: &BTreeMap<BackendId, Backend>,
    ) -> BTreeSet<String> {
        let mut used = BTreeSet::new();
        for (name, backend) in backends {
            let BackendKind::Http { contract, .. } = &backend.kind else { continue };
            let path = format!("ai.backends.{name}.contract");
            for operation in &contract.operations {
                let Some(policy) = operation.ai.as_ref().and_then(|ai| ai.cache.as_ref()) else { continue };
                let what = format!("{} {}: x-flexway-ai cache `{policy}`", operation.method, operation.path);
                match cache.map(|c| (c, c.policies.get(policy))) {
                    None => self.error(
                        &path,
                        format!("{what} names a policy, but ai.cache is not declared: declare it, or remove `cache`"),
                    ),
                    Some((cache, None)) => {
                        let declared: BTreeSet<String> = cache.policies.keys().cloned().collect();
                        let message = format!("{what} is not declared under ai.cache.policies ({})", list(&declared));
                        self.error(&path, message);
                    }
                    Some((_, Some(p))) if p.mode == CacheMode::Semantic => self.error(
                        &path,
                        format!("{what} is a semantic policy: REST operations are cached in exact mode only"),
                    ),
                    Some(_) => {
                        used.insert(policy.clone());
                    }
                }
            }
        }
        used
    }

    /// A warning for policies nothing applies to: no model name maps to them and no
    /// REST operation names them.
    pub(super) fn unused_cache_policies(&mut self, cache: &Cache, rest: &BTreeSet<String>) {
        let used: BTreeSet<&String> = cache.models.values().chain(rest).collect();
        if used.is_empty() {
            self.warn(
                "ai.cache",
                "no model name (ai.cache.models) maps to a policy and no REST operation names one \
                 (x-flexway-ai: {cache: POLICY}): nothing is cached",
            );
            return;
        }
        for name in cache.policies.keys().filter(|name| !used.contains(name)) {
            self.warn(
                format!("ai.cache.policies.{name}"),
                "no model name (ai.cache.models) maps to it and no REST operation names it: it caches nothing",
            );
        }
    }
}

/// Model names an embeddings-only backend answers to (its `models`, `aliases`,
/// `default_model`), with that backend.
fn embeddings_models(backends: &BTreeMap<BackendId, Backend>) -> BTreeMap<&str, &BackendId> {
    let mut names = BTreeMap::new();
    for (id, backend) in backends {
        let caps = &backend.capabilities;
        if !caps.contains(&Capability::Embeddings) || caps.contains(&Capability::Chat) {
            continue;
        }
        for model in backend.kind.endpoint().into_iter().flat_map(Endpoint::client_names) {
            names.entry(model).or_insert(id);
        }
    }
    names
}

/// A policy's name: it labels metrics and is typed on the command line.
fn is_policy_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn list(names: &BTreeSet<String>) -> String {
    if names.is_empty() {
        return "none is".to_owned();
    }
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    format!("declared: {}", names.join(", "))
}

/// `none` (0), `full` (1,000,000) or a fraction in (0, 1) with at most 6 decimal
/// places, in parts per million, read exactly from its text.
fn charge_ppm(text: &str) -> Result<u32, String> {
    match text.trim() {
        "none" => return Ok(0),
        "full" => return Ok(PPM),
        _ => {}
    }
    let text = text.trim();
    let malformed = || format!("`{text}` is not none, full or a fraction between 0 and 1 (e.g. 0.1)");
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (whole.is_empty() && fraction.is_empty()) || !digits(whole) || !digits(fraction) {
        return Err(malformed());
    }
    if fraction.len() > 6 {
        return Err(format!("`{text}` has more than 6 decimal places (a charge is counted in parts per million)"));
    }
    if !whole.trim_start_matches('0').is_empty() {
        return Err(format!("`{text}` is not below 1: a hit charged the producing call's whole cost is `full`"));
    }
    let ppm: u32 = format!("{fraction:0<6}").parse().map_err(|_| malformed())?;
    if ppm == 0 {
        return Err(format!("`{text}` is zero: a hit charged nothing is `none` (the default)"));
    }
    Ok(ppm)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use serde_norway::Value;

    use crate::config::{Diagnostic, Loaded, Secrets, load_str, load_str_with};

    use super::*;

    const FULL: &str = r#"
version: 1
tenants:
  acme:
    keys: [{sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08}]
    agents: {bot: {}, quiet: {cache: off}}
  hush:
    keys: [{sha256: 60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752}]
    cache: off
    agents: {helper: {}}
ai:
  default_backend: main
  capabilities: {embeddings: embedder}
  cache:
    store: {kind: embedded, path: ./flexway-cache}
    key: env:CACHE_KEY
    policies:
      faq: {mode: semantic, ttl: 1h, threshold: 0.9, embed: {backend: embedder, model: text-embedding-3-small},
            scope: agent, charge: "0.1", max_entry_bytes: 65536, max_entries_per_tenant: 5000, sensitive: allow}
      strict: {mode: exact, ttl: 10m}
    models: {gpt-4.1: faq, gpt-4.1-mini: strict, text-embedding-3-small: strict}
  backends:
    main:
      url: https://main.example.net/v1
      price: {input_per_mtok_eur: 1, output_per_mtok_eur: 2}
    chatty:
      url: https://chatty.example.net/v1
      capabilities: [chat]
      price: {input_per_mtok_eur: 1, output_per_mtok_eur: 2}
    embedder:
      url: https://embed.example.net/v1
      capabilities: [embeddings]
      default_model: text-embedding-3-small
      price: {input_per_mtok_eur: 0.02, output_per_mtok_eur: 0}
"#;

    struct Doc(Value);

    fn full() -> Doc {
        Doc(serde_norway::from_str(FULL).unwrap())
    }

    /// `doc` without `ai.cache`, nor the `cache: off` switches that need it.
    fn without_cache(doc: Doc) -> Doc {
        doc.remove("ai.cache").remove("tenants.hush.cache").remove("tenants.acme.agents.quiet.cache")
    }

    fn env() -> HashMap<String, String> {
        HashMap::from([("CACHE_KEY".to_owned(), "k".repeat(32)), ("PG_URL".to_owned(), "postgres://x".to_owned())])
    }

    impl Doc {
        /// Sets the value at a dotted path, creating mappings.
        fn set(mut self, path: &str, value: &str) -> Doc {
            let (parents, last) = path.rsplit_once('.').unwrap_or(("", path));
            let mut node = &mut self.0;
            for key in parents.split('.').filter(|k| !k.is_empty()) {
                let map = node.as_mapping_mut().unwrap();
                if !map.contains_key(key) {
                    map.insert(key.into(), Value::Mapping(Default::default()));
                }
                node = map.get_mut(key).unwrap();
            }
            node.as_mapping_mut().unwrap().insert(last.into(), serde_norway::from_str(value).unwrap());
            self
        }

        fn remove(mut self, path: &str) -> Doc {
            let (parents, last) = path.rsplit_once('.').unwrap_or(("", path));
            let mut node = &mut self.0;
            for key in parents.split('.').filter(|k| !k.is_empty()) {
                node = node.get_mut(key).unwrap();
            }
            node.as_mapping_mut().unwrap().remove(last).unwrap();
            self
        }

        fn text(&self) -> String {
            serde_norway::to_string(&self.0).unwrap()
        }

        fn loads(&self) -> Loaded {
            load_str(&self.text(), &env()).unwrap_or_else(|e| panic!("should load, got {e}"))
        }

        fn errors(&self) -> Vec<Diagnostic> {
            match load_str(&self.text(), &env()) {
                Ok(_) => panic!("should be refused:\n{}", self.text()),
                Err(e) => e.errors,
            }
        }

        /// Refused with exactly one error, at `path`, saying `fragment`.
        fn refused(&self, path: &str, fragment: &str) {
            let errors = self.errors();
            assert_eq!(errors.len(), 1, "expected one error at {path}, got {errors:#?}");
            assert_eq!(errors[0].path, path, "{errors:#?}");
            assert!(errors[0].message.contains(fragment), "`{}` lacks `{fragment}`", errors[0].message);
            assert!(!errors[0].message.contains("  "), "a run of spaces in `{}`", errors[0].message);
        }
    }

    #[test]
    fn a_full_cache_loads_with_every_key() {
        let config = full().loads().config;
        let cache = config.ai.cache.as_ref().unwrap();
        assert_eq!(cache.store, CacheStoreConfig::Embedded { path: "./flexway-cache".into() });
        assert_eq!(cache.key, SecretRef::Env("CACHE_KEY".into()));
        let faq = &cache.policies["faq"];
        assert_eq!(faq.mode, CacheMode::Semantic);
        assert_eq!(faq.ttl, Duration::from_secs(3600));
        assert_eq!(faq.threshold, 0.9);
        assert_eq!(
            faq.embed,
            Some(CacheEmbed { backend: BackendId::new("embedder"), model: "text-embedding-3-small".into() })
        );
        assert_eq!(faq.scope, CacheScope::Agent);
        assert_eq!(faq.charge_ppm, 100_000);
        assert_eq!((faq.max_entry_bytes, faq.max_entries_per_tenant), (65_536, 5_000));
        assert!(faq.sensitive_allowed);
        assert_eq!(cache.for_model("gpt-4.1").map(|(name, _)| name), Some("faq"));
        assert_eq!(cache.for_model("text-embedding-3-small").map(|(name, _)| name), Some("strict"));
        assert_eq!(cache.for_model("unlisted"), None);
        // Resolved at start, like the audit's chain key.
        let references: Vec<String> = config.secret_references().into_iter().map(|(path, _)| path).collect();
        assert!(references.contains(&"ai.cache.key".to_owned()), "{references:?}");
    }

    #[test]
    fn an_exact_policy_takes_the_spec_defaults() {
        let config = full().loads().config;
        let strict = &config.ai.cache.as_ref().unwrap().policies["strict"];
        let expected = CachePolicy {
            mode: CacheMode::Exact,
            ttl: Duration::from_secs(600),
            threshold: 0.95,
            embed: None,
            scope: CacheScope::Tenant,
            charge_ppm: 0,
            max_entry_bytes: 262_144,
            max_entries_per_tenant: 100_000,
            sensitive_allowed: false,
        };
        assert_eq!(**strict, expected);
    }

    #[test]
    fn cache_off_reaches_tenants_and_their_agents() {
        let tenants = full().loads().config.tenants;
        let off = |tenant: &str, agent: Option<&str>| {
            let tenant = &tenants[tenant];
            agent.map_or(tenant.cache_off, |a| tenant.agents[a].cache_off)
        };
        assert!(!off("acme", None) && !off("acme", Some("bot")));
        assert!(off("acme", Some("quiet")));
        assert!(off("hush", None) && off("hush", Some("helper")));
        let refused = full().set("tenants.acme.cache", "on").errors();
        assert_eq!(refused[0].path, "tenants.acme.cache", "{refused:#?}");
        assert!(refused[0].message.contains("off"), "{refused:#?}");
    }

    #[test]
    fn no_cache_is_none() {
        assert_eq!(without_cache(full()).loads().config.ai.cache, None);
    }

    #[test]
    fn charge_is_none_full_or_a_fraction_in_parts_per_million() {
        for (written, ppm) in
            [("none", 0), ("full", 1_000_000), ("0.1", 100_000), ("\"0.25\"", 250_000), ("0.000001", 1)]
        {
            let config = full().set("ai.cache.policies.strict.charge", written).loads().config;
            assert_eq!(config.ai.cache.unwrap().policies["strict"].charge_ppm, ppm, "{written}");
        }
        for (written, fragment) in [
            ("0", "`none`"),
            ("1", "`full`"),
            ("1.5", "`full`"),
            ("\"0.0000001\"", "6 decimal places"),
            ("half", "not none, full or a fraction"),
            ("-0.1", "not none, full or a fraction"),
        ] {
            full().set("ai.cache.policies.strict.charge", written).refused("ai.cache.policies.strict.charge", fragment);
        }
    }

    #[test]
    fn the_store_and_key_are_required_and_of_one_kind() {
        full().remove("ai.cache.key").refused("ai.cache.key", "required");
        full().set("ai.cache.key", "plain-text").refused("ai.cache.key", "env:");
        full().remove("ai.cache.store").refused("ai.cache.store", "required");
        full().set("ai.cache.store", "{kind: embedded}").refused("ai.cache.store.path", "required");
        full()
            .set("ai.cache.store", "{kind: embedded, path: ./c, table: t}")
            .refused("ai.cache.store.table", "kind dynamodb");
        full().set("ai.cache.store", "{kind: postgres}").refused("ai.cache.store.url", "required");
        full().set("ai.cache.store", "{kind: postgres, url: env:NOT_SET}").refused("ai.cache.store.url", "NOT_SET");
        let errors = full().remove("ai.cache.policies.faq").set("ai.cache.models", "{gpt-4.1: strict}");
        errors
            .set("ai.cache.store", "{kind: dynamodb, path: ./c, table: t}")
            .refused("ai.cache.store.path", "kind embedded");
    }

    #[test]
    fn a_postgres_url_is_resolved_at_start() {
        let config = full().set("ai.cache.store", "{kind: postgres, url: env:PG_URL}").loads().config;
        let cache = config.ai.cache.as_ref().unwrap();
        assert_eq!(cache.store, CacheStoreConfig::Postgres { url: SecretRef::Env("PG_URL".into()) });
        let references: Vec<String> = config.secret_references().into_iter().map(|(path, _)| path).collect();
        assert!(references.contains(&"ai.cache.store.url".to_owned()), "{references:?}");
    }

    #[test]
    fn dynamodb_keeps_exact_policies_only() {
        let dynamodb = full().set("ai.cache.store", "{kind: dynamodb, table: flexway-cache}");
        dynamodb.refused("ai.cache.policies.faq.mode", "DynamoDB keeps exact entries only");
        let exact_only = full()
            .set("ai.cache.store", "{kind: dynamodb, table: flexway-cache}")
            .remove("ai.cache.policies.faq")
            .set("ai.cache.models", "{gpt-4.1: strict}")
            .loads();
        let cache = exact_only.config.ai.cache.unwrap();
        assert_eq!(cache.store, CacheStoreConfig::DynamoDb { table: "flexway-cache".into() });
    }

    #[test]
    fn a_policy_says_its_mode_and_ttl() {
        let p = "ai.cache.policies.strict";
        full().remove(&format!("{p}.mode")).refused(&format!("{p}.mode"), "required");
        full().set(&format!("{p}.mode"), "fuzzy").refused(&format!("{p}.mode"), "exact");
        full().remove(&format!("{p}.ttl")).refused(&format!("{p}.ttl"), "required");
        full().set(&format!("{p}.ttl"), "0s").refused(&format!("{p}.ttl"), "longer than zero");
        full().set(&format!("{p}.ttl"), "10").refused(&format!("{p}.ttl"), "no unit");
        full().set(&format!("{p}.max_entry_bytes"), "0").refused(&format!("{p}.max_entry_bytes"), "greater than zero");
        full()
            .set(&format!("{p}.max_entries_per_tenant"), "0")
            .refused(&format!("{p}.max_entries_per_tenant"), "at least 1");
        full().set(&format!("{p}.sensitive"), "maybe").refused(&format!("{p}.sensitive"), "bypass");
        full().set(&format!("{p}.scope"), "fleet").refused(&format!("{p}.scope"), "tenant");
        full().set(&format!("{p}.size"), "1").refused(&format!("{p}.size"), "size");
    }

    #[test]
    fn threshold_and_embed_belong_to_semantic_policies() {
        let exact = "ai.cache.policies.strict";
        full().set(&format!("{exact}.threshold"), "0.9").refused(&format!("{exact}.threshold"), "mode semantic");
        full()
            .set(&format!("{exact}.embed"), "{backend: embedder, model: m}")
            .refused(&format!("{exact}.embed"), "mode semantic");
        let semantic = "ai.cache.policies.faq";
        full().remove(&format!("{semantic}.embed")).refused(&format!("{semantic}.embed"), "required");
        for bad in ["0", "1.5", "-0.2"] {
            full().set(&format!("{semantic}.threshold"), bad).refused(&format!("{semantic}.threshold"), "at most 1");
        }
        let semantic_default = full().remove(&format!("{semantic}.threshold")).loads().config;
        assert_eq!(semantic_default.ai.cache.unwrap().policies["faq"].threshold, 0.95);
        full()
            .set(&format!("{semantic}.embed.backend"), "chatty")
            .refused(&format!("{semantic}.embed.backend"), "does not serve embeddings");
        full()
            .set(&format!("{semantic}.embed.backend"), "nowhere")
            .refused(&format!("{semantic}.embed.backend"), "not declared");
        full().remove(&format!("{semantic}.embed.model")).refused(&format!("{semantic}.embed.model"), "required");
    }

    #[test]
    fn policies_are_declared_named_and_named_by_models() {
        full().set("ai.cache.policies", "{}").errors();
        let empty = full().set("ai.cache.policies", "{}").set("ai.cache.models", "{}");
        empty.refused("ai.cache.policies", "at least one policy");
        full()
            .set("ai.cache.policies.bad name", "{mode: exact, ttl: 1m}")
            .refused("ai.cache.policies.bad name", "not a policy name");
        full()
            .set("ai.cache.models", "{gpt-4.1: nope, gpt-4.1-mini: strict}")
            .refused("ai.cache.models.gpt-4.1", "not declared under ai.cache.policies");
        // Any model name a caller sends can be listed: a backend's default model serves
        // names it does not list.
        let any = full().set("ai.cache.models.whatever-model", "strict").loads().config;
        assert_eq!(any.ai.cache.unwrap().models["whatever-model"], "strict");
    }

    #[test]
    fn an_embeddings_model_is_cached_in_exact_mode_only() {
        full()
            .set("ai.cache.models.text-embedding-3-small", "faq")
            .refused("ai.cache.models.text-embedding-3-small", "exact mode only");
    }

    #[test]
    fn a_cache_nothing_uses_is_a_warning() {
        let unused = full().set("ai.cache.models", "{}").loads();
        assert!(unused.warnings.iter().any(|w| w.path == "ai.cache" && w.message.contains("nothing is cached")));
        let one_unused = full().set("ai.cache.models", "{gpt-4.1: faq}").loads();
        let paths: Vec<&str> = one_unused.warnings.iter().map(|w| w.path.as_str()).collect();
        assert!(paths.contains(&"ai.cache.policies.strict") && !paths.contains(&"ai.cache.policies.faq"), "{paths:?}");
        assert!(full().loads().warnings.iter().all(|w| !w.path.starts_with("ai.cache")));
    }

    #[test]
    fn a_key_that_does_not_resolve_is_a_warning_for_validate() {
        let text = full().set("ai.cache.key", "env:UNSET_KEY").text();
        let loaded = load_str_with(&text, &env(), Secrets::Check).unwrap();
        assert!(loaded.warnings.iter().any(|w| w.path == "ai.cache.key"), "{:#?}", loaded.warnings);
    }

    /// A document with a REST backend whose one operation is `method /ocr` with
    /// `x-flexway-ai` as given.
    fn rest(dir: &tempfile::TempDir, method: &str, ai: &str) -> Doc {
        let contract = dir.path().join(format!("{method}.yaml"));
        let text = format!(
            "openapi: 3.1.0\ninfo: {{title: t, version: '1'}}\npaths:\n  /ocr:\n    {method}:\n      x-flexway-ai: {ai}\n"
        );
        std::fs::write(&contract, text).unwrap();
        full().set(
            "ai.backends.ocr",
            &format!(
                "{{kind: http, url: 'http://10.0.0.9:8080', mount: /apis/ocr, contract: '{}'}}",
                contract.display()
            ),
        )
    }

    #[test]
    fn a_rest_operation_names_an_exact_policy() {
        let dir = tempfile::tempdir().unwrap();
        let metering = "metering: per_call, price_per_thousand_eur: '1', feature: ocr";
        let config = rest(&dir, "post", &format!("{{{metering}, cache: strict}}")).loads().config;
        let BackendKind::Http { contract, .. } = &config.ai.backends["ocr"].kind else { panic!("an http backend") };
        assert_eq!(contract.operations[0].ai.as_ref().unwrap().cache.as_deref(), Some("strict"));
        // The REST operation uses `strict`: with no model mapped, no warning says nothing is cached.
        let only_rest =
            rest(&dir, "get", &format!("{{{metering}, cache: strict}}")).set("ai.cache.models", "{}").loads();
        assert!(only_rest.warnings.iter().all(|w| w.path != "ai.cache"), "{:#?}", only_rest.warnings);

        let path = "ai.backends.ocr.contract";
        rest(&dir, "post", &format!("{{{metering}, cache: nope}}"))
            .refused(path, "not declared under ai.cache.policies");
        rest(&dir, "post", &format!("{{{metering}, cache: faq}}")).refused(path, "exact mode only");
        without_cache(rest(&dir, "post", &format!("{{{metering}, cache: strict}}")))
            .refused(path, "ai.cache is not declared");
        rest(&dir, "delete", &format!("{{{metering}, cache: strict}}")).refused(path, "GET and POST operations only");
        rest(&dir, "post", &format!("{{{metering}, cache: 3}}")).refused(path, "not a policy name");
    }

    #[test]
    fn charge_ppm_reads_text_exactly() {
        assert_eq!(charge_ppm(".5"), Ok(500_000));
        assert_eq!(charge_ppm("0.123456"), Ok(123_456));
        assert!(charge_ppm(".").is_err());
        assert!(charge_ppm("").is_err());
    }
}
