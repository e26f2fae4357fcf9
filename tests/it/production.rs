//! PostgreSQL as platform teams run it (issue 25): the defaults a DBA sets on the database
//! (`default_transaction_isolation`, `statement_timeout`, `lock_timeout`,
//! `idle_in_transaction_session_timeout`), least-privilege roles, and a topology the outbox
//! cannot run on (a read-only database, a pooler in statement mode). The PgBouncer variants of
//! the conformance suite and the worker tests are in `repository` and `workers`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, Handler, HandlerError, Handlers, OutboxEvent,
    WorkerConfig,
};
use outbox_persistence::{ConnectConfig, Database, Error, EventStatus, NewEvent, with_tx};
use outbox_tests::{TestDb, drain, persistent};
use sqlx::{Connection, PgConnection};

fn config(workers: usize) -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("tests of the worker mechanics with undeclared handlers")
        .with_workers(workers)
        .with_poll_interval(Duration::from_millis(50))
        .with_retry_delay(Duration::from_millis(5))
        .with_max_retry_delay(Duration::from_millis(20))
        .with_max_retry_attempts(3)
        .with_heartbeat_interval(Duration::from_millis(300))
        .with_stale_after(Duration::from_secs(30))
        .with_lock_timeout(Duration::from_millis(500))
}

fn payload(record: usize, seq: usize) -> String {
    format!(r#"{{"object":"Ticket","record_id":"t{record}","snapshot":{{"seq":{seq}}}}}"#)
}

/// Fails the first attempt of about one event in twenty (before its effect), runs events whose
/// `seq` is 0 for `slow` first, writes one effect row per attempt in the attempt transaction,
/// and records the isolation level each attempt ran at.
#[derive(Clone)]
struct Faulty {
    slow: Duration,
    attempts: Arc<Mutex<HashMap<uuid::Uuid, u32>>>,
    /// What each attempt ran under.
    isolation: Arc<Mutex<Vec<AttemptSettings>>>,
}

/// An attempt's isolation level, lock, statement and idle-in-transaction timeouts.
type AttemptSettings = (String, String, String, String);

#[async_trait]
impl Handler for Faulty {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let attempt = {
            let mut attempts = self.attempts.lock().unwrap();
            let n = attempts.entry(event.id).or_default();
            *n += 1;
            *n
        };
        let settings: AttemptSettings = with_tx!(ctx.tx(), |conn| {
            sqlx::query_as(
                "SELECT current_setting('transaction_isolation'), current_setting('lock_timeout'),
                        current_setting('statement_timeout'),
                        current_setting('idle_in_transaction_session_timeout')",
            )
            .persistent(persistent())
            .fetch_one(conn)
            .await
        })
        .map_err(HandlerError::db)?;
        self.isolation.lock().unwrap().push(settings);
        if attempt == 1 && event.id.as_u128().is_multiple_of(20) {
            return Err(HandlerError::Retryable(
                "injected first-attempt fault".into(),
            ));
        }
        if event.payload.contains(r#""seq":0"#) && !self.slow.is_zero() {
            tokio::time::sleep(self.slow).await;
        }
        with_tx!(ctx.tx(), |conn| {
            sqlx::query("INSERT INTO effect (event_id) VALUES ($1)")
                .persistent(persistent())
                .bind(event.id)
                .execute(conn)
                .await
                .map(|r| r.rows_affected())
        })
        .map_err(HandlerError::db)?;
        Ok(())
    }
}

/// Runs 4 workers over 40 records x 5 events with first-attempt faults on `db`, then checks
/// from the database that every event was processed once, none failed, and every attempt ran
/// at READ COMMITTED.
async fn run_demo_load(db: &TestDb, slow: Duration, what: &str) {
    db.execute("CREATE TABLE effect (event_id uuid PRIMARY KEY)")
        .await;
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..5)
        .flat_map(|seq| (0..40).map(move |r| NewEvent::new("ticket.changed", payload(r, seq))))
        .collect();
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let handler = Faulty {
        slow,
        attempts: Arc::default(),
        isolation: Arc::default(),
    };
    let handlers = Handlers::new().register("ticket.changed", handler.clone());
    let dispatcher = Dispatcher::new(repo.clone(), handlers, config(4))
        .start()
        .await
        .unwrap();
    drain(&repo, Duration::from_secs(120)).await;
    let report = dispatcher.shutdown().await;
    let failed = db
        .count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'failed'")
        .await;
    let processed = db
        .count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'")
        .await;
    let effects = db.count("SELECT count(*) FROM effect").await;
    assert_eq!(failed, 0, "{what}: no event failed ({:?})", report.metrics);
    // Every failure was recorded in its attempt transaction (rolled back to the savepoint),
    // none on the side: nothing killed an attempt's transaction here.
    assert_eq!(
        report.metrics.detached_bookkeeping, 0,
        "{what}: no bookkeeping fell back to the detached path ({:?})",
        report.metrics
    );
    assert_eq!(processed, 200, "{what}: every event processed");
    assert_eq!(effects, 200, "{what}: one effect per event");
    // The attempt's own settings, whatever the database's: READ COMMITTED, the worker's lock
    // timeout (500 ms), the outbox's statement timeout (30 s), no idle timeout.
    let settings = handler.isolation.lock().unwrap().clone();
    let expected = (
        "read committed".to_string(),
        "500ms".to_string(),
        "30s".to_string(),
        "0".to_string(),
    );
    assert!(
        !settings.is_empty() && settings.iter().all(|s| *s == expected),
        "{what}: every attempt under the outbox's settings, saw {:?}",
        settings.iter().find(|s| **s != expected)
    );
    let retried = db
        .count("SELECT count(*) FROM _System_OutboxEvent WHERE RetryCount > 0")
        .await;
    let injected = handler
        .attempts
        .lock()
        .unwrap()
        .keys()
        .filter(|id| id.as_u128().is_multiple_of(20))
        .count() as i64;
    assert_eq!(
        retried, injected,
        "{what}: only the events a fault touched were counted, once each"
    );
}

/// The DBA's defaults on the database: the outbox's transactions state their own isolation
/// and timeouts, so nothing that only a first-attempt fault touched ends `failed`, and a
/// handler longer than the server's idle-in-transaction timeout succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_dba_defaults_fail_no_event() {
    let cases: &[(&str, &str, Duration)] = &[
        (
            "default_transaction_isolation",
            "serializable",
            Duration::ZERO,
        ),
        (
            "default_transaction_isolation",
            "repeatable read",
            Duration::ZERO,
        ),
        ("statement_timeout", "200ms", Duration::ZERO),
        ("lock_timeout", "50ms", Duration::ZERO),
        (
            "idle_in_transaction_session_timeout",
            "1s",
            Duration::from_millis(1_600),
        ),
    ];
    for (setting, value, slow) in cases {
        let Some(db) = TestDb::postgres_with_defaults(&[(setting, value)]).await else {
            return;
        };
        run_demo_load(&db, *slow, &format!("{setting} = {value}")).await;
    }
}

/// The same load through the transaction-pooling PgBouncer, on a database that defaults to
/// SERIALIZABLE with a 1 s idle-in-transaction timeout (the pooler hands each transaction any
/// server connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_workers_fail_no_event() {
    let Some(db) = TestDb::pgbouncer_with_defaults(&[
        ("default_transaction_isolation", "serializable"),
        ("idle_in_transaction_session_timeout", "1s"),
    ])
    .await
    else {
        return;
    };
    run_demo_load(&db, Duration::ZERO, "through PgBouncer").await;
}

/// A `processed` write that runs into the lock timeout (another transaction holds the event's
/// row) does not count the attempt: the claim is released with `RetryCount` unchanged, and the
/// event runs again once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_processed_write_timeout_is_not_counted() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    db.execute("CREATE TABLE effect (event_id uuid PRIMARY KEY)")
        .await;
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let ids = repo
        .enqueue(&mut tx, &[NewEvent::new("ticket.changed", payload(1, 1))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let id = ids[0];
    /// Locks the event's row from another connection while the handler runs, the first time.
    struct LockDuringHandler {
        url: String,
        holder: Arc<tokio::sync::Mutex<Option<PgConnection>>>,
        runs: Arc<AtomicU64>,
    }
    #[async_trait]
    impl Handler for LockDuringHandler {
        async fn handle(
            &self,
            event: &OutboxEvent,
            _: &mut AttemptContext<'_>,
        ) -> Result<(), HandlerError> {
            if self.runs.fetch_add(1, Ordering::SeqCst) == 0 {
                let mut conn = PgConnection::connect(&self.url).await.unwrap();
                sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
                sqlx::query("SELECT 1 FROM _System_OutboxEvent WHERE Id = $1 FOR UPDATE")
                    .bind(event.id)
                    .execute(&mut conn)
                    .await
                    .unwrap();
                *self.holder.lock().await = Some(conn);
            }
            Ok(())
        }
    }
    let holder = Arc::new(tokio::sync::Mutex::new(None));
    let runs = Arc::new(AtomicU64::new(0));
    let handlers = Handlers::new().register(
        "ticket.changed",
        LockDuringHandler {
            url: db.url.clone(),
            holder: holder.clone(),
            runs: runs.clone(),
        },
    );
    let dispatcher = Dispatcher::new(
        repo.clone(),
        handlers,
        config(1).with_lock_timeout(Duration::from_millis(200)),
    )
    .start()
    .await
    .unwrap();
    // The processed write times out; the release waits for the lock too (its retries back
    // off), so hold it a while, then let go.
    let start = std::time::Instant::now();
    while runs.load(Ordering::SeqCst) == 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let conn = holder.lock().await.take().expect("the row lock was taken");
    conn.close().await.ok();
    drain(&repo, Duration::from_secs(60)).await;
    let report = dispatcher.shutdown().await;
    let row = repo.get_event(id).await.unwrap().unwrap();
    assert_eq!(row.status, EventStatus::Processed);
    assert_eq!(row.retry_count, 0, "the released attempt was not counted");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "ran again after the release"
    );
    assert_eq!(report.metrics.released, 1, "{:?}", report.metrics);
    assert_eq!(report.metrics.retried, 0);
}

/// `outbox migrate` against a database whose transactions default to read-only (a replica's
/// endpoint, a read-only role) says so in one line and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migrate_refuses_a_read_only_database() {
    let Some(db) =
        TestDb::unmigrated_with_defaults(&[("default_transaction_read_only", "on")]).await
    else {
        return;
    };
    let err = db.db.migrate().await.unwrap_err();
    assert!(
        matches!(err, Error::Unsupported(_)) && err.to_string().contains("read-only"),
        "{err}"
    );
    assert!(!err.to_string().contains('\n'), "one line: {err}");
    let tables = db
        .count("SELECT count(*) FROM pg_tables WHERE tablename LIKE '_system_outbox%'")
        .await;
    assert_eq!(tables, 0, "nothing was created");
}

/// A pooler in statement mode cannot run the outbox's transactions: `migrate` says so in one
/// line and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_statement_mode_is_refused() {
    let Some(pooler) = outbox_tests::pgbouncer_url() else {
        if outbox_tests::pgbouncer_required() {
            panic!("PgBouncer is required but OUTBOX_TEST_PGBOUNCER_URL is not set");
        }
        return;
    };
    // `cargo xtask test` declares this database in statement mode (it is the server's `test`).
    let url = outbox_persistence::test_support::with_database(&pooler, "outbox_statement_mode");
    let db = Database::connect(&url, ConnectConfig::default())
        .await
        .unwrap();
    let err = db.migrate().await.unwrap_err();
    assert!(
        matches!(err, Error::Unsupported(_)) && err.to_string().contains("statement mode"),
        "{err}"
    );
    assert!(!err.to_string().contains('\n'), "one line: {err}");
}

/// The three roles of docs/deployment.md, with exactly its grants: the migrate role owns the
/// schema objects, the worker role enqueues, runs the workers (heartbeats, bookkeeping, heads
/// repair, pruning) and retries, the read-only role reads what `outbox status` shows; a grant
/// missing gives an error that names the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_least_privilege_roles() {
    let Some(db) = TestDb::unmigrated_with_defaults(&[]).await else {
        return;
    };
    let name = db.url.rsplit('/').next().unwrap().to_string();
    let suffix = &uuid::Uuid::now_v7().simple().to_string()[24..];
    let (migrator, worker, reader) = (
        format!("outbox_migrate_{suffix}"),
        format!("outbox_worker_{suffix}"),
        format!("outbox_reader_{suffix}"),
    );
    // docs/deployment.md, "Roles", as the database's owner.
    for sql in [
        // As PostgreSQL 15 has it; older releases grant CREATE on `public` to everyone.
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC".to_string(),
        format!("CREATE ROLE {migrator} LOGIN"),
        format!("CREATE ROLE {worker} LOGIN"),
        format!("CREATE ROLE {reader} LOGIN"),
        format!("GRANT CONNECT ON DATABASE {name} TO {migrator}, {worker}, {reader}"),
        format!("GRANT USAGE, CREATE ON SCHEMA public TO {migrator}"),
        format!("GRANT USAGE ON SCHEMA public TO {worker}, {reader}"),
        format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {migrator} IN SCHEMA public \
             GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {worker}"
        ),
        format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {migrator} IN SCHEMA public \
             GRANT USAGE, UPDATE ON SEQUENCES TO {worker}"
        ),
        format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {migrator} IN SCHEMA public \
             GRANT SELECT ON TABLES TO {reader}"
        ),
    ] {
        db.execute(&sql).await;
    }
    let as_role = |role: &str| db.url_as(role);
    let migrate = Database::connect(&as_role(&migrator), ConnectConfig::default())
        .await
        .unwrap();
    migrate.migrate().await.unwrap();
    migrate.close().await;

    // The worker role: enqueue, pull workers with a fail-once handler, the pruner's delete,
    // an operator retry and the heads repair.
    let workers = Database::connect(&as_role(&worker), ConnectConfig::default())
        .await
        .unwrap();
    workers.check_schema().await.unwrap();
    let repo = workers.repository();
    let events: Vec<NewEvent> = (0..20)
        .map(|i| NewEvent::new("ticket.changed", payload(i % 4, i)))
        .collect();
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    db.execute("CREATE TABLE effect (event_id uuid PRIMARY KEY)")
        .await;
    db.execute(&format!("GRANT INSERT, SELECT ON effect TO {worker}"))
        .await;
    let handler = Faulty {
        slow: Duration::ZERO,
        attempts: Arc::default(),
        isolation: Arc::default(),
    };
    let dispatcher = Dispatcher::new(
        repo.clone(),
        Handlers::new().register("ticket.changed", handler),
        config(2),
    )
    .start()
    .await
    .unwrap();
    drain(&repo, Duration::from_secs(60)).await;
    dispatcher.shutdown().await;
    repo.repair_heads(100).await.unwrap();
    repo.retry_failed(outbox_persistence::RetryFilter::Failed { event_type: None })
        .await
        .unwrap();
    let pruned = repo
        .prune(outbox_persistence::PrunePolicy {
            processed_older_than: Some(Duration::ZERO),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(pruned.processed, 20, "the worker role prunes");

    // The read-only role: what `outbox status` reads, and a clear refusal to write.
    let readers = Database::connect(&as_role(&reader), ConnectConfig::default())
        .await
        .unwrap();
    readers.check_schema().await.unwrap();
    let read = readers.repository();
    let policy = outbox_persistence::ClaimPolicy::new(Duration::from_secs(30), Duration::ZERO, 5);
    read.stats(policy).await.unwrap();
    read.blocked_keys(policy, 10).await.unwrap();
    read.list_events(outbox_persistence::EventFilter::default())
        .await
        .unwrap();
    let mut tx = read.begin().await.unwrap();
    let err = read
        .enqueue(&mut tx, &[NewEvent::new("ticket.changed", payload(9, 9))])
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("permission denied for table _system_outboxevent"),
        "the error names the missing grant: {err}"
    );
    drop(tx);
    workers.close().await;
    readers.close().await;
    // The roles own objects in this database: drop it before them.
    let admin = outbox_tests::postgres_admin_url();
    let mut conn = PgConnection::connect(&admin).await.unwrap();
    for sql in [
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!("DROP ROLE {migrator}, {worker}, {reader}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut conn)
            .await
            .unwrap();
    }
}
