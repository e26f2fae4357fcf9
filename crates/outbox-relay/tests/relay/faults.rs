//! The failure cases: a worker that dies after its publish and before its commit, a NATS
//! server restart in the middle of a run, a publish the server never acks.

use std::sync::Arc;
use std::time::Duration;

use outbox_events::persistence::EventFilter;
use outbox_events::{
    AttemptContext, AttemptOutcome, ClaimRunner, Dispatcher, Handler, HandlerError, Handlers,
    OutboxEvent, async_trait,
};
use outbox_relay::test_support::NatsServer;
use outbox_relay::{audit, read_stream};
use outbox_tests::{TestDb, backend_tests};
use tokio::sync::Notify;

use crate::common::{TYPES, enqueue, expected, fast, relay, relay_config, wait_drained};

/// Publishes through the relay's handler, then never returns: the attempt is stuck between
/// the publish and the commit until the worker is stopped hard, as a process killed there is.
struct DiesAfterPublish {
    inner: Arc<dyn Handler>,
    published: Arc<Notify>,
}

#[async_trait]
impl Handler for DiesAfterPublish {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.inner.handle(event, ctx).await?;
        self.published.notify_one();
        std::future::pending().await
    }
}

async fn a_worker_killed_after_its_publish_leaves_no_duplicate(db: TestDb) {
    let nats = NatsServer::start();
    let worker = fast(1).with_shutdown_timeout(Duration::from_millis(100));
    let relay = relay(&nats, &worker).await;
    let repo = db.repository();
    enqueue(&repo, 1, 1).await;

    let published = Arc::new(Notify::new());
    let real = relay.handlers(&worker);
    let consumer = relay.config().consumers(&worker).remove(0);
    assert_eq!(consumer.event_type, TYPES[0]);
    let dying = Handlers::new().register_consumer(
        consumer,
        DiesAfterPublish {
            inner: real.get(TYPES[0]).unwrap().clone(),
            published: published.clone(),
        },
    );
    let first = Dispatcher::new(repo.clone(), dying, relay.worker_config(worker.clone()))
        .start()
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), published.notified())
        .await
        .expect("the first attempt published");
    let killed = first.shutdown().await;
    assert!(
        !killed.graceful,
        "the attempt was cut between publish and commit"
    );
    let row = &repo.list_events(EventFilter::new()).await.unwrap()[0];
    assert_eq!(
        row.status.as_str(),
        "processing",
        "no commit: the row waits for stale reclaim"
    );
    assert_eq!(
        read_stream(relay.jetstream(), "OUTBOX")
            .await
            .unwrap()
            .len(),
        1
    );

    // A new worker reclaims the stale row and publishes the event again: the stream drops it.
    let (dispatcher, _) = relay.dispatcher(repo.clone(), worker).await.unwrap();
    let second = dispatcher.start().await.unwrap();
    wait_drained(&db, Duration::from_secs(30)).await;
    let report = second.shutdown().await;
    assert_eq!(report.metrics.stale_reclaims, 1);
    assert_eq!(
        relay.metrics().duplicates,
        1,
        "the redelivery was acked as a duplicate"
    );
    let row = &repo.list_events(EventFilter::new()).await.unwrap()[0];
    assert_eq!(row.status.as_str(), "processed");
    assert_eq!(row.retry_count, 1, "the dead attempt was counted");
    let messages = read_stream(relay.jetstream(), "OUTBOX").await.unwrap();
    let audit = audit(&messages, &expected(&repo).await);
    assert!(audit.passed(), "{audit:?}");
    assert_eq!(messages.len(), 1);
}

async fn a_server_restart_mid_run_loses_and_duplicates_nothing(db: TestDb) {
    let mut nats = NatsServer::start();
    let worker = fast(8);
    let relay = relay(&nats, &worker).await;
    let repo = db.repository();
    enqueue(&repo, 1_500, 60).await;
    let (dispatcher, _) = relay.dispatcher(repo.clone(), worker).await.unwrap();
    let handle = dispatcher.start().await.unwrap();
    let start = std::time::Instant::now();
    while relay.metrics().published < 150 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the relay did not start publishing"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    nats.stop();
    let at_stop = relay.metrics().published;
    // The outage lasts until the relay has felt it (at least 700 ms): on a loaded machine a
    // fixed pause could pass before the relay tried to publish again.
    let stopped = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(700)).await;
    while relay.metrics().failures == 0 && stopped.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nats.start_again();
    wait_drained(&db, Duration::from_secs(90)).await;
    let report = handle.shutdown().await;
    assert!(
        at_stop < 1_500,
        "the server stopped mid-run ({at_stop} published before)"
    );
    assert!(
        relay.metrics().failures > 0,
        "the outage was felt: {:?}",
        relay.metrics()
    );
    assert_eq!(report.metrics.processed, 1_500);
    assert_eq!(report.metrics.failed, 0);
    let messages = read_stream(relay.jetstream(), "OUTBOX").await.unwrap();
    let audit = audit(&messages, &expected(&repo).await);
    assert!(audit.passed(), "{audit:?}");
    assert_eq!(messages.len(), 1_500);
}

async fn a_publish_that_is_not_acked_is_a_retry(db: TestDb) {
    let mut nats = NatsServer::start();
    let worker = fast(1);
    let relay = relay(&nats, &worker).await;
    let repo = db.repository();
    enqueue(&repo, 1, 1).await;
    nats.stop();
    let claim = repo
        .claim_next(worker.claim_policy(), &relay_config().scope())
        .await
        .unwrap()
        .expect("the event is claimable");
    let runner = ClaimRunner::new(repo.clone(), relay.handlers(&worker), worker);
    let outcome = tokio::time::timeout(Duration::from_secs(10), runner.run(claim))
        .await
        .expect("the ack wait is bounded");
    assert_eq!(outcome, AttemptOutcome::Retried);
    let row = &repo.list_events(EventFilter::new()).await.unwrap()[0];
    assert_eq!(row.status.as_str(), "pending");
    assert_eq!(row.retry_count, 1);
    let error = row.last_error.as_deref().unwrap_or_default();
    assert!(error.contains("publish to crm.account.updated"), "{error}");
    assert_eq!(relay.metrics().failures, 1);
}

backend_tests!(
    a_worker_killed_after_its_publish_leaves_no_duplicate,
    a_server_restart_mid_run_loses_and_duplicates_nothing,
    a_publish_that_is_not_acked_is_a_retry,
);
