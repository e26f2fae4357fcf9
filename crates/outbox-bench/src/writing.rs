//! Handlers that write (issue 37), in a keyed drain beside the no-op drain and ceiling (b) of
//! the same run, as platform teams' handlers do: one upserts an application row of its record
//! through `ctx.tx()`; the other runs a create action's find-or-create (crate `create-action`,
//! an autonumbered object keyed by the event's record and a snapshot field: every event creates
//! its own row, drawing the gap-free autonumber). A handler that keeps effects in the attempt
//! transaction ends its batch's segment by default (docs/state-machine.md, "Batched attempts",
//! rule 2: a transaction holds at most one handler's effects), so these drains measure what that
//! lock-footprint rule costs; each also runs with shared writes (rule 11, opt-in), which buy
//! part of it back. The application rows are read back afterwards: the upserts count
//! each event exactly once; the creates hold one row per event, numbered 1 to N without a gap.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail};
use create_action::{ColumnType, EventEnvelope, FindOrCreate, ObjectDef, Source};
use outbox_events::{AttemptContext, Handler, HandlerError, Handlers, OutboxEvent, WorkerConfig};
use outbox_persistence::NewEvent;
use outbox_persistence::sqlx::PgPool;

use crate::report::{Report, Row};
use crate::scenarios::{EVENT_TYPE, VARIANTS, drain_with, enqueue, keyed_events, pg, reset};
use crate::{BenchDb, Sizes};

/// The window of the shared-writes runs (`WorkerConfig::with_shared_writes`), unless
/// `OUTBOX_BENCH_SHARED_WRITES_MS` says otherwise.
const SHARED_WRITES_WINDOW: Duration = Duration::from_millis(20);

/// The shared-writes runs' window: `OUTBOX_BENCH_SHARED_WRITES_MS` or [`SHARED_WRITES_WINDOW`].
fn shared_writes_window() -> Duration {
    std::env::var("OUTBOX_BENCH_SHARED_WRITES_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(SHARED_WRITES_WINDOW, Duration::from_millis)
}

/// One `INSERT … ON CONFLICT DO UPDATE` of the event's record's application row.
struct Upsert;

#[async_trait::async_trait]
impl Handler for Upsert {
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

/// A create action's find-or-create of the event's `BenchOpportunity`, in the attempt.
struct Create(FindOrCreate);

#[async_trait::async_trait]
impl Handler for Create {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let envelope = EventEnvelope::parse(&event.payload)
            .map_err(|e| HandlerError::permanent_from("unreadable payload", e))?;
        let action = &self.0;
        outbox_persistence::with_tx!(ctx.tx(), |conn| action
            .run(conn, &envelope)
            .await
            .map(|_| ()))
        .map_err(HandlerError::from)
    }
}

/// The object the create drain makes: keyed by the lead and the event's `Relation`, numbered.
fn create_action() -> Result<FindOrCreate> {
    let object = Arc::new(
        ObjectDef::builder("BenchOpportunity")
            .natural_key("SourceLeadId", ColumnType::Text)
            .natural_key("Relation", ColumnType::Text)
            .field("Name", ColumnType::Text)
            .autonumber("OpportunityNumber")
            .build()?,
    );
    Ok(FindOrCreate::builder(object)
        .key("SourceLeadId", Source::RecordId)
        .key("Relation", Source::snapshot("Relation"))
        .field("Name", Source::snapshot("Company"))
        .build()?)
}

/// Which writing handler a drain runs.
#[derive(Clone, Copy)]
enum Writer {
    Upsert,
    Create,
}

impl Writer {
    fn scenario(self, sizes: &Sizes) -> String {
        match self {
            Writer::Upsert => format!(
                "drain {} writing (one upsert through ctx.tx()), {} records",
                sizes.drain_events, sizes.records
            ),
            Writer::Create => format!(
                "drain {} writing (create-action find-or-create, autonumbered), {} records",
                sizes.drain_events, sizes.records
            ),
        }
    }

    fn target(self) -> &'static str {
        match self {
            Writer::Upsert => {
                "8 pull workers, keyed drain with a writing handler >= 1.5x ceiling (b)"
            }
            Writer::Create => {
                "8 pull workers, keyed drain with a create-action find-or-create >= 1.5x ceiling (b)"
            }
        }
    }

    /// The application table, empty, and the events (keyed over `sizes.records`).
    async fn prepare(self, pool: &PgPool, sizes: &Sizes) -> Result<Vec<NewEvent>> {
        match self {
            Writer::Upsert => {
                sqlx::raw_sql(
                    "CREATE TABLE IF NOT EXISTS bench_app (id text PRIMARY KEY, n bigint NOT NULL);
                     TRUNCATE bench_app;",
                )
                .execute(pool)
                .await?;
                Ok(keyed_events(sizes.drain_events, sizes.records, true))
            }
            Writer::Create => {
                sqlx::raw_sql(
                    "DROP TABLE IF EXISTS BenchOpportunity;
                     CREATE TABLE BenchOpportunity (
                       SourceLeadId text NOT NULL, Relation text NOT NULL,
                       OpportunityNumber bigint NOT NULL, Name text NOT NULL,
                       CONSTRAINT bench_opportunity_natural_key UNIQUE (SourceLeadId, Relation),
                       CONSTRAINT bench_opportunity_number UNIQUE (OpportunityNumber));
                     DELETE FROM _System_Autonumber WHERE ObjectName = 'benchopportunity';",
                )
                .execute(pool)
                .await?;
                Ok((0..sizes.drain_events)
                    .map(|i| {
                        let payload = serde_json::json!({
                            "object": "Lead",
                            "record_id": format!("r{}", i % sizes.records),
                            "snapshot": {"Relation": format!("e{i}"), "Company": format!("c{i}")},
                        });
                        NewEvent::new(EVENT_TYPE, payload.to_string())
                    })
                    .collect())
            }
        }
    }

    fn handlers(self) -> Result<Handlers> {
        Ok(match self {
            Writer::Upsert => Handlers::new().register(EVENT_TYPE, Upsert),
            Writer::Create => Handlers::new().register(EVENT_TYPE, Create(create_action()?)),
        })
    }

    /// Reads the application rows back: what the note says of them, or why the drain is wrong.
    async fn check(self, pool: &PgPool, sizes: &Sizes) -> Result<String> {
        let n = sizes.drain_events as i64;
        match self {
            Writer::Upsert => {
                let (rows, counted): (i64, i64) =
                    sqlx::query_as("SELECT count(*), coalesce(sum(n), 0)::bigint FROM bench_app")
                        .fetch_one(pool)
                        .await?;
                if counted != n || rows != sizes.records as i64 {
                    bail!(
                        "the writing drain's application rows count {counted} events over {rows} records, not {n} over {}",
                        sizes.records
                    );
                }
                Ok(format!(
                    "application rows count each event once ({counted} over {rows} records)"
                ))
            }
            Writer::Create => {
                let (rows, low, high): (i64, Option<i64>, Option<i64>) = sqlx::query_as(
                    "SELECT count(*), min(OpportunityNumber), max(OpportunityNumber)
                     FROM BenchOpportunity",
                )
                .fetch_one(pool)
                .await?;
                // The numbers are UNIQUE: n rows numbered 1 to n have no gap.
                if rows != n || low != Some(1) || high != Some(n) {
                    bail!(
                        "the create drain holds {rows} rows numbered {low:?} to {high:?}, not {n} numbered 1 to {n}"
                    );
                }
                Ok(format!(
                    "one created row per event ({rows}), autonumbers 1 to {n} without a gap"
                ))
            }
        }
    }
}

/// The keyed drains with writing handlers, by the shipped pull workers and with one event per
/// attempt, at 8 workers; a target against ceiling (b) each.
pub(crate) async fn writing_drains(db: &BenchDb, sizes: &Sizes, report: &mut Report) -> Result<()> {
    // `OUTBOX_BENCH_WRITERS=upsert` (or `create`) runs one of them, for an A/B.
    let only = std::env::var("OUTBOX_BENCH_WRITERS").unwrap_or_default();
    if !["", "upsert", "create"].contains(&only.as_str()) {
        bail!("OUTBOX_BENCH_WRITERS is {only:?}: upsert, create, or unset for both");
    }
    for (name, writer) in [("upsert", Writer::Upsert), ("create", Writer::Create)] {
        if only.is_empty() || only == name {
            writing_drain(db, sizes, report, writer).await?;
        }
    }
    Ok(())
}

/// `config` with writes shared for `shared` (rule 11), and the dispatcher's name for the row.
fn sharing(config: WorkerConfig, name: &str, shared: Option<Duration>) -> (WorkerConfig, String) {
    match shared {
        Some(window) => (
            config.with_shared_writes(window),
            format!("{name}, writes shared ({} ms)", window.as_millis()),
        ),
        None => (config, name.to_owned()),
    }
}

async fn writing_drain(
    db: &BenchDb,
    sizes: &Sizes,
    report: &mut Report,
    writer: Writer,
) -> Result<()> {
    eprintln!("writing drain: {}", writer.scenario(sizes));
    let workers = 8;
    let variants = VARIANTS
        .into_iter()
        .filter(|v| v.shipped_pull() || v.name == "pull, one event per attempt");
    // The shipped pull workers twice: as shipped, then with writes shared (rule 11, opt-in).
    let runs = variants
        .flat_map(|v| {
            let shared = v
                .shipped_pull()
                .then_some((v, Some(shared_writes_window())));
            [Some((v, None)), shared]
        })
        .flatten();
    for (variant, shared) in runs {
        reset(db).await?;
        let pool = db.connect(2).await?;
        let events = writer.prepare(pg(&pool)?, sizes).await?;
        enqueue(&pool.repository(), &events, 1_000).await?;
        pool.close().await;
        let (config, async_claims) = variant.setup(workers);
        let (config, dispatcher) = sharing(config, variant.name, shared);
        let d = drain_with(
            db,
            (config, async_claims),
            sizes.drain_events,
            writer.handlers()?,
        )
        .await?;
        let pool = db.connect(1).await?;
        let checked = writer.check(pg(&pool)?, sizes).await;
        pool.close().await;
        let checked = checked?;
        let f = d.figures;
        let rate = f.n as f64 / f.span_s.max(1e-9);
        report.push(Row {
            scenario: writer.scenario(sizes),
            dispatcher,
            workers: Some(workers),
            events: Some(f.n),
            per_second: Some(rate),
            p50_ms: Some(f.p50_ms),
            p99_ms: Some(f.p99_ms),
            note: format!(
                "order violations {}; {checked}{}{}",
                d.violations,
                variant.claims_note(d.per_statement),
                shared.map_or(String::new(), |_| format!(
                    "; {} run again in the next segment (a bounded lock wait or a failure)",
                    d.shared_write_reruns
                ))
            ),
            ..Row::default()
        });
        if variant.shipped_pull()
            && let Some(b) = report.ceiling_b.get(&workers).copied()
        {
            let target = match shared {
                Some(window) => format!(
                    "{}, writes shared ({} ms, opt-in)",
                    writer.target(),
                    window.as_millis()
                ),
                None => writer.target().to_owned(),
            };
            report.target(
                target,
                format!("{rate:.0}/s = {:.2}x of {b:.0}/s", rate / b),
                rate >= 1.5 * b,
            );
        }
    }
    Ok(())
}
