//! A handler that writes (issue 37): each event's handler upserts one application row of its
//! record through `ctx.tx()`, as a platform team's handler does, in a keyed drain beside the
//! no-op drain and ceiling (b) of the same run. A handler that keeps effects in the attempt
//! transaction ends its batch's segment (docs/state-machine.md, "Batched attempts", rule 2:
//! a transaction holds at most one handler's effects), so this drain measures what that
//! lock-footprint rule costs. The application rows are read back afterwards: each counts its
//! record's events exactly once.

use anyhow::{Result, bail};
use outbox_events::{AttemptContext, Handler, HandlerError, Handlers, OutboxEvent};

use crate::report::{Report, Row};
use crate::scenarios::{EVENT_TYPE, VARIANTS, drain_with, enqueue, keyed_events, pg, reset};
use crate::{BenchDb, Sizes};

/// One `INSERT … ON CONFLICT DO UPDATE` of the event's record's application row.
struct Writing;

#[async_trait::async_trait]
impl Handler for Writing {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let record = event
            .record_key
            .as_ref()
            .map(|k| k.as_str().to_owned())
            .unwrap_or_default();
        outbox_persistence::with_tx!(ctx.tx(), |conn| {
            sqlx::query(
                "INSERT INTO bench_app (id, n) VALUES ($1, 1)
                 ON CONFLICT (id) DO UPDATE SET n = bench_app.n + 1",
            )
            .bind(record)
            .execute(conn)
            .await
            .map(|_| ())
        })
        .map_err(HandlerError::db)
    }
}

/// The keyed drain with a writing handler, by the shipped pull workers and with one event per
/// attempt, at 8 workers; a target against ceiling (b).
pub(crate) async fn writing_drains(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    eprintln!("writing drain");
    let workers = 8;
    for variant in VARIANTS
        .into_iter()
        .filter(|v| v.shipped_pull() || v.name == "pull, one event per attempt")
    {
        reset(db).await?;
        let pool = db.connect(2).await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS bench_app (id text PRIMARY KEY, n bigint NOT NULL);
             TRUNCATE bench_app;",
        )
        .execute(pg(&pool)?)
        .await?;
        let events = keyed_events(sizes.drain_events, sizes.records, true);
        enqueue(&pool.repository(), &events, 1_000).await?;
        pool.close().await;
        let d = drain_with(
            db,
            variant.setup(workers),
            sizes.drain_events,
            Handlers::new().register(EVENT_TYPE, Writing),
        )
        .await?;
        let pool = db.connect(1).await?;
        let (rows, counted): (i64, i64) =
            sqlx::query_as("SELECT count(*), coalesce(sum(n), 0)::bigint FROM bench_app")
                .fetch_one(pg(&pool)?)
                .await?;
        pool.close().await;
        if counted != sizes.drain_events as i64 || rows != sizes.records as i64 {
            bail!(
                "the writing drain's application rows count {counted} events over {rows} records, not {} over {}",
                sizes.drain_events,
                sizes.records
            );
        }
        let f = d.figures;
        let rate = f.n as f64 / f.span_s.max(1e-9);
        report.push(Row {
            scenario: format!(
                "drain {} writing (one upsert through ctx.tx()), {} records",
                sizes.drain_events, sizes.records
            ),
            dispatcher: variant.name.into(),
            workers: Some(workers),
            events: Some(f.n),
            per_second: Some(rate),
            p50_ms: Some(f.p50_ms),
            p99_ms: Some(f.p99_ms),
            note: format!(
                "order violations {}; application rows count each event once ({counted} over {rows} records){}",
                d.violations,
                variant.claims_note(d.per_statement)
            ),
            ..Row::default()
        });
        if variant.shipped_pull()
            && let Some(b) = report.ceiling_b.get(&workers).copied()
        {
            report.target(
                "8 pull workers, keyed drain with a writing handler >= 1.5x ceiling (b)",
                format!("{rate:.0}/s = {:.2}x of {b:.0}/s", rate / b),
                rate >= 1.5 * b,
            );
        }
    }
    Ok(())
}
