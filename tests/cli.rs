//! The command line: `validate`, `key new`, what `serve` says at start, and its shutdown.
#![cfg(test)]

use flexway_testkit::golden as support;

use std::process::{Command, Stdio};

use flexway_testkit::*;
use support::laughs;

fn flexway(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_flexway"));
    command.args(args);
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn spec_example() -> String {
    format!("{}/config/flexway.yaml", env!("CARGO_MANIFEST_DIR"))
}

const SPEC_ENV: [(&str, &str); 4] =
    [("PTU_WEST_KEY", "k1"), ("PAYG_WEST_KEY", "k2"), ("PAYG_NORTH_KEY", "k3"), ("FLEXWAY_AUDIT_SALT", "salt")];

#[test]
fn validate_accepts_the_spec_example() {
    let (ok, stdout, stderr) = flexway(&["validate", "--config", &spec_example()], &SPEC_ENV);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("ok"));
}

#[test]
fn validate_lists_every_error_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.yaml");
    let yaml = "version: 1\ntenants:\n  acme:\n    keys: [{sha256: nothex}]\n    backend: ghost\nai:\n  default_backend: missing\n  backends:\n    a: {url: \"http://x\", colour: red}\n";
    std::fs::write(&path, yaml).unwrap();
    let (ok, _, stderr) = flexway(&["validate", "--config", path.to_str().unwrap()], &[]);
    assert!(!ok);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert!(errors.len() >= 3, "{stderr}");
    assert!(stderr.contains("ai.backends.a"), "{stderr}");
    assert!(stderr.contains("bad.yaml"), "errors name the file: {stderr}");
}

#[test]
fn validate_warns_about_a_locally_metered_relay() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.yaml");
    let yaml = "version: 1\nai:\n  default_backend: up\n  backends:\n    up: {kind: relay, url: \"https://peer.example\", metering: local}\n";
    std::fs::write(&path, yaml).unwrap();
    let (ok, _, stderr) = flexway(&["validate", "--config", path.to_str().unwrap()], &[]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("warning") && stderr.contains("up"), "{stderr}");
}

#[test]
fn validate_warns_when_audit_hash_salt_is_absent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unsalted.yaml");
    let yaml = "version: 1\naudit: {sink: stdout}\nai:\n  default_backend: a\n  backends:\n    a: {url: \"https://a.example\", price: {input_per_mtok_eur: 1, output_per_mtok_eur: 1}}\n";
    std::fs::write(&path, yaml).unwrap();
    let (ok, stdout, stderr) = flexway(&["validate", "--config", path.to_str().unwrap()], &[]);
    assert!(ok, "a warning, not an error: {stderr}");
    assert!(stdout.contains("ok (1 warning(s))"), "{stdout}");
    let warning = stderr
        .lines()
        .find(|l| l.starts_with("warning:") && l.contains("audit.hash_salt"))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(warning.contains("without a salt"), "{warning}");

    let salted = yaml.replace("{sink: stdout}", "{sink: stdout, hash_salt: \"env:SALT\"}");
    std::fs::write(&path, salted).unwrap();
    let (ok, stdout, stderr) = flexway(&["validate", "--config", path.to_str().unwrap()], &[("SALT", "pepper")]);
    assert!(ok && stdout.contains("ok (0 warning(s))"), "{stdout}\n{stderr}");
}

#[test]
fn serve_logs_the_unsalted_audit_warning_at_start() {
    let gw = Flexway::start(
        "version: 1\nstore: {kind: memory}\nai:\n  default_backend: a\n  backends:\n    a: {url: \"http://127.0.0.1:9\"}\n",
    );
    let logs = gw.logs();
    assert!(logs.lines().any(|l| l.contains("WARN") && l.contains("audit.hash_salt")), "{logs}");
}

/// `flexway` with `args` and no environment but `env`: a variable a test expects unset
/// cannot leak in from the shell that runs the tests.
fn flexway_in_clean_env(args: &[&str], env: &[(&str, &str)]) -> (std::process::ExitStatus, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_flexway"));
    command.args(args).env_clear().envs(env.iter().copied());
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // `serve` would run until stopped if it started: stop it, and let the test fail.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    if child.try_wait().unwrap().is_none() {
        child.kill().unwrap();
    }
    let out = child.wait_with_output().unwrap();
    (out.status, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A config whose one backend authenticates with `secret`.
fn with_secret(dir: &std::path::Path, secret: &str) -> String {
    let path = dir.join("secrets.yaml");
    let yaml = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: stdout, hash_salt: \"env:SALT\"}}\nai:\n  default_backend: a\n  backends:\n    a:\n      url: \"http://127.0.0.1:9\"\n      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 1}}\n      auth: {{type: bearer, secret: \"{secret}\"}}\n"
    );
    std::fs::write(&path, yaml).unwrap();
    path.to_str().unwrap().to_owned()
}

fn line<'a>(stderr: &'a str, prefix: &str, needle: &str) -> &'a str {
    stderr.lines().find(|l| l.starts_with(prefix) && l.contains(needle)).unwrap_or_else(|| panic!("{stderr}"))
}

const SALT: (&str, &str) = ("SALT", "pepper");

#[test]
fn validate_warns_about_an_unset_variable_and_resolve_secrets_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = with_secret(dir.path(), "env:BACKEND_A_KEY");

    let (status, stdout, stderr) = flexway_in_clean_env(&["validate", "--config", &config], &[SALT]);
    assert!(status.success(), "a warning, not an error: {stderr}");
    assert!(stdout.contains("ok (1 warning(s))"), "{stdout}");
    let warning = line(&stderr, "warning:", "ai.backends.a.auth.secret");
    assert!(warning.contains("secrets.yaml") && warning.contains("BACKEND_A_KEY is not set"), "{warning}");

    let (status, _, stderr) = flexway_in_clean_env(&["validate", "--config", &config, "--resolve-secrets"], &[SALT]);
    assert!(!status.success(), "{stderr}");
    let error = line(&stderr, "error:", "ai.backends.a.auth.secret");
    assert!(error.contains("BACKEND_A_KEY is not set"), "{error}");

    // Set, it resolves; its value is never printed.
    let set = [SALT, ("BACKEND_A_KEY", "sk-canary-31337")];
    let (status, stdout, stderr) = flexway_in_clean_env(&["validate", "--config", &config, "--resolve-secrets"], &set);
    assert!(status.success() && stdout.contains("ok (0 warning(s))"), "{stdout}\n{stderr}");
    assert!(!stdout.contains("canary") && !stderr.contains("canary"));
}

#[test]
fn validate_warns_about_an_unreadable_file_and_resolve_secrets_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-key");
    let config = with_secret(dir.path(), &format!("file:{}", missing.display()));

    let (status, _, stderr) = flexway_in_clean_env(&["validate", "--config", &config], &[SALT]);
    assert!(status.success(), "{stderr}");
    let warning = line(&stderr, "warning:", "ai.backends.a.auth.secret");
    assert!(warning.contains(&format!("{} cannot be read", missing.display())), "{warning}");

    let (status, _, stderr) = flexway_in_clean_env(&["validate", "--config", &config, "--resolve-secrets"], &[SALT]);
    assert!(!status.success(), "{stderr}");
    assert!(line(&stderr, "error:", "ai.backends.a.auth.secret").contains("cannot be read"), "{stderr}");

    std::fs::write(&missing, "sk-canary-31337\n").unwrap();
    let (status, stdout, stderr) =
        flexway_in_clean_env(&["validate", "--config", &config, "--resolve-secrets"], &[SALT]);
    assert!(status.success(), "{stderr}");
    assert!(!stdout.contains("canary") && !stderr.contains("canary"));
}

/// An AWS environment where no AWS answers: dummy credentials, an endpoint nobody
/// listens on, no instance metadata to probe. A resolution fails at once.
const NO_AWS: [(&str, &str); 4] = [
    ("AWS_ACCESS_KEY_ID", "test"),
    ("AWS_SECRET_ACCESS_KEY", "test"),
    ("AWS_ENDPOINT_URL", "http://127.0.0.1:9"),
    ("AWS_EC2_METADATA_DISABLED", "true"),
];

/// Loading makes no network call: validate checks an AWS reference for its form, and
/// `--resolve-secrets` calls AWS for it (tests/secrets_aws.rs, against the emulator,
/// shows it resolving); here no AWS answers, and the error names the reference.
#[test]
#[cfg(feature = "aws")]
fn validate_checks_an_aws_reference_for_form_and_resolve_secrets_calls_aws() {
    let dir = tempfile::tempdir().unwrap();
    let arn = "arn:aws:ssm:eu-west-1:123456789012:parameter/flexway/a";
    let config = with_secret(dir.path(), arn);

    let (status, stdout, stderr) = flexway_in_clean_env(&["validate", "--config", &config], &[SALT]);
    assert!(status.success() && stdout.contains("ok (0 warning(s))"), "{stdout}\n{stderr}");

    let env = [&[SALT][..], &NO_AWS].concat();
    let (status, _, stderr) = flexway_in_clean_env(&["validate", "--config", &config, "--resolve-secrets"], &env);
    assert!(!status.success(), "{stderr}");
    let error = line(&stderr, "error:", "ai.backends.a.auth.secret");
    assert!(error.contains(&format!("secret {arn}: SSM: ")), "{error}");
}

/// Without the `aws` feature the reference still loads (its form is checked), and
/// resolving it says this flexway does not resolve AWS references.
#[test]
#[cfg(not(feature = "aws"))]
fn without_the_aws_feature_an_aws_reference_is_refused_when_resolved() {
    let dir = tempfile::tempdir().unwrap();
    let config = with_secret(dir.path(), "arn:aws:ssm:eu-west-1:123456789012:parameter/flexway/a");
    let (status, stdout, stderr) = flexway_in_clean_env(&["validate", "--config", &config], &[SALT]);
    assert!(status.success() && stdout.contains("ok (0 warning(s))"), "{stdout}\n{stderr}");
    let (status, _, stderr) = flexway_in_clean_env(&["validate", "--config", &config, "--resolve-secrets"], &[SALT]);
    assert!(!status.success(), "{stderr}");
    let error = line(&stderr, "error:", "ai.backends.a.auth.secret");
    assert!(error.contains("does not resolve AWS Secrets Manager or SSM references"), "{error}");
}

#[test]
fn serve_refuses_to_start_when_a_secret_cannot_be_resolved() {
    let dir = tempfile::tempdir().unwrap();
    let unreadable = format!("file:{}", dir.path().join("no-such-key").display());
    for secret in ["env:BACKEND_A_KEY", &unreadable, "arn:aws:ssm:eu-west-1:123456789012:parameter/flexway/a"] {
        let config = with_secret(dir.path(), secret);
        let env = [&[SALT][..], &NO_AWS].concat();
        let (status, _, stderr) =
            flexway_in_clean_env(&["serve", "--config", &config, "--listen", "127.0.0.1:0"], &env);
        assert!(!status.success(), "{secret}: {stderr}");
        assert!(!stderr.contains("listening"), "{secret}: {stderr}");
        line(&stderr, "error:", "ai.backends.a.auth.secret");
    }
}

/// The SPEC example loads in a CI without its secrets (a warning for each of the
/// four), and does not when they must resolve.
#[test]
fn validate_loads_the_spec_example_without_its_secrets() {
    let (status, stdout, stderr) = flexway_in_clean_env(&["validate", "--config", &spec_example()], &[]);
    assert!(status.success(), "{stdout}\n{stderr}");
    for (name, _) in SPEC_ENV {
        line(&stderr, "warning:", &format!("environment variable {name} is not set"));
    }
    let (status, _, stderr) =
        flexway_in_clean_env(&["validate", "--config", &spec_example(), "--resolve-secrets"], &[]);
    assert!(!status.success());
    assert_eq!(stderr.lines().filter(|l| l.starts_with("error:")).count(), SPEC_ENV.len(), "{stderr}");
}

/// `scripts/demo` runs `flexway serve --config config/demo.yaml` from the repository
/// root with nothing set: the demo loads there, salt included, without a warning.
#[test]
fn the_demo_config_loads_with_no_environment() {
    let out = Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["validate", "--config", "config/demo.yaml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_clear()
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("ok (0 warning(s))"), "{stdout}\n{stderr}");
}

/// Runs `flexway validate --config PATH` and answers its exit, stderr and peak
/// resident memory in KiB: GNU time's `%M` where it is installed, else the highest
/// `VmHWM` read from /proc while the process ran (a lower bound, read every ms).
fn validate_with_peak_memory(path: &std::path::Path) -> (bool, String, u64) {
    let binary = env!("CARGO_BIN_EXE_flexway");
    let args = ["validate", "--config", path.to_str().unwrap()];
    if std::path::Path::new("/usr/bin/time").exists() {
        let out = Command::new("/usr/bin/time").args(["-f", "peak-kib=%M", binary]).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let peak = stderr.lines().find_map(|l| l.strip_prefix("peak-kib=")).unwrap().trim().parse().unwrap();
        return (out.status.success(), stderr, peak);
    }
    let mut child = Command::new(binary).args(args).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak = 0;
    while child.try_wait().unwrap().is_none() {
        let status = std::fs::read_to_string(&status_file).unwrap_or_default();
        let hwm = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok());
        peak = peak.max(hwm.unwrap_or(0));
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned(), peak)
}

/// Alias bombs of 10 and 30 KB, which drove `validate` to hundreds of MB (aliases of
/// aliases) and gigabytes (aliases of a long text) before it bounded them: refused
/// before expansion, in the memory of a small document.
#[test]
fn validate_refuses_alias_bombs_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    // Half the text in four copies of one string, half in aliases of it.
    let text = |bytes: usize| laughs(bytes / 2, 5, &format!("'{}'", "x".repeat(bytes / 8)));
    for (name, bomb) in [
        ("laughs-10k.yaml", laughs(10_000, 10, "lol")),
        ("laughs-30k.yaml", laughs(30_000, 10, "lol")),
        ("text-10k.yaml", text(10_000)),
        ("text-30k.yaml", text(30_000)),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, &bomb).unwrap();
        let kb = if name.contains("10k") { 10_000 } else { 30_000 };
        assert!((kb * 9 / 10..kb * 11 / 10).contains(&bomb.len()), "{name}: {} bytes", bomb.len());
        let (ok, stderr, peak_kib) = validate_with_peak_memory(&path);
        assert!(!ok, "{name}: {stderr}");
        assert!(stderr.contains("YAML aliases would expand the document"), "{name}: {stderr}");
        assert!(peak_kib < 100 * 1024, "{name}: peak {peak_kib} KiB");
    }
}

#[tokio::test]
async fn key_new_prints_a_key_whose_config_line_authenticates() {
    let (ok, stdout, _) = flexway(&["key", "new", "--tenant", "acme", "--agent", "bot"], &[]);
    assert!(ok);
    let key = stdout.lines().find_map(|l| l.strip_prefix("key: ")).unwrap().to_owned();
    let line = stdout.lines().find(|l| l.contains("sha256:")).unwrap();
    assert!(line.contains("agent: bot"));
    assert!(line.contains(&sha(&key)));
    let (_, again, _) = flexway(&["key", "new", "--tenant", "acme"], &[]);
    assert!(!again.contains(&key), "every key is new");

    let model = FakeModel::start().await.unwrap();
    let yaml = format!(
        "version: 1\nstore: {{kind: memory}}\ntenants:\n  acme:\n    keys:\n    {}\n    agents:\n      bot: {{}}\nai:\n  default_backend: main\n  backends:\n    main: {{url: \"{}\"}}\n",
        line.trim(),
        model.url()
    );
    let gw = Flexway::start(&yaml);
    assert_eq!(gw.chat(&key, hello("m")).await.status(), 200);
}

#[tokio::test]
async fn serve_finishes_the_calls_in_flight_on_ctrl_c_then_exits() {
    let model = FakeModel::start().await.unwrap();
    let slow = model.scenario_url(&Scenario { delay_ms: Some(3000), ..Default::default() });
    let mut gw = Flexway::start(&one_backend(&slow));
    let url = gw.url.clone();
    let in_flight = tokio::spawn(async move {
        client().post(format!("{url}/v1/chat/completions")).bearer_auth(KEY).json(&hello("m")).send().await
    });
    while model.request_count() == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    gw.interrupt();
    // The listener closes once the signal is handled, while the call is in flight.
    let mut refused = Ok(());
    for _ in 0..100 {
        refused = client().get(format!("{}/healthz", gw.url)).send().await.map(drop);
        if refused.is_err() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(refused.is_err(), "no new connection after the signal");
    assert!(!in_flight.is_finished(), "the listener closed before the call in flight ended");
    let answered = in_flight.await.unwrap().unwrap();
    assert_eq!(answered.status(), 200, "the call in flight is finished, not cut");
    assert!(answered.headers().contains_key("flexway-request-id"));
    let status = gw.wait_exit(std::time::Duration::from_secs(10)).expect("flexway exits once its calls are done");
    assert!(status.success(), "{status:?}");
}
