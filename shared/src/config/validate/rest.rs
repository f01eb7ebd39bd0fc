//! A `kind: http` backend's REST keys: its `mount` and its OpenAPI contract, read at
//! load (every refusal names the file and the operation). No mount overlaps the
//! gateway's own paths or another backend's.

use std::collections::BTreeMap;

use super::super::*;
use super::Checker;

/// An OpenAPI contract larger than this is not one an operator meant.
const MAX_CONTRACT_BYTES: u64 = 16 * 1024 * 1024;
/// The paths the gateway serves itself: no REST mount may overlap them.
const GATEWAY_PATHS: [&str; 4] = ["/v1", "/metrics", "/healthz", "/console"];

impl Checker<'_> {
    /// `mount`: an absolute path of segments, without a trailing `/` (overlaps with
    /// the gateway's own paths and other mounts are checked once all are read).
    pub(super) fn mount(&mut self, path: &str, raw: Option<String>) -> Option<String> {
        let key_path = format!("{path}.mount");
        let mount =
            self.non_empty(&key_path, raw, "for an http backend (where its operations are served, e.g. /apis/ocr)")?;
        let segments_ok = mount.starts_with('/')
            && mount.len() > 1
            && !mount.ends_with('/')
            && mount[1..]
                .split('/')
                .all(|s| !s.is_empty() && s != "." && s != ".." && !s.contains(['{', '}', '?', '#']));
        if !segments_ok {
            self.error(key_path, format!("`{mount}` is not an absolute path of segments (e.g. /apis/ocr)"));
            return None;
        }
        Some(mount)
    }

    /// The contract, read now: the operations served and how each is metered. Every
    /// refusal names the file and the operation.
    pub(super) fn contract(&mut self, path: &str, raw: Option<String>) -> Option<Contract> {
        let key_path = format!("{path}.contract");
        let file = self.non_empty(&key_path, raw, "for an http backend (its OpenAPI 3.0 or 3.1 contract)")?;
        let text = match std::fs::metadata(&file) {
            Ok(meta) if meta.len() > MAX_CONTRACT_BYTES => {
                self.error(
                    key_path,
                    format!("{file} is {} bytes, more than a contract needs ({MAX_CONTRACT_BYTES})", meta.len()),
                );
                return None;
            }
            _ => match std::fs::read_to_string(&file) {
                Ok(text) => text,
                Err(e) => {
                    self.error(key_path, format!("cannot read {file}: {e}"));
                    return None;
                }
            },
        };
        match super::super::contract::read(&text) {
            Ok(contract) => Some(contract),
            Err(reasons) => {
                for reason in reasons {
                    self.error(&key_path, format!("{file} {reason}"));
                }
                None
            }
        }
    }

    /// REST mounts (SPEC §10): none over the gateway's own paths, none over another
    /// (one mount a prefix of the other, by whole segments).
    pub(super) fn mounts(&mut self, backends: &BTreeMap<BackendId, Backend>) {
        let within = |inner: &str, outer: &str| {
            inner == outer || inner.strip_prefix(outer).is_some_and(|rest| rest.starts_with('/'))
        };
        let mounts: Vec<(&BackendId, &str)> = backends
            .iter()
            .filter_map(|(name, b)| match &b.kind {
                BackendKind::Http { mount, .. } => Some((name, mount.as_str())),
                _ => None,
            })
            .collect();
        for (i, (name, mount)) in mounts.iter().enumerate() {
            let path = format!("ai.backends.{name}.mount");
            if let Some(own) = GATEWAY_PATHS.iter().find(|own| within(mount, own) || within(own, mount)) {
                self.error(&path, format!("`{mount}` overlaps the gateway's own {own}"));
            }
            for (other, other_mount) in &mounts[..i] {
                if within(mount, other_mount) || within(other_mount, mount) {
                    self.error(&path, format!("`{mount}` overlaps `{other_mount}`, the mount of backend `{other}`"));
                }
            }
        }
    }
}
