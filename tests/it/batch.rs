//! `claim_batch`: several rows claimed in one statement (PostgreSQL) or one write transaction
//! (SQLite), with every rule of `claim_next`, on both backends.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::postgres::PgOutbox;
use outbox_persistence::sqlx::postgres::PgPoolOptions;
use outbox_persistence::{
    BeatOutcome, ClaimPolicy, EventStatus, FenceOutcome, NewEvent, OutboxRepository, Scope,
    Terminal,
};
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

/// A claim that never reached the disk (`PgOutbox::with_async_claims`, then a server crash)
/// leaves the row exactly as it was before the claim. Simulated here by putting the row back as
/// it was. The worker that held the lost claim writes nothing and never starts its handler if it
/// had not yet; the row is claimed again, in its key's order, and processed once.
async fn a_claim_lost_in_a_crash_is_claimed_again_in_order(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(
        &repo,
        &[
            NewEvent::new("t", lead("lost")),
            NewEvent::new("t", lead("lost")),
        ],
    )
    .await;
    db.execute(
        "CREATE TABLE before_claim AS
         SELECT Id, Status, RetryCount, LastModifiedDate, LastError FROM _System_OutboxEvent",
    )
    .await;
    let lost = repo.claim_batch(policy(5), &Scope::All, 8).await.unwrap();
    assert_eq!(lost.len(), 1, "one row per key: {lost:?}");
    assert_eq!(lost[0].event.id, ids[0]);
    let lost = lost[0].fence;

    // The crash: the claim's transaction never reached the disk.
    db.execute(
        "UPDATE _System_OutboxEvent SET
           Status = (SELECT b.Status FROM before_claim b WHERE b.Id = _System_OutboxEvent.Id),
           RetryCount = (SELECT b.RetryCount FROM before_claim b WHERE b.Id = _System_OutboxEvent.Id),
           LastModifiedDate = (SELECT b.LastModifiedDate FROM before_claim b
                               WHERE b.Id = _System_OutboxEvent.Id),
           LastError = (SELECT b.LastError FROM before_claim b WHERE b.Id = _System_OutboxEvent.Id)
         WHERE Id IN (SELECT Id FROM before_claim)",
    )
    .await;

    // The worker that held it is fenced out before its handler starts, and everywhere else.
    assert!(
        repo.begin_attempt(Duration::from_secs(5), lost)
            .await
            .unwrap()
            .is_none(),
        "a handler never starts on a claim the crash lost"
    );
    assert_eq!(repo.heartbeat(lost).await.unwrap(), BeatOutcome::Lost);
    assert_eq!(
        repo.increment_retry(lost, Duration::ZERO, "late")
            .await
            .unwrap(),
        FenceOutcome::Lost
    );

    // Claimed again, still before its successor; the lost claim left no count behind.
    let again = repo.claim_batch(policy(5), &Scope::All, 8).await.unwrap();
    let again_ids: Vec<_> = again.iter().map(|c| c.event.id).collect();
    assert_eq!(again_ids, vec![ids[0]], "the same row, its successor waits");
    assert!(!again[0].reclaimed);
    assert_eq!(again[0].event.retry_count, 0);
    let mut attempt = repo
        .begin_attempt(Duration::from_secs(5), again[0].fence)
        .await
        .unwrap()
        .expect("the new claim holds");
    assert_eq!(
        attempt.mark_processed(again[0].fence).await.unwrap(),
        FenceOutcome::Written
    );
    attempt.commit().await.unwrap();
    let next = repo.claim_batch(policy(5), &Scope::All, 8).await.unwrap();
    let next_ids: Vec<_> = next.iter().map(|c| c.event.id).collect();
    assert_eq!(next_ids, vec![ids[1]], "then its successor");
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.status, EventStatus::Processed);
    assert_eq!(row.retry_count, 0);
}

/// Asynchronous claims (`PgOutbox::with_async_claims`) set `synchronous_commit` for the
/// claim's own transaction only: the connection goes back to the pool with the session's
/// `synchronous_commit` (and `lock_timeout`) untouched, so the application's transactions on the
/// same pool stay durable. Durable claims, the default, leave them alone too.
async fn claims_leave_the_sessions_durability_alone(db: TestDb) {
    let Some(pool) = db.pg() else {
        return; // SQLite has no such setting: its claims commit like any other write.
    };
    if db.behind_pooler() {
        return; // It builds a direct pool of its own: the PostgreSQL variant covers it.
    }
    let one = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    // Whatever the server's default, the session asks for durable commits.
    sqlx::query("SET synchronous_commit = on")
        .execute(&one)
        .await
        .unwrap();
    let settings = || async {
        let row: (String, String) = sqlx::query_as(
            "SELECT current_setting('synchronous_commit'), current_setting('lock_timeout')",
        )
        .fetch_one(&one)
        .await
        .unwrap();
        row
    };
    let before = settings().await;
    assert_eq!(before.0, "on");
    enqueue(
        &db.repository(),
        &[NewEvent::new("t", lead("a")), NewEvent::new("t", lead("b"))],
    )
    .await;
    for async_claims in [true, false] {
        let repo = PgOutbox::new(one.clone()).with_async_claims(async_claims);
        let claims = repo.claim_batch(policy(5), &Scope::All, 1).await.unwrap();
        assert_eq!(claims.len(), 1);
        assert_eq!(settings().await, before, "async claims: {async_claims}");
    }
    one.close().await;
}

/// `release_claims`: several claims back to `pending` unrun in one statement (uncounted, with
/// the message in `LastError`), each fenced: a fence that moved is reported lost and its row
/// left alone. A released head is claimable again at once.
async fn released_claims_go_back_unrun_and_fenced(db: TestDb) {
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..3)
        .map(|k| NewEvent::new("t", lead(&format!("R{k}"))))
        .collect();
    enqueue(&repo, &events).await;
    let claimed = repo.claim_batch(policy(5), &Scope::All, 3).await.unwrap();
    assert_eq!(claimed.len(), 3);
    let mut moved = claimed[1].fence;
    moved.last_written += chrono::Duration::milliseconds(1);
    let outcomes = repo
        .release_claims(vec![claimed[0].fence, moved], "beyond the want")
        .await
        .unwrap();
    assert_eq!(outcomes, vec![FenceOutcome::Written, FenceOutcome::Lost]);
    let released = repo.get_event(claimed[0].event.id).await.unwrap().unwrap();
    assert_eq!(released.status, EventStatus::Pending);
    assert_eq!(released.retry_count, 0, "a release is not counted");
    assert_eq!(released.last_error.as_deref(), Some("beyond the want"));
    let kept = repo.get_event(claimed[1].event.id).await.unwrap().unwrap();
    assert_eq!(
        kept.status,
        EventStatus::Processing,
        "a moved fence releases nothing"
    );
    let again = repo.claim_batch(policy(5), &Scope::All, 3).await.unwrap();
    let again: Vec<_> = again.iter().map(|c| c.event.id).collect();
    assert_eq!(again, vec![claimed[0].event.id]);
}

/// A reclaimed row given back unrun (by `release_claims`, or one claim's fenced release) keeps
/// the reclaim's `worker died: …`: the give-back of a reclaimer never reads as the dead
/// holder's own release (`released_by_us` in outbox-events). A row no reclaim counted takes the
/// give-back's message.
async fn a_reclaimed_row_given_back_keeps_its_worker_died_error(db: TestDb) {
    let repo = db.repository();
    let at = outbox_persistence::truncate_micros(chrono::Utc::now()) - chrono::Duration::hours(1);
    let mut dead = Vec::new();
    for (k, key) in ["lead:d0", "lead:d1"].iter().enumerate() {
        let mut row = RawRow::pending(Some(key), at + chrono::Duration::seconds(k as i64));
        row.status = "processing";
        db.insert_raw(&row).await;
        dead.push(row.id);
    }
    enqueue(&repo, &[NewEvent::new("t", lead("fresh"))]).await;
    // Their worker died: let SQLite observe them, then stale-after pass.
    repo.stats(policy(5)).await.unwrap();
    db.clock.advance(STALE_AFTER + Duration::from_secs(1));
    let claims = claim_all(&repo, policy(5), 3).await;
    assert_eq!(claims.len(), 3, "{claims:?}");
    let by_id = |id| claims.iter().find(|c| c.event.id == id).unwrap();
    let outcomes = repo
        .release_claims(vec![by_id(dead[0]).fence], "beyond the want")
        .await
        .unwrap();
    assert_eq!(outcomes, vec![FenceOutcome::Written]);
    let fresh = claims.iter().find(|c| !dead.contains(&c.event.id)).unwrap();
    for claim in [by_id(dead[1]), fresh] {
        assert_eq!(
            repo.release_claim(claim.fence, "given back").await.unwrap(),
            FenceOutcome::Written
        );
    }
    for id in &dead {
        let row = repo.get_event(*id).await.unwrap().unwrap();
        assert_eq!(row.status, EventStatus::Pending);
        assert_eq!(row.retry_count, 1, "the reclaim counted the dead attempt");
        let error = row.last_error.unwrap_or_default();
        assert!(
            error.starts_with(outbox_persistence::WORKER_DIED),
            "the give-back kept the reclaim's error: {error}"
        );
    }
    let fresh = repo.get_event(fresh.event.id).await.unwrap().unwrap();
    assert_eq!(fresh.last_error.as_deref(), Some("given back"));
    // Claimed fresh (once its retry delay passed: a reclaim counted it) and failed for good:
    // the handler's error replaces the reclaim's.
    db.clock.advance(Duration::from_secs(11));
    let again = claim_all(&repo, policy(5), 3).await;
    let failing = again.iter().find(|c| c.event.id == dead[0]).unwrap();
    assert_eq!(
        repo.update_status(failing.fence, Terminal::Failed, Some("unreadable".into()))
            .await
            .unwrap(),
        FenceOutcome::Written
    );
    let failed = repo.get_event(dead[0]).await.unwrap().unwrap();
    assert_eq!(failed.status, EventStatus::Failed);
    assert_eq!(failed.last_error.as_deref(), Some("unreadable"));
}

backend_tests!(
    with_pgbouncer: a_claim_lost_in_a_crash_is_claimed_again_in_order,
    claims_leave_the_sessions_durability_alone,
    a_batch_reclaims_a_stale_row_once,
    a_batch_claims_the_oldest_heads_of_distinct_keys,
    concurrent_batches_respect_keys,
    exhausted_rows_end_failed_and_release_their_successors,
    released_claims_go_back_unrun_and_fenced,
    a_reclaimed_row_given_back_keeps_its_worker_died_error,
);

/// SQLite: a beat of a worker's many claims waits for the write lock once, not once per claim.
/// An application's write transaction holds the lock past the busy timeout (500 ms here): the
/// beat of 12 claims fails after one wait (beaten one by one, it waited 12 times, 6 s, while
/// none of the claims was beaten and other processes' observers counted them silent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_beat_of_many_claims_waits_for_the_lock_once() {
    let db = TestDb::sqlite().await;
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..12)
        .map(|k| NewEvent::new("t", lead(&format!("B{k}"))))
        .collect();
    enqueue(&repo, &events).await;
    let claimed = repo.claim_batch(policy(5), &Scope::All, 12).await.unwrap();
    assert_eq!(claimed.len(), 12);
    let fences: Vec<_> = claimed.iter().map(|c| c.fence).collect();
    let config = outbox_persistence::ConnectConfig {
        lock_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let beater = outbox_persistence::Database::connect(&db.url, config)
        .await
        .unwrap()
        .repository();
    let app = db
        .sqlite_pool()
        .unwrap()
        .begin_with("BEGIN IMMEDIATE")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let beaten = beater.heartbeat_many(fences.clone()).await;
    let waited = started.elapsed();
    assert!(beaten.is_err(), "the lock is held throughout: {beaten:?}");
    assert!(
        waited < Duration::from_secs(3),
        "one wait for the lock, not one per claim: {waited:?}"
    );
    app.rollback().await.unwrap();
    let outcomes = beater.heartbeat_many(fences).await.unwrap();
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, outbox_persistence::BeatOutcome::Beaten(_))),
        "{outcomes:?}"
    );
}

/// A reply-loss proxy in front of `db`'s server, and a repository that connects through it.
async fn through_reply_loss(
    db: &TestDb,
) -> (
    outbox_tests::reply_loss::ReplyLoss,
    std::sync::Arc<dyn OutboxRepository>,
) {
    let proxy = outbox_tests::reply_loss::ReplyLoss::start(&db.url);
    let through = outbox_persistence::Database::connect(
        &proxy.url,
        outbox_persistence::ConnectConfig::for_workers(1),
    )
    .await
    .unwrap()
    .repository();
    (proxy, through)
}

/// PostgreSQL: a claim whose `COMMIT` landed with its reply lost (the proxy closes the
/// connection as the reply comes back) is read back and taken: the rows under exactly the
/// fence the claim wrote are this claim's. Left to stale reclaim, each would have been counted
/// an attempt that never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_claim_whose_commit_reply_was_lost_is_taken() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..3)
        .map(|k| NewEvent::new("t", lead(&format!("L{k}"))))
        .collect();
    enqueue(&repo, &events).await;
    let (proxy, through) = through_reply_loss(&db).await;
    proxy.lose_next_commit_reply();
    let claims = through
        .claim_batch(policy(5), &Scope::All, 3)
        .await
        .expect("the claim landed: read back, not an error");
    assert_eq!(proxy.lost(), 1, "the claim's COMMIT reply was lost");
    assert_eq!(claims.len(), 3);
    for claim in &claims {
        let row = repo.get_event(claim.event.id).await.unwrap().unwrap();
        assert_eq!(row.status, EventStatus::Processing);
        assert_eq!(row.last_modified_date, claim.fence.last_written);
        assert_eq!(row.retry_count, 0, "nothing counted");
    }
    // The claims are live: their holder's writes land under their fences.
    for claim in &claims {
        assert_eq!(
            through
                .update_status(claim.fence, Terminal::Processed, None)
                .await
                .unwrap(),
            FenceOutcome::Written
        );
    }
}

/// PostgreSQL: a beat whose `COMMIT` landed with its reply lost reports what it wrote and in
/// which transaction (`BeatOutcome::Unsure`), one claim's beat and a group's alike; the
/// read-back (`beat_landed`) names exactly that row version. Rewriting the very same values
/// in another transaction (the look-alike another worker's fresh claim can leave after this
/// worker's release landed, finding 4 of the batched-attempts review) is not that version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_beat_whose_commit_reply_was_lost_is_read_back_by_its_version() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let repo = db.repository();
    enqueue(&repo, &[NewEvent::new("t", lead("L1"))]).await;
    let claim = repo
        .claim_batch(policy(5), &Scope::All, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    let (proxy, through) = through_reply_loss(&db).await;
    let (mut fence, mut last_writer) = (claim.fence, 0);
    for group in [false, true] {
        proxy.lose_next_commit_reply();
        let outcome = if group {
            through.heartbeat_many(vec![fence]).await.unwrap()[0]
        } else {
            through.heartbeat(fence).await.unwrap()
        };
        let BeatOutcome::Unsure { written, writer } = outcome else {
            panic!("group {group}: {outcome:?}");
        };
        let row = repo.get_event(fence.id).await.unwrap().unwrap();
        assert_eq!(row.last_modified_date, written.last_written, "it landed");
        assert!(repo.beat_landed(written, writer).await.unwrap());
        assert!(!repo.beat_landed(written, writer + 1).await.unwrap());
        (fence, last_writer) = (written, writer);
    }
    assert_eq!(proxy.lost(), 2, "both beats' COMMIT replies were lost");
    // The same values, written again by another transaction: no longer the beat's version.
    sqlx::query("UPDATE _System_OutboxEvent SET LastModifiedDate = LastModifiedDate WHERE Id = $1")
        .bind(fence.id)
        .execute(db.pg().unwrap())
        .await
        .unwrap();
    let row = repo.get_event(fence.id).await.unwrap().unwrap();
    assert_eq!(row.status, EventStatus::Processing);
    assert_eq!(row.last_modified_date, fence.last_written);
    assert!(
        !repo.beat_landed(fence, last_writer).await.unwrap(),
        "a look-alike written by another transaction is not the beat's version"
    );
}

/// SQLite: a record chain over rows whose ids other code spelled differently (upper case,
/// braces) ends before such a row instead of failing the claim (the claim of a chain's rows
/// compares the canonical spelling); each such row is claimed as its record's head later, its id
/// made canonical then, and the record drains in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_chain_ends_before_a_row_whose_id_other_code_spelled() {
    let db = TestDb::sqlite().await;
    let repo = db.repository();
    let at = outbox_persistence::truncate_micros(chrono::Utc::now()) - chrono::Duration::hours(1);
    let rows: Vec<RawRow> = (0..4)
        .map(|k| RawRow::pending(Some("lead:spelled"), at + chrono::Duration::seconds(k)))
        .collect();
    for row in &rows {
        db.insert_raw(row).await;
    }
    let other = RawRow::pending(Some("lead:other"), at + chrono::Duration::seconds(10));
    db.insert_raw(&other).await;
    let (upper, braced) = (rows[2].id.to_string(), rows[3].id.to_string());
    db.execute(&format!(
        "UPDATE _System_OutboxEvent SET Id = '{}' WHERE Id = '{upper}';
         UPDATE _System_OutboxEvent SET Id = '{{{braced}}}' WHERE Id = '{braced}';",
        upper.to_uppercase()
    ))
    .await;
    let mut order = Vec::new();
    for round in 0..4 {
        let claims = repo
            .claim_chains(policy(5), &Scope::All, 8, 8)
            .await
            .unwrap_or_else(|e| panic!("claim {round} fails: {e}"));
        assert!(!claims.is_empty(), "round {round} claims something");
        for claim in claims {
            order.push(claim.event.id);
            let mut attempt = repo
                .begin_attempt(Duration::from_secs(5), claim.fence)
                .await
                .unwrap()
                .expect("the claim holds");
            assert_eq!(
                attempt.mark_processed(claim.fence).await.unwrap(),
                FenceOutcome::Written
            );
            attempt.commit().await.unwrap();
        }
        if order.len() == 5 {
            break;
        }
    }
    let spelled: Vec<_> = order
        .iter()
        .filter(|id| **id != other.id)
        .copied()
        .collect();
    let expected: Vec<_> = rows.iter().map(|r| r.id).collect();
    assert_eq!(spelled, expected, "the record's rows once each, in order");
    assert!(order.contains(&other.id));
    for row in &rows {
        let event = repo
            .get_event(row.id)
            .await
            .unwrap()
            .expect("found by its id");
        assert_eq!(event.status, EventStatus::Processed);
    }
}
