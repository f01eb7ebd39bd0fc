//! The gateway's shared state: built once at start-up (outside any handler, so the
//! clients live across requests and Lambda invocations), then read by every request.
//!
//! Every secret reference resolves before the gateway exists (a reference that does
//! not stops the start, named by its path and reference, never by a value). The
//! backends' references, and the MCP servers' `auth` secrets, are resolved again every
//! `secrets.refresh` ([`Gateway::refresh_secrets`]); the audit salt is not: hashes must
//! stay comparable.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::audit::chain::ChainedAuditSink;
use crate::audit::{AuditSink, Hasher};
use crate::budget::BudgetStore;
use crate::budget::SoftHints;
use crate::config::{BackendId, Config, Price};
use crate::identity::KeyRing;
use crate::metrics::Registry;
use crate::realtime::Sessions;
use crate::routing::Router;
use crate::routing::breaker::Breakers;
use crate::secret::SecretError;
use crate::secret::{SecretSource, resolve_all};
use crate::telemetry::{Export, Telemetry};
use crate::upstream::Upstreams;

/// Why a gateway could not be built from a configuration.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A reference that did not resolve, named by its path in the document.
    #[error("{path}: {source}")]
    Secret { path: String, source: SecretError },
    /// The upstream clients could not be built (a credential, a header, TLS).
    #[error(transparent)]
    Upstream(#[from] crate::upstream::SetupError),
    /// A grpc backend's descriptor set that loading only warned about (it may be
    /// shipped apart from the config): a gateway does not start without it.
    #[error("ai.backends.{backend}.descriptor_set: {} does not exist: a gateway with a grpc backend starts only with its descriptor set", path.display())]
    MissingDescriptorSet { backend: BackendId, path: std::path::PathBuf },
    /// A cache key anyone could guess is no key.
    #[error("ai.cache.key: the key is {len} bytes; a cache key is at least 16 (32 random bytes is the usual)")]
    ShortCacheKey { len: usize },
    /// A chain key anyone could guess is no key.
    #[error("audit.chain_key: the key is {len} bytes; a chain key is at least 16 (32 random bytes is the usual)")]
    ShortChainKey { len: usize },
    /// A session key anyone could guess is no key.
    #[error("mcp.session_key: the key is {len} bytes; a session key is at least 16 (32 random bytes is the usual)")]
    ShortSessionKey { len: usize },
    /// An inference pool's endpoint picker could not be set up.
    #[error(transparent)]
    Picker(#[from] crate::routing::endpoint_picker::PickerError),
    #[error(transparent)]
    Telemetry(#[from] crate::telemetry::NoRuntime),
}

/// Why a new configuration was not put in use: the running one serves on.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("`{0}` changed: it takes a restart (the ledger, the audit and the telemetry stay as they started)")]
    NeedsRestart(&'static str),
    #[error(transparent)]
    Setup(#[from] SetupError),
}

/// The adapters a shape plugs into the core: built by each binary from the config's
/// tagged enums (memory/embedded/DynamoDB ledger; file/stdout/CloudWatch audit).
pub struct Adapters {
    pub budgets: Arc<dyn BudgetStore>,
    pub audit: Arc<dyn AuditSink>,
    /// When telemetry (if configured) is sent: batched by a long-lived process, at
    /// the end of each call by a function that may be frozen after it.
    pub export: Export,
    /// The response cache's store (`ai.cache.store`), when the config has one: one
    /// that failed to open is given as [`crate::cache::Failed`] (every call a miss).
    pub cache: Option<Arc<dyn crate::cache::CacheStore>>,
}

pub struct Gateway {
    pub config: Arc<Config>,
    pub keys: KeyRing,
    pub router: Router,
    pub upstreams: Upstreams,
    pub budgets: Arc<dyn BudgetStore>,
    /// Callers last read past their soft threshold: admission routes them soft without
    /// reading their counters.
    pub soft_hints: SoftHints,
    pub audit: Arc<dyn AuditSink>,
    /// Salted hashing of identifiers for the audit.
    pub hasher: Hasher,
    pub breakers: Arc<Breakers>,
    /// Kept across reloads, as the telemetry is: counters never go back.
    pub metrics: Arc<Registry>,
    pub telemetry: Arc<Telemetry>,
    /// The response cache (SPEC §16), when `ai.cache` is configured.
    pub cache: Option<Arc<crate::cache::ResponseCache>>,
    /// Open realtime sessions (local shape), closed and waited for when it stops;
    /// one registry across reloads, so a session opened before one is closed too.
    pub sessions: Arc<Sessions>,
    /// `/mcp`'s state (SPEC §17), when `mcp` is configured.
    pub mcp: Option<Arc<McpState>>,
    secrets: Arc<dyn SecretSource>,
    /// When the backends' secrets are next due for a refresh.
    next_refresh: Mutex<Instant>,
}

impl Gateway {
    /// Resolves every secret reference of `config` through `secrets` (concurrently),
    /// then builds the gateway; `secrets` is kept for the refreshes. A grpc backend
    /// whose descriptor set is missing (loading only warns) stops the start.
    pub async fn new(config: Config, secrets: Arc<dyn SecretSource>, adapters: Adapters) -> Result<Self, SetupError> {
        descriptor_sets(&config)?;
        let (resolved, failures) = resolve_all(&config.secret_references(), secrets.as_ref()).await;
        if let Some((path, source)) = failures.into_iter().next() {
            return Err(SetupError::Secret { path, source });
        }
        let salt = match &config.audit.hash_salt {
            Some(reference) => resolved.get(reference).map(|s| s.expose().as_bytes().to_vec()).unwrap_or_default(),
            None => Vec::new(),
        };
        // Every door writes through `audit`: chained here, every record is.
        let audit = match &config.audit.chain_key {
            Some(reference) => {
                let key = resolved.get(reference).map(|s| s.expose().as_bytes().to_vec()).unwrap_or_default();
                if key.len() < 16 {
                    return Err(SetupError::ShortChainKey { len: key.len() });
                }
                Arc::new(ChainedAuditSink::new(adapters.audit, &key)) as Arc<dyn AuditSink>
            }
            None => adapters.audit,
        };
        let cache = match (&config.ai.cache, adapters.cache) {
            (Some(cache), Some(store)) => {
                let key = resolved.get(&cache.key).map(|s| s.expose().as_bytes().to_vec()).unwrap_or_default();
                if key.len() < 16 {
                    return Err(SetupError::ShortCacheKey { len: key.len() });
                }
                Some(Arc::new(crate::cache::ResponseCache::new(store, &key)))
            }
            _ => None,
        };
        let telemetry = Arc::new(Telemetry::start(config.telemetry.as_ref(), adapters.export)?);
        let upstreams = Upstreams::new(&config, &resolved)?;
        session_key_length(&config, &resolved)?;
        let mcp = config.mcp.as_ref().map(|mcp| Arc::new(McpState::new(mcp, &resolved, &salt, None)));
        let next_refresh = Mutex::new(Instant::now() + config.secrets.refresh);
        let config = Arc::new(config);
        let keys = KeyRing::new(&config);
        let router = Router::new(config.clone())?;
        router.loads.start_polling(&config);
        Ok(Gateway {
            telemetry,
            cache,
            sessions: Arc::default(),
            mcp,
            hasher: Hasher::with_keys(&salt, keys.digests()),
            keys,
            router,
            upstreams,
            budgets: adapters.budgets,
            soft_hints: SoftHints::default(),
            audit,
            metrics: Arc::new(Registry::new()),
            breakers: Arc::new(Breakers::new(
                config.ai.backends.iter().map(|(n, b)| (n.clone(), b.circuit_breaker.clone())),
            )),
            config,
            secrets,
            next_refresh,
        })
    }

    /// The gateway of `config`, a configuration that replaces this one's (SPEC §12):
    /// its own keys, routes, backends' clients and secrets (resolved now), with this
    /// one's ledger, audit (its chain goes on), metrics and telemetry, and the state
    /// of every breaker whose policy is unchanged. Calls in flight finish on this
    /// one. Refused, this one serving on, when `config` changes what only a restart
    /// can (the ledger, the audit's sink, salt or chain key, the telemetry), or a
    /// secret of it does not resolve.
    pub async fn reload(&self, config: Config) -> Result<Gateway, ReloadError> {
        let running = &self.config;
        for (what, same) in [
            ("store", config.store == running.store),
            ("audit.sink", config.audit.sink == running.audit.sink),
            ("audit.hash_salt", config.audit.hash_salt == running.audit.hash_salt),
            ("audit.chain_key", config.audit.chain_key == running.audit.chain_key),
            ("telemetry", config.telemetry == running.telemetry),
            ("ai.cache.store", cache_store(&config) == cache_store(running)),
        ] {
            if !same {
                return Err(ReloadError::NeedsRestart(what));
            }
        }
        descriptor_sets(&config)?;
        let (resolved, failures) = resolve_all(&config.ai.secret_references(), self.secrets.as_ref()).await;
        if let Some((path, source)) = failures.into_iter().next() {
            return Err(ReloadError::Setup(SetupError::Secret { path, source }));
        }
        let upstreams = Upstreams::reloaded(&config, &resolved, &self.upstreams).map_err(SetupError::from)?;
        // The MCP servers' secrets and the session key, resolved again with the rest.
        let mcp = match &config.mcp {
            Some(mcp) => {
                let (resolved, failures) = resolve_all(&config.secret_references(), self.secrets.as_ref()).await;
                if let Some((path, source)) = failures.into_iter().next() {
                    return Err(ReloadError::Setup(SetupError::Secret { path, source }));
                }
                session_key_length(&config, &resolved)?;
                let salt = match &config.audit.hash_salt {
                    Some(reference) => resolved.get(reference).map(|s| s.expose().as_bytes().to_vec()),
                    None => None,
                };
                Some(Arc::new(McpState::new(mcp, &resolved, &salt.unwrap_or_default(), self.mcp.as_deref())))
            }
            None => None,
        };
        let config = Arc::new(config);
        let keys = KeyRing::new(&config);
        let router = Router::new(config.clone()).map_err(SetupError::from)?;
        router.loads.start_polling(&config);
        let breakers = Breakers::new(config.ai.backends.iter().map(|(n, b)| (n.clone(), b.circuit_breaker.clone())));
        breakers.carry_from(&self.breakers);
        Ok(Gateway {
            telemetry: self.telemetry.clone(),
            cache: self.cache.clone(),
            sessions: self.sessions.clone(),
            mcp,
            hasher: self.hasher.rekeyed(keys.digests()),
            keys,
            router,
            upstreams,
            budgets: self.budgets.clone(),
            soft_hints: SoftHints::default(),
            audit: self.audit.clone(),
            metrics: self.metrics.clone(),
            breakers: Arc::new(breakers),
            next_refresh: Mutex::new(Instant::now() + config.secrets.refresh),
            config,
            secrets: self.secrets.clone(),
        })
    }

    pub fn price(&self, backend: &BackendId) -> Price {
        self.config.ai.backends.get(backend).map(|b| b.price).unwrap_or_default()
    }

    pub fn timeout(&self, backend: &BackendId) -> Duration {
        self.config.ai.backends.get(backend).map(|b| b.timeout).unwrap_or_default()
    }

    /// The longest a call may spend at `backend`: its `timeout`, once for each
    /// endpoint an inference pool's picker may have it try.
    pub fn attempt_time(&self, backend: &BackendId) -> Duration {
        let tries = if self.router.picker(backend).is_some() { crate::routing::endpoint_picker::MAX_TRIED } else { 1 };
        self.timeout(backend) * u32::try_from(tries).unwrap_or(1)
    }

    /// Resolves the backends' and the MCP servers' secret references again and puts
    /// new values in use. A reference that fails is logged (its path and reference,
    /// never a value) and its backend or server keeps the values it has.
    pub async fn refresh_secrets(&self) {
        let mut references = self.config.ai.secret_references();
        let mcp_servers =
            self.config.secret_references().into_iter().filter(|(path, _)| path.starts_with("mcp.servers."));
        references.extend(mcp_servers);
        if references.is_empty() {
            return;
        }
        let (resolved, failures) = resolve_all(&references, self.secrets.as_ref()).await;
        for (path, error) in &failures {
            tracing::error!(
                "{}: {path}: {error}; its backend or MCP server keeps the last value resolved",
                crate::secret::REFRESH
            );
        }
        let updated = self.upstreams.refresh(&self.config, &resolved);
        if !updated.is_empty() {
            let names: Vec<&str> = updated.iter().map(BackendId::as_str).collect();
            tracing::info!(backends = %names.join(", "), "{}: new values in use", crate::secret::REFRESH);
        }
        if let (Some(mcp), Some(state)) = (&self.config.mcp, &self.mcp) {
            let updated = state.refresh(mcp, &resolved);
            if !updated.is_empty() {
                tracing::info!(mcp_servers = %updated.join(", "), "{}: new values in use", crate::secret::REFRESH);
            }
        }
    }

    /// The serverless shape's refresh: started by the first request after
    /// `secrets.refresh` has passed, beside it, never in its way: the request (and
    /// those meanwhile) go on with the values in use. No timer runs between
    /// invocations; a refresh that an environment's freeze interrupts ends on thaw
    /// (or fails on the SDK's timeouts, logged, the values in use kept).
    pub fn refresh_secrets_if_due(self: &Arc<Self>) {
        let now = Instant::now();
        {
            let mut next = self.next_refresh.lock().unwrap_or_else(PoisonError::into_inner);
            if now < *next {
                return;
            }
            *next = now + self.config.secrets.refresh;
        }
        let gateway = self.clone();
        tokio::spawn(async move { gateway.refresh_secrets().await });
    }
}

/// What `/mcp` keeps across calls (SPEC §17): the upstream client, the key its session
/// ids are sealed with, each server's own credential (never the caller's), the
/// servers' breakers, and the upstream sessions renewed after a server forgot one.
pub struct McpState {
    pub client: crate::mcp::upstream::McpClient,
    pub key: crate::mcp::session::SessionKey,
    /// Each server's own credential (`mcp.servers.NAME.auth`): its headers, swapped
    /// when a refresh resolves a new secret, or its token file, read at each call.
    auth: std::sync::RwLock<std::collections::BTreeMap<String, McpAuth>>,
    /// One breaker per server, keyed by its name.
    pub breakers: Arc<Breakers>,
    /// `mcp.oauth`'s JWT verifier (its key set fetched on first use).
    pub verifier: Option<crate::identity::jwt::Verifier>,
    /// Upstream sessions opened again after their server forgot them: (server, the id
    /// a sealed session carries) → the id in use. Per process, bounded: a session id
    /// the client still holds keeps working without a new `initialize`.
    pub renewed: Mutex<std::collections::HashMap<(String, String), String>>,
    /// Sessions ended here (`DELETE /mcp`): SHA-256 of the id → when it was issued.
    /// Kept until the id would have expired anyway, at most [`MCP_REVOKED`] of them.
    revoked: Mutex<Revoked>,
    /// Tool calls in flight in a session: (SHA-256 of its id, the request's id as
    /// JSON) → where it went. What a client's `notifications/cancelled` is forwarded
    /// by; per process (a cancellation that reaches another is not forwarded).
    in_flight: Mutex<std::collections::HashMap<([u8; 32], String), McpInFlight>>,
    /// Each server's listed tool and prompt names: what a call's name is checked
    /// against (bounded by the servers).
    pub listed: Mutex<McpListed>,
}

/// (server, list method) → when its listing was read, the names in it.
pub type McpListed = std::collections::HashMap<(String, String), (Instant, Arc<[String]>)>;

/// Calls in flight a process remembers; past it, a call is not registered (it cannot
/// be cancelled by the client, only by its leaving).
const MCP_IN_FLIGHT: usize = 10_000;

/// Where a tool call in flight went: its server, the upstream session its client's
/// session carries there (the one in use is looked up when a cancellation comes),
/// and the protocol version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpInFlight {
    pub server: String,
    pub carried: Option<String>,
    pub version: String,
}

/// A registered call in flight, forgotten when dropped (the call ended, or was
/// abandoned).
pub struct McpInFlightGuard {
    state: Arc<McpState>,
    key: ([u8; 32], String),
}

impl Drop for McpInFlightGuard {
    fn drop(&mut self) {
        self.state.in_flight.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.key);
    }
}

/// Ended session ids, and when expired ones were last dropped (Unix seconds).
#[derive(Clone, Default)]
struct Revoked {
    ids: std::collections::HashMap<[u8; 32], u64>,
    pruned_at: u64,
}

/// Ended sessions a process remembers (40 bytes each and the map's own); past it, the
/// oldest is forgotten first (it opens again here until its age refuses it).
const MCP_REVOKED: usize = 100_000;

/// Renewed upstream sessions a process remembers; past it, the map starts again.
const MCP_RENEWED: usize = 10_000;

/// `mcp.session_key`, when set, resolves to 16 bytes or more.
fn session_key_length(config: &Config, resolved: &crate::secret::Resolved) -> Result<(), SetupError> {
    let key = config.mcp.as_ref().and_then(|mcp| mcp.session_key.as_ref()).and_then(|r| resolved.get(r));
    match key.map(|key| key.expose().len()) {
        Some(len) if len < 16 => Err(SetupError::ShortSessionKey { len }),
        _ => Ok(()),
    }
}

impl McpState {
    /// The state of `mcp`: its session key from `mcp.session_key`, else derived from
    /// the audit salt (processes of one configuration share it), else, with neither,
    /// a random key (sessions then hold in this process only: logged). `previous`
    /// (a reload): its breakers carried over where their policy is unchanged.
    pub fn new(
        mcp: &crate::config::Mcp,
        resolved: &crate::secret::Resolved,
        salt: &[u8],
        previous: Option<&McpState>,
    ) -> McpState {
        use crate::mcp::session::SessionKey;
        let configured = mcp.session_key.as_ref().and_then(|reference| resolved.get(reference));
        let key = match configured {
            Some(secret) => SessionKey::derive(secret.expose().as_bytes()),
            None if !salt.is_empty() => SessionKey::derive(salt),
            None => {
                tracing::warn!(
                    "mcp: neither mcp.session_key nor audit.hash_salt is set: MCP session ids hold in this process \
                     only"
                );
                let mut random = [0u8; 32];
                let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut random);
                SessionKey::derive(&random)
            }
        };
        let mut auth = std::collections::BTreeMap::new();
        for (name, server) in &mcp.servers {
            auth.insert(name.clone(), mcp_auth(name, &server.auth, resolved));
        }
        let breakers = Breakers::new(
            mcp.servers.keys().map(|name| (BackendId::new(name), crate::config::BreakerPolicy::default())),
        );
        let mut revoked = Revoked::default();
        if let Some(previous) = previous {
            breakers.carry_from(&previous.breakers);
            revoked = previous.revoked.lock().unwrap_or_else(PoisonError::into_inner).clone();
        }
        McpState {
            client: crate::mcp::upstream::McpClient::new(),
            key,
            auth: std::sync::RwLock::new(auth),
            breakers: Arc::new(breakers),
            verifier: mcp.oauth.as_ref().map(crate::identity::jwt::Verifier::new),
            renewed: Mutex::new(std::collections::HashMap::new()),
            revoked: Mutex::new(revoked),
            in_flight: Mutex::new(std::collections::HashMap::new()),
            listed: Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// A tool call of the session `session_id` sent under the request id `request`:
    /// registered until the guard drops. `None` (not registered) when the session
    /// already has a call of that id in flight, or the process has too many.
    pub fn call_started(
        self: &Arc<Self>,
        session_id: &str,
        request: &serde_json::Value,
        call: McpInFlight,
    ) -> Option<McpInFlightGuard> {
        let key = (digest(session_id), request.to_string());
        let mut in_flight = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        if in_flight.len() >= MCP_IN_FLIGHT || in_flight.contains_key(&key) {
            return None;
        }
        in_flight.insert(key.clone(), call);
        Some(McpInFlightGuard { state: self.clone(), key })
    }

    /// The call of the session `session_id` with the request id `request`, if one is
    /// in flight.
    pub fn call_in_flight(&self, session_id: &str, request: &serde_json::Value) -> Option<McpInFlight> {
        let in_flight = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        in_flight.get(&(digest(session_id), request.to_string())).cloned()
    }

    /// The session `id` seals, unless it is expired (older than
    /// [`crate::mcp::session::MAX_AGE`] at `now`, Unix seconds) or was ended here.
    pub fn open(&self, id: &str, now: u64) -> Option<crate::mcp::session::Session> {
        let session = self.key.open(id).filter(|s| !s.expired(now))?;
        let revoked = self.revoked.lock().unwrap_or_else(PoisonError::into_inner);
        (!revoked.ids.contains_key(&digest(id))).then_some(session)
    }

    /// `id` (which seals `session`) ended: it opens no more in this process. The ids
    /// that expired since are dropped (at most once a minute, or when the set is
    /// full); a set still full forgets its oldest.
    pub fn revoke(&self, id: &str, session: &crate::mcp::session::Session, now: u64) {
        let mut revoked = self.revoked.lock().unwrap_or_else(PoisonError::into_inner);
        if revoked.ids.len() >= MCP_REVOKED || now >= revoked.pruned_at.saturating_add(60) {
            let max_age = crate::mcp::session::MAX_AGE.as_secs();
            revoked.ids.retain(|_, issued_at| now.saturating_sub(*issued_at) < max_age);
            revoked.pruned_at = now;
        }
        if revoked.ids.len() >= MCP_REVOKED
            && let Some(oldest) = revoked.ids.iter().min_by_key(|(_, issued_at)| **issued_at).map(|(k, _)| *k)
        {
            revoked.ids.remove(&oldest);
        }
        revoked.ids.insert(digest(id), session.issued_at);
    }

    /// Ended session ids remembered (a test's window on the bound).
    #[cfg(test)]
    pub fn revoked_len(&self) -> usize {
        self.revoked.lock().unwrap_or_else(PoisonError::into_inner).ids.len()
    }

    /// `server`'s own auth headers as they are now (a token file read now); `None`
    /// for a server not configured.
    pub fn auth_headers(&self, server: &str) -> Option<http::HeaderMap> {
        let auth = self.auth.read().unwrap_or_else(PoisonError::into_inner).get(server)?.clone();
        Some(match auth {
            McpAuth::Headers(headers) => headers,
            McpAuth::TokenFile(path) => token_file_headers(server, &path),
        })
    }

    /// The servers' `auth` secrets as `resolved` has them (a refresh): a server whose
    /// value changed sends the new one from now on; one whose reference did not
    /// resolve keeps the value in use. The servers updated, by name.
    pub fn refresh(&self, mcp: &crate::config::Mcp, resolved: &crate::secret::Resolved) -> Vec<String> {
        use crate::config::Auth;
        let mut updated = Vec::new();
        for (name, server) in &mcp.servers {
            let (Auth::Bearer { secret } | Auth::Header { secret, .. }) = &server.auth else { continue };
            if resolved.get(secret).is_none() {
                continue;
            }
            let fresh = mcp_auth(name, &server.auth, resolved);
            let mut auth = self.auth.write().unwrap_or_else(PoisonError::into_inner);
            if auth.get(name) != Some(&fresh) {
                auth.insert(name.clone(), fresh);
                updated.push(name.clone());
            }
        }
        updated
    }

    /// The upstream session id in use for `carried` (what a sealed session holds).
    pub fn session_in_use(&self, server: &str, carried: &str) -> String {
        self.renewed(server, carried).unwrap_or_else(|| carried.to_owned())
    }

    /// The session id that replaced `carried` at `server`, if one did.
    pub fn renewed(&self, server: &str, carried: &str) -> Option<String> {
        let renewed = self.renewed.lock().unwrap_or_else(PoisonError::into_inner);
        renewed.get(&(server.to_owned(), carried.to_owned())).cloned()
    }

    /// `server` forgot `carried`: `fresh` is used in its place from now on.
    pub fn renew(&self, server: &str, carried: &str, fresh: String) {
        let mut renewed = self.renewed.lock().unwrap_or_else(PoisonError::into_inner);
        if renewed.len() >= MCP_RENEWED {
            renewed.clear();
        }
        renewed.insert((server.to_owned(), carried.to_owned()), fresh);
    }
}

/// What the revocation set keeps of a session id (up to 16 KiB) instead of the id.
fn digest(id: &str) -> [u8; 32] {
    <sha2::Sha256 as sha2::Digest>::digest(id.as_bytes()).into()
}

/// A server's own credential.
#[derive(Clone, PartialEq)]
enum McpAuth {
    /// Its header (none for `auth: none`), from a resolved secret.
    Headers(http::HeaderMap),
    /// A token file, read at each call (as a backend's is): a projected token rotates
    /// under the gateway.
    TokenFile(std::path::PathBuf),
}

/// A server's own credential. A secret that did not resolve (it is not among the
/// configuration's references) leaves the header out, logged by path.
fn mcp_auth(server: &str, auth: &crate::config::Auth, resolved: &crate::secret::Resolved) -> McpAuth {
    use crate::config::Auth;
    let headers = http::HeaderMap::new();
    match auth {
        Auth::None => McpAuth::Headers(headers),
        Auth::Bearer { secret } => match resolved.get(secret) {
            Some(s) => McpAuth::Headers(auth_header(
                server,
                http::header::AUTHORIZATION,
                format!("Bearer {}", s.expose().trim()),
            )),
            None => McpAuth::Headers(unresolved(server, headers)),
        },
        Auth::Header { name, secret } => match (http::HeaderName::try_from(name.as_str()), resolved.get(secret)) {
            (Ok(name), Some(s)) => McpAuth::Headers(auth_header(server, name, s.expose().trim().to_owned())),
            _ => McpAuth::Headers(unresolved(server, headers)),
        },
        Auth::TokenFile { path } => McpAuth::TokenFile(path.clone()),
    }
}

/// A token file's `Authorization`, read now; an unreadable file leaves it out, logged.
fn token_file_headers(server: &str, path: &std::path::Path) -> http::HeaderMap {
    match std::fs::read_to_string(path) {
        Ok(token) => auth_header(server, http::header::AUTHORIZATION, format!("Bearer {}", token.trim())),
        Err(e) => {
            tracing::error!(server, path = %path.display(), "mcp.servers.{server}.auth: token file unreadable: {e}");
            http::HeaderMap::new()
        }
    }
}

/// `name: value` as a sensitive header (left out, logged, when it is not a valid value).
fn auth_header(server: &str, name: http::HeaderName, value: String) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    match http::HeaderValue::try_from(value) {
        Ok(mut value) => {
            value.set_sensitive(true);
            headers.insert(name, value);
        }
        Err(_) => tracing::error!(server, "mcp.servers.{server}.auth: the secret is not a valid header value"),
    }
    headers
}

fn unresolved(server: &str, headers: http::HeaderMap) -> http::HeaderMap {
    tracing::error!(server, "mcp.servers.{server}.auth: the secret did not resolve; the server is called without it");
    headers
}

/// Every grpc backend's descriptor set is there (loading only warns when one is not:
/// it may be shipped apart from the config); a gateway does not start without it.
fn descriptor_sets(config: &Config) -> Result<(), SetupError> {
    for (backend, settings) in &config.ai.backends {
        if let crate::config::BackendKind::Grpc { descriptor_set, .. } = &settings.kind
            && !descriptor_set.exists()
        {
            return Err(SetupError::MissingDescriptorSet { backend: backend.clone(), path: descriptor_set.clone() });
        }
    }
    Ok(())
}

/// The response cache's store and key: what only a restart changes.
fn cache_store(config: &Config) -> Option<(&crate::config::CacheStoreConfig, &crate::config::SecretRef)> {
    config.ai.cache.as_ref().map(|c| (&c.store, &c.key))
}
