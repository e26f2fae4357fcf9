//! The service's unit tests, without a database server or a file: the handler on an in-memory
//! SQLite database (`Database::sqlite_in_memory`), and one attempt over the mocked repository
//! and attempt (`outbox-events`' `mock` feature) the way a worker runs it.

use std::sync::Arc;

use outbox_events::mock::{MockAttempt, MockOutboxRepository, Sequence};

use super::*;

fn request(record_id: &str, email: &str) -> OutboxEvent {
    let snapshot = BTreeMap::from([("email", email), ("name", "A")]);
    let event = NewEvent::for_record(CONTACT_REQUESTED, "ContactRequest", record_id, &snapshot)
        .expect("a valid envelope");
    OutboxEvent::for_test(event.event_type, event.payload)
}

/// An in-memory database with the service's tables and the outbox's.
async fn memory() -> Database {
    let db = Database::sqlite_in_memory().await.unwrap();
    migrate(&db).await.unwrap();
    db
}

/// The handler run twice on one event (a redelivery), in real transactions: one contact, one
/// number.
#[tokio::test]
async fn a_redelivered_request_creates_one_contact() {
    let db = memory().await;
    let event = request("r1", "a@example.com");
    let handler = CreateContact::new().unwrap();
    let repo = db.repository();
    for _ in 0..2 {
        let mut tx = repo.begin().await.unwrap();
        handler
            .handle(&event, &mut AttemptContext::new(&mut tx))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(count(&db, "SELECT count(*) FROM contact").await.unwrap(), 1);
    let top = count(&db, "SELECT max(contact_number) FROM contact").await;
    assert_eq!(top.unwrap(), 1);
}

/// A mocked repository that begins `attempt` and takes whatever heartbeats come.
fn repository(attempt: MockAttempt) -> Arc<dyn OutboxRepository> {
    let mut repo = MockOutboxRepository::new();
    repo.expect_backend_name().return_const("mock");
    repo.expect_serializes_writers().return_const(false);
    repo.expect_note_alive().returning(|_| ());
    repo.expect_heartbeat()
        .returning(|fence| Ok(outbox_events::BeatOutcome::Beaten(fence)));
    let mut attempt = Some(attempt);
    repo.expect_begin_attempt()
        .times(1)
        .returning(move |_, _| Ok(Some(Box::new(attempt.take().unwrap()) as Box<dyn Attempt>)));
    Arc::new(repo)
}

fn runner(repo: Arc<dyn OutboxRepository>) -> ClaimRunner {
    let action = CreateContact::new().unwrap();
    let handlers = Handlers::new().register_consumer(action.consumer(), action);
    ClaimRunner::new(repo, handlers, WorkerConfig::default())
}

/// One attempt as a worker runs it, over mocks: the handler writes through the attempt's
/// transaction (a real one, in memory), then `processed` and the commit.
#[tokio::test]
async fn an_attempt_over_mocks_writes_and_marks_processed() {
    let db = memory().await;
    let tx = db.repository().begin().await.unwrap();
    let claim = Claim::for_test(request("r2", "b@example.com"));
    let fence = claim.fence;
    let mut attempt = MockAttempt::new();
    attempt.expect_tx().return_var(tx);
    attempt
        .expect_mark_processed()
        .withf(move |f| *f == fence)
        .times(1)
        .returning(|_| Ok(FenceOutcome::Written));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    let outcome = runner(repository(attempt)).run(claim).await;
    assert_eq!(outcome, AttemptOutcome::Processed);
}

/// An unreadable payload fails at once: rolled back to the savepoint, `failed` recorded in the
/// attempt, committed.
#[tokio::test]
async fn an_unreadable_request_fails_without_retries() {
    let claim = Claim::for_test(OutboxEvent::for_test(CONTACT_REQUESTED, "not json"));
    let mut attempt = MockAttempt::new();
    let mut order = Sequence::new();
    attempt
        .expect_rollback_to_savepoint()
        .times(1)
        .in_sequence(&mut order)
        .returning(|| Ok(()));
    attempt
        .expect_record_failure()
        .withf(|_, bookkeeping, error| {
            *bookkeeping == FailureBookkeeping::Fail && error.contains("unreadable payload")
        })
        .times(1)
        .in_sequence(&mut order)
        .returning(|_, _, _| Ok(FenceOutcome::Written));
    attempt
        .expect_commit()
        .times(1)
        .in_sequence(&mut order)
        .returning(|| Ok(()));
    let outcome = runner(repository(attempt)).run(claim).await;
    assert_eq!(outcome, AttemptOutcome::Failed);
}
