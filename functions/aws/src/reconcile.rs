//! The serverless shape's reconciliation (SPEC §9): the last days of the audit's log
//! group set against the providers' usage APIs (the backends' `usage_api`), as
//! `flexway reconcile --log-group --fetch` does, for the scheduled reconcile function
//! to print the drift as EMF.
//!
//! A month of audit is millions of records: they are folded page by page as
//! FilterLogEvents returns them ([`fold_audit`]), never held, and only the first
//! [`UNREADABLE_LISTED`] unreadable lines are kept (the others counted), so that the
//! function's memory does not grow with the audit.

use aws_sdk_cloudwatchlogs::Client;
use aws_sdk_cloudwatchlogs::types::FilteredLogEvent;
use flexway::audit::report::{Filter, Unreadables};
use flexway::config::Config;
use flexway::reconcile::fetch::{FetchAllError, fetch_all};
use flexway::reconcile::{Date, GatewayUsage, Reconciliation};

use crate::audit_reader::{for_each_page, records_of};
use crate::{AuditReadError, AwsSecretSource, WRITE_DELAY_MARGIN_MS};

/// How many unreadable audit lines a run lists (the others are counted).
pub const UNREADABLE_LISTED: usize = 100;

#[derive(Debug, thiserror::Error)]
pub enum ReconcileJobError {
    #[error("the reconciled days: {0}")]
    Days(String),
    #[error(transparent)]
    Fetch(#[from] FetchAllError),
    #[error(transparent)]
    Audit(#[from] AuditReadError),
}

/// What a run found: the reconciliation, and the audit's and the providers' lines
/// it could not read (listed, never counted): the audit's first
/// [`UNREADABLE_LISTED`], then the providers'; `unlisted` says how many more the
/// audit had.
#[derive(Debug)]
pub struct Reconciled {
    pub reconciliation: Reconciliation,
    pub unreadable: Vec<String>,
    pub unlisted: u64,
}

/// The `days` complete UTC days before `today`, reconciled: the providers' usage
/// fetched with the admin keys (resolved with the function's role), the audit read
/// from `audit_log_group`.
pub async fn reconcile_days(
    config: &Config,
    sdk: &aws_config::SdkConfig,
    audit_log_group: &str,
    days: i32,
    today: Date,
) -> Result<Reconciled, ReconcileJobError> {
    let days_error = |e: jiff::Error| ReconcileJobError::Days(e.to_string());
    let to = today.yesterday().map_err(days_error)?;
    let from = today.checked_sub(jiff::Span::new().days(days.max(1))).map_err(days_error)?;
    let filter = Filter::new(Some(from.to_string()), Some(to.to_string()))
        .map_err(|e| ReconcileJobError::Days(e.to_string()))?;
    let provider = fetch_all(config, None, &AwsSecretSource::new(sdk.clone()), from, to).await?;
    let client = Client::new(sdk);
    let mut usage = GatewayUsage::new(&filter, false);
    let mut audit = Unreadables::first(UNREADABLE_LISTED);
    fold_audit(&client, audit_log_group, &filter, &mut usage, &mut audit).await?;
    let unlisted = audit.unlisted();
    let unreadable = audit
        .listed()
        .iter()
        .map(|line| format!("audit: {line}"))
        .chain(provider.unreadable.iter().map(|line| format!("provider usage: {line}")))
        .collect();
    Ok(Reconciled { reconciliation: usage.reconcile(&provider), unreadable, unlisted })
}

/// The audit's side of a reconciliation of `filter`'s period: every record of
/// `audit_log_group` in it added to `usage` as its FilterLogEvents page is read, every
/// event that claims to be a record and is not pushed to `unreadable`.
///
/// An event is timestamped when the sink wrote it, a little after its record's `ts`:
/// the read's window is the period widened by that delay (never before the epoch,
/// which CloudWatch refuses), and the `ts` filter in `usage` decides.
pub async fn fold_audit(
    client: &Client,
    audit_log_group: &str,
    filter: &Filter,
    usage: &mut GatewayUsage,
    unreadable: &mut Unreadables,
) -> Result<(), AuditReadError> {
    let (start, end) = filter.unix_millis();
    let start = start.map(|ms| ms.saturating_sub(WRITE_DELAY_MARGIN_MS).max(0));
    let end = end.map(|ms| ms.saturating_add(WRITE_DELAY_MARGIN_MS).max(0));
    for_each_page(client, audit_log_group, start, end, |page| fold_page(page, usage, unreadable)).await
}

/// One FilterLogEvents page of the audit folded: its records added to `usage`, its
/// unreadable lines pushed to `unreadable`. Nothing of the page is kept.
fn fold_page(page: &[FilteredLogEvent], usage: &mut GatewayUsage, unreadable: &mut Unreadables) {
    records_of(page, |read| match read {
        Ok(record) => usage.add(&record),
        Err(line) => unreadable.push(line),
    });
}

#[cfg(test)]
mod tests {
    use flexway::audit::{AuditRecord, sample};
    use flexway::config::Metering;

    use super::*;

    const DAYS: u64 = 3;
    const EVENTS: u64 = 200;

    /// Page `n` of a run: `EVENTS` records over `DAYS` days, 2 backends, 2 models, 4
    /// tenants and 2 agents, as the sink writes them; one event in 10 cut short.
    fn page(n: u64) -> Vec<FilteredLogEvent> {
        (0..EVENTS)
            .map(|i| {
                let seq = n * EVENTS + i;
                let record = AuditRecord {
                    ts: format!("2026-11-0{}T10:00:00.000Z", 1 + seq % DAYS).parse().unwrap(),
                    request_id: format!("req-{seq}"),
                    agent: Some(format!("agent-{}", seq % 2)),
                    model_served: Some(format!("model-{}", seq % 2)),
                    ..sample::record(
                        &format!("tenant-{}", seq % 4),
                        Some(["a", "b"][(seq % 2) as usize]),
                        Metering::Local,
                        1_000,
                    )
                };
                let mut line = serde_json::to_string(&record).unwrap();
                if seq.is_multiple_of(10) {
                    line.truncate(line.len() / 2);
                }
                FilteredLogEvent::builder().event_id(format!("e{seq}")).log_stream_name("s").message(line).build()
            })
            .collect()
    }

    #[test]
    fn the_fold_holds_no_more_after_ten_times_the_records() {
        let filter = Filter::new(Some("2026-11-01".into()), Some("2026-11-30".into())).unwrap();
        // With the chargeback's sums too: the most a fold holds.
        let mut usage = GatewayUsage::new(&filter, true);
        let mut unreadable = Unreadables::first(UNREADABLE_LISTED);
        for n in 0..10 {
            fold_page(&page(n), &mut usage, &mut unreadable);
        }
        let (sums, unlisted) = (usage.sums(), unreadable.unlisted());
        assert_eq!(unreadable.listed().len(), UNREADABLE_LISTED);
        for n in 10..100 {
            fold_page(&page(n), &mut usage, &mut unreadable);
        }
        assert_eq!(usage.sums(), sums, "as many sums for 20,000 records as for 2,000");
        assert_eq!(unreadable.listed().len(), UNREADABLE_LISTED, "the list stays at its bound");
        assert_eq!(unreadable.unlisted(), 100 * EVENTS / 10 - UNREADABLE_LISTED as u64, "the others are counted");
        assert!(unreadable.unlisted() > unlisted);
        // Everything readable was counted: 9 in 10 records, 150 tokens each.
        let provider = flexway::reconcile::ProviderUsage {
            backends: ["a".to_owned(), "b".to_owned()].into(),
            ..Default::default()
        };
        let reconciliation = usage.reconcile(&provider);
        let tokens: u64 = reconciliation.backends.iter().map(|b| b.gateway.total()).sum();
        assert_eq!(tokens, 100 * EVENTS * 9 / 10 * 150);
    }
}
