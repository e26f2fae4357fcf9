//! PostgreSQL backlogs shaped for measurement, the design's select-and-claim as written (the
//! baseline the bench compares `claim_next` with), and figures read back from the table:
//! latencies, per-key order, update and WAL counters. Used by `outbox-bench`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row as _};
use uuid::Uuid;

use crate::{ClaimPolicy, Result};

/// The select-and-claim statement as it was before the per-key-head rewrite: the design's
/// eligible query, as written, feeding the claim, with the scope predicates (bound NULL) and
/// the full row returned, as the repository ran it then. Kept to measure before and after.
const DESIGN_CLAIM_NEXT: &str = "\
WITH candidate AS (
  SELECT e.Id, e.Status AS old_status
  FROM _System_OutboxEvent e
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
          AND (
            older.CreatedDate < e.CreatedDate
            OR (older.CreatedDate = e.CreatedDate AND older.Id < e.Id)
          )
          AND older.Status NOT IN ('processed', 'failed')
      )
    )
    AND ($4::text[] IS NULL OR e.EventType = ANY($4))
    AND ($5::text[] IS NULL OR e.EventType <> ALL($5))
  ORDER BY e.CreatedDate ASC, e.Id ASC
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
)
UPDATE _System_OutboxEvent t
SET Status = 'processing',
    LastModifiedDate = GREATEST($1, t.LastModifiedDate + interval '1 microsecond')
FROM candidate c
WHERE t.Id = c.Id
RETURNING t.Id, t.EventType, t.Payload, t.Status, t.RetryCount, t.RecordKey, t.CreatedDate,
          t.LastModifiedDate, t.LastError, c.old_status";

/// Empties the outbox table and refreshes its statistics.
pub async fn reset(pool: &PgPool) -> Result<()> {
    // (Its truncate trigger empties the heads table too; the effect ledger and the webhook
    // attempts reference it.)
    sqlx::raw_sql(
        "TRUNCATE _System_OutboxEvent, _System_OutboxEffect, _System_OutboxWebhookAttempt",
    )
    .execute(pool)
    .await?;
    vacuum_analyze(pool).await
}

/// `VACUUM ANALYZE` of the outbox table and its heads table.
pub async fn vacuum_analyze(pool: &PgPool) -> Result<()> {
    sqlx::raw_sql("VACUUM ANALYZE _System_OutboxEvent, _System_OutboxHead")
        .execute(pool)
        .await?;
    Ok(())
}

/// Enables or disables the enqueue trigger that wakes idle workers (`outbox_notify_insert`),
/// so that the bench can measure enqueue with and without any notification side by side.
pub async fn set_wakeup_trigger(pool: &PgPool, enabled: bool) -> Result<()> {
    let verb = if enabled { "ENABLE" } else { "DISABLE" };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE _System_OutboxEvent {verb} TRIGGER outbox_notify_insert"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// A backlog shape to seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Pending rows of one hot key (`lead:hot`), created before every other row.
    pub hot: usize,
    /// Pending rows over `keys` keys (`lead:r0` …), interleaved round robin.
    pub rows: usize,
    /// Keys the `rows` are spread over.
    pub keys: usize,
    /// Heads of the oldest keys claimed by live workers (their heartbeat is a day ahead).
    pub in_flight: usize,
}

/// Empties the outbox and seeds `shape` (event type `bench`, payload `{}`).
pub async fn seed_backlog(pool: &PgPool, shape: Backlog) -> Result<()> {
    let Backlog {
        hot,
        rows,
        keys,
        in_flight,
    } = shape;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "TRUNCATE _System_OutboxEvent, _System_OutboxEffect, _System_OutboxWebhookAttempt;
         INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'bench', '{{}}', 'pending', 0, 'lead:hot', t, t
         FROM (SELECT now() - interval '1 day' + i * interval '1 microsecond' AS t
               FROM generate_series(1, {hot}) i) s;
         INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'bench', '{{}}', 'pending', 0, 'lead:r' || (i % {keys}), t, t
         FROM (SELECT i, now() - interval '12 hours' + i * interval '1 microsecond' AS t
               FROM generate_series(1, {rows}) i) s;
         UPDATE _System_OutboxEvent SET Status = 'processing',
                LastModifiedDate = now() + interval '1 day'
         WHERE Id IN (
           SELECT Id FROM (
             SELECT DISTINCT ON (RecordKey) Id, CreatedDate
             FROM _System_OutboxEvent ORDER BY RecordKey, CreatedDate, Id) heads
           ORDER BY CreatedDate, Id LIMIT {in_flight});",
        keys = keys.max(1),
    )))
    .execute(pool)
    .await?;
    vacuum_analyze(pool).await
}

/// The design's cutoffs as timestamps, computed from the database's clock.
async fn design_cutoffs(
    pool: &PgPool,
    policy: ClaimPolicy,
) -> Result<(DateTime<Utc>, DateTime<Utc>, DateTime<Utc>)> {
    let now: DateTime<Utc> = crate::statement::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await?;
    let span = |d: Duration| chrono::Duration::from_std(d).unwrap_or_default();
    Ok((
        now,
        now - span(policy.stale_after),
        now - span(policy.retry_delay),
    ))
}

/// Claims one row with the design's query as written (no in-flight guard, no per-key heads);
/// returns its id. For measurement only: it is not the repository's claim.
pub async fn design_claim_next(pool: &PgPool, policy: ClaimPolicy) -> Result<Option<Uuid>> {
    let (now, stale, retry) = design_cutoffs(pool, policy).await?;
    let no_types: Option<Vec<String>> = None;
    Ok(crate::statement::query_scalar(DESIGN_CLAIM_NEXT)
        .bind(now)
        .bind(stale)
        .bind(retry)
        .bind(&no_types)
        .bind(&no_types)
        .fetch_optional(pool)
        .await?)
}

/// Marks row `id` processed directly (no attempt), so that the next timed claim takes the next
/// row.
pub async fn mark_processed(pool: &PgPool, id: Uuid) -> Result<()> {
    crate::statement::query("UPDATE _System_OutboxEvent SET Status = 'processed' WHERE Id = $1")
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of the design's eligible query and of `claim_next`
/// ([`crate::postgres::explain_analyze`]), and of the design's query feeding the claim, on the
/// table as it is; each runs in a transaction that is rolled back, so nothing is claimed.
pub async fn explain_claims(
    pool: &PgPool,
    policy: ClaimPolicy,
) -> Result<Vec<(&'static str, Vec<String>)>> {
    let mut plans = crate::postgres::explain_analyze(pool, policy).await?;
    let (now, stale, retry) = design_cutoffs(pool, policy).await?;
    let mut tx = pool.begin().await?;
    let design = crate::statement::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {DESIGN_CLAIM_NEXT}"
    )))
    .bind(now)
    .bind(stale)
    .bind(retry)
    .bind(None::<Vec<String>>)
    .bind(None::<Vec<String>>)
    .fetch_all(&mut *tx)
    .await?;
    tx.rollback().await?;
    plans.push((
        "select-and-claim before: the design's query feeding the claim",
        design,
    ));
    Ok(plans)
}

/// Which processed rows a figure is about.
#[derive(Debug, Clone, Copy)]
pub enum Keys<'a> {
    /// Every row.
    All,
    /// Rows of this record key.
    Only(&'a str),
    /// Rows of every other record key (and rows without one).
    Except(&'a str),
}

impl Keys<'_> {
    /// The condition, with the key bound as `$2`.
    fn condition(self) -> &'static str {
        match self {
            Keys::All => "$2::text IS NULL",
            Keys::Only(_) => "RecordKey = $2",
            Keys::Except(_) => "RecordKey IS DISTINCT FROM $2",
        }
    }

    fn key(self) -> Option<String> {
        match self {
            Keys::All => None,
            Keys::Only(k) | Keys::Except(k) => Some(k.to_string()),
        }
    }
}

/// Enqueue-to-processed latency of processed rows (`LastModifiedDate - CreatedDate`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Figures {
    /// Rows counted.
    pub n: usize,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 99th percentile latency, ms.
    pub p99_ms: f64,
    /// Longest latency, ms.
    pub max_ms: f64,
    /// Seconds from `since` to the last processed row.
    pub span_s: f64,
}

/// Latency figures of the processed rows of `keys`, with the span measured from `since`.
pub async fn latency(pool: &PgPool, keys: Keys<'_>, since: DateTime<Utc>) -> Result<Figures> {
    let row = crate::statement::query(sqlx::AssertSqlSafe(format!(
        "SELECT count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY lat),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY lat),
                EXTRACT(EPOCH FROM (max(LastModifiedDate) - $1))::float8,
                max(lat)
         FROM (SELECT LastModifiedDate,
                      EXTRACT(EPOCH FROM (LastModifiedDate - CreatedDate))::float8 * 1000 AS lat
               FROM _System_OutboxEvent
               WHERE Status = 'processed' AND {}) s",
        keys.condition()
    )))
    .bind(since)
    .bind(keys.key())
    .fetch_one(pool)
    .await?;
    Ok(Figures {
        n: row.try_get::<i64, _>(0)? as usize,
        p50_ms: row.try_get::<Option<f64>, _>(1)?.unwrap_or(0.0),
        p99_ms: row.try_get::<Option<f64>, _>(2)?.unwrap_or(0.0),
        span_s: row.try_get::<Option<f64>, _>(3)?.unwrap_or(0.0),
        max_ms: row.try_get::<Option<f64>, _>(4)?.unwrap_or(0.0),
    })
}

/// Latency figures (`LastModifiedDate - CreatedDate`) of the processed rows whose event type
/// starts with `prefix`, then of the others: two stages of a pipeline (the webhooks' fan-out
/// rows and their delivery rows). The span is not measured (0).
pub async fn latency_by_type_prefix(pool: &PgPool, prefix: &str) -> Result<(Figures, Figures)> {
    let rows = crate::statement::query(
        "SELECT starts_with(EventType, $1), count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY lat),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY lat),
                max(lat)
         FROM (SELECT EventType,
                      EXTRACT(EPOCH FROM (LastModifiedDate - CreatedDate))::float8 * 1000 AS lat
               FROM _System_OutboxEvent WHERE Status = 'processed') s
         GROUP BY 1",
    )
    .bind(prefix)
    .fetch_all(pool)
    .await?;
    let mut out = (Figures::default(), Figures::default());
    for row in rows {
        let figures = Figures {
            n: row.try_get::<i64, _>(1)? as usize,
            p50_ms: row.try_get::<Option<f64>, _>(2)?.unwrap_or(0.0),
            p99_ms: row.try_get::<Option<f64>, _>(3)?.unwrap_or(0.0),
            max_ms: row.try_get::<Option<f64>, _>(4)?.unwrap_or(0.0),
            span_s: 0.0,
        };
        if row.try_get::<bool, _>(0)? {
            out.0 = figures;
        } else {
            out.1 = figures;
        }
    }
    Ok(out)
}

/// When the processed rows ended, in seconds from `since`: the first, the 10th and 90th
/// percentiles and the last (a run's ramp, steady part and tail).
#[derive(Debug, Clone, Copy, Default)]
pub struct Timeline {
    /// The first processed row.
    pub first_s: f64,
    /// 10% of the rows were processed by then.
    pub p10_s: f64,
    /// 90% of the rows were processed by then.
    pub p90_s: f64,
    /// The last processed row.
    pub last_s: f64,
}

impl Timeline {
    /// Rows per second between the 10th and 90th percentiles of `n` rows (the steady part).
    pub fn steady_rate(&self, n: usize) -> f64 {
        0.8 * n as f64 / (self.p90_s - self.p10_s).max(1e-9)
    }
}

/// The [`Timeline`] of every processed row since `since`.
pub async fn timeline(pool: &PgPool, since: DateTime<Utc>) -> Result<Timeline> {
    let row = crate::statement::query(
        "SELECT min(t), percentile_cont(0.1) WITHIN GROUP (ORDER BY t),
                percentile_cont(0.9) WITHIN GROUP (ORDER BY t), max(t)
         FROM (SELECT EXTRACT(EPOCH FROM (LastModifiedDate - $1))::float8 AS t
               FROM _System_OutboxEvent WHERE Status = 'processed') s",
    )
    .bind(since)
    .fetch_one(pool)
    .await?;
    let at = |i: usize| -> Result<f64> { Ok(row.try_get::<Option<f64>, _>(i)?.unwrap_or(0.0)) };
    Ok(Timeline {
        first_s: at(0)?,
        p10_s: at(1)?,
        p90_s: at(2)?,
        last_s: at(3)?,
    })
}

/// Processed rows of `keys` whose outcome was written at or before `until`.
pub async fn processed_until(pool: &PgPool, keys: Keys<'_>, until: DateTime<Utc>) -> Result<i64> {
    Ok(crate::statement::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM _System_OutboxEvent
         WHERE Status = 'processed' AND LastModifiedDate <= $1 AND {}",
        keys.condition()
    )))
    .bind(until)
    .bind(keys.key())
    .fetch_one(pool)
    .await?)
}

/// Rows of one key processed before an older row of the same key (must be zero).
pub async fn order_violations(pool: &PgPool) -> Result<i64> {
    Ok(crate::statement::query_scalar(
        "SELECT count(*) FROM (
           SELECT LastModifiedDate < lag(LastModifiedDate)
                    OVER (PARTITION BY RecordKey ORDER BY CreatedDate, Id) AS early
           FROM _System_OutboxEvent WHERE RecordKey IS NOT NULL AND Status = 'processed') s
         WHERE early",
    )
    .fetch_one(pool)
    .await?)
}

/// Update counters of the outbox table and the server's WAL position.
#[derive(Debug, Clone, Copy, Default)]
pub struct TableCounters {
    /// Row updates.
    pub updates: i64,
    /// Of which heap-only (HOT) updates.
    pub hot_updates: i64,
    /// Dead tuples.
    pub dead: i64,
    /// The WAL position, bytes.
    pub wal_bytes: f64,
    /// WAL flushes to disk since the server's statistics were reset (`pg_stat_wal.wal_sync`,
    /// server-wide, the WAL writer's included; one flush serves every commit waiting for it).
    /// `None` where the server does not count them there (before PostgreSQL 14, from 18 on).
    pub wal_syncs: Option<i64>,
    /// Row writes (inserts, updates, deletes) of the heads table `_System_OutboxHead`, the
    /// claim's derived candidate list (migration 0004).
    pub head_writes: i64,
}

/// The outbox table's counters now. Backends flush their statistics when they exit, so read
/// them after the measured pool is closed and flushed.
pub async fn table_counters(pool: &PgPool) -> Result<TableCounters> {
    let row = crate::statement::query(
        "SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup,
                pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8,
                (SELECT n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables
                 WHERE relname = '_system_outboxhead')
         FROM pg_stat_user_tables WHERE relname = '_system_outboxevent'",
    )
    .fetch_one(pool)
    .await?;
    // Read by name through JSON, so that a server without the column answers NULL.
    let wal_syncs = crate::statement::query_scalar::<_, Option<i64>>(
        "SELECT (to_jsonb(w) ->> 'wal_sync')::bigint FROM pg_stat_wal w",
    )
    .fetch_one(pool)
    .await
    .ok()
    .flatten();
    Ok(TableCounters {
        updates: row.try_get(0)?,
        hot_updates: row.try_get(1)?,
        dead: row.try_get(2)?,
        wal_bytes: row.try_get(3)?,
        head_writes: row.try_get::<Option<i64>, _>(4)?.unwrap_or(0),
        wal_syncs,
    })
}
