//! The operator side of the outbox as a library: the commands of the `outbox` binary
//! (`migrate`, `status`, `events`, `retry`, `explain`, `backfill-record-keys`, `consumers`,
//! `gate`, `prune`) as a [`clap`] subcommand enum that a service mounts in its own command
//! line, with its own registered consumers, and the shared worker options.
//!
//! ```no_run
//! use clap::Parser;
//! use outbox_cli::OperatorCommand;
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[arg(long, env = "DATABASE_URL")]
//!     database_url: Option<String>,
//!     #[command(subcommand)]
//!     command: OperatorCommand,
//! }
//!
//! # async fn run() -> anyhow::Result<std::process::ExitCode> {
//! let cli = Cli::parse();
//! // The consumers this service registers with its dispatcher: `gate` and `consumers` judge them.
//! let consumers = Vec::new();
//! outbox_cli::run_operator(cli.database_url.as_deref(), cli.command, &consumers).await
//! # }
//! ```
//!
//! The `outbox` binary is this library with no consumers of its own; the demo workload
//! (`outbox-demo`) mounts the same commands with the demo's consumers.

#![warn(missing_docs)]

pub mod args;
pub mod console;
pub mod db;
pub mod metrics;
pub mod ops;
pub mod status;
pub mod webhooks;

use std::process::ExitCode;

use anyhow::Result;
use clap::Subcommand;
use outbox_events::Consumer;

use args::{
    AuditArgs, BackfillArgs, EventsArgs, HeadsArgs, JsonArg, PauseArgs, PruneArgs, RetryArgs,
};

/// The operator commands. Each one changes only what it was asked to change.
#[derive(Debug, Subcommand)]
pub enum OperatorCommand {
    /// Apply the migrations this binary carries (a no-op when they are applied).
    Migrate,
    /// Counts by status, the oldest pending age, stale claims and the longest-blocked keys;
    /// with `--key`, one record's rows and why its head is not running now.
    Status(status::StatusArgs),
    /// List outbox rows (never their payloads), oldest first.
    Events(EventsArgs),
    /// Return failed rows to pending (recorded in the audit log with who and when).
    Retry(RetryArgs),
    /// Pause an event type: every dispatcher stops claiming its rows within a second, and a
    /// record whose head is of that type waits behind it in order (audited).
    Pause(PauseArgs),
    /// Resume a paused event type (audited).
    Resume(PauseArgs),
    /// The newest operator actions (pauses, resumes, retries) with who and when.
    Audit(AuditArgs),
    /// Serve the operator console in the browser (read-only unless --allow-actions; an address
    /// other than loopback needs a token): see docs/console.md.
    Console(console::ConsoleArgs),
    /// Print PostgreSQL plans of the eligible-event and claim queries.
    Explain,
    /// Set missing RecordKey values of non-terminal rows, in resumable batches.
    BackfillRecordKeys(BackfillArgs),
    /// Check the claim's derived heads table against the outbox rows (exit 1 when they differ);
    /// `--repair` puts differing keys right without blocking, `--rebuild` recomputes it.
    Heads(HeadsArgs),
    /// Print the consumer map: every registered consumer, its effects and its verdict.
    Consumers(JsonArg),
    /// Exit 0 only when OUTBOX_PULL_WORKER may flip for the registered consumers; otherwise
    /// print one line per reason.
    Gate(JsonArg),
    /// Delete terminal rows (processed, failed) older than an age, in small batches; never a
    /// pending or processing row. `--dry-run` counts them.
    Prune(PruneArgs),
    /// Webhook endpoints: add, list, disable, enable, rotate a secret, recent attempts (see
    /// docs/webhooks.md).
    #[command(subcommand)]
    Webhooks(webhooks::WebhooksCommand),
}

/// Runs one operator command against the database at `url`; `consumers` are the consumers the
/// calling service registers (judged by `consumers` and `gate`). The exit code says whether it
/// succeeded.
pub async fn run_operator(
    url: Option<&str>,
    command: OperatorCommand,
    consumers: &[Consumer],
) -> Result<ExitCode> {
    match command {
        OperatorCommand::Migrate => ops::migrate(url).await,
        OperatorCommand::Status(args) => status::run(url, args).await,
        OperatorCommand::Events(args) => ops::events(url, args).await,
        OperatorCommand::Retry(args) => ops::retry(url, args).await,
        OperatorCommand::Pause(args) => ops::pause(url, args, true).await,
        OperatorCommand::Resume(args) => ops::pause(url, args, false).await,
        OperatorCommand::Audit(args) => ops::audit(url, args).await,
        OperatorCommand::Console(args) => console::run(url, args, consumers).await,
        OperatorCommand::Explain => ops::explain(url).await,
        OperatorCommand::BackfillRecordKeys(args) => ops::backfill(url, args).await,
        OperatorCommand::Heads(args) => ops::heads(url, args).await,
        OperatorCommand::Consumers(a) => ops::consumers(consumers, a.json),
        OperatorCommand::Gate(a) => ops::gate(url, consumers, a.json).await,
        OperatorCommand::Prune(args) => ops::prune(url, args).await,
        OperatorCommand::Webhooks(command) => webhooks::run(url, command).await,
    }
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM: how the long-running commands (`relay`, `console`)
/// stop.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                tokio::signal::ctrl_c().await.ok();
            }
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await.ok();
    }
}

/// Logs to stderr at `default_level` unless `RUST_LOG` says otherwise.
pub fn init_tracing(default_level: &str) {
    use tracing_subscriber::EnvFilter;
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Runs `main` on a multi-threaded runtime and turns its outcome into the process's exit code
/// (an error is printed with its causes).
pub fn block_on(main: impl Future<Output = Result<ExitCode>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(main) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
