//! The macros that run one body of SQL on either backend: over an open transaction
//! ([`crate::with_tx!`]), a connection of a database ([`crate::with_conn!`]) or its pool
//! ([`crate::with_pool!`]). Exported at the crate's root.

/// Runs `body` with `$conn` bound to the connection of a [`Tx`](crate::Tx), on either backend. Write the
/// SQL once with `$1`-style parameters (both backends accept them) when it is portable:
///
/// ```text
/// let n = outbox_persistence::with_tx!(ctx.tx(), |conn| {
///     sqlx::query("UPDATE Account SET Name = $1 WHERE Id = $2")
///         .bind(name).bind(id).execute(conn).await.map(|r| r.rows_affected())
/// })?;
/// ```
#[macro_export]
macro_rules! with_tx {
    ($tx:expr, |$conn:ident| $body:expr) => {
        match $tx {
            $crate::Tx::Postgres(tx) => {
                let $conn: &mut $crate::sqlx::PgConnection = &mut **tx;
                $body
            }
            $crate::Tx::Sqlite(tx) => {
                let $conn: &mut $crate::sqlx::SqliteConnection = &mut **tx;
                $body
            }
        }
    };
}

/// Runs `body` (an expression that evaluates to a `Result<T, sqlx::Error>`, using `$conn`
/// once as its executor) on a connection of a [`Database`](crate::Database): on PostgreSQL inside a READ
/// COMMITTED transaction of its own, committed when `body` succeeded (so it is safe behind a
/// transaction pooler, where a statement outside a transaction block is not), on SQLite on the
/// pool. Evaluates to `body`'s result. Use it with [`statement`](crate::statement)'s constructors.
#[macro_export]
macro_rules! with_conn {
    ($db:expr, |$conn:ident| $body:expr) => {
        match $db {
            $crate::Database::Postgres(p) => {
                match p.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED").await {
                    Err(e) => Err(e),
                    Ok(mut tx) => {
                        let result = {
                            let $conn: &mut $crate::sqlx::PgConnection = &mut *tx;
                            $body
                        };
                        match result {
                            Ok(value) => tx.commit().await.map(|()| value),
                            Err(e) => Err(e),
                        }
                    }
                }
            }
            $crate::Database::Sqlite(p) => {
                let $conn: &$crate::sqlx::SqlitePool = p;
                $body
            }
        }
    };
}

/// Runs `body` with `$pool` bound to the pool of a [`Database`](crate::Database), on either backend.
#[macro_export]
macro_rules! with_pool {
    ($db:expr, |$pool:ident| $body:expr) => {
        match $db {
            $crate::Database::Postgres(p) => {
                let $pool: &$crate::sqlx::PgPool = p;
                $body
            }
            $crate::Database::Sqlite(p) => {
                let $pool: &$crate::sqlx::SqlitePool = p;
                $body
            }
        }
    };
}
