//! The relay scenario: 8 pull workers drain the keyed backlog (`drain_events` over `records`)
//! into a NATS JetStream stream through `outbox-relay`, against the no-op drain of the same
//! backlog in the same run. Enqueue-to-stream latency is the time the server stored each
//! message minus the event's `CreatedDate` (the database's clock; both on this host); the
//! stream is read back and audited (each event once, per-record order).
//!
//! The server is `OUTBOX_BENCH_NATS_URL` when set, otherwise a `nats-server -js` of the bench's
//! own (`outbox_relay::test_support`); without either the scenario says so and is skipped.

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use outbox_events::DispatchMode;
use outbox_persistence::test_support::bench::{self, Figures, Keys};
use outbox_relay::test_support::NatsServer;
use outbox_relay::{Expected, NatsConnect, Relay, RelayConfig, StreamSpec, audit, read_stream};

use super::report::{Report, Row};
use super::scenarios::{config, enqueue, handlers, keyed_events, pg, reset, start};
use super::{BenchDb, Sizes};

const WORKERS: usize = 8;

/// The server the scenario publishes to, and the one it started (kept alive until the end).
fn server() -> Result<(String, Option<NatsServer>)> {
    if let Ok(url) = std::env::var("OUTBOX_BENCH_NATS_URL") {
        return Ok((url, None));
    }
    let found = std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|dir| dir.join("nats-server").is_file())
    }) || std::env::var_os("NATS_SERVER").is_some();
    anyhow::ensure!(
        found,
        "no nats-server on PATH and no OUTBOX_BENCH_NATS_URL: install nats-server to measure the relay"
    );
    let server = NatsServer::start();
    Ok((server.url(), Some(server)))
}

/// Enqueues the keyed backlog on an empty outbox.
async fn backlog(db: &BenchDb, sizes: &Sizes) -> Result<()> {
    reset(db).await?;
    let pool = db.connect(2).await?;
    let events = keyed_events(sizes.drain_events, sizes.records, true);
    enqueue(&pool.repository(), &events, 1_000).await?;
    pool.close().await;
    Ok(())
}

/// Drains the backlog with `handlers` and reads the figures from the table.
async fn drain(
    db: &BenchDb,
    sizes: &Sizes,
    worker: outbox_events::WorkerConfig,
    handlers: outbox_events::Handlers,
) -> Result<Figures> {
    let since = Utc::now();
    let run = start(db, worker, handlers).await?;
    run.wait_for(sizes.drain_events as u64).await?;
    run.stop().await?;
    let pool = db.connect(1).await?;
    let f = bench::latency(pg(&pool)?, Keys::All, since).await?;
    pool.close().await;
    Ok(f)
}

/// The p50 and p99 of `values` (milliseconds).
fn percentiles(mut values: Vec<f64>) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// Reads the stream back: the enqueue-to-stream latencies and the audit's verdict.
async fn read_back(db: &BenchDb, relay: &Relay) -> Result<((f64, f64), String)> {
    let messages = read_stream(relay.jetstream(), &relay.config().stream).await?;
    let latencies = messages
        .iter()
        .filter_map(|m| {
            let created = DateTime::parse_from_rfc3339(m.created_date.as_deref()?).ok()?;
            let stored: DateTime<Utc> = m.stored_at;
            Some((stored - created.with_timezone(&Utc)).num_microseconds()? as f64 / 1_000.0)
        })
        .collect();
    let pool = db.connect(1).await?;
    let rows = pool
        .repository()
        .list_events(outbox_persistence::EventFilter::new())
        .await?;
    pool.close().await;
    let expected: Vec<Expected> = rows
        .iter()
        .map(|r| Expected {
            id: r.id.to_string(),
            record_key: r.record_key.as_ref().map(|k| k.as_str().to_string()),
        })
        .collect();
    let a = audit(&messages, &expected);
    let verdict = format!(
        "stream audit: {} messages, {} missing, {} duplicated, {} out of record order",
        a.messages,
        a.missing.len(),
        a.duplicated.len(),
        a.out_of_order.len()
    );
    Ok((percentiles(latencies), verdict))
}

/// A relay of the bench's events to a new stream `stream`, created and checked.
async fn relay_to(url: &str, stream: &str, worker: &outbox_events::WorkerConfig) -> Result<Relay> {
    let client = NatsConnect::new(url).connect().await?;
    let relay = Relay::new(client, RelayConfig::new(stream, "bench", ["bench"]))?;
    relay
        .create_stream(&StreamSpec::for_relay(relay.config(), worker))
        .await?;
    relay.check_stream(worker).await?;
    Ok(relay)
}

/// Reports the relay scenario as skipped (no NATS server to run against), and why.
fn skipped(report: &mut Report, why: &anyhow::Error) {
    report.push(Row {
        scenario: "relay to NATS JetStream".into(),
        dispatcher: "pull".into(),
        note: format!("skipped: {why:#}"),
        ..Row::default()
    });
}

/// The relay scenario.
pub(crate) async fn relay(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("relay");
    let (url, _server) = match server() {
        Ok(found) => found,
        Err(e) => {
            skipped(report, &e);
            return Ok(());
        }
    };
    backlog(db, sizes).await?;
    let noop = drain(
        db,
        sizes,
        config(DispatchMode::Pull, WORKERS),
        handlers(None, None),
    )
    .await?;

    backlog(db, sizes).await?;
    let stream = format!("BENCH_{}", uuid::Uuid::now_v7().simple());
    let worker = config(DispatchMode::Pull, WORKERS);
    let relay = relay_to(&url, &stream, &worker).await?;
    let relayed = drain(
        db,
        sizes,
        relay.worker_config(worker.clone()),
        relay.handlers(&worker),
    )
    .await
    .context("the relay drain")?;
    let ((p50, p99), verdict) = read_back(db, &relay).await?;
    relay.jetstream().delete_stream(&stream).await.ok();

    let rate = |f: &Figures| f.n as f64 / f.span_s.max(1e-9);
    let scenario = format!(
        "drain {} over {} records",
        sizes.drain_events, sizes.records
    );
    report.push(Row {
        scenario: format!("{scenario}, no-op (same run)"),
        dispatcher: "pull".into(),
        workers: Some(WORKERS),
        events: Some(noop.n),
        per_second: Some(rate(&noop)),
        p50_ms: Some(noop.p50_ms),
        p99_ms: Some(noop.p99_ms),
        note: "enqueue-to-processed".into(),
        ..Row::default()
    });
    let m = relay.metrics();
    report.push(Row {
        scenario: format!("{scenario}, relay to NATS JetStream"),
        dispatcher: "pull".into(),
        workers: Some(WORKERS),
        events: Some(relayed.n),
        per_second: Some(rate(&relayed)),
        p50_ms: Some(p50),
        p99_ms: Some(p99),
        note: format!(
            "enqueue-to-stream (server store time - CreatedDate); enqueue-to-processed p50 {:.1} ms, p99 {:.1} ms; {verdict}; {} published, {} duplicates, {} publish failures",
            relayed.p50_ms, relayed.p99_ms, m.published, m.duplicates, m.failures
        ),
        ..Row::default()
    });
    let ratio = rate(&relayed) / rate(&noop).max(1e-9);
    report.target(
        "relay drain >= 0.7x the no-op drain (8 pull workers, same run)",
        format!(
            "{:.0}/s vs {:.0}/s = {ratio:.2}x",
            rate(&relayed),
            rate(&noop)
        ),
        ratio >= 0.7,
    );
    Ok(())
}
