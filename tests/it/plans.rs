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

use outbox_tests::TestDb;
use sqlx::{Connection as _, PgConnection};

/// A claim of `$1` rows: batches of one and of eight share the function's cached plan.
const CLAIM: &str = "SELECT Id FROM _System_OutboxClaimBatch('0', '30 seconds', '10 seconds', 5, NULL, NULL, $1, '5000ms')";

/// An ordinary client-prepared read over the same tables: the candidates' walk and its join.
const CONTROL: &str = "\
SELECT e.Id
FROM _System_OutboxHead h
JOIN _System_OutboxEvent e ON e.Id = h.Id
WHERE e.Status = 'pending'
ORDER BY h.CreatedDate, h.Id
LIMIT 1";

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
    db.execute("ALTER TABLE _System_OutboxEvent SET (autovacuum_enabled = false)")
        .await;
    db.execute("ALTER TABLE _System_OutboxHead SET (autovacuum_enabled = false)")
        .await;
    db.execute("VACUUM ANALYZE _System_OutboxEvent").await;
    db.execute("VACUUM ANALYZE _System_OutboxHead").await;

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
