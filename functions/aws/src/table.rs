//! What the ledger's and the cache's tables share once created: waiting until the
//! table and its indexes are ACTIVE, then turning TTL on.

use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::DisplayErrorContext;
use aws_sdk_dynamodb::types::TimeToLiveSpecification;

/// Polls `table` (every 100 ms, 10 s at most) until it and its global secondary
/// indexes are ACTIVE, then enables TTL on `ttl_attribute`. The error names the
/// operation that failed.
pub(crate) async fn activate_with_ttl(client: &Client, table: &str, ttl_attribute: &str) -> Result<(), String> {
    let failed =
        |operation: &str, e: &dyn std::error::Error| format!("{operation} {table}: {}", DisplayErrorContext(e));
    for _ in 0..100 {
        let described =
            client.describe_table().table_name(table).send().await.map_err(|e| failed("DescribeTable", &e))?;
        let active = described.table().is_some_and(|t| {
            t.table_status().is_some_and(|s| s.as_str() == "ACTIVE")
                && t.global_secondary_indexes().iter().all(|i| i.index_status().is_none_or(|s| s.as_str() == "ACTIVE"))
        });
        if active {
            let ttl = TimeToLiveSpecification::builder()
                .attribute_name(ttl_attribute)
                .enabled(true)
                .build()
                .map_err(|e| e.to_string())?;
            client
                .update_time_to_live()
                .table_name(table)
                .time_to_live_specification(ttl)
                .send()
                .await
                .map_err(|e| failed("UpdateTimeToLive", &e))?;
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("table {table} did not become ACTIVE"))
}
