//! Batched attempts that cost the application nothing (docs/state-machine.md, "Batched
//! attempts", rules 2, 3 and 8), on real databases with the default batch configuration:
//! application transactions that write the handlers' rows beside 8 workers never fail; a claim
//! lost at the settle never lets a later row of its record end before it
//! (`../shared/repro/batches/f1_chain_commits_past_lost_head.sh`); a handler that runs long
//! gives its worker's unstarted claims back for idle workers. Invariants are read back from the
//! database.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, DispatcherHandle, Handler, HandlerError, Handlers,
    OutboxEvent, WorkerConfig,
};
use outbox_persistence::{NewEvent, OutboxRepository, Tx, statement, with_tx};
use outbox_tests::{Backend, TestDb, backend_tests, drain};
use record_key::EventEnvelope;

const EVENT_TYPE: &str = "safety.test";

/// Rows the application and the handlers both write.
const APP_ROWS: u64 = 30;

/// The default pull configuration (batches of 32, a 10 ms budget), `workers` workers, quick
/// polls; the gate is skipped (no consumers are declared here).
fn config(workers: usize) -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("batch safety under test")
        .with_workers(workers)
        .with_poll_interval(Duration::from_millis(20))
        .with_retry_delay(Duration::from_millis(20))
        .with_max_retry_delay(Duration::from_millis(50))
}

fn payload(record: &str, what: &str, row: u64) -> String {
    format!(
        r#"{{"object":"Account","record_id":"{record}","snapshot":{{"do":"{what}","row":{row}}}}}"#
    )
}

fn event(record: &str, what: &str, row: u64) -> NewEvent {
    NewEvent::new(EVENT_TYPE, payload(record, what, row))
}

async fn enqueue(repo: &Arc<dyn OutboxRepository>, events: &[NewEvent]) {
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
}

async fn start(
    repo: &Arc<dyn OutboxRepository>,
    handler: impl Handler,
    config: WorkerConfig,
) -> DispatcherHandle {
    let handlers = Handlers::new().register(EVENT_TYPE, handler);
    Dispatcher::new(repo.clone(), handlers, config)
        .start()
        .await
        .unwrap()
}

/// What the handler is asked to do, and the application row it touches.
fn act(event: &OutboxEvent) -> (String, u64) {
    let envelope = EventEnvelope::parse(&event.payload).expect("a test payload");
    let what = envelope.snapshot["do"].as_str().unwrap_or("").to_string();
    let row = envelope.snapshot["row"].as_u64().unwrap_or(0);
    (what, row)
}

/// The handlers of these tests: `touch` updates its application row in the attempt
/// transaction (as a CRM's after-save capture does), `noop` succeeds without the transaction,
/// `hold` waits (without the transaction) until the test lets it go, the first time it runs.
#[derive(Default)]
struct Acting {
    held: Arc<AtomicBool>,
    go_on: Arc<tokio::sync::Notify>,
    runs: Arc<AtomicU64>,
    /// The record of every handler run, in order.
    log: Arc<std::sync::Mutex<Vec<String>>>,
    /// Set once a `fail_first` handler failed.
    failed_once: Arc<AtomicBool>,
    /// The transaction of every `touch` (PostgreSQL).
    writers: Arc<std::sync::Mutex<Vec<i64>>>,
}

#[async_trait]
impl Handler for Acting {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let envelope = EventEnvelope::parse(&event.payload).expect("a test payload");
        let (what, row) = act(event);
        let record = envelope.record_id.clone().unwrap_or_default();
        self.log.lock().unwrap().push(format!("{record}:{row}"));
        if what == "fail_first" && !self.failed_once.swap(true, Ordering::SeqCst) {
            return Err(HandlerError::Permanent(
                "failing its first run on purpose".into(),
            ));
        }
        if what == "hold_touch" && !self.held.swap(true, Ordering::SeqCst) {
            self.go_on.notified().await;
        }
        match what.as_str() {
            "touch" | "hold_touch" | "touch_wrapped" | "touch_unbounded" => {
                // On PostgreSQL the row keeps the transaction that wrote it, and the handler
                // notes it: the tests read which handlers shared a transaction.
                // `touch_wrapped` hides a database error's kind in a message of its own, as
                // handlers do.
                let tx = ctx.tx();
                if matches!(tx, Tx::Postgres(_)) {
                    if what == "touch_unbounded" {
                        // A handler that sets its own lock timeout for the rest of the
                        // transaction, as a careless one might.
                        with_tx!(&mut *tx, |conn| statement::query(
                            "SET LOCAL lock_timeout = '10s'"
                        )
                        .execute(conn)
                        .await
                        .map(|_| ()))?;
                    }
                    let written = with_tx!(tx, |conn| {
                        statement::query_scalar(
                        "UPDATE app_row SET seen = seen + 1, writer = txid_current() WHERE id = $1
                         RETURNING writer"
                    )
                    .bind(row as i64)
                    .fetch_one(conn)
                    .await
                    });
                    let writer: i64 = match written {
                        Err(e) if what == "touch_wrapped" => {
                            return Err(HandlerError::Retryable(format!("could not touch: {e}")));
                        }
                        written => written?,
                    };
                    self.writers.lock().unwrap().push(writer);
                } else {
                    with_tx!(tx, |conn| statement::query(
                        "UPDATE app_row SET seen = seen + 1 WHERE id = $1"
                    )
                    .bind(row as i64)
                    .execute(conn)
                    .await
                    .map(|_| ()))?;
                }
            }
            "hold" if !self.held.swap(true, Ordering::SeqCst) => {
                self.go_on.notified().await;
            }
            _ => {}
        }
        Ok(())
    }
}

/// A small deterministic generator (no test depends on a seed it cannot print).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % below
    }
}

/// The application's table the handlers write, with rows `ids` at zero.
async fn app_rows(db: &TestDb, ids: &[i64]) {
    db.execute(
        "CREATE TABLE app_row (id BIGINT PRIMARY KEY, n BIGINT NOT NULL, seen BIGINT NOT NULL,
                               writer BIGINT NOT NULL DEFAULT 0)",
    )
    .await;
    for id in ids {
        db.execute(&format!(
            "INSERT INTO app_row (id, n, seen) VALUES ({id}, 0, 0)"
        ))
        .await;
    }
}

/// One application transaction: upserts `rows` (ascending, so two applications never deadlock
/// with each other) and enqueues an event for each, as a CRM saves records and their triggers.
async fn application_transaction(
    repo: &Arc<dyn OutboxRepository>,
    rows: &[u64],
) -> Result<(), String> {
    let mut tx = repo.begin().await.map_err(|e| e.chain())?;
    for &row in rows {
        with_tx!(&mut tx, |conn| statement::query(
            "INSERT INTO app_row (id, n, seen) VALUES ($1, 1, 0)
             ON CONFLICT (id) DO UPDATE SET n = app_row.n + 1"
        )
        .bind(row as i64)
        .execute(conn)
        .await
        .map(|_| ()))
        .map_err(|e| e.to_string())?;
    }
    let events: Vec<NewEvent> = rows
        .iter()
        .map(|&row| event(&format!("R{row}"), "touch", row))
        .collect();
    repo.enqueue(&mut tx, &events)
        .await
        .map_err(|e| e.chain())?;
    tx.commit().await.map_err(|e| e.chain())
}

/// Finding 1 of the batched-attempts review: an application's transactions that write the rows
/// the handlers write, repeated beside 8 pull workers with the default batches, never fail
/// because of the workers (no deadlock victim, no lock timeout). With a batch holding up to 32
/// handlers' row locks to one `COMMIT`, the application's upserts deadlocked with it; a batch
/// now commits after each handler that kept effects, so it never holds two handlers' locks.
async fn application_transactions_beside_batches_never_fail(db: TestDb) {
    let (_, writers) = applications_beside_workers(&db, config(8)).await;
    let mut distinct = writers.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        writers.len(),
        "no transaction wrote two handlers' rows"
    );
}

/// The same with writes shared (rule 11): a segment holds several writing handlers' locks, and
/// its later handlers' lock waits are bounded (5 ms), so a later handler never waits beside
/// those locks long enough for a deadlock check (1 s) to find a cycle through it. Without the
/// bound (shared segments, later handlers waiting up to the attempt's lock timeout), 8 workers
/// beside the applications' ascending upserts meet cycles. PostgreSQL only: on SQLite a batch
/// holds the one write lock and writes are not shared.
async fn application_transactions_beside_shared_writes_never_fail(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return;
    }
    let shared = config(8).with_shared_writes(Duration::from_millis(50));
    let (metrics, writers) = applications_beside_workers(&db, shared).await;
    let mut distinct = writers.clone();
    distinct.sort_unstable();
    distinct.dedup();
    eprintln!(
        "shared writes beside applications: {} batches, {} handler writes by {} transactions, {} run again",
        metrics.batches,
        writers.len(),
        distinct.len(),
        metrics.shared_write_reruns
    );
    assert!(
        distinct.len() < writers.len(),
        "some transactions wrote several handlers' rows"
    );
}

/// Two applications run 60 transactions each that upsert up to 8 random application rows
/// (ascending) and enqueue an event per row, beside 8 pull workers of `config` whose handlers
/// update those rows; asserts that none failed, every event ran its effect once and none was
/// counted as a failure. Returns the workers' metrics and the transactions that wrote the
/// handlers' rows (PostgreSQL; empty on SQLite).
async fn applications_beside_workers(
    db: &TestDb,
    config: WorkerConfig,
) -> (outbox_events::MetricsSnapshot, Vec<i64>) {
    app_rows(db, &[]).await;
    let repo = db.repository();
    let rows: Vec<u64> = (0..APP_ROWS).collect();
    application_transaction(&repo, &rows).await.unwrap();
    let handler = Acting::default();
    let writers = handler.writers.clone();
    let handle = start(&repo, handler, config).await;
    let mut applications = Vec::new();
    for seed in 1..=2u64 {
        let repo = repo.clone();
        applications.push(tokio::spawn(async move {
            let mut random = Lcg(seed * 7_919);
            let mut failures = Vec::new();
            for _ in 0..60 {
                let mut rows: Vec<u64> = (0..8).map(|_| random.next(APP_ROWS)).collect();
                rows.sort_unstable();
                rows.dedup();
                if let Err(e) = application_transaction(&repo, &rows).await {
                    failures.push(e);
                }
            }
            failures
        }));
    }
    let mut failures = Vec::new();
    for application in applications {
        failures.extend(application.await.unwrap());
    }
    drain(&repo, Duration::from_secs(120)).await;
    let metrics = handle.shutdown().await.metrics;
    assert!(
        failures.is_empty(),
        "{} application transactions failed beside the workers: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    // Every event ran its effect once, and none was counted as a failure (no worker was a
    // deadlock victim or timed out on a lock either).
    let events = db
        .count(&format!(
            "SELECT count(*) FROM _System_OutboxEvent WHERE EventType = '{EVENT_TYPE}'"
        ))
        .await;
    assert_eq!(
        db.count("SELECT CAST(sum(seen) AS BIGINT) FROM app_row")
            .await,
        events
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status <> 'processed' OR RetryCount > 0"
        )
        .await,
        0,
        "{metrics:?}"
    );
    assert!(metrics.batches > 0, "batches ran: {metrics:?}");
    let writers = writers.lock().unwrap().clone();
    (metrics, writers)
}

/// Rule 11, one interleaving: with writes shared, writing handlers of one batch commit
/// together, and a later handler whose lock wait reaches the bound (its statement fails) is
/// rolled back and runs first in the next segment, uncounted, even when it wraps the error in
/// a message of its own. An application transaction holds row 3 while one worker runs
/// six events (rows 1 to 6, one record each) in a batch: rows 1 and 2 are written by one
/// transaction; event 3 waits 5 ms for its row, runs again in a segment of its own (it waited
/// past the 250 ms window there), and rows 4 to 6 share the next.
async fn writers_share_a_segment_and_a_bounded_wait_runs_again(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return;
    }
    app_rows(&db, &[1, 2, 3, 4, 5, 6]).await;
    let repo = db.repository();
    let config = config(1)
        .with_batches(32, Duration::from_secs(30))
        .with_shared_writes(Duration::from_millis(250));
    let handle = start(&repo, Acting::default(), config).await;
    // The first claim runs alone (the worker has not timed its handlers yet): a warm-up.
    enqueue(&repo, &[event("W", "noop", 0)]).await;
    drain(&repo, Duration::from_secs(20)).await;
    let mut application = repo.begin().await.unwrap();
    with_tx!(&mut application, |conn| statement::query(
        "UPDATE app_row SET n = n + 1 WHERE id = 3"
    )
    .execute(conn)
    .await
    .map(|_| ()))
    .unwrap();
    // Row 2's handler sets its own lock timeout (10 s) for the rest of the transaction: row 3's
    // savepoint bounds its waits again. Row 3's handler wraps its lock timeout in an error of
    // its own: still run again, uncounted.
    let events: Vec<NewEvent> = (1..=6)
        .map(|row| {
            let what = match row {
                2 => "touch_unbounded",
                3 => "touch_wrapped",
                _ => "touch",
            };
            event(&format!("S{row}"), what, row)
        })
        .collect();
    enqueue(&repo, &events).await;
    // Held until event 3 has met the bound and been rolled back (the metric says so), then
    // past the 250 ms window, so that its run again waits longer than the window.
    let bounced = tokio::time::timeout(Duration::from_secs(20), async {
        while handle.metrics().shared_write_reruns == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    application.commit().await.unwrap();
    bounced.expect("event 3's lock wait was bounded while the application held its row");
    drain(&repo, Duration::from_secs(20)).await;
    let metrics = handle.shutdown().await.metrics;
    let mut w = Vec::new();
    for row in 1..=6 {
        w.push(
            db.count(&format!("SELECT writer FROM app_row WHERE id = {row}"))
                .await,
        );
    }
    assert_eq!(w[0], w[1], "rows 1 and 2 written by one segment: {w:?}");
    assert!(w[2] != w[0] && w[2] != w[3], "row 3 alone: {w:?}");
    assert!(w[3] == w[4] && w[4] == w[5], "rows 4 to 6 in one: {w:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM app_row WHERE id BETWEEN 1 AND 6 AND seen = 1")
            .await,
        6,
        "each event's write landed once"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status <> 'processed' OR RetryCount > 0"
        )
        .await,
        0,
        "the bounded wait was counted against no event: {metrics:?}"
    );
    assert!(metrics.shared_write_reruns >= 1, "{metrics:?}");
    assert_eq!(metrics.lock_timeouts, 0, "{metrics:?}");
}

/// Finding 1, one interleaving, deterministic: a batch never holds a finished handler's row
/// locks while a later handler of it runs. Two events of two records run in one batch: the
/// first updates application row 1 in the attempt transaction, the second waits for the test
/// before it touches row 2. Meanwhile an application transaction updates row 1 under a 500 ms
/// lock timeout: row 1 is free, because the first handler's segment
/// committed when it ended. Held to the batch's one `COMMIT` (before segments), that update
/// waited for the batch, and an application holding row 2 would have deadlocked with it.
/// PostgreSQL only: on SQLite a batch holds the one write lock, and an application write waits
/// for it whatever the handlers do.
async fn a_batch_holds_no_finished_handlers_row_locks(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return;
    }
    app_rows(&db, &[1, 2]).await;
    let repo = db.repository();
    let handler = Acting::default();
    let (held, go_on) = (handler.held.clone(), handler.go_on.clone());
    let handle = start(&repo, handler, config(1)).await;
    // The first claim runs alone (the worker has not timed its handlers yet): a warm-up.
    enqueue(&repo, &[event("W", "noop", 0)]).await;
    drain(&repo, Duration::from_secs(20)).await;
    let batches_before = handle.metrics().batches;
    enqueue(
        &repo,
        &[event("A", "touch", 1), event("B", "hold_touch", 2)],
    )
    .await;
    until_held(&held).await;
    assert_eq!(
        status(&db, "A", 1).await,
        "processed",
        "A's segment committed"
    );
    assert_eq!(status(&db, "B", 2).await, "processing");
    let application = async {
        let mut tx = repo.begin().await.unwrap();
        for sql in [
            "SET LOCAL lock_timeout = '500ms'",
            "UPDATE app_row SET n = n + 1 WHERE id = 1",
        ] {
            with_tx!(&mut tx, |conn| statement::query(sql)
                .execute(conn)
                .await
                .map(|_| ()))
            .map_err(|e| e.to_string())?;
        }
        tx.commit().await.map_err(|e| e.chain())
    };
    let applied: Result<(), String> = application.await;
    go_on.notify_one();
    drain(&repo, Duration::from_secs(20)).await;
    let metrics = handle.shutdown().await.metrics;
    applied.expect("the application waited for a finished handler's row lock");
    assert_eq!(
        metrics.batches,
        batches_before + 1,
        "A and B ran in one batch"
    );
    assert_eq!(
        db.count("SELECT CAST(sum(seen) AS BIGINT) FROM app_row WHERE id IN (1, 2)")
            .await,
        2
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status <> 'processed' OR RetryCount > 0"
        )
        .await,
        0
    );
}

/// Waits (20 s at most) until a `hold` handler runs and waits for the test.
async fn until_held(held: &AtomicBool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !held.load(Ordering::SeqCst) {
        assert!(
            std::time::Instant::now() < deadline,
            "the hold handler never ran"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (20 s at most) until `sql` counts `want`.
async fn until_count(db: &TestDb, sql: &str, want: i64, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if db.count(sql).await == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: never reached {want}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Status of the row of `record` with `seq` (its place in its record), as text.
async fn status(db: &TestDb, record: &str, row: u64) -> String {
    let code = db
        .count(&format!(
            "SELECT CAST(CASE Status WHEN 'processed' THEN 1 WHEN 'failed' THEN 2
                 WHEN 'processing' THEN 3 ELSE 0 END AS BIGINT)
             FROM _System_OutboxEvent WHERE RecordKey = 'account:{record}' AND Payload LIKE '%\"row\":{row}}}%'"
        ))
        .await;
    ["pending", "processed", "failed", "processing"][code as usize].to_string()
}

/// Finding 3 (`f1_chain_commits_past_lost_head.sh`): a worker holds the chain [r1, r2] of one
/// record; r1's handler succeeded without the transaction, then r1's claim is taken over (as a
/// reclaim by another worker after the beats failed for stale-after) while r2's handler runs.
/// At the settle r1 is lost: r2 must not be written `processed` while the older r1 is still in
/// flight elsewhere. It is given back, and runs after r1.
async fn a_claim_lost_at_the_settle_never_lets_its_record_run_ahead(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return; // SQLite's batch holds the write lock: nobody can take a claim over meanwhile.
    }
    let repo = db.repository();
    let handler = Acting::default();
    let (held, go_on) = (handler.held.clone(), handler.go_on.clone());
    let handle = start(&repo, handler, config(1)).await;
    // The first claim runs alone (the worker has not timed its handlers yet): a warm-up.
    enqueue(&repo, &[event("W", "noop", 0)]).await;
    drain(&repo, Duration::from_secs(20)).await;
    enqueue(&repo, &[event("C", "noop", 1), event("C", "hold", 2)]).await;
    until_held(&held).await;
    assert_eq!(
        status(&db, "C", 2).await,
        "processing",
        "r2 runs in r1's batch"
    );
    // r1 ran and waits for the settle: another worker reclaims it (counted, a new fence).
    db.execute(
        "UPDATE _System_OutboxEvent SET RetryCount = RetryCount + 1,
             LastModifiedDate = clock_timestamp()
         WHERE RecordKey = 'account:C' AND Payload LIKE '%\"row\":1}%'",
    )
    .await;
    go_on.notify_one();
    // The batch settles: r2 goes back to pending (uncounted), never processed before r1.
    until_count(
        &db,
        "SELECT count(*) FROM _System_OutboxEvent WHERE RecordKey = 'account:C' AND Status = 'pending'",
        1,
        "r2 given back",
    )
    .await;
    assert_eq!(status(&db, "C", 1).await, "processing");
    assert_eq!(status(&db, "C", 2).await, "pending");
    // The "other worker" dies: r1 goes stale, is reclaimed and runs, then r2.
    db.execute(
        "UPDATE _System_OutboxEvent SET LastModifiedDate = LastModifiedDate - interval '1 hour'
         WHERE RecordKey = 'account:C' AND Payload LIKE '%\"row\":1}%'",
    )
    .await;
    drain(&repo, Duration::from_secs(60)).await;
    let metrics = handle.shutdown().await.metrics;
    assert_eq!(status(&db, "C", 1).await, "processed");
    assert_eq!(status(&db, "C", 2).await, "processed");
    assert!(metrics.lost_claims >= 1, "{metrics:?}");
}

/// Finding 2: a handler that runs long gives back its worker's claims that have not started
/// (they are untouched by its transaction), so an idle worker runs them while it still runs;
/// before, they waited for it in the same worker.
async fn a_long_handler_gives_its_workers_unstarted_claims_to_idle_workers(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return; // SQLite runs one attempt at a time: no other worker could run them meanwhile.
    }
    let repo = db.repository();
    let slow = Acting::default();
    let (held, go_on) = (slow.held.clone(), slow.go_on.clone());
    let first = start(&repo, slow, config(1)).await;
    // A warm-up: the worker then asks for batches.
    enqueue(&repo, &[event("W", "noop", 0)]).await;
    drain(&repo, Duration::from_secs(20)).await;
    enqueue(
        &repo,
        &[
            event("S", "hold", 1),
            event("A", "noop", 2),
            event("B", "noop", 3),
            event("C", "noop", 4),
        ],
    )
    .await;
    until_held(&held).await;
    // Another worker (another process's, say) is idle: it gets the rows the slow one held.
    let idle = Acting::default();
    let idle_runs = idle.runs.clone();
    let second = start(&repo, idle, config(1)).await;
    until_count(
        &db,
        "SELECT count(*) FROM _System_OutboxEvent
         WHERE Status = 'processed' AND RecordKey IN ('account:A', 'account:B', 'account:C')",
        3,
        "the slow worker's other claims run elsewhere while it runs",
    )
    .await;
    assert_eq!(
        status(&db, "S", 1).await,
        "processing",
        "the slow handler still runs"
    );
    assert_eq!(idle_runs.load(Ordering::SeqCst), 3);
    go_on.notify_one();
    drain(&repo, Duration::from_secs(20)).await;
    let first = first.shutdown().await.metrics;
    second.shutdown().await;
    // The slow worker held A, B and C (claimed with S) and gave them back unrun.
    assert_eq!(first.not_run, 3, "{first:?}");
    // Given back uncounted.
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status <> 'processed' OR RetryCount > 0"
        )
        .await,
        0
    );
}

/// Finding 6: a claim lost at the settle whose handler kept effects in the transaction costs
/// only its own event: the segment rolls back to its savepoint (the lost event's effects alone:
/// a batch holds one handler's effects at a time) and the other events' outcomes commit. Before,
/// the whole batch rolled back and its other events ran again.
async fn a_claim_lost_at_the_settle_costs_only_its_own_event(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return; // SQLite's batch holds the write lock: nobody can take a claim over meanwhile.
    }
    app_rows(&db, &[7]).await;
    let repo = db.repository();
    let handler = Acting::default();
    let (held, go_on, log) = (
        handler.held.clone(),
        handler.go_on.clone(),
        handler.log.clone(),
    );
    let handle = start(&repo, handler, config(1)).await;
    enqueue(&repo, &[event("W", "noop", 0)]).await;
    drain(&repo, Duration::from_secs(20)).await;
    enqueue(
        &repo,
        &[
            event("A", "noop", 1),
            event("B", "noop", 2),
            event("L", "hold_touch", 7),
        ],
    )
    .await;
    until_held(&held).await;
    // L's claim is taken over while its handler runs (its effects then go in the transaction).
    db.execute(
        "UPDATE _System_OutboxEvent SET RetryCount = RetryCount + 1,
             LastModifiedDate = clock_timestamp()
         WHERE RecordKey = 'account:L'",
    )
    .await;
    go_on.notify_one();
    until_count(
        &db,
        "SELECT count(*) FROM _System_OutboxEvent WHERE RecordKey IN ('account:A', 'account:B') AND Status = 'processed'",
        2,
        "the others commit",
    )
    .await;
    assert_eq!(
        status(&db, "L", 7).await,
        "processing",
        "L is the other worker's"
    );
    assert_eq!(
        db.count("SELECT seen FROM app_row WHERE id = 7").await,
        0,
        "the lost claim's effects rolled back"
    );
    // The other worker dies; L is reclaimed here and runs once more.
    db.execute(
        "UPDATE _System_OutboxEvent SET LastModifiedDate = LastModifiedDate - interval '1 hour'
         WHERE RecordKey = 'account:L'",
    )
    .await;
    drain(&repo, Duration::from_secs(60)).await;
    let metrics = handle.shutdown().await.metrics;
    assert!(
        metrics.batches >= 1,
        "A, B and L ran in one batch: {metrics:?}"
    );
    let log = log.lock().unwrap().clone();
    let runs = |record: &str| {
        log.iter()
            .filter(|r| r.split(':').next() == Some(record))
            .count()
    };
    assert_eq!((runs("A"), runs("B"), runs("L")), (1, 1, 2), "{log:?}");
    assert_eq!(db.count("SELECT seen FROM app_row WHERE id = 7").await, 1);
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status <> 'processed'")
            .await,
        0
    );
}

/// Finding 5: an operator retry of an older failed row, made while a worker's batch runs the
/// record's later rows as a chain, is not overtaken by the chain's rows: the settle holds back
/// the record's rows (an older row became non-terminal after the segment began) and gives them
/// back; the retried row runs first, then they run again, in order.
async fn an_operator_retry_mid_chain_is_not_overtaken(db: TestDb) {
    if db.backend() != Backend::Postgres {
        return; // SQLite's retry waits for the batch's write lock: it cannot land mid-batch.
    }
    let repo = db.repository();
    let handler = Acting::default();
    let (held, go_on, log) = (
        handler.held.clone(),
        handler.go_on.clone(),
        handler.log.clone(),
    );
    let handle = start(&repo, handler, config(1)).await;
    enqueue(&repo, &[event("W", "noop", 0)]).await;
    drain(&repo, Duration::from_secs(20)).await;
    // r1 fails for good; r2 and r3 then run as a chain in one segment.
    enqueue(&repo, &[event("K", "fail_first", 1)]).await;
    drain(&repo, Duration::from_secs(20)).await;
    assert_eq!(status(&db, "K", 1).await, "failed");
    enqueue(&repo, &[event("K", "noop", 2), event("K", "hold", 3)]).await;
    until_held(&held).await;
    // An operator retries r1 while r3's handler runs (r2's already ran in the chain).
    let r1 = db
        .count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE RecordKey = 'account:K' AND Status = 'failed'",
        )
        .await;
    assert_eq!(r1, 1);
    let retried = repo
        .retry_failed(outbox_persistence::RetryFilter::Failed { event_type: None })
        .await
        .unwrap();
    assert_eq!(retried, 1);
    go_on.notify_one();
    drain(&repo, Duration::from_secs(60)).await;
    handle.shutdown().await;
    let log: Vec<String> = log.lock().unwrap().clone();
    let k: Vec<&str> = log
        .iter()
        .filter(|r| r.starts_with("K:"))
        .map(String::as_str)
        .collect();
    // r1 failed; r2 and r3 ran in the chain; the retry held them back at the settle; then r1,
    // r2, r3 in order. Before, the chain committed past the retried r1, which ran last.
    assert_eq!(k, ["K:1", "K:2", "K:3", "K:1", "K:2", "K:3"], "{log:?}");
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE RecordKey = 'account:K' AND Status = 'processed'",
        )
        .await,
        3
    );
}

backend_tests!(
    an_operator_retry_mid_chain_is_not_overtaken,
    a_claim_lost_at_the_settle_costs_only_its_own_event,
    application_transactions_beside_batches_never_fail,
    application_transactions_beside_shared_writes_never_fail,
    writers_share_a_segment_and_a_bounded_wait_runs_again,
    a_batch_holds_no_finished_handlers_row_locks,
    a_claim_lost_at_the_settle_never_lets_its_record_run_ahead,
    a_long_handler_gives_its_workers_unstarted_claims_to_idle_workers,
);
