//! The simulated mail provider: an external system the demo's welcome email reaches. Its writes
//! are outside the attempt transaction (they do not roll back with it), and it deduplicates by
//! the idempotency key the sender passes, counting the duplicates it absorbed.
//!
//! On PostgreSQL it lives in the same database, written on a connection of its own. On SQLite,
//! whose single writer the attempt holds, it lives in a sibling file (`PATH-mailbox.db`).
//!
//! The same side store keeps the slow handler's attempt journal: a row when a slow attempt
//! starts and its finish time when its sleep ends, written outside the attempt transaction so
//! that a rolled-back or killed attempt still leaves its start behind.

use std::collections::HashMap;

use anyhow::Result;
use outbox_persistence::{ConnectConfig, Database, with_pool};

/// The slow handler's attempt journal on PostgreSQL.
const SLOW_ATTEMPTS_POSTGRES: &str = "CREATE TABLE IF NOT EXISTS DemoSlowAttempt (
    Seq BIGSERIAL PRIMARY KEY, EventId TEXT NOT NULL, RetryCount INTEGER NOT NULL,
    Pid BIGINT NOT NULL, StartedMs BIGINT NOT NULL, FinishedMs BIGINT)";

/// The slow handler's attempt journal on SQLite.
const SLOW_ATTEMPTS_SQLITE: &str = "CREATE TABLE IF NOT EXISTS DemoSlowAttempt (
    Seq INTEGER PRIMARY KEY AUTOINCREMENT, EventId TEXT NOT NULL, RetryCount INTEGER NOT NULL,
    Pid BIGINT NOT NULL, StartedMs BIGINT NOT NULL, FinishedMs BIGINT)";

/// One journaled slow attempt.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SlowAttempt {
    /// The event.
    pub event_id: String,
    /// The row's `RetryCount` when the attempt ran.
    pub retry_count: i32,
    /// The process that ran it.
    pub pid: i64,
    /// When its handler started (Unix milliseconds).
    pub started_ms: i64,
    /// When its sleep ended; `None` when the attempt died first (killed or cancelled).
    pub finished_ms: Option<i64>,
}

/// The provider's inbox.
#[derive(Clone, Debug)]
pub struct MailSink {
    db: Database,
}

/// The sink's URL for an outbox database URL.
fn sink_url(url: &str) -> String {
    if url.starts_with("sqlite:") {
        match url.split_once('?') {
            Some((path, query)) => format!("{path}-mailbox.db?{query}"),
            None => format!("{url}-mailbox.db"),
        }
    } else {
        url.to_string()
    }
}

impl MailSink {
    /// Opens (and creates when missing) the provider inbox that belongs to the outbox database
    /// at `url`.
    pub async fn open(url: &str) -> Result<Self> {
        let db = Database::connect(&sink_url(url), ConnectConfig::default()).await?;
        with_pool!(&db, |pool| sqlx::query(super::schema::MAILBOX)
            .execute(pool)
            .await
            .map(|_| ()))?;
        let journal = match &db {
            Database::Postgres(_) => SLOW_ATTEMPTS_POSTGRES,
            Database::Sqlite(_) => SLOW_ATTEMPTS_SQLITE,
        };
        with_pool!(&db, |pool| sqlx::query(journal)
            .execute(pool)
            .await
            .map(|_| ()))?;
        Ok(Self { db })
    }

    /// Journals the start of a slow attempt by this process; returns the journal row's id.
    pub async fn slow_started(&self, event_id: &str, retry_count: i32) -> Result<i64> {
        let now = chrono::Utc::now().timestamp_millis();
        let pid = i64::from(std::process::id());
        Ok(with_pool!(&self.db, |pool| {
            sqlx::query_scalar(
                "INSERT INTO DemoSlowAttempt (EventId, RetryCount, Pid, StartedMs)
                 VALUES ($1, $2, $3, $4) RETURNING Seq",
            )
            .bind(event_id)
            .bind(retry_count)
            .bind(pid)
            .bind(now)
            .fetch_one(pool)
            .await
        })?)
    }

    /// Journals the end of a slow attempt's sleep.
    pub async fn slow_finished(&self, seq: i64) -> Result<()> {
        let now = chrono::Utc::now().timestamp_millis();
        with_pool!(&self.db, |pool| {
            sqlx::query("UPDATE DemoSlowAttempt SET FinishedMs = $1 WHERE Seq = $2")
                .bind(now)
                .bind(seq)
                .execute(pool)
                .await
                .map(|_| ())
        })?;
        Ok(())
    }

    /// Every journaled slow attempt, in start order.
    pub async fn slow_attempts(&self) -> Result<Vec<SlowAttempt>> {
        let rows: Vec<(String, i32, i64, i64, Option<i64>)> = with_pool!(&self.db, |pool| {
            sqlx::query_as(
                "SELECT EventId, RetryCount, Pid, StartedMs, FinishedMs FROM DemoSlowAttempt
                 ORDER BY StartedMs, Seq",
            )
            .fetch_all(pool)
            .await
        })?;
        Ok(rows
            .into_iter()
            .map(|r| SlowAttempt {
                event_id: r.0,
                retry_count: r.1,
                pid: r.2,
                started_ms: r.3,
                finished_ms: r.4,
            })
            .collect())
    }

    /// Delivers one email; a repeated idempotency key is absorbed and counted.
    pub async fn send(&self, idempotency_key: &str, recipient: &str, subject: &str) -> Result<()> {
        with_pool!(&self.db, |pool| {
            sqlx::query(
                "INSERT INTO DemoMailbox (IdempotencyKey, Recipient, Subject, Deliveries)
                 VALUES ($1, $2, $3, 1)
                 ON CONFLICT (IdempotencyKey) DO UPDATE SET Deliveries = DemoMailbox.Deliveries + 1",
            )
            .bind(idempotency_key)
            .bind(recipient)
            .bind(subject)
            .execute(pool)
            .await
            .map(|_| ())
        })?;
        Ok(())
    }

    /// Every idempotency key received, with how many times it was sent.
    pub async fn deliveries(&self) -> Result<HashMap<String, i64>> {
        let rows: Vec<(String, i64)> = with_pool!(&self.db, |pool| {
            sqlx::query_as("SELECT IdempotencyKey, Deliveries FROM DemoMailbox")
                .fetch_all(pool)
                .await
        })?;
        Ok(rows.into_iter().collect())
    }

    /// Closes the sink's own pool (SQLite) .
    pub async fn close(&self) {
        if matches!(self.db, Database::Sqlite(_)) {
            self.db.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_sink_is_a_sibling_file() {
        assert_eq!(
            sink_url("sqlite:///tmp/x.db"),
            "sqlite:///tmp/x.db-mailbox.db"
        );
        assert_eq!(
            sink_url("sqlite:x.db?mode=rwc"),
            "sqlite:x.db-mailbox.db?mode=rwc"
        );
        assert_eq!(sink_url("postgres://u@h/db"), "postgres://u@h/db");
    }
}
