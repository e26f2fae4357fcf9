//! What a delivery writes beside its attempt: the attempt log, the endpoint's failures in a
//! row, and disabling the endpoint. They must survive the attempt's rollback (a failed attempt
//! is kept too), so they are not written in its transaction; and they must not cost the
//! attempt a connection while it holds one (on PostgreSQL a pool sized for the workers would
//! starve their heartbeats; on SQLite the attempt holds the one write lock). One task per
//! sender writes them, in order, in batches, on one connection after the attempts that queued
//! them: it holds no row lock across an attempt, a success with no failures to clear does not
//! write the endpoint row, and endpoint rows are written in name order (no deadlock between
//! processes).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use outbox_events::OutboxRepository;
use outbox_events::persistence::webhooks::{self, DeliveryAttempt};
use tokio::sync::mpsc;

/// One write.
#[derive(Debug, Clone)]
pub(crate) enum SideWrite {
    /// Keep an attempt and count it on its endpoint (`delivered`: a 2xx).
    Attempt(DeliveryAttempt, bool),
    /// Disable an endpoint, for a reason.
    Disable { endpoint: String, reason: String },
}

impl SideWrite {
    fn endpoint(&self) -> &str {
        match self {
            SideWrite::Attempt(attempt, _) => &attempt.endpoint,
            SideWrite::Disable { endpoint, .. } => endpoint,
        }
    }
}

/// Writes queued beyond this are dropped (logged): the attempt log is a record, the queue
/// must not grow without bound behind a database that is away.
const QUEUE: usize = 10_000;
/// The most writes in one transaction.
const BATCH: usize = 256;
/// How often a batch is tried.
const TRIES: u32 = 10;

/// The writer: a queue and the task that drains it, started on first use.
pub(crate) struct SideWriter {
    repo: Arc<dyn OutboxRepository>,
    disable_after: i32,
    queue: OnceLock<mpsc::Sender<SideWrite>>,
}

impl SideWriter {
    pub(crate) fn new(repo: Arc<dyn OutboxRepository>, disable_after: i32) -> Self {
        Self {
            repo,
            disable_after,
            queue: OnceLock::new(),
        }
    }

    /// Queues `write` (never waits).
    pub(crate) fn send(&self, write: SideWrite) {
        let queue = self.queue.get_or_init(|| {
            let (tx, rx) = mpsc::channel(QUEUE);
            tokio::spawn(run(self.repo.clone(), rx, self.disable_after));
            tx
        });
        if let Err(e) = queue.try_send(write) {
            tracing::warn!(error = %e, "the webhook attempt log's queue is full; an attempt's record is dropped");
        }
    }
}

/// How often the endpoint gauges are read again (and after every disable).
const GAUGES_EVERY: Duration = Duration::from_secs(15);

async fn run(
    repo: Arc<dyn OutboxRepository>,
    mut rx: mpsc::Receiver<SideWrite>,
    disable_after: i32,
) {
    let mut gauges = tokio::time::interval(GAUGES_EVERY);
    gauges.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let first = tokio::select! {
            write = rx.recv() => match write {
                Some(write) => write,
                None => return,
            },
            _ = gauges.tick() => {
                publish_gauges(&repo).await;
                continue;
            }
        };
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(write) => batch.push(write),
                Err(_) => break,
            }
        }
        let mut backoff = Duration::from_millis(50);
        for try_number in 1..=TRIES {
            match write(&repo, &batch, disable_after).await {
                Ok(disabled) => {
                    if disabled {
                        publish_gauges(&repo).await;
                    }
                    break;
                }
                Err(e) if try_number == TRIES => {
                    tracing::warn!(error = %e, writes = batch.len(), "the webhooks' side writes failed; giving them up");
                }
                Err(e) => {
                    tracing::debug!(error = %e, try_number, "the webhooks' side writes failed; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}

/// Publishes the endpoints' state, read from the database (every process that delivers
/// publishes the same values): `outbox_webhook_endpoint_enabled{endpoint}` (1 or 0) and
/// `outbox_webhook_endpoints{state}` (how many are enabled and disabled).
async fn publish_gauges(repo: &Arc<dyn OutboxRepository>) {
    let read = async {
        let mut tx = repo.begin().await?;
        let endpoints = webhooks::endpoints(&mut tx).await?;
        tx.rollback().await?;
        Ok::<_, outbox_events::persistence::Error>(endpoints)
    };
    match read.await {
        Ok(endpoints) => {
            let disabled = endpoints.iter().filter(|e| !e.enabled).count();
            for e in &endpoints {
                metrics::gauge!(ENDPOINT_ENABLED, "endpoint" => e.name.clone()).set(if e.enabled {
                    1.0
                } else {
                    0.0
                });
            }
            metrics::gauge!(ENDPOINTS, "state" => "disabled").set(disabled as f64);
            metrics::gauge!(ENDPOINTS, "state" => "enabled")
                .set((endpoints.len() - disabled) as f64);
        }
        Err(e) => {
            tracing::debug!(error = %e, "could not read the webhook endpoints for their gauges")
        }
    }
}

/// Gauge: 1 while an endpoint is enabled, 0 while it is disabled (label `endpoint`).
pub(crate) const ENDPOINT_ENABLED: &str = "outbox_webhook_endpoint_enabled";
/// Gauge: how many endpoints are in each state (label `state`: `enabled`, `disabled`).
pub(crate) const ENDPOINTS: &str = "outbox_webhook_endpoints";

/// Writes one batch; `true` when it disabled an endpoint.
async fn write(
    repo: &Arc<dyn OutboxRepository>,
    batch: &[SideWrite],
    disable_after: i32,
) -> outbox_events::persistence::Result<bool> {
    // Endpoint rows are written in name order: two processes' batches never wait for each
    // other in a cycle (the order of one endpoint's attempts is kept).
    let mut batch: Vec<&SideWrite> = batch.iter().collect();
    batch.sort_by(|a, b| a.endpoint().cmp(b.endpoint()));
    let mut tx = repo.begin().await?;
    let mut disabled = false;
    for write in batch {
        match write {
            SideWrite::Attempt(attempt, delivered) => {
                webhooks::record_delivery_attempt(&mut tx, attempt).await?;
                let failures =
                    webhooks::note_delivery(&mut tx, &attempt.endpoint, *delivered).await?;
                if !delivered && failures >= disable_after {
                    let reason = format!("{failures} failed attempts in a row");
                    if webhooks::set_endpoint_enabled(
                        &mut tx,
                        &attempt.endpoint,
                        false,
                        Some(&reason),
                        crate::deliver::DELIVERY_CONSUMER,
                    )
                    .await?
                    {
                        disabled = true;
                        tracing::warn!(endpoint = %attempt.endpoint, failures, "webhook endpoint disabled after sustained failure");
                    }
                }
            }
            SideWrite::Disable { endpoint, reason } => {
                if webhooks::set_endpoint_enabled(
                    &mut tx,
                    endpoint,
                    false,
                    Some(reason),
                    crate::deliver::DELIVERY_CONSUMER,
                )
                .await?
                {
                    disabled = true;
                    tracing::warn!(%endpoint, reason, "webhook endpoint disabled");
                }
            }
        }
    }
    tx.commit().await?;
    if disabled {
        // After the commit: a read before it would cache the endpoint as still enabled.
        crate::cache::changed();
    }
    Ok(disabled)
}
