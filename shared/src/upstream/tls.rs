//! TLS towards the backends: rustls on the `ring` provider, over the webpki roots or a
//! backend's own `tls.ca`, with its client certificate and key (mTLS); and what a
//! failed handshake means for an operator. An error names a PEM's reference and what
//! is wrong with it, never the PEM (the key is a secret).

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::SetupError;
use crate::config::{BackendId, SecretRef, Tls};
use crate::secret::{Resolved, Secret, SecretError};

#[derive(Clone, PartialEq, Eq)]
pub(super) struct TlsMaterial {
    cert: Secret,
    key: Secret,
    ca: Option<Secret>,
}

/// A backend's TLS material, taken from those resolved.
pub(super) fn tls_material(name: &BackendId, tls: &Tls, secrets: &Resolved) -> Result<TlsMaterial, SetupError> {
    let get = |key: &str, reference: &SecretRef| {
        secrets.get(reference).cloned().ok_or_else(|| SetupError::Secret {
            path: format!("ai.backends.{name}.{key}"),
            source: SecretError::Unavailable { reference: reference.to_string(), detail: "not resolved".into() },
        })
    };
    Ok(TlsMaterial {
        cert: get("tls.cert", &tls.cert)?,
        key: get("tls.key", &tls.key)?,
        ca: tls.ca.as_ref().map(|ca| get("tls.ca", ca)).transpose()?,
    })
}

/// The roots a backend's certificate is checked against without a `tls.ca`.
pub(super) fn public_roots() -> rustls::RootCertStore {
    rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() }
}

/// rustls on the `ring` provider, with a client certificate when `identity` is given.
pub(super) fn tls_config(
    roots: rustls::RootCertStore,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<rustls::ClientConfig, rustls::Error> {
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    match identity {
        Some((certs, key)) => builder.with_client_auth_cert(certs, key),
        None => Ok(builder.with_no_client_auth()),
    }
}

/// The TLS configuration of a backend's `tls` (mTLS): its client certificate and key,
/// and its CA bundle in place of the system roots. Errors name the reference and what
/// is wrong with its PEM, never the PEM (the key is a secret).
pub(super) fn client_tls(name: &BackendId, tls: &Tls, pem: &TlsMaterial) -> Result<rustls::ClientConfig, SetupError> {
    let err = |detail: String| SetupError::Tls { backend: name.clone(), detail };
    // Both read apart first, so that an error says which one is wrong.
    if !pem_holds(pem.cert.expose(), &["CERTIFICATE"]) {
        return Err(err(format!("tls.cert ({}) holds no PEM certificate", tls.cert)));
    }
    if !pem_holds(pem.key.expose(), &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"]) {
        return Err(err(format!("tls.key ({}) holds no PEM private key", tls.key)));
    }
    let pair = |detail: String| err(format!("tls.cert and tls.key ({}, {}): {detail}", tls.cert, tls.key));
    let certs = CertificateDer::pem_slice_iter(pem.cert.expose().as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pair(e.to_string()))?;
    let key = PrivateKeyDer::from_pem_slice(pem.key.expose().as_bytes()).map_err(|e| pair(e.to_string()))?;
    let roots = match (&tls.ca, &pem.ca) {
        (Some(reference), Some(ca)) => {
            let bundle = CertificateDer::pem_slice_iter(ca.expose().as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| err(format!("tls.ca ({reference}): {e}")))?;
            let mut roots = rustls::RootCertStore::empty();
            let (added, _) = roots.add_parsable_certificates(bundle);
            if added == 0 {
                return Err(err(format!("tls.ca ({reference}) holds no PEM certificate")));
            }
            roots
        }
        _ => public_roots(),
    };
    tls_config(roots, Some((certs, key))).map_err(|e| pair(e.to_string()))
}

/// Whether `pem` has a block of one of these labels (`-----BEGIN <label>-----`).
fn pem_holds(pem: &str, labels: &[&str]) -> bool {
    labels.iter().any(|label| pem.contains(&format!("-----BEGIN {label}-----")))
}

/// rustls's words, and where to look: the CA that should sign the backend's
/// certificate, or the client certificate the backend refused.
pub(super) fn tls_failure(error: &rustls::Error) -> String {
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
