//! Fenced writes on PostgreSQL: the heartbeat, the attempt's begin (fence check, lock timeout,
//! savepoint in one round trip) and its bookkeeping, and the same bookkeeping detached (on a
//! connection of its own). Every write applies only while the row still carries the fence and
//! moves `LastModifiedDate` strictly forward, on the database's clock.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use sqlx::postgres::types::PgInterval;

use super::{Begin, CLAIM_LOST_SQLSTATE, PgOutbox, begin_sql, interval, span};
use crate::attempt::{
    AttemptWrites, FencedWrite, OpenAttempt, SET_SAVEPOINT, fence_outcome, snoozed_error,
};
use crate::{
    Attempt, BeatOutcome, ClockShift, EventId, Fence, FenceOutcome, Result, Tx, clip_error,
};

/// One claim's beat (`_System_OutboxBeat`, migration 0012): the value written and the writing
/// transaction, or no row when the claim is lost. Parameters: the clock shift, the id, its
/// fence, the lock timeout.
const HEARTBEAT: &str = "SELECT * FROM _System_OutboxBeat($1, $2, $3, $4)";

/// Whether the row is still the version a beat wrote (`$3`: the beat's transaction id, the
/// `xmin` of the version it wrote) under the fence it wrote (`$2`): read back after the beat's
/// `COMMIT` got no answer. Every later write moves `LastModifiedDate` forward; the `xmin`
/// also tells a rewrite of the same values apart (short of an xid reused after wraparound).
/// Rare (a lost `COMMIT` reply), so planned at every call (`persistent(false)`): no cached plan
/// can go stale (docs/queries.md, "Plan stability").
const BEAT_LANDED: &str = "\
SELECT EXISTS (SELECT 1 FROM _System_OutboxEvent
               WHERE Id = $1 AND Status = 'processing' COLLATE \"C\" AND LastModifiedDate = $2
                 AND xmin::text::bigint = $3)";

/// Beats several claims in one statement (`_System_OutboxBeatMany`, migration 0012): one row
/// per fence, its new `LastModifiedDate` and writer when beaten, else whether it is still this
/// worker's as last committed (`busy`: locked by someone else) or lost. Parameters: the clock
/// shift, the ids, their fences in the same order.
const HEARTBEAT_MANY: &str = "SELECT * FROM _System_OutboxBeatMany($1, $2, $3)";

/// `; SELECT _System_OutboxCheckFence(…)` for `fence`, to follow an attempt's `BEGIN` in its
/// one simple-query string (no parameters there): raises [`CLAIM_LOST_SQLSTATE`] unless the row
/// is still `processing` under the fence. The values are a UUID and a timestamp the outbox
/// formats itself, in UTC to the microsecond (PostgreSQL's precision, which the fence was read
/// at); one round trip less per one-event attempt than a statement of its own.
fn check_fence_sql(fence: Fence) -> String {
    format!(
        "; SELECT _System_OutboxCheckFence('{}'::uuid, '{}'::timestamptz)",
        fence.id,
        fence.last_written.format("%Y-%m-%d %H:%M:%S%.6f+00")
    )
}

/// A batch's fence check (`_System_OutboxLostFences`, migration 0012): the ids (`$1`) that may
/// not run now: their row is no longer `processing` under its fence (`$2`, in the same order),
/// or an older row of its record outside the batch is not terminal (an operator retry, or a row
/// other code wrote, since the claim). One probe per record, with `ORDER BY … LIMIT 1` (issue
/// 37, `../shared/repro/batches/f4_lost_fences_cost.sh`).
const LOST_FENCES: &str = "SELECT * FROM _System_OutboxLostFences($1, $2)";

/// One claim's outcome, fenced (`_System_OutboxSettle`, migration 0012): the rows written (0 or
/// 1). Parameters: the clock shift, the id, its fence, the error (`failed`, `retry`,
/// `snooze`, `release`), the extra backoff (`retry`) or the snooze's delay (`snooze`,
/// migration 0025), the lock timeout, the outcome's name.
const SETTLE: &str = "SELECT _System_OutboxSettle($1, $2, $3, $4, $5, $6, $7)";

/// `processed` for several claims (`_System_OutboxSettleMany`, migration 0012): the ids
/// written, each at its place in the claim order (a microsecond apart) on one reading of the
/// clock. With `$5` (a batch holding a record chain) no row of a record is written while an
/// older row of the record outside the batch is not terminal (an operator retry of an older
/// failed row, or a row other code wrote, after the segment's begin check): those rows are
/// left `processing` under their fences, for the worker to give back (rule 3 of "Batched
/// attempts"). Parameters: the clock shift, the ids, their fences, the lock timeout, chains.
const SETTLE_MANY: &str = "SELECT * FROM _System_OutboxSettleMany($1, $2, $3, $4, $5)";

/// A beat that wrote `written` in transaction `writer` and whose `COMMIT` failed with `e`:
/// it may have landed (the reply was lost) or not.
fn unsure(written: Fence, writer: i64, e: &crate::Error) -> BeatOutcome {
    tracing::warn!(event_id = %written.id, writer, error = %e.chain(), "a heartbeat's COMMIT got no answer");
    BeatOutcome::Unsure { written, writer }
}

/// `write`, fenced on `fence`, in `conn` (the attempt's transaction or one of its own): `shift`
/// is the clock shift, `lock_timeout` the bound of its lock waits (text such as `5000ms`),
/// `cached` whether the statement may be prepared under a name.
async fn write_fenced<'c>(
    conn: impl PgExecutor<'c>,
    shift: PgInterval,
    fence: Fence,
    write: FencedWrite<'_>,
    lock_timeout: &str,
    cached: bool,
) -> Result<FenceOutcome> {
    let (outcome, error, extra_delay) = match write {
        FencedWrite::Processed => ("processed", None, None),
        FencedWrite::Failed { error } => ("failed", Some(clip_error(error)), None),
        FencedWrite::Retry { extra_delay, error } => {
            ("retry", Some(clip_error(error)), Some(span(extra_delay)))
        }
        FencedWrite::Snooze { delay, error } => (
            "snooze",
            Some(clip_error(&snoozed_error(delay, error))),
            Some(span(delay)),
        ),
        FencedWrite::Release { error } => ("release", Some(clip_error(error)), None),
    };
    let rows: i32 = sqlx::query_scalar(SETTLE)
        .persistent(cached)
        .bind(shift)
        .bind(fence.id)
        .bind(fence.last_written)
        .bind(error)
        .bind(extra_delay)
        .bind(lock_timeout)
        .bind(outcome)
        .fetch_one(conn)
        .await?;
    Ok(fence_outcome(u64::try_from(rows).unwrap_or(0)))
}

/// The release of several claims uncounted (`_System_OutboxReleaseMany`, migration 0012): the
/// ids released. `LastError` says why, unless it says a stale reclaim counted a dead worker
/// (`WORKER_DIED`): that is kept, so a row given back by its reclaimer never reads as the
/// earlier holder's own landed release (`released_by_us` in outbox-events). Parameters: the
/// clock shift, the ids, their fences, the error, the lock timeout.
const RELEASE_MANY: &str = "SELECT * FROM _System_OutboxReleaseMany($1, $2, $3, $4, $5)";

/// What the PostgreSQL attempt adds to [`OpenAttempt`]: its clock shift and lock timeout.
struct PgAttemptWrites {
    shift: ClockShift,
    /// The attempt's lock timeout, as its bookkeeping statements restate it.
    lock_timeout: String,
    /// Whether statements may be prepared under a name.
    cached: bool,
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
        write_fenced(
            tx.postgres()?,
            shift,
            fence,
            write,
            &self.lock_timeout,
            self.cached,
        )
        .await
    }

    async fn processed_many(&self, tx: &mut Tx, fences: &[Fence]) -> Result<Vec<FenceOutcome>> {
        self.processed_by(false, tx, fences).await
    }

    async fn processed_chains(&self, tx: &mut Tx, fences: &[Fence]) -> Result<Vec<FenceOutcome>> {
        self.processed_by(true, tx, fences).await
    }

    fn lock_waits_sql(&self, bound: Option<Duration>) -> Option<String> {
        let timeout = match bound {
            Some(bound) => format!("{}ms", super::session::millis(bound).max(1)),
            None => self.lock_timeout.clone(),
        };
        Some(format!("SET LOCAL lock_timeout = '{timeout}'"))
    }
}

impl PgAttemptWrites {
    /// `processed` for several claims, with the chains' rule when `chains` (the ids it returns
    /// are written).
    async fn processed_by(
        &self,
        chains: bool,
        tx: &mut Tx,
        fences: &[Fence],
    ) -> Result<Vec<FenceOutcome>> {
        let ids: Vec<EventId> = fences.iter().map(|f| f.id).collect();
        let written: Vec<DateTime<Utc>> = fences.iter().map(|f| f.last_written).collect();
        let done: Vec<EventId> = sqlx::query_scalar(SETTLE_MANY)
            .persistent(self.cached)
            .bind(interval(self.shift.micros()))
            .bind(&ids)
            .bind(&written)
            .bind(&self.lock_timeout)
            .bind(chains)
            .fetch_all(tx.postgres()?)
            .await?;
        Ok(ids
            .iter()
            .map(|id| {
                if done.contains(id) {
                    FenceOutcome::Written
                } else {
                    FenceOutcome::Lost
                }
            })
            .collect())
    }
}

impl PgOutbox {
    /// The detached bookkeeping: `write` in a transaction of its own, bounded by the
    /// repository's lock timeout.
    /// Releases several claims uncounted in one statement, on a transaction of its own.
    pub(super) async fn release_many(
        &self,
        fences: &[Fence],
        error: &str,
    ) -> Result<Vec<FenceOutcome>> {
        let ids: Vec<EventId> = fences.iter().map(|f| f.id).collect();
        let written: Vec<DateTime<Utc>> = fences.iter().map(|f| f.last_written).collect();
        let mut tx = self.begin_write().await?;
        let done: Vec<EventId> = sqlx::query_scalar(RELEASE_MANY)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(&ids)
            .bind(&written)
            .bind(clip_error(error))
            .bind(self.lock_timeout())
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(ids
            .iter()
            .map(|id| fence_outcome(u64::from(done.contains(id))))
            .collect())
    }

    pub(super) async fn write_detached(
        &self,
        fence: Fence,
        write: FencedWrite<'_>,
    ) -> Result<FenceOutcome> {
        let mut tx = self.begin_write().await?;
        let outcome = write_fenced(
            &mut *tx,
            self.shift(),
            fence,
            write,
            &self.lock_timeout(),
            self.cached(),
        )
        .await?;
        tx.commit().await?;
        Ok(outcome)
    }

    /// One claim's beat. Its `UPDATE` answers before the `COMMIT` is sent, so when the
    /// `COMMIT` gets no answer the beat knows what it wrote and in which transaction
    /// ([`BeatOutcome::Unsure`]); any earlier error leaves the transaction uncommitted.
    pub(super) async fn beat(&self, fence: Fence) -> Result<BeatOutcome> {
        let mut tx = self.begin_write().await?;
        let written: Option<(DateTime<Utc>, i64)> = sqlx::query_as(HEARTBEAT)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(fence.id)
            .bind(fence.last_written)
            .bind(self.lock_timeout())
            .fetch_optional(&mut *tx)
            .await?;
        let outcome = match written {
            Some((last_written, writer)) => (
                Fence {
                    id: fence.id,
                    last_written,
                },
                writer,
            ),
            None => {
                tx.commit().await?;
                return Ok(BeatOutcome::Lost);
            }
        };
        Ok(match tx.commit().await {
            Ok(()) => BeatOutcome::Beaten(outcome.0),
            Err(e) => unsure(outcome.0, outcome.1, &e.into()),
        })
    }

    /// See [`BEAT_LANDED`].
    pub(super) async fn read_back_beat(&self, written: Fence, writer: i64) -> Result<bool> {
        let mut tx = self.begin_read().await?;
        let landed: bool = sqlx::query_scalar(BEAT_LANDED)
            .persistent(false)
            .bind(written.id)
            .bind(written.last_written)
            .bind(writer)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(landed)
    }

    pub(super) async fn beat_many(&self, fences: Vec<Fence>) -> Result<Vec<BeatOutcome>> {
        let ids: Vec<EventId> = fences.iter().map(|f| f.id).collect();
        let written: Vec<DateTime<Utc>> = fences.iter().map(|f| f.last_written).collect();
        let mut tx = self.begin_write().await?;
        type Row = (EventId, Option<DateTime<Utc>>, Option<i64>, bool);
        let rows: Vec<Row> = sqlx::query_as(HEARTBEAT_MANY)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(&ids)
            .bind(&written)
            .fetch_all(&mut *tx)
            .await?;
        // The statement answered before the `COMMIT` is sent: if the `COMMIT` gets no answer,
        // each beaten claim knows what it wrote, and in which transaction.
        let committed = tx.commit().await.map_err(crate::Error::from);
        if let Err(e) = &committed
            && rows.iter().all(|(_, beaten, _, _)| beaten.is_none())
        {
            tracing::warn!(error = %e.chain(), "a heartbeat that wrote nothing failed at its COMMIT");
        }
        Ok(fences
            .iter()
            .map(
                |fence| match rows.iter().find(|(id, _, _, _)| *id == fence.id) {
                    Some((_, Some(last_written), Some(writer), _)) => {
                        let next = Fence {
                            id: fence.id,
                            last_written: *last_written,
                        };
                        match &committed {
                            Ok(()) => BeatOutcome::Beaten(next),
                            Err(e) => unsure(next, *writer, e),
                        }
                    }
                    Some((_, None, _, true)) => BeatOutcome::Busy,
                    _ => BeatOutcome::Lost,
                },
            )
            .collect())
    }

    /// Begins an attempt transaction as the attempt needs it whatever the session's defaults
    /// (READ COMMITTED, the attempt's lock timeout, the outbox's statement timeout, no
    /// idle-in-transaction timeout: a handler may run longer than the server's while the
    /// heartbeat keeps its claim), sets the post-claim savepoint and, given a `fence`, checks
    /// it ([`check_fence_sql`]), in one round trip. The fence check cannot precede BEGIN in
    /// this string: it would start the transaction at the session's default level, which
    /// BEGIN can no longer change. A string that fails after its BEGIN leaves a `ROLLBACK`
    /// queued on the connection (sqlx 0.9.1's begin guard), so the pool gets it back idle.
    async fn begin_attempt_tx(
        &self,
        lock_timeout: Duration,
        fence: Option<Fence>,
    ) -> std::result::Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        let begin = begin_sql(Begin {
            may_idle: true,
            lock_timeout,
            ..self.begin_spec(false)
        });
        let check = fence.map(check_fence_sql).unwrap_or_default();
        self.pool
            .begin_with(sqlx::AssertSqlSafe(format!(
                "{begin}; {SET_SAVEPOINT}{check}"
            )))
            .await
    }

    fn attempt_writes(&self, lock_timeout: Duration) -> PgAttemptWrites {
        PgAttemptWrites {
            shift: self.shift.clone(),
            lock_timeout: format!("{}ms", super::session::millis(lock_timeout)),
            cached: self.cached(),
        }
    }

    pub(super) async fn open_attempt(
        &self,
        lock_timeout: Duration,
        fence: Fence,
    ) -> Result<Option<Box<dyn Attempt>>> {
        // `_System_OutboxCheckFence`, in the begin's string, raises CLAIM_LOST_SQLSTATE when
        // the claim was taken over meanwhile, so no handler runs for a lost claim; the
        // transaction is rolled back on the connection's next use.
        match self.begin_attempt_tx(lock_timeout, Some(fence)).await {
            Ok(tx) => {
                let writes = self.attempt_writes(lock_timeout);
                Ok(Some(Box::new(OpenAttempt::new(Tx::Postgres(tx), writes))))
            }
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(CLAIM_LOST_SQLSTATE) => {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A batch's attempt: the transaction as for one event, then every fence checked in one
    /// statement, which returns the rows whose claim is lost.
    pub(super) async fn open_batch_attempt(
        &self,
        lock_timeout: Duration,
        fences: Vec<Fence>,
    ) -> Result<(Box<dyn Attempt>, Vec<EventId>)> {
        let mut tx = self.begin_attempt_tx(lock_timeout, None).await?;
        let ids: Vec<EventId> = fences.iter().map(|f| f.id).collect();
        let written: Vec<DateTime<Utc>> = fences.iter().map(|f| f.last_written).collect();
        let lost: Vec<EventId> = sqlx::query_scalar(LOST_FENCES)
            .persistent(self.cached())
            .bind(ids)
            .bind(written)
            .fetch_all(&mut *tx)
            .await?;
        let writes = self.attempt_writes(lock_timeout);
        Ok((Box::new(OpenAttempt::new(Tx::Postgres(tx), writes)), lost))
    }
}
