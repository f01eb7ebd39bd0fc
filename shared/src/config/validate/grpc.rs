//! A `grpc` backend's descriptor set, read at load: what the backend serves and how
//! each method is metered. A set that cannot be used is an error; one that does not
//! exist yet is a warning (it is often shipped apart from the config).

use std::path::PathBuf;

use super::super::descriptor;
use super::super::*;
use super::Checker;

/// A descriptor set larger than this is not one an operator meant.
const MAX_DESCRIPTOR_SET_BYTES: u64 = 16 * 1024 * 1024;

impl Checker<'_> {
    /// The descriptor set, read now: what the backend serves and how each method is
    /// metered. A file that cannot be used is an error. One that does not exist is a
    /// warning, because the set is often built and shipped apart from the config (the
    /// SPEC's example names one): the gateway itself does not start without it
    /// (`Gateway::new`).
    pub(super) fn descriptor_set(
        &mut self,
        path: &str,
        name: &str,
        raw: Option<String>,
    ) -> Option<(PathBuf, GrpcServices)> {
        let key_path = format!("{path}.descriptor_set");
        let file =
            self.non_empty(&key_path, raw, "for a grpc backend (the FileDescriptorSet of the services it serves)")?;
        let bytes = match std::fs::metadata(&file).and_then(|meta| {
            if meta.len() > MAX_DESCRIPTOR_SET_BYTES {
                return Ok(Err(format!(
                    "{file} is {} bytes, more than a descriptor set needs ({MAX_DESCRIPTOR_SET_BYTES})",
                    meta.len()
                )));
            }
            if !meta.is_file() {
                return Ok(Err(format!("{file} is not a file")));
            }
            std::fs::read(&file).map(Ok)
        }) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let message = format!(
                    "{file} does not exist: gRPC calls to backend {name} will be refused until it does \
                     (flexway serve and the Lambda function do not start without it)"
                );
                self.warn(&key_path, message);
                return Some((PathBuf::from(file), GrpcServices::default()));
            }
            Err(e) => Err(format!("{file} cannot be read: {e}")),
            Ok(result) => result,
        };
        let bytes = bytes.map_err(|message| self.error(&key_path, message)).ok()?;
        if bytes.is_empty() {
            self.error(&key_path, format!("{file} is empty: it must be a serialized FileDescriptorSet"));
            return None;
        }
        match descriptor::services(&bytes) {
            Ok(services) => Some((PathBuf::from(file), services)),
            Err(reasons) => {
                for reason in reasons {
                    self.error(&key_path, format!("{file}: {reason}"));
                }
                None
            }
        }
    }
}
