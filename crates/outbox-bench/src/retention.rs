//! Retention under load: a history of terminal rows (1M; 200k with `--quick`) beside a keyed
//! no-op drain (20,000 events over 1,000 records; 5,000 with `--quick`) by 8 pull workers,
//! without a pruner, with the dispatcher's pruner at its default pacing (a pause of 100 ms or
//! four times the batch's own time), at the fixed 100 ms pause it had before, and with a pruner
//! that never pauses; then the whole history pruned alone. Issue 18's target: throughput within 20%
//! and the claim's p99 within 2x of the run without a pruner.
//!
//! The claim's latency is timed at the client around every `claim_next` of the drain's
//! workers: that is the statement a pruner competes with (CPU, I/O, the table's indexes), under
//! the real concurrency. The drain's enqueue-to-processed latency would not show it: with the
//! backlog enqueued before the start it is each event's place in the queue, so it restates the
//! throughput. The workers are the dispatcher's attempt ([`ClaimRunner`]) in the pull worker's
//! loop, so that each claim can be timed; the pruner is the dispatcher's pruner loop
//! ([`prune_until_done`]) on a pool of its own, as another process would run it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use outbox_events::{
    AttemptOutcome, CancellationToken, ClaimRunner, DispatchMode, PrunePacing, PrunePolicy, Scope,
    prune_until_done,
};
use outbox_persistence::test_support::retention as history;
use outbox_persistence::{ConnectConfig, Database};

use crate::report::{Report, Row};
use crate::scenarios::{config, enqueue, handlers, keyed_events, pg, reset};
use crate::{BenchDb, Sizes};

const WORKERS: usize = 8;
/// Longest a drain may take before the bench gives up.
const RUN_LIMIT: Duration = Duration::from_secs(600);

/// What one drain measured.
struct Drain {
    events: usize,
    seconds: f64,
    /// Client-side latency of every `claim_next` that returned a row.
    claims: Vec<Duration>,
    /// Rows the pruner deleted while the workers drained.
    pruned: u64,
}

impl Drain {
    fn rate(&self) -> f64 {
        self.events as f64 / self.seconds.max(1e-9)
    }
}

fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1_000.0
}

/// The scenario's sizes: terminal rows of history, and events drained.
fn sizes_of(sizes: &Sizes) -> (usize, usize) {
    if sizes.quick {
        (200_000, 5_000)
    } else {
        (1_000_000, 20_000)
    }
}

/// Empties the outbox, seeds the history (90% processed, 10% failed, all older than the
/// default ages) and enqueues the drain's events.
async fn prepare(db: &BenchDb, sizes: &Sizes) -> Result<()> {
    let (rows, events) = sizes_of(sizes);
    reset(db).await?;
    let pool = db.connect(2).await?;
    history::seed_terminal_rows(pg(&pool)?, rows * 9 / 10, rows / 10, sizes.records).await?;
    enqueue(
        &pool.repository(),
        &keyed_events(events, sizes.records, true),
        1_000,
    )
    .await?;
    pool.close().await;
    Ok(())
}

/// Runs the pruner (batches of the default size, paced by `pacing`) until `stop`; the rows it
/// deleted.
async fn run_pruner(pool: Database, pacing: PrunePacing, stop: CancellationToken) -> Result<u64> {
    let repo = pool.repository();
    let mut deleted = 0;
    while !stop.is_cancelled() {
        let run = prune_until_done(&*repo, PrunePolicy::default(), pacing, &stop).await?;
        deleted += run.total();
        if !run.more {
            break;
        }
    }
    pool.close().await;
    Ok(deleted)
}

/// One worker: the pull worker's loop around the dispatcher's attempt, each claim timed.
async fn worker(
    repo: Arc<dyn outbox_persistence::OutboxRepository>,
    runner: Arc<ClaimRunner>,
    processed: Arc<AtomicU64>,
    target: u64,
) -> Result<Vec<Duration>> {
    let policy = outbox_events::WorkerConfig::default().claim_policy();
    let mut claims = Vec::new();
    let began = Instant::now();
    while processed.load(Ordering::SeqCst) < target {
        if began.elapsed() > RUN_LIMIT {
            bail!("the drain did not finish within {RUN_LIMIT:?}");
        }
        let t = Instant::now();
        match repo.claim_next(policy, &Scope::All).await? {
            Some(claim) => {
                claims.push(t.elapsed());
                match runner.run(claim).await {
                    AttemptOutcome::Processed => {
                        processed.fetch_add(1, Ordering::SeqCst);
                    }
                    AttemptOutcome::Retried => {}
                    other => bail!("a bench attempt ended {other:?}"),
                }
            }
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
    Ok(claims)
}

/// Drains the enqueued events with [`WORKERS`] workers, with a pruner paced by `pacing` beside
/// them when given.
async fn drain(db: &BenchDb, sizes: &Sizes, pacing: Option<PrunePacing>) -> Result<Drain> {
    let (_, events) = sizes_of(sizes);
    let pool = db
        .connect(ConnectConfig::for_workers(WORKERS).max_connections)
        .await?;
    let repo = pool.repository();
    let runner = Arc::new(ClaimRunner::new(
        repo.clone(),
        handlers(None, None),
        config(DispatchMode::Pull, WORKERS),
    ));
    let stop = CancellationToken::new();
    let pruner = match pacing {
        Some(pacing) => Some(tokio::spawn(run_pruner(
            db.connect(2).await?,
            pacing,
            stop.clone(),
        ))),
        None => None,
    };
    let processed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..WORKERS)
        .map(|_| {
            tokio::spawn(worker(
                repo.clone(),
                runner.clone(),
                processed.clone(),
                events as u64,
            ))
        })
        .collect();
    let mut claims = Vec::new();
    for task in tasks {
        claims.extend(task.await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    stop.cancel();
    let pruned = match pruner {
        Some(task) => task.await??,
        None => 0,
    };
    pool.close().await;
    claims.sort();
    Ok(Drain {
        events,
        seconds,
        claims,
        pruned,
    })
}

/// Prunes the whole history with no workers and no pause: the pruner's own rate.
async fn prune_alone(db: &BenchDb, report: &mut Report) -> Result<()> {
    let pool = db.connect(2).await?;
    let before = history::terminal_rows(pg(&pool)?).await?;
    let started = Instant::now();
    let deleted = run_pruner(
        db.connect(2).await?,
        PrunePacing::from(Duration::ZERO),
        CancellationToken::new(),
    )
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    let left = history::terminal_rows(pg(&pool)?).await?;
    pool.close().await;
    report.push(Row {
        scenario: format!("prune {before} terminal rows alone (batches of 1,000, no pause)"),
        dispatcher: "pruner".into(),
        workers: Some(1),
        events: Some(deleted as usize),
        per_second: Some(deleted as f64 / seconds.max(1e-9)),
        note: format!("{seconds:.1} s; {left} terminal rows left (the drain's own)"),
        ..Row::default()
    });
    Ok(())
}

/// The retention scenario.
pub(crate) async fn retention(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("retention");
    let (rows, events) = sizes_of(sizes);
    let variants = [
        ("no pruner", None),
        (
            "pruner, default pacing (1,000-row batches, pause 100 ms or 4x the batch's time)",
            Some(PrunePacing::default()),
        ),
        (
            "pruner, fixed 100 ms pause (the default before 2026-12-02)",
            Some(PrunePacing::from(Duration::from_millis(100))),
        ),
        ("pruner, no pause", Some(PrunePacing::from(Duration::ZERO))),
    ];
    let mut baseline: Option<(f64, f64)> = None;
    for (i, (name, pacing)) in variants.into_iter().enumerate() {
        prepare(db, sizes).await?;
        let d = drain(db, sizes, pacing).await?;
        let (p50, p99) = (
            percentile_ms(&d.claims, 0.5),
            percentile_ms(&d.claims, 0.99),
        );
        report.push(Row {
            scenario: format!("drain {events} keyed no-op beside {rows} terminal rows: {name}"),
            dispatcher: "pull".into(),
            workers: Some(WORKERS),
            events: Some(d.events),
            per_second: Some(d.rate()),
            p50_ms: Some(p50),
            p99_ms: Some(p99),
            note: format!(
                "p50/p99 are claim_next latencies ({} claims); pruned during the drain: {} rows ({:.0}/s)",
                d.claims.len(),
                d.pruned,
                d.pruned as f64 / d.seconds.max(1e-9)
            ),
            ..Row::default()
        });
        match baseline {
            None => baseline = Some((d.rate(), p99)),
            Some((rate, base_p99)) => {
                let (ratio, slower) = (d.rate() / rate, p99 / base_p99.max(1e-9));
                report.target(
                    format!("retention ({name}): throughput within 20%, claim p99 within 2x"),
                    format!(
                        "{:.0}/s = {ratio:.2}x of {rate:.0}/s; claim p99 {p99:.2} ms = {slower:.2}x of {base_p99:.2} ms",
                        d.rate()
                    ),
                    ratio >= 0.8 && slower <= 2.0,
                );
            }
        }
        if i == 0 {
            prune_alone(db, report).await?;
        }
    }
    Ok(())
}
