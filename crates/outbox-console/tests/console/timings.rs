//! Each page's answer time on a 1,000,000-row PostgreSQL table, 95% terminal (900,000
//! `processed`, 50,000 `failed`, 45,000 `pending` of which 5,000 are retrying and 500 keys are
//! blocked, 5,000 `processing` of which 100 are stale), created over the last 7 days. Printed,
//! not asserted (timings belong in the bench, see the house style): `cargo test -p
//! outbox-console --test console timings -- --nocapture`. The numbers are in docs/console.md.

use std::time::Instant;

use axum::http::StatusCode;
use outbox_console::ConsoleConfig;
use outbox_tests::TestDb;

use crate::support::*;

/// One statement: the rows, by `generate_series`, with the index maintenance of a bulk load.
const FILL: &str = "
    INSERT INTO _System_OutboxEvent (Id, EventType, Payload, Status, RetryCount, RecordKey,
                                     CreatedDate, LastModifiedDate, LastError)
    SELECT gen_random_uuid(),
           'type.' || (g % 7),
           '{\"object\":\"Lead\",\"record_id\":\"' || g || '\",\"snapshot\":{}}',
           CASE WHEN g <= 900000 THEN 'processed'
                WHEN g <= 950000 THEN 'failed'
                WHEN g <= 995000 THEN 'pending'
                ELSE 'processing' END,
           CASE WHEN g > 900000 AND g <= 950000 THEN 5
                WHEN g > 950000 AND g <= 955000 THEN 2
                ELSE 0 END,
           CASE WHEN g > 950000 AND g <= 995000 THEN 'lead:' || (g % 40000)
                WHEN g > 995000 THEN 'lead:run' || g
                ELSE 'lead:' || g END,
           now() - ((1000000 - g) * interval '600 milliseconds'),
           now() - ((1000000 - g) * interval '600 milliseconds')
                 + CASE WHEN g > 995000 AND g <= 995100 THEN interval '0' ELSE interval '0.2 s' END,
           CASE WHEN g > 900000 AND g <= 955000 THEN 'handler failed: timeout after ' || (g % 97) || ' ms' END
    FROM generate_series(1, 1000000) AS g";

async fn page_timings_on_a_million_rows() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let started = Instant::now();
    db.execute(FILL).await;
    db.execute("ANALYZE _System_OutboxEvent").await;
    db.execute("VACUUM _System_OutboxEvent").await;
    eprintln!("filled 1,000,000 rows in {:?}", started.elapsed());
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent").await,
        1_000_000
    );
    let consumers = vec![outbox_events::Consumer::new("timing", "type.1")];
    let console = outbox_console::Console::new(db.db.clone(), consumers, ConsoleConfig::default())
        .expect("a valid console configuration");
    let a_failed: uuid::Uuid = {
        let pool = db.pg().expect("a PostgreSQL test");
        sqlx::query_scalar("SELECT Id FROM _System_OutboxEvent WHERE Status = 'failed' LIMIT 1")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let event = format!("/events/{a_failed}");
    let pages = [
        "/",
        "/fragments/overview",
        "/records?key=lead:123",
        "/failed",
        "/failed?type=type.3",
        "/failed?error=after%2096",
        event.as_str(),
        "/consumers",
        "/retention",
        "/audit",
    ];
    let mut worst = 0u128;
    for path in pages {
        get(&console, path, None).await; // warm the connection and plan caches
        let mut best = u128::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            let answer = get(&console, path, None).await;
            assert_eq!(answer.status, StatusCode::OK, "{path}: {}", answer.body);
            best = best.min(t.elapsed().as_millis());
        }
        worst = worst.max(best);
        eprintln!("page {path:<28} {best:>5} ms (best of 3, 1M rows)");
    }
    eprintln!("slowest page: {worst} ms");
    overview_parts(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_answer_on_a_million_row_table() {
    page_timings_on_a_million_rows().await;
}

/// What the overview's reads take, one by one.
async fn overview_parts(db: &TestDb) {
    let repo = db.db.repository();
    let policy = ConsoleConfig::default().claim_policy;
    let t = Instant::now();
    outbox_persistence::console::queue_counts(&db.db, repo.as_ref(), policy)
        .await
        .unwrap();
    eprintln!("  queue_counts     {:>5} ms", t.elapsed().as_millis());
    let t = Instant::now();
    repo.blocked_keys(policy, 10).await.unwrap();
    eprintln!("  blocked_keys     {:>5} ms", t.elapsed().as_millis());
    let t = Instant::now();
    outbox_persistence::console::throughput(&db.db)
        .await
        .unwrap();
    eprintln!("  throughput       {:>5} ms", t.elapsed().as_millis());
    let t = Instant::now();
    repo.paused_event_types().await.unwrap();
    repo.audit_log(20).await.unwrap();
    eprintln!("  paused + audit   {:>5} ms", t.elapsed().as_millis());
}
