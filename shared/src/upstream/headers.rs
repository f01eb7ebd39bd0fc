//! What goes upstream with a call besides its body and credential: to a relay, who
//! the call is for, under the names its `identity_headers` declares and only those;
//! and the caller's headers a backend names in `forward_headers`, and no others (the
//! config refuses a credential there, so the caller's key never reaches a backend).

use http::{HeaderName, HeaderValue};

use super::{CallError, SetupError};
use crate::config::{AgentId, BackendId, IdentityHeaders, TenantId};

/// Who a call is for, as a relay passes it on: the caller's tenant and agent, and
/// whether the request is sensitive (`ai.sensitive_header`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallerIdentity {
    pub tenant: TenantId,
    pub agent: Option<AgentId>,
    pub sensitive: bool,
    /// The caller's headers that some backend forwards ([`Upstreams::forwardable`]);
    /// each backend is sent those it names. Empty when no backend forwards any.
    pub forwarded: Vec<(HeaderName, HeaderValue)>,
}

/// A relay's `identity_headers`, as header names; one left out is not sent.
pub(super) struct RelayHeaders {
    tenant: Option<HeaderName>,
    agent: Option<HeaderName>,
    sensitive: Option<HeaderName>,
}

impl RelayHeaders {
    pub(super) fn new(name: &BackendId, declared: &IdentityHeaders) -> Result<Self, SetupError> {
        let parse = |header: &Option<String>| {
            header
                .as_deref()
                .map(|h| HeaderName::from_bytes(h.as_bytes()))
                .transpose()
                .map_err(|_| SetupError::BadIdentityHeader { backend: name.clone() })
        };
        Ok(RelayHeaders {
            tenant: parse(&declared.tenant)?,
            agent: parse(&declared.agent)?,
            sensitive: parse(&declared.sensitive)?,
        })
    }

    /// The headers that say who the call is for. A name that cannot be a header value
    /// fails the call: sent without it, the call would be billed to the relay's own
    /// tenant at the other end.
    pub(super) fn values(&self, caller: &CallerIdentity) -> Result<Vec<(HeaderName, HeaderValue)>, CallError> {
        let value = |what: &str, text: &str| {
            HeaderValue::from_str(text)
                .map_err(|_| CallError::Credential(format!("the {what} `{text}` cannot be sent in a header")))
        };
        let sensitive = HeaderValue::from_static(if caller.sensitive { "true" } else { "false" });
        let mut headers = Vec::new();
        if let Some(name) = &self.tenant {
            headers.push((name.clone(), value("tenant", caller.tenant.as_str())?));
        }
        if let (Some(name), Some(agent)) = (&self.agent, &caller.agent) {
            headers.push((name.clone(), value("agent", agent.as_str())?));
        }
        if let Some(name) = &self.sensitive {
            headers.push((name.clone(), sensitive));
        }
        Ok(headers)
    }
}

/// An upstream call's headers, in the order they are written: a few, so a list. A
/// `HeaderMap`, built and dropped only for `h1::request` to write it out, was ~900
/// instructions a call; one is made only for HTTP/2.
#[derive(Clone)]
pub(super) struct Outgoing(pub(super) Vec<(HeaderName, HeaderValue)>);

impl Outgoing {
    /// Sets `name` to `value`, replacing any value it had (as `HeaderMap::insert`).
    pub(super) fn insert(&mut self, name: HeaderName, value: HeaderValue) {
        self.0.retain(|(held, _)| *held != name);
        self.0.push((name, value));
    }

    pub(super) fn into_map(self) -> http::HeaderMap {
        let mut map = http::HeaderMap::with_capacity(self.0.len());
        for (name, value) in self.0 {
            map.append(name, value);
        }
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outgoing_headers_are_set_as_a_header_map_sets_them() {
        let value = HeaderValue::from_static;
        let mut headers = Outgoing(Vec::new());
        headers.insert(http::header::USER_AGENT, value("flexway"));
        headers.insert(http::header::ACCEPT, value("*/*"));
        headers.0.push((HeaderName::from_static("anthropic-beta"), value("a")));
        headers.0.push((HeaderName::from_static("anthropic-beta"), value("b")));
        // A later value of a name set before replaces it (a credential, an identity
        // header), as `HeaderMap::insert` does; repeated forwarded values stay.
        headers.insert(http::header::USER_AGENT, value("relay"));
        let names: Vec<(&str, &[u8])> = headers.0.iter().map(|(n, v)| (n.as_str(), v.as_bytes())).collect();
        assert_eq!(
            names,
            [("accept", &b"*/*"[..]), ("anthropic-beta", b"a"), ("anthropic-beta", b"b"), ("user-agent", b"relay")]
        );
        let map = headers.into_map();
        assert_eq!(map.get_all("anthropic-beta").iter().count(), 2);
        assert_eq!(map["user-agent"], "relay");
    }
}
