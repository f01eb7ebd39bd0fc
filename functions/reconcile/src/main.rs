//! The reconcile Lambda function: on a schedule (EventBridge, daily), the audit's
//! last `FLEXWAY_RECONCILE_DAYS` complete UTC days (default 7) set against the
//! providers' usage APIs (the `usage_api` of the backends in the bundled config,
//! `FLEXWAY_CONFIG`), and the drift per backend printed as EMF lines
//! (`flexway_reconciliation_drift_ratio`, namespace `Flexway/<stack>`), which the
//! template's alarm watches. The audit group is `FLEXWAY_AUDIT_LOG_GROUP`. One log
//! line a run says what was reconciled; lines of either side that could not be read
//! are logged one by one (the audit's first [`flexway_aws::UNREADABLE_LISTED`], then how many more),
//! never counted. The audit is folded page by page as it is read: the function's
//! memory does not grow with the number of records.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use flexway::config::{Config, ProcessEnv, Secrets};
use lambda_runtime::{Error, LambdaEvent, service_fn};
use serde_json::{Value, json};

const DEFAULT_DAYS: i32 = 7;

fn main() -> ExitCode {
    flexway_aws::lambda_main(run)
}

struct Job {
    config: Config,
    sdk: aws_config::SdkConfig,
    group: String,
    days: i32,
}

async fn run() -> Result<(), Error> {
    let path = PathBuf::from(std::env::var("FLEXWAY_CONFIG").unwrap_or_else(|_| "flexway.yaml".to_owned()));
    // The gateway's own secrets are not this function's to read: forms only.
    let config = flexway::config::load_file_with(&path, &ProcessEnv, Secrets::Check)?.config;
    let group = std::env::var("FLEXWAY_AUDIT_LOG_GROUP").map_err(|_| "FLEXWAY_AUDIT_LOG_GROUP is not set")?;
    let days = match std::env::var("FLEXWAY_RECONCILE_DAYS") {
        Ok(days) => days.parse().map_err(|_| format!("FLEXWAY_RECONCILE_DAYS={days} is not a number of days"))?,
        Err(_) => DEFAULT_DAYS,
    };
    let job = Job { config, sdk: flexway_aws::load_sdk_config().await, group, days };
    let job = &job;
    lambda_runtime::run(service_fn(move |event: LambdaEvent<Value>| reconcile(job, event))).await
}

async fn reconcile(job: &Job, _event: LambdaEvent<Value>) -> Result<Value, Error> {
    let today = flexway::reconcile::today().parse().map_err(|e| format!("today: {e}"))?;
    let done = flexway_aws::reconcile_days(&job.config, &job.sdk, &job.group, job.days, today).await?;
    let namespace = flexway_aws::metrics_namespace(&job.group);
    let now_ms = i64::try_from(flexway::budget::period::unix_now_millis()).unwrap_or(i64::MAX);
    let lines = flexway_aws::drift_lines(&done.reconciliation, &namespace, now_ms);
    // Lambda delivers stdout to the function's log, where CloudWatch reads EMF.
    let mut out = std::io::stdout().lock();
    for line in &lines {
        writeln!(out, "{line}").map_err(|e| format!("cannot write the EMF lines: {e}"))?;
    }
    out.flush().map_err(|e| format!("cannot write the EMF lines: {e}"))?;
    for line in &done.unreadable {
        tracing::warn!(line, "unreadable line left out of the reconciliation");
    }
    if done.unlisted > 0 {
        tracing::warn!(
            unlisted = done.unlisted,
            "more unreadable audit lines left out of the reconciliation, not listed"
        );
    }
    let unreadable = u64::try_from(done.unreadable.len()).unwrap_or(u64::MAX).saturating_add(done.unlisted);
    let backends: Vec<Value> = done
        .reconciliation
        .backends
        .iter()
        .map(|b| json!({"backend": b.backend, "drift_ratio": b.drift_ratio, "growing": b.growing}))
        .collect();
    let growing = done.reconciliation.backends.iter().filter(|b| b.growing).count();
    tracing::info!(backends = backends.len(), growing, unreadable, "reconciled the audit with the providers' usage");
    Ok(json!({"backends": backends, "unreadable": unreadable}))
}
