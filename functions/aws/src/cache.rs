//! `DynamoDbCacheStore`: the response cache of the serverless shape without a VPC
//! (SPEC §16, `ai.cache.store: {kind: dynamodb, table}`), exact policies only. Its
//! table is its own (not the ledger's): `infra/template.yaml`'s `CacheTable`, created
//! when the stack's `CacheStore` parameter is `dynamodb`.
//!
//! # Table design
//!
//! | item | `pk` (S, hash key) | attributes |
//! | --- | --- | --- |
//! | entry | `<partition id hex>#<exact hash hex>` (129 characters) | `tenant` (S), `policy` (S), `sealed` (B: nonce, ciphertext, tag), `sealed_bytes` (N), `stored_at` (N), `expires_at` (N), `guard` (N) |
//! | tenant count | `count#<tenant>` | `entries` (N): the tenant's entries in the table, as this store counted them |
//!
//! No sort key. `expires_at` is the table's TTL attribute: DynamoDB deletes an
//! expired entry lazily (within days), so a lookup checks it itself. A count item has
//! no `expires_at` and is never deleted. An entry's `pk` is lowercase hex and `#`, a
//! count's starts with `count#` (`o`, `u`, `n`, `t` are not hex): they never meet.
//!
//! One global secondary index, [`TENANT_INDEX`]: hash key `tenant` (S), range key
//! `stored_at` (N), projection `INCLUDE` `policy`, `expires_at`, `sealed_bytes` (the
//! table's and the index's keys come with it; `sealed` does not). Only entries carry
//! `tenant`, so count items are not in it. Eviction reads a tenant's oldest entries
//! from it, purge a tenant's entries, stats every entry.
//!
//! # Operations
//!
//! - **lookup**: one `GetItem` of the entry's `pk` (eventually consistent: an entry
//!   written a moment ago may be missed once, a miss), served only if `expires_at >
//!   now` and `stored_at >= stored_since`.
//! - **store**: one `TransactWriteItems`: a `Put` of the entry conditioned on
//!   `attribute_not_exists(pk)` and `ADD entries 1` on the tenant's count conditioned
//!   on `entries < max_entries_per_tenant`. The common case is that one request. If the
//!   `Put`'s condition fails, the entry replaces one of the same partition and exact
//!   hash: a plain `PutItem`, the count unchanged. If the count's condition fails, the
//!   tenant is at its limit: its entries are counted from the index (`Query`, every
//!   page, keys and `expires_at` only), its expired ones and then its oldest past
//!   `max - 1` are deleted (`BatchWriteItem`), the count is `SET` to what is left, and
//!   the transaction is sent again (three times at most).
//! - **purge**: `Query` of the index for the tenant (a `FilterExpression` on `policy`
//!   when one is given), `BatchWriteItem` deletes of every entry found, `ADD entries
//!   -deleted` on the count.
//! - **stats**: a `Scan` of the index (every tenant's entries, without their sealed
//!   bytes), counting the unexpired ones. An operator's command (`flexway cache
//!   stats`), rare: it reads the whole index.
//!
//! # What is approximate
//!
//! The count is exact while one store at a time writes a tenant's entries at its
//! limit, and DynamoDB's TTL deletions are not subtracted from it (nothing tells the
//! store about them): a count above the truth only makes the limit reached sooner,
//! and reaching it recounts from the index, which holds what is really there (the
//! index is eventually consistent: an entry written a moment earlier may be missed by
//! the recount). Two stores of one tenant making room at once may each evict the
//! oldest and set the count; the tenant then holds up to one entry more, or fewer,
//! per concurrent store, until its next recount. The limit costs one `Query` of the
//! tenant's index keys (about 100 bytes an entry: 1,000 entries are 25 read units,
//! eventually consistent) each time a store finds the tenant at it.
//!
//! # Failures
//!
//! Every SDK error is [`StoreError::Unavailable`] (a miss for the driver, counted); an
//! item that does not read as this design says is [`StoreError::Corrupt`]. Errors
//! name the operation and the table, never a key's content beyond its hashes. The
//! store's client retries once and gives up after 2 s ([`cache_client`]): a store
//! that fails costs a call little.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::DisplayErrorContext;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, DeleteRequest, GlobalSecondaryIndex, KeySchemaElement, KeyType,
    Projection, ProjectionType, Put, ScalarAttributeType, TransactWriteItem, Update, WriteRequest,
};
use flexway::cache::{CacheStore, Entry, Found, Lookup, Sealed, Stats, StoreError};

/// The global secondary index of entries by tenant, oldest first (hash key `tenant`,
/// range key `stored_at`).
pub const TENANT_INDEX: &str = "tenant";
/// The table's TTL attribute (an entry's expiry, Unix seconds).
pub const TTL_ATTRIBUTE: &str = "expires_at";
const COUNT_PREFIX: &str = "count#";
/// Times a store makes room and tries again when its tenant is at the limit.
const ATTEMPTS: u32 = 3;
/// Deletes per `BatchWriteItem` (DynamoDB's limit).
const BATCH: usize = 25;

/// The DynamoDB cache store. Cheap to clone (the SDK client is shared).
#[derive(Debug, Clone)]
pub struct DynamoDbCacheStore {
    client: Client,
    table: String,
}

/// An entry as the tenant index lists it.
#[derive(Debug)]
struct Listed {
    pk: String,
    stored_at: u64,
    expires_at: u64,
}

/// How a store's transaction ended.
enum Written {
    Stored,
    /// An entry of that `pk` exists: replace it.
    Exists,
    /// The tenant is at its limit.
    Full,
}

impl DynamoDbCacheStore {
    /// The store on `table`, through `client` with the cache's own retries and
    /// timeouts ([`cache_client`]).
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        DynamoDbCacheStore { client: cache_client(&client), table: table.into() }
    }

    /// The store on `table`, its SDK configuration from the environment as every
    /// binary loads it ([`crate::load_sdk_config`]). Sends nothing: [`warm`](Self::warm)
    /// checks the table.
    pub async fn connect(table: &str) -> Self {
        let sdk = crate::load_sdk_config().await;
        DynamoDbCacheStore::new(Client::new(&sdk), table)
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// Checks that the table exists and opens the connection on the way
    /// (`DescribeTable`), so that the first lookup does not pay the TLS handshake.
    pub async fn warm(&self) -> Result<(), StoreError> {
        self.client
            .describe_table()
            .table_name(&self.table)
            .send()
            .await
            .map_err(|e| self.failed("DescribeTable", &e))?;
        Ok(())
    }

    /// Creates the cache table as `infra/template.yaml` declares it (on-demand, `pk`
    /// hash key, the index [`TENANT_INDEX`], TTL on [`TTL_ATTRIBUTE`]) and waits until
    /// it is active: for tests.
    pub async fn create_table(client: &Client, table: &str) -> Result<(), StoreError> {
        let built = |e: aws_sdk_dynamodb::error::BuildError| StoreError::Unavailable(e.to_string());
        let key = |name: &str, key_type| KeySchemaElement::builder().attribute_name(name).key_type(key_type).build();
        let attribute =
            |name: &str, kind| AttributeDefinition::builder().attribute_name(name).attribute_type(kind).build();
        let projection = Projection::builder()
            .projection_type(ProjectionType::Include)
            .non_key_attributes("policy")
            .non_key_attributes(TTL_ATTRIBUTE)
            .non_key_attributes("sealed_bytes")
            .build();
        let index = GlobalSecondaryIndex::builder()
            .index_name(TENANT_INDEX)
            .key_schema(key("tenant", KeyType::Hash).map_err(built)?)
            .key_schema(key("stored_at", KeyType::Range).map_err(built)?)
            .projection(projection)
            .build()
            .map_err(built)?;
        let failed = |operation: &str, e: &dyn std::error::Error| {
            StoreError::Unavailable(format!("{operation} {table}: {}", DisplayErrorContext(e)))
        };
        client
            .create_table()
            .table_name(table)
            .key_schema(key("pk", KeyType::Hash).map_err(built)?)
            .attribute_definitions(attribute("pk", ScalarAttributeType::S).map_err(built)?)
            .attribute_definitions(attribute("tenant", ScalarAttributeType::S).map_err(built)?)
            .attribute_definitions(attribute("stored_at", ScalarAttributeType::N).map_err(built)?)
            .global_secondary_indexes(index)
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await
            .map_err(|e| failed("CreateTable", &e))?;
        crate::table::activate_with_ttl(client, table, TTL_ATTRIBUTE).await.map_err(StoreError::Unavailable)
    }

    fn failed(&self, operation: &str, error: &dyn std::error::Error) -> StoreError {
        StoreError::Unavailable(format!("{operation} {}: {}", self.table, DisplayErrorContext(error)))
    }

    fn corrupt(&self, pk: &str, detail: impl std::fmt::Display) -> StoreError {
        StoreError::Corrupt(format!("{} item {pk}: {detail}", self.table))
    }

    /// The entry's item.
    fn item(entry: &Entry<'_>) -> HashMap<String, AttributeValue> {
        let partition = entry.partition;
        HashMap::from([
            ("pk".to_owned(), AttributeValue::S(entry_pk(&partition.id, &entry.probe.exact))),
            ("tenant".to_owned(), AttributeValue::S(partition.tenant.clone())),
            ("policy".to_owned(), AttributeValue::S(partition.policy.clone())),
            ("sealed".to_owned(), AttributeValue::B(Blob::new(entry.sealed.0.clone()))),
            ("sealed_bytes".to_owned(), n(entry.sealed.0.len())),
            ("stored_at".to_owned(), n(entry.stored_at)),
            (TTL_ATTRIBUTE.to_owned(), n(entry.expires_at)),
            ("guard".to_owned(), n(entry.probe.guard)),
        ])
    }

    /// The put of a new entry and the count's increment, in one transaction.
    async fn put_counted(&self, entry: &Entry<'_>) -> Result<Written, StoreError> {
        let built = |e: aws_sdk_dynamodb::error::BuildError| StoreError::Unavailable(e.to_string());
        let put = Put::builder()
            .table_name(&self.table)
            .set_item(Some(Self::item(entry)))
            .condition_expression("attribute_not_exists(pk)")
            .build()
            .map_err(built)?;
        let count = Update::builder()
            .table_name(&self.table)
            .key("pk", count_key(&entry.partition.tenant))
            .update_expression("ADD entries :one")
            .condition_expression("attribute_not_exists(entries) OR entries < :max")
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":max", n(entry.max_entries_per_tenant))
            .build()
            .map_err(built)?;
        let sent = self
            .client
            .transact_write_items()
            .transact_items(TransactWriteItem::builder().put(put).build())
            .transact_items(TransactWriteItem::builder().update(count).build())
            .send()
            .await;
        let error = match sent {
            Ok(_) => return Ok(Written::Stored),
            Err(error) => error,
        };
        let failed = self.failed("TransactWriteItems", &error);
        let TransactWriteItemsError::TransactionCanceledException(cancelled) = error.into_service_error() else {
            return Err(failed);
        };
        let reasons = cancelled.cancellation_reasons();
        let condition_failed =
            |index: usize| reasons.get(index).and_then(|r| r.code()) == Some("ConditionalCheckFailed");
        if condition_failed(0) {
            Ok(Written::Exists)
        } else if condition_failed(1) {
            Ok(Written::Full)
        } else {
            Err(failed)
        }
    }

    /// Brings `tenant` under `max` entries: its expired entries and its oldest past
    /// `max - 1` deleted, its count set to what is left.
    async fn make_room(&self, tenant: &str, max: u64, now: u64) -> Result<(), StoreError> {
        let listed = self.tenant_entries(tenant, None).await?;
        let (expired, live): (Vec<Listed>, Vec<Listed>) = listed.into_iter().partition(|e| e.expires_at <= now);
        let keep = usize::try_from(max.saturating_sub(1)).unwrap_or(usize::MAX);
        let oldest = live.len().saturating_sub(keep);
        // The index lists them oldest first.
        let victims: Vec<String> = expired.iter().chain(&live[..oldest]).map(|e| e.pk.clone()).collect();
        self.delete(&victims).await?;
        let left = live.len() - oldest;
        self.client
            .update_item()
            .table_name(&self.table)
            .key("pk", count_key(tenant))
            .update_expression("SET entries = :left")
            .expression_attribute_values(":left", n(left))
            .send()
            .await
            .map_err(|e| self.failed("UpdateItem", &e))?;
        Ok(())
    }

    /// `tenant`'s entries (of `policy` only, if given), oldest first, from the index.
    async fn tenant_entries(&self, tenant: &str, policy: Option<&str>) -> Result<Vec<Listed>, StoreError> {
        let mut entries = Vec::new();
        let mut start = None;
        loop {
            let mut query = self
                .client
                .query()
                .table_name(&self.table)
                .index_name(TENANT_INDEX)
                .key_condition_expression("#tenant = :tenant")
                .projection_expression("pk, #stored_at, #expires_at")
                .expression_attribute_names("#tenant", "tenant")
                .expression_attribute_names("#stored_at", "stored_at")
                .expression_attribute_names("#expires_at", TTL_ATTRIBUTE)
                .expression_attribute_values(":tenant", AttributeValue::S(tenant.to_owned()))
                .scan_index_forward(true)
                .set_exclusive_start_key(start);
            if let Some(policy) = policy {
                query = query
                    .filter_expression("#policy = :policy")
                    .expression_attribute_names("#policy", "policy")
                    .expression_attribute_values(":policy", AttributeValue::S(policy.to_owned()));
            }
            let page = query.send().await.map_err(|e| self.failed("Query", &e))?;
            for item in page.items() {
                let pk = self.string(item, "pk")?;
                let stored_at = self.number(item, "stored_at", &pk)?;
                let expires_at = self.number(item, TTL_ATTRIBUTE, &pk)?;
                entries.push(Listed { pk, stored_at, expires_at });
            }
            match page.last_evaluated_key() {
                Some(key) if !key.is_empty() => start = Some(key.clone()),
                _ => break,
            }
        }
        entries.sort_by_key(|e| e.stored_at);
        Ok(entries)
    }

    /// Deletes the items of `pks`, 25 a request, until DynamoDB has processed them all.
    async fn delete(&self, pks: &[String]) -> Result<(), StoreError> {
        for chunk in pks.chunks(BATCH) {
            let mut requests = chunk
                .iter()
                .map(|pk| {
                    let delete = DeleteRequest::builder()
                        .key("pk", AttributeValue::S(pk.clone()))
                        .build()
                        .map_err(|e| StoreError::Unavailable(e.to_string()))?;
                    Ok(WriteRequest::builder().delete_request(delete).build())
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            for attempt in 0.. {
                let written = self
                    .client
                    .batch_write_item()
                    .request_items(&self.table, requests)
                    .send()
                    .await
                    .map_err(|e| self.failed("BatchWriteItem", &e))?;
                requests =
                    written.unprocessed_items().and_then(|left| left.get(&self.table)).cloned().unwrap_or_default();
                if requests.is_empty() {
                    break;
                }
                if attempt >= 8 {
                    return Err(StoreError::Unavailable(format!(
                        "BatchWriteItem {}: {} deletes still unprocessed (throttled)",
                        self.table,
                        requests.len()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(20 << attempt)).await;
            }
        }
        Ok(())
    }

    fn string(&self, item: &HashMap<String, AttributeValue>, name: &str) -> Result<String, StoreError> {
        match item.get(name) {
            Some(AttributeValue::S(value)) => Ok(value.clone()),
            other => {
                let pk = match item.get("pk") {
                    Some(AttributeValue::S(pk)) => pk.as_str(),
                    _ => "?",
                };
                Err(self.corrupt(pk, format_args!("{name} is not a string: {}", kind(other))))
            }
        }
    }

    fn number(&self, item: &HashMap<String, AttributeValue>, name: &str, pk: &str) -> Result<u64, StoreError> {
        match item.get(name) {
            Some(AttributeValue::N(value)) => {
                value.parse().map_err(|e| self.corrupt(pk, format_args!("{name} = {value}: {e}")))
            }
            other => Err(self.corrupt(pk, format_args!("{name} is not a number: {}", kind(other)))),
        }
    }
}

#[async_trait]
impl CacheStore for DynamoDbCacheStore {
    async fn lookup(&self, lookup: &Lookup<'_>) -> Result<Option<Found>, StoreError> {
        let pk = entry_pk(&lookup.partition.id, &lookup.probe.exact);
        let read = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(pk.clone()))
            .send()
            .await
            .map_err(|e| self.failed("GetItem", &e))?;
        let Some(item) = read.item() else { return Ok(None) };
        let stored_at = self.number(item, "stored_at", &pk)?;
        let expires_at = self.number(item, TTL_ATTRIBUTE, &pk)?;
        // The partition id covers the tenant; an item that says otherwise is not served.
        if self.string(item, "tenant")? != lookup.partition.tenant {
            return Err(self.corrupt(&pk, "its tenant is not its partition's"));
        }
        if expires_at <= lookup.now || stored_at < lookup.stored_since {
            return Ok(None);
        }
        let sealed = match item.get("sealed") {
            Some(AttributeValue::B(blob)) => Sealed(blob.clone().into_inner()),
            other => return Err(self.corrupt(&pk, format_args!("sealed is not binary: {}", kind(other)))),
        };
        Ok(Some(Found { sealed, exact: lookup.probe.exact, similarity: 1.0, stored_at }))
    }

    async fn store(&self, entry: Entry<'_>) -> Result<(), StoreError> {
        if entry.max_entries_per_tenant == 0 {
            return Ok(());
        }
        for _ in 0..ATTEMPTS {
            match self.put_counted(&entry).await? {
                Written::Stored => return Ok(()),
                Written::Exists => {
                    self.client
                        .put_item()
                        .table_name(&self.table)
                        .set_item(Some(Self::item(&entry)))
                        .send()
                        .await
                        .map_err(|e| self.failed("PutItem", &e))?;
                    return Ok(());
                }
                Written::Full => {
                    self.make_room(&entry.partition.tenant, entry.max_entries_per_tenant, entry.stored_at).await?
                }
            }
        }
        Err(StoreError::Unavailable(format!(
            "{}: the tenant stayed at its entry limit after {ATTEMPTS} evictions (other stores filling it)",
            self.table
        )))
    }

    async fn purge(&self, tenant: &str, policy: Option<&str>) -> Result<u64, StoreError> {
        let entries = self.tenant_entries(tenant, policy).await?;
        let pks: Vec<String> = entries.into_iter().map(|e| e.pk).collect();
        self.delete(&pks).await?;
        let deleted = pks.len() as u64;
        if deleted > 0 {
            self.client
                .update_item()
                .table_name(&self.table)
                .key("pk", count_key(tenant))
                .update_expression("ADD entries :gone")
                .expression_attribute_values(":gone", AttributeValue::N(format!("-{deleted}")))
                .send()
                .await
                .map_err(|e| self.failed("UpdateItem", &e))?;
        }
        Ok(deleted)
    }

    async fn stats(&self) -> Result<Vec<Stats>, StoreError> {
        let now = flexway::budget::period::unix_now();
        let mut stats: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
        let mut start = None;
        loop {
            let page = self
                .client
                .scan()
                .table_name(&self.table)
                .index_name(TENANT_INDEX)
                .projection_expression("pk, #tenant, #policy, #expires_at, sealed_bytes")
                .expression_attribute_names("#tenant", "tenant")
                .expression_attribute_names("#policy", "policy")
                .expression_attribute_names("#expires_at", TTL_ATTRIBUTE)
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(|e| self.failed("Scan", &e))?;
            for item in page.items() {
                let pk = self.string(item, "pk")?;
                if self.number(item, TTL_ATTRIBUTE, &pk)? <= now {
                    continue;
                }
                let bytes = self.number(item, "sealed_bytes", &pk)?;
                let counted = stats.entry((self.string(item, "tenant")?, self.string(item, "policy")?)).or_default();
                counted.0 += 1;
                counted.1 += bytes;
            }
            match page.last_evaluated_key() {
                Some(key) if !key.is_empty() => start = Some(key.clone()),
                _ => break,
            }
        }
        Ok(stats
            .into_iter()
            .map(|((tenant, policy), (entries, bytes))| Stats { tenant, policy, entries, bytes })
            .collect())
    }

    fn semantic(&self) -> bool {
        false
    }
}

/// `client` with the retries and timeouts of a store whose failure is a miss: a lookup
/// waits on the call's path, and a store that does not answer must cost the call
/// little. One retry after about 50 ms (throttling, a connection reset), 1 s an
/// attempt (connecting included), 2 s in all: a store that refuses connections answers
/// in about 50 ms, one that hangs in 2 s (the ledger's client allows 12).
fn cache_client(client: &Client) -> Client {
    use aws_sdk_dynamodb::config::retry::RetryConfig;
    use aws_sdk_dynamodb::config::timeout::TimeoutConfig;
    let retries = RetryConfig::standard().with_max_attempts(2).with_initial_backoff(Duration::from_millis(50));
    let timeouts = TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(1))
        .operation_attempt_timeout(Duration::from_secs(1))
        .operation_timeout(Duration::from_secs(2))
        .build();
    Client::from_conf(client.config().to_builder().retry_config(retries).timeout_config(timeouts).build())
}

/// An entry's `pk`: its partition id and exact hash, in hex.
fn entry_pk(partition: &[u8; 32], exact: &[u8; 32]) -> String {
    format!("{}#{}", hex(partition), hex(exact))
}

fn count_key(tenant: &str) -> AttributeValue {
    AttributeValue::S(format!("{COUNT_PREFIX}{tenant}"))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

fn n(value: impl ToString) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

/// What an attribute is, without its value (a sealed value is no one's business).
fn kind(value: Option<&AttributeValue>) -> &'static str {
    match value {
        None => "missing",
        Some(AttributeValue::S(_)) => "a string",
        Some(AttributeValue::N(_)) => "a number",
        Some(AttributeValue::B(_)) => "binary",
        Some(_) => "another type",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_key_is_both_hashes_in_hex_and_never_a_count_key() {
        let key = entry_pk(&[0xab; 32], &[0x01; 32]);
        assert_eq!(key.len(), 129);
        assert_eq!(&key[..4], "abab");
        assert_eq!(&key[64..67], "#01");
        assert!(key.bytes().all(|b| b == b'#' || b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        let AttributeValue::S(count) = count_key("acme") else { panic!("a string key") };
        assert!(!count.bytes().all(|b| b == b'#' || b.is_ascii_hexdigit()));
    }
}
