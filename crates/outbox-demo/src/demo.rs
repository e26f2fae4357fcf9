//! The demo run: seed a fresh database, run the dispatcher with faults injected until the
//! queue drains, then verify every invariant from the database and print the report.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use chrono::Utc;
use indicatif::{ProgressBar, ProgressStyle};
use outbox_cli::db;
use outbox_events::{DispatchMode, Dispatcher, MetricsSnapshot, WorkerConfig};
use outbox_persistence::{Database, OutboxRepository};
use serde::Serialize;

use crate::args::DemoArgs;
use crate::commands::{connect_config, decide, demo_worker_config, mode_name, stats};
use crate::handlers::{Actions, Faults, handlers};
use crate::relay::{DemoRelay, RelayReport};
use crate::sink::MailSink;
use crate::webhooks::{DemoWebhooks, WebhooksReport};
use crate::{faults, verify, workload};

/// The demo's default share of failing attempts.
pub const DEFAULT_DEMO_FAULT_RATE: f64 = 0.05;

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
    #[serde(skip_serializing_if = "Option::is_none")]
    relay: Option<RelayReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    webhooks: Option<WebhooksReport>,
    verification: verify::Verification,
}

#[derive(Debug, Serialize)]
pub(crate) struct Observed {
    claimed: u64,
    processed: u64,
    retried: u64,
    failed: u64,
    lock_timeouts: u64,
    stale_reclaims: u64,
    lost_claims: u64,
    detached_bookkeeping: u64,
    /// Attempt transactions that ran more than one event.
    batches: u64,
    /// Claims given back unrun (a batch's budget spent, an older row of the record failed).
    not_run: u64,
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
            batches: m.batches,
            not_run: m.not_run,
        }
    }
}

/// A new SQLite file's URL under the temporary directory.
fn fresh_sqlite_url() -> String {
    let path = std::env::temp_dir().join(format!(
        "outbox-demo-{}.db",
        Utc::now().format("%Y%m%d-%H%M%S-%3f")
    ));
    format!("sqlite://{}", path.display())
}

/// Every failed attempt is counted once: `sum(RetryCount)` equals the attempts the workers
/// ended in a retry or failure plus the stale reclaims, each of which counts the attempt that
/// died (the worker killed mid-attempt).
fn failures_counted_once(
    v: &verify::Verification,
    m: &MetricsSnapshot,
    others: &[MetricsSnapshot],
) -> verify::Check {
    let mut m = *m;
    for r in others {
        m.retried += r.retried;
        m.failed += r.failed;
        m.stale_reclaims += r.stale_reclaims;
    }
    let counted = m.retried + m.failed + m.stale_reclaims;
    verify::Check {
        name: "every failed attempt counted once in RetryCount",
        ok: v.retries == counted as i64,
        detail: format!(
            "sum(RetryCount) = {}; attempts the workers ended in a retry or failure ({}) + stale reclaims that counted a dead attempt ({}) = {counted}",
            v.retries,
            m.retried + m.failed,
            m.stale_reclaims,
        ),
    }
}

/// The demo.
pub async fn run_demo(url: Option<&str>, args: DemoArgs) -> Result<ExitCode> {
    let url = url.map_or_else(fresh_sqlite_url, str::to_string);
    let mode: DispatchMode = args.mode.into();
    let mut config = args.workers.config(demo_worker_config(mode));
    if args.relay.is_some() {
        config = DemoRelay::scope_out(config);
    }
    if args.webhooks {
        config = DemoWebhooks::scope_out(config);
    }
    config.validate().map_err(anyhow::Error::msg)?;
    let db = open_fresh(&url, &config, args.json).await?;
    let repo = db.repository();
    // One process hosts every worker here, so no poison event: it would abort the demo itself.
    let seeded = workload::seed(
        &db,
        &repo,
        &workload::Workload {
            events: args.workload.events,
            records: args.workload.records,
            seed: Utc::now().timestamp_millis() as u64,
            feed: args.relay.is_some() || args.webhooks,
            ..workload::Workload::default()
        },
    )
    .await?;
    let fault_rate = args.workers.fault_rate.unwrap_or(DEFAULT_DEMO_FAULT_RATE);
    let sink = MailSink::open(&url).await?;
    let run = sink.run_started(mode_name(mode)).await?;
    let relay = match &args.relay {
        Some(nats) => Some(DemoRelay::start(nats, &args.relay_stream, repo.clone()).await?),
        None => None,
    };
    let webhooks = match args.webhooks {
        true => Some(DemoWebhooks::start(repo.clone()).await?),
        false => None,
    };
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
    let (verification, relay, webhooks) =
        verify_run(&db, &repo, &sink, &outcome, (relay, webhooks)).await?;
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
        relay,
        webhooks,
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

/// Connects to `url`, migrates, and refuses a database that holds outbox events: the
/// verification reads every row of the database (a second run on the same database found
/// twice the processed rows and retries it seeded, and failed with nothing wrong).
async fn open_fresh(url: &str, config: &WorkerConfig, json: bool) -> Result<Database> {
    let db = db::connect(Some(url), connect_config(config)).await?;
    if !json {
        println!(
            "outbox demo on {} ({})",
            outbox_persistence::redact_url(url),
            db.backend_name()
        );
    }
    db.migrate().await.context("migrating")?;
    db::check_schema(&db).await?;
    let before = stats(&db.repository()).await?;
    let held = before.pending + before.processing + before.processed + before.failed;
    if held > 0 {
        anyhow::bail!(
            "the database already holds {held} outbox events ({} unfinished), and the demo verifies every row of its database; run it on a fresh database (omit --database-url for a new SQLite file)",
            before.pending + before.processing
        );
    }
    Ok(db)
}

/// Verifies the run from the database, the relay's stream from NATS when it ran, and the
/// webhook receiver's log when they ran.
async fn verify_run(
    db: &Database,
    repo: &Arc<dyn OutboxRepository>,
    sink: &MailSink,
    outcome: &RunOutcome,
    (relay, webhooks): (Option<DemoRelay>, Option<DemoWebhooks>),
) -> Result<(
    verify::Verification,
    Option<RelayReport>,
    Option<WebhooksReport>,
)> {
    let mut verification = verify::verify(db, sink).await?;
    let mut others = Vec::new();
    let relay = match relay {
        Some(relay) => {
            let (report, checks, metrics) = relay.finish(repo).await?;
            verification.checks.extend(checks);
            others.push(metrics);
            Some(report)
        }
        None => None,
    };
    let webhooks = match webhooks {
        Some(webhooks) => {
            let (report, checks, metrics) = webhooks.finish(repo).await?;
            verification.checks.extend(checks);
            others.push(metrics);
            Some(report)
        }
        None => None,
    };
    verification.checks.push(failures_counted_once(
        &verification,
        &outcome.metrics,
        &others,
    ));
    Ok((verification, relay, webhooks))
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
    if let Some(relay) = &r.relay {
        print_relay(relay);
    }
    if let Some(w) = &r.webhooks {
        println!(
            "webhooks    {} of {} changes delivered to {} ({} requests, {} redeliveries, {} signatures refused, {} out of per-record order)",
            w.delivered, w.events, w.url, w.requests, w.redelivered, w.unverified, w.out_of_order
        );
    }
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

fn print_relay(r: &RelayReport) {
    let a = &r.audit;
    println!(
        "relay       {} of {} changes processed into stream {} at {}: {} published, {} duplicates dropped by the stream, {} publish failures",
        r.processed, r.events, r.stream, r.url, r.published, r.duplicates, r.failures
    );
    println!(
        "stream      {} messages read back from NATS: {} missing, {} duplicated, {} unexpected, {} out of per-record order",
        r.messages,
        a.missing.len(),
        a.duplicated.len(),
        a.unexpected.len(),
        a.out_of_order.len()
    );
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
