//! Pausing and resuming an event type (issue 27) on both backends: the pause persists, every
//! pull worker stops claiming the type within `PAUSE_REFRESH`, a record whose head is paused
//! waits behind it in order while other records flow, resuming restarts it, and every pause,
//! resume and retry by an operator is in the audit log with who and when.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, Handler, HandlerError, Handlers, OutboxEvent,
    PAUSE_REFRESH, WorkerConfig,
};
use outbox_persistence::{
    EventFilter, EventId, EventStatus, NewEvent, OutboxRepository, RetryFilter,
};
use outbox_tests::{TestDb, backend_tests};

fn config() -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("tests of pausing with undeclared handlers")
        .with_workers(4)
        .with_poll_interval(Duration::from_millis(50))
}

/// Records the order in which events ran, by their payload's `n`.
#[derive(Clone, Default)]
struct Journal(Arc<Mutex<Vec<String>>>);

#[async_trait]
impl Handler for Journal {
    async fn handle(
        &self,
        event: &OutboxEvent,
        _: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(event.payload.clone());
        Ok(())
    }
}

fn event(event_type: &str, record: Option<&str>, n: u32) -> NewEvent {
    let payload = match record {
        Some(id) => format!(r#"{{"object":"Lead","record_id":"{id}","n":{n}}}"#),
        None => format!(r#"{{"n":{n}}}"#),
    };
    NewEvent::new(event_type, payload)
}

async fn enqueue(repo: &Arc<dyn OutboxRepository>, events: Vec<NewEvent>) -> Vec<EventId> {
    let mut tx = repo.begin().await.unwrap();
    let ids = repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

async fn status(repo: &Arc<dyn OutboxRepository>, id: EventId) -> EventStatus {
    repo.get_event(id).await.unwrap().unwrap().status
}

/// Waits until every row in `ids` is processed.
async fn processed(repo: &Arc<dyn OutboxRepository>, ids: &[EventId], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let rows = repo
            .list_events(EventFilter::new().ids(ids.to_vec()))
            .await
            .unwrap();
        if rows.iter().all(|r| r.status == EventStatus::Processed) {
            return;
        }
        assert!(Instant::now() < deadline, "not processed in time: {rows:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Pause, resume and retry by an operator: persisted, idempotent, audited with who and when.
async fn pause_resume_and_retry_are_audited(db: TestDb) {
    let repo = db.repository();
    assert!(repo.paused_event_types().await.unwrap().is_empty());
    assert!(
        repo.pause_event_type("lead.changed", "alice")
            .await
            .unwrap()
    );
    assert!(
        !repo.pause_event_type("lead.changed", "bob").await.unwrap(),
        "pausing a paused type changes nothing"
    );
    let paused = repo.paused_event_types().await.unwrap();
    assert_eq!(paused.len(), 1);
    assert_eq!(paused[0].event_type, "lead.changed");
    assert_eq!(paused[0].paused_by, "alice");
    assert!(!repo.resume_event_type("other", "alice").await.unwrap());
    assert!(
        repo.resume_event_type("lead.changed", "carol")
            .await
            .unwrap()
    );
    assert!(repo.paused_event_types().await.unwrap().is_empty());

    // Two failed rows; one retried by id from a selection that also names a pending row.
    let ids = enqueue(
        &repo,
        vec![
            event("t", None, 1),
            event("t", None, 2),
            event("t", None, 3),
        ],
    )
    .await;
    db.execute(&format!(
        "UPDATE _System_OutboxEvent SET Status = 'failed', RetryCount = 6 WHERE Id IN ('{}', '{}')",
        ids[0], ids[1]
    ))
    .await;
    let retried = repo
        .retry_failed_by(RetryFilter::Ids(vec![ids[0], ids[2]]), "dave")
        .await
        .unwrap();
    assert_eq!(retried, 1, "only the failed row of the selection");
    assert_eq!(status(&repo, ids[0]).await, EventStatus::Pending);
    assert_eq!(status(&repo, ids[1]).await, EventStatus::Failed);

    let log = repo.audit_log(10).await.unwrap();
    let seen: Vec<(&str, &str)> = log
        .iter()
        .map(|e| (e.actor.as_str(), e.action.as_str()))
        .collect();
    assert_eq!(
        seen,
        [("dave", "retry"), ("carol", "resume"), ("alice", "pause")],
        "newest first, only what changed something"
    );
    assert!(
        log[0].detail.contains(&ids[0].to_string()),
        "{}",
        log[0].detail
    );
    assert!(log[0].detail.contains("1 row(s)"), "{}", log[0].detail);
    assert!(log[2].detail.contains("lead.changed"));
    assert!(log[0].at >= log[2].at);
    assert_eq!(repo.audit_log(1).await.unwrap().len(), 1);
}

/// Workers stop claiming a paused type within `PAUSE_REFRESH`; a record whose head is paused
/// waits behind it in order while other records and types flow; resume restarts it all.
async fn paused_type_waits_in_order_and_resumes(db: TestDb) {
    let repo = db.repository();
    let journal = Journal::default();
    let handlers = Handlers::new()
        .register("held", journal.clone())
        .register("free", journal.clone());
    // Paused before the dispatcher starts: its workers claim nothing before its first read of
    // the paused types, so no sleep stands in for "the pause has been seen".
    assert!(repo.pause_event_type("held", "ops").await.unwrap());
    let dispatcher = Dispatcher::new(repo.clone(), handlers, config())
        .start()
        .await
        .unwrap();

    let ids = enqueue(
        &repo,
        vec![
            event("held", Some("R1"), 1),
            event("free", Some("R1"), 2),
            event("free", Some("R2"), 3),
            event("held", None, 4),
            event("free", None, 5),
        ],
    )
    .await;
    processed(&repo, &[ids[2], ids[4]], Duration::from_secs(30)).await;
    // Long enough for a worker that ignored the pause to have claimed the others.
    tokio::time::sleep(PAUSE_REFRESH * 2).await;
    assert_eq!(
        status(&repo, ids[0]).await,
        EventStatus::Pending,
        "paused head"
    );
    assert_eq!(
        status(&repo, ids[1]).await,
        EventStatus::Pending,
        "its record's next row waits behind the paused head"
    );
    assert_eq!(
        status(&repo, ids[3]).await,
        EventStatus::Pending,
        "paused unkeyed row"
    );
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.retry_count, 0, "a paused row is never attempted");

    assert!(repo.resume_event_type("held", "ops").await.unwrap());
    processed(&repo, &ids, Duration::from_secs(30)).await;
    dispatcher.shutdown().await;
    let journal = journal.0.lock().unwrap().clone();
    let pos = |n: u32| {
        journal
            .iter()
            .position(|p| p.contains(&format!("\"n\":{n}")))
            .unwrap()
    };
    assert!(
        pos(1) < pos(2),
        "R1 kept its order across the pause: {journal:?}"
    );
    assert_eq!(journal.len(), 5, "each ran once: {journal:?}");
}

backend_tests!(
    with_pgbouncer: pause_resume_and_retry_are_audited,
    paused_type_waits_in_order_and_resumes,
);
