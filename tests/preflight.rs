//! `infra/preflight`, the check before a first deploy, run against the AWS emulator:
//! each case in an account of its own on the emulator (the credentials of a role
//! assumed there), with or without an API Gateway CloudWatch role set. The emulator
//! does not answer `lambda get-account-settings`, so the Lambda figures come from
//! `--settings`, as that command prints them: the decision is what is tested.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

use flexway_testkit::emulator;
use flexway_testkit::template::workspace;
use serde_json::{Value, json};

/// The AWS CLI: the workspace's `.venv/bin/aws` (scripts/test installs it), else `aws`.
fn aws_cli() -> PathBuf {
    let venv = workspace().join(".venv/bin/aws");
    if venv.exists() { venv } else { PathBuf::from("aws") }
}

/// The emulator's environment, for `credentials` when given.
fn environment(credentials: Option<&Value>) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = emulator::process_env().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    env.push(("AWS_DEFAULT_REGION".into(), "us-east-1".into()));
    env.push(("AWS_CLI".into(), aws_cli().display().to_string()));
    if let Some(credentials) = credentials {
        env.retain(|(k, _)| !k.starts_with("AWS_ACCESS_KEY_ID") && !k.starts_with("AWS_SECRET_ACCESS_KEY"));
        for (name, field) in [
            ("AWS_ACCESS_KEY_ID", "AccessKeyId"),
            ("AWS_SECRET_ACCESS_KEY", "SecretAccessKey"),
            ("AWS_SESSION_TOKEN", "SessionToken"),
        ] {
            env.push((name.into(), credentials[field].as_str().unwrap().to_owned()));
        }
    }
    env
}

fn aws(env: &[(String, String)], args: &[&str]) -> Value {
    let output = Command::new(aws_cli())
        .args(args)
        .args(["--output", "json"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap_or_else(|e| panic!("cannot run the AWS CLI {} ({e}): scripts/test installs it", aws_cli().display()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "aws {args:?}: {stderr}");
    serde_json::from_slice(&output.stdout).unwrap_or(Value::Null)
}

/// A new account of the emulator's, as a first deploy meets it; with an API Gateway
/// CloudWatch role set when `log_role` names one.
struct Account {
    env: Vec<(String, String)>,
    id: String,
}

impl Account {
    fn new(log_role: bool) -> Account {
        let digits: String = uuid::Uuid::new_v4().as_u128().to_string().chars().take(12).collect();
        let id = format!("{digits:0>12}");
        let role = format!("arn:aws:iam::{id}:role/flexway-preflight");
        let assumed =
            aws(&environment(None), &["sts", "assume-role", "--role-arn", &role, "--role-session-name", "preflight"]);
        let env = environment(Some(&assumed["Credentials"]));
        let identity = aws(&env, &["sts", "get-caller-identity"]);
        assert_eq!(identity["Account"], id.as_str(), "the emulator keeps no account of its own for an assumed role");
        if log_role {
            let value = format!("op=replace,path=/cloudwatchRoleArn,value=arn:aws:iam::{id}:role/apigateway-logs");
            aws(&env, &["apigateway", "update-account", "--patch-operations", &value]);
        }
        Account { env, id }
    }

    /// `infra/preflight --settings <the figures> args`: its exit code and output.
    fn preflight(&self, quota: u64, unreserved: u64, args: &[&str]) -> (i32, String) {
        let settings = json!({
            "AccountLimit": {
                "TotalCodeSize": 80_530_636_800u64, "CodeSizeUnzipped": 262_144_000, "CodeSizeZipped": 52_428_800,
                "ConcurrentExecutions": quota, "UnreservedConcurrentExecutions": unreserved
            },
            "AccountUsage": {"TotalCodeSize": 0, "FunctionCount": 0}
        });
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), serde_json::to_string_pretty(&settings).unwrap()).unwrap();
        let output = Command::new(workspace().join("infra/preflight"))
            .arg("--settings")
            .arg(file.path())
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        (output.status.code().unwrap(), text)
    }
}

/// A new account: a concurrency quota of 10, no API Gateway CloudWatch role. The
/// template's defaults fit it (nothing reserved, the role created); a reservation of
/// either function cannot, and the preflight says what to deploy with instead.
#[test]
fn a_new_account_deploys_with_the_defaults_and_no_reservation() {
    let account = Account::new(false);
    let (code, out) = account.preflight(10, 10, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("quota 10, 10 unreserved; API Gateway CloudWatch role: none"), "{out}");
    assert!(out.contains("ApiGatewayAccountLogRole=create makes one"), "{out}");
    assert!(
        out.contains("SweeperReservedConcurrency=0 ApiGatewayAccountLogRole=create PublicFunctionUrl=true"),
        "{out}"
    );

    for reserving in ["SweeperReservedConcurrency=1", "GatewayReservedConcurrency=5"] {
        let (code, out) = account.preflight(10, 10, &[reserving]);
        assert_eq!(code, 1, "{reserving}: {out}");
        assert!(
            out.contains("needs: quota 10: GatewayReservedConcurrency + SweeperReservedConcurrency must be 0"),
            "{reserving}: {out}"
        );
    }
    let (code, out) = account.preflight(10, 10, &["PublicFunctionUrl=false"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("no function URL: API Gateway only"), "{out}");
}

/// Lambda keeps 100 of the account's executions unreserved: a reservation fits what
/// is unreserved now (other functions' reservations already out of it) less 100.
#[test]
fn reservations_fit_what_is_unreserved_less_the_hundred_lambda_keeps() {
    let account = Account::new(false);
    let (code, out) =
        account.preflight(1000, 1000, &["GatewayReservedConcurrency=899", "SweeperReservedConcurrency=1"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("ok: reserves 900 of the 1000 unreserved executions, leaving 100"), "{out}");
    let (code, out) =
        account.preflight(1000, 1000, &["GatewayReservedConcurrency=900", "SweeperReservedConcurrency=1"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("needs: GatewayReservedConcurrency + SweeperReservedConcurrency is 901: at most 900 fit"),
        "{out}"
    );
    // Other functions of the account reserve 850 of its 1000.
    let (code, out) = account.preflight(1000, 150, &["GatewayReservedConcurrency=51"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("at most 50 fit"), "{out}");
    assert_eq!(account.preflight(1000, 150, &["GatewayReservedConcurrency=50"]).0, 0);
    assert!(!account.preflight(1000, 1000, &[]).1.contains("note: quota"), "a quota of 1000 needs no note");
}

/// An account whose API Gateway already has a CloudWatch role keeps it
/// (`ApiGatewayAccountLogRole=existing`); one without needs the stack to create it.
#[test]
fn the_api_gateway_role_is_created_only_where_the_account_has_none() {
    let with_role = Account::new(true);
    let role = format!("arn:aws:iam::{}:role/apigateway-logs", with_role.id);
    let (code, out) = with_role.preflight(10, 10, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "needs: the account already has an API Gateway CloudWatch role ({role}): deploy with \
             ApiGatewayAccountLogRole=existing"
        )),
        "{out}"
    );
    let (code, out) = with_role.preflight(10, 10, &["ApiGatewayAccountLogRole=existing"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&format!("uses the account's API Gateway CloudWatch role ({role})")), "{out}");

    let without = Account::new(false);
    let (code, out) = without.preflight(10, 10, &["ApiGatewayAccountLogRole=existing"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(
            "needs: the account has no API Gateway CloudWatch role: deploy with ApiGatewayAccountLogRole=create"
        ),
        "{out}"
    );
}

/// A parameter the template does not have, or a value it does not allow, is refused.
#[test]
fn a_misspelled_parameter_or_a_value_the_template_refuses_is_refused() {
    let account = Account::new(false);
    let (code, out) = account.preflight(10, 10, &["SweeperReservedConcurency=0"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("SweeperReservedConcurency: not a parameter of infra/template.yaml"), "{out}");
    let (code, out) = account.preflight(10, 10, &["PublicFunctionUrl=maybe"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("needs: PublicFunctionUrl is true or false"), "{out}");
    let (code, out) = account.preflight(10, 10, &["GatewayReservedConcurrency=ten"]);
    assert_eq!(code, 2, "{out}");
}
