//! Read-only queries of the operator console (`outbox-console`), on both backends: what the
//! console's pages show beyond the repository's operator reads. Every query uses an index and
//! takes no row lock a worker needs.
//!
//! - [`throughput`]: rows that became `processed` per minute over the last hour, for the
//!   overview's chart, read from the rollup `_System_OutboxThroughput` (PostgreSQL migration
//!   0016, SQLite 0009), which the settles keep in the attempt's own transaction: sixty
//!   minutes of counts, whatever the table holds. It used to count the `processed` rows
//!   created in the last 6 h, which on a busy outbox was most of the table.
//! - [`queue_counts`]: rows by status, the oldest pending age, stale claims and retrying rows.
//!   On PostgreSQL every count but `processed` reads the partial indexes; counting hundreds of
//!   thousands of `processed` rows would take a scan (about 100 ms per million rows), so above
//!   [`ESTIMATE_PROCESSED_ABOVE`] rows in the table `processed` is the planner's row estimate
//!   less the exact other counts, flagged as an estimate. SQLite reads the repository's
//!   `stats` (its staleness is observed by the workers' process, see `docs/state-machine.md`).
//! - [`prunable_rows`]: the terminal rows a prune would delete now, counted up to
//!   [`PRUNABLE_COUNTED`] per status (an exact count of a long-kept history took seconds on
//!   10M rows; `outbox prune --dry-run` still counts them all).
//! - [`failed_rows`]: `failed` rows filtered by event type and error text, newest first, over
//!   the terminal index; [`failed_types`]: the failed rows per event type.

use std::time::Duration;

use chrono::{DateTime, DurationRound, Utc};
use record_key::RecordKey;

use crate::postgres::{Begin, begin_sql, pool_caches_statements};
use crate::sqlite::{format_ts, parse_ts};
use crate::{ClaimPolicy, Database, EventId, EventRow, OutboxStats, PrunePolicy, Result};

pub use crate::ESTIMATE_PROCESSED_ABOVE;

/// The queue's counts for the console, from [`queue_counts`].
#[derive(Debug, Clone, PartialEq)]
pub struct QueueCounts {
    /// The counts; the blocked-key counts are left at zero (the console lists blocked keys).
    pub stats: OutboxStats,
    /// Whether `stats.processed` is an estimate (a large table on PostgreSQL).
    pub processed_estimated: bool,
}

const PG_COUNTS: &str = "
    WITH clock AS (SELECT clock_timestamp() AS now)
    SELECT
      (SELECT count(*) FROM _System_OutboxEvent WHERE Status NOT IN ('processed', 'failed'))
        - (SELECT count(*) FROM _System_OutboxEvent
            WHERE Status NOT IN ('processed', 'failed') AND Status = 'processing'),
      (SELECT count(*) FROM _System_OutboxEvent
        WHERE Status NOT IN ('processed', 'failed') AND Status = 'processing'),
      (SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'failed'),
      (SELECT reltuples::float8 FROM pg_class WHERE oid = '_system_outboxevent'::regclass),
      (SELECT EXTRACT(EPOCH FROM ((SELECT now FROM clock) - min(CreatedDate)))::float8
         FROM _System_OutboxEvent
        WHERE Status NOT IN ('processed', 'failed') AND Status = 'pending'),
      (SELECT count(*) FROM _System_OutboxEvent
        WHERE Status NOT IN ('processed', 'failed') AND Status = 'processing'
          AND LastModifiedDate < (SELECT now FROM clock) - $1::interval),
      (SELECT count(*) FROM _System_OutboxEvent
        WHERE Status NOT IN ('processed', 'failed') AND Status = 'pending' AND RetryCount > 0)";

const PG_PROCESSED: &str = "SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'";

/// The counts of [`PG_COUNTS`].
type PgCounts = (i64, i64, i64, Option<f64>, Option<f64>, i64, i64);

/// Rows by status, the oldest pending age, stale claims (judged by `policy`) and retrying
/// rows, with index reads only (see the module's note on the `processed` count). `repo` is the
/// long-lived repository over `db`: on SQLite stale claims are judged by the silence it has
/// observed over time, which a repository made for the call has not.
pub async fn queue_counts(
    db: &Database,
    repo: &dyn crate::OutboxRepository,
    policy: ClaimPolicy,
) -> Result<QueueCounts> {
    let pool = match db {
        Database::Postgres(pool) => pool,
        Database::Sqlite(_) => {
            let mut stats = repo.stats(policy).await?;
            stats.keys_blocked_by_running = 0;
            stats.keys_blocked_by_stale = 0;
            stats.keys_blocked_by_retry = 0;
            let processed_estimated = false;
            return Ok(QueueCounts {
                stats,
                processed_estimated,
            });
        }
    };
    let cached = pool_caches_statements(pool);
    let mut tx = begin_read(pool).await?;
    let (pending, processing, failed, rows, oldest, stale, retrying): PgCounts =
        sqlx::query_as(PG_COUNTS)
            .persistent(cached)
            .bind(interval(policy.stale_after))
            .fetch_one(&mut *tx)
            .await?;
    let known = pending + processing + failed;
    let estimate = rows.filter(|r| *r >= ESTIMATE_PROCESSED_ABOVE);
    let processed = match estimate {
        Some(rows) => (rows as i64 - known).max(0),
        None => {
            sqlx::query_scalar(PG_PROCESSED)
                .persistent(cached)
                .fetch_one(&mut *tx)
                .await?
        }
    };
    tx.commit().await?;
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    let stats = OutboxStats {
        pending: n(pending),
        processing: n(processing),
        processed: n(processed),
        processed_estimated: estimate.is_some(),
        failed: n(failed),
        oldest_pending_age_seconds: oldest,
        stale_claims: n(stale),
        retrying: n(retrying),
        ..OutboxStats::default()
    };
    Ok(QueueCounts {
        stats,
        processed_estimated: estimate.is_some(),
    })
}

/// The window [`throughput`] counts: the last hour.
pub const THROUGHPUT_WINDOW: Duration = Duration::from_secs(3600);

/// The most rows [`failed_rows`] returns.
pub const MAX_FAILED_ROWS: u32 = 500;

/// The statement timeout of the console's reads on PostgreSQL: a page that cannot be answered
/// in this time shows an error instead of holding a connection.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Rows processed per minute over the last hour, from [`throughput`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Throughput {
    /// The queue's clock when it was read.
    pub now: DateTime<Utc>,
    /// Sixty counts, the oldest minute first: `per_minute[59]` is the current minute.
    pub per_minute: Vec<u64>,
}

impl Throughput {
    /// Rows processed over the whole window.
    pub fn total(&self) -> u64 {
        self.per_minute.iter().sum()
    }

    /// Puts `(minute, count)` rows into sixty buckets ending at `now`'s minute.
    fn from_minutes(now: DateTime<Utc>, minutes: Vec<(DateTime<Utc>, i64)>) -> Self {
        let mut per_minute = vec![0u64; 60];
        let current = now
            .duration_trunc(chrono::Duration::minutes(1))
            .unwrap_or(now);
        for (minute, n) in minutes {
            let ago = (current - minute).num_minutes();
            if (0..60).contains(&ago) {
                per_minute[59 - ago as usize] += u64::try_from(n).unwrap_or(0);
            }
        }
        Self { now, per_minute }
    }
}

/// Which failed rows [`failed_rows`] returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailedFilter {
    /// Only rows of this `EventType`.
    pub event_type: Option<String>,
    /// Only rows whose `LastError` contains this text (case-insensitively; no wildcards).
    pub error_contains: Option<String>,
    /// At most this many rows, the newest (capped at [`MAX_FAILED_ROWS`]).
    pub limit: u32,
}

/// A reading transaction of the console's own on PostgreSQL: READ COMMITTED, READ ONLY, with
/// the outbox's timeouts.
pub(crate) async fn begin_read(
    pool: &sqlx::PgPool,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let sql = begin_sql(Begin {
        read_only: true,
        lock_timeout: crate::DEFAULT_LOCK_TIMEOUT,
        statement_timeout: READ_TIMEOUT,
        may_idle: false,
        async_commit: false,
    });
    Ok(pool.begin_with(sqlx::AssertSqlSafe(sql)).await?)
}

/// The rollup's last sixty minutes (a row per minute and backend, summed), by its primary key.
const PG_THROUGHPUT: &str = "
    WITH clock AS (SELECT clock_timestamp() AS now)
    SELECT (SELECT now FROM clock), t.Minute, sum(t.Processed)::bigint
    FROM _System_OutboxThroughput t
    WHERE t.Minute >= (date_trunc('minute', (SELECT now FROM clock) AT TIME ZONE 'UTC')
                       AT TIME ZONE 'UTC') - interval '59 minutes'
    GROUP BY t.Minute";

/// The rollup's last sixty minutes on SQLite (a row per minute, `YYYY-MM-DDTHH:MM`).
const SQLITE_THROUGHPUT: &str = "
    SELECT Minute, Processed FROM _System_OutboxThroughput WHERE Minute >= ?1";

/// How far a hot standby's data is behind its primary, as `replica_lag` reads it on the standby.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaLag {
    /// Seconds since the newest transaction the standby has replayed committed on the primary
    /// (`now() - pg_last_xact_replay_timestamp()`); `None` before it replayed any.
    pub behind_seconds: Option<f64>,
    /// Whether the standby has replayed all the WAL it received (then a large
    /// `behind_seconds` only means the primary has been idle, when it is `streaming`).
    pub caught_up: bool,
    /// Whether its WAL receiver streams from the primary now (`pg_stat_wal_receiver`): when it
    /// does not, "caught up" only means with what it received before it stopped.
    pub streaming: bool,
}

/// How far the database `db` reads from is behind its primary: `None` when it is not a standby
/// (a primary, or SQLite).
pub async fn replica_lag(db: &Database) -> Result<Option<ReplicaLag>> {
    let Database::Postgres(pool) = db else {
        return Ok(None);
    };
    let row: (bool, Option<f64>, bool, bool) = sqlx::query_as(
        "SELECT pg_is_in_recovery(),
                greatest(EXTRACT(EPOCH FROM clock_timestamp()
                                 - pg_last_xact_replay_timestamp())::float8, 0),
                coalesce(pg_last_wal_receive_lsn() <= pg_last_wal_replay_lsn(), false),
                EXISTS (SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming')",
    )
    .persistent(pool_caches_statements(pool))
    .fetch_one(pool)
    .await?;
    Ok(row.0.then_some(ReplicaLag {
        behind_seconds: row.1,
        caught_up: row.2,
        streaming: row.3,
    }))
}

/// Rows that became `processed` in each minute of the last hour, from the rollup the settles
/// keep (see the module's note): rows other code set `processed` with its own SQL are counted
/// on SQLite (a trigger keeps it) and not on PostgreSQL (the settle functions do).
pub async fn throughput(db: &Database) -> Result<Throughput> {
    match db {
        Database::Postgres(pool) => {
            let mut tx = begin_read(pool).await?;
            let rows: Vec<(DateTime<Utc>, DateTime<Utc>, i64)> = sqlx::query_as(PG_THROUGHPUT)
                .persistent(pool_caches_statements(pool))
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            let now = match rows.first() {
                Some((now, _, _)) => *now,
                None => postgres_now(pool).await?,
            };
            let minutes = rows.into_iter().map(|(_, m, n)| (m, n)).collect();
            Ok(Throughput::from_minutes(now, minutes))
        }
        Database::Sqlite(pool) => {
            let now = crate::truncate_micros(Utc::now());
            let minute = now
                .duration_trunc(chrono::Duration::minutes(1))
                .unwrap_or(now);
            let since = minute - chrono::Duration::minutes(59);
            let rows: Vec<(String, i64)> = sqlx::query_as(SQLITE_THROUGHPUT)
                .bind(since.format("%Y-%m-%dT%H:%M").to_string())
                .fetch_all(pool)
                .await?;
            let mut minutes = Vec::with_capacity(rows.len());
            for (text, n) in rows {
                minutes.push((parse_ts(&format!("{text}:00Z"))?, n));
            }
            Ok(Throughput::from_minutes(now, minutes))
        }
    }
}

/// The database's clock on PostgreSQL.
async fn postgres_now(pool: &sqlx::PgPool) -> Result<DateTime<Utc>> {
    let mut tx = begin_read(pool).await?;
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .persistent(pool_caches_statements(pool))
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(now)
}

/// A duration as a PostgreSQL interval.
fn interval(d: Duration) -> sqlx::postgres::types::PgInterval {
    sqlx::postgres::types::PgInterval {
        months: 0,
        days: 0,
        microseconds: i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
    }
}

const PG_FAILED: &str = "
    SELECT Id, EventType, Status, RecordKey, CreatedDate, LastModifiedDate, RetryCount, LastError
    FROM _System_OutboxEvent
    WHERE Status = 'failed'
      AND ($1::text IS NULL OR EventType = $1)
      AND ($2::text IS NULL OR strpos(lower(coalesce(LastError, '')), lower($2)) > 0)
    ORDER BY Status DESC, CreatedDate DESC
    LIMIT $3";

const SQLITE_FAILED: &str = "
    SELECT Id, EventType, Status, RecordKey, CreatedDate, LastModifiedDate, RetryCount, LastError
    FROM _System_OutboxEvent
    WHERE Status = 'failed'
      AND (?1 IS NULL OR EventType = ?1)
      AND (?2 IS NULL OR instr(lower(coalesce(LastError, '')), lower(?2)) > 0)
    ORDER BY Status DESC, CreatedDate DESC, Id DESC
    LIMIT ?3";

/// A row of a failed-row read: the columns of [`EventRow`] as the backend returns them.
type PgRow = (
    EventId,
    String,
    String,
    Option<String>,
    DateTime<Utc>,
    DateTime<Utc>,
    i32,
    Option<String>,
);
type SqliteRow = (
    String,
    String,
    String,
    Option<String>,
    String,
    String,
    i32,
    Option<String>,
);

/// `failed` rows that `filter` selects, newest (`CreatedDate`) first, without payloads.
pub async fn failed_rows(db: &Database, filter: &FailedFilter) -> Result<Vec<EventRow>> {
    let limit = i64::from(filter.limit.clamp(1, MAX_FAILED_ROWS));
    let error = filter.error_contains.as_deref().filter(|e| !e.is_empty());
    let event_type = filter.event_type.as_deref().filter(|t| !t.is_empty());
    match db {
        Database::Postgres(pool) => {
            let mut tx = begin_read(pool).await?;
            let rows: Vec<PgRow> = sqlx::query_as(PG_FAILED)
                .persistent(pool_caches_statements(pool))
                .bind(event_type)
                .bind(error)
                .bind(limit)
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(rows
                .into_iter()
                .map(|(id, t, s, k, c, m, r, e)| row(id, t, &s, k, c, m, r, e))
                .collect())
        }
        Database::Sqlite(pool) => {
            let rows: Vec<SqliteRow> = sqlx::query_as(SQLITE_FAILED)
                .bind(event_type)
                .bind(error)
                .bind(limit)
                .fetch_all(pool)
                .await?;
            let mut out = Vec::with_capacity(rows.len());
            for (id, t, s, k, c, m, r, e) in rows {
                let id = uuid::Uuid::parse_str(&id).map_err(|e| {
                    crate::Error::Database(sqlx::Error::Decode(format!("bad id: {e}").into()))
                })?;
                out.push(row(id, t, &s, k, parse_ts(&c)?, parse_ts(&m)?, r, e));
            }
            Ok(out)
        }
    }
}

/// An [`EventRow`] from its columns.
#[allow(clippy::too_many_arguments)]
fn row(
    id: EventId,
    event_type: String,
    status: &str,
    key: Option<String>,
    created: DateTime<Utc>,
    modified: DateTime<Utc>,
    retry_count: i32,
    last_error: Option<String>,
) -> EventRow {
    EventRow {
        id,
        event_type,
        status: status.parse().unwrap_or(crate::EventStatus::Failed),
        record_key: key.map(RecordKey::from_stored),
        created_date: created,
        last_modified_date: modified,
        retry_count,
        last_error,
    }
}

const FAILED_TYPES: &str = "
    SELECT EventType, count(*) FROM _System_OutboxEvent
    WHERE Status = 'failed'
    GROUP BY EventType ORDER BY EventType";

/// The event types of `failed` rows, each with its count, by name.
pub async fn failed_types(db: &Database) -> Result<Vec<(String, u64)>> {
    let rows: Vec<(String, i64)> = match db {
        Database::Postgres(pool) => {
            let mut tx = begin_read(pool).await?;
            let rows = sqlx::query_as(FAILED_TYPES)
                .persistent(pool_caches_statements(pool))
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            rows
        }
        Database::Sqlite(pool) => sqlx::query_as(FAILED_TYPES).fetch_all(pool).await?,
    };
    Ok(rows
        .into_iter()
        .map(|(t, n)| (t, u64::try_from(n).unwrap_or(0)))
        .collect())
}

/// The most rows [`prunable_rows`] counts of each status: past it a count says "more than".
pub const PRUNABLE_COUNTED: u64 = 100_000;

/// The terminal rows a prune would delete now, from [`prunable_rows`]: each count stops at
/// [`PRUNABLE_COUNTED`] + 1, which means "more than [`PRUNABLE_COUNTED`]"; `None` for a status
/// the policy keeps forever.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prunable {
    /// `processed` rows older than the policy's age for them.
    pub processed: Option<u64>,
    /// `failed` rows older than the policy's age for them.
    pub failed: Option<u64>,
}

/// One status' prunable rows on PostgreSQL, at most `$2` of them: `$1` the age. The status is
/// a literal, so that the plan uses the partial `outbox_terminal_idx`, and the walk is in its
/// order ([`PRUNABLE_PLAN`]): without it, on a table whose rows were all younger than the age,
/// the count read all 10M of them (0.9 s) to count none.
macro_rules! pg_prunable {
    ($status:literal) => {
        concat!(
            "WITH clock AS (SELECT clock_timestamp() - $1::interval AS cutoff)
    SELECT count(*) FROM (
      SELECT 1 FROM _System_OutboxEvent
      WHERE Status = '",
            $status,
            "' AND CreatedDate < (SELECT cutoff FROM clock)
        AND LastModifiedDate < (SELECT cutoff FROM clock)
      ORDER BY CreatedDate
      LIMIT $2) c"
        )
    };
}

/// The plan of `pg_prunable!` for this transaction: the terminal index in its order, stopping at
/// the cap. The cutoff is not known when the plan is made, so the planner guesses a third of the
/// rows and preferred a sequential scan and a sort (50 ms to count none of 1M rows), or a bitmap
/// of every old row (0.4 s to count 100,001 of 900,000).
const PRUNABLE_PLAN: &str = "SELECT set_config('enable_seqscan', 'off', true),
    set_config('enable_bitmapscan', 'off', true), set_config('enable_sort', 'off', true)";

/// One status' prunable rows on SQLite: `?1` the status, `?2` the cutoff, `?3` the cap.
const SQLITE_PRUNABLE: &str = "
    SELECT count(*) FROM (
      SELECT 1 FROM _System_OutboxEvent
      WHERE Status = ?1 AND CreatedDate < ?2 AND LastModifiedDate < ?2
      LIMIT ?3)";

/// The rows a prune under `policy` would delete now (see [`Prunable`]), with the database's
/// clock on PostgreSQL and the host's on SQLite, as the prune itself (without a repository's
/// test `ClockShift`: the console has none).
pub async fn prunable_rows(db: &Database, policy: &PrunePolicy) -> Result<Prunable> {
    let cap = i64::try_from(PRUNABLE_COUNTED + 1).unwrap_or(i64::MAX);
    let mut out = Prunable::default();
    let ages = [
        (policy.processed_older_than, "processed", &mut out.processed),
        (policy.failed_older_than, "failed", &mut out.failed),
    ];
    for (age, status, count) in ages {
        let Some(age) = age else { continue };
        let n: i64 = match db {
            Database::Postgres(pool) => {
                let sql = match status {
                    "processed" => pg_prunable!("processed"),
                    _ => pg_prunable!("failed"),
                };
                let mut tx = begin_read(pool).await?;
                sqlx::query(PRUNABLE_PLAN)
                    .persistent(pool_caches_statements(pool))
                    .execute(&mut *tx)
                    .await?;
                let n = sqlx::query_scalar(sql)
                    .persistent(pool_caches_statements(pool))
                    .bind(interval(age))
                    .bind(cap)
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                n
            }
            Database::Sqlite(pool) => {
                let now = crate::truncate_micros(Utc::now());
                let Some(cutoff) = chrono::Duration::from_std(age)
                    .ok()
                    .and_then(|age| now.checked_sub_signed(age))
                else {
                    *count = Some(0);
                    continue;
                };
                sqlx::query_scalar(SQLITE_PRUNABLE)
                    .bind(status)
                    .bind(format_ts(cutoff))
                    .bind(cap)
                    .fetch_one(pool)
                    .await?
            }
        };
        *count = Some(u64::try_from(n).unwrap_or(0));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minutes_fall_into_sixty_buckets_ending_now() {
        let now = DateTime::parse_from_rfc3339("2026-01-05T10:30:42Z")
            .unwrap()
            .with_timezone(&Utc);
        let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
        let t = Throughput::from_minutes(
            now,
            vec![
                (at("2026-01-05T10:30:00Z"), 3),
                (at("2026-01-05T09:31:00Z"), 2),
                (at("2026-01-05T09:30:00Z"), 7),
            ],
        );
        assert_eq!(t.per_minute.len(), 60);
        assert_eq!((t.per_minute[59], t.per_minute[0]), (3, 2));
        assert_eq!(t.total(), 5);
    }
}
