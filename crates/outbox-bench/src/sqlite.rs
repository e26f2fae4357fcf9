//! SQLite, the embedded backend: no-op drains by 1 and 8 pull workers against a SQLite ceiling
//! measured the same way as PostgreSQL's ceiling (b) (one-row queue transactions, `BEGIN
//! IMMEDIATE; SELECT; UPDATE; COMMIT`, on a plain table in a file opened with the outbox's own
//! pragmas: WAL, `synchronous = NORMAL`), each in a fresh file (issue 15: >= 0.7x).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use outbox_events::{DispatchMode, Dispatcher};
use outbox_persistence::{ConnectConfig, Database};

use super::Sizes;
use super::report::{Report, Row};
use super::scenarios::{config, enqueue, handlers, keyed_events};

/// A fresh, migrated SQLite file in the temporary directory.
pub(crate) struct SqliteFile {
    path: std::path::PathBuf,
    pub(crate) database: Database,
}

impl SqliteFile {
    /// Creates and migrates the file, with a pool of `connections`.
    pub(crate) async fn create(connections: u32) -> Result<Self> {
        let path =
            std::env::temp_dir().join(format!("outbox_bench_{}.db", uuid::Uuid::now_v7().simple()));
        let url = format!("sqlite://{}", path.display());
        let config = ConnectConfig {
            max_connections: connections,
            acquire_timeout: Duration::from_secs(60),
            ..ConnectConfig::default()
        };
        let database = Database::connect(&url, config)
            .await
            .with_context(|| format!("open {}", path.display()))?;
        database.migrate().await?;
        Ok(Self { path, database })
    }

    /// Closes the pool and deletes the file (and its WAL).
    pub(crate) async fn remove(self) {
        self.database.close().await;
        for suffix in ["", "-wal", "-shm"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

/// One-row queue transactions per second by `connections` tasks for `run`.
async fn ceiling(connections: usize, run: Duration) -> Result<f64> {
    let file = SqliteFile::create(connections as u32).await?;
    let Database::Sqlite(pool) = &file.database else {
        bail!("not a SQLite database");
    };
    sqlx::raw_sql(
        "CREATE TABLE bench_queue (id INTEGER PRIMARY KEY, status TEXT NOT NULL);
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
         INSERT INTO bench_queue SELECT i, 'pending' FROM n;
         CREATE INDEX bench_queue_pending ON bench_queue (id) WHERE status = 'pending';",
    )
    .execute(pool)
    .await?;
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + run;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (pool, done) = (pool.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let id: Option<i64> = sqlx::query_scalar(
                    "SELECT id FROM bench_queue WHERE status = 'pending' ORDER BY id LIMIT 1",
                )
                .fetch_optional(&mut *tx)
                .await?;
                if let Some(id) = id {
                    sqlx::query("UPDATE bench_queue SET status = 'done' WHERE id = ?1")
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let rate = done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    file.remove().await;
    Ok(rate)
}

/// A keyed no-op drain of `n` events by `workers` pull workers; events/s and client CPU per
/// event.
async fn drain(workers: usize, n: usize, records: usize) -> Result<(f64, f64)> {
    let file = SqliteFile::create(ConnectConfig::for_workers(workers).max_connections).await?;
    let repo = file.database.repository();
    enqueue(&repo, &keyed_events(n, records, true), 1_000).await?;
    let cpu = super::cpu::ProcessCpu::now();
    let started = Instant::now();
    let handle = Dispatcher::new(
        repo,
        handlers(None, None),
        config(DispatchMode::Pull, workers),
    )
    .start()
    .await?;
    loop {
        let m = handle.metrics();
        if m.processed + m.failed >= n as u64 {
            break;
        }
        if started.elapsed() > super::scenarios::RUN_LIMIT {
            bail!("the SQLite drain did not finish {n} events");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu_us = cpu.per_event_us(n);
    handle.shutdown().await;
    file.remove().await;
    Ok((rate, cpu_us))
}

pub(crate) async fn sqlite_drains(sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("SQLite drains");
    let n = if sizes.quick { 1_000 } else { 4_000 };
    for workers in [1usize, 8] {
        let c = ceiling(workers, sizes.ceiling_run).await?;
        report.push(Row {
            scenario: "SQLite ceiling: one-row queue tx".into(),
            dispatcher: "ceiling (SQLite)".into(),
            workers: Some(workers),
            per_second: Some(c),
            note: "BEGIN IMMEDIATE; SELECT one pending row; UPDATE; COMMIT (WAL, synchronous = NORMAL)".into(),
            ..Row::default()
        });
        let (rate, cpu_us) = drain(workers, n, 200).await?;
        report.push(Row {
            scenario: format!("SQLite drain {n} no-op, 200 records"),
            dispatcher: "pull".into(),
            workers: Some(workers),
            events: Some(n),
            per_second: Some(rate),
            note: format!(
                "{:.2}x of the SQLite ceiling; client CPU {cpu_us:.0} µs/event",
                rate / c
            ),
            ..Row::default()
        });
        report.target(
            format!(
                "SQLite: {workers} pull workers, keyed no-op drain >= 1.0x of the SQLite ceiling (issue 37)"
            ),
            format!("{rate:.0}/s = {:.2}x of {c:.0}/s", rate / c),
            rate >= c,
        );
    }
    Ok(())
}
