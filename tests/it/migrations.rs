//! The outbox's migrations next to an application's own: each records its versions in a table
//! of its own, so an application's sqlx migrator with default settings runs before and after
//! the outbox's on the same database; a database migrated by an earlier version (outbox
//! versions in `_sqlx_migrations`) is adopted.

use std::path::PathBuf;

use outbox_events::{DispatchMode, Dispatcher, Handlers, WorkerConfig};
use outbox_persistence::{Database, MIGRATIONS_TABLE};
use outbox_tests::{Backend, TestDb};
use sqlx::migrate::Migrator;

/// An application's migrations folder: one migration with a timestamp version and another
/// whose version collides with the outbox's first (`0001`), as a team numbering from 1 has.
fn app_migrations() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("app_migrations_{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("0001_contact.sql"),
        "CREATE TABLE contact (id TEXT PRIMARY KEY, name TEXT NOT NULL);",
    )
    .unwrap();
    std::fs::write(
        dir.join("20260101000000_contact_name.sql"),
        "CREATE INDEX contact_name ON contact (name);",
    )
    .unwrap();
    dir
}

async fn run_app(db: &Database, migrator: &Migrator) {
    match db {
        Database::Postgres(pool) => migrator.run(pool).await,
        Database::Sqlite(pool) => migrator.run(pool).await,
    }
    .expect("the application's migrator runs");
}

async fn count(db: &Database, sql: &str) -> i64 {
    let sql = sqlx::AssertSqlSafe(sql.to_string());
    match db {
        Database::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
        Database::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
    }
    .unwrap()
}

async fn coexist(backend: Backend, app_first: bool) {
    let Some(test) = TestDb::unmigrated(backend).await else {
        return;
    };
    let db = &test.db;
    let app = Migrator::new(app_migrations()).await.unwrap();
    if app_first {
        run_app(db, &app).await;
        db.migrate()
            .await
            .expect("the outbox migrates after the application");
    } else {
        db.migrate().await.unwrap();
        run_app(db, &app).await;
    }
    // Both again, in the other order: each is a no-op for the other's versions.
    run_app(db, &app).await;
    db.migrate().await.unwrap();
    run_app(db, &app).await;
    db.check_schema()
        .await
        .expect("the outbox sees only its versions");
    assert_eq!(count(db, "SELECT count(*) FROM _sqlx_migrations").await, 2);
    assert_eq!(
        count(db, &format!("SELECT count(*) FROM {MIGRATIONS_TABLE}")).await,
        db.migrator().iter().count() as i64
    );
    assert_eq!(count(db, "SELECT count(*) FROM contact").await, 0);
}

/// A database migrated by an earlier version: the outbox's rows sit in `_sqlx_migrations`,
/// where the application's migrator would take them for its own missing versions. `migrate`
/// moves exactly those rows (version and checksum the outbox's) to the outbox's table.
async fn adopt(backend: Backend) {
    let Some(test) = TestDb::unmigrated(backend).await else {
        return;
    };
    let db = &test.db;
    let mut legacy = Migrator::with_migrations(db.migrator().iter().cloned().collect());
    legacy.dangerous_set_table_name("_sqlx_migrations");
    run_app(db, &legacy).await;
    assert!(
        db.check_schema().await.is_err(),
        "not yet in the outbox's table"
    );
    db.migrate().await.expect("adopts the earlier records");
    db.check_schema().await.unwrap();
    assert_eq!(count(db, "SELECT count(*) FROM _sqlx_migrations").await, 0);
    let app = Migrator::new(app_migrations()).await.unwrap();
    run_app(db, &app).await;
    db.migrate().await.unwrap();
    db.check_schema().await.unwrap();
}

async fn application_migrations_first(backend: Backend) {
    coexist(backend, true).await;
}

async fn outbox_migrations_first(backend: Backend) {
    coexist(backend, false).await;
}

async fn earlier_records_are_adopted(backend: Backend) {
    adopt(backend).await;
}

/// A dispatcher started through the library, in either mode, on a database without this
/// build's migrations says which are missing and what applies them, and starts nothing: every
/// claim would fail otherwise, with nothing saying why. So does one that lacks only the newest.
/// A newer schema (a rolling deploy) starts, and so does an outbox table with no migration
/// recorded (applied by a tool of the application's own); one whose newest migration is recorded
/// as failed does not, even beside a newer build's.
async fn a_dispatcher_refuses_a_database_without_its_migrations(backend: Backend) {
    let Some(test) = TestDb::unmigrated(backend).await else {
        return;
    };
    let newest = test.db.migrator().iter().map(|m| m.version).max().unwrap();
    let start = async |mode: DispatchMode| {
        Dispatcher::new(
            test.repository(),
            Handlers::new(),
            WorkerConfig::default().with_mode(mode),
        )
        .start()
        .await
    };
    let refused = async |missing: &str| {
        for mode in [DispatchMode::Legacy, DispatchMode::Pull] {
            let Err(e) = start(mode).await else {
                panic!("{mode:?}: started without migrations {missing}");
            };
            assert!(
                matches!(e, outbox_persistence::Error::NotMigrated { .. })
                    && e.to_string().contains(missing)
                    && e.to_string().contains("Database::migrate"),
                "{mode:?}: {e}"
            );
        }
    };
    let starts = async |why: &str| {
        for mode in [DispatchMode::Legacy, DispatchMode::Pull] {
            let handle = start(mode)
                .await
                .unwrap_or_else(|e| panic!("{why}, {mode:?}: {e}"));
            assert_eq!(handle.decision().mode, mode, "{why}");
            handle.shutdown().await;
        }
    };
    refused("[1, 2, 3").await;
    test.db.migrate().await.unwrap();
    test.execute(&format!(
        "INSERT INTO {MIGRATIONS_TABLE} (version, description, success, checksum, execution_time)
         SELECT 99999, 'a newer build', success, checksum, execution_time
         FROM {MIGRATIONS_TABLE} WHERE version = {newest}"
    ))
    .await;
    starts("a newer build's migration").await;
    // The newest recorded as failed (sqlx's `success = false`) beside the newer build's: not
    // applied, and missing comes before too new at a start.
    test.execute(&format!(
        "UPDATE {MIGRATIONS_TABLE} SET success = FALSE WHERE version = {newest}"
    ))
    .await;
    refused(&format!("[{newest}]")).await;
    // `Database::check_schema` (the binary's, before `outbox migrate`) names the newer build's
    // version first: the migrator would refuse the database for it.
    let strict = test.db.check_schema().await;
    assert!(
        matches!(&strict, Err(outbox_persistence::Error::SchemaTooNew { unknown }) if unknown == &[99999]),
        "{strict:?}"
    );
    test.execute(&format!(
        "DELETE FROM {MIGRATIONS_TABLE} WHERE version = 99999"
    ))
    .await;
    let strict = test.db.check_schema().await;
    assert!(
        matches!(&strict, Err(outbox_persistence::Error::NotMigrated { missing }) if missing == &[newest]),
        "{strict:?}"
    );
    test.execute(&format!(
        "DELETE FROM {MIGRATIONS_TABLE} WHERE version IN (99999, {newest})"
    ))
    .await;
    refused(&format!("[{newest}]")).await;
    test.execute(&format!("DELETE FROM {MIGRATIONS_TABLE}"))
        .await;
    starts("no migration recorded beside the outbox's table").await;
}

/// Each listed `async fn name(backend)` as a test on SQLite and one on PostgreSQL.
macro_rules! on_both {
    ($($name:ident),+ $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::Sqlite).await;
                }
            )+
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::Postgres).await;
                }
            )+
        }
    };
}

on_both!(
    application_migrations_first,
    outbox_migrations_first,
    earlier_records_are_adopted,
    a_dispatcher_refuses_a_database_without_its_migrations,
);
