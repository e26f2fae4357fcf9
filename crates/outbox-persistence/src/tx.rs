//! [`Tx`]: an open transaction on either backend.

use crate::{Error, Result};

/// An open transaction on either backend: the application's own (for `enqueue` next to its
/// record write) or an attempt's (for a handler's effects).
pub enum Tx {
    /// A PostgreSQL transaction.
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
    /// A SQLite transaction.
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
}

impl Tx {
    /// The backend's name, for messages.
    pub fn backend_name(&self) -> &'static str {
        match self {
            Tx::Postgres(_) => "postgres",
            Tx::Sqlite(_) => "sqlite",
        }
    }

    /// Commits the transaction.
    pub async fn commit(self) -> Result<()> {
        match self {
            Tx::Postgres(tx) => tx.commit().await?,
            Tx::Sqlite(tx) => tx.commit().await?,
        }
        Ok(())
    }

    /// Rolls the transaction back.
    pub async fn rollback(self) -> Result<()> {
        match self {
            Tx::Postgres(tx) => tx.rollback().await?,
            Tx::Sqlite(tx) => tx.rollback().await?,
        }
        Ok(())
    }

    /// The PostgreSQL connection, or [`Error::BackendMismatch`].
    pub(crate) fn postgres(&mut self) -> Result<&mut sqlx::PgConnection> {
        match self {
            Tx::Postgres(tx) => Ok(&mut **tx),
            other => Err(Error::BackendMismatch {
                expected: "postgres",
                given: other.backend_name(),
            }),
        }
    }

    /// The SQLite connection, or [`Error::BackendMismatch`].
    pub(crate) fn sqlite(&mut self) -> Result<&mut sqlx::SqliteConnection> {
        match self {
            Tx::Sqlite(tx) => Ok(&mut **tx),
            other => Err(Error::BackendMismatch {
                expected: "sqlite",
                given: other.backend_name(),
            }),
        }
    }
}

/// Whether the table `name` (lower case, as PostgreSQL folds an unquoted name) exists, read in
/// `tx` (on PostgreSQL on its search path).
pub(crate) async fn table_exists(tx: &mut Tx, name: &str) -> crate::Result<bool> {
    let exists = match tx {
        Tx::Postgres(tx) => {
            crate::statement::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(name)
                .fetch_one(&mut **tx)
                .await?
        }
        Tx::Sqlite(tx) => {
            crate::statement::query_scalar::<_, i64>(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table'
                 AND name = $1 COLLATE NOCASE",
            )
            .bind(name)
            .fetch_one(&mut **tx)
            .await?
                == 1
        }
    };
    Ok(exists)
}
