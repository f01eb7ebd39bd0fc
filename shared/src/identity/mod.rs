//! Identity: who is calling (SPEC §7).
//!
//! A key is hashed with SHA-256 the moment it arrives and compared in constant time
//! against every configured hash (no early exit, so the time taken says nothing about
//! which hash came close). The clear key goes nowhere else: not upstream, not to logs,
//! not to the audit.

use http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{AgentId, Config, Tenant, TenantId};

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
        let asked = headers.get(AGENT_HEADER).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty());
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

/// SHA-256 of a key as lower-case hex: the form the config holds.
pub fn key_sha256_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

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
}
