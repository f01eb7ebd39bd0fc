//! The validated configuration: what the rest of Flexway reads.
//!
//! Every value here has passed validation: names refer to declared things, secrets are
//! references (never values), money is integer micro-euros. Nothing in this module
//! parses YAML; `raw.rs` does, and `validate.rs` turns raw into this.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use super::contract::Contract;
pub use crate::call::Criticality;
use crate::money::MicroEur;

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Arc<str>);

        impl $name {
            pub fn new(s: impl AsRef<str>) -> Self {
                Self(Arc::from(s.as_ref()))
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:?}", &*self.0)
            }
        }
        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }
    };
}

name_type!(
    /// A tenant's name, as declared under `tenants:`.
    TenantId
);
name_type!(
    /// An agent's name, as declared under a tenant's `agents:`.
    AgentId
);
name_type!(
    /// A backend's name, as declared under `ai.backends:`.
    BackendId
);

#[derive(Debug, Clone)]
pub struct Config {
    pub store: StoreConfig,
    pub audit: AuditConfig,
    pub secrets: SecretsConfig,
    pub tenants: BTreeMap<TenantId, Tenant>,
    pub ai: Ai,
    /// OpenTelemetry export; `None`: nothing is exported.
    pub telemetry: Option<TelemetryConfig>,
    /// The operator's console; `None`: `/console` answers 404.
    pub console: Option<ConsoleConfig>,
    /// `/mcp` (SPEC §17); `None`: `/mcp` answers 404.
    pub mcp: Option<super::Mcp>,
    /// The SHA-256 of the text it was loaded from, hex (`GET /healthz`).
    pub sha256: String,
}

/// Who may open the console: the SHA-256 of each console key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsoleConfig {
    pub keys: Vec<[u8; 32]>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// The collector's base URL, without a trailing slash.
    pub otlp_endpoint: String,
    pub export_interval: Duration,
}

impl TelemetryConfig {
    pub const DEFAULT_EXPORT_INTERVAL: Duration = Duration::from_secs(5);
}

impl Config {
    /// Every secret reference, with its path in the document: what a gateway resolves
    /// before it starts, and `flexway validate --resolve-secrets` checks.
    pub fn secret_references(&self) -> Vec<(String, &SecretRef)> {
        let salt = self.audit.hash_salt.iter().map(|salt| ("audit.hash_salt".to_owned(), salt));
        let chain = self.audit.chain_key.iter().map(|key| ("audit.chain_key".to_owned(), key));
        let cache = self.ai.cache.iter().flat_map(|cache| {
            let url = match &cache.store {
                CacheStoreConfig::Postgres { url } => Some(("ai.cache.store.url".to_owned(), url)),
                CacheStoreConfig::Embedded { .. } | CacheStoreConfig::DynamoDb { .. } => None,
            };
            std::iter::once(("ai.cache.key".to_owned(), &cache.key)).chain(url)
        });
        let mcp = self.mcp.iter().flat_map(|mcp| {
            let session = mcp.session_key.iter().map(|key| ("mcp.session_key".to_owned(), key));
            let servers = mcp.servers.iter().filter_map(|(name, server)| match &server.auth {
                Auth::Bearer { secret } | Auth::Header { secret, .. } => {
                    Some((format!("mcp.servers.{name}.auth.secret"), secret))
                }
                Auth::None | Auth::TokenFile { .. } => None,
            });
            session.chain(servers)
        });
        salt.chain(chain).chain(cache).chain(self.ai.secret_references()).chain(mcp).collect()
    }

    /// The usage APIs' admin keys, with their paths: resolved by `flexway reconcile
    /// --fetch` and `validate --resolve-secrets`, never by the gateway.
    pub fn usage_api_references(&self) -> Vec<(String, &SecretRef)> {
        let apis = self.ai.backends.iter().filter_map(|(name, b)| Some((name, b.usage_api.as_ref()?)));
        apis.map(|(name, api)| (format!("ai.backends.{name}.usage_api.secret"), &api.secret)).collect()
    }
}

impl Ai {
    /// The backends' secret references (auth secrets, TLS material), with their paths
    /// in the document: what `secrets.refresh` resolves again.
    pub fn secret_references(&self) -> Vec<(String, &SecretRef)> {
        let mut references = Vec::new();
        for (name, backend) in &self.backends {
            let path = |key: &str| format!("ai.backends.{name}.{key}");
            match backend.kind.endpoint().map(|e| &e.auth) {
                Some(Auth::Bearer { secret } | Auth::Header { secret, .. }) => {
                    references.push((path("auth.secret"), secret));
                }
                Some(Auth::None | Auth::TokenFile { .. }) | None => {}
            }
            if let Some(tls) = backend.kind.tls() {
                references.push((path("tls.cert"), &tls.cert));
                references.push((path("tls.key"), &tls.key));
                references.extend(tls.ca.iter().map(|ca| (path("tls.ca"), ca)));
            }
        }
        references
    }
}

/// Secret references after the start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretsConfig {
    /// How often the backends' references are resolved again (a rotated key is
    /// picked up without a restart).
    pub refresh: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    Embedded { path: PathBuf, sync: LedgerSync },
    Memory,
    DynamoDb { table: String },
}

/// When the embedded ledger's journal is fsynced (`store.sync`; the ledger's module
/// docs, `budget/embedded/mod.rs`, say what each keeps through a crash).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LedgerSync {
    /// Every operation is acknowledged once its journal line is written; the writer
    /// thread fsyncs the journal at most every `SYNC_EVERY` while it holds lines not
    /// yet synced, off every call's path.
    #[default]
    Interval,
    /// A reservation, intent, sweep or run is acknowledged only once its journal line
    /// is synced (an fsync shared by the operations of a batch); a settlement at its
    /// write.
    Reservation,
}

#[derive(Debug, Clone)]
pub struct AuditConfig {
    pub sink: AuditSinkConfig,
    /// Salt for hashed identifiers; `None` means "no salt declared" (hashes still taken).
    pub hash_salt: Option<SecretRef>,
    /// Key of the audit's HMAC chain; `None`: records are not chained.
    pub chain_key: Option<SecretRef>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuditSinkConfig {
    File { path: PathBuf },
    Stdout,
    CloudWatch { log_group: String, log_stream: Option<String> },
}

#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: TenantId,
    pub keys: Vec<KeyEntry>,
    pub budgets: Budgets,
    pub limits: Rates,
    pub backend: Option<BackendId>,
    pub agents: BTreeMap<AgentId, Agent>,
    /// The highest class its calls may claim (`Critical`: no limit).
    pub max_criticality: Criticality,
    /// The jurisdictions its calls may be processed in, lower-cased (`None`: any).
    pub residency: Option<BTreeSet<String>>,
    /// `cache: off` (SPEC §16): its calls neither read nor write the response cache.
    pub cache_off: bool,
    /// `mcp:` (SPEC §17): the servers and tools its callers may use.
    pub mcp: super::McpNarrowing,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyEntry {
    /// SHA-256 of the key, the only form in which a key is ever held.
    pub sha256: [u8; 32],
    pub agent: Option<AgentId>,
    pub relay_peer: bool,
    pub limits: Rates,
}

/// Per-minute rates (SPEC §14); `None` means "no limit of this kind".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rates {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
}

impl Rates {
    pub fn is_none(&self) -> bool {
        self.requests_per_minute.is_none() && self.tokens_per_minute.is_none()
    }
}

/// Limits; `None` means "no limit of this kind".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Budgets {
    pub tokens_per_day: Option<u64>,
    pub tokens_per_month: Option<u64>,
    pub eur_per_month: Option<MicroEur>,
}

#[derive(Debug, Clone, Default)]
pub struct Agent {
    pub backend: Option<BackendId>,
    pub budgets: Budgets,
    pub limits: Rates,
    /// The highest class its calls may claim: its own, never above its tenant's
    /// (narrowed at load).
    pub max_criticality: Criticality,
    /// The jurisdictions its calls may be processed in: its tenant's narrowed by its
    /// own (at load), lower-cased (`None`: any).
    pub residency: Option<BTreeSet<String>>,
    /// `cache: off` (SPEC §16), its own or its tenant's.
    pub cache_off: bool,
    /// `mcp:` (SPEC §17): its own narrowing (its tenant's applies too).
    pub mcp: super::McpNarrowing,
}

impl Config {
    /// The limits a caller's calls are held to, its class and its jurisdictions:
    /// its agent's (which hold its tenant's), or its tenant's.
    pub fn limits(&self, tenant: &TenantId, agent: Option<&AgentId>) -> (Criticality, Option<&BTreeSet<String>>) {
        let tenant = self.tenants.get(tenant);
        match (tenant, agent.and_then(|a| tenant.and_then(|t| t.agents.get(a)))) {
            (_, Some(agent)) => (agent.max_criticality, agent.residency.as_ref()),
            (Some(tenant), None) => (tenant.max_criticality, tenant.residency.as_ref()),
            (None, None) => (Criticality::Critical, None),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Ai {
    /// Empty (a name no backend has) only when every backend is `grpc` (SPEC §10):
    /// no HTTP call then has a backend to go to (`capability_unavailable`).
    pub default_backend: BackendId,
    pub capabilities: CapabilityOverrides,
    /// Header name, stored lower-case.
    pub sensitive_header: String,
    pub sensitive_backend: Option<BackendId>,
    pub budget: BudgetPolicy,
    pub vision: VisionPolicy,
    pub limits: Limits,
    /// Session affinity for HTTP calls (`ai.affinity`); `None`: off.
    pub affinity: Option<Affinity>,
    /// The response cache (`ai.cache`, SPEC §16); `None`: nothing is cached.
    pub cache: Option<Cache>,
    pub backends: BTreeMap<BackendId, Backend>,
    /// Whether any backend has a provider quota (`quota`, SPEC §14), known at load: an
    /// attempt under a config with none looks no backend up for one.
    pub any_quota: bool,
    /// What each `kind: grpc` backend's descriptor set declares, read at load (empty
    /// for a backend whose set is missing under [`Secrets::Check`](super::Secrets)).
    pub grpc: BTreeMap<BackendId, Arc<GrpcServices>>,
}

impl Ai {
    /// The longest `cache_affinity.prefix_bytes` of any pool: how much of a prompt
    /// makes its prefix key. `None` when no pool has cache affinity.
    pub fn prefix_bytes(&self) -> Option<u32> {
        self.backends
            .values()
            .filter_map(|b| match &b.kind {
                BackendKind::Pool { picking, .. } => picking.prefix_bytes,
                _ => None,
            })
            .max()
    }
}

/// `ai.cache` (SPEC §16): where entries are kept, the key they are sealed with, the
/// policies, and which model names each applies to.
#[derive(Debug, Clone, PartialEq)]
pub struct Cache {
    pub store: CacheStoreConfig,
    /// The master key each tenant's entry key is derived from (HKDF).
    pub key: SecretRef,
    pub policies: BTreeMap<String, Arc<CachePolicy>>,
    /// The model name a caller sends → the policy its calls are cached under.
    pub models: BTreeMap<String, String>,
}

impl Cache {
    /// The policy that applies to a call asking for `model`, and its name.
    pub fn for_model(&self, model: &str) -> Option<(&str, &Arc<CachePolicy>)> {
        let name = self.models.get(model)?;
        self.policies.get(name).map(|policy| (name.as_str(), policy))
    }
}

/// Where cache entries are kept (`ai.cache.store`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheStoreConfig {
    /// One local file: the entries, and an index per partition rebuilt from it.
    Embedded { path: PathBuf },
    /// PostgreSQL with pgvector (the fleet; Aurora PostgreSQL in a VPC).
    Postgres { url: SecretRef },
    /// A DynamoDB table: exact policies only.
    DynamoDb { table: String },
}

/// One cache policy (`ai.cache.policies.NAME`).
#[derive(Debug, Clone, PartialEq)]
pub struct CachePolicy {
    pub mode: CacheMode,
    /// How long an entry serves.
    pub ttl: Duration,
    /// The least cosine similarity a semantic hit needs (0.95 by default).
    pub threshold: f32,
    /// The backend and model that embed a semantic policy's messages.
    pub embed: Option<CacheEmbed>,
    pub scope: CacheScope,
    /// What a hit is charged: a fraction of the producing call's cost, in parts per
    /// million (`none`: 0, `full`: 1,000,000).
    pub charge_ppm: u32,
    pub max_entry_bytes: u64,
    pub max_entries_per_tenant: u64,
    /// Whether sensitive calls read and write the cache (`sensitive: allow`).
    pub sensitive_allowed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    Exact,
    Semantic,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEmbed {
    pub backend: BackendId,
    pub model: String,
}

/// Whose entries a call shares: its tenant's, or its agent's only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheScope {
    Tenant,
    Agent,
}

/// `ai.affinity`: the header whose value pins a session to a pool member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Affinity {
    /// Header name, stored lower-case.
    pub header: String,
}

/// Bounds on an upstream answer (`ai.limits`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_response_bytes: u64,
    pub max_event_bytes: u64,
}

#[derive(Debug, Clone, Default)]
pub struct CapabilityOverrides {
    pub vision: Option<BackendId>,
    pub embeddings: Option<BackendId>,
    pub realtime: Option<BackendId>,
}

#[derive(Debug, Clone)]
pub struct BudgetPolicy {
    pub soft: Option<SoftCap>,
    pub default_max_tokens: u32,
    pub min_completion_tokens: u32,
}

#[derive(Debug, Clone)]
pub struct SoftCap {
    /// Fraction of any budget, in parts per million (0.8 → 800_000).
    pub threshold_ppm: u32,
    pub backend: BackendId,
}

#[derive(Debug, Clone)]
pub struct VisionPolicy {
    pub max_image_bytes: u64,
    pub max_body_bytes: u64,
    /// `https://host[:port]` origins, normalised (lower-case host, no trailing slash).
    pub allowed_origins: Vec<String>,
}

/// What a call asks of a backend. Also the audit record's `capability` (lowercase).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
#[schemars(inline)]
pub enum Capability {
    Chat,
    Vision,
    Embeddings,
    Realtime,
    // A gRPC call (SPEC §10). Never declared by a backend: a `grpc` backend's
    // descriptor set says what it serves, and no HTTP call asks for it. (A plain
    // comment: a doc comment would turn the published enum into a `oneOf`.)
    Grpc,
    // A REST operation of a `kind: http` backend (SPEC §10), likewise never declared.
    Http,
}

impl Capability {
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Chat => "chat",
            Capability::Vision => "vision",
            Capability::Embeddings => "embeddings",
            Capability::Realtime => "realtime",
            Capability::Grpc => "grpc",
            Capability::Http => "http",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Backend {
    pub name: BackendId,
    pub kind: BackendKind,
    /// `true` unless the operator declared `external: false`.
    pub external: bool,
    /// Declared capabilities; for a pool without a declaration, the union of its members'.
    pub capabilities: BTreeSet<Capability>,
    pub price: Price,
    pub fallback: Vec<BackendId>,
    pub timeout: Duration,
    pub circuit_breaker: BreakerPolicy,
    /// The model server's metrics, for the pools that read its load.
    pub load: Option<LoadSource>,
    /// Where it processes data, lower-cased; `None` never serves a residency-bound
    /// call.
    pub jurisdiction: Option<String>,
    /// The provider's usage API, for `flexway reconcile --fetch`.
    pub usage_api: Option<UsageApi>,
    /// Its provider's quota (SPEC §14): `Rates::default()` when none.
    pub quota: Rates,
}

/// `usage_api`: where `flexway reconcile --fetch` reads the provider's usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageApi {
    pub kind: UsageApiKind,
    pub secret: SecretRef,
    /// The API's base URL, without a trailing slash.
    pub url: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageApiKind {
    Openai,
    Anthropic,
}

impl UsageApiKind {
    /// The provider's own API, where `url` is left out.
    pub fn default_url(self) -> &'static str {
        match self {
            UsageApiKind::Openai => "https://api.openai.com",
            UsageApiKind::Anthropic => "https://api.anthropic.com",
        }
    }
}

/// Whether `label` is a jurisdiction: 1 to 64 ASCII letters, digits, `.`, `_`, `-`.
pub fn is_jurisdiction(label: &str) -> bool {
    (1..=64).contains(&label.len())
        && label.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// `load`: a model server's Prometheus endpoint and how often it is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSource {
    pub metrics_url: String,
    pub every: Duration,
}

/// How a pool chooses among the members of the priority group that serves (SPEC §5).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Picking {
    pub pick: Pick,
    /// `cache_affinity.prefix_bytes`, when on.
    pub prefix_bytes: Option<u32>,
    pub saturation: Option<Saturation>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Pick {
    #[default]
    Weighted,
    LeastLoaded,
    Latency,
}

/// A member is saturated when its queue or its KV-cache use reaches these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saturation {
    pub queue: Option<u32>,
    /// KV-cache use in parts per million of the cache.
    pub kv_cache_ppm: Option<u32>,
}

#[derive(Debug, Clone)]
pub enum BackendKind {
    OpenAi(Endpoint),
    Anthropic(Endpoint),
    Relay {
        endpoint: Endpoint,
        metering: Metering,
        identity_headers: IdentityHeaders,
    },
    /// A specialised model's gRPC upstream (HTTP/2: cleartext for `http://`, TLS for
    /// `https://`, with a client certificate when `tls` is given); what its descriptor
    /// set declares is in [`Ai::grpc`].
    Grpc {
        url: String,
        descriptor_set: PathBuf,
        tls: Option<Tls>,
    },
    /// A REST upstream described by an OpenAPI contract (SPEC §10): its operations are
    /// served under `mount`, those with `x-flexway-ai` metered.
    Http {
        endpoint: Endpoint,
        mount: String,
        contract: Arc<Contract>,
    },
    Pool {
        members: Vec<PoolMember>,
        picking: Picking,
    },
    /// Model servers of the Gateway API Inference Extension (SPEC §5): an endpoint
    /// picker names, per call, the ones to call as an `openai` backend. `endpoint`
    /// holds the pool's auth, models and forwarded headers; its `url` is the target's
    /// path (`/v1`), each picked endpoint's base being `http://{endpoint}{path}`.
    InferencePool {
        endpoint: Endpoint,
        picker: PickerSettings,
        /// Used as a plain (weighted) pool when the picker cannot answer and
        /// `failure_mode` is `fail_open`; may be empty.
        members: Vec<PoolMember>,
    },
}

/// An inference pool's endpoint picker and its target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickerSettings {
    /// `http://host:port`, spoken to over HTTP/2 cleartext.
    pub url: String,
    pub failure_mode: FailureMode,
    /// The port of an endpoint named without one.
    pub port: u16,
}

/// What a call does when its inference pool's picker cannot answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FailureMode {
    /// The pool fails (503 `picker_unavailable` when nothing after it serves).
    #[default]
    FailClose,
    /// The pool's `members` serve as a plain pool.
    FailOpen,
}

impl BackendKind {
    pub fn name(&self) -> &'static str {
        match self {
            BackendKind::OpenAi(_) => "openai",
            BackendKind::Anthropic(_) => "anthropic",
            BackendKind::Relay { .. } => "relay",
            BackendKind::Grpc { .. } => "grpc",
            BackendKind::Http { .. } => "http",
            BackendKind::InferencePool { .. } => "inference_pool",
            BackendKind::Pool { .. } => "pool",
        }
    }

    /// The HTTP endpoint of an `openai`, `anthropic`, `relay`, `http` or
    /// `inference_pool` backend (the last one's `url` is only its target's path).
    /// The client certificate (and CA bundle) towards the backend, whatever its kind.
    pub fn tls(&self) -> Option<&Tls> {
        match self {
            BackendKind::Grpc { tls, .. } => tls.as_ref(),
            _ => self.endpoint()?.tls.as_ref(),
        }
    }

    pub fn endpoint(&self) -> Option<&Endpoint> {
        match self {
            BackendKind::OpenAi(e) | BackendKind::Anthropic(e) => Some(e),
            BackendKind::Relay { endpoint, .. }
            | BackendKind::Http { endpoint, .. }
            | BackendKind::InferencePool { endpoint, .. } => Some(endpoint),
            BackendKind::Grpc { .. } | BackendKind::Pool { .. } => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Base URL without a trailing slash; the gateway appends `/chat/completions`, ...
    /// (a relay's is the other Flexway's base: `/v1` goes in between).
    pub url: String,
    pub auth: Auth,
    pub tls: Option<Tls>,
    pub models: Vec<String>,
    /// Client-facing name → backend model name.
    pub aliases: BTreeMap<String, String>,
    pub default_model: Option<String>,
    /// The caller's headers passed on (`forward_headers`), lower-case names.
    pub forward_headers: Vec<String>,
}

impl Endpoint {
    /// SPEC §3: the requested model if the backend lists it (or aliases it), else the
    /// backend's default model, else the requested name unchanged.
    pub fn served_model(&self, requested: &str) -> String {
        if self.models.iter().any(|m| m == requested) {
            return requested.to_owned();
        }
        if let Some(target) = self.aliases.get(requested) {
            return target.clone();
        }
        self.default_model.clone().unwrap_or_else(|| requested.to_owned())
    }

    /// Client-facing names this endpoint answers to (for `GET /v1/models`).
    pub fn client_names(&self) -> impl Iterator<Item = &str> {
        self.models
            .iter()
            .map(String::as_str)
            .chain(self.aliases.keys().map(String::as_str))
            .chain(self.default_model.as_deref())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    None,
    Bearer {
        secret: SecretRef,
    },
    Header {
        name: String,
        secret: SecretRef,
    },
    /// Re-read at every call and sent as `Authorization: Bearer <trimmed content>`.
    TokenFile {
        path: PathBuf,
    },
}

/// Where a secret lives. The secret itself never appears in the config.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SecretRef {
    Env(String),
    File(PathBuf),
    /// An AWS Secrets Manager or SSM parameter ARN (serverless shape).
    AwsArn(String),
}

impl fmt::Display for SecretRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SecretRef::Env(name) => write!(f, "env:{name}"),
            SecretRef::File(path) => write!(f, "file:{}", path.display()),
            SecretRef::AwsArn(arn) => f.write_str(arn),
        }
    }
}

/// mTLS towards a backend: each a reference to PEM text (SPEC §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    /// The client certificate chain.
    pub cert: SecretRef,
    /// The client private key.
    pub key: SecretRef,
    /// The CA bundle that replaces the system roots for this backend.
    pub ca: Option<SecretRef>,
}

/// Prices in micro-euros per million tokens (2.0 €/Mtok → 2_000_000).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Price {
    pub input_per_mtok: MicroEur,
    pub output_per_mtok: MicroEur,
    /// Prompt tokens read from the provider's prompt cache; `None`: the input price.
    pub cached_input_per_mtok: Option<MicroEur>,
    /// Prompt tokens written to it; `None`: the input price.
    pub cache_write_per_mtok: Option<MicroEur>,
}

/// Where a consumption is billed: here, or by the Flexway a relay forwards to. Also
/// the audit record's `metered_by` (lowercase).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
#[schemars(inline)]
pub enum Metering {
    Local,
    Upstream,
}

impl Metering {
    pub fn as_str(self) -> &'static str {
        match self {
            Metering::Local => "local",
            Metering::Upstream => "upstream",
        }
    }
}

/// The header in which a relay peer's key asserts the tenant a call is made for
/// (SPEC §8): what a receiving Flexway reads, whatever the sender's config calls it.
pub const TENANT_HEADER: &str = "flexway-tenant";
/// The header that names an agent (SPEC §7); a relay peer asserts its agent in it too.
pub const AGENT_HEADER: &str = "flexway-agent";

/// Header names (lower-case) under which a relay passes the caller's identity on; a
/// name left out is not sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdentityHeaders {
    pub tenant: Option<String>,
    pub agent: Option<String>,
    pub sensitive: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMember {
    pub backend: BackendId,
    pub priority: u32,
    pub weight: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BreakerPolicy {
    pub trigger: BreakerTrigger,
    pub interval: Duration,
    pub trip: Duration,
    /// Inclusive HTTP status ranges that count as failures (connection errors and
    /// timeouts always count).
    pub status: Vec<(u16, u16)>,
    pub accept_retry_after: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum BreakerTrigger {
    Failures(u32),
    /// `failure_ratio` in parts per million over at least `min_requests`.
    Ratio {
        ratio_ppm: u32,
        min_requests: u32,
    },
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        BreakerPolicy {
            trigger: BreakerTrigger::Failures(5),
            interval: Duration::from_secs(60),
            trip: Duration::from_secs(30),
            status: vec![(500, 599)],
            accept_retry_after: false,
        }
    }
}

/// The services a `kind: grpc` backend serves, by full name (`ocr.v1.Ocr`), and their
/// methods by name, as its descriptor set declares them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrpcServices {
    pub services: BTreeMap<String, BTreeMap<String, GrpcMethod>>,
}

impl GrpcServices {
    pub fn method(&self, service: &str, method: &str) -> Option<&GrpcMethod> {
        self.services.get(service)?.get(method)
    }
}

/// One method: its shape, and its metering when it carries `(flexway.v1.operation).ai`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcMethod {
    pub client_streaming: bool,
    pub server_streaming: bool,
    /// `None`: proxied unmetered (identity still required).
    pub operation: Option<AiOperation>,
}

/// `(flexway.v1.operation).ai`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AiOperation {
    pub metering: GrpcMetering,
    /// Micro-euros per thousand calls or per thousand message bytes.
    pub price_per_thousand: MicroEur,
    /// A metrics dimension and an audit field (`ocr`).
    pub feature: String,
    /// The cache policy its answers are kept under (`cache: POLICY`; REST only).
    pub cache: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcMetering {
    /// Per call; the body is never read.
    PerCall,
    /// Per byte of request and response message payloads (the 5-byte gRPC prefix of
    /// each message is not counted).
    PerByte,
}

impl AiOperation {
    /// The cost of `units` (calls or bytes), rounded up to the micro-euro.
    pub fn cost(&self, units: u64) -> MicroEur {
        let micro = u128::from(units) * u128::from(self.price_per_thousand.0);
        MicroEur(u64::try_from(micro.div_ceil(1000)).unwrap_or(u64::MAX))
    }
}
