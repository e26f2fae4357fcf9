//! Shared set-up: a relay on a test server, a keyed workload, the expected order read back
//! from the outbox, and a run until the relay's share of the queue is drained.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_events::persistence::EventFilter;
use outbox_events::{DispatchMode, NewEvent, OutboxRepository, WorkerConfig};
use outbox_relay::test_support::NatsServer;
use outbox_relay::{Expected, NatsConnect, Relay, RelayConfig, StreamSpec, relayed_rows_left};
use outbox_tests::TestDb;

/// The relayed event types.
pub const TYPES: [&str; 2] = ["account.updated", "lead.updated"];
/// An event type the relay does not own.
pub const OTHER: &str = "invoice.sent";

/// Worker settings that make stale reclaim and retries quick.
pub fn fast(workers: usize) -> WorkerConfig {
    WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .with_workers(workers)
        .with_poll_interval(Duration::from_millis(50))
        .with_heartbeat_interval(Duration::from_millis(200))
        .with_stale_after(Duration::from_millis(1_000))
        .with_retry_delay(Duration::from_millis(50))
        .with_max_retry_delay(Duration::from_millis(500))
        .with_max_retry_attempts(30)
        .with_shutdown_timeout(Duration::from_secs(5))
}

/// The relay's configuration in these tests.
pub fn relay_config() -> RelayConfig {
    RelayConfig::new("OUTBOX", "crm", TYPES).with_ack_timeout(Duration::from_millis(1_000))
}

/// A relay on `nats` with its stream created for `worker`.
pub async fn relay(nats: &NatsServer, worker: &WorkerConfig) -> Relay {
    let client = NatsConnect::new(nats.url())
        .connect()
        .await
        .expect("connect");
    let relay = Relay::new(client, relay_config()).expect("a valid relay config");
    let spec = StreamSpec::for_relay(relay.config(), worker);
    assert!(relay.create_stream(&spec).await.expect("create the stream"));
    relay
}

/// Enqueues `n` events over `records` accounts, alternating the relayed types, in batches of
/// 50 per transaction (several events of one record in one transaction too).
pub async fn enqueue(repo: &Arc<dyn OutboxRepository>, n: usize, records: usize) {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            let payload = format!(
                r#"{{"object":"Account","record_id":"A{:04}","seq":{i}}}"#,
                i % records
            );
            NewEvent::new(TYPES[i % 2], payload)
        })
        .collect();
    for batch in events.chunks(50) {
        let mut tx = repo.begin().await.expect("begin");
        repo.enqueue(&mut tx, batch).await.expect("enqueue");
        tx.commit().await.expect("commit");
    }
}

/// The relayed events in enqueue order, as the audit expects them.
pub async fn expected(repo: &Arc<dyn OutboxRepository>) -> Vec<Expected> {
    repo.list_events(EventFilter::new())
        .await
        .expect("list the outbox")
        .into_iter()
        .filter(|r| TYPES.contains(&r.event_type.as_str()))
        .map(|r| Expected {
            id: r.id.to_string(),
            record_key: r.record_key.map(|k| k.as_str().to_string()),
        })
        .collect()
}

/// Waits until no relayed row is pending or processing, or panics after `limit`.
pub async fn wait_drained(db: &TestDb, limit: Duration) {
    let repo = db.repository();
    let start = Instant::now();
    while relayed_rows_left(&repo, &relay_config())
        .await
        .expect("read the queue")
        > 0
    {
        assert!(
            start.elapsed() < limit,
            "the relay did not drain within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Counts rows of `event_type` in `status`.
pub async fn count(repo: &Arc<dyn OutboxRepository>, event_type: &str, status: &str) -> usize {
    repo.list_events(
        EventFilter::new()
            .event_type(event_type)
            .statuses([status.parse().expect("a status")]),
    )
    .await
    .expect("list the outbox")
    .len()
}
