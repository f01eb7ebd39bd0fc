//! Identity: who is calling (SPEC §7).
//!
//! A key is hashed with SHA-256 the moment it arrives and compared in constant time
//! against every configured hash (no early exit, so the time taken says nothing about
//! which hash came close). The clear key goes nowhere else: not upstream, not to logs,
//! not to the audit.
//!
//! The headers that choose an agent or narrow routing are read strictly: a value the
//! gateway cannot read is refused, never taken as absent or as `false`, because a
//! reading that guesses could widen what a caller reaches (another agent's budget,
//! an external backend for a sensitive prompt).

use http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{AgentId, Config, Tenant, TenantId};
use crate::protocol::openai::InvalidRequest;

/// The request header in which a key without a bound agent may name one of its
/// tenant's agents.
pub const AGENT_HEADER: &str = "flexway-agent";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: TenantId,
    pub agent: Option<AgentId>,
    /// SHA-256 of the key, hex: what the audit hashes further, never the key.
    pub key_sha256: [u8; 32],
    pub relay_peer: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error("missing API key: send `Authorization: Bearer <key>`")]
    MissingKey,
    #[error("invalid API key")]
    UnknownKey,
    #[error("agent `{agent}` is not declared for this tenant")]
    UnknownAgent { agent: String },
    #[error("this key is bound to agent `{bound}`; the Flexway-Agent header cannot re-bind it to `{asked}`")]
    AgentRebind { bound: String, asked: String },
    #[error("the Flexway-Agent header must name an agent in readable text (UTF-8, no control characters)")]
    UnreadableAgent,
    #[error("the Flexway-Agent header appears more than once with different values (`{first}`, `{other}`)")]
    AmbiguousAgent { first: String, other: String },
}

struct KeyRecord {
    sha256: [u8; 32],
    tenant: TenantId,
    agent: Option<AgentId>,
    relay_peer: bool,
}

/// Every configured key hash with what it identifies.
pub struct KeyRing {
    keys: Vec<KeyRecord>,
    tenants: std::collections::BTreeMap<TenantId, Vec<AgentId>>,
}

impl KeyRing {
    pub fn new(config: &Config) -> Self {
        Self::from_tenants(config.tenants.values())
    }

    pub fn from_tenants<'a>(tenants: impl IntoIterator<Item = &'a Tenant>) -> Self {
        let mut ring = KeyRing { keys: Vec::new(), tenants: Default::default() };
        for tenant in tenants {
            for key in &tenant.keys {
                ring.keys.push(KeyRecord {
                    sha256: key.sha256,
                    tenant: tenant.name.clone(),
                    agent: key.agent.clone(),
                    relay_peer: key.relay_peer,
                });
            }
            ring.tenants.insert(tenant.name.clone(), tenant.agents.keys().cloned().collect());
        }
        ring
    }

    /// Identifies the caller from the request headers.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, IdentityError> {
        let key = bearer_key(headers).ok_or(IdentityError::MissingKey)?;
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let record = self.find(&digest).ok_or(IdentityError::UnknownKey)?;
        let asked = agent_header(headers)?;
        let agent = match (&record.agent, asked) {
            (Some(bound), Some(asked)) if bound.as_str() != asked => {
                return Err(IdentityError::AgentRebind { bound: bound.to_string(), asked: asked.to_owned() });
            }
            (Some(bound), _) => Some(bound.clone()),
            (None, Some(asked)) => Some(self.declared_agent(&record.tenant, asked)?),
            (None, None) => None,
        };
        Ok(Caller { tenant: record.tenant.clone(), agent, key_sha256: digest, relay_peer: record.relay_peer })
    }

    fn find(&self, digest: &[u8; 32]) -> Option<&KeyRecord> {
        let mut found = None;
        for record in &self.keys {
            if bool::from(record.sha256.ct_eq(digest)) {
                found = Some(record);
            }
        }
        found
    }

    fn declared_agent(&self, tenant: &TenantId, asked: &str) -> Result<AgentId, IdentityError> {
        self.tenants
            .get(tenant)
            .and_then(|agents| agents.iter().find(|a| a.as_str() == asked))
            .cloned()
            .ok_or_else(|| IdentityError::UnknownAgent { agent: asked.to_owned() })
    }
}

fn bearer_key(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = value.split_once(' ')?;
    let key = key.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
}

/// The agent named by the `Flexway-Agent` header, if the header is present.
///
/// Readable text means valid UTF-8 with no control character (so an agent declared
/// with a non-ASCII name can be named), trimmed, not empty. The header may repeat
/// (a proxy may copy it) but only with one value: different values are ambiguous.
/// Both are refused rather than read as "no agent", which would bill the call to
/// the tenant outside the agent's budgets.
pub fn agent_header(headers: &HeaderMap) -> Result<Option<&str>, IdentityError> {
    let mut named: Option<&str> = None;
    for value in headers.get_all(AGENT_HEADER) {
        // Trimmed of HTTP's own whitespace only: Unicode's (U+0085...) is refused.
        let agent = std::str::from_utf8(value.as_bytes())
            .map(str::trim_ascii)
            .ok()
            .filter(|a| !a.is_empty() && !a.chars().any(char::is_control))
            .ok_or(IdentityError::UnreadableAgent)?;
        match named {
            Some(first) if first != agent => {
                return Err(IdentityError::AmbiguousAgent { first: first.to_owned(), other: agent.to_owned() });
            }
            _ => named = Some(agent),
        }
    }
    Ok(named)
}

/// The sensitivity header (`ai.sensitive_header`, SPEC §4.4): whether the request
/// must stay on internal backends.
///
/// The header can only narrow routing. Each value, and each comma-separated item of a
/// value (a proxy may fold repeated headers into one), must be `true`/`false`,
/// `1`/`0` or `yes`/`no` (ASCII, any case, trimmed); any true item makes the request
/// sensitive. Anything else is refused — an empty item, a non-ASCII or non-UTF-8
/// byte included — because reading it as `false` could send a sensitive prompt to an
/// external backend. An empty item is refused even inside a list (`false,`), where
/// RFC 9110 would skip it, so that a folded header reads as its unfolded copies do.
pub fn sensitivity(headers: &HeaderMap, name: &str) -> Result<bool, InvalidRequest> {
    let mut sensitive = false;
    for value in headers.get_all(name) {
        for item in value.as_bytes().split(|&b| b == b',') {
            match flag(item) {
                Some(on) => sensitive |= on,
                None => {
                    return Err(InvalidRequest {
                        message: format!(
                            "the {name} header must be true, false, 1, 0, yes or no (every value when repeated)"
                        ),
                        param: None,
                    });
                }
            }
        }
    }
    Ok(sensitive)
}

fn flag(item: &[u8]) -> Option<bool> {
    let item = item.trim_ascii();
    let is = |word: &str| item.eq_ignore_ascii_case(word.as_bytes());
    if is("true") || is("1") || is("yes") {
        Some(true)
    } else if is("false") || is("0") || is("no") {
        Some(false)
    } else {
        None
    }
}

/// SHA-256 of a key as lower-case hex: the form the config holds.
pub fn key_sha256_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use http::HeaderValue;

    use super::*;
    use crate::config::{Agent, KeyEntry};

    fn ring() -> KeyRing {
        let hash = |k: &str| -> [u8; 32] { Sha256::digest(k.as_bytes()).into() };
        let mut agents = BTreeMap::new();
        agents.insert(AgentId::new("bot"), Agent::default());
        agents.insert(AgentId::new("helper"), Agent::default());
        let tenant = Tenant {
            name: TenantId::new("acme"),
            keys: vec![
                KeyEntry { sha256: hash("plain"), agent: None, relay_peer: false },
                KeyEntry { sha256: hash("bound"), agent: Some(AgentId::new("bot")), relay_peer: false },
            ],
            budgets: Default::default(),
            backend: None,
            agents,
        };
        KeyRing::from_tenants([&tenant])
    }

    fn headers(key: Option<&str>, agent: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(k) = key {
            h.insert("authorization", HeaderValue::from_str(&format!("Bearer {k}")).unwrap());
        }
        if let Some(a) = agent {
            h.insert(AGENT_HEADER, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[test]
    fn identifies_tenant_by_key_hash() {
        let caller = ring().authenticate(&headers(Some("plain"), None)).unwrap();
        assert_eq!(caller.tenant.as_str(), "acme");
        assert_eq!(caller.agent, None);
        assert_eq!(hex::encode(caller.key_sha256), key_sha256_hex("plain"));
    }

    #[test]
    fn refuses_missing_and_unknown_keys() {
        assert_eq!(ring().authenticate(&headers(None, None)), Err(IdentityError::MissingKey));
        assert_eq!(ring().authenticate(&headers(Some("nope"), None)), Err(IdentityError::UnknownKey));
        let mut basic = HeaderMap::new();
        basic.insert("authorization", HeaderValue::from_static("Basic cGxhaW4="));
        assert_eq!(ring().authenticate(&basic), Err(IdentityError::MissingKey));
    }

    #[test]
    fn header_names_a_declared_agent_for_an_unbound_key() {
        let caller = ring().authenticate(&headers(Some("plain"), Some("helper"))).unwrap();
        assert_eq!(caller.agent, Some(AgentId::new("helper")));
    }

    #[test]
    fn refuses_an_undeclared_agent() {
        let got = ring().authenticate(&headers(Some("plain"), Some("ghost")));
        assert_eq!(got, Err(IdentityError::UnknownAgent { agent: "ghost".into() }));
    }

    #[test]
    fn bound_key_keeps_its_agent_and_cannot_be_rebound() {
        let caller = ring().authenticate(&headers(Some("bound"), None)).unwrap();
        assert_eq!(caller.agent, Some(AgentId::new("bot")));
        let same = ring().authenticate(&headers(Some("bound"), Some("bot"))).unwrap();
        assert_eq!(same.agent, Some(AgentId::new("bot")));
        let rebind = ring().authenticate(&headers(Some("bound"), Some("helper")));
        assert!(matches!(rebind, Err(IdentityError::AgentRebind { .. })));
    }

    /// Headers with `name` set to each of `values`, in order (raw bytes).
    fn repeated(name: &'static str, values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(name, HeaderValue::from_bytes(v).unwrap());
        }
        h
    }

    fn with_key(mut h: HeaderMap, key: &str) -> HeaderMap {
        h.insert("authorization", HeaderValue::from_str(&format!("Bearer {key}")).unwrap());
        h
    }

    #[test]
    fn refuses_an_agent_header_that_is_not_readable_text() {
        for value in [&b"\xff\xfe"[..], b"bot\x80", b"", b"   ", b"a\tb", "\u{85}bot".as_bytes()] {
            let h = with_key(repeated(AGENT_HEADER, &[value]), "plain");
            assert_eq!(ring().authenticate(&h), Err(IdentityError::UnreadableAgent), "{value:?}");
            // A bound key does not make an unreadable header acceptable.
            let h = with_key(repeated(AGENT_HEADER, &[value]), "bound");
            assert_eq!(ring().authenticate(&h), Err(IdentityError::UnreadableAgent), "{value:?}");
        }
    }

    #[test]
    fn reads_a_utf8_agent_name_trimmed() {
        assert_eq!(agent_header(&repeated(AGENT_HEADER, &[b" helper "])), Ok(Some("helper")));
        assert_eq!(agent_header(&repeated(AGENT_HEADER, &["équipe".as_bytes()])), Ok(Some("équipe")));
        assert_eq!(agent_header(&HeaderMap::new()), Ok(None));
    }

    #[test]
    fn refuses_an_agent_header_repeated_with_different_values() {
        let h = with_key(repeated(AGENT_HEADER, &[b"helper", b"bot"]), "plain");
        let got = ring().authenticate(&h);
        assert_eq!(got, Err(IdentityError::AmbiguousAgent { first: "helper".into(), other: "bot".into() }));
        let h = with_key(repeated(AGENT_HEADER, &[b"bot", b"helper"]), "bound");
        assert!(matches!(ring().authenticate(&h), Err(IdentityError::AmbiguousAgent { .. })));
        // The same value twice (a proxy copying the header) names one agent.
        let h = with_key(repeated(AGENT_HEADER, &[b"helper", b" helper"]), "plain");
        assert_eq!(ring().authenticate(&h).unwrap().agent, Some(AgentId::new("helper")));
    }

    const SENSITIVE: &str = "flexway-sensitive";

    fn sensitivity_of(values: &[&[u8]]) -> Result<bool, InvalidRequest> {
        sensitivity(&repeated(SENSITIVE, values), SENSITIVE)
    }

    #[test]
    fn sensitivity_reads_the_six_words_in_any_case() {
        assert_eq!(sensitivity_of(&[]), Ok(false));
        for on in ["true", "TRUE", "True", "1", "yes", "YeS", " true ", "\ttrue"] {
            assert_eq!(sensitivity_of(&[on.as_bytes()]), Ok(true), "{on:?}");
        }
        for off in ["false", "FALSE", "0", "no", "No", " no "] {
            assert_eq!(sensitivity_of(&[off.as_bytes()]), Ok(false), "{off:?}");
        }
    }

    #[test]
    fn sensitivity_any_true_value_wins_when_repeated_or_folded() {
        assert_eq!(sensitivity_of(&[b"false", b"true"]), Ok(true));
        assert_eq!(sensitivity_of(&[b"true", b"false"]), Ok(true));
        assert_eq!(sensitivity_of(&[b"0", b"no", b"1"]), Ok(true));
        assert_eq!(sensitivity_of(&[b"false, true"]), Ok(true));
        assert_eq!(sensitivity_of(&[b"no,0 , false"]), Ok(false));
    }

    #[test]
    fn sensitivity_refuses_anything_else_never_reading_it_as_false() {
        let refused: [&[u8]; 13] = [
            b"",
            b"  ",
            b"perhaps",
            b"on",
            b"t",
            b"truee",
            b"2",
            b"\xff",
            "trúe".as_bytes(),
            "ｔｒｕｅ".as_bytes(),
            b"false,",
            b",true",
            b"false, maybe",
        ];
        for value in refused {
            let err = sensitivity_of(&[value]).unwrap_err();
            assert!(err.message.contains(SENSITIVE), "{}", err.message);
            assert_eq!(err.param, None);
        }
        // One bad copy among good ones is refused too.
        assert!(sensitivity_of(&[b"true", b"perhaps"]).is_err());
        assert!(sensitivity_of(&[b"false", b""]).is_err());
    }
}
