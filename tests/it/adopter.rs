//! The queue under an adopter's real conditions (issue 12), on both backends: an operator
//! retry while a younger row of the record runs, an older row that other code writes late,
//! two application transactions enqueueing for one record, timestamps and rows in shapes this
//! code never writes, an event that kills its worker on every attempt, and a host whose clock
//! steps. Every verdict is read back from the database.

use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use outbox_events::{Dispatcher, Handler, HandlerError, Handlers, OutboxEvent, WorkerConfig};
use outbox_persistence::{
    ClaimPolicy, ClockShift, Database, EventStatus, NewEvent, OutboxRepository, RetryFilter, Scope,
    Terminal, WORKER_DIED,
};
use outbox_tests::{Backend, RawRow, TestDb, backend_tests, drain};

const STALE_AFTER: Duration = Duration::from_secs(30);
const MAX_RETRY_ATTEMPTS: i32 = 3;

fn policy() -> ClaimPolicy {
    ClaimPolicy::new(STALE_AFTER, Duration::from_secs(1), MAX_RETRY_ATTEMPTS)
}

fn lead(id: &str, seq: u32) -> String {
    format!(r#"{{"object":"Lead","record_id":"{id}","snapshot":{{"seq":{seq}}}}}"#)
}

async fn enqueue(repo: &Arc<dyn OutboxRepository>, events: &[NewEvent]) -> Vec<uuid::Uuid> {
    let mut tx = repo.begin().await.unwrap();
    let ids = repo.enqueue(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

async fn status(repo: &Arc<dyn OutboxRepository>, id: uuid::Uuid) -> EventStatus {
    repo.get_event(id).await.unwrap().unwrap().status
}

/// Row A fails; row B, younger, same record, is claimed and running; row C waits behind them.
/// `retry --id A` (and `retry --failed`) returns A to `pending`, but A is never claimed while B
/// runs, by either claim path; once B ends, A runs before C (it keeps its place in the
/// record's order).
async fn operator_retry_waits_for_the_running_sibling(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(
        &repo,
        &[
            NewEvent::new("t", lead("r", 1)),
            NewEvent::new("t", lead("r", 2)),
            NewEvent::new("t", lead("r", 3)),
        ],
    )
    .await;
    let (a, b, c) = (ids[0], ids[1], ids[2]);
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claim.event.id, a);
    repo.update_status(claim.fence, Terminal::Failed, Some("boom".into()))
        .await
        .unwrap();
    let running = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(running.event.id, b, "a failed head releases its successors");

    for filter in [RetryFilter::Id(a), RetryFilter::Failed { event_type: None }] {
        if status(&repo, a).await == EventStatus::Failed {
            assert_eq!(repo.retry_failed(filter).await.unwrap(), 1);
        }
        // Past PostgreSQL's not-before delay of a retried row: only the guard holds A now.
        db.clock.advance(Duration::from_secs(5));
        assert_eq!(status(&repo, a).await, EventStatus::Pending);
        assert!(
            repo.claim_next(policy(), &Scope::All)
                .await
                .unwrap()
                .is_none(),
            "A must not run beside its running sibling B"
        );
        assert!(repo.claim_event(a, policy()).await.unwrap().is_none());
        assert!(
            repo.get_pending_events(policy(), &Scope::All, 10)
                .await
                .unwrap()
                .is_empty()
        );
        // Back to failed for the bulk form.
        db.execute(&format!(
            "UPDATE _System_OutboxEvent SET Status = 'failed' WHERE Id = '{a}'"
        ))
        .await;
    }
    assert_eq!(repo.retry_failed(RetryFilter::Id(a)).await.unwrap(), 1);
    db.clock.advance(Duration::from_secs(5));
    // B ends: A runs next, then C.
    repo.update_status(running.fence, Terminal::Processed, None)
        .await
        .unwrap();
    let next = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        next.event.id, a,
        "the retried row keeps its place: before C"
    );
    assert!(
        repo.claim_next(policy(), &Scope::All)
            .await
            .unwrap()
            .is_none(),
        "C waits for A"
    );
    repo.update_status(next.fence, Terminal::Processed, None)
        .await
        .unwrap();
    let last = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(last.event.id, c);
}

/// Other code writes an older row of a record while a younger one runs (a transaction that
/// committed late, a clock that runs behind): the older row waits while the younger one runs,
/// instead of running beside it.
async fn late_older_row_never_runs_beside_its_sibling(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(&repo, &[NewEvent::new("t", lead("late", 2))]).await;
    let running = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(running.event.id, ids[0]);
    let late = RawRow {
        payload: lead("late", 1),
        ..RawRow::pending(Some("lead:late"), Utc::now() - TimeDelta::seconds(60))
    };
    db.insert_raw(&late).await;
    assert!(
        repo.claim_next(policy(), &Scope::All)
            .await
            .unwrap()
            .is_none()
    );
    assert!(repo.claim_event(late.id, policy()).await.unwrap().is_none());
    repo.update_status(running.fence, Terminal::Processed, None)
        .await
        .unwrap();
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claim.event.id, late.id, "it runs once its sibling is done");
}

/// Two application transactions enqueue for one record; the first to enqueue commits late.
/// The second's enqueue waits for that commit (PostgreSQL: the per-key advisory lock; SQLite:
/// the write lock, even from a deferred transaction) and draws a later `CreatedDate`, so the
/// record's events are ordered as their transactions commit and no older row becomes visible
/// after a younger one.
async fn racing_application_transactions_are_ordered_by_commit(db: TestDb) {
    let repo = db.repository();
    let (tx_a, tx_b) = match &db.db {
        Database::Postgres(pool) => (
            outbox_persistence::Tx::Postgres(pool.begin().await.unwrap()),
            outbox_persistence::Tx::Postgres(pool.begin().await.unwrap()),
        ),
        // Deferred transactions, as an application opens them.
        Database::Sqlite(pool) => (
            outbox_persistence::Tx::Sqlite(pool.begin().await.unwrap()),
            outbox_persistence::Tx::Sqlite(pool.begin().await.unwrap()),
        ),
    };
    let mut tx_a = tx_a;
    let a = repo
        .enqueue(&mut tx_a, &[NewEvent::new("t", lead("race", 1))])
        .await
        .unwrap()[0];
    let second = {
        let repo = repo.clone();
        tokio::spawn(async move {
            let mut tx_b = tx_b;
            let started = std::time::Instant::now();
            let ids = repo
                .enqueue(&mut tx_b, &[NewEvent::new("t", lead("race", 2))])
                .await
                .unwrap();
            let waited = started.elapsed();
            tx_b.commit().await.unwrap();
            (ids[0], waited)
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    tx_a.commit().await.unwrap();
    let (b, waited) = second.await.unwrap();
    assert!(
        waited >= Duration::from_millis(300),
        "the second enqueue waited for the first commit ({waited:?})"
    );
    let (row_a, row_b) = (
        repo.get_event(a).await.unwrap().unwrap(),
        repo.get_event(b).await.unwrap().unwrap(),
    );
    assert!(
        row_b.created_date > row_a.created_date,
        "commit order is CreatedDate order: {} then {}",
        row_a.created_date,
        row_b.created_date
    );
    let head = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(head.event.id, a);
}

/// Timestamps written by other code in shapes this code never writes. PostgreSQL's
/// `timestamptz` reads them all; SQLite stores text, and a trigger rewrites every shape its
/// date functions read to the one fixed-width shape the comparisons need, and fails a row
/// whose timestamp cannot be read at all. Nothing stalls: every row ends terminal.
async fn foreign_timestamp_shapes_never_stall(db: TestDb) {
    let repo = db.repository();
    // A zone-less time is UTC to SQLite; PostgreSQL would read it in the session's time zone,
    // so there it carries its zone.
    let bare = match db.backend() {
        Backend::Sqlite => "2026-11-30 00:00:01",
        Backend::Postgres => "2026-11-30 00:00:01+00",
    };
    let shapes = [
        "2026-11-30T00:00:00Z",
        bare,
        "2026-11-30T01:00:02+01:00",
        "2026-11-30T00:00:03.5Z",
    ];
    let mut ids = Vec::new();
    for (n, shape) in shapes.iter().enumerate() {
        let id = outbox_persistence::new_event_id();
        ids.push(id);
        let payload = lead("shape", n as u32);
        let sql = format!(
            "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount,
               RecordKey, CreatedDate, LastModifiedDate)
             VALUES ('{id}', 't', '{payload}', 'pending', 0, 'Lead:shape', '{shape}', '{shape}')"
        );
        db.execute(&sql).await;
    }
    // As text, ' ' sorts before 'T': the second row would come first. Order follows time.
    let events = repo
        .get_pending_events(policy(), &Scope::All, 10)
        .await
        .unwrap();
    assert_eq!(events.len(), 1, "one head for the record");
    assert_eq!(events[0].id, ids[0]);
    let broken = outbox_persistence::new_event_id();
    if db.backend() == Backend::Sqlite {
        db.execute(&format!(
            "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount,
               RecordKey, CreatedDate, LastModifiedDate)
             VALUES ('{broken}', 't', '{}', 'pending', 0, 'lead:other', 'yesterday', 'soon')",
            lead("other", 0)
        ))
        .await;
        let row = repo.get_event(broken).await.unwrap().unwrap();
        assert_eq!(row.status, EventStatus::Failed);
        assert!(
            row.last_error
                .as_deref()
                .is_some_and(|e| e.contains("unreadable timestamp") && e.contains("yesterday")),
            "{:?}",
            row.last_error
        );
    }
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handlers = Handlers::new().register("t", Record(seen.clone()));
    let dispatcher = Dispatcher::new(repo.clone(), handlers, fast())
        .start()
        .await
        .unwrap();
    drain(&repo, Duration::from_secs(30)).await;
    dispatcher.shutdown().await;
    assert_eq!(*seen.lock().unwrap(), ids, "processed, in time order");
    for id in &ids {
        assert_eq!(status(&repo, *id).await, EventStatus::Processed);
    }
}

/// SQLite stores `Id` as text, so other code can write a row no claim can parse: it is failed
/// with the reason and the worker goes on (PostgreSQL's `uuid` column cannot hold one).
async fn unreadable_sqlite_row_is_failed_and_skipped(db: TestDb) {
    if db.backend() != Backend::Sqlite {
        return;
    }
    let repo = db.repository();
    db.execute(&format!(
        "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount, RecordKey,
           CreatedDate, LastModifiedDate)
         VALUES ('not-a-uuid', 't', '{}', 'pending', 0, NULL,
           '2026-01-01T00:00:00.000000Z', '2026-01-01T00:00:00.000000Z')",
        lead("x", 0)
    ))
    .await;
    let good = enqueue(&repo, &[NewEvent::new("t", lead("y", 0))]).await;
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        claim.event.id, good[0],
        "the worker went on to the next row"
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Id = 'not-a-uuid'
               AND Status = 'failed' AND LastError LIKE 'unreadable outbox row%'"
        )
        .await,
        1
    );
}

/// An event whose worker dies on every attempt (abort, OOM kill, a native crash): each stale
/// reclaim counts the dead attempt, and at `MaxRetryAttempts` the row ends `failed` with a
/// `LastError` that says its worker died, releasing its record's successors.
async fn poison_event_ends_failed_and_releases_its_record(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(
        &repo,
        &[
            NewEvent::new("t", lead("poison", 1)),
            NewEvent::new("t", lead("poison", 2)),
        ],
    )
    .await;
    let (poison, successor) = (ids[0], ids[1]);
    for attempt in 1..=MAX_RETRY_ATTEMPTS {
        if attempt == 1 {
            let claim = repo
                .claim_next(policy(), &Scope::All)
                .await
                .unwrap()
                .unwrap();
            assert_eq!((claim.event.id, claim.event.retry_count), (poison, 0));
        }
        // The worker dies: no outcome, no heartbeat. Stale-after passes.
        repo.stats(policy()).await.unwrap();
        db.clock.advance(STALE_AFTER);
        let next = repo.claim_next(policy(), &Scope::All).await.unwrap();
        let row = repo.get_event(poison).await.unwrap().unwrap();
        assert_eq!(row.retry_count, attempt, "attempt {attempt} counted");
        assert!(
            row.last_error
                .as_deref()
                .is_some_and(|e| e.starts_with(WORKER_DIED)),
            "{:?}",
            row.last_error
        );
        if attempt < MAX_RETRY_ATTEMPTS {
            let claim = next.expect("reclaimed for another attempt");
            assert_eq!(claim.event.id, poison);
            assert!(claim.reclaimed);
            assert_eq!(claim.event.retry_count, attempt);
        } else {
            assert_eq!(row.status, EventStatus::Failed);
            let claim = next.expect("the successor is released");
            assert_eq!(claim.event.id, successor);
        }
    }
}

/// The host's wall clock steps an hour forward while a claim is live (NTP, a resumed VM, an
/// operator): the claim is not taken for stale, by the process that watched it nor by a
/// process started on a host an hour ahead. SQLite stamps rows with its host's clock but
/// decides staleness by observing on a monotonic clock; PostgreSQL reads no host clock at all,
/// and a claim's timestamps are the database's.
async fn clock_steps_never_make_a_live_claim_stale(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(&repo, &[NewEvent::new("t", lead("step", 0))]).await;
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    // Seen live by the repository; then its host's clock jumps.
    repo.stats(policy()).await.unwrap();
    db.clock.step_host_clock(TimeDelta::hours(1));
    let ahead = ClockShift::new();
    ahead.step_host_clock(TimeDelta::hours(1));
    let other_host = db.db.repository_with_clock_shift(ahead);
    for _ in 0..3 {
        for r in [&repo, &other_host] {
            assert!(
                r.claim_next(policy(), &Scope::All).await.unwrap().is_none(),
                "a live claim is never stale because a clock stepped"
            );
        }
    }
    match &db.db {
        Database::Sqlite(_) => {}
        Database::Postgres(pool) => {
            let (before, after): (chrono::DateTime<Utc>, chrono::DateTime<Utc>) = {
                let fence = repo.heartbeat(claim.fence).await.unwrap().beaten().unwrap();
                let now: chrono::DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
                    .fetch_one(pool)
                    .await
                    .unwrap();
                (fence.last_written, now)
            };
            assert!(before <= after && after - before < TimeDelta::seconds(5));
        }
    }
    assert_eq!(status(&repo, ids[0]).await, EventStatus::Processing);
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.retry_count, 0, "nothing was reclaimed");
}

/// A worker whose claim was taken over tries to begin its attempt, many times: each is refused
/// before its handler could start, and the pool's connections stay usable (a refused begin
/// must not leave a connection inside a failed transaction).
async fn refused_attempts_leave_connections_usable(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(&repo, &[NewEvent::new("t", lead("refused", 0))]).await;
    let first = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    repo.stats(policy()).await.unwrap();
    db.clock.advance(STALE_AFTER);
    let second = repo.claim_event(ids[0], policy()).await.unwrap().unwrap();
    for _ in 0..40 {
        assert!(
            repo.begin_attempt(Duration::from_secs(1), first.fence)
                .await
                .unwrap()
                .is_none()
        );
    }
    for _ in 0..20 {
        let mut attempt = repo
            .begin_attempt(Duration::from_secs(1), second.fence)
            .await
            .unwrap()
            .expect("the holder's attempt begins");
        attempt.rollback().await.unwrap();
    }
    let mut attempt = repo
        .begin_attempt(Duration::from_secs(1), second.fence)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        attempt.mark_processed(second.fence).await.unwrap(),
        outbox_persistence::FenceOutcome::Written
    );
    attempt.commit().await.unwrap();
    assert_eq!(status(&repo, ids[0]).await, EventStatus::Processed);
}

/// The application's own transactions on the outbox's pool keep the server's settings: no
/// `lock_timeout` is set on a session. The outbox's own writes outside attempts still bound
/// their lock waits (here a heartbeat behind a row lock held by other code).
async fn application_sessions_are_left_alone(db: TestDb) {
    let Database::Postgres(pool) = &db.db else {
        return;
    };
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let setting: String = outbox_persistence::with_tx!(&mut tx, |conn| {
        sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(conn)
            .await
    })
    .unwrap();
    assert_eq!(
        setting, "0",
        "the application's transaction has no lock timeout"
    );
    tx.rollback().await.unwrap();
    let ids = enqueue(&repo, &[NewEvent::new("t", lead("alone", 0))]).await;
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM _System_OutboxEvent WHERE Id = $1 FOR UPDATE")
        .bind(ids[0])
        .execute(&mut *holder)
        .await
        .unwrap();
    let bounded = outbox_persistence::postgres::PgOutbox::new(pool.clone())
        .with_lock_timeout(Duration::from_millis(200));
    let started = std::time::Instant::now();
    let err = bounded.heartbeat(claim.fence).await.unwrap_err();
    assert!(err.is_lock_timeout(), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    holder.rollback().await.unwrap();
    // The same pooled sessions still have no lock timeout afterwards.
    for _ in 0..4 {
        let setting: String = sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(setting, "0");
    }
}

/// Records the order handlers ran in.
struct Record(Arc<std::sync::Mutex<Vec<uuid::Uuid>>>);

#[async_trait::async_trait]
impl Handler for Record {
    async fn handle(
        &self,
        event: &OutboxEvent,
        _: &mut outbox_events::AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(event.id);
        Ok(())
    }
}

fn fast() -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(outbox_events::DispatchMode::Pull)
        .dangerously_skip_rollout_gate("tests of the queue rules with undeclared handlers")
        .with_workers(3)
        .with_poll_interval(Duration::from_millis(20))
        .with_heartbeat_interval(Duration::from_millis(200))
        .with_stale_after(Duration::from_secs(10))
}

backend_tests!(
    operator_retry_waits_for_the_running_sibling,
    late_older_row_never_runs_beside_its_sibling,
    racing_application_transactions_are_ordered_by_commit,
    foreign_timestamp_shapes_never_stall,
    unreadable_sqlite_row_is_failed_and_skipped,
    poison_event_ends_failed_and_releases_its_record,
    clock_steps_never_make_a_live_claim_stale,
    refused_attempts_leave_connections_usable,
    application_sessions_are_left_alone,
);
