//! The connections actions run on ([`ActionConn`]), and the statements they send.
//!
//! An action runs on whatever connection it is given, inside the transaction the caller has
//! open there (the outbox attempt's). Each backend has its own module with its own SQL where the
//! dialects differ ([`crate::postgres`], [`crate::sqlite`]); the algorithms are written once
//! over [`AnyConn`].

use serde_json::{Map, Value};
use sqlx::{Connection, PgConnection, Postgres, Sqlite, SqliteConnection, Transaction};

use crate::registry::Column;
use crate::value::BindValue;
use crate::{Result, postgres, sqlite};

/// Which database an action runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// PostgreSQL, the production backend.
    Postgres,
    /// SQLite, the embedded default.
    Sqlite,
}

impl Backend {
    /// The backend's name (`postgres` or `sqlite`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::PgConnection {}
    impl Sealed for sqlx::SqliteConnection {}
    impl Sealed for super::AnyConn<'_> {}
}

/// A connection an action can run on: `sqlx::PgConnection` or `sqlx::SqliteConnection` (pass
/// `&mut *tx` for an open `sqlx::Transaction`). Sealed: the actions know exactly these two
/// dialects.
pub trait ActionConn: Send + sealed::Sealed {
    /// The connection's backend.
    fn backend(&self) -> Backend;

    /// The connection as a backend-tagged reference, for a handler's own SQL.
    fn any(&mut self) -> AnyConn<'_>;
}

impl ActionConn for PgConnection {
    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    fn any(&mut self) -> AnyConn<'_> {
        AnyConn::Postgres(self)
    }
}

impl ActionConn for SqliteConnection {
    fn backend(&self) -> Backend {
        Backend::Sqlite
    }

    fn any(&mut self) -> AnyConn<'_> {
        AnyConn::Sqlite(self)
    }
}

impl ActionConn for AnyConn<'_> {
    fn backend(&self) -> Backend {
        match self {
            AnyConn::Postgres(_) => Backend::Postgres,
            AnyConn::Sqlite(_) => Backend::Sqlite,
        }
    }

    fn any(&mut self) -> AnyConn<'_> {
        match self {
            AnyConn::Postgres(c) => AnyConn::Postgres(c),
            AnyConn::Sqlite(c) => AnyConn::Sqlite(c),
        }
    }
}

/// A connection of either backend, borrowed.
pub enum AnyConn<'c> {
    /// A PostgreSQL connection.
    Postgres(&'c mut PgConnection),
    /// A SQLite connection.
    Sqlite(&'c mut SqliteConnection),
}

impl AnyConn<'_> {
    pub(crate) async fn fetch_optional_row(
        &mut self,
        stmt: &Statement,
        columns: &[&Column],
    ) -> Result<Option<Map<String, Value>>> {
        match self {
            AnyConn::Postgres(c) => postgres::fetch_optional_row(c, stmt, columns).await,
            AnyConn::Sqlite(c) => sqlite::fetch_optional_row(c, stmt, columns).await,
        }
    }

    pub(crate) async fn fetch_optional_i64(&mut self, stmt: &Statement) -> Result<Option<i64>> {
        match self {
            AnyConn::Postgres(c) => postgres::fetch_optional_i64(c, stmt).await,
            AnyConn::Sqlite(c) => sqlite::fetch_optional_i64(c, stmt).await,
        }
    }

    pub(crate) async fn execute(&mut self, stmt: &Statement) -> Result<u64> {
        match self {
            AnyConn::Postgres(c) => postgres::execute(c, stmt).await,
            AnyConn::Sqlite(c) => sqlite::execute(c, stmt).await,
        }
    }

    /// A savepoint inside the open transaction, or a transaction when none is open. Dropping
    /// it without commit rolls it back (sqlx queues the rollback), so a cancelled action
    /// leaves nothing behind.
    pub(crate) async fn begin_nested(&mut self) -> Result<Nested<'_>> {
        Ok(match self {
            AnyConn::Postgres(c) => Nested::Postgres(c.begin().await?),
            AnyConn::Sqlite(c) => Nested::Sqlite(c.begin().await?),
        })
    }
}

/// A savepoint (or a transaction) opened by [`AnyConn::begin_nested`].
pub(crate) enum Nested<'c> {
    Postgres(Transaction<'c, Postgres>),
    Sqlite(Transaction<'c, Sqlite>),
}

impl Nested<'_> {
    pub(crate) fn conn(&mut self) -> AnyConn<'_> {
        match self {
            Nested::Postgres(tx) => AnyConn::Postgres(tx),
            Nested::Sqlite(tx) => AnyConn::Sqlite(tx),
        }
    }

    /// Releases the savepoint (or commits the transaction).
    pub(crate) async fn commit(self) -> Result<()> {
        match self {
            Nested::Postgres(tx) => tx.commit().await?,
            Nested::Sqlite(tx) => tx.commit().await?,
        }
        Ok(())
    }

    /// Rolls back to the savepoint (or rolls the transaction back).
    pub(crate) async fn rollback(self) -> Result<()> {
        match self {
            Nested::Postgres(tx) => tx.rollback().await?,
            Nested::Sqlite(tx) => tx.rollback().await?,
        }
        Ok(())
    }
}

/// SQL text built from validated identifiers, with its bound values.
#[derive(Clone, Debug)]
pub(crate) struct Statement {
    backend: Backend,
    pub(crate) sql: String,
    pub(crate) binds: Vec<BindValue>,
}

impl Statement {
    pub(crate) fn new(backend: Backend) -> Self {
        Self {
            backend,
            sql: String::new(),
            binds: Vec::new(),
        }
    }

    /// Appends SQL text. Callers pass only constant text and [`crate::Ident::quoted`] names.
    pub(crate) fn push(&mut self, sql: &str) -> &mut Self {
        self.sql.push_str(sql);
        self
    }

    /// Binds `value` and appends its placeholder.
    pub(crate) fn bind(&mut self, value: BindValue) -> &mut Self {
        let n = self.binds.len() + 1;
        let placeholder = match self.backend {
            Backend::Postgres => postgres::placeholder(n, value.ty()),
            Backend::Sqlite => sqlite::placeholder(n),
        };
        self.sql.push_str(&placeholder);
        self.binds.push(value);
        self
    }

    /// Appends the select list that reads `columns` back in their registered types.
    pub(crate) fn push_select_list(&mut self, columns: &[&Column]) -> &mut Self {
        for (i, column) in columns.iter().enumerate() {
            if i > 0 {
                self.sql.push_str(", ");
            }
            let expr = match self.backend {
                Backend::Postgres => postgres::select_expr(column),
                Backend::Sqlite => sqlite::select_expr(column),
            };
            self.sql.push_str(&expr);
        }
        self
    }
}
