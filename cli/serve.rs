//! `flexway serve`: load, build the adapters once, listen.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use flexway::budget::{BudgetStore, MemoryBudgetStore};
use flexway::config::{self, ProcessEnv, StoreConfig};
use flexway::secret::LocalSecrets;

pub fn run(config_path: &Path, listen: &str) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FLEXWAY_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let loaded = match config::load_file(config_path, &ProcessEnv) {
        Ok(loaded) => loaded,
        Err(error) => {
            for diagnostic in &error.errors {
                eprintln!("error: {}: {diagnostic}", config_path.display());
            }
            return ExitCode::FAILURE;
        }
    };
    for warning in &loaded.warnings {
        tracing::warn!("{}: {warning}", config_path.display());
    }
    let budgets: Arc<dyn BudgetStore> = match &loaded.config.store {
        StoreConfig::Memory => Arc::new(MemoryBudgetStore::new()),
        StoreConfig::Embedded { path } => Arc::new(MemoryBudgetStore::new()),
        StoreConfig::DynamoDb { .. } => {
            eprintln!("error: store kind dynamodb is served by the Lambda function, not by `flexway serve`");
            return ExitCode::FAILURE;
        }
    };
    let gateway = match flexway::Gateway::new(loaded.config, &LocalSecrets { env: &ProcessEnv }, budgets) {
        Ok(gateway) => Arc::new(gateway),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(gateway, listen)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(gateway: Arc<flexway::Gateway>, listen: &str) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    // Tests and scripts read this line to find the port when `--listen` asks for 0.
    eprintln!("flexway listening on http://{}", listener.local_addr()?);
    axum::serve(listener, flexway::http::app(gateway))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
}
