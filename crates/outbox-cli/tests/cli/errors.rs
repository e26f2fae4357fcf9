//! The binary's refusals, end to end: a bad `--database-url`, a database that is down, an
//! unmigrated schema and a schema newer than the binary each give a clear message on stderr and
//! a non-zero exit, before any worker starts.

use outbox_tests::{Backend, TestDb, backend_tests};

use super::{outbox, stderr};

/// Runs `args` against `url` and returns stderr, asserting a non-zero exit.
fn refused(url: &str, args: &[&str]) -> String {
    let o = outbox(url, args);
    assert!(
        !o.status.success(),
        "`outbox {}` should fail against {url}",
        args.join(" ")
    );
    stderr(&o)
}

#[test]
fn a_bad_database_url_is_named_with_what_to_pass() {
    for url in [
        "mysql://root@localhost/x",
        "postgres://root@127.0.0.1:notaport/x",
    ] {
        let err = refused(url, &["status"]);
        assert!(err.contains("invalid database url"), "{url}: {err}");
        assert!(err.contains("--database-url"), "{url}: {err}");
    }
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["status"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no database given"), "{}", stderr(&o));
}

#[test]
fn a_database_that_is_down_is_reported_as_unreachable() {
    // Nothing listens on port 1.
    for args in [&["status"][..], &["migrate"]] {
        let err = refused("postgres://root@127.0.0.1:1/test", args);
        assert!(
            err.contains("cannot reach the database at postgres://root@127.0.0.1:1/test"),
            "{args:?}: {err}"
        );
    }
}

/// An empty database (or one whose migration table was dropped) asks for `outbox migrate`.
async fn an_unmigrated_schema_asks_for_migrate(db: TestDb) {
    db.execute("DROP TABLE _system_outbox_migrations").await;
    for args in [
        &["events"][..],
        &["status"],
        &["backfill-record-keys", "--dry-run"],
    ] {
        let err = refused(&db.url, args);
        assert!(
            err.contains("the database schema is not migrated") && err.contains("outbox migrate"),
            "{args:?}: {err}"
        );
    }
}

/// A migration this binary does not know means an older binary: it refuses to run.
async fn a_schema_newer_than_the_binary_is_refused(db: TestDb) {
    match db.backend() {
        Backend::Postgres => {
            db.execute(
                "INSERT INTO _system_outbox_migrations (version, description, success, checksum, execution_time)
                 VALUES (99990101000000, 'from the future', true, '\\x00'::bytea, 0)",
            )
            .await
        }
        Backend::Sqlite => {
            db.execute(
                "INSERT INTO _system_outbox_migrations (version, description, success, checksum, execution_time)
                 VALUES (99990101000000, 'from the future', true, X'00', 0)",
            )
            .await
        }
    }
    for args in [&["events"][..], &["status"], &["migrate"]] {
        let err = refused(&db.url, args);
        assert!(
            err.contains("newer than this binary") && err.contains("99990101000000"),
            "{args:?}: {err}"
        );
    }
}

backend_tests!(
    an_unmigrated_schema_asks_for_migrate,
    a_schema_newer_than_the_binary_is_refused,
    the_gate_without_consumers_refuses,
);

#[test]
fn a_fresh_sqlite_file_is_unmigrated() {
    let path = std::env::temp_dir().join(format!("outbox-unmigrated-{}.db", std::process::id()));
    let url = format!("sqlite://{}", path.display());
    let err = refused(&url, &["status"]);
    for suffix in ["", "-wal", "-shm"] {
        std::fs::remove_file(format!("{}{suffix}", path.display())).ok();
    }
    assert!(err.contains("not migrated"), "{err}");
}

/// The deployed binary registers no consumers: its gate refuses (fails closed) instead of
/// passing with nothing to judge.
async fn the_gate_without_consumers_refuses(db: TestDb) {
    let err = refused(&db.url, &["gate"]);
    assert!(
        err.contains("gate refused") && err.contains("registers no consumers"),
        "{err}"
    );
}
