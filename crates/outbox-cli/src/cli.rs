//! The command line: every command takes `--database-url` (or `DATABASE_URL`).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_events::{DispatchMode, WorkerConfig};
use uuid::Uuid;

use crate::{demo, ops};

/// Dispatches a CRM platform's post-commit events from a transactional outbox table.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about)]
pub struct Cli {
    /// The database: postgres://… or sqlite://PATH.
    #[arg(long, global = true, env = "DATABASE_URL")]
    pub database_url: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the whole repair on a CRM workload and verify it from the database (SQLite by
    /// default; a fresh file is created and its path printed).
    Demo(DemoArgs),
    /// Apply the migrations this binary carries (a no-op when they are applied).
    Migrate,
    /// Enqueue the demo CRM workload (creates the demo tables when missing).
    Seed(SeedArgs),
    /// Run workers over the outbox.
    Work(WorkArgs),
    /// Check the demo invariants from the database.
    Verify(JsonArg),
    /// Counts by status, the oldest pending age, stale claims and blocked keys.
    Status(JsonArg),
    /// Return failed rows to pending (audited in the log).
    Retry(RetryArgs),
    /// Print PostgreSQL plans of the eligible-event and claim queries.
    Explain,
    /// Set missing RecordKey values of non-terminal rows, in resumable batches.
    BackfillRecordKeys(BackfillArgs),
    /// Print the consumer map: every registered consumer, its effects and its verdict.
    Consumers(JsonArg),
    /// Exit 0 only when OUTBOX_PULL_WORKER may flip; otherwise print one line per reason.
    Gate(JsonArg),
    /// Measure throughput, latency and cost on PostgreSQL (run it as `cargo xtask bench`).
    #[command(hide = true)]
    Bench(crate::bench::BenchArgs),
}

/// `--json`.
#[derive(Debug, Args)]
pub struct JsonArg {
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Which dispatcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Independent pull workers.
    Pull,
    /// The legacy batch dispatcher.
    Legacy,
}

impl From<Mode> for DispatchMode {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Pull => DispatchMode::Pull,
            Mode::Legacy => DispatchMode::Legacy,
        }
    }
}

/// The demo workload's size.
#[derive(Debug, Clone, Args)]
pub struct WorkloadArgs {
    /// Events to enqueue.
    #[arg(long, default_value_t = 2_000)]
    pub events: usize,
    /// Records the events are about (several events per record).
    #[arg(long, default_value_t = 200)]
    pub records: usize,
}

/// Worker settings shared by `work` and `demo`.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Concurrent workers.
    #[arg(long, default_value_t = outbox_events::DEFAULT_WORKERS)]
    pub workers: usize,
    /// Share of handler attempts that fail on purpose (handler errors and lock timeouts).
    #[arg(long)]
    pub fault_rate: Option<f64>,
    /// Heartbeat interval in milliseconds.
    #[arg(long)]
    pub heartbeat_ms: Option<u64>,
    /// Stale-after in milliseconds.
    #[arg(long)]
    pub stale_after_ms: Option<u64>,
    /// Lock timeout of an attempt in milliseconds.
    #[arg(long)]
    pub lock_timeout_ms: Option<u64>,
    /// Base retry delay in milliseconds.
    #[arg(long)]
    pub retry_delay_ms: Option<u64>,
    /// Longest retry delay in milliseconds (the delay doubles per failure up to this).
    #[arg(long)]
    pub max_retry_delay_ms: Option<u64>,
    /// MaxRetryAttempts.
    #[arg(long)]
    pub max_retry_attempts: Option<i32>,
}

impl WorkerArgs {
    /// The worker configuration, on top of `base`.
    pub fn config(&self, base: WorkerConfig) -> WorkerConfig {
        let ms = Duration::from_millis;
        let mut c = base.with_workers(self.workers);
        if let Some(v) = self.heartbeat_ms {
            c = c.with_heartbeat_interval(ms(v));
        }
        if let Some(v) = self.stale_after_ms {
            c = c.with_stale_after(ms(v));
        }
        if let Some(v) = self.lock_timeout_ms {
            c = c.with_lock_timeout(ms(v));
        }
        if let Some(v) = self.retry_delay_ms {
            c = c.with_retry_delay(ms(v));
        }
        if let Some(v) = self.max_retry_delay_ms {
            c = c.with_max_retry_delay(ms(v));
        }
        if let Some(v) = self.max_retry_attempts {
            c = c.with_max_retry_attempts(v);
        }
        c
    }
}

/// `outbox demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub workers: WorkerArgs,
    /// Pull workers (the repair) or the legacy dispatcher.
    #[arg(long, value_enum, default_value_t = Mode::Pull)]
    pub mode: Mode,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `outbox seed`.
#[derive(Debug, Args)]
pub struct SeedArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Share of seeded events that ask their handler to fail once (exercised by `work`).
    #[arg(long, default_value_t = 0.0)]
    pub fault_rate: f64,
    /// Slow events to add, spread over the workload (their handler sleeps `--slow-ms`).
    #[arg(long, default_value_t = 0)]
    pub slow_events: usize,
    /// How long a slow event's handler sleeps, in milliseconds.
    #[arg(long, default_value_t = 5_000)]
    pub slow_ms: u64,
    /// Poison records to add first (`Account:P000000`, …): each has a poison event, whose
    /// handler aborts the `outbox work` process on every attempt until the event is counted
    /// `failed`, and a younger event that must run after it. Run them under a supervisor that
    /// restarts dead processes; `outbox demo` runs in one process and seeds none.
    #[arg(long, default_value_t = 0)]
    pub poison_events: usize,
}

/// `outbox work`.
#[derive(Debug, Args)]
pub struct WorkArgs {
    #[command(flatten)]
    pub workers: WorkerArgs,
    /// Exit when no row is left pending or processing.
    #[arg(long)]
    pub until_drained: bool,
    /// Select the pull workers (`true`) or the legacy dispatcher; overrides
    /// OUTBOX_PULL_WORKER. Pull mode still needs the rollout gate to pass.
    #[arg(long)]
    pub pull_worker: Option<bool>,
    /// Print the end-of-run counters as one JSON document instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// `outbox retry`.
#[derive(Debug, Args)]
pub struct RetryArgs {
    /// Return this failed row to pending.
    #[arg(long, conflicts_with = "failed", required_unless_present = "failed")]
    pub id: Option<Uuid>,
    /// Return every failed row to pending.
    #[arg(long)]
    pub failed: bool,
    /// With --failed: only rows of this event type.
    #[arg(long, requires = "failed")]
    pub event_type: Option<String>,
}

/// `outbox backfill-record-keys`.
#[derive(Debug, Args)]
pub struct BackfillArgs {
    /// Rows per batch.
    #[arg(long, default_value_t = 1_000)]
    pub batch: u32,
    /// Resume after this id (printed by an interrupted run).
    #[arg(long)]
    pub after: Option<Uuid>,
    /// Report what would change without writing.
    #[arg(long)]
    pub dry_run: bool,
}

/// Runs one command; the exit code says whether it succeeded.
pub async fn run(cli: Cli) -> Result<ExitCode> {
    let url = cli.database_url.as_deref();
    match cli.command {
        Command::Demo(args) => demo::run_demo(url, args).await,
        Command::Migrate => ops::migrate(url).await,
        Command::Seed(args) => demo::seed_command(url, args).await,
        Command::Work(args) => demo::work_command(url, args).await,
        Command::Verify(a) => demo::verify_command(url, a.json).await,
        Command::Status(a) => ops::status(url, a.json).await,
        Command::Retry(args) => ops::retry(url, args).await,
        Command::Explain => ops::explain(url).await,
        Command::BackfillRecordKeys(args) => ops::backfill(url, args).await,
        Command::Consumers(a) => ops::consumers(a.json),
        Command::Gate(a) => ops::gate(url, a.json).await,
        Command::Bench(args) => crate::bench::run(url, args).await,
    }
}
