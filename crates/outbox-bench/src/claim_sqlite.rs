//! Select-and-claim latency on SQLite, by the same backlog shapes as [`super::claim`]: each
//! shape in a fresh SQLite file, enqueued through the repository (so the heads table and every
//! trigger do their real work), the oldest keys' heads claimed and left in flight, then
//! `claim_next` timed at the caller, each claimed row completed through a real attempt
//! (untimed) so that the next claim takes the next row.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use outbox_persistence::{ClaimPolicy, NewEvent, OutboxRepository, Scope};

use super::Sizes;
use super::claim::{HOT_OTHERS, IN_FLIGHT, KEYS, Shape, percentile, shapes};
use super::report::{Report, Row};
use super::sqlite::SqliteFile;

/// Events per enqueue transaction while seeding.
const SEED_BATCH: usize = 1_000;

/// The shape's events in enqueue order: the hot key's first, then the others round robin.
fn events(shape: Shape) -> impl Iterator<Item = NewEvent> {
    let (hot, rows, keys) = match shape {
        Shape::Backlog(n) => (0, n, KEYS),
        Shape::Hot(h) => (h, HOT_OTHERS, KEYS),
        Shape::Spread(n) => (0, n, n),
    };
    let hot = (0..hot).map(|i| format!(r#"{{"objectName":"lead","recordId":"hot","seq":{i}}}"#));
    let others = (0..rows).map(move |i| {
        format!(
            r#"{{"objectName":"lead","recordId":"r{}","seq":{i}}}"#,
            i % keys.max(1)
        )
    });
    hot.chain(others).map(|p| NewEvent::new("bench", p))
}

async fn seed(repo: &dyn OutboxRepository, shape: Shape, policy: ClaimPolicy) -> Result<()> {
    let mut events = events(shape).peekable();
    while events.peek().is_some() {
        let batch: Vec<NewEvent> = events.by_ref().take(SEED_BATCH).collect();
        let mut tx = repo.begin().await?;
        repo.enqueue(&mut tx, &batch).await?;
        tx.commit().await?;
    }
    for _ in 0..IN_FLIGHT {
        repo.claim_next(policy, &Scope::All).await?;
    }
    Ok(())
}

/// Times `claim_next` up to `samples` times or `budget`, completing each claimed row.
async fn time_claims(
    repo: &dyn OutboxRepository,
    policy: ClaimPolicy,
    samples: usize,
    budget: Duration,
) -> Result<Vec<f64>> {
    let mut ms = Vec::with_capacity(samples);
    let began = Instant::now();
    while ms.len() < samples && (ms.len() < 5 || began.elapsed() < budget) {
        let t = Instant::now();
        let claim = repo.claim_next(policy, &Scope::All).await?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        let Some(claim) = claim else { break };
        let mut attempt = repo
            .begin_attempt(Duration::from_secs(5), claim.fence)
            .await?
            .context("the claimed row's fence moved")?;
        attempt.mark_processed(claim.fence).await?;
        attempt.commit().await?;
    }
    Ok(ms)
}

/// The SQLite rows of the select-and-claim measurement and their targets (within 2x of the
/// 10k figure, as on PostgreSQL).
pub(crate) async fn select_and_claim_sqlite(sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("select-and-claim on SQLite");
    let policy = super::claim::cutoffs();
    let mut p50 = Vec::new();
    for shape in shapes(sizes) {
        let file = SqliteFile::create(2).await?;
        let repo = file.database.repository();
        let seeding = Instant::now();
        seed(repo.as_ref(), shape, policy).await?;
        let seeded = seeding.elapsed();
        let mut ms = time_claims(
            repo.as_ref(),
            policy,
            sizes.claim_samples,
            sizes.claim_budget,
        )
        .await?;
        file.remove().await;
        ms.sort_by(f64::total_cmp);
        let (median, p99) = (percentile(&ms, 0.5), percentile(&ms, 0.99));
        p50.push((shape, median));
        report.push(Row {
            scenario: format!("select-and-claim (SQLite), {}", shape.name()),
            dispatcher: "claim_next".into(),
            workers: Some(1),
            events: Some(ms.len()),
            p50_ms: Some(median),
            p99_ms: Some(p99),
            note: format!(
                "{IN_FLIGHT} heads in flight; timed at the caller; seeded through enqueue in {:.1} s",
                seeded.as_secs_f64()
            ),
            ..Row::default()
        });
    }
    let Some(base) = p50
        .iter()
        .find(|(s, _)| matches!(s, Shape::Backlog(10_000)))
        .map(|(_, m)| *m)
    else {
        return Ok(());
    };
    for (shape, m) in &p50 {
        if !matches!(shape, Shape::Backlog(10_000)) {
            report.target(
                format!(
                    "SQLite select-and-claim p50 at {} within 2x of 10k",
                    shape.name()
                ),
                format!("{m:.2} ms vs {base:.2} ms = {:.1}x", m / base),
                *m <= 2.0 * base,
            );
        }
    }
    Ok(())
}
