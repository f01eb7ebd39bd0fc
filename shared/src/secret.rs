//! Secrets: resolved from references, redacted everywhere they could be printed.
//!
//! A `Secret` has no `Display`, and its `Debug` prints `Secret(***)`, so a secret that
//! slips into a log line or an error message shows up as a redaction, never as itself.

use std::fmt;

use crate::config::{EnvSource, SecretRef};

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
    #[error("secret {reference}: the file is empty")]
    Empty { reference: String },
    #[error("secret {reference}: this Flexway does not resolve AWS Secrets Manager or SSM references")]
    Unsupported { reference: String },
}

/// Turns a reference into the secret it names.
pub trait SecretSource {
    fn resolve(&self, reference: &SecretRef) -> Result<Secret, SecretError>;
}

/// `env:` and `file:` references, for the local shape and for tests.
pub struct LocalSecrets<'a> {
    pub env: &'a dyn EnvSource,
}

impl SecretSource for LocalSecrets<'_> {
    fn resolve(&self, reference: &SecretRef) -> Result<Secret, SecretError> {
        let value = match reference {
            SecretRef::Env(name) => {
                self.env.var(name).ok_or_else(|| SecretError::EnvMissing { reference: reference.to_string() })?
            }
            SecretRef::File(path) => std::fs::read_to_string(path)
                .map_err(|source| SecretError::File { reference: reference.to_string(), source })?,
            SecretRef::AwsArn(_) => {
                return Err(SecretError::Unsupported { reference: reference.to_string() });
            }
        };
        let value = value.trim();
        if value.is_empty() {
            return Err(SecretError::Empty { reference: reference.to_string() });
        }
        Ok(Secret::new(value))
    }
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

    #[test]
    fn resolves_env_references_and_trims() {
        let env: HashMap<String, String> = [("K".to_owned(), " v1 \n".to_owned())].into();
        let secrets = LocalSecrets { env: &env };
        let got = secrets.resolve(&SecretRef::Env("K".into())).map(|s| s.expose().to_owned());
        assert_eq!(got.ok().as_deref(), Some("v1"));
        assert!(matches!(secrets.resolve(&SecretRef::Env("MISSING".into())), Err(SecretError::EnvMissing { .. })));
    }

    #[test]
    fn refuses_aws_references_in_the_local_shape() {
        let env: HashMap<String, String> = HashMap::new();
        let secrets = LocalSecrets { env: &env };
        let arn = SecretRef::AwsArn("arn:aws:ssm:eu-west-1:1:parameter/k".into());
        assert!(matches!(secrets.resolve(&arn), Err(SecretError::Unsupported { .. })));
    }
}
