//! `DynamoDbBudgetStore`: the ledger of the serverless shape, on one DynamoDB table.
//!
//! # Table design (single table)
//!
//! | item | `pk` (S, hash key) | attributes |
//! | --- | --- | --- |
//! | counter | `counter#<key>` (`counter#acme/*/tokens/day/2026-11-29`) | `used` (N), `ttl` (N: period end + 35 days; a per-minute window's or a run's counter, [`CounterKey::expiry`] + a day) |
//! | run | `run#<id>` (SPEC §15) | `run` (S, JSON `Run` but for its children and end), `children` (L of S, once it has one), `ended_at` (N, once ended), `ttl` (N: its expiry + a day) |
//! | reservation | `reservation#<request_id>` | `lines` (S, JSON `[[key, amount], ...]`), `expires_at` (N), `swept` (BOOL), `ttl` (N: `expires_at` + 1 day, and never before its counters' `ttl`: a sweeper down for days leaves live reservations to refund), `gsi_expiry_pk` (S, `live#00`..`live#15`) while the sweeper has work on it; `actual` (S, JSON like `lines`) only when a settlement could not be written, its `ttl` then pushed 35 days ahead |
//!
//! No sort key. One global secondary index, `expiry` ([`EXPIRY_INDEX`]): hash key
//! `gsi_expiry_pk` (S), range key `expires_at` (N), projection `ALL`. It is sparse:
//! only items carrying `gsi_expiry_pk` are in it, i.e. live reservations (set by the
//! reserve `Put`) and swept ones that received a settle intent (set again by
//! `record_intent`); a refund by the sweeper `REMOVE`s it, a settle or a charge deletes
//! the item. Counters and swept reservations are never in it. Sixteen shards spread it
//! over partitions (FNV-1a of the request id), so the index never caps the table.
//!
//! `ttl` is the table's TTL attribute, so the table cleans itself: swept reservations
//! (out of the index) are deleted by it, lazily (up to days late; emulators never do
//! it). Correctness never relies on it: a late settle of a swept reservation still
//! present charges the usage once, as the ledger's rules say.
//!
//! # How each operation holds the invariants of `flexway::budget`
//!
//! - **reserve** is one `TransactWriteItems`: per counter an `Update` `ADD used :amount`
//!   conditioned on `attribute_not_exists(used) OR used <= :limit_minus_amount` (no
//!   condition for an unlimited line), plus a `Put` of the reservation conditioned on
//!   `attribute_not_exists(pk)`. All or nothing. No read before it: admission asks for
//!   the whole allowance and lets the conditions decide. Idempotency on the request id
//!   comes from that `Put` condition, not from `ClientRequestToken` (emulators ignore
//!   it): a cancellation whose reason on the `Put` is `ConditionalCheckFailed` means
//!   "already reserved"; one on a counter means "refused on that line" (the
//!   cancellation reasons are indexed like the transaction's items), after one
//!   `GetItem` of the reservation (DynamoDB may report only the counters' failures on a
//!   retry): a read on refusal only.
//! - **settle** is one transaction written from the ticket's `Reservation` (its lines),
//!   without reading: `ADD used :(actual - reserved)` per counter that moves (a signed
//!   number) and a `Delete` of the reservation conditioned on `attribute_exists(pk) AND
//!   swept = false AND lines = :the_ticket's_lines`, so a settle and a sweep can never
//!   both apply and a ticket's claim is checked, never trusted. Only when that
//!   condition fails (swept meanwhile, already settled, or lines unlike the stored
//!   ones) is the reservation read (`GetItem`, strongly consistent) and the settlement
//!   decided again from what is stored: a swept reservation is settled by charging the
//!   actual usage with the `Delete` conditioned on `swept = true`; a missing one is
//!   `Unknown`. A settle ignores `actual`: the real settlement supersedes its intent.
//! - **record_intent** (a settlement that could not be written) is one `UpdateItem` of
//!   the reservation alone, `SET actual, gsi_expiry_pk` conditioned on
//!   `attribute_exists(pk)`: no counter, no transaction; a swept reservation re-enters
//!   the index so that the sweeper charges it.
//! - **renew** (a budget lease still serving) is one `UpdateItem` of the lease's item,
//!   `SET actual, expires_at` conditioned on `attribute_exists(pk) AND swept = false`:
//!   its usage so far for the sweeper, and a new expiry (the index's range key).
//! - **sweep** `Query`s each shard of the index for `expires_at < now` (never a
//!   `Scan`). One with `actual` is settled on it in its own transaction (counters `ADD
//!   actual - reserved`, or `actual` if it was already refunded; `Delete` conditioned
//!   on the `swept` and `actual` it read); any other live one is refunded (counters
//!   `ADD -reserved`, reservation `SET swept = true REMOVE gsi_expiry_pk` conditioned
//!   on `swept = false AND attribute_not_exists(actual)`, so an intent recorded
//!   meanwhile is never refunded). Both conditions also hold `expires_at < :now`, so
//!   a lease renewed since the index was read is left alone. The index is eventually
//!   consistent: a stale entry only loses its conditional write, and the next sweep
//!   sees it. An item that cannot be read or written is logged and left for the next
//!   sweep; the others are still closed.
//! - **live_reservations** counts through the index (`Query`, `Select COUNT`, filter
//!   `swept = false`), eventually consistent: for tests and operators.
//! - **used** (`BatchGetItem`, strongly consistent) is read by admission only when a
//!   reservation was refused (soft threshold, clamp, or the 429 itself). A window's or
//!   a run's counter past its retention reads 0, as the other stores' sweep forgets it:
//!   DynamoDB deletes items after their `ttl` lazily, and returns them until then.
//! - **create_run** is one transaction: a `Put` of the run conditioned on
//!   `attribute_not_exists(pk)` and, for a child, an `Update` of its parent appending
//!   to `children`, conditioned on the parent existing and not ended; `false` when a
//!   condition fails. **run** is one strongly consistent `GetItem`. **end_run** walks
//!   the run and its descendants: each is ended by an `UpdateItem` `SET ended_at`
//!   conditioned on its not being ended, which returns its children as of that write
//!   (a child created after it finds its parent ended, one before is in the list); an
//!   already ended one is read (`GetItem`) for its children.
//!
//! # Ceiling
//!
//! Every call writes its tenant's counters: one item absorbs about 1,000 write units
//! per second (one partition key's limit), and a transactional write costs two, so a
//! single tenant (or agent) counter tops out near 500 reserve-or-settle operations
//! per second, i.e. about 250 calls per second (each call reserves and settles). Past
//! that, DynamoDB throttles or cancels with `TransactionConflict`; this store retries
//! those with jittered backoff. The gateway function lifts that ceiling with budget
//! leases (`flexway::budget::LeasedBudgetStore` over this store, `build_adapters`). The expiry index takes
//! two writes per call (the reservation enters and leaves it) spread over 16 shards:
//! about 8,000 calls per second for the whole table before the index throttles.
//!
//! Per served call, a tenant with its three counters (items ≤ 1 KB; a transactional
//! write costs 2 WCU per item, an index write 1 WCU, a strongly consistent read 1 RCU
//! per item ≤ 4 KB), as `a_served_call_costs_two_transactions_and_no_read` counts it:
//!
//! | | requests | write units | read units |
//! | --- | --- | --- | --- |
//! | the first design, with reads | `BatchGetItem`, `TransactWriteItems`, `GetItem`, `TransactWriteItems` | 8 + 8 = 16 | 3 + 1 = 4 |
//! | now | `TransactWriteItems`, `TransactWriteItems` | 8 + 8 + 2 (index) = 18 | 0 |
//!
//! Each transaction is 3 counters + the reservation = 4 items (an agent with its own
//! budgets adds 3: 14 WCU each); a settle skips a counter that does not move. The
//! sweeper no longer reads the whole table every minute (counters live 35 days past
//! their period): it reads the live reservations only.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::DisplayErrorContext;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, Delete, GlobalSecondaryIndex, KeySchemaElement, KeyType,
    KeysAndAttributes, Projection, ProjectionType, Put, ReturnValue, ScalarAttributeType, Select, TransactWriteItem,
    Update,
};
use flexway::budget::ledger::SWEPT_RETENTION_SECS;
use flexway::budget::run::MAX_CHILDREN;
use flexway::budget::{
    BudgetStore, CounterKey, IntentOutcome, Line, Period, RUN_RETENTION_SECS, Reservation, ReserveOutcome,
    ReserveRequest, Run, RunEnd, SettleOutcome, StoreError, Swept,
};

const COUNTER_PREFIX: &str = "counter#";
const RESERVATION_PREFIX: &str = "reservation#";
const RUN_PREFIX: &str = "run#";
/// Counters outlive their period by this much (chargeback reads them after month end).
const COUNTER_RETENTION_SECS: u64 = 35 * 86_400;
/// The sparse global secondary index of reservations the sweeper must visit: only
/// items carrying [`EXPIRY_SHARD`] are in it (hash key), ordered by `expires_at`
/// (range key), every attribute projected.
pub const EXPIRY_INDEX: &str = "expiry";
/// The index's hash key: `live#00` .. `live#15`, set on a reservation while it is
/// live (and again on a swept one that receives a settle intent), removed when it is
/// swept; a settled reservation is deleted, so it leaves the index too.
pub const EXPIRY_SHARD: &str = "gsi_expiry_pk";
/// Index partitions the live reservations spread over: one partition key takes about
/// 1,000 writes per second, and every call writes the index twice (put, delete).
const EXPIRY_SHARDS: u64 = 16;
/// Attempts on a transaction that DynamoDB cancelled for contention
/// (`TransactionConflict`, throttling), with jittered exponential backoff.
const MAX_ATTEMPTS: u32 = 12;

/// The DynamoDB ledger. Cheap to clone (the SDK client is shared).
#[derive(Debug, Clone)]
pub struct DynamoDbBudgetStore {
    client: Client,
    table: String,
}

/// One counter of a reservation, its lines merged (a transaction may touch an item
/// only once): the summed amount, the tightest limit, the first line naming it.
#[derive(Debug)]
struct Merged<'a> {
    key: &'a CounterKey,
    amount: u64,
    limit: Option<u64>,
    line: usize,
}

/// A reservation item as read from the table (or as a ticket says it was written).
#[derive(Debug)]
struct Stored {
    lines: Vec<(CounterKey, u64)>,
    swept: bool,
    /// The settle intent: the `actual` attribute as stored (a condition compares it)
    /// and parsed.
    intent: Option<(String, Vec<(CounterKey, u64)>)>,
}

impl Stored {
    /// How a settlement on `actual` moves each counter: by `actual - reserved`, or by
    /// `actual` alone once the sweeper has refunded the reservation.
    fn settle_deltas<'a>(&'a self, actual: &'a [(CounterKey, u64)]) -> BTreeMap<&'a CounterKey, i128> {
        let mut deltas: BTreeMap<&CounterKey, i128> = BTreeMap::new();
        if !self.swept {
            for (key, reserved) in &self.lines {
                *deltas.entry(key).or_default() -= i128::from(*reserved);
            }
        }
        for (key, amount) in actual {
            *deltas.entry(key).or_default() += i128::from(*amount);
        }
        deltas
    }
}

/// What a cancelled transaction tells us, item by item.
enum Cancelled {
    /// The condition of the item at this index failed.
    Condition(Vec<usize>),
    /// Contention or throttling: try again.
    Retry,
}

impl DynamoDbBudgetStore {
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        DynamoDbBudgetStore { client, table: table.into() }
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// Checks that the table exists, and opens the connection on the way (called at
    /// the function's init, so the first request does not pay the TLS handshake).
    pub async fn warm(&self) -> Result<(), StoreError> {
        let described = self
            .client
            .describe_table()
            .table_name(&self.table)
            .send()
            .await
            .map_err(|e| backend("DescribeTable", &e))?;
        let indexed = described
            .table()
            .is_some_and(|t| t.global_secondary_indexes().iter().any(|i| i.index_name() == Some(EXPIRY_INDEX)));
        if !indexed {
            // Calls are served without it; the sweeper cannot find expired reservations.
            tracing::warn!(table = %self.table, index = EXPIRY_INDEX, "the ledger table has no expiry index: deploy infra/template.yaml");
        }
        Ok(())
    }

    /// Creates the ledger table as `infra/template.yaml` declares it (on-demand,
    /// `pk` hash key, TTL on `ttl`, the sparse index [`EXPIRY_INDEX`]) and waits until
    /// it is active: for tests and `localstack/start` (`localstack/resources.py`
    /// creates the same).
    pub async fn create_table(client: &Client, table: &str) -> Result<(), StoreError> {
        let built = |e: aws_sdk_dynamodb::error::BuildError| StoreError::Backend(e.to_string());
        let key = |name: &str, key_type| KeySchemaElement::builder().attribute_name(name).key_type(key_type).build();
        let attribute =
            |name: &str, kind| AttributeDefinition::builder().attribute_name(name).attribute_type(kind).build();
        let index = GlobalSecondaryIndex::builder()
            .index_name(EXPIRY_INDEX)
            .key_schema(key(EXPIRY_SHARD, KeyType::Hash).map_err(built)?)
            .key_schema(key("expires_at", KeyType::Range).map_err(built)?)
            .projection(Projection::builder().projection_type(ProjectionType::All).build())
            .build()
            .map_err(built)?;
        client
            .create_table()
            .table_name(table)
            .key_schema(key("pk", KeyType::Hash).map_err(built)?)
            .attribute_definitions(attribute("pk", ScalarAttributeType::S).map_err(built)?)
            .attribute_definitions(attribute(EXPIRY_SHARD, ScalarAttributeType::S).map_err(built)?)
            .attribute_definitions(attribute("expires_at", ScalarAttributeType::N).map_err(built)?)
            .global_secondary_indexes(index)
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await
            .map_err(|e| backend("CreateTable", &e))?;
        crate::table::activate_with_ttl(client, table, "ttl").await.map_err(StoreError::Backend)
    }

    fn counter_update(
        &self,
        key: &CounterKey,
        delta: i128,
        condition_limit: Option<u64>,
    ) -> Result<TransactWriteItem, StoreError> {
        let mut update = Update::builder()
            .table_name(&self.table)
            .key("pk", s(format!("{COUNTER_PREFIX}{}", key.as_str())))
            .update_expression("SET #ttl = if_not_exists(#ttl, :ttl) ADD used :delta")
            .expression_attribute_names("#ttl", "ttl")
            .expression_attribute_values(":delta", n(delta))
            .expression_attribute_values(":ttl", n(counter_ttl(key)));
        if let Some(max_before) = condition_limit {
            update = update
                .condition_expression("attribute_not_exists(used) OR used <= :max_before")
                .expression_attribute_values(":max_before", n(max_before));
        }
        let update = update.build().map_err(|e| StoreError::Backend(e.to_string()))?;
        Ok(TransactWriteItem::builder().update(update).build())
    }

    /// Unconditional counter moves (settle, refund, sweep), one item per counter that
    /// changes, with room left for the reservation item that goes with them.
    fn counter_moves(&self, deltas: BTreeMap<&CounterKey, i128>) -> Result<Vec<TransactWriteItem>, StoreError> {
        let mut items = Vec::with_capacity(deltas.len() + 1);
        for (key, delta) in deltas {
            if delta != 0 {
                items.push(self.counter_update(key, delta, None)?);
            }
        }
        Ok(items)
    }

    async fn transact(&self, items: Vec<TransactWriteItem>) -> Result<Option<Cancelled>, StoreError> {
        // The SDK gives each request a client request token of its own (an idempotency
        // token in the API's model), kept across its retries: an attempt that timed out
        // after DynamoDB applied it is answered as applied when retried, not refused.
        let result = self.client.transact_write_items().set_transact_items(Some(items)).send().await;
        let error = match result {
            Ok(_) => return Ok(None),
            Err(error) => error,
        };
        let detail = DisplayErrorContext(&error).to_string();
        match error.into_service_error() {
            TransactWriteItemsError::TransactionCanceledException(cancelled) => {
                let reasons = cancelled.cancellation_reasons();
                let failed: Vec<usize> = reasons
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.code() == Some("ConditionalCheckFailed"))
                    .map(|(i, _)| i)
                    .collect();
                if !failed.is_empty() {
                    return Ok(Some(Cancelled::Condition(failed)));
                }
                let contended = reasons.iter().any(|r| {
                    matches!(
                        r.code(),
                        Some("TransactionConflict" | "ThrottlingError" | "ProvisionedThroughputExceeded")
                    )
                });
                if contended {
                    Ok(Some(Cancelled::Retry))
                } else {
                    Err(StoreError::Backend(format!("TransactWriteItems cancelled: {detail}")))
                }
            }
            TransactWriteItemsError::TransactionInProgressException(_)
            | TransactWriteItemsError::ProvisionedThroughputExceededException(_)
            | TransactWriteItemsError::RequestLimitExceeded(_) => Ok(Some(Cancelled::Retry)),
            _ => Err(StoreError::Backend(format!("TransactWriteItems: {detail}"))),
        }
    }

    async fn reservation(&self, request_id: &str) -> Result<Option<Stored>, StoreError> {
        let pk = format!("{RESERVATION_PREFIX}{request_id}");
        self.item(&pk).await?.map(|item| parse_reservation(&pk, &item)).transpose()
    }

    /// The item `pk`, read consistently.
    async fn item(&self, pk: &str) -> Result<Option<HashMap<String, AttributeValue>>, StoreError> {
        let output = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", s(pk.to_owned()))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| backend("GetItem", &e))?;
        Ok(output.item)
    }

    fn reservation_key(request_id: &str) -> AttributeValue {
        s(format!("{RESERVATION_PREFIX}{request_id}"))
    }
}

#[async_trait::async_trait]
impl BudgetStore for DynamoDbBudgetStore {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        let merged = merge(&request.lines);
        // A line larger than its whole limit can never fit: refuse without writing
        // (the condition would need a negative bound), unless it is a retry.
        let impossible = merged.iter().filter(|m| m.limit.is_some_and(|limit| m.amount > limit)).map(|m| m.line).min();
        if let Some(line) = impossible {
            return Ok(match self.reservation(&request.request_id).await? {
                Some(_) => ReserveOutcome::Reserved,
                None => ReserveOutcome::Refused { line },
            });
        }
        let mut items = Vec::with_capacity(merged.len() + 1);
        for m in &merged {
            let max_before = m.limit.map(|limit| limit - m.amount);
            items.push(self.counter_update(m.key, i128::from(m.amount), max_before)?);
        }
        let stored: Vec<(&CounterKey, u64)> = request.lines.iter().map(|l| (&l.key, l.amount)).collect();
        let lines = serde_json::to_string(&stored).map_err(|e| StoreError::Backend(e.to_string()))?;
        let put = Put::builder()
            .table_name(&self.table)
            .item("pk", Self::reservation_key(&request.request_id))
            .item("lines", s(lines))
            .item("expires_at", n(request.expires_at))
            .item("swept", AttributeValue::Bool(false))
            .item("ttl", n(reservation_ttl(request)))
            .item(EXPIRY_SHARD, s(expiry_shard(&request.request_id)))
            .condition_expression("attribute_not_exists(pk)")
            .build()
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        items.push(TransactWriteItem::builder().put(put).build());
        let put_index = merged.len();

        for attempt in 0..MAX_ATTEMPTS {
            match self.transact(items.clone()).await? {
                None => return Ok(ReserveOutcome::Reserved),
                Some(Cancelled::Condition(failed)) => {
                    if failed.contains(&put_index) {
                        return Ok(ReserveOutcome::Reserved);
                    }
                    // DynamoDB may report only the counters' failures when the
                    // reservation exists too: a retry must still answer Reserved.
                    if self.reservation(&request.request_id).await?.is_some() {
                        return Ok(ReserveOutcome::Reserved);
                    }
                    let line = failed.iter().filter_map(|&i| merged.get(i)).map(|m| m.line).min();
                    return match line {
                        Some(line) => Ok(ReserveOutcome::Refused { line }),
                        None => Err(StoreError::Backend(format!("reserve: unexpected cancellation {failed:?}"))),
                    };
                }
                Some(Cancelled::Retry) => backoff(attempt).await,
            }
        }
        Err(contended("reserve", &request.request_id))
    }

    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        let request_id = reservation.request_id.as_str();
        // First as the ticket says it was reserved: live, these lines. The `Delete`'s
        // condition checks both, so a wrong guess writes nothing and costs a read.
        let mut known = Some(Stored { lines: reservation.lines.clone(), swept: false, intent: None });
        for attempt in 0..MAX_ATTEMPTS {
            let stored = match known.take() {
                Some(stored) => stored,
                None => match self.reservation(request_id).await? {
                    Some(stored) => stored,
                    None => return Ok(SettleOutcome::Unknown),
                },
            };
            let mut items = self.counter_moves(stored.settle_deltas(actual))?;
            let lines = serde_json::to_string(&stored.lines).map_err(|e| StoreError::Backend(e.to_string()))?;
            let delete = Delete::builder()
                .table_name(&self.table)
                .key("pk", Self::reservation_key(request_id))
                .condition_expression("attribute_exists(pk) AND swept = :swept AND #lines = :lines")
                .expression_attribute_names("#lines", "lines")
                .expression_attribute_values(":swept", AttributeValue::Bool(stored.swept))
                .expression_attribute_values(":lines", s(lines))
                .build()
                .map_err(|e| StoreError::Backend(e.to_string()))?;
            items.push(TransactWriteItem::builder().delete(delete).build());
            match self.transact(items).await? {
                None if stored.swept => return Ok(SettleOutcome::ChargedAfterSweep),
                None => return Ok(SettleOutcome::Settled),
                // Swept, settled or unlike the ticket: read it and decide again.
                Some(Cancelled::Condition(_)) => {}
                Some(Cancelled::Retry) => {
                    known = Some(stored);
                    backoff(attempt).await;
                }
            }
        }
        Err(contended("settle", request_id))
    }

    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        self.write_actual(request_id, actual, None).await
    }

    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        self.write_actual(request_id, actual, Some(expires_at)).await
    }

    /// [`DynamoDbBudgetStore::sweep_reporting_oldest`], the oldest expiry unused.
    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        Ok(self.sweep_reporting_oldest(now).await?.0)
    }

    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        let mut values: HashMap<String, u64> = HashMap::new();
        let mut wanted: Vec<String> = keys.iter().map(|k| format!("{COUNTER_PREFIX}{}", k.as_str())).collect();
        wanted.sort();
        wanted.dedup();
        for chunk in wanted.chunks(100) {
            let mut pending: Vec<HashMap<String, AttributeValue>> =
                chunk.iter().map(|pk| HashMap::from([("pk".to_owned(), s(pk.clone()))])).collect();
            let mut attempt = 0;
            while !pending.is_empty() {
                let request = KeysAndAttributes::builder()
                    .set_keys(Some(pending))
                    .consistent_read(true)
                    .build()
                    .map_err(|e| StoreError::Backend(e.to_string()))?;
                let output = self
                    .client
                    .batch_get_item()
                    .request_items(&self.table, request)
                    .send()
                    .await
                    .map_err(|e| backend("BatchGetItem", &e))?;
                for item in output.responses().and_then(|r| r.get(&self.table)).into_iter().flatten() {
                    let pk = string_attr(item, "pk")?;
                    let used = number_attr(item, "used", &pk)?.unwrap_or(0);
                    values.insert(pk, u64::try_from(used).unwrap_or(0));
                }
                pending = output
                    .unprocessed_keys()
                    .and_then(|u| u.get(&self.table))
                    .map(|k| k.keys().to_vec())
                    .unwrap_or_default();
                if !pending.is_empty() {
                    if attempt >= MAX_ATTEMPTS {
                        return Err(StoreError::Backend("BatchGetItem: keys left unprocessed".to_owned()));
                    }
                    backoff(attempt).await;
                    attempt += 1;
                }
            }
        }
        let now = flexway::budget::period::unix_now();
        let value = |k: &CounterKey| {
            if forgotten(k, now) {
                0
            } else {
                values.get(&format!("{COUNTER_PREFIX}{}", k.as_str())).copied().unwrap_or(0)
            }
        };
        Ok(keys.iter().map(value).collect())
    }

    /// Counts through the expiry index (eventually consistent), not a table scan.
    async fn live_reservations(&self) -> Result<usize, StoreError> {
        let mut count = 0usize;
        for shard in 0..EXPIRY_SHARDS {
            let mut start = None;
            loop {
                let page = self
                    .client
                    .query()
                    .table_name(&self.table)
                    .index_name(EXPIRY_INDEX)
                    .select(Select::Count)
                    .key_condition_expression("#shard = :shard")
                    .filter_expression("swept = :false")
                    .expression_attribute_names("#shard", EXPIRY_SHARD)
                    .expression_attribute_values(":shard", s(shard_name(shard)))
                    .expression_attribute_values(":false", AttributeValue::Bool(false))
                    .set_exclusive_start_key(start)
                    .send()
                    .await
                    .map_err(|e| backend("Query", &e))?;
                count += usize::try_from(page.count()).unwrap_or(0);
                match page.last_evaluated_key() {
                    Some(key) if !key.is_empty() => start = Some(key.clone()),
                    _ => break,
                }
            }
        }
        Ok(count)
    }

    async fn create_run(&self, run: &Run) -> Result<bool, StoreError> {
        let built = |e: aws_sdk_dynamodb::error::BuildError| StoreError::Backend(e.to_string());
        let record = Run { children: Vec::new(), ended_at: None, ..run.clone() };
        let record = serde_json::to_string(&record).map_err(|e| StoreError::Backend(e.to_string()))?;
        let mut put = Put::builder()
            .table_name(&self.table)
            .item("pk", run_key(run.id()))
            .item("run", s(record))
            .item("ttl", n(run.this.expires_at.saturating_add(RUN_RETENTION_SECS)))
            .condition_expression("attribute_not_exists(pk)");
        if let Some(at) = run.ended_at {
            put = put.item("ended_at", n(at));
        }
        if !run.children.is_empty() {
            put = put.item("children", AttributeValue::L(run.children.iter().cloned().map(s).collect()));
        }
        let mut items = vec![TransactWriteItem::builder().put(put.build().map_err(built)?).build()];
        if let Some(parent) = run.ancestors.first() {
            let update = Update::builder()
                .table_name(&self.table)
                .key("pk", run_key(&parent.id))
                .update_expression("SET children = list_append(if_not_exists(children, :none), :child)")
                .condition_expression(
                    "attribute_exists(pk) AND attribute_not_exists(ended_at) \
                     AND (attribute_not_exists(children) OR size(children) < :max)",
                )
                .expression_attribute_values(":max", n(MAX_CHILDREN))
                .expression_attribute_values(":none", AttributeValue::L(Vec::new()))
                .expression_attribute_values(":child", AttributeValue::L(vec![s(run.id().to_owned())]))
                .build()
                .map_err(built)?;
            items.push(TransactWriteItem::builder().update(update).build());
        }
        for attempt in 0..MAX_ATTEMPTS {
            match self.transact(items.clone()).await? {
                None => return Ok(true),
                // Its id taken, or its parent gone, ended or full.
                Some(Cancelled::Condition(_)) => return Ok(false),
                Some(Cancelled::Retry) => backoff(attempt).await,
            }
        }
        Err(contended("create_run", run.id()))
    }

    async fn run(&self, id: &str) -> Result<Option<Run>, StoreError> {
        let pk = format!("{RUN_PREFIX}{id}");
        self.item(&pk).await?.map(|item| parse_run(&pk, &item)).transpose()
    }

    /// Ends each run before reading its children (see the module docs), so that no
    /// child created meanwhile is missed.
    async fn end_run(&self, id: &str, at: u64) -> Result<RunEnd, StoreError> {
        let mut ended = Vec::new();
        let mut next = vec![id.to_owned()];
        let mut root = true;
        while let Some(id) = next.pop() {
            let run = match self.mark_ended(&id, at).await? {
                Some(run) => {
                    ended.push(id);
                    run
                }
                None => match self.run(&id).await? {
                    Some(run) => run,
                    None if root => return Ok(RunEnd::Unknown),
                    // A child forgotten (its retention past): nothing to end.
                    None => continue,
                },
            };
            root = false;
            next.extend(run.children);
        }
        Ok(RunEnd::Ended(ended))
    }
}

impl DynamoDbBudgetStore {
    /// Ends one run unless it was ended before: its record as that write left it, or
    /// `None` when it is missing or already ended (nothing written).
    async fn mark_ended(&self, id: &str, at: u64) -> Result<Option<Run>, StoreError> {
        let pk = format!("{RUN_PREFIX}{id}");
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(pk.clone()))
            .update_expression("SET ended_at = :at")
            .condition_expression("attribute_exists(pk) AND attribute_not_exists(ended_at)")
            .expression_attribute_values(":at", n(at))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        match result {
            Ok(output) => match output.attributes() {
                Some(item) => parse_run(&pk, item).map(Some),
                None => Err(StoreError::Backend(format!("UpdateItem {pk}: no attributes returned"))),
            },
            Err(e) if e.as_service_error().is_some_and(|e| e.is_conditional_check_failed_exception()) => Ok(None),
            Err(e) => Err(backend("UpdateItem", &e)),
        }
    }

    async fn sweep_item(&self, item: &HashMap<String, AttributeValue>, now: u64) -> Result<Closed, StoreError> {
        let pk = string_attr(item, "pk")?;
        let reservation = parse_reservation(&pk, item)?;
        let lease = pk.strip_prefix(RESERVATION_PREFIX).is_some_and(flexway::budget::is_lease);
        if reservation.intent.is_some() {
            if self.charge_intent(&pk, &reservation, now).await? {
                return Ok(if lease { Closed::Lease } else { Closed::Charged });
            }
        } else if !reservation.swept && self.refund_expired(&pk, &reservation, now).await? {
            return Ok(if lease { Closed::Lease } else { Closed::Refunded });
        }
        Ok(Closed::Nothing)
    }

    /// One `UpdateItem` of a reservation's own item (never a counter, no transaction):
    /// `actual` for the sweeper to charge, never refund, and the item kept as long as
    /// its counters (it is now a bill). A settle intent (`renew_until` none) is
    /// conditioned on the item existing, and puts a swept one back in the expiry index;
    /// a lease's renewal, on the item being live, and moves its expiry (the index's
    /// range key). `Unknown` when the condition fails.
    async fn write_actual(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        renew_until: Option<u64>,
    ) -> Result<IntentOutcome, StoreError> {
        let encoded = serde_json::to_string(actual).map_err(|e| StoreError::Backend(e.to_string()))?;
        let ttl = flexway::budget::period::unix_now().saturating_add(COUNTER_RETENTION_SECS);
        let update = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", Self::reservation_key(request_id))
            .expression_attribute_names("#ttl", "ttl")
            .expression_attribute_values(":actual", s(encoded))
            .expression_attribute_values(":ttl", n(ttl));
        let update = match renew_until {
            Some(expires_at) => update
                .update_expression("SET actual = :actual, expires_at = :expires_at, #ttl = :ttl")
                .condition_expression("attribute_exists(pk) AND swept = :live")
                .expression_attribute_values(":expires_at", n(expires_at))
                .expression_attribute_values(":live", AttributeValue::Bool(false)),
            None => update
                .update_expression("SET actual = :actual, #ttl = :ttl, #shard = :shard")
                .condition_expression("attribute_exists(pk)")
                .expression_attribute_names("#shard", EXPIRY_SHARD)
                .expression_attribute_values(":shard", s(expiry_shard(request_id))),
        };
        match update.send().await {
            Ok(_) => Ok(IntentOutcome::Recorded),
            Err(e) if e.as_service_error().is_some_and(|e| e.is_conditional_check_failed_exception()) => {
                Ok(IntentOutcome::Unknown)
            }
            Err(e) => Err(backend("UpdateItem", &e)),
        }
    }

    /// The sweep: queries each shard of the expiry index for `expires_at < now`,
    /// oldest first: it holds the live reservations and the swept ones that carry an
    /// intent, nothing else. The index is eventually consistent; every write below is
    /// conditioned on the item itself, so a stale entry only loses its race. Also
    /// returns the expiry of the oldest reservation found (`now` minus it is how far
    /// the sweeper lags), read from each shard's first item: no request more.
    pub async fn sweep_reporting_oldest(&self, now: u64) -> Result<(Swept, Option<u64>), StoreError> {
        let mut swept = Swept::default();
        let mut oldest: Option<u64> = None;
        for shard in 0..EXPIRY_SHARDS {
            let mut start = None;
            loop {
                let first_page = start.is_none();
                let page = self
                    .client
                    .query()
                    .table_name(&self.table)
                    .index_name(EXPIRY_INDEX)
                    .key_condition_expression("#shard = :shard AND expires_at < :now")
                    .expression_attribute_names("#shard", EXPIRY_SHARD)
                    .expression_attribute_values(":shard", s(shard_name(shard)))
                    .expression_attribute_values(":now", n(now))
                    .scan_index_forward(true)
                    .set_exclusive_start_key(start)
                    .send()
                    .await
                    .map_err(|e| backend("Query", &e))?;
                let first = page.items().first().filter(|_| first_page);
                if let Some(expires_at) = first.and_then(|item| number_attr(item, "expires_at", "").ok().flatten()) {
                    let expires_at = u64::try_from(expires_at).unwrap_or(0);
                    oldest = Some(oldest.map_or(expires_at, |o| o.min(expires_at)));
                }
                for item in page.items() {
                    // One item that cannot be read or written is left for the next
                    // sweep; the others are still closed.
                    match self.sweep_item(item, now).await {
                        Ok(Closed::Charged) => swept.charged += 1,
                        Ok(Closed::Refunded) => swept.refunded += 1,
                        Ok(Closed::Lease) => swept.leases += 1,
                        Ok(Closed::Nothing) => {}
                        Err(e) => {
                            let pk = string_attr(item, "pk").unwrap_or_default();
                            tracing::error!(pk, error = %e, "sweeper: reservation left for the next sweep");
                        }
                    }
                }
                match page.last_evaluated_key() {
                    Some(key) if !key.is_empty() => start = Some(key.clone()),
                    _ => break,
                }
            }
        }
        Ok((swept, oldest))
    }

    /// Refunds one expired reservation; false when a settle, an intent or another
    /// sweeper got there first (an intent is then charged by the next sweep).
    async fn refund_expired(&self, pk: &str, reservation: &Stored, now: u64) -> Result<bool, StoreError> {
        let mut deltas: BTreeMap<&CounterKey, i128> = BTreeMap::new();
        for (key, reserved) in &reservation.lines {
            *deltas.entry(key).or_default() -= i128::from(*reserved);
        }
        let mut items = self.counter_moves(deltas)?;
        let mark = Update::builder()
            .table_name(&self.table)
            .key("pk", s(pk.to_owned()))
            // Out of the expiry index: the sweeper is done with it (TTL deletes it later).
            .update_expression("SET swept = :true REMOVE #shard")
            .condition_expression(
                "attribute_exists(pk) AND swept = :false AND attribute_not_exists(actual) AND expires_at < :now",
            )
            .expression_attribute_names("#shard", EXPIRY_SHARD)
            .expression_attribute_values(":now", n(now))
            .expression_attribute_values(":true", AttributeValue::Bool(true))
            .expression_attribute_values(":false", AttributeValue::Bool(false))
            .build()
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        items.push(TransactWriteItem::builder().update(mark).build());
        self.sweep_write(items, pk).await
    }

    /// Writes one sweep transaction, retrying contention: true when written, false when
    /// its condition failed (a settle or another sweeper closed the reservation first).
    async fn sweep_write(&self, items: Vec<TransactWriteItem>, pk: &str) -> Result<bool, StoreError> {
        for attempt in 0..MAX_ATTEMPTS {
            match self.transact(items.clone()).await? {
                None => return Ok(true),
                Some(Cancelled::Condition(_)) => return Ok(false),
                Some(Cancelled::Retry) => backoff(attempt).await,
            }
        }
        Err(contended("sweep", pk))
    }

    /// Settles one expired reservation on its intent, as the settlement that could not
    /// be written would have; false when a settle (or another sweeper) closed it first,
    /// or the intent changed meanwhile (the next sweep decides again).
    async fn charge_intent(&self, pk: &str, reservation: &Stored, now: u64) -> Result<bool, StoreError> {
        let Some((stored, actual)) = &reservation.intent else {
            return Ok(false);
        };
        let mut items = self.counter_moves(reservation.settle_deltas(actual))?;
        let delete = Delete::builder()
            .table_name(&self.table)
            .key("pk", s(pk.to_owned()))
            // Still expired: a lease renewed since the index was read is not closed.
            .condition_expression("attribute_exists(pk) AND swept = :swept AND actual = :actual AND expires_at < :now")
            .expression_attribute_values(":swept", AttributeValue::Bool(reservation.swept))
            .expression_attribute_values(":now", n(now))
            .expression_attribute_values(":actual", s(stored.clone()))
            .build()
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        items.push(TransactWriteItem::builder().delete(delete).build());
        self.sweep_write(items, pk).await
    }
}

/// What sweeping one item did.
enum Closed {
    Charged,
    Refunded,
    Lease,
    Nothing,
}

/// The expiry index shard of a reservation: a stable hash (FNV-1a) of its request id.
fn expiry_shard(request_id: &str) -> String {
    let hash =
        request_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    shard_name(hash % EXPIRY_SHARDS)
}

fn shard_name(shard: u64) -> String {
    format!("live#{shard:02}")
}

fn merge(lines: &[Line]) -> Vec<Merged<'_>> {
    let mut merged: Vec<Merged<'_>> = Vec::with_capacity(lines.len());
    for (index, line) in lines.iter().enumerate() {
        match merged.iter_mut().find(|m| m.key == &line.key) {
            Some(m) => {
                m.amount = m.amount.saturating_add(line.amount);
                m.limit = match (m.limit, line.limit) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            None => merged.push(Merged { key: &line.key, amount: line.amount, limit: line.limit, line: index }),
        }
    }
    merged
}

/// When DynamoDB may delete a reservation: a day after its expiry, and never before
/// its counters (a live reservation deleted while its counters remain would hold
/// their budget for good, should the sweeper be down past the day).
fn reservation_ttl(request: &ReserveRequest) -> u64 {
    let counters = request.lines.iter().map(|line| counter_ttl(&line.key)).max().unwrap_or(0);
    request.expires_at.saturating_add(SWEPT_RETENTION_SECS).max(counters)
}

/// Counters expire 35 days after the end of their period; the period is read from
/// the key (`.../day/...`, `.../month/...`), a key without one keeps a year; a
/// window's or a run's counter at its [`CounterKey::forget_at`].
fn counter_ttl(key: &CounterKey) -> u64 {
    // A per-minute window's or a run's: when the other stores forget it too.
    if let Some(at) = key.forget_at() {
        return at;
    }
    let now = flexway::budget::period::unix_now();
    let period = key.as_str().split('/').find_map(|part| match part {
        "day" => Some(Period::Day),
        "month" => Some(Period::Month),
        _ => None,
    });
    match period {
        Some(period) => period.end(now).saturating_add(COUNTER_RETENTION_SECS),
        None => now.saturating_add(365 * 86_400),
    }
}

fn parse_reservation(pk: &str, item: &HashMap<String, AttributeValue>) -> Result<Stored, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt { key: pk.to_owned(), detail };
    let lines = string_attr(item, "lines")?;
    let lines: Vec<(CounterKey, u64)> = serde_json::from_str(&lines).map_err(|e| corrupt(format!("lines: {e}")))?;
    let swept = match item.get("swept") {
        Some(AttributeValue::Bool(b)) => *b,
        None => false,
        Some(other) => return Err(corrupt(format!("swept is not a BOOL: {other:?}"))),
    };
    let intent = match item.get("actual") {
        None => None,
        Some(AttributeValue::S(stored)) => {
            let actual: Vec<(CounterKey, u64)> =
                serde_json::from_str(stored).map_err(|e| corrupt(format!("actual: {e}")))?;
            Some((stored.clone(), actual))
        }
        Some(other) => return Err(corrupt(format!("actual is not a string: {other:?}"))),
    };
    Ok(Stored { lines, swept, intent })
}

/// Whether a window's or a run's counter is past its retention (by the clock, as
/// DynamoDB's TTL deletes it): it reads 0, though DynamoDB may not have deleted it yet.
fn forgotten(key: &CounterKey, now: u64) -> bool {
    key.forget_at().is_some_and(|at| at < now)
}

fn run_key(id: &str) -> AttributeValue {
    s(format!("{RUN_PREFIX}{id}"))
}

/// A run item: its record, with its children and end from their own attributes.
fn parse_run(pk: &str, item: &HashMap<String, AttributeValue>) -> Result<Run, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt { key: pk.to_owned(), detail };
    let record = string_attr(item, "run")?;
    let mut run: Run = serde_json::from_str(&record).map_err(|e| corrupt(format!("run: {e}")))?;
    run.ended_at = match number_attr(item, "ended_at", pk)? {
        Some(at) => Some(u64::try_from(at).map_err(|e| corrupt(format!("ended_at = {at}: {e}")))?),
        None => None,
    };
    run.children = match item.get("children") {
        None => Vec::new(),
        Some(AttributeValue::L(children)) => children
            .iter()
            .map(|child| match child {
                AttributeValue::S(id) => Ok(id.clone()),
                other => Err(corrupt(format!("a child is not a string: {other:?}"))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(corrupt(format!("children is not a list: {other:?}"))),
    };
    Ok(run)
}

fn string_attr(item: &HashMap<String, AttributeValue>, name: &str) -> Result<String, StoreError> {
    match item.get(name) {
        Some(AttributeValue::S(value)) => Ok(value.clone()),
        other => Err(StoreError::Corrupt {
            key: format!("{:?}", item.get("pk")),
            detail: format!("{name} is not a string: {other:?}"),
        }),
    }
}

fn number_attr(item: &HashMap<String, AttributeValue>, name: &str, pk: &str) -> Result<Option<i128>, StoreError> {
    match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::N(value)) => value
            .parse::<i128>()
            .map(Some)
            .map_err(|e| StoreError::Corrupt { key: pk.to_owned(), detail: format!("{name} = {value}: {e}") }),
        Some(other) => {
            Err(StoreError::Corrupt { key: pk.to_owned(), detail: format!("{name} is not a number: {other:?}") })
        }
    }
}

fn s(value: String) -> AttributeValue {
    AttributeValue::S(value)
}

fn n(value: impl ToString) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

fn backend<E: std::error::Error + 'static>(operation: &str, error: &E) -> StoreError {
    StoreError::Backend(format!("{operation}: {}", DisplayErrorContext(error)))
}

fn contended(operation: &str, id: &str) -> StoreError {
    StoreError::Busy(format!(
        "{operation} {id}: still contended after {MAX_ATTEMPTS} attempts (TransactionConflict/throttling)"
    ))
}

/// Full jitter: a random wait up to 10 ms × 2^attempt, capped at 500 ms.
async fn backoff(attempt: u32) {
    let cap = 10u64.saturating_mul(1 << attempt.min(6)).min(500);
    let wait = rand::random_range(1..=cap);
    tokio::time::sleep(Duration::from_millis(wait)).await;
}
