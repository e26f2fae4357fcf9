//! The demo and its steps (`seed`, `work`, `verify`) as commands: the whole repair on a CRM
//! workload, with faults injected on purpose and every invariant read back from the database.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use chrono::Utc;
use outbox_events::{DispatchMode, Dispatcher, ModeDecision, WorkerConfig};
use outbox_persistence::{ClaimPolicy, ConnectConfig, OutboxRepository};

use outbox_cli::db;

use crate::args::{Cli, Command, SeedArgs};
use crate::handlers::{Actions, registered_consumers};
use crate::sink::MailSink;
use crate::{schema, verify, workload};

/// Runs the command line.
pub async fn run(cli: Cli) -> Result<ExitCode> {
    let url = cli.database_url.as_deref();
    match cli.command {
        None => crate::demo::run_demo(url, cli.demo).await,
        Some(Command::Seed(args)) => seed_command(url, args).await,
        Some(Command::Work(args)) => crate::work::work_command(url, args).await,
        Some(Command::Verify(a)) => verify_command(url, a.json).await,
        Some(Command::Foreign(args)) => crate::foreign::foreign_command(url, args).await,
        Some(Command::Operator(command)) => {
            let consumers = registered_consumers(Arc::new(Actions::new()?)).await?;
            outbox_cli::run_operator(url, command, &consumers).await
        }
    }
}

/// Worker settings that make faults visible within a demo's run time: a claim whose heartbeat
/// stopped is reclaimed after 3 s instead of 30 s.
pub(crate) fn demo_worker_config(mode: DispatchMode) -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(mode)
        .with_poll_interval(Duration::from_millis(200))
        .with_heartbeat_interval(Duration::from_millis(500))
        .with_stale_after(Duration::from_secs(3))
        .with_retry_delay(Duration::from_millis(50))
        .with_max_retry_delay(Duration::from_secs(1))
        .with_max_retry_attempts(8)
        .with_lock_timeout(Duration::from_millis(300))
        .with_shutdown_timeout(Duration::from_secs(10))
}

pub(crate) fn connect_config(config: &WorkerConfig) -> ConnectConfig {
    // `workers + 3`, and one more for the fault injector's lock holds (its own transaction
    // that holds a row lock for a while).
    let pool = ConnectConfig::for_workers(config.workers);
    ConnectConfig {
        max_connections: pool.max_connections + 1,
        lock_timeout: config.lock_timeout,
        ..pool
    }
}

pub(crate) async fn stats(
    repo: &Arc<dyn OutboxRepository>,
) -> Result<outbox_persistence::OutboxStats> {
    Ok(repo
        .stats(ClaimPolicy::new(
            Duration::from_secs(30),
            Duration::ZERO,
            outbox_events::DEFAULT_MAX_RETRY_ATTEMPTS,
        ))
        .await?)
}

/// The name of a dispatch mode in reports.
pub(crate) fn mode_name(mode: DispatchMode) -> &'static str {
    match mode {
        DispatchMode::Pull => "pull",
        DispatchMode::Legacy => "legacy",
    }
}

/// `seed`.
pub async fn seed_command(url: Option<&str>, args: SeedArgs) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    let repo = db.repository();
    let seeded = workload::seed(
        &db,
        &repo,
        &workload::Workload {
            events: args.workload.events,
            records: args.workload.records,
            fault_rate: args.fault_rate,
            seed: Utc::now().timestamp_millis() as u64,
            slow: workload::SlowEvents {
                count: args.slow_events,
                sleep_ms: args.slow_ms,
            },
            held: workload::SlowEvents {
                count: args.held_sends,
                sleep_ms: args.held_ms,
            },
            poison: args.poison_events,
            feed: false,
        },
    )
    .await?;
    // Create the provider's tables now, so that work processes starting together do not race
    // to create them.
    MailSink::open(url.unwrap_or_default()).await?.close().await;
    println!(
        "seeded {} events over {} records ({} marked to fail their first attempt, {} slow, {} held sends, {} poison)",
        seeded.events,
        seeded.records,
        seeded.marked_faults,
        args.slow_events,
        args.held_sends,
        seeded.poison
    );
    Ok(ExitCode::SUCCESS)
}

/// Decides what `work` runs, through the library (pull mode only when asked for and the rollout
/// gate passes, fail closed to the legacy path), and says why on stderr when pull mode was
/// refused.
pub(crate) async fn decide(dispatcher: &Dispatcher) -> Result<ModeDecision> {
    let decision = dispatcher.decide().await?;
    if !decision.refused.is_empty() {
        eprintln!(
            "OUTBOX_PULL_WORKER asks for pull workers, but the rollout gate refuses ({} reason(s)); running the legacy dispatcher:\n  {}",
            decision.refused.len(),
            decision.refused.join("\n  ")
        );
    }
    Ok(decision)
}

/// `verify`.
pub async fn verify_command(url: Option<&str>, json: bool) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    if !schema::exists(&db).await? {
        anyhow::bail!(
            "this database holds no demo workload (run `outbox-demo seed` or `outbox demo` first)"
        );
    }
    let sink = MailSink::open(url.unwrap_or_default()).await?;
    let v = verify::verify(&db, &sink).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for c in &v.checks {
            println!(
                "[{}] {}: {}",
                if c.ok { " ok " } else { "FAIL" },
                c.name,
                c.detail
            );
        }
        println!("{}", if v.passed() { "PASSED" } else { "FAILED" });
    }
    Ok(if v.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
