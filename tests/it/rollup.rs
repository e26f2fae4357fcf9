//! The throughput rollup that the console's chart reads (`_System_OutboxThroughput`, migrations
//! PostgreSQL 0016 and SQLite 0009) checked against the rows: after a drain through batches,
//! with failed attempts, a killed attempt connection (PostgreSQL) and reclaims, each minute's
//! count equals the rows processed in that minute, and a prune of every processed row leaves
//! the counts as they were; a settle rolled back takes its count back with it.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use crate::repository::lead;
use async_trait::async_trait;
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, Handler, HandlerError, Handlers, OutboxEvent,
    WorkerConfig,
};
use outbox_persistence::test_support::inspect::rollup_total;
use outbox_persistence::{ClaimPolicy, Fence, FenceOutcome, NewEvent, PrunePolicy, Scope, with_tx};
use outbox_tests::{Backend, TestDb, backend_tests, drain};

/// Fails the first attempt of every fifth event and, on PostgreSQL, kills the attempt's own
/// connection (`pg_terminate_backend`) in the first attempt of every seventh: the attempt's
/// transaction dies with whatever the batch had settled in it.
struct Tally {
    backend: Backend,
    seen: Mutex<HashSet<uuid::Uuid>>,
}

#[async_trait]
impl Handler for Tally {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let first = self.seen.lock().unwrap().insert(event.id);
        let n = event.id.as_u128();
        if first && n.is_multiple_of(7) && self.backend == Backend::Postgres {
            let killed = with_tx!(ctx.tx(), |conn| {
                sqlx::query_scalar::<_, bool>("SELECT pg_terminate_backend(pg_backend_pid())")
                    .fetch_one(conn)
                    .await
            });
            return Err(HandlerError::Retryable(format!(
                "killed its own connection: {killed:?}"
            )));
        }
        if first && n.is_multiple_of(5) {
            return Err(HandlerError::Retryable("fails once".into()));
        }
        Ok(())
    }
}

/// Rows processed per minute (`YYYY-MM-DDTHH:MM`, UTC), read from the rows.
async fn from_rows(db: &TestDb) -> BTreeMap<String, i64> {
    let sql = match db.backend() {
        Backend::Postgres => {
            "SELECT to_char(date_trunc('minute', LastModifiedDate AT TIME ZONE 'UTC'),
                            'YYYY-MM-DD\"T\"HH24:MI'), count(*)
             FROM _System_OutboxEvent WHERE Status = 'processed' GROUP BY 1"
        }
        Backend::Sqlite => {
            "SELECT substr(LastModifiedDate, 1, 16), count(*)
             FROM _System_OutboxEvent WHERE Status = 'processed' GROUP BY 1"
        }
    };
    minutes(db, sql).await
}

/// Rows processed per minute, read from the rollup (summed over PostgreSQL's backends).
async fn from_rollup(db: &TestDb) -> BTreeMap<String, i64> {
    let sql = match db.backend() {
        Backend::Postgres => {
            "SELECT to_char(Minute AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI'),
                    sum(Processed)::bigint
             FROM _System_OutboxThroughput GROUP BY 1"
        }
        Backend::Sqlite => "SELECT Minute, Processed FROM _System_OutboxThroughput",
    };
    minutes(db, sql).await
}

async fn minutes(db: &TestDb, sql: &'static str) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> = match db.backend() {
        Backend::Postgres => sqlx::query_as(sql)
            .fetch_all(db.pg().unwrap())
            .await
            .unwrap(),
        Backend::Sqlite => sqlx::query_as(sql)
            .fetch_all(db.sqlite_pool().unwrap())
            .await
            .unwrap(),
    };
    rows.into_iter().collect()
}

async fn rollup_matches_the_rows_through_kills_and_prunes(db: TestDb) {
    let repo = db.repository();
    let total = 240;
    let events: Vec<NewEvent> = (0..total)
        .map(|i| {
            let payload = format!(
                r#"{{"object":"Account","record_id":"A{}","snapshot":{{"seq":{i}}}}}"#,
                i % 24
            );
            NewEvent::new("account.changed", payload)
        })
        .collect();
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let handler = Tally {
        backend: db.backend(),
        seen: Mutex::new(HashSet::new()),
    };
    let config = WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("a test of the rollup with an undeclared handler")
        .with_workers(4)
        .with_poll_interval(Duration::from_millis(50))
        .with_retry_delay(Duration::from_millis(5))
        .with_max_retry_delay(Duration::from_millis(40))
        .with_heartbeat_interval(Duration::from_millis(200))
        .with_stale_after(Duration::from_secs(2));
    let handlers = Handlers::new().register("account.changed", handler);
    let dispatcher = Dispatcher::new(repo.clone(), handlers, config)
        .start()
        .await
        .unwrap();
    drain(&repo, Duration::from_secs(90)).await;
    let report = dispatcher.shutdown().await;
    assert!(report.metrics.batches > 0, "no batch ran");
    if db.backend() == Backend::Postgres {
        assert!(
            report.metrics.detached_bookkeeping > 0,
            "no attempt connection was killed: {:?}",
            report.metrics
        );
    }
    let processed = db
        .count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'")
        .await;
    assert_eq!(processed, total, "every event processed");
    let retried = db
        .count("SELECT count(*) FROM _System_OutboxEvent WHERE RetryCount > 0")
        .await;
    assert!(retried > 0, "no attempt failed: the test proves less");
    let rows = from_rows(&db).await;
    let rollup = from_rollup(&db).await;
    assert_eq!(rollup, rows, "the rollup's minutes against the rows'");
    let chart = outbox_persistence::console::throughput(&db.db)
        .await
        .unwrap();
    assert_eq!(
        chart.total(),
        total as u64,
        "the chart counts each row once"
    );

    let prune_all = PrunePolicy {
        processed_older_than: Some(Duration::ZERO),
        failed_older_than: None,
        ..PrunePolicy::default()
    };
    while repo.prune(prune_all).await.unwrap().more {}
    let left = db.count("SELECT count(*) FROM _System_OutboxEvent").await;
    assert_eq!(left, 0, "the prune deleted every processed row");
    assert_eq!(from_rollup(&db).await, rows, "a prune keeps the counts");
    let chart = outbox_persistence::console::throughput(&db.db)
        .await
        .unwrap();
    assert_eq!(chart.total(), total as u64);
}

/// The tally commits and rolls back with the settle that wrote it: a batch's settle and one
/// event's settle, rolled back, leave the rollup as it was (the rows stay claimed); committed,
/// they count each row once, in the minute the row records.
async fn the_tally_rolls_back_with_its_settle(db: TestDb) {
    let repo = db.repository();
    let policy = ClaimPolicy::new(Duration::from_secs(30), Duration::from_secs(1), 5);
    let events: Vec<NewEvent> = (0..3)
        .map(|i| NewEvent::new("t", lead(&format!("tally{i}"))))
        .collect();
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let claims = repo.claim_batch(policy, &Scope::All, 3).await.unwrap();
    assert_eq!(claims.len(), 3, "the heads of three records");
    let fences: Vec<Fence> = claims.iter().map(|c| c.fence).collect();
    for commit in [false, true] {
        let (mut batch, lost) = repo
            .begin_batch_attempt(Duration::from_secs(5), fences[..2].to_vec())
            .await
            .unwrap();
        assert!(lost.is_empty(), "{lost:?}");
        let outcomes = batch
            .mark_processed_many(fences[..2].to_vec())
            .await
            .unwrap();
        assert_eq!(outcomes, vec![FenceOutcome::Written; 2]);
        if commit {
            batch.commit().await.unwrap();
        } else {
            batch.rollback().await.unwrap();
        }
        let mut one = repo
            .begin_attempt(Duration::from_secs(5), fences[2])
            .await
            .unwrap()
            .expect("the claim holds");
        assert_eq!(
            one.mark_processed(fences[2]).await.unwrap(),
            FenceOutcome::Written
        );
        if commit {
            one.commit().await.unwrap();
        } else {
            one.rollback().await.unwrap();
        }
        let tallied = rollup_total(&db.db).await.unwrap();
        let processed = db
            .count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'")
            .await;
        assert_eq!((tallied, processed), if commit { (3, 3) } else { (0, 0) });
    }
    assert_eq!(from_rollup(&db).await, from_rows(&db).await);
}

backend_tests!(
    rollup_matches_the_rows_through_kills_and_prunes,
    the_tally_rolls_back_with_its_settle
);
