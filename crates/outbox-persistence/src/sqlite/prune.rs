//! Retention on SQLite: deleting terminal rows older than a [`PrunePolicy`]'s ages, one short
//! write transaction per batch, and counting them for a dry run.
//!
//! SQLite has one writer, so concurrent pruners (and workers) simply take turns on the write
//! lock; each batch holds it for one `DELETE` of at most `batch_size` rows. The cutoff comes
//! from the host's clock (plus the repository's `ClockShift`), like every SQLite timestamp,
//! compared as fixed-width text. The walk uses the status-led `outbox_eligible_idx (Status,
//! CreatedDate, Id)` of migration 0001, so no index was added for it.

use std::time::Duration;

use super::SqliteOutbox;
use super::time::format_ts;
use crate::attempt::chrono_span;
use crate::{PrunePolicy, PruneReport, Result};

/// One batch of one terminal status: `?1` the status, `?2` the cutoff, `?3` the batch size.
/// The outer re-check is written `+Status` so that SQLite deletes through the primary key:
/// with a plain `Status = ?1` it walked every row of the status in `outbox_eligible_idx` and
/// tested each against the batch.
const PRUNE_BATCH: &str = "DELETE FROM _System_OutboxEvent WHERE Id IN (
  SELECT Id FROM _System_OutboxEvent
  WHERE Status = ?1 AND CreatedDate < ?2 AND LastModifiedDate < ?2
  ORDER BY CreatedDate
  LIMIT ?3)
  AND +Status = ?1";

/// What the batches would delete now: `?1` the status, `?2` the cutoff.
const PRUNE_COUNT: &str = "SELECT count(*) FROM _System_OutboxEvent
  WHERE Status = ?1 AND CreatedDate < ?2 AND LastModifiedDate < ?2";

impl SqliteOutbox {
    /// The cutoff for `age` as stored text, or `None` when the age reaches before any time
    /// the clock can show (nothing is that old).
    fn prune_cutoff(&self, age: Duration) -> Option<String> {
        self.now()
            .checked_sub_signed(chrono_span(age))
            .map(format_ts)
    }

    pub(super) async fn prune_batch(&self, policy: PrunePolicy) -> Result<PruneReport> {
        let mut report = PruneReport::default();
        if let Some(age) = policy.processed_older_than {
            report.processed = self.delete_batch("processed", age, policy).await?;
        }
        if let Some(age) = policy.failed_older_than {
            report.failed = self.delete_batch("failed", age, policy).await?;
        }
        let full = policy.batch() as u64;
        report.more = report.processed >= full || report.failed >= full;
        Ok(report)
    }

    async fn delete_batch(&self, status: &str, age: Duration, p: PrunePolicy) -> Result<u64> {
        let (mut tx, _) = self.begin_write().await?;
        let Some(cutoff) = self.prune_cutoff(age) else {
            tx.rollback().await?;
            return Ok(0);
        };
        let deleted = sqlx::query(PRUNE_BATCH)
            .bind(status)
            .bind(cutoff)
            .bind(p.batch())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(deleted)
    }

    pub(super) async fn count_prunable_rows(&self, policy: PrunePolicy) -> Result<PruneReport> {
        let mut report = PruneReport::default();
        for (status, age, count) in [
            (
                "processed",
                policy.processed_older_than,
                &mut report.processed,
            ),
            ("failed", policy.failed_older_than, &mut report.failed),
        ] {
            let Some(cutoff) = age.and_then(|age| self.prune_cutoff(age)) else {
                continue;
            };
            let n: i64 = sqlx::query_scalar(PRUNE_COUNT)
                .bind(status)
                .bind(cutoff)
                .fetch_one(&self.pool)
                .await?;
            *count = n as u64;
        }
        Ok(report)
    }
}
