//! Slow handlers: 32 workers whose handlers take 50 ms each, against the ideal of 32 events per
//! 50 ms, with when the rows ended (the ramp, the steady part and the tail).

use std::time::Duration;

use anyhow::Result;

use crate::report::{Report, Row};
use crate::scenarios::{VARIANTS, drain_with, enqueue, handlers, keyed_events, reset};
use crate::{BenchDb, Sizes};

pub(crate) async fn slow_handlers(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("slow handlers");
    let workers = 32;
    let sleep = Duration::from_millis(50);
    let ideal = workers as f64 / sleep.as_secs_f64();
    for variant in VARIANTS {
        reset(db).await?;
        let pool = db.connect(2).await?;
        enqueue(
            &pool.repository(),
            &keyed_events(sizes.slow_events, sizes.records, true),
            1_000,
        )
        .await?;
        pool.close().await;
        let d = drain_with(
            db,
            variant.setup(workers),
            sizes.slow_events,
            handlers(Some(sleep), None),
        )
        .await?;
        let (f, t) = (d.figures, d.timeline);
        let rate = f.n as f64 / f.span_s.max(1e-9);
        let claims = variant.claims_note(d.per_statement);
        report.push(Row {
            scenario: format!("slow handlers 50 ms, {} events", sizes.slow_events),
            dispatcher: variant.name.into(),
            workers: Some(workers),
            events: Some(f.n),
            per_second: Some(rate),
            p50_ms: Some(f.p50_ms),
            p99_ms: Some(f.p99_ms),
            note: format!(
                "{:.0}% of the ideal {ideal:.0}/s; first row processed at {:.0} ms, 10% at {:.0} ms, \
                 90% at {:.0} ms, last at {:.0} ms (ideal {:.0}); between 10% and 90% {:.0}/s = {:.0}%; \
                 order violations {}{claims}",
                100.0 * rate / ideal,
                1e3 * t.first_s,
                1e3 * t.p10_s,
                1e3 * t.p90_s,
                1e3 * t.last_s,
                1e3 * f.n as f64 / ideal,
                t.steady_rate(f.n),
                100.0 * t.steady_rate(f.n) / ideal,
                d.violations,
            ),
            ..Row::default()
        });
        if variant.shipped_pull() {
            report.target(
                "slow handlers (50 ms, 32 workers) reach 90% of the ideal 640/s",
                format!("{rate:.0}/s = {:.0}%", 100.0 * rate / ideal),
                rate >= 0.9 * ideal,
            );
        }
    }
    Ok(())
}
