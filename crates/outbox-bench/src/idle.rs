//! The idle pickup: one event into an idle pool of workers, directly (woken by `LISTEN`) and
//! through a transaction-pooling PgBouncer (woken by `LISTEN` on a direct URL, or polling).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use outbox_events::DispatchMode;
use outbox_persistence::postgres::PgOutbox;
use outbox_persistence::test_support::bench::{self, Figures, Keys};
use outbox_persistence::{ConnectConfig, NewEvent, OutboxRepository};

use super::report::{Report, Row};
use super::scenarios::{
    EVENT_TYPE, Running, config, enqueue, handlers, mode_name, payload, pg, reset, start, start_on,
};
use super::{BenchDb, Sizes};

/// The idle pickup of pull workers behind a transaction-pooling PgBouncer: woken by `LISTEN`
/// on a direct URL, and by polling at the poll interval when there is none. The event is
/// enqueued and the latency read on direct connections.
pub(crate) async fn idle_pickup_pooled(
    db: &BenchDb,
    sizes: &Sizes,
    report: &mut Report,
) -> Result<()> {
    for (listen, wakeups) in [(true, "LISTEN on a direct URL"), (false, "polling")] {
        let config = config(DispatchMode::Pull, 8);
        let connections = ConnectConfig::for_workers(config.workers).max_connections;
        let Some(pool) = db.connect_pooled(connections, listen).await? else {
            return Ok(());
        };
        eprintln!("idle pickup through PgBouncer ({wakeups})");
        reset(db).await?;
        let poll = config.poll_interval;
        let repository: Arc<dyn OutboxRepository> = Arc::new(PgOutbox::new(pg(&pool)?.clone()));
        let run = start_on(pool, repository, config, handlers(None, None)).await?;
        let f = sample(db, sizes, run).await?;
        report.push(Row {
            scenario: format!("idle pickup through PgBouncer (transaction pooling), {wakeups}"),
            dispatcher: "pull".into(),
            workers: Some(8),
            events: Some(f.n),
            p50_ms: Some(f.p50_ms),
            p99_ms: Some(f.p99_ms),
            note: if listen {
                "enqueue-to-processed; LISTEN on the server directly, statements through the pooler"
                    .into()
            } else {
                format!(
                    "enqueue-to-processed; no LISTEN: idle workers poll every {} ms",
                    poll.as_millis()
                )
            },
            ..Row::default()
        });
    }
    Ok(())
}

pub(crate) async fn idle_pickup(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("idle pickup");
    for mode in [DispatchMode::Pull, DispatchMode::Legacy] {
        reset(db).await?;
        let run = start(db, config(mode, 8), handlers(None, None)).await?;
        let f = sample(db, sizes, run).await?;
        report.push(Row {
            scenario: "idle pickup: one event into an idle pool".into(),
            dispatcher: mode_name(mode).into(),
            workers: Some(8),
            events: Some(f.n),
            p50_ms: Some(f.p50_ms),
            p99_ms: Some(f.p99_ms),
            note: "enqueue-to-processed; LISTEN/NOTIFY wakes pull workers".into(),
            ..Row::default()
        });
        if mode == DispatchMode::Pull {
            report.target(
                "idle pickup p50 and p99 < 20 ms (issue 37)",
                format!("p50 {:.1} ms, p99 {:.1} ms", f.p50_ms, f.p99_ms),
                f.p50_ms < 20.0 && f.p99_ms < 20.0,
            );
        }
    }
    Ok(())
}

/// Feeds `run`'s idle workers one event at a time (each after a pause long enough for the
/// workers' poll to back off to its interval), enqueued on a direct connection, stops it, and
/// reads the enqueue-to-processed latencies.
async fn sample(db: &BenchDb, sizes: &Sizes, run: Running) -> Result<Figures> {
    let feeder = db.connect(1).await?;
    let repo = feeder.repository();
    for i in 0..sizes.idle_samples {
        tokio::time::sleep(Duration::from_millis(300 + (i as u64 * 97) % 400)).await;
        enqueue(
            &repo,
            &[NewEvent::new(EVENT_TYPE, payload(Some(&format!("r{i}"))))],
            1,
        )
        .await?;
        run.wait_for(i as u64 + 1).await?;
    }
    let since = run.started;
    run.stop().await?;
    let figures = bench::latency(pg(&feeder)?, Keys::All, since).await?;
    feeder.close().await;
    Ok(figures)
}
