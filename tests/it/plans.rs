//! The claim's plan does not depend on when it was planned (PostgreSQL). A connection that
//! claimed while the queue was empty and analyzed holds cached plans built for a one-page
//! table; when the backlog then grows (a bulk import into a fresh deployment) and no ANALYZE
//! has run yet, a plan cached for a client-prepared statement keeps its sequential scans, so
//! every claim reads the whole table. `claim_next` and `claim_batch` run inside
//! `_System_OutboxClaimBatch` (migration 0008; `_System_OutboxClaimNext` of 0006 before it),
//! whose settings leave only the index plan: on that connection, after the
//! growth, the claim must read the outbox and its heads without one sequential scan (counted by
//! `pg_stat_xact_user_tables`), while a statement prepared the ordinary way on the same
//! connection, the control, does scan, which shows that the check can fail.

use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::postgres::PgOutbox;
use outbox_persistence::sqlx::PgPool;
use outbox_persistence::sqlx::postgres::PgPoolOptions;
use outbox_persistence::{
    BeatOutcome, ClaimPolicy, FailureBookkeeping, Fence, FenceOutcome, NewEvent, OutboxRepository,
    Scope,
};
use outbox_tests::TestDb;
use sqlx::{Connection as _, PgConnection};

use crate::repository::{enqueue, lead};

/// A claim of `$1` rows: batches of one and of eight share the function's cached plan.
pub(crate) const CLAIM: &str = "SELECT Id FROM _System_OutboxClaimBatch('0', '30 seconds', '10 seconds', 5, NULL, NULL, $1, '5000ms')";

/// An ordinary client-prepared read over the same tables: the candidates' walk and its join.
const CONTROL: &str = "\
SELECT e.Id
FROM _System_OutboxHead h
JOIN _System_OutboxEvent e ON e.Id = h.Id
WHERE e.Status = 'pending'
ORDER BY h.CreatedDate, h.Id
LIMIT 1";

/// The outbox and its heads analyzed as they are now (small), with autovacuum off: no ANALYZE
/// may invalidate the cached plans between the growth and the checks.
async fn statistics_of_a_small_table(db: &TestDb) {
    for table in ["_System_OutboxEvent", "_System_OutboxHead"] {
        db.execute(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .await;
        db.execute(&format!("VACUUM ANALYZE {table}")).await;
    }
}

/// Sequential scans of the outbox table and its heads counted by this backend and not yet
/// flushed to the shared statistics.
async fn seq_scans(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(seq_scan), 0)::bigint FROM pg_stat_xact_user_tables
         WHERE relname IN ('_system_outboxevent', '_system_outboxhead')",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn postgres_a_claim_planned_on_an_empty_queue_uses_the_indexes_after_it_grows() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    // No autovacuum ANALYZE may invalidate the cached plans between the growth and the checks.
    statistics_of_a_small_table(&db).await;

    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    for i in 0..8 {
        let claimed: Vec<uuid::Uuid> = sqlx::query_scalar(CLAIM)
            .bind(if i % 2 == 0 { 1 } else { 8 })
            .fetch_all(&mut conn)
            .await
            .unwrap();
        assert!(claimed.is_empty(), "the queue is empty");
        let read: Option<uuid::Uuid> = sqlx::query_scalar(CONTROL)
            .fetch_optional(&mut conn)
            .await
            .unwrap();
        assert_eq!(read, None);
    }

    db.execute(
        "INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'bench', '{}', 'pending', 0, 'lead:r' || (i % 500),
                clock_timestamp() - interval '1 hour' + i * interval '1 microsecond',
                clock_timestamp() - interval '1 hour'
         FROM generate_series(1, 20000) i",
    )
    .await;

    // The view also holds counts of this backend's earlier transactions that are not yet
    // flushed to the shared statistics: compare before and after.
    let mut tx = conn.begin().await.unwrap();
    let before = seq_scans(&mut tx).await;
    for i in 0..5 {
        let want = if i % 2 == 0 { 1 } else { 8 };
        let claimed: Vec<uuid::Uuid> = sqlx::query_scalar(CLAIM)
            .bind(want)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        assert_eq!(
            claimed.len(),
            want as usize,
            "heads of the grown backlog are claimed"
        );
    }
    let after_claims = seq_scans(&mut tx).await;
    assert_eq!(
        after_claims - before,
        0,
        "the claim read the grown outbox with a sequential scan: its plan was cached for the empty table"
    );
    let read: Option<uuid::Uuid> = sqlx::query_scalar(CONTROL)
        .fetch_optional(&mut *tx)
        .await
        .unwrap();
    assert!(read.is_some());
    assert!(
        seq_scans(&mut tx).await > after_claims,
        "control: a statement prepared on the empty table should keep its sequential scans"
    );
    tx.rollback().await.unwrap();
}

/// Issue 37, "plans that hold": every statement the attempt's path sends (the claim and its
/// chains, the heartbeats, the fence checks, the settles, the give-backs, and the heads
/// triggers they fire) keeps an index plan when the table grows after the statements were
/// prepared. A repository on one connection runs six rounds of that path on a small table
/// (autovacuum off, so no ANALYZE invalidates a plan), the table then grows by 25,000 rows
/// (20,000 processed, 5,000 pending and due in an hour, each on a record of its own), and one
/// more round must read fewer outbox rows by sequential scan than the table holds (today: none;
/// with the statements prepared by the client, one round read 260,273). The control, a
/// client-prepared one-row read planned on the same connection before the growth, reads the
/// whole table.
#[tokio::test]
async fn postgres_the_attempt_path_planned_on_a_small_table_uses_the_indexes_after_it_grows() {
    // The control holds only while the connection keeps its cached plans: a reset of the
    // server's shared invalidation queue (other tests' databases migrating under load) replans
    // every statement, and the control with it. Its read then shows that the round proved
    // nothing either, so the round is run again on a fresh database (at most three times).
    for _ in 0..3 {
        let Some(db) = TestDb::postgres().await else {
            return;
        };
        // `pg_stat_force_next_flush` is PostgreSQL 15's; a pooler would move the connection.
        let version = db
            .count("SELECT current_setting('server_version_num')::bigint")
            .await;
        if db.behind_pooler() || version < 150_000 {
            return;
        }
        if attempt_path_after_growth(&db).await >= 20_000 {
            return;
        }
    }
    panic!("control: a statement prepared on the small table should keep its sequential scan");
}

/// One run of the test above: asserts the round's reads and returns the control's.
async fn attempt_path_after_growth(db: &TestDb) -> i64 {
    statistics_of_a_small_table(db).await;
    let one = one_connection(db).await;
    let repo: Arc<dyn OutboxRepository> = Arc::new(PgOutbox::new(one.clone()));
    let control = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Id = $1 AND Status = 'processing'",
        )
        .bind(uuid::Uuid::nil())
        .fetch_one(&one)
        .await
        .unwrap()
    };
    for round in 0..6 {
        attempt_path_round(&repo, round).await;
        assert_eq!(control().await, 0);
    }
    sqlx::query(GROW).execute(&one).await.unwrap();
    let before = outbox_rows_scanned(db, &one).await;
    attempt_path_round(&repo, 6).await;
    let after = outbox_rows_scanned(db, &one).await;
    assert!(
        after - before < 1_000,
        "one round of the attempt path read {} outbox rows by sequential scan: a plan made on the small table was kept",
        after - before
    );
    assert_eq!(control().await, 0);
    let control_read = outbox_rows_scanned(db, &one).await - after;
    one.close().await;
    control_read
}

/// The growth: 20,000 processed rows over 500 records and 5,000 pending rows, each on a record
/// of its own, due in an hour (so no round claims them, and the heads table grows too).
const GROW: &str = "\
INSERT INTO _System_OutboxEvent
  (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
SELECT gen_random_uuid(), 'grown', '{}', CASE WHEN i <= 20000 THEN 'processed' ELSE 'pending' END,
       0, CASE WHEN i <= 20000 THEN 'lead:g' || (i % 500) ELSE 'lead:later' || i END,
       clock_timestamp() + interval '1 hour' + i * interval '1 microsecond',
       clock_timestamp() + interval '1 hour'
FROM generate_series(1, 25000) i";

/// A count read from the shared statistics (`sql`), with `conn`'s counts flushed to them first
/// (`pg_stat_force_next_flush`: flushed before the call's reply is sent).
pub(crate) async fn flushed_count(db: &TestDb, conn: &PgPool, sql: &str) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(conn)
        .await
        .unwrap();
    db.count(sql).await
}

/// A pool of one connection to `db`: every statement of a test on one backend, so that its
/// cached plans and its statistics counts are the ones read.
pub(crate) async fn one_connection(db: &TestDb) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.pg().unwrap().connect_options().as_ref().clone())
        .await
        .unwrap()
}

/// The outbox rows read by sequential scans so far (`conn`'s counts flushed).
async fn outbox_rows_scanned(db: &TestDb, conn: &PgPool) -> i64 {
    flushed_count(
        db,
        conn,
        "SELECT coalesce(sum(seq_tup_read), 0)::bigint FROM pg_stat_user_tables
         WHERE relname = '_system_outboxevent'",
    )
    .await
}

/// One round of the attempt's path on records of their own (`round` names them): two records
/// of three rows and two unkeyed rows claimed with chains, beaten together and alone, a chain's
/// batch settled (two `processed`, one `failed`), single attempts (`processed`, a retry due in
/// an hour, a give-back in the batch's attempt), the detached retry and release, a reclaim.
async fn attempt_path_round(repo: &Arc<dyn OutboxRepository>, round: u32) {
    let (ids, claims) = claim_round(repo, round).await;
    let f = beat_round(repo, round, &ids, &claims).await;
    settle_round(repo, &f).await;
    reclaim_round(repo, &f).await;
}

/// The claims of [`attempt_path_round`]: its rows' ids in enqueue order, and their fences.
pub(crate) async fn claim_round(
    repo: &Arc<dyn OutboxRepository>,
    round: u32,
) -> (Vec<uuid::Uuid>, Vec<Fence>) {
    let unkeyed = r#"{"kind":"unkeyed"}"#;
    let mut events = Vec::new();
    for record in ["a", "b"] {
        for _ in 0..3 {
            events.push(NewEvent::new("t", lead(&format!("p{round}{record}"))));
        }
    }
    events.push(NewEvent::new("t", unkeyed));
    events.push(NewEvent::new("t", unkeyed));
    let ids = enqueue(repo, &events).await;
    let policy = ClaimPolicy::new(Duration::from_secs(30), Duration::from_secs(10), 5);
    let claims = repo.claim_chains(policy, &Scope::All, 8, 2).await.unwrap();
    assert_eq!(claims.len(), 8, "round {round}: every row is claimed");
    (ids, claims.iter().map(|c| c.fence).collect())
}

/// The beats of [`attempt_path_round`], together and alone: the fences in enqueue order.
pub(crate) async fn beat_round(
    repo: &Arc<dyn OutboxRepository>,
    round: u32,
    ids: &[uuid::Uuid],
    fences: &[Fence],
) -> Vec<Fence> {
    let fences = fences.to_vec();
    let fence = |outcomes: Vec<BeatOutcome>| -> Vec<Fence> {
        outcomes
            .into_iter()
            .map(|o| match o {
                BeatOutcome::Beaten(f) => f,
                other => panic!("round {round}: a beat was {other:?}"),
            })
            .collect()
    };
    let mut beaten = fence(repo.heartbeat_many(fences).await.unwrap());
    let by_id = |fences: &[Fence], id: uuid::Uuid| *fences.iter().find(|f| f.id == id).unwrap();
    let first = by_id(&beaten, ids[0]);
    let single = fence(vec![repo.heartbeat(first).await.unwrap()])[0];
    beaten.retain(|f| f.id != single.id);
    beaten.push(single);
    ids.iter().map(|id| by_id(&beaten, *id)).collect()
}

/// The settles of [`attempt_path_round`] over its fences, in its enqueue order.
pub(crate) async fn settle_round(repo: &Arc<dyn OutboxRepository>, f: &[Fence]) {
    let lock = Duration::from_secs(5);
    let (mut batch, lost) = repo
        .begin_batch_attempt(lock, [&f[0..3], &f[6..8]].concat())
        .await
        .unwrap();
    assert!(lost.is_empty());
    let written = batch.mark_processed_chains(f[0..2].to_vec()).await.unwrap();
    assert_eq!(written, vec![FenceOutcome::Written; 2]);
    batch.savepoint().await.unwrap();
    let failed = batch
        .record_failure(f[2], FailureBookkeeping::Fail, "poison")
        .await
        .unwrap();
    assert_eq!(failed, FenceOutcome::Written);
    batch.savepoint().await.unwrap();
    assert_eq!(
        batch.mark_processed_many(vec![f[6]]).await.unwrap(),
        vec![FenceOutcome::Written]
    );
    assert_eq!(
        batch.release(f[7], "given back").await.unwrap(),
        FenceOutcome::Written
    );
    batch.commit().await.unwrap();

    let mut single = repo.begin_attempt(lock, f[3]).await.unwrap().unwrap();
    assert_eq!(
        single.mark_processed(f[3]).await.unwrap(),
        FenceOutcome::Written
    );
    single.commit().await.unwrap();
    // Due in an hour: no later round claims it, and it holds the record's last row back.
    let retry = repo
        .increment_retry(f[4], Duration::from_secs(3600), "later")
        .await
        .unwrap();
    assert_eq!(retry, FenceOutcome::Written);
    assert_eq!(
        repo.release_claims(vec![f[5]], "unrun").await.unwrap(),
        vec![FenceOutcome::Written]
    );
}

/// The reclaims that end [`attempt_path_round`].
pub(crate) async fn reclaim_round(repo: &Arc<dyn OutboxRepository>, f: &[Fence]) {
    let lock = Duration::from_secs(5);
    // The unkeyed row given back in the batch is the only one eligible: claimed and settled.
    let policy = ClaimPolicy::new(Duration::from_secs(30), Duration::from_secs(10), 5);
    let again = repo.claim_next(policy, &Scope::All).await.unwrap().unwrap();
    assert_eq!(again.event.id, f[7].id);
    assert_eq!(
        repo.release_claim(again.fence, "once more").await.unwrap(),
        FenceOutcome::Written
    );
    let last = repo.claim_next(policy, &Scope::All).await.unwrap().unwrap();
    let mut single = repo.begin_attempt(lock, last.fence).await.unwrap().unwrap();
    let outcome = single
        .record_failure(last.fence, FailureBookkeeping::Fail, "done")
        .await
        .unwrap();
    assert_eq!(outcome, FenceOutcome::Written);
    single.commit().await.unwrap();
}

/// Rows in `processing` on records of their own, fresh (no reclaim takes them): the in-flight
/// rows of other workers beside the round.
const IN_FLIGHT: &str = "\
INSERT INTO _System_OutboxEvent
  (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
SELECT gen_random_uuid(), 'busy', '{}', 'processing', 0, 'lead:busy' || i,
       clock_timestamp() - interval '1 hour' + i * interval '1 microsecond', clock_timestamp()
FROM generate_series(1, 2000) i";

/// Index entries of the partial index on in-flight rows read so far (`conn`'s counts flushed).
async fn in_flight_entries_read(db: &TestDb, conn: &PgPool) -> i64 {
    flushed_count(
        db,
        conn,
        "SELECT coalesce(sum(idx_tup_read), 0)::bigint FROM pg_stat_user_indexes
         WHERE indexrelname = 'outbox_in_flight_idx'",
    )
    .await
}

/// The attempt's fenced statements (beats, fence checks, settles, releases) reach a claimed row
/// by its id, however many rows are in flight and whatever the statistics said when they were
/// planned. Planned while the statistics counted no row in `processing`, they used to walk the
/// whole partial index on in-flight rows and filter by id (migration 0014): with 2,000 other
/// rows in flight, one round read 2,000 entries per statement. The round's beats and settles
/// (its claims are made before the other rows go in flight) must now read fewer than 100 of
/// that index's entries. The control, the
/// same fence check with `Status` compared as before under the functions' settings, planned on
/// the same connection, walks it.
#[tokio::test]
async fn postgres_the_fenced_statements_reach_a_claim_by_its_id_however_many_are_in_flight() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let version = db
        .count("SELECT current_setting('server_version_num')::bigint")
        .await;
    if db.behind_pooler() || version < 150_000 {
        return;
    }
    statistics_of_a_small_table(&db).await;
    let one = PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::raw_sql(
                    "SET enable_seqscan = off; SET enable_bitmapscan = off;
                     SET plan_cache_mode = force_generic_plan;",
                )
                .execute(conn)
                .await
                .map(|_| ())
            })
        })
        .connect_with(db.pg().unwrap().connect_options().as_ref().clone())
        .await
        .unwrap();
    let repo: Arc<dyn OutboxRepository> = Arc::new(PgOutbox::new(one.clone()));
    let control = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM _System_OutboxEvent
             WHERE Id = $1 AND Status = 'processing' AND LastModifiedDate = $2",
        )
        .bind(uuid::Uuid::nil())
        .bind(chrono::Utc::now())
        .fetch_one(&one)
        .await
        .unwrap()
    };
    for round in 0..6 {
        attempt_path_round(&repo, round).await;
        assert_eq!(control().await, 0);
    }
    // Claimed before the other rows go in flight: the claim's own probes of the index are not
    // the fenced statements' (docs/benchmarks.md, "Open gaps", on the claim's plan).
    let (ids, claims) = claim_round(&repo, 6).await;
    sqlx::query(IN_FLIGHT).execute(&one).await.unwrap();
    let before = in_flight_entries_read(&db, &one).await;
    let f = beat_round(&repo, 6, &ids, &claims).await;
    settle_round(&repo, &f).await;
    let after = in_flight_entries_read(&db, &one).await;
    reclaim_round(&repo, &f).await;
    assert!(
        after - before < 100,
        "one round of the attempt path read {} entries of the in-flight index: a fenced statement walked it",
        after - before
    );
    assert_eq!(control().await, 0);
    let control_read = in_flight_entries_read(&db, &one).await - after;
    assert!(
        control_read >= 2_000,
        "control: the fence check as it was should walk the in-flight index (read {control_read})"
    );
    one.close().await;
}

/// Live outbox rows fetched through an index by this backend (not yet flushed to the shared
/// statistics).
async fn outbox_rows_fetched(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(idx_tup_fetch), 0)::bigint FROM pg_stat_xact_user_tables
         WHERE relname = '_system_outboxevent'",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Issue 37, "a hot record that slows no one": the claim reads each key's oldest row by its
/// id, never by the key. Before migration 0018 the head pick's row (`e`) could be reached
/// through `outbox_record_key_idx` (the clause `e.RecordKey = h.RecordKey` was indexable, and
/// the statistics put a handful of rows behind a key), and every claim that passed a hot
/// record's head read all of its pending rows and dropped them one by one: with 10,000 pending
/// on one record, each claim took 40-60 ms and the other records drained at 0.18-0.21x of their
/// rate alone (one event per attempt: 0.01x). Here 5,000 events on one record and 5,000 over
/// 1,000 others, analyzed, the hot record's head in flight: a claim of 8 rows must fetch
/// fewer than 1,000 outbox rows (today about 30; before, over 5,000).
#[tokio::test]
async fn postgres_a_claim_passing_a_hot_record_reads_its_oldest_row_alone() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    db.execute(
        "INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'bench', '{}', 'pending', 0, 'lead:hot',
                clock_timestamp() - interval '2 hours' + i * interval '1 microsecond',
                clock_timestamp() - interval '2 hours'
         FROM generate_series(1, 5000) i",
    )
    .await;
    db.execute(
        "INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'bench', '{}', 'pending', 0, 'lead:r' || (i % 1000),
                clock_timestamp() - interval '1 hour' + i * interval '1 microsecond',
                clock_timestamp() - interval '1 hour'
         FROM generate_series(1, 5000) i",
    )
    .await;
    // The hot record's oldest row in flight, as a worker holds it.
    db.execute(
        "UPDATE _System_OutboxEvent SET Status = 'processing', LastModifiedDate = clock_timestamp()
         WHERE Id = (SELECT Id FROM _System_OutboxEvent WHERE RecordKey = 'lead:hot'
                     ORDER BY CreatedDate, Id LIMIT 1)",
    )
    .await;
    db.execute("ANALYZE _System_OutboxEvent").await;
    db.execute("ANALYZE _System_OutboxHead").await;

    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let before = outbox_rows_fetched(&mut tx).await;
    let claimed: Vec<uuid::Uuid> = sqlx::query_scalar(CLAIM)
        .bind(8)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let fetched = outbox_rows_fetched(&mut tx).await - before;
    tx.rollback().await.unwrap();
    assert_eq!(claimed.len(), 8, "the other records' heads are claimed");
    assert!(
        fetched < 1_000,
        "a claim of 8 rows fetched {fetched} outbox rows: it read the hot record's pending rows"
    );
}

/// Issue 37, "plans that hold": the settle of a record chain reaches its rows by their ids,
/// whatever the table holds. Before migration 0019 the chains settle walked the outbox table's
/// whole primary key (its `DISTINCT ON` needs a sort, priced 10^10 under the function's
/// `enable_sort = off`, and a join by id would have paid the `waits` subplan's price once per
/// id; allowing the sort alone still walked it for 16 ids and more): a round that enqueues,
/// claims and settles a chain of 32 rows beside 10,000 processed ones must fetch fewer than
/// 1,000 outbox rows (before: every row of the table, at each settle).
#[tokio::test]
async fn postgres_a_chain_settle_reaches_its_rows_by_id_on_a_grown_table() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    db.execute(
        "INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'old', '{}', 'processed', 0, 'lead:old' || (i % 100),
                clock_timestamp() - interval '2 hours' + i * interval '1 microsecond',
                clock_timestamp() - interval '2 hours'
         FROM generate_series(1, 10000) i",
    )
    .await;
    db.execute("ANALYZE _System_OutboxEvent").await;
    let one = one_connection(&db).await;
    let repo: Arc<dyn OutboxRepository> = Arc::new(PgOutbox::new(one.clone()));
    let policy = ClaimPolicy::new(Duration::from_secs(30), Duration::from_secs(10), 5);
    let mut fetched = Vec::new();
    // Seven rounds: the plan cache may choose a generic plan after five calls.
    for round in 0..7 {
        let events: Vec<NewEvent> = (0..32)
            .map(|_| NewEvent::new("t", lead(&format!("chain{round}"))))
            .collect();
        let before = outbox_rows_fetched_pooled(&db, &one).await;
        enqueue(&repo, &events).await;
        let claims = repo
            .claim_chains(policy, &Scope::All, 32, 31)
            .await
            .unwrap();
        assert_eq!(claims.len(), 32, "round {round}: the chain is claimed");
        let fences: Vec<Fence> = claims.iter().map(|c| c.fence).collect();
        let (mut batch, lost) = repo
            .begin_batch_attempt(Duration::from_secs(5), fences.clone())
            .await
            .unwrap();
        assert!(lost.is_empty());
        let written = batch.mark_processed_chains(fences).await.unwrap();
        assert_eq!(written, vec![FenceOutcome::Written; 32]);
        batch.commit().await.unwrap();
        // The whole round (enqueue, claim, begin, settle) on the pool's one connection.
        fetched.push(outbox_rows_fetched_pooled(&db, &one).await - before);
    }
    one.close().await;
    assert!(
        fetched.iter().all(|&n| n < 1_000),
        "outbox rows fetched by each chain settle: {fetched:?}"
    );
}

/// Issue 37, "plans that hold": a batch's heartbeat reaches its claims by their ids. Before
/// migration 0020 `_System_OutboxBeatMany` locked its rows `ORDER BY e.Id`, and under the
/// function's `enable_sort = off` the planner walked the outbox table's whole primary key to
/// yield them in order: every row of the table at each beat of a batch. Seven beats of 32 claims
/// beside 10,000 processed rows (generic plans since migration 0021)
/// must each fetch fewer than 1,000 outbox rows, and beat every claim.
#[tokio::test]
async fn postgres_a_batch_beat_reaches_its_claims_by_id_on_a_grown_table() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    db.execute(
        "INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'old', '{}', 'processed', 0, 'lead:old' || (i % 100),
                clock_timestamp() - interval '2 hours' + i * interval '1 microsecond',
                clock_timestamp() - interval '2 hours'
         FROM generate_series(1, 10000) i",
    )
    .await;
    db.execute("ANALYZE _System_OutboxEvent").await;
    let one = one_connection(&db).await;
    let repo: Arc<dyn OutboxRepository> = Arc::new(PgOutbox::new(one.clone()));
    let events: Vec<NewEvent> = (0..32)
        .map(|i| NewEvent::new("t", lead(&format!("beaten{i}"))))
        .collect();
    enqueue(&repo, &events).await;
    let policy = ClaimPolicy::new(Duration::from_secs(30), Duration::from_secs(10), 5);
    let claims = repo.claim_batch(policy, &Scope::All, 32).await.unwrap();
    assert_eq!(claims.len(), 32, "every record's row is claimed");
    let mut fences: Vec<Fence> = claims.iter().map(|c| c.fence).collect();
    let mut fetched = Vec::new();
    for beat in 0..7 {
        let before = outbox_rows_fetched_pooled(&db, &one).await;
        let outcomes = repo.heartbeat_many(fences.clone()).await.unwrap();
        fetched.push(outbox_rows_fetched_pooled(&db, &one).await - before);
        fences = outcomes
            .into_iter()
            .map(|o| match o {
                BeatOutcome::Beaten(f) => f,
                other => panic!("beat {beat}: a claim was {other:?}"),
            })
            .collect();
    }
    one.close().await;
    assert!(
        fetched.iter().all(|&n| n < 1_000),
        "outbox rows fetched by each beat of 32 claims: {fetched:?}"
    );
}

/// Live outbox rows fetched through an index so far, `conn`'s counts flushed first.
async fn outbox_rows_fetched_pooled(db: &TestDb, conn: &PgPool) -> i64 {
    flushed_count(
        db,
        conn,
        "SELECT coalesce(sum(idx_tup_fetch), 0)::bigint FROM pg_stat_user_tables
         WHERE relname = '_system_outboxevent'",
    )
    .await
}

/// Issue 37, "plans that hold": the claim's head pick reaches each head's row by its primary key
/// and each key's oldest row through the key's index, also on statistics taken while the
/// backlog was empty (every partial index then looks empty, and a walk of a whole one as cheap
/// as a probe). The bench's retention scenario (200,000 terminal rows analyzed, then a backlog)
/// found the claim walking all of `outbox_record_key_idx` for each head it passed: claims of 17
/// ms at the median. Here 20,000 terminal rows analyzed (autovacuum off), then 5,000 pending
/// over 1,000 records with 8 heads in flight: a claim of one row must fetch fewer than 500
/// outbox rows.
#[tokio::test]
async fn postgres_a_claim_on_statistics_of_an_empty_backlog_reads_by_key_and_id() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    db.execute(
        "INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'old', '{}',
                CASE WHEN i % 10 = 0 THEN 'failed' ELSE 'processed' END, 0, 'lead:r' || (i % 1000),
                clock_timestamp() - interval '2 days' + i * interval '1 microsecond',
                clock_timestamp() - interval '2 days'
         FROM generate_series(1, 20000) i",
    )
    .await;
    statistics_of_a_small_table(&db).await;
    db.execute(
        "INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'bench', '{}', 'pending', 0, 'lead:r' || (i % 1000),
                clock_timestamp() - interval '1 hour' + i * interval '1 microsecond',
                clock_timestamp() - interval '1 hour'
         FROM generate_series(1, 5000) i",
    )
    .await;
    db.execute(
        "UPDATE _System_OutboxEvent SET Status = 'processing', LastModifiedDate = clock_timestamp()
         WHERE Id IN (SELECT Id FROM _System_OutboxHead ORDER BY CreatedDate, Id LIMIT 8)",
    )
    .await;
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let before = outbox_rows_fetched(&mut tx).await;
    let claimed: Vec<uuid::Uuid> = sqlx::query_scalar(CLAIM)
        .bind(1)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let fetched = outbox_rows_fetched(&mut tx).await - before;
    tx.rollback().await.unwrap();
    assert_eq!(claimed.len(), 1, "the first head not in flight is claimed");
    assert!(
        fetched < 500,
        "a claim of one row fetched {fetched} outbox rows: it walked a partial index per head"
    );
}

/// Issue 37, "plans that hold": every function of the claim, the attempt and the heads keeps the
/// settings that leave only index walks (migration 0012), and those that reach rows only by a
/// key statistics cannot mislead plan their statements once per connection (0021; those that
/// read a record's open rows through a partial index keep the default). A later `CREATE OR REPLACE FUNCTION` replaces a function's
/// settings with the ones it is given, so a migration that forgets one would silently bring
/// back per-call planning or a sequential scan; this reads what the server holds.
#[tokio::test]
async fn postgres_the_outbox_functions_keep_their_planner_settings() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let functions = [
        "_system_outboxclaimbatch",
        "_system_outboxclaimchains",
        "_system_outboxbeat",
        "_system_outboxbeatmany",
        "_system_outboxlostfences",
        "_system_outboxsettle",
        "_system_outboxsettlemany",
        "_system_outboxreleasemany",
        "_system_outboxcheckfence",
        "_system_outboxheadadd",
        "_system_outboxheadremove",
        "_system_outboxheadremovemany",
        "_system_outboxtally",
        "_system_outboxfindeffects",
    ];
    let pool = db.pg().unwrap();
    for function in functions {
        let config: Vec<Option<Vec<String>>> =
            sqlx::query_scalar("SELECT proconfig FROM pg_proc WHERE proname = $1")
                .bind(function)
                .fetch_all(pool)
                .await
                .unwrap();
        assert_eq!(config.len(), 1, "{function}: one function of that name");
        let config = config[0].clone().unwrap_or_default();
        let generic = [
            "_system_outboxheadadd",
            "_system_outboxcheckfence",
            "_system_outboxbeat",
            "_system_outboxbeatmany",
            "_system_outboxsettle",
            "_system_outboxreleasemany",
            "_system_outboxtally",
            "_system_outboxfindeffects",
        ]
        .contains(&function);
        if function == "_system_outboxheadremove" {
            // Called by the row trigger inside `_System_OutboxSettle`, whose setting it would
            // inherit.
            assert!(
                config.iter().any(|c| c == "plan_cache_mode=auto"),
                "{config:?}"
            );
        }
        assert_eq!(
            config
                .iter()
                .any(|c| c == "plan_cache_mode=force_generic_plan"),
            generic,
            "{function}: planned once per connection only when it reaches rows by key: {config:?}"
        );
        for setting in [
            "enable_seqscan=off",
            "enable_bitmapscan=off",
            "enable_hashjoin=off",
            "enable_mergejoin=off",
            "enable_sort=off",
            "enable_material=off",
        ] {
            assert!(
                config.iter().any(|c| c == setting),
                "{function} lacks {setting}: {config:?}"
            );
        }
    }
}
