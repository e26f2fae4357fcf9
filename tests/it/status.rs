//! "Why is this record stuck?" on both backends: `key_report` names each state of a key's head
//! (running, stale, waiting for its retry, waiting for a running row of its key, claimable,
//! none) and the newest failed row; `blocked_keys` lists keys with waiting rows, the longest
//! wait first, with the same verdicts.

use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{
    ClaimPolicy, EventStatus, HeadState, NewEvent, OutboxRepository, RetryFilter, Terminal,
    key_report,
};
use outbox_tests::{TestDb, backend_tests};

const STALE_AFTER: Duration = Duration::from_secs(30);
const RETRY_DELAY: Duration = Duration::from_secs(10);

fn policy() -> ClaimPolicy {
    ClaimPolicy::new(STALE_AFTER, RETRY_DELAY, 5)
}

fn lead(id: &str) -> String {
    format!(r#"{{"object":"Lead","record_id":"{id}","snapshot":{{}}}}"#)
}

/// Enqueues `n` events about `Lead:id` (in one transaction, in order) and returns their ids.
async fn enqueue(repo: &Arc<dyn OutboxRepository>, id: &str, n: usize) -> Vec<uuid::Uuid> {
    let events: Vec<NewEvent> = (0..n)
        .map(|_| NewEvent::new("lead.updated", lead(id)))
        .collect();
    let mut tx = repo.begin().await.unwrap();
    let ids = repo.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

async fn state(repo: &Arc<dyn OutboxRepository>, key: &str) -> Option<HeadState> {
    key_report(repo.as_ref(), key, policy()).await.unwrap().head
}

async fn why_each_key_is_stuck(db: TestDb) {
    let repo = db.repository();

    // A running head: live heartbeat, one row waiting behind it.
    let a = enqueue(&repo, "a", 2).await;
    let claim_a = repo.claim_event(a[0], policy()).await.unwrap().unwrap();
    assert!(matches!(
        state(&repo, "lead:a").await,
        Some(HeadState::Running { .. })
    ));
    let blocked = repo.blocked_keys(policy(), 10).await.unwrap();
    assert_eq!(blocked.len(), 1, "{blocked:?}");
    assert_eq!(blocked[0].head.id, a[0]);
    assert_eq!(blocked[0].waiting, 1);
    assert!(matches!(blocked[0].state, HeadState::Running { .. }));

    // Its heartbeat stops: stale since the last beat plus stale-after.
    db.clock.advance(STALE_AFTER + Duration::from_secs(1));
    match state(&repo, "lead:a").await {
        Some(HeadState::Stale {
            last_beat,
            stale_since,
        }) => {
            assert_eq!(last_beat, claim_a.fence.last_written);
            assert_eq!(
                stale_since,
                last_beat + chrono::Duration::from_std(STALE_AFTER).unwrap()
            );
        }
        other => panic!("expected stale, got {other:?}"),
    }

    // A head that failed once waits for its retry delay.
    let b = enqueue(&repo, "b", 2).await;
    let claim_b = repo.claim_event(b[0], policy()).await.unwrap().unwrap();
    repo.increment_retry(claim_b.fence, Duration::ZERO, "boom")
        .await
        .unwrap();
    let report = key_report(repo.as_ref(), "lead:b", policy()).await.unwrap();
    match report.head {
        Some(HeadState::WaitingForRetry { until, failures }) => {
            assert_eq!(failures, 1);
            assert!(until > report.now, "{until} > {}", report.now);
        }
        other => panic!("expected a retry wait, got {other:?}"),
    }
    assert_eq!(report.rows.len(), 2);
    assert_eq!(report.rows[0].id, b[0]);

    // A head that failed for good released its successor, which is claimable now.
    let c = enqueue(&repo, "c", 2).await;
    let claim_c = repo.claim_event(c[0], policy()).await.unwrap().unwrap();
    repo.update_status(claim_c.fence, Terminal::Failed, Some("bad".into()))
        .await
        .unwrap();
    let report = key_report(repo.as_ref(), "lead:c", policy()).await.unwrap();
    assert_eq!(report.head, Some(HeadState::Ready));
    assert_eq!(report.rows.len(), 1);
    let failed = report.last_failed.expect("the failed row");
    assert_eq!((failed.id, failed.status), (c[0], EventStatus::Failed));

    // A key without non-terminal rows has no head.
    assert_eq!(state(&repo, "lead:nobody").await, None);

    // An operator retried an older row while a younger one of its key runs: it waits for it.
    let e = enqueue(&repo, "e", 2).await;
    let claim_e = repo.claim_event(e[0], policy()).await.unwrap().unwrap();
    repo.update_status(claim_e.fence, Terminal::Failed, Some("bad".into()))
        .await
        .unwrap();
    repo.claim_event(e[1], policy()).await.unwrap().unwrap();
    assert_eq!(repo.retry_failed(RetryFilter::Id(e[0])).await.unwrap(), 1);
    // PostgreSQL holds a retried row back for RETRY_NOT_BEFORE; let that pass.
    db.clock.advance(Duration::from_secs(3));
    assert_eq!(
        state(&repo, "lead:e").await,
        Some(HeadState::WaitingForInFlight { running: e[1] })
    );

    // The longest wait first: lead:a's waiting row is the oldest.
    let blocked = repo.blocked_keys(policy(), 10).await.unwrap();
    let keys: Vec<&str> = blocked
        .iter()
        .map(|b| b.head.record_key.as_ref().unwrap().as_str())
        .collect();
    assert_eq!(keys, ["lead:a", "lead:b", "lead:e"], "{blocked:?}");
    assert!(matches!(blocked[0].state, HeadState::Stale { .. }));
    assert!(matches!(
        blocked[1].state,
        HeadState::WaitingForRetry { .. }
    ));
    assert_eq!(
        blocked[2].state,
        HeadState::WaitingForInFlight { running: e[1] }
    );
    assert_eq!(repo.blocked_keys(policy(), 1).await.unwrap().len(), 1);
}

backend_tests!(with_pgbouncer: why_each_key_is_stuck);
