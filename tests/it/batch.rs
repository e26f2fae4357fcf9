//! `claim_batch`: several rows claimed in one statement (PostgreSQL) or one write transaction
//! (SQLite), with every rule of `claim_next`, on both backends.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{ClaimPolicy, EventStatus, NewEvent, OutboxRepository, Scope};
use outbox_tests::{RawRow, TestDb, backend_tests};

use crate::repository::{distinct_claims, enqueue, lead};

const STALE_AFTER: Duration = Duration::from_secs(30);

fn policy(max_retry_attempts: i32) -> ClaimPolicy {
    ClaimPolicy::new(STALE_AFTER, Duration::from_secs(10), max_retry_attempts)
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
    assert_eq!(
        distinct_claims(tasks).await,
        30,
        "every key's head was claimed, once"
    );
}

/// A stale row whose dead attempts used up `MaxRetryAttempts` ends `failed` instead of being
/// claimed, and releases the rows behind it, its own key's next row included. (SQLite fills
/// the batch in the same transaction; PostgreSQL returns the claims its statement made at once,
/// and the next call takes the rest.)
async fn exhausted_rows_end_failed_and_release_their_successors(db: TestDb) {
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

    let claims = claim_all(&repo, policy(1), 2).await;
    let claimed: HashSet<_> = claims.iter().map(|c| c.event.id).collect();
    assert_eq!(claims.len(), 2, "each row once: {claims:?}");
    assert_eq!(
        claimed,
        HashSet::from([ids[1], ids[2]]),
        "the exhausted row's successor and B"
    );
    let first = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(first.status, EventStatus::Failed);
    assert!(first.last_error.unwrap().starts_with("worker died"));
}

/// `claim_batch` of `max` until it returns nothing; each batch must come oldest first.
async fn claim_all(
    repo: &Arc<dyn OutboxRepository>,
    policy: ClaimPolicy,
    max: usize,
) -> Vec<outbox_persistence::Claim> {
    let mut all = Vec::new();
    loop {
        let batch = repo.claim_batch(policy, &Scope::All, max).await.unwrap();
        if batch.is_empty() {
            return all;
        }
        assert!(batch.len() <= max);
        let order: Vec<_> = batch
            .iter()
            .map(|c| (c.event.created_date, c.event.id))
            .collect();
        assert!(order.is_sorted(), "oldest first: {order:?}");
        all.extend(batch);
    }
}

/// One batch over a reclaimable stale row, an exhausted one and pending rows: the stale row is
/// reclaimed once (its dead attempt counted), the exhausted one ends `failed`, and the places
/// are filled with the rows behind them, its key's next row included.
async fn a_batch_reclaims_a_stale_row_once(db: TestDb) {
    let repo = db.repository();
    let at = outbox_persistence::truncate_micros(chrono::Utc::now()) - chrono::Duration::hours(1);
    let row = |key: &str, status: &'static str, retries: i32, secs: i64| {
        let mut row = RawRow::pending(Some(key), at + chrono::Duration::seconds(secs));
        row.status = status;
        row.retry_count = retries;
        row
    };
    let stale = row("lead:a", "processing", 0, 0);
    let exhausted = row("lead:b", "processing", 4, 1);
    let behind_exhausted = row("lead:b", "pending", 0, 2);
    let pending = row("lead:c", "pending", 0, 3);
    for r in [&stale, &exhausted, &behind_exhausted, &pending] {
        db.insert_raw(r).await;
    }
    // Both claims' workers died: let SQLite observe them, then stale-after pass.
    repo.stats(policy(5)).await.unwrap();
    db.clock.advance(STALE_AFTER + Duration::from_secs(1));

    let claims = if repo.backend_name() == "sqlite" {
        // SQLite fills the batch in its one transaction, past the rows it failed and the stale
        // row it reclaimed (which still reads as stale there).
        let claims = repo.claim_batch(policy(5), &Scope::All, 3).await.unwrap();
        assert_eq!(
            claims.len(),
            3,
            "one transaction fills the batch: {claims:?}"
        );
        claims
    } else {
        claim_all(&repo, policy(5), 3).await
    };
    let mut ids: Vec<_> = claims.iter().map(|c| c.event.id).collect();
    ids.sort();
    let mut expected = vec![stale.id, behind_exhausted.id, pending.id];
    expected.sort();
    assert_eq!(ids, expected, "each row once: {claims:?}");
    let reclaimed = claims.iter().find(|c| c.event.id == stale.id).unwrap();
    assert!(reclaimed.reclaimed);
    assert_eq!(
        reclaimed.event.retry_count, 1,
        "the dead attempt counted once"
    );
    let failed = repo.get_event(exhausted.id).await.unwrap().unwrap();
    assert_eq!(failed.status, EventStatus::Failed);
    assert_eq!(failed.retry_count, 5);
}

backend_tests!(
    a_batch_reclaims_a_stale_row_once,
    a_batch_claims_the_oldest_heads_of_distinct_keys,
    concurrent_batches_respect_keys,
    exhausted_rows_end_failed_and_release_their_successors,
);
