//! sqlx's statement constructors, for code beside the outbox that must also work behind a
//! transaction pooler (a handler's writes in the attempt transaction, an application's
//! statements in its enqueue transaction, the demo and test tooling): the same signatures as
//! `sqlx::query`, `sqlx::query_as` and `sqlx::query_scalar`, with `persistent` set to
//! [`crate::postgres::caches_statements`], so the statement is sent unnamed once any pool of the
//! process was declared behind a transaction pooler (docs/deployment.md). On SQLite, and on a
//! direct PostgreSQL connection, they behave as sqlx's do.
//!
//! A statement behind a transaction pooler must also run inside a transaction: see
//! [`crate::with_conn!`] for statements that would otherwise run on the pool.

use sqlx::database::HasStatementCache;
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{Database, FromRow, SqlSafeStr};

use crate::postgres::caches_statements;

/// `sqlx::query`, unnamed behind a transaction pooler.
pub fn query<'a, DB: Database + HasStatementCache>(
    sql: impl SqlSafeStr,
) -> Query<'a, DB, <DB as Database>::Arguments> {
    sqlx::query(sql).persistent(caches_statements())
}

/// `sqlx::query_as`, unnamed behind a transaction pooler.
pub fn query_as<'q, DB, O>(sql: impl SqlSafeStr) -> QueryAs<'q, DB, O, <DB as Database>::Arguments>
where
    DB: Database + HasStatementCache,
    O: for<'r> FromRow<'r, DB::Row>,
{
    sqlx::query_as(sql).persistent(caches_statements())
}

/// `sqlx::query_scalar`, unnamed behind a transaction pooler.
pub fn query_scalar<'q, DB, O>(
    sql: impl SqlSafeStr,
) -> QueryScalar<'q, DB, O, <DB as Database>::Arguments>
where
    DB: Database + HasStatementCache,
    (O,): for<'r> FromRow<'r, DB::Row>,
{
    sqlx::query_scalar(sql).persistent(caches_statements())
}
