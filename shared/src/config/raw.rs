//! Phase 1: the YAML document as written, checked for shape only.
//!
//! Every struct mirrors one mapping of `flexway.yaml` and refuses unknown keys: a
//! misspelt key is an error, never silently ignored. Every field is optional (or
//! defaulted) here, even the required ones, so that phase 2 (`validate.rs`) can say
//! per backend kind what is missing or out of place, and so that dropping a bad entry
//! (below) never invents a "missing field" error. These types are also the source of
//! the published JSON Schema, so their doc comments are its descriptions.
//!
//! The text is first held to the bounds of `bounds.rs` (size, nesting, aliases), then
//! read into a YAML tree, and the tree into these types by `shape.rs`, which reports
//! every entry that is wrong once, in document order, with its path, leaves it out,
//! and goes on: what remains goes on to phase 2. A value given where a secret
//! reference belongs is never echoed, even in a type error.

use std::collections::BTreeMap;
use std::fmt;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_norway::Value;

use super::shape::{self, ShapeErrors};
use super::{Diagnostic, bounds};

/// Flexway gateway configuration (`flexway.yaml`). The key names are a contract:
/// configurations written for earlier releases keep loading unchanged.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "FlexwayConfig", expecting = "a configuration (a mapping)")]
#[schemars(title = "flexway.yaml")]
pub struct RawConfig {
    /// Version of this file's format; must be 1.
    #[schemars(required, range(min = 1, max = 1))]
    pub version: Option<u32>,
    /// Where budgets are counted. Default: `{kind: embedded, path: ./flexway-ledger}`.
    pub store: Option<RawStore>,
    /// Where audit records go. Default: `{sink: stdout}`.
    pub audit: Option<RawAudit>,
    /// How secret references are kept fresh. Default: `{refresh: 5m}`.
    pub secrets: Option<RawSecretPolicy>,
    /// Tenants by name: their API keys, budgets and agents.
    pub tenants: Option<BTreeMap<String, RawTenant>>,
    /// Routing, budget policy, vision limits and the backends.
    #[schemars(required)]
    pub ai: Option<RawAi>,
    /// OpenTelemetry: one span per call and the GenAI client metrics, sent to a
    /// collector over OTLP/HTTP. Absent: nothing is exported.
    pub telemetry: Option<RawTelemetry>,
    /// The operator's console at `/console` (`flexway serve` only): who may open it.
    /// Absent: `/console` answers 404.
    pub console: Option<RawConsole>,
    /// `/mcp`: the tools of MCP servers, federated behind the tenants' keys, budgets
    /// and audit. Absent: `/mcp` answers 404.
    pub mcp: Option<RawMcp>,
}

/// The console: read-only, opened by a console key (never a tenant's).
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Console", expecting = "a console ({keys: [...]}) (a mapping)")]
pub struct RawConsole {
    /// The keys that open it, by SHA-256, as a tenant's are declared.
    #[schemars(required)]
    pub keys: Option<Vec<RawConsoleKey>>,
}

/// A console key.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "ConsoleKey", expecting = "a console key ({sha256: HEX}) (a mapping)")]
pub struct RawConsoleKey {
    /// SHA-256 of the key, 64 hex digits (`flexway key new` prints it).
    #[schemars(required, regex(pattern = r"^[0-9a-fA-F]{64}$"))]
    pub sha256: Option<String>,
}

/// The Model Context Protocol endpoint `/mcp` (Streamable HTTP): one endpoint federating
/// the tools of `servers`, each named `{server}__{tool}`, each call priced, budgeted and
/// audited as an inference call is. The caller's credential never goes upstream.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Mcp", expecting = "an mcp section ({servers: {...}}) (a mapping)")]
pub struct RawMcp {
    /// The key MCP session ids are sealed with (AES-256-GCM), a secret reference
    /// resolved once, at start. Absent: derived from `audit.hash_salt`, so that every
    /// process of one configuration serves every session.
    pub session_key: Option<RawSecret>,
    /// `true`: each operation of a `kind: http` contract that carries `x-flexway-ai` is
    /// a tool too (`{mount}__{operationId}`), metered as the REST operation is. Default
    /// false.
    pub expose_rest: Option<bool>,
    /// JWTs from the organisation's identity provider accepted as a caller's Bearer,
    /// besides Flexway keys. Absent: Flexway keys only.
    pub oauth: Option<RawMcpOauth>,
    /// The upstream MCP servers by name: 1 to 32 of `a-z`, `0-9`, `_`, `-`, without
    /// `__` and not ending in `_` (a federated tool is `{server}__{tool}`).
    pub servers: Option<BTreeMap<String, RawMcpServer>>,
}

/// An upstream MCP server (Streamable HTTP).
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    rename = "McpServer",
    expecting = "an MCP server ({url: https://tools.internal/mcp}) (a mapping)"
)]
pub struct RawMcpServer {
    /// Its MCP endpoint, http or https (`https://tools.internal/mcp`).
    #[schemars(required)]
    pub url: Option<String>,
    /// How the gateway authenticates to it, the same keys as a backend's `auth` (never
    /// the caller's credential). Default `{type: none}`.
    pub auth: Option<RawAuth>,
    /// `false` declares the server internal: the only kind a sensitive caller reaches.
    /// Default true.
    pub external: Option<bool>,
    /// Where it processes data, a label as a backend's (`eu`, `ch`); a caller with
    /// `residency` reaches only servers whose jurisdiction it lists.
    pub jurisdiction: Option<String>,
    /// How long a call waits for its answer, e.g. `30s` (the default).
    pub timeout: Option<RawDuration>,
    /// What a `tools/call` costs, reserved against the caller's euro budgets before it
    /// is sent. Default 0.
    pub price: Option<RawMcpPrice>,
    /// Globs over this server's own tool names (`*` any run, `?` one character); deny
    /// wins. Absent: every tool.
    pub tools: Option<RawToolGlobs>,
}

/// An MCP server's prices in euros, at most 6 decimal places.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "McpPrice", expecting = "a price ({per_call_eur: 0.001}) (a mapping)")]
pub struct RawMcpPrice {
    /// Euros per `tools/call`. Default 0.
    #[schemars(range(min = 0))]
    pub per_call_eur: Option<f64>,
    /// A tool's own price in euros per call (by its name on this server), in place of
    /// `per_call_eur`.
    pub tools: Option<BTreeMap<String, f64>>,
}

/// Allow and deny globs over tool names (`*` any run of characters, `?` one); deny
/// wins.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    rename = "ToolGlobs",
    expecting = "tool globs ({allow: [GLOB], deny: [GLOB]}) (a mapping)"
)]
pub struct RawToolGlobs {
    /// The tools that may be called. Absent: every tool.
    pub allow: Option<Vec<String>>,
    /// The tools that may not, even when `allow` matches.
    pub deny: Option<Vec<String>>,
}

/// JWTs as a caller's Bearer on `/mcp` (RFC 8707, RFC 9728), signed RS256 or ES256 by a
/// key of the issuer's JWK set.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    rename = "McpOauth",
    expecting = "an oauth ({issuer, audience, jwks_url, tenant_claim}) (a mapping)"
)]
pub struct RawMcpOauth {
    /// The `iss` a token must carry, exactly; listed as the authorization server in
    /// `/.well-known/oauth-protected-resource/mcp`.
    #[schemars(required)]
    pub issuer: Option<String>,
    /// The `aud` a token must carry: this resource's URL (`https://gw.example/mcp`),
    /// the resource metadata's `resource`.
    #[schemars(required)]
    pub audience: Option<String>,
    /// Where the issuer's signing keys are (a JWK set, http or https), fetched on first
    /// use and again when a token names an unknown key.
    #[schemars(required)]
    pub jwks_url: Option<String>,
    /// The claim naming the caller's tenant (one declared under `tenants`).
    #[schemars(required)]
    pub tenant_claim: Option<String>,
    /// The claim naming the caller's agent (one of that tenant's), if any.
    pub agent_claim: Option<String>,
}

/// A tenant's or an agent's narrowing of `/mcp`; an agent is held to its tenant's too.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    rename = "McpNarrowing",
    expecting = "an mcp narrowing ({servers: [NAME], tools: {allow, deny}}) (a mapping)"
)]
pub struct RawMcpNarrowing {
    /// The servers (of `mcp.servers`) its callers may use. Absent: every server. With
    /// `expose_rest`, a REST tool's server is its mount's prefix (`/apis/ocr`:
    /// `apis_ocr`): a list without it hides that mount's tools.
    pub servers: Option<Vec<String>>,
    /// Globs over the federated tool names `{server}__{tool}`; deny wins.
    pub tools: Option<RawToolGlobs>,
}

/// The budget ledger.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Store", expecting = "a store (a mapping)")]
pub struct RawStore {
    /// `embedded` (a local file, needs `path`), `memory` (lost on exit, for tests) or
    /// `dynamodb` (serverless, needs `table`).
    #[schemars(required)]
    pub kind: Option<RawStoreKind>,
    /// Directory of the embedded ledger (kind `embedded`).
    pub path: Option<String>,
    /// DynamoDB table name (kind `dynamodb`).
    pub table: Option<String>,
    /// When the embedded ledger's journal is fsynced (kind `embedded`). `interval`:
    /// every operation is acknowledged once its journal line is written, and the
    /// journal is fsynced every 5 ms at most, off the calls' path; `reservation`: a
    /// reservation is acknowledged only once its line is fsynced (one fsync shared by
    /// concurrent calls), a settlement at its write. Neither loses anything
    /// acknowledged when the process is killed; a power loss or a kernel crash can take
    /// the operations of about the last 5 ms (`interval`), or the settlements since the
    /// last fsync (`reservation`): docs/guarantees.md. Default `interval`.
    pub sync: Option<RawStoreSync>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "StoreKind")]
pub enum RawStoreKind {
    Embedded,
    Memory,
    Dynamodb,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "StoreSync")]
pub enum RawStoreSync {
    Interval,
    Reservation,
}

/// The audit trail: one JSON line per inference call, metadata only.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Audit", expecting = "an audit (a mapping)")]
pub struct RawAudit {
    /// `file` (JSONL, needs `path`), `stdout` (default) or `cloudwatch` (needs
    /// `log_group`).
    pub sink: Option<RawSinkKind>,
    /// JSONL file the records are appended to (sink `file`).
    pub path: Option<String>,
    /// CloudWatch Logs group (sink `cloudwatch`).
    pub log_group: Option<String>,
    /// CloudWatch Logs stream (sink `cloudwatch`; optional).
    pub log_stream: Option<String>,
    /// Salt for hashed identifiers (keys, end users): a secret reference.
    pub hash_salt: Option<RawSecret>,
    /// Key of the audit's HMAC chain, a secret reference: each record then carries
    /// `chain` (its writer, its number in the writer's sequence, and an HMAC-SHA256
    /// over it and the previous record's), so that `flexway report --verify` finds a
    /// line altered, forged, removed or moved. Resolved once, at start.
    pub chain_key: Option<RawSecret>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "AuditSink")]
pub enum RawSinkKind {
    File,
    Stdout,
    Cloudwatch,
}

/// Secret references: every one is resolved when the gateway starts (one that cannot
/// be stops the start, named); the backends' ones are resolved again after.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Secrets", expecting = "secrets (a mapping)")]
pub struct RawSecretPolicy {
    /// How often the backends' secret references (auth secrets, TLS material) are
    /// resolved again, so that a rotated value is used without a restart; a failed
    /// refresh keeps the last value. `audit.hash_salt` is resolved once (hashes stay
    /// comparable). Default: 5m.
    pub refresh: Option<RawDuration>,
}

/// OpenTelemetry export (OTLP/HTTP with protobuf bodies). Spans and metrics carry
/// metadata only, never a prompt or a completion.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Telemetry", expecting = "telemetry (a mapping)")]
pub struct RawTelemetry {
    /// The collector's base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT`: spans are posted to
    /// `{otlp_endpoint}/v1/traces`, metrics to `{otlp_endpoint}/v1/metrics`.
    #[schemars(required)]
    pub otlp_endpoint: Option<String>,
    /// How often the local shape sends the spans gathered since the last export, and
    /// the metrics. Default `5s`. (The serverless shape sends at the end of each call:
    /// a frozen function cannot send later.)
    pub export_interval: Option<RawDuration>,
}

/// A tenant: a consuming team, with its keys, budgets and agents.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Tenant", expecting = "a tenant (a mapping)")]
pub struct RawTenant {
    /// The tenant's API keys, as SHA-256 hashes (never the keys themselves).
    pub keys: Option<Vec<RawKey>>,
    /// The tenant's budgets; an absent budget is no limit.
    pub budgets: Option<RawBudgets>,
    /// The tenant's per-minute rates (SPEC §14), counted in the ledger with its budgets.
    pub limits: Option<RawRates>,
    /// Backend serving this tenant instead of `ai.default_backend`.
    pub backend: Option<String>,
    /// Agents of this tenant by name, each with optional overrides.
    pub agents: Option<BTreeMap<String, RawAgent>>,
    /// The highest `Flexway-Criticality` class this tenant's calls may claim; a
    /// higher one asked is lowered to it. Default `critical` (no limit).
    pub max_criticality: Option<RawCriticality>,
    /// The jurisdictions this tenant's calls may be processed in: only backends
    /// whose `jurisdiction` is listed serve them, at every routing step. Absent: no
    /// restriction.
    pub residency: Option<Vec<String>>,
    /// `off`: this tenant's calls (its agents' too) neither read nor write the
    /// response cache (`ai.cache`, which must be declared). Absent: the cache's
    /// policies apply.
    pub cache: Option<RawCacheSwitch>,
    /// The MCP servers and tools this tenant's callers may use (within `mcp`).
    /// Absent: all of them.
    pub mcp: Option<RawMcpNarrowing>,
}

/// A tenant's or an agent's `cache`: only `off` is written (on is the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "CacheSwitch")]
pub enum RawCacheSwitch {
    Off,
}

/// A call's class when every member of a pool is saturated (SPEC §5): `sheddable`
/// calls are refused, `standard` and `critical` ones go to the least loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "Criticality")]
pub enum RawCriticality {
    Critical,
    Standard,
    Sheddable,
}

/// One API key of a tenant.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Key", expecting = "a key ({sha256: ...}) (a mapping)")]
pub struct RawKey {
    /// SHA-256 of the key, 64 hex digits (`flexway key new` prints it).
    #[schemars(required, regex(pattern = r"^[0-9a-fA-F]{64}$"))]
    pub sha256: Option<String>,
    /// Agent this key is bound to (one of the tenant's `agents`); a bound key cannot
    /// name another agent in the `Flexway-Agent` header.
    pub agent: Option<String>,
    /// This key belongs to another Flexway relaying to this one: the tenant it names in
    /// `Flexway-Tenant` (one declared here, else 403 `unknown_tenant`) is the call's,
    /// with the agent it names in `Flexway-Agent` (one of that tenant's). Without
    /// `Flexway-Tenant` the key calls as its own tenant. From any other key,
    /// `Flexway-Tenant` is ignored. Default false.
    pub relay_peer: Option<bool>,
    /// This key's own per-minute rates, inside its tenant's (and agent's).
    pub limits: Option<RawRates>,
}

/// Per-minute rates (SPEC §14); each one absent is no limit. Windows are UTC minutes.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Rates", expecting = "per-minute limits (a mapping)")]
pub struct RawRates {
    /// Calls per UTC minute.
    #[schemars(range(min = 1))]
    pub requests_per_minute: Option<u64>,
    /// Tokens (input + output) per UTC minute, reserved at a call's upper bound and
    /// settled to what it used, as budgets count them.
    #[schemars(range(min = 1))]
    pub tokens_per_minute: Option<u64>,
}

/// Budgets; each one absent is no limit. Periods are UTC calendar days and months.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Budgets", expecting = "budgets (a mapping)")]
pub struct RawBudgets {
    /// Tokens (input + output) per UTC day.
    pub tokens_per_day: Option<u64>,
    /// Tokens (input + output) per UTC month.
    pub tokens_per_month: Option<u64>,
    /// Euros per UTC month, at most 6 decimal places.
    #[schemars(range(min = 0))]
    pub eur_per_month: Option<f64>,
}

/// An agent of a tenant; its budgets are sub-limits inside the tenant's.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Agent", expecting = "an agent (a mapping)")]
pub struct RawAgent {
    /// Backend serving this agent instead of its tenant's.
    pub backend: Option<String>,
    /// The agent's own budgets, on top of its tenant's.
    pub budgets: Option<RawBudgets>,
    /// The agent's own per-minute rates, inside its tenant's.
    pub limits: Option<RawRates>,
    /// The highest `Flexway-Criticality` class this agent's calls may claim (never
    /// above its tenant's).
    pub max_criticality: Option<RawCriticality>,
    /// The jurisdictions this agent's calls may be processed in, within its
    /// tenant's `residency` (both apply).
    pub residency: Option<Vec<String>>,
    /// `off`: this agent's calls neither read nor write the response cache (a
    /// tenant's `off` holds for its agents too; `ai.cache` must be declared).
    pub cache: Option<RawCacheSwitch>,
    /// The MCP servers and tools this agent's calls may use, within its tenant's
    /// (both apply).
    pub mcp: Option<RawMcpNarrowing>,
}

/// Routing and policy.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Ai", expecting = "the ai section (a mapping)")]
pub struct RawAi {
    /// Backend serving every request that no override routes elsewhere. Required,
    /// unless every backend is `grpc` (a gRPC call is routed by its service).
    pub default_backend: Option<String>,
    /// Backends for requests that need a capability (images, embeddings).
    pub capabilities: Option<RawCapabilityOverrides>,
    /// Request header marking a request sensitive. Default `Flexway-Sensitive`.
    pub sensitive_header: Option<String>,
    /// Backend pinned for sensitive requests; must be internal (`external: false`).
    pub sensitive_backend: Option<String>,
    /// Soft cap and completion allowances.
    pub budget: Option<RawBudgetPolicy>,
    /// Limits on images and request bodies.
    pub vision: Option<RawVision>,
    /// Limits on what a backend may send back.
    pub limits: Option<RawLimits>,
    /// Session affinity for HTTP calls: calls carrying the same value in `header`
    /// go to the same pool member while it is healthy. Absent: off.
    pub affinity: Option<RawAffinity>,
    /// The response cache (SPEC §16): answers kept for the model names and REST
    /// operations a policy names, and served again. Absent: nothing is cached.
    pub cache: Option<RawCache>,
    /// The backends by name.
    pub backends: Option<BTreeMap<String, RawBackend>>,
}

/// The response cache. Entries live in hard partitions (tenant, and agent with
/// `scope: agent`, × policy × requested model × everything in the request that changes
/// the answer but its last user message); they are sealed with AES-256-GCM under a key
/// per tenant derived from `key`, and never logged.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    rename = "Cache",
    expecting = "a cache ({store: ..., key: env:NAME, policies: {...}, models: {...}}) (a mapping)"
)]
pub struct RawCache {
    /// Where entries are kept: `{kind: embedded, path}`, `{kind: postgres, url}` or
    /// `{kind: dynamodb, table}` (exact policies only). A store that fails is a miss,
    /// never an error.
    #[schemars(required)]
    pub store: Option<RawCacheStore>,
    /// The master key each tenant's entry key is derived from (HKDF-SHA256), a secret
    /// reference resolved once, at start.
    #[schemars(required)]
    pub key: Option<RawSecret>,
    /// The policies by name.
    #[schemars(required)]
    pub policies: Option<BTreeMap<String, RawCachePolicy>>,
    /// The model name a caller sends (on the chat, Responses and Messages doors, and
    /// `/v1/embeddings`) → the policy its calls are cached under. A REST operation
    /// names its policy in its contract (`x-flexway-ai: {cache: POLICY}`).
    pub models: Option<BTreeMap<String, String>>,
}

/// Where cache entries are kept. Every kind runs in the operator's own account and
/// counts as internal for `sensitive: allow`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    rename = "CacheStore",
    expecting = "a cache store ({kind: embedded, path: ...}) (a mapping)"
)]
pub struct RawCacheStore {
    /// `embedded` (one local file, needs `path`), `postgres` (PostgreSQL with
    /// pgvector, needs `url`) or `dynamodb` (needs `table`; exact policies only).
    #[schemars(required)]
    pub kind: Option<RawCacheStoreKind>,
    /// The cache file (kind `embedded`).
    pub path: Option<String>,
    /// The PostgreSQL connection URL, a secret reference (kind `postgres`).
    pub url: Option<RawSecret>,
    /// The DynamoDB table name (kind `dynamodb`).
    pub table: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "CacheStoreKind")]
pub enum RawCacheStoreKind {
    Embedded,
    Postgres,
    Dynamodb,
}

/// A cache policy: how an entry is matched, how long it serves, what a hit costs.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "CachePolicy", expecting = "a cache policy ({mode: exact, ttl: 1h}) (a mapping)")]
pub struct RawCachePolicy {
    /// `exact` (the last user message byte for byte) or `semantic` (its embedding,
    /// at or above `threshold`, the numbers and negations of both messages the same;
    /// needs `embed`).
    #[schemars(required)]
    pub mode: Option<RawCacheMode>,
    /// How long an entry serves, e.g. `1h`.
    #[schemars(required)]
    pub ttl: Option<RawDuration>,
    /// `semantic`: the least cosine similarity a hit needs, in (0, 1]. Default `0.95`.
    #[schemars(range(min = 0, max = 1))]
    pub threshold: Option<f64>,
    /// `semantic`: the backend and model that embed the last user message (a
    /// `/v1/embeddings` call, priced and charged to the caller like any).
    pub embed: Option<RawCacheEmbed>,
    /// Whose entries a call shares: `tenant` (the default: every agent of its tenant)
    /// or `agent` (its agent's only).
    pub scope: Option<RawCacheScope>,
    /// What a hit costs the caller: `none` (the default), `full` (the producing call's
    /// cost) or a fraction of it in (0, 1), e.g. `0.1`.
    pub charge: Option<RawCharge>,
    /// The largest answer stored, in bytes. Default 262144 (256 KiB).
    #[schemars(range(min = 1))]
    pub max_entry_bytes: Option<u64>,
    /// The most entries a tenant keeps in the store, counted when one of this
    /// policy's is stored; past it the tenant's oldest go first. Default 100000.
    #[schemars(range(min = 1))]
    pub max_entries_per_tenant: Option<u64>,
    /// Sensitive calls: `bypass` (the default: they neither read nor write) or
    /// `allow`.
    pub sensitive: Option<RawCacheSensitive>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "CacheMode")]
pub enum RawCacheMode {
    Exact,
    Semantic,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "CacheScope")]
pub enum RawCacheScope {
    Tenant,
    Agent,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "CacheSensitive")]
pub enum RawCacheSensitive {
    Bypass,
    Allow,
}

/// The embedding a semantic policy compares.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "CacheEmbed", expecting = "an embed ({backend: ..., model: ...}) (a mapping)")]
pub struct RawCacheEmbed {
    /// A backend serving `embeddings`.
    #[schemars(required)]
    pub backend: Option<String>,
    /// The embedding model asked of it, e.g. `text-embedding-3-small`.
    #[schemars(required)]
    pub model: Option<String>,
}

/// A hit's charge as written: `none`, `full`, or a fraction (`0.1` or `"0.1"`). A
/// number is kept as its text, so that phase 2 reads it exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawCharge(pub String);

impl<'de> Deserialize<'de> for RawCharge {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ChargeVisitor;

        impl serde::de::Visitor<'_> for ChargeVisitor {
            type Value = RawCharge;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("none, full or a fraction such as 0.1")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawCharge, E> {
                Ok(RawCharge(v.to_owned()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<RawCharge, E> {
                Ok(RawCharge(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<RawCharge, E> {
                Ok(RawCharge(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<RawCharge, E> {
                Ok(RawCharge(v.to_string()))
            }
        }

        deserializer.deserialize_any(ChargeVisitor)
    }
}

impl JsonSchema for RawCharge {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "CacheCharge".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "anyOf": [
                {"enum": ["none", "full"]},
                {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                {"type": "string", "pattern": "^0?\\.[0-9]{1,6}$"}
            ]
        })
    }
}

/// Session affinity (SPEC §2.3): a pool picks its member by consistent (rendezvous)
/// hashing of the header's value, inside the usual priority order, so that the same
/// session goes to the same member while that member is healthy, falls back as usual
/// when it is not, and few sessions move when a member is added.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Affinity", expecting = "an affinity (a mapping)")]
pub struct RawAffinity {
    /// The request header carrying the session's value, e.g. `Flexway-Session`.
    #[schemars(required)]
    pub header: Option<String>,
}

/// Capability overrides.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "CapabilityOverrides", expecting = "capability overrides (a mapping)")]
pub struct RawCapabilityOverrides {
    /// Backend for requests carrying images; it must serve `vision`.
    pub vision: Option<String>,
    /// Backend for `/v1/embeddings`; it must serve `embeddings`.
    pub embeddings: Option<String>,
    /// Backend for `/v1/realtime` sessions (WebSocket); it must serve `realtime`.
    pub realtime: Option<String>,
}

/// Budget policy.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "BudgetPolicy", expecting = "a budget policy (a mapping)")]
pub struct RawBudgetPolicy {
    /// Past a fraction of any budget, switch to a cheaper backend.
    pub soft: Option<RawSoftCap>,
    /// Completion allowance reserved when a request sets no `max_tokens`. Default 4096.
    #[schemars(range(min = 1))]
    pub default_max_tokens: Option<u32>,
    /// Smallest completion allowance a near-exhausted budget may be clamped to.
    /// Default 16; at most `default_max_tokens`.
    pub min_completion_tokens: Option<u32>,
}

/// The soft budget cap.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "SoftCap", expecting = "a soft cap (a mapping)")]
pub struct RawSoftCap {
    /// Fraction of any budget, in (0, 1], at which traffic switches (e.g. 0.8).
    #[schemars(required, range(min = 0, max = 1))]
    pub threshold: Option<f64>,
    /// The cheaper backend traffic switches to.
    #[schemars(required)]
    pub backend: Option<String>,
}

/// Limits for requests carrying images.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Vision", expecting = "vision limits (a mapping)")]
pub struct RawVision {
    /// Largest image, measured in the body without decoding. Default 8388608 (8 MiB).
    #[schemars(range(min = 1))]
    pub max_image_bytes: Option<u64>,
    /// Largest request body. Default 25165824 (24 MiB).
    #[schemars(range(min = 1))]
    pub max_body_bytes: Option<u64>,
    /// https origins (`https://host[:port]`) remote image URLs may point under.
    pub allowed_origins: Option<Vec<String>>,
}

/// Bounds on an upstream answer: memory per call stays bounded whatever a backend sends.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Limits", expecting = "answer limits (a mapping)")]
pub struct RawLimits {
    /// Largest non-streamed answer body (a relayed 4xx included). Default 67108864 (64 MiB).
    #[schemars(range(min = 1))]
    pub max_response_bytes: Option<u64>,
    /// Largest single server-sent event of a stream, and largest WebSocket message of
    /// a realtime session, either way. Default 1048576 (1 MiB).
    #[schemars(range(min = 1))]
    pub max_event_bytes: Option<u64>,
}

/// A backend. Which keys apply depends on `kind`; a key of another kind is refused.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Backend", expecting = "a backend (a mapping)")]
pub struct RawBackend {
    /// `openai` (default), `anthropic`, `relay` (another Flexway), `grpc`, `http`,
    /// `inference_pool` (model servers an endpoint picker chooses per call) or `pool`.
    pub kind: Option<RawBackendKind>,
    /// Base URL, http or https (a `grpc` backend's also grpc or grpcs; not for `pool` or
    /// `inference_pool`).
    pub url: Option<String>,
    /// How the gateway authenticates to the backend. Default `{type: none}`.
    pub auth: Option<RawAuth>,
    /// Client certificate (mTLS) and extra CA; for an https:// (or grpcs://) url only.
    pub tls: Option<RawTls>,
    /// Price in euros per million tokens. Default 0. Not on a `pool`, `grpc` or `http`
    /// backend, priced by its members, its descriptor set or its contract.
    pub price: Option<RawPrice>,
    /// Model names served as requested.
    pub models: Option<Vec<String>>,
    /// Client-facing model name → backend model name.
    pub aliases: Option<BTreeMap<String, String>>,
    /// Model served when the requested one is neither in `models` nor `aliases`.
    pub default_model: Option<String>,
    /// What the backend serves (`realtime`: sessions over WebSocket, `/v1/realtime`,
    /// local shape only). Default `[chat]`; for a pool, its members' union.
    pub capabilities: Option<Vec<RawCapability>>,
    /// `false` declares the backend internal: it may receive sensitive requests.
    /// Default true.
    pub external: Option<bool>,
    /// Backends tried in order when this one fails before the first byte.
    pub fallback: Option<Vec<String>>,
    /// Time allowed to one call, e.g. `60s` (the default). Not on a `pool`: its
    /// members' apply.
    pub timeout: Option<RawDuration>,
    /// When to stop sending to this backend for a while. Not on a `pool`: its members
    /// have their own.
    pub circuit_breaker: Option<RawBreaker>,
    /// Members of a `pool`; of an `inference_pool`, the backends used as a plain pool
    /// when its picker cannot answer and `failure_mode` is `fail_open`.
    pub members: Option<Vec<RawPoolMember>>,
    /// `inference_pool`: the Gateway API Inference Extension's endpoint picker, asked
    /// over Envoy's `ext_proc` v3 which model server serves each call.
    pub endpoint_picker: Option<RawEndpointPicker>,
    /// `inference_pool`: where a picked endpoint is called: `http://{endpoint}{path}`,
    /// its port when the picker names an address alone.
    pub target: Option<RawTarget>,
    /// `pool`: how a member is chosen inside the priority group that serves:
    /// `weighted` (default), `least_loaded` (the members' model-server `load`) or
    /// `latency` (peak-EWMA time to first byte, power of two choices).
    pub pick: Option<RawPick>,
    /// `pool`: calls whose prompts begin alike go to the member that served that
    /// beginning last, so its prefix cache is hit.
    pub cache_affinity: Option<RawCacheAffinity>,
    /// `pool`: when a member counts as saturated; when all are, `sheddable` calls are
    /// refused (503 `overloaded`).
    pub saturation: Option<RawSaturation>,
    /// `openai`, `anthropic`, `relay`: the model server's Prometheus metrics, polled
    /// off the request path, for the pools that pick by load or declare saturation.
    pub load: Option<RawLoad>,
    /// `openai`, `anthropic`: the provider's usage API, read by `flexway reconcile
    /// --fetch` with an admin key (never by the gateway itself).
    pub usage_api: Option<RawUsageApi>,
    /// Every kind but `pool`: where the backend processes data, a free label (`eu`,
    /// `ch`, `us-east`; letters, digits, `.`, `_`, `-`, any case). Only backends
    /// whose jurisdiction is listed serve a caller with `residency`; a backend
    /// without one never does.
    pub jurisdiction: Option<String>,
    /// `openai`, `anthropic`, `relay`, `inference_pool`: the deployment's quota at its
    /// provider (an Azure OpenAI deployment's TPM, a vendor's tier), counted fleet-wide
    /// in the ledger; a backend at its quota is passed over like one whose breaker is
    /// open.
    pub quota: Option<RawRates>,
    /// `relay`: `local` (default; counts here) or `upstream` (the receiving Flexway
    /// meters, so a call is billed once).
    pub metering: Option<RawMetering>,
    /// `relay`: header names under which the caller's identity is passed on. Left
    /// out: `{tenant: Flexway-Tenant, agent: Flexway-Agent, sensitive:
    /// Flexway-Sensitive}`, the names a receiving Flexway reads (the sensitivity under
    /// its own `ai.sensitive_header`).
    pub identity_headers: Option<RawIdentityHeaders>,
    /// `grpc`: path of the serialized FileDescriptorSet naming the services served
    /// and the metered methods.
    pub descriptor_set: Option<String>,
    /// `http`: path of the OpenAPI 3.0 or 3.1 contract (YAML or JSON) whose operations
    /// are forwarded, those with `x-flexway-ai` metered; nothing else is.
    pub contract: Option<String>,
    /// `http`: where callers reach the contract's operations (`/apis/ocr`): an
    /// absolute path, apart from `/v1`, `/metrics`, `/healthz`, `/console` and the other
    /// mounts.
    pub mount: Option<String>,
    /// `openai`, `anthropic`, `relay`, `inference_pool`: the caller's request headers
    /// passed on to the backend, by name (e.g. `[anthropic-beta]`, `[openai-beta]`); nothing else of the
    /// caller's headers ever reaches a backend. Never a credential, a hop-by-hop
    /// header, one the gateway writes itself or one of Flexway's own.
    pub forward_headers: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "BackendKind")]
pub enum RawBackendKind {
    Openai,
    Anthropic,
    Relay,
    Grpc,
    Http,
    #[serde(rename = "inference_pool")]
    InferencePool,
    Pool,
}

impl RawBackendKind {
    pub fn name(self) -> &'static str {
        match self {
            RawBackendKind::Openai => "openai",
            RawBackendKind::Anthropic => "anthropic",
            RawBackendKind::Relay => "relay",
            RawBackendKind::Grpc => "grpc",
            RawBackendKind::Http => "http",
            RawBackendKind::InferencePool => "inference_pool",
            RawBackendKind::Pool => "pool",
        }
    }

    /// "an openai backend", "a pool backend": for messages.
    pub fn a_backend(self) -> String {
        let article = match self {
            RawBackendKind::Openai | RawBackendKind::Anthropic | RawBackendKind::InferencePool => "an",
            RawBackendKind::Relay | RawBackendKind::Grpc | RawBackendKind::Http | RawBackendKind::Pool => "a",
        };
        format!("{article} {} backend", self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "Capability")]
pub enum RawCapability {
    Chat,
    Vision,
    Embeddings,
    Realtime,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase", rename = "Metering")]
pub enum RawMetering {
    Local,
    Upstream,
}

/// Authentication to an upstream: a backend, or an MCP server.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Auth", expecting = "an auth (a mapping)")]
pub struct RawAuth {
    /// `none`, `bearer` (+ `secret`), `header` (+ `name`, `secret`) or `token_file`
    /// (+ `path`).
    #[serde(rename = "type")]
    #[schemars(required)]
    pub kind: Option<RawAuthKind>,
    /// Secret reference (`bearer`, `header`).
    pub secret: Option<RawSecret>,
    /// Header carrying the secret (`header`); not a name the gateway writes itself
    /// (`host`, `content-length`, `content-type`, a hop-by-hop header).
    pub name: Option<String>,
    /// File holding a token, re-read at every call and sent as a bearer token
    /// (`token_file`).
    pub path: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case", rename = "AuthType")]
pub enum RawAuthKind {
    None,
    Bearer,
    Header,
    TokenFile,
}

impl RawAuthKind {
    pub fn name(self) -> &'static str {
        match self {
            RawAuthKind::None => "none",
            RawAuthKind::Bearer => "bearer",
            RawAuthKind::Header => "header",
            RawAuthKind::TokenFile => "token_file",
        }
    }
}

/// mTLS towards a backend: a client certificate and key, and optionally the CA that
/// signs the backend's certificate. Each is a secret reference to PEM text.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Tls", expecting = "a tls (a mapping)")]
pub struct RawTls {
    /// Client certificate chain (PEM text), a secret reference; with `key`.
    #[schemars(required)]
    pub cert: Option<RawSecret>,
    /// Client private key (PEM text), a secret reference; with `cert`.
    #[schemars(required)]
    pub key: Option<RawSecret>,
    /// CA bundle (PEM text), a secret reference: the only roots trusted for this
    /// backend's certificate (the system roots are not). Default: the system roots.
    pub ca: Option<RawSecret>,
}

/// Price in euros per million tokens, at most 6 decimal places.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Price", expecting = "a price (a mapping)")]
pub struct RawPrice {
    /// Euros per million input (prompt) tokens.
    #[schemars(required, range(min = 0))]
    pub input_per_mtok_eur: Option<f64>,
    /// Euros per million output (completion) tokens.
    #[schemars(required, range(min = 0))]
    pub output_per_mtok_eur: Option<f64>,
    /// Euros per million prompt tokens the provider read from its prompt cache
    /// (OpenAI's `prompt_tokens_details.cached_tokens`, Anthropic's
    /// `cache_read_input_tokens`). Default: the input price.
    #[schemars(range(min = 0))]
    pub cached_input_per_mtok_eur: Option<f64>,
    /// Euros per million prompt tokens written to the provider's prompt cache
    /// (Anthropic's `cache_creation_input_tokens`). Default: the input price.
    #[schemars(range(min = 0))]
    pub cache_write_per_mtok_eur: Option<f64>,
}

/// Circuit breaker: `failures`, or `failure_ratio` with `min_requests`, within
/// `interval` trips the breaker for `trip`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "CircuitBreaker", expecting = "a circuit breaker (a mapping)")]
pub struct RawBreaker {
    /// Failures within `interval` that trip the breaker. Default 5.
    #[schemars(range(min = 1))]
    pub failures: Option<u32>,
    /// Failure fraction in (0, 1] that trips the breaker (with `min_requests`).
    #[schemars(range(min = 0, max = 1))]
    pub failure_ratio: Option<f64>,
    /// Requests within `interval` before `failure_ratio` applies.
    #[schemars(range(min = 1))]
    pub min_requests: Option<u32>,
    /// Window in which failures are counted. Default `60s`.
    pub interval: Option<RawDuration>,
    /// How long a tripped breaker stays open. Default `30s`.
    pub trip: Option<RawDuration>,
    /// HTTP statuses counted as failures, as codes (`503`) or ranges (`"500-599"`);
    /// connection errors and timeouts always count. Default `["500-599"]`.
    pub status: Option<Vec<RawStatus>>,
    /// Trip for exactly the backend's `Retry-After` when it sends one. Default false.
    pub accept_retry_after: Option<bool>,
}

/// An HTTP status (`503`) or an inclusive range (`"500-599"`).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(untagged, rename = "Status", expecting = "expected a status code (503) or a range (\"500-599\")")]
pub enum RawStatus {
    Code(#[schemars(range(min = 100, max = 599))] u16),
    Text(#[schemars(regex(pattern = r"^[1-5][0-9]{2}(-[1-5][0-9]{2})?$"))] String),
}

/// How a pool picks among the members of its serving priority group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case", rename = "Pick")]
pub enum RawPick {
    Weighted,
    LeastLoaded,
    Latency,
}

/// Prefix-cache affinity of a pool.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    rename = "CacheAffinity",
    expecting = "a cache affinity ({prefix_bytes: 4096}) (a mapping)"
)]
pub struct RawCacheAffinity {
    /// How many bytes of the prompt (system prompt and first messages, as sent) make
    /// the prefix. Default 4096.
    #[schemars(range(min = 1, max = 1048576))]
    pub prefix_bytes: Option<u32>,
}

/// When a pool's member is saturated: either bound reached.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Saturation", expecting = "a saturation ({queue: 8, kv_cache: 0.9}) (a mapping)")]
pub struct RawSaturation {
    /// Requests waiting in the model server's queue (without metrics: the gateway's
    /// own calls in flight to it).
    #[schemars(range(min = 1))]
    pub queue: Option<u32>,
    /// KV-cache use, a fraction in (0, 1].
    #[schemars(range(min = 0, max = 1))]
    pub kv_cache: Option<f64>,
}

/// A model server's Prometheus endpoint (vLLM, SGLang or TGI series).
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Load", expecting = "a load source ({metrics_url: ...}) (a mapping)")]
pub struct RawLoad {
    /// The `/metrics` URL, http or https.
    #[schemars(required)]
    pub metrics_url: Option<String>,
    /// How often it is read, e.g. `1s` (the default); at least 100ms.
    pub every: Option<RawDuration>,
}

/// A provider's usage API (`flexway reconcile --fetch`).
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    rename = "UsageApi",
    expecting = "a usage API ({kind: openai, secret: env:OPENAI_ADMIN_KEY}) (a mapping)"
)]
pub struct RawUsageApi {
    /// `openai` (the organization usage API) or `anthropic` (the Admin API's usage
    /// report).
    #[schemars(required)]
    pub kind: Option<RawUsageApiKind>,
    /// The admin key's reference (env:NAME, file:PATH, an AWS ARN). Only `flexway
    /// reconcile --fetch` and `validate --resolve-secrets` resolve it.
    #[schemars(required)]
    pub secret: Option<RawSecret>,
    /// The API's base URL; by default the provider's (`https://api.openai.com`,
    /// `https://api.anthropic.com`).
    pub url: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case", rename = "UsageApiKind")]
pub enum RawUsageApiKind {
    Openai,
    Anthropic,
}

/// An inference pool's endpoint picker.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    rename = "EndpointPicker",
    expecting = "an endpoint picker ({url: http://epp.ns.svc:9002}) (a mapping)"
)]
pub struct RawEndpointPicker {
    /// The picker's gRPC address, `http://host:port` (HTTP/2 cleartext, as the
    /// Inference Extension's pickers serve).
    #[schemars(required)]
    pub url: Option<String>,
    /// When the picker cannot answer: `fail_close` (the default: the pool fails, 503
    /// `picker_unavailable` if nothing else serves) or `fail_open` (the pool's
    /// `members` serve as a plain pool).
    pub failure_mode: Option<RawFailureMode>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case", rename = "FailureMode")]
pub enum RawFailureMode {
    FailClose,
    FailOpen,
}

/// Where an inference pool's picked endpoints are called.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "Target", expecting = "a target ({port: 8000, path: /v1}) (a mapping)")]
pub struct RawTarget {
    /// The model servers' port, for an endpoint the picker names without one.
    #[schemars(required, range(min = 1, max = 65535))]
    pub port: Option<u32>,
    /// The OpenAI API's base path on each model server. Default `/v1`.
    pub path: Option<String>,
}

/// A member of a pool.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "PoolMember", expecting = "a pool member ({backend: ...}) (a mapping)")]
pub struct RawPoolMember {
    /// The member backend (not a pool, not grpc).
    #[schemars(required)]
    pub backend: Option<String>,
    /// 1 is tried first; a lower priority only when no higher one is available.
    /// Default 1.
    #[schemars(range(min = 1))]
    pub priority: Option<u32>,
    /// Share of traffic within its priority group. Default 1.
    #[schemars(range(min = 1))]
    pub weight: Option<u32>,
}

/// Header names under which a relay passes the caller's identity on; in a declared
/// mapping, a name left out is not sent. Not a name the gateway writes itself (`host`,
/// `content-length`, `transfer-encoding`, `connection`, `keep-alive`, `proxy-connection`,
/// `te`, `trailer`, `upgrade`, `content-type`).
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename = "IdentityHeaders", expecting = "identity headers (a mapping)")]
pub struct RawIdentityHeaders {
    /// Header carrying the tenant's name (a receiving Flexway reads `Flexway-Tenant`).
    pub tenant: Option<String>,
    /// Header carrying the agent's name, if the call has one (a receiving Flexway
    /// reads `Flexway-Agent`).
    pub agent: Option<String>,
    /// Header carrying the sensitivity flag, `true` or `false` (a receiving Flexway
    /// reads its `ai.sensitive_header`).
    pub sensitive: Option<String>,
}

/// A duration as written (`30s`). A bare YAML number is taken too, as text, so that
/// phase 2 can say what unit is missing instead of "expected a string".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawDuration(pub String);

impl<'de> Deserialize<'de> for RawDuration {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DurationVisitor;

        impl serde::de::Visitor<'_> for DurationVisitor {
            type Value = RawDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as 500ms, 30s, 5m, 1h or 2d")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawDuration, E> {
                Ok(RawDuration(v.to_owned()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<RawDuration, E> {
                Ok(RawDuration(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<RawDuration, E> {
                Ok(RawDuration(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<RawDuration, E> {
                Ok(RawDuration(v.to_string()))
            }
        }

        deserializer.deserialize_any(DurationVisitor)
    }
}

impl JsonSchema for RawDuration {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Duration".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "description": "A whole number and a unit: 500ms, 30s, 5m, 1h, 2d.",
            "pattern": "^[0-9]+(ms|s|m|h|d)$"
        })
    }
}

/// A secret reference as written. Its `Debug` never shows the text and its
/// deserialization never echoes a value of the wrong type: whatever was written
/// here may be a secret pasted by mistake.
#[derive(Clone, PartialEq, Eq)]
pub struct RawSecret(pub String);

impl fmt::Debug for RawSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RawSecret(..)")
    }
}

pub(super) const SECRET_REFERENCE_FORMS: &str = "env:NAME, file:PATH, or an AWS Secrets Manager or SSM parameter ARN";

impl<'de> Deserialize<'de> for RawSecret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SecretVisitor;

        fn not_a_string<E: serde::de::Error>() -> E {
            E::custom(format_args!("expected a secret reference ({SECRET_REFERENCE_FORMS})"))
        }

        impl serde::de::Visitor<'_> for SecretVisitor {
            type Value = RawSecret;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a secret reference ({SECRET_REFERENCE_FORMS})")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawSecret, E> {
                Ok(RawSecret(v.to_owned()))
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<RawSecret, E> {
                Err(not_a_string())
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<RawSecret, E> {
                Err(not_a_string())
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<RawSecret, E> {
                Err(not_a_string())
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<RawSecret, E> {
                Err(not_a_string())
            }
            fn visit_bytes<E: serde::de::Error>(self, _: &[u8]) -> Result<RawSecret, E> {
                Err(not_a_string())
            }
        }

        // `deserialize_any`, not `deserialize_str`: a YAML tree refuses a non-string
        // for `deserialize_str` itself, quoting the value.
        deserializer.deserialize_any(SecretVisitor)
    }
}

impl JsonSchema for RawSecret {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "SecretRef".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "description": "A reference to a secret, never the secret itself: env:NAME, \
                file:PATH, or an AWS Secrets Manager / SSM parameter ARN.",
            "pattern": "^(env:.+|file:.+|arn:aws[a-z-]*:(secretsmanager|ssm):.+)$"
        })
    }
}

/// The document as far as it parsed, and what did not.
pub(super) struct Parsed {
    /// Every entry that had the right shape; the others are left out.
    pub raw: RawConfig,
    /// The entries left out, with their paths, in document order.
    pub errors: ShapeErrors,
}

/// Reads the document. `Err` when it is refused whole: over a bound of `bounds`, not
/// YAML, or not a mapping; otherwise the entries of the wrong shape are reported
/// (the first `cap` of them with their message) and left out of `raw`.
pub(super) fn parse(text: &str, cap: usize) -> Result<Parsed, Diagnostic> {
    bounds::check(text)?;
    let mut doc: Value = serde_norway::from_str(text).map_err(|e| syntax_error(&e))?;
    doc.apply_merge().map_err(|e| syntax_error(&e))?;
    match &doc {
        Value::Mapping(_) => {}
        Value::Null => return Err(Diagnostic::new("", "the document is empty: it starts with `version: 1`")),
        _ => {
            return Err(Diagnostic::new(
                "",
                "the document must be a mapping of keys \
                 (`version`, `store`, `audit`, `tenants`, `ai`)",
            ));
        }
    }
    match shape::read::<RawConfig>(&doc, cap) {
        (Some(raw), errors) => Ok(Parsed { raw, errors }),
        // A mapping always reads as a `RawConfig`, if an empty one.
        (None, errors) => Ok(Parsed { raw: RawConfig::default(), errors }),
    }
}

fn syntax_error(error: &serde_norway::Error) -> Diagnostic {
    let message = error.to_string();
    match error.location() {
        Some(at) if !message.contains(" line ") => {
            Diagnostic::new("", format!("invalid YAML at line {} column {}: {message}", at.line(), at.column()))
        }
        _ => Diagnostic::new("", format!("invalid YAML: {message}")),
    }
}
