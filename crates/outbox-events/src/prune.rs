//! Retention as a background task of the [`Dispatcher`](crate::Dispatcher): every
//! [`RetentionConfig::interval`] it deletes terminal rows that the policy lets go, in batches
//! ([`OutboxRepository::prune`]) with a pause between full batches, until a batch is not full.
//!
//! Off unless configured ([`WorkerConfig::with_retention`](crate::WorkerConfig::with_retention)):
//! deleting rows cannot be undone, and terminal rows are what operators and audits read
//! (`outbox events`, a failed row's `LastError` and payload for `outbox retry`, a service's own
//! verification), so how long to keep them is the embedding service's decision. Several
//! processes may run the task at once: on PostgreSQL each batch locks its rows with `SKIP
//! LOCKED`, so one process wins a batch and the others skip it; on SQLite batches take turns
//! on the write lock. See `docs/retention.md`.

use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{OutboxRepository, PrunePolicy, PruneReport};
use tokio_util::sync::CancellationToken;

/// Default time between two prune runs of the background task.
pub const DEFAULT_PRUNE_INTERVAL: Duration = Duration::from_secs(60);
/// Default pause between two full batches of one run, so that a large backlog of old rows is
/// deleted at a bounded rate that leaves the database to the workers.
pub const DEFAULT_PRUNE_BATCH_PAUSE: Duration = Duration::from_millis(100);
/// Default [`PrunePacing::pause_per_batch_time`]: after a full batch the dispatcher's pruner
/// pauses at least four times as long as the batch took, so it keeps to a fifth of one
/// connection's time at most, and less as the database slows down. Measured with a fixed
/// 100 ms pause only (`outbox-bench`, full run of 2026-12-02, 8 workers beside 1M terminal
/// rows on two cores): the drain ran at 0.54x of its rate without the pruner; see
/// `docs/retention.md` for the figures with this default.
pub const DEFAULT_PRUNE_PAUSE_FACTOR: u32 = 4;

/// How a run paces its batches: after each full batch it pauses `pause`, or
/// `pause_per_batch_time` times as long as the batch took, whichever is longer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrunePacing {
    /// The least pause between two full batches.
    pub pause: Duration,
    /// The pause as a multiple of the last batch's duration (0: `pause` alone).
    pub pause_per_batch_time: u32,
}

impl Default for PrunePacing {
    /// [`DEFAULT_PRUNE_BATCH_PAUSE`], [`DEFAULT_PRUNE_PAUSE_FACTOR`].
    fn default() -> Self {
        Self {
            pause: DEFAULT_PRUNE_BATCH_PAUSE,
            pause_per_batch_time: DEFAULT_PRUNE_PAUSE_FACTOR,
        }
    }
}

impl From<Duration> for PrunePacing {
    /// A fixed pause.
    fn from(pause: Duration) -> Self {
        Self {
            pause,
            pause_per_batch_time: 0,
        }
    }
}

impl PrunePacing {
    /// The pause after a full batch that took `batch`.
    pub fn after(&self, batch: Duration) -> Duration {
        self.pause
            .max(batch.saturating_mul(self.pause_per_batch_time))
    }
}

/// The dispatcher's background pruner: which rows to delete and how fast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionConfig {
    /// The ages of `processed` and `failed` rows, and the batch size.
    pub policy: PrunePolicy,
    /// Time between two runs (a run deletes batches until one is not full).
    pub interval: Duration,
    /// Pause between two full batches of one run.
    pub batch_pause: Duration,
    /// The pause as a multiple of the last batch's duration, when that is longer than
    /// `batch_pause` ([`PrunePacing::pause_per_batch_time`]).
    pub pause_per_batch_time: u32,
}

impl RetentionConfig {
    /// Runs `policy` every [`DEFAULT_PRUNE_INTERVAL`], pausing between full batches
    /// [`DEFAULT_PRUNE_BATCH_PAUSE`] or [`DEFAULT_PRUNE_PAUSE_FACTOR`] times the batch's own
    /// time, whichever is longer.
    pub fn new(policy: PrunePolicy) -> Self {
        Self {
            policy,
            interval: DEFAULT_PRUNE_INTERVAL,
            batch_pause: DEFAULT_PRUNE_BATCH_PAUSE,
            pause_per_batch_time: DEFAULT_PRUNE_PAUSE_FACTOR,
        }
    }

    /// The pacing of a run.
    pub fn pacing(&self) -> PrunePacing {
        PrunePacing {
            pause: self.batch_pause,
            pause_per_batch_time: self.pause_per_batch_time,
        }
    }

    /// Sets the time between runs (at least one millisecond).
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Sets the least pause between full batches.
    pub fn with_batch_pause(mut self, pause: Duration) -> Self {
        self.batch_pause = pause;
        self
    }

    /// Sets the pause as a multiple of the last batch's duration (0: `batch_pause` alone).
    pub fn with_pause_per_batch_time(mut self, factor: u32) -> Self {
        self.pause_per_batch_time = factor;
        self
    }
}

/// Deletes what `policy` lets go, batch after batch ([`OutboxRepository::prune`]), pausing
/// after each full batch as `pacing` says (a `Duration` is a fixed pause), until a batch is not
/// full or `stop` is cancelled. Returns the rows deleted. An error ends the run (the rows
/// deleted so far stay deleted; they are logged).
/// Every batch's rows are counted in `outbox_pruned_rows_total` by status.
pub async fn prune_until_done(
    repo: &dyn OutboxRepository,
    policy: PrunePolicy,
    pacing: impl Into<PrunePacing>,
    stop: &CancellationToken,
) -> Result<PruneReport, outbox_persistence::Error> {
    let pacing = pacing.into();
    let mut total = PruneReport::default();
    loop {
        let began = tokio::time::Instant::now();
        let batch = match repo.prune(policy).await {
            Ok(batch) => batch,
            Err(e) => {
                if total.total() > 0 {
                    tracing::info!(
                        processed = total.processed,
                        failed = total.failed,
                        "outbox prune stopped by an error after deleting rows"
                    );
                }
                return Err(e);
            }
        };
        crate::metrics::pruned(&batch);
        total.add(batch);
        if !batch.more || stop.is_cancelled() {
            return Ok(total);
        }
        let pause = pacing.after(began.elapsed());
        tokio::select! {
            _ = stop.cancelled() => return Ok(total),
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// The background task: a run every interval until `stop`. A batch in flight when `stop` comes
/// is dropped, which rolls it back (a batch deletes all its rows or none).
pub(crate) async fn run(
    repo: Arc<dyn OutboxRepository>,
    retention: RetentionConfig,
    stop: CancellationToken,
) {
    tracing::info!(
        processed_older_than = ?retention.policy.processed_older_than,
        failed_older_than = ?retention.policy.failed_older_than,
        batch = retention.policy.batch_size,
        interval = ?retention.interval,
        "outbox pruner starting"
    );
    while !stop.is_cancelled() {
        let run = prune_until_done(&*repo, retention.policy, retention.pacing(), &stop);
        let outcome = tokio::select! {
            _ = stop.cancelled() => break,
            outcome = run => outcome,
        };
        match outcome {
            Ok(report) if report.total() > 0 => tracing::info!(
                processed = report.processed,
                failed = report.failed,
                "outbox pruner deleted terminal rows"
            ),
            Ok(_) => tracing::debug!("outbox pruner found nothing to delete"),
            Err(e) if e.is_lock_timeout() => {
                tracing::debug!(error = %e.chain(), "outbox pruner hit the lock timeout; next run later");
            }
            Err(e) => tracing::warn!(error = %e.chain(), "outbox pruner failed; next run later"),
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(retention.interval) => {}
        }
    }
    tracing::debug!("outbox pruner stopped");
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use outbox_persistence::{Error, MockOutboxRepository};

    use super::*;

    fn batch(processed: u64, failed: u64, more: bool) -> PruneReport {
        PruneReport {
            processed,
            failed,
            more,
        }
    }

    /// A repository whose `prune` answers `batches` in order.
    fn repo(batches: Vec<Result<PruneReport, Error>>) -> MockOutboxRepository {
        let batches = Mutex::new(batches.into_iter());
        let mut repo = MockOutboxRepository::new();
        repo.expect_prune()
            .returning(move |_| batches.lock().unwrap().next().expect("no more batches"));
        repo
    }

    #[test]
    fn the_pause_grows_with_the_batch_time() {
        let paced = super::PrunePacing::default();
        assert_eq!(
            paced.after(Duration::from_millis(5)),
            Duration::from_millis(100)
        );
        assert_eq!(
            paced.after(Duration::from_millis(60)),
            Duration::from_millis(240)
        );
        let fixed = super::PrunePacing::from(Duration::from_millis(100));
        assert_eq!(
            fixed.after(Duration::from_secs(2)),
            Duration::from_millis(100)
        );
        assert_eq!(
            super::RetentionConfig::new(PrunePolicy::default()).pacing(),
            paced
        );
    }

    #[tokio::test(start_paused = true)]
    async fn pruned_rows_are_counted_by_status_batch_by_batch() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let _local = metrics::set_default_local_recorder(&recorder);
        let stop = CancellationToken::new();
        let full = repo(vec![Ok(batch(3, 1, true)), Ok(batch(2, 0, false))]);
        let report = prune_until_done(&full, PrunePolicy::default(), Duration::ZERO, &stop)
            .await
            .unwrap();
        assert_eq!((report.processed, report.failed), (5, 1));
        // A run that an error ends still counts the batches it deleted.
        let broken = repo(vec![
            Ok(batch(0, 4, true)),
            Err(Error::Unavailable(sqlx::Error::PoolTimedOut)),
        ]);
        prune_until_done(&broken, PrunePolicy::default(), Duration::ZERO, &stop)
            .await
            .unwrap_err();
        let text = handle.render();
        for line in [
            r#"outbox_pruned_rows_total{status="processed"} 5"#,
            r#"outbox_pruned_rows_total{status="failed"} 5"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
