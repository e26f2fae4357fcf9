//! The PostgreSQL repository: the production backend.
//!
//! Claims use one statement: the design's eligible-row selection with `FOR UPDATE SKIP LOCKED`
//! feeding the `pending`/stale `processing` -> `processing` update, so concurrent workers skip
//! each other's rows instead of queueing behind them. Idle workers wake on `LISTEN outbox_event`
//! (a statement-level trigger notifies on enqueue).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::{PgListener, PgRow};
use sqlx::{PgPool, Row};
use tokio::sync::{Notify, OnceCell};

use crate::{
    Attempt, BackfillPage, Claim, Cutoffs, Error, EventId, FailureBookkeeping, Fence, FenceOutcome,
    NewEvent, OutboxEvent, OutboxRepository, OutboxStats, Result, RetryFilter, Scope, Terminal, Tx,
    clip_error, new_event_id, truncate_micros,
};

/// The notification channel the enqueue trigger signals.
pub const NOTIFY_CHANNEL: &str = "outbox_event";

const COLUMNS: &str = "Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError";

/// The design's eligible-event query, as written in the design (identifiers unquoted).
pub const ELIGIBLE_QUERY: &str = "\
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent e
WHERE
  (e.Status = 'pending'
   OR (e.Status = 'processing' AND e.LastModifiedDate < $1))
  AND (e.Status <> 'pending'
       OR e.RetryCount = 0
       OR e.LastModifiedDate < $2)
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
LIMIT $3";

/// How many of the oldest non-terminal rows `claim_next` inspects before it falls back to
/// generating candidates per key. More than the workers that can hold a claim at once, so that
/// in a flowing queue the oldest eligible row is almost always inside this prefix. The query
/// spells it as `LIMIT 64`.
pub const CLAIM_PREFIX_ROWS: u32 = 64;

/// The candidate selection of `claim_next`: the design's eligible set and order, computed so
/// that its cost does not grow with the backlog or with one hot key (see `docs/queries.md`).
///
/// 1. `in_prefix`: the design's query over the oldest [`CLAIM_PREFIX_ROWS`] non-terminal rows.
///    Every row older than the oldest eligible one is non-terminal and inside that prefix, so a
///    hit here is the oldest eligible row overall. The same-key probe is the design's
///    `NOT EXISTS`, with the `(CreatedDate, Id)` comparison written as a row comparison so that
///    the index bounds it: a key's head costs one index descent, not a walk of its backlog.
/// 2. `by_head` (only when the prefix holds nothing claimable, for example a hot key's backlog
///    fills it): a keyed row is eligible only as the first non-terminal row of its key, so the
///    candidates are each key's head (a skip scan over `outbox_record_key_idx`, one descent per
///    key with non-terminal rows) and the unkeyed rows, sorted first (`OFFSET 0` keeps the
///    planner from sorting after the join) and then checked oldest first until one is
///    claimable. A blocked key's backlog is never walked; the cost is one descent per key.
///
/// Parameters: `$2` stale cutoff, `$3` retry cutoff; `$scope` is spliced in twice, empty for
/// [`Scope::All`] (so that the statement has no parameter that changes its plan, and
/// PostgreSQL keeps one generic plan instead of planning every claim) or `scope_filter!()`.
macro_rules! claim_candidate {
    ($($scope:tt)*) => {
        concat!(
            "\
WITH RECURSIVE
heads AS (
  (SELECT h.RecordKey, h.CreatedDate, h.Id
   FROM _System_OutboxEvent h
   WHERE h.RecordKey IS NOT NULL AND h.Status NOT IN ('processed', 'failed')
   ORDER BY h.RecordKey, h.CreatedDate, h.Id
   LIMIT 1)
  UNION ALL
  SELECT n.RecordKey, n.CreatedDate, n.Id
  FROM heads p
  CROSS JOIN LATERAL (
    SELECT x.RecordKey, x.CreatedDate, x.Id
    FROM _System_OutboxEvent x
    WHERE x.RecordKey > p.RecordKey AND x.Status NOT IN ('processed', 'failed')
    ORDER BY x.RecordKey, x.CreatedDate, x.Id
    LIMIT 1
  ) n
),
in_prefix AS (
  SELECT e.Id, e.Status AS old_status
  FROM (
    SELECT w.Id, w.CreatedDate
    FROM _System_OutboxEvent w
    WHERE w.Status NOT IN ('processed', 'failed')
    ORDER BY w.CreatedDate, w.Id
    LIMIT 64
  ) w
  JOIN _System_OutboxEvent e ON e.Id = w.Id
  WHERE
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < $2))
    AND (e.Status <> 'pending'
         OR e.RetryCount = 0
         OR e.LastModifiedDate < $3)
    AND (
      e.RecordKey IS NULL
      OR NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent older
        WHERE older.RecordKey = e.RecordKey
          AND (older.CreatedDate, older.Id) < (e.CreatedDate, e.Id)
          AND older.Status NOT IN ('processed', 'failed')
      )
    )
",
            $($scope)*,
            "  ORDER BY w.CreatedDate, w.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
by_head AS (
  SELECT e.Id, e.Status AS old_status
  FROM (
    SELECT heads.Id, heads.CreatedDate FROM heads
    UNION ALL
    SELECT u.Id, u.CreatedDate
    FROM _System_OutboxEvent u
    WHERE u.RecordKey IS NULL AND u.Status NOT IN ('processed', 'failed')
    ORDER BY 2, 1
    OFFSET 0
  ) c
  JOIN _System_OutboxEvent e ON e.Id = c.Id
  WHERE
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < $2))
    AND (e.Status <> 'pending'
         OR e.RetryCount = 0
         OR e.LastModifiedDate < $3)
",
            $($scope)*,
            "  ORDER BY c.CreatedDate, c.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
candidate AS (
  SELECT Id, old_status FROM in_prefix
  UNION ALL
  SELECT Id, old_status FROM by_head
  LIMIT 1
)"
        )
    };
}

/// The scope predicates of a narrowed claim: `$4` event types only, `$5` event types except.
macro_rules! scope_filter {
    () => {
        "    AND ($4::text[] IS NULL OR e.EventType = ANY($4))
    AND ($5::text[] IS NULL OR e.EventType <> ALL($5))
"
    };
}

/// The claim itself: the candidate moves to `processing`, its `LastModifiedDate` strictly forward.
macro_rules! claim_update {
    () => {
        "
UPDATE _System_OutboxEvent t
SET Status = 'processing',
    LastModifiedDate = GREATEST($1, t.LastModifiedDate + interval '1 microsecond')
FROM candidate c
WHERE t.Id = c.Id
RETURNING t.Id, t.EventType, t.Payload, t.Status, t.RetryCount, t.RecordKey, t.CreatedDate,
          t.LastModifiedDate, t.LastError, c.old_status"
    };
}

/// Select-and-claim in one statement: the candidate selection above locks its row with
/// `FOR UPDATE OF e SKIP LOCKED` and the update moves it to `processing`. Parameters: `$1` now,
/// `$2` stale cutoff, `$3` retry cutoff, `$4`/`$5` the scope's event types.
pub const CLAIM_NEXT: &str = concat!(claim_candidate!(scope_filter!()), claim_update!());

/// [`CLAIM_NEXT`] for [`Scope::All`]: the same statement without the scope predicates.
/// Parameters: `$1` now, `$2` stale cutoff, `$3` retry cutoff.
pub const CLAIM_NEXT_ALL: &str = concat!(claim_candidate!(""), claim_update!());

const CLAIM_EVENT: &str = "\
UPDATE _System_OutboxEvent t
SET Status = 'processing',
    LastModifiedDate = GREATEST($2, t.LastModifiedDate + interval '1 microsecond')
FROM (SELECT Id, Status AS old_status FROM _System_OutboxEvent WHERE Id = $1
      FOR UPDATE SKIP LOCKED) o
WHERE t.Id = o.Id
  AND (t.Status = 'pending' OR (t.Status = 'processing' AND t.LastModifiedDate < $3))
  AND (t.Status <> 'pending' OR t.RetryCount = 0 OR t.LastModifiedDate < $4)
RETURNING t.Id, t.EventType, t.Payload, t.Status, t.RetryCount, t.RecordKey, t.CreatedDate,
          t.LastModifiedDate, t.LastError, o.old_status";

const HEARTBEAT: &str = "\
UPDATE _System_OutboxEvent
SET LastModifiedDate = GREATEST($2, LastModifiedDate + interval '1 microsecond')
WHERE Id = $1 AND Status = 'processing' AND LastModifiedDate = $3
RETURNING LastModifiedDate";

const MARK_PROCESSED: &str = "\
UPDATE _System_OutboxEvent
SET Status = 'processed',
    LastModifiedDate = GREATEST($2, LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
WHERE Id = $1 AND Status = 'processing' AND LastModifiedDate = $3";

const MARK_FAILED: &str = "\
UPDATE _System_OutboxEvent
SET Status = 'failed',
    RetryCount = RetryCount + 1,
    LastModifiedDate = GREATEST($2, LastModifiedDate + interval '1 microsecond'),
    LastError = $4
WHERE Id = $1 AND Status = 'processing' AND LastModifiedDate = $3";

const INCREMENT_RETRY: &str = "\
UPDATE _System_OutboxEvent
SET Status = 'pending',
    RetryCount = RetryCount + 1,
    LastModifiedDate = GREATEST($2, LastModifiedDate + interval '1 microsecond'),
    LastError = $4
WHERE Id = $1 AND Status = 'processing' AND LastModifiedDate = $3";

/// The PostgreSQL outbox repository.
#[derive(Debug, Clone)]
pub struct PgOutbox {
    pool: PgPool,
    wake: Arc<Wake>,
}

#[derive(Debug, Default)]
struct Wake {
    notify: Notify,
    listener: OnceCell<()>,
}

impl PgOutbox {
    /// A repository over `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            wake: Arc::default(),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn start_listener(&self) {
        let pool = self.pool.clone();
        let wake = Arc::downgrade(&self.wake);
        self.wake
            .listener
            .get_or_init(|| async move {
                tokio::spawn(async move {
                    loop {
                        let listener = async {
                            let mut l = PgListener::connect_with(&pool).await?;
                            l.listen(NOTIFY_CHANNEL).await?;
                            Ok::<_, sqlx::Error>(l)
                        };
                        let mut listener = match listener.await {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::debug!(error = %e, "outbox listener cannot connect; retrying");
                                if wake.strong_count() == 0 || pool.is_closed() {
                                    return;
                                }
                                tokio::time::sleep(Duration::from_secs(1)).await;
                                continue;
                            }
                        };
                        loop {
                            let received = listener.try_recv().await;
                            let Some(wake) = wake.upgrade() else { return };
                            // A lost connection also wakes the workers: they poll once and
                            // fall back to their poll interval while the listener reconnects.
                            wake.notify.notify_waiters();
                            match received {
                                Ok(Some(_)) => {}
                                Ok(None) => {}
                                Err(_) => break,
                            }
                        }
                        if pool.is_closed() {
                            return;
                        }
                    }
                });
            })
            .await;
    }
}

fn event_from_row(row: &PgRow) -> Result<OutboxEvent> {
    let status: String = row.try_get("status")?;
    Ok(OutboxEvent {
        id: row.try_get("id")?,
        event_type: row.try_get("eventtype")?,
        payload: row.try_get("payload")?,
        status: status
            .parse()
            .map_err(|e: String| Error::Database(sqlx::Error::Decode(e.into())))?,
        retry_count: row.try_get("retrycount")?,
        record_key: row.try_get("recordkey")?,
        created_date: row.try_get("createddate")?,
        last_modified_date: row.try_get("lastmodifieddate")?,
        last_error: row.try_get("lasterror")?,
    })
}

fn claim_from_row(row: &PgRow) -> Result<Claim> {
    let event = event_from_row(row)?;
    let old_status: String = row.try_get("old_status")?;
    Ok(Claim {
        fence: Fence {
            id: event.id,
            last_written: event.last_modified_date,
        },
        reclaimed: old_status == "processing",
        event,
    })
}

fn pg_tx(tx: &mut Tx) -> Result<&mut sqlx::Transaction<'static, sqlx::Postgres>> {
    match tx {
        Tx::Postgres(tx) => Ok(tx),
        other => Err(Error::BackendMismatch {
            expected: "postgres",
            given: other.backend_name(),
        }),
    }
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

/// Inserts `events` with one statement (arrays unnested), deriving each `RecordKey`.
pub async fn enqueue(
    conn: &mut sqlx::PgConnection,
    events: &[NewEvent],
    now: DateTime<Utc>,
) -> Result<Vec<EventId>> {
    let now = truncate_micros(now);
    let mut ids = Vec::with_capacity(events.len());
    let mut types = Vec::with_capacity(events.len());
    let mut payloads = Vec::with_capacity(events.len());
    let mut keys = Vec::with_capacity(events.len());
    for event in events {
        let key =
            record_key::record_key_from_payload(&event.payload).map_err(Error::InvalidPayload)?;
        ids.push(new_event_id());
        types.push(event.event_type.as_str());
        payloads.push(event.payload.as_str());
        keys.push(key.map(record_key::RecordKey::into_string));
    }
    if ids.is_empty() {
        return Ok(ids);
    }
    sqlx::query(
        "INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT id, event_type, payload, 'pending', 0, record_key, $5, $5
         FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[])
           AS n(id, event_type, payload, record_key)",
    )
    .bind(&ids)
    .bind(&types)
    .bind(&payloads)
    .bind(&keys)
    .bind(now)
    .execute(conn)
    .await?;
    Ok(ids)
}

#[async_trait]
impl OutboxRepository for PgOutbox {
    fn backend_name(&self) -> &'static str {
        "postgres"
    }

    async fn begin(&self) -> Result<Tx> {
        Ok(Tx::Postgres(self.pool.begin().await?))
    }

    async fn enqueue(
        &self,
        tx: &mut Tx,
        events: &[NewEvent],
        now: DateTime<Utc>,
    ) -> Result<Vec<EventId>> {
        enqueue(pg_tx(tx)?, events, now).await
    }

    async fn get_pending_events(
        &self,
        cutoffs: Cutoffs,
        scope: &Scope,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>> {
        let query = match scope {
            Scope::All => sqlx::query(ELIGIBLE_QUERY),
            _ => sqlx::query(sqlx::AssertSqlSafe(ELIGIBLE_QUERY.replace(
                "ORDER BY e.CreatedDate ASC",
                "  AND ($4::text[] IS NULL OR e.EventType = ANY($4))
  AND ($5::text[] IS NULL OR e.EventType <> ALL($5))
ORDER BY e.CreatedDate ASC",
            ))),
        };
        let query = query
            .bind(cutoffs.stale_cutoff)
            .bind(cutoffs.retry_cutoff)
            .bind(i64::from(limit));
        let query = match scope {
            Scope::All => query,
            _ => query.bind(scope.only()).bind(scope.except()),
        };
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter().map(event_from_row).collect()
    }

    async fn claim_event(&self, id: EventId, cutoffs: Cutoffs) -> Result<Option<Claim>> {
        let row = sqlx::query(CLAIM_EVENT)
            .bind(id)
            .bind(cutoffs.now)
            .bind(cutoffs.stale_cutoff)
            .bind(cutoffs.retry_cutoff)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(claim_from_row).transpose()
    }

    async fn claim_next(&self, cutoffs: Cutoffs, scope: &Scope) -> Result<Option<Claim>> {
        let query = match scope {
            Scope::All => sqlx::query(CLAIM_NEXT_ALL),
            _ => sqlx::query(CLAIM_NEXT),
        };
        let query = query
            .bind(cutoffs.now)
            .bind(cutoffs.stale_cutoff)
            .bind(cutoffs.retry_cutoff);
        let query = match scope {
            Scope::All => query,
            _ => query.bind(scope.only()).bind(scope.except()),
        };
        let row = query.fetch_optional(&self.pool).await?;
        row.as_ref().map(claim_from_row).transpose()
    }

    async fn heartbeat(&self, fence: Fence, now: DateTime<Utc>) -> Result<Option<Fence>> {
        let written: Option<DateTime<Utc>> = sqlx::query_scalar(HEARTBEAT)
            .bind(fence.id)
            .bind(truncate_micros(now))
            .bind(fence.last_written)
            .fetch_optional(&self.pool)
            .await?;
        Ok(written.map(|last_written| Fence {
            id: fence.id,
            last_written,
        }))
    }

    async fn begin_attempt(
        &self,
        lock_timeout: Duration,
        _fence: Fence,
    ) -> Result<Option<Box<dyn Attempt>>> {
        // One round trip: BEGIN, the attempt's lock timeout, and the post-claim savepoint.
        let ms = lock_timeout.as_millis().max(1);
        let begin = format!("BEGIN; SET LOCAL lock_timeout = '{ms}ms'; SAVEPOINT outbox_claimed");
        let tx = self.pool.begin_with(sqlx::AssertSqlSafe(begin)).await?;
        Ok(Some(Box::new(PgAttempt {
            tx: Some(Tx::Postgres(tx)),
        })))
    }

    async fn increment_retry(
        &self,
        fence: Fence,
        now: DateTime<Utc>,
        extra_delay: Duration,
        error: &str,
    ) -> Result<FenceOutcome> {
        let rows = sqlx::query(INCREMENT_RETRY)
            .bind(fence.id)
            .bind(truncate_micros(now) + delay(extra_delay))
            .bind(fence.last_written)
            .bind(clip_error(error))
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(outcome(rows))
    }

    async fn update_status(
        &self,
        fence: Fence,
        status: Terminal,
        now: DateTime<Utc>,
        error: Option<String>,
    ) -> Result<FenceOutcome> {
        let query = match status {
            Terminal::Processed => sqlx::query(MARK_PROCESSED)
                .bind(fence.id)
                .bind(truncate_micros(now))
                .bind(fence.last_written),
            Terminal::Failed => sqlx::query(MARK_FAILED)
                .bind(fence.id)
                .bind(truncate_micros(now))
                .bind(fence.last_written)
                .bind(clip_error(error.as_deref().unwrap_or("failed"))),
        };
        let rows = query.execute(&self.pool).await?.rows_affected();
        Ok(outcome(rows))
    }

    async fn backfill_record_keys(
        &self,
        after: Option<EventId>,
        batch: u32,
        dry_run: bool,
    ) -> Result<BackfillPage> {
        let rows = sqlx::query(
            "SELECT Id, Payload, RecordKey FROM _System_OutboxEvent
             WHERE Status NOT IN ('processed', 'failed') AND ($1::uuid IS NULL OR Id > $1)
             ORDER BY Id LIMIT $2",
        )
        .bind(after)
        .bind(i64::from(batch))
        .fetch_all(&self.pool)
        .await?;
        let scanned: Vec<(EventId, String, Option<String>)> = rows
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
            .collect::<Result<_, sqlx::Error>>()?;
        let (mut page, updates) = crate::classify_backfill(&scanned, batch);
        if !dry_run && !updates.is_empty() {
            let ids: Vec<EventId> = updates.iter().map(|(id, _)| *id).collect();
            let keys: Vec<&str> = updates.iter().map(|(_, k)| k.as_str()).collect();
            let done = sqlx::query(
                "UPDATE _System_OutboxEvent t SET RecordKey = u.key
                 FROM UNNEST($1::uuid[], $2::text[]) AS u(id, key)
                 WHERE t.Id = u.id AND t.RecordKey IS NULL",
            )
            .bind(&ids)
            .bind(&keys)
            .execute(&self.pool)
            .await?
            .rows_affected();
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
            let n: i64 = row.try_get(1)?;
            let n = n as u64;
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
               (SELECT EXTRACT(EPOCH FROM ($1 - min(CreatedDate)))::float8
                  FROM _System_OutboxEvent WHERE Status = 'pending'),
               (SELECT count(*) FROM _System_OutboxEvent
                  WHERE Status = 'processing' AND LastModifiedDate < $2),
               (SELECT count(*) FROM _System_OutboxEvent
                  WHERE Status = 'pending' AND RetryCount > 0)",
        )
        .bind(cutoffs.now)
        .bind(cutoffs.stale_cutoff)
        .fetch_one(&self.pool)
        .await?;
        stats.oldest_pending_age_seconds = row.try_get(0)?;
        stats.stale_claims = row.try_get::<i64, _>(1)? as u64;
        stats.retrying = row.try_get::<i64, _>(2)? as u64;
        let blocked = sqlx::query(
            "SELECT
               count(*) FILTER (WHERE h.Status = 'processing' AND h.LastModifiedDate >= $1),
               count(*) FILTER (WHERE h.Status = 'processing' AND h.LastModifiedDate < $1),
               count(*) FILTER (WHERE h.Status = 'pending' AND h.RetryCount > 0
                                  AND h.LastModifiedDate >= $2)
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
        .bind(cutoffs.stale_cutoff)
        .bind(cutoffs.retry_cutoff)
        .fetch_one(&self.pool)
        .await?;
        stats.keys_blocked_by_running = blocked.try_get::<i64, _>(0)? as u64;
        stats.keys_blocked_by_stale = blocked.try_get::<i64, _>(1)? as u64;
        stats.keys_blocked_by_retry = blocked.try_get::<i64, _>(2)? as u64;
        Ok(stats)
    }

    async fn retry_failed(&self, filter: RetryFilter, now: DateTime<Utc>) -> Result<u64> {
        let now = truncate_micros(now);
        let rows = match filter {
            RetryFilter::Id(id) => sqlx::query(
                "UPDATE _System_OutboxEvent SET Status = 'pending', RetryCount = 0,
                   LastModifiedDate = $2
                 WHERE Id = $1 AND Status = 'failed'",
            )
            .bind(id)
            .bind(now)
            .execute(&self.pool)
            .await?
            .rows_affected(),
            RetryFilter::Failed { event_type } => sqlx::query(
                "UPDATE _System_OutboxEvent SET Status = 'pending', RetryCount = 0,
                   LastModifiedDate = $2
                 WHERE Status = 'failed' AND ($1::text IS NULL OR EventType = $1)",
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
        let sql = format!("SELECT {COLUMNS} FROM _System_OutboxEvent WHERE Id = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(event_from_row).transpose()
    }

    async fn wait_for_work(&self, timeout: Duration) -> Result<()> {
        self.start_listener().await;
        let _ = tokio::time::timeout(timeout, self.wake.notify.notified()).await;
        Ok(())
    }
}

/// The attempt transaction on PostgreSQL.
struct PgAttempt {
    tx: Option<Tx>,
}

impl PgAttempt {
    fn conn(&mut self) -> Result<&mut sqlx::PgConnection> {
        match self.tx.as_mut() {
            Some(Tx::Postgres(tx)) => Ok(&mut **tx),
            Some(other) => Err(Error::BackendMismatch {
                expected: "postgres",
                given: other.backend_name(),
            }),
            None => Err(Error::AttemptFinished),
        }
    }
}

#[async_trait]
impl Attempt for PgAttempt {
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
        let rows = sqlx::query(MARK_PROCESSED)
            .bind(fence.id)
            .bind(truncate_micros(now))
            .bind(fence.last_written)
            .execute(self.conn()?)
            .await?
            .rows_affected();
        Ok(outcome(rows))
    }

    async fn record_failure(
        &mut self,
        fence: Fence,
        now: DateTime<Utc>,
        bookkeeping: FailureBookkeeping,
        error: &str,
    ) -> Result<FenceOutcome> {
        let now = truncate_micros(now);
        let query = match bookkeeping {
            FailureBookkeeping::Retry { extra_delay } => sqlx::query(INCREMENT_RETRY)
                .bind(fence.id)
                .bind(now + delay(extra_delay)),
            FailureBookkeeping::Fail => sqlx::query(MARK_FAILED).bind(fence.id).bind(now),
        };
        let rows = query
            .bind(fence.last_written)
            .bind(clip_error(error))
            .execute(self.conn()?)
            .await?
            .rows_affected();
        Ok(outcome(rows))
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
