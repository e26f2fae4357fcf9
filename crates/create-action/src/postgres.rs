//! The PostgreSQL dialect: typed placeholders, typed read-back, and the bindings.
//!
//! Every placeholder carries an explicit cast to its column type, so a statement is prepared
//! with the same types whatever the values, and text-encoded types (JSON, timestamps) are
//! converted by the server. Reads cast back to the registered type; timestamps are read as
//! RFC 3339 UTC text so both backends return the same shape.

use serde_json::{Map, Value};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgConnection, Postgres, Row};

use crate::conn::Statement;
use crate::registry::{Column, ColumnType};
use crate::value::BindValue;
use crate::{Error, Result};

/// The placeholder of parameter `n`, cast to `ty`.
pub(crate) fn placeholder(n: usize, ty: ColumnType) -> String {
    let cast = match ty {
        ColumnType::Text => "text",
        ColumnType::Integer => "int8",
        ColumnType::Real => "float8",
        ColumnType::Boolean => "bool",
        ColumnType::Json => "jsonb",
        ColumnType::Timestamp => "timestamptz",
    };
    format!("${n}::{cast}")
}

/// The select-list expression reading `column` back in its registered type.
pub(crate) fn select_expr(column: &Column) -> String {
    let name = column.name().quoted();
    match column.ty() {
        ColumnType::Text => format!("{name}::text"),
        ColumnType::Integer => format!("{name}::int8"),
        ColumnType::Real => format!("{name}::float8"),
        ColumnType::Boolean => format!("{name}::bool"),
        ColumnType::Json => format!("{name}::jsonb::text"),
        ColumnType::Timestamp => format!(
            "to_char({name}::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
        ),
    }
}

fn query(stmt: &Statement) -> Query<'static, Postgres, PgArguments> {
    let mut q = outbox_persistence::statement::query(sqlx::AssertSqlSafe(stmt.sql.clone()));
    for value in &stmt.binds {
        q = match value {
            BindValue::Null(ColumnType::Integer) => q.bind(None::<i64>),
            BindValue::Null(ColumnType::Real) => q.bind(None::<f64>),
            BindValue::Null(ColumnType::Boolean) => q.bind(None::<bool>),
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

fn decode_row(row: &PgRow, columns: &[&Column]) -> Result<Map<String, Value>> {
    let mut out = Map::new();
    for (i, column) in columns.iter().enumerate() {
        let value = match column.ty() {
            ColumnType::Text | ColumnType::Timestamp => {
                row.try_get::<Option<String>, _>(i)?.map(Value::String)
            }
            ColumnType::Integer => row.try_get::<Option<i64>, _>(i)?.map(Value::from),
            ColumnType::Real => row.try_get::<Option<f64>, _>(i)?.map(Value::from),
            ColumnType::Boolean => row.try_get::<Option<bool>, _>(i)?.map(Value::Bool),
            ColumnType::Json => match row.try_get::<Option<String>, _>(i)? {
                Some(text) => {
                    Some(serde_json::from_str(&text).map_err(|e| decode_error(column, e))?)
                }
                None => None,
            },
        };
        out.insert(column.name().to_string(), value.unwrap_or(Value::Null));
    }
    Ok(out)
}

pub(crate) async fn fetch_optional_row(
    conn: &mut PgConnection,
    stmt: &Statement,
    columns: &[&Column],
) -> Result<Option<Map<String, Value>>> {
    match query(stmt).fetch_optional(conn).await? {
        Some(row) => Ok(Some(decode_row(&row, columns)?)),
        None => Ok(None),
    }
}

pub(crate) async fn fetch_optional_i64(
    conn: &mut PgConnection,
    stmt: &Statement,
) -> Result<Option<i64>> {
    match query(stmt).fetch_optional(conn).await? {
        Some(row) => Ok(Some(row.try_get::<i64, _>(0)?)),
        None => Ok(None),
    }
}

pub(crate) async fn execute(conn: &mut PgConnection, stmt: &Statement) -> Result<u64> {
    Ok(query(stmt).execute(conn).await?.rows_affected())
}
