//! The fleet's configuration in S3 (SPEC §12): `flexway serve --config s3://bucket/key
//! --watch` reads it at start and polls it by ETag, so one upload reaches every
//! process; on the AWS emulator (`AWS_ENDPOINT_URL`; `scripts/test` starts one).
// The binary reaches AWS only when built with the `aws` feature (scripts/test builds it).
#![cfg(test)]
#![cfg(feature = "aws")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use flexway_testkit::emulator;

use std::time::{Duration, Instant};

use aws_sdk_s3::primitives::ByteStream;
use flexway_testkit::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_follow_one_object_in_s3() {
    let sdk = emulator::sdk().await;
    let s3 = aws_sdk_s3::Client::from_conf(aws_sdk_s3::config::Builder::from(&sdk).force_path_style(true).build());
    let bucket = emulator::unique("flexway-config");
    s3.create_bucket().bucket(&bucket).send().await.unwrap();
    let upload = |text: String| {
        s3.put_object().bucket(&bucket).key("gateway/flexway.yaml").body(ByteStream::from(text.into_bytes())).send()
    };
    let model = FakeModel::start().await.unwrap();
    let first = reloadable_config(KEY, &model.url());
    upload(first.clone()).await.unwrap();

    let env = emulator::process_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let url = format!("s3://{bucket}/gateway/flexway.yaml");
    // The harness writes a local file too; `--config` given again names the object.
    let start = || Flexway::start_with_env_and_args(&first, &env, &["--config", &url, "--watch", "200ms"]);
    let fleet = [start(), start()];
    for gw in &fleet {
        assert_eq!(gw.served_sha().await, sha(&first), "{}", gw.logs());
        assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    }

    let second = reloadable_config("sk-test-acme-rotated", &model.url());
    upload(second.clone()).await.unwrap();
    for gw in &fleet {
        let deadline = Instant::now() + Duration::from_secs(20);
        while gw.served_sha().await != sha(&second) {
            assert!(Instant::now() < deadline, "never reloaded from S3: {}", gw.logs());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(gw.chat(KEY, hello("m")).await.status(), 401, "the revoked key, on every process");
        assert_eq!(gw.chat("sk-test-acme-rotated", hello("m")).await.status(), 200);
    }
    // Polled by ETag: an unchanged object is not loaded again.
    tokio::time::sleep(Duration::from_millis(600)).await;
    for gw in &fleet {
        assert_eq!(gw.logs().matches("configuration reloaded").count(), 1, "{}", gw.logs());
    }

    // An invalid upload is refused by each, which serves on.
    upload("version: 1\nai: {}\n".to_owned()).await.unwrap();
    for gw in &fleet {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !gw.logs().contains("reload refused") {
            assert!(Instant::now() < deadline, "{}", gw.logs());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(gw.served_sha().await, sha(&second));
    }
}
