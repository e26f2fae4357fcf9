//! What a delivery writes beside its attempt: the attempt log, the endpoint's failures in a
//! row, and disabling the endpoint. They must survive the attempt's rollback (a failed attempt
//! is kept too), so they are not written in its transaction; and they must not cost the
//! attempt a connection while it holds one (on PostgreSQL a pool sized for the workers would
//! starve their heartbeats; on SQLite the attempt holds the one write lock). One task per
//! sender writes them, in order, in batches, on one connection after the attempts that queued
//! them: it holds no row lock across an attempt, a success with no failures to clear does not
//! write the endpoint row, and endpoint rows are written in name order (no deadlock between
//! processes). [`SideWriter::flush`] waits until what was queued before it is written (a
//! process that stops calls it after its dispatcher stopped, so no attempt's record is lost).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use outbox_events::OutboxRepository;
use outbox_events::persistence::webhooks::{self, DeliveryAttempt};
use tokio::sync::{mpsc, oneshot};

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

/// What the queue carries: a write, or a caller waiting until every write queued before it
/// has been written (or given up).
enum Queued {
    Write(SideWrite),
    Flush(oneshot::Sender<()>),
}

/// The writer: a queue and the task that drains it, started on first use. Clones share both.
#[derive(Clone)]
pub(crate) struct SideWriter {
    inner: Arc<Inner>,
}

struct Inner {
    repo: Arc<dyn OutboxRepository>,
    disable_after: i32,
    queue: OnceLock<mpsc::Sender<Queued>>,
}

impl SideWriter {
    pub(crate) fn new(repo: Arc<dyn OutboxRepository>, disable_after: i32) -> Self {
        Self {
            inner: Arc::new(Inner {
                repo,
                disable_after,
                queue: OnceLock::new(),
            }),
        }
    }

    /// Queues `write` (never waits).
    pub(crate) fn send(&self, write: SideWrite) {
        let inner = &self.inner;
        let queue = inner.queue.get_or_init(|| {
            let (tx, rx) = mpsc::channel(QUEUE);
            tokio::spawn(run(inner.repo.clone(), rx, inner.disable_after));
            tx
        });
        match queue.try_send(Queued::Write(write)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(
                    "the webhook attempt log's queue is full; an attempt's record is dropped"
                );
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                tracing::warn!(
                    "the webhook attempt log's writer has stopped; an attempt's record is dropped"
                );
            }
        }
    }

    /// Whether no delivery holds this writer any more (only the caller's handle is left).
    pub(crate) fn only_here(&self) -> bool {
        Arc::strong_count(&self.inner) == 1
    }

    /// Waits until every write queued before this call is written, or given up after its
    /// tries (logged). Returns at once when nothing was ever queued.
    pub(crate) async fn flush(&self) {
        let Some(queue) = self.inner.queue.get() else {
            return;
        };
        let (done, written) = oneshot::channel();
        if queue.send(Queued::Flush(done)).await.is_ok() {
            let _ = written.await;
        }
    }
}

/// How often the endpoint gauges are read again (and after every disable).
const GAUGES_EVERY: Duration = Duration::from_secs(15);

async fn run(repo: Arc<dyn OutboxRepository>, mut rx: mpsc::Receiver<Queued>, disable_after: i32) {
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
        let mut batch = Vec::new();
        let mut waiting = Vec::new();
        let mut next = Some(first);
        while let Some(queued) = next {
            match queued {
                Queued::Write(write) => batch.push(write),
                Queued::Flush(done) => waiting.push(done),
            }
            next = if batch.len() < BATCH {
                rx.try_recv().ok()
            } else {
                None
            };
        }
        if !batch.is_empty() {
            write_with_tries(&repo, &batch, disable_after).await;
        }
        for done in waiting {
            let _ = done.send(());
        }
    }
}

/// Writes `batch`, tried [`TRIES`] times with a backoff, then given up (logged).
async fn write_with_tries(
    repo: &Arc<dyn OutboxRepository>,
    batch: &[SideWrite],
    disable_after: i32,
) {
    let mut backoff = Duration::from_millis(50);
    for try_number in 1..=TRIES {
        match write(repo, batch, disable_after).await {
            Ok(disabled) => {
                if disabled {
                    publish_gauges(repo).await;
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
    // The attempts first, in the order they were made, in one statement (on PostgreSQL): the
    // log names its endpoint by name, so this locks no endpoint row.
    let attempts: Vec<DeliveryAttempt> = batch
        .iter()
        .filter_map(|w| match w {
            SideWrite::Attempt(attempt, _) => Some(attempt.clone()),
            SideWrite::Disable { .. } => None,
        })
        .collect();
    // Endpoint rows are written in name order: two processes' batches never wait for each
    // other in a cycle (the order of one endpoint's attempts is kept).
    let mut batch: Vec<&SideWrite> = batch.iter().collect();
    batch.sort_by(|a, b| a.endpoint().cmp(b.endpoint()));
    let mut tx = repo.begin().await?;
    webhooks::record_delivery_attempts(&mut tx, &attempts).await?;
    let mut disabled = false;
    // The endpoint whose failures this batch cleared last, with nothing written for it since:
    // its next successes would clear nothing (one statement per endpoint for a healthy batch).
    let mut cleared: Option<&str> = None;
    for write in batch {
        match write {
            SideWrite::Attempt(attempt, delivered) => {
                if *delivered && cleared == Some(attempt.endpoint.as_str()) {
                    continue;
                }
                let failures =
                    webhooks::note_delivery(&mut tx, &attempt.endpoint, *delivered).await?;
                cleared = delivered.then_some(attempt.endpoint.as_str());
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
                cleared = None;
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

#[cfg(test)]
mod tests {
    use outbox_events::persistence::webhooks::{NewEndpoint, SecretText, add_endpoint, endpoint};
    use outbox_tests::{TestDb, backend_tests};

    use super::*;

    fn sent(endpoint: &str, delivered: bool) -> SideWrite {
        SideWrite::Attempt(
            DeliveryAttempt {
                endpoint: endpoint.into(),
                // No outbox row: the log skips it, the endpoint's count does not.
                event_id: uuid::Uuid::now_v7(),
                source_event_id: uuid::Uuid::now_v7(),
                attempt: 1,
                at: None,
                status_code: Some(if delivered { 200 } else { 500 }),
                latency_ms: 1,
                response_body: None,
                error: None,
            },
            delivered,
        )
    }

    /// The failures in a row of each endpoint, and whether it is enabled.
    async fn counts(repo: &Arc<dyn OutboxRepository>) -> Vec<(i32, bool)> {
        let mut tx = repo.begin().await.unwrap();
        let mut out = Vec::new();
        for name in ["a", "b"] {
            let e = endpoint(&mut tx, name).await.unwrap().unwrap();
            out.push((e.consecutive_failures, e.enabled));
        }
        tx.rollback().await.unwrap();
        out
    }

    /// A batch's successes after a success of the same endpoint write nothing; any failure or
    /// disable in between makes the next success clear again. Counted as if every write ran.
    async fn a_batch_counts_failures_as_every_write_would(db: TestDb) {
        let repo = db.repository();
        let mut tx = repo.begin().await.unwrap();
        for name in ["a", "b"] {
            let new = NewEndpoint {
                name: name.into(),
                url: "https://example.com/in".into(),
                event_types: vec!["lead.updated".into()],
                secret: SecretText("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into()),
            };
            assert!(add_endpoint(&mut tx, &new, "test").await.unwrap());
        }
        tx.commit().await.unwrap();
        let batch = [
            sent("a", true),
            sent("b", false),
            sent("a", false),
            sent("a", true),
            sent("b", true),
            sent("a", true),
            sent("b", true),
            sent("a", false),
            sent("b", false),
            sent("a", false),
        ];
        assert!(!write(&repo, &batch, 3).await.unwrap());
        assert_eq!(counts(&repo).await, vec![(2, true), (1, true)]);
        let disable = SideWrite::Disable {
            endpoint: "b".into(),
            reason: "test".into(),
        };
        let batch = [
            sent("a", true),
            sent("a", true),
            sent("b", true),
            sent("b", false),
            disable,
            sent("b", false),
            sent("a", false),
            sent("a", false),
            sent("a", false),
        ];
        assert!(write(&repo, &batch, 3).await.unwrap(), "a disabled");
        // A disable starts its count again: `a` at 0 once its third failure disabled it.
        assert_eq!(counts(&repo).await, vec![(0, false), (1, false)]);
    }

    backend_tests!(a_batch_counts_failures_as_every_write_would);
}
