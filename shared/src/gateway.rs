//! The gateway's shared state: built once at start-up (outside any handler, so the
//! clients live across requests and Lambda invocations), then read by every request.

use std::sync::Arc;

use crate::config::Config;
use crate::identity::KeyRing;
use crate::routing::Router;
use crate::secret::SecretSource;
use crate::upstream::{SetupError, Upstreams};

pub struct Gateway {
    pub config: Arc<Config>,
    pub keys: KeyRing,
    pub router: Router,
    pub upstreams: Upstreams,
}

impl Gateway {
    pub fn new(config: Config, secrets: &dyn SecretSource) -> Result<Self, SetupError> {
        let config = Arc::new(config);
        Ok(Gateway {
            keys: KeyRing::new(&config),
            router: Router::new(config.clone()),
            upstreams: Upstreams::new(&config, secrets)?,
            config,
        })
    }
}
