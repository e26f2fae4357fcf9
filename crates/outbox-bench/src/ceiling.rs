//! The ceilings every figure is compared with, on the same server and connection counts:
//! (a) single-row `UPDATE` transactions, (b) one-row queue transactions (select one pending row
//! `FOR UPDATE SKIP LOCKED` and update it, one per transaction, on a plain table).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use outbox_persistence::Database;
use sqlx::PgPool;

use super::report::{Report, Row};
use super::{BenchDb, Sizes};

/// Rows of the plain queue table per second of a run: more than any run can consume.
const QUEUE_ROWS_PER_SECOND: u64 = 15_000;

pub(crate) async fn run(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("ceilings");
    for &connections in sizes.workers {
        let pool = pg(db, connections).await?;
        let rows = QUEUE_ROWS_PER_SECOND * sizes.ceiling_run.as_secs().max(1);
        setup(&pool, connections, rows).await?;
        let (a, _) = measure(&pool, connections, sizes.ceiling_run, |pool, i| {
            Box::pin(async move {
                sqlx::query("UPDATE bench_counter SET n = n + 1 WHERE id = $1")
                    .bind(i as i64)
                    .execute(&pool)
                    .await?;
                Ok(())
            })
        })
        .await?;
        let (b, b_cpu) = measure(&pool, connections, sizes.ceiling_run, |pool, _| {
            Box::pin(async move {
                let mut tx = pool.begin().await?;
                let id: Option<i64> = sqlx::query_scalar(
                    "SELECT id FROM bench_queue WHERE status = 'pending'
                     ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED",
                )
                .fetch_optional(&mut *tx)
                .await?;
                if let Some(id) = id {
                    sqlx::query("UPDATE bench_queue SET status = 'done' WHERE id = $1")
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok(())
            })
        })
        .await?;
        pool.close().await;
        report.ceiling_b.insert(connections, b);
        report.push(Row {
            scenario: "ceiling (a) single-row UPDATE".into(),
            dispatcher: "ceiling (a)".into(),
            workers: Some(connections),
            per_second: Some(a),
            note: "one statement per transaction".into(),
            ..Row::default()
        });
        report.push(Row {
            scenario: "ceiling (b) one-row queue tx".into(),
            dispatcher: "ceiling (b)".into(),
            workers: Some(connections),
            per_second: Some(b),
            of_ceiling_b: Some(1.0),
            note: format!(
                "BEGIN; SELECT .. FOR UPDATE SKIP LOCKED; UPDATE; COMMIT; client CPU {b_cpu:.0} µs/tx"
            ),
            ..Row::default()
        });
    }
    Ok(())
}

async fn pg(db: &BenchDb, connections: usize) -> Result<PgPool> {
    match db.connect(connections as u32 + 1).await? {
        Database::Postgres(pool) => Ok(pool),
        Database::Sqlite(_) => anyhow::bail!("the bench runs on PostgreSQL"),
    }
}

async fn setup(pool: &PgPool, connections: usize, rows: u64) -> Result<()> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS bench_counter, bench_queue;
         CREATE TABLE bench_counter (id bigint PRIMARY KEY, n bigint NOT NULL);
         INSERT INTO bench_counter SELECT i, 0 FROM generate_series(0, {connections}) i;
         CREATE TABLE bench_queue (id bigint PRIMARY KEY, status text NOT NULL, payload text);
         INSERT INTO bench_queue SELECT i, 'pending', '{{}}' FROM generate_series(1, {rows}) i;
         CREATE INDEX bench_queue_pending ON bench_queue (id) WHERE status = 'pending';"
    )))
    .execute(pool)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE bench_counter, bench_queue")
        .execute(pool)
        .await?;
    Ok(())
}

type Op = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;

/// Runs `op` in a loop on `connections` tasks for `run`; transactions per second, and this
/// process's CPU per transaction (the drains' client CPU is measured the same way).
async fn measure(
    pool: &PgPool,
    connections: usize,
    run: Duration,
    op: impl Fn(PgPool, usize) -> Op + Send + Sync + 'static,
) -> Result<(f64, f64)> {
    let cpu = crate::cpu::ProcessCpu::now();
    let op = Arc::new(op);
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + run;
    let mut tasks = Vec::new();
    for i in 0..connections {
        let (pool, op, done) = (pool.clone(), op.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                op(pool.clone(), i).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let done = done.load(Ordering::Relaxed);
    Ok((
        done as f64 / started.elapsed().as_secs_f64(),
        cpu.per_event_us(done as usize),
    ))
}
