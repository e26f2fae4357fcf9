//! The crates as an embedding service uses them: the caller's stop token, waiting until
//! drained, and errors that say their cause.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_events::{
    AttemptContext, CancellationToken, Dispatcher, Handler, HandlerError, Handlers, NewEvent,
    OutboxEvent, WorkerConfig, async_trait,
};
use outbox_tests::{TestDb, backend_tests};

struct Count(Arc<AtomicU64>);

#[async_trait]
impl Handler for Count {
    async fn handle(
        &self,
        _: &OutboxEvent,
        _: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// The service's own token stops claiming; `drained` tells when the queue is empty.
async fn caller_token_and_drained(db: TestDb) {
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..30)
        .map(|i| {
            NewEvent::new(
                "t",
                format!(r#"{{"object":"Lead","record_id":"e{}"}}"#, i % 7),
            )
        })
        .collect();
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let handled = Arc::new(AtomicU64::new(0));
    let shutdown = CancellationToken::new();
    let handle = Dispatcher::new(
        repo.clone(),
        Handlers::new().register("t", Count(handled.clone())),
        WorkerConfig::default()
            .with_workers(3)
            .with_poll_interval(Duration::from_millis(20)),
    )
    .with_stop_token(shutdown.clone())
    .start()
    .await
    .unwrap();
    let drained = tokio::time::timeout(
        Duration::from_secs(30),
        handle.drained(Duration::from_millis(20)),
    )
    .await
    .expect("drains in time")
    .unwrap();
    assert!(drained);
    assert_eq!(handled.load(Ordering::SeqCst), 30);
    // The service cancels its own token: claiming stops, and shutdown waits for the workers.
    shutdown.cancel();
    assert!(handle.shutdown().await.graceful);
    let mut tx = repo.begin().await.unwrap();
    repo.enqueue(&mut tx, &events[..1]).await.unwrap();
    tx.commit().await.unwrap();
    // A dispatcher whose token is already cancelled claims nothing, and `drained` does not
    // wait for rows that nobody will take.
    let stopped = Dispatcher::new(
        repo.clone(),
        Handlers::new().register("t", Count(handled.clone())),
        WorkerConfig::default().with_workers(3),
    )
    .with_stop_token(shutdown.clone())
    .start()
    .await
    .unwrap();
    assert!(!stopped.drained(Duration::from_millis(20)).await.unwrap());
    assert!(stopped.shutdown().await.graceful);
    assert_eq!(
        handled.load(Ordering::SeqCst),
        30,
        "nothing claimed after the stop"
    );
}

/// An error's text names its cause, not only its kind.
async fn errors_say_their_cause(db: TestDb) {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let err = repo
        .enqueue(&mut tx, &[NewEvent::new("t", "{not json")])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not valid JSON"), "{err}");
    tx.rollback().await.unwrap();
    // The effect ledger and the webhook attempts reference the outbox table: they go first.
    db.execute("DROP TABLE _System_OutboxEffect").await;
    db.execute("DROP TABLE _System_OutboxWebhookAttempt").await;
    db.execute("DROP TABLE _System_OutboxEvent").await;
    let err = repo.get_event(uuid::Uuid::now_v7()).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("database error: ") && text.to_lowercase().contains("outboxevent"),
        "{text}"
    );
}

/// An application that owns its pool and its transactions enqueues on the connection of a
/// transaction it opened itself with sqlx; the rows commit or roll back with it.
async fn enqueue_on_the_applications_own_transaction(db: TestDb) {
    let events = [NewEvent::new("t", r#"{"object":"Lead","record_id":"own"}"#)];
    let ids = match &db.db {
        outbox_events::Database::Postgres(pool) => {
            let mut rolled_back = pool.begin().await.unwrap();
            outbox_events::persistence::postgres::enqueue(&mut rolled_back, &events)
                .await
                .unwrap();
            rolled_back.rollback().await.unwrap();
            let mut tx = pool.begin().await.unwrap();
            let ids = outbox_events::persistence::postgres::enqueue(&mut tx, &events)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            ids
        }
        outbox_events::Database::Sqlite(pool) => {
            let mut rolled_back = pool.begin().await.unwrap();
            outbox_events::persistence::sqlite::enqueue(&mut rolled_back, &events)
                .await
                .unwrap();
            rolled_back.rollback().await.unwrap();
            let mut tx = pool.begin().await.unwrap();
            let ids = outbox_events::persistence::sqlite::enqueue(&mut tx, &events)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            ids
        }
    };
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent").await,
        1,
        "the rolled-back enqueue left nothing"
    );
    let row = db.repository().get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(
        row.record_key.as_ref().map(|k| k.as_str()),
        Some("lead:own")
    );
}

backend_tests!(
    caller_token_and_drained,
    errors_say_their_cause,
    enqueue_on_the_applications_own_transaction
);
