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
//!
//! A relay peer (SPEC §8: another Flexway, by a key marked `relay_peer: true`) calls
//! on behalf of its own callers: the tenant it names in `Flexway-Tenant` becomes the
//! call's, and `Flexway-Agent` then names one of that tenant's agents. Only such a key
//! is believed: from any other key `Flexway-Tenant` is ignored, so a caller can never
//! bill another tenant by sending a header.

pub mod jwt;

use http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::call::InvalidRequest;
use crate::config::{AgentId, Config, Rates, Tenant, TenantId};

pub use crate::call::IdentityError;

/// `AGENT_HEADER`: the request header in which a key without a bound agent may name
/// one of its tenant's agents. `TENANT_HEADER`: the one in which a relay peer names
/// the tenant it calls for.
pub use crate::config::{AGENT_HEADER, TENANT_HEADER};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: TenantId,
    pub agent: Option<AgentId>,
    /// SHA-256 of the key, hex: what the audit hashes further, never the key.
    pub key_sha256: [u8; 32],
    pub relay_peer: bool,
    /// The key's own per-minute limits (SPEC §14), inside its tenant's.
    pub key_limits: Rates,
}

struct KeyRecord {
    sha256: [u8; 32],
    tenant: TenantId,
    agent: Option<AgentId>,
    relay_peer: bool,
    limits: Rates,
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
                    limits: key.limits,
                });
            }
            ring.tenants.insert(tenant.name.clone(), tenant.agents.keys().cloned().collect());
        }
        ring
    }

    /// The SHA-256 of every configured key.
    pub fn digests(&self) -> impl Iterator<Item = &[u8; 32]> {
        self.keys.iter().map(|record| &record.sha256)
    }

    /// Identifies the caller from the request headers: the key's tenant and agent, or
    /// for a relay peer's key that sends `Flexway-Tenant`, the tenant it asserts (the
    /// key's own bound agent, which belongs to the peer's tenant, then does not apply).
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, IdentityError> {
        self.identify(bearer_key(headers), headers)
    }

    /// As [`Keys::authenticate`], for the Anthropic Messages door (SPEC §2.2): the key
    /// comes as `x-api-key`, as Anthropic's SDKs send it, or as a bearer token.
    pub fn authenticate_x_api_key(&self, headers: &HeaderMap) -> Result<Caller, IdentityError> {
        let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim).filter(|k| !k.is_empty());
        self.identify(x_api_key.or_else(|| bearer_key(headers)), headers)
    }

    fn identify(&self, key: Option<&str>, headers: &HeaderMap) -> Result<Caller, IdentityError> {
        let key = key.ok_or(IdentityError::MissingKey)?;
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let record = self.find(&digest).ok_or(IdentityError::UnknownKey)?;
        let asserted = if record.relay_peer { tenant_header(headers)? } else { None };
        let (tenant, bound) = match asserted {
            Some(asserted) => (self.declared_tenant(asserted)?, None),
            None => (record.tenant.clone(), record.agent.clone()),
        };
        let asked = agent_header(headers)?;
        let agent = match (bound, asked) {
            (Some(bound), Some(asked)) if bound.as_str() != asked => {
                return Err(IdentityError::AgentRebind { bound: bound.to_string(), asked: asked.to_owned() });
            }
            (Some(bound), _) => Some(bound),
            (None, Some(asked)) => Some(self.declared_agent(&tenant, asked)?),
            (None, None) => None,
        };
        Ok(Caller { tenant, agent, key_sha256: digest, relay_peer: record.relay_peer, key_limits: record.limits })
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

    fn declared_tenant(&self, asked: &str) -> Result<TenantId, IdentityError> {
        self.tenants
            .get_key_value(asked)
            .map(|(tenant, _)| tenant.clone())
            .ok_or_else(|| IdentityError::UnknownTenant { tenant: asked.to_owned() })
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
    one_name(headers, AGENT_HEADER).map_err(|unread| match unread {
        Unread::Unreadable => IdentityError::UnreadableAgent,
        Unread::Ambiguous { first, other } => IdentityError::AmbiguousAgent { first, other },
    })
}

/// The tenant a relay peer names in `Flexway-Tenant`, read as strictly as the agent:
/// an unreadable or ambiguous value is refused, never read as the peer's own tenant.
fn tenant_header(headers: &HeaderMap) -> Result<Option<&str>, IdentityError> {
    one_name(headers, TENANT_HEADER).map_err(|_| IdentityError::UnreadableTenant)
}

/// Why a header naming one thing could not be read.
enum Unread {
    Unreadable,
    Ambiguous { first: String, other: String },
}

/// The one name a header gives, if present: readable text, trimmed, the same value
/// however many times it repeats.
fn one_name<'h>(headers: &'h HeaderMap, header: &str) -> Result<Option<&'h str>, Unread> {
    let mut named: Option<&str> = None;
    for value in headers.get_all(header) {
        // Trimmed of HTTP's own whitespace only: Unicode's (U+0085...) is refused.
        let name = std::str::from_utf8(value.as_bytes())
            .map(str::trim_ascii)
            .ok()
            .filter(|a| !a.is_empty() && !a.chars().any(char::is_control))
            .ok_or(Unread::Unreadable)?;
        match named {
            Some(first) if first != name => {
                return Err(Unread::Ambiguous { first: first.to_owned(), other: name.to_owned() });
            }
            _ => named = Some(name),
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
                KeyEntry { sha256: hash("plain"), agent: None, relay_peer: false, limits: Default::default() },
                KeyEntry {
                    sha256: hash("bound"),
                    agent: Some(AgentId::new("bot")),
                    relay_peer: false,
                    limits: Default::default(),
                },
            ],
            budgets: Default::default(),
            limits: Default::default(),
            backend: None,
            agents,
            max_criticality: Default::default(),
            residency: None,
            cache_off: false,
            mcp: Default::default(),
        };
        let mut edge_agents = BTreeMap::new();
        edge_agents.insert(AgentId::new("relayer"), Agent::default());
        let edge = Tenant {
            name: TenantId::new("edge"),
            keys: vec![
                KeyEntry { sha256: hash("peer"), agent: None, relay_peer: true, limits: Default::default() },
                KeyEntry {
                    sha256: hash("bound-peer"),
                    agent: Some(AgentId::new("relayer")),
                    relay_peer: true,
                    limits: Default::default(),
                },
            ],
            budgets: Default::default(),
            limits: Default::default(),
            backend: None,
            agents: edge_agents,
            max_criticality: Default::default(),
            residency: None,
            cache_off: false,
            mcp: Default::default(),
        };
        KeyRing::from_tenants([&tenant, &edge])
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

    fn asserting(key: &str, tenant: &[u8], agent: Option<&str>) -> HeaderMap {
        let mut h = headers(Some(key), agent);
        h.insert(TENANT_HEADER, HeaderValue::from_bytes(tenant).unwrap());
        h
    }

    #[test]
    fn a_relay_peer_calls_for_the_declared_tenant_and_agent_it_asserts() {
        let caller = ring().authenticate(&asserting("peer", b"acme", Some("helper"))).unwrap();
        assert_eq!((caller.tenant.as_str(), caller.agent), ("acme", Some(AgentId::new("helper"))));
        assert!(caller.relay_peer);
        assert_eq!(hex::encode(caller.key_sha256), key_sha256_hex("peer"));
        let tenant_only = ring().authenticate(&asserting("peer", b" acme ", None)).unwrap();
        assert_eq!((tenant_only.tenant.as_str(), tenant_only.agent), ("acme", None));
    }

    #[test]
    fn a_relay_peer_asserting_an_undeclared_tenant_is_refused() {
        let got = ring().authenticate(&asserting("peer", b"initech", None));
        assert_eq!(got, Err(IdentityError::UnknownTenant { tenant: "initech".into() }));
        let got = ring().authenticate(&asserting("peer", b"Acme", None));
        assert_eq!(got, Err(IdentityError::UnknownTenant { tenant: "Acme".into() }));
    }

    #[test]
    fn a_relay_peer_asserts_only_agents_of_the_asserted_tenant() {
        // `relayer` is declared, but under the peer's own tenant.
        let got = ring().authenticate(&asserting("peer", b"acme", Some("relayer")));
        assert_eq!(got, Err(IdentityError::UnknownAgent { agent: "relayer".into() }));
        // A peer key bound to its own agent: the asserted tenant's call is not that agent's.
        let caller = ring().authenticate(&asserting("bound-peer", b"acme", None)).unwrap();
        assert_eq!((caller.tenant.as_str(), caller.agent), ("acme", None));
        let caller = ring().authenticate(&asserting("bound-peer", b"acme", Some("bot"))).unwrap();
        assert_eq!(caller.agent, Some(AgentId::new("bot")));
    }

    #[test]
    fn a_relay_peer_without_a_tenant_header_calls_as_its_own_tenant() {
        let caller = ring().authenticate(&headers(Some("peer"), Some("relayer"))).unwrap();
        assert_eq!((caller.tenant.as_str(), caller.agent), ("edge", Some(AgentId::new("relayer"))));
        let bound = ring().authenticate(&headers(Some("bound-peer"), None)).unwrap();
        assert_eq!((bound.tenant.as_str(), bound.agent), ("edge", Some(AgentId::new("relayer"))));
    }

    #[test]
    fn a_tenant_header_from_a_key_that_is_not_a_relay_peer_is_ignored() {
        let caller = ring().authenticate(&asserting("plain", b"edge", None)).unwrap();
        assert_eq!((caller.tenant.as_str(), caller.agent), ("acme", None));
        // Even a name that is declared nowhere, or unreadable: not read at all.
        for value in [&b"initech"[..], b"\xff", b""] {
            let caller = ring().authenticate(&asserting("bound", value, None)).unwrap();
            assert_eq!((caller.tenant.as_str(), caller.agent), ("acme", Some(AgentId::new("bot"))));
        }
    }

    #[test]
    fn a_relay_peer_tenant_header_must_be_readable_and_single_valued() {
        for value in [&b"\xff"[..], b"", b"  ", b"ac\tme"] {
            let got = ring().authenticate(&asserting("peer", value, None));
            assert_eq!(got, Err(IdentityError::UnreadableTenant), "{value:?}");
        }
        let mut twice = headers(Some("peer"), None);
        twice.append(TENANT_HEADER, HeaderValue::from_static("acme"));
        twice.append(TENANT_HEADER, HeaderValue::from_static("edge"));
        assert_eq!(ring().authenticate(&twice), Err(IdentityError::UnreadableTenant));
        twice.remove(TENANT_HEADER);
        twice.append(TENANT_HEADER, HeaderValue::from_static("acme"));
        twice.append(TENANT_HEADER, HeaderValue::from_static("acme"));
        assert_eq!(ring().authenticate(&twice).unwrap().tenant.as_str(), "acme");
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
