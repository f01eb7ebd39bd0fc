//! `flexway` built without the `aws` feature (the default: the local shape needs no
//! AWS SDK, and builds in about half the time). The same items as `built.rs`, each
//! refusing with how to get it.

use std::sync::Arc;

use flexway::audit::chain::Verifier;
use flexway::audit::report::{Read, Unreadable};
use flexway::audit::{AuditRecord, AuditSink};
use flexway::budget::BudgetStore;
use flexway::config::ProcessEnv;
use flexway::secret::{LocalSecrets, SecretSource};

const NOT_BUILT: &str = "this flexway was built without AWS support; build it with `cargo build --release \
                         --features aws` (the fleet shape, report --log-group, arn: secret references)";

/// No ledger of this kind can exist here: the value is never made.
pub enum Leases {}

impl Leases {
    pub async fn flush(&self) {
        match *self {}
    }
}

pub async fn dynamodb_ledger(table: &str) -> anyhow::Result<(Arc<dyn BudgetStore>, Arc<Leases>)> {
    anyhow::bail!("store: {{kind: dynamodb, table: {table}}}: {NOT_BUILT}")
}

pub async fn dynamodb_cache(table: &str) -> anyhow::Result<Arc<dyn flexway::cache::CacheStore>> {
    anyhow::bail!("ai.cache.store: {{kind: dynamodb, table: {table}}}: {NOT_BUILT}")
}

pub async fn cloudwatch_audit(log_group: &str, _log_stream: Option<&str>) -> anyhow::Result<Arc<dyn AuditSink>> {
    anyhow::bail!("audit: {{sink: cloudwatch, log_group: {log_group}}}: {NOT_BUILT}")
}

/// `env:` and `file:` references; an `arn:` one is refused as unsupported.
pub fn secret_source() -> Arc<dyn SecretSource> {
    Arc::new(LocalSecrets::<ProcessEnv>::default())
}

pub async fn read_log_group(
    group: &str,
    _from: Option<i64>,
    _to: Option<i64>,
    _verifier: Option<&mut Verifier>,
) -> Result<Read, String> {
    Err(format!("--log-group {group}: {NOT_BUILT}"))
}

pub async fn for_each_in_log_group(
    group: &str,
    _from: Option<i64>,
    _to: Option<i64>,
    _each: impl FnMut(Result<AuditRecord, Unreadable>),
) -> Result<(), String> {
    Err(format!("--log-group {group}: {NOT_BUILT}"))
}

pub const WRITE_DELAY_MARGIN_MS: i64 = 0;

pub async fn read_s3(bucket: &str, key: &str, _known: Option<&str>) -> anyhow::Result<Option<(String, String)>> {
    anyhow::bail!("--config s3://{bucket}/{key}: {NOT_BUILT}")
}
