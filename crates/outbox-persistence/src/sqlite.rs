//! The SQLite repository: the embedded default.
//!
//! SQLite has one writer at a time. Claims and attempts take the write lock up front
//! (`BEGIN IMMEDIATE`), so a read-then-write transaction never fails on a stale snapshot; waits
//! are bounded by the busy timeout, which surfaces as [`Error::LockTimeout`]. Timestamps are
//! fixed-width UTC text, so the design's comparisons work on them as written.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, SecondsFormat, Utc};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection, SqlitePool};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::{
    Attempt, BackfillPage, Claim, Cutoffs, Error, EventId, EventStatus, FailureBookkeeping, Fence,
    FenceOutcome, NewEvent, OutboxEvent, OutboxRepository, OutboxStats, Result, RetryFilter, Scope,
    Terminal, Tx, clip_error, new_event_id, truncate_micros,
};

/// The design's eligible-event query, as written in the design (SQLite placeholders).
pub const ELIGIBLE_QUERY: &str = "\
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent e
WHERE
  (e.Status = 'pending'
   OR (e.Status = 'processing' AND e.LastModifiedDate < ?1))
  AND (e.Status <> 'pending'
       OR e.RetryCount = 0
       OR e.LastModifiedDate < ?2)
  AND (
    e.RecordKey IS NULL
    OR NOT EXISTS (
      SELECT 1
      FROM _System_OutboxEvent older
      WHERE older.RecordKey = e.RecordKey
        AND (
          older.CreatedDate < e.CreatedDate
          OR (older.CreatedDate = e.CreatedDate AND older.Id < e.Id)
        )
        AND older.Status NOT IN ('processed', 'failed')
    )
  )
ORDER BY e.CreatedDate ASC, e.Id ASC
LIMIT ?3";

const SELECT_BY_ID: &str = "\
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent WHERE Id = ?1";

const FENCED_PROCESSED: &str = "\
UPDATE _System_OutboxEvent SET Status = 'processed', LastModifiedDate = ?2, LastError = ?4
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3";

const FENCED_FAILED: &str = "\
UPDATE _System_OutboxEvent
SET Status = 'failed', RetryCount = RetryCount + 1, LastModifiedDate = ?2, LastError = ?4
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3";

const FENCED_RETRY: &str = "\
UPDATE _System_OutboxEvent
SET Status = 'pending', RetryCount = RetryCount + 1, LastModifiedDate = ?2, LastError = ?4
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3";

/// The eligible query narrowed to a [`Scope`] (`?4`: only these types, `?5`: all but these, as
/// JSON arrays or NULL).
fn scoped(query: &str) -> String {
    query.replace(
        "ORDER BY e.CreatedDate ASC",
        "  AND (?4 IS NULL OR e.EventType IN (SELECT value FROM json_each(?4)))
  AND (?5 IS NULL OR e.EventType NOT IN (SELECT value FROM json_each(?5)))
ORDER BY e.CreatedDate ASC",
    )
}

fn json_list(types: Option<&[String]>) -> Option<String> {
    types.map(|t| serde_json::to_string(t).expect("a list of strings serializes"))
}

/// Formats a time as stored: `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
pub fn format_ts(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

fn parse_ts(s: &str) -> Result<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            Error::Database(sqlx::Error::Decode(
                format!("bad timestamp {s:?}: {e}").into(),
            ))
        })
}

fn parse_id(s: &str) -> Result<EventId> {
    Uuid::parse_str(s)
        .map_err(|e| Error::Database(sqlx::Error::Decode(format!("bad id {s:?}: {e}").into())))
}

/// The value a fenced write stores: strictly after the value it replaces.
fn next_written(now: DateTime<Utc>, previous: DateTime<Utc>) -> DateTime<Utc> {
    truncate_micros(now).max(previous + chrono::Duration::microseconds(1))
}

fn event_from_row(row: &SqliteRow) -> Result<OutboxEvent> {
    let status: String = row.try_get(3)?;
    Ok(OutboxEvent {
        id: parse_id(&row.try_get::<String, _>(0)?)?,
        event_type: row.try_get(1)?,
        payload: row.try_get(2)?,
        status: status
            .parse()
            .map_err(|e: String| Error::Database(sqlx::Error::Decode(e.into())))?,
        retry_count: row.try_get(4)?,
        record_key: row.try_get(5)?,
        created_date: parse_ts(&row.try_get::<String, _>(6)?)?,
        last_modified_date: parse_ts(&row.try_get::<String, _>(7)?)?,
        last_error: row.try_get(8)?,
    })
}

fn outcome(rows: u64) -> FenceOutcome {
    if rows == 1 {
        FenceOutcome::Written
    } else {
        FenceOutcome::Lost
    }
}

fn delay(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

/// Inserts `events` in order on `conn` (the caller's transaction), deriving each `RecordKey`.
pub async fn enqueue(
    conn: &mut SqliteConnection,
    events: &[NewEvent],
    now: DateTime<Utc>,
) -> Result<Vec<EventId>> {
    let now = format_ts(truncate_micros(now));
    let mut rows = Vec::with_capacity(events.len());
    for event in events {
        let key =
            record_key::record_key_from_payload(&event.payload).map_err(Error::InvalidPayload)?;
        rows.push((new_event_id(), key.map(record_key::RecordKey::into_string)));
    }
    for (event, (id, key)) in events.iter().zip(&rows) {
        sqlx::query(
            "INSERT INTO _System_OutboxEvent
               (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
             VALUES (?1, ?2, ?3, 'pending', 0, ?4, ?5, ?5)",
        )
        .bind(id.to_string())
        .bind(&event.event_type)
        .bind(&event.payload)
        .bind(key)
        .bind(&now)
        .execute(&mut *conn)
        .await?;
    }
    Ok(rows.into_iter().map(|(id, _)| id).collect())
}

/// Claims `event` (already read inside the write transaction on `conn`) when its state allows.
async fn claim_on(
    conn: &mut SqliteConnection,
    event: OutboxEvent,
    cutoffs: Cutoffs,
) -> Result<Option<Claim>> {
    let claimable = (event.status == EventStatus::Pending
        && (event.retry_count == 0 || event.last_modified_date < cutoffs.retry_cutoff))
        || (event.status == EventStatus::Processing
            && event.last_modified_date < cutoffs.stale_cutoff);
    if !claimable {
        return Ok(None);
    }
    let written = next_written(cutoffs.now, event.last_modified_date);
    let rows = sqlx::query(
        "UPDATE _System_OutboxEvent SET Status = 'processing', LastModifiedDate = ?2
         WHERE Id = ?1 AND Status = ?3 AND LastModifiedDate = ?4",
    )
    .bind(event.id.to_string())
    .bind(format_ts(written))
    .bind(event.status.as_str())
    .bind(format_ts(event.last_modified_date))
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if rows != 1 {
        return Ok(None);
    }
    let reclaimed = event.status == EventStatus::Processing;
    Ok(Some(Claim {
        fence: Fence {
            id: event.id,
            last_written: written,
        },
        reclaimed,
        event: OutboxEvent {
            status: EventStatus::Processing,
            last_modified_date: written,
            ..event
        },
    }))
}

/// The SQLite outbox repository.
#[derive(Debug, Clone)]
pub struct SqliteOutbox {
    pool: SqlitePool,
    enqueued: Arc<Notify>,
}

impl SqliteOutbox {
    /// A repository over `pool`.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            enqueued: Arc::default(),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn fenced(
        &self,
        sql: &'static str,
        fence: Fence,
        written: DateTime<Utc>,
        error: Option<&str>,
    ) -> Result<FenceOutcome> {
        let rows = sqlx::query(sql)
            .bind(fence.id.to_string())
            .bind(format_ts(written))
            .bind(format_ts(fence.last_written))
            .bind(error.map(clip_error))
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(outcome(rows))
    }
}

#[async_trait]
impl OutboxRepository for SqliteOutbox {
    fn backend_name(&self) -> &'static str {
        "sqlite"
    }

    async fn begin(&self) -> Result<Tx> {
        Ok(Tx::Sqlite(self.pool.begin_with("BEGIN IMMEDIATE").await?))
    }

    async fn enqueue(
        &self,
        tx: &mut Tx,
        events: &[NewEvent],
        now: DateTime<Utc>,
    ) -> Result<Vec<EventId>> {
        let ids = match tx {
            Tx::Sqlite(tx) => enqueue(tx, events, now).await?,
            other => {
                return Err(Error::BackendMismatch {
                    expected: "sqlite",
                    given: other.backend_name(),
                });
            }
        };
        self.enqueued.notify_waiters();
        Ok(ids)
    }

    async fn get_pending_events(
        &self,
        cutoffs: Cutoffs,
        scope: &Scope,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>> {
        let query = match scope {
            Scope::All => sqlx::query(ELIGIBLE_QUERY),
            _ => sqlx::query(sqlx::AssertSqlSafe(scoped(ELIGIBLE_QUERY))),
        };
        let query = query
            .bind(format_ts(cutoffs.stale_cutoff))
            .bind(format_ts(cutoffs.retry_cutoff))
            .bind(i64::from(limit));
        let query = match scope {
            Scope::All => query,
            _ => query
                .bind(json_list(scope.only()))
                .bind(json_list(scope.except())),
        };
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter().map(event_from_row).collect()
    }

    async fn claim_event(&self, id: EventId, cutoffs: Cutoffs) -> Result<Option<Claim>> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let row = sqlx::query(SELECT_BY_ID)
            .bind(id.to_string())
            .fetch_optional(&mut *tx)
            .await?;
        let claim = match row {
            Some(row) => claim_on(&mut tx, event_from_row(&row)?, cutoffs).await?,
            None => None,
        };
        tx.commit().await?;
        Ok(claim)
    }

    async fn claim_next(&self, cutoffs: Cutoffs, scope: &Scope) -> Result<Option<Claim>> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let query = match scope {
            Scope::All => sqlx::query(ELIGIBLE_QUERY),
            _ => sqlx::query(sqlx::AssertSqlSafe(scoped(ELIGIBLE_QUERY))),
        };
        let query = query
            .bind(format_ts(cutoffs.stale_cutoff))
            .bind(format_ts(cutoffs.retry_cutoff))
            .bind(1_i64);
        let query = match scope {
            Scope::All => query,
            _ => query
                .bind(json_list(scope.only()))
                .bind(json_list(scope.except())),
        };
        let row = query.fetch_optional(&mut *tx).await?;
        let claim = match row {
            Some(row) => claim_on(&mut tx, event_from_row(&row)?, cutoffs).await?,
            None => None,
        };
        tx.commit().await?;
        Ok(claim)
    }

    async fn heartbeat(&self, fence: Fence, now: DateTime<Utc>) -> Result<Option<Fence>> {
        let written = next_written(now, fence.last_written);
        let rows = sqlx::query(
            "UPDATE _System_OutboxEvent SET LastModifiedDate = ?2
             WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3",
        )
        .bind(fence.id.to_string())
        .bind(format_ts(written))
        .bind(format_ts(fence.last_written))
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok((rows == 1).then_some(Fence {
            id: fence.id,
            last_written: written,
        }))
    }

    fn serializes_writers(&self) -> bool {
        true
    }

    async fn begin_attempt(
        &self,
        _lock_timeout: Duration,
        fence: Fence,
    ) -> Result<Option<Box<dyn Attempt>>> {
        // The busy timeout of the pool's connections bounds lock waits on SQLite. The write
        // lock is held from here to commit, so once the fence is checked nobody can reclaim
        // the row during the attempt.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let held: Option<i64> = sqlx::query_scalar(
            "SELECT 1 FROM _System_OutboxEvent
             WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?2",
        )
        .bind(fence.id.to_string())
        .bind(format_ts(fence.last_written))
        .fetch_optional(&mut *tx)
        .await?;
        if held.is_none() {
            tx.rollback().await?;
            return Ok(None);
        }
        sqlx::query("SAVEPOINT outbox_claimed")
            .execute(&mut *tx)
            .await?;
        Ok(Some(Box::new(SqliteAttempt {
            tx: Some(Tx::Sqlite(tx)),
        })))
    }

    async fn increment_retry(
        &self,
        fence: Fence,
        now: DateTime<Utc>,
        extra_delay: Duration,
        error: &str,
    ) -> Result<FenceOutcome> {
        let written = next_written(now + delay(extra_delay), fence.last_written);
        self.fenced(FENCED_RETRY, fence, written, Some(error)).await
    }

    async fn update_status(
        &self,
        fence: Fence,
        status: Terminal,
        now: DateTime<Utc>,
        error: Option<String>,
    ) -> Result<FenceOutcome> {
        let written = next_written(now, fence.last_written);
        match status {
            Terminal::Processed => self.fenced(FENCED_PROCESSED, fence, written, None).await,
            Terminal::Failed => {
                self.fenced(
                    FENCED_FAILED,
                    fence,
                    written,
                    Some(error.as_deref().unwrap_or("failed")),
                )
                .await
            }
        }
    }

    async fn backfill_record_keys(
        &self,
        after: Option<EventId>,
        batch: u32,
        dry_run: bool,
    ) -> Result<BackfillPage> {
        let rows = sqlx::query(
            "SELECT Id, Payload, RecordKey FROM _System_OutboxEvent
             WHERE Status NOT IN ('processed', 'failed') AND (?1 IS NULL OR Id > ?1)
             ORDER BY Id LIMIT ?2",
        )
        .bind(after.map(|id| id.to_string()))
        .bind(i64::from(batch))
        .fetch_all(&self.pool)
        .await?;
        let scanned: Vec<(EventId, String, Option<String>)> = rows
            .iter()
            .map(|r| {
                Ok((
                    parse_id(&r.try_get::<String, _>(0)?)?,
                    r.try_get(1)?,
                    r.try_get(2)?,
                ))
            })
            .collect::<Result<_>>()?;
        let (mut page, updates) = crate::classify_backfill(&scanned, batch);
        if !dry_run && !updates.is_empty() {
            let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
            let mut done = 0;
            for (id, key) in &updates {
                done += sqlx::query(
                    "UPDATE _System_OutboxEvent SET RecordKey = ?2 WHERE Id = ?1 AND RecordKey IS NULL",
                )
                .bind(id.to_string())
                .bind(key)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            }
            tx.commit().await?;
            page.updated = done;
        }
        Ok(page)
    }

    async fn stats(&self, cutoffs: Cutoffs) -> Result<OutboxStats> {
        let mut stats = OutboxStats::default();
        let counts =
            sqlx::query("SELECT Status, count(*) FROM _System_OutboxEvent GROUP BY Status")
                .fetch_all(&self.pool)
                .await?;
        for row in counts {
            let status: String = row.try_get(0)?;
            let n = row.try_get::<i64, _>(1)? as u64;
            match status.as_str() {
                "pending" => stats.pending = n,
                "processing" => stats.processing = n,
                "processed" => stats.processed = n,
                "failed" => stats.failed = n,
                _ => {}
            }
        }
        let row = sqlx::query(
            "SELECT
               (SELECT min(CreatedDate) FROM _System_OutboxEvent WHERE Status = 'pending'),
               (SELECT count(*) FROM _System_OutboxEvent
                  WHERE Status = 'processing' AND LastModifiedDate < ?1),
               (SELECT count(*) FROM _System_OutboxEvent
                  WHERE Status = 'pending' AND RetryCount > 0)",
        )
        .bind(format_ts(cutoffs.stale_cutoff))
        .fetch_one(&self.pool)
        .await?;
        let oldest: Option<String> = row.try_get(0)?;
        if let Some(oldest) = oldest {
            let age = cutoffs.now - parse_ts(&oldest)?;
            stats.oldest_pending_age_seconds =
                Some(age.num_microseconds().unwrap_or(0) as f64 / 1e6);
        }
        stats.stale_claims = row.try_get::<i64, _>(1)? as u64;
        stats.retrying = row.try_get::<i64, _>(2)? as u64;
        let blocked = sqlx::query(
            "SELECT
               coalesce(sum(h.Status = 'processing' AND h.LastModifiedDate >= ?1), 0),
               coalesce(sum(h.Status = 'processing' AND h.LastModifiedDate < ?1), 0),
               coalesce(sum(h.Status = 'pending' AND h.RetryCount > 0 AND h.LastModifiedDate >= ?2), 0)
             FROM _System_OutboxEvent h
             WHERE h.RecordKey IS NOT NULL AND h.Status NOT IN ('processed', 'failed')
               AND NOT EXISTS (
                 SELECT 1 FROM _System_OutboxEvent o
                 WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
                   AND (o.CreatedDate < h.CreatedDate OR (o.CreatedDate = h.CreatedDate AND o.Id < h.Id)))
               AND EXISTS (
                 SELECT 1 FROM _System_OutboxEvent y
                 WHERE y.RecordKey = h.RecordKey AND y.Status NOT IN ('processed', 'failed')
                   AND (y.CreatedDate > h.CreatedDate OR (y.CreatedDate = h.CreatedDate AND y.Id > h.Id)))",
        )
        .bind(format_ts(cutoffs.stale_cutoff))
        .bind(format_ts(cutoffs.retry_cutoff))
        .fetch_one(&self.pool)
        .await?;
        stats.keys_blocked_by_running = blocked.try_get::<i64, _>(0)? as u64;
        stats.keys_blocked_by_stale = blocked.try_get::<i64, _>(1)? as u64;
        stats.keys_blocked_by_retry = blocked.try_get::<i64, _>(2)? as u64;
        Ok(stats)
    }

    async fn retry_failed(&self, filter: RetryFilter, now: DateTime<Utc>) -> Result<u64> {
        let now = format_ts(truncate_micros(now));
        let rows = match filter {
            RetryFilter::Id(id) => sqlx::query(
                "UPDATE _System_OutboxEvent SET Status = 'pending', RetryCount = 0,
                   LastModifiedDate = ?2
                 WHERE Id = ?1 AND Status = 'failed'",
            )
            .bind(id.to_string())
            .bind(now)
            .execute(&self.pool)
            .await?
            .rows_affected(),
            RetryFilter::Failed { event_type } => sqlx::query(
                "UPDATE _System_OutboxEvent SET Status = 'pending', RetryCount = 0,
                   LastModifiedDate = ?2
                 WHERE Status = 'failed' AND (?1 IS NULL OR EventType = ?1)",
            )
            .bind(event_type)
            .bind(now)
            .execute(&self.pool)
            .await?
            .rows_affected(),
        };
        Ok(rows)
    }

    async fn get_event(&self, id: EventId) -> Result<Option<OutboxEvent>> {
        let row = sqlx::query(SELECT_BY_ID)
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(event_from_row).transpose()
    }

    async fn wait_for_work(&self, timeout: Duration) -> Result<()> {
        // In-process enqueues wake the workers; other processes are seen at the next poll.
        let _ = tokio::time::timeout(timeout, self.enqueued.notified()).await;
        Ok(())
    }
}

/// The attempt transaction on SQLite.
struct SqliteAttempt {
    tx: Option<Tx>,
}

impl SqliteAttempt {
    fn conn(&mut self) -> Result<&mut SqliteConnection> {
        match self.tx.as_mut() {
            Some(Tx::Sqlite(tx)) => Ok(&mut **tx),
            Some(other) => Err(Error::BackendMismatch {
                expected: "sqlite",
                given: other.backend_name(),
            }),
            None => Err(Error::AttemptFinished),
        }
    }

    async fn fenced(
        &mut self,
        sql: &'static str,
        fence: Fence,
        written: DateTime<Utc>,
        error: Option<&str>,
    ) -> Result<FenceOutcome> {
        let rows = sqlx::query(sql)
            .bind(fence.id.to_string())
            .bind(format_ts(written))
            .bind(format_ts(fence.last_written))
            .bind(error.map(clip_error))
            .execute(self.conn()?)
            .await?
            .rows_affected();
        Ok(outcome(rows))
    }
}

#[async_trait]
impl Attempt for SqliteAttempt {
    fn tx(&mut self) -> &mut Tx {
        self.tx
            .as_mut()
            .expect("the attempt transaction is open until commit or rollback")
    }

    async fn rollback_to_savepoint(&mut self) -> Result<()> {
        sqlx::query("ROLLBACK TO SAVEPOINT outbox_claimed")
            .execute(self.conn()?)
            .await?;
        Ok(())
    }

    async fn mark_processed(&mut self, fence: Fence, now: DateTime<Utc>) -> Result<FenceOutcome> {
        let written = next_written(now, fence.last_written);
        self.fenced(FENCED_PROCESSED, fence, written, None).await
    }

    async fn record_failure(
        &mut self,
        fence: Fence,
        now: DateTime<Utc>,
        bookkeeping: FailureBookkeeping,
        error: &str,
    ) -> Result<FenceOutcome> {
        match bookkeeping {
            FailureBookkeeping::Retry { extra_delay } => {
                let written = next_written(now + delay(extra_delay), fence.last_written);
                self.fenced(FENCED_RETRY, fence, written, Some(error)).await
            }
            FailureBookkeeping::Fail => {
                let written = next_written(now, fence.last_written);
                self.fenced(FENCED_FAILED, fence, written, Some(error))
                    .await
            }
        }
    }

    async fn commit(&mut self) -> Result<()> {
        self.tx.take().ok_or(Error::AttemptFinished)?.commit().await
    }

    async fn rollback(&mut self) -> Result<()> {
        self.tx
            .take()
            .ok_or(Error::AttemptFinished)?
            .rollback()
            .await
    }
}
