//! The gateway's shared state: built once at start-up (outside any handler, so the
//! clients live across requests and Lambda invocations), then read by every request.

use std::sync::Arc;
use std::time::Duration;

use crate::budget::BudgetStore;
use crate::config::{BackendId, Config, Price};
use crate::identity::KeyRing;
use crate::routing::Router;
use crate::secret::SecretSource;
use crate::upstream::{SetupError, Upstreams};

pub struct Gateway {
    pub config: Arc<Config>,
    pub keys: KeyRing,
    pub router: Router,
    pub upstreams: Upstreams,
    pub budgets: Arc<dyn BudgetStore>,
}

impl Gateway {
    pub fn new(config: Config, secrets: &dyn SecretSource, budgets: Arc<dyn BudgetStore>) -> Result<Self, SetupError> {
        let config = Arc::new(config);
        Ok(Gateway {
            keys: KeyRing::new(&config),
            router: Router::new(config.clone()),
            upstreams: Upstreams::new(&config, secrets)?,
            budgets,
            config,
        })
    }

    pub fn price(&self, backend: &BackendId) -> Price {
        self.config
            .ai
            .backends
            .get(backend)
            .map(|b| b.price)
            .unwrap_or_default()
    }

    pub fn timeout(&self, backend: &BackendId) -> Duration {
        self.config
            .ai
            .backends
            .get(backend)
            .map(|b| b.timeout)
            .unwrap_or_default()
    }
}
