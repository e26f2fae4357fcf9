//! The cost per event: WAL bytes, dead tuples and (HOT) updates of the outbox table per event
//! for no-op drains of each dispatcher, read from the server's statistics before and after.

use std::time::Duration;

use anyhow::Result;
use outbox_events::DispatchMode;
use outbox_persistence::sqlx::PgPool;
use outbox_persistence::test_support::bench::{self, TableCounters};

use crate::report::{Report, Row};
use crate::scenarios::{config, enqueue, handlers, keyed_events, pg, reset, start, start_with};
use crate::{BenchDb, Sizes};

async fn counters(pool: &PgPool) -> Result<TableCounters> {
    // Backends flush their table statistics when they exit; the dispatcher's pool is closed
    // before this is called, so give the flush a moment.
    tokio::time::sleep(Duration::from_millis(700)).await;
    Ok(bench::table_counters(pool).await?)
}

/// Measures the cost per event of each dispatcher.
pub(crate) async fn cost(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("cost per event");
    // No-op drains: WAL, dead tuples and updates per event.
    for (mode, async_claims, name) in [
        (DispatchMode::Pull, false, "pull"),
        (DispatchMode::Pull, true, "pull, async claims"),
        (DispatchMode::Legacy, false, "legacy"),
    ] {
        reset(db).await?;
        let pool = db.connect(2).await?;
        let n = sizes.drain_events;
        enqueue(
            &pool.repository(),
            &keyed_events(n, sizes.records, true),
            1_000,
        )
        .await?;
        let before = counters(pg(&pool)?).await?;
        let run = start_with(db, config(mode, 8), handlers(None, None), async_claims).await?;
        run.wait_for(n as u64).await?;
        run.stop().await?;
        let after = counters(pg(&pool)?).await?;
        pool.close().await;
        let per = |v: f64| v / n as f64;
        report.push(Row {
            scenario: format!("cost per no-op event ({n} drained)"),
            dispatcher: name.into(),
            workers: Some(8),
            events: Some(n),
            note: format!(
                "WAL {:.0} B/event and {} WAL flushes/event (server-wide); dead tuples left {:.2}/event; updates {:.2}/event, HOT {:.2}/event; heads table writes {:.2}/event",
                per(after.wal_bytes - before.wal_bytes),
                match (before.wal_syncs, after.wal_syncs) {
                    (Some(b), Some(a)) => format!("{:.2}", per((a - b) as f64)),
                    _ => "n/a".into(),
                },
                per((after.dead - before.dead) as f64),
                per((after.updates - before.updates) as f64),
                per((after.hot_updates - before.hot_updates) as f64),
                per((after.head_writes - before.head_writes) as f64),
            ),
            ..Row::default()
        });
    }
    heartbeats(db, sizes, report).await
}

/// Heartbeats: handlers that outlive several heartbeat intervals.
async fn heartbeats(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    reset(db).await?;
    let pool = db.connect(2).await?;
    let n = 256;
    enqueue(
        &pool.repository(),
        &keyed_events(n, sizes.records, true),
        1_000,
    )
    .await?;
    let before = counters(pg(&pool)?).await?;
    let config = config(DispatchMode::Pull, 32)
        .with_heartbeat_interval(Duration::from_millis(50))
        .with_stale_after(Duration::from_secs(5));
    let run = start(db, config, handlers(Some(Duration::from_millis(300)), None)).await?;
    run.wait_for(n as u64).await?;
    run.stop().await?;
    let after = counters(pg(&pool)?).await?;
    pool.close().await;
    // Claims and `processed` change Status (in the partial indexes' predicates), so they are
    // never HOT; the rest of the updates are heartbeats.
    let updates = after.updates - before.updates;
    let heartbeats = updates - 2 * n as i64;
    let hot = after.hot_updates - before.hot_updates;
    let share = if heartbeats > 0 {
        hot as f64 / heartbeats as f64
    } else {
        0.0
    };
    report.push(Row {
        scenario: format!("heartbeats: {n} events x 300 ms, beat every 50 ms"),
        dispatcher: "pull".into(),
        workers: Some(32),
        events: Some(n),
        note: format!(
            "{heartbeats} heartbeat updates, {:.0}% HOT; dead tuples left {:.2}/event; WAL {:.0} B/event (server-wide)",
            share * 100.0,
            (after.dead - before.dead) as f64 / n as f64,
            (after.wal_bytes - before.wal_bytes) / n as f64
        ),
        ..Row::default()
    });
    Ok(())
}
