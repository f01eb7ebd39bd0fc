//! The gateway Lambda function: the same router as `flexway serve` without the local
//! `/metrics` (`flexway::http::api`; metrics leave as EMF lines), served by
//! `lambda_http` in response-streaming mode behind a function URL (InvokeMode
//! RESPONSE_STREAM) or API Gateway REST with streaming.
//!
//! Everything is built once, at init: config (bundled with the function, path in
//! `FLEXWAY_CONFIG`), SDK clients with their connections warmed, every secret
//! reference resolved (Secrets Manager and SSM with the function's own role), the
//! backends' connections opened in the background. Handlers
//! settle budgets and write the audit before the response ends, never in a task
//! left behind: Lambda may freeze the environment as soon as the stream closes. Each
//! request carries its invocation's deadline ([`Deadline`]): a stream still open just
//! before it (3 s, or a tenth of its time if shorter) ends with the `deadline` error, settled and recorded.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use flexway::config::ProcessEnv;
use flexway::http::Deadline;
use flexway_aws::AwsSecretSource;
use lambda_http::RequestExt;
use lambda_http::tower::ServiceBuilder;

/// How long init's connection to a backend may take before its first call makes it.
const PRECONNECT_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// As `flexway serve`: many small, short-lived allocations across threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let started = Instant::now();
    flexway_aws::lambda_main(|| run(started))
}

async fn run(started: Instant) -> Result<(), lambda_http::Error> {
    let path = PathBuf::from(std::env::var("FLEXWAY_CONFIG").unwrap_or_else(|_| "flexway.yaml".to_owned()));
    let loaded = flexway::config::load_file(&path, &ProcessEnv)?;
    for warning in &loaded.warnings {
        tracing::warn!("{}: {warning}", path.display());
    }
    let sdk = flexway_aws::load_sdk_config().await;
    let adapters = flexway_aws::build_adapters(&loaded.config, &sdk).await?;
    // Secrets Manager / SSM references with the function's own role; refreshed beside
    // the first request that finds `secrets.refresh` due (`flexway::http::api`).
    let secrets = Arc::new(AwsSecretSource::new(sdk.clone()));
    let gateway = Arc::new(flexway::Gateway::new(loaded.config, secrets, adapters).await?);
    // The backends' handshakes, begun now and not waited for: on a cold start they
    // overlap the first call's own work (its ledger write) instead of following it.
    let connecting = gateway.clone();
    tokio::spawn(async move { connecting.upstreams.preconnect(PRECONNECT_WITHIN).await });
    let app = flexway::http::api(gateway);
    // Each invocation's deadline, for streams to end (settled, recorded) before it.
    let app = ServiceBuilder::new().map_request(with_deadline).service(app);
    tracing::info!(init_ms = started.elapsed().as_millis() as u64, "flexway gateway ready; polling for invocations");
    lambda_http::run_with_streaming_response(app).await
}

fn with_deadline(mut request: lambda_http::Request) -> lambda_http::Request {
    if let Some(deadline) = request.lambda_context_ref().and_then(|c| Deadline::from_unix_millis(c.deadline)) {
        request.extensions_mut().insert(deadline);
    }
    request
}
