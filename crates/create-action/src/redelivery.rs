//! The redelivery test kit: proves that delivering an event again leaves the database as one
//! delivery did.
//!
//! Platform teams call it from their own tests with a handler, an event payload, a database and
//! the tables the handler touches:
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool, action: create_action::FindOrCreate) -> create_action::Result<()> {
//! use create_action::{ActionConn, redelivery::Redelivery};
//! use record_key::EventEnvelope;
//!
//! let handler = async |conn: &mut dyn ActionConn, payload: &serde_json::Value| {
//!     let event = EventEnvelope::from_value(payload.clone()).map_err(create_action::Error::InvalidPayload)?;
//!     action.run(conn, &event).await.map(drop)
//! };
//! let payload = serde_json::json!({"object": "Lead", "record_id": "00Q1", "snapshot": {}});
//! let report = Redelivery::new(pool)
//!     .capture("Opportunity")
//!     .check(&handler, &payload)
//!     .await?;
//! report.assert_idempotent();
//! # Ok(())
//! # }
//! ```
//!
//! [`Redelivery::check`] delivers the event once (a committed transaction, opened the way the
//! outbox attempt opens it), captures the tables and the autonumber counters, delivers it a
//! second time, captures again, then delivers it twice concurrently from two connections and
//! captures a third time. The [`Report`] lists every difference between consecutive captures:
//! a changed value (table, row, column: before -> after), an inserted, deleted or duplicated
//! row, a moved autonumber counter, or a redelivery that failed.

use std::collections::BTreeMap;
use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::str::FromStr;
use std::task::Poll;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{PgConnection, PgPool, Row, SqliteConnection, SqlitePool, ValueRef};

use crate::error::BoxError;
use crate::{ActionConn, Error, Ident, Result};

/// A connection pool of either backend, for the kit. It needs two connections at once for the
/// concurrent redelivery.
#[derive(Clone, Debug)]
pub enum Pool {
    /// A PostgreSQL pool.
    Postgres(PgPool),
    /// A SQLite pool.
    Sqlite(SqlitePool),
}

impl Pool {
    /// Connects to `postgres://…` or `sqlite:…` (the SQLite file must exist).
    pub async fn connect(url: &str) -> Result<Self> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Pool::Postgres(
                PgPoolOptions::new().max_connections(4).connect(url).await?,
            ))
        } else if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)?;
            Ok(Pool::Sqlite(
                SqlitePoolOptions::new()
                    .max_connections(4)
                    .connect_with(options)
                    .await?,
            ))
        } else {
            Err(Error::InvalidUrl(
                "expected postgres://… or sqlite:…".to_string(),
            ))
        }
    }
}

impl From<PgPool> for Pool {
    fn from(pool: PgPool) -> Self {
        Pool::Postgres(pool)
    }
}

impl From<SqlitePool> for Pool {
    fn from(pool: SqlitePool) -> Self {
        Pool::Sqlite(pool)
    }
}

/// The handler under test: runs an event's effects on the connection of an open transaction.
/// Implemented for every `async |conn: &mut dyn ActionConn, payload: &Value| -> Result<(), E>`
/// closure whose error converts into a boxed error (this crate's `Error`, `anyhow::Error`, …).
#[async_trait(?Send)]
pub trait EventHandler {
    /// Runs the effects of the event with `payload`.
    async fn handle(&self, conn: &mut dyn ActionConn, payload: &Value) -> Result<(), BoxError>;
}

#[async_trait(?Send)]
impl<F, E> EventHandler for F
where
    F: AsyncFn(&mut dyn ActionConn, &Value) -> Result<(), E>,
    E: Into<BoxError>,
{
    async fn handle(&self, conn: &mut dyn ActionConn, payload: &Value) -> Result<(), BoxError> {
        self(conn, payload).await.map_err(Into::into)
    }
}

/// Which deliveries a difference lies between.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Before and after the first delivery (what the event is meant to do; not a finding).
    FirstDelivery,
    /// After the first and after the second delivery.
    Redelivery,
    /// After the second delivery and after two concurrent deliveries.
    ConcurrentRedelivery,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::FirstDelivery => "the first delivery",
            Phase::Redelivery => "the second delivery",
            Phase::ConcurrentRedelivery => "two concurrent deliveries",
        })
    }
}

/// A captured row: column (lower case) to value.
pub type CapturedRow = BTreeMap<String, Value>;

/// One way the database differs between two captures.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Difference {
    /// A row appeared.
    RowInserted {
        /// When.
        phase: Phase,
        /// The table (lower case).
        table: String,
        /// The row's identity, as `column=value` pairs.
        identity: String,
        /// The new row.
        row: CapturedRow,
    },
    /// A row disappeared.
    RowDeleted {
        /// When.
        phase: Phase,
        /// The table (lower case).
        table: String,
        /// The row's identity, as `column=value` pairs.
        identity: String,
        /// The old row.
        row: CapturedRow,
    },
    /// More (or fewer) rows share one identity than before: a duplicate create when the
    /// identity is the natural key.
    RowDuplicated {
        /// When.
        phase: Phase,
        /// The table (lower case).
        table: String,
        /// The shared identity, as `column=value` pairs.
        identity: String,
        /// Rows with this identity before.
        before: usize,
        /// Rows with this identity after.
        after: usize,
    },
    /// A column of one row changed.
    ValueChanged {
        /// When.
        phase: Phase,
        /// The table (lower case).
        table: String,
        /// The row's identity, as `column=value` pairs.
        identity: String,
        /// The column (lower case).
        column: String,
        /// The value before.
        before: Value,
        /// The value after.
        after: Value,
    },
    /// An autonumber counter moved: a value was drawn.
    CounterMoved {
        /// When.
        phase: Phase,
        /// The counter's object (folded).
        object: String,
        /// The counter's field (folded).
        field: String,
        /// `NextValue` before (`None`: no counter row yet).
        before: Option<i64>,
        /// `NextValue` after (`None`: the counter row is gone).
        after: Option<i64>,
    },
    /// A redelivery failed (its transaction was rolled back).
    DeliveryFailed {
        /// When.
        phase: Phase,
        /// The error and its causes.
        error: String,
    },
}

impl Difference {
    /// The deliveries this difference lies between.
    pub fn phase(&self) -> Phase {
        match self {
            Difference::RowInserted { phase, .. }
            | Difference::RowDeleted { phase, .. }
            | Difference::RowDuplicated { phase, .. }
            | Difference::ValueChanged { phase, .. }
            | Difference::CounterMoved { phase, .. }
            | Difference::DeliveryFailed { phase, .. } => *phase,
        }
    }

    /// The table (lower case), for row differences; `_system_autonumber` for counters.
    pub fn table(&self) -> Option<&str> {
        match self {
            Difference::RowInserted { table, .. }
            | Difference::RowDeleted { table, .. }
            | Difference::RowDuplicated { table, .. }
            | Difference::ValueChanged { table, .. } => Some(table),
            Difference::CounterMoved { .. } => Some("_system_autonumber"),
            Difference::DeliveryFailed { .. } => None,
        }
    }

    /// The changed column (lower case), for [`Difference::ValueChanged`].
    pub fn column(&self) -> Option<&str> {
        match self {
            Difference::ValueChanged { column, .. } => Some(column),
            _ => None,
        }
    }
}

fn show_row(row: &CapturedRow) -> String {
    serde_json::to_string(row).unwrap_or_default()
}

fn show_counter(value: Option<i64>) -> String {
    value.map_or_else(|| "none".to_string(), |v| v.to_string())
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "after {}: ", self.phase())?;
        match self {
            Difference::RowInserted {
                table,
                identity,
                row,
                ..
            } => write!(f, "{table} [{identity}]: row inserted {}", show_row(row)),
            Difference::RowDeleted {
                table,
                identity,
                row,
                ..
            } => write!(f, "{table} [{identity}]: row deleted {}", show_row(row)),
            Difference::RowDuplicated {
                table,
                identity,
                before,
                after,
                ..
            } => write!(
                f,
                "{table} [{identity}]: duplicated row: {before} -> {after} rows with this identity"
            ),
            Difference::ValueChanged {
                table,
                identity,
                column,
                before,
                after,
                ..
            } => write!(
                f,
                "{table} [{identity}] column {column}: {before} -> {after}"
            ),
            Difference::CounterMoved {
                object,
                field,
                before,
                after,
                ..
            } => write!(
                f,
                "autonumber {object}.{field} moved: next value {} -> {} (a value was drawn)",
                show_counter(*before),
                show_counter(*after)
            ),
            Difference::DeliveryFailed { error, .. } => write!(f, "the delivery failed: {error}"),
        }
    }
}

/// What [`Redelivery::check`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    first_delivery: Vec<Difference>,
    differences: Vec<Difference>,
}

impl Report {
    /// Every difference a redelivery made: empty when the handler is idempotent.
    pub fn differences(&self) -> &[Difference] {
        &self.differences
    }

    /// What the first delivery changed (for information: that is the event's intended effect).
    pub fn first_delivery(&self) -> &[Difference] {
        &self.first_delivery
    }

    /// Whether the redeliveries left the database as the first delivery did.
    pub fn is_idempotent(&self) -> bool {
        self.differences.is_empty()
    }

    /// Panics with the readable diff unless the handler is idempotent.
    #[track_caller]
    pub fn assert_idempotent(&self) {
        if !self.is_idempotent() {
            panic!("{self}");
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.differences.is_empty() {
            return f.write_str("redelivery left the database unchanged");
        }
        writeln!(
            f,
            "redelivery changed the database ({} difference(s)):",
            self.differences.len()
        )?;
        for difference in &self.differences {
            writeln!(f, "  {difference}")?;
        }
        Ok(())
    }
}

/// The redelivery check of one handler against one database.
#[derive(Clone, Debug)]
#[must_use = "nothing is delivered until `check` is awaited"]
pub struct Redelivery {
    pool: Pool,
    tables: Vec<(String, Option<Vec<String>>)>,
}

impl Redelivery {
    /// A check against `pool`, capturing no table yet (the autonumber counters always are).
    pub fn new(pool: impl Into<Pool>) -> Self {
        Self {
            pool: pool.into(),
            tables: Vec::new(),
        }
    }

    /// Captures `table`, identifying rows by its primary key (by the whole row when it has
    /// none).
    pub fn capture(mut self, table: &str) -> Self {
        self.tables.push((table.to_string(), None));
        self
    }

    /// Captures `table`, identifying rows by `identity` (for example the natural key, so that a
    /// duplicate create shows as a duplicated row rather than an inserted one).
    pub fn capture_by(mut self, table: &str, identity: &[&str]) -> Self {
        self.tables.push((
            table.to_string(),
            Some(identity.iter().map(|c| c.to_string()).collect()),
        ));
        self
    }

    /// Delivers `payload` to `handler` once, then again, then twice concurrently, and reports
    /// every difference the redeliveries made. Fails when a name is not a valid identifier, a
    /// table does not exist, or the first delivery fails.
    pub async fn check<H: EventHandler + ?Sized>(
        &self,
        handler: &H,
        payload: &Value,
    ) -> Result<Report> {
        let specs = self
            .tables
            .iter()
            .map(|(table, identity)| {
                let identity = identity
                    .as_ref()
                    .map(|cols| {
                        cols.iter()
                            .map(|c| Ident::new(c))
                            .collect::<Result<Vec<_>>>()
                    })
                    .transpose()?;
                Ok(CaptureSpec {
                    table: Ident::new(table)?,
                    identity,
                })
            })
            .collect::<Result<Vec<_>>>()?;

        let before = capture(&self.pool, &specs).await?;
        deliver(&self.pool, handler, payload)
            .await
            .map_err(Error::Handler)?;
        let first = capture(&self.pool, &specs).await?;
        let mut differences = Vec::new();

        if let Err(e) = deliver(&self.pool, handler, payload).await {
            differences.push(failed(Phase::Redelivery, &e));
        }
        let second = capture(&self.pool, &specs).await?;
        differences.extend(diff(&first, &second, Phase::Redelivery));

        let (a, b) = join2(
            deliver(&self.pool, handler, payload),
            deliver(&self.pool, handler, payload),
        )
        .await;
        for e in [a.err(), b.err()].into_iter().flatten() {
            differences.push(failed(Phase::ConcurrentRedelivery, &e));
        }
        let third = capture(&self.pool, &specs).await?;
        differences.extend(diff(&second, &third, Phase::ConcurrentRedelivery));

        Ok(Report {
            first_delivery: diff(&before, &first, Phase::FirstDelivery),
            differences,
        })
    }
}

fn failed(phase: Phase, error: &BoxError) -> Difference {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    Difference::DeliveryFailed { phase, error: text }
}

/// One delivery: a committed transaction, opened as the outbox attempt opens it (PostgreSQL
/// `BEGIN`, read committed; SQLite `BEGIN IMMEDIATE`). A failed handler rolls it back.
async fn deliver<H: EventHandler + ?Sized>(
    pool: &Pool,
    handler: &H,
    payload: &Value,
) -> Result<(), BoxError> {
    match pool {
        Pool::Postgres(pool) => {
            let mut tx = pool.begin().await?;
            handler.handle(&mut *tx, payload).await?;
            tx.commit().await?;
        }
        Pool::Sqlite(pool) => {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            handler.handle(&mut *tx, payload).await?;
            tx.commit().await?;
        }
    }
    Ok(())
}

/// Polls two futures on the current task until both are done.
async fn join2<A: Future, B: Future>(a: A, b: B) -> (A::Output, B::Output) {
    let (mut a, mut b) = (pin!(a), pin!(b));
    let (mut ra, mut rb) = (None, None);
    poll_fn(|cx| {
        if ra.is_none()
            && let Poll::Ready(v) = a.as_mut().poll(cx)
        {
            ra = Some(v);
        }
        if rb.is_none()
            && let Poll::Ready(v) = b.as_mut().poll(cx)
        {
            rb = Some(v);
        }
        if ra.is_some() && rb.is_some() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    match (ra, rb) {
        (Some(a), Some(b)) => (a, b),
        _ => unreachable!("poll_fn returned before both futures finished"),
    }
}

struct CaptureSpec {
    table: Ident,
    identity: Option<Vec<Ident>>,
}

/// The captured state: the rows of each table and every autonumber counter.
#[derive(Clone, Debug, Default, PartialEq)]
struct Capture {
    tables: BTreeMap<String, TableCapture>,
    counters: BTreeMap<(String, String), i64>,
}

#[derive(Clone, Debug, Default, PartialEq)]
struct TableCapture {
    /// Identity columns (lower case); empty means the whole row.
    identity: Vec<String>,
    rows: Vec<CapturedRow>,
}

async fn capture(pool: &Pool, specs: &[CaptureSpec]) -> Result<Capture> {
    match pool {
        Pool::Postgres(pool) => capture_postgres(&mut *pool.acquire().await?, specs).await,
        Pool::Sqlite(pool) => capture_sqlite(&mut *pool.acquire().await?, specs).await,
    }
}

fn lowercase_keys(row: serde_json::Map<String, Value>) -> CapturedRow {
    row.into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect()
}

async fn capture_postgres(conn: &mut PgConnection, specs: &[CaptureSpec]) -> Result<Capture> {
    let mut out = Capture::default();
    for spec in specs {
        let quoted = spec.table.quoted();
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(&quoted)
            .fetch_one(&mut *conn)
            .await?;
        if !exists {
            return Err(Error::UnknownTable(spec.table.to_string()));
        }
        let identity = match &spec.identity {
            Some(columns) => columns.iter().map(Ident::folded).collect(),
            None => {
                sqlx::query_scalar(
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
        let texts: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_all(&mut *conn)
            .await?;
        let mut rows = Vec::with_capacity(texts.len());
        for text in texts {
            let row: serde_json::Map<String, Value> =
                serde_json::from_str(&text).map_err(|e| Error::Decode {
                    column: spec.table.to_string(),
                    reason: e.to_string(),
                })?;
            rows.push(lowercase_keys(row));
        }
        out.tables
            .insert(spec.table.folded(), TableCapture { identity, rows });
    }
    let counters_exist: bool =
        sqlx::query_scalar("SELECT to_regclass('_system_autonumber') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    if counters_exist {
        let counters: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT ObjectName, FieldName, NextValue FROM _System_Autonumber")
                .fetch_all(&mut *conn)
                .await?;
        out.counters = counters.into_iter().map(|(o, f, v)| ((o, f), v)).collect();
    }
    Ok(out)
}

async fn capture_sqlite(conn: &mut SqliteConnection, specs: &[CaptureSpec]) -> Result<Capture> {
    let mut out = Capture::default();
    for spec in specs {
        let columns: Vec<(String, i64)> =
            sqlx::query_as("SELECT name, pk FROM pragma_table_info(?1) ORDER BY cid")
                .bind(spec.table.folded())
                .fetch_all(&mut *conn)
                .await?;
        if columns.is_empty() {
            return Err(Error::UnknownTable(spec.table.to_string()));
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
        let fetched = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&mut *conn)
            .await?;
        let mut rows = Vec::with_capacity(fetched.len());
        for row in &fetched {
            let mut captured = CapturedRow::new();
            for (i, column) in row.columns().iter().enumerate() {
                use sqlx::Column as _;
                let raw = row.try_get_raw(i)?;
                let value = if raw.is_null() {
                    Value::Null
                } else {
                    // The value's storage class, not the declared type: SQLite is dynamically
                    // typed.
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
            rows.push(captured);
        }
        out.tables
            .insert(spec.table.folded(), TableCapture { identity, rows });
    }
    let counters_exist: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_System_Autonumber' COLLATE NOCASE)",
    )
    .fetch_one(&mut *conn)
    .await?;
    if counters_exist {
        let counters: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT ObjectName, FieldName, NextValue FROM _System_Autonumber")
                .fetch_all(&mut *conn)
                .await?;
        out.counters = counters.into_iter().map(|(o, f, v)| ((o, f), v)).collect();
    }
    Ok(out)
}

/// A row's identity: its identity columns' values as `column=value` pairs (the whole row when
/// the table has no identity columns).
fn identity_of(identity: &[String], row: &CapturedRow) -> String {
    if identity.is_empty() {
        return show_row(row);
    }
    identity
        .iter()
        .map(|c| format!("{c}={}", row.get(c).unwrap_or(&Value::Null)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every difference from `before` to `after`, in table, identity and column order.
fn diff(before: &Capture, after: &Capture, phase: Phase) -> Vec<Difference> {
    let mut out = Vec::new();
    let empty = TableCapture::default();
    let tables: std::collections::BTreeSet<&String> =
        before.tables.keys().chain(after.tables.keys()).collect();
    for table in tables {
        let b = before.tables.get(table).unwrap_or(&empty);
        let a = after.tables.get(table).unwrap_or(&empty);
        let identity = if a.identity.is_empty() {
            &b.identity
        } else {
            &a.identity
        };
        let group = |capture: &TableCapture| {
            let mut groups: BTreeMap<String, Vec<CapturedRow>> = BTreeMap::new();
            for row in &capture.rows {
                groups
                    .entry(identity_of(identity, row))
                    .or_default()
                    .push(row.clone());
            }
            for rows in groups.values_mut() {
                rows.sort_by_key(show_row);
            }
            groups
        };
        let (gb, ga) = (group(b), group(a));
        let keys: std::collections::BTreeSet<&String> = gb.keys().chain(ga.keys()).collect();
        for key in keys {
            let rb = gb.get(key).map_or(&[][..], Vec::as_slice);
            let ra = ga.get(key).map_or(&[][..], Vec::as_slice);
            let (table, identity) = (table.clone(), key.clone());
            match (rb.len(), ra.len()) {
                (0, _) => out.extend(ra.iter().map(|row| Difference::RowInserted {
                    phase,
                    table: table.clone(),
                    identity: identity.clone(),
                    row: row.clone(),
                })),
                (_, 0) => out.extend(rb.iter().map(|row| Difference::RowDeleted {
                    phase,
                    table: table.clone(),
                    identity: identity.clone(),
                    row: row.clone(),
                })),
                (nb, na) if nb != na => out.push(Difference::RowDuplicated {
                    phase,
                    table,
                    identity,
                    before: nb,
                    after: na,
                }),
                _ => {
                    for (row_b, row_a) in rb.iter().zip(ra) {
                        let columns: std::collections::BTreeSet<&String> =
                            row_b.keys().chain(row_a.keys()).collect();
                        for column in columns {
                            let vb = row_b.get(column).unwrap_or(&Value::Null);
                            let va = row_a.get(column).unwrap_or(&Value::Null);
                            if vb != va {
                                out.push(Difference::ValueChanged {
                                    phase,
                                    table: table.clone(),
                                    identity: identity.clone(),
                                    column: column.clone(),
                                    before: vb.clone(),
                                    after: va.clone(),
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    let counters: std::collections::BTreeSet<&(String, String)> = before
        .counters
        .keys()
        .chain(after.counters.keys())
        .collect();
    for key in counters {
        let (vb, va) = (
            before.counters.get(key).copied(),
            after.counters.get(key).copied(),
        );
        if vb != va {
            out.push(Difference::CounterMoved {
                phase,
                object: key.0.clone(),
                field: key.1.clone(),
                before: vb,
                after: va,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn row(value: Value) -> CapturedRow {
        serde_json::from_value(value).unwrap()
    }

    fn table(identity: &[&str], rows: Vec<Value>) -> TableCapture {
        TableCapture {
            identity: identity.iter().map(|s| s.to_string()).collect(),
            rows: rows.into_iter().map(row).collect(),
        }
    }

    fn capture(tables: Vec<(&str, TableCapture)>, counters: &[(&str, &str, i64)]) -> Capture {
        Capture {
            tables: tables
                .into_iter()
                .map(|(name, t)| (name.to_string(), t))
                .collect(),
            counters: counters
                .iter()
                .map(|(o, f, v)| ((o.to_string(), f.to_string()), *v))
                .collect(),
        }
    }

    #[test]
    fn equal_captures_have_no_difference() {
        let c = capture(
            vec![(
                "lead",
                table(&["id"], vec![json!({"id": 1, "status": "Open"})]),
            )],
            &[("opportunity", "number", 2)],
        );
        assert!(diff(&c, &c.clone(), Phase::Redelivery).is_empty());
    }

    #[test]
    fn changed_values_name_table_row_and_column() {
        let b = capture(
            vec![("lead", table(&["id"], vec![json!({"id": 1, "touches": 1})]))],
            &[],
        );
        let a = capture(
            vec![("lead", table(&["id"], vec![json!({"id": 1, "touches": 2})]))],
            &[],
        );
        let d = diff(&b, &a, Phase::Redelivery);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].column(), Some("touches"));
        assert_eq!(
            d[0].to_string(),
            "after the second delivery: lead [id=1] column touches: 1 -> 2"
        );
    }

    #[test]
    fn inserted_duplicated_rows_and_counters_are_reported() {
        let b = capture(
            vec![
                (
                    "opportunity",
                    table(&["id"], vec![json!({"id": 1, "lead": "L1"})]),
                ),
                ("note", table(&["lead"], vec![json!({"lead": "L1"})])),
            ],
            &[("opportunity", "number", 2)],
        );
        let a = capture(
            vec![
                (
                    "opportunity",
                    table(
                        &["id"],
                        vec![
                            json!({"id": 1, "lead": "L1"}),
                            json!({"id": 2, "lead": "L1"}),
                        ],
                    ),
                ),
                (
                    "note",
                    table(
                        &["lead"],
                        vec![json!({"lead": "L1"}), json!({"lead": "L1"})],
                    ),
                ),
            ],
            &[("opportunity", "number", 3)],
        );
        let shown: Vec<String> = diff(&b, &a, Phase::ConcurrentRedelivery)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            shown,
            [
                r#"after two concurrent deliveries: note [lead="L1"]: duplicated row: 1 -> 2 rows with this identity"#,
                r#"after two concurrent deliveries: opportunity [id=2]: row inserted {"id":2,"lead":"L1"}"#,
                "after two concurrent deliveries: autonumber opportunity.number moved: next value 2 -> 3 (a value was drawn)",
            ]
        );
    }

    #[test]
    fn a_report_with_differences_is_not_idempotent() {
        let report = Report {
            first_delivery: Vec::new(),
            differences: vec![Difference::DeliveryFailed {
                phase: Phase::Redelivery,
                error: "duplicate key".into(),
            }],
        };
        assert!(!report.is_idempotent());
        assert_eq!(
            report.to_string(),
            "redelivery changed the database (1 difference(s)):\n  after the second delivery: the delivery failed: duplicate key\n"
        );
        let clean = Report {
            first_delivery: Vec::new(),
            differences: Vec::new(),
        };
        assert!(clean.is_idempotent());
        clean.assert_idempotent();
    }
}
