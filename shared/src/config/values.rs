//! Leaf values of the configuration: money, fractions, header names, URLs, origins,
//! secret references, key hashes, status ranges. Each parser answers the value or a
//! message fit for an operator (the caller adds the path).
//!
//! A value given where a secret reference belongs is never put in a message.

use crate::money::MicroEur;

use super::raw::{RawStatus, SECRET_REFERENCE_FORMS};
use super::{EnvSource, SecretRef};

/// Euros (a YAML number) to micro-euros, exactly: at most 6 decimal places.
pub(super) fn micro_eur(eur: f64) -> Result<MicroEur, String> {
    if !eur.is_finite() {
        return Err("must be a finite number of euros".into());
    }
    if eur < 0.0 {
        return Err(format!("must not be negative (got {eur})"));
    }
    // Display of an f64 is the shortest text that reads back as the same number and
    // never uses an exponent, so it is what the operator wrote (0.15, not
    // 0.1499999...).
    let text = eur.abs().to_string();
    let (whole, fraction) = text.split_once('.').unwrap_or((&text, ""));
    if fraction.len() > 6 {
        return Err(format!("{text} has more than 6 decimal places (money is counted in micro-euros)"));
    }
    let micros: Option<u64> = format!("{fraction:0<6}").parse().ok();
    whole
        .parse::<u64>()
        .ok()
        .and_then(|w| w.checked_mul(MicroEur::PER_EUR))
        .zip(micros)
        .and_then(|(w, f)| w.checked_add(f))
        .map(MicroEur)
        .ok_or_else(|| format!("{text} euros is too large"))
}

/// A fraction in (0, 1] to parts per million.
pub(super) fn fraction_ppm(fraction: f64) -> Result<u32, String> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(format!("must be a fraction greater than 0 and at most 1 (got {fraction})"));
    }
    let ppm = (fraction * 1_000_000.0).round();
    if ppm < 1.0 {
        return Err(format!("{fraction} is below one part per million"));
    }
    // In range by the check above: 1 ≤ ppm ≤ 1_000_000.
    Ok(ppm as u32)
}

/// A valid HTTP header name, lower-cased.
pub(super) fn header_name(name: &str) -> Result<String, String> {
    http::HeaderName::from_bytes(name.as_bytes())
        .map(|h| h.as_str().to_owned())
        .map_err(|_| format!("`{name}` is not a valid HTTP header name"))
}

/// A URL split into its lower-case scheme and its text without trailing slashes.
pub(super) struct BaseUrl {
    pub scheme: String,
    pub rest: String,
}

impl BaseUrl {
    pub fn with_scheme(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.rest)
    }
}

/// A base URL: a scheme, a host, maybe a port and a path; no query, fragment or
/// credentials. Credentials are not echoed back.
pub(super) fn base_url(url: &str) -> Result<BaseUrl, String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!("`{url}` is not a URL (expected e.g. https://host/v1)"));
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err("credentials are not allowed in a URL: declare them under `auth` as a secret reference".into());
    }
    if rest.contains(['?', '#']) {
        return Err(format!("`{url}` has a query or fragment; a base URL has neither"));
    }
    let uri: http::Uri = url.parse().map_err(|e| format!("`{url}` is not a valid URL: {e}"))?;
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("`{url}` has no host"));
    }
    if !has_valid_port(authority) {
        return Err(format!("`{url}` has an invalid port"));
    }
    Ok(BaseUrl { scheme: scheme.to_ascii_lowercase(), rest: rest.trim_end_matches('/').to_owned() })
}

/// `https://host[:port]`, a trailing `/` tolerated; answered lower-case without it.
pub(super) fn https_origin(origin: &str) -> Result<String, String> {
    let lower = origin.to_ascii_lowercase();
    let Some(rest) = lower.strip_prefix("https://") else {
        return Err(if lower.starts_with("http://") {
            format!("`{origin}` is not https: remote images are only fetched over https")
        } else {
            format!("`{origin}` is not an https origin (https://host[:port])")
        });
    };
    let host_port = rest.strip_suffix('/').unwrap_or(rest);
    if host_port.is_empty() || host_port.contains(['/', '?', '#', '@']) {
        return Err(format!(
            "`{origin}` is not an origin: write https://host[:port], without path, query \
             or credentials"
        ));
    }
    let authority: Result<http::uri::Authority, _> = host_port.parse();
    if authority.is_err() || !has_valid_port(host_port) {
        return Err(format!("`{origin}` is not a valid https origin"));
    }
    Ok(format!("https://{host_port}"))
}

/// `host`, `host:port` or `[v6]:port` with the port, if any, in 1..=65535 (the `http`
/// crate's parser lets a bad port through as "no port").
fn has_valid_port(authority: &str) -> bool {
    match authority.rsplit_once(':') {
        Some((_, port)) if !port.contains(']') => port.parse::<u16>().is_ok_and(|p| p != 0),
        _ => true,
    }
}

/// A reference as the configuration writes it (`env:NAME`, `file:PATH`, an AWS ARN),
/// for the commands that take one on their command line.
impl std::str::FromStr for SecretRef {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        secret_ref(text)
    }
}

/// A secret reference, checked for its form only: whether it can be resolved here
/// and now is [`unresolvable`]'s question.
pub(super) fn secret_ref(text: &str) -> Result<SecretRef, String> {
    if let Some(name) = text.strip_prefix("env:") {
        if name.is_empty() {
            return Err("`env:` needs a variable name (env:NAME)".into());
        }
        return Ok(SecretRef::Env(name.to_owned()));
    }
    if let Some(path) = text.strip_prefix("file:") {
        if path.is_empty() {
            return Err("`file:` needs a path (file:PATH)".into());
        }
        return Ok(SecretRef::File(path.into()));
    }
    if text.starts_with("arn:") {
        return aws_secret_arn(text).map(|()| SecretRef::AwsArn(text.to_owned()));
    }
    Err(format!(
        "secrets are references, never values: write {SECRET_REFERENCE_FORMS} \
         (the value given is not shown)"
    ))
}

/// Why a well-formed local reference cannot be resolved here and now, if it cannot:
/// an unset or empty variable, an unreadable file. The message names the reference,
/// never a value. An AWS reference is not judged here: loading makes no network call,
/// and the gateway's secret source resolves it at start (as `flexway validate
/// --resolve-secrets` does).
pub(super) fn unresolvable(reference: &SecretRef, env: &dyn EnvSource) -> Option<String> {
    match reference {
        SecretRef::Env(name) => match env.var(name) {
            None => Some(format!("environment variable {name} is not set")),
            Some(value) if value.is_empty() => Some(format!("environment variable {name} is empty")),
            Some(_) => None,
        },
        SecretRef::File(path) => readable_file(&path.to_string_lossy()).err(),
        SecretRef::AwsArn(_) => None,
    }
}

/// `arn:aws[-cn|-us-gov]:secretsmanager|ssm:region:account:resource`. The text is not
/// echoed: it was not a well-formed reference, so it may be anything.
fn aws_secret_arn(arn: &str) -> Result<(), String> {
    let parts: Vec<&str> = arn.splitn(6, ':').collect();
    let well_formed = matches!(
        parts.as_slice(),
        ["arn", partition, "secretsmanager" | "ssm", _, _, resource]
            if partition.starts_with("aws") && !resource.is_empty()
    );
    if well_formed {
        Ok(())
    } else {
        Err("an ARN here must name a Secrets Manager secret or an SSM parameter \
             (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME or \
             arn:aws:ssm:REGION:ACCOUNT:parameter/NAME)"
            .into())
    }
}

/// A file that exists and can be opened for reading now.
fn readable_file(path: &str) -> Result<(), String> {
    match std::fs::metadata(path) {
        Err(e) => Err(format!("file {path} cannot be read: {e}")),
        Ok(meta) if !meta.is_file() => Err(format!("{path} is not a file")),
        Ok(_) => std::fs::File::open(path).map(drop).map_err(|e| format!("file {path} cannot be read: {e}")),
    }
}

/// The SHA-256 of a key: 64 hex digits, either case.
pub(super) fn key_hash(hex_text: &str) -> Result<[u8; 32], String> {
    let mut hash = [0u8; 32];
    if hex_text.len() != 64 {
        return Err(format!(
            "a key's sha256 is 64 hex digits, got {} characters (is this the key itself? \
             store only its SHA-256)",
            hex_text.chars().count()
        ));
    }
    hex::decode_to_slice(hex_text, &mut hash).map_err(|_| "a key's sha256 is 64 hex digits (0-9, a-f)".to_owned())?;
    Ok(hash)
}

/// `503` or `"500-599"` (inclusive), within 100..=599.
pub(super) fn status_range(status: &RawStatus) -> Result<(u16, u16), String> {
    let bad = |text: &str| format!("`{text}` is not a status (503) or a range (\"500-599\")");
    let (lo, hi) = match status {
        RawStatus::Code(code) => (*code, *code),
        RawStatus::Text(text) => {
            let number = |s: &str| s.trim().parse::<u16>().map_err(|_| bad(text));
            match text.split_once('-') {
                Some((lo, hi)) => (number(lo)?, number(hi)?),
                None => {
                    let code = number(text)?;
                    (code, code)
                }
            }
        }
    };
    if !(100..=599).contains(&lo) || !(100..=599).contains(&hi) {
        return Err(format!("HTTP statuses are between 100 and 599 (got {lo}-{hi})"));
    }
    if lo > hi {
        return Err(format!("range {lo}-{hi} is reversed"));
    }
    Ok((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn euros_become_exact_micro_euros() {
        assert_eq!(micro_eur(2.0), Ok(MicroEur(2_000_000)));
        assert_eq!(micro_eur(0.15), Ok(MicroEur(150_000)));
        assert_eq!(micro_eur(0.000001), Ok(MicroEur(1)));
        assert_eq!(micro_eur(500.0), Ok(MicroEur(500_000_000)));
        assert!(micro_eur(0.0000001).is_err());
        assert!(micro_eur(-1.0).is_err());
        assert!(micro_eur(f64::NAN).is_err());
        assert!(micro_eur(1e30).is_err());
    }

    #[test]
    fn origins_are_normalised() {
        assert_eq!(https_origin("HTTPS://Img.Example.com/"), Ok("https://img.example.com".into()));
        assert_eq!(https_origin("https://a.b:8443"), Ok("https://a.b:8443".into()));
        assert!(https_origin("https://a.b:99999").is_err());
        assert!(https_origin("https://a.b/x").is_err());
        assert!(https_origin("http://a.b").is_err());
    }

    #[test]
    fn ratios_become_ppm() {
        assert_eq!(fraction_ppm(0.8), Ok(800_000));
        assert_eq!(fraction_ppm(1.0), Ok(1_000_000));
        assert!(fraction_ppm(0.0).is_err());
        assert!(fraction_ppm(1.5).is_err());
    }
}
