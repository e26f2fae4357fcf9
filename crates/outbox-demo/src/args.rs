//! The demo workload's command line: `outbox-demo` runs the demo (its flags below), and the
//! subcommands `seed`, `work` and `verify` run its steps as separate processes (the fault
//! suite's way); the operator commands of [`outbox_cli::OperatorCommand`] are mounted too, with
//! the demo's consumers.

use clap::{Args, Parser, Subcommand};
use outbox_cli::OperatorCommand;
use outbox_cli::args::{Mode, WorkerArgs};

/// The whole repair on a CRM workload, verified from the database.
#[derive(Debug, Parser)]
#[command(
    name = "outbox-demo",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    /// The database: postgres://… or sqlite://PATH (a fresh SQLite file when omitted).
    #[arg(long, global = true, env = "DATABASE_URL")]
    pub database_url: Option<String>,

    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub demo: DemoArgs,
}

/// The demo's steps, and the operator commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Enqueue the demo CRM workload (creates the demo tables when missing).
    Seed(SeedArgs),
    /// Run workers with the demo's handlers over the outbox.
    Work(WorkArgs),
    /// Check the demo invariants from the database.
    Verify(outbox_cli::args::JsonArg),
    /// Write rows the way other code does, beside the workers (the fault suite's foreign
    /// writers): plain inserts for the demo's records with older `CreatedDate`s, sleeping
    /// inside their transactions, some rolled back.
    Foreign(ForeignArgs),
    #[command(flatten)]
    Operator(OperatorCommand),
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

/// `outbox-demo` (and `outbox demo`).
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
    /// Relay to this NATS server (JetStream) as a second consumer: each write also enqueues its
    /// record's change (`account.changed`, `lead.changed`), which the relay publishes while the
    /// demo's handlers run the rest; the stream is then read back and verified.
    #[arg(long, value_name = "NATS_URL")]
    pub relay: Option<String>,
    /// The stream of `--relay` (created when missing; this run's messages are verified).
    #[arg(long, default_value = "OUTBOX_DEMO")]
    pub relay_stream: String,
    /// Deliver webhooks as a second consumer: each write also enqueues its record's change
    /// (`account.changed`, `lead.changed`), which the webhooks fan out to one endpoint, a
    /// receiver in this process that verifies every signature; its log is checked after the
    /// run (every change delivered, verified, in each record's order).
    #[arg(long, conflicts_with = "relay")]
    pub webhooks: bool,
}

/// `outbox-demo seed`.
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
    /// Welcome emails whose attempt waits `--held-ms` after its send before it commits
    /// (`Account:H000000`, …), spread over the workload: a window for the fault suite's kills
    /// between a send and its commit.
    #[arg(long, default_value_t = 0)]
    pub held_sends: usize,
    /// How long a held send's attempt waits after the send, in milliseconds.
    #[arg(long, default_value_t = 2_000)]
    pub held_ms: u64,
    /// Poison records to add first (`Account:P000000`, …): each has a poison event, whose
    /// handler aborts the `outbox-demo work` process on every attempt until the event is counted
    /// `failed`, and a younger event that must run after it. Run them under a supervisor that
    /// restarts dead processes; the demo itself runs in one process and seeds none.
    #[arg(long, default_value_t = 0)]
    pub poison_events: usize,
}

/// `outbox-demo foreign`.
#[derive(Debug, Args)]
pub struct ForeignArgs {
    /// How long to write, in seconds.
    #[arg(long, default_value_t = 10)]
    pub secs: u64,
    /// Concurrent writers, each with its own connection.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
}

/// `outbox-demo work`.
#[derive(Debug, Args)]
pub struct WorkArgs {
    #[command(flatten)]
    pub workers: WorkerArgs,
    #[command(flatten)]
    pub metrics: outbox_cli::metrics::MetricsArgs,
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
