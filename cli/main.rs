//! `flexway`: the local shape and the operator's tools (SPEC §13).
#![allow(clippy::print_stdout)]

// The AWS adapters when the `aws` feature is on, refusals with how to get them when not.
#[cfg_attr(feature = "aws", path = "aws/built.rs")]
#[cfg_attr(not(feature = "aws"), path = "aws/not_built.rs")]
mod aws;
mod cache;
mod key;
/// The PostgreSQL cache store when the `postgres` feature is on, a refusal when not.
mod postgres;
mod reconcile;
mod report;
mod serve;
mod stack;
mod workers;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use flexway::config::Secrets;

/// mimalloc: the request path allocates many small, short-lived buffers across
/// threads, where glibc's malloc spends its time consolidating.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "flexway", version, about = "Flexway AI gateway")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway locally (the embedded shape).
    Serve {
        #[arg(long, default_value = "flexway.yaml")]
        config: PathBuf,
        /// Address to listen on; port 0 picks a free port (printed on start).
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// Reload the configuration when the file changes, checked this often
        /// (`--watch` alone: every 2s). SIGHUP reloads it in any case.
        #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "2s",
              value_parser = flexway::config::parse_duration)]
        watch: Option<std::time::Duration>,
    },
    /// Check a configuration: every error listed, warnings printed.
    ///
    /// Secret references are checked for their form; an unset variable or an
    /// unreadable file is a warning (a config repository's CI holds no secrets).
    Validate {
        #[arg(long, default_value = "flexway.yaml")]
        config: PathBuf,
        /// Resolve every secret reference, as `serve` does: one that cannot be
        /// resolved here is an error. AWS Secrets Manager and SSM references are read
        /// with the AWS SDK's usual environment and credentials.
        #[arg(long)]
        resolve_secrets: bool,
        /// Check it is a serverless config (the DynamoDB ledger, the CloudWatch audit)
        /// and print the stack parameters its ARN references need, as `sam deploy
        /// --parameter-overrides` takes them.
        #[arg(long)]
        serverless: bool,
        /// With --serverless: check that these stack parameters (the string given to
        /// `sam deploy --parameter-overrides`) grant every ARN the config references,
        /// instead of printing them.
        #[arg(long, value_name = "PARAMETERS", requires = "serverless")]
        stack_parameters: Option<stack::StackParameters>,
    },
    /// Turn the audit (a JSONL file or a CloudWatch log group) into a chargeback table:
    /// per tenant, agent and backend.
    Report(report::ReportArgs),
    /// Set the audit's tokens and cost against the provider's usage (an export or
    /// its usage API): the drift per backend, model and day, and with --chargeback
    /// the chargeback corrected to the provider's totals.
    Reconcile(reconcile::ReconcileArgs),
    /// Manage API keys.
    Key {
        #[command(subcommand)]
        command: KeyCommand,
    },
    /// The response cache (`ai.cache`): purge a tenant's entries, or count them. On
    /// the embedded store, with the gateway stopped (it holds the file).
    Cache {
        #[command(subcommand)]
        command: CacheCommand,
    },
}

#[derive(Subcommand)]
enum CacheCommand {
    /// Remove a tenant's cached answers (of one policy, with --policy).
    Purge {
        #[arg(long, default_value = "flexway.yaml")]
        config: PathBuf,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        policy: Option<String>,
    },
    /// Entries and bytes per tenant and policy.
    Stats {
        #[arg(long, default_value = "flexway.yaml")]
        config: PathBuf,
    },
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Print a new key once, and the config line that declares its SHA-256.
    New {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        agent: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve { config, listen, watch } => serve::run(&config, &listen, watch),
        Command::Validate { config, resolve_secrets, serverless, stack_parameters } => {
            let secrets = if resolve_secrets { Secrets::Resolve } else { Secrets::Check };
            let stack = match (serverless, stack_parameters) {
                (false, _) => None,
                (true, None) => Some(stack::Mode::Print),
                (true, Some(given)) => Some(stack::Mode::Check(given)),
            };
            validate(&config, secrets, stack)
        }
        Command::Report(args) => report::run(args),
        Command::Reconcile(args) => reconcile::run(args),
        Command::Key { command: KeyCommand::New { tenant, agent } } => key::new(&tenant, agent.as_deref()),
        Command::Cache { command: CacheCommand::Purge { config, tenant, policy } } => {
            cache::purge(&config, &tenant, policy.as_deref())
        }
        Command::Cache { command: CacheCommand::Stats { config } } => cache::stats(&config),
    }
}

/// `stack`: with `--serverless`, what to do with the stack parameters.
fn validate(path: &std::path::Path, secrets: Secrets, stack: Option<stack::Mode>) -> ExitCode {
    let loaded = match flexway::config::load_file_with(path, &flexway::config::ProcessEnv, secrets) {
        Ok(loaded) => loaded,
        Err(error) => {
            for diagnostic in &error.errors {
                eprintln!("error: {}: {diagnostic}", path.display());
            }
            if let Some(line) = error.unlisted_line() {
                eprintln!("error: {}: {line}", path.display());
            }
            eprintln!("{}: {} error(s)", path.display(), error.count());
            return ExitCode::FAILURE;
        }
    };
    let mut warnings = loaded.warnings;
    let mut errors = Vec::new();
    let review = stack.map(|mode| stack::review(&loaded.config, &mode));
    if let Some(review) = &review {
        errors.extend(review.errors.iter().map(ToString::to_string));
        warnings.extend(review.warnings.iter().cloned());
    }
    for warning in &warnings {
        eprintln!("warning: {}: {warning}", path.display());
    }
    // Loading checked the local references; AWS ones are network calls, made here.
    if secrets == Secrets::Resolve {
        match resolve_secrets(&loaded.config) {
            Ok(failures) => errors.extend(failures.iter().map(|(at, error)| format!("{at}: {error}"))),
            Err(e) => {
                eprintln!("error: cannot start the runtime: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if !errors.is_empty() {
        for error in &errors {
            eprintln!("error: {}: {error}", path.display());
        }
        eprintln!("{}: {} error(s)", path.display(), errors.len());
        return ExitCode::FAILURE;
    }
    let ok = format!("{}: ok ({} warning(s))", path.display(), warnings.len());
    match review.and_then(|review| review.overrides) {
        // stdout is the parameters alone, for `params="$(flexway validate ...)"`.
        Some(overrides) => {
            println!("{overrides}");
            eprintln!("{ok}");
        }
        None => println!("{ok}"),
    }
    ExitCode::SUCCESS
}

/// Every secret reference of `config` resolved as a start would: the failures, each
/// with its path in the document.
fn resolve_secrets(config: &flexway::config::Config) -> std::io::Result<Vec<(String, flexway::secret::SecretError)>> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let source = aws::secret_source();
    // The usage APIs' admin keys too: only `reconcile --fetch` reads them, but a
    // config repository's CI checks every reference it holds.
    let mut references = config.secret_references();
    references.extend(config.usage_api_references());
    let (_, failures) = runtime.block_on(flexway::secret::resolve_all(&references, source.as_ref()));
    Ok(failures)
}
