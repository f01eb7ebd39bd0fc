//! The `Mcp-Session-Id` the gateway hands out is the session itself, sealed: the
//! caller's tenant and agent, the protocol version and the upstream servers' session
//! ids, under AES-256-GCM with a key every process of one configuration derives alike.
//! So any process of a fleet, any Lambda instance, serves any session, and nothing is
//! stored. A tampered, foreign or malformed id opens to nothing (the door answers 404).

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf::{HKDF_SHA256, Salt};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};

/// What the HKDF expansion is bound to: a key for anything else never opens a session.
const INFO: &[u8] = b"flexway mcp session v1";

/// Session ids the door accepts are at most this long: a client cannot make the
/// gateway decode and decrypt an arbitrary amount of data.
const MAX_ID: usize = 16 * 1024;

/// How long a session id opens. Sealed and stored nowhere, an id cannot be withdrawn
/// from every process of a fleet: its age is what bounds the use of one that leaked.
/// A day outlasts an agent's working session; past it the door answers 404 and the
/// client, as the protocol has it, initializes a new session.
pub const MAX_AGE: Duration = Duration::from_secs(24 * 60 * 60);

/// One MCP session, as its id carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    pub tenant: String,
    pub agent: Option<String>,
    /// The protocol version negotiated at `initialize`.
    pub version: String,
    /// Each upstream server's own session id, by server name.
    pub upstream: BTreeMap<String, String>,
    /// When it was issued (Unix seconds).
    pub issued_at: u64,
}

impl Session {
    /// Issued [`MAX_AGE`] or longer before `now` (Unix seconds). An id issued "after"
    /// `now` (another process's clock ahead of this one's) is not expired.
    pub fn expired(&self, now: u64) -> bool {
        now.saturating_sub(self.issued_at) >= MAX_AGE.as_secs()
    }
}

/// The key sessions are sealed with.
pub struct SessionKey {
    /// `None` only were HKDF to fail for a 32-byte output, which it never does.
    key: Option<LessSafeKey>,
    random: SystemRandom,
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    /// The key derived from `secret` (the resolved `mcp.session_key`, or the audit's
    /// hash salt): HKDF-SHA256, info `flexway mcp session v1`.
    pub fn derive(secret: &[u8]) -> SessionKey {
        let prk = Salt::new(HKDF_SHA256, &[]).extract(secret);
        let key = prk.expand(&[INFO], &AES_256_GCM).ok().map(|okm| LessSafeKey::new(UnboundKey::from(okm)));
        SessionKey { key, random: SystemRandom::new() }
    }

    /// `session` sealed: URL-safe Base64 without padding of nonce ‖ ciphertext ‖ tag,
    /// visible ASCII as the MCP spec requires of a session id. Empty only if the
    /// system's random source failed (never with a repeated nonce).
    pub fn seal(&self, session: &Session) -> String {
        self.try_seal(session).unwrap_or_default()
    }

    fn try_seal(&self, session: &Session) -> Option<String> {
        let key = self.key.as_ref()?;
        let mut nonce = [0u8; NONCE_LEN];
        self.random.fill(&mut nonce).ok()?;
        let mut buffer = serde_json::to_vec(session).ok()?;
        key.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut buffer).ok()?;
        let mut sealed = Vec::with_capacity(NONCE_LEN + buffer.len());
        sealed.extend_from_slice(&nonce);
        sealed.extend_from_slice(&buffer);
        Some(URL_SAFE_NO_PAD.encode(sealed))
    }

    /// The session `id` seals, if this key sealed it and it was not altered.
    pub fn open(&self, id: &str) -> Option<Session> {
        if id.len() > MAX_ID {
            return None;
        }
        let key = self.key.as_ref()?;
        let bytes = URL_SAFE_NO_PAD.decode(id).ok()?;
        if bytes.len() < NONCE_LEN {
            return None;
        }
        let (nonce, cipher) = bytes.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buffer = cipher.to_vec();
        let plain = key.open_in_place(nonce, Aad::empty(), &mut buffer).ok()?;
        serde_json::from_slice(plain).ok()
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine;

    use super::*;

    fn session() -> Session {
        Session {
            tenant: "acme".into(),
            agent: Some("bot".into()),
            version: "2025-11-25".into(),
            upstream: [("search".to_owned(), "up-1".to_owned()), ("files".to_owned(), "f/2=".to_owned())].into(),
            issued_at: 1_780_000_000,
        }
    }

    #[test]
    fn a_sealed_session_opens_to_itself() {
        let key = SessionKey::derive(b"a secret of the configuration");
        let id = key.seal(&session());
        assert_eq!(key.open(&id), Some(session()));
        let no_agent = Session { agent: None, upstream: BTreeMap::new(), ..session() };
        assert_eq!(key.open(&key.seal(&no_agent)), Some(no_agent));
    }

    #[test]
    fn a_session_expires_a_day_after_it_was_issued() {
        let issued = session().issued_at;
        assert!(!session().expired(issued));
        assert!(!session().expired(issued + MAX_AGE.as_secs() - 1));
        assert!(session().expired(issued + MAX_AGE.as_secs()));
        assert!(!session().expired(issued - 60), "a clock behind the issuer's");
    }

    #[test]
    fn two_processes_deriving_from_one_secret_share_sessions() {
        let id = SessionKey::derive(b"shared").seal(&session());
        assert_eq!(SessionKey::derive(b"shared").open(&id), Some(session()));
    }

    #[test]
    fn the_id_is_visible_ascii_and_different_each_time() {
        let key = SessionKey::derive(b"k");
        let a = key.seal(&session());
        let b = key.seal(&session());
        assert_ne!(a, b, "a fresh nonce each time");
        for id in [&a, &b] {
            assert!(!id.is_empty());
            assert!(id.bytes().all(|c| (0x21..=0x7e).contains(&c)), "{id}");
            assert!(http::HeaderValue::from_str(id).is_ok());
        }
    }

    #[test]
    fn a_flipped_byte_opens_to_nothing() {
        let key = SessionKey::derive(b"k");
        let raw = URL_SAFE_NO_PAD.decode(key.seal(&session())).unwrap_or_default();
        assert!(raw.len() > NONCE_LEN + 16);
        for at in [0, NONCE_LEN, raw.len() / 2, raw.len() - 1] {
            let mut tampered = raw.clone();
            tampered[at] ^= 0x01;
            assert_eq!(key.open(&URL_SAFE_NO_PAD.encode(&tampered)), None, "byte {at}");
        }
    }

    #[test]
    fn another_key_opens_to_nothing() {
        let id = SessionKey::derive(b"one").seal(&session());
        assert_eq!(SessionKey::derive(b"two").open(&id), None);
    }

    #[test]
    fn a_malformed_id_opens_to_nothing() {
        let key = SessionKey::derive(b"k");
        let id = key.seal(&session());
        for bad in ["", "not base64!", "AAAA", &id[..id.len() - 1], &format!("{id}A"), &"A".repeat(MAX_ID + 1)] {
            assert_eq!(key.open(bad), None, "{bad:.40}");
        }
        // Sealed by this key, but not a session.
        let mut nonce = [7u8; NONCE_LEN];
        nonce[0] = 1;
        let mut buffer = b"{\"tenant\": 1}".to_vec();
        let sealer = key.key.as_ref().map(|k| {
            k.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut buffer).is_ok()
        });
        assert_eq!(sealer, Some(true));
        let forged = URL_SAFE_NO_PAD.encode([&nonce[..], &buffer[..]].concat());
        assert_eq!(key.open(&forged), None);
    }
}
