//! Retention on PostgreSQL: deleting terminal rows older than a [`PrunePolicy`]'s ages, one
//! small batch per statement, and counting them for a dry run.
//!
//! A batch is one statement (its own short transaction): the oldest `n` rows of one terminal
//! status whose `CreatedDate` and `LastModifiedDate` are older than the cutoff, locked with
//! `FOR UPDATE SKIP LOCKED` and deleted. Concurrent pruners (other processes) therefore take
//! disjoint batches and never wait for each other; a row locked by anyone else (an operator's
//! `retry` of a failed row) is skipped now and met by a later batch. The cutoff is the
//! database's `clock_timestamp()` (plus the repository's `ClockShift`), read once per
//! statement. The walk uses `outbox_terminal_idx (Status, CreatedDate)` (migration 0005): the
//! status is a literal in each statement, so the partial index's predicate is proved for the
//! generic plan too.

use std::time::Duration;

use super::{PgOutbox, span};
use crate::{PrunePolicy, PruneReport, Result};

/// One batch of one terminal status: `$1` the clock shift, `$2` the age, `$3` the batch size.
/// It waits for no row lock (they are skipped); its transaction's `lock_timeout` bounds the
/// wait for the table lock (behind an operator's DDL). The batch's ids are collected into an
/// array (an init plan) and deleted through the primary key: a join with a CTE instead let
/// the generic plan hash-join against a scan of the whole table (measured: 63 ms against
/// 13 ms for a batch of 1,000 at 220k rows).
macro_rules! prune_batch {
    ($status:literal) => {
        concat!(
            "WITH clock AS (SELECT clock_timestamp() + $1::interval - $2::interval AS cutoff)
DELETE FROM _System_OutboxEvent t
WHERE t.Id = ANY(ARRAY(
  SELECT Id FROM _System_OutboxEvent
  WHERE Status = '",
            $status,
            "'
    AND CreatedDate < (SELECT cutoff FROM clock)
    AND LastModifiedDate < (SELECT cutoff FROM clock)
  ORDER BY CreatedDate
  LIMIT $3
  FOR UPDATE SKIP LOCKED))
  AND t.Status = '",
            $status,
            "'"
        )
    };
}

/// Counts what the batches would delete now: `$1` the clock shift, `$2` the age.
macro_rules! prune_count {
    ($status:literal) => {
        concat!(
            "WITH clock AS (SELECT clock_timestamp() + $1::interval - $2::interval AS cutoff)
SELECT count(*) FROM _System_OutboxEvent
WHERE Status = '",
            $status,
            "'
  AND CreatedDate < (SELECT cutoff FROM clock)
  AND LastModifiedDate < (SELECT cutoff FROM clock)"
        )
    };
}

const PRUNE_PROCESSED: &str = prune_batch!("processed");
const PRUNE_FAILED: &str = prune_batch!("failed");
const COUNT_PROCESSED: &str = prune_count!("processed");
const COUNT_FAILED: &str = prune_count!("failed");

impl PgOutbox {
    pub(super) async fn prune_batch(&self, policy: PrunePolicy) -> Result<PruneReport> {
        let mut report = PruneReport::default();
        if let Some(age) = policy.processed_older_than {
            report.processed = self.delete_batch(PRUNE_PROCESSED, age, policy).await?;
        }
        if let Some(age) = policy.failed_older_than {
            report.failed = self.delete_batch(PRUNE_FAILED, age, policy).await?;
        }
        let full = policy.batch() as u64;
        report.more = report.processed >= full || report.failed >= full;
        Ok(report)
    }

    async fn delete_batch(&self, sql: &'static str, age: Duration, p: PrunePolicy) -> Result<u64> {
        let mut tx = self.begin_write().await?;
        let deleted = sqlx::query(sql)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(span(age))
            .bind(p.batch())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(deleted)
    }

    pub(super) async fn count_prunable_rows(&self, policy: PrunePolicy) -> Result<PruneReport> {
        let mut report = PruneReport::default();
        if let Some(age) = policy.processed_older_than {
            report.processed = self.count(COUNT_PROCESSED, age).await?;
        }
        if let Some(age) = policy.failed_older_than {
            report.failed = self.count(COUNT_FAILED, age).await?;
        }
        Ok(report)
    }

    async fn count(&self, sql: &'static str, age: Duration) -> Result<u64> {
        let mut tx = self.begin_unbounded_read().await?;
        let n: i64 = sqlx::query_scalar(sql)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(span(age))
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(n as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_statement_names_one_terminal_status_as_a_literal() {
        for (sql, status) in [
            (PRUNE_PROCESSED, "processed"),
            (PRUNE_FAILED, "failed"),
            (COUNT_PROCESSED, "processed"),
            (COUNT_FAILED, "failed"),
        ] {
            assert!(sql.contains(&format!("Status = '{status}'")), "{sql}");
            assert!(
                !sql.contains("pending") && !sql.contains("processing"),
                "{sql}"
            );
        }
        assert!(PRUNE_PROCESSED.contains("FOR UPDATE SKIP LOCKED"));
    }
}
