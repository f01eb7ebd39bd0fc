//! `flexway.yaml`: read, checked, and turned into the [`Config`] the gateway runs on.
//!
//! Loading has two phases. `raw` reads the YAML into structs that mirror the
//! document key for key (unknown keys are errors); `validate` turns them into the
//! types of [`model`], resolving every reference and refusing what SPEC.md says is
//! "refused at load". Both phases collect every problem they find rather than stopping
//! at the first, and each problem carries its path in the document
//! (`ai.backends.ptu-west.auth.secret`), so an operator fixes a file in one pass.
//!
//! A configuration is operator input that CI may run on pull requests: before any of
//! that, [`bounds`] refuses a document whose size, nesting or aliases exceed what a
//! configuration needs, before building it, and the errors listed stop at
//! [`MAX_LISTED_ERRORS`] (the rest are counted).
//!
//! Invariants: a [`Config`] only exists if it passed every rule; a secret never
//! enters the config, only a reference to it, and no message ever echoes a value
//! given where a secret reference was expected.

pub mod bounds;
pub mod contract;
pub mod mcp;
pub mod model;

mod descriptor;
mod duration;
mod raw;
mod shape;
mod validate;
mod values;

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

pub use duration::parse_duration;
pub use mcp::{Mcp, McpNarrowing, McpOauth, McpPrice, McpServer, ToolGlobs};
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

impl<T: EnvSource + ?Sized> EnvSource for &T {
    fn var(&self, name: &str) -> Option<String> {
        (**self).var(name)
    }
}

impl EnvSource for HashMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

/// What loading does with a local secret reference (`env:`, `file:`).
///
/// Its form is always checked. Whether it resolves is the question: a gateway about
/// to start needs every secret now, while a config repository's CI holds none of
/// them and still wants the rest of the file judged. An AWS reference is checked for
/// its form only: loading makes no network call; the gateway's secret source resolves
/// it when it starts (`crate::secret`), and so does `flexway validate
/// --resolve-secrets`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Secrets {
    /// Form only: an unset variable or an unreadable file is a warning (`flexway
    /// validate`). The [`Config`] is for reading, not for serving.
    Check,
    /// Every local reference resolves here and now, or it is an error (`serve`, the
    /// Lambda function, `flexway validate --resolve-secrets`).
    Resolve,
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

/// Errors listed at most: a document with thousands of errors is fixed from the
/// first ones, and the list must not grow with a hostile document.
pub const MAX_LISTED_ERRORS: usize = 100;

/// A configuration that did not load, with every error found (never empty), or the
/// first [`MAX_LISTED_ERRORS`] of them and how many more there are.
#[derive(thiserror::Error, Debug)]
#[error("{}", render_errors(.file.as_deref(), .errors, *.unlisted))]
pub struct ConfigError {
    pub file: Option<PathBuf>,
    pub errors: Vec<Diagnostic>,
    /// Errors found beyond those in `errors`.
    pub unlisted: usize,
}

impl ConfigError {
    /// Keeps the first [`MAX_LISTED_ERRORS`] of `errors`; `unlisted` more were found.
    fn new(mut errors: Vec<Diagnostic>, unlisted: usize) -> ConfigError {
        let over = errors.len().saturating_sub(MAX_LISTED_ERRORS);
        errors.truncate(MAX_LISTED_ERRORS);
        ConfigError { file: None, errors, unlisted: unlisted + over }
    }

    fn whole_file(file: &Path, message: String) -> ConfigError {
        ConfigError { file: Some(file.to_path_buf()), errors: vec![Diagnostic::new("", message)], unlisted: 0 }
    }

    /// Every error found, listed or not.
    pub fn count(&self) -> usize {
        self.errors.len() + self.unlisted
    }

    /// "... and 11900 more errors", when some are not listed.
    pub fn unlisted_line(&self) -> Option<String> {
        (self.unlisted > 0).then(|| format!("... and {} more error(s), not listed", self.unlisted))
    }
}

fn render_errors(file: Option<&Path>, errors: &[Diagnostic], unlisted: usize) -> String {
    let mut lines: Vec<String> = errors
        .iter()
        .map(|error| match file {
            Some(file) => format!("{}: {error}", file.display()),
            None => error.to_string(),
        })
        .collect();
    if unlisted > 0 {
        lines.push(format!("... and {unlisted} more error(s), not listed"));
    }
    lines.join("\n")
}

/// Reads and loads a configuration file, every local secret reference resolvable
/// ([`Secrets::Resolve`]). Relative paths inside it (store, secrets,
/// descriptor sets, TLS files) are left as written: they resolve against the
/// process's working directory, not the file's.
///
/// A file over [`bounds::MAX_BYTES`] is refused unread when its metadata says so,
/// else after reading one byte more than that (it may be a pipe).
pub fn load_file(path: &Path, env: &dyn EnvSource) -> Result<Loaded, ConfigError> {
    load_file_with(path, env, Secrets::Resolve)
}

/// [`load_file`], with secret references checked as `secrets` says.
pub fn load_file_with(path: &Path, env: &dyn EnvSource, secrets: Secrets) -> Result<Loaded, ConfigError> {
    let cannot_read = |e: std::io::Error| ConfigError::whole_file(path, format!("cannot read the file: {e}"));
    let file = std::fs::File::open(path).map_err(cannot_read)?;
    if let Ok(metadata) = file.metadata()
        && let Err(too_large) = bounds::check_size(usize::try_from(metadata.len()).unwrap_or(usize::MAX))
    {
        return Err(ConfigError::whole_file(path, too_large.message));
    }
    let mut bytes = Vec::new();
    file.take(bounds::MAX_BYTES as u64 + 1).read_to_end(&mut bytes).map_err(cannot_read)?;
    if let Err(too_large) = bounds::check_size(bytes.len()) {
        return Err(ConfigError::whole_file(path, too_large.message));
    }
    let text = String::from_utf8(bytes).map_err(|_| {
        cannot_read(std::io::Error::new(std::io::ErrorKind::InvalidData, "stream did not contain valid UTF-8"))
    })?;
    load_str_with(&text, env, secrets).map_err(|error| ConfigError { file: Some(path.to_path_buf()), ..error })
}

/// Loads a configuration from its YAML text.
///
/// Errors of shape (unknown keys, wrong types) and errors of rules are reported
/// together. Rules are not applied inside a part of the document that lost an entry
/// to a shape error: they would only repeat it ("required") or guess.
///
/// Every local secret reference must resolve ([`Secrets::Resolve`]): this is the load
/// of a gateway about to start.
pub fn load_str(text: &str, env: &dyn EnvSource) -> Result<Loaded, ConfigError> {
    load_str_with(text, env, Secrets::Resolve)
}

/// [`load_str`], with secret references checked as `secrets` says.
pub fn load_str_with(text: &str, env: &dyn EnvSource, secrets: Secrets) -> Result<Loaded, ConfigError> {
    let parsed = raw::parse(text, MAX_LISTED_ERRORS).map_err(|refused| ConfigError::new(vec![refused], 0))?;
    let mut loaded =
        validate::validate(parsed, env, secrets).map_err(|(errors, unlisted)| ConfigError::new(errors, unlisted))?;
    loaded.config.sha256 = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(text.as_bytes()));
    Ok(loaded)
}

/// The JSON Schema of `flexway.yaml`, generated from the raw types (the document's
/// shape; the cross-references and value rules are `flexway validate`'s job).
pub fn json_schema() -> serde_json::Value {
    schemars::schema_for!(raw::RawConfig).to_value()
}
