//! The simulated mail provider: an external system the demo's welcome email reaches. Its writes
//! are outside the attempt transaction (they do not roll back with it), and it deduplicates by
//! the idempotency key the sender passes, counting the duplicates it absorbed. It also keeps one
//! row per send with the attempt that sent it (`DemoMailSend`), so that verification can tell a
//! send repeated within one attempt from a redelivery after a counted failure.
//!
//! On PostgreSQL it lives in the same database, written on a connection of its own. On SQLite,
//! whose single writer the attempt holds, it lives in a sibling file (`PATH-mailbox.db`).
//!
//! The same side store keeps the attempt journal and the work runs (see [`super::journal`]),
//! written outside the attempt transaction so that a rolled-back or killed attempt still leaves
//! its rows behind.

use std::collections::HashMap;

use anyhow::Result;
use outbox_persistence::{ConnectConfig, Database, with_conn, with_pool};

/// Begins a transaction on the pool `$pool` of either backend: READ COMMITTED on PostgreSQL
/// (a database whose default is SERIALIZABLE would otherwise fail the provider's upsert now and
/// then, charging a welcome email's attempt for it), SQLite's default there.
macro_rules! begin_demo {
    ($pool:expr) => {
        $crate::sink::Begin::begin_demo($pool).await
    };
}

/// How the side store begins a transaction on each backend.
pub(crate) trait Begin {
    /// The transaction's type.
    type Tx;
    /// Begins it.
    async fn begin_demo(&self) -> Result<Self::Tx, sqlx::Error>;
}

impl Begin for sqlx::PgPool {
    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;
    async fn begin_demo(&self) -> Result<Self::Tx, sqlx::Error> {
        self.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
    }
}

impl Begin for sqlx::SqlitePool {
    type Tx = sqlx::Transaction<'static, sqlx::Sqlite>;
    async fn begin_demo(&self) -> Result<Self::Tx, sqlx::Error> {
        self.begin().await
    }
}

/// The side store's tables on PostgreSQL, besides the inbox (`super::schema::MAILBOX`).
const SIDE_TABLES_POSTGRES: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS DemoMailSend (
        Seq BIGSERIAL PRIMARY KEY, IdempotencyKey TEXT NOT NULL, RetryCount INTEGER NOT NULL,
        Pid BIGINT NOT NULL, Claim TEXT NOT NULL DEFAULT '')",
    "CREATE TABLE IF NOT EXISTS DemoAttemptJournal (
        Seq BIGSERIAL PRIMARY KEY, Mark TEXT NOT NULL, EventId TEXT NOT NULL,
        RetryCount INTEGER NOT NULL, Pid BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS DemoWorkRun (
        RunId BIGSERIAL PRIMARY KEY, Pid BIGINT NOT NULL, Mode TEXT NOT NULL,
        Completed BIGINT NOT NULL DEFAULT 0, Claimed BIGINT NOT NULL DEFAULT 0,
        LostClaims BIGINT NOT NULL DEFAULT 0, StaleReclaims BIGINT NOT NULL DEFAULT 0,
        Cancelled BIGINT NOT NULL DEFAULT 0)",
];

/// Adds `DemoMailSend.Claim` to a side store created before it: PostgreSQL skips it when
/// present; SQLite reports a duplicate column, which `MailSink::open` ignores.
const ADD_CLAIM_POSTGRES: &str =
    "ALTER TABLE DemoMailSend ADD COLUMN IF NOT EXISTS Claim TEXT NOT NULL DEFAULT ''";
const ADD_CLAIM_SQLITE: &str = "ALTER TABLE DemoMailSend ADD COLUMN Claim TEXT NOT NULL DEFAULT ''";

/// The side store's tables on SQLite.
const SIDE_TABLES_SQLITE: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS DemoMailSend (
        Seq INTEGER PRIMARY KEY AUTOINCREMENT, IdempotencyKey TEXT NOT NULL,
        RetryCount INTEGER NOT NULL, Pid BIGINT NOT NULL, Claim TEXT NOT NULL DEFAULT '')",
    "CREATE TABLE IF NOT EXISTS DemoAttemptJournal (
        Seq INTEGER PRIMARY KEY AUTOINCREMENT, Mark TEXT NOT NULL, EventId TEXT NOT NULL,
        RetryCount INTEGER NOT NULL, Pid BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS DemoWorkRun (
        RunId INTEGER PRIMARY KEY AUTOINCREMENT, Pid BIGINT NOT NULL, Mode TEXT NOT NULL,
        Completed BIGINT NOT NULL DEFAULT 0, Claimed BIGINT NOT NULL DEFAULT 0,
        LostClaims BIGINT NOT NULL DEFAULT 0, StaleReclaims BIGINT NOT NULL DEFAULT 0,
        Cancelled BIGINT NOT NULL DEFAULT 0)",
];

/// One send the provider received.
#[derive(Debug, Clone)]
pub struct Send {
    /// The idempotency key (the event id).
    pub key: String,
    /// The sending attempt's `RetryCount`.
    pub retry_count: i32,
    /// The sending attempt's claim (the `LastModifiedDate` its claim wrote): an event given
    /// back uncounted after its handler ran runs again with the same `RetryCount` under a new
    /// claim.
    pub claim: String,
    /// The sending process.
    pub pid: i64,
}

/// The provider's inbox.
#[derive(Clone, Debug)]
pub struct MailSink {
    pub(super) db: Database,
}

/// Where the side store is reached instead of the outbox's URL, when set: the fault suite's
/// processes whose outbox connections go through its COMMIT-reply-losing proxy reach their
/// side store (the journal and work runs the verification reads, and the mail provider)
/// directly, so that the lost replies hit the outbox's transactions and the evidence stays
/// exact.
pub const SIDE_URL_ENV: &str = "OUTBOX_DEMO_SIDE_URL";

/// The sink's URL for an outbox database URL.
fn sink_url(url: &str) -> String {
    if let Some(side) = std::env::var(SIDE_URL_ENV).ok().filter(|u| !u.is_empty()) {
        return side;
    }
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
        if let Database::Postgres(_) = &db {
            // Created already (by `seed` or an earlier run): create nothing, so that a role
            // without `CREATE` on the schema (docs/deployment.md, the worker role) can work.
            let present: bool = with_conn!(&db, |conn| {
                outbox_persistence::statement::query_scalar(
                    "SELECT to_regclass('demomailbox') IS NOT NULL
                        AND to_regclass('demomailsend') IS NOT NULL
                        AND to_regclass('demoattemptjournal') IS NOT NULL
                        AND to_regclass('demoworkrun') IS NOT NULL
                        AND EXISTS (SELECT 1 FROM information_schema.columns
                                    WHERE table_name = 'demomailsend' AND column_name = 'claim')",
                )
                .fetch_one(conn)
                .await
            })?;
            if present {
                return Ok(Self { db });
            }
        }
        with_conn!(&db, |pool| outbox_persistence::statement::query(
            super::schema::MAILBOX
        )
        .execute(pool)
        .await
        .map(|_| ()))?;
        let tables = match &db {
            Database::Postgres(_) => SIDE_TABLES_POSTGRES,
            Database::Sqlite(_) => SIDE_TABLES_SQLITE,
        };
        for sql in tables {
            with_conn!(&db, |pool| outbox_persistence::statement::query(*sql)
                .execute(pool)
                .await
                .map(|_| ()))?;
        }
        // A side store created before sends recorded their claim gains the column (SQLite
        // has no `ADD COLUMN IF NOT EXISTS`: a column already there is an error to ignore).
        let add = match &db {
            Database::Postgres(_) => ADD_CLAIM_POSTGRES,
            Database::Sqlite(_) => ADD_CLAIM_SQLITE,
        };
        let added = with_conn!(&db, |pool| outbox_persistence::statement::query(add)
            .execute(pool)
            .await
            .map(|_| ()));
        if let Err(e) = added
            && !e.to_string().contains("duplicate column")
        {
            return Err(e.into());
        }
        Ok(Self { db })
    }

    /// Delivers one email sent by the attempt at `retry_count`; a repeated idempotency key is
    /// absorbed and counted. Each send is also recorded with its attempt and process.
    ///
    /// A send whose reply is lost (a connection cut or a restart while it committed) is asked
    /// about by its key, as a client asks a provider that honours idempotency keys: one that
    /// landed is a success, so that the sender does not repeat a send it made. A send that did
    /// not land (not found three times over about 0.3 s), or whose fate stays unknown for
    /// about 30 s, is an error.
    pub async fn send(
        &self,
        idempotency_key: &str,
        attempt: (i32, &str),
        recipient: &str,
        subject: &str,
    ) -> Result<()> {
        let Err(error) = self
            .deliver(idempotency_key, attempt, recipient, subject)
            .await
        else {
            return Ok(());
        };
        // A server still finishing the commit of a cut connection shows the send a moment
        // later: "not there" counts after three looks over about 0.3 s.
        let (mut backoff, mut absent) = (std::time::Duration::from_millis(50), 0);
        for _ in 0..12 {
            match self.landed(idempotency_key, attempt).await {
                Ok(true) => return Ok(()),
                Ok(false) => {
                    absent += 1;
                    if absent == 3 {
                        return Err(error);
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
                }
                Err(_) => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
                }
            }
        }
        Err(error)
    }

    /// Whether this process's send of `idempotency_key` by `attempt` reached the provider.
    async fn landed(
        &self,
        idempotency_key: &str,
        (retry_count, claim): (i32, &str),
    ) -> Result<bool> {
        let found: Option<i64> = with_conn!(&self.db, |pool| {
            outbox_persistence::statement::query_scalar(
                "SELECT Seq FROM DemoMailSend
                 WHERE IdempotencyKey = $1 AND RetryCount = $2 AND Claim = $3 AND Pid = $4",
            )
            .bind(idempotency_key)
            .bind(retry_count)
            .bind(claim)
            .bind(i64::from(std::process::id()))
            .fetch_optional(pool)
            .await
        })?;
        Ok(found.is_some())
    }

    async fn deliver(
        &self,
        idempotency_key: &str,
        (retry_count, claim): (i32, &str),
        recipient: &str,
        subject: &str,
    ) -> Result<()> {
        // The delivery and its record land together: a send is never half recorded.
        with_pool!(&self.db, |pool| {
            async {
            // READ COMMITTED on PostgreSQL whatever the database's default: `begin_demo!`.
            let mut tx = begin_demo!(pool)?;
            outbox_persistence::statement::query(
                "INSERT INTO DemoMailbox (IdempotencyKey, Recipient, Subject, Deliveries)
                 VALUES ($1, $2, $3, 1)
                 ON CONFLICT (IdempotencyKey) DO UPDATE SET Deliveries = DemoMailbox.Deliveries + 1",
            )
            .bind(idempotency_key)
            .bind(recipient)
            .bind(subject)
            .execute(&mut *tx)
            .await?;
            outbox_persistence::statement::query(
                "INSERT INTO DemoMailSend (IdempotencyKey, RetryCount, Pid, Claim) VALUES ($1, $2, $3, $4)",
            )
            .bind(idempotency_key)
            .bind(retry_count)
            .bind(i64::from(std::process::id()))
            .bind(claim)
            .execute(&mut *tx)
            .await?;
            tx.commit().await
        }
        .await
        })?;
        Ok(())
    }

    /// Every send the provider received, in order.
    pub async fn sends(&self) -> Result<Vec<Send>> {
        let rows: Vec<(String, i32, String, i64)> = with_conn!(&self.db, |pool| {
            outbox_persistence::statement::query_as(
                "SELECT IdempotencyKey, RetryCount, Claim, Pid FROM DemoMailSend ORDER BY Seq",
            )
            .fetch_all(pool)
            .await
        })?;
        Ok(rows
            .into_iter()
            .map(|(key, retry_count, claim, pid)| Send {
                key,
                retry_count,
                claim,
                pid,
            })
            .collect())
    }

    /// Every idempotency key received, with how many times it was sent.
    pub async fn deliveries(&self) -> Result<HashMap<String, i64>> {
        let rows: Vec<(String, i64)> = with_conn!(&self.db, |pool| {
            outbox_persistence::statement::query_as(
                "SELECT IdempotencyKey, Deliveries FROM DemoMailbox",
            )
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
