//! `outbox demo` and its sub-steps (`seed`, `work`, `verify`): the whole repair on a CRM
//! workload, with faults injected on purpose and every invariant read back from the database.

mod faults;
mod handlers;
mod integrity;
mod journal;
mod schema;
mod sink;
mod verify;
mod workload;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use chrono::Utc;
use indicatif::{ProgressBar, ProgressStyle};
use outbox_events::{DispatchMode, Dispatcher, MetricsSnapshot, ModeDecision, WorkerConfig};
use outbox_persistence::{ClaimPolicy, ConnectConfig, Database, OutboxRepository};
use serde::Serialize;

use crate::cli::{DemoArgs, SeedArgs, WorkArgs};
use crate::db;

pub use handlers::{Actions, Faults, consumers, handlers};
pub use sink::MailSink;

/// The demo's default share of failing attempts.
pub const DEFAULT_DEMO_FAULT_RATE: f64 = 0.05;

/// Worker settings that make faults visible within a demo's run time: a claim whose heartbeat
/// stopped is reclaimed after 3 s instead of 30 s.
fn demo_worker_config(mode: DispatchMode) -> WorkerConfig {
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

fn connect_config(config: &WorkerConfig) -> ConnectConfig {
    ConnectConfig {
        max_connections: (config.workers as u32 * 2 + 4).max(8),
        lock_timeout: config.lock_timeout,
        ..ConnectConfig::default()
    }
}

/// The demo's report.
#[derive(Debug, Serialize)]
struct Report {
    backend: &'static str,
    database: String,
    mode: String,
    workers: usize,
    events: usize,
    records: usize,
    seconds: f64,
    events_per_second: f64,
    faults: faults::FaultReport,
    workers_observed: Observed,
    verification: verify::Verification,
}

#[derive(Debug, Serialize)]
struct Observed {
    claimed: u64,
    processed: u64,
    retried: u64,
    failed: u64,
    lock_timeouts: u64,
    stale_reclaims: u64,
    lost_claims: u64,
    detached_bookkeeping: u64,
}

impl From<MetricsSnapshot> for Observed {
    fn from(m: MetricsSnapshot) -> Self {
        Self {
            claimed: m.claimed,
            processed: m.processed,
            retried: m.retried,
            failed: m.failed,
            lock_timeouts: m.lock_timeouts,
            stale_reclaims: m.stale_reclaims,
            lost_claims: m.lost_claims,
            detached_bookkeeping: m.detached_bookkeeping,
        }
    }
}

/// `outbox demo`.
pub async fn run_demo(url: Option<&str>, args: DemoArgs) -> Result<ExitCode> {
    let url = match url {
        Some(url) => url.to_string(),
        None => {
            let path = std::env::temp_dir().join(format!(
                "outbox-demo-{}.db",
                Utc::now().format("%Y%m%d-%H%M%S-%3f")
            ));
            format!("sqlite://{}", path.display())
        }
    };
    let mode: DispatchMode = args.mode.into();
    let config = args.workers.config(demo_worker_config(mode));
    config.validate().map_err(anyhow::Error::msg)?;
    let db = db::connect(Some(&url), connect_config(&config)).await?;
    if !args.json {
        println!(
            "outbox demo on {} ({})",
            outbox_persistence::redact_url(&url),
            db.backend_name()
        );
    }
    db.migrate().await.context("migrating")?;
    db::check_schema(&db).await?;
    let repo = db.repository();
    let before = stats(&repo).await?;
    if before.pending + before.processing > 0 {
        anyhow::bail!(
            "the database already holds {} unfinished events; run the demo on a fresh database (omit --database-url for a new SQLite file)",
            before.pending + before.processing
        );
    }
    // One process hosts every worker here, so no poison event: it would abort the demo itself.
    let seeded = workload::seed(
        &db,
        &repo,
        &workload::Workload {
            events: args.workload.events,
            records: args.workload.records,
            seed: Utc::now().timestamp_millis() as u64,
            ..workload::Workload::default()
        },
    )
    .await?;
    let fault_rate = args.workers.fault_rate.unwrap_or(DEFAULT_DEMO_FAULT_RATE);
    let sink = MailSink::open(&url).await?;
    let run = sink.run_started(mode_name(mode)).await?;
    let outcome = run_workers(
        &db,
        &repo,
        &sink,
        config.clone(),
        fault_rate,
        true,
        !args.json,
    )
    .await?;
    sink.run_completed(run, &outcome.metrics).await?;
    let mut verification = verify::verify(&db, &sink).await?;
    // A stale reclaim counts the attempt that died (the worker killed mid-attempt).
    let m = &outcome.metrics;
    let counted = m.retried + m.failed + m.stale_reclaims;
    verification.checks.push(verify::Check {
        name: "every failed attempt counted once in RetryCount",
        ok: verification.retries == counted as i64,
        detail: format!(
            "sum(RetryCount) = {}; attempts the workers ended in a retry or failure ({}) + stale reclaims that counted a dead attempt ({}) = {counted}",
            verification.retries,
            m.retried + m.failed,
            m.stale_reclaims,
        ),
    });
    let report = Report {
        backend: db.backend_name(),
        database: outbox_persistence::redact_url(&url),
        mode: mode_name(mode).to_string(),
        workers: config.workers,
        events: seeded.events,
        records: args.workload.records,
        seconds: outcome.elapsed.as_secs_f64(),
        events_per_second: seeded.events as f64 / outcome.elapsed.as_secs_f64().max(1e-9),
        faults: outcome.faults,
        workers_observed: outcome.metrics.into(),
        verification,
    };
    sink.close().await;
    db.close().await;
    let passed = report.verification.passed();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_report(r: &Report) {
    println!();
    println!(
        "events      {} over {} records, {} workers ({} mode)",
        r.events, r.records, r.workers, r.mode
    );
    println!(
        "throughput  {:.0} events/s ({:.2} s to drain)",
        r.events_per_second, r.seconds
    );
    println!(
        "outcome     {} processed, {} failed; {} retries recorded (sum of RetryCount)",
        r.verification.processed, r.verification.failed, r.verification.retries
    );
    let f = &r.faults;
    println!(
        "faults      {} handler errors, {} lock holds -> {} lock timeouts, {} worker killed mid-attempt{}",
        f.handler_errors,
        f.lock_holds,
        r.workers_observed.lock_timeouts,
        f.killed_workers,
        f.kill_to_reclaim_ms.map_or(String::new(), |ms| format!(
            " (its row reclaimed {ms} ms after the kill)"
        )),
    );
    println!(
        "workers     {} claims, {} stale reclaims, {} lost claims, {} detached bookkeeping",
        r.workers_observed.claimed,
        r.workers_observed.stale_reclaims,
        r.workers_observed.lost_claims,
        r.workers_observed.detached_bookkeeping
    );
    let v = &r.verification;
    println!(
        "integrity   {} claims lost, {} handlers ran twice for one attempt; {} reclaims after {} worker death(s)",
        v.lost_claims,
        v.ran_twice,
        v.reclaims,
        v.worker_deaths + f.killed_workers as i64,
    );
    println!(
        "effects     {} opportunities created, {} emails delivered ({} sends repeated within one attempt; {} duplicate sends absorbed by the provider's idempotency key)",
        v.opportunities, v.emails, v.sent_twice_in_one_attempt, v.duplicate_sends_absorbed
    );
    println!();
    println!("verification (read from the database):");
    for c in &r.verification.checks {
        println!(
            "  [{}] {}: {}",
            if c.ok { " ok " } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    println!();
    println!(
        "{}",
        if r.verification.passed() {
            "PASSED"
        } else {
            "FAILED"
        }
    );
}

async fn stats(repo: &Arc<dyn OutboxRepository>) -> Result<outbox_persistence::OutboxStats> {
    Ok(repo
        .stats(ClaimPolicy::new(
            Duration::from_secs(30),
            Duration::ZERO,
            outbox_events::DEFAULT_MAX_RETRY_ATTEMPTS,
        ))
        .await?)
}

struct RunOutcome {
    elapsed: Duration,
    metrics: MetricsSnapshot,
    faults: faults::FaultReport,
}

/// Runs the dispatcher until no row is pending or processing, with faults at `fault_rate`
/// (and a worker killed mid-attempt when `kill_one`), showing progress when `progress`.
async fn run_workers(
    db: &Database,
    repo: &Arc<dyn OutboxRepository>,
    sink: &MailSink,
    config: WorkerConfig,
    fault_rate: f64,
    kill_one: bool,
    progress: bool,
) -> Result<RunOutcome> {
    let actions = Arc::new(Actions::new()?);
    let injected = Arc::new(Faults::at(fault_rate));
    let handlers = handlers(actions.clone(), sink.clone(), injected.clone());
    let start = Instant::now();
    let dispatcher = Dispatcher::new(repo.clone(), handlers.clone(), config.clone());
    let decision = decide(&dispatcher).await?;
    let dispatcher = dispatcher.start_decided(decision);
    let fault_task = faults::FaultInjector::start(
        db.clone(),
        repo.clone(),
        handlers,
        config.clone(),
        fault_rate,
        kill_one,
    );
    let total = stats(repo).await?;
    let total = total.pending + total.processing + total.processed + total.failed;
    let bar = progress_bar(total, progress);
    loop {
        let s = stats(repo).await?;
        bar.set_position(s.processed + s.failed);
        if !bar.is_hidden() {
            bar.set_message(format!("{} retrying, {} failed", s.retrying, s.failed));
        } else if progress {
            eprintln!("progress: {} of {total} terminal", s.processed + s.failed);
        }
        if s.pending + s.processing == 0 {
            break;
        }
        tokio::time::sleep(if bar.is_hidden() {
            Duration::from_secs(2)
        } else {
            Duration::from_millis(200)
        })
        .await;
    }
    let elapsed = start.elapsed();
    bar.finish_and_clear();
    let mut fault_report = fault_task.stop().await;
    let report = dispatcher.shutdown().await;
    fault_report.handler_errors = injected
        .random_errors
        .load(std::sync::atomic::Ordering::Relaxed)
        + injected
            .marked_errors
            .load(std::sync::atomic::Ordering::Relaxed);
    Ok(RunOutcome {
        elapsed,
        metrics: report.metrics,
        faults: fault_report,
    })
}

fn progress_bar(total: u64, show: bool) -> ProgressBar {
    if !show || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} events ({per_sec}) {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// The name of a dispatch mode in reports.
fn mode_name(mode: DispatchMode) -> &'static str {
    match mode {
        DispatchMode::Pull => "pull",
        DispatchMode::Legacy => "legacy",
    }
}

/// `outbox seed`.
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
            poison: args.poison_events,
        },
    )
    .await?;
    // Create the provider's tables now, so that work processes starting together do not race
    // to create them.
    MailSink::open(url.unwrap_or_default()).await?.close().await;
    println!(
        "seeded {} events over {} records ({} marked to fail their first attempt, {} slow, {} poison)",
        seeded.events, seeded.records, seeded.marked_faults, args.slow_events, seeded.poison
    );
    Ok(ExitCode::SUCCESS)
}

/// Decides what `work` runs, through the library (pull mode only when asked for and the rollout
/// gate passes, fail closed to the legacy path), and says why on stderr when pull mode was
/// refused.
async fn decide(dispatcher: &Dispatcher) -> Result<ModeDecision> {
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

/// How often `work` records its counters in its run while it works.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// A work process's run in the side store, and the counters it records there while it works:
/// a process that dies later (killed, aborted) leaves what it had counted so far, so a claim
/// it lost while alive still shows.
struct Progress {
    sink: MailSink,
    run: i64,
    metrics: Arc<outbox_events::Metrics>,
}

impl Progress {
    async fn record(&self) {
        let m = self.metrics.snapshot();
        if let Err(e) = self.sink.run_progress(self.run, &m).await {
            tracing::debug!(error = %e, "could not record this run's progress");
        }
    }
}

/// Waits for Ctrl-C, for the dispatcher to stop, or (with `until_drained`) for no row to be
/// left pending or processing.
async fn wait_for_the_end(
    repo: &Arc<dyn OutboxRepository>,
    stop: tokio_util::sync::CancellationToken,
    until_drained: bool,
    progress: &Progress,
) {
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut last_progress = Instant::now();
    loop {
        tokio::select! {
            _ = &mut ctrl_c => {
                eprintln!("interrupted: finishing in-flight attempts");
                return;
            }
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        if last_progress.elapsed() >= PROGRESS_EVERY {
            last_progress = Instant::now();
            progress.record().await;
        }
        if until_drained {
            // A database that is briefly away (restarted, connection cut) is not the end of
            // the run: the workers ride it out, and so does this check.
            match stats(repo).await {
                Ok(s) if s.pending + s.processing == 0 => return,
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the outbox counts; trying again")
                }
            }
        }
    }
}

/// `outbox work`. Its run is recorded in the side store before the workers start, updated with
/// its counters every few seconds, and completed on a normal exit, so that `verify` can count
/// the claims a process lost while it lived, whatever became of it later.
pub async fn work_command(url: Option<&str>, args: WorkArgs) -> Result<ExitCode> {
    let requested = match args.pull_worker {
        Some(true) => DispatchMode::Pull,
        Some(false) => DispatchMode::Legacy,
        None => DispatchMode::from_env(),
    };
    let config = args.workers.config(WorkerConfig::default());
    config.validate().map_err(anyhow::Error::msg)?;
    let db = db::open(url, connect_config(&config)).await?;
    let url = url.unwrap_or_default().to_string();
    schema::ensure(&db).await?;
    let repo = db.repository();
    let sink = MailSink::open(&url).await?;
    let fault_rate = args.workers.fault_rate.unwrap_or(0.0);
    let injected = Arc::new(Faults::at(fault_rate));
    let handlers = handlers(Arc::new(Actions::new()?), sink.clone(), injected.clone());
    let config = config.with_mode(requested);
    let dispatcher = Dispatcher::new(repo.clone(), handlers.clone(), config.clone());
    let decision = decide(&dispatcher).await?;
    let mode = decision.mode;
    let config = config.with_mode(mode);
    let run = sink.run_started(mode_name(mode)).await?;
    let dispatcher = dispatcher.start_decided(decision);
    let fault_task = faults::FaultInjector::start(
        db.clone(),
        repo.clone(),
        handlers,
        config.clone(),
        fault_rate,
        false,
    );
    let start = Instant::now();
    let progress = Progress {
        sink: sink.clone(),
        run,
        metrics: dispatcher.metrics_handle(),
    };
    wait_for_the_end(
        &repo,
        dispatcher.stop_token(),
        args.until_drained,
        &progress,
    )
    .await;
    let faults = fault_task.stop().await;
    let report = dispatcher.shutdown().await;
    let m = report.metrics;
    if let Err(e) = sink.run_completed(run, &m).await {
        tracing::error!(error = %e, "could not record the end of this run");
    }
    let handler_errors = injected
        .random_errors
        .load(std::sync::atomic::Ordering::Relaxed)
        + injected
            .marked_errors
            .load(std::sync::atomic::Ordering::Relaxed);
    if args.json {
        let doc = serde_json::json!({
            "pid": std::process::id(),
            "seconds": start.elapsed().as_secs_f64(),
            "mode": mode_name(mode),
            "graceful": report.graceful,
            "metrics": Observed::from(m),
            "cancelled": m.cancelled,
            "handler_errors": handler_errors,
            "lock_holds": faults.lock_holds,
        });
        println!("{doc}");
    } else {
        println!(
            "worked {:.1} s in {:?} mode: {} claimed, {} processed, {} retried, {} failed, {} lock timeouts, {} stale reclaims, {} lost claims; faults: {} handler errors, {} lock holds",
            start.elapsed().as_secs_f64(),
            mode,
            m.claimed,
            m.processed,
            m.retried,
            m.failed,
            m.lock_timeouts,
            m.stale_reclaims,
            m.lost_claims,
            handler_errors,
            faults.lock_holds,
        );
    }
    sink.close().await;
    db.close().await;
    Ok(ExitCode::SUCCESS)
}

/// `outbox verify`.
pub async fn verify_command(url: Option<&str>, json: bool) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    if !schema::exists(&db).await? {
        anyhow::bail!(
            "this database holds no demo workload (run `outbox seed` or `outbox demo` first)"
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
