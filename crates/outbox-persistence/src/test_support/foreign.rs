//! Rows written the way other code writes them: a plain `INSERT` in a transaction of its own,
//! bypassing enqueue's per-record lock, with a `CreatedDate` older than now (so a row can
//! commit behind younger rows of its record), sleeping inside its transaction before and after
//! the insert, sometimes rolling back. The fault suite runs them beside its workers
//! (`outbox-demo foreign`) so that the heads table meets out-of-order writers under kills and
//! cuts; see `docs/queries.md`, "Why a head cannot hide a row".

use std::time::Duration;

use chrono::Utc;

use crate::{Database, Result, new_event_id, truncate_micros};

/// One foreign write.
#[derive(Debug, Clone)]
pub struct ForeignWrite<'a> {
    /// `EventType`.
    pub event_type: &'a str,
    /// `RecordKey` as stored (already folded).
    pub record_key: &'a str,
    /// `Payload`.
    pub payload: &'a str,
    /// How far before now its `CreatedDate` (and `LastModifiedDate`) lies.
    pub created_back: Duration,
    /// Sleep inside the transaction before the insert.
    pub before: Duration,
    /// Sleep inside the transaction after the insert.
    pub after: Duration,
    /// Roll the transaction back instead of committing it.
    pub rollback: bool,
}

const PG_INSERT: &str = "INSERT INTO _System_OutboxEvent
      (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
    SELECT $1, $2, $3, 'pending', 0, $4, t, t
    FROM (SELECT clock_timestamp() - make_interval(secs => $5::float8 / 1000000) AS t) c";

const SQLITE_INSERT: &str = "INSERT INTO _System_OutboxEvent
      (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
    VALUES (?1, ?2, ?3, 'pending', 0, ?4, ?5, ?5)";

/// Writes `write` as other code would; returns whether it committed.
pub async fn foreign_write(db: &Database, write: &ForeignWrite<'_>) -> Result<bool> {
    let id = new_event_id();
    match db {
        Database::Postgres(pool) => {
            let mut tx = pool.begin().await?;
            tokio::time::sleep(write.before).await;
            crate::statement::query(PG_INSERT)
                .bind(id)
                .bind(write.event_type)
                .bind(write.payload)
                .bind(write.record_key)
                .bind(write.created_back.as_micros() as f64)
                .execute(&mut *tx)
                .await?;
            tokio::time::sleep(write.after).await;
            finish(tx, write.rollback).await
        }
        Database::Sqlite(pool) => {
            let created =
                Utc::now() - chrono::Duration::from_std(write.created_back).unwrap_or_default();
            let mut tx = pool.begin().await?;
            tokio::time::sleep(write.before).await;
            crate::statement::query(SQLITE_INSERT)
                .bind(id.to_string())
                .bind(write.event_type)
                .bind(write.payload)
                .bind(write.record_key)
                .bind(crate::sqlite::format_ts(truncate_micros(created)))
                .execute(&mut *tx)
                .await?;
            tokio::time::sleep(write.after).await;
            finish(tx, write.rollback).await
        }
    }
}

async fn finish<DB: sqlx::Database>(tx: sqlx::Transaction<'_, DB>, rollback: bool) -> Result<bool> {
    if rollback {
        tx.rollback().await?;
        Ok(false)
    } else {
        tx.commit().await?;
        Ok(true)
    }
}

/// The record keys of the outbox's rows (at most `limit`, any status): the records foreign
/// writers write for.
pub async fn record_keys(db: &Database, limit: u32) -> Result<Vec<String>> {
    const SQL: &str = "SELECT DISTINCT RecordKey FROM _System_OutboxEvent
        WHERE RecordKey IS NOT NULL ORDER BY RecordKey LIMIT $1";
    Ok(match db {
        Database::Postgres(pool) => {
            let mut tx = super::read(pool).await?;
            crate::statement::query_scalar(SQL)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?
        }
        Database::Sqlite(pool) => {
            crate::statement::query_scalar(SQL)
                .bind(i64::from(limit))
                .fetch_all(pool)
                .await?
        }
    })
}
