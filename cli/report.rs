//! `flexway report`: the audit turned into a chargeback table (SPEC §9, §13), from a
//! JSONL file (`--audit`) or from the CloudWatch log group the serverless shape writes
//! (`--log-group`, with the AWS SDK's usual environment: `AWS_REGION`, credentials,
//! `AWS_ENDPOINT_URL`).
//!
//! Exit codes: 0 with the report on stdout; 3 with the report of every readable record
//! on stdout and, on stderr, each line that is not one (the file's line, or the log
//! group's event and stream, and why: cut, damaged, of a newer schema), so that a
//! pipeline notices (SPEC §2); 4 with `--verify` when the HMAC chain breaks, each
//! break listed on stderr (and the report still out); 1 when the audit cannot be read
//! at all or the chain key cannot be resolved; 2 for a usage error (bad dates, not
//! exactly one source).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use flexway::audit::AuditRecord;
use flexway::audit::chain::{Verdict, Verifier};
use flexway::audit::report::{self, Filter, Read, Unreadable};
use flexway::config::SecretRef;

const USAGE: u8 = 2;
/// The report is out, without the lines listed on stderr.
const UNREADABLE_LINES: u8 = 3;
/// The report is out, and the audit's chain breaks where stderr says.
const CHAIN_BROKEN: u8 = 4;
/// Where `--verify` finds the chain key without `--chain-key`.
const CHAIN_KEY_DEFAULT: &str = "env:FLEXWAY_AUDIT_CHAIN_KEY";

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["audit", "log_group"])))]
pub struct ReportArgs {
    /// A JSONL audit file (the local shape's `audit: {sink: file, path: ...}`).
    #[arg(long, value_name = "FILE")]
    audit: Option<PathBuf>,
    /// A CloudWatch log group holding the audit (the serverless shape), e.g.
    /// /flexway/audit; read with the AWS SDK's environment (AWS_REGION, credentials,
    /// AWS_ENDPOINT_URL).
    #[arg(long, value_name = "NAME")]
    log_group: Option<String>,
    /// First UTC date included, YYYY-MM-DD.
    #[arg(long, value_name = "DATE")]
    from: Option<String>,
    /// Last UTC date included, YYYY-MM-DD.
    #[arg(long, value_name = "DATE")]
    to: Option<String>,
    /// Output format: Markdown tables for people, CSV or JSON for finance tooling.
    #[arg(long, value_enum, default_value_t = Format::Md)]
    format: Format,
    /// What a row totals: `tenant` (each tenant's agents and backends) or `run`
    /// (each run, SPEC §15; the calls that named no run in a row of run `-`).
    #[arg(long, value_enum, default_value_t = By::Tenant)]
    by: By,
    /// Check the audit's HMAC chain (the gateway's `audit.chain_key`): every line
    /// altered, forged, removed or moved is listed on stderr, and the exit code is 4.
    #[arg(long)]
    verify: bool,
    /// The chain key's secret reference (env:NAME, file:PATH, an AWS ARN), as the
    /// gateway's `audit.chain_key` [default: env:FLEXWAY_AUDIT_CHAIN_KEY].
    #[arg(long, value_name = "REF", requires = "verify")]
    chain_key: Option<String>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum Format {
    Csv,
    Json,
    #[value(alias = "markdown")]
    Md,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum By {
    Tenant,
    Run,
}

pub fn run(args: ReportArgs) -> ExitCode {
    let filter = match Filter::new(args.from, args.to) {
        Ok(filter) => filter,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(USAGE);
        }
    };
    let mut verifier = None;
    if args.verify {
        let reference = args.chain_key.as_deref().unwrap_or(CHAIN_KEY_DEFAULT);
        match chain_key(reference) {
            // A read from a date on starts inside chains: their heads are not missing.
            Ok(key) => verifier = Some(Verifier::new(&key, args.audit.is_some() || filter.from().is_none())),
            Err(error) => {
                eprintln!("error: --chain-key {reference}: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    let read = match (&args.audit, &args.log_group) {
        (Some(path), None) => read_file(path, verifier.as_mut()),
        (None, Some(group)) => read_log_group(group, &filter, verifier.as_mut()),
        // clap's `source` group already lets exactly one through.
        _ => {
            eprintln!("error: give exactly one of --audit and --log-group");
            return ExitCode::from(USAGE);
        }
    };
    let Read { records, unreadable } = match read {
        Ok(read) => read,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let text = match args.by {
        By::Tenant => {
            let report = report::chargeback(&records, &filter);
            match args.format {
                Format::Csv => report::to_csv(&report),
                // `{:#}` pretty-prints a JSON value.
                Format::Json => format!("{:#}\n", report::to_json(&report)),
                Format::Md => report::to_markdown(&report),
            }
        }
        By::Run => {
            let report = report::by_run(&records, &filter);
            match args.format {
                Format::Csv => report::runs_to_csv(&report),
                Format::Json => format!("{:#}\n", report::runs_to_json(&report)),
                Format::Md => report::runs_to_markdown(&report),
            }
        }
    };
    let mut stdout = std::io::stdout().lock();
    let written = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush());
    for line in &unreadable {
        eprintln!("unreadable: {line}");
    }
    if !unreadable.is_empty() {
        eprintln!("error: {} unreadable line(s) left out of the report", unreadable.len());
    }
    let verdict = verifier.map(Verifier::finish);
    if let Some(verdict) = &verdict {
        tell(
            verdict,
            &args.audit.as_ref().map_or_else(
                || format!("log group {}", args.log_group.as_deref().unwrap_or_default()),
                |p| p.display().to_string(),
            ),
        );
    }
    let done = if verdict.is_some_and(|v| !v.breaks.is_empty()) {
        ExitCode::from(CHAIN_BROKEN)
    } else if unreadable.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(UNREADABLE_LINES)
    };
    match written {
        Ok(()) => done,
        // A closed pipe (`| head`) is the reader's choice, not a failure worth a message.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => done,
        Err(error) => {
            eprintln!("error: writing the report: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The verifier's findings on stderr: each break, then one line of totals.
fn tell(verdict: &Verdict, source: &str) {
    for line in &verdict.breaks {
        eprintln!("chain broken: {source}: {line}");
    }
    let Verdict { verified, chains, breaks } = verdict;
    match breaks.len() {
        0 => eprintln!("verified: {verified} record(s) in {chains} chain(s), unbroken"),
        n => eprintln!("error: {n} break(s) in the audit's chain; {verified} record(s) verified in {chains} chain(s)"),
    }
}

/// The chain key, resolved as the gateway resolves `audit.chain_key`.
fn chain_key(reference: &str) -> Result<Vec<u8>, String> {
    let reference: SecretRef = reference.parse()?;
    let runtime = runtime()?;
    let secret = runtime.block_on(crate::aws::secret_source().resolve(&reference)).map_err(|e| e.to_string())?;
    Ok(secret.expose().as_bytes().to_vec())
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
}

pub(crate) fn read_file(path: &Path, verifier: Option<&mut Verifier>) -> Result<Read, String> {
    let mut read = Read::default();
    for_each_in_file(path, verifier, |line| match line {
        Ok(record) => read.records.push(record),
        Err(unreadable) => read.unreadable.push(unreadable),
    })?;
    Ok(read)
}

/// Each line of the JSONL audit at `path` handed to `each` as it is read: its record,
/// or where (the file and line) and why it is not one.
pub(crate) fn for_each_in_file(
    path: &Path,
    verifier: Option<&mut Verifier>,
    mut each: impl FnMut(Result<AuditRecord, Unreadable>),
) -> Result<(), String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    report::for_each_jsonl(std::io::BufReader::new(file), verifier, |line| {
        each(line.map_err(|mut unreadable| {
            unreadable.at = format!("{}: {}", path.display(), unreadable.at);
            unreadable
        }));
    })
    .map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads the events of the period from the log group, sorted. An event is timestamped
/// when the sink wrote it, a little after its record's `ts`: the query window is the
/// period widened by that delay, and the `ts` filter (in `chargeback`) decides.
pub(crate) fn read_log_group(group: &str, filter: &Filter, verifier: Option<&mut Verifier>) -> Result<Read, String> {
    let runtime = runtime()?;
    let (from, to) = window(filter);
    let mut read = runtime.block_on(crate::aws::read_log_group(group, from, to, verifier))?;
    for line in &mut read.unreadable {
        line.at = format!("log group {group}, {}", line.at);
    }
    Ok(read)
}

/// The records of the period in the log group handed to `each` a page at a time, as
/// they are read (not sorted, never all held), or an event that claims to be a
/// record, where (the group, the event and its stream) and why it is not one.
pub(crate) fn for_each_in_log_group(
    group: &str,
    filter: &Filter,
    mut each: impl FnMut(Result<AuditRecord, Unreadable>),
) -> Result<(), String> {
    let runtime = runtime()?;
    let (from, to) = window(filter);
    runtime.block_on(crate::aws::for_each_in_log_group(group, from, to, |line| {
        each(line.map_err(|mut unreadable| {
            unreadable.at = format!("log group {group}, {}", unreadable.at);
            unreadable
        }));
    }))
}

/// The events' window (Unix ms) of the period: widened by the write delay, and never
/// before the epoch, which CloudWatch refuses (`--from 1969-12-31`; no event is older).
fn window(filter: &Filter) -> (Option<i64>, Option<i64>) {
    let margin = crate::aws::WRITE_DELAY_MARGIN_MS;
    let (from, to) = filter.unix_millis();
    (from.map(|ms| ms.saturating_sub(margin).max(0)), to.map(|ms| ms.saturating_add(margin).max(0)))
}
