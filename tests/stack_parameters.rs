//! `flexway validate --serverless`: the stack parameters a config's ARN references
//! need, printed for `sam deploy --parameter-overrides`, or given ones checked; and
//! `infra/Makefile`, which checks `STACK_PARAMETERS` before it packages the config.
#![cfg(test)]

use std::path::{Path, PathBuf};
use std::process::Command;

const REGION_ACCOUNT: &str = "eu-west-1:123456789012";

fn secret(name: &str) -> String {
    format!("arn:aws:secretsmanager:{REGION_ACCOUNT}:secret:{name}")
}

fn parameter(name: &str) -> String {
    format!("arn:aws:ssm:{REGION_ACCOUNT}:parameter/{name}")
}

/// A serverless config: the audit salt in SSM, `full` by a full Secrets Manager ARN,
/// `partial` by one without its suffix, `mtls` with its client certificate and key in
/// SSM, `local` by an environment variable, and `full`'s usage API admin key in
/// Secrets Manager.
fn serverless_config() -> String {
    format!(
        "version: 1
store: {{kind: dynamodb, table: flexway-ledger}}
audit: {{sink: cloudwatch, log_group: /flexway/audit, hash_salt: \"{salt}\"}}
ai:
  default_backend: full
  backends:
    full:
      url: https://api.openai.com/v1
      auth: {{type: bearer, secret: \"{openai}\"}}
      price: {{input_per_mtok_eur: 2.0, output_per_mtok_eur: 8.0}}
      default_model: gpt-4.1
      usage_api: {{kind: openai, secret: \"{admin}\"}}
    partial:
      url: https://partial.example.net/v1
      auth: {{type: header, name: api-key, secret: \"{partial}\"}}
      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 1.0}}
    mtls:
      url: https://mtls.example.net/v1
      tls: {{cert: \"{cert}\", key: \"{key}\"}}
      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 1.0}}
    local:
      url: https://local.example.net/v1
      auth: {{type: bearer, secret: \"env:LOCAL_KEY\"}}
      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 1.0}}
",
        salt = parameter("flexway/audit-salt"),
        openai = secret("flexway/openai-AbCdEf"),
        admin = secret("flexway/openai-admin-Gh1jK2"),
        partial = secret("flexway/partial"),
        cert = parameter("flexway/mtls-cert"),
        key = parameter("flexway/mtls-key"),
    )
}

/// What `serverless_config` needs, in the order `validate --serverless` prints it:
/// the audit's references, then the backends' by name; no cache table.
fn needed() -> String {
    format!(
        "SecretsManagerArns={},{}-?????? SsmParameterArns={},{},{} UsageApiSecretArns={} CacheStore=none",
        secret("flexway/openai-AbCdEf"),
        secret("flexway/partial"),
        parameter("flexway/audit-salt"),
        parameter("flexway/mtls-cert"),
        parameter("flexway/mtls-key"),
        secret("flexway/openai-admin-Gh1jK2"),
    )
}

struct Run {
    ok: bool,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn validate(yaml: &str, args: &[&str]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flexway.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["validate", "--config", path.to_str().unwrap()])
        .args(args)
        .env_remove("LOCAL_KEY")
        .output()
        .unwrap();
    Run {
        ok: out.status.success(),
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn errors(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("error:")).collect()
}

#[test]
fn prints_the_parameters_each_kind_of_reference_needs_and_nothing_else() {
    let run = validate(&serverless_config(), &["--serverless"]);
    assert!(run.ok, "{}", run.stderr);
    // stdout is the parameters alone: `params="$(flexway validate ...)"`.
    assert_eq!(run.stdout, format!("{}\n", needed()));
    assert!(!run.stdout.contains("env:") && !run.stdout.contains("LOCAL_KEY"), "{}", run.stdout);
    assert!(run.stderr.contains("flexway.yaml: ok ("), "{}", run.stderr);
}

#[test]
fn a_config_of_env_references_needs_every_parameter_empty() {
    let yaml = "version: 1
store: {kind: dynamodb, table: flexway-ledger}
audit: {sink: cloudwatch, log_group: /flexway/audit, hash_salt: \"env:SALT\"}
ai:
  default_backend: a
  backends:
    a: {url: \"https://a.example\", auth: {type: bearer, secret: \"env:LOCAL_KEY\"}, price: {input_per_mtok_eur: 1, output_per_mtok_eur: 1}}
";
    let run = validate(yaml, &["--serverless"]);
    assert!(run.ok, "{}", run.stderr);
    // Every one given, empty: a parameter left out would keep its previous value.
    assert_eq!(run.stdout, "SecretsManagerArns=\"\" SsmParameterArns=\"\" UsageApiSecretArns=\"\" CacheStore=none\n");
    let checked = validate(yaml, &["--serverless", "--stack-parameters", run.stdout.trim()]);
    assert!(checked.ok, "{}", checked.stderr);
}

#[test]
fn the_printed_parameters_pass_their_own_check() {
    let run = validate(&serverless_config(), &["--serverless", "--stack-parameters", &needed()]);
    assert!(run.ok, "{}", run.stderr);
    assert!(run.stdout.contains("ok (") && !run.stdout.contains("SecretsManagerArns"), "{}", run.stdout);
    assert!(!run.stderr.contains("--stack-parameters"), "no pattern is unused: {}", run.stderr);
}

#[test]
fn a_reference_left_out_fails_with_its_path_arn_and_parameter() {
    // The same string, the usage API's admin key and one SSM parameter left out.
    let given = needed()
        .replace(&format!(",{}", parameter("flexway/mtls-key")), "")
        .replace(&secret("flexway/openai-admin-Gh1jK2"), &secret("flexway/other-Zz9Yy8"));
    let run = validate(&serverless_config(), &["--serverless", "--stack-parameters", &given]);
    assert!(!run.ok);
    assert_eq!(run.code, Some(1));
    assert!(run.stdout.is_empty(), "{}", run.stdout);
    let errors = errors(&run.stderr);
    assert_eq!(errors.len(), 2, "{}", run.stderr);
    let key =
        errors.iter().find(|l| l.contains("ai.backends.mtls.tls.key")).unwrap_or_else(|| panic!("{}", run.stderr));
    assert!(key.contains(&parameter("flexway/mtls-key")) && key.contains("SsmParameterArns"), "{key}");
    assert!(key.contains("gateway's role"), "{key}");
    let admin = errors
        .iter()
        .find(|l| l.contains("ai.backends.full.usage_api.secret"))
        .unwrap_or_else(|| panic!("{}", run.stderr));
    assert!(admin.contains(&secret("flexway/openai-admin-Gh1jK2")) && admin.contains("UsageApiSecretArns"), "{admin}");
    assert!(admin.contains("reconcile function's role"), "{admin}");
    assert!(run.stderr.contains("flexway.yaml: 2 error(s)"), "{}", run.stderr);
    // The pattern that covers nothing the config names is said too.
    assert!(
        run.stderr.lines().any(|l| l.starts_with("warning:") && l.contains("flexway/other-Zz9Yy8")),
        "{}",
        run.stderr
    );
}

#[test]
fn a_parameter_not_given_covers_nothing() {
    let given = format!("SecretsManagerArns={}", secret("*"));
    let run = validate(&serverless_config(), &["--serverless", "--stack-parameters", &given]);
    assert!(!run.ok);
    let errors = errors(&run.stderr);
    // The salt, the certificate and the key in SSM; the admin key.
    assert_eq!(errors.len(), 4, "{}", run.stderr);
    assert!(
        errors
            .iter()
            .any(|l| l.contains("audit.hash_salt") && l.contains("SsmParameterArns (not among the stack parameters)")),
        "{}",
        run.stderr
    );
}

#[test]
fn a_suffix_pattern_covers_the_full_arn_and_the_partial_one() {
    let patterns = format!(
        "SecretsManagerArns={},{} SsmParameterArns={} UsageApiSecretArns={}",
        secret("flexway/openai-??????"),
        secret("flexway/partial-??????"),
        parameter("flexway/*"),
        secret("flexway/openai-admin-??????"),
    );
    let run = validate(&serverless_config(), &["--serverless", "--stack-parameters", &patterns]);
    assert!(run.ok, "{}", run.stderr);

    // A partial reference names no suffix: the name alone is not what IAM checks.
    let bare = patterns.replace(&secret("flexway/partial-??????"), &secret("flexway/partial"));
    let run = validate(&serverless_config(), &["--serverless", "--stack-parameters", &bare]);
    assert!(!run.ok);
    let errors = errors(&run.stderr);
    assert_eq!(errors.len(), 1, "{}", run.stderr);
    assert!(errors[0].contains("ai.backends.partial.auth.secret"), "{}", errors[0]);
    assert!(errors[0].contains(&format!("list {}-??????", secret("flexway/partial"))), "{}", errors[0]);
}

/// A response cache kept in DynamoDB is the stack's cache table, which only
/// `CacheStore=dynamodb` creates and lets the gateway use.
#[test]
fn a_dynamodb_cache_needs_the_stacks_cache_table() {
    let cached = serverless_config().replace(
        "ai:\n",
        "ai:
  cache:
    store: {kind: dynamodb, table: flexway-cache}
    key: \"env:FLEXWAY_CACHE_KEY\"
    policies: {faq: {mode: exact, ttl: 1h}}
    models: {gpt-4.1: faq}
",
    );
    let run = validate(&cached, &["--serverless"]);
    assert!(run.ok, "{}", run.stderr);
    let with_table = needed().replace("CacheStore=none", "CacheStore=dynamodb");
    assert_eq!(run.stdout, format!("{with_table}\n"));
    let run = validate(&cached, &["--serverless", "--stack-parameters", &with_table]);
    assert!(run.ok, "{}", run.stderr);

    // Without the table, or without saying: the gateway could not reach it.
    let without = needed().replace(" CacheStore=none", "");
    for given in [needed(), without] {
        let run = validate(&cached, &["--serverless", "--stack-parameters", &given]);
        assert!(!run.ok, "{given}");
        let errors = errors(&run.stderr);
        assert_eq!(errors.len(), 1, "{}", run.stderr);
        assert!(errors[0].contains("ai.cache.store") && errors[0].contains("CacheStore=dynamodb"), "{}", errors[0]);
    }

    // A table the config does not use is said, not refused.
    let run = validate(&serverless_config(), &["--serverless", "--stack-parameters", &with_table]);
    assert!(run.ok, "{}", run.stderr);
    assert!(
        run.stderr.lines().any(|l| l.starts_with("warning:") && l.contains("CacheStore=dynamodb")),
        "{}",
        run.stderr
    );
}

#[test]
fn a_local_config_is_not_a_serverless_one() {
    let yaml = "version: 1
store: {kind: embedded, path: ./ledger}
audit: {sink: file, path: ./audit.jsonl}
ai:
  default_backend: a
  backends:
    a: {url: \"https://a.example\", price: {input_per_mtok_eur: 1, output_per_mtok_eur: 1}}
";
    let run = validate(yaml, &["--serverless"]);
    assert!(!run.ok);
    assert!(run.stdout.is_empty(), "no parameters for a config that cannot be deployed: {}", run.stdout);
    let errors = errors(&run.stderr);
    assert!(errors.iter().any(|l| l.contains("store.kind") && l.contains("dynamodb")), "{}", run.stderr);
    assert!(errors.iter().any(|l| l.contains("audit.sink") && l.contains("cloudwatch")), "{}", run.stderr);
    // Without --serverless it is a valid config, as before.
    assert!(validate(yaml, &[]).ok);
}

#[test]
fn a_usage_api_key_in_ssm_is_refused() {
    let yaml = serverless_config().replace(&secret("flexway/openai-admin-Gh1jK2"), &parameter("flexway/admin"));
    let run = validate(&yaml, &["--serverless"]);
    assert!(!run.ok);
    let errors = errors(&run.stderr);
    assert_eq!(errors.len(), 1, "{}", run.stderr);
    assert!(
        errors[0].contains("ai.backends.full.usage_api.secret") && errors[0].contains("Secrets Manager"),
        "{}",
        errors[0]
    );
}

#[test]
fn malformed_stack_parameters_are_a_usage_error() {
    let run = validate(&serverless_config(), &["--serverless", "--stack-parameters", "SecretsManagerArns"]);
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(run.stderr.contains("--stack-parameters") && run.stderr.contains("NAME=VALUE"), "{}", run.stderr);
    let run = validate(&serverless_config(), &["--stack-parameters", &needed()]);
    assert_eq!(run.code, Some(2), "--stack-parameters needs --serverless: {}", run.stderr);
}

/// `infra/Makefile`'s gateway and reconcile targets, as `sam build` runs them: the
/// config checked against `STACK_PARAMETERS` when it is set, validated only when not.
#[test]
fn the_build_checks_the_stack_parameters_when_they_are_given() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let workspace = tempfile::tempdir().unwrap();
    for function in ["flexway-gateway", "flexway-reconcile"] {
        let bootstrap = workspace.path().join(format!("target/lambda/{function}/bootstrap"));
        std::fs::create_dir_all(bootstrap.parent().unwrap()).unwrap();
        std::fs::write(&bootstrap, b"the function").unwrap();
    }
    let config = workspace.path().join("flexway.yaml");
    std::fs::write(&config, serverless_config()).unwrap();
    let build = |target: &str, parameters: Option<&str>| {
        let artifacts = tempfile::tempdir().unwrap();
        let mut make = Command::new("make");
        make.arg("-C")
            .arg(workspace.path())
            .arg("-f")
            .arg(root.join("infra/Makefile"))
            .arg(target)
            .arg(format!("ARTIFACTS_DIR={}", artifacts.path().display()))
            .arg(format!("FLEXWAY_YAML={}", config.display()))
            .arg(format!("FLEXWAY={}", env!("CARGO_BIN_EXE_flexway")))
            .env_remove("STACK_PARAMETERS");
        // As `STACK_PARAMETERS="$params" sam build` passes it: in the environment.
        if let Some(parameters) = parameters {
            make.env("STACK_PARAMETERS", parameters);
        }
        let output = make.output().unwrap();
        let packaged: Vec<PathBuf> = std::fs::read_dir(artifacts.path()).unwrap().map(|e| e.unwrap().path()).collect();
        (output, packaged.len())
    };
    let short = needed().replace(&format!("{},", secret("flexway/openai-AbCdEf")), "");
    for target in ["build-GatewayFunction", "build-ReconcileFunction"] {
        let (output, packaged) = build(target, Some(&needed()));
        assert!(output.status.success(), "{target}: {}", String::from_utf8_lossy(&output.stderr));
        assert_eq!(packaged, 2, "{target}");

        let (output, packaged) = build(target, Some(&short));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{target}: a config the roles cannot read was packaged");
        assert!(
            stderr.contains("ai.backends.full.auth.secret")
                && stderr.contains(&secret("flexway/openai-AbCdEf"))
                && stderr.contains("SecretsManagerArns"),
            "{target}: {stderr}"
        );
        assert_eq!(packaged, 0, "{target}");

        let (output, packaged) = build(target, None);
        assert!(output.status.success(), "{target}: validated only: {}", String::from_utf8_lossy(&output.stderr));
        assert_eq!(packaged, 2, "{target}");
    }
}
