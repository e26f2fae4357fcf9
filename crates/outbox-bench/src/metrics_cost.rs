//! The cost of metrics: the keyed no-op drain (8 pull workers, the drain's events over 1,000
//! records) with a Prometheus recorder recording everything the workers count, against the same
//! drain with no recorder (the `metrics` facade's no-op), alternated so that drift of the machine
//! (other load, the table's and the server's state) falls on both sides alike.
//!
//! A process has one global recorder, installed once and never removed, and the workers record
//! from every thread of the runtime (so a thread-local recorder cannot stand in). The method:
//!
//! 1. the first run is **off** with no recorder installed at all: the facade's own no-op;
//! 2. then a [`Switch`] recorder is installed, holding the Prometheus recorder (the `_seconds`
//!    buckets of `--metrics-addr`, a scrape rendered every second, which also drains the
//!    histograms, more often than Prometheus would scrape);
//! 3. the runs alternate **on** (the switch hands out the Prometheus recorder's handles) and
//!    **off** (it hands out the no-op handles the facade's no-op recorder hands out: one more
//!    virtual call and one atomic load per record than step 1; the row of step 1 shows whether
//!    that is visible).
//!
//! The switch stays installed (off) afterwards, which is why this scenario runs last. Every run
//! drains a fresh backlog; an on-run checks that the recorder counted all its attempts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use outbox_events::DispatchMode;
use outbox_persistence::test_support::bench::{self, Keys};

use crate::report::{Report, Row};
use crate::scenarios::{config, enqueue, handlers, keyed_events, pg, reset, start};
use crate::{BenchDb, Sizes};

/// Events of each run (over the drain's 1,000 records).
const EVENTS: usize = 20_000;
/// Events of each run with `--quick`.
const QUICK_EVENTS: usize = 4_000;
/// Pull workers of each run.
const WORKERS: usize = 8;
/// Off/on pairs after the first off-run.
const PAIRS: usize = 3;
/// How often the on-runs render the Prometheus text (a scrape).
const SCRAPE_EVERY: Duration = Duration::from_secs(1);

/// A recorder that forwards to the Prometheus recorder while on, and hands out no-op handles
/// while off.
struct Switch {
    on: Arc<AtomicBool>,
    inner: PrometheusRecorder,
}

impl Recorder for Switch {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        if self.on.load(Ordering::Relaxed) {
            self.inner.register_counter(key, metadata)
        } else {
            Counter::noop()
        }
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if self.on.load(Ordering::Relaxed) {
            self.inner.register_gauge(key, metadata)
        } else {
            Gauge::noop()
        }
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        if self.on.load(Ordering::Relaxed) {
            self.inner.register_histogram(key, metadata)
        } else {
            Histogram::noop()
        }
    }
}

/// Installs the switch (off) as the global recorder; its switch and the Prometheus handle.
fn install_switch() -> Result<(Arc<AtomicBool>, PrometheusHandle)> {
    let inner = outbox_events::prometheus::with_outbox_buckets(PrometheusBuilder::new())
        .context("histogram buckets")?
        .build_recorder();
    let handle = inner.handle();
    let on = Arc::new(AtomicBool::new(false));
    metrics::set_global_recorder(Switch {
        on: on.clone(),
        inner,
    })
    .map_err(|_| anyhow::anyhow!("a metrics recorder is installed already"))?;
    outbox_events::describe_metrics();
    Ok((on, handle))
}

/// The processed attempts the Prometheus recorder has counted so far.
fn processed_counted(handle: &PrometheusHandle) -> u64 {
    handle
        .render()
        .lines()
        .filter(|l| l.starts_with("outbox_attempts_total{") && l.contains("outcome=\"processed\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// One drain of a fresh keyed backlog: events per second (processed rows over the time from
/// the dispatcher's start to the last `processed`), p50 and p99 in ms.
async fn drain(
    db: &BenchDb,
    n: usize,
    scrape: Option<&PrometheusHandle>,
) -> Result<(f64, f64, f64)> {
    reset(db).await?;
    let pool = db.connect(2).await?;
    enqueue(&pool.repository(), &keyed_events(n, 1_000, true), 1_000).await?;
    pool.close().await;
    let scraper = scrape.cloned().map(|handle| {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SCRAPE_EVERY).await;
                drop(handle.render());
            }
        })
    });
    // From just before the dispatcher's pool opens (the no-op drain rows start after it: a few
    // milliseconds, the same in every run here).
    let since = chrono::Utc::now();
    let run = start(
        db,
        config(DispatchMode::Pull, WORKERS),
        handlers(None, None),
    )
    .await?;
    run.wait_for(n as u64).await?;
    run.stop().await?;
    if let Some(task) = scraper {
        task.abort();
    }
    let pool = db.connect(1).await?;
    let f = bench::latency(pg(&pool)?, Keys::All, since).await?;
    pool.close().await;
    if f.n != n {
        bail!("{} of {n} events processed", f.n);
    }
    Ok((f.n as f64 / f.span_s.max(1e-9), f.p50_ms, f.p99_ms))
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// The scenario: off (no recorder), then on/off alternating through the switch.
pub(crate) async fn metrics_cost(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("metrics cost");
    let n = if sizes.quick { QUICK_EVENTS } else { EVENTS };
    let scenario = format!("metrics cost: drain {n} no-op, 1000 records");
    let row = |label: &str, (rate, p50, p99): (f64, f64, f64), note: String| Row {
        scenario: scenario.clone(),
        dispatcher: format!("pull, {label}"),
        workers: Some(WORKERS),
        events: Some(n),
        per_second: Some(rate),
        p50_ms: Some(p50),
        p99_ms: Some(p99),
        note,
        ..Row::default()
    };
    let bare = drain(db, n, None).await?;
    report.push(row(
        "no recorder",
        bare,
        "the facade's no-op: no recorder installed yet".into(),
    ));
    let (switch, handle) = install_switch()?;
    let (mut offs, mut ons) = (Vec::new(), Vec::new());
    for pair in 1..=PAIRS {
        switch.store(true, Ordering::Relaxed);
        let before = processed_counted(&handle);
        let on = drain(db, n, Some(&handle)).await;
        switch.store(false, Ordering::Relaxed);
        let on = on?;
        let counted = processed_counted(&handle) - before;
        if counted != n as u64 {
            bail!("the recorder counted {counted} processed attempts of {n}");
        }
        report.push(row(
            &format!("metrics on #{pair}"),
            on,
            format!(
                "Prometheus recorder, {counted} attempts counted, scraped every {SCRAPE_EVERY:?}"
            ),
        ));
        ons.push(on.0);
        let off = drain(db, n, None).await?;
        report.push(row(
            &format!("metrics off #{pair}"),
            off,
            "switch off: the no-op handles".into(),
        ));
        offs.push(off.0);
    }
    let (on, off) = (mean(&ons), mean(&offs));
    report.target(
        "keyed no-op drain with metrics on >= 0.95x of metrics off (8 pull workers)",
        format!(
            "on {on:.0}/s vs off {off:.0}/s = {:.3}x (means of {PAIRS} alternated pairs; no recorder at all: {:.0}/s)",
            on / off,
            bare.0
        ),
        on >= 0.95 * off,
    );
    Ok(())
}
