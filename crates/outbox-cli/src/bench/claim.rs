//! Select-and-claim latency by backlog shape (10k, 100k, 1M rows; one hot key's backlog
//! created before every other key's rows), for the design's query as written and for the
//! repository's `claim_next`; and `--explain`, which prints their plans on the same shapes.

use std::time::{Duration, Instant};

use anyhow::Result;
use chrono::Utc;
use outbox_persistence::{ClaimPolicy, Database, Scope};
use sqlx::PgPool;

use super::report::{Report, Row};
use super::{BenchDb, Sizes};

/// Keys the seeded backlog is spread over, round robin.
const KEYS: usize = 1_000;
/// Rows over the other keys in the hot-key shape.
const HOT_OTHERS: usize = 10_000;
/// Heads in flight (claimed by live workers) in every shape.
const IN_FLIGHT: usize = 8;

/// The select-and-claim statement as it was before the per-key-head rewrite: the design's
/// eligible query, as written, feeding the claim. Kept here to measure before and after.
pub(super) const DESIGN_CLAIM_NEXT: &str = "\
WITH candidate AS (
  SELECT e.Id, e.Status AS old_status
  FROM _System_OutboxEvent e
  WHERE
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < $2))
    AND (e.Status <> 'pending'
         OR e.RetryCount = 0
         OR e.LastModifiedDate < $3)
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
    AND ($4::text[] IS NULL OR e.EventType = ANY($4))
    AND ($5::text[] IS NULL OR e.EventType <> ALL($5))
  ORDER BY e.CreatedDate ASC, e.Id ASC
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
)
UPDATE _System_OutboxEvent t
SET Status = 'processing',
    LastModifiedDate = GREATEST($1, t.LastModifiedDate + interval '1 microsecond')
FROM candidate c
WHERE t.Id = c.Id
RETURNING t.Id, t.EventType, t.Payload, t.Status, t.RetryCount, t.RecordKey, t.CreatedDate,
          t.LastModifiedDate, t.LastError, c.old_status";

/// A seeded backlog shape.
#[derive(Debug, Clone, Copy)]
enum Shape {
    /// `rows` pending rows over [`KEYS`] keys, interleaved.
    Backlog(usize),
    /// `hot` pending rows of one key, created before [`HOT_OTHERS`] rows over [`KEYS`] keys.
    Hot(usize),
}

impl Shape {
    fn name(self) -> String {
        match self {
            Shape::Backlog(n) => format!("{} rows over {KEYS} keys", count(n)),
            Shape::Hot(h) => format!(
                "hot key: {} rows before {} over {KEYS} keys",
                count(h),
                count(HOT_OTHERS)
            ),
        }
    }
}

fn count(n: usize) -> String {
    if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else if n >= 1_000 && n.is_multiple_of(1_000) {
        format!("{}k", n / 1_000)
    } else {
        n.to_string()
    }
}

/// Seeds `shape` into the (emptied) outbox table, with the [`IN_FLIGHT`] oldest keys' heads
/// claimed by live workers (their heartbeat is fresh for the whole run).
async fn seed(pool: &PgPool, shape: Shape) -> Result<()> {
    let (hot, rows) = match shape {
        Shape::Backlog(n) => (0, n),
        Shape::Hot(h) => (h, HOT_OTHERS),
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "TRUNCATE _System_OutboxEvent;
         INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'bench', '{{}}', 'pending', 0, 'Lead:hot', t, t
         FROM (SELECT now() - interval '1 day' + i * interval '1 microsecond' AS t
               FROM generate_series(1, {hot}) i) s;
         INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT gen_random_uuid(), 'bench', '{{}}', 'pending', 0, 'Lead:r' || (i % {KEYS}), t, t
         FROM (SELECT i, now() - interval '12 hours' + i * interval '1 microsecond' AS t
               FROM generate_series(1, {rows}) i) s;
         UPDATE _System_OutboxEvent SET Status = 'processing',
                LastModifiedDate = now() + interval '1 day'
         WHERE Id IN (
           SELECT Id FROM (
             SELECT DISTINCT ON (RecordKey) Id, CreatedDate
             FROM _System_OutboxEvent ORDER BY RecordKey, CreatedDate, Id) heads
           ORDER BY CreatedDate, Id LIMIT {IN_FLIGHT});"
    )))
    .execute(pool)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE _System_OutboxEvent")
        .execute(pool)
        .await?;
    Ok(())
}

fn shapes(sizes: &Sizes) -> Vec<Shape> {
    let mut shapes: Vec<Shape> = sizes
        .claim_backlogs
        .iter()
        .map(|&n| Shape::Backlog(n))
        .collect();
    shapes.push(Shape::Hot(sizes.claim_hot_backlog));
    shapes
}

fn cutoffs() -> ClaimPolicy {
    ClaimPolicy::new(
        outbox_events::DEFAULT_STALE_AFTER,
        outbox_events::DEFAULT_RETRY_DELAY,
        outbox_events::DEFAULT_MAX_RETRY_ATTEMPTS,
    )
}

/// The design's query as written takes its cutoffs as timestamps: the bench computes them on
/// this host, which is the database's host in every bench run.
struct DesignCutoffs {
    now: chrono::DateTime<Utc>,
    stale_cutoff: chrono::DateTime<Utc>,
    retry_cutoff: chrono::DateTime<Utc>,
}

fn design_cutoffs() -> DesignCutoffs {
    let now = outbox_persistence::truncate_micros(Utc::now());
    let policy = cutoffs();
    let span = |d: std::time::Duration| chrono::Duration::from_std(d).unwrap_or_default();
    DesignCutoffs {
        now,
        stale_cutoff: now - span(policy.stale_after),
        retry_cutoff: now - span(policy.retry_delay),
    }
}

/// An interval for the repository's claim statement.
fn interval(d: std::time::Duration) -> sqlx::postgres::types::PgInterval {
    sqlx::postgres::types::PgInterval {
        months: 0,
        days: 0,
        microseconds: i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
    }
}

/// Times `claim` (which claims one row and returns its id) up to `samples` times or
/// `budget`, completing each claimed row untimed so that the next claim takes the next.
async fn time_claims<F, Fut>(
    pool: &PgPool,
    samples: usize,
    budget: Duration,
    mut claim: F,
) -> Result<Vec<f64>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<uuid::Uuid>>>,
{
    let mut ms = Vec::with_capacity(samples);
    let began = Instant::now();
    while ms.len() < samples && (ms.len() < 5 || began.elapsed() < budget) {
        let t = Instant::now();
        let id = claim().await?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        let Some(id) = id else { break };
        sqlx::query("UPDATE _System_OutboxEvent SET Status = 'processed' WHERE Id = $1")
            .bind(id)
            .execute(pool)
            .await?;
    }
    Ok(ms)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

pub(super) async fn select_and_claim(
    db: &BenchDb,
    sizes: &Sizes,
    report: &mut Report,
) -> Result<()> {
    eprintln!("select-and-claim");
    let database = db.connect(2).await?;
    let Database::Postgres(pool) = &database else {
        anyhow::bail!("the bench runs on PostgreSQL");
    };
    let repo = database.repository();
    let no_types: Option<Vec<String>> = None;
    let mut p50 = Vec::new();
    for shape in shapes(sizes) {
        for variant in ["design query", "claim_next"] {
            seed(pool, shape).await?;
            let mut ms = if variant == "claim_next" {
                let repo = repo.clone();
                time_claims(pool, sizes.claim_samples, sizes.claim_budget, || {
                    let repo = repo.clone();
                    async move {
                        Ok(repo
                            .claim_next(cutoffs(), &Scope::All)
                            .await?
                            .map(|c| c.event.id))
                    }
                })
                .await?
            } else {
                time_claims(pool, sizes.claim_samples, sizes.claim_budget, || {
                    let c = design_cutoffs();
                    let no_types = no_types.clone();
                    async move {
                        Ok(sqlx::query_scalar(DESIGN_CLAIM_NEXT)
                            .bind(c.now)
                            .bind(c.stale_cutoff)
                            .bind(c.retry_cutoff)
                            .bind(&no_types)
                            .bind(&no_types)
                            .fetch_optional(pool)
                            .await?)
                    }
                })
                .await?
            };
            ms.sort_by(f64::total_cmp);
            let (median, p99) = (percentile(&ms, 0.5), percentile(&ms, 0.99));
            p50.push((shape, variant, median));
            report.push(Row {
                scenario: format!("select-and-claim, {}", shape.name()),
                dispatcher: variant.into(),
                workers: Some(1),
                events: Some(ms.len()),
                p50_ms: Some(median),
                p99_ms: Some(p99),
                note: format!(
                    "{IN_FLIGHT} heads in flight; one claim statement, timed at the client"
                ),
                ..Row::default()
            });
        }
    }
    database.close().await;
    let base = p50
        .iter()
        .find(|(s, v, _)| matches!(s, Shape::Backlog(10_000)) && *v == "claim_next")
        .map(|(_, _, m)| *m);
    if let Some(base) = base {
        for (shape, variant, m) in &p50 {
            let big = matches!(shape, Shape::Backlog(n) if *n == *sizes.claim_backlogs.last().unwrap_or(&0) && *n > 10_000);
            if *variant == "claim_next" && (big || matches!(shape, Shape::Hot(_))) {
                report.target(
                    format!("select-and-claim p50 at {} within 2x of 10k", shape.name()),
                    format!("{m:.2} ms vs {base:.2} ms = {:.1}x", m / base),
                    *m <= 2.0 * base,
                );
            }
        }
    }
    Ok(())
}

/// `outbox bench --explain`: the plans, with run times, of the design's query and of
/// `claim_next` on every shape (each inside a transaction that is rolled back).
pub(super) async fn explain(db: &BenchDb, sizes: &Sizes) -> Result<()> {
    let database = db.connect(2).await?;
    let Database::Postgres(pool) = &database else {
        anyhow::bail!("the bench runs on PostgreSQL");
    };
    let no_types: Option<Vec<String>> = None;
    for shape in shapes(sizes) {
        seed(pool, shape).await?;
        for (name, sql) in [
            (
                "the design's eligible query, as written (LIMIT 1)",
                outbox_persistence::postgres::ELIGIBLE_QUERY,
            ),
            (
                "select-and-claim before: the design's query feeding the claim",
                DESIGN_CLAIM_NEXT,
            ),
            (
                "select-and-claim now: claim_next",
                outbox_persistence::postgres::CLAIM_NEXT,
            ),
        ] {
            let c = design_cutoffs();
            let p = cutoffs();
            let mut tx = pool.begin().await?;
            let query = sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}"
            )));
            let query = if sql == outbox_persistence::postgres::ELIGIBLE_QUERY {
                query.bind(c.stale_cutoff).bind(c.retry_cutoff).bind(1_i64)
            } else if sql == outbox_persistence::postgres::CLAIM_NEXT {
                query
                    .bind(interval(std::time::Duration::ZERO))
                    .bind(interval(p.stale_after))
                    .bind(interval(p.retry_delay))
                    .bind(p.max_retry_attempts)
                    .bind(no_types.clone())
                    .bind(no_types.clone())
            } else {
                query
                    .bind(c.now)
                    .bind(c.stale_cutoff)
                    .bind(c.retry_cutoff)
                    .bind(no_types.clone())
                    .bind(no_types.clone())
            };
            let plan = query.fetch_all(&mut *tx).await?;
            tx.rollback().await?;
            println!("== {}: {name}", shape.name());
            for line in plan {
                println!("{line}");
            }
            println!();
        }
    }
    database.close().await;
    Ok(())
}
