//! A backend's credential, and what its resolved secrets build: the header its `auth`
//! sends and, with `tls`, connections of its own, held together in a [`Live`] that a
//! refresh replaces whole, so a request uses one consistent set. `token_file` has no
//! secret to resolve: it is read again at every call.

use std::path::PathBuf;
use std::sync::Arc;

use http::{HeaderName, HeaderValue};

use super::alpn::Negotiated;
use super::tls::{TlsMaterial, client_tls, tls_material};
use super::transport::Transport;
use super::{CallError, SetupError};
use crate::config::{Auth, BackendId, Endpoint, SecretRef};
use crate::secret::{Resolved, Secret, SecretError};

/// What a backend's secrets built: the clients (its own when it has `tls`) and the
/// credential, replaced together by a refresh.
pub(super) struct Live {
    pub(super) transport: Transport,
    pub(super) credential: Credential,
    /// The values they were built from, to tell whether a refresh brought new ones.
    pub(super) material: Material,
}

/// A backend's resolved secrets.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Material {
    auth: Option<Secret>,
    tls: Option<TlsMaterial>,
}

impl Live {
    /// The clients and credential `material` makes. Connections of its own are made
    /// for new TLS material (none in `previous`, or different); otherwise `keep`
    /// serves: the shared ones at start, the backend's current ones on a refresh (its
    /// connections stay open).
    pub(super) fn build(
        name: &BackendId,
        endpoint: &Endpoint,
        material: Material,
        previous: Option<&Live>,
        keep: &Transport,
        negotiated: &Arc<Negotiated>,
    ) -> Result<Live, SetupError> {
        let transport = match (&endpoint.tls, &material.tls) {
            (Some(tls), Some(pem)) if previous.is_none_or(|p| p.material.tls.as_ref() != Some(pem)) => {
                Transport::over(&client_tls(name, tls, pem)?, negotiated, keep.lanes.len())
            }
            _ => keep.clone(),
        };
        let credential = credential(name, &endpoint.auth, material.auth.as_ref())?;
        Ok(Live { transport, credential, material })
    }
}

/// A backend's secrets, taken from those resolved (each reference named by its path
/// when it is missing).
pub(super) fn material(name: &BackendId, endpoint: &Endpoint, secrets: &Resolved) -> Result<Material, SetupError> {
    let get = |key: &str, reference: &SecretRef| {
        secrets.get(reference).cloned().ok_or_else(|| SetupError::Secret {
            path: format!("ai.backends.{name}.{key}"),
            source: SecretError::Unavailable { reference: reference.to_string(), detail: "not resolved".into() },
        })
    };
    let auth = match &endpoint.auth {
        Auth::Bearer { secret } | Auth::Header { secret, .. } => Some(get("auth.secret", secret)?),
        Auth::None | Auth::TokenFile { .. } => None,
    };
    let tls = endpoint.tls.as_ref().map(|tls| tls_material(name, tls, secrets)).transpose()?;
    Ok(Material { auth, tls })
}

#[derive(Clone)]
pub(super) enum Credential {
    None,
    Header(HeaderName, HeaderValue),
    TokenFile(PathBuf),
}

impl Credential {
    /// The header this credential sends, if any.
    pub(super) fn header(&self) -> Result<Option<(HeaderName, HeaderValue)>, CallError> {
        match self {
            Credential::None => Ok(None),
            Credential::Header(name, value) => Ok(Some((name.clone(), value.clone()))),
            Credential::TokenFile(path) => {
                // A few bytes from a projected token file: read in place, not on the
                // blocking pool (two thread hops for a microsecond's work).
                let token = std::fs::read_to_string(path)
                    .map_err(|e| CallError::Credential(format!("token_file {}: {e}", path.display())))?;
                let mut value = HeaderValue::from_str(&format!("Bearer {}", token.trim())).map_err(|_| {
                    CallError::Credential(format!("token_file {}: not a valid header value", path.display()))
                })?;
                value.set_sensitive(true);
                Ok(Some((http::header::AUTHORIZATION, value)))
            }
        }
    }
}

/// The header a backend's auth sends, from its secret (`None` for `none` and
/// `token_file`, which has no secret to resolve).
fn credential(name: &BackendId, auth: &Auth, secret: Option<&Secret>) -> Result<Credential, SetupError> {
    let sensitive = |value: String| {
        HeaderValue::from_str(&value)
            .map(|mut v| {
                v.set_sensitive(true);
                v
            })
            .map_err(|_| SetupError::BadCredential { backend: name.clone() })
    };
    Ok(match (auth, secret) {
        (Auth::None, _) => Credential::None,
        (Auth::TokenFile { path }, _) => Credential::TokenFile(path.clone()),
        (Auth::Bearer { .. }, Some(secret)) => {
            Credential::Header(http::header::AUTHORIZATION, sensitive(format!("Bearer {}", secret.expose()))?)
        }
        (Auth::Header { name: header, .. }, Some(secret)) => {
            let header = HeaderName::from_bytes(header.as_bytes())
                .map_err(|_| SetupError::BadCredential { backend: name.clone() })?;
            Credential::Header(header, sensitive(secret.expose().to_owned())?)
        }
        (Auth::Bearer { .. } | Auth::Header { .. }, None) => {
            return Err(SetupError::BadCredential { backend: name.clone() });
        }
    })
}
