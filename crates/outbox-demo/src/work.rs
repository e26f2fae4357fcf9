//! `outbox-demo work`: one work process with the demo's handlers, recording its run in the
//! side store so that `verify` can count the claims a process lost while it lived.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use outbox_cli::db;
use outbox_events::{DispatchMode, Dispatcher, WorkerConfig};
use outbox_persistence::OutboxRepository;

use crate::args::WorkArgs;
use crate::commands::{connect_config, decide, mode_name, stats};
use crate::demo::Observed;
use crate::handlers::{Actions, Faults, handlers};
use crate::sink::MailSink;
use crate::{faults, schema};

/// What `work` writes to stderr once its workers have started (`cargo xtask faults` keeps a
/// copy of this text).
pub const STARTED_LOG: &str = "outbox-demo work: workers started";

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

/// `work`. Its run is recorded in the side store before the workers start, updated with
/// its counters every few seconds, and completed on a normal exit, so that `verify` can count
/// the claims a process lost while it lived, whatever became of it later.
pub async fn work_command(url: Option<&str>, args: WorkArgs) -> Result<ExitCode> {
    let requested = match args.pull_worker {
        Some(true) => DispatchMode::Pull,
        Some(false) => DispatchMode::Legacy,
        None => DispatchMode::from_env(),
    };
    let config = args
        .metrics
        .apply(args.workers.config(WorkerConfig::default()));
    config.validate().map_err(anyhow::Error::msg)?;
    args.metrics.install()?;
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
    // The fault suite tells a process that could not start (exit 1 before this line: its
    // database was cut or restarting) from one that failed while it worked.
    eprintln!("{STARTED_LOG}");
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
    print_outcome(
        args.json,
        start.elapsed(),
        mode,
        &report,
        handler_errors,
        faults.lock_holds,
    );
    sink.close().await;
    db.close().await;
    Ok(ExitCode::SUCCESS)
}

/// Prints a work process's end-of-run counters, as one JSON document or a sentence.
fn print_outcome(
    json: bool,
    elapsed: Duration,
    mode: DispatchMode,
    report: &outbox_events::ShutdownReport,
    handler_errors: u64,
    lock_holds: u64,
) {
    let m = report.metrics;
    if json {
        let doc = serde_json::json!({
            "pid": std::process::id(),
            "seconds": elapsed.as_secs_f64(),
            "mode": mode_name(mode),
            "graceful": report.graceful,
            "metrics": Observed::from(m),
            "cancelled": m.cancelled,
            "handler_errors": handler_errors,
            "lock_holds": lock_holds,
        });
        println!("{doc}");
    } else {
        println!(
            "worked {:.1} s in {:?} mode: {} claimed, {} processed, {} retried, {} failed, {} lock timeouts, {} stale reclaims, {} lost claims; faults: {} handler errors, {} lock holds",
            elapsed.as_secs_f64(),
            mode,
            m.claimed,
            m.processed,
            m.retried,
            m.failed,
            m.lock_timeouts,
            m.stale_reclaims,
            m.lost_claims,
            handler_errors,
            lock_holds,
        );
    }
}
