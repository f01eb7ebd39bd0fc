//! The gateway's shared state: built once at start-up (outside any handler, so the
//! clients live across requests and Lambda invocations), then read by every request.

use std::sync::Arc;
use std::time::Duration;

use crate::audit::{AuditSink, Hasher};
use crate::budget::BudgetStore;
use crate::config::{BackendId, Config, Price};
use crate::identity::KeyRing;
use crate::metrics::Registry;
use crate::routing::Router;
use crate::routing::breaker::Breakers;
use crate::secret::SecretSource;
use crate::telemetry::{Export, Telemetry};
use crate::upstream::{SetupError, Upstreams};

/// The adapters a shape plugs into the core: built by each binary from the config's
/// tagged enums (memory/embedded/DynamoDB ledger; file/stdout/CloudWatch audit).
pub struct Adapters {
    pub budgets: Arc<dyn BudgetStore>,
    pub audit: Arc<dyn AuditSink>,
    /// When telemetry (if configured) is sent: batched by a long-lived process, at
    /// the end of each call by a function that may be frozen after it.
    pub export: Export,
}

pub struct Gateway {
    pub config: Arc<Config>,
    pub keys: KeyRing,
    pub router: Router,
    pub upstreams: Upstreams,
    pub budgets: Arc<dyn BudgetStore>,
    pub audit: Arc<dyn AuditSink>,
    /// Salted hashing of identifiers for the audit.
    pub hasher: Hasher,
    pub breakers: Breakers,
    pub metrics: Registry,
    pub telemetry: Telemetry,
}

impl Gateway {
    pub fn new(config: Config, secrets: &dyn SecretSource, adapters: Adapters) -> Result<Self, SetupError> {
        let salt = match &config.audit.hash_salt {
            Some(reference) => secrets
                .resolve(reference)
                .map_err(|source| SetupError::AuditSalt { source })?
                .expose()
                .as_bytes()
                .to_vec(),
            None => Vec::new(),
        };
        let telemetry = Telemetry::start(config.telemetry.as_ref(), adapters.export)?;
        let config = Arc::new(config);
        Ok(Gateway {
            telemetry,
            keys: KeyRing::new(&config),
            router: Router::new(config.clone()),
            upstreams: Upstreams::new(&config, secrets)?,
            budgets: adapters.budgets,
            audit: adapters.audit,
            hasher: Hasher::new(&salt),
            metrics: Registry::new(),
            breakers: Breakers::new(config.ai.backends.iter().map(|(n, b)| (n.clone(), b.circuit_breaker.clone()))),
            config,
        })
    }

    pub fn price(&self, backend: &BackendId) -> Price {
        self.config.ai.backends.get(backend).map(|b| b.price).unwrap_or_default()
    }

    pub fn timeout(&self, backend: &BackendId) -> Duration {
        self.config.ai.backends.get(backend).map(|b| b.timeout).unwrap_or_default()
    }
}
