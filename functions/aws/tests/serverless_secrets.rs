//! `AwsSecretSource` against the emulator: a Secrets Manager secret and an SSM
//! SecureString parameter resolved by ARN, a rotated value read anew, and a reference
//! that does not exist refused naming its ARN and never a value.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use flexway_testkit::emulator;

use flexway::config::SecretRef;
use flexway::secret::{SecretError, SecretSource};
use flexway_aws::AwsSecretSource;

/// A new Secrets Manager secret holding `value`: its ARN.
async fn secret(sdk: &aws_config::SdkConfig, value: &str) -> String {
    let client = aws_sdk_secretsmanager::Client::new(sdk);
    let created =
        client.create_secret().name(emulator::unique("flexway-test")).secret_string(value).send().await.unwrap();
    created.arn().unwrap().to_owned()
}

/// A new SSM SecureString parameter holding `value`: its ARN.
async fn parameter(sdk: &aws_config::SdkConfig, value: &str) -> String {
    let client = aws_sdk_ssm::Client::new(sdk);
    let name = format!("/flexway/{}", emulator::unique("test"));
    client
        .put_parameter()
        .name(&name)
        .value(value)
        .r#type(aws_sdk_ssm::types::ParameterType::SecureString)
        .send()
        .await
        .unwrap();
    let described = client.get_parameter().name(&name).send().await.unwrap();
    described.parameter().and_then(|p| p.arn()).unwrap().to_owned()
}

async fn resolve(source: &AwsSecretSource, arn: &str) -> Result<String, SecretError> {
    source.resolve(&SecretRef::AwsArn(arn.to_owned())).await.map(|s| s.expose().to_owned())
}

#[tokio::test]
async fn resolves_a_secrets_manager_secret_by_arn_and_reads_a_rotation() {
    let sdk = emulator::sdk().await;
    let arn = secret(&sdk, "sk-sm-one\n").await;
    let source = AwsSecretSource::new(sdk.clone());
    assert_eq!(resolve(&source, &arn).await.unwrap(), "sk-sm-one");

    let client = aws_sdk_secretsmanager::Client::new(&sdk);
    client.put_secret_value().secret_id(&arn).secret_string("sk-sm-two").send().await.unwrap();
    assert_eq!(resolve(&source, &arn).await.unwrap(), "sk-sm-two");
}

#[tokio::test]
async fn resolves_an_ssm_securestring_parameter_by_arn() {
    let sdk = emulator::sdk().await;
    let arn = parameter(&sdk, "sk-ssm-one").await;
    assert!(arn.starts_with("arn:aws:ssm:us-east-1:") && arn.contains(":parameter/flexway/"), "{arn}");
    let source = AwsSecretSource::new(sdk);
    assert_eq!(resolve(&source, &arn).await.unwrap(), "sk-ssm-one");
}

#[tokio::test]
async fn a_reference_that_does_not_exist_is_refused_naming_its_arn() {
    let sdk = emulator::sdk().await;
    let source = AwsSecretSource::new(sdk);
    let account = "123456789012";
    for arn in [
        format!("arn:aws:secretsmanager:us-east-1:{account}:secret:{}", emulator::unique("missing")),
        format!("arn:aws:ssm:us-east-1:{account}:parameter/flexway/{}", emulator::unique("missing")),
    ] {
        let error = resolve(&source, &arn).await.unwrap_err();
        assert!(matches!(error, SecretError::Unavailable { .. }), "{error:?}");
        let message = error.to_string();
        assert!(message.starts_with(&format!("secret {arn}: ")), "{message}");
        assert!(message.contains("NotFound"), "{message}");
    }
}

#[tokio::test]
async fn env_and_file_references_are_resolved_as_the_local_source_does() {
    let file = std::env::temp_dir().join(emulator::unique("flexway-secret"));
    std::fs::write(&file, "from-a-file\n").unwrap();
    let source = AwsSecretSource::new(emulator::sdk().await);
    let got = source.resolve(&SecretRef::File(file.clone())).await.unwrap();
    assert_eq!(got.expose(), "from-a-file");
    std::fs::remove_file(file).unwrap();
    let missing = source.resolve(&SecretRef::Env(emulator::unique("FLEXWAY_UNSET"))).await;
    assert!(matches!(missing, Err(SecretError::EnvMissing { .. })));
}
