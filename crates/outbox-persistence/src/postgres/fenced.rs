//! Fenced writes on PostgreSQL: the heartbeat, the attempt's begin (fence check, lock timeout,
//! savepoint in one round trip) and its bookkeeping, and the same bookkeeping detached (on a
//! connection of its own). Every write applies only while the row still carries the fence and
//! moves `LastModifiedDate` strictly forward, on the database's clock.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use sqlx::postgres::types::PgInterval;

use super::sql::{db_now, lock_guard};
use super::{CLAIM_LOST_SQLSTATE, PgOutbox, interval, span};
use crate::attempt::{AttemptWrites, FencedWrite, OpenAttempt, SET_SAVEPOINT, fence_outcome};
use crate::{Attempt, ClockShift, Fence, FenceOutcome, Result, Tx, clip_error};

const HEARTBEAT: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET LastModifiedDate = GREATEST(",
    db_now!(),
    ", LastModifiedDate + interval '1 microsecond')
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("4"),
    "
RETURNING LastModifiedDate"
);

const MARK_PROCESSED: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET Status = 'processed',
    LastModifiedDate = GREATEST(",
    db_now!(),
    ", LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("4")
);

const MARK_FAILED: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET Status = 'failed',
    RetryCount = RetryCount + 1,
    LastModifiedDate = GREATEST(",
    db_now!(),
    ", LastModifiedDate + interval '1 microsecond'),
    LastError = $4
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("5")
);

/// Back to `pending`: `LastModifiedDate` is the database's time plus the extra backoff (`$5`).
const INCREMENT_RETRY: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET Status = 'pending',
    RetryCount = RetryCount + 1,
    LastModifiedDate = GREATEST(",
    db_now!(),
    " + $5::interval, LastModifiedDate + interval '1 microsecond'),
    LastError = $4
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("6")
);

/// `write`, fenced on `fence`, on `conn` (the attempt's transaction or the pool): `shift` is the
/// clock shift, `lock_timeout` the bound of its lock waits (text such as `5000ms`).
async fn write_fenced<'c>(
    conn: impl PgExecutor<'c>,
    shift: PgInterval,
    fence: Fence,
    write: FencedWrite<'_>,
    lock_timeout: &str,
) -> Result<FenceOutcome> {
    let query = |sql| {
        sqlx::query(sql)
            .bind(shift)
            .bind(fence.id)
            .bind(fence.last_written)
    };
    let query = match write {
        FencedWrite::Processed => query(MARK_PROCESSED).bind(lock_timeout),
        FencedWrite::Failed { error } => query(MARK_FAILED)
            .bind(clip_error(error))
            .bind(lock_timeout),
        FencedWrite::Retry { extra_delay, error } => query(INCREMENT_RETRY)
            .bind(clip_error(error))
            .bind(span(extra_delay))
            .bind(lock_timeout),
    };
    let rows = query.execute(conn).await?.rows_affected();
    Ok(fence_outcome(rows))
}

/// What the PostgreSQL attempt adds to [`OpenAttempt`]: its clock shift and lock timeout.
struct PgAttemptWrites {
    shift: ClockShift,
    /// The attempt's lock timeout, as its bookkeeping statements restate it.
    lock_timeout: String,
}

#[async_trait]
impl AttemptWrites for PgAttemptWrites {
    async fn write(
        &self,
        tx: &mut Tx,
        fence: Fence,
        write: FencedWrite<'_>,
    ) -> Result<FenceOutcome> {
        let shift = interval(self.shift.micros());
        write_fenced(tx.postgres()?, shift, fence, write, &self.lock_timeout).await
    }
}

impl PgOutbox {
    /// The detached bookkeeping: `write` on a connection of its own, bounded by the
    /// repository's lock timeout.
    pub(super) async fn write_detached(
        &self,
        fence: Fence,
        write: FencedWrite<'_>,
    ) -> Result<FenceOutcome> {
        write_fenced(&self.pool, self.shift(), fence, write, &self.lock_timeout()).await
    }

    pub(super) async fn beat(&self, fence: Fence) -> Result<Option<Fence>> {
        let written: Option<DateTime<Utc>> = sqlx::query_scalar(HEARTBEAT)
            .bind(self.shift())
            .bind(fence.id)
            .bind(fence.last_written)
            .bind(self.lock_timeout())
            .fetch_optional(&self.pool)
            .await?;
        Ok(written.map(|last_written| Fence {
            id: fence.id,
            last_written,
        }))
    }

    pub(super) async fn open_attempt(
        &self,
        lock_timeout: Duration,
        fence: Fence,
    ) -> Result<Option<Box<dyn Attempt>>> {
        // One round trip: the fence check (raises CLAIM_LOST_SQLSTATE when the claim was
        // taken over meanwhile), BEGIN, the attempt's lock timeout and the post-claim savepoint.
        // The check comes first: when it raises, the statements after it never run and the
        // connection is left idle, not inside a failed transaction (a read that precedes BEGIN
        // in one query string joins the transaction BEGIN opens). The values are a UUID and a
        // timestamp this code formats itself.
        let ms = lock_timeout.as_millis().max(1);
        let begin = format!(
            "SELECT _System_OutboxCheckFence('{}'::uuid, '{}'::timestamptz); \
             BEGIN; SET LOCAL lock_timeout = '{ms}ms'; {SET_SAVEPOINT}",
            fence.id,
            fence
                .last_written
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        );
        match self.pool.begin_with(sqlx::AssertSqlSafe(begin)).await {
            Ok(tx) => {
                let writes = PgAttemptWrites {
                    shift: self.shift.clone(),
                    lock_timeout: format!("{ms}ms"),
                };
                Ok(Some(Box::new(OpenAttempt::new(Tx::Postgres(tx), writes))))
            }
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(CLAIM_LOST_SQLSTATE) => {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }
}
