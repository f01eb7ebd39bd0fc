//! Secret references by ARN: an AWS Secrets Manager secret
//! (`arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME`) or an SSM parameter
//! (`arn:aws:ssm:REGION:ACCOUNT:parameter/NAME`, a SecureString decrypted), read with
//! the SDK's usual environment and credentials: the function's own role in Lambda, the
//! operator's environment or profile for `flexway serve` and `flexway validate`.
//!
//! Each call goes to the region the ARN names, whatever `AWS_REGION` says. Errors name
//! the ARN and the service's reason (not found, access denied, no credentials), never
//! a value. `env:` and `file:` references are resolved as [`LocalSecrets`] does, so one
//! source serves a whole configuration, and a configuration without an ARN never
//! loads the SDK's environment.

use std::time::Duration;

use aws_config::{Region, SdkConfig};
use aws_sdk_secretsmanager::error::{ProvideErrorMetadata, SdkError};
use flexway::config::SecretRef;
use flexway::secret::{LocalSecrets, Secret, SecretError, SecretSource};
use tokio::sync::OnceCell;

/// A start waits for its secrets: past this, an AWS call is a failure, not a hang
/// (an unreachable endpoint, credentials that never come).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// `env:`, `file:`, and Secrets Manager / SSM ARNs.
pub struct AwsSecretSource {
    local: LocalSecrets,
    sdk: OnceCell<SdkConfig>,
}

impl AwsSecretSource {
    /// The SDK's environment is loaded at the first ARN resolved.
    pub fn from_env() -> AwsSecretSource {
        AwsSecretSource { local: LocalSecrets::default(), sdk: OnceCell::new() }
    }

    /// With the SDK configuration a binary has already loaded.
    pub fn new(sdk: SdkConfig) -> AwsSecretSource {
        AwsSecretSource { local: LocalSecrets::default(), sdk: OnceCell::new_with(Some(sdk)) }
    }

    async fn sdk(&self) -> &SdkConfig {
        self.sdk.get_or_init(crate::load_sdk_config).await
    }

    async fn resolve_arn(&self, reference: &SecretRef, arn: &str) -> Result<Secret, SecretError> {
        let unavailable = |detail: String| SecretError::Unavailable { reference: reference.to_string(), detail };
        // Checked at load: arn:PARTITION:SERVICE:REGION:ACCOUNT:RESOURCE.
        let parts: Vec<&str> = arn.splitn(6, ':').collect();
        let (service, region) = match parts.as_slice() {
            [_, _, service, region, _, _] => (*service, *region),
            _ => return Err(unavailable("not a Secrets Manager or SSM parameter ARN".into())),
        };
        let sdk = self.sdk().await;
        let region = if region.is_empty() { sdk.region().cloned() } else { Some(Region::new(region.to_owned())) };
        let timeouts = aws_config::timeout::TimeoutConfig::builder().operation_timeout(CALL_TIMEOUT).build();
        let value = match service {
            "secretsmanager" => {
                let config =
                    aws_sdk_secretsmanager::config::Builder::from(sdk).region(region).timeout_config(timeouts).build();
                let client = aws_sdk_secretsmanager::Client::from_conf(config);
                let output = client
                    .get_secret_value()
                    .secret_id(arn)
                    .send()
                    .await
                    .map_err(|e| unavailable(format!("Secrets Manager: {}", reason(&e))))?;
                match (output.secret_string(), output.secret_binary()) {
                    (Some(text), _) => text.to_owned(),
                    (None, Some(binary)) => String::from_utf8(binary.as_ref().to_vec())
                        .map_err(|_| unavailable("Secrets Manager: the binary secret is not UTF-8 text".into()))?,
                    (None, None) => return Err(unavailable("Secrets Manager: the secret has no value".into())),
                }
            }
            "ssm" => {
                let config = aws_sdk_ssm::config::Builder::from(sdk).region(region).timeout_config(timeouts).build();
                let client = aws_sdk_ssm::Client::from_conf(config);
                let output = client
                    .get_parameter()
                    .name(arn)
                    .with_decryption(true)
                    .send()
                    .await
                    .map_err(|e| unavailable(format!("SSM: {}", aws_sdk_ssm::error::DisplayErrorContext(&e))))?;
                let value = output.parameter().and_then(|p| p.value());
                value.ok_or_else(|| unavailable("SSM: the parameter has no value".into()))?.to_owned()
            }
            _ => return Err(unavailable("not a Secrets Manager or SSM parameter ARN".into())),
        };
        Secret::trimmed(reference, &value)
    }
}

/// Why a call failed, in words that cannot carry the value. Not the SDK's
/// `DisplayErrorContext`: it prints the raw response, body included, and the body of
/// an answer that failed to parse may be the secret itself.
fn reason<E, R>(error: &SdkError<E, R>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    match error {
        SdkError::ServiceError(e) => match (e.err().code(), e.err().message()) {
            (Some(code), Some(message)) => format!("{code}: {message}"),
            (Some(code), None) => code.to_owned(),
            _ => "the service refused the call".to_owned(),
        },
        SdkError::TimeoutError(_) => format!("no answer within {}s", CALL_TIMEOUT.as_secs()),
        SdkError::ResponseError(_) => "the answer could not be read".to_owned(),
        // Nothing was received yet: the causes (no credentials, no region, the
        // endpoint unreachable) are the SDK's own words.
        SdkError::ConstructionFailure(_) | SdkError::DispatchFailure(_) => {
            let mut words = Vec::new();
            let mut source = std::error::Error::source(error);
            while let Some(cause) = source {
                words.push(cause.to_string());
                source = cause.source();
            }
            let words = if words.is_empty() { error.to_string() } else { words.join(": ") };
            // One line: the credential chain lists its attempts a line each.
            words.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; ")
        }
        _ => error.to_string(),
    }
}

#[async_trait::async_trait]
impl SecretSource for AwsSecretSource {
    async fn resolve(&self, reference: &SecretRef) -> Result<Secret, SecretError> {
        match reference {
            SecretRef::AwsArn(arn) => self.resolve_arn(reference, arn).await,
            SecretRef::Env(_) | SecretRef::File(_) => self.local.resolve(reference).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use aws_sdk_secretsmanager::operation::get_secret_value::GetSecretValueError;

    use super::*;

    #[test]
    fn an_answer_that_could_not_be_read_is_never_shown() {
        let body = r#"{"SecretString": "sk-canary-in-the-body"}"#.to_owned();
        let error = SdkError::<GetSecretValueError, String>::response_error("unexpected field", body);
        let reason = reason(&error);
        assert_eq!(reason, "the answer could not be read");
        // What this guards against: the SDK's own rendering prints the raw answer.
        let sdk_words = aws_sdk_secretsmanager::error::DisplayErrorContext(&error).to_string();
        assert!(sdk_words.contains("sk-canary"), "{sdk_words}");
    }
}
