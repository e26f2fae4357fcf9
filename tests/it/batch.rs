//! `claim_batch`: several rows claimed in one statement (PostgreSQL) or one write transaction
//! (SQLite), with every rule of `claim_next`, on both backends.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{ClaimPolicy, EventStatus, NewEvent, OutboxRepository, Scope};
use outbox_tests::{TestDb, backend_tests};

const STALE_AFTER: Duration = Duration::from_secs(30);

fn policy(max_retry_attempts: i32) -> ClaimPolicy {
    ClaimPolicy::new(STALE_AFTER, Duration::from_secs(10), max_retry_attempts)
}

fn lead(id: &str) -> String {
    format!(r#"{{"object":"Lead","record_id":"{id}","snapshot":{{"Status":"Open"}}}}"#)
}

async fn enqueue(repo: &Arc<dyn OutboxRepository>, events: &[NewEvent]) -> Vec<uuid::Uuid> {
    let mut tx = repo.begin().await.unwrap();
    let ids = repo.enqueue(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

/// A batch takes the oldest eligible rows, oldest first: each key's head and the unkeyed rows,
/// never two rows of one key, and never a row of a key already in flight.
async fn a_batch_claims_the_oldest_heads_of_distinct_keys(db: TestDb) {
    let repo = db.repository();
    // Three rounds over five keys, with two unkeyed events in the second round.
    let mut events = Vec::new();
    for round in 0..3 {
        for key in 0..5 {
            events.push(NewEvent::new("t", lead(&format!("K{key}"))));
        }
        if round == 1 {
            events.push(NewEvent::new("t", r#"{"note":"no record"}"#.to_string()));
            events.push(NewEvent::new("t", r#"{"note":"no record"}"#.to_string()));
        }
    }
    let ids = enqueue(&repo, &events).await;
    let expected: Vec<_> = repo
        .get_pending_events(policy(5), &Scope::All, 100)
        .await
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(expected.len(), 7, "five heads and two unkeyed rows");

    let first = repo.claim_batch(policy(5), &Scope::All, 4).await.unwrap();
    let first_ids: Vec<_> = first.iter().map(|c| c.event.id).collect();
    assert_eq!(first_ids, expected[..4], "the four oldest, oldest first");
    for claim in &first {
        assert_eq!(claim.event.status, EventStatus::Processing);
        assert_eq!(claim.fence.last_written, claim.event.last_modified_date);
    }

    let rest = repo.claim_batch(policy(5), &Scope::All, 100).await.unwrap();
    let rest_ids: Vec<_> = rest.iter().map(|c| c.event.id).collect();
    assert_eq!(
        rest_ids,
        expected[4..],
        "the other heads; no row of a key in flight"
    );
    assert!(
        repo.claim_batch(policy(5), &Scope::All, 100)
            .await
            .unwrap()
            .is_empty(),
        "every key is in flight and no unkeyed row is left"
    );
    let stored: HashSet<_> = ids.iter().collect();
    assert!(
        first_ids
            .iter()
            .chain(&rest_ids)
            .all(|id| stored.contains(id))
    );
}

/// Concurrent batches never share a row and never hold two rows of one key.
async fn concurrent_batches_respect_keys(db: TestDb) {
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..90)
        .map(|i| NewEvent::new("t", lead(&format!("K{}", i % 30))))
        .collect();
    enqueue(&repo, &events).await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let repo = repo.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for _ in 0..10 {
                match repo.claim_batch(policy(5), &Scope::All, 5).await {
                    Ok(claims) if claims.is_empty() => break,
                    Ok(claims) => {
                        mine.extend(claims.into_iter().map(|c| (c.event.id, c.event.record_key)))
                    }
                    Err(e) if e.is_transient() => continue,
                    Err(e) => panic!("claim_batch failed: {e:?}"),
                }
            }
            mine
        }));
    }
    let mut ids = HashSet::new();
    let mut keys = HashSet::new();
    for task in tasks {
        for (id, key) in task.await.unwrap() {
            assert!(ids.insert(id), "row {id} claimed twice");
            assert!(keys.insert(key.clone()), "two rows of {key:?} in flight");
        }
    }
    assert_eq!(keys.len(), 30, "every key's head was claimed, once");
}

/// A stale row whose dead attempts used up `MaxRetryAttempts` ends `failed` instead of being
/// claimed, and the batch fills up with the rows behind it, its own key's next row included.
async fn a_batch_fills_up_past_exhausted_rows(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(
        &repo,
        &[
            NewEvent::new("t", lead("A")),
            NewEvent::new("t", lead("A")),
            NewEvent::new("t", lead("B")),
        ],
    )
    .await;
    let dead = repo
        .claim_next(policy(1), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(dead.event.id, ids[0]);
    // The claim's worker died: let its heartbeat go silent for longer than stale-after.
    repo.stats(policy(1)).await.unwrap();
    db.clock.advance(STALE_AFTER + Duration::from_secs(1));

    let claims = repo.claim_batch(policy(1), &Scope::All, 2).await.unwrap();
    let claimed: HashSet<_> = claims.iter().map(|c| c.event.id).collect();
    assert_eq!(
        claimed,
        HashSet::from([ids[1], ids[2]]),
        "the exhausted row's successor and B"
    );
    let order: Vec<_> = claims
        .iter()
        .map(|c| (c.event.created_date, c.event.id))
        .collect();
    assert!(order.is_sorted(), "oldest first: {order:?}");
    let first = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(first.status, EventStatus::Failed);
    assert!(first.last_error.unwrap().starts_with("worker died"));
}

backend_tests!(
    a_batch_claims_the_oldest_heads_of_distinct_keys,
    concurrent_batches_respect_keys,
    a_batch_fills_up_past_exhausted_rows,
);
