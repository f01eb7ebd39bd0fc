//! `flexway.yaml`: read, checked, and turned into the [`Config`] the gateway runs on.
//!
//! Loading has two phases. `raw` reads the YAML into structs that mirror the
//! document key for key (unknown keys are errors); `validate` turns them into the
//! types of [`model`], resolving every reference and refusing what SPEC.md says is
//! "refused at load". Both phases collect every problem they find rather than stopping
//! at the first, and each problem carries its path in the document
//! (`ai.backends.ptu-west.auth.secret`), so an operator fixes a file in one pass.
//!
//! Invariants: a [`Config`] only exists if it passed every rule; a secret never
//! enters the config, only a reference to it, and no message ever echoes a value
//! given where a secret reference was expected.

pub mod model;

mod duration;
mod raw;
mod validate;
mod values;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

pub use duration::parse_duration;
pub use model::*;

/// Where environment variables come from: the process, or a map in tests.
pub trait EnvSource {
    fn var(&self, name: &str) -> Option<String>;
}

/// The process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl EnvSource for HashMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

/// One problem found in a configuration, where it is and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// Path in the document (`tenants.acme.keys[1].agent`); empty for the whole file.
    pub path: String,
    pub message: String,
}

impl Diagnostic {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Diagnostic { path: path.into(), message: message.into() }
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() { f.write_str(&self.message) } else { write!(f, "{}: {}", self.path, self.message) }
    }
}

/// A configuration that loaded, and what deserves the operator's attention in it.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub warnings: Vec<Diagnostic>,
}

/// A configuration that did not load, with every error found (never empty).
#[derive(thiserror::Error, Debug)]
#[error("{}", render_errors(.file.as_deref(), .errors))]
pub struct ConfigError {
    pub file: Option<PathBuf>,
    pub errors: Vec<Diagnostic>,
}

fn render_errors(file: Option<&Path>, errors: &[Diagnostic]) -> String {
    let lines: Vec<String> = errors
        .iter()
        .map(|error| match file {
            Some(file) => format!("{}: {error}", file.display()),
            None => error.to_string(),
        })
        .collect();
    lines.join("\n")
}

/// Reads and loads a configuration file. Relative paths inside it (store, secrets,
/// descriptor sets, TLS files) are left as written: they resolve against the
/// process's working directory, not the file's.
pub fn load_file(path: &Path, env: &dyn EnvSource) -> Result<Loaded, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: Some(path.to_path_buf()),
        errors: vec![Diagnostic::new("", format!("cannot read the file: {e}"))],
    })?;
    load_str(&text, env).map_err(|error| ConfigError { file: Some(path.to_path_buf()), ..error })
}

/// Loads a configuration from its YAML text.
///
/// Errors of shape (unknown keys, wrong types) and errors of rules are reported
/// together. Rules are not applied inside a part of the document that lost an entry
/// to a shape error: they would only repeat it ("required") or guess.
pub fn load_str(text: &str, env: &dyn EnvSource) -> Result<Loaded, ConfigError> {
    let parsed = raw::parse(text).map_err(|errors| ConfigError { file: None, errors })?;
    validate::validate(parsed, env).map_err(|errors| ConfigError { file: None, errors })
}

/// The JSON Schema of `flexway.yaml`, generated from the raw types (the document's
/// shape; the cross-references and value rules are `flexway validate`'s job).
pub fn json_schema() -> serde_json::Value {
    schemars::schema_for!(raw::RawConfig).to_value()
}
