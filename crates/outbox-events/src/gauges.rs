//! The queue gauges: one read of the queue per interval per dispatcher
//! ([`outbox_persistence::OutboxRepository::stats`]), published through the `metrics` facade
//! (rows by status, the oldest pending age, stale claims, blocked keys). Off unless
//! [`crate::WorkerConfig::with_queue_gauges`] sets an interval; its cost is argued in
//! `docs/queries.md`.

use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{ClaimPolicy, OutboxRepository};
use tokio_util::sync::CancellationToken;

use crate::metrics::{gauge_read_failed, record_queue_gauges};

/// Reads the queue every `every` until `stop`, first at once.
pub(crate) async fn run(
    repo: Arc<dyn OutboxRepository>,
    policy: ClaimPolicy,
    every: Duration,
    stop: CancellationToken,
) {
    loop {
        match repo.stats(policy).await {
            Ok(stats) => record_queue_gauges(&stats),
            Err(e) => {
                gauge_read_failed();
                tracing::debug!(error = %e.chain(), "could not read the queue for the gauges");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}
