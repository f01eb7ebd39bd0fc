//! JWTs as a caller's Bearer on `/mcp` (`mcp.oauth`, SPEC §17): a token from the
//! organisation's identity provider, signed RS256 or ES256 by a key of its JWK set,
//! issued by `issuer` for `audience` (RFC 8707), in its validity window give or take
//! a minute. Its claims name the caller's tenant (and agent); whether that tenant and
//! agent are declared is the caller's question, not this module's.
//!
//! The key set is fetched on first use and kept; a token naming a key the set lacks
//! (the issuer rotated) fetches it again, at most once a minute, so a stream of
//! tokens with made-up `kid`s cannot turn the gateway into a load on the issuer. One
//! fetch at a time, and no lock held across it: while one is under way every other
//! token is checked against the keys held (only the first, with none held, waits).
//! Nothing of a token goes into an error or a log: a token is a credential.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::signature::{self, RsaPublicKeyComponents, UnparsedPublicKey};
use serde::Deserialize;
use serde_json::Value;

use crate::config::McpOauth;

/// How far `exp` and `nbf` are stretched for clocks that disagree.
const LEEWAY_S: u64 = 60;
/// The least time between two fetches of the key set for an unknown `kid`.
const MIN_REFETCH: Duration = Duration::from_secs(60);
/// The least time between two fetches while no key set was ever read.
const RETRY_UNFETCHED: Duration = Duration::from_secs(5);
/// How long a fetch of the key set may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest key set read; an identity provider's is a few KiB.
const MAX_JWKS_BYTES: usize = 256 * 1024;
/// The largest token looked at.
const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// Who a verified token says the caller is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    /// The value of `tenant_claim`.
    pub tenant: String,
    /// The value of `agent_claim`, when configured and present.
    pub agent: Option<String>,
    /// `sub`, when present.
    pub subject: Option<String>,
}

/// Why a token is refused. No variant carries anything of the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwtError {
    #[error("not a JWT (three base64url parts, a JSON header and payload)")]
    Malformed,
    #[error("the token's algorithm is not accepted (RS256, ES256)")]
    Algorithm,
    #[error("no key of the issuer's key set matches the token")]
    UnknownKey,
    #[error("the token's signature does not verify")]
    Signature,
    #[error("the token is from another issuer")]
    Issuer,
    #[error("the token is for another audience")]
    Audience,
    #[error("the token has expired (or carries no exp)")]
    Expired,
    #[error("the token is not valid yet")]
    NotYetValid,
    #[error("the token's `{0}` claim is missing or not a string")]
    Claim(String),
    #[error("the issuer's key set could not be read: {0}")]
    Keys(String),
}

/// Verifies tokens against one `mcp.oauth`; shared by every request.
pub struct Verifier {
    oauth: McpOauth,
    /// Its own client, following no redirect; the error if none could be built.
    http: Result<reqwest::Client, String>,
    min_refetch: Duration,
    keys: Mutex<Held>,
    /// Held by the one fetch of the key set under way.
    fetching: tokio::sync::Mutex<()>,
}

/// The key set as last read, and when it was asked for.
#[derive(Default)]
struct Held {
    keys: Arc<Vec<Jwk>>,
    /// Whether a key set was ever read.
    fetched: bool,
    /// The last fetch, whether or not it succeeded.
    attempted: Option<Instant>,
}

/// A signing key of the set.
#[derive(Debug, Clone)]
struct Jwk {
    kid: Option<String>,
    key: PublicKey,
}

#[derive(Debug, Clone)]
enum PublicKey {
    /// Modulus and exponent, big-endian.
    Rsa { n: Vec<u8>, e: Vec<u8> },
    /// A P-256 point, uncompressed (`04 ‖ x ‖ y`).
    P256(Vec<u8>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Alg {
    Rs256,
    Es256,
}

#[derive(Deserialize)]
struct Header {
    alg: String,
    kid: Option<String>,
    /// Extensions the token says must be understood (RFC 7515 §4.1.11): this
    /// verifier understands none, so a token with any is refused.
    crit: Option<Value>,
}

impl Verifier {
    /// The verifier of `oauth`. Its key set is fetched from `jwks_url` and nowhere
    /// else: a redirect is not followed (the keys are whatever the URL answers, so
    /// that answer is a failure), lest the set come from a host no one configured.
    pub fn new(oauth: &McpOauth) -> Verifier {
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("no HTTP client: {e}"));
        Verifier {
            oauth: oauth.clone(),
            http,
            min_refetch: MIN_REFETCH,
            keys: Mutex::new(Held::default()),
            fetching: tokio::sync::Mutex::new(()),
        }
    }

    /// The token's claims, once its signature, issuer, audience and validity window
    /// are checked.
    pub async fn verify(&self, token: &str) -> Result<Claims, JwtError> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.verify_at(token, now).await
    }

    async fn verify_at(&self, token: &str, now: u64) -> Result<Claims, JwtError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(JwtError::Malformed);
        }
        let mut parts = token.split('.');
        let (Some(header), Some(payload), Some(signature), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(JwtError::Malformed);
        };
        let header: Header = serde_json::from_slice(&decode(header)?).map_err(|_| JwtError::Malformed)?;
        if header.crit.is_some() {
            return Err(JwtError::Malformed);
        }
        let alg = match header.alg.as_str() {
            "RS256" => Alg::Rs256,
            "ES256" => Alg::Es256,
            _ => return Err(JwtError::Algorithm),
        };
        let signature = decode(signature)?;
        let signed = &token[..token.len() - signature_len(token)];

        let keys = self.keys_for(header.kid.as_deref()).await?;
        let candidates: Vec<&Jwk> = keys
            .iter()
            .filter(|k| header.kid.is_none() || k.kid == header.kid)
            .filter(|k| matches!((&k.key, alg), (PublicKey::Rsa { .. }, Alg::Rs256) | (PublicKey::P256(_), Alg::Es256)))
            .collect();
        if candidates.is_empty() {
            return Err(JwtError::UnknownKey);
        }
        if !candidates.iter().any(|k| k.key.verifies(signed.as_bytes(), &signature)) {
            return Err(JwtError::Signature);
        }

        let claims: serde_json::Map<String, Value> =
            serde_json::from_slice(&decode(payload)?).map_err(|_| JwtError::Malformed)?;
        self.check(&claims, now)?;
        let string = |name: &str| claims.get(name).and_then(Value::as_str).map(str::to_owned);
        let tenant = string(&self.oauth.tenant_claim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| JwtError::Claim(self.oauth.tenant_claim.clone()))?;
        let agent = match &self.oauth.agent_claim {
            Some(claim) => match claims.get(claim) {
                None | Some(Value::Null) => None,
                Some(Value::String(agent)) if !agent.is_empty() => Some(agent.clone()),
                Some(_) => return Err(JwtError::Claim(claim.clone())),
            },
            None => None,
        };
        Ok(Claims { tenant, agent, subject: string("sub") })
    }

    /// Issuer, audience and the validity window.
    fn check(&self, claims: &serde_json::Map<String, Value>, now: u64) -> Result<(), JwtError> {
        if claims.get("iss").and_then(Value::as_str) != Some(self.oauth.issuer.as_str()) {
            return Err(JwtError::Issuer);
        }
        let audience = self.oauth.audience.as_str();
        let for_us = match claims.get("aud") {
            Some(Value::String(aud)) => aud == audience,
            Some(Value::Array(auds)) => auds.iter().any(|aud| aud.as_str() == Some(audience)),
            _ => false,
        };
        if !for_us {
            return Err(JwtError::Audience);
        }
        // A token without `exp` never expires: not one to accept as a Bearer.
        let exp = claims.get("exp").and_then(numeric_date).ok_or(JwtError::Expired)?;
        if now > exp.saturating_add(LEEWAY_S) {
            return Err(JwtError::Expired);
        }
        match claims.get("nbf") {
            None => Ok(()),
            Some(nbf) => match numeric_date(nbf) {
                Some(nbf) if nbf <= now.saturating_add(LEEWAY_S) => Ok(()),
                Some(_) => Err(JwtError::NotYetValid),
                None => Err(JwtError::Malformed),
            },
        }
    }

    /// The key set, fetched first when none was read yet, or when `kid` names a key
    /// it lacks and the last fetch is a minute old. While a fetch is under way the
    /// keys held answer, without waiting for it, unless none is held yet.
    async fn keys_for(&self, kid: Option<&str>) -> Result<Arc<Vec<Jwk>>, JwtError> {
        if self.due(kid) {
            match self.fetching.try_lock() {
                // Looked at again under the lock: a fetch may have ended in between.
                Ok(_one_fetch) => {
                    if self.due(kid) {
                        self.refetch().await?;
                    }
                }
                Err(_) => {
                    let none_held = !self.held().fetched;
                    if none_held {
                        drop(self.fetching.lock().await);
                    }
                }
            }
        }
        let held = self.held();
        if !held.fetched {
            return Err(JwtError::Keys("the last attempt failed; retried shortly".into()));
        }
        Ok(held.keys.clone())
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the key set is to be fetched for a token naming `kid`.
    fn due(&self, kid: Option<&str>) -> bool {
        let held = self.held();
        let since = |wait: Duration| held.attempted.is_none_or(|at| at.elapsed() >= wait);
        let unknown = kid.is_some_and(|kid| !held.keys.iter().any(|k| k.kid.as_deref() == Some(kid)));
        if held.fetched { unknown && since(self.min_refetch) } else { since(RETRY_UNFETCHED) }
    }

    /// Fetches the key set and keeps it; a failure keeps the keys held, and is the
    /// answer only when none is.
    async fn refetch(&self) -> Result<(), JwtError> {
        self.held().attempted = Some(Instant::now());
        let fetched = self.fetch().await;
        let mut held = self.held();
        match fetched {
            Ok(keys) => {
                held.keys = Arc::new(keys);
                held.fetched = true;
            }
            Err(error) => {
                tracing::warn!(jwks_url = %self.oauth.jwks_url, "mcp oauth: {error}");
                if !held.fetched {
                    return Err(error);
                }
            }
        }
        Ok(())
    }

    async fn fetch(&self) -> Result<Vec<Jwk>, JwtError> {
        let failed = |what: String| JwtError::Keys(what);
        let http = self.http.as_ref().map_err(|e| failed(e.clone()))?;
        let mut response = http
            .get(&self.oauth.jwks_url)
            .header(http::header::ACCEPT, "application/json")
            .timeout(FETCH_TIMEOUT)
            .send()
            .await
            .map_err(|e| failed(format!("{e}")))?;
        if !response.status().is_success() {
            return Err(failed(format!("status {}", response.status().as_u16())));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| failed(format!("{e}")))? {
            if body.len() + chunk.len() > MAX_JWKS_BYTES {
                return Err(failed(format!("over {MAX_JWKS_BYTES} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        let set: Value = serde_json::from_slice(&body).map_err(|_| failed("not JSON".into()))?;
        let keys = set.get("keys").and_then(Value::as_array).ok_or_else(|| failed("no `keys` list".into()))?;
        Ok(keys.iter().filter_map(Jwk::read).collect())
    }
}

impl Jwk {
    /// A signing key of a kind this verifier uses (RSA, EC P-256); any other entry
    /// (an encryption key, another curve, a symmetric key) is passed over.
    fn read(entry: &Value) -> Option<Jwk> {
        let field = |name: &str| entry.get(name).and_then(Value::as_str);
        if field("use").is_some_and(|u| u != "sig") {
            return None;
        }
        let bytes = |name: &str| field(name).and_then(|text| URL_SAFE_NO_PAD.decode(text).ok());
        let key = match (field("kty")?, field("alg")) {
            ("RSA", None | Some("RS256")) => {
                let n = bytes("n")?;
                let e = bytes("e")?;
                PublicKey::Rsa { n: strip_zeros(n), e: strip_zeros(e) }
            }
            ("EC", None | Some("ES256")) if field("crv") == Some("P-256") => {
                let (x, y) = (bytes("x")?, bytes("y")?);
                if x.len() != 32 || y.len() != 32 {
                    return None;
                }
                PublicKey::P256([&[4u8][..], &x, &y].concat())
            }
            _ => return None,
        };
        Some(Jwk { kid: field("kid").map(str::to_owned), key })
    }
}

impl PublicKey {
    fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        match self {
            PublicKey::Rsa { n, e } => RsaPublicKeyComponents { n, e }
                .verify(&signature::RSA_PKCS1_2048_8192_SHA256, message, signature)
                .is_ok(),
            PublicKey::P256(point) => {
                UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_FIXED, point).verify(message, signature).is_ok()
            }
        }
    }
}

fn decode(part: &str) -> Result<Vec<u8>, JwtError> {
    URL_SAFE_NO_PAD.decode(part).map_err(|_| JwtError::Malformed)
}

/// The length of `.signature` at the end of a three-part token.
fn signature_len(token: &str) -> usize {
    token.rfind('.').map_or(0, |dot| token.len() - dot)
}

/// A JWK's big-endian integer without the leading zeros ring refuses.
fn strip_zeros(mut bytes: Vec<u8>) -> Vec<u8> {
    let zeros = bytes.iter().take_while(|b| **b == 0).count();
    bytes.drain(..zeros);
    bytes
}

/// A NumericDate (RFC 7519 §2): seconds since the epoch, maybe with a fraction.
fn numeric_date(value: &Value) -> Option<u64> {
    match value {
        Value::Number(n) => n.as_u64().or_else(|| n.as_f64().filter(|f| *f >= 0.0 && f.is_finite()).map(|f| f as u64)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    use axum::Router;
    use axum::extract::State;
    use axum::routing::get;
    use ring::rand::SystemRandom;
    use ring::signature::{EcdsaKeyPair, KeyPair, RsaKeyPair};
    use serde_json::json;

    use super::*;

    /// A 2048-bit RSA key made with `openssl genpkey` for these tests only.
    const RSA_PKCS8: &[u8] = include_bytes!("testdata/rsa-2048-test-only.pk8");
    const NOW: u64 = 1_800_000_000;

    enum Signer {
        Rsa(RsaKeyPair),
        Ec(EcdsaKeyPair),
    }

    impl Signer {
        fn rsa() -> Signer {
            Signer::Rsa(RsaKeyPair::from_pkcs8(RSA_PKCS8).unwrap())
        }

        fn ec() -> Signer {
            let rng = SystemRandom::new();
            let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
            let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).unwrap();
            Signer::Ec(EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).unwrap())
        }

        fn alg(&self) -> &'static str {
            match self {
                Signer::Rsa(_) => "RS256",
                Signer::Ec(_) => "ES256",
            }
        }

        /// Its public key as a JWK under `kid`.
        fn jwk(&self, kid: &str) -> Value {
            let b64 = |bytes: &[u8]| URL_SAFE_NO_PAD.encode(bytes);
            match self {
                Signer::Rsa(key) => {
                    let public: RsaPublicKeyComponents<Vec<u8>> = key.public().into();
                    json!({"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256", "n": b64(&public.n), "e": b64(&public.e)})
                }
                Signer::Ec(key) => {
                    let point = key.public_key().as_ref();
                    json!({"kty": "EC", "kid": kid, "crv": "P-256", "x": b64(&point[1..33]), "y": b64(&point[33..])})
                }
            }
        }

        /// A token with this header and these claims, signed.
        fn sign(&self, header: &Value, claims: &Value) -> String {
            let part = |v: &Value| URL_SAFE_NO_PAD.encode(serde_json::to_vec(v).unwrap());
            let signed = format!("{}.{}", part(header), part(claims));
            let rng = SystemRandom::new();
            let signature = match self {
                Signer::Rsa(key) => {
                    let mut out = vec![0; key.public().modulus_len()];
                    key.sign(&signature::RSA_PKCS1_SHA256, &rng, signed.as_bytes(), &mut out).unwrap();
                    out
                }
                Signer::Ec(key) => key.sign(&rng, signed.as_bytes()).unwrap().as_ref().to_vec(),
            };
            format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature))
        }

        fn token(&self, kid: &str, claims: &Value) -> String {
            self.sign(&json!({"alg": self.alg(), "typ": "JWT", "kid": kid}), claims)
        }
    }

    fn claims() -> Value {
        json!({
            "iss": "https://idp.example",
            "aud": "https://gw.example/mcp",
            "sub": "user-7",
            "tenant": "acme",
            "agent": "bot",
            "exp": NOW + 300,
            "nbf": NOW - 10,
            "iat": NOW - 10,
        })
    }

    fn with(changes: Value) -> Value {
        let mut claims = claims();
        for (key, value) in changes.as_object().unwrap() {
            if value.is_null() {
                claims.as_object_mut().unwrap().remove(key);
            } else {
                claims[key] = value.clone();
            }
        }
        claims
    }

    /// A JWK set served on loopback: what it serves and how slowly can change, and it
    /// counts its requests.
    struct Issuer {
        set: Arc<std::sync::Mutex<(u16, Value)>>,
        hits: Arc<AtomicUsize>,
        /// Milliseconds each answer waits.
        delay_ms: Arc<AtomicU64>,
        url: String,
    }

    type Shared = (Arc<std::sync::Mutex<(u16, Value)>>, Arc<AtomicUsize>, Arc<AtomicU64>);

    async fn jwks(State((set, hits, delay_ms)): State<Shared>) -> (http::StatusCode, axum::Json<Value>) {
        hits.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(delay_ms.load(Ordering::SeqCst))).await;
        let (status, body) = set.lock().unwrap().clone();
        (http::StatusCode::from_u16(status).unwrap(), axum::Json(body))
    }

    impl Issuer {
        async fn serving(keys: Vec<Value>) -> Issuer {
            let set = Arc::new(std::sync::Mutex::new((200, json!({"keys": keys}))));
            let hits = Arc::new(AtomicUsize::new(0));
            let delay_ms = Arc::new(AtomicU64::new(0));
            let state = (set.clone(), hits.clone(), delay_ms.clone());
            let moved = || async { axum::response::Redirect::temporary("/jwks") };
            let app = Router::new().route("/jwks", get(jwks)).route("/moved", get(moved)).with_state(state);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/jwks", listener.local_addr().unwrap());
            tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
            Issuer { set, hits, delay_ms, url }
        }

        fn serve(&self, status: u16, keys: Vec<Value>) {
            *self.set.lock().unwrap() = (status, json!({"keys": keys}));
        }

        fn slow(&self, delay: Duration) {
            self.delay_ms.store(u64::try_from(delay.as_millis()).unwrap(), Ordering::SeqCst);
        }

        fn hits(&self) -> usize {
            self.hits.load(Ordering::SeqCst)
        }

        fn verifier(&self) -> Verifier {
            let oauth = McpOauth {
                issuer: "https://idp.example".into(),
                audience: "https://gw.example/mcp".into(),
                jwks_url: self.url.clone(),
                tenant_claim: "tenant".into(),
                agent_claim: Some("agent".into()),
            };
            Verifier::new(&oauth)
        }
    }

    fn acme_bot() -> Claims {
        Claims { tenant: "acme".into(), agent: Some("bot".into()), subject: Some("user-7".into()) }
    }

    #[tokio::test]
    async fn rs256_and_es256_tokens_verify_and_name_the_caller() {
        let (rsa, ec) = (Signer::rsa(), Signer::ec());
        let issuer = Issuer::serving(vec![rsa.jwk("r1"), ec.jwk("e1")]).await;
        let verifier = issuer.verifier();
        assert_eq!(verifier.verify_at(&rsa.token("r1", &claims()), NOW).await, Ok(acme_bot()));
        assert_eq!(verifier.verify_at(&ec.token("e1", &claims()), NOW).await, Ok(acme_bot()));
        // Without a `kid`, the keys of the token's kind are tried.
        let no_kid = ec.sign(&json!({"alg": "ES256"}), &claims());
        assert_eq!(verifier.verify_at(&no_kid, NOW).await, Ok(acme_bot()));
        // No agent claim, no `sub`: neither is required.
        let tenant_only = rsa.token("r1", &with(json!({"agent": null, "sub": null})));
        let expected = Claims { tenant: "acme".into(), agent: None, subject: None };
        assert_eq!(verifier.verify_at(&tenant_only, NOW).await, Ok(expected));
        // The set was read once.
        assert_eq!(issuer.hits(), 1);
        // Now, against the clock: a token valid today.
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
        let today = with(json!({"exp": now + 60, "nbf": now}));
        assert_eq!(verifier.verify(&ec.token("e1", &today)).await, Ok(acme_bot()));
    }

    #[tokio::test]
    async fn issuer_audience_and_window_are_checked() {
        let ec = Signer::ec();
        let issuer = Issuer::serving(vec![ec.jwk("e1")]).await;
        let verifier = issuer.verifier();
        let verify = |claims: Value| {
            let token = ec.token("e1", &claims);
            let verifier = &verifier;
            async move { verifier.verify_at(&token, NOW).await }
        };
        assert_eq!(verify(with(json!({"iss": "https://evil.example"}))).await, Err(JwtError::Issuer));
        assert_eq!(verify(with(json!({"iss": "https://idp.example/"}))).await, Err(JwtError::Issuer));
        assert_eq!(verify(with(json!({"iss": null}))).await, Err(JwtError::Issuer));
        assert_eq!(verify(with(json!({"aud": "https://other.example/mcp"}))).await, Err(JwtError::Audience));
        assert_eq!(verify(with(json!({"aud": null}))).await, Err(JwtError::Audience));
        let listed = with(json!({"aud": ["https://other.example", "https://gw.example/mcp"]}));
        assert_eq!(verify(listed).await, Ok(acme_bot()));
        assert_eq!(verify(with(json!({"aud": ["https://other.example"]}))).await, Err(JwtError::Audience));
        // exp and nbf, 60 s of leeway either way.
        assert_eq!(verify(with(json!({"exp": NOW - 60}))).await, Ok(acme_bot()));
        assert_eq!(verify(with(json!({"exp": NOW - 61}))).await, Err(JwtError::Expired));
        assert_eq!(verify(with(json!({"exp": null}))).await, Err(JwtError::Expired));
        assert_eq!(verify(with(json!({"exp": (NOW + 10) as f64 + 0.5}))).await, Ok(acme_bot()));
        assert_eq!(verify(with(json!({"nbf": NOW + 60}))).await, Ok(acme_bot()));
        assert_eq!(verify(with(json!({"nbf": NOW + 61}))).await, Err(JwtError::NotYetValid));
        // The tenant claim is a non-empty string; the agent claim, when present, too.
        assert_eq!(verify(with(json!({"tenant": null}))).await, Err(JwtError::Claim("tenant".into())));
        assert_eq!(verify(with(json!({"tenant": 7}))).await, Err(JwtError::Claim("tenant".into())));
        assert_eq!(verify(with(json!({"tenant": ""}))).await, Err(JwtError::Claim("tenant".into())));
        assert_eq!(verify(with(json!({"agent": ["bot"]}))).await, Err(JwtError::Claim("agent".into())));
    }

    #[tokio::test]
    async fn only_a_signature_by_a_key_of_the_set_is_believed() {
        let (ec, stranger, rsa) = (Signer::ec(), Signer::ec(), Signer::rsa());
        let issuer = Issuer::serving(vec![ec.jwk("e1"), rsa.jwk("r1")]).await;
        let verifier = issuer.verifier();
        // Signed by another key under a listed kid.
        assert_eq!(verifier.verify_at(&stranger.token("e1", &claims()), NOW).await, Err(JwtError::Signature));
        // A payload changed after signing.
        let token = ec.token("e1", &claims());
        let parts: Vec<&str> = token.split('.').collect();
        let forged = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&with(json!({"tenant": "other"}))).unwrap());
        let tampered = format!("{}.{forged}.{}", parts[0], parts[2]);
        assert_eq!(verifier.verify_at(&tampered, NOW).await, Err(JwtError::Signature));
        // The algorithm must match the key's kind: an RS256 header on the EC key's kid.
        let crossed = rsa.sign(&json!({"alg": "RS256", "kid": "e1"}), &claims());
        assert_eq!(verifier.verify_at(&crossed, NOW).await, Err(JwtError::UnknownKey));
        // `none` and HMAC are never accepted, whatever the signature.
        for alg in ["none", "HS256", "RS384", "PS256"] {
            let header = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&json!({"alg": alg, "kid": "e1"})).unwrap());
            let token = format!("{header}.{}.{}", parts[1], parts[2]);
            assert_eq!(verifier.verify_at(&token, NOW).await, Err(JwtError::Algorithm), "{alg}");
        }
        let critical = ec.sign(&json!({"alg": "ES256", "kid": "e1", "crit": ["exp-ext"], "exp-ext": 1}), &claims());
        assert_eq!(verifier.verify_at(&critical, NOW).await, Err(JwtError::Malformed));
        for malformed in ["", "abc", "a.b", "a.b.c.d", "!!.!!.!!", &format!("{}.{}", parts[0], parts[1])] {
            assert_eq!(verifier.verify_at(malformed, NOW).await, Err(JwtError::Malformed), "{malformed}");
        }
    }

    #[tokio::test]
    async fn an_unknown_kid_fetches_the_set_once_a_minute_at_most() {
        let (old, new) = (Signer::ec(), Signer::rsa());
        let issuer = Issuer::serving(vec![old.jwk("k1")]).await;
        let verifier = issuer.verifier();
        assert!(verifier.verify_at(&old.token("k1", &claims()), NOW).await.is_ok());
        assert_eq!(issuer.hits(), 1, "fetched on first use");
        // Known kids never fetch; unknown ones within the minute do not either.
        issuer.serve(200, vec![old.jwk("k1"), new.jwk("k2")]);
        for _ in 0..3 {
            assert!(verifier.verify_at(&old.token("k1", &claims()), NOW).await.is_ok());
            assert_eq!(verifier.verify_at(&new.token("k2", &claims()), NOW).await, Err(JwtError::UnknownKey));
            assert_eq!(verifier.verify_at(&new.token("made-up", &claims()), NOW).await, Err(JwtError::UnknownKey));
        }
        assert_eq!(issuer.hits(), 1);
    }

    #[tokio::test]
    async fn a_rotated_key_is_fetched_after_the_minute() {
        let (old, new) = (Signer::ec(), Signer::rsa());
        let issuer = Issuer::serving(vec![old.jwk("k1")]).await;
        let mut verifier = issuer.verifier();
        verifier.min_refetch = Duration::from_millis(100); // the minute, shortened
        assert!(verifier.verify_at(&old.token("k1", &claims()), NOW).await.is_ok());
        tokio::time::sleep(Duration::from_millis(150)).await;
        // The issuer rotates: a token with the new kid fetches the set again.
        issuer.serve(200, vec![new.jwk("k2")]);
        assert_eq!(verifier.verify_at(&new.token("k2", &claims()), NOW).await, Ok(acme_bot()));
        assert_eq!(issuer.hits(), 2);
        // The old key went with the old set.
        assert_eq!(verifier.verify_at(&old.token("k1", &claims()), NOW).await, Err(JwtError::UnknownKey));
        assert_eq!(issuer.hits(), 2, "within the minute of the last fetch");
        // A set the issuer fails to serve keeps the keys held.
        tokio::time::sleep(Duration::from_millis(150)).await;
        issuer.serve(503, vec![]);
        assert_eq!(verifier.verify_at(&old.token("k1", &claims()), NOW).await, Err(JwtError::UnknownKey));
        assert_eq!(issuer.hits(), 3);
        assert_eq!(verifier.verify_at(&new.token("k2", &claims()), NOW).await, Ok(acme_bot()));
    }

    #[tokio::test]
    async fn a_slow_fetch_for_an_invented_kid_holds_up_no_other_token() {
        let (ec, stranger) = (Signer::ec(), Signer::ec());
        let issuer = Issuer::serving(vec![ec.jwk("k1")]).await;
        let mut verifier = issuer.verifier();
        verifier.min_refetch = Duration::ZERO; // every unknown kid is due a fetch
        assert!(verifier.verify_at(&ec.token("k1", &claims()), NOW).await.is_ok());
        issuer.slow(Duration::from_secs(2));
        let verifier = Arc::new(verifier);
        let invented = {
            let (verifier, token) = (verifier.clone(), stranger.token("invented", &claims()));
            tokio::spawn(async move { verifier.verify_at(&token, NOW).await })
        };
        while issuer.hits() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The fetch is under way: a known key answers at once, and another invented
        // kid neither waits for it nor starts a second one.
        let started = Instant::now();
        assert_eq!(verifier.verify_at(&ec.token("k1", &claims()), NOW).await, Ok(acme_bot()));
        let other = stranger.token("invented-too", &claims());
        assert_eq!(verifier.verify_at(&other, NOW).await, Err(JwtError::UnknownKey));
        assert!(started.elapsed() < Duration::from_millis(500), "waited {:?}", started.elapsed());
        assert_eq!(invented.await.unwrap(), Err(JwtError::UnknownKey));
        assert_eq!(issuer.hits(), 2);
    }

    #[tokio::test]
    async fn a_redirect_from_the_jwks_url_is_not_followed() {
        let ec = Signer::ec();
        let issuer = Issuer::serving(vec![ec.jwk("e1")]).await;
        let mut verifier = issuer.verifier();
        verifier.oauth.jwks_url = issuer.url.replace("/jwks", "/moved");
        let refused = verifier.verify_at(&ec.token("e1", &claims()), NOW).await;
        assert_eq!(refused, Err(JwtError::Keys("status 307".into())));
        assert_eq!(issuer.hits(), 0, "the set the redirect names was not asked for");
    }

    #[tokio::test]
    async fn an_unreadable_set_is_an_error_retried_later() {
        let ec = Signer::ec();
        let issuer = Issuer::serving(vec![]).await;
        issuer.serve(500, vec![]);
        let verifier = issuer.verifier();
        let token = ec.token("e1", &claims());
        assert!(matches!(verifier.verify_at(&token, NOW).await, Err(JwtError::Keys(_))));
        // Not fetched again at once: the first failure is retried after a few seconds.
        issuer.serve(200, vec![ec.jwk("e1")]);
        assert!(matches!(verifier.verify_at(&token, NOW).await, Err(JwtError::Keys(_))));
        assert_eq!(issuer.hits(), 1);
        // Entries of kinds the verifier does not use are passed over.
        let odd = vec![
            json!({"kty": "oct", "kid": "h", "k": "c2VjcmV0"}),
            json!({"kty": "EC", "kid": "p384", "crv": "P-384", "x": "AA", "y": "AA"}),
            json!({"kty": "RSA", "kid": "enc", "use": "enc", "n": "AQAB", "e": "AQAB"}),
            ec.jwk("e1"),
        ];
        let fresh = issuer.verifier();
        issuer.serve(200, odd);
        assert_eq!(fresh.verify_at(&token, NOW).await, Ok(acme_bot()));
        assert_eq!(fresh.held().keys.len(), 1);
    }
}
