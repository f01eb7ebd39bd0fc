//! `flexway reconcile`: the audit's tokens and cost against the provider's usage
//! (SPEC §9, §13), read from an export (`--provider-usage`) or from the providers'
//! usage APIs (`--fetch`, the backends' `usage_api`).
//!
//! Exit codes: 0 with the reconciliation on stdout; 3 with it out and, on stderr,
//! every line of either side that could not be read (SPEC §2); 1 when a side cannot
//! be read at all, a fetch fails or the push fails; 2 for a usage error.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use flexway::audit::AuditRecord;
use flexway::audit::report::{Filter, Unreadable};
use flexway::config::{ProcessEnv, Secrets};
use flexway::reconcile::{self, Date, GatewayUsage, ProviderUsage, fetch, usage};

use crate::report::{Format, for_each_in_file, for_each_in_log_group, runtime};

const USAGE: u8 = 2;
const UNREADABLE_LINES: u8 = 3;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["audit", "log_group"])))]
#[command(group(clap::ArgGroup::new("provider").required(true).args(["provider_usage", "fetch"])))]
pub struct ReconcileArgs {
    /// A JSONL audit file (the local shape's `audit: {sink: file, path: ...}`).
    #[arg(long, value_name = "FILE")]
    audit: Option<PathBuf>,
    /// A CloudWatch log group holding the audit (the serverless shape).
    #[arg(long, value_name = "NAME")]
    log_group: Option<String>,
    /// The provider's usage export: a CSV (date,backend,model,input_tokens,
    /// output_tokens[,cost_eur][,cached_tokens][,cache_write_tokens]), or JSON pages
    /// of the OpenAI organization usage API or the Anthropic usage report (with
    /// --backend).
    #[arg(long, value_name = "FILE")]
    provider_usage: Option<PathBuf>,
    /// Fetch the usage from the providers' APIs: every backend of --config with a
    /// `usage_api` (or the one named by --backend). Needs --from.
    #[arg(long)]
    fetch: bool,
    /// The backend a provider's own export covers (or the one backend to --fetch).
    #[arg(long, value_name = "NAME")]
    backend: Option<String>,
    /// The configuration declaring the backends' `usage_api` (for --fetch).
    #[arg(long, value_name = "FILE", default_value = "flexway.yaml")]
    config: PathBuf,
    /// First UTC date included, YYYY-MM-DD.
    #[arg(long, value_name = "DATE")]
    from: Option<String>,
    /// Last UTC date included, YYYY-MM-DD (with --fetch, today by default).
    #[arg(long, value_name = "DATE")]
    to: Option<String>,
    /// Also write the chargeback (per tenant, agent and backend) corrected to the
    /// provider's totals, with the drift stated on it.
    #[arg(long)]
    chargeback: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Md)]
    format: Format,
    /// Push the drift per backend (flexway_reconciliation_drift_ratio) to this
    /// Prometheus Pushgateway.
    #[arg(long, value_name = "URL")]
    push: Option<String>,
}

pub fn run(mut args: ReconcileArgs) -> ExitCode {
    if args.fetch && args.to.is_none() {
        args.to = Some(reconcile::today());
    }
    let filter = match Filter::new(args.from.clone(), args.to.clone()) {
        Ok(filter) => filter,
        Err(error) => return usage_error(&error.to_string()),
    };
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(error) => return failure(&error),
    };
    let provider = match (&args.provider_usage, args.fetch) {
        (Some(path), false) => read_usage(path, args.backend.as_deref()),
        (None, true) => match filter.dates() {
            (Some(from), Some(to)) => runtime.block_on(fetch_usage(&args, from, to)),
            _ => return usage_error("--fetch needs --from (the first day to fetch)"),
        },
        _ => return usage_error("give exactly one of --provider-usage and --fetch"),
    };
    let provider = match provider {
        Ok(provider) => provider,
        Err(Failure::Usage(message)) => return usage_error(&message),
        Err(Failure::Read(message)) => return failure(&message),
    };
    // The audit folded as it is read: a month of records is never held at once.
    let mut usage = GatewayUsage::new(&filter, args.chargeback);
    let mut unreadable = Vec::new();
    let each = |line: Result<AuditRecord, Unreadable>| match line {
        Ok(record) => usage.add(&record),
        Err(line) => unreadable.push(line),
    };
    let read = match (&args.audit, &args.log_group) {
        (Some(path), None) => for_each_in_file(path, None, each),
        (None, Some(group)) => for_each_in_log_group(group, &filter, each),
        _ => return usage_error("give exactly one of --audit and --log-group"),
    };
    if let Err(error) = read {
        return failure(&error);
    }

    let result = usage.reconcile(&provider);
    let text = match args.format {
        Format::Csv => reconcile::to_csv(&result),
        Format::Json => format!("{:#}\n", reconcile::to_json(&result)),
        Format::Md => reconcile::to_markdown(&result),
    };
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
            return failure(&format!("writing the reconciliation: {error}"));
        }
        _ => {}
    }
    for backend in result.backends.iter().filter(|b| b.growing) {
        eprintln!("warning: {}: the drift grew from one day to the next over the last days", backend.backend);
    }
    // Listed before the push, whose failure ends the command: every unreadable line is
    // named whatever happens to the push.
    let unreadable: Vec<String> = unreadable
        .iter()
        .map(|line| format!("audit: {line}"))
        .chain(provider.unreadable.iter().map(|line| format!("provider usage: {line}")))
        .collect();
    for line in &unreadable {
        eprintln!("unreadable: {line}");
    }
    if let Some(url) = &args.push {
        if let Err(error) = runtime.block_on(fetch::push(url, reconcile::to_prometheus(&result))) {
            return failure(&format!("--push {error}"));
        }
        eprintln!("pushed the drift of {} backend(s) to {url}", result.backends.len());
    }
    if unreadable.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("error: {} unreadable line(s) left out of the reconciliation", unreadable.len());
        ExitCode::from(UNREADABLE_LINES)
    }
}

enum Failure {
    Usage(String),
    Read(String),
}

fn usage_error(message: &str) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(USAGE)
}

fn failure(message: &str) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::FAILURE
}

fn read_usage(path: &std::path::Path, backend: Option<&str>) -> Result<ProviderUsage, Failure> {
    let bytes = std::fs::read(path).map_err(|e| Failure::Read(format!("{}: {e}", path.display())))?;
    let mut read = usage::read(&bytes, backend).map_err(|e| Failure::Usage(format!("{}: {e}", path.display())))?;
    for line in &mut read.unreadable {
        line.at = format!("{}: {}", path.display(), line.at);
    }
    Ok(read)
}

/// Every backend of `--config` with a `usage_api` (or the one `--backend` names),
/// fetched.
async fn fetch_usage(args: &ReconcileArgs, from: Date, to: Date) -> Result<ProviderUsage, Failure> {
    let path = &args.config;
    let loaded = flexway::config::load_file_with(path, &ProcessEnv, Secrets::Check).map_err(|error| {
        let errors: Vec<String> = error.errors.iter().map(ToString::to_string).collect();
        Failure::Read(format!("{}: {}", path.display(), errors.join("; ")))
    })?;
    let secrets = crate::aws::secret_source();
    fetch::fetch_all(&loaded.config, args.backend.as_deref(), secrets.as_ref(), from, to).await.map_err(|e| match e {
        fetch::FetchAllError::NoneDeclared(_) => Failure::Usage(format!("{}: {e}", path.display())),
        e => Failure::Read(e.to_string()),
    })
}
