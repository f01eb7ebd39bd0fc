//! Secrets: resolved from references, redacted everywhere they could be printed.
//!
//! A `Secret` has no `Display`, and its `Debug` prints `Secret(***)`, so a secret that
//! slips into a log line or an error message shows up as a redaction, never as itself.
//! Errors name the reference (`env:NAME`, a path, an ARN), never a value.
//!
//! The core knows the port ([`SecretSource`]) and its local adapter ([`LocalSecrets`]);
//! AWS Secrets Manager and SSM references are resolved by `flexway-aws`, which every
//! binary plugs in.

use std::collections::HashMap;
use std::fmt;

use crate::config::{EnvSource, ProcessEnv, SecretRef};

#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The only way to read the value: call sites that need it are easy to audit.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("secret {reference}: environment variable is not set")]
    EnvMissing { reference: String },
    #[error("secret {reference}: {source}")]
    File { reference: String, source: std::io::Error },
    #[error("secret {reference}: the value is empty")]
    Empty { reference: String },
    #[error("secret {reference}: this secret source does not resolve AWS Secrets Manager or SSM references")]
    Unsupported { reference: String },
    /// A store that could not give the value (an AWS error: not found, access denied,
    /// unreachable). `detail` comes from the store, never from the value.
    #[error("secret {reference}: {detail}")]
    Unavailable { reference: String, detail: String },
}

/// What every log line of a secret refresh starts with: at error, a value that could
/// not be resolved or put in use (its backend keeps the one it has, until that one is
/// revoked), which the template's metric filter counts by this text and the level; at
/// info, new values in use.
pub const REFRESH: &str = "secret refresh";

/// Turns a reference into the secret it names. Async: an AWS reference is a network
/// call, and nothing may block a runtime thread while it is made (at start, and at
/// every `secrets.refresh`).
#[async_trait::async_trait]
pub trait SecretSource: Send + Sync {
    async fn resolve(&self, reference: &SecretRef) -> Result<Secret, SecretError>;
}

/// `env:` and `file:` references: the local part of every shape, and tests. An AWS
/// reference is [`SecretError::Unsupported`] here (the AWS adapter resolves those).
#[derive(Debug, Clone, Default)]
pub struct LocalSecrets<E = ProcessEnv> {
    pub env: E,
}

#[async_trait::async_trait]
impl<E: EnvSource + Send + Sync> SecretSource for LocalSecrets<E> {
    async fn resolve(&self, reference: &SecretRef) -> Result<Secret, SecretError> {
        let value = match reference {
            SecretRef::Env(name) => {
                self.env.var(name).ok_or_else(|| SecretError::EnvMissing { reference: reference.to_string() })?
            }
            SecretRef::File(path) => tokio::fs::read_to_string(path)
                .await
                .map_err(|source| SecretError::File { reference: reference.to_string(), source })?,
            SecretRef::AwsArn(_) => {
                return Err(SecretError::Unsupported { reference: reference.to_string() });
            }
        };
        Secret::trimmed(reference, &value)
    }
}

impl Secret {
    /// The value without surrounding whitespace (a file's last newline, a pasted
    /// space), refused when nothing is left.
    pub fn trimmed(reference: &SecretRef, value: &str) -> Result<Secret, SecretError> {
        match value.trim() {
            "" => Err(SecretError::Empty { reference: reference.to_string() }),
            value => Ok(Secret::new(value)),
        }
    }
}

/// Secrets resolved at once, by reference.
#[derive(Debug, Default)]
pub struct Resolved {
    values: HashMap<SecretRef, Secret>,
}

impl Resolved {
    pub fn get(&self, reference: &SecretRef) -> Option<&Secret> {
        self.values.get(reference)
    }
}

/// Resolves `references` (each with its path in the document) concurrently: a start
/// with twenty AWS references waits for the slowest, not for their sum. A reference
/// used twice is resolved once. Returns what resolved, and each failure with the
/// first path that uses it.
pub async fn resolve_all(
    references: &[(String, &SecretRef)],
    source: &dyn SecretSource,
) -> (Resolved, Vec<(String, SecretError)>) {
    let mut unique: Vec<(&str, &SecretRef)> = Vec::new();
    for (path, reference) in references {
        if !unique.iter().any(|(_, seen)| seen == reference) {
            unique.push((path, reference));
        }
    }
    let answers = futures_util::future::join_all(unique.iter().map(|(_, reference)| source.resolve(reference))).await;
    let mut resolved = Resolved::default();
    let mut failures = Vec::new();
    for ((path, reference), answer) in unique.into_iter().zip(answers) {
        match answer {
            Ok(secret) => {
                resolved.values.insert(reference.clone(), secret);
            }
            Err(error) => failures.push((path.to_owned(), error)),
        }
    }
    (resolved, failures)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn debug_output_never_shows_the_value() {
        let secret = Secret::new("sk-canary-123");
        assert_eq!(format!("{secret:?}"), "Secret(***)");
        assert!(!format!("{:?}", Some(&secret)).contains("canary"));
    }

    #[tokio::test]
    async fn resolves_env_references_and_trims() {
        let env: HashMap<String, String> = [("K".to_owned(), " v1 \n".to_owned())].into();
        let secrets = LocalSecrets { env };
        let got = secrets.resolve(&SecretRef::Env("K".into())).await.map(|s| s.expose().to_owned());
        assert_eq!(got.ok().as_deref(), Some("v1"));
        let missing = secrets.resolve(&SecretRef::Env("MISSING".into())).await;
        assert!(matches!(missing, Err(SecretError::EnvMissing { .. })));
    }

    #[tokio::test]
    async fn refuses_aws_references_without_the_aws_adapter() {
        let secrets = LocalSecrets { env: HashMap::<String, String>::new() };
        let arn = SecretRef::AwsArn("arn:aws:ssm:eu-west-1:1:parameter/k".into());
        assert!(matches!(secrets.resolve(&arn).await, Err(SecretError::Unsupported { .. })));
    }

    #[tokio::test]
    async fn resolves_each_reference_once_and_names_failures_by_their_first_path() {
        let env: HashMap<String, String> = [("K".to_owned(), "v".to_owned())].into();
        let (k, missing) = (SecretRef::Env("K".into()), SecretRef::Env("NOPE".into()));
        let references =
            [("a".to_owned(), &k), ("b".to_owned(), &missing), ("c".to_owned(), &k), ("d".to_owned(), &missing)];
        let (resolved, failures) = resolve_all(&references, &LocalSecrets { env }).await;
        assert_eq!(resolved.get(&k).map(Secret::expose), Some("v"));
        assert_eq!(failures.len(), 1);
        assert_eq!(failures[0].0, "b");
        assert!(failures[0].1.to_string().contains("env:NOPE"));
    }
}
