//! Every processed event in the stream exactly once, each record's events in enqueue order,
//! the metadata in headers, another event type left alone, and the gate passing for the relay.

use std::time::Duration;

use outbox_events::persistence::EventFilter;
use outbox_events::{DispatchMode, Verdict, evaluate_gate};
use outbox_relay::test_support::NatsServer;
use outbox_relay::{audit, read_stream};
use outbox_tests::{TestDb, backend_tests};

use crate::common::{OTHER, count, enqueue, expected, fast, relay, wait_drained};

async fn every_event_lands_once_in_per_record_order(db: TestDb) {
    let nats = NatsServer::start();
    let worker = fast(8);
    let relay = relay(&nats, &worker).await;
    let repo = db.repository();
    enqueue(&repo, 600, 40).await;
    // An event type the relay does not own: it must stay untouched.
    let mut tx = repo.begin().await.unwrap();
    let other = outbox_events::NewEvent::new(OTHER, r#"{"object":"Account","record_id":"A0001"}"#);
    repo.enqueue(&mut tx, &[other]).await.unwrap();
    tx.commit().await.unwrap();

    let gate = evaluate_gate(&repo, &relay.config().consumers(&worker))
        .await
        .unwrap();
    assert!(gate.passes(), "{:?}", gate.reasons);
    assert!(gate.consumers.iter().all(|(_, v)| *v == Verdict::Protected));

    let (dispatcher, check) = relay.dispatcher(repo.clone(), worker).await.unwrap();
    assert!(check.warnings.is_empty(), "{:?}", check.warnings);
    let handle = dispatcher.start().await.unwrap();
    assert_eq!(
        handle.decision().mode,
        DispatchMode::Pull,
        "the gate passes for the relay"
    );
    wait_drained(&db, Duration::from_secs(60)).await;
    let report = handle.shutdown().await;
    assert_eq!(report.metrics.processed, 600);

    let messages = read_stream(relay.jetstream(), "OUTBOX").await.unwrap();
    let expected = expected(&repo).await;
    let audit = audit(&messages, &expected);
    assert!(audit.passed(), "{audit:?}");
    assert_eq!(audit.messages, 600);
    assert_eq!(relay.metrics().published, 600);
    assert_eq!(
        count(&repo, OTHER, "pending").await,
        1,
        "the other type is not the relay's"
    );

    // The message carries the payload as stored and the event's metadata.
    let first = &messages[0];
    let id = first.msg_id.clone().unwrap();
    let row = repo
        .get_event(id.parse().unwrap())
        .await
        .unwrap()
        .expect("the row of the first message");
    assert_eq!(first.payload, row.payload.as_bytes());
    assert_eq!(first.subject, format!("crm.{}", row.event_type));
    assert_eq!(first.event_type.as_deref(), Some(row.event_type.as_str()));
    assert_eq!(
        first.record_key.as_deref(),
        row.record_key.as_ref().map(|k| k.as_str())
    );
    assert_eq!(first.attempt, Some(1));
    let rows = repo
        .list_events(EventFilter::new().ids([row.id]))
        .await
        .unwrap();
    assert_eq!(rows[0].status.as_str(), "processed");
    let created = row
        .created_date
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    assert_eq!(first.created_date.as_deref(), Some(created.as_str()));
}

backend_tests!(every_event_lands_once_in_per_record_order);
