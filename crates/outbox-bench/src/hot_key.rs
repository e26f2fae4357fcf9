//! The hot-key scenario: one record's `n` events enqueued before `n` events over the other
//! records (a bulk import or a runaway automation on one account). The other records must drain
//! at >= 0.8x of their rate without the hot record, measured in the same run by a drain of the
//! same other events alone; the hot record runs at its serial rate. The legacy dispatcher is
//! stopped once the other records drained (its hot record runs at the design query's pace, which
//! would take many minutes), and its hot record's rate is what it reached by then.

use std::time::Duration;

use anyhow::{Result, bail};
use outbox_events::DispatchMode;
use outbox_persistence::NewEvent;
use outbox_persistence::test_support::bench::{self, Keys};

use super::report::{Report, Row};
use super::scenarios::{
    EVENT_TYPE, HOT_KEY, RUN_LIMIT, Running, config, drain, enqueue, handlers, keyed_events,
    mode_name, payload, pg, reset, start,
};
use super::{BenchDb, Sizes};

/// Waits until the `n` events of the records other than the hot one are processed.
async fn wait_for_others(db: &BenchDb, run: &Running, n: usize) -> Result<()> {
    let pool = db.connect(1).await?;
    loop {
        let others = bench::latency(pg(&pool)?, Keys::Except(HOT_KEY), run.started).await?;
        if others.n >= n {
            pool.close().await;
            return Ok(());
        }
        if run.started_at.elapsed() > RUN_LIMIT {
            bail!("the other records' {n} events did not drain within {RUN_LIMIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The other records' rate without the hot record: the same `n` events drained alone.
async fn baseline(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<f64> {
    let n = sizes.hot_events;
    reset(db).await?;
    let pool = db.connect(2).await?;
    enqueue(
        &pool.repository(),
        &keyed_events(n, sizes.records, true),
        1_000,
    )
    .await?;
    pool.close().await;
    let (f, violations) = drain(db, DispatchMode::Pull, 8, n, handlers(None, None)).await?;
    let rate = f.n as f64 / f.span_s.max(1e-9);
    report.push(Row {
        scenario: format!(
            "hot key baseline: {n} over {} (no hot record)",
            sizes.records
        ),
        dispatcher: mode_name(DispatchMode::Pull).into(),
        workers: Some(8),
        events: Some(f.n),
        per_second: Some(rate),
        p50_ms: Some(f.p50_ms),
        p99_ms: Some(f.p99_ms),
        note: format!(
            "the other records' rate without the hot record; order violations {violations}"
        ),
        ..Row::default()
    });
    Ok(rate)
}

pub(crate) async fn hot_key(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("hot key");
    let n = sizes.hot_events;
    let alone = baseline(db, sizes, report).await?;
    let mut hot_rates = Vec::new();
    for (mode, batches) in [
        (DispatchMode::Pull, true),
        (DispatchMode::Pull, false),
        (DispatchMode::Legacy, false),
    ] {
        reset(db).await?;
        let pool = db.connect(2).await?;
        // The hot record's events first, then the others: the design query's worst case.
        let mut events: Vec<NewEvent> = (0..n)
            .map(|_| NewEvent::new(EVENT_TYPE, payload(Some("hot"))))
            .collect();
        events.extend(keyed_events(n, sizes.records, true));
        enqueue(&pool.repository(), &events, 1_000).await?;
        pool.close().await;
        let config = if batches {
            config(mode, 8)
        } else {
            config(mode, 8).without_batches()
        };
        let run = start(db, config, handlers(None, None)).await?;
        match mode {
            DispatchMode::Pull => run.wait_for(2 * n as u64).await?,
            DispatchMode::Legacy => wait_for_others(db, &run, n).await?,
        }
        let since = run.started;
        run.stop().await?;
        let pool = db.connect(1).await?;
        let all = bench::latency(pg(&pool)?, Keys::All, since).await?;
        let others = bench::latency(pg(&pool)?, Keys::Except(HOT_KEY), since).await?;
        let hot = bench::latency(pg(&pool)?, Keys::Only(HOT_KEY), since).await?;
        let violations = bench::order_violations(pg(&pool)?).await?;
        pool.close().await;
        let others_rate = others.n as f64 / others.span_s.max(1e-9);
        let hot_rate = hot.n as f64 / hot.span_s.max(1e-9);
        if mode == DispatchMode::Pull {
            hot_rates.push(hot_rate);
        }
        report.push(Row {
            scenario: format!("hot key: {n} on 1 record + {n} over {}", sizes.records),
            dispatcher: match (mode, batches) {
                (DispatchMode::Pull, false) => "pull, one event per attempt".into(),
                _ => mode_name(mode).into(),
            },
            workers: Some(8),
            events: Some(all.n),
            per_second: Some(all.n as f64 / all.span_s.max(1e-9)),
            p50_ms: Some(others.p50_ms),
            p99_ms: Some(others.p99_ms),
            note: format!(
                "latency of the other records; others drained in {:.1}s ({others_rate:.0}/s = {:.2}x of the pull workers' rate without the hot record), hot record {} of {n} at {:.0}/s (serial); order violations {violations}",
                others.span_s,
                others_rate / alone,
                hot.n,
                hot_rate
            ),
            ..Row::default()
        });
        if mode == DispatchMode::Pull && batches {
            report.target(
                "hot key: the other records drain at >= 0.8x of their rate without the hot record",
                format!(
                    "{others_rate:.0}/s vs {alone:.0}/s = {:.2}x",
                    others_rate / alone
                ),
                others_rate >= 0.8 * alone,
            );
        }
    }
    hot_target(report, &hot_rates);
    Ok(())
}

/// Issue 26's target: the hot record drained by batched attempts (its chains) against one
/// attempt per event, `rates` in that order.
fn hot_target(report: &mut Report, rates: &[f64]) {
    if let [batched, single] = rates[..] {
        report.target(
            "hot key: the hot record's own events drain >= 10x faster than one attempt per event",
            format!(
                "{batched:.0}/s vs {single:.0}/s = {:.1}x",
                batched / single.max(1e-9)
            ),
            batched >= 10.0 * single,
        );
    }
}
