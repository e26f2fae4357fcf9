//! Connecting to a database by URL, migrating it, and checking that its schema matches.

use std::collections::BTreeSet;
use std::str::FromStr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};

use crate::postgres::migrate::{applied_postgres, check_server, migrate_postgres};
use crate::postgres::{DEFAULT_STATEMENT_TIMEOUT, PgSettings, Pooler, pool_caches_statements};
use crate::{Error, OutboxRepository, Result};

/// The oldest PostgreSQL release the outbox's migrations and statements are written for
/// (`server_version_num`).
pub const MIN_POSTGRES_VERSION: i32 = 130_000;

/// The advisory-lock namespace (`(3481, 0)`, transaction-scoped) that serializes the outbox's
/// migrations across processes: a transaction-scoped lock, so nothing is left held on a server
/// connection a pooler hands to someone else.
pub const MIGRATE_LOCK_NAMESPACE: i32 = 3481;

/// The lock timeout used when none is configured, the workspace's one default: an attempt's
/// `lock_timeout` on PostgreSQL (`outbox_events::WorkerConfig`, which re-exports this), the
/// outbox's own writes outside attempts on PostgreSQL
/// ([`PgOutbox::with_lock_timeout`](crate::postgres::PgOutbox::with_lock_timeout)), and SQLite's
/// busy timeout ([`ConnectConfig::lock_timeout`]).
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);
/// The pool size used when none is configured.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 16;

/// The table in which the outbox records its own migrations. It is not sqlx's default
/// `_sqlx_migrations`, so an application's own sqlx migrator (with default settings) and the
/// outbox's share a database without either taking the other's versions for its own.
pub const MIGRATIONS_TABLE: &str = "_system_outbox_migrations";

static POSTGRES_MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let mut migrator = sqlx::migrate!("../../migrations/postgres");
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
});
static SQLITE_MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let mut migrator = sqlx::migrate!("../../migrations/sqlite");
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
});

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectConfig {
    /// Pool size. A process of pull workers needs [`ConnectConfig::for_workers`]'s
    /// `workers + 3`.
    pub max_connections: u32,
    /// How long to wait for a connection from the pool or the server.
    pub acquire_timeout: Duration,
    /// SQLite's busy timeout. On PostgreSQL nothing is set on the sessions (the application
    /// may share them): attempts set their `lock_timeout` themselves (`WorkerConfig`), and the
    /// outbox's other writes take [`PgOutbox::with_lock_timeout`](crate::postgres::PgOutbox::with_lock_timeout)'s;
    /// migrations wait this long for their table locks.
    pub lock_timeout: Duration,
    /// PostgreSQL: what sits between the outbox and the server. [`Pooler::Transaction`] for
    /// PgBouncer's `pool_mode = transaction` and poolers like it (no named prepared statements,
    /// wake-ups from [`ConnectConfig::listen_url`] or by polling). The URL parameter
    /// `outbox_pooler=transaction` says the same.
    pub pooler: Pooler,
    /// PostgreSQL: a URL that reaches the server directly (not through the pooler), for the
    /// wake-up `LISTEN` behind a transaction pooler. Without one, idle workers poll at
    /// `WorkerConfig::poll_interval`.
    pub listen_url: Option<String>,
    /// PostgreSQL: the statement timeout of the outbox's own transactions, whatever the
    /// database's default ([`DEFAULT_STATEMENT_TIMEOUT`]; zero for none).
    pub statement_timeout: Duration,
}

impl Default for ConnectConfig {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            acquire_timeout: Duration::from_secs(10),
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            pooler: Pooler::Direct,
            listen_url: None,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
        }
    }
}

/// The connections a process of pull workers needs beyond one per worker: the wake-up
/// `LISTEN` connection, and two shared by the heartbeats, the detached bookkeeping, the queue
/// gauges and the pruner (each a short statement).
pub const CONNECTIONS_BESIDE_WORKERS: u32 = 3;

impl ConnectConfig {
    /// The pool for a process running `workers` pull workers: `workers + 3` connections
    /// ([`CONNECTIONS_BESIDE_WORKERS`]). A worker holds one connection at a time: its claim
    /// commits and returns the connection before the attempt takes one, and the attempt keeps
    /// its connection until it commits or rolls back. The three others are the wake-up
    /// `LISTEN` connection (PostgreSQL) and two for the short statements beside the attempts:
    /// heartbeats (every `heartbeat_interval` per running attempt), detached bookkeeping, the
    /// queue gauges and the pruner. The legacy dispatcher of event types excluded from the
    /// pull rollout shares the workers' attempt permits, so it adds none. Handlers that need
    /// connections of their own beyond the attempt's transaction must add them.
    pub fn for_workers(workers: usize) -> Self {
        let workers = u32::try_from(workers).unwrap_or(u32::MAX);
        Self {
            max_connections: workers.saturating_add(CONNECTIONS_BESIDE_WORKERS),
            ..Self::default()
        }
    }
}

/// A connection pool on one of the two backends.
#[derive(Debug, Clone)]
pub enum Database {
    /// PostgreSQL, the production backend.
    Postgres(PgPool),
    /// SQLite, the embedded default.
    Sqlite(SqlitePool),
}

impl Database {
    /// Connects to `url`: `postgres://…` / `postgresql://…`, or `sqlite://PATH` / `sqlite:PATH`
    /// (the file is created when missing).
    pub async fn connect(url: &str, config: ConnectConfig) -> Result<Self> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            // No session settings: the application may use this pool for its own transactions,
            // and a pooler would hand them to others. Every outbox transaction states its own
            // isolation and timeouts as it begins (`postgres::session`).
            let (url, declared) = take_pooler_parameter(url)?;
            let pooler = declared.unwrap_or(config.pooler);
            let mut options = PgConnectOptions::from_str(&url)
                .map_err(|e| Error::InvalidUrl(format!("{}: {e}", redact(&url))))?;
            if pooler == Pooler::Transaction {
                // sqlx would still name (and leak) statements it does not cache; the outbox
                // sends its own unnamed, and an application's queries on this pool must too.
                options = options.statement_cache_capacity(0);
            }
            let pool = PgPoolOptions::new()
                .max_connections(config.max_connections)
                .acquire_timeout(config.acquire_timeout)
                .connect_with(options)
                .await?;
            crate::postgres::register(
                &pool,
                PgSettings {
                    pooler,
                    listen_url: config.listen_url.clone(),
                    statement_timeout: Some(config.statement_timeout),
                },
            );
            Ok(Database::Postgres(pool))
        } else if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(|e| Error::InvalidUrl(format!("{url}: {e}")))?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(config.lock_timeout)
                .foreign_keys(true);
            let pool = SqlitePoolOptions::new()
                .max_connections(config.max_connections)
                .acquire_timeout(config.acquire_timeout)
                .connect_with(options)
                .await?;
            // The outbox's writers in this process queue for the file's write lock, waiting
            // as long as the busy timeout allows (see `sqlite::gate`).
            crate::sqlite::gate::Gate::bound(&pool, config.lock_timeout);
            Ok(Database::Sqlite(pool))
        } else {
            Err(Error::InvalidUrl(format!(
                "{}: expected postgres://… or sqlite://PATH",
                redact(url)
            )))
        }
    }

    /// A private SQLite database in memory with the outbox's tables, on one connection that
    /// lives as long as the pool: for unit tests of handlers, and of the code beside them,
    /// without a database server or a file. Run the application's own migrator on it
    /// (`with_pool!`), open a transaction (`db.repository().begin()`) and hand it to the
    /// handler (`AttemptContext::new`); everything is gone once the `Database` is dropped.
    ///
    /// One connection: a transaction holds it until it ends, so run one transaction at a time
    /// (a second `begin` waits for the first, up to the acquire timeout). Not for pull workers,
    /// which need a connection for the claim beside the attempt: use a file
    /// (`sqlite://PATH`) or PostgreSQL for those.
    pub async fn sqlite_in_memory() -> Result<Self> {
        let options = SqliteConnectOptions::from_str("sqlite::memory:")
            .map_err(|e| Error::InvalidUrl(format!("sqlite::memory: {e}")))?
            .foreign_keys(true);
        let config = ConnectConfig::default();
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            // The database lives in its one connection: never close it while the pool is open.
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(config.acquire_timeout)
            .connect_with(options)
            .await?;
        crate::sqlite::gate::Gate::bound(&pool, config.lock_timeout);
        let db = Database::Sqlite(pool);
        db.migrate().await?;
        Ok(db)
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        match self {
            Database::Postgres(_) => "postgres",
            Database::Sqlite(_) => "sqlite",
        }
    }

    /// The outbox's migrations for this backend, recording themselves in
    /// [`MIGRATIONS_TABLE`]. An application that runs its schema changes with a tool of its own
    /// can take the SQL from here (`migrator().iter()`), or from the `migrations/` folder of
    /// this repository, and record them as it records its own; [`Database::check_schema`] then
    /// expects them in `MIGRATIONS_TABLE`, so run [`Database::migrate`] once as well (it skips
    /// what is applied) or keep to one way.
    pub fn migrator(&self) -> &'static Migrator {
        match self {
            Database::Postgres(_) => &POSTGRES_MIGRATOR,
            Database::Sqlite(_) => &SQLITE_MIGRATOR,
        }
    }

    /// Applies the outbox's migrations; applying them again is a no-op. They are recorded in
    /// [`MIGRATIONS_TABLE`]; a database migrated by an earlier version, which recorded them in
    /// `_sqlx_migrations`, has those rows moved over first (only rows whose version and
    /// checksum are the outbox's own).
    ///
    /// On PostgreSQL it first checks that the server can run the outbox (a primary, not a
    /// read-only standby; at least [`MIN_POSTGRES_VERSION`]; transactions allowed, which a
    /// pooler in statement mode refuses) and fails with [`Error::Unsupported`] changing
    /// nothing otherwise. Then each pending migration runs in a transaction of its own under a
    /// transaction-scoped advisory lock ([`MIGRATE_LOCK_NAMESPACE`]), recorded as sqlx's
    /// migrator records it; so it also runs through a transaction-pooling pooler, and a
    /// process killed meanwhile leaves no lock held on any server connection.
    pub async fn migrate(&self) -> Result<()> {
        if let Database::Postgres(pool) = self {
            check_server(pool).await?;
        }
        self.adopt_legacy_records().await?;
        match self {
            Database::Postgres(pool) => migrate_postgres(pool, &POSTGRES_MIGRATOR).await?,
            Database::Sqlite(pool) => SQLITE_MIGRATOR.run(pool).await?,
        }
        Ok(())
    }

    /// Moves the outbox's migration records out of `_sqlx_migrations` (where versions before
    /// the separate table kept them) into [`MIGRATIONS_TABLE`].
    async fn adopt_legacy_records(&self) -> Result<()> {
        let migrations: Vec<(i64, Vec<u8>)> = self
            .migrator()
            .iter()
            .map(|m| (m.version, m.checksum.to_vec()))
            .collect();
        match self {
            Database::Postgres(pool) => adopt_legacy_postgres(pool, migrations).await,
            Database::Sqlite(pool) => adopt_legacy_sqlite(pool, &migrations).await,
        }
    }

    /// [`Database::check_schema`] as a dispatcher's start reads it
    /// (`OutboxRepository::check_schema`, over `repo` on this database): missing versions come
    /// first ([`Error::NotMigrated`], even beside versions a newer build recorded: this build's
    /// statements may need them), then [`Error::SchemaTooNew`]; and a database whose outbox
    /// table exists while no outbox migration is recorded passes (its SQL applied by a tool of
    /// the application's own, see [`Database::migrator`]).
    pub(crate) async fn check_schema_for_workers(
        &self,
        repo: &dyn crate::OutboxRepository,
    ) -> Result<()> {
        let (missing, unknown) = self.schema_versions().await?;
        if missing.len() == self.migrator().iter().count() {
            let mut tx = repo.begin().await?;
            let exists = crate::tx::table_exists(&mut tx, "_system_outboxevent").await?;
            tx.rollback().await?;
            if exists {
                return Ok(());
            }
        }
        if !missing.is_empty() {
            return Err(Error::NotMigrated { missing });
        }
        if !unknown.is_empty() {
            return Err(Error::SchemaTooNew { unknown });
        }
        Ok(())
    }

    /// Checks that the database has exactly the migrations this binary knows: fails with
    /// [`Error::SchemaTooNew`] when it has versions this binary does not know (a newer build
    /// migrated it: the migrator would refuse it too), else with [`Error::NotMigrated`] when
    /// one is missing or recorded as failed.
    pub async fn check_schema(&self) -> Result<()> {
        let (missing, unknown) = self.schema_versions().await?;
        if !unknown.is_empty() {
            return Err(Error::SchemaTooNew { unknown });
        }
        if !missing.is_empty() {
            return Err(Error::NotMigrated { missing });
        }
        Ok(())
    }

    /// The versions this binary knows that the database has not applied (all of them without
    /// the migrations' table; a version recorded with `success = false`, sqlx's record of a
    /// migration that failed outside a transaction, is not applied), and those it applied that
    /// this binary does not know.
    async fn schema_versions(&self) -> Result<(Vec<i64>, Vec<i64>)> {
        let known: BTreeSet<i64> = self.migrator().iter().map(|m| m.version).collect();
        let applied: Vec<i64> = match self {
            Database::Postgres(pool) => match applied_postgres(pool).await? {
                Some(applied) => applied
                    .into_iter()
                    .filter(|(_, _, success)| *success)
                    .map(|(v, _, _)| v)
                    .collect(),
                None => return Ok((known.into_iter().collect(), Vec::new())),
            },
            Database::Sqlite(pool) => {
                let exists: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
                )
                .bind(MIGRATIONS_TABLE)
                .fetch_one(pool)
                .await?;
                if !exists {
                    return Ok((known.into_iter().collect(), Vec::new()));
                }
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT version FROM {MIGRATIONS_TABLE} WHERE success"
                )))
                .fetch_all(pool)
                .await?
            }
        };
        let applied: BTreeSet<i64> = applied.into_iter().collect();
        let missing = known.difference(&applied).copied().collect();
        let unknown = applied.difference(&known).copied().collect();
        Ok((missing, unknown))
    }

    /// The outbox repository over this pool.
    pub fn repository(&self) -> Arc<dyn OutboxRepository> {
        self.repository_with_clock_shift(crate::ClockShift::default())
    }

    /// The outbox repository over this pool, reading its clock shifted by `shift` (tests move
    /// it instead of sleeping; production uses [`Database::repository`]).
    pub fn repository_with_clock_shift(
        &self,
        shift: crate::ClockShift,
    ) -> Arc<dyn OutboxRepository> {
        match self {
            Database::Postgres(pool) => {
                Arc::new(crate::postgres::PgOutbox::new(pool.clone()).with_clock_shift(shift))
            }
            Database::Sqlite(pool) => {
                Arc::new(crate::sqlite::SqliteOutbox::new(pool.clone()).with_clock_shift(shift))
            }
        }
    }

    /// The record keys whose row in the heads table (`_System_OutboxHead`, the derived list of
    /// each key's oldest non-terminal row that the claim reads its candidates from) differs from
    /// what the outbox rows say: missing, out of date, or left over. Empty when consistent.
    /// Reads one snapshot; takes no lock (at most 1,000 keys are listed).
    pub async fn check_heads(&self) -> Result<Vec<String>> {
        match self {
            Database::Postgres(pool) => {
                crate::postgres::PgOutbox::new(pool.clone())
                    .check_heads()
                    .await
            }
            Database::Sqlite(pool) => {
                crate::sqlite::SqliteOutbox::new(pool.clone())
                    .check_heads()
                    .await
            }
        }
    }

    /// Rebuilds the heads table from the outbox rows (it is derived state: nothing is lost);
    /// returns the number of heads. Blocks writers of the outbox table while it runs (on
    /// PostgreSQL a `SHARE` lock on the table, which also waits for open writers).
    pub async fn rebuild_heads(&self) -> Result<u64> {
        match self {
            Database::Postgres(pool) => {
                crate::postgres::PgOutbox::new(pool.clone())
                    .rebuild_heads()
                    .await
            }
            Database::Sqlite(pool) => {
                crate::sqlite::SqliteOutbox::new(pool.clone())
                    .rebuild_heads()
                    .await
            }
        }
    }

    /// Closes the pool.
    pub async fn close(&self) {
        match self {
            Database::Postgres(pool) => pool.close().await,
            Database::Sqlite(pool) => pool.close().await,
        }
    }
}

/// Removes the `outbox_pooler` parameter from a PostgreSQL URL: the URL for the driver and
/// the pooler it declares.
fn take_pooler_parameter(url: &str) -> Result<(String, Option<Pooler>)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), None));
    };
    let mut pooler = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((key, value)) if key == Pooler::URL_PARAMETER => {
                pooler = Some(Pooler::parse(value).ok_or_else(|| {
                    Error::InvalidUrl(format!(
                        "{}: {}={value} is not supported; use transaction (PgBouncer pool_mode = transaction and poolers like it) or session (a direct connection or a session pooler); a pooler in statement mode cannot run the outbox's transactions",
                        redact(url),
                        Pooler::URL_PARAMETER
                    ))
                })?);
            }
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, pooler))
}

/// [`Database::adopt_legacy_records`] on PostgreSQL: one statement moves the outbox's rows.
async fn adopt_legacy_postgres(pool: &PgPool, migrations: Vec<(i64, Vec<u8>)>) -> Result<()> {
    let cached = pool_caches_statements(pool);
    // Under the migrate lock: two processes would race the table's creation.
    let mut tx = crate::postgres::migrate::locked(pool, cached).await?;
    let legacy: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .persistent(cached)
        .fetch_one(&mut *tx)
        .await?;
    if !legacy {
        tx.rollback().await?;
        return Ok(());
    }
    let (versions, checksums): (Vec<i64>, Vec<Vec<u8>>) = migrations.into_iter().unzip();
    crate::postgres::migrate::create_migrations_table(&mut tx, cached).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH ours AS (
               DELETE FROM _sqlx_migrations l
               USING UNNEST($1::bigint[], $2::bytea[]) AS o(version, checksum)
               WHERE l.version = o.version AND l.checksum = o.checksum AND l.success
               RETURNING l.*)
             INSERT INTO {MIGRATIONS_TABLE}
               (version, description, installed_on, success, checksum, execution_time)
             SELECT version, description, installed_on, success, checksum, execution_time
             FROM ours
             ON CONFLICT (version) DO NOTHING"
    )))
    .persistent(cached)
    .bind(&versions)
    .bind(&checksums)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// [`Database::adopt_legacy_records`] on SQLite: row by row, under the write lock.
async fn adopt_legacy_sqlite(pool: &SqlitePool, migrations: &[(i64, Vec<u8>)]) -> Result<()> {
    let legacy: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations')",
        )
        .fetch_one(pool)
        .await?;
    if !legacy {
        return Ok(());
    }
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (
               version BIGINT PRIMARY KEY,
               description TEXT NOT NULL,
               installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
               success BOOLEAN NOT NULL,
               checksum BLOB NOT NULL,
               execution_time BIGINT NOT NULL)"
    )))
    .execute(&mut *tx)
    .await?;
    for (version, checksum) in migrations {
        let moved = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT OR IGNORE INTO {MIGRATIONS_TABLE}
                   (version, description, installed_on, success, checksum, execution_time)
                 SELECT version, description, installed_on, success, checksum, execution_time
                 FROM _sqlx_migrations WHERE version = ?1 AND checksum = ?2 AND success"
        )))
        .bind(version)
        .bind(checksum)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if moved > 0 {
            sqlx::query("DELETE FROM _sqlx_migrations WHERE version = ?1 AND checksum = ?2")
                .bind(version)
                .bind(checksum)
                .execute(&mut *tx)
                .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// A URL with its password replaced, for messages.
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let rest = &url[scheme_end..];
    let Some(at) = rest.find('@') else {
        return url.to_string();
    };
    let userinfo = &rest[..at];
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{}{user}:***{}", &url[..scheme_end], &rest[at..]),
        None => url.to_string(),
    }
}
