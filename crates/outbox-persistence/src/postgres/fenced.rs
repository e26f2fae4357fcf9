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
use super::{Begin, CLAIM_LOST_SQLSTATE, PgOutbox, begin_sql, interval, span};
use crate::attempt::{AttemptWrites, FencedWrite, OpenAttempt, SET_SAVEPOINT, fence_outcome};
use crate::{
    Attempt, BeatOutcome, ClockShift, EventId, Fence, FenceOutcome, Result, Tx, clip_error,
};

const HEARTBEAT: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET LastModifiedDate = GREATEST(",
    db_now!(),
    ", LastModifiedDate + interval '1 microsecond')
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("4"),
    "
RETURNING LastModifiedDate, xmin::text::bigint"
);

/// Whether the row is still the version a beat wrote (`$3`: the beat's transaction id, the
/// `xmin` of the version it wrote) under the fence it wrote (`$2`): read back after the beat's
/// `COMMIT` got no answer. Every later write moves `LastModifiedDate` forward; the `xmin`
/// also tells a rewrite of the same values apart (short of an xid reused after wraparound).
const BEAT_LANDED: &str = "\
SELECT EXISTS (SELECT 1 FROM _System_OutboxEvent
               WHERE Id = $1 AND Status = 'processing' AND LastModifiedDate = $2
                 AND xmin::text::bigint = $3)";

/// Beats several claims in one statement: the rows (`$2`) still `processing` under their fence
/// (`$3`, in the same order) that no other transaction holds locked move `LastModifiedDate`
/// forward. One row per fence: its new `LastModifiedDate` when beaten, else whether it is still
/// this worker's as last committed (`busy`: locked by someone else, not beaten this time) or
/// lost. The outer `EXISTS` reads the statement's snapshot, from before the update.
const HEARTBEAT_MANY: &str = concat!(
    "\
WITH f AS (SELECT * FROM unnest($2::uuid[], $3::timestamptz[]) AS f(id, written)),
mine AS (
  SELECT e.Id FROM _System_OutboxEvent e JOIN f ON e.Id = f.id
  WHERE e.Status = 'processing' AND e.LastModifiedDate = f.written
  ORDER BY e.Id
  FOR UPDATE OF e SKIP LOCKED
),
beaten AS (
  UPDATE _System_OutboxEvent e
  SET LastModifiedDate = GREATEST(",
    db_now!(),
    ", e.LastModifiedDate + interval '1 microsecond')
  FROM mine WHERE e.Id = mine.Id
  RETURNING e.Id, e.LastModifiedDate, e.xmin::text::bigint AS writer
)
SELECT f.id, b.LastModifiedDate AS beaten, b.writer,
  EXISTS (SELECT 1 FROM _System_OutboxEvent e
          WHERE e.Id = f.id AND e.Status = 'processing' AND e.LastModifiedDate = f.written) AS mine
FROM f LEFT JOIN beaten b ON b.Id = f.id"
);

/// Raises [`CLAIM_LOST_SQLSTATE`] unless the row is still `processing` under the fence.
const CHECK_FENCE: &str = "SELECT _System_OutboxCheckFence($1, $2)";

/// A batch's fence check: the ids (`$1`) that may not run now: their row is no longer
/// `processing` under its fence (`$2`, in the same order), or an older row of its record outside
/// the batch is not terminal (an operator retry, or a row other code wrote, since the claim).
/// One probe per record, not per member (issue 37, `../shared/repro/batches/f4_lost_fences_cost.sh`):
/// the record's oldest open row outside the batch and older than its newest member, read with
/// `ORDER BY … LIMIT 1` from the record's first index entry; a member waits when that row is
/// older than it. Probing per member without a limit read the record's older entries (dead
/// ones too, until vacuum) once for every member of a chain. `outside` is `MATERIALIZED`:
/// inlined into the last `NOT EXISTS`, its probes ran once per member and record (32 x 32).
const LOST_FENCES: &str = "\
WITH held AS (
  SELECT e.Id, f.written, e.RecordKey, e.CreatedDate
  FROM unnest($1::uuid[], $2::timestamptz[]) AS f(id, written)
  JOIN _System_OutboxEvent e ON e.Id = f.id
  WHERE e.Status = 'processing' AND e.LastModifiedDate = f.written
),
newest AS (
  SELECT DISTINCT ON (h.RecordKey) h.RecordKey AS k, h.CreatedDate AS c, h.Id AS i
  FROM held h
  WHERE h.RecordKey IS NOT NULL
  ORDER BY h.RecordKey, h.CreatedDate DESC, h.Id DESC
),
outside AS MATERIALIZED (
  SELECT n.k, o.CreatedDate AS c, o.Id AS i
  FROM newest n
  CROSS JOIN LATERAL (
    SELECT older.CreatedDate, older.Id FROM _System_OutboxEvent older
    WHERE older.RecordKey = n.k
      AND (older.CreatedDate, older.Id) < (n.c, n.i)
      AND older.Status NOT IN ('processed', 'failed')
      AND older.Id <> ALL($1)
    ORDER BY older.CreatedDate, older.Id
    LIMIT 1
  ) o
)
SELECT f.id FROM unnest($1::uuid[], $2::timestamptz[]) AS f(id, written)
WHERE NOT EXISTS (
  SELECT 1 FROM held h
  WHERE h.Id = f.id AND h.written = f.written
    AND NOT EXISTS (
      SELECT 1 FROM outside o
      WHERE o.k = h.RecordKey AND (o.c, o.i) < (h.CreatedDate, h.Id)))";

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

/// The `processed` write of several claims (`$2`, fenced on `$3` in the same order), after a
/// `clock` CTE: the clock is read once, and each row's `processed` time follows its place in
/// the claim order (a microsecond apart), so a record's rows written together keep their order
/// in time whatever order the server updates them in.
macro_rules! processed_in_claim_order {
    () => {
        "
UPDATE _System_OutboxEvent e
SET Status = 'processed',
    LastModifiedDate = GREATEST((SELECT now FROM clock) + f.ord * interval '1 microsecond',
                                e.LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
FROM unnest($2::uuid[], $3::timestamptz[]) WITH ORDINALITY AS f(id, written, ord)
WHERE e.Id = f.id AND e.Status = 'processing' AND e.LastModifiedDate = f.written"
    };
}

/// `processed` for several claims: the ids written. The heads trigger runs per row after the
/// statement, so a record chain's rows move its head once each, to the record's oldest row
/// still open.
const MARK_PROCESSED_MANY: &str = concat!(
    "WITH clock AS (SELECT ",
    db_now!(),
    " AS now)",
    processed_in_claim_order!(),
    lock_guard!("4"),
    "
RETURNING e.Id"
);

/// [`MARK_PROCESSED_MANY`] for a batch holding a chain: no row of a record is written while an
/// older row of the record outside the batch is not terminal (an operator retry of an older
/// failed row, or a row other code wrote, that appeared after the segment's begin check):
/// those rows are left `processing` under their fences, for the worker to give back (rule 3 of
/// "Batched attempts"). One probe per record, from its oldest row in the batch.
const MARK_PROCESSED_CHAINS: &str = concat!(
    "WITH clock AS (SELECT ",
    db_now!(),
    " AS now),
firsts AS (
  SELECT DISTINCT ON (x.RecordKey) x.RecordKey AS k, x.CreatedDate AS c, x.Id AS i
  FROM _System_OutboxEvent x
  WHERE x.Id = ANY($2) AND x.RecordKey IS NOT NULL
  ORDER BY x.RecordKey, x.CreatedDate, x.Id
),
waits AS (
  SELECT fi.k FROM firsts fi
  WHERE EXISTS (
    SELECT 1 FROM _System_OutboxEvent older
    WHERE older.RecordKey = fi.k
      AND (older.CreatedDate, older.Id) < (fi.c, fi.i)
      AND older.Status NOT IN ('processed', 'failed')
      AND older.Id <> ALL($2))
)",
    processed_in_claim_order!(),
    "
  AND (e.RecordKey IS NULL OR e.RecordKey NOT IN (SELECT k FROM waits))",
    lock_guard!("4"),
    "
RETURNING e.Id"
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
    let query = |sql| {
        sqlx::query(sql)
            .persistent(cached)
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
        FencedWrite::Release { error } => query(RELEASE).bind(clip_error(error)).bind(lock_timeout),
    };
    let rows = query.execute(conn).await?.rows_affected();
    Ok(fence_outcome(rows))
}

/// Back to `pending` with `RetryCount` unchanged: the attempt is not counted (its handler
/// succeeded, and the outbox's own write of the outcome failed). `LastError` says why, unless
/// it says a stale reclaim counted a dead worker (`WORKER_DIED`): that is kept, so a row given
/// back by its reclaimer never reads as the earlier holder's own landed release
/// (`released_by_us` in outbox-events).
const RELEASE: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET Status = 'pending',
    LastModifiedDate = GREATEST(",
    db_now!(),
    ", LastModifiedDate + interval '1 microsecond'),
    LastError = CASE WHEN LastError LIKE 'worker died:%' THEN LastError ELSE $4 END
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("5")
);

/// [`RELEASE`] of several claims (`$2`, fenced on `$3` in the same order): the ids released.
const RELEASE_MANY: &str = concat!(
    "\
UPDATE _System_OutboxEvent e
SET Status = 'pending',
    LastModifiedDate = GREATEST(",
    db_now!(),
    ", e.LastModifiedDate + interval '1 microsecond'),
    LastError = CASE WHEN e.LastError LIKE 'worker died:%' THEN e.LastError ELSE $4 END
FROM unnest($2::uuid[], $3::timestamptz[]) AS f(id, written)
WHERE e.Id = f.id AND e.Status = 'processing' AND e.LastModifiedDate = f.written",
    lock_guard!("5"),
    "
RETURNING e.Id"
);

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
        self.processed_by(MARK_PROCESSED_MANY, tx, fences).await
    }

    async fn processed_chains(&self, tx: &mut Tx, fences: &[Fence]) -> Result<Vec<FenceOutcome>> {
        self.processed_by(MARK_PROCESSED_CHAINS, tx, fences).await
    }
}

impl PgAttemptWrites {
    /// `processed` for several claims with `statement` (the ids it returns are written).
    async fn processed_by(
        &self,
        statement: &'static str,
        tx: &mut Tx,
        fences: &[Fence],
    ) -> Result<Vec<FenceOutcome>> {
        let ids: Vec<EventId> = fences.iter().map(|f| f.id).collect();
        let written: Vec<DateTime<Utc>> = fences.iter().map(|f| f.last_written).collect();
        let done: Vec<EventId> = sqlx::query_scalar(statement)
            .persistent(self.cached)
            .bind(interval(self.shift.micros()))
            .bind(&ids)
            .bind(&written)
            .bind(&self.lock_timeout)
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
            .persistent(self.cached())
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
    /// heartbeat keeps its claim) and sets the post-claim savepoint, in one round trip. The
    /// fence check that follows cannot precede BEGIN in this string: it would start the
    /// transaction at the session's default level, which BEGIN can no longer change.
    async fn begin_attempt_tx(
        &self,
        lock_timeout: Duration,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        let begin = begin_sql(Begin {
            may_idle: true,
            lock_timeout,
            ..self.begin_spec(false)
        });
        Ok(self
            .pool
            .begin_with(sqlx::AssertSqlSafe(format!("{begin}; {SET_SAVEPOINT}")))
            .await?)
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
        // `_System_OutboxCheckFence` raises CLAIM_LOST_SQLSTATE when the claim was taken over
        // meanwhile, so no handler runs for a lost claim.
        let mut tx = self.begin_attempt_tx(lock_timeout).await?;
        let checked = sqlx::query(CHECK_FENCE)
            .persistent(self.cached())
            .bind(fence.id)
            .bind(fence.last_written)
            .execute(&mut *tx)
            .await;
        match checked {
            Ok(_) => {
                let writes = self.attempt_writes(lock_timeout);
                Ok(Some(Box::new(OpenAttempt::new(Tx::Postgres(tx), writes))))
            }
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(CLAIM_LOST_SQLSTATE) => {
                tx.rollback().await?;
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
        let mut tx = self.begin_attempt_tx(lock_timeout).await?;
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
