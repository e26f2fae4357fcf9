//! Reading the outbox table whole, payloads included, and auditing every change of
//! `RetryCount`: what the demo's verification and the fault suite check invariants with.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{Database, Result};

/// The table the retry audit writes (one row per change of `RetryCount`).
pub const RETRY_AUDIT_TABLE: &str = "TestSupportRetryAudit";

/// One outbox row, every column a verification reads (the payload too: verification compares
/// effects with the payload they came from). Its `Debug` leaves the payload out.
#[derive(Clone)]
pub struct StoredRow {
    /// `Id`.
    pub id: Uuid,
    /// `EventType`.
    pub event_type: String,
    /// `Status`.
    pub status: String,
    /// `RecordKey`, as stored.
    pub record_key: Option<String>,
    /// `CreatedDate`.
    pub created: DateTime<Utc>,
    /// `Payload`.
    pub payload: String,
    /// `RetryCount`.
    pub retry_count: i32,
    /// `LastError`.
    pub last_error: Option<String>,
}

impl std::fmt::Debug for StoredRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredRow")
            .field("id", &self.id)
            .field("event_type", &self.event_type)
            .field("status", &self.status)
            .field("record_key", &self.record_key)
            .field("created", &self.created)
            .field("payload", &format_args!("<{} bytes>", self.payload.len()))
            .field("retry_count", &self.retry_count)
            .field("last_error", &self.last_error)
            .finish()
    }
}

const ALL_ROWS: &str = "SELECT Id, EventType, Status, RecordKey, CreatedDate, Payload, RetryCount, LastError \
     FROM _System_OutboxEvent ORDER BY CreatedDate, Id";

/// `(Id, EventType, Status, RecordKey, CreatedDate, Payload, RetryCount, LastError)`.
type Columns<I, T> = (
    I,
    String,
    String,
    Option<String>,
    T,
    String,
    i32,
    Option<String>,
);

/// Every row of the outbox table, oldest first.
pub async fn all_rows(db: &Database) -> Result<Vec<StoredRow>> {
    let row = |(id, event_type, status, record_key, created, payload, retry_count, last_error)| {
        StoredRow {
            id,
            event_type,
            status,
            record_key,
            created,
            payload,
            retry_count,
            last_error,
        }
    };
    match db {
        Database::Postgres(pool) => {
            let mut tx = super::read(pool).await?;
            let rows: Vec<Columns<Uuid, DateTime<Utc>>> = crate::statement::query_as(ALL_ROWS)
                .fetch_all(&mut *tx)
                .await?;
            Ok(rows.into_iter().map(row).collect())
        }
        Database::Sqlite(pool) => {
            let rows: Vec<Columns<String, String>> =
                crate::statement::query_as(ALL_ROWS).fetch_all(pool).await?;
            rows.into_iter()
                .map(|r| {
                    let id = Uuid::parse_str(&r.0)
                        .map_err(|e| decode(format!("row id {:?} is not a UUID: {e}", r.0)))?;
                    let created = DateTime::parse_from_rfc3339(&r.4)
                        .map_err(|e| decode(format!("CreatedDate {:?} of {id}: {e}", r.4)))?
                        .with_timezone(&Utc);
                    Ok(row((id, r.1, r.2, r.3, created, r.5, r.6, r.7)))
                })
                .collect()
        }
    }
}

fn audit_missing() -> crate::Error {
    decode(format!(
        "the retry audit ({RETRY_AUDIT_TABLE}) is not installed in this database (install_retry_audit)"
    ))
}

fn decode(message: String) -> crate::Error {
    crate::Error::Database(sqlx::Error::Decode(message.into()))
}

/// `sum(RetryCount)` over the whole table.
pub async fn retry_count_sum(db: &Database) -> Result<i64> {
    const SQL: &str =
        "SELECT CAST(coalesce(sum(RetryCount), 0) AS BIGINT) FROM _System_OutboxEvent";
    Ok(match db {
        Database::Postgres(pool) => {
            let mut tx = super::read(pool).await?;
            crate::statement::query_scalar(SQL)
                .fetch_one(&mut *tx)
                .await?
        }
        Database::Sqlite(pool) => crate::statement::query_scalar(SQL).fetch_one(pool).await?,
    })
}

/// The rows the throughput rollup (`_System_OutboxThroughput`, the console's chart) counts as
/// processed, over every minute it keeps (a day).
pub async fn rollup_total(db: &Database) -> Result<i64> {
    const SQL: &str =
        "SELECT CAST(coalesce(sum(Processed), 0) AS BIGINT) FROM _System_OutboxThroughput";
    scalar(db, SQL).await
}

/// The rows that ended `processed` since one cutoff 23 hours back (a whole minute, UTC), by
/// their `LastModifiedDate`, and what the rollup counts from that minute on, read in one
/// statement (one cutoff for both): the span the rollup surely keeps whole (it trims after a
/// day). The two agree on a database whose every row in that span ended through the outbox's
/// settles (PostgreSQL) or while the trigger existed (SQLite); not within 23 hours of
/// migration 0016 (0009 on SQLite) on a database that had processed rows before it, nor
/// after a prune within the span.
pub async fn rollup_against_rows(db: &Database) -> Result<(i64, i64)> {
    const PG: &str = "WITH c AS (
          SELECT date_trunc('minute', (clock_timestamp() - interval '23 hours') AT TIME ZONE 'UTC')
                 AT TIME ZONE 'UTC' AS t)
        SELECT (SELECT coalesce(sum(r.Processed), 0)::bigint
                FROM _System_OutboxThroughput r, c WHERE r.Minute >= c.t),
               (SELECT count(*) FROM _System_OutboxEvent e, c
                WHERE e.Status = 'processed' AND e.LastModifiedDate >= c.t)";
    const SQLITE: &str = "SELECT
          (SELECT CAST(coalesce(sum(Processed), 0) AS BIGINT) FROM _System_OutboxThroughput
           WHERE Minute >= strftime('%Y-%m-%dT%H:%M', 'now', '-23 hours')),
          (SELECT count(*) FROM _System_OutboxEvent
           WHERE Status = 'processed'
             AND substr(LastModifiedDate, 1, 16) >= strftime('%Y-%m-%dT%H:%M', 'now', '-23 hours'))";
    Ok(match db {
        Database::Postgres(pool) => {
            let mut tx = super::read(pool).await?;
            crate::statement::query_as(PG).fetch_one(&mut *tx).await?
        }
        Database::Sqlite(pool) => crate::statement::query_as(SQLITE).fetch_one(pool).await?,
    })
}

/// One `BIGINT` read.
async fn scalar(db: &Database, sql: &'static str) -> Result<i64> {
    Ok(match db {
        Database::Postgres(pool) => {
            let mut tx = super::read(pool).await?;
            crate::statement::query_scalar(sql)
                .fetch_one(&mut *tx)
                .await?
        }
        Database::Sqlite(pool) => crate::statement::query_scalar(sql).fetch_one(pool).await?,
    })
}

/// The record key of a random pending row of `event_type` that has failed fewer than
/// `max_retry_count` times: the fault injection locks that record's own row to provoke lock
/// timeouts without using up one event's attempts.
pub async fn random_pending_key(
    db: &Database,
    event_type: &str,
    max_retry_count: i32,
) -> Result<Option<String>> {
    const PG: &str = "SELECT RecordKey FROM _System_OutboxEvent
        WHERE Status = 'pending' AND EventType = $1 AND RetryCount < $2
        ORDER BY random() LIMIT 1";
    const SQLITE: &str = "SELECT RecordKey FROM _System_OutboxEvent
        WHERE Status = 'pending' AND EventType = ?1 AND RetryCount < ?2
        ORDER BY random() LIMIT 1";
    Ok(match db {
        Database::Postgres(pool) => {
            let mut tx = super::read(pool).await?;
            crate::statement::query_scalar(PG)
                .bind(event_type)
                .bind(max_retry_count)
                .fetch_optional(&mut *tx)
                .await?
                .flatten()
        }
        Database::Sqlite(pool) => crate::statement::query_scalar(SQLITE)
            .bind(event_type)
            .bind(max_retry_count)
            .fetch_optional(pool)
            .await?
            .flatten(),
    })
}

/// One change of `RetryCount`, as the audit trigger recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryAudit {
    /// The row's `Id` (as text).
    pub event_id: String,
    /// `RetryCount` before the change.
    pub old_retry_count: i32,
    /// `RetryCount` after it.
    pub new_retry_count: i32,
    /// `LastError` after it.
    pub last_error: Option<String>,
}

const POSTGRES_AUDIT: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS TestSupportRetryAudit (
        Seq BIGSERIAL PRIMARY KEY, EventId TEXT NOT NULL, OldRetryCount INTEGER NOT NULL,
        NewRetryCount INTEGER NOT NULL, Status TEXT NOT NULL, LastError TEXT)",
    "CREATE OR REPLACE FUNCTION test_support_retry_audit() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO TestSupportRetryAudit (EventId, OldRetryCount, NewRetryCount, Status, LastError)
        VALUES (NEW.Id::text, OLD.RetryCount, NEW.RetryCount, NEW.Status, NEW.LastError);
        RETURN NULL;
    END;
    $$",
    "CREATE OR REPLACE TRIGGER test_support_retry_audit AFTER UPDATE OF RetryCount ON _System_OutboxEvent
        FOR EACH ROW WHEN (NEW.RetryCount IS DISTINCT FROM OLD.RetryCount)
        EXECUTE FUNCTION test_support_retry_audit()",
];

const SQLITE_AUDIT: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS TestSupportRetryAudit (
        Seq INTEGER PRIMARY KEY AUTOINCREMENT, EventId TEXT NOT NULL, OldRetryCount INTEGER NOT NULL,
        NewRetryCount INTEGER NOT NULL, Status TEXT NOT NULL, LastError TEXT)",
    "CREATE TRIGGER IF NOT EXISTS test_support_retry_audit AFTER UPDATE OF RetryCount ON _System_OutboxEvent
        FOR EACH ROW WHEN NEW.RetryCount IS NOT OLD.RetryCount
        BEGIN
            INSERT INTO TestSupportRetryAudit (EventId, OldRetryCount, NewRetryCount, Status, LastError)
            VALUES (NEW.Id, OLD.RetryCount, NEW.RetryCount, NEW.Status, NEW.LastError);
        END",
];

/// Installs the retry audit when missing: a trigger that records every change of `RetryCount`
/// in [`RETRY_AUDIT_TABLE`], in the transaction that made it (so no crash can separate a count
/// from its audit row). Processes starting together may all call it: on PostgreSQL it is
/// installed once (concurrent `CREATE OR REPLACE` of one function fails).
pub async fn install_retry_audit(db: &Database) -> Result<()> {
    match db {
        Database::Postgres(pool) => {
            let mut tx = super::read(pool).await?;
            let exists: bool = crate::statement::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'test_support_retry_audit')",
            )
            .fetch_one(&mut *tx)
            .await?;
            drop(tx);
            if !exists {
                for sql in POSTGRES_AUDIT {
                    let mut tx = super::read(pool).await?;
                    crate::statement::query(*sql).execute(&mut *tx).await?;
                    tx.commit().await?;
                }
            }
        }
        Database::Sqlite(pool) => {
            for sql in SQLITE_AUDIT {
                crate::statement::query(*sql).execute(pool).await?;
            }
        }
    }
    Ok(())
}

/// Every audited change of `RetryCount`, in the order the changes committed; an error when
/// the audit was never installed (a verification without it would prove nothing).
pub async fn retry_audit(db: &Database) -> Result<Vec<RetryAudit>> {
    const SQL: &str = "SELECT EventId, OldRetryCount, NewRetryCount, LastError \
                       FROM TestSupportRetryAudit ORDER BY Seq";
    type AuditRow = (String, i32, i32, Option<String>);
    let rows: Vec<AuditRow> = match db {
        Database::Postgres(pool) => {
            let mut tx = super::read(pool).await?;
            let exists: bool = crate::statement::query_scalar(
                "SELECT to_regclass('testsupportretryaudit') IS NOT NULL",
            )
            .fetch_one(&mut *tx)
            .await?;
            if !exists {
                return Err(audit_missing());
            }
            crate::statement::query_as(SQL).fetch_all(&mut *tx).await?
        }
        Database::Sqlite(pool) => {
            let exists: bool = crate::statement::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'TestSupportRetryAudit')",
            )
            .fetch_one(pool)
            .await?;
            if !exists {
                return Err(audit_missing());
            }
            crate::statement::query_as(SQL).fetch_all(pool).await?
        }
    };
    Ok(rows
        .into_iter()
        .map(|(event_id, old, new, last_error)| RetryAudit {
            event_id,
            old_retry_count: old,
            new_retry_count: new,
            last_error,
        })
        .collect())
}
