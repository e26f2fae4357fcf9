//! Select-and-claim latency by backlog shape (10k, 100k, 1M rows; one hot key's backlog
//! created before every other key's rows), for the design's query as written and for the
//! repository's `claim_next`; and `--explain`, which prints their plans on the same shapes.

use std::time::{Duration, Instant};

use anyhow::Result;
use outbox_persistence::sqlx::PgPool;
use outbox_persistence::test_support::bench::{self, Backlog};
use outbox_persistence::{ClaimPolicy, Database, Scope};

use super::report::{Report, Row};
use super::{BenchDb, Sizes};

/// Keys the seeded backlog is spread over, round robin.
pub(crate) const KEYS: usize = 1_000;
/// Rows over the other keys in the hot-key shape.
pub(crate) const HOT_OTHERS: usize = 10_000;
/// Heads in flight (claimed by live workers) in every shape.
pub(crate) const IN_FLIGHT: usize = 8;

/// A seeded backlog shape.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Shape {
    /// `rows` pending rows over [`KEYS`] keys, interleaved.
    Backlog(usize),
    /// `hot` pending rows of one key, created before [`HOT_OTHERS`] rows over [`KEYS`] keys.
    Hot(usize),
    /// `n` pending rows over `n` keys: one row per key.
    Spread(usize),
}

impl Shape {
    pub(crate) fn name(self) -> String {
        match self {
            Shape::Backlog(n) => format!("{} rows over {KEYS} keys", count(n)),
            Shape::Hot(h) => format!(
                "hot key: {} rows before {} over {KEYS} keys",
                count(h),
                count(HOT_OTHERS)
            ),
            Shape::Spread(n) => format!("{} keys with one row each", count(n)),
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
    let (hot, rows, keys) = match shape {
        Shape::Backlog(n) => (0, n, KEYS),
        Shape::Hot(h) => (h, HOT_OTHERS, KEYS),
        Shape::Spread(n) => (0, n, n),
    };
    bench::seed_backlog(
        pool,
        Backlog {
            hot,
            rows,
            keys,
            in_flight: IN_FLIGHT,
        },
    )
    .await?;
    Ok(())
}

pub(crate) fn shapes(sizes: &Sizes) -> Vec<Shape> {
    let mut shapes: Vec<Shape> = sizes
        .claim_backlogs
        .iter()
        .map(|&n| Shape::Backlog(n))
        .collect();
    shapes.extend(sizes.claim_hot_backlogs.iter().map(|&h| Shape::Hot(h)));
    shapes.push(Shape::Spread(sizes.claim_spread_keys));
    shapes
}

pub(crate) fn cutoffs() -> ClaimPolicy {
    ClaimPolicy::new(
        outbox_events::DEFAULT_STALE_AFTER,
        outbox_events::DEFAULT_RETRY_DELAY,
        outbox_events::DEFAULT_MAX_RETRY_ATTEMPTS,
    )
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
        bench::mark_processed(pool, id).await?;
    }
    Ok(ms)
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

pub(crate) async fn select_and_claim(
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
                time_claims(pool, sizes.claim_samples, sizes.claim_budget, || async {
                    Ok(bench::design_claim_next(pool, cutoffs()).await?)
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
            let shaped = matches!(shape, Shape::Hot(_) | Shape::Spread(_));
            if *variant == "claim_next" && (big || shaped) {
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

/// `outbox-bench --explain`: the plans, with run times, of the design's query and of
/// `claim_next` on every shape (each inside a transaction that is rolled back).
pub(crate) async fn explain(db: &BenchDb, sizes: &Sizes) -> Result<()> {
    let database = db.connect(2).await?;
    let Database::Postgres(pool) = &database else {
        anyhow::bail!("the bench runs on PostgreSQL");
    };
    for shape in shapes(sizes) {
        seed(pool, shape).await?;
        for (name, plan) in bench::explain_claims(pool, cutoffs()).await? {
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
