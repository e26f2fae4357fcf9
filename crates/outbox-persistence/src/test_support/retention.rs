//! A history of terminal rows for the retention benchmark: seeded in one statement on
//! PostgreSQL, counted back. Used by `outbox-bench`'s retention scenario.

use sqlx::PgPool;

use crate::Result;

/// Adds `processed` rows finished 20 days ago and `failed` rows finished 40 days ago (event type
/// `bench`, payload `{}`), spread over `keys` record keys `lead:r0` … (the drain's keys), then
/// `VACUUM ANALYZE`. With the default ages (7 and 30 days) every one of them may be pruned.
pub async fn seed_terminal_rows(
    pool: &PgPool,
    processed: usize,
    failed: usize,
    keys: usize,
) -> Result<()> {
    for (status, n, age) in [("processed", processed, 20), ("failed", failed, 40)] {
        crate::statement::query(
            "INSERT INTO _System_OutboxEvent
               (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate,
                LastModifiedDate, LastError)
             SELECT gen_random_uuid(), 'bench', '{}', $1, 0, 'lead:r' || (i % $3), t, t,
                    CASE WHEN $1 = 'failed' THEN 'seeded failure' END
             FROM (SELECT i, now() - make_interval(days => $4) + i * interval '1 microsecond' AS t
                   FROM generate_series(1, $2) i) s",
        )
        .bind(status)
        .bind(n as i64)
        .bind(keys.max(1) as i64)
        .bind(age)
        .execute(pool)
        .await?;
    }
    super::bench::vacuum_analyze(pool).await
}

/// Terminal rows in the table (`processed` and `failed`).
pub async fn terminal_rows(pool: &PgPool) -> Result<i64> {
    Ok(crate::statement::query_scalar(
        "SELECT count(*) FROM _System_OutboxEvent WHERE Status IN ('processed', 'failed')",
    )
    .fetch_one(pool)
    .await?)
}
