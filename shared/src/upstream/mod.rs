//! Upstream calls: one HTTP client per backend, with its authentication.
//!
//! The request sent upstream is built from nothing: a JSON body, a content type, the
//! call's trace context and the backend's own credential. No other header of the
//! caller's travels, so the caller's key can never reach a backend. Secrets are resolved once at start-up, except
//! `token_file`, which is re-read at every call (a projected workload-identity token
//! rotates under our feet).

pub mod body;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderName, HeaderValue};

use crate::config::{Auth, BackendId, Config, Endpoint, Tls};
use crate::secret::{SecretError, SecretSource};
use crate::telemetry::{TraceContext, context};

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("backend `{backend}`: {source}")]
    Secret { backend: BackendId, source: SecretError },
    #[error("backend `{backend}`: the credential is not a valid header value")]
    BadCredential { backend: BackendId },
    #[error("backend `{backend}`: TLS: {detail}")]
    Tls { backend: BackendId, detail: String },
    #[error("HTTP client: {0}")]
    Client(String),
    #[error("audit.hash_salt: {source}")]
    AuditSalt { source: SecretError },
    #[error(transparent)]
    Telemetry(#[from] crate::telemetry::NoRuntime),
}

/// Why a backend did not answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("connection failed: {0}")]
    Connect(String),
    #[error("credential unavailable: {0}")]
    Credential(String),
}

#[derive(Clone)]
enum Credential {
    None,
    Header(HeaderName, HeaderValue),
    TokenFile(PathBuf),
}

pub struct UpstreamClient {
    http: reqwest::Client,
    base: String,
    credential: Credential,
    pub timeout: Duration,
}

impl UpstreamClient {
    /// POSTs a JSON body to `{url}{path}` and waits for the response head. The call's
    /// trace context goes with it (W3C `traceparent`, `tracestate`).
    pub async fn post_json(
        &self,
        path: &str,
        body: Vec<u8>,
        trace: &TraceContext,
    ) -> Result<reqwest::Response, CallError> {
        let mut request = self
            .http
            .post(format!("{}{}", self.base, path))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some((traceparent, state)) = trace.upstream() {
            request = request.header(context::TRACEPARENT, traceparent);
            if let Some(state) = state {
                request = request.header(context::TRACESTATE, state);
            }
        }
        match &self.credential {
            Credential::None => {}
            Credential::Header(name, value) => request = request.header(name, value),
            Credential::TokenFile(path) => {
                // A few bytes from a projected token file: read in place, not on the
                // blocking pool (two thread hops for a microsecond's work).
                let token = std::fs::read_to_string(path)
                    .map_err(|e| CallError::Credential(format!("token_file {}: {e}", path.display())))?;
                let mut value = HeaderValue::from_str(&format!("Bearer {}", token.trim())).map_err(|_| {
                    CallError::Credential(format!("token_file {}: not a valid header value", path.display()))
                })?;
                value.set_sensitive(true);
                request = request.header(http::header::AUTHORIZATION, value);
            }
        }
        match tokio::time::timeout(self.timeout, request.send()).await {
            Err(_) => Err(CallError::Timeout(self.timeout)),
            Ok(Err(e)) if e.is_timeout() => Err(CallError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(CallError::Connect(without_url(&e))),
            Ok(Ok(response)) => Ok(response),
        }
    }
}

/// reqwest errors print the URL; ours carry no secret, but keep messages short.
fn without_url(e: &reqwest::Error) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message = format!("{message}: {s}");
        source = s.source();
    }
    message
}

/// Every endpoint backend's client, built once.
pub struct Upstreams {
    clients: HashMap<BackendId, UpstreamClient>,
}

impl Upstreams {
    pub fn new(config: &Config, secrets: &dyn SecretSource) -> Result<Self, SetupError> {
        let shared = client_builder().build().map_err(|e| SetupError::Client(e.to_string()))?;
        let mut clients = HashMap::new();
        for (name, backend) in &config.ai.backends {
            let Some(endpoint) = backend.kind.endpoint() else {
                continue;
            };
            let http = match &endpoint.tls {
                None => shared.clone(),
                Some(tls) => tls_client(name, tls)?,
            };
            let client = UpstreamClient {
                http,
                base: endpoint.url.trim_end_matches('/').to_owned(),
                credential: credential(name, endpoint, secrets)?,
                timeout: backend.timeout,
            };
            clients.insert(name.clone(), client);
        }
        Ok(Upstreams { clients })
    }

    pub fn get(&self, name: &BackendId) -> Option<&UpstreamClient> {
        self.clients.get(name)
    }
}

fn client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .user_agent(concat!("flexway/", env!("CARGO_PKG_VERSION")))
}

fn tls_client(name: &BackendId, tls: &Tls) -> Result<reqwest::Client, SetupError> {
    let err = |detail: String| SetupError::Tls { backend: name.clone(), detail };
    let mut pem = std::fs::read(&tls.cert).map_err(|e| err(format!("{}: {e}", tls.cert.display())))?;
    pem.extend(std::fs::read(&tls.key).map_err(|e| err(format!("{}: {e}", tls.key.display())))?);
    let identity = reqwest::Identity::from_pem(&pem).map_err(|e| err(e.to_string()))?;
    let mut builder = client_builder().identity(identity);
    if let Some(ca) = &tls.ca {
        let ca_pem = std::fs::read(ca).map_err(|e| err(format!("{}: {e}", ca.display())))?;
        let cert = reqwest::Certificate::from_pem(&ca_pem).map_err(|e| err(e.to_string()))?;
        builder = builder.add_root_certificate(cert);
    }
    builder.build().map_err(|e| err(e.to_string()))
}

fn credential(name: &BackendId, endpoint: &Endpoint, secrets: &dyn SecretSource) -> Result<Credential, SetupError> {
    let sensitive = |value: String| {
        HeaderValue::from_str(&value)
            .map(|mut v| {
                v.set_sensitive(true);
                v
            })
            .map_err(|_| SetupError::BadCredential { backend: name.clone() })
    };
    let resolve =
        |reference| secrets.resolve(reference).map_err(|source| SetupError::Secret { backend: name.clone(), source });
    Ok(match &endpoint.auth {
        Auth::None => Credential::None,
        Auth::Bearer { secret } => {
            let secret = resolve(secret)?;
            Credential::Header(http::header::AUTHORIZATION, sensitive(format!("Bearer {}", secret.expose()))?)
        }
        Auth::Header { name: header, secret } => {
            let header = HeaderName::from_bytes(header.as_bytes())
                .map_err(|_| SetupError::BadCredential { backend: name.clone() })?;
            Credential::Header(header, sensitive(resolve(secret)?.expose().to_owned())?)
        }
        Auth::TokenFile { path } => Credential::TokenFile(path.clone()),
    })
}
