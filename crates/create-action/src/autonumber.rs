//! Gap-free autonumbers from the transactional counter table `_System_Autonumber`.
//!
//! A draw is one upsert that increments the counter row of `(ObjectName, FieldName)` inside the
//! caller's transaction and returns the value drawn. The row stays locked until that transaction
//! ends, so a value drawn by a transaction that rolls back (entirely, or to a savepoint around
//! the draw) is handed out again: nothing is burned, at the price of serialising the creators of
//! one object (see `docs/create-action.md`).
//!
//! Counter keys are the folded (lower-case) object and field names, the names the database
//! stores for them, so two registrations that differ only in case share one counter.

use crate::conn::{ActionConn, AnyConn, Backend, Statement};
use crate::value::BindValue;
use crate::{Ident, Result};

/// The counter table, as the migrations spell it.
pub const AUTONUMBER_TABLE: &str = "_System_Autonumber";

const DRAW_POSTGRES: &str = "\
INSERT INTO _System_Autonumber AS a (ObjectName, FieldName, NextValue) VALUES ($1, $2, 2)
ON CONFLICT (ObjectName, FieldName) DO UPDATE SET NextValue = a.NextValue + 1
RETURNING NextValue - 1";

const DRAW_SQLITE: &str = "\
INSERT INTO _System_Autonumber (ObjectName, FieldName, NextValue) VALUES (?1, ?2, 2)
ON CONFLICT (ObjectName, FieldName) DO UPDATE SET NextValue = NextValue + 1
RETURNING NextValue - 1";

const NEXT_POSTGRES: &str =
    "SELECT NextValue FROM _System_Autonumber WHERE ObjectName = $1 AND FieldName = $2";

const NEXT_SQLITE: &str =
    "SELECT NextValue FROM _System_Autonumber WHERE ObjectName = ?1 AND FieldName = ?2";

fn statement(backend: Backend, sql: &str, object: &Ident, field: &Ident) -> Statement {
    let mut stmt = Statement::new(backend);
    stmt.push(sql);
    stmt.binds = vec![
        BindValue::Text(object.folded()),
        BindValue::Text(field.folded()),
    ];
    stmt
}

/// Draws the next value of `object.field` in the connection's open transaction. The first draw
/// of a field creates its counter row and returns 1.
pub(crate) async fn draw(conn: &mut AnyConn<'_>, object: &Ident, field: &Ident) -> Result<i64> {
    let backend = conn.backend();
    let sql = match backend {
        Backend::Postgres => DRAW_POSTGRES,
        Backend::Sqlite => DRAW_SQLITE,
    };
    let value = conn
        .fetch_optional_i64(&statement(backend, sql, object, field))
        .await?
        .unwrap_or_default();
    tracing::debug!(object = %object, field = %field, value, "autonumber drawn");
    Ok(value)
}

/// The value the next draw of `object.field` would return, or `None` before its first draw.
/// With no gaps, that is one past the number of values drawn.
pub async fn next_value<C: ActionConn + ?Sized>(
    conn: &mut C,
    object: &str,
    field: &str,
) -> Result<Option<i64>> {
    let (object, field) = (Ident::new(object)?, Ident::new(field)?);
    let mut conn = conn.any();
    let backend = conn.backend();
    let sql = match backend {
        Backend::Postgres => NEXT_POSTGRES,
        Backend::Sqlite => NEXT_SQLITE,
    };
    conn.fetch_optional_i64(&statement(backend, sql, &object, &field))
        .await
}
