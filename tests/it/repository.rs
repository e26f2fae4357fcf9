//! The repository conformance suite: written once against `OutboxRepository`, run on SQLite and
//! PostgreSQL, each test on a fresh database.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_persistence::{
    BeatOutcome, ClaimPolicy, Database, EventFilter, EventRow, EventStatus, FailureBookkeeping,
    Fence, FenceOutcome, NewEvent, OutboxRepository, RetryFilter, Scope, Terminal, Tx,
};
use outbox_tests::{RawRow, TestDb, backend_tests};

const STALE_AFTER: Duration = Duration::from_secs(30);
const RETRY_DELAY: Duration = Duration::from_secs(10);

fn base() -> DateTime<Utc> {
    outbox_persistence::truncate_micros(Utc::now())
}

fn at(base: DateTime<Utc>, secs: i64) -> DateTime<Utc> {
    base + chrono::Duration::seconds(secs)
}

const MAX_RETRY_ATTEMPTS: i32 = 5;

fn policy() -> ClaimPolicy {
    ClaimPolicy::new(STALE_AFTER, RETRY_DELAY, MAX_RETRY_ATTEMPTS)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Lets `STALE_AFTER` pass for the rows written so far: PostgreSQL compares their heartbeat
/// with the database's clock, SQLite must first have observed them (it decides staleness by
/// watching a row stay unchanged for `stale_after` of monotonic time). Both clocks move with the
/// test's clock shift.
async fn let_stale_after_pass(db: &TestDb, repo: &Arc<dyn OutboxRepository>) {
    repo.stats(policy()).await.unwrap();
    db.clock.advance(STALE_AFTER);
}

/// The payload of an event about Lead `id`.
pub(crate) fn lead(id: &str) -> String {
    format!(r#"{{"object":"Lead","record_id":"{id}","snapshot":{{"Status":"Open"}}}}"#)
}

/// Enqueues `events` in a transaction of their own; their ids.
pub(crate) async fn enqueue(
    repo: &Arc<dyn OutboxRepository>,
    events: &[NewEvent],
) -> Vec<uuid::Uuid> {
    let mut tx = repo.begin().await.unwrap();
    let ids = repo.enqueue(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

/// Every row kind of the eligibility rules, with the expected verdict. Times are relative to
/// `now`, the time after `STALE_AFTER` has been let pass; the live claims are written after
/// that, so that SQLite sees them first then (a fresh observation is live).
async fn eligibility_truth_table(db: TestDb) {
    let repo = db.repository();
    let now = base() + chrono::Duration::from_std(STALE_AFTER).unwrap();
    let mut t = at(now, -1000);
    let mut next = || {
        t += chrono::Duration::seconds(1);
        t
    };
    let row = |key: Option<&str>,
               status: &'static str,
               retry: i32,
               created: DateTime<Utc>,
               modified: DateTime<Utc>| RawRow {
        status,
        retry_count: retry,
        last_modified: modified,
        ..RawRow::pending(key, created)
    };
    let a = row(Some("Lead:a"), "pending", 0, next(), at(now, -500));
    let b = row(Some("Lead:b"), "processing", 0, next(), at(now, -1));
    let c = row(Some("Lead:c"), "processing", 0, next(), at(now, -60));
    let d = row(Some("Lead:d"), "pending", 1, next(), at(now, -5));
    let e = row(Some("Lead:e"), "pending", 1, next(), at(now, -20));
    let f = row(Some("Lead:f"), "processed", 0, next(), at(now, -100));
    let g = row(Some("Lead:g"), "failed", 3, next(), at(now, -100));
    let h = row(Some("Lead:b"), "pending", 0, next(), at(now, -100));
    let i = row(Some("Lead:c"), "pending", 0, next(), at(now, -100));
    let j = row(Some("Lead:g"), "pending", 0, next(), at(now, -100));
    let k = row(Some("Lead:f"), "pending", 0, next(), at(now, -100));
    let l = row(None, "pending", 0, next(), at(now, -100));
    let same = next();
    let (mut m, mut n) = (
        row(Some("Lead:m"), "pending", 0, same, at(now, -100)),
        row(Some("Lead:m"), "pending", 0, same, at(now, -100)),
    );
    if m.id > n.id {
        std::mem::swap(&mut m.id, &mut n.id);
    }
    let o = row(Some("Lead:d"), "pending", 0, next(), at(now, -100));
    let p = row(None, "processing", 0, next(), at(now, -2));
    let q = row(None, "pending", 2, next(), at(now, -9));
    for r in [&a, &c, &d, &e, &f, &g, &h, &i, &j, &k, &l, &m, &n, &o, &q] {
        db.insert_raw(r).await;
    }
    let_stale_after_pass(&db, &repo).await;
    for r in [&b, &p] {
        db.insert_raw(r).await;
    }
    let eligible: Vec<_> = repo
        .get_pending_events(policy(), &Scope::All, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    let expected = vec![a.id, c.id, e.id, j.id, k.id, l.id, m.id];
    assert_eq!(eligible, expected, "eligible rows, oldest first");

    // The limit keeps the oldest.
    let first_two: Vec<_> = repo
        .get_pending_events(policy(), &Scope::All, 2)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(first_two, vec![a.id, c.id]);

    // claim_next walks the same order and never takes an ineligible row.
    let mut claimed = Vec::new();
    while let Some(claim) = repo.claim_next(policy(), &Scope::All).await.unwrap() {
        claimed.push(claim.event.id);
        assert!(
            claimed.len() <= expected.len(),
            "claimed more than the eligible rows"
        );
    }
    assert_eq!(claimed, expected);
    // The stale claim `c` was reclaimed: its dead attempt is counted.
    let c_row = repo.get_event(c.id).await.unwrap().unwrap();
    assert_eq!(c_row.retry_count, 1);
    assert!(
        c_row
            .last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("worker died:")),
        "{:?}",
        c_row.last_error
    );
}

/// The query exactly as the design writes it (only the parameter markers differ) runs on a
/// migrated database.
async fn design_query_runs_unchanged(db: TestDb) {
    let design = "SELECT Id, EventType, Payload, RetryCount
FROM _System_OutboxEvent e
WHERE
  (e.Status = 'pending'
   OR (e.Status = 'processing' AND e.LastModifiedDate < :stale_cutoff))
  AND (e.Status <> 'pending'
       OR e.RetryCount = 0
       OR e.LastModifiedDate < :retry_cutoff)
  AND (
    e.RecordKey IS NULL
    OR NOT EXISTS (
      SELECT 1
      FROM _System_OutboxEvent older
      WHERE older.RecordKey = e.RecordKey
        AND (
          older.CreatedDate < e.CreatedDate
          OR (older.CreatedDate = e.CreatedDate AND older.Id < e.Id)
        )
        AND older.Status NOT IN ('processed', 'failed')
    )
  )
ORDER BY e.CreatedDate ASC, e.Id ASC
LIMIT :limit;";
    let now = base();
    let first = RawRow::pending(Some("Lead:1"), at(now, -3));
    let second = RawRow::pending(Some("Lead:1"), at(now, -2));
    db.insert_raw(&first).await;
    db.insert_raw(&second).await;
    let stale_cutoff = now - chrono::Duration::from_std(STALE_AFTER).unwrap();
    let retry_cutoff = now - chrono::Duration::from_std(RETRY_DELAY).unwrap();
    let ids: Vec<String> = match &db.db {
        Database::Postgres(_) => {
            let pool = db.pg().unwrap();
            let sql = design
                .replace(":stale_cutoff", "$1")
                .replace(":retry_cutoff", "$2")
                .replace(":limit", "$3");
            let rows: Vec<(uuid::Uuid, String, String, i32)> =
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .bind(stale_cutoff)
                    .bind(retry_cutoff)
                    .bind(10_i64)
                    .fetch_all(pool)
                    .await
                    .unwrap();
            rows.into_iter().map(|r| r.0.to_string()).collect()
        }
        Database::Sqlite(pool) => {
            use outbox_persistence::sqlite::format_ts;
            let rows: Vec<(String, String, String, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(
                design
                    .replace(":stale_cutoff", "?1")
                    .replace(":retry_cutoff", "?2")
                    .replace(":limit", "?3"),
            ))
            .bind(format_ts(stale_cutoff))
            .bind(format_ts(retry_cutoff))
            .bind(10_i64)
            .fetch_all(pool)
            .await
            .unwrap();
            rows.into_iter().map(|r| r.0).collect()
        }
    };
    assert_eq!(ids, vec![first.id.to_string()]);
}

/// Enqueue derives keys, keeps batch order in `Id`, and refuses a bad batch whole.
async fn enqueue_orders_and_validates(db: TestDb) {
    let repo = db.repository();
    let before = base();
    let events: Vec<NewEvent> = (0..200)
        .map(|i| NewEvent::new("lead.updated", lead(&format!("L{}", i % 7))))
        .collect();
    let ids = enqueue(&repo, &events).await;
    assert_eq!(ids.len(), 200);
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "ids increase in enqueue order"
    );
    let stored = repo.get_event(ids[3]).await.unwrap().unwrap();
    assert_eq!(
        stored.record_key.as_ref().map(|k| k.as_str()),
        Some("lead:L3"),
        "the object name's case is folded"
    );
    assert_eq!(stored.status, EventStatus::Pending);
    let drift = (stored.created_date - before).num_milliseconds();
    assert!(
        (-1000..5000).contains(&drift),
        "CreatedDate comes from the database's clock (this host's): {drift} ms"
    );
    // Only the head of each of the 7 keys is eligible, oldest first.
    let eligible = repo
        .get_pending_events(policy(), &Scope::All, 100)
        .await
        .unwrap();
    assert_eq!(
        eligible.iter().map(|e| e.id).collect::<Vec<_>>(),
        ids[..7].to_vec()
    );

    let bad = vec![
        NewEvent::new("lead.updated", lead("ok")),
        NewEvent::new("lead.updated", r#"{"record_id":"no-object"}"#),
    ];
    let mut tx = repo.begin().await.unwrap();
    let err = repo.enqueue(&mut tx, &bad).await.unwrap_err();
    assert!(
        matches!(err, outbox_persistence::Error::InvalidPayload(_)),
        "{err:?}"
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent").await,
        200
    );

    // An event about no record is unordered.
    let ids = enqueue(&repo, &[NewEvent::new("digest", r#"{"kind":"nightly"}"#)]).await;
    assert_eq!(
        repo.get_event(ids[0]).await.unwrap().unwrap().record_key,
        None
    );
}

/// Many concurrent claims of one row from separate connections: exactly one winner.
async fn claim_race_has_one_winner(db: TestDb) {
    let repo = db.repository();
    for round in 0..5 {
        let ids = enqueue(&repo, &[NewEvent::new("t", lead(&format!("race{round}")))]).await;
        let mut tasks = Vec::new();
        for _ in 0..12 {
            let repo = repo.clone();
            let id = ids[0];
            tasks.push(tokio::spawn(async move {
                loop {
                    match repo.claim_event(id, policy()).await {
                        Ok(claim) => return claim,
                        // SQLite may report busy under this contention: try again.
                        Err(e) if e.is_transient() => continue,
                        Err(e) => panic!("claim failed: {e:?}"),
                    }
                }
            }));
        }
        let mut winners = 0;
        for task in tasks {
            if task.await.unwrap().is_some() {
                winners += 1;
            }
        }
        assert_eq!(winners, 1, "round {round}");
    }
}

/// The claims one concurrent task made, each `(id, record key)`.
pub(crate) type TaskClaims =
    tokio::task::JoinHandle<Vec<(uuid::Uuid, Option<outbox_persistence::RecordKey>)>>;

/// The claims concurrent `tasks` made: asserts that no row was claimed
/// twice and no key had two rows in flight; the number of keys claimed.
pub(crate) async fn distinct_claims(tasks: Vec<TaskClaims>) -> usize {
    let mut ids = HashSet::new();
    let mut keys = HashSet::new();
    for task in tasks {
        for (id, key) in task.await.unwrap() {
            assert!(ids.insert(id), "row {id} claimed twice");
            assert!(keys.insert(key.clone()), "two rows of {key:?} in flight");
        }
    }
    keys.len()
}

/// Concurrent `claim_next` callers never share a row and never take two rows of one key.
async fn concurrent_claim_next_respects_keys(db: TestDb) {
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..60)
        .map(|i| NewEvent::new("t", lead(&format!("K{}", i % 20))))
        .collect();
    enqueue(&repo, &events).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let repo = repo.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for _ in 0..10 {
                match repo.claim_next(policy(), &Scope::All).await {
                    Ok(Some(claim)) => mine.push((claim.event.id, claim.event.record_key)),
                    Ok(None) => break,
                    Err(e) if e.is_transient() => continue,
                    Err(e) => panic!("claim_next failed: {e:?}"),
                }
            }
            mine
        }));
    }
    assert_eq!(
        distinct_claims(tasks).await,
        20,
        "one head per key is claimable, and all of them were claimed"
    );
}

/// A lost claim's attempt fails inside its begin's one round trip (the fence check follows
/// `BEGIN` in one string), and its connection goes back to the pool out of the transaction: on
/// a pool of one connection, the next attempts begin, and the holder's attempt writes and
/// commits. A fence a microsecond off is lost: the check compares the exact value.
async fn a_lost_claims_begin_leaves_its_connection_idle(db: TestDb) {
    let config = outbox_persistence::ConnectConfig {
        max_connections: 1,
        ..outbox_persistence::ConnectConfig::default()
    };
    let one = Database::connect(&db.url, config).await.unwrap();
    let repo = one.repository();
    let ids = enqueue(&repo, &[NewEvent::new("t", lead("lost-begin"))]).await;
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    for off in [-1, 1, -1] {
        let lost = Fence {
            id: claim.fence.id,
            last_written: claim.fence.last_written + chrono::TimeDelta::microseconds(off),
        };
        let begun = repo.begin_attempt(secs(5), lost).await.unwrap();
        assert!(begun.is_none(), "a handler never starts on a lost claim");
    }
    let mut attempt = repo
        .begin_attempt(secs(5), claim.fence)
        .await
        .unwrap()
        .expect("the holder's claim holds");
    assert_eq!(
        attempt.mark_processed(claim.fence).await.unwrap(),
        FenceOutcome::Written
    );
    attempt.commit().await.unwrap();
    let row = db.repository().get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.status, EventStatus::Processed);
    one.close().await;
}

/// A live heartbeat keeps a slow claim; a stopped one makes the row reclaimable (its dead
/// attempt counted), and the fenced-out worker can write nothing afterwards.
async fn heartbeat_fences(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(&repo, &[NewEvent::new("t", lead("hb"))]).await;
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claim.event.id, ids[0]);
    assert!(!claim.reclaimed);

    // A heartbeat 25 s after the last write keeps it alive for another 25 s, again and again:
    // 200 s in all, several stale-after periods.
    let mut fence = claim.fence;
    for _ in 0..4 {
        db.clock.advance(secs(25));
        fence = repo
            .heartbeat(fence)
            .await
            .unwrap()
            .beaten()
            .expect("still ours");
        db.clock.advance(secs(25));
        assert!(repo.claim_event(ids[0], policy()).await.unwrap().is_none());
        assert!(
            repo.get_pending_events(policy(), &Scope::All, 10)
                .await
                .unwrap()
                .is_empty()
        );
    }

    // The heartbeat stops; 31 s after the last one another worker reclaims the row, and the
    // dead attempt is counted.
    db.clock.advance(secs(6));
    let eligible = repo
        .get_pending_events(policy(), &Scope::All, 10)
        .await
        .unwrap();
    assert_eq!(eligible.len(), 1);
    let second = repo
        .claim_event(ids[0], policy())
        .await
        .unwrap()
        .expect("reclaimable");
    assert!(second.reclaimed);
    assert_eq!(second.event.retry_count, 1, "the dead attempt is counted");

    // The first worker is fenced out everywhere, the attempt's start included.
    assert_eq!(repo.heartbeat(fence).await.unwrap(), BeatOutcome::Lost);
    assert_eq!(
        repo.update_status(fence, Terminal::Processed, None)
            .await
            .unwrap(),
        FenceOutcome::Lost
    );
    assert_eq!(
        repo.increment_retry(fence, Duration::ZERO, "late")
            .await
            .unwrap(),
        FenceOutcome::Lost
    );
    assert!(
        repo.begin_attempt(Duration::from_secs(5), fence)
            .await
            .unwrap()
            .is_none(),
        "a handler never starts on a lost claim"
    );
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.status, EventStatus::Processing);
    assert_eq!(row.last_modified_date, second.fence.last_written);

    // The new holder's attempt begins, and it finishes normally.
    let mut attempt = repo
        .begin_attempt(Duration::from_secs(5), second.fence)
        .await
        .unwrap()
        .expect("the new holder's claim holds");
    assert_eq!(
        attempt.mark_processed(second.fence).await.unwrap(),
        FenceOutcome::Written
    );
    attempt.commit().await.unwrap();
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.status, EventStatus::Processed);
    assert_eq!(row.retry_count, 1);
}

/// One statement beats a worker's claims together: each claim's own outcome, a row finished
/// elsewhere reported lost, and (PostgreSQL) a row another transaction holds locked skipped at
/// once as busy, without delaying the others' beats.
async fn heartbeat_many_beats_each_claim(db: TestDb) {
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..3)
        .map(|i| NewEvent::new("t", lead(&format!("hbm{i}"))))
        .collect();
    let ids = enqueue(&repo, &events).await;
    let claims = repo.claim_batch(policy(), &Scope::All, 3).await.unwrap();
    assert_eq!(claims.len(), 3);
    let mut fences: Vec<Fence> = ids
        .iter()
        .map(|id| claims.iter().find(|c| c.event.id == *id).unwrap().fence)
        .collect();

    db.clock.advance(secs(25));
    let outcomes = repo.heartbeat_many(fences.clone()).await.unwrap();
    for (i, outcome) in outcomes.iter().enumerate() {
        let BeatOutcome::Beaten(next) = outcome else {
            panic!("claim {i} is still ours: {outcome:?}");
        };
        assert_eq!(next.id, ids[i]);
        assert!(next.last_written > fences[i].last_written);
        let row = repo.get_event(ids[i]).await.unwrap().unwrap();
        assert_eq!(
            row.last_modified_date, next.last_written,
            "the beat is written"
        );
        fences[i] = *next;
    }
    db.clock.advance(secs(25));
    assert!(
        repo.get_pending_events(policy(), &Scope::All, 10)
            .await
            .unwrap()
            .is_empty(),
        "beaten claims are not stale"
    );

    // The third finishes elsewhere (its holder's own write): lost to this beat.
    assert_eq!(
        repo.update_status(fences[2], Terminal::Processed, None)
            .await
            .unwrap(),
        FenceOutcome::Written
    );
    let outcomes = repo.heartbeat_many(fences.clone()).await.unwrap();
    assert!(matches!(outcomes[0], BeatOutcome::Beaten(_)));
    assert!(matches!(outcomes[1], BeatOutcome::Beaten(_)));
    assert_eq!(outcomes[2], BeatOutcome::Lost);
    for (i, outcome) in outcomes.iter().take(2).enumerate() {
        if let BeatOutcome::Beaten(next) = outcome {
            fences[i] = *next;
        }
    }

    let Some(pg) = db.pg() else {
        return;
    };
    // Another transaction holds the second row locked: the beat skips it at once (busy, its
    // fence unchanged) and beats the first.
    let mut locker = pg.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM _System_OutboxEvent WHERE Id = $1 FOR UPDATE")
        .bind(ids[1])
        .execute(&mut *locker)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let outcomes = repo.heartbeat_many(fences[..2].to_vec()).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a locked row is skipped, not waited for"
    );
    assert!(matches!(outcomes[0], BeatOutcome::Beaten(_)));
    assert_eq!(outcomes[1], BeatOutcome::Busy);
    locker.rollback().await.unwrap();
    let outcomes = repo.heartbeat_many(vec![fences[1]]).await.unwrap();
    assert!(
        matches!(outcomes[0], BeatOutcome::Beaten(_)),
        "the fence a busy beat left is still the claim's"
    );
}

/// A batch's settle writes every `processed` in one statement (PostgreSQL; one by one on
/// SQLite): each claim still under its fence is written, a claim finished elsewhere is reported
/// lost and left alone, and each record's head moves past its processed row.
async fn mark_processed_many_writes_each_fenced_claim(db: TestDb) {
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..3)
        .map(|i| NewEvent::new("t", lead(&format!("mpm{i}"))))
        .chain([NewEvent::new("t", lead("mpm0"))])
        .collect();
    let ids = enqueue(&repo, &events).await;
    let claims = repo.claim_batch(policy(), &Scope::All, 3).await.unwrap();
    let fences: Vec<Fence> = ids[..3]
        .iter()
        .map(|id| claims.iter().find(|c| c.event.id == *id).unwrap().fence)
        .collect();
    assert_eq!(claims.len(), 3, "the heads of three records");
    // The third finishes elsewhere (its holder's own write): lost to the settle.
    assert_eq!(
        repo.update_status(fences[2], Terminal::Processed, None)
            .await
            .unwrap(),
        FenceOutcome::Written
    );
    let (mut tx, lost) = repo
        .begin_batch_attempt(secs(5), fences.clone())
        .await
        .unwrap();
    assert_eq!(lost, vec![ids[2]]);
    let outcomes = tx.mark_processed_many(fences.clone()).await.unwrap();
    assert_eq!(
        outcomes,
        vec![
            FenceOutcome::Written,
            FenceOutcome::Written,
            FenceOutcome::Lost
        ]
    );
    tx.commit().await.unwrap();
    for id in &ids[..3] {
        let row = repo.get_event(*id).await.unwrap().unwrap();
        assert_eq!(row.status, EventStatus::Processed, "{id}");
        assert_eq!(row.retry_count, 0, "{id}");
    }
    // The record's next row is its head now, and claimable.
    let next = repo.claim_batch(policy(), &Scope::All, 3).await.unwrap();
    assert_eq!(
        next.iter().map(|c| c.event.id).collect::<Vec<_>>(),
        vec![ids[3]]
    );
}

/// A batch's begin check holds back each member that an older open row of its record outside
/// the batch precedes: a row other code wrote into the middle of a claimed chain holds back the
/// members after it and not the one before, nor another record's members in the same batch;
/// one newer than every member holds back nothing; one older than the whole chain holds back
/// all of its record (issue 36; one probe per record since issue 37).
async fn begin_check_holds_back_the_members_after_a_foreign_row(db: TestDb) {
    let repo = db.repository();
    let (mut mid, mut other) = (Vec::new(), Vec::new());
    for i in 0..3 {
        mid.extend(enqueue(&repo, &[NewEvent::new("t", lead("mid"))]).await);
        if i < 2 {
            other.extend(enqueue(&repo, &[NewEvent::new("t", lead("other"))]).await);
        }
        db.clock.advance(secs(1));
    }
    let claims = repo
        .claim_chains(policy(), &Scope::All, 5, 3)
        .await
        .unwrap();
    assert_eq!(claims.len(), 5, "both records' chains");
    let fences: Vec<Fence> = claims.iter().map(|c| c.fence).collect();
    let first = repo.get_event(mid[0]).await.unwrap().unwrap();
    let second = repo.get_event(mid[1]).await.unwrap().unwrap();
    let last = repo.get_event(mid[2]).await.unwrap().unwrap();
    let key = first.record_key.as_ref().map(|k| k.as_str().to_owned());
    let held_back = |db: &TestDb, fences: Vec<Fence>| {
        let repo = db.repository();
        async move {
            let (mut tx, mut lost) = repo.begin_batch_attempt(secs(5), fences).await.unwrap();
            tx.rollback().await.unwrap();
            lost.sort();
            lost
        }
    };
    let sorted = |mut ids: Vec<uuid::Uuid>| {
        ids.sort();
        ids
    };
    assert!(held_back(&db, fences.clone()).await.is_empty());
    let after_all = last.created_date + chrono::TimeDelta::milliseconds(500);
    db.insert_raw(&RawRow::pending(key.as_deref(), after_all))
        .await;
    assert!(
        held_back(&db, fences.clone()).await.is_empty(),
        "a row newer than every member holds back nothing"
    );
    let between = first.created_date + (second.created_date - first.created_date) / 2;
    assert!(between > first.created_date && between < second.created_date);
    db.insert_raw(&RawRow::pending(key.as_deref(), between))
        .await;
    assert_eq!(
        held_back(&db, fences.clone()).await,
        sorted(vec![mid[1], mid[2]])
    );
    let before = first.created_date - chrono::TimeDelta::seconds(1);
    db.insert_raw(&RawRow::pending(key.as_deref(), before))
        .await;
    assert_eq!(held_back(&db, fences).await, sorted(mid.clone()));
    assert_eq!(other.len(), 2);
}

async fn insert_side_effect(tx: &mut Tx) {
    outbox_persistence::with_tx!(tx, |conn| {
        sqlx::query("INSERT INTO side_effect VALUES (1)")
            .persistent(outbox_tests::persistent())
            .execute(conn)
            .await
            .unwrap();
    });
}

/// Side effects of the attempt roll back to the savepoint; bookkeeping in the same
/// transaction survives; `RetryCount` counts every failure, `failed` included.
async fn attempt_savepoint_and_retry_counting(db: TestDb) {
    let repo = db.repository();
    db.execute("CREATE TABLE side_effect (v INTEGER NOT NULL)")
        .await;
    let ids = enqueue(&repo, &[NewEvent::new("t", lead("sp"))]).await;

    // Attempt 1 fails: effect rolled back, retry recorded.
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    let mut attempt = repo
        .begin_attempt(Duration::from_secs(5), claim.fence)
        .await
        .unwrap()
        .expect("the claim holds");
    insert_side_effect(attempt.tx()).await;
    attempt.rollback_to_savepoint().await.unwrap();
    let bookkeeping = FailureBookkeeping::Retry {
        extra_delay: Duration::from_secs(5),
    };
    assert_eq!(
        attempt
            .record_failure(claim.fence, bookkeeping, "boom")
            .await
            .unwrap(),
        FenceOutcome::Written
    );
    attempt.commit().await.unwrap();
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!((row.status, row.retry_count), (EventStatus::Pending, 1));
    assert_eq!(row.last_error.as_deref(), Some("boom"));
    assert_eq!(db.count("SELECT count(*) FROM side_effect").await, 0);

    // Not eligible before base delay + backoff (10 s + 5 s), eligible after.
    db.clock.advance(secs(14));
    assert!(
        repo.claim_next(policy(), &Scope::All)
            .await
            .unwrap()
            .is_none()
    );
    db.clock.advance(secs(2));
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claim.event.retry_count, 1);

    // Attempt 2 fails permanently: failed, counted.
    let mut attempt = repo
        .begin_attempt(Duration::from_secs(5), claim.fence)
        .await
        .unwrap()
        .expect("the claim holds");
    attempt.rollback_to_savepoint().await.unwrap();
    attempt
        .record_failure(claim.fence, FailureBookkeeping::Fail, "fatal")
        .await
        .unwrap();
    attempt.commit().await.unwrap();
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!((row.status, row.retry_count), (EventStatus::Failed, 2));

    // An operator retry returns it to pending with a fresh count; success commits the effect.
    assert_eq!(repo.retry_failed(RetryFilter::Id(ids[0])).await.unwrap(), 1);
    assert_eq!(repo.retry_failed(RetryFilter::Id(ids[0])).await.unwrap(), 0);
    // A retried row waits a moment before it may be claimed (PostgreSQL's not-before delay).
    db.clock.advance(secs(3));
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    let mut attempt = repo
        .begin_attempt(Duration::from_secs(5), claim.fence)
        .await
        .unwrap()
        .expect("the claim holds");
    insert_side_effect(attempt.tx()).await;
    assert_eq!(
        attempt.mark_processed(claim.fence).await.unwrap(),
        FenceOutcome::Written
    );
    attempt.commit().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM side_effect").await, 1);
    assert_eq!(
        repo.get_event(ids[0]).await.unwrap().unwrap().status,
        EventStatus::Processed
    );

    // Detached bookkeeping counts too.
    let ids = enqueue(&repo, &[NewEvent::new("t", lead("detached"))]).await;
    let claim = repo.claim_event(ids[0], policy()).await.unwrap().unwrap();
    repo.increment_retry(claim.fence, Duration::ZERO, "lost connection")
        .await
        .unwrap();
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!((row.status, row.retry_count), (EventStatus::Pending, 1));
}

/// Backfill derives exactly what enqueue derives, is resumable and idempotent, and reports what
/// it cannot derive instead of guessing.
async fn backfill_matches_enqueue(db: TestDb) {
    let repo = db.repository();
    let now = base();
    let enqueued = enqueue(&repo, &[NewEvent::new("t", lead("B1"))]).await;
    let expected_key = repo
        .get_event(enqueued[0])
        .await
        .unwrap()
        .unwrap()
        .record_key;
    // Make it a legacy row: same payload, no key.
    let legacy = RawRow {
        payload: lead("B1"),
        ..RawRow::pending(None, at(now, 1))
    };
    let no_record = RawRow {
        payload: r#"{"kind":"digest"}"#.into(),
        ..RawRow::pending(None, at(now, 2))
    };
    let broken = RawRow {
        payload: r#"{"record_id":"x"}"#.into(),
        ..RawRow::pending(None, at(now, 3))
    };
    let not_json = RawRow {
        payload: "{oops".into(),
        ..RawRow::pending(None, at(now, 4))
    };
    let done = RawRow {
        payload: lead("B9"),
        status: "processed",
        ..RawRow::pending(None, at(now, 5))
    };
    for r in [&legacy, &no_record, &broken, &not_json, &done] {
        db.insert_raw(r).await;
    }
    let mut after = None;
    let mut total = outbox_persistence::BackfillPage::default();
    let mut pages = 0;
    loop {
        let page = repo.backfill_record_keys(after, 2, false).await.unwrap();
        pages += 1;
        total.scanned += page.scanned;
        total.updated += page.updated;
        total.already_set += page.already_set;
        total.no_record += page.no_record;
        total.underivable.extend(page.underivable);
        after = page.next_after;
        if after.is_none() {
            break;
        }
    }
    assert!(pages >= 3, "resumable in pages");
    assert_eq!(total.scanned, 5, "terminal rows are not scanned");
    assert_eq!(total.updated, 1);
    assert_eq!(total.already_set, 1);
    assert_eq!(total.no_record, 1);
    let mut underivable: Vec<_> = total.underivable.iter().map(|(id, _)| *id).collect();
    underivable.sort();
    let mut expected_bad = vec![broken.id, not_json.id];
    expected_bad.sort();
    assert_eq!(underivable, expected_bad);
    assert_eq!(
        repo.get_event(legacy.id).await.unwrap().unwrap().record_key,
        expected_key
    );
    assert_eq!(
        repo.get_event(broken.id).await.unwrap().unwrap().record_key,
        None
    );
    // Idempotent: a second run changes nothing.
    let again = repo.backfill_record_keys(None, 100, false).await.unwrap();
    assert_eq!(again.updated, 0);
    assert_eq!(again.already_set, 2);
}

/// `stats` counts statuses, stale claims, retries and blocked keys.
async fn stats_reports_the_queue(db: TestDb) {
    let repo = db.repository();
    // `now` is the time after `STALE_AFTER` has been let pass; the running claim is written
    // after that (see eligibility_truth_table).
    let now = base() + chrono::Duration::from_std(STALE_AFTER).unwrap();
    let running = RawRow {
        status: "processing",
        last_modified: at(now, -1),
        ..RawRow::pending(Some("Lead:run"), at(now, -50))
    };
    let rows = [
        RawRow::pending(Some("Lead:run"), at(now, -49)),
        RawRow {
            status: "processing",
            last_modified: at(now, -100),
            ..RawRow::pending(Some("Lead:stale"), at(now, -48))
        },
        RawRow::pending(Some("Lead:stale"), at(now, -47)),
        RawRow {
            retry_count: 1,
            last_modified: at(now, -2),
            ..RawRow::pending(Some("Lead:retry"), at(now, -46))
        },
        RawRow::pending(Some("Lead:retry"), at(now, -45)),
        RawRow {
            status: "failed",
            ..RawRow::pending(None, at(now, -44))
        },
        RawRow {
            status: "processed",
            ..RawRow::pending(None, at(now, -43))
        },
    ];
    for r in &rows {
        db.insert_raw(r).await;
    }
    let_stale_after_pass(&db, &repo).await;
    db.insert_raw(&running).await;
    let stats = repo.stats(policy()).await.unwrap();
    assert_eq!(
        (
            stats.pending,
            stats.processing,
            stats.processed,
            stats.failed
        ),
        (4, 2, 1, 1)
    );
    assert_eq!(stats.stale_claims, 1);
    assert_eq!(stats.retrying, 1);
    assert_eq!(stats.keys_blocked_by_running, 1);
    assert_eq!(stats.keys_blocked_by_stale, 1);
    assert_eq!(stats.keys_blocked_by_retry, 1);
    let age = stats.oldest_pending_age_seconds.unwrap();
    assert!((48.5..50.0).contains(&age), "oldest pending age {age}");
}

/// A scope narrows the event types a dispatcher takes, but the ordering rule still sees every
/// type: an excluded older row blocks its key on both paths.
async fn scope_narrows_types_but_not_order(db: TestDb) {
    let repo = db.repository();
    let now = base();
    let older = RawRow {
        event_type: "mail.send".into(),
        ..RawRow::pending(Some("Lead:s"), at(now, -2))
    };
    let younger = RawRow {
        event_type: "lead.updated".into(),
        ..RawRow::pending(Some("Lead:s"), at(now, -1))
    };
    let other = RawRow {
        event_type: "lead.updated".into(),
        ..RawRow::pending(Some("Lead:t"), at(now, 0))
    };
    for r in [&older, &younger, &other] {
        db.insert_raw(r).await;
    }
    let pull = Scope::Except(vec!["mail.send".into()]);
    let legacy = Scope::Only(vec!["mail.send".into()]);
    let ids =
        |v: Vec<outbox_persistence::OutboxEvent>| v.into_iter().map(|e| e.id).collect::<Vec<_>>();
    assert_eq!(
        ids(repo.get_pending_events(policy(), &pull, 10).await.unwrap()),
        vec![other.id]
    );
    assert_eq!(
        ids(repo
            .get_pending_events(policy(), &legacy, 10)
            .await
            .unwrap()),
        vec![older.id]
    );
    let claim = repo.claim_next(policy(), &pull).await.unwrap().unwrap();
    assert_eq!(claim.event.id, other.id);
    assert!(
        repo.claim_next(policy(), &pull).await.unwrap().is_none(),
        "the excluded head blocks its key"
    );
    let claim = repo.claim_next(policy(), &legacy).await.unwrap().unwrap();
    assert_eq!(claim.event.id, older.id);
    repo.update_status(claim.fence, Terminal::Processed, None)
        .await
        .unwrap();
    let claim = repo.claim_next(policy(), &pull).await.unwrap().unwrap();
    assert_eq!(claim.event.id, younger.id);
}

/// A blocked key whose backlog fills the oldest rows (more than the PostgreSQL claim inspects
/// before generating candidates per key) does not hide younger keys' heads or unkeyed rows, nor
/// change their order; once its head goes stale, the head is taken first.
async fn hot_key_backlog_does_not_hide_other_heads(db: TestDb) {
    let repo = db.repository();
    let now = base();
    let mut t = at(now, -2000);
    let mut next = || {
        t += chrono::Duration::seconds(1);
        t
    };
    let head = RawRow {
        status: "processing",
        last_modified: at(now, -1),
        ..RawRow::pending(Some("Lead:hot"), next())
    };
    db.insert_raw(&head).await;
    for _ in 0..150 {
        db.insert_raw(&RawRow::pending(Some("Lead:hot"), next()))
            .await;
    }
    // Interleaved younger rows: each other key has two rows, and the unkeyed rows have no order
    // constraint of their own.
    let mut expected = Vec::new();
    let mut seconds = Vec::new();
    for i in 0..5 {
        let first = RawRow::pending(Some(&format!("Lead:k{i}")), next());
        let unkeyed = RawRow::pending(None, next());
        let second = RawRow::pending(Some(&format!("Lead:k{i}")), next());
        db.insert_raw(&first).await;
        db.insert_raw(&unkeyed).await;
        db.insert_raw(&second).await;
        expected.push(first.id);
        expected.push(unkeyed.id);
        seconds.push(second.id);
    }
    let mut claimed = Vec::new();
    while let Some(claim) = repo.claim_next(policy(), &Scope::All).await.unwrap() {
        assert_ne!(
            claim.event.record_key.as_ref().map(|k| k.as_str()),
            Some("lead:hot"),
            "stored with the object's case folded (the schema's trigger)"
        );
        claimed.push(claim.event.id);
    }
    assert_eq!(
        claimed, expected,
        "each key's head and the unkeyed rows, oldest first"
    );
    // The hot key's head goes stale: it is reclaimed before anything else.
    db.clock.advance(secs(60));
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claim.event.id, head.id);
    assert!(claim.reclaimed);
    assert!(!seconds.contains(&claim.event.id));
}

/// A failure whose text holds a NUL byte (echoing payload data) is still recorded: PostgreSQL
/// text cannot hold NUL, and an unrecordable failure would loop forever.
async fn error_text_with_nul_is_recorded(db: TestDb) {
    let repo = db.repository();
    enqueue(&repo, &[NewEvent::new("t", lead("nul"))]).await;
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    let outcome = repo
        .increment_retry(claim.fence, Duration::ZERO, "bad byte: \0 in the payload")
        .await
        .unwrap();
    assert_eq!(outcome, FenceOutcome::Written);
    let row = repo.get_event(claim.event.id).await.unwrap().unwrap();
    assert_eq!(
        row.last_error.as_deref(),
        Some("bad byte: \u{FFFD} in the payload")
    );
    assert!(
        row.last_modified_date > claim.fence.last_written,
        "the fence moved forward"
    );
}

/// A `RecordKey` that other code wrote and that `RecordKey::new` would refuse (a record id with
/// surrounding white space, no object, an object name that is no identifier) is read back
/// exactly as stored, and orders its rows like any key: no read or claim fails on it. (The
/// schema's trigger folds the object part's case of a foreign key as it is written, so the
/// stored text is what counts.)
async fn foreign_record_keys_are_read_and_ordered(db: TestDb) {
    let repo = db.repository();
    let now = base();
    let foreign = ["lead: padded ", "  spaced key ", "9obj:1"];
    let mut heads = Vec::new();
    let mut seconds = Vec::new();
    for (i, key) in foreign.iter().enumerate() {
        let first = RawRow::pending(Some(key), at(now, -20 + 2 * i as i64));
        let second = RawRow::pending(Some(key), at(now, -19 + 2 * i as i64));
        db.insert_raw(&first).await;
        db.insert_raw(&second).await;
        heads.push(first.id);
        seconds.push(second.id);
    }
    let stored = repo.get_event(heads[0]).await.unwrap().unwrap();
    assert_eq!(
        stored.record_key.as_ref().map(|k| k.as_str()),
        Some("lead: padded ")
    );
    let listed = repo
        .list_events(EventFilter::new().record_key("  spaced key "))
        .await
        .unwrap();
    assert_eq!(
        listed.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![heads[1], seconds[1]]
    );
    assert_eq!(
        listed[0].record_key.as_ref().map(|k| k.as_str()),
        Some("  spaced key ")
    );
    let eligible: Vec<_> = repo
        .get_pending_events(policy(), &Scope::All, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(eligible, heads, "only each foreign key's head is eligible");
    let mut claims = Vec::new();
    while let Some(claim) = repo.claim_next(policy(), &Scope::All).await.unwrap() {
        let key = claim
            .event
            .record_key
            .as_ref()
            .map(|k| k.as_str().to_owned());
        claims.push((claim, key));
    }
    assert_eq!(
        claims.iter().map(|(c, _)| c.event.id).collect::<Vec<_>>(),
        heads,
        "a running head blocks its foreign key"
    );
    for ((claim, key), expected) in claims.iter().zip(foreign) {
        assert_eq!(key.as_deref(), Some(expected));
        repo.update_status(claim.fence, Terminal::Processed, None)
            .await
            .unwrap();
    }
    let claim = repo
        .claim_event(seconds[0], policy())
        .await
        .unwrap()
        .expect("the next row of a foreign key once its head is done");
    assert_eq!(
        claim.event.record_key.as_ref().map(|k| k.as_str()),
        Some("lead: padded ")
    );
}

/// `list_events` filters by status, type, id and key, keeps `CreatedDate, Id` order, limits,
/// and never carries a payload.
async fn list_events_filters_and_orders(db: TestDb) {
    let repo = db.repository();
    let now = base();
    let row = |key: Option<&str>, event_type: &str, status: &'static str, secs: i64| RawRow {
        event_type: event_type.into(),
        status,
        payload: r#"{"secret":"do-not-list"}"#.into(),
        ..RawRow::pending(key, at(now, secs))
    };
    let a = row(Some("lead:1"), "lead.updated", "pending", -5);
    let b = row(Some("lead:1"), "lead.updated", "failed", -4);
    let c = row(None, "mail.send", "processed", -3);
    let mut d = row(Some("lead:2"), "mail.send", "pending", -2);
    let mut e = row(Some("lead:2"), "lead.updated", "pending", -2);
    if d.id > e.id {
        std::mem::swap(&mut d.id, &mut e.id);
    }
    for r in [&e, &c, &a, &d, &b] {
        db.insert_raw(r).await;
    }
    let ids = |rows: Vec<EventRow>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    let list = |f: EventFilter| {
        let repo = repo.clone();
        async move { ids(repo.list_events(f).await.unwrap()) }
    };
    assert_eq!(
        list(EventFilter::new()).await,
        vec![a.id, b.id, c.id, d.id, e.id],
        "CreatedDate, then Id"
    );
    assert_eq!(list(EventFilter::new().limit(2)).await, vec![a.id, b.id]);
    assert_eq!(
        list(EventFilter::new().statuses([EventStatus::Failed, EventStatus::Processed])).await,
        vec![b.id, c.id]
    );
    assert_eq!(
        list(EventFilter::new().event_type("mail.send")).await,
        vec![c.id, d.id]
    );
    assert_eq!(
        list(EventFilter::new().ids([e.id, a.id, uuid::Uuid::now_v7()])).await,
        vec![a.id, e.id]
    );
    assert_eq!(
        list(EventFilter::new().record_key("lead:2")).await,
        vec![d.id, e.id]
    );
    assert_eq!(
        list(
            EventFilter::new()
                .record_key("lead:1")
                .statuses([EventStatus::Pending])
                .event_type("lead.updated")
        )
        .await,
        vec![a.id]
    );
    assert!(
        list(EventFilter::new().event_type("nothing"))
            .await
            .is_empty()
    );
    let rows = repo
        .list_events(EventFilter::new().ids([b.id]))
        .await
        .unwrap();
    assert_eq!(
        (rows[0].status, rows[0].retry_count, rows[0].created_date),
        (EventStatus::Failed, 0, b.created)
    );
    let json = serde_json::to_string(&rows).unwrap();
    assert!(!json.contains("do-not-list"), "{json}");
}

/// `list_events` reports `LastModifiedDate` exactly as stored: the fence a claim holds, the
/// same JSON text on every poll of an unchanged row, a different one after a heartbeat, and
/// text that parses back to the same value.
async fn listed_timestamps_round_trip_exactly(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(&repo, &[NewEvent::new("t", lead("rt"))]).await;
    let claim = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    let poll = || {
        let repo = repo.clone();
        let ids = ids.clone();
        async move {
            let rows = repo.list_events(EventFilter::new().ids(ids)).await.unwrap();
            assert_eq!(rows.len(), 1);
            rows.into_iter().next().unwrap()
        }
    };
    let first = poll().await;
    assert_eq!(first.last_modified_date, claim.fence.last_written);
    assert_eq!(first.status, EventStatus::Processing);
    let text = serde_json::to_value(&first).unwrap();
    let again = serde_json::to_value(poll().await).unwrap();
    assert_eq!(text, again, "an unchanged row prints the same text");
    let back: EventRow = serde_json::from_value(text.clone()).unwrap();
    assert_eq!(back, first, "the JSON parses back to the same row");
    let event = repo.get_event(first.id).await.unwrap().unwrap();
    assert_eq!(
        EventRow::from(event),
        first,
        "list_events and get_event agree"
    );

    db.clock.advance(secs(1));
    let fence = repo
        .heartbeat(claim.fence)
        .await
        .unwrap()
        .beaten()
        .expect("ours");
    let beaten = poll().await;
    assert_eq!(beaten.last_modified_date, fence.last_written);
    assert_ne!(
        serde_json::to_value(&beaten).unwrap()["last_modified_date"],
        text["last_modified_date"],
        "a heartbeat shows in the listing"
    );
}

/// Migrating twice is a no-op, and the schema check passes on a migrated database.
async fn migrations_are_idempotent(db: TestDb) {
    db.db.migrate().await.unwrap();
    db.db.check_schema().await.unwrap();
}

backend_tests!(
    with_pgbouncer: eligibility_truth_table,
    design_query_runs_unchanged,
    enqueue_orders_and_validates,
    claim_race_has_one_winner,
    concurrent_claim_next_respects_keys,
    heartbeat_fences,
    a_lost_claims_begin_leaves_its_connection_idle,
    heartbeat_many_beats_each_claim,
    mark_processed_many_writes_each_fenced_claim,
    begin_check_holds_back_the_members_after_a_foreign_row,
    attempt_savepoint_and_retry_counting,
    backfill_matches_enqueue,
    stats_reports_the_queue,
    migrations_are_idempotent,
    scope_narrows_types_but_not_order,
    error_text_with_nul_is_recorded,
    hot_key_backlog_does_not_hide_other_heads,
    foreign_record_keys_are_read_and_ordered,
    list_events_filters_and_orders,
    listed_timestamps_round_trip_exactly,
);
