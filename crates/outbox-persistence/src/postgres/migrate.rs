//! The outbox's migrations on PostgreSQL, safe behind a transaction pooler: the server checks
//! first, then each pending migration in a transaction of its own under a transaction-scoped
//! advisory lock, recorded as sqlx's migrator records it (see `Database::migrate`).

use std::time::Duration;

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use super::pool_caches_statements;
use crate::database::{MIGRATE_LOCK_NAMESPACE, MIGRATIONS_TABLE, MIN_POSTGRES_VERSION};
use crate::{Error, Result};

/// A transaction of the outbox's migrations: READ COMMITTED and writable whatever the
/// database's defaults, no statement timeout (an index build on a large table takes what it
/// takes), table locks waited for at most `lock_timeout` (a migration queued behind a long
/// transaction would hold every enqueue and claim behind its own lock request).
fn migrate_begin(lock_timeout: Duration) -> String {
    crate::postgres::begin_sql(crate::postgres::Begin {
        read_only: false,
        lock_timeout,
        statement_timeout: Duration::ZERO,
        may_idle: false,
        async_commit: false,
    })
}

/// The lock timeout of migrations.
const MIGRATE_LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// Checks, in one read-only transaction, that the server can run the outbox: see
/// [`Database::migrate`]. Changes nothing.
pub async fn check_server(pool: &PgPool) -> Result<()> {
    let cached = pool_caches_statements(pool);
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
        .map_err(server_refusal)?;
    let (version, version_num, standby, read_only): (String, i32, bool, String) = sqlx::query_as(
        "SELECT current_setting('server_version'), current_setting('server_version_num')::int,
                pg_is_in_recovery(), current_setting('default_transaction_read_only')",
    )
    .persistent(cached)
    .fetch_one(&mut *tx)
    .await
    .map_err(server_refusal)?;
    tx.commit().await?;
    server_verdict(&version, version_num, standby, &read_only)
}

/// What [`check_server`] concludes from the server's answers.
fn server_verdict(version: &str, version_num: i32, standby: bool, read_only: &str) -> Result<()> {
    if version_num < MIN_POSTGRES_VERSION {
        return Err(Error::Unsupported(format!(
            "PostgreSQL {version} is older than the oldest supported release ({}); upgrade the server",
            MIN_POSTGRES_VERSION / 10_000
        )));
    }
    if standby {
        return Err(Error::Unsupported(
            "the server is a read-only standby (pg_is_in_recovery()); migrate the primary".into(),
        ));
    }
    // `default_transaction_read_only` alone is overridden by the outbox's `READ WRITE`, but a
    // database that a DBA set read-only is one the operator should know they are writing to.
    if read_only == "on" {
        return Err(Error::Unsupported(
            "the database defaults to read-only transactions (default_transaction_read_only = on): is this a replica or a read-only endpoint? migrate the primary's read-write endpoint".into(),
        ));
    }
    Ok(())
}

/// A server's refusal as the outbox's error (a pooler in statement mode becomes
/// [`Error::Unsupported`]).
pub(crate) fn server_refusal(e: sqlx::Error) -> Error {
    e.into()
}

/// The outbox's applied migrations on PostgreSQL (`(version, checksum, success)`), or `None`
/// when the table does not exist.
pub(crate) async fn applied_postgres(pool: &PgPool) -> Result<Option<Vec<(i64, Vec<u8>, bool)>>> {
    let cached = pool_caches_statements(pool);
    // Bounded like the outbox's other reads whatever the database's defaults: a lock held on
    // the records' table (a migration's DDL) or a stalled server ends in an error.
    let begin = crate::postgres::begin_sql(crate::postgres::Begin {
        read_only: true,
        lock_timeout: crate::DEFAULT_LOCK_TIMEOUT,
        statement_timeout: crate::postgres::settings_of(pool).statement_timeout(),
        may_idle: false,
        async_commit: false,
    });
    let mut tx = pool
        .begin_with(sqlx::AssertSqlSafe(begin))
        .await
        .map_err(server_refusal)?;
    let applied = read_applied(&mut tx, cached).await?;
    tx.commit().await?;
    Ok(applied)
}

async fn read_applied(
    tx: &mut sqlx::PgConnection,
    cached: bool,
) -> Result<Option<Vec<(i64, Vec<u8>, bool)>>> {
    let exists: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT to_regclass('{MIGRATIONS_TABLE}') IS NOT NULL"
    )))
    .persistent(cached)
    .fetch_one(&mut *tx)
    .await?;
    if !exists {
        return Ok(None);
    }
    Ok(Some(
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT version, checksum, success FROM {MIGRATIONS_TABLE} ORDER BY version"
        )))
        .persistent(cached)
        .fetch_all(&mut *tx)
        .await?,
    ))
}

/// Creates [`MIGRATIONS_TABLE`] when missing, with sqlx's migrator's columns (so that sqlx's
/// own migrator reads the outbox's records as it reads its own).
pub(crate) async fn create_migrations_table(
    tx: &mut sqlx::PgConnection,
    cached: bool,
) -> Result<()> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (
           version BIGINT PRIMARY KEY,
           description TEXT NOT NULL,
           installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
           success BOOLEAN NOT NULL,
           checksum BYTEA NOT NULL,
           execution_time BIGINT NOT NULL)"
    )))
    .persistent(cached)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A migration transaction that holds the migrate lock: it waits for another migrator as long
/// as that one takes (no lock timeout on the advisory lock), then bounds its table locks by
/// [`MIGRATE_LOCK_TIMEOUT`].
pub(crate) async fn locked(
    pool: &PgPool,
    cached: bool,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut tx = pool
        .begin_with(sqlx::AssertSqlSafe(migrate_begin(Duration::ZERO)))
        .await
        .map_err(server_refusal)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1, 0)::text")
        .persistent(cached)
        .bind(MIGRATE_LOCK_NAMESPACE)
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = '{}ms'",
        super::session::millis(MIGRATE_LOCK_TIMEOUT)
    )))
    .execute(&mut *tx)
    .await?;
    Ok(tx)
}

/// Applies `migrator`'s pending migrations on PostgreSQL, each in a transaction of its own
/// under the transaction-scoped lock [`MIGRATE_LOCK_NAMESPACE`]; see [`Database::migrate`].
/// What sqlx's migrator checks is checked the same way: an applied migration whose checksum
/// differs, one recorded as failed, or one this binary does not know stops the run; a
/// migration marked to run outside a transaction is refused.
pub(crate) async fn migrate_postgres(pool: &PgPool, migrator: &Migrator) -> Result<()> {
    use sqlx::migrate::MigrateError;
    let cached = pool_caches_statements(pool);
    for migration in migrator.iter() {
        if migration.migration_type.is_down_migration() {
            continue;
        }
        if migration.no_tx {
            return Err(Error::Unsupported(format!(
                "migration {} asks to run outside a transaction, which the outbox's migrator does not do (it must run under its transaction-scoped lock)",
                migration.version
            )));
        }
        let mut tx = locked(pool, cached).await?;
        let applied = match read_applied(&mut tx, cached).await? {
            Some(applied) => applied,
            None => {
                create_migrations_table(&mut tx, cached).await?;
                Vec::new()
            }
        };
        if let Some((version, _, _)) = applied.iter().find(|(_, _, success)| !success) {
            return Err(MigrateError::Dirty(*version).into());
        }
        if let Some((version, _, _)) = applied
            .iter()
            .find(|(v, _, _)| migrator.iter().all(|m| m.version != *v))
        {
            return Err(MigrateError::VersionMissing(*version).into());
        }
        if let Some((_, checksum, _)) = applied.iter().find(|(v, _, _)| *v == migration.version) {
            if checksum.as_slice() != &*migration.checksum {
                return Err(MigrateError::VersionMismatch(migration.version).into());
            }
            tx.rollback().await?;
            continue;
        }
        let started = std::time::Instant::now();
        sqlx::raw_sql(migration.sql.clone())
            .execute(&mut *tx)
            .await
            .map_err(|e| MigrateError::ExecuteMigration(e, migration.version))?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {MIGRATIONS_TABLE} (version, description, success, checksum, execution_time)
             VALUES ($1, $2, TRUE, $3, $4)"
        )))
        .persistent(cached)
        .bind(migration.version)
        .bind(&*migration.description)
        .bind(&*migration.checksum)
        .bind(i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_verdict_names_what_to_change_in_one_line() {
        let old = server_verdict("12.17", 120_017, false, "off").unwrap_err();
        assert!(
            old.to_string().contains("PostgreSQL 12.17 is older"),
            "{old}"
        );
        let standby = server_verdict("15.4", 150_004, true, "off").unwrap_err();
        assert!(
            standby.to_string().contains("read-only standby"),
            "{standby}"
        );
        let read_only = server_verdict("15.4", 150_004, false, "on").unwrap_err();
        assert!(read_only.to_string().contains("read-only"), "{read_only}");
        for e in [old, standby, read_only] {
            assert!(matches!(e, Error::Unsupported(_)) && !e.to_string().contains('\n'));
        }
        assert!(server_verdict("13.0", 130_000, false, "off").is_ok());
    }
}
