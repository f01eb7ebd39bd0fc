//! Phase 2: raw document → [`Config`], every rule of SPEC.md's "refused at load".
//!
//! The checker walks the whole document and collects every error and warning with
//! its path; a [`Config`] comes out only when there is no error. References between
//! sections (a tenant's backend, a fallback, a pool member) are checked against a
//! [`Catalog`] of the declared backends built first, so the order of the document
//! never matters.
//!
//! Invariants of the result: every backend name points at a declared backend; no
//! gRPC backend is reachable by HTTP routing; the sensitive backend is internal; no
//! two keys share a hash; money is exact micro-euros; with [`Secrets::Resolve`],
//! `env:` secrets are set and `file:` secrets (TLS material included) readable at load
//! time (with [`Secrets::Check`], each of those is a warning instead); AWS references
//! are well-formed ARNs, resolved later by the gateway's secret source.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::Duration;

mod backends;

use super::raw::{
    Parsed, RawAgent, RawAi, RawAudit, RawBackend, RawBackendKind, RawBudgetPolicy, RawBudgets, RawCapability,
    RawConfig, RawConsole, RawCriticality, RawDuration, RawKey, RawLimits, RawSecret, RawSinkKind, RawStore,
    RawStoreKind, RawTelemetry, RawTenant, RawVision,
};
use super::values::{base_url, fraction_ppm, header_name, https_origin, key_hash, micro_eur, secret_ref, unresolvable};
use super::*;

const DEFAULT_LEDGER_PATH: &str = "./flexway-ledger";
/// The paths the gateway serves itself: no REST mount may overlap them.
const GATEWAY_PATHS: [&str; 4] = ["/v1", "/metrics", "/healthz", "/console"];

const DEFAULT_SECRETS_REFRESH: Duration = Duration::from_secs(5 * 60);
const DEFAULT_SENSITIVE_HEADER: &str = "Flexway-Sensitive";
const DEFAULT_MAX_TOKENS: u32 = 4096;
const DEFAULT_MIN_COMPLETION_TOKENS: u32 = 16;
const DEFAULT_MAX_IMAGE_BYTES: u64 = 8 * 1024 * 1024;
const DEFAULT_MAX_BODY_BYTES: u64 = 24 * 1024 * 1024;
const DEFAULT_MAX_RESPONSE_BYTES: u64 = 64 * 1024 * 1024;
const DEFAULT_MAX_EVENT_BYTES: u64 = 1024 * 1024;
/// Lambda's request payload limit (function URL and API Gateway alike): 6 MB.
const LAMBDA_MAX_REQUEST_BYTES: u64 = 6 * 1024 * 1024;

/// The configuration, or its errors (at most the shape pass's listed ones, all the
/// rules') and how many more shape errors were found than listed.
pub(super) fn validate(
    parsed: Parsed,
    env: &dyn EnvSource,
    secrets: Secrets,
) -> Result<Loaded, (Vec<Diagnostic>, usize)> {
    let Parsed { raw, errors: shape_errors } = parsed;
    let unparsed = Unparsed::new(&shape_errors.lost_values);
    let RawConfig { version, store, audit, secrets: secret_policy, tenants, ai, telemetry, console } = raw;
    let mut check = Checker { env, secrets, errors: Vec::new(), warnings: Vec::new(), grpc: BTreeMap::new() };

    match version {
        Some(1) => {}
        Some(other) => check.error("version", format!("unsupported version {other}: this Flexway reads version 1")),
        None => check.error("version", "required: `version: 1`"),
    }
    let store = check.store(store);
    let audit = check.audit(audit);
    let refresh = secret_policy.and_then(|policy| policy.refresh);
    let secret_policy =
        SecretsConfig { refresh: check.duration("secrets.refresh", refresh.as_ref(), DEFAULT_SECRETS_REFRESH) };
    let telemetry = telemetry.and_then(|raw| check.telemetry(raw));

    let mut ai = ai.unwrap_or_default();
    let raw_backends = ai.backends.take().unwrap_or_default();
    let catalog = Catalog::new(&raw_backends, &unparsed);
    let backends: BTreeMap<BackendId, Backend> = raw_backends
        .into_iter()
        .filter_map(|(name, raw)| check.backend(&name, raw, &catalog))
        .map(|backend| (backend.name.clone(), backend))
        .collect();
    check.mounts(&backends);
    check.loads(&backends);
    let ai = check.ai(ai, &catalog, backends);
    let tenants = check.tenants(tenants.unwrap_or_default(), &catalog);
    if let Some(ai) = &ai {
        check.residency_chains(&tenants, ai);
    }
    let console = console.and_then(|raw| check.console(raw, &tenants));
    if let (Some(store), Some(audit), Some(ai)) = (&store, &audit, &ai) {
        check.platform_limits(store, audit, ai);
    }

    let mut errors = shape_errors.listed;
    errors.extend(check.errors.into_iter().filter(|e| !unparsed.covers(&e.path)));
    // Checked in dependency order; reported in the order of a typical document.
    errors.sort_by_key(|d| section_rank(&d.path));
    check.warnings.sort_by_key(|d| section_rank(&d.path));

    match (store, audit, ai) {
        (Some(store), Some(audit), Some(ai)) if errors.is_empty() && shape_errors.unlisted == 0 => Ok(Loaded {
            config: Config {
                store,
                audit,
                secrets: secret_policy,
                tenants,
                ai,
                telemetry,
                console,
                sha256: String::new(),
            },
            warnings: check.warnings,
        }),
        _ if errors.is_empty() && shape_errors.unlisted == 0 => {
            Err((vec![Diagnostic::new("", "the configuration is incomplete (internal error)")], 0))
        }
        _ => Err((errors, shape_errors.unlisted)),
    }
}

/// The parts of the document (a section, a tenant, a backend) that lost a value to a
/// shape error. Their rules are not checked, and a backend among them is not
/// judged when something refers to it: the shape error already fails the load, and
/// anything more would be a guess about what the entry meant.
struct Unparsed {
    units: BTreeSet<String>,
}

/// Request headers the gateway writes to a backend itself, beyond [`RESERVED_HEADERS`]:
/// a caller's would go out beside the gateway's own (`forward_headers`).
const GATEWAY_HEADERS: [&str; 5] = ["accept", "user-agent", "traceparent", "tracestate", "anthropic-version"];

/// The request headers a config may not name for the gateway to send (see
/// `Checker::sent_header`).
const RESERVED_HEADERS: [&str; 10] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "content-type",
];

impl Unparsed {
    /// From the paths of the shape errors that lost a value (an unknown key took
    /// nothing the rules read: its part is still judged).
    fn new(lost_values: &[String]) -> Unparsed {
        Unparsed { units: lost_values.iter().map(|path| unit_of(path)).collect() }
    }

    /// Whether `path` is in a unit: one lookup per prefix of the path that ends
    /// where a segment does, so as cheap with 10,000 units as with one.
    fn covers(&self, path: &str) -> bool {
        if self.units.is_empty() {
            return false;
        }
        let ends = path.match_indices(['.', '[']).map(|(i, _)| i).chain([path.len()]);
        ends.into_iter().any(|end| self.units.contains(&path[..end]))
    }

    /// Whether every backend's shape is in doubt (`ai` or `ai.backends` itself).
    fn all_backends(&self) -> bool {
        self.units.contains("ai") || self.units.contains("ai.backends")
    }

    /// Backends whose entry lost something, or was dropped whole.
    fn backends(&self) -> BTreeSet<String> {
        self.units.iter().filter_map(|u| u.strip_prefix("ai.backends.")).map(str::to_owned).collect()
    }
}

/// `ai.backends.X...` → `ai.backends.X`, `tenants.X...` → `tenants.X`, `ai.K...` →
/// `ai.K`, anything else → its top-level key.
fn unit_of(path: &str) -> String {
    let top = path.split(['.', '[']).next().unwrap_or_default();
    let depth = match top {
        "ai" if path.starts_with("ai.backends.") => 3,
        "ai" | "tenants" => 2,
        _ => 1,
    };
    path.splitn(depth + 1, '.')
        .take(depth)
        .map(|segment| segment.split('[').next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join(".")
}

/// The position of a path's section in SPEC.md's example, for a stable sort.
fn section_rank(path: &str) -> u8 {
    let section = path.split(['.', '[']).next().unwrap_or_default();
    match section {
        "version" => 0,
        "store" => 1,
        "audit" => 2,
        "secrets" => 3,
        "tenants" => 4,
        "ai" if path.starts_with("ai.backends") => 6,
        "ai" => 5,
        "telemetry" => 7,
        _ => 8,
    }
}

/// What routing rules need to know of each declared backend, pools resolved.
struct Summary {
    kind: RawBackendKind,
    /// External unless declared `external: false`; a pool is also external when any
    /// of its members is.
    external: bool,
    capabilities: BTreeSet<Capability>,
}

struct Catalog {
    backends: BTreeMap<String, Summary>,
    /// Backends whose shape was wrong, and the pools they are members of.
    in_doubt: BTreeSet<String>,
    /// `ai` or `ai.backends` itself was of the wrong shape.
    all_in_doubt: bool,
}

impl Catalog {
    fn new(backends: &BTreeMap<String, RawBackend>, unparsed: &Unparsed) -> Catalog {
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

    fn get(&self, name: &str) -> Option<&Summary> {
        self.backends.get(name)
    }

    /// Whether `name` may have been declared, or declared otherwise, in entries that
    /// did not parse.
    fn is_in_doubt(&self, name: &str) -> bool {
        self.all_in_doubt || self.in_doubt.contains(name)
    }
}

fn capability(raw: RawCapability) -> Capability {
    match raw {
        RawCapability::Chat => Capability::Chat,
        RawCapability::Vision => Capability::Vision,
        RawCapability::Embeddings => Capability::Embeddings,
        RawCapability::Realtime => Capability::Realtime,
    }
}

fn capability_list(capabilities: &BTreeSet<Capability>) -> String {
    if capabilities.is_empty() {
        return "none".into();
    }
    capabilities.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(", ")
}

struct Checker<'a> {
    env: &'a dyn EnvSource,
    secrets: Secrets,
    errors: Vec<Diagnostic>,
    warnings: Vec<Diagnostic>,
    /// The grpc backends' descriptor sets, as read (`Ai::grpc`).
    grpc: BTreeMap<BackendId, std::sync::Arc<GrpcServices>>,
}

impl Checker<'_> {
    fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Diagnostic::new(path, message));
    }

    fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Diagnostic::new(path, message));
    }

    /// The serverless shape's platform limits that change a guarantee (ARCHITECTURE.md,
    /// "Deployment shapes"): said at load, as warnings, never found in an incident. The
    /// shape is recognised by its adapters (a DynamoDB ledger or a CloudWatch audit).
    fn platform_limits(&mut self, store: &StoreConfig, audit: &AuditConfig, ai: &Ai) {
        let serverless =
            matches!(store, StoreConfig::DynamoDb { .. }) || matches!(audit.sink, AuditSinkConfig::CloudWatch { .. });
        if !serverless {
            return;
        }
        if ai.vision.max_body_bytes > LAMBDA_MAX_REQUEST_BYTES {
            self.warn(
                "ai.vision.max_body_bytes",
                format!(
                    "{} bytes is more than the 6 MB ({LAMBDA_MAX_REQUEST_BYTES} bytes) request payload Lambda accepts: \
                     in the serverless shape the effective body limit is 6 MB (including the event envelope), \
                     and a larger request is refused by the platform before Flexway sees it",
                    ai.vision.max_body_bytes
                ),
            );
        }
        for backend in ai.backends.values() {
            if backend.capabilities.contains(&Capability::Realtime) && backend.kind.endpoint().is_some() {
                self.warn(
                    format!("ai.backends.{}.capabilities", backend.name),
                    "realtime sessions are not served by the serverless shape (a function URL cannot hold a \
                     WebSocket): /v1/realtime is refused there; serve this backend's sessions with `flexway serve`",
                );
            }
            if matches!(backend.kind, BackendKind::Grpc { .. }) {
                self.warn(
                    format!("ai.backends.{}", backend.name),
                    "no native gRPC through a Lambda function URL (gRPC-Web only): in the serverless shape \
                     callers of this backend must use gRPC-Web, and its client and bidirectional streaming \
                     methods are refused (the function URL buffers the request body)",
                );
            }
        }
    }

    /// The value, or an error saying it is required (`what` says what it is for).
    fn required<T>(&mut self, path: &str, value: Option<T>, what: &str) -> Option<T> {
        if value.is_none() {
            self.error(path, format!("required {what}"));
        }
        value
    }

    /// Refuses a key present where it does not apply.
    fn refuse(&mut self, parent: &str, key: &str, present: bool, here: &str, applies_to: &str) {
        if present {
            self.error(
                format!("{parent}.{key}"),
                format!("`{key}` does not apply to {here}; it belongs to {applies_to}"),
            );
        }
    }

    /// A secret reference of the right form, and whether it resolves now, judged as
    /// [`Secrets`] says.
    fn secret(&mut self, path: &str, raw: &RawSecret) -> Option<SecretRef> {
        let reference = secret_ref(&raw.0).map_err(|message| self.error(path, message)).ok()?;
        self.resolvable(path, &reference).then_some(reference)
    }

    /// Whether `reference` may go into the config: it resolves now, or it need not
    /// ([`Secrets::Check`]: then what would stop it is a warning).
    fn resolvable(&mut self, path: &str, reference: &SecretRef) -> bool {
        let Some(reason) = unresolvable(reference, self.env) else {
            return true;
        };
        match self.secrets {
            Secrets::Check => {
                self.warn(
                    path,
                    format!("{reason} (checked for its form only: the gateway will not start until it resolves)"),
                );
                true
            }
            Secrets::Resolve => {
                self.error(path, reason);
                false
            }
        }
    }

    fn duration(&mut self, path: &str, raw: Option<&RawDuration>, default: Duration) -> Duration {
        let Some(RawDuration(text)) = raw else {
            return default;
        };
        match parse_duration(text) {
            Ok(d) if d.is_zero() => {
                self.error(path, "must be longer than zero");
                default
            }
            Ok(d) => d,
            Err(message) => {
                self.error(path, message);
                default
            }
        }
    }

    fn header(&mut self, path: &str, name: &str) -> Option<String> {
        header_name(name).map_err(|message| self.error(path, message)).ok()
    }

    /// A header the gateway sends a backend under a name the config gives: not one
    /// that frames the request or holds for one hop only (RFC 9110 §7.6.1), nor the
    /// body's type, which the gateway writes itself (sent twice, a backend may read
    /// either, or refuse the request).
    fn sent_header(&mut self, path: &str, name: &str) -> Option<String> {
        let name = self.header(path, name)?;
        if RESERVED_HEADERS.contains(&name.as_str()) {
            self.error(path, format!("`{name}` is written by the gateway itself: choose another header name"));
            return None;
        }
        Some(name)
    }

    fn non_empty(&mut self, path: &str, text: Option<String>, what: &str) -> Option<String> {
        match text {
            Some(text) if text.trim().is_empty() => {
                self.error(path, format!("must not be empty: required {what}"));
                None
            }
            other => self.required(path, other, what),
        }
    }

    /// A declared backend that HTTP routing may use (not gRPC), for `role`.
    fn route_target<'c>(
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

    /// REST mounts (SPEC §10): none over the gateway's own paths, none over another
    /// (one mount a prefix of the other, by whole segments).
    fn mounts(&mut self, backends: &BTreeMap<BackendId, Backend>) {
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

    // ----- store, audit -------------------------------------------------------------

    fn store(&mut self, raw: Option<RawStore>) -> Option<StoreConfig> {
        let Some(RawStore { kind, path, table }) = raw else {
            return Some(StoreConfig::Embedded { path: PathBuf::from(DEFAULT_LEDGER_PATH) });
        };
        let kind = self.required("store.kind", kind, "(embedded | memory | dynamodb)")?;
        let (has_path, has_table) = (path.is_some(), table.is_some());
        match kind {
            RawStoreKind::Embedded => {
                self.refuse("store", "table", has_table, "store kind embedded", "kind dynamodb");
                let path = self.non_empty("store.path", path, "(the ledger directory of kind embedded)")?;
                Some(StoreConfig::Embedded { path: path.into() })
            }
            RawStoreKind::Memory => {
                self.refuse("store", "path", has_path, "store kind memory", "kind embedded");
                self.refuse("store", "table", has_table, "store kind memory", "kind dynamodb");
                Some(StoreConfig::Memory)
            }
            RawStoreKind::Dynamodb => {
                self.refuse("store", "path", has_path, "store kind dynamodb", "kind embedded");
                let table = self.non_empty("store.table", table, "(the DynamoDB table of kind dynamodb)")?;
                Some(StoreConfig::DynamoDb { table })
            }
        }
    }

    fn audit(&mut self, raw: Option<RawAudit>) -> Option<AuditConfig> {
        let Some(RawAudit { sink, path, log_group, log_stream, hash_salt, chain_key }) = raw else {
            self.unsalted_audit();
            return Some(AuditConfig { sink: AuditSinkConfig::Stdout, hash_salt: None, chain_key: None });
        };
        let here = |sink: &str| format!("audit sink {sink}");
        let (has_path, has_group, has_stream) = (path.is_some(), log_group.is_some(), log_stream.is_some());
        let sink = match sink.unwrap_or(RawSinkKind::Stdout) {
            RawSinkKind::File => {
                self.refuse("audit", "log_group", has_group, &here("file"), "sink cloudwatch");
                self.refuse("audit", "log_stream", has_stream, &here("file"), "sink cloudwatch");
                self.non_empty("audit.path", path, "(the JSONL file of sink file)")
                    .map(|path| AuditSinkConfig::File { path: path.into() })
            }
            RawSinkKind::Stdout => {
                self.refuse("audit", "path", has_path, &here("stdout"), "sink file");
                self.refuse("audit", "log_group", has_group, &here("stdout"), "sink cloudwatch");
                self.refuse("audit", "log_stream", has_stream, &here("stdout"), "sink cloudwatch");
                Some(AuditSinkConfig::Stdout)
            }
            RawSinkKind::Cloudwatch => {
                self.refuse("audit", "path", has_path, &here("cloudwatch"), "sink file");
                self.non_empty("audit.log_group", log_group, "(the log group of sink cloudwatch)")
                    .map(|log_group| AuditSinkConfig::CloudWatch { log_group, log_stream })
            }
        };
        let hash_salt = match &hash_salt {
            Some(salt) => Some(self.secret("audit.hash_salt", salt)?),
            None => {
                self.unsalted_audit();
                None
            }
        };
        let chain_key = match &chain_key {
            Some(key) => Some(self.secret("audit.chain_key", key)?),
            None => None,
        };
        Some(AuditConfig { sink: sink?, hash_salt, chain_key })
    }

    fn telemetry(&mut self, raw: RawTelemetry) -> Option<TelemetryConfig> {
        let RawTelemetry { otlp_endpoint, export_interval } = raw;
        let export_interval = self.duration(
            "telemetry.export_interval",
            export_interval.as_ref(),
            TelemetryConfig::DEFAULT_EXPORT_INTERVAL,
        );
        let url = self.non_empty("telemetry.otlp_endpoint", otlp_endpoint, "(the collector's base URL)")?;
        let parsed = base_url(&url).map_err(|m| self.error("telemetry.otlp_endpoint", m)).ok()?;
        if parsed.scheme != "http" && parsed.scheme != "https" {
            self.error(
                "telemetry.otlp_endpoint",
                format!("`{url}` is not http(s): OTLP/HTTP is sent over http or https"),
            );
            return None;
        }
        Some(TelemetryConfig { otlp_endpoint: parsed.with_scheme(&parsed.scheme), export_interval })
    }

    /// Without a salt, the identifiers the audit hashes (the caller's key, the
    /// request's `user`) are plain SHA-256: a short `user` value is reversed by
    /// hashing a dictionary of candidates.
    fn unsalted_audit(&mut self) {
        self.warn(
            "audit.hash_salt",
            "not set: identifiers in the audit (keys, end users) are hashed without a salt, so short values \
             such as user names can be recovered by hashing guesses; set a secret reference \
             (env:NAME or file:PATH) to a random value",
        );
    }

    // ----- tenants ------------------------------------------------------------------

    fn tenants(&mut self, raw: BTreeMap<String, RawTenant>, catalog: &Catalog) -> BTreeMap<TenantId, Tenant> {
        let relay_peer_declared =
            raw.values().flat_map(|t| t.keys.iter().flatten()).any(|k| k.relay_peer == Some(true));
        let mut seen_keys: HashMap<[u8; 32], String> = HashMap::new();
        let mut tenants = BTreeMap::new();
        for (name, tenant) in raw {
            let path = format!("tenants.{name}");
            let RawTenant { keys, budgets, backend, agents, max_criticality, residency } = tenant;

            let agents: BTreeMap<AgentId, Agent> = agents
                .unwrap_or_default()
                .into_iter()
                .map(|(agent, raw)| {
                    let agent_path = format!("{path}.agents.{agent}");
                    (AgentId::new(&agent), self.agent(&agent_path, raw, catalog))
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
            let backend = backend.and_then(|b| {
                self.route_target(&format!("{path}.backend"), &b, catalog, "a tenant's backend").map(|(id, _)| id)
            });
            let id = TenantId::new(&name);
            let max_criticality = criticality(max_criticality);
            let residency = residency.and_then(|list| self.residency(&format!("{path}.residency"), list));
            // An agent is held to its tenant's limits too: its own are narrowed here,
            // once, so that a call reads one set.
            let mut agents = agents;
            for agent in agents.values_mut() {
                agent.max_criticality = agent.max_criticality.min(max_criticality);
                agent.residency = match (&residency, agent.residency.take()) {
                    (Some(of_tenant), Some(own)) => Some(of_tenant.intersection(&own).cloned().collect()),
                    (of_tenant, own) => own.or_else(|| of_tenant.clone()),
                };
            }
            let tenant = Tenant { name: id.clone(), keys, budgets, backend, agents, max_criticality, residency };
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
        Some(KeyEntry { sha256: hash, agent, relay_peer: raw.relay_peer.unwrap_or(false) })
    }

    /// The console's keys: at least one, each once, none a tenant's (a tenant's key
    /// never opens the console).
    fn console(&mut self, raw: RawConsole, tenants: &BTreeMap<TenantId, Tenant>) -> Option<ConsoleConfig> {
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

    fn agent(&mut self, path: &str, raw: RawAgent, catalog: &Catalog) -> Agent {
        let backend = raw.backend.and_then(|b| {
            self.route_target(&format!("{path}.backend"), &b, catalog, "an agent's backend").map(|(id, _)| id)
        });
        let max_criticality = criticality(raw.max_criticality);
        let residency = raw.residency.and_then(|list| self.residency(&format!("{path}.residency"), list));
        Agent { backend, budgets: self.budgets(&format!("{path}.budgets"), raw.budgets), max_criticality, residency }
    }

    /// A warning for each residency-bound tenant or agent whose default chain (its
    /// backend, its pools' members, their fallbacks) holds no backend in its
    /// jurisdictions: its calls would all be refused with `residency_unavailable`.
    fn residency_chains(&mut self, tenants: &BTreeMap<TenantId, Tenant>, ai: &Ai) {
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

    fn budgets(&mut self, path: &str, raw: Option<RawBudgets>) -> Budgets {
        let Some(raw) = raw else {
            return Budgets::default();
        };
        let eur_per_month = raw
            .eur_per_month
            .and_then(|eur| micro_eur(eur).map_err(|m| self.error(format!("{path}.eur_per_month"), m)).ok());
        Budgets { tokens_per_day: raw.tokens_per_day, tokens_per_month: raw.tokens_per_month, eur_per_month }
    }

    // ----- ai -----------------------------------------------------------------------

    fn ai(&mut self, raw: RawAi, catalog: &Catalog, backends: BTreeMap<BackendId, Backend>) -> Option<Ai> {
        let RawAi {
            default_backend,
            capabilities,
            sensitive_header,
            sensitive_backend,
            budget,
            vision,
            limits,
            affinity,
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

        Some(Ai {
            default_backend: default_backend?,
            capabilities,
            sensitive_header: sensitive_header?,
            sensitive_backend,
            budget: budget?,
            vision: vision?,
            limits,
            affinity,
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

/// A jurisdiction label, lower-cased: 1 to 64 letters, digits, `.`, `_` or `-`.
fn jurisdiction(check: &mut Checker<'_>, path: &str, label: &str) -> Option<String> {
    if is_jurisdiction(label) {
        Some(label.to_ascii_lowercase())
    } else {
        check.error(path, format!("`{label}` is not a jurisdiction: 1 to 64 letters, digits, `.`, `_` or `-`"));
        None
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
