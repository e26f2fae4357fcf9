//! The simulated mail provider: an external system the demo's welcome email reaches. Its writes
//! are outside the attempt transaction (they do not roll back with it), and it deduplicates by
//! the idempotency key the sender passes, counting the duplicates it absorbed.
//!
//! On PostgreSQL it lives in the same database, written on a connection of its own. On SQLite,
//! whose single writer the attempt holds, it lives in a sibling file (`PATH-mailbox.db`).

use std::collections::HashMap;

use anyhow::Result;
use outbox_persistence::{ConnectConfig, Database, with_pool};

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
        Ok(Self { db })
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
