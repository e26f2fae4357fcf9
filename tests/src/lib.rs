//! The fresh-database harness for integration tests: every test gets its own SQLite file or its
//! own PostgreSQL database, with the workspace's migrations applied.
//!
//! PostgreSQL tests run when a server is reachable at `DATABASE_URL` (default
//! [`DEFAULT_POSTGRES_URL`]). When it is not, they are skipped with a line on stderr, unless
//! `CI=true` or `OUTBOX_REQUIRE_POSTGRES=1`, in which case they fail.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{ClockShift, Database, OutboxRepository};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool, SqlitePool};

pub mod reply_loss;

/// The PostgreSQL server tests use when `DATABASE_URL` is not set.
pub const DEFAULT_POSTGRES_URL: &str = "postgres://root@127.0.0.1:5432/test";

/// Which backend a test database lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// An embedded SQLite file.
    Sqlite,
    /// A database on the PostgreSQL server.
    Postgres,
}

/// A migrated database that exists for one test and is removed when dropped.
pub struct TestDb {
    /// The database handle the code under test uses.
    pub db: Database,
    /// Behind a transaction pooler: a direct pool for the test's own inspection and setup
    /// (named prepared statements, as any test code writes them).
    direct: Option<PgPool>,
    /// The URL of this database, for code that connects by itself (for example a CLI process).
    pub url: String,
    /// The clock shift of [`TestDb::repository`]'s repositories: advance it to let time pass.
    pub clock: ClockShift,
    cleanup: Cleanup,
}

enum Cleanup {
    SqliteFile(PathBuf),
    PostgresDatabase { admin_url: String, name: String },
}

/// The URL of a PgBouncer in `pool_mode = transaction` in front of the server under test
/// (`OUTBOX_TEST_PGBOUNCER_URL`; `cargo xtask test` starts one and sets it). Its database part
/// is replaced per test.
pub fn pgbouncer_url() -> Option<String> {
    std::env::var("OUTBOX_TEST_PGBOUNCER_URL")
        .ok()
        .filter(|u| !u.is_empty())
}

/// Whether the PgBouncer variants must run (`OUTBOX_REQUIRE_PGBOUNCER=1`, which `cargo xtask
/// test` sets under CI).
pub fn pgbouncer_required() -> bool {
    std::env::var("OUTBOX_REQUIRE_PGBOUNCER").is_ok_and(|v| v == "1" || v == "true")
}

/// Statements that test code sends itself inside an attempt or an application transaction:
/// unnamed once this process runs anything behind a transaction pooler (the value for sqlx's
/// `Query::persistent`).
pub fn persistent() -> bool {
    outbox_persistence::postgres::caches_statements()
}

/// Whether PostgreSQL tests must run (and fail when the server is unreachable).
pub fn postgres_required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
        || std::env::var("OUTBOX_REQUIRE_POSTGRES").is_ok_and(|v| v == "1" || v == "true")
}

/// The admin URL of the PostgreSQL server under test.
pub fn postgres_admin_url() -> String {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| u.starts_with("postgres"))
        .unwrap_or_else(|| DEFAULT_POSTGRES_URL.to_string())
}

fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::now_v7().simple())
}

impl TestDb {
    /// A fresh, migrated database on `backend`, or `None` when the backend is PostgreSQL, the
    /// server is unreachable and PostgreSQL is not required.
    pub async fn new(backend: Backend) -> Option<Self> {
        match backend {
            Backend::Sqlite => Some(Self::sqlite().await),
            Backend::Postgres => Self::postgres().await,
        }
    }

    /// A fresh, migrated SQLite database file in the temporary directory.
    pub async fn sqlite() -> Self {
        let db = Self::sqlite_unmigrated().await;
        db.db.migrate().await.expect("migrate the SQLite database");
        db
    }

    /// A fresh database on `backend` without the outbox's migrations (for tests of the
    /// migrations themselves), or `None` as [`TestDb::new`].
    pub async fn unmigrated(backend: Backend) -> Option<Self> {
        match backend {
            Backend::Sqlite => Some(Self::sqlite_unmigrated().await),
            Backend::Postgres => Self::postgres_unmigrated().await,
        }
    }

    async fn sqlite_unmigrated() -> Self {
        let path = std::env::temp_dir().join(format!("{}.db", unique_name("outbox_test")));
        let url = format!("sqlite://{}", path.display());
        let db = Database::connect(&url, Default::default())
            .await
            .expect("open a fresh SQLite database");
        Self {
            db,
            url,
            clock: ClockShift::new(),
            cleanup: Cleanup::SqliteFile(path),
            direct: None,
        }
    }

    /// A fresh, migrated PostgreSQL database, or `None` (with a line on stderr) when the server
    /// is unreachable and PostgreSQL is not required.
    pub async fn postgres() -> Option<Self> {
        let db = Self::postgres_unmigrated().await?;
        db.db
            .migrate()
            .await
            .expect("migrate the PostgreSQL database");
        Some(db)
    }

    /// A fresh, migrated PostgreSQL database whose defaults a DBA changed before anyone
    /// connected: `ALTER DATABASE … SET name = value` for each of `settings` (for example
    /// `("default_transaction_isolation", "serializable")`).
    pub async fn postgres_with_defaults(settings: &[(&str, &str)]) -> Option<Self> {
        let db = Self::postgres_created(settings).await?;
        db.db
            .migrate()
            .await
            .expect("migrate under the database's defaults");
        Some(db)
    }

    /// [`TestDb::postgres_with_defaults`] without the migrations.
    pub async fn unmigrated_with_defaults(settings: &[(&str, &str)]) -> Option<Self> {
        Self::postgres_created(settings).await
    }

    async fn postgres_unmigrated() -> Option<Self> {
        Self::postgres_created(&[]).await
    }

    /// Creates a database, applies `settings` to it, connects (the pool is opened after).
    async fn postgres_created(settings: &[(&str, &str)]) -> Option<Self> {
        let admin_url = postgres_admin_url();
        let admin = PgConnectOptions::from_str(&admin_url).expect("a valid DATABASE_URL");
        let mut conn = match tokio::time::timeout(Duration::from_secs(5), admin.connect()).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return unreachable_postgres(&admin_url, &e.to_string()),
            Err(_) => return unreachable_postgres(&admin_url, "connect timed out"),
        };
        let name = unique_name("outbox_t");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create a fresh PostgreSQL database");
        for (setting, value) in settings {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "ALTER DATABASE {name} SET {setting} = '{value}'"
            )))
            .execute(&mut conn)
            .await
            .expect("set a database default");
        }
        conn.close().await.ok();
        let url = outbox_persistence::test_support::with_database(&admin_url, &name);
        let db = Database::connect(&url, Default::default())
            .await
            .expect("connect to the fresh PostgreSQL database");
        Some(Self {
            db,
            direct: None,
            url,
            clock: ClockShift::new(),
            cleanup: Cleanup::PostgresDatabase { admin_url, name },
        })
    }

    /// A fresh PostgreSQL database reached through the transaction-pooling PgBouncer
    /// ([`pgbouncer_url`]), declared with `outbox_pooler=transaction`, migrated through it;
    /// wake-ups `LISTEN` on a direct URL. `None` (with a line on stderr) when no PgBouncer is
    /// configured and none is required.
    pub async fn pgbouncer() -> Option<Self> {
        Self::pgbouncer_with_defaults(&[]).await
    }

    /// [`TestDb::pgbouncer`] on a database whose defaults a DBA changed first (as
    /// [`TestDb::postgres_with_defaults`]).
    pub async fn pgbouncer_with_defaults(settings: &[(&str, &str)]) -> Option<Self> {
        let Some(pooler) = pgbouncer_url() else {
            if pgbouncer_required() {
                panic!(
                    "PgBouncer is required (OUTBOX_REQUIRE_PGBOUNCER=1) but OUTBOX_TEST_PGBOUNCER_URL is not set; run the tests with `cargo xtask test`"
                );
            }
            eprintln!(
                "skipping the PgBouncer variant: OUTBOX_TEST_PGBOUNCER_URL is not set (`cargo xtask test` starts one)"
            );
            return None;
        };
        let mut direct = Self::postgres_created(settings).await?;
        let Cleanup::PostgresDatabase { name, .. } = &direct.cleanup else {
            unreachable!("a PostgreSQL test database")
        };
        let url = outbox_persistence::test_support::with_database(&pooler, name);
        let separator = if url.contains('?') { '&' } else { '?' };
        let url = format!("{url}{separator}outbox_pooler=transaction");
        let config = outbox_persistence::ConnectConfig {
            listen_url: Some(direct.url.clone()),
            ..Default::default()
        };
        let db = Database::connect(&url, config)
            .await
            .expect("connect to the fresh database through PgBouncer");
        db.migrate().await.expect("migrate through PgBouncer");
        let Database::Postgres(inspect) = std::mem::replace(&mut direct.db, db) else {
            unreachable!("a PostgreSQL test database")
        };
        direct.direct = Some(inspect);
        direct.url = url;
        Some(direct)
    }

    /// The pool for the test's own statements: the direct one behind a pooler.
    fn inspect_pg(&self) -> Option<&PgPool> {
        self.direct.as_ref().or(match &self.db {
            Database::Postgres(pool) => Some(pool),
            Database::Sqlite(_) => None,
        })
    }

    /// Which backend this database is on.
    pub fn backend(&self) -> Backend {
        match self.db {
            Database::Postgres(_) => Backend::Postgres,
            Database::Sqlite(_) => Backend::Sqlite,
        }
    }

    /// An outbox repository over this database whose clock moves with [`TestDb::clock`].
    pub fn repository(&self) -> Arc<dyn OutboxRepository> {
        self.db.repository_with_clock_shift(self.clock.clone())
    }

    /// The PostgreSQL pool for the test's own statements, when this database is on
    /// PostgreSQL (behind a pooler, a direct pool: the code under test uses [`TestDb::db`]).
    pub fn pg(&self) -> Option<&PgPool> {
        self.inspect_pg()
    }

    /// This database's URL as `role` would connect (no password; trust authentication), for
    /// tests of least-privilege roles.
    pub fn url_as(&self, role: &str) -> String {
        let (scheme, rest) = self.url.split_once("://").expect("a URL with a scheme");
        let host = rest.split_once('@').map_or(rest, |(_, h)| h);
        format!("{scheme}://{role}@{host}")
    }

    /// Whether the code under test reaches this database through a transaction pooler.
    pub fn behind_pooler(&self) -> bool {
        self.direct.is_some()
    }

    /// The SQLite pool, when this database is on SQLite.
    pub fn sqlite_pool(&self) -> Option<&SqlitePool> {
        match &self.db {
            Database::Sqlite(pool) => Some(pool),
            Database::Postgres(_) => None,
        }
    }
}

fn unreachable_postgres(url: &str, why: &str) -> Option<TestDb> {
    if postgres_required() {
        panic!(
            "PostgreSQL is required (CI=true or OUTBOX_REQUIRE_POSTGRES=1) but {url} is unreachable: {why}"
        );
    }
    eprintln!("skipping the PostgreSQL variant: {url} is unreachable ({why})");
    None
}

impl Drop for TestDb {
    fn drop(&mut self) {
        match &self.cleanup {
            Cleanup::SqliteFile(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut p = path.clone().into_os_string();
                    p.push(suffix);
                    std::fs::remove_file(PathBuf::from(p)).ok();
                }
            }
            Cleanup::PostgresDatabase { admin_url, name } => {
                // Dropping runs outside the test's runtime: a short-lived thread with its own
                // runtime removes the database (FORCE ends connections the test left open).
                let admin_url = admin_url.clone();
                let name = name.clone();
                let _ = std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a runtime for cleanup");
                    rt.block_on(async move {
                        if let Ok(pool) = PgPoolOptions::new()
                            .max_connections(1)
                            .connect(&admin_url)
                            .await
                        {
                            let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                            sqlx::query(sqlx::AssertSqlSafe(sql))
                                .execute(&pool)
                                .await
                                .ok();
                            pool.close().await;
                        }
                    });
                })
                .join();
            }
        }
    }
}

/// Declares each listed `async fn name(db: TestDb)` as two tests, `sqlite::name` and
/// `postgres::name`, each on a fresh database.
#[macro_export]
macro_rules! backend_tests {
    ($($name:ident),+ $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = $crate::TestDb::sqlite().await;
                    super::$name(db).await;
                }
            )+
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    if let Some(db) = $crate::TestDb::postgres().await {
                        super::$name(db).await;
                    }
                }
            )+
        }
    };
    (with_pgbouncer: $($name:ident),+ $(,)?) => {
        $crate::backend_tests!($($name),+);
        mod pgbouncer {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    if let Some(db) = $crate::TestDb::pgbouncer().await {
                        super::$name(db).await;
                    }
                }
            )+
        }
    };
}

/// A row written straight into the outbox table, bypassing enqueue: for states that enqueue
/// cannot produce (a stale claim, a retried row, hostile input).
#[derive(Debug, Clone)]
pub struct RawRow {
    /// `Id`.
    pub id: uuid::Uuid,
    /// `EventType`.
    pub event_type: String,
    /// `Payload`.
    pub payload: String,
    /// `Status`.
    pub status: &'static str,
    /// `RetryCount`.
    pub retry_count: i32,
    /// `RecordKey`.
    pub record_key: Option<String>,
    /// `CreatedDate`.
    pub created: chrono::DateTime<chrono::Utc>,
    /// `LastModifiedDate`.
    pub last_modified: chrono::DateTime<chrono::Utc>,
}

impl RawRow {
    /// A `pending` row with a fresh id, created and modified at `at`.
    pub fn pending(key: Option<&str>, at: chrono::DateTime<chrono::Utc>) -> Self {
        Self {
            id: outbox_persistence::new_event_id(),
            event_type: "test.event".into(),
            payload: "{}".into(),
            status: "pending",
            retry_count: 0,
            record_key: key.map(str::to_string),
            created: at,
            last_modified: at,
        }
    }
}

impl TestDb {
    /// Writes `row` straight into the outbox table.
    pub async fn insert_raw(&self, row: &RawRow) {
        match &self.db {
            Database::Postgres(_) => {
                let pool = self.inspect_pg().expect("a PostgreSQL pool");
                sqlx::query(
                    "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount,
                       RecordKey, CreatedDate, LastModifiedDate) VALUES ($1,$2,$3,$4,$5,$6,$7,$8)",
                )
                .bind(row.id)
                .bind(&row.event_type)
                .bind(&row.payload)
                .bind(row.status)
                .bind(row.retry_count)
                .bind(&row.record_key)
                .bind(outbox_persistence::truncate_micros(row.created))
                .bind(outbox_persistence::truncate_micros(row.last_modified))
                .execute(pool)
                .await
                .expect("insert a raw outbox row");
            }
            Database::Sqlite(pool) => {
                use outbox_persistence::sqlite::format_ts;
                sqlx::query(
                    "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount,
                       RecordKey, CreatedDate, LastModifiedDate) VALUES (?1,?2,?3,?4,?5,?6,?7,?8)",
                )
                .bind(row.id.to_string())
                .bind(&row.event_type)
                .bind(&row.payload)
                .bind(row.status)
                .bind(row.retry_count)
                .bind(&row.record_key)
                .bind(format_ts(outbox_persistence::truncate_micros(row.created)))
                .bind(format_ts(outbox_persistence::truncate_micros(
                    row.last_modified,
                )))
                .execute(pool)
                .await
                .expect("insert a raw outbox row");
            }
        }
    }

    /// Runs a statement that needs no parameters (test setup and fault injection).
    pub async fn execute(&self, sql: &str) {
        let sql = sqlx::AssertSqlSafe(sql.to_string());
        match &self.db {
            Database::Postgres(_) => sqlx::query(sql)
                .execute(self.inspect_pg().expect("a PostgreSQL pool"))
                .await
                .map(|_| ()),
            Database::Sqlite(pool) => sqlx::query(sql).execute(pool).await.map(|_| ()),
        }
        .expect("execute a test statement");
    }

    /// Counts rows for a query of the form `SELECT count(*) FROM …`.
    pub async fn count(&self, sql: &str) -> i64 {
        let sql = sqlx::AssertSqlSafe(sql.to_string());
        match &self.db {
            Database::Postgres(_) => {
                sqlx::query_scalar(sql)
                    .fetch_one(self.inspect_pg().expect("a PostgreSQL pool"))
                    .await
            }
            Database::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
        }
        .expect("count rows")
    }
}

/// Waits until no row is pending or processing, or panics after `limit`.
pub async fn drain(repo: &Arc<dyn OutboxRepository>, limit: Duration) {
    let start = std::time::Instant::now();
    loop {
        let stats = repo
            .stats(outbox_persistence::ClaimPolicy::new(
                Duration::from_secs(30),
                Duration::ZERO,
                5,
            ))
            .await
            .expect("read the queue's stats");
        if stats.pending + stats.processing == 0 {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "not drained after {limit:?}: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
