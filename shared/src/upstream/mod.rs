//! Upstream calls: one HTTP client per backend, with its authentication.
//!
//! The request sent upstream is built from nothing: a JSON body, a content type and
//! the backend's own credential. No header of the caller's travels, so the caller's
//! key can never reach a backend. Secrets are resolved once at start-up, except
//! `token_file`, which is re-read at every call (a projected workload-identity token
//! rotates under our feet).

pub mod body;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderName, HeaderValue};

use crate::config::{Auth, BackendId, Config, Endpoint, Tls};
use crate::secret::{SecretError, SecretSource};

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
}

/// Why a backend did not answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("connection failed: {0}")]
    Connect(String),
    /// The TLS handshake failed: what an operator fixes in the backend's `tls`.
    #[error("TLS handshake failed: {0}")]
    Tls(String),
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
    /// POSTs a JSON body to `{url}{path}` and waits for the response head.
    pub async fn post_json(&self, path: &str, body: Vec<u8>) -> Result<reqwest::Response, CallError> {
        let mut request = self
            .http
            .post(format!("{}{}", self.base, path))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body);
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
            Ok(Err(e)) => Err(send_error(&e)),
            Ok(Ok(response)) => Ok(response),
        }
    }
}

/// A request that got no answer: a TLS failure as rustls names it, else the
/// connection error as reqwest tells it. rustls's error sits down the error's sources,
/// inside I/O errors (hyper's, tokio-rustls's) whose `source()` skips the error they
/// wrap: those are opened with `get_ref`.
fn send_error(e: &reqwest::Error) -> CallError {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = next {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return CallError::Tls(tls_failure(tls));
        }
        next = match error.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref) {
            Some(inner) => Some(inner),
            None => error.source(),
        };
    }
    CallError::Connect(without_url(e))
}

/// rustls's words, and where to look: the CA that should sign the backend's
/// certificate, or the client certificate the backend refused.
fn tls_failure(error: &rustls::Error) -> String {
    use rustls::AlertDescription as Alert;
    match error {
        rustls::Error::InvalidCertificate(_) => {
            format!("{error}: the backend's certificate is not trusted (its `tls.ca`, or the system roots)")
        }
        rustls::Error::AlertReceived(
            Alert::CertificateRequired
            | Alert::BadCertificate
            | Alert::UnknownCA
            | Alert::CertificateUnknown
            | Alert::CertificateExpired
            | Alert::CertificateRevoked
            | Alert::UnsupportedCertificate
            | Alert::AccessDenied,
        ) => format!("{error}: the backend refused the client certificate (its `tls.cert` and `tls.key`)"),
        other => other.to_string(),
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
                Some(tls) => tls_client(name, tls, secrets)?,
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

/// The backend's own client for mTLS: its client certificate and key, and its CA
/// bundle in place of the system roots. Errors name the reference and what is wrong
/// with its PEM, never the PEM (the key is a secret).
fn tls_client(name: &BackendId, tls: &Tls, secrets: &dyn SecretSource) -> Result<reqwest::Client, SetupError> {
    let err = |detail: String| SetupError::Tls { backend: name.clone(), detail };
    let resolve =
        |reference| secrets.resolve(reference).map_err(|source| SetupError::Secret { backend: name.clone(), source });
    let cert = resolve(&tls.cert)?;
    let key = resolve(&tls.key)?;
    // Both read apart first, so that an error says which one is wrong.
    if !pem_holds(cert.expose(), &["CERTIFICATE"]) {
        return Err(err(format!("tls.cert ({}) holds no PEM certificate", tls.cert)));
    }
    if !pem_holds(key.expose(), &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"]) {
        return Err(err(format!("tls.key ({}) holds no PEM private key", tls.key)));
    }
    let pem = format!("{}\n{}\n", cert.expose(), key.expose());
    let identity = reqwest::Identity::from_pem(pem.as_bytes())
        .map_err(|e| err(format!("tls.cert and tls.key ({}, {}): {}", tls.cert, tls.key, without_url(&e))))?;
    let mut builder = client_builder().identity(identity);
    if let Some(reference) = &tls.ca {
        let ca = resolve(reference)?;
        let roots = reqwest::Certificate::from_pem_bundle(ca.expose().as_bytes())
            .map_err(|e| err(format!("tls.ca ({reference}): {}", without_url(&e))))?;
        if roots.is_empty() {
            return Err(err(format!("tls.ca ({reference}) holds no PEM certificate")));
        }
        builder =
            roots.into_iter().fold(builder.tls_built_in_root_certs(false), |b, root| b.add_root_certificate(root));
    }
    builder.build().map_err(|e| err(without_url(&e)))
}

/// Whether `pem` has a block of one of these labels (`-----BEGIN <label>-----`).
fn pem_holds(pem: &str, labels: &[&str]) -> bool {
    labels.iter().any(|label| pem.contains(&format!("-----BEGIN {label}-----")))
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
