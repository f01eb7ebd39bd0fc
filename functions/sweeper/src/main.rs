//! The sweeper Lambda function: on a schedule (EventBridge, `rate(1 minute)`), refunds
//! the budget reservations whose call vanished (a killed invocation, a timeout) once
//! they are past their expiry, and charges instead those that carry the actual amounts
//! of a settlement that could not be written. The ledger table is named by
//! `FLEXWAY_TABLE`; it finds them by `Query` on the table's sparse `expiry` index
//! (live reservations only), never by scanning the table.

use std::process::ExitCode;

use flexway_aws::DynamoDbBudgetStore;
use lambda_runtime::{Error, LambdaEvent, service_fn};
use serde_json::{Value, json};

fn main() -> ExitCode {
    flexway_aws::lambda_main(run)
}

async fn run() -> Result<(), Error> {
    let table = std::env::var("FLEXWAY_TABLE").map_err(|_| "FLEXWAY_TABLE is not set")?;
    let sdk = flexway_aws::load_sdk_config().await;
    let store = flexway_aws::dynamodb_store(&sdk, &table).await?;
    let store = &store;
    lambda_runtime::run(service_fn(move |event: LambdaEvent<Value>| sweep(store, event))).await
}

/// The scheduled event's own `time` is not used: the sweeper refunds what is expired
/// now, so a late or repeated schedule tick is harmless.
///
/// Each run logs one line, even when nothing was expired: `refunded` (calls that
/// vanished), `charged` (settlements the gateway could not write), `leases` (budget
/// leases whose owner stopped renewing them: their normal end, never an alarm) and
/// `lag_secs`, how long the oldest expired reservation waited for this sweep. The
/// template's metric filters and alarms read that line.
async fn sweep(store: &DynamoDbBudgetStore, _event: LambdaEvent<Value>) -> Result<Value, Error> {
    let now = flexway::budget::period::unix_now();
    let (swept, oldest) = store.sweep_reporting_oldest(now).await?;
    let lag_secs = oldest.map_or(0, |oldest| now.saturating_sub(oldest));
    tracing::info!(
        refunded = swept.refunded,
        charged = swept.charged,
        leases = swept.leases,
        lag_secs,
        "swept expired reservations"
    );
    Ok(json!({ "refunded": swept.refunded, "charged": swept.charged, "leases": swept.leases, "lag_secs": lag_secs }))
}
