//! An HTTP endpoint's keys (`url`, `auth`, `tls`, `forward_headers`, models), shared
//! by every kind that calls one, and the `openai`, `anthropic` and `relay` backends
//! made of them. No forwarded header carries a credential or one the gateway writes;
//! a client certificate goes only over `https://`.

use std::collections::{BTreeMap, BTreeSet};

use super::super::raw::{RawAuth, RawAuthKind, RawBackendKind, RawIdentityHeaders, RawMetering, RawSecret, RawTls};
use super::super::values::base_url;
use super::super::*;
use super::{Checker, DEFAULT_SENSITIVE_HEADER, GATEWAY_HEADERS, RESERVED_HEADERS};
use crate::call::headers::CREDENTIALS;

impl Checker<'_> {
    /// `url` of an endpoint or grpc backend: parsed, scheme checked, trailing slash
    /// stripped. A gRPC URL is stored as http(s), the scheme gRPC runs over.
    pub(super) fn url(&mut self, path: &str, kind: RawBackendKind, url: Option<&str>) -> Option<String> {
        let url_path = format!("{path}.url");
        let url = self.required(&url_path, url, &format!("for {}", kind.a_backend()))?;
        let parsed = base_url(url).map_err(|m| self.error(&url_path, m)).ok()?;
        let scheme = match (parsed.scheme.as_str(), kind) {
            ("http" | "https", _) => parsed.scheme.clone(),
            ("grpc", RawBackendKind::Grpc) => "http".to_owned(),
            ("grpcs", RawBackendKind::Grpc) => "https".to_owned(),
            ("grpc" | "grpcs", _) => {
                self.error(url_path, "a gRPC upstream must be declared kind: grpc");
                return None;
            }
            (other, _) => {
                self.error(url_path, format!("scheme `{other}` is not supported: use http:// or https://"));
                return None;
            }
        };
        Some(parsed.with_scheme(&scheme))
    }

    pub(super) fn endpoint(&mut self, path: &str, kind: RawBackendKind, keys: EndpointKeys) -> Option<Endpoint> {
        let EndpointKeys { url, auth, tls, models, aliases, default_model, forward_headers } = keys;
        let url = self.url(path, kind, url.as_deref());
        let auth = self.auth(&format!("{path}.auth"), auth);
        let forward_headers = self.forward_headers(&format!("{path}.forward_headers"), forward_headers, auth.as_ref());
        let tls = self.client_tls(path, tls, url.as_deref())?;
        Some(Endpoint {
            url: url?,
            auth: auth?,
            tls,
            models: models.unwrap_or_default(),
            aliases: aliases.unwrap_or_default(),
            default_model,
            forward_headers: forward_headers?,
        })
    }

    /// The caller's headers a backend is sent: each a header name, listed once, and
    /// none that would carry a credential (the caller's key, a cookie, the backend's
    /// own auth header), frame or route the request (RFC 9110 §7.6.1, and the body's
    /// type), or say something only the gateway may say (its own `flexway-` headers,
    /// the trace context, the format's version, a WebSocket's handshake). The
    /// sensitivity and affinity headers are checked once `ai` is read.
    pub(super) fn forward_headers(
        &mut self,
        path: &str,
        raw: Option<Vec<String>>,
        auth: Option<&Auth>,
    ) -> Option<Vec<String>> {
        let mut names: Vec<String> = Vec::new();
        let mut valid = true;
        for (i, raw_name) in raw.unwrap_or_default().iter().enumerate() {
            let at = format!("{path}[{i}]");
            let Some(name) = self.header(&at, raw_name) else {
                valid = false;
                continue;
            };
            let own_auth = matches!(auth, Some(Auth::Header { name: own, .. }) if own.eq_ignore_ascii_case(&name));
            let refusal = if CREDENTIALS.contains(&name.as_str()) || own_auth {
                Some("carries a credential: a caller's secret never reaches a backend")
            } else if RESERVED_HEADERS.contains(&name.as_str()) || GATEWAY_HEADERS.contains(&name.as_str()) {
                Some("is written by the gateway itself (or holds for one hop only)")
            } else if name.starts_with("flexway-") || name.starts_with("sec-websocket-") {
                Some("is the gateway's own: it is never passed on")
            } else if names.contains(&name) {
                Some("is listed twice")
            } else {
                None
            };
            match refusal {
                Some(why) => {
                    self.error(at, format!("`{name}` {why}"));
                    valid = false;
                }
                None => names.push(name),
            }
        }
        valid.then_some(names)
    }

    pub(super) fn auth(&mut self, path: &str, raw: Option<RawAuth>) -> Option<Auth> {
        let Some(RawAuth { kind, secret, name, path: file }) = raw else {
            return Some(Auth::None);
        };
        let kind = self.required(&format!("{path}.type"), kind, "(none | bearer | header | token_file)")?;
        let here = format!("auth type {}", kind.name());
        let (needs_secret, needs_name, needs_path) = match kind {
            RawAuthKind::None => (false, false, false),
            RawAuthKind::Bearer => (true, false, false),
            RawAuthKind::Header => (true, true, false),
            RawAuthKind::TokenFile => (false, false, true),
        };
        self.refuse(path, "secret", secret.is_some() && !needs_secret, &here, "types bearer and header");
        self.refuse(path, "name", name.is_some() && !needs_name, &here, "type header");
        self.refuse(path, "path", file.is_some() && !needs_path, &here, "type token_file");

        let with = format!("(with auth type {})", kind.name());
        match kind {
            RawAuthKind::None => Some(Auth::None),
            RawAuthKind::Bearer => {
                let secret = self.required(&format!("{path}.secret"), secret, &with)?;
                Some(Auth::Bearer { secret: self.secret(&format!("{path}.secret"), &secret)? })
            }
            RawAuthKind::Header => {
                let name = self
                    .required(&format!("{path}.name"), name, &with)
                    .and_then(|n| self.sent_header(&format!("{path}.name"), &n));
                let secret = self
                    .required(&format!("{path}.secret"), secret, &with)
                    .and_then(|s| self.secret(&format!("{path}.secret"), &s));
                Some(Auth::Header { name: name?, secret: secret? })
            }
            // Not checked for existence: a projected token appears and rotates at run
            // time, and it is re-read at every call.
            RawAuthKind::TokenFile => self
                .non_empty(&format!("{path}.path"), file, "(the token file)")
                .map(|file| Auth::TokenFile { path: file.into() }),
        }
    }

    /// A client certificate and key (both, or no `tls`), and an optional CA: secret
    /// references to PEM text, resolvable now as every secret is (a warning under
    /// [`Secrets::Check`]). The PEM itself is parsed when the client is built.
    fn tls(&mut self, path: &str, raw: RawTls) -> Option<Tls> {
        let mut reference = |key: &str, value: Option<RawSecret>, required: &str| {
            let key_path = format!("{path}.{key}");
            let value = self.required(&key_path, value, required)?;
            self.secret(&key_path, &value)
        };
        let cert = reference("cert", raw.cert, "(the client certificate goes with its key)");
        let key = reference("key", raw.key, "(the client key goes with its certificate)");
        let ca = match raw.ca {
            Some(ca) => Some(reference("ca", Some(ca), "(a CA bundle)")?),
            None => None,
        };
        Some(Tls { cert: cert?, key: key?, ca })
    }

    /// A backend's `tls` (its client certificate), refused towards an `http://` url,
    /// where it would never be presented. `None` on an error; `Some(None)` without.
    pub(super) fn client_tls(&mut self, path: &str, tls: Option<RawTls>, url: Option<&str>) -> Option<Option<Tls>> {
        let Some(tls) = tls else { return Some(None) };
        let tls = self.tls(&format!("{path}.tls"), tls)?;
        if url.is_some_and(|url| url.starts_with("http://")) {
            self.error(
                format!("{path}.tls"),
                "a client certificate is presented over TLS only: this backend's url is http://, so it would \
                 never be sent; write https:// or remove `tls`",
            );
            return None;
        }
        Some(Some(tls))
    }

    /// An `openai`, `anthropic` or `relay` backend.
    pub(super) fn http_backend(
        &mut self,
        path: &str,
        name: &str,
        kind: RawBackendKind,
        endpoint: EndpointKeys,
        metering: Option<RawMetering>,
        identity_headers: Option<RawIdentityHeaders>,
    ) -> Option<BackendKind> {
        let endpoint = self.endpoint(path, kind, endpoint);
        match kind {
            RawBackendKind::Anthropic => endpoint.map(BackendKind::Anthropic),
            RawBackendKind::Relay => {
                let metering = match metering.unwrap_or(RawMetering::Local) {
                    RawMetering::Upstream => Metering::Upstream,
                    RawMetering::Local => {
                        self.warn(
                            path,
                            format!(
                                "relay {name} is metered locally (metering: local): if the \
                                 upstream Flexway meters too, its calls are counted twice; set \
                                 metering: upstream"
                            ),
                        );
                        Metering::Local
                    }
                };
                if let Some(url) = endpoint.as_ref().map(|e| &e.url).filter(|url| url.ends_with("/v1")) {
                    self.warn(
                        format!("{path}.url"),
                        format!(
                            "relay {name}: url is the other Flexway's base and the gateway appends /v1 \
                             ({url}/v1/chat/completions); leave /v1 out"
                        ),
                    );
                }
                let identity_headers = self.identity_headers(path, name, identity_headers);
                Some(BackendKind::Relay { endpoint: endpoint?, metering, identity_headers: identity_headers? })
            }
            _ => endpoint.map(BackendKind::OpenAi),
        }
    }

    /// The names a relay sends the caller's identity under. Left out, the names a
    /// receiving Flexway reads (`Flexway-Tenant`, `Flexway-Agent`, and the default
    /// `ai.sensitive_header`); declared, only the names given.
    fn identity_headers(&mut self, path: &str, name: &str, raw: Option<RawIdentityHeaders>) -> Option<IdentityHeaders> {
        let Some(raw) = raw else {
            return Some(IdentityHeaders {
                tenant: Some(TENANT_HEADER.to_owned()),
                agent: Some(AGENT_HEADER.to_owned()),
                sensitive: Some(DEFAULT_SENSITIVE_HEADER.to_ascii_lowercase()),
            });
        };
        let mut ok = true;
        let mut header = |key: &str, value: Option<String>| match value {
            None => None,
            Some(v) => {
                let parsed = self.sent_header(&format!("{path}.identity_headers.{key}"), &v);
                ok &= parsed.is_some();
                parsed
            }
        };
        let headers = IdentityHeaders {
            tenant: header("tenant", raw.tenant),
            agent: header("agent", raw.agent),
            sensitive: header("sensitive", raw.sensitive),
        };
        let names: Vec<&String> = [&headers.tenant, &headers.agent, &headers.sensitive].into_iter().flatten().collect();
        let distinct: BTreeSet<&String> = names.iter().copied().collect();
        if distinct.len() != names.len() {
            self.error(format!("{path}.identity_headers"), "tenant, agent and sensitive must be different headers");
            ok = false;
        }
        // The receiving Flexway reads fixed names: another one is sent for nothing.
        for (key, declared, read) in
            [("tenant", &headers.tenant, TENANT_HEADER), ("agent", &headers.agent, AGENT_HEADER)]
        {
            if declared.as_deref().is_some_and(|d| d != read) {
                self.warn(
                    format!("{path}.identity_headers.{key}"),
                    format!("relay {name} sends the {key} under a name a receiving Flexway does not read ({read})"),
                );
            }
        }
        ok.then_some(headers)
    }
}

/// The keys of an HTTP endpoint, taken together out of a raw backend.
pub(super) struct EndpointKeys {
    pub(super) url: Option<String>,
    pub(super) auth: Option<RawAuth>,
    pub(super) tls: Option<RawTls>,
    pub(super) models: Option<Vec<String>>,
    pub(super) aliases: Option<BTreeMap<String, String>>,
    pub(super) default_model: Option<String>,
    pub(super) forward_headers: Option<Vec<String>>,
}
