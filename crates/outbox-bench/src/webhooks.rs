//! The webhooks scenario: 8 pull workers fan the keyed backlog out to one endpoint and deliver
//! it (`outbox-webhooks`, signed, through the effect ledger) to a local receiver over
//! keep-alive connections, against the no-op drain of the same backlog in the same run; then
//! enqueue-to-delivered latency at 1,000 events/s offered. The receiver is in this process
//! (hyper, HTTP/1): it acknowledges every request with 200 and keeps when it got it and the
//! delivery's `outbox-sequence`, so the figures are the receiver's clock minus `CreatedDate`,
//! and per-record order is checked from what it received. `OUTBOX_BENCH_WEBHOOK_BUDGET_MS`
//! sets the workers' batch budget, in the drains and at the offered rate (the default's,
//! 10 ms, otherwise).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use chrono::Utc;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use outbox_events::{DispatchMode, Handlers, NewEvent, OutboxRepository};
use outbox_persistence::test_support::bench::{self, Figures, Keys};
use outbox_webhooks::{AddressPolicy, WebhookConfig, Webhooks, headers};

use super::report::{Report, Row};
use super::scenarios::{EVENT_TYPE, config, enqueue, keyed_events, payload, pg, reset, start};
use super::{BenchDb, Sizes};

const WORKERS: usize = 8;
/// Offered rate of the latency run, events per second.
const OFFERED: usize = 1_000;

/// One request the receiver acknowledged.
#[derive(Debug, Clone)]
struct Ack {
    /// Unix microseconds, the receiver's clock.
    at_us: i64,
    /// `outbox-sequence`: the event's `CreatedDate` in Unix microseconds, and its id.
    sequence: (i64, String),
    record: String,
    id: String,
}

/// The local receiver.
struct Receiver {
    port: u16,
    acks: Arc<Mutex<Vec<Ack>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start() -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let acks: Arc<Mutex<Vec<Ack>>> = Arc::default();
        let kept = acks.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let kept = kept.clone();
                tokio::spawn(async move {
                    let service =
                        service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                            let kept = kept.clone();
                            async move {
                                let header = |name: &str| {
                                    request
                                        .headers()
                                        .get(name)
                                        .and_then(|v| v.to_str().ok())
                                        .unwrap_or_default()
                                        .to_string()
                                };
                                let sequence = header(headers::SEQUENCE);
                                let (micros, event) = sequence.split_once('.').unwrap_or(("0", ""));
                                let ack = Ack {
                                    at_us: Utc::now().timestamp_micros(),
                                    sequence: (micros.parse().unwrap_or(0), event.to_string()),
                                    record: header(headers::RECORD),
                                    id: header(headers::ID),
                                };
                                kept.lock().unwrap_or_else(|e| e.into_inner()).push(ack);
                                Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                                    Bytes::new(),
                                )))
                            }
                        });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Self { port, acks, task })
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/bench", self.port)
    }

    /// Distinct deliveries acknowledged.
    fn delivered(&self) -> usize {
        let acks = self.acks.lock().unwrap_or_else(|e| e.into_inner());
        acks.iter()
            .map(|a| a.id.as_str())
            .collect::<std::collections::HashSet<_>>()
            .len()
    }

    fn take(&self) -> Vec<Ack> {
        std::mem::take(&mut *self.acks.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Deliveries acknowledged for a record before an older event of it.
fn order_violations(acks: &[Ack]) -> usize {
    let mut last: HashMap<&str, &(i64, String)> = HashMap::new();
    let mut violations = 0;
    for ack in acks {
        if last
            .get(ack.record.as_str())
            .is_some_and(|prev| **prev > ack.sequence)
        {
            violations += 1;
        }
        last.insert(&ack.record, &ack.sequence);
    }
    violations
}

/// p50 and p99 of the first acknowledgement per delivery, receiver clock minus `CreatedDate`
/// (ms).
fn latencies(acks: &[Ack]) -> (f64, f64) {
    let mut first: HashMap<&str, f64> = HashMap::new();
    for a in acks {
        first
            .entry(&a.id)
            .or_insert((a.at_us - a.sequence.0) as f64 / 1_000.0);
    }
    let mut values: Vec<f64> = first.into_values().collect();
    values.sort_by(f64::total_cmp);
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// The webhook handlers for the bench's event type, delivering to `receiver`, and their
/// `Webhooks` (flushed after each run: its attempt log is written beside the attempts, and a
/// `reset` that truncates the tables while those writes go on deadlocks with them).
async fn webhook_handlers(
    db: &BenchDb,
    receiver: &Receiver,
    worker: &outbox_events::WorkerConfig,
) -> Result<(Handlers, Webhooks)> {
    let pool = db.connect(2).await?;
    let repo = pool.repository();
    let hooks = Webhooks::new(
        repo.clone(),
        WebhookConfig::default()
            .with_addresses(AddressPolicy::default().allow("127.0.0.0/8".parse()?)),
    );
    hooks
        .add_with_secret(
            "bench",
            &receiver.url(),
            &[],
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "bench",
        )
        .await?;
    let handlers = hooks.register(Handlers::new(), &[EVENT_TYPE], worker)?;
    Ok((handlers, hooks))
}

/// The workers' configuration: [`WORKERS`] pull workers, with the batch budget
/// `OUTBOX_BENCH_WEBHOOK_BUDGET_MS` names (the default's otherwise).
fn worker_config() -> outbox_events::WorkerConfig {
    let worker = config(DispatchMode::Pull, WORKERS);
    match std::env::var("OUTBOX_BENCH_WEBHOOK_BUDGET_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(ms) => worker.with_batches(32, Duration::from_millis(ms)),
        None => worker,
    }
}

/// Drains `n` backlog events with `handlers` until `done`; the rate from the dispatcher's
/// start to the last processed row (or the last acknowledgement).
async fn drain_until(
    db: &BenchDb,
    handlers: Handlers,
    rows: u64,
    done: impl Fn() -> bool,
) -> Result<(Figures, chrono::DateTime<Utc>)> {
    let worker = worker_config();
    let run = start(db, worker, handlers).await?;
    let since = run.started;
    run.wait_for(rows).await?;
    let began = Instant::now();
    while !done() {
        anyhow::ensure!(
            began.elapsed() < Duration::from_secs(60),
            "the receiver did not get every delivery"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    run.stop().await?;
    let pool = db.connect(1).await?;
    let f = bench::latency(pg(&pool)?, Keys::All, since).await?;
    pool.close().await;
    Ok((f, since))
}

/// The webhooks scenario.
pub(crate) async fn webhooks(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("webhooks");
    let n = sizes.drain_events;
    reset(db).await?;
    let pool = db.connect(2).await?;
    enqueue(
        &pool.repository(),
        &keyed_events(n, sizes.records, true),
        1_000,
    )
    .await?;
    let (noop, _) = drain_until(db, super::scenarios::handlers(None, None), n as u64, || {
        true
    })
    .await
    .context("the no-op drain")?;

    reset(db).await?;
    let receiver = Receiver::start().await?;
    let worker = worker_config();
    let (handlers, hooks) = webhook_handlers(db, &receiver, &worker).await?;
    enqueue(
        &pool.repository(),
        &keyed_events(n, sizes.records, true),
        1_000,
    )
    .await?;
    let (_, since) = drain_until(db, handlers, 2 * n as u64, || receiver.delivered() >= n)
        .await
        .context("the webhook drain")?;
    hooks.flush().await;
    let acks = receiver.take();
    let last = acks.iter().map(|a| a.at_us).max().unwrap_or_default();
    let span_s = (last - since.timestamp_micros()) as f64 / 1e6;
    let delivered_rate = n as f64 / span_s.max(1e-9);
    let noop_rate = noop.n as f64 / noop.span_s.max(1e-9);
    let violations = order_violations(&acks);
    let scenario = format!("drain {n} over {} records", sizes.records);
    push_drains(
        report,
        &scenario,
        (noop.n, noop_rate),
        (n, delivered_rate),
        (acks.len(), violations),
    );

    let (p50, p99, offered, violations, stages) = offered_latency(db, sizes, &receiver).await?;
    report.push(Row {
        scenario: format!("webhooks at {OFFERED} events/s offered over {} records", sizes.records),
        dispatcher: "pull".into(),
        workers: Some(WORKERS),
        events: Some(offered),
        p50_ms: Some(p50),
        p99_ms: Some(p99),
        note: format!(
            "enqueue-to-delivered (receiver clock - CreatedDate, first acknowledgement); {violations} out of record order; {stages}"
        ),
        ..Row::default()
    });
    report.target(
        "webhooks enqueue-to-delivered p99 < 50 ms at 1,000 events/s offered (8 workers)",
        format!("p50 {p50:.1} ms, p99 {p99:.1} ms"),
        p99 < 50.0 && violations == 0,
    );
    pool.close().await;
    Ok(())
}

/// The drain rows and their target: the no-op drain (events, per second), the webhook drain
/// (source events delivered, per second), and the receiver's requests and order violations.
fn push_drains(
    report: &mut Report,
    scenario: &str,
    (noop_n, noop_rate): (usize, f64),
    (n, delivered_rate): (usize, f64),
    (requests, violations): (usize, usize),
) {
    report.push(Row {
        scenario: format!("{scenario}, no-op (same run as webhooks)"),
        dispatcher: "pull".into(),
        workers: Some(WORKERS),
        events: Some(noop_n),
        per_second: Some(noop_rate),
        note: "enqueue-to-processed".into(),
        ..Row::default()
    });
    report.push(Row {
        scenario: format!("{scenario}, webhooks to a local receiver (one endpoint)"),
        dispatcher: "pull".into(),
        workers: Some(WORKERS),
        events: Some(n),
        per_second: Some(delivered_rate),
        note: format!(
            "source events delivered per second (fan-out row + delivery row each, signed, through the ledger, keep-alive HTTP/1); {requests} requests, {violations} out of record order"
        ),
        ..Row::default()
    });
    let ratio = delivered_rate / noop_rate.max(1e-9);
    report.target(
        "webhook drain >= 0.5x the no-op keyed drain (8 pull workers, same run)",
        format!(
            "{ratio:.2}x ({delivered_rate:.0}/s vs {noop_rate:.0}/s), {violations} order violations"
        ),
        ratio >= 0.5 && violations == 0,
    );
}

/// Enqueue-to-delivered at [`OFFERED`] events/s for a few seconds (10 in the full run), with
/// the workers already running: p50, p99, events, order violations, and each stage's share.
async fn offered_latency(
    db: &BenchDb,
    sizes: &Sizes,
    receiver: &Receiver,
) -> Result<(f64, f64, usize, usize, String)> {
    reset(db).await?;
    let worker = worker_config();
    let (handlers, hooks) = webhook_handlers(db, receiver, &worker).await?;
    let run = start(db, worker, handlers).await?;
    let pool = db.connect(2).await?;
    let repo: Arc<dyn OutboxRepository> = pool.repository();
    let seconds = if sizes.quick { 3 } else { 10 };
    let tick = Duration::from_millis(10);
    let per_tick = OFFERED * tick.as_millis() as usize / 1_000;
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sent = 0;
    for _ in 0..(seconds * 1_000 / tick.as_millis() as usize) {
        interval.tick().await;
        let events: Vec<NewEvent> = (0..per_tick)
            .map(|i| {
                let record = format!("r{}", (sent + i) % sizes.records);
                NewEvent::new(EVENT_TYPE, payload(Some(&record)))
            })
            .collect();
        let mut tx = repo.begin().await?;
        repo.enqueue(&mut tx, &events).await?;
        tx.commit().await?;
        sent += per_tick;
    }
    let began = Instant::now();
    while receiver.delivered() < sent {
        anyhow::ensure!(
            began.elapsed() < Duration::from_secs(60),
            "the receiver did not get every delivery at the offered rate"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    run.stop().await?;
    hooks.flush().await;
    let stages = stages(pg(&pool)?).await?;
    pool.close().await;
    let acks = receiver.take();
    let (p50, p99) = latencies(&acks);
    Ok((p50, p99, sent, order_violations(&acks), stages))
}

/// Where the latency goes, from the rows (the database's clock): each stage's row from its
/// `CreatedDate` to its `processed` write (`LastModifiedDate`), p50/p99 in ms, the fan-out's
/// (the source event) and the delivery's.
async fn stages(pool: &sqlx::PgPool) -> Result<String> {
    let (delivery, fan_out) = bench::latency_by_type_prefix(pool, "webhook:").await?;
    Ok(format!(
        "fan-out row created-to-processed p50 {:.1} / p99 {:.1} ms, delivery row p50 {:.1} / p99 {:.1} ms",
        fan_out.p50_ms, fan_out.p99_ms, delivery.p50_ms, delivery.p99_ms
    ))
}
