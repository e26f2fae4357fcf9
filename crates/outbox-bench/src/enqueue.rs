//! The application's write path: events enqueued per second by concurrent writers (one event
//! per transaction, and 1,000), and the cost of waking idle workers measured side by side: the
//! same one-event transactions with the wake-up trigger (`outbox_notify_insert`, debounced by
//! migration 0007) and with it disabled, alternating, at 8 and 32 writers (issue 15: within 10%).

use std::time::Instant;

use anyhow::Result;
use outbox_persistence::NewEvent;
use outbox_persistence::test_support::bench;

use super::report::{Report, Row};
use super::scenarios::{EVENT_TYPE, payload, pg, reset};
use super::{BenchDb, Sizes};

/// Runs `writers` concurrent writers of `per_tx` events per transaction for the ceiling's run
/// time; returns events per second.
async fn rate(db: &BenchDb, sizes: &Sizes, writers: usize, per_tx: usize) -> Result<f64> {
    let pool = db.connect(writers as u32 + 1).await?;
    let started = Instant::now();
    let deadline = started + sizes.ceiling_run;
    let mut handles = Vec::new();
    for t in 0..writers {
        let repo = pool.repository();
        handles.push(tokio::spawn(async move {
            let mut n = 0usize;
            while Instant::now() < deadline {
                let events: Vec<NewEvent> = (0..per_tx)
                    .map(|i| {
                        let record = format!("r{}", (t * per_tx + i + n) % 1000);
                        NewEvent::new(EVENT_TYPE, payload(Some(&record)))
                    })
                    .collect();
                let mut tx = repo.begin().await?;
                repo.enqueue(&mut tx, &events).await?;
                tx.commit().await?;
                n += per_tx;
            }
            Ok::<_, anyhow::Error>(n)
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await??;
    }
    let rate = total as f64 / started.elapsed().as_secs_f64();
    pool.close().await;
    Ok(rate)
}

/// Sets the wake-up trigger on or off.
async fn wakeups(db: &BenchDb, enabled: bool) -> Result<()> {
    let pool = db.connect(1).await?;
    bench::set_wakeup_trigger(pg(&pool)?, enabled).await?;
    pool.close().await;
    Ok(())
}

pub(crate) async fn enqueue_rate(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("enqueue");
    for writers in [8usize, 32] {
        let (mut on, mut off) = (Vec::new(), Vec::new());
        // Alternating, so that a machine that slows down during the run hurts both alike.
        for enabled in [true, false, true, false] {
            reset(db).await?;
            wakeups(db, enabled).await?;
            let r = rate(db, sizes, writers, 1).await;
            wakeups(db, true).await?;
            if enabled { on.push(r?) } else { off.push(r?) }
        }
        let (on, off) = (mean(&on), mean(&off));
        for (label, r) in [
            ("wake-up trigger (as shipped)", on),
            ("no notification", off),
        ] {
            report.push(Row {
                scenario: "enqueue, 1 per transaction".into(),
                dispatcher: "enqueue".into(),
                workers: Some(writers),
                events: None,
                per_second: Some(r),
                note: format!(
                    "{writers} concurrent writers, events/s, {label}; mean of 2 alternating runs"
                ),
                ..Row::default()
            });
        }
        report.target(
            format!("enqueue with wake-ups within 10% of no notification, {writers} writers"),
            format!("{on:.0}/s vs {off:.0}/s = {:.2}x", on / off),
            on >= 0.9 * off,
        );
    }
    reset(db).await?;
    let bulk = rate(db, sizes, 8, 1_000).await?;
    report.push(Row {
        scenario: "enqueue, 1000 per transaction".into(),
        dispatcher: "enqueue".into(),
        workers: Some(8),
        events: None,
        per_second: Some(bulk),
        note: "8 concurrent writers, events/s".into(),
        ..Row::default()
    });
    Ok(())
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}
