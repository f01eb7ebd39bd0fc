//! Every endpoint backend's client, built from the config and its resolved secrets.
//! A reload builds them over the previous set's connection pools; a refresh puts new
//! secrets in use backend by backend. A backend whose new values do not resolve or
//! do not build keeps what it has.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use arc_swap::ArcSwap;
use foldhash::HashMap;
use http::{HeaderName, HeaderValue, Uri};

use super::alpn::Negotiated;
use super::client::PATHS;
use super::credential::{Live, material};
use super::grpc::GrpcClient;
use super::headers::RelayHeaders;
use super::tls::{TlsMaterial, client_tls, public_roots, tls_config, tls_material};
use super::transport::{SERVING_THREADS, Transport};
use super::{SetupError, UpstreamClient, h1};
use crate::config::{BackendId, BackendKind, Config, Tls};
use crate::protocol::Wire;
use crate::secret::Resolved;

/// Every endpoint backend's client.
pub struct Upstreams {
    clients: HashMap<BackendId, UpstreamClient>,
    /// Each serving thread's connections over the public roots, shared by every
    /// `https://` backend without a `tls` of its own.
    shared: Transport,
    /// Each serving thread's pool of plain HTTP/1.1 connections, shared by every plain
    /// backend and every endpoint a picker names.
    pools: Vec<Arc<h1::Pool>>,
    /// Every name some backend's `forward_headers` lists.
    forwardable: Vec<HeaderName>,
    /// What the backends' servers chose at their TLS handshakes.
    negotiated: Arc<Negotiated>,
    /// The `grpc` backends' client over the public roots (h2c towards `http://`).
    grpc_shared: Arc<GrpcClient>,
    /// A `grpc` backend with `tls`: its own client.
    grpc_own: HashMap<BackendId, ArcSwap<OwnGrpc>>,
}

/// A `grpc` backend's own client, and the TLS material it was made with.
struct OwnGrpc {
    client: Arc<GrpcClient>,
    material: TlsMaterial,
}

impl Upstreams {
    /// Every endpoint backend's client, from its secrets resolved in `secrets`.
    pub fn new(config: &Config, secrets: &Resolved) -> Result<Self, SetupError> {
        Self::build(config, secrets, None)
    }

    /// The clients of a reloaded configuration (SPEC §12), over `previous`'s
    /// connection pools: a backend the reload leaves where it was keeps its pooled
    /// connections (and, with unchanged `tls`, its own client); one it removes is
    /// drained by the pools' idle timeout.
    pub fn reloaded(config: &Config, secrets: &Resolved, previous: &Upstreams) -> Result<Self, SetupError> {
        Self::build(config, secrets, Some(previous))
    }

    fn build(config: &Config, secrets: &Resolved, previous: Option<&Upstreams>) -> Result<Self, SetupError> {
        let threads = SERVING_THREADS.load(Ordering::Relaxed);
        let (shared, pools, negotiated, grpc_shared) = match previous {
            Some(previous) => (
                previous.shared.clone(),
                previous.pools.clone(),
                previous.negotiated.clone(),
                previous.grpc_shared.clone(),
            ),
            None => {
                let tls = tls_config(public_roots(), None).map_err(|e| SetupError::Client(e.to_string()))?;
                let negotiated = Arc::new(Negotiated::default());
                let shared = Transport::over(&tls, &negotiated, threads);
                let pools: Vec<_> = (0..threads).map(|_| Arc::new(h1::Pool::default())).collect();
                (shared, pools, negotiated, Arc::new(GrpcClient::new(tls)))
            }
        };
        let mut grpc_own = HashMap::default();
        for (name, backend) in &config.ai.backends {
            let BackendKind::Grpc { tls: Some(tls), .. } = &backend.kind else { continue };
            let material = tls_material(name, tls, secrets)?;
            let before = previous.and_then(|p| p.grpc_own.get(name)).map(ArcSwap::load_full);
            let own = match before {
                Some(before) if before.material == material => before,
                _ => Arc::new(OwnGrpc::new(name, tls, material)?),
            };
            grpc_own.insert(name.clone(), ArcSwap::new(own));
        }
        let mut clients = HashMap::default();
        let mut forwardable: Vec<HeaderName> = Vec::new();
        for (name, backend) in &config.ai.backends {
            let Some(endpoint) = backend.kind.endpoint() else {
                continue;
            };
            let material = material(name, endpoint, secrets)?;
            let base = endpoint.url.trim_end_matches('/');
            let uri = base.parse::<Uri>().ok();
            let https = uri.as_ref().filter(|uri| uri.scheme() == Some(&http::uri::Scheme::HTTPS));
            // HTTP/1.1 over the plain pools, or the TLS ones of the public roots.
            let h1 = if https.is_some() { shared.h1.clone() } else { pools.clone() };
            let kept = Transport { h1, ..shared.clone() };
            // A backend with its own TLS client keeps it when its material is the same.
            let before = previous.and_then(|p| p.clients.get(name)).map(|c| c.live.load_full());
            let live = match &before {
                Some(before) if before.material == material => {
                    Live::build(name, endpoint, material, Some(before), &before.transport, &negotiated)?
                }
                _ => Live::build(name, endpoint, material, None, &kept, &negotiated)?,
            };
            // A relay's url is the other Flexway's base: its API is under `/v1`.
            let (base, identity_headers) = match &backend.kind {
                BackendKind::Relay { identity_headers, .. } => {
                    (format!("{base}/v1"), Some(RelayHeaders::new(name, identity_headers)?))
                }
                _ => (base.to_owned(), None),
            };
            let wire = match backend.kind {
                BackendKind::Anthropic(_) => Wire::Anthropic,
                _ => Wire::OpenAi,
            };
            let live = ArcSwap::from_pointee(live);
            let urls = PATHS.iter().filter_map(|path| Some((*path, format!("{base}{path}").parse().ok()?))).collect();
            // Only TLS chooses a version: a plain `http://` backend keeps a flag of its
            // own, never set, whatever an `https://` one at the same authority chose.
            let authority = https.and_then(Uri::authority).map(|a| a.as_str().to_owned());
            let speaks_h2 = authority.map_or_else(Arc::default, |authority| negotiated.speaks_h2(&authority));
            let timeout = backend.timeout;
            let template = matches!(backend.kind, BackendKind::InferencePool { .. });
            let target = match https {
                Some(uri) => h1::Target::tls(uri, speaks_h2.clone()),
                None => uri.as_ref().and_then(h1::Target::of),
            };
            let forward: Vec<HeaderName> = endpoint
                .forward_headers
                .iter()
                .map(|h| {
                    HeaderName::from_bytes(h.as_bytes())
                        .map_err(|_| SetupError::BadForwardHeader { backend: name.clone() })
                })
                .collect::<Result<_, _>>()?;
            for header in &forward {
                if !forwardable.contains(header) {
                    forwardable.push(header.clone());
                }
            }
            let client = UpstreamClient {
                base,
                urls,
                wire,
                live,
                timeout,
                identity_headers,
                forward,
                speaks_h2,
                target,
                template,
            };
            clients.insert(name.clone(), client);
        }
        Ok(Upstreams { clients, shared, pools, forwardable, negotiated, grpc_shared, grpc_own })
    }

    /// The client a `grpc` backend is called through: its own with `tls`, else the
    /// shared one.
    pub fn grpc(&self, name: &BackendId) -> Arc<GrpcClient> {
        self.grpc_own.get(name).map_or_else(|| self.grpc_shared.clone(), |own| own.load().client.clone())
    }

    /// The client of `endpoint` (`ip:port`), named by the picker of the inference pool
    /// `pool`: called at `http://{endpoint}{path}` with the pool's credential,
    /// forwarded headers and timeout, over the plain connections every thread pools
    /// (a connection to it is reused by the next call it is named for). `None` when
    /// `pool` is not an inference pool or `endpoint` makes no URL.
    pub fn at(&self, pool: &BackendId, endpoint: &str) -> Option<UpstreamClient> {
        let template = self.clients.get(pool).filter(|c| c.template)?;
        let base = format!("http://{endpoint}{}", template.base);
        let uri = base.parse::<Uri>().ok()?;
        let target = h1::Target::of(&uri)?;
        let urls = PATHS.iter().filter_map(|path| Some((*path, format!("{base}{path}").parse().ok()?))).collect();
        Some(UpstreamClient {
            base,
            urls,
            wire: Wire::OpenAi,
            // An inference pool has no `tls` (the config refuses it): its HTTP/1.1 pools
            // are the plain ones its endpoints are called over.
            live: ArcSwap::new(template.live.load_full()),
            timeout: template.timeout,
            identity_headers: None,
            forward: template.forward.clone(),
            speaks_h2: Arc::default(),
            target: Some(target),
            template: false,
        })
    }

    /// Opens a connection to every endpoint backend at once, each given at most
    /// `within`; one that fails or takes longer is logged and left to its first call.
    pub async fn preconnect(&self, within: Duration) {
        let each = self.clients.iter().map(|(name, client)| async move {
            match tokio::time::timeout(within, client.preconnect()).await {
                Ok(Ok(())) => tracing::debug!(backend = %name, "connected ahead of the first call"),
                Ok(Err(e)) => tracing::info!(backend = %name, "not connected ahead of the first call: {e}"),
                Err(_) => tracing::info!(backend = %name, "not connected ahead of the first call within {within:?}"),
            }
        });
        futures_util::future::join_all(each).await;
    }

    /// The caller's headers some backend forwards, each value of each: what a call
    /// keeps of its request's headers for the backends it may reach.
    pub fn forwardable(&self, headers: &http::HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
        let mut kept = Vec::new();
        for name in &self.forwardable {
            for value in headers.get_all(name) {
                kept.push((name.clone(), value.clone()));
            }
        }
        kept
    }

    pub fn get(&self, name: &BackendId) -> Option<&UpstreamClient> {
        self.clients.get(name)
    }

    /// Puts the values of a refresh in use, backend by backend: a backend whose
    /// references all resolved, to values that differ from those in use, gets a new
    /// credential (and a new client if its TLS material changed). A backend with a
    /// reference missing from `secrets` (its refresh failed, and was logged), or whose
    /// new values do not build, keeps what it has. Returns the backends updated.
    pub fn refresh(&self, config: &Config, secrets: &Resolved) -> Vec<BackendId> {
        let mut updated = Vec::new();
        for (name, client) in &self.clients {
            let Some(endpoint) = config.ai.backends.get(name).and_then(|b| b.kind.endpoint()) else {
                continue;
            };
            let Ok(material) = material(name, endpoint, secrets) else {
                continue;
            };
            let current = client.live.load();
            if material == current.material {
                continue;
            }
            match Live::build(name, endpoint, material, Some(&current), &current.transport, &self.negotiated) {
                Ok(live) => {
                    client.live.store(Arc::new(live));
                    updated.push(name.clone());
                }
                Err(e) => tracing::error!("{}: {e}; the backend keeps its current credential", crate::secret::REFRESH),
            }
        }
        for (name, own) in &self.grpc_own {
            let Some(tls) = config.ai.backends.get(name).and_then(|b| b.kind.tls()) else { continue };
            let Ok(material) = tls_material(name, tls, secrets) else { continue };
            if material == own.load().material {
                continue;
            }
            match OwnGrpc::new(name, tls, material) {
                Ok(new) => {
                    own.store(Arc::new(new));
                    updated.push(name.clone());
                }
                Err(e) => tracing::error!("{}: {e}; the backend keeps its current client", crate::secret::REFRESH),
            }
        }
        updated
    }
}

impl OwnGrpc {
    fn new(name: &BackendId, tls: &Tls, material: TlsMaterial) -> Result<OwnGrpc, SetupError> {
        let client = Arc::new(GrpcClient::new(client_tls(name, tls, &material)?));
        Ok(OwnGrpc { client, material })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(backends: &str) -> Config {
        let yaml = format!("version: 1\nai:\n  default_backend: a\n  backends:\n{backends}");
        crate::config::load_str(&yaml, &std::collections::HashMap::<String, String>::new()).unwrap().config
    }

    #[tokio::test]
    async fn a_reload_keeps_the_connection_pools() {
        let grpc = "    g: {kind: grpc, url: 'grpcs://g.example', descriptor_set: /nonexistent/g.binpb}\n";
        let before =
            config(&format!("    a: {{url: 'http://127.0.0.1:9/v1'}}\n    b: {{url: 'https://b.example/v1'}}\n{grpc}"));
        let old = Upstreams::new(&before, &Resolved::default()).unwrap();
        let after = config(&format!(
            "    a: {{url: 'http://127.0.0.1:9/v1'}}\n    c: {{url: 'http://127.0.0.1:10/v1'}}\n{grpc}"
        ));
        let new = Upstreams::reloaded(&after, &Resolved::default(), &old).unwrap();
        let counts = |u: &Upstreams| (u.pools.len(), u.shared.lanes.len(), u.shared.h1.len());
        assert_eq!(counts(&new), counts(&old), "each serving thread's pools and lanes, none left out");
        assert!(new.pools.iter().zip(&old.pools).all(|(n, o)| Arc::ptr_eq(n, o)), "plain connections kept");
        assert!(new.shared.lanes.iter().zip(&old.shared.lanes).all(|(n, o)| Arc::ptr_eq(n, o)), "TLS connections kept");
        assert!(new.shared.h1.iter().zip(&old.shared.h1).all(|(n, o)| Arc::ptr_eq(n, o)), "TLS pools kept");
        let g = BackendId::new("g");
        assert!(Arc::ptr_eq(&new.grpc(&g), &old.grpc(&g)), "gRPC connections kept");
        assert!(new.get(&BackendId::new("c")).is_some() && new.get(&BackendId::new("b")).is_none());
        let fresh = Upstreams::new(&after, &Resolved::default()).unwrap();
        assert!(!Arc::ptr_eq(&fresh.pools[0], &old.pools[0]), "a start makes its own");
    }
}
