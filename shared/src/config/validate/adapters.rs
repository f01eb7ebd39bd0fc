//! The gateway's adapters: `store`, `audit` and `telemetry`, each a kind and the keys
//! of that kind (a key of another kind is refused, naming it); and the serverless
//! shape's platform limits, said at load as warnings.

use std::path::PathBuf;

use super::super::raw::{RawAudit, RawSinkKind, RawStore, RawStoreKind, RawStoreSync, RawTelemetry};
use super::super::values::base_url;
use super::super::*;
use super::Checker;

const DEFAULT_LEDGER_PATH: &str = "./flexway-ledger";
/// Lambda's request payload limit (function URL and API Gateway alike): 6 MB.
const LAMBDA_MAX_REQUEST_BYTES: u64 = 6 * 1024 * 1024;

impl Checker<'_> {
    pub(super) fn store(&mut self, raw: Option<RawStore>) -> Option<StoreConfig> {
        let Some(RawStore { kind, path, table, sync }) = raw else {
            return Some(StoreConfig::Embedded {
                path: PathBuf::from(DEFAULT_LEDGER_PATH),
                sync: LedgerSync::default(),
            });
        };
        let kind = self.required("store.kind", kind, "(embedded | memory | dynamodb)")?;
        let (has_path, has_table, has_sync) = (path.is_some(), table.is_some(), sync.is_some());
        match kind {
            RawStoreKind::Embedded => {
                self.refuse("store", "table", has_table, "store kind embedded", "kind dynamodb");
                let path = self.non_empty("store.path", path, "(the ledger directory of kind embedded)")?;
                let sync = match sync {
                    None | Some(RawStoreSync::Interval) => LedgerSync::Interval,
                    Some(RawStoreSync::Reservation) => LedgerSync::Reservation,
                };
                Some(StoreConfig::Embedded { path: path.into(), sync })
            }
            RawStoreKind::Memory => {
                self.refuse("store", "path", has_path, "store kind memory", "kind embedded");
                self.refuse("store", "table", has_table, "store kind memory", "kind dynamodb");
                self.refuse("store", "sync", has_sync, "store kind memory", "kind embedded");
                Some(StoreConfig::Memory)
            }
            RawStoreKind::Dynamodb => {
                self.refuse("store", "path", has_path, "store kind dynamodb", "kind embedded");
                self.refuse("store", "sync", has_sync, "store kind dynamodb", "kind embedded");
                let table = self.non_empty("store.table", table, "(the DynamoDB table of kind dynamodb)")?;
                Some(StoreConfig::DynamoDb { table })
            }
        }
    }

    pub(super) fn audit(&mut self, raw: Option<RawAudit>) -> Option<AuditConfig> {
        let Some(RawAudit { sink, path, log_group, log_stream, hash_salt, chain_key }) = raw else {
            self.unsalted_audit();
            return Some(AuditConfig { sink: AuditSinkConfig::Stdout, hash_salt: None, chain_key: None });
        };
        let here = |sink: &str| format!("audit sink {sink}");
        let (has_path, has_group, has_stream) = (path.is_some(), log_group.is_some(), log_stream.is_some());
        let sink = match sink.unwrap_or(RawSinkKind::Stdout) {
            RawSinkKind::File => {
                self.refuse("audit", "log_group", has_group, &here("file"), "sink cloudwatch");
                self.refuse("audit", "log_stream", has_stream, &here("file"), "sink cloudwatch");
                self.non_empty("audit.path", path, "(the JSONL file of sink file)")
                    .map(|path| AuditSinkConfig::File { path: path.into() })
            }
            RawSinkKind::Stdout => {
                self.refuse("audit", "path", has_path, &here("stdout"), "sink file");
                self.refuse("audit", "log_group", has_group, &here("stdout"), "sink cloudwatch");
                self.refuse("audit", "log_stream", has_stream, &here("stdout"), "sink cloudwatch");
                Some(AuditSinkConfig::Stdout)
            }
            RawSinkKind::Cloudwatch => {
                self.refuse("audit", "path", has_path, &here("cloudwatch"), "sink file");
                self.non_empty("audit.log_group", log_group, "(the log group of sink cloudwatch)")
                    .map(|log_group| AuditSinkConfig::CloudWatch { log_group, log_stream })
            }
        };
        let hash_salt = match &hash_salt {
            Some(salt) => Some(self.secret("audit.hash_salt", salt)?),
            None => {
                self.unsalted_audit();
                None
            }
        };
        let chain_key = match &chain_key {
            Some(key) => Some(self.secret("audit.chain_key", key)?),
            None => None,
        };
        Some(AuditConfig { sink: sink?, hash_salt, chain_key })
    }

    pub(super) fn telemetry(&mut self, raw: RawTelemetry) -> Option<TelemetryConfig> {
        let RawTelemetry { otlp_endpoint, export_interval } = raw;
        let export_interval = self.duration(
            "telemetry.export_interval",
            export_interval.as_ref(),
            TelemetryConfig::DEFAULT_EXPORT_INTERVAL,
        );
        let url = self.non_empty("telemetry.otlp_endpoint", otlp_endpoint, "(the collector's base URL)")?;
        let parsed = base_url(&url).map_err(|m| self.error("telemetry.otlp_endpoint", m)).ok()?;
        if parsed.scheme != "http" && parsed.scheme != "https" {
            self.error(
                "telemetry.otlp_endpoint",
                format!("`{url}` is not http(s): OTLP/HTTP is sent over http or https"),
            );
            return None;
        }
        Some(TelemetryConfig { otlp_endpoint: parsed.with_scheme(&parsed.scheme), export_interval })
    }

    /// Without a salt, the identifiers the audit hashes (the caller's key, the
    /// request's `user`) are plain SHA-256: a short `user` value is reversed by
    /// hashing a dictionary of candidates.
    fn unsalted_audit(&mut self) {
        self.warn(
            "audit.hash_salt",
            "not set: identifiers in the audit (keys, end users) are hashed without a salt, so short values \
             such as user names can be recovered by hashing guesses; set a secret reference \
             (env:NAME or file:PATH) to a random value",
        );
    }

    /// The serverless shape's platform limits that change a guarantee (ARCHITECTURE.md,
    /// "Deployment shapes"): said at load, as warnings, never found in an incident. The
    /// shape is recognised by its adapters (a DynamoDB ledger or a CloudWatch audit).
    pub(super) fn platform_limits(&mut self, store: &StoreConfig, audit: &AuditConfig, ai: &Ai) {
        let serverless =
            matches!(store, StoreConfig::DynamoDb { .. }) || matches!(audit.sink, AuditSinkConfig::CloudWatch { .. });
        if !serverless {
            return;
        }
        if ai.vision.max_body_bytes > LAMBDA_MAX_REQUEST_BYTES {
            self.warn(
                "ai.vision.max_body_bytes",
                format!(
                    "{} bytes is more than the 6 MB ({LAMBDA_MAX_REQUEST_BYTES} bytes) request payload Lambda accepts: \
                     in the serverless shape the effective body limit is 6 MB (including the event envelope), \
                     and a larger request is refused by the platform before Flexway sees it",
                    ai.vision.max_body_bytes
                ),
            );
        }
        for backend in ai.backends.values() {
            if backend.capabilities.contains(&Capability::Realtime) && backend.kind.endpoint().is_some() {
                self.warn(
                    format!("ai.backends.{}.capabilities", backend.name),
                    "realtime sessions are not served by the serverless shape (a function URL cannot hold a \
                     WebSocket): /v1/realtime is refused there; serve this backend's sessions with `flexway serve`",
                );
            }
            if matches!(backend.kind, BackendKind::Grpc { .. }) {
                self.warn(
                    format!("ai.backends.{}", backend.name),
                    "no native gRPC through a Lambda function URL (gRPC-Web only): in the serverless shape \
                     callers of this backend must use gRPC-Web, and its client and bidirectional streaming \
                     methods are refused (the function URL buffers the request body)",
                );
            }
        }
    }
}
