//! Secret references by ARN in the local shape: the real `flexway serve` resolves a
//! Secrets Manager secret and an SSM SecureString parameter at start, with the AWS
//! SDK's usual environment (here the emulator's: `AWS_ENDPOINT_URL`, default
//! http://127.0.0.1:4566; `scripts/test` starts it), sends them to the backends, and
//! picks up a rotation at the next `secrets.refresh`. A reference that does not exist
//! stops the start naming it. No emulator answering is a failure, never a skip.
// The binary resolves ARNs only when built with the `aws` feature (scripts/test builds it).
#![cfg(test)]
#![cfg(feature = "aws")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use flexway_testkit::emulator;

use std::time::{Duration, Instant};

use flexway_testkit::*;

fn start(yaml: &str) -> Flexway {
    let env = emulator::process_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Flexway::start_with_env(yaml, &env)
}

/// A new Secrets Manager secret holding `value`: its ARN.
async fn secret(sdk: &aws_config::SdkConfig, value: &str) -> String {
    let client = aws_sdk_secretsmanager::Client::new(sdk);
    let name = emulator::unique("flexway-backend-key");
    let created = client.create_secret().name(name).secret_string(value).send().await.unwrap();
    created.arn().unwrap().to_owned()
}

/// A new SSM SecureString parameter holding `value`: its ARN.
async fn parameter(sdk: &aws_config::SdkConfig, value: &str) -> String {
    let client = aws_sdk_ssm::Client::new(sdk);
    let name = format!("/flexway/{}", emulator::unique("backend-key"));
    let put = client.put_parameter().name(&name).value(value);
    put.r#type(aws_sdk_ssm::types::ParameterType::SecureString).send().await.unwrap();
    let got = client.get_parameter().name(&name).send().await.unwrap();
    got.parameter().and_then(|p| p.arn()).unwrap().to_owned()
}

/// Tenant acme (KEY) on backend `sm` (bearer from a Secrets Manager secret), tenant
/// globex (OTHER_KEY) on backend `ssm` (an `api-key` header from an SSM parameter);
/// the audit salt from `salt`.
fn two_backends(url: &str, sm: &str, ssm: &str, salt: &str, refresh: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
audit: {{sink: stdout, hash_salt: "{salt}"}}
secrets: {{refresh: {refresh}}}
tenants:
  acme:
    keys: [{{sha256: {acme}}}]
  globex:
    keys: [{{sha256: {globex}}}]
    backend: ssm
ai:
  default_backend: sm
  backends:
    sm:
      url: {url}
      auth: {{type: bearer, secret: "{sm}"}}
      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 1}}
    ssm:
      url: {url}
      auth: {{type: header, name: api-key, secret: "{ssm}"}}
      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 1}}
"#,
        acme = sha(KEY),
        globex = sha(OTHER_KEY),
    )
}

fn last_header(model: &FakeModel, name: &str) -> Option<String> {
    model.requests().last().and_then(|r| r.header(name).map(str::to_owned))
}

#[tokio::test]
async fn serve_resolves_secrets_manager_and_ssm_references_at_start() {
    let sdk = emulator::sdk().await;
    let model = FakeModel::start().await.unwrap();
    let sm = secret(&sdk, "sk-from-secrets-manager").await;
    let ssm = parameter(&sdk, "sk-from-ssm").await;
    let salt = secret(&sdk, "a-salt-from-secrets-manager").await;
    let gw = start(&two_backends(&model.url(), &sm, &ssm, &salt, "5m"));

    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    assert_eq!(last_header(&model, "authorization").as_deref(), Some("Bearer sk-from-secrets-manager"));
    assert_eq!(gw.chat(OTHER_KEY, hello("m")).await.status(), 200);
    assert_eq!(last_header(&model, "api-key").as_deref(), Some("sk-from-ssm"));
    let logs = gw.logs();
    assert!(!logs.contains("sk-from") && !logs.contains("a-salt"), "a secret reached the logs: {logs}");
}

#[tokio::test]
async fn serve_refuses_to_start_on_a_reference_that_does_not_exist_naming_it() {
    let sdk = emulator::sdk().await;
    let sm = secret(&sdk, "sk-canary-present").await;
    let missing = format!("arn:aws:ssm:us-east-1:123456789012:parameter/flexway/{}", emulator::unique("missing"));
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("flexway.yaml");
    std::fs::write(&config, two_backends("http://127.0.0.1:9/v1", &sm, &missing, "env:SALT", "5m")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .envs(emulator::process_env())
        .env("SALT", "pepper")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !stderr.contains("listening"), "{stderr}");
    let error = stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(error.contains(&format!("ai.backends.ssm.auth.secret: secret {missing}: SSM: ")), "{error}");
    assert!(!stderr.contains("sk-canary"), "a value was shown: {stderr}");

    // `validate --resolve-secrets` says the same, and resolves the ones that exist.
    let validate = |config: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_flexway"))
            .args(["validate", "--resolve-secrets", "--config"])
            .arg(config)
            .envs(emulator::process_env())
            .env("SALT", "pepper")
            .output()
            .unwrap()
    };
    let out = validate(&config);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("ai.backends.ssm.auth.secret: secret {missing}")), "{stderr}");
    let present = parameter(&sdk, "sk-canary-ssm").await;
    std::fs::write(&config, two_backends("http://127.0.0.1:9/v1", &sm, &present, "env:SALT", "5m")).unwrap();
    let out = validate(&config);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("ok (0 warning(s))"), "{stdout}\n{stderr}");
    assert!(!stdout.contains("canary") && !stderr.contains("canary"));
}

#[tokio::test]
async fn a_rotated_secret_is_used_after_the_next_refresh() {
    let sdk = emulator::sdk().await;
    let model = FakeModel::start().await.unwrap();
    let sm = secret(&sdk, "sk-before-rotation").await;
    let ssm = parameter(&sdk, "sk-ssm-before").await;
    let salt = secret(&sdk, "a-salt").await;
    let gw = start(&two_backends(&model.url(), &sm, &ssm, &salt, "1s"));
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    assert_eq!(last_header(&model, "authorization").as_deref(), Some("Bearer sk-before-rotation"));

    let secrets = aws_sdk_secretsmanager::Client::new(&sdk);
    secrets.put_secret_value().secret_id(&sm).secret_string("sk-after-rotation").send().await.unwrap();
    let ssm_client = aws_sdk_ssm::Client::new(&sdk);
    let name = ssm.split_once(":parameter").unwrap().1;
    let put = ssm_client.put_parameter().name(name).value("sk-ssm-after").overwrite(true);
    put.r#type(aws_sdk_ssm::types::ParameterType::SecureString).send().await.unwrap();

    // Within a few refreshes (1s each), both backends send the new values.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
        let bearer = last_header(&model, "authorization");
        assert_eq!(gw.chat(OTHER_KEY, hello("m")).await.status(), 200);
        let header = last_header(&model, "api-key");
        if bearer.as_deref() == Some("Bearer sk-after-rotation") && header.as_deref() == Some("sk-ssm-after") {
            break;
        }
        assert!(Instant::now() < deadline, "not picked up: {bearer:?}, {header:?}\n{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A refresh that fails (the secret is gone) keeps the last value, and says so. The
    // salt is never refreshed: its deletion goes unnoticed.
    secrets.delete_secret().secret_id(&salt).force_delete_without_recovery(true).send().await.unwrap();
    secrets.delete_secret().secret_id(&sm).force_delete_without_recovery(true).send().await.unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    assert_eq!(last_header(&model, "authorization").as_deref(), Some("Bearer sk-after-rotation"));
    let failed = gw.log_line(&["secret refresh: ai.backends.sm.auth.secret"]).await;
    let logs = gw.logs();
    assert!(failed.contains(&sm) && failed.contains("keeps the last value"), "{failed}");
    assert!(!logs.contains(&salt), "the salt was refreshed: {logs}");
    assert!(!logs.contains("sk-after") && !logs.contains("sk-before"), "a secret reached the logs");
}
