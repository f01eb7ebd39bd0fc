//! `flexway report`: the audit turned into a chargeback table (SPEC §9, §13).
//!
//! Exit codes: 0 with the report on stdout; 1 when the audit cannot be read (the error
//! names the file and line); 2 for a usage error (bad dates, a source this build cannot
//! read).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use flexway::audit::report::{self, Filter};

const USAGE: u8 = 2;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["audit", "log_group"])))]
pub struct ReportArgs {
    /// A JSONL audit file (the local shape's `audit: {sink: file, path: ...}`).
    #[arg(long, value_name = "FILE")]
    audit: Option<PathBuf>,
    /// A CloudWatch log group holding the audit (the serverless shape).
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
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Csv,
    Json,
    #[value(alias = "markdown")]
    Md,
}

pub fn run(args: ReportArgs) -> ExitCode {
    let filter = match Filter::new(args.from, args.to) {
        Ok(filter) => filter,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(USAGE);
        }
    };
    let Some(path) = args.audit else {
        // clap guarantees one source; without --audit it is --log-group.
        eprintln!("error: reading a CloudWatch log group needs the aws build (flexway-aws)");
        return ExitCode::from(USAGE);
    };
    let records = match read(&path) {
        Ok(records) => records,
        Err(error) => {
            eprintln!("error: {}: {error}", path.display());
            return ExitCode::FAILURE;
        }
    };
    let report = report::chargeback(&records, &filter);
    let text = match args.format {
        Format::Csv => report::to_csv(&report),
        // `{:#}` pretty-prints a JSON value.
        Format::Json => format!("{:#}\n", report::to_json(&report)),
        Format::Md => report::to_markdown(&report),
    };
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`| head`) is the reader's choice, not a failure worth a message.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: writing the report: {error}");
            ExitCode::FAILURE
        }
    }
}

fn read(path: &Path) -> Result<Vec<flexway::audit::AuditRecord>, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    report::read_jsonl(std::io::BufReader::new(file)).map_err(|e| e.to_string())
}
