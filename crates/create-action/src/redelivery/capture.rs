//! Captures of the database between deliveries: the rows of each captured table and every
//! autonumber counter, read through one connection of the kit's pool.

use std::collections::BTreeMap;

use serde_json::Value;
use sqlx::{PgConnection, Row, SqliteConnection, ValueRef};

use super::error::KitError;
use super::pool::Pool;
use super::report::CapturedRow;
use crate::Ident;

/// A table to capture, with its identity columns (`None`: the primary key).
pub(super) struct CaptureSpec {
    /// The table.
    pub(super) table: Ident,
    /// The columns that identify a row, when not the primary key.
    pub(super) identity: Option<Vec<Ident>>,
}

/// The captured state: the rows of each table and every autonumber counter.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Capture {
    /// Table (lower case) to its rows.
    pub(super) tables: BTreeMap<String, TableCapture>,
    /// `(ObjectName, FieldName)` to `NextValue`.
    pub(super) counters: BTreeMap<(String, String), i64>,
}

/// The rows of one table.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct TableCapture {
    /// Identity columns (lower case); empty means the whole row.
    pub(super) identity: Vec<String>,
    /// Every row, column names in lower case.
    pub(super) rows: Vec<CapturedRow>,
}

/// Reads the tables of `specs` and the autonumber counters.
pub(super) async fn capture(pool: &Pool, specs: &[CaptureSpec]) -> Result<Capture, KitError> {
    match pool {
        Pool::Postgres(pool) => {
            // One snapshot, in a transaction (behind a transaction pooler a statement outside
            // one is not safe); read only, rolled back when dropped.
            let mut tx = pool
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED, READ ONLY")
                .await?;
            capture_postgres(&mut tx, specs).await
        }
        Pool::Sqlite(pool) => capture_sqlite(&mut *pool.acquire().await?, specs).await,
    }
}

/// The counters table's rows, as `(ObjectName, FieldName)` to `NextValue`.
type Counters = BTreeMap<(String, String), i64>;

const COUNTERS: &str = "SELECT ObjectName, FieldName, NextValue FROM _System_Autonumber";

fn counters_of(rows: Vec<(String, String, i64)>) -> Counters {
    rows.into_iter().map(|(o, f, v)| ((o, f), v)).collect()
}

async fn capture_postgres(
    conn: &mut PgConnection,
    specs: &[CaptureSpec],
) -> Result<Capture, KitError> {
    let mut out = Capture::default();
    for spec in specs {
        let table = postgres_table(conn, spec).await?;
        out.tables.insert(spec.table.folded(), table);
    }
    let counters_exist: bool = outbox_persistence::statement::query_scalar(
        "SELECT to_regclass('_system_autonumber') IS NOT NULL",
    )
    .fetch_one(&mut *conn)
    .await?;
    if counters_exist {
        out.counters = counters_of(
            outbox_persistence::statement::query_as(COUNTERS)
                .fetch_all(&mut *conn)
                .await?,
        );
    }
    Ok(out)
}

/// One PostgreSQL table: its identity (the primary key unless given) and its rows, each read
/// as `to_jsonb` so that every column type comes back as JSON.
async fn postgres_table(
    conn: &mut PgConnection,
    spec: &CaptureSpec,
) -> Result<TableCapture, KitError> {
    let quoted = spec.table.quoted();
    let exists: bool =
        outbox_persistence::statement::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(&quoted)
            .fetch_one(&mut *conn)
            .await?;
    if !exists {
        return Err(KitError::UnknownTable(spec.table.to_string()));
    }
    let identity = match &spec.identity {
        Some(columns) => columns.iter().map(Ident::folded).collect(),
        None => {
            outbox_persistence::statement::query_scalar(
                "SELECT a.attname::text FROM pg_index i
                 JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
                 WHERE i.indrelid = to_regclass($1) AND i.indisprimary
                 ORDER BY array_position(i.indkey::int2[], a.attnum)",
            )
            .bind(&quoted)
            .fetch_all(&mut *conn)
            .await?
        }
    };
    let sql = format!("SELECT to_jsonb(t)::text FROM {quoted} AS t");
    let texts: Vec<String> = outbox_persistence::statement::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(&mut *conn)
        .await?;
    let mut rows = Vec::with_capacity(texts.len());
    for text in texts {
        let row: serde_json::Map<String, Value> =
            serde_json::from_str(&text).map_err(|source| KitError::Decode {
                table: spec.table.to_string(),
                source,
            })?;
        rows.push(lowercase_keys(row));
    }
    Ok(TableCapture { identity, rows })
}

fn lowercase_keys(row: serde_json::Map<String, Value>) -> CapturedRow {
    row.into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect()
}

async fn capture_sqlite(
    conn: &mut SqliteConnection,
    specs: &[CaptureSpec],
) -> Result<Capture, KitError> {
    let mut out = Capture::default();
    for spec in specs {
        let table = sqlite_table(conn, spec).await?;
        out.tables.insert(spec.table.folded(), table);
    }
    let counters_exist: bool = outbox_persistence::statement::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_System_Autonumber' COLLATE NOCASE)",
    )
    .fetch_one(&mut *conn)
    .await?;
    if counters_exist {
        out.counters = counters_of(
            outbox_persistence::statement::query_as(COUNTERS)
                .fetch_all(&mut *conn)
                .await?,
        );
    }
    Ok(out)
}

/// One SQLite table: its identity (the primary key unless given) and its rows.
async fn sqlite_table(
    conn: &mut SqliteConnection,
    spec: &CaptureSpec,
) -> Result<TableCapture, KitError> {
    let columns: Vec<(String, i64)> = outbox_persistence::statement::query_as(
        "SELECT name, pk FROM pragma_table_info(?1) ORDER BY cid",
    )
    .bind(spec.table.folded())
    .fetch_all(&mut *conn)
    .await?;
    if columns.is_empty() {
        return Err(KitError::UnknownTable(spec.table.to_string()));
    }
    let identity = match &spec.identity {
        Some(columns) => columns.iter().map(Ident::folded).collect(),
        None => {
            let mut pk: Vec<_> = columns.iter().filter(|(_, pk)| *pk > 0).collect();
            pk.sort_by_key(|(_, pk)| *pk);
            pk.into_iter()
                .map(|(c, _)| c.to_ascii_lowercase())
                .collect()
        }
    };
    let sql = format!("SELECT * FROM {}", spec.table.quoted());
    let fetched = outbox_persistence::statement::query(sqlx::AssertSqlSafe(sql))
        .fetch_all(&mut *conn)
        .await?;
    let rows = fetched
        .iter()
        .map(sqlite_row)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(TableCapture { identity, rows })
}

/// One SQLite row as JSON, each value by its storage class, not the declared type: SQLite is
/// dynamically typed. A blob becomes its lower-case hex text.
fn sqlite_row(row: &sqlx::sqlite::SqliteRow) -> Result<CapturedRow, sqlx::Error> {
    use sqlx::Column as _;
    let mut captured = CapturedRow::new();
    for (i, column) in row.columns().iter().enumerate() {
        let raw = row.try_get_raw(i)?;
        let value = if raw.is_null() {
            Value::Null
        } else {
            match raw.type_info().to_string().as_str() {
                "INTEGER" => Value::from(row.try_get_unchecked::<i64, _>(i)?),
                "REAL" => Value::from(row.try_get_unchecked::<f64, _>(i)?),
                "BLOB" => Value::from(
                    row.try_get_unchecked::<Vec<u8>, _>(i)?
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>(),
                ),
                _ => Value::String(row.try_get_unchecked::<String, _>(i)?),
            }
        };
        captured.insert(column.name().to_ascii_lowercase(), value);
    }
    Ok(captured)
}
