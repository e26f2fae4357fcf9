//! The statistics trap (PostgreSQL, migrations 0022 and 0023). An ANALYZE taken while the
//! outbox held only terminal rows (a quiet period over a large retained history) counts every
//! partial index on the open rows as empty: `outbox_eligible_idx` (CreatedDate, Id),
//! `outbox_record_key_idx` (RecordKey, CreatedDate, Id) and `outbox_in_flight_idx` then cost
//! the same, and a probe of one record's open rows written as `RecordKey = k … ORDER BY
//! CreatedDate, Id` was read from `outbox_eligible_idx` with the record as a filter: every open
//! row of the table per record. The functions plan at each call on the statistics of the moment,
//! so the trap lasted until the next ANALYZE. These tests take such statistics, then give the
//! table open rows, and count the entries of `outbox_eligible_idx` each path reads.

use std::sync::Arc;

use std::time::Duration;

use outbox_persistence::postgres::PgOutbox;
use outbox_persistence::sqlx::PgPool;
use outbox_persistence::{ClaimPolicy, Fence, FenceOutcome, NewEvent, OutboxRepository, Scope};
use outbox_tests::TestDb;

use crate::plans::{
    CLAIM, beat_round, claim_round, flushed_count, one_connection, reclaim_round, settle_round,
};
use crate::repository::{enqueue, lead};

/// 20,000 `processed` rows over 200 records, analyzed with autovacuum off: statistics that
/// count no open row, kept while the test's open rows arrive. Run on `pool`.
async fn statistics_of_terminal_rows(pool: &PgPool) {
    for sql in [
        "ALTER TABLE _System_OutboxEvent SET (autovacuum_enabled = false)",
        "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount, RecordKey,
           CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 't', '{}', 'processed', 0, 'lead:k' || (i % 200),
                now() - interval '2 hours' + i * interval '1 ms',
                now() - interval '2 hours' + i * interval '1 ms'
         FROM generate_series(1, 20000) i",
        "ANALYZE _System_OutboxEvent",
        "ANALYZE _System_OutboxHead",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

/// The claim (migration 0022): a backlog of 4,000 rows over the 200 records arrives after the
/// statistics, the oldest 50 heads in flight; one claim of 32 must reach each head's rows
/// through the record's own indexes: (almost) nothing of `outbox_eligible_idx` read, where the
/// equality-keyed probes read the table's open rows once per head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_claim_after_statistics_of_terminal_rows_reads_each_record_by_its_key() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    statistics_of_terminal_rows(db.pg().expect("PostgreSQL")).await;
    db.execute(
        "INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount, RecordKey,
           CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 't', '{}', 'pending', 0, 'lead:k' || (i % 200),
                now() - interval '1 hour' + i * interval '1 ms',
                now() - interval '1 hour' + i * interval '1 ms'
         FROM generate_series(1, 4000) i",
    )
    .await;
    // The oldest 50 records' heads in flight, as beside running workers.
    db.execute(
        "UPDATE _System_OutboxEvent SET Status = 'processing', LastModifiedDate = clock_timestamp()
         WHERE Id IN (SELECT Id FROM _System_OutboxHead ORDER BY CreatedDate, Id LIMIT 50)",
    )
    .await;
    let pool = db.pg().expect("PostgreSQL");
    let mut tx = pool.begin().await.unwrap();
    // The counter holds this transaction's reads (and earlier unflushed ones of the session):
    // what the claim adds is the difference.
    let eligible_read = "SELECT pg_stat_get_xact_tuples_returned('outbox_eligible_idx'::regclass)";
    let before: i64 = sqlx::query_scalar(eligible_read)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let claimed: Vec<uuid::Uuid> = sqlx::query_scalar(CLAIM)
        .bind(32_i32)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let after: i64 = sqlx::query_scalar(eligible_read)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let read = after - before;
    tx.rollback().await.unwrap();
    assert_eq!(
        claimed.len(),
        32,
        "a batch of heads beside the 50 in flight"
    );
    assert!(
        read < 100,
        "the claim read {read} entries of outbox_eligible_idx: a record's rows walked through \
         the table's open rows"
    );
}

/// Open rows around the round's: 2,000 in flight, created before it (each on a record of its
/// own, beaten an hour ahead: no reclaim takes them however slow the test), and 20,000 pending
/// on the round's first record (`lead:p0a`), created after it and due in an hour (no claim
/// takes them): a hot record's tail.
const AROUND: &str = "\
INSERT INTO _System_OutboxEvent
  (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
SELECT gen_random_uuid(), 'around', '{}', CASE WHEN i <= 2000 THEN 'processing' ELSE 'pending' END,
       0, CASE WHEN i <= 2000 THEN 'lead:busy' || i ELSE 'lead:p0a' END,
       clock_timestamp() + CASE WHEN i <= 2000 THEN interval '-1 hour' ELSE interval '1 hour' END
         + i * interval '1 microsecond',
       clock_timestamp() + interval '1 hour'
FROM generate_series(1, 22000) i";

/// What the round's statements have read so far (`conn`'s counts flushed first): entries
/// returned by `outbox_eligible_idx`, and pages of `outbox_record_key_idx` (an entry its
/// conditions reject is not returned, so a walk past a probe's bound shows in pages only).
async fn reads(db: &TestDb, conn: &PgPool) -> (i64, i64) {
    let eligible = "SELECT coalesce(sum(idx_tup_read), 0)::bigint FROM pg_stat_user_indexes
                    WHERE indexrelname = 'outbox_eligible_idx'";
    let by_key = "SELECT coalesce(sum(idx_blks_hit + idx_blks_read), 0)::bigint
                  FROM pg_statio_user_indexes WHERE indexrelname = 'outbox_record_key_idx'";
    (
        flushed_count(db, conn, eligible).await,
        flushed_count(db, conn, by_key).await,
    )
}

/// The rest of the attempt's path (migration 0023) after the trap's statistics: record chains,
/// the batch's begin check, beats, the chain settle and its heads, the one-event settle's row
/// trigger, reclaims, and records emptied (the heads' deletes). One round of the attempt path
/// (two records of three rows, two unkeyed rows; every statement the library runs, on one
/// connection) and [`emptied_round`] beside the 22,000 open rows of [`AROUND`]: each of its steps must read fewer than 100 entries of `outbox_eligible_idx`,
/// where the equality-keyed probes read it from the table's oldest open row up to the record's
/// (the 2,000 in flight) or to its end (all 22,000) once per record and step, and fewer than 100
/// pages of `outbox_record_key_idx`, where a probe bounded by a row comparison on its second
/// column walks the hot record's whole tail (302 pages per settle). The setup runs on the
/// round's connection, so that its own reads are flushed before the first count.
#[tokio::test]
async fn postgres_the_attempt_path_after_statistics_of_terminal_rows_reads_each_record_by_its_key()
{
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
    let one = one_connection(&db).await;
    statistics_of_terminal_rows(&one).await;
    sqlx::query(AROUND).execute(&one).await.unwrap();
    let repo: Arc<dyn OutboxRepository> = Arc::new(PgOutbox::new(one.clone()));
    let mut read = reads(&db, &one).await;
    let mut step = |name: &'static str, now: (i64, i64)| {
        let step = (name, now.0 - read.0, now.1 - read.1);
        read = now;
        step
    };
    let (ids, claims) = claim_round(&repo, 0).await;
    let claimed = step("claims", reads(&db, &one).await);
    let fences = beat_round(&repo, 0, &ids, &claims).await;
    let beaten = step("beats", reads(&db, &one).await);
    settle_round(&repo, &fences).await;
    let settled = step("settles", reads(&db, &one).await);
    reclaim_round(&repo, &fences).await;
    let reclaimed = step("reclaims", reads(&db, &one).await);
    emptied_round(&repo).await;
    let emptied = step("records emptied", reads(&db, &one).await);
    let heads: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM _System_OutboxHead WHERE RecordKey LIKE 'lead:gone-%'",
    )
    .fetch_one(&one)
    .await
    .unwrap();
    assert_eq!(heads, 0, "the emptied records' heads are deleted");
    one.close().await;
    let steps = [claimed, beaten, settled, reclaimed, emptied];
    assert!(
        steps
            .iter()
            .all(|(_, eligible, pages)| *eligible < 100 && *pages < 100),
        "the round's steps' (entries of outbox_eligible_idx, pages of outbox_record_key_idx): \
         {steps:?}; a record's rows walked through the table's open rows, or the hot record's \
         past a probe's bound"
    );
}

/// Records whose last open rows end, so that the heads' removal deletes their heads: a chain
/// of three and a single row settled in a batch (`_System_OutboxHeadRemoveMany`), and a row
/// settled alone (the row trigger's `_System_OutboxHeadRemove`), each after the round's rows.
async fn emptied_round(repo: &Arc<dyn OutboxRepository>) {
    let mut events: Vec<NewEvent> = (0..3).map(|_| NewEvent::new("t", lead("gone-a"))).collect();
    events.push(NewEvent::new("t", lead("gone-b")));
    enqueue(repo, &events).await;
    let policy = ClaimPolicy::new(Duration::from_secs(30), Duration::from_secs(10), 5);
    let claims = repo.claim_chains(policy, &Scope::All, 8, 2).await.unwrap();
    assert_eq!(claims.len(), 4, "the two records' rows, and no other");
    let fences: Vec<Fence> = claims.iter().map(|c| c.fence).collect();
    let lock = Duration::from_secs(5);
    let (mut batch, lost) = repo
        .begin_batch_attempt(lock, fences.clone())
        .await
        .unwrap();
    assert!(lost.is_empty());
    let written = batch.mark_processed_chains(fences).await.unwrap();
    assert_eq!(written, vec![FenceOutcome::Written; 4]);
    batch.commit().await.unwrap();
    enqueue(repo, &[NewEvent::new("t", lead("gone-c"))]).await;
    let claim = repo.claim_next(policy, &Scope::All).await.unwrap().unwrap();
    let mut single = repo
        .begin_attempt(lock, claim.fence)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        single.mark_processed(claim.fence).await.unwrap(),
        FenceOutcome::Written
    );
    single.commit().await.unwrap();
}
