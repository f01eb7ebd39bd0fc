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

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

mod adapters;
mod ai;
mod backends;
mod cache;
mod catalog;
mod endpoint;
mod grpc;
mod mcp;
mod pools;
mod rest;
mod tenants;

use self::catalog::{Catalog, Summary, capability, capability_list};
use self::mcp::McpDeclared;
use super::raw::{Parsed, RawConfig, RawDuration, RawSecret};
use super::values::{header_name, secret_ref, unresolvable};
use super::*;

const DEFAULT_SECRETS_REFRESH: Duration = Duration::from_secs(5 * 60);
const DEFAULT_SENSITIVE_HEADER: &str = "Flexway-Sensitive";

/// The configuration, or its errors (at most the shape pass's listed ones, all the
/// rules') and how many more shape errors were found than listed.
pub(super) fn validate(
    parsed: Parsed,
    env: &dyn EnvSource,
    secrets: Secrets,
) -> Result<Loaded, (Vec<Diagnostic>, usize)> {
    let Parsed { raw, errors: shape_errors } = parsed;
    let unparsed = Unparsed::new(&shape_errors.lost_values);
    let RawConfig { version, store, audit, secrets: secret_policy, tenants, ai, telemetry, console, mcp } = raw;
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
    // A cache whose entries lost a value is not judged against what names its policies.
    let cache_in_doubt = unparsed.covers("ai.cache");
    // `cache: off` where no cache is declared would do nothing: refused.
    let cache_declared = cache_in_doubt || ai.cache.is_some();
    let ai = check.ai(ai, &catalog, backends, cache_in_doubt);
    // A section whose entries lost a value is not judged against what names its servers.
    let mcp_declared = McpDeclared::of(mcp.as_ref(), ai.as_ref(), unparsed.covers("mcp"));
    let tenants = check.tenants(tenants.unwrap_or_default(), &catalog, &mcp_declared, cache_declared);
    let hash_salt = audit.as_ref().is_some_and(|audit| audit.hash_salt.is_some());
    let mcp_written = mcp.is_some();
    let mcp = mcp.and_then(|raw| check.mcp(raw, ai.as_ref(), hash_salt));
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
        // A declared `mcp` that did not load has an error.
        (Some(store), Some(audit), Some(ai))
            if errors.is_empty() && shape_errors.unlisted == 0 && mcp.is_some() == mcp_written =>
        {
            Ok(Loaded {
                config: Config {
                    store,
                    audit,
                    secrets: secret_policy,
                    tenants,
                    ai,
                    telemetry,
                    console,
                    mcp,
                    sha256: String::new(),
                },
                warnings: check.warnings,
            })
        }
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
