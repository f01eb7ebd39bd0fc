//! `flexway serve`: load, resolve the secrets, build the adapters once, run the sweeper,
//! the secrets refresh and the reloads (SIGHUP, `--watch`), listen.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::{Listener, ListenerExt};
use hyper_util::rt::TokioExecutor;
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;

use flexway::audit::{AuditSink, FileAuditSink, StdoutAuditSink};
use flexway::budget::{BudgetStore, EmbeddedBudgetStore, MemoryBudgetStore, period::unix_now};
use flexway::config::{self, AuditSinkConfig, Config, ProcessEnv, Secrets, StoreConfig};
use flexway::gateway::Adapters;
use flexway::http::Reloadable;
use flexway::telemetry::Export;
use sha2::{Digest, Sha256};

use crate::aws;
use crate::workers::Workers;

/// How long `serve` waits, on its way out, for the last telemetry to be sent.
const TELEMETRY_FLUSH_AT_EXIT: Duration = Duration::from_secs(5);

/// How long `serve` waits, on its way out, for the realtime sessions it closed to
/// settle and write their records.
const SESSIONS_CLOSE_AT_EXIT: Duration = Duration::from_secs(10);

/// How often the local shape refunds expired reservations.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// The header section the transport accepts: HTTP/1.1's read buffer and HTTP/2's
/// header list (HPACK size: names, values and 32 bytes a field). They stay far above
/// the gateway's own limit (`flexway::http::MAX_HEADER_BYTES`), so that oversized
/// headers reach the router and are refused there with the envelope and a request id;
/// hyper's defaults (~400 KiB, 16 KiB) would answer a bare 431 first. Past them, hyper
/// still does. A request body may already take `ai.vision.max_body_bytes` (24 MiB by
/// default), so a 2 MiB ceiling on headers adds no new way to use memory.
const MAX_HEADER_SECTION: usize = 2 * 1024 * 1024;

pub fn run(config_path: &Path, listen: &str, watch: Option<Duration>) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FLEXWAY_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        // Colours only on a terminal: in a piped log, escape codes would split
        // `request_id=req_...` and defeat a grep for a call's lines.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // The main runtime accepts and runs the background tasks; the calls are served on
    // one thread per core (`workers.rs`).
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let source = Source::of(config_path);
    // Every secret resolved now, or no start: a gateway that starts can authenticate
    // to its backends (`validate` alone may only check the references' form).
    let (loaded, etag) = match runtime.block_on(source.load(None)) {
        Ok(Some(loaded)) => loaded,
        Ok(None) => unreachable!("an unconditional read always reads"),
        Err(lines) => {
            for line in lines {
                eprintln!("error: {line}");
            }
            return ExitCode::FAILURE;
        }
    };
    for warning in &loaded.warnings {
        tracing::warn!("{}: {warning}", source.name());
    }
    match runtime.block_on(serve(loaded.config, listen, source, etag, watch)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Where the configuration is read from: a file, or with the `aws` feature an S3
/// object (`--config s3://bucket/key`: one upload reaches a whole fleet).
enum Source {
    File(PathBuf),
    S3 { bucket: String, key: String },
}

impl Source {
    fn of(path: &Path) -> Source {
        match path.to_str().and_then(|p| p.strip_prefix("s3://")).and_then(|p| p.split_once('/')) {
            Some((bucket, key)) => Source::S3 { bucket: bucket.to_owned(), key: key.to_owned() },
            None => Source::File(path.to_owned()),
        }
    }

    fn name(&self) -> String {
        match self {
            Source::File(path) => path.display().to_string(),
            Source::S3 { bucket, key } => format!("s3://{bucket}/{key}"),
        }
    }

    /// The text now and its S3 ETag; `None` when the object's ETag is still `known`.
    async fn read(&self, known: Option<&str>) -> anyhow::Result<Option<(Vec<u8>, Option<String>)>> {
        match self {
            Source::File(path) => Ok(Some((tokio::fs::read(path).await?, None))),
            Source::S3 { bucket, key } => {
                Ok(aws::read_s3(bucket, key, known).await?.map(|(text, etag)| (text.into_bytes(), Some(etag))))
            }
        }
    }

    /// The configuration loaded, every secret resolved, and its S3 ETag; `None` when
    /// unchanged since `known`. Refused with every error, each a line naming it.
    async fn load(&self, known: Option<&str>) -> Result<Option<(config::Loaded, Option<String>)>, Vec<String>> {
        let loaded = match self {
            Source::File(path) => {
                let path = path.clone();
                let loading =
                    tokio::task::spawn_blocking(move || config::load_file_with(&path, &ProcessEnv, Secrets::Resolve));
                (loading.await.map_err(|e| vec![e.to_string()])?, None)
            }
            Source::S3 { .. } => match self.read(known).await.map_err(|e| vec![e.to_string()])? {
                None => return Ok(None),
                Some((text, etag)) => {
                    let text = String::from_utf8(text).map_err(|_| vec![format!("{}: not UTF-8", self.name())])?;
                    (config::load_str_with(&text, &ProcessEnv, Secrets::Resolve), etag)
                }
            },
        };
        match loaded {
            (Ok(loaded), etag) => Ok(Some((loaded, etag))),
            (Err(error), _) => {
                let mut lines: Vec<String> = error.errors.iter().map(|d| format!("{}: {d}", self.name())).collect();
                lines.extend(error.unlisted_line().map(|l| format!("{}: {l}", self.name())));
                Err(lines)
            }
        }
    }
}

/// The adapters the config names, and the leased ledger to flush on the way out if
/// there is one. The DynamoDB ledger and the CloudWatch audit (built with the `aws`
/// feature) make the fleet shape:
/// processes behind a load balancer sharing one table (and one log group, each process
/// writing its own stream), with the AWS SDK's usual environment and credentials. The
/// DynamoDB ledger is served through budget leases, as the Lambda function's is: a
/// process writes a tenant's counters once per lease, and renews a lease with its
/// usage at most every second (a killed process loses at most that second's usage;
/// its lease expires seconds later and the other processes' sweeps charge the rest
/// and give its unused slice back).
async fn adapters(config: &Config) -> anyhow::Result<(Adapters, Option<Arc<aws::Leases>>)> {
    let mut leases = None;
    let budgets: Arc<dyn BudgetStore> = match &config.store {
        StoreConfig::Memory => Arc::new(MemoryBudgetStore::new()),
        StoreConfig::Embedded { path, sync } => Arc::new(EmbeddedBudgetStore::open_with(path, *sync)?),
        StoreConfig::DynamoDb { table } => {
            let (ledger, leased) = aws::dynamodb_ledger(table).await?;
            leases = Some(leased);
            ledger
        }
    };
    let audit: Arc<dyn AuditSink> = match &config.audit.sink {
        AuditSinkConfig::File { path } => Arc::new(FileAuditSink::open(path)?),
        AuditSinkConfig::Stdout => Arc::new(StdoutAuditSink),
        AuditSinkConfig::CloudWatch { log_group, log_stream } => {
            aws::cloudwatch_audit(log_group, log_stream.as_deref()).await?
        }
    };
    let cache = crate::cache::for_serving(config).await;
    Ok((Adapters { budgets, audit, export: Export::Batched, cache }, leases))
}

async fn serve(
    config: Config,
    listen: &str,
    source: Source,
    etag: Option<String>,
    watch: Option<Duration>,
) -> anyhow::Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    // Each serving thread calls the backends through connection pools of its own.
    flexway::upstream::set_serving_threads(threads);
    let (adapters, leases) = adapters(&config).await?;
    let budgets = adapters.budgets.clone();
    let gateway = Arc::new(flexway::Gateway::new(config, aws::secret_source(), adapters).await?);
    let current = Reloadable::new(gateway.clone());
    drop(gateway);
    let refreshing = current.clone();
    tokio::spawn(async move { refresh_secrets(&refreshing).await });
    // SIGHUP's handler is in place before the port is announced: a hangup that came
    // before it would end the process (the signal's default action).
    let hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(hangup) => Some(hangup),
        Err(e) => {
            tracing::warn!("cannot listen for SIGHUP ({e}): reloads only with --watch");
            None
        }
    };
    tokio::spawn(reloads(source, etag, watch, hangup, current.clone()));
    // The sweeper refunds reservations whose call vanished (a killed process), and
    // charges those that carry a settlement that could not be written.
    tokio::spawn(async move {
        loop {
            match budgets.sweep(unix_now()).await {
                Ok(swept) => {
                    if swept.refunded > 0 {
                        tracing::info!(refunded = swept.refunded, "sweeper refunded expired reservations");
                    }
                    if swept.leases > 0 {
                        tracing::info!(leases = swept.leases, "sweeper closed the expired leases of other processes");
                    }
                    if swept.charged > 0 {
                        tracing::warn!(
                            charged = swept.charged,
                            "sweeper charged the settle intents of expired reservations (settlements that could \
                             not be written)"
                        );
                    }
                }
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
    let builder = transport();
    let workers = Workers::start(threads, &current.service(), &builder)?;
    let workers = serve_http(listener, workers, stop_signal()).await;
    let gateway = current.gateway();
    // Upgraded connections are no longer the transport's: realtime sessions are closed
    // (1001) and waited for here, so each settles and writes its record.
    gateway.sessions.close_all(SESSIONS_CLOSE_AT_EXIT).await;
    // What the leases served goes to the counters: the ledger then equals the audit.
    if let Some(leases) = leases {
        leases.flush().await;
    }
    // The spans and metrics of the last calls, before the process ends.
    gateway.telemetry.flush(TELEMETRY_FLUSH_AT_EXIT).await;
    workers.stop();
    Ok(())
}

/// The backends' secrets resolved again every `secrets.refresh`, for the gateway in
/// use.
async fn refresh_secrets(current: &Reloadable) {
    let mut every = tokio::time::interval(current.gateway().config.secrets.refresh);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await; // the first tick is now: the start has just resolved them
    loop {
        every.tick().await;
        current.gateway().refresh_secrets().await;
    }
}

/// Reloads the configuration on SIGHUP, and with `--watch` when its content changes
/// (a file's bytes; an S3 object's ETag, read conditionally) (SPEC §12): read and
/// validated off the request path, put in use if valid (new calls take it, calls in
/// flight finish on theirs); otherwise every error is logged and the running one
/// serves on.
async fn reloads(
    source: Source,
    mut etag: Option<String>,
    watch: Option<Duration>,
    mut hangup: Option<tokio::signal::unix::Signal>,
    current: Arc<Reloadable>,
) {
    let mut seen = current.gateway().config.sha256.clone();
    loop {
        let asked = tokio::select! {
            Some(()) = async { hangup.as_mut()?.recv().await } => true,
            () = async {
                match watch {
                    Some(every) => tokio::time::sleep(every).await,
                    None => std::future::pending().await,
                }
            } => false,
        };
        if !asked {
            // Watching: only a change of content reloads (an editor's save that
            // rewrites the same bytes does not).
            match source.read(etag.as_deref()).await {
                Ok(Some((text, _))) if hex::encode(Sha256::digest(&text)) != seen => {}
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!("watching {}: {e}", source.name());
                    continue;
                }
            }
        }
        let gateway = current.gateway();
        let loaded = match source.load(if asked { None } else { etag.as_deref() }).await {
            Ok(Some((loaded, new_etag))) => {
                etag = new_etag;
                loaded
            }
            Ok(None) => continue,
            Err(lines) => {
                for line in lines {
                    tracing::error!("reload refused, the running configuration serves on: {line}");
                }
                gateway.metrics.reloaded(false);
                if let Ok(Some((text, new_etag))) = source.read(None).await {
                    seen = hex::encode(Sha256::digest(&text));
                    etag = new_etag;
                }
                continue;
            }
        };
        for warning in &loaded.warnings {
            tracing::warn!("{}: {warning}", source.name());
        }
        let sha256 = loaded.config.sha256.clone();
        seen = sha256.clone();
        match gateway.reload(loaded.config).await {
            Ok(next) => {
                current.swap(Arc::new(next));
                gateway.metrics.reloaded(true);
                tracing::info!(config_sha256 = %sha256, "configuration reloaded: new calls use it");
            }
            Err(e) => {
                gateway.metrics.reloaded(false);
                tracing::error!("reload refused, the running configuration serves on: {}: {e}", source.name());
            }
        }
    }
}

/// Ctrl-C, or the SIGTERM a container platform (ECS, Kubernetes) stops a task with.
async fn stop_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(e) => {
            tracing::warn!("cannot listen for SIGTERM ({e}): Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The transport's limits (axum does not expose hyper's builder): HTTP/1.1 and HTTP/2
/// on one port, the header limits above, upgrades (WebSocket, HTTP/2 CONNECT) allowed.
///
/// HTTP/1.1 keeps hyper's count of 100 headers: past it hyper's bare 431 answers, since
/// raising the count moves the parser's header array to the heap on every request
/// (hyper documents a ~5% cost).
fn transport() -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().max_buf_size(MAX_HEADER_SECTION);
    builder.http2().max_header_list_size(MAX_HEADER_SECTION as u32).enable_connect_protocol();
    builder
}

/// `axum::serve`'s loop, handing each connection to a serving thread; on `shutdown`, no
/// new connection while those open finish their requests.
async fn serve_http<L>(mut listener: L, mut workers: Workers, shutdown: impl Future<Output = ()>) -> Workers
where
    L: Listener<Io = tokio::net::TcpStream>,
{
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // `accept` retries by itself on errors (axum's handling: back off on EMFILE).
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        workers.hand(stream, graceful.watcher());
    }
    drop(listener);
    graceful.shutdown().await;
    workers
}
