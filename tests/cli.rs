//! The command line: `validate`, `key new`, `serve`'s shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;

use common::*;

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
    let slow = model.scenario_url(&Scenario { delay_ms: Some(1500), ..Default::default() });
    let mut gw = Flexway::start(&one_backend(&slow));
    let url = gw.url.clone();
    let in_flight = tokio::spawn(async move {
        client().post(format!("{url}/v1/chat/completions")).bearer_auth(KEY).json(&hello("m")).send().await
    });
    while model.request_count() == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    gw.interrupt();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let refused = client().get(format!("{}/healthz", gw.url)).send().await;
    assert!(refused.is_err(), "no new connection after the signal: {refused:?}");
    let answered = in_flight.await.unwrap().unwrap();
    assert_eq!(answered.status(), 200, "the call in flight is finished, not cut");
    assert!(answered.headers().contains_key("flexway-request-id"));
    let status = gw.wait_exit(std::time::Duration::from_secs(10)).expect("flexway exits once its calls are done");
    assert!(status.success(), "{status:?}");
}
