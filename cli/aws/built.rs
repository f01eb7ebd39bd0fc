//! What the `aws` feature builds into `flexway`: the fleet shape's DynamoDB ledger
//! (through budget leases) and CloudWatch audit, `report --log-group`, and secret
//! references by ARN. Its twin `not_built.rs` has the same items, refusing.

use std::sync::Arc;

use flexway::audit::chain::Verifier;
use flexway::audit::report::{Read, Unreadable};
use flexway::audit::{AuditRecord, AuditSink};
use flexway::budget::{BudgetStore, LeasePolicy, LeasedBudgetStore};
use flexway::secret::SecretSource;
use flexway_aws::{AwsSecretSource, CloudWatchAuditSink, DynamoDbBudgetStore};

/// The leased DynamoDB ledger, flushed when `serve` stops.
pub type Leases = LeasedBudgetStore<DynamoDbBudgetStore>;

/// The DynamoDB ledger on `table` through budget leases, its connection warmed: the
/// ledger, and its leases to flush on the way out.
pub async fn dynamodb_ledger(table: &str) -> anyhow::Result<(Arc<dyn BudgetStore>, Arc<Leases>)> {
    let sdk = flexway_aws::load_sdk_config().await;
    let store = DynamoDbBudgetStore::new(aws_sdk_dynamodb::Client::new(&sdk), table);
    store.warm().await?;
    let leases = LeasedBudgetStore::start(Arc::new(store), LeasePolicy::default());
    Ok((leases.clone(), leases))
}

/// The response cache's DynamoDB store on `table` (exact policies only). Its table is
/// checked on the way (`DescribeTable`), but a table not reached now is only a
/// warning: each call that finds the store failing is a miss, and the next may not.
pub async fn dynamodb_cache(table: &str) -> anyhow::Result<Arc<dyn flexway::cache::CacheStore>> {
    let store = flexway_aws::cache::DynamoDbCacheStore::connect(table).await;
    if let Err(e) = store.warm().await {
        tracing::warn!("ai.cache.store: table {table} not reached at start ({e}); starting anyway");
    }
    Ok(Arc::new(store))
}

/// The CloudWatch audit in `log_group`, on this process's own stream unless the config
/// names one (one writer per stream).
pub async fn cloudwatch_audit(log_group: &str, log_stream: Option<&str>) -> anyhow::Result<Arc<dyn AuditSink>> {
    let sdk = flexway_aws::load_sdk_config().await;
    let stream = log_stream.map_or_else(|| format!("flexway-serve-{}", uuid::Uuid::new_v4().simple()), str::to_owned);
    let sink = CloudWatchAuditSink::new(aws_sdk_cloudwatchlogs::Client::new(&sdk), log_group, stream);
    sink.ensure_stream().await?;
    Ok(Arc::new(sink))
}

/// `env:` and `file:` references, and AWS ones with the SDK's usual environment (as
/// the Lambda function does): both shapes resolve the same configuration alike.
pub fn secret_source() -> Arc<dyn SecretSource> {
    Arc::new(AwsSecretSource::from_env())
}

/// The audit records in `group` whose events are timestamped in `from..=to` (Unix ms).
pub async fn read_log_group(
    group: &str,
    from: Option<i64>,
    to: Option<i64>,
    verifier: Option<&mut Verifier>,
) -> Result<Read, String> {
    let sdk = flexway_aws::load_sdk_config().await;
    let client = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    flexway_aws::read_audit_log_group(&client, group, from, to, verifier).await.map_err(read_error)
}

/// The same records, each handed to `each` as its page is read (never all held).
pub async fn for_each_in_log_group(
    group: &str,
    from: Option<i64>,
    to: Option<i64>,
    each: impl FnMut(Result<AuditRecord, Unreadable>),
) -> Result<(), String> {
    let sdk = flexway_aws::load_sdk_config().await;
    let client = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    flexway_aws::for_each_audit_record(&client, group, from, to, each).await.map_err(read_error)
}

fn read_error(error: flexway_aws::AuditReadError) -> String {
    match error {
        flexway_aws::AuditReadError::Query { .. } => {
            format!("{error}\nhint: it is read with the AWS environment: AWS_REGION, credentials, AWS_ENDPOINT_URL")
        }
        error => error.to_string(),
    }
}

/// How much later than its `ts` a record's event can be timestamped.
pub const WRITE_DELAY_MARGIN_MS: i64 = flexway_aws::WRITE_DELAY_MARGIN_MS;

/// The object at `s3://{bucket}/{key}`: its text and ETag; `None` when its ETag is
/// still `known` (a conditional read: nothing is downloaded). Read with the AWS
/// environment, path-style when `AWS_ENDPOINT_URL` names an emulator.
pub async fn read_s3(bucket: &str, key: &str, known: Option<&str>) -> anyhow::Result<Option<(String, String)>> {
    static CLIENT: tokio::sync::OnceCell<aws_sdk_s3::Client> = tokio::sync::OnceCell::const_new();
    let client = CLIENT
        .get_or_init(|| async {
            let sdk = flexway_aws::load_sdk_config().await;
            let emulated = std::env::var_os("AWS_ENDPOINT_URL").is_some();
            aws_sdk_s3::Client::from_conf(aws_sdk_s3::config::Builder::from(&sdk).force_path_style(emulated).build())
        })
        .await;
    let mut get = client.get_object().bucket(bucket).key(key);
    if let Some(etag) = known {
        get = get.if_none_match(etag);
    }
    let object = match get.send().await {
        Ok(object) => object,
        Err(e) if e.raw_response().is_some_and(|r| r.status().as_u16() == 304) => return Ok(None),
        Err(e) => {
            let detail = aws_sdk_s3::error::DisplayErrorContext(&e);
            anyhow::bail!("s3://{bucket}/{key}: {detail}")
        }
    };
    let etag = object.e_tag().unwrap_or_default().to_owned();
    if object.content_length().is_some_and(|n| n > flexway::config::bounds::MAX_BYTES as i64) {
        anyhow::bail!(
            "s3://{bucket}/{key}: larger than a configuration ({} bytes)",
            flexway::config::bounds::MAX_BYTES
        );
    }
    let bytes = object.body.collect().await.map_err(|e| anyhow::anyhow!("s3://{bucket}/{key}: {e}"))?.into_bytes();
    let text = String::from_utf8(bytes.to_vec()).map_err(|_| anyhow::anyhow!("s3://{bucket}/{key}: not UTF-8 text"))?;
    Ok(Some((text, etag)))
}
