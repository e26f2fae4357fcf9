//! Owned rows (`AttemptContext::enqueue_owned`: a fan-out's rows under keys only its handler
//! writes) beside other workers' settles, PostgreSQL. A batch's settle moves or deletes the
//! heads of the records whose rows it ended; a settle that did so and then inserted owned rows
//! under a key whose head another settle had just moved or deleted waited for that settle, and
//! when the other had done the reverse (a webhook workload: one batch ends record A's delivery
//! and fans out record B's next event, another ends B's delivery and fans out A's), each
//! waited for the other: PostgreSQL aborted one as a deadlock after `deadlock_timeout`, and its
//! segment was given back and run again. Found by an outside service written from
//! docs/webhooks.md (2 deadlocks in 4 runs of 63 events over 7 records).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, EventId, Handler, HandlerError, Handlers,
    OutboxEvent, WorkerConfig,
};
use outbox_persistence::{NewEvent, OutboxRepository};
use outbox_tests::{TestDb, drain};

const SOURCE: &str = "owned_heads.source";
const OWNED: &str = "owned_heads.owned";
const RECORDS: usize = 6;
const PER_RECORD: usize = 120;

/// Runs of each event id, and how many ran more than once.
#[derive(Default)]
struct Runs {
    seen: Mutex<HashSet<EventId>>,
    again: Mutex<Vec<EventId>>,
}

impl Runs {
    fn ran(&self, id: EventId) {
        if !self.seen.lock().unwrap().insert(id) {
            self.again.lock().unwrap().push(id);
        }
    }
}

/// The source's handler: one owned row under its record's owned key, as the webhook fan-out.
struct FanOut {
    repo: Arc<dyn OutboxRepository>,
    runs: Arc<Runs>,
}

#[async_trait]
impl Handler for FanOut {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.runs.ran(event.id);
        let record = event.record_key.as_ref().map(|k| k.as_str()).unwrap_or("-");
        let record = record.rsplit(':').next().unwrap_or("-");
        let owned = NewEvent::new(
            OWNED,
            format!(r#"{{"object":"Owned","record_id":"{record}","snapshot":{{}}}}"#),
        );
        ctx.enqueue_owned(self.repo.as_ref(), vec![owned]).await
    }

    fn runs_without_tx(&self) -> bool {
        true
    }
}

/// The owned rows' handler: nothing but counting, as a delivery to a fast receiver.
struct Sink(Arc<Runs>);

#[async_trait]
impl Handler for Sink {
    async fn handle(
        &self,
        event: &OutboxEvent,
        _ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.0.ran(event.id);
        Ok(())
    }

    fn runs_without_tx(&self) -> bool {
        true
    }
}

/// 8 pull workers fan out 720 events of 6 records while they run the owned rows: no settle
/// waits for another settle that waits for it, so no segment is a deadlock's victim and every
/// handler runs once (a given-back segment would run its handlers again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_settles_with_owned_rows_never_deadlock_each_other() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let repo: Arc<dyn OutboxRepository> = db.repository();
    let runs = Arc::new(Runs::default());
    let config = WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("owned rows under test")
        .with_workers(8)
        .with_poll_interval(Duration::from_millis(20))
        .with_lock_timeout(Duration::from_secs(30))
        .with_batches(32, Duration::from_secs(1));
    let handlers = Handlers::new()
        .register(
            SOURCE,
            FanOut {
                repo: repo.clone(),
                runs: runs.clone(),
            },
        )
        .register(OWNED, Sink(runs.clone()));
    let events: Vec<NewEvent> = (0..PER_RECORD * RECORDS)
        .map(|i| {
            NewEvent::new(
                SOURCE,
                format!(
                    r#"{{"object":"Source","record_id":"r{}","snapshot":{{"seq":{i}}}}}"#,
                    i % RECORDS
                ),
            )
        })
        .collect();
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let handle = Dispatcher::new(repo.clone(), handlers, config)
        .start()
        .await
        .unwrap();
    drain(&repo, Duration::from_secs(120)).await;
    handle.shutdown().await;

    let total = 2 * PER_RECORD * RECORDS;
    assert_eq!(
        db.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed' AND RetryCount = 0"
        )
        .await,
        total as i64,
        "every source and owned row processed, none counted a failure"
    );
    let again = runs.again.lock().unwrap().len();
    assert_eq!(
        again, 0,
        "{again} handlers ran again: their segments were given back (a settle was a deadlock's victim)"
    );
    assert_eq!(runs.seen.lock().unwrap().len(), total);
}

/// A settle's hold of its owned rows' heads beside `outbox heads --rebuild`, which locks the
/// outbox table in SHARE mode and then deletes every head: the hold takes the table's ROW
/// EXCLUSIVE lock first, so the rebuild waits for the settle's commit instead of holding the
/// table while it waits for a held head (a deadlock a review reproduced in psql, with the
/// settle's write after the hold waiting for the rebuild's table lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_held_head_never_deadlocks_with_the_heads_rebuild() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let repo: Arc<dyn OutboxRepository> = db.repository();
    let owned = || {
        NewEvent::new(
            OWNED,
            r#"{"object":"Owned","record_id":"r0","snapshot":{}}"#.to_string(),
        )
    };
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &[owned()]).await.unwrap();
    tx.commit().await.unwrap();
    let key = owned().record_key().expect("a keyed row");

    let mut settle = repo.begin().await.unwrap();
    repo.hold_owned_heads(&mut settle, std::slice::from_ref(&key))
        .await
        .unwrap();
    let rebuild = tokio::spawn({
        let database = db.db.clone();
        async move { database.rebuild_heads().await }
    });
    // The rebuild is waiting for a lock (the table's, with the hold as it is now).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while db
        .count(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await
        == 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the rebuild never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The settle's own write after its hold, then its commit: neither may be a deadlock's victim.
    repo.enqueue_owned(&mut settle, &[owned()])
        .await
        .expect("the settle's write after its hold");
    settle.commit().await.expect("the settle commits");
    let rebuilt = tokio::time::timeout(Duration::from_secs(30), rebuild)
        .await
        .expect("the rebuild ends")
        .unwrap()
        .expect("the rebuild is no deadlock's victim");
    assert_eq!(rebuilt, 1, "one key with open rows, one head");
}
