//! `flexway serve`: load, build the adapters once, run the sweeper, listen.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;

use flexway::audit::{AuditSink, FileAuditSink, StdoutAuditSink};
use flexway::budget::{BudgetStore, EmbeddedBudgetStore, MemoryBudgetStore, period::unix_now};
use flexway::config::{self, AuditSinkConfig, Config, ProcessEnv, StoreConfig};
use flexway::gateway::Adapters;
use flexway::secret::LocalSecrets;

/// How often the local shape refunds expired reservations.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

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
            if let Some(line) = error.unlisted_line() {
                eprintln!("error: {}: {line}", config_path.display());
            }
            return ExitCode::FAILURE;
        }
    };
    for warning in &loaded.warnings {
        tracing::warn!("{}: {warning}", config_path.display());
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(loaded.config, listen)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The local shape's adapters, from the config's tagged enums.
fn adapters(config: &Config) -> anyhow::Result<Adapters> {
    let budgets: Arc<dyn BudgetStore> = match &config.store {
        StoreConfig::Memory => Arc::new(MemoryBudgetStore::new()),
        StoreConfig::Embedded { path } => Arc::new(EmbeddedBudgetStore::open(path)?),
        StoreConfig::DynamoDb { .. } => {
            anyhow::bail!("store kind dynamodb is the serverless shape's (functions/gateway)")
        }
    };
    let audit: Arc<dyn AuditSink> = match &config.audit.sink {
        AuditSinkConfig::File { path } => Arc::new(FileAuditSink::open(path)?),
        AuditSinkConfig::Stdout => Arc::new(StdoutAuditSink),
        AuditSinkConfig::CloudWatch { .. } => anyhow::bail!("audit sink cloudwatch is the serverless shape's"),
    };
    Ok(Adapters { budgets, audit })
}

async fn serve(config: Config, listen: &str) -> anyhow::Result<()> {
    let adapters = adapters(&config)?;
    let budgets = adapters.budgets.clone();
    let gateway = Arc::new(flexway::Gateway::new(config, &LocalSecrets { env: &ProcessEnv }, adapters)?);
    // The sweeper refunds reservations whose call vanished (a killed process).
    tokio::spawn(async move {
        loop {
            match budgets.sweep(unix_now()).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(refunded = n, "sweeper refunded expired reservations"),
                Err(e) => tracing::error!("sweeper: {e}"),
            }
            tokio::time::sleep(SWEEP_EVERY).await;
        }
    });
    let listener = tokio::net::TcpListener::bind(listen).await?;
    // Tests and scripts read this line to find the port when `--listen` asks for 0.
    eprintln!("flexway listening on http://{}", listener.local_addr()?);
    // Without TCP_NODELAY, Nagle holds a stream's first small chunk until the client
    // acknowledges the headers: up to 40 ms added to the first byte.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("TCP_NODELAY: {e}");
        }
    });
    axum::serve(listener, flexway::http::app(gateway))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
