//! The delivery attempts' log as the side writer keeps a batch of it: one statement on
//! PostgreSQL, in the order made, each attempt's fields as given, nothing for a pruned row.

use outbox_events::persistence::NewEvent;
use outbox_events::persistence::webhooks::{
    AttemptsOf, DeliveryAttempt, RESPONSE_BODY_KEPT, delivery_attempts, record_delivery_attempts,
};
use outbox_tests::{TestDb, backend_tests};

fn attempt(event_id: uuid::Uuid, attempt: i32, status: Option<i32>) -> DeliveryAttempt {
    DeliveryAttempt {
        endpoint: "crm".into(),
        event_id,
        source_event_id: uuid::Uuid::now_v7(),
        attempt,
        at: None,
        status_code: status,
        latency_ms: 10 + attempt,
        response_body: status.map(|s| format!("answer {s}")),
        error: None,
    }
}

async fn a_batch_of_attempts_is_kept_in_order_without_pruned_rows(db: TestDb) {
    let repo = db.repository();
    let mut tx = repo.begin().await.unwrap();
    let rows = repo
        .enqueue(
            &mut tx,
            &[
                NewEvent::new("webhook:crm", "{}"),
                NewEvent::new("webhook:crm", "{}"),
            ],
        )
        .await
        .unwrap();
    let mut failed = attempt(rows[1], 2, None);
    // A receiver may answer anything: a NUL and more than is kept.
    failed.error = Some(format!("timed out\0{}", "x".repeat(2 * RESPONSE_BODY_KEPT)));
    failed.response_body = Some("y".repeat(2 * RESPONSE_BODY_KEPT));
    let batch = vec![
        attempt(rows[0], 1, Some(200)),
        // Its outbox row is gone (pruned since the attempt): nothing is kept for it.
        attempt(uuid::Uuid::now_v7(), 1, Some(200)),
        attempt(rows[1], 1, Some(503)),
        failed.clone(),
    ];
    record_delivery_attempts(&mut tx, &batch).await.unwrap();
    record_delivery_attempts(&mut tx, &[]).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = repo.begin().await.unwrap();
    let kept = delivery_attempts(&mut tx, &AttemptsOf::Endpoint("crm".into()), 10)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    type Seen = (uuid::Uuid, i32, Option<i32>, i32, Option<String>);
    let seen: Vec<Seen> = kept
        .iter()
        .map(|a| {
            (
                a.event_id,
                a.attempt,
                a.status_code,
                a.latency_ms,
                a.response_body.clone(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (rows[1], 2, None, 12, Some("y".repeat(RESPONSE_BODY_KEPT))),
            (rows[1], 1, Some(503), 11, Some("answer 503".into())),
            (rows[0], 1, Some(200), 11, Some("answer 200".into())),
        ],
        "newest first, the pruned row's attempt left out"
    );
    assert_eq!(kept[0].source_event_id, failed.source_event_id);
    let error = kept[0].error.as_deref().unwrap();
    assert!(error.starts_with("timed out\u{fffd}x"), "{error:.40}");
    assert_eq!(error.len(), RESPONSE_BODY_KEPT);
    assert!(kept.iter().all(|a| a.at.is_some() && a.endpoint == "crm"));
}

backend_tests!(a_batch_of_attempts_is_kept_in_order_without_pruned_rows);
