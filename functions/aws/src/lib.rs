//! Flexway's AWS adapters, for the serverless shape: the DynamoDB ledger, the
//! CloudWatch Logs audit sink (and its reader, for `flexway report --log-group`), the
//! secret source that resolves Secrets Manager and SSM references (both shapes use
//! it), and the one function that turns the config's tagged enums into the adapters
//! the core runs on. The core crate (`flexway`) never sees an AWS type; the Lambda binaries
//! (`functions/gateway`, `functions/sweeper`) call [`build_adapters`] once, at init.

mod audit_reader;
/// The response cache's DynamoDB store (SPEC §16, exact policies only).
pub mod cache;
mod cloudwatch;
mod dynamodb;
mod emf;
mod reconcile;
mod secrets;
mod table;

use std::sync::Arc;

use flexway::audit::{AuditError, AuditSink, FileAuditSink, StdoutAuditSink};
use flexway::budget::{
    BudgetStore, EmbeddedBudgetStore, LeasePolicy, LeasedBudgetStore, MemoryBudgetStore, StoreError,
};
use flexway::config::{AuditSinkConfig, Config, StoreConfig};
use flexway::gateway::Adapters;
use flexway::telemetry::Export;

pub use audit_reader::{AuditReadError, WRITE_DELAY_MARGIN_MS, for_each_audit_record, read_audit_log_group};
pub use cache::DynamoDbCacheStore;
pub use cloudwatch::CloudWatchAuditSink;
pub use dynamodb::{DynamoDbBudgetStore, EXPIRY_INDEX, EXPIRY_SHARD};
pub use emf::{DRIFT_METRIC, EmfAuditSink, drift_lines};
pub use reconcile::{ReconcileJobError, Reconciled, UNREADABLE_LISTED, fold_audit, reconcile_days};
pub use secrets::AwsSecretSource;

#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Audit(#[from] AuditError),
}

/// A Lambda function's `main`: its log ([`log_subscriber`] on stderr), a multi-thread
/// runtime, and `run` on it. A runtime that cannot start or an error from `run` is
/// logged, and the exit status says so.
pub fn lambda_main<F, E>(run: impl FnOnce() -> F) -> std::process::ExitCode
where
    F: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    use tracing_subscriber::util::SubscriberInitExt;
    log_subscriber(std::io::stderr).init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!("cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The functions' log: one JSON object a line (the message under `fields.message`, the
/// level under `level`), filtered by `FLEXWAY_LOG`, `info` by default. The template's
/// metric filters read these lines, so its tests print theirs through this too, into a
/// buffer `writer`.
pub fn log_subscriber<W>(writer: W) -> impl tracing::Subscriber + Send + Sync + 'static
where
    W: for<'writer> tracing_subscriber::fmt::MakeWriter<'writer> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FLEXWAY_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(writer)
        .finish()
}

/// The AWS SDK's configuration loader, as `aws_config::defaults` with the latest
/// behavior version, and with its HTTP client on the stack the rest of Flexway uses
/// (hyper 1, rustls with ring): the SDK's own default client would build aws-lc as
/// well. Every binary and test loads its SDK configuration through it.
///
/// With timeouts ([`sdk_timeouts`]): without them a write that hangs holds a call for
/// as long as the function may run. Retrying a write is safe: a reservation is
/// idempotent on its `Put` condition, and the SDK gives each transaction a client request
/// token, so an attempt that was applied and then timed out is answered as applied.
pub fn sdk_loader() -> aws_config::ConfigLoader {
    static CLIENT: std::sync::OnceLock<aws_sdk_dynamodb::config::SharedHttpClient> = std::sync::OnceLock::new();
    let client = CLIENT.get_or_init(|| {
        use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
        aws_smithy_http_client::Builder::new().tls_provider(Provider::Rustls(CryptoMode::Ring)).build_https()
    });
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(client.clone())
        .timeout_config(sdk_timeouts())
}

/// Connecting takes at most 2 s, one attempt 5 s (a DynamoDB write answers in
/// milliseconds, a page of FilterLogEvents in well under that), one operation with
/// its retries 12 s.
pub fn sdk_timeouts() -> aws_config::timeout::TimeoutConfig {
    aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(std::time::Duration::from_secs(2))
        .operation_attempt_timeout(std::time::Duration::from_secs(5))
        .operation_timeout(std::time::Duration::from_secs(12))
        .build()
}

/// The SDK's configuration from the environment (region, credentials, endpoint), as
/// `aws_config::load_from_env` reads it, on [`sdk_loader`]'s client.
pub async fn load_sdk_config() -> aws_config::SdkConfig {
    sdk_loader().load().await
}

/// Budget leases on Lambda: an environment serves one call at a time and may freeze
/// after any response, so each settle renews the lease with its usage (one write of
/// the lease's own item): a frozen environment's lease is charged to the token when it
/// is reclaimed, seconds later.
const LEASES: LeasePolicy = LeasePolicy { intent_every: std::time::Duration::ZERO, ..LeasePolicy::DEFAULT };

/// The audit stream used when the config names none: the execution environment's
/// own stream name (one writer per stream), else `flexway-audit`.
pub fn default_audit_stream() -> String {
    std::env::var("AWS_LAMBDA_LOG_STREAM_NAME").unwrap_or_else(|_| "flexway-audit".to_owned())
}

/// Whether `log_group` is the group Lambda delivers this function's own log to
/// (`AWS_LAMBDA_LOG_GROUP_NAME`, its `LoggingConfig`). Records printed to stdout
/// then reach the audit group with no network write by the function: Lambda ships
/// the log outside the invocation's path, and still ships what was printed when the
/// environment is frozen after the response.
fn is_own_log_group(log_group: &str) -> bool {
    std::env::var("AWS_LAMBDA_LOG_GROUP_NAME").is_ok_and(|own| own == log_group)
}

/// Builds the ledger and the audit sink the config declares, with their SDK clients,
/// and warms each connection (DescribeTable, CreateLogStream) so that the first
/// request does not pay for it. Warming is best effort: a cold start that cannot do
/// it (CreateLogStream is throttled at 50 per second per account, a role may lack
/// DescribeTable) still starts, and the first call that needs the resource does it
/// again or says why it cannot.
///
/// A CloudWatch audit whose group is the function's own log group (the template's
/// `LoggingConfig`) is printed to stdout, one record a line, and Lambda delivers it:
/// nothing between the answer and the client waits on the network. Any other group
/// is written with PutLogEvents (a function deployed with its own log group, the
/// fleet shape). A CloudWatch audit also prints each call's EMF
/// metrics line to stdout (the function's log), where CloudWatch reads metrics.
///
/// The DynamoDB ledger is always served through budget leases (`LeasedBudgetStore`):
/// a tenant's calls write its counters once per lease, not once per call, so one
/// tenant is not capped by one counter item's write rate. Each settle renews the
/// lease with its usage on the lease's own item (`intent_every` zero: one uncontended
/// `UpdateItem`, 1 WCU): an environment frozen or gone after its response leaves a lease
/// that expires seconds later, and that the sweeper, or any environment refused a call,
/// charges to the token and closes. The sweeper function uses the plain store.
pub async fn build_adapters(config: &Config, sdk: &aws_config::SdkConfig) -> Result<Adapters, AdapterError> {
    let budgets: Arc<dyn BudgetStore> = match &config.store {
        StoreConfig::DynamoDb { table } => {
            let store = DynamoDbBudgetStore::new(aws_sdk_dynamodb::Client::new(sdk), table);
            if let Err(e) = store.warm().await {
                tracing::warn!("ledger table {table} not reached at start ({e}); starting anyway");
            }
            LeasedBudgetStore::start(Arc::new(store), LEASES)
        }
        StoreConfig::Memory => Arc::new(MemoryBudgetStore::new()),
        StoreConfig::Embedded { path, sync } => Arc::new(EmbeddedBudgetStore::open_with(path, *sync)?),
    };
    let audit: Arc<dyn AuditSink> = match &config.audit.sink {
        AuditSinkConfig::CloudWatch { log_group, log_stream } if is_own_log_group(log_group) => {
            if let Some(stream) = log_stream {
                tracing::warn!(
                    "audit.log_stream {stream} is not used: {log_group} is this function's own log group, whose \
                     streams Lambda names"
                );
            }
            tracing::info!(
                "{log_group} is this function's own log group: audit records are printed and Lambda delivers \
                 them (no PutLogEvents on the request path)"
            );
            Arc::new(EmfAuditSink::new(StdoutAuditSink, metrics_namespace(log_group)).with_quotas(config))
        }
        AuditSinkConfig::CloudWatch { log_group, log_stream } => {
            let stream = log_stream.clone().unwrap_or_else(default_audit_stream);
            let sink = CloudWatchAuditSink::new(aws_sdk_cloudwatchlogs::Client::new(sdk), log_group, stream);
            if let Err(e) = sink.ensure_stream().await {
                tracing::warn!("{e}; starting anyway: the first audit write creates the stream");
            }
            Arc::new(EmfAuditSink::new(sink, metrics_namespace(log_group)).with_quotas(config))
        }
        AuditSinkConfig::Stdout => Arc::new(StdoutAuditSink),
        AuditSinkConfig::File { path } => Arc::new(FileAuditSink::open(path)?),
    };
    let cache = match config.ai.cache.as_ref().map(|c| &c.store) {
        None => None,
        Some(store) => Some(cache_store(store, sdk).await),
    };
    Ok(Adapters { budgets, audit, export: Export::EachCall, cache })
}

/// The response cache's store (SPEC §16). One that fails to open serves misses, and
/// the function starts anyway. Nothing is sent at init for DynamoDB (its first lookup
/// opens the connection, as the ledger's warm-up would).
async fn cache_store(
    store: &flexway::config::CacheStoreConfig,
    sdk: &aws_config::SdkConfig,
) -> Arc<dyn flexway::cache::CacheStore> {
    use flexway::config::CacheStoreConfig;
    use flexway::secret::SecretSource as _;
    let opened: Result<Arc<dyn flexway::cache::CacheStore>, String> = match store {
        CacheStoreConfig::DynamoDb { table } => {
            Ok(Arc::new(DynamoDbCacheStore::new(aws_sdk_dynamodb::Client::new(sdk), table.clone())))
        }
        CacheStoreConfig::Embedded { path } => flexway::cache::embedded::EmbeddedCacheStore::open(path)
            .map(|s| Arc::new(s) as Arc<dyn flexway::cache::CacheStore>)
            .map_err(|e| e.to_string()),
        CacheStoreConfig::Postgres { url } => match AwsSecretSource::from_env().resolve(url).await {
            Ok(url) => flexway_postgres::PostgresCacheStore::connect(url.expose())
                .await
                .map(|s| Arc::new(s) as Arc<dyn flexway::cache::CacheStore>)
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!("ai.cache.store.url: {e}")),
        },
    };
    opened.unwrap_or_else(|e| {
        tracing::error!("ai.cache.store: {e}; every call is a cache miss until the next cold start");
        Arc::new(flexway::cache::Failed(e))
    })
}

/// The EMF metrics' namespace ([`emf::namespace`]).
pub fn metrics_namespace(audit_log_group: &str) -> String {
    emf::namespace(std::env::var("FLEXWAY_METRICS_NAMESPACE").ok(), audit_log_group)
}

/// The DynamoDB ledger on `table`, its connection warmed.
pub async fn dynamodb_store(sdk: &aws_config::SdkConfig, table: &str) -> Result<DynamoDbBudgetStore, StoreError> {
    let store = DynamoDbBudgetStore::new(aws_sdk_dynamodb::Client::new(sdk), table);
    store.warm().await?;
    Ok(store)
}
