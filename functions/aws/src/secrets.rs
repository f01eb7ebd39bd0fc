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
        self.sdk.get_or_init(aws_config::load_from_env).await
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
                let output = client.get_secret_value().secret_id(arn).send().await.map_err(|e| {
                    unavailable(format!("Secrets Manager: {}", aws_sdk_secretsmanager::error::DisplayErrorContext(&e)))
                })?;
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

#[async_trait::async_trait]
impl SecretSource for AwsSecretSource {
    async fn resolve(&self, reference: &SecretRef) -> Result<Secret, SecretError> {
        match reference {
            SecretRef::AwsArn(arn) => self.resolve_arn(reference, arn).await,
            SecretRef::Env(_) | SecretRef::File(_) => self.local.resolve(reference).await,
        }
    }
}
