//! The emulator endpoint the serverless tests run against: `AWS_ENDPOINT_URL`
//! (default http://127.0.0.1:4566, where `localstack/start` puts LocalStack or moto),
//! region us-east-1, dummy credentials unless real ones are set. An endpoint that does
//! not answer fails the test with the way to start one: these tests never pass by
//! skipping.

use aws_config::{Region, SdkConfig};
use aws_sdk_dynamodb::config::Credentials;

pub fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".to_owned())
}

/// The SDK configuration for the emulator; panics with instructions when it does not answer.
pub async fn sdk() -> SdkConfig {
    let endpoint = endpoint();
    let authority = endpoint.split("://").nth(1).unwrap_or(&endpoint).trim_end_matches('/').to_owned();
    if let Err(e) = tokio::net::TcpStream::connect(&authority).await {
        panic!(
            "no AWS emulator answers at {endpoint} ({e}): start one with `localstack/start` \
             (moto's server or LocalStack), or set AWS_ENDPOINT_URL; scripts/test does both"
        );
    }
    let key = std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|_| "test".to_owned());
    let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "test".to_owned());
    flexway_aws::sdk_loader()
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(Credentials::new(key, secret, None, None, "flexway-tests"))
        .load()
        .await
}

/// The emulator as a child process's AWS environment (as `scripts/test` exports it),
/// for the binaries the tests start.
pub fn process_env() -> Vec<(&'static str, String)> {
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| "test".to_owned());
    vec![
        ("AWS_ENDPOINT_URL", endpoint()),
        ("AWS_REGION", "us-east-1".to_owned()),
        ("AWS_ACCESS_KEY_ID", var("AWS_ACCESS_KEY_ID")),
        ("AWS_SECRET_ACCESS_KEY", var("AWS_SECRET_ACCESS_KEY")),
        ("AWS_EC2_METADATA_DISABLED", "true".to_owned()),
    ]
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}
