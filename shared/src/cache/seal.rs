//! An entry at rest: AES-256-GCM under a key per tenant, derived from `ai.cache.key`
//! with HKDF-SHA256 (SPEC §16). The partition and the exact hash are the associated
//! data, so an entry copied into another tenant's or partition's row does not open.
//! A random 96-bit nonce per entry (safe far past any tenant's entry count).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf::{HKDF_SHA256, Prk, Salt};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use super::{Partition, Probe};

/// An entry's bytes as a store keeps them: nonce, ciphertext and tag.
#[derive(Clone, PartialEq, Eq)]
pub struct Sealed(pub Vec<u8>);

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sealed({} bytes)", self.0.len())
    }
}

/// The tenants' entry keys, derived once each from the master key.
pub struct Keys {
    /// HKDF-Extract of the master key (`ai.cache.key`).
    prk: Prk,
    /// The key the hashes a store keeps in clear are blinded with ([`Keys::blind`]).
    blinding: hmac::Key,
    derived: Mutex<HashMap<String, Arc<LessSafeKey>>>,
    random: SystemRandom,
}

impl Keys {
    /// Keys derived from `master` (the resolved `ai.cache.key`).
    pub fn new(master: &[u8]) -> Keys {
        let prk = Salt::new(HKDF_SHA256, b"flexway response cache v1").extract(master);
        let blinding = match prk.expand(&[b"blinding"], hmac::HMAC_SHA256) {
            Ok(okm) => hmac::Key::from(okm),
            // `expand` fails only for an output longer than 255 hashes: never here.
            Err(_) => hmac::Key::new(hmac::HMAC_SHA256, master),
        };
        Keys { prk, blinding, derived: Mutex::default(), random: SystemRandom::new() }
    }

    /// `hash` blinded: HMAC-SHA256 under a key derived from the master key. A store
    /// keeps only blinded hashes (partitions, messages, guards), so a short or common
    /// prompt cannot be confirmed by hashing guesses without the key.
    pub fn blind(&self, hash: &[u8]) -> [u8; 32] {
        let tag = hmac::sign(&self.blinding, hash);
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// `tenant`'s key: HKDF-Expand of the master key with the tenant's name.
    fn key(&self, tenant: &str) -> Option<Arc<LessSafeKey>> {
        let mut derived = self.derived.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(key) = derived.get(tenant) {
            return Some(key.clone());
        }
        // `expand` fails only for an output longer than 255 hashes, never for 32 bytes.
        let info = [b"tenant:", tenant.as_bytes()];
        let okm = self.prk.expand(&info, &AES_256_GCM).ok()?;
        let key = Arc::new(LessSafeKey::new(UnboundKey::from(okm)));
        derived.insert(tenant.to_owned(), key.clone());
        Some(key)
    }

    /// `plain` sealed for `partition`'s tenant, bound to the partition and the probe's
    /// exact hash.
    pub fn seal(&self, partition: &Partition, probe: &Probe, plain: &[u8]) -> Option<Sealed> {
        let mut nonce = [0u8; NONCE_LEN];
        self.random.fill(&mut nonce).ok()?;
        let mut buffer = plain.to_vec();
        let aad = aad(partition, &probe.exact);
        let key = self.key(&partition.tenant)?;
        key.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(&aad[..]), &mut buffer).ok()?;
        let mut sealed = Vec::with_capacity(NONCE_LEN + buffer.len());
        sealed.extend_from_slice(&nonce);
        sealed.extend_from_slice(&buffer);
        Some(Sealed(sealed))
    }

    /// What `sealed` holds, if it was sealed for this partition and exact hash under
    /// this master key; `None` otherwise (a miss).
    pub fn open(&self, partition: &Partition, exact: &[u8; 32], sealed: &Sealed) -> Option<Vec<u8>> {
        if sealed.0.len() < NONCE_LEN {
            return None;
        }
        let (nonce, cipher) = sealed.0.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buffer = cipher.to_vec();
        let aad = aad(partition, exact);
        let key = self.key(&partition.tenant)?;
        let plain = key.open_in_place(nonce, Aad::from(&aad[..]), &mut buffer).ok()?.len();
        buffer.truncate(plain);
        Some(buffer)
    }
}

fn aad(partition: &Partition, exact: &[u8; 32]) -> [u8; 64] {
    let mut aad = [0u8; 64];
    aad[..32].copy_from_slice(&partition.id);
    aad[32..].copy_from_slice(exact);
    aad
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(exact: u8) -> Probe {
        Probe { exact: [exact; 32], vector: None, guard: 0 }
    }

    #[test]
    fn an_entry_opens_only_in_its_partition_under_its_key() {
        let keys = Keys::new(b"0123456789abcdef0123456789abcdef");
        let acme = Partition::new("acme", None, "faq", "m", &[0; 32]);
        let sealed = keys.seal(&acme, &probe(1), b"Paris is the capital").unwrap();
        assert!(!sealed.0.windows(5).any(|w| w == b"Paris"), "no clear text at rest");
        assert_eq!(keys.open(&acme, &[1; 32], &sealed).as_deref(), Some(&b"Paris is the capital"[..]));
        assert_eq!(keys.open(&acme, &[2; 32], &sealed), None, "another exact hash");
        let initech = Partition { tenant: "initech".into(), ..acme.clone() };
        assert_eq!(keys.open(&initech, &[1; 32], &sealed), None, "another tenant's key");
        let other = Partition::new("acme", None, "faq", "m2", &[0; 32]);
        assert_eq!(keys.open(&other, &[1; 32], &sealed), None, "another partition");
        assert_eq!(Keys::new(b"another master key of 32 bytes..").open(&acme, &[1; 32], &sealed), None);
        let mut flipped = sealed.clone();
        let last = flipped.0.len() - 1;
        flipped.0[last] ^= 1;
        assert_eq!(keys.open(&acme, &[1; 32], &flipped), None, "tampered");
        assert_eq!(keys.open(&acme, &[1; 32], &Sealed(vec![1, 2])), None, "truncated");
    }

    #[test]
    fn a_blinded_hash_depends_on_the_key() {
        let (one, other) = (Keys::new(b"one master key.."), Keys::new(b"another master key"));
        assert_eq!(one.blind(b"x"), one.blind(b"x"));
        assert_ne!(one.blind(b"x"), one.blind(b"y"));
        assert_ne!(one.blind(b"x"), other.blind(b"x"));
    }

    #[test]
    fn two_seals_of_one_entry_differ() {
        let keys = Keys::new(b"k");
        let p = Partition::new("acme", None, "faq", "m", &[0; 32]);
        assert_ne!(keys.seal(&p, &probe(1), b"x").unwrap(), keys.seal(&p, &probe(1), b"x").unwrap());
    }
}
