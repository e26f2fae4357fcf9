//! The SQLite dialect: numbered placeholders, and reads by registered type.
//!
//! SQLite stores JSON and timestamps as text and booleans as 0 or 1; values are bound as such
//! and converted back by their registered type, so both backends return the same shape.

use serde_json::{Map, Value};
use sqlx::query::Query;
use sqlx::sqlite::{SqliteArguments, SqliteRow};
use sqlx::{Row, Sqlite, SqliteConnection, ValueRef};

use crate::conn::Statement;
use crate::registry::{Column, ColumnType};
use crate::value::BindValue;
use crate::{Error, Result};

/// The placeholder of parameter `n`.
pub(crate) fn placeholder(n: usize) -> String {
    format!("?{n}")
}

/// The select-list expression reading `column`.
pub(crate) fn select_expr(column: &Column) -> String {
    column.name().quoted()
}

fn query(stmt: &Statement) -> Query<'static, Sqlite, SqliteArguments> {
    let mut q = sqlx::query(sqlx::AssertSqlSafe(stmt.sql.clone()));
    for value in &stmt.binds {
        q = match value {
            BindValue::Null(_) => q.bind(None::<String>),
            BindValue::Text(s) | BindValue::Json(s) | BindValue::Timestamp(s) => q.bind(s.clone()),
            BindValue::Integer(i) => q.bind(*i),
            BindValue::Real(f) => q.bind(*f),
            BindValue::Boolean(b) => q.bind(*b),
        };
    }
    q
}

fn decode_error(column: &Column, e: impl std::fmt::Display) -> Error {
    Error::Decode {
        column: column.name().to_string(),
        reason: e.to_string(),
    }
}

fn decode_row(row: &SqliteRow, columns: &[&Column]) -> Result<Map<String, Value>> {
    let mut out = Map::new();
    for (i, column) in columns.iter().enumerate() {
        let value = if row.try_get_raw(i)?.is_null() {
            Value::Null
        } else {
            // The storage class may differ from the declared type (SQLite is dynamically
            // typed), so values are converted by the registered type, as SQLite would.
            match column.ty() {
                ColumnType::Text | ColumnType::Timestamp => {
                    Value::String(row.try_get_unchecked::<String, _>(i)?)
                }
                ColumnType::Integer => Value::from(row.try_get_unchecked::<i64, _>(i)?),
                ColumnType::Real => Value::from(row.try_get_unchecked::<f64, _>(i)?),
                ColumnType::Boolean => Value::Bool(row.try_get_unchecked::<i64, _>(i)? != 0),
                ColumnType::Json => {
                    let text = row.try_get_unchecked::<String, _>(i)?;
                    serde_json::from_str(&text).map_err(|e| decode_error(column, e))?
                }
            }
        };
        out.insert(column.name().to_string(), value);
    }
    Ok(out)
}

pub(crate) async fn fetch_optional_row(
    conn: &mut SqliteConnection,
    stmt: &Statement,
    columns: &[&Column],
) -> Result<Option<Map<String, Value>>> {
    match query(stmt).fetch_optional(conn).await? {
        Some(row) => Ok(Some(decode_row(&row, columns)?)),
        None => Ok(None),
    }
}

pub(crate) async fn fetch_optional_i64(
    conn: &mut SqliteConnection,
    stmt: &Statement,
) -> Result<Option<i64>> {
    match query(stmt).fetch_optional(conn).await? {
        Some(row) => Ok(Some(row.try_get::<i64, _>(0)?)),
        None => Ok(None),
    }
}

pub(crate) async fn execute(conn: &mut SqliteConnection, stmt: &Statement) -> Result<u64> {
    Ok(query(stmt).execute(conn).await?.rows_affected())
}
