//! Handlers that use the attempt transaction only for lock-free statements
//! (`AttemptContext::lock_free_tx`: reads, the effect ledger, rows keyed by their own event)
//! share a batch's transaction (docs/state-machine.md, "Batched attempts", rule 2): one commit
//! for the batch, each handler under a savepoint of its own, so a failing handler undoes only
//! its own writes. The same handlers through `ctx.tx()` commit once each.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, DispatcherHandle, Handler, HandlerError, Handlers,
    OutboxEvent, WorkerConfig,
};
use outbox_persistence::{NewEvent, OutboxRepository, Tx, statement, with_tx};
use outbox_tests::{Backend, TestDb, backend_tests, drain};

const EVENT_TYPE: &str = "lock_free.test";

/// Inserts a row named after its event, through `lock_free_tx` or `tx`; the event of record
/// `fail` writes a marker row and then fails, the first time.
struct Writing {
    lock_free: bool,
    failed: Arc<AtomicBool>,
}

async fn insert(tx: &mut Tx, name: &str, postgres: bool) -> Result<(), HandlerError> {
    let sql = if postgres {
        "INSERT INTO lf_row (name, writer) VALUES ($1, txid_current())"
    } else {
        "INSERT INTO lf_row (name, writer) VALUES ($1, 0)"
    };
    with_tx!(tx, |conn| statement::query(sql)
        .bind(name.to_string())
        .execute(conn)
        .await
        .map(|_| ()))?;
    Ok(())
}

#[async_trait]
impl Handler for Writing {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let record = event
            .record_key
            .as_ref()
            .map(|k| k.as_str().to_string())
            .unwrap_or_default();
        let tx = if self.lock_free {
            ctx.lock_free_tx()
        } else {
            ctx.tx()
        };
        let postgres = matches!(tx, Tx::Postgres(_));
        if record.ends_with(":fail") && !self.failed.swap(true, Ordering::SeqCst) {
            insert(tx, &format!("marker {record}"), postgres).await?;
            return Err(HandlerError::Retryable("failing once on purpose".into()));
        }
        insert(tx, &record, postgres).await
    }
}

/// One pull worker with `handler`, quick polls and retries, and room for a whole batch on a
/// loaded machine (the budget is not what these tests are about).
async fn start(repo: &Arc<dyn OutboxRepository>, handler: impl Handler) -> DispatcherHandle {
    let config = WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("lock-free segments under test")
        .with_workers(1)
        .with_poll_interval(Duration::from_millis(20))
        .with_retry_delay(Duration::from_millis(20))
        .with_max_retry_delay(Duration::from_millis(50))
        .with_batches(32, Duration::from_secs(30));
    Dispatcher::new(
        repo.clone(),
        Handlers::new().register(EVENT_TYPE, handler),
        config,
    )
    .start()
    .await
    .unwrap()
}

fn event(record: &str) -> NewEvent {
    NewEvent::new(
        EVENT_TYPE,
        format!(r#"{{"object":"Account","record_id":"{record}","snapshot":{{}}}}"#),
    )
}

/// Runs 12 events (one of which fails once) in a batch of one worker; returns how many
/// transactions wrote the 11 rows of the events that succeeded at once (PostgreSQL; 0 on
/// SQLite, which has no transaction id to read).
async fn run(db: &TestDb, lock_free: bool) -> i64 {
    db.execute("CREATE TABLE lf_row (name TEXT PRIMARY KEY, writer BIGINT NOT NULL)")
        .await;
    let repo: Arc<dyn OutboxRepository> = db.repository();
    let handler = Writing {
        lock_free,
        failed: Arc::default(),
    };
    let handle = start(&repo, handler).await;
    let mut events: Vec<NewEvent> = (0..6).map(|i| event(&format!("a{i}"))).collect();
    events.push(event("fail"));
    events.extend((6..11).map(|i| event(&format!("a{i}"))));
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    drain(&repo, Duration::from_secs(30)).await;
    handle.shutdown().await;

    assert_eq!(
        db.count("SELECT count(*) FROM lf_row WHERE name LIKE 'marker%'")
            .await,
        0,
        "the failed handler's write was undone"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM lf_row").await,
        12,
        "every event's row, the failed one's from its retry"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status <> 'processed' \
             OR (RetryCount > 0) <> (RecordKey LIKE '%:fail')"
        )
        .await,
        0,
        "all processed; only the failed one counted a retry"
    );
    if db.backend() == Backend::Postgres {
        db.count("SELECT count(DISTINCT writer) FROM lf_row WHERE name NOT LIKE '%:fail'")
            .await
    } else {
        0
    }
}

async fn lock_free_handlers_share_a_commit_and_a_failure_undoes_only_its_own(db: TestDb) {
    let writers = run(&db, true).await;
    if db.backend() == Backend::Postgres {
        assert!(
            writers <= 3,
            "11 lock-free handlers of one batch committed in {writers} transactions"
        );
    }
}

async fn handlers_that_may_lock_commit_once_each(db: TestDb) {
    let writers = run(&db, false).await;
    if db.backend() == Backend::Postgres {
        assert_eq!(writers, 11, "one commit per handler that used ctx.tx()");
    }
}

/// Record `a`'s event writes lock-free; record `b`'s first event writes lock-free and then
/// waits for the test (the first time), its second writes nothing.
#[derive(Default)]
struct Chain {
    waited: AtomicBool,
    go_on: Arc<tokio::sync::Notify>,
    waiting: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl Handler for Chain {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let key = event.record_key.as_ref().map(|k| k.as_str().to_string());
        let envelope = record_key::EventEnvelope::parse(&event.payload).expect("a test payload");
        let row = envelope.snapshot["row"].as_u64().unwrap_or(0);
        if key.as_deref() == Some("account:b") && row == 2 {
            return Ok(());
        }
        insert(ctx.lock_free_tx(), &event.id.to_string(), true).await?;
        if key.as_deref() == Some("account:b") && !self.waited.swap(true, Ordering::SeqCst) {
            self.waiting.notify_one();
            self.go_on.notified().await;
        }
        Ok(())
    }
}

async fn status_of(db: &TestDb, record: &str, row: u64) -> String {
    let sql = format!(
        "SELECT Status FROM _System_OutboxEvent WHERE RecordKey = 'account:{record}' \
         AND Payload LIKE '%\"row\":{row}}}%'"
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(db.pg().expect("PostgreSQL"))
        .await
        .expect("a row's status")
}

fn row_event(record: &str, row: u64) -> NewEvent {
    NewEvent::new(
        EVENT_TYPE,
        format!(r#"{{"object":"Account","record_id":"{record}","snapshot":{{"row":{row}}}}}"#),
    )
}

/// A claim lost at the settle with lock-free effects in the segment rolls every handler's
/// effects back: record `b`'s first event is given back, and its second (run in the same
/// segment, without the transaction) must be given back with it, never end before it.
async fn a_record_never_ends_ahead_of_its_event_given_back_at_the_settle(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return; // SQLite's batch holds the write lock: nobody can take a claim over meanwhile.
    }
    db.execute("CREATE TABLE lf_row (name TEXT PRIMARY KEY, writer BIGINT NOT NULL)")
        .await;
    let repo: Arc<dyn OutboxRepository> = db.repository();
    let handler = Chain::default();
    let (go_on, waiting) = (handler.go_on.clone(), handler.waiting.clone());
    let handle = start(&repo, handler).await;
    // A warm-up: the worker's first claim runs alone.
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &[row_event("w", 0)]).await.unwrap();
    tx.commit().await.unwrap();
    drain(&repo, Duration::from_secs(20)).await;
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(
        &mut tx,
        &[row_event("a", 1), row_event("b", 1), row_event("b", 2)],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), waiting.notified())
        .await
        .expect("b's first event runs after a's, in one batch");
    // a's handler has ended: another worker takes its claim over (counted, a new fence).
    db.execute(
        "UPDATE _System_OutboxEvent SET RetryCount = RetryCount + 1, \
         LastModifiedDate = clock_timestamp() WHERE RecordKey = 'account:a'",
    )
    .await;
    go_on.notify_one();
    // The batch settles (a's claim found lost, every effect of the segment rolled back), and
    // b's events run again: b's second must not have ended before its first.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while status_of(&db, "b", 2).await != "processed" {
        assert!(std::time::Instant::now() < deadline, "b did not drain");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The "other worker" dies: a goes stale and runs again; everything ends in order: b's
    // second written by b's first's transaction or a later one (one worker: transactions in
    // turn; `LastModifiedDate` would not do, a chain's rows are written in one statement).
    db.execute(
        "UPDATE _System_OutboxEvent SET LastModifiedDate = LastModifiedDate - interval '1 hour' \
         WHERE RecordKey = 'account:a'",
    )
    .await;
    drain(&repo, Duration::from_secs(60)).await;
    handle.shutdown().await;
    let rows: Vec<(String, String, i32, String)> = sqlx::query_as(
        "SELECT RecordKey, Status, RetryCount, xmin::text FROM _System_OutboxEvent \
         ORDER BY CreatedDate, Id",
    )
    .fetch_all(db.pg().expect("PostgreSQL"))
    .await
    .unwrap();
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent b1, _System_OutboxEvent b2 \
             WHERE b1.RecordKey = 'account:b' AND b2.RecordKey = 'account:b' \
             AND (b1.CreatedDate, b1.Id) < (b2.CreatedDate, b2.Id) \
             AND b1.xmin::text::bigint <= b2.xmin::text::bigint \
             AND b1.Status = 'processed' AND b2.Status = 'processed'"
        )
        .await,
        1,
        "b's events processed, in order: {rows:?}"
    );
}

/// The follow-up rows' type: out of the worker's scope, so they stay as inserted.
const FOLLOW_TYPE: &str = "lock_free.follow";

/// Enqueues one follow-up row per event through `ctx.enqueue_owned` (keyed `follow:<record>`);
/// the event of record `fail` enqueues and then fails, the first time; the event of record
/// `bad` enqueues a payload that is not an envelope.
struct Fanning {
    repo: Arc<dyn OutboxRepository>,
    failed: Arc<AtomicBool>,
}

#[async_trait]
impl Handler for Fanning {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let key = event.record_key.as_ref().map(|k| k.as_str().to_string());
        let record = key
            .as_deref()
            .unwrap_or_default()
            .trim_start_matches("account:");
        let payload = if record == "bad" {
            "not an envelope".to_string()
        } else {
            format!(r#"{{"object":"Follow","record_id":"{record}","snapshot":{{}}}}"#)
        };
        ctx.enqueue_owned(
            self.repo.as_ref(),
            vec![NewEvent::new(FOLLOW_TYPE, payload)],
        )
        .await?;
        if record == "fail" && !self.failed.swap(true, Ordering::SeqCst) {
            return Err(HandlerError::Retryable("failing once on purpose".into()));
        }
        Ok(())
    }
}

/// Rows enqueued through `ctx.enqueue_owned` in a batch are inserted at the settle, for the
/// events written `processed` only: none for an attempt that failed (its retry's row comes
/// later) nor for a payload refused at the call (that handler's error, the rest of its batch
/// unharmed), in the events' order; on PostgreSQL a segment's rows are inserted by one
/// statement (one command id within their transaction).
async fn owned_rows_are_inserted_at_the_settle_for_processed_events_only(db: TestDb) {
    let repo: Arc<dyn OutboxRepository> = db.repository();
    let config = WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("owned rows under test")
        .with_workers(1)
        .with_poll_interval(Duration::from_millis(20))
        .with_retry_delay(Duration::from_millis(20))
        .with_max_retry_delay(Duration::from_millis(50))
        .with_batches(32, Duration::from_secs(30))
        .with_scope(outbox_persistence::Scope::Only(vec![EVENT_TYPE.into()]));
    let handler = Fanning {
        repo: repo.clone(),
        failed: Arc::default(),
    };
    let handle = Dispatcher::new(
        repo.clone(),
        Handlers::new().register(EVENT_TYPE, handler),
        config,
    )
    .start()
    .await
    .unwrap();
    // A warm-up: the worker's first claim runs alone (one event per attempt: at once).
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &[event("w")]).await.unwrap();
    tx.commit().await.unwrap();
    let sources = format!(
        "SELECT count(*) FROM _System_OutboxEvent WHERE EventType = '{EVENT_TYPE}' AND Status IN ('pending', 'processing')"
    );
    let wait = |what: &'static str| {
        let (db, sources) = (&db, sources.clone());
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while db.count(&sources).await > 0 {
                assert!(std::time::Instant::now() < deadline, "{what} did not drain");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    wait("the warm-up").await;
    let mut events: Vec<NewEvent> = (0..6).map(|i| event(&format!("a{i}"))).collect();
    events.push(event("fail"));
    events.push(event("bad"));
    events.extend((6..11).map(|i| event(&format!("a{i}"))));
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    wait("the sources").await;
    handle.shutdown().await;

    let status = |record: &str| {
        format!(
            "SELECT count(*) FROM _System_OutboxEvent WHERE RecordKey = 'account:{record}' AND Status = 'failed'"
        )
    };
    assert_eq!(
        db.count(&status("bad")).await,
        1,
        "the refused payload failed its event"
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM _System_OutboxEvent WHERE EventType = '{EVENT_TYPE}' \
             AND RecordKey <> 'account:bad' AND (Status <> 'processed' \
             OR (RetryCount > 0) <> (RecordKey = 'account:fail'))"
        ))
        .await,
        0,
        "the rest processed; only the failed one counted a retry"
    );
    let follows: Vec<String> = match db.backend() {
        Backend::Postgres => sqlx::query_scalar(
            "SELECT RecordKey FROM _System_OutboxEvent WHERE EventType = $1 ORDER BY CreatedDate, Id",
        )
        .bind(FOLLOW_TYPE)
        .fetch_all(db.pg().expect("PostgreSQL"))
        .await
        .unwrap(),
        Backend::Sqlite => {
            let Some(pool) = db.sqlite_pool() else {
                unreachable!()
            };
            sqlx::query_scalar(
                "SELECT RecordKey FROM _System_OutboxEvent WHERE EventType = ?1 ORDER BY CreatedDate, Id",
            )
            .bind(FOLLOW_TYPE)
            .fetch_all(pool)
            .await
            .unwrap()
        }
    };
    let mut expected: Vec<String> = std::iter::once("follow:w".to_string())
        .chain((0..11).map(|i| format!("follow:a{i}")))
        .collect();
    expected.push("follow:fail".into());
    assert_eq!(
        follows, expected,
        "one row per processed event, in their order, the retry's last"
    );
    if db.backend() == Backend::Postgres {
        // Rows of one transaction (a segment) share their statement's command id.
        assert_eq!(
            db.count(&format!(
                "SELECT count(*) FROM (SELECT xmin::text FROM _System_OutboxEvent \
                 WHERE EventType = '{FOLLOW_TYPE}' GROUP BY xmin::text \
                 HAVING count(DISTINCT cmin::text) > 1) t"
            ))
            .await,
            0,
            "a segment's rows were inserted by more than one statement"
        );
        assert!(
            db.count(&format!(
                "SELECT max(n) FROM (SELECT count(*) AS n FROM _System_OutboxEvent \
                 WHERE EventType = '{FOLLOW_TYPE}' GROUP BY xmin::text) t"
            ))
            .await
                > 1,
            "a batch's rows share a transaction"
        );
    }
}

backend_tests!(
    owned_rows_are_inserted_at_the_settle_for_processed_events_only,
    lock_free_handlers_share_a_commit_and_a_failure_undoes_only_its_own,
    handlers_that_may_lock_commit_once_each,
    a_record_never_ends_ahead_of_its_event_given_back_at_the_settle,
);
