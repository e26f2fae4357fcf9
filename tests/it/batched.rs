//! Batched attempts (docs/state-machine.md, "Batched attempts") on real databases: per-event
//! savepoints inside one transaction, a transaction that dies at `COMMIT` (a deferred constraint
//! one event's effects broke), a lock timeout in one event, the time budget, and a claim taken
//! over inside a live batch. Every invariant is read back from the database.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, DispatcherHandle, Handler, HandlerError, Handlers,
    MetricsSnapshot, OutboxEvent, WorkerConfig,
};
use outbox_persistence::{NewEvent, OutboxRepository, statement, with_tx};
use outbox_tests::{Backend, TestDb, backend_tests, drain};
use record_key::EventEnvelope;

const EVENT_TYPE: &str = "batched.test";

/// What the handler does with an event, from its payload's `snapshot.do`.
#[derive(Debug, PartialEq)]
enum Act {
    /// Writes its effect.
    Effect,
    /// Writes its effect, then fails (retryable) on its first attempt.
    FailOnce,
    /// Succeeds without asking for the transaction (a relay's kind of handler).
    Noop,
    /// Fails (retryable) on its first attempt without asking for the transaction, then
    /// succeeds without it.
    NoopFailOnce,
    /// Writes a child row whose parent does not exist: the deferred constraint fails the
    /// `COMMIT` of whatever transaction it ran in.
    BreakCommit,
    /// Takes a row lock the test holds (PostgreSQL), on its first attempt.
    LockHeld,
    /// Sleeps 30 ms, then writes its effect.
    Slow,
    /// On its first run, says it runs ([`WAITING`]) and waits for [`RESUME`]; then writes its
    /// effect.
    Wait,
    /// The same with [`HOLDING`] and [`GO_ON`] (a test of its own, run beside `Wait`'s).
    Hold,
    /// The same with [`PAUSING`] and [`UNPAUSE`] (another test's).
    Pause,
}

/// Set by a `wait` handler once it runs.
static WAITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Lets a `wait` handler go on.
static RESUME: tokio::sync::Notify = tokio::sync::Notify::const_new();
/// Set by a `hold` handler once it runs.
static HOLDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Lets a `hold` handler go on.
static GO_ON: tokio::sync::Notify = tokio::sync::Notify::const_new();
/// Set by a `pause` handler once it runs.
static PAUSING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Lets a `pause` handler go on.
static UNPAUSE: tokio::sync::Notify = tokio::sync::Notify::const_new();

fn act(event: &OutboxEvent) -> Act {
    let envelope = EventEnvelope::parse(&event.payload).expect("a test payload");
    match envelope.snapshot.get("do").and_then(|v| v.as_str()) {
        Some("fail_once") => Act::FailOnce,
        Some("noop") => Act::Noop,
        Some("noop_fail_once") => Act::NoopFailOnce,
        Some("break_commit") => Act::BreakCommit,
        Some("lock_held") => Act::LockHeld,
        Some("slow") => Act::Slow,
        Some("wait") => Act::Wait,
        Some("hold") => Act::Hold,
        Some("pause") => Act::Pause,
        _ => Act::Effect,
    }
}

fn event(record: usize, what: &str) -> NewEvent {
    NewEvent::new(
        EVENT_TYPE,
        format!(r#"{{"object":"Account","record_id":"B{record}","snapshot":{{"do":"{what}"}}}}"#),
    )
}

/// The effect table, and a parent/child pair whose foreign key is checked at `COMMIT`.
async fn create_tables(db: &TestDb) {
    let serial = match db.backend() {
        Backend::Postgres => "n BIGSERIAL PRIMARY KEY",
        Backend::Sqlite => "n INTEGER PRIMARY KEY AUTOINCREMENT",
    };
    db.execute(&format!(
        "CREATE TABLE batch_effect ({serial}, event_id TEXT NOT NULL, attempt INTEGER NOT NULL)"
    ))
    .await;
    db.execute("CREATE TABLE batch_parent (id TEXT PRIMARY KEY)")
        .await;
    db.execute(
        "CREATE TABLE batch_child (id TEXT PRIMARY KEY, parent_id TEXT NOT NULL
           REFERENCES batch_parent (id) DEFERRABLE INITIALLY DEFERRED)",
    )
    .await;
    db.execute("CREATE TABLE batch_lock (id INTEGER PRIMARY KEY)")
        .await;
    db.execute("INSERT INTO batch_lock (id) VALUES (1)").await;
}

/// Writes the effects the payload asks for, in the attempt transaction.
struct Acting {
    calls: Arc<AtomicU64>,
}

#[async_trait]
impl Handler for Acting {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let what = act(event);
        match what {
            Act::NoopFailOnce if event.retry_count == 0 => {
                return Err(HandlerError::Retryable("failing once, no effects".into()));
            }
            Act::Noop | Act::NoopFailOnce => return Ok(()),
            _ => {}
        }
        if what == Act::Slow {
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        // Only its first run waits: a batch given back at its settle runs it again uncounted.
        if what == Act::Wait && !WAITING.load(Ordering::SeqCst) {
            let resumed = RESUME.notified();
            WAITING.store(true, Ordering::SeqCst);
            resumed.await;
        }
        if what == Act::Hold && event.retry_count == 0 {
            let resumed = GO_ON.notified();
            HOLDING.store(true, Ordering::SeqCst);
            resumed.await;
        }
        if what == Act::Pause && event.retry_count == 0 {
            let resumed = UNPAUSE.notified();
            PAUSING.store(true, Ordering::SeqCst);
            resumed.await;
        }
        if what == Act::LockHeld && event.retry_count == 0 {
            with_tx!(ctx.tx(), |conn| statement::query(
                "SELECT id FROM batch_lock WHERE id = 1 FOR UPDATE"
            )
            .execute(conn)
            .await
            .map(|_| ()))?;
        }
        let id = event.id.to_string();
        let attempt = event.retry_count + 1;
        with_tx!(ctx.tx(), |conn| statement::query(
            "INSERT INTO batch_effect (event_id, attempt) VALUES ($1, $2)"
        )
        .bind(&id)
        .bind(attempt)
        .execute(conn)
        .await
        .map(|_| ()))?;
        if what == Act::BreakCommit {
            with_tx!(ctx.tx(), |conn| statement::query(
                "INSERT INTO batch_child (id, parent_id) VALUES ($1, 'missing')"
            )
            .bind(&id)
            .execute(conn)
            .await
            .map(|_| ()))?;
        }
        if what == Act::FailOnce && event.retry_count == 0 {
            return Err(HandlerError::Retryable("failing once on purpose".into()));
        }
        Ok(())
    }
}

/// Waits (20 s at most) until a handler has set `flag`: it runs and waits for the test.
async fn until_running(flag: &std::sync::atomic::AtomicBool, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !flag.load(Ordering::SeqCst) {
        assert!(
            std::time::Instant::now() < deadline,
            "the {what} handler never ran"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn config() -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("batched attempts under test")
        .with_workers(1)
        .with_poll_interval(Duration::from_millis(20))
        .with_retry_delay(Duration::from_millis(20))
        .with_max_retry_delay(Duration::from_millis(50))
        .with_max_retry_attempts(3)
        .with_batches(16, Duration::from_secs(5))
}

async fn enqueue(repo: &Arc<dyn OutboxRepository>, events: &[NewEvent]) {
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
}

async fn start(repo: &Arc<dyn OutboxRepository>, config: WorkerConfig) -> DispatcherHandle {
    let handlers = Handlers::new().register(
        EVENT_TYPE,
        Acting {
            calls: Arc::default(),
        },
    );
    Dispatcher::new(repo.clone(), handlers, config)
        .start()
        .await
        .unwrap()
}

async fn finish(repo: &Arc<dyn OutboxRepository>, handle: DispatcherHandle) -> MetricsSnapshot {
    drain(repo, Duration::from_secs(60)).await;
    handle.shutdown().await.metrics
}

/// The effects of `record`'s event that committed (one per committed attempt).
async fn effects(db: &TestDb, record: usize) -> i64 {
    db.count(&format!(
        "SELECT count(*) FROM batch_effect f JOIN _System_OutboxEvent e ON f.event_id = {}
         WHERE e.RecordKey = 'account:B{record}'",
        match db.backend() {
            Backend::Postgres => "e.Id::text",
            Backend::Sqlite => "e.Id",
        }
    ))
    .await
}

async fn retry_count(db: &TestDb, record: usize) -> (String, i64) {
    let status = db
        .count(&format!(
            "SELECT CAST(CASE Status WHEN 'processed' THEN 1 WHEN 'failed' THEN 2 ELSE 0 END AS BIGINT)
             FROM _System_OutboxEvent WHERE RecordKey = 'account:B{record}'"
        ))
        .await;
    let retries = db
        .count(&format!(
            "SELECT CAST(RetryCount AS BIGINT) FROM _System_OutboxEvent WHERE RecordKey = 'account:B{record}'"
        ))
        .await;
    let status = match status {
        1 => "processed",
        2 => "failed",
        _ => "open",
    };
    (status.to_string(), retries)
}

/// One transaction, a savepoint per event: a failing event's effects roll back alone, its
/// retry is recorded in the batch, and the events before and after it keep theirs.
async fn each_event_keeps_its_own_outcome_in_a_batch(db: TestDb) {
    create_tables(&db).await;
    let repo = db.repository();
    // Handlers with effects and handlers that never ask for the transaction (no savepoint is
    // taken after those, nor a rollback for their failure), interleaved.
    let what = |i: usize| match i % 5 {
        2 => "fail_once",
        3 => "noop",
        4 if i % 10 == 4 => "noop_fail_once",
        _ => "effect",
    };
    let events: Vec<NewEvent> = (0..40).map(|i| event(i, what(i))).collect();
    enqueue(&repo, &events).await;
    let handle = start(&repo, config()).await;
    let metrics = finish(&repo, handle).await;
    assert!(
        metrics.batches > 0,
        "the events ran in batches: {metrics:?}"
    );
    for i in 0..40 {
        let failed_once = matches!(what(i), "fail_once" | "noop_fail_once");
        assert_eq!(
            retry_count(&db, i).await,
            ("processed".into(), i64::from(failed_once)),
            "record {i}"
        );
        // The failed attempt's effect rolled back with its savepoint; the retry's committed.
        let effect = i64::from(!matches!(what(i), "noop" | "noop_fail_once"));
        assert_eq!(
            effects(&db, i).await,
            effect,
            "record {i}: committed effects"
        );
    }
    assert_eq!(metrics.processed, 40);
    assert_eq!(metrics.retried, 12);
    // Every first-attempt effect that committed: the 20 `effect` records'.
    assert_eq!(
        db.count("SELECT count(*) FROM batch_effect WHERE attempt = 1")
            .await,
        20
    );
}

/// A batch whose `COMMIT` fails (one event broke a deferred constraint): its segment is the
/// breaking event's alone (every handler here writes, and a handler that kept effects ends its
/// segment's transaction), so only that event is counted, on the detached path, and runs again
/// alone until it ends `failed` at MaxRetryAttempts; every other event is processed once,
/// uncounted. (Before segments, every event sharing its batch was counted once.)
async fn a_batch_whose_commit_fails_finds_the_event_that_broke_it(db: TestDb) {
    create_tables(&db).await;
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..30)
        .map(|i| event(i, if i == 12 { "break_commit" } else { "effect" }))
        .collect();
    enqueue(&repo, &events).await;
    let handle = start(&repo, config()).await;
    let metrics = finish(&repo, handle).await;
    let (status, retries) = retry_count(&db, 12).await;
    assert_eq!(
        (status.as_str(), retries),
        ("failed", 3),
        "the breaking event"
    );
    let last_error = db
        .count(
            "SELECT count(*) FROM _System_OutboxEvent
             WHERE RecordKey = 'account:B12' AND LastError LIKE '%commit failed%'",
        )
        .await;
    assert_eq!(last_error, 1, "its LastError names the failed commit");
    for i in (0..30).filter(|&i| i != 12) {
        let (status, retries) = retry_count(&db, i).await;
        assert_eq!(
            (status.as_str(), retries),
            ("processed", 0),
            "record {i}: not counted for the breaking event's commit"
        );
        assert_eq!(effects(&db, i).await, 1, "record {i}: one committed effect");
    }
    assert_eq!(effects(&db, 12).await, 0);
    assert_eq!(db.count("SELECT count(*) FROM batch_child").await, 0);
    assert!(metrics.detached_bookkeeping >= 1, "{metrics:?}");
    assert!(metrics.batches >= 1, "{metrics:?}");
}

/// A lock timeout in one event of a batch fails that event alone (retried later); the others
/// of the batch are processed with it.
async fn a_lock_timeout_in_one_event_fails_it_alone(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return; // SQLite's batch holds the only write lock: no row lock to wait for.
    }
    create_tables(&db).await;
    let pool = db.pg().unwrap().clone();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM batch_lock WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let repo = db.repository();
    // The first attempt runs alone (the worker has not timed its handlers yet); the events
    // after it share batches.
    let events: Vec<NewEvent> = (0..20)
        .map(|i| event(i, if i == 6 { "lock_held" } else { "effect" }))
        .collect();
    enqueue(&repo, &events).await;
    let handle = start(
        &repo,
        config().with_lock_timeout(Duration::from_millis(200)),
    )
    .await;
    // Every event but the locked one is processed while the lock is held.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while db
        .count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'")
        .await
        < 19
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the others were held up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.rollback().await.unwrap();
    let metrics = finish(&repo, handle).await;
    assert_eq!(retry_count(&db, 6).await, ("processed".into(), 1));
    assert!(
        metrics.lock_timeouts >= 1 && metrics.batches > 0,
        "{metrics:?}"
    );
    for i in 0..20 {
        assert_eq!(effects(&db, i).await, 1, "record {i}");
    }
}

/// A batch stops taking events once its handlers ran for the budget: the rest go back to
/// `pending` unrun and uncounted, and run in later attempts.
async fn a_batch_stops_at_its_time_budget(db: TestDb) {
    create_tables(&db).await;
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..60)
        .map(|i| event(i, if i % 10 == 5 { "slow" } else { "effect" }))
        .collect();
    enqueue(&repo, &events).await;
    let config = config().with_batches(16, Duration::from_millis(10));
    let handle = start(&repo, config).await;
    let metrics = finish(&repo, handle).await;
    assert!(
        metrics.not_run > 0,
        "a slow handler spent the budget: {metrics:?}"
    );
    assert_eq!(metrics.processed, 60);
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE RetryCount <> 0")
            .await,
        0,
        "events given back unrun are not counted"
    );
    for i in 0..60 {
        assert_eq!(effects(&db, i).await, 1, "record {i}");
    }
}

/// The committed effects' events in the order they ran, as `(record, seq)`.
async fn effect_order(db: &TestDb) -> Vec<(String, i64)> {
    let id = match db.backend() {
        Backend::Postgres => "e.Id::text",
        Backend::Sqlite => "e.Id",
    };
    let sql = format!(
        "SELECT e.RecordKey, e.Payload FROM batch_effect f JOIN _System_OutboxEvent e ON f.event_id = {id} ORDER BY f.n"
    );
    let rows: Vec<(String, String)> = match db.backend() {
        Backend::Postgres => sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_all(db.pg().unwrap())
            .await
            .unwrap(),
        Backend::Sqlite => sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_all(db.sqlite_pool().unwrap())
            .await
            .unwrap(),
    };
    rows.into_iter()
        .map(|(key, payload)| {
            let envelope = EventEnvelope::parse(&payload).unwrap();
            let seq = envelope.snapshot["seq"].as_i64().unwrap();
            (key, seq)
        })
        .collect()
}

fn sequenced(record: usize, seq: usize, what: &str) -> NewEvent {
    NewEvent::new(
        EVENT_TYPE,
        format!(
            r#"{{"object":"Account","record_id":"B{record}","snapshot":{{"do":"{what}","seq":{seq}}}}}"#
        ),
    )
}

/// Checks every record's committed effects ran in enqueue order, each once.
fn assert_in_order(order: &[(String, i64)], per_record: usize) {
    let mut last: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    for (key, seq) in order {
        let previous = last.insert(key, *seq).unwrap_or(-1);
        assert_eq!(*seq, previous + 1, "{key}: seq {seq} after {previous}");
    }
    assert!(
        last.values().all(|&seq| seq == per_record as i64 - 1),
        "{last:?}"
    );
}

/// A hot record's rows run in chains (its head and its next rows in one attempt), in order;
/// the other records beside it too.
async fn a_hot_record_runs_in_chains_in_order(db: TestDb) {
    create_tables(&db).await;
    let repo = db.repository();
    let mut events: Vec<NewEvent> = (0..150).map(|seq| sequenced(0, seq, "effect")).collect();
    events.extend((1..=10).flat_map(|r| (0..5).map(move |seq| sequenced(r, seq, "effect"))));
    enqueue(&repo, &events).await;
    let metrics = finish(&repo, start(&repo, config().with_workers(4)).await).await;
    assert!(metrics.batches > 0, "{metrics:?}");
    assert_eq!(metrics.processed, 200);
    // Without chains every one of the hot record's 150 rows needs a claim statement of its
    // own (a statement takes one head per record), so fewer than 150 statements in all shows
    // the chains; idle workers' empty claims count too (104 seen with chains on a loaded CI
    // machine, so the bound is not tighter).
    assert!(
        metrics.claim_statements < 150,
        "chains: the hot record's rows come several per claim: {metrics:?}"
    );
    let order = effect_order(&db).await;
    assert_eq!(order.len(), 200);
    let hot: Vec<_> = order
        .iter()
        .filter(|(k, _)| k == "account:B0")
        .cloned()
        .collect();
    assert_in_order(&hot, 150);
    for r in 1..=10 {
        let key = format!("account:B{r}");
        let rows: Vec<_> = order.iter().filter(|(k, _)| *k == key).cloned().collect();
        assert_in_order(&rows, 5);
    }
}

/// An event of a chain that fails: the chain's later rows go back unrun and uncounted, and
/// run after it, in order.
async fn a_failure_in_a_chain_gives_back_the_rest_unrun(db: TestDb) {
    create_tables(&db).await;
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..40)
        .map(|seq| sequenced(0, seq, if seq % 9 == 3 { "fail_once" } else { "effect" }))
        .collect();
    enqueue(&repo, &events).await;
    let metrics = finish(&repo, start(&repo, config()).await).await;
    assert!(
        metrics.not_run > 0,
        "the rows behind a failure were given back: {metrics:?}"
    );
    assert_eq!(metrics.retried, 5);
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE RetryCount <> 0")
            .await,
        5,
        "only the failed events are counted"
    );
    let order = effect_order(&db).await;
    assert_in_order(&order, 40);
}

/// A claim taken over while its batch runs (another worker reclaimed it, moving its fence)
/// writes nothing and commits nothing. If its beat finds it lost before it runs, its handler
/// never runs and the events around it commit in the batch; if its fenced write at the settle
/// finds it lost, the batch rolls back whole and gives the others back uncounted, to run again
/// (rule 3). Either way the database ends the same: each of the others processed once,
/// uncounted, and the row is the other worker's (here it goes stale and is reclaimed).
async fn a_claim_taken_over_inside_a_live_batch_writes_nothing(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return; // SQLite's batch holds the write lock: nobody can take a claim over meanwhile.
    }
    create_tables(&db).await;
    let repo = db.repository();
    // The first claim runs alone (the worker has not timed its handlers yet): a warm-up.
    enqueue(&repo, &[event(99, "effect")]).await;
    enqueue(
        &repo,
        &[event(0, "wait"), event(1, "effect"), event(2, "effect")],
    )
    .await;
    let config = config()
        .with_heartbeat_interval(Duration::from_millis(300))
        .with_stale_after(Duration::from_millis(1_500));
    WAITING.store(false, std::sync::atomic::Ordering::SeqCst);
    let handle = start(&repo, config).await;
    until_running(&WAITING, "wait").await;
    // B1 waits its turn in the live batch: move its fence, as a reclaim by another worker would.
    db.execute(
        "UPDATE _System_OutboxEvent SET LastModifiedDate = LastModifiedDate + interval '1 second'
         WHERE RecordKey = 'account:B1' AND Status = 'processing'",
    )
    .await;
    RESUME.notify_one();
    let metrics = finish(&repo, handle).await;
    assert!(
        metrics.lost_claims >= 1 && metrics.batches >= 1,
        "{metrics:?}"
    );
    for i in [0, 2, 99] {
        assert_eq!(
            retry_count(&db, i).await,
            ("processed".into(), 0),
            "record {i}"
        );
        assert_eq!(effects(&db, i).await, 1, "record {i}");
    }
    // B1's run in the batch wrote nothing; its reclaim counted the other worker's attempt.
    assert_eq!(retry_count(&db, 1).await, ("processed".into(), 1));
    assert_eq!(
        effects(&db, 1).await,
        1,
        "only the run after the reclaim committed"
    );
}

/// Every claim of a live batch stays beaten while a later handler of the batch runs longer than
/// stale-after (the outcomes are written at the settle, so no claimed row is locked by the
/// transaction meanwhile); when that transaction then dies, every event is accounted for by
/// this worker, none is reclaimed and none is lost.
async fn a_batch_keeps_its_claims_fresh_while_a_later_handler_runs_long(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return; // SQLite's batch holds the write lock: nobody can reclaim a row meanwhile.
    }
    create_tables(&db).await;
    let repo = db.repository();
    enqueue(&repo, &[event(99, "effect")]).await;
    // B0 never asks for the transaction, so it shares B1's segment (a handler that kept
    // effects would have ended the segment and committed before B1 ran).
    enqueue(&repo, &[event(0, "noop"), event(1, "hold")]).await;
    let config = config()
        .with_heartbeat_interval(Duration::from_millis(200))
        .with_stale_after(Duration::from_millis(1_000));
    HOLDING.store(false, std::sync::atomic::Ordering::SeqCst);
    let handle = start(&repo, config).await;
    until_running(&HOLDING, "hold").await;
    // Twice stale-after into the wait: B0 ran before it in the same batch, and its claim must
    // look as alive as B1's to any other claimer.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let stale = db
        .count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processing'
               AND LastModifiedDate < now() - interval '1 second'",
        )
        .await;
    assert_eq!(stale, 0, "a claim of the live batch went stale");
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processing'")
            .await,
        2,
        "B0 and B1 are claimed in the batch"
    );
    // Cut the batch's connection (the one long in its transaction), then let the handler end.
    let cut = db
        .count(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
               WHERE datname = current_database() AND pid <> pg_backend_pid()
                 AND xact_start < now() - interval '1 second') t",
        )
        .await;
    assert_eq!(cut, 1, "one connection held the batch's transaction");
    GO_ON.notify_one();
    let metrics = finish(&repo, handle).await;
    assert_eq!(metrics.lost_claims, 0, "{metrics:?}");
    assert_eq!(metrics.stale_reclaims, 0, "{metrics:?}");
    for i in [0, 1] {
        // Counted once for the dead batch (rule 5), then processed alone.
        assert_eq!(
            retry_count(&db, i).await,
            ("processed".into(), 1),
            "record {i}"
        );
    }
    assert_eq!(effects(&db, 0).await, 0, "B0 writes nothing");
    assert_eq!(effects(&db, 1).await, 1);
}

/// A graceful shutdown lets the running handler finish and commit, and gives the batch's
/// claims whose handlers have not started back unrun and uncounted, at once, instead of running
/// them past the shutdown timeout.
async fn a_stopping_worker_gives_back_what_it_has_not_started(db: TestDb) {
    create_tables(&db).await;
    let repo = db.repository();
    // The first claim runs alone (the worker has not timed its handlers yet): a warm-up.
    enqueue(&repo, &[event(99, "effect")]).await;
    let handle = start(&repo, config()).await;
    drain(&repo, Duration::from_secs(20)).await;
    PAUSING.store(false, Ordering::SeqCst);
    enqueue(
        &repo,
        &[event(0, "pause"), event(1, "effect"), event(2, "effect")],
    )
    .await;
    until_running(&PAUSING, "pause").await;
    // The graceful stop begins (what `shutdown` does first) before the handler goes on.
    handle.stop_token().cancel();
    let stopping = tokio::spawn(handle.shutdown());
    UNPAUSE.notify_one();
    let report = stopping.await.unwrap();
    assert!(report.graceful, "{report:?}");
    assert!(report.metrics.not_run >= 2, "{:?}", report.metrics);
    assert_eq!(retry_count(&db, 0).await, ("processed".into(), 0));
    assert_eq!(effects(&db, 0).await, 1);
    for i in [1, 2] {
        assert_eq!(retry_count(&db, i).await, ("open".into(), 0), "record {i}");
        assert_eq!(effects(&db, i).await, 0, "record {i}");
    }
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'pending'")
            .await,
        2,
        "given back to pending, not left claimed"
    );
}

backend_tests!(
    a_stopping_worker_gives_back_what_it_has_not_started,
    a_batch_keeps_its_claims_fresh_while_a_later_handler_runs_long,
    a_claim_taken_over_inside_a_live_batch_writes_nothing,
    a_hot_record_runs_in_chains_in_order,
    a_failure_in_a_chain_gives_back_the_rest_unrun,
    each_event_keeps_its_own_outcome_in_a_batch,
    a_batch_whose_commit_fails_finds_the_event_that_broke_it,
    a_lock_timeout_in_one_event_fails_it_alone,
    a_batch_stops_at_its_time_budget,
);
