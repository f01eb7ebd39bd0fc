//! The serverless shape's reconciliation (SPEC §9): the last days of the audit's log
//! group set against the providers' usage APIs (the backends' `usage_api`), as
//! `flexway reconcile --log-group --fetch` does, for the scheduled reconcile function
//! to print the drift as EMF.

use flexway::audit::report::{Filter, Read};
use flexway::config::Config;
use flexway::reconcile::fetch::{FetchAllError, fetch_all};
use flexway::reconcile::{Date, Reconciliation, reconcile};

use crate::{AuditReadError, AwsSecretSource, WRITE_DELAY_MARGIN_MS, read_audit_log_group};

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
/// it could not read (listed, never counted).
#[derive(Debug)]
pub struct Reconciled {
    pub reconciliation: Reconciliation,
    pub unreadable: Vec<String>,
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
    let (start, end) = filter.unix_millis();
    let client = aws_sdk_cloudwatchlogs::Client::new(sdk);
    let read = read_audit_log_group(
        &client,
        audit_log_group,
        start.map(|ms| ms - WRITE_DELAY_MARGIN_MS),
        end.map(|ms| ms + WRITE_DELAY_MARGIN_MS),
        None,
    )
    .await?;
    let Read { records, unreadable } = read;
    let unreadable = unreadable
        .iter()
        .map(|line| format!("audit: {line}"))
        .chain(provider.unreadable.iter().map(|line| format!("provider usage: {line}")))
        .collect();
    Ok(Reconciled { reconciliation: reconcile(&records, &provider, &filter, false), unreadable })
}
