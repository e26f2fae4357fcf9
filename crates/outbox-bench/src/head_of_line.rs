//! Head-of-line: one record's handler blocked on a row lock for a while, the other records'
//! events fed at a steady rate meanwhile (issue 37: their p99 < 20 ms, and none of them waits
//! out the block).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use chrono::Utc;
use outbox_persistence::test_support::bench::{self, Keys};
use outbox_persistence::{NewEvent, OutboxRepository};

use super::report::{Report, Row};
use super::scenarios::{BLOCKED_KEY, EVENT_TYPE, VARIANTS, enqueue, handlers, payload, pg, reset};
use super::{BenchDb, Sizes};

/// Enqueues `sizes.block_events` events of the other records at a steady rate over
/// `sizes.block`, in ticks of 10 ms.
async fn feed_steadily(repo: &Arc<dyn OutboxRepository>, sizes: &Sizes) -> Result<()> {
    let ticks = (sizes.block.as_millis() / 10).max(1) as usize;
    let per_tick = sizes.block_events.div_ceil(ticks);
    let began = Instant::now();
    let mut sent = 0;
    let mut i = 0;
    while sent < sizes.block_events {
        let n = per_tick.min(sizes.block_events - sent);
        let batch: Vec<NewEvent> = (0..n)
            .map(|_| {
                i += 1;
                NewEvent::new(
                    EVENT_TYPE,
                    payload(Some(&format!("r{}", i % sizes.records))),
                )
            })
            .collect();
        enqueue(repo, &batch, n).await?;
        sent += n;
        let next = Duration::from_millis(10) * (sent / per_tick) as u32;
        if let Some(wait) = next.checked_sub(began.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
    Ok(())
}

pub(crate) async fn head_of_line(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("head-of-line");
    for variant in VARIANTS {
        reset(db).await?;
        let run = variant
            .start(db, 8, handlers(None, Some(BLOCKED_KEY)))
            .await?;
        let feeder = db.connect(2).await?;
        let repo = feeder.repository();
        // Hold the row lock the blocked record's handler needs.
        let mut blocker = pg(&feeder)?.begin().await?;
        sqlx::query("SELECT n FROM bench_lock WHERE id = 1 FOR UPDATE")
            .execute(&mut *blocker)
            .await?;
        let block_start = Utc::now();
        let blocked: Vec<NewEvent> = (0..3)
            .map(|_| NewEvent::new(EVENT_TYPE, payload(Some("blocked"))))
            .collect();
        enqueue(&repo, &blocked, 3).await?;
        // The other records' events flow at a steady rate during the block.
        let began = Instant::now();
        feed_steadily(&repo, sizes).await?;
        if let Some(wait) = sizes.block.checked_sub(began.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let block_end = Utc::now();
        blocker.commit().await?;
        run.wait_for((sizes.block_events + blocked.len()) as u64)
            .await?;
        run.stop().await?;
        let pool = feeder;
        let f = bench::latency(pg(&pool)?, Keys::Except(BLOCKED_KEY), block_start).await?;
        let during =
            bench::processed_until(pg(&pool)?, Keys::Except(BLOCKED_KEY), block_end).await?;
        let blocked_f = bench::latency(pg(&pool)?, Keys::Only(BLOCKED_KEY), block_start).await?;
        let violations = bench::order_violations(pg(&pool)?).await?;
        pool.close().await;
        let block_s = (block_end - block_start).as_seconds_f64();
        let rate = during as f64 / block_s;
        report.push(Row {
            scenario: format!(
                "head-of-line: 1 record blocked {}s, {} others flow",
                sizes.block.as_secs(),
                sizes.block_events
            ),
            dispatcher: variant.name.into(),
            workers: Some(8),
            events: Some(f.n),
            per_second: Some(rate),
            p50_ms: Some(f.p50_ms),
            p99_ms: Some(f.p99_ms),
            note: format!(
                "others processed during the block: {during} of {} offered ({:.0}/s offered); blocked record: {} of {} processed after the block, p50 {:.0} ms; order violations {violations}",
                sizes.block_events,
                sizes.block_events as f64 / sizes.block.as_secs_f64(),
                blocked_f.n,
                blocked.len(),
                blocked_f.p50_ms
            ),
            ..Row::default()
        });
        if variant.shipped_pull() {
            let block_ms = block_s * 1000.0;
            report.target(
                "head-of-line (issue 37): other records' p99 < 20 ms while one record is blocked, and none of them waits out the block",
                format!(
                    "p99 {:.1} ms; the slowest {:.0} ms against the block's {block_ms:.0} ms",
                    f.p99_ms, f.max_ms
                ),
                f.p99_ms < 20.0 && f.max_ms < block_ms,
            );
        }
    }
    Ok(())
}
