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
    AttemptContext, DispatchMode, Dispatcher, Handler, HandlerError, Handlers, OutboxEvent,
    WorkerConfig,
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
    let config = WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("lock-free segments under test")
        .with_workers(1)
        .with_poll_interval(Duration::from_millis(20))
        .with_retry_delay(Duration::from_millis(20))
        .with_max_retry_delay(Duration::from_millis(50))
        // Room for the whole batch on a loaded machine: the budget is not what is tested.
        .with_batches(32, Duration::from_secs(5));
    let handler = Writing {
        lock_free,
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

backend_tests!(
    lock_free_handlers_share_a_commit_and_a_failure_undoes_only_its_own,
    handlers_that_may_lock_commit_once_each,
);
