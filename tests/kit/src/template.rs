//! `infra/template.yaml` as AWS receives it: transformed by the SAM translator
//! (`infra/transform`), offline, as JSON. The translator is Python (the SAM CLI's
//! package, which `scripts/test` installs into `.venv`); a test that needs it fails,
//! saying how to install it, when it cannot run: never skipped.

use std::path::{Path, PathBuf};

/// The repository's root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The template the tests read: `FLEXWAY_TEMPLATE` (a mutated copy, to check that a
/// test fails on what it guards), else `infra/template.yaml`.
pub fn path() -> PathBuf {
    match std::env::var_os("FLEXWAY_TEMPLATE") {
        Some(path) => path.into(),
        None => workspace().join("infra/template.yaml"),
    }
}

/// `PYTHON`, else the workspace's `.venv/bin/python`.
pub fn python() -> PathBuf {
    match std::env::var_os("PYTHON") {
        Some(python) => python.into(),
        None => workspace().join(".venv/bin/python"),
    }
}

/// The transformed template: `infra/transform` run on [`path`] with `args` (`Name=Value`
/// parameters; `--template PATH` for another template).
pub fn transformed(args: &[&str]) -> serde_json::Value {
    let python = python();
    let script = workspace().join("infra/transform");
    let mut command = std::process::Command::new(&python);
    command.arg(&script);
    if !args.contains(&"--template") {
        command.arg("--template").arg(path());
    }
    let output = command.args(args).output().unwrap_or_else(|e| {
        panic!(
            "cannot run {} {} ({e}): set PYTHON to a Python with the SAM translator, or install it as \
             scripts/test does (python3 -m venv .venv && .venv/bin/pip install -r localstack/requirements.txt)",
            python.display(),
            script.display()
        )
    });
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "infra/transform {args:?} failed ({}): {stderr}", output.status);
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("infra/transform {args:?} printed no JSON ({e}); stderr: {stderr}"))
}
