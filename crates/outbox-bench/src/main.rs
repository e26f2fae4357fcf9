//! `outbox-bench` (run it as `cargo xtask bench`): throughput, latency, head-of-line
//! blocking, scaling and bloat of the pull workers and the legacy dispatcher, measured side by
//! side against the PostgreSQL ceilings of the same server in one run.
//!
//! It creates a fresh database next to the one `--database-url` names, migrates it,
//! runs every scenario there and drops it. Figures are printed, never asserted: the targets are
//! listed next to them so that a reader sees the gap. `--explain` instead seeds the claim
//! shapes and prints the plans of the design's query and of `claim_next` (`cargo xtask explain`).

mod ceiling;
mod claim;
mod claim_sqlite;
mod cost;
mod cpu;
mod enqueue;
mod head_of_line;
mod hot_key;
mod idle;
mod metrics_cost;
mod relay;
mod report;
mod retention;
mod scenarios;
mod slow;
mod sqlite;
mod webhooks;
mod writing;

use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use outbox_persistence::{ConnectConfig, Database};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

use report::Report;

/// Measures the outbox's workers on PostgreSQL, side by side with the server's ceilings.
#[derive(Debug, Parser)]
#[command(name = "outbox-bench", version, about)]
struct BenchArgs {
    /// The PostgreSQL server: a fresh database is created next to the one this names, and
    /// dropped at the end.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// Smaller sizes and shorter runs (under two minutes on two cores), for CI.
    #[arg(long)]
    pub quick: bool,
    /// Print one JSON document after the table.
    #[arg(long)]
    pub json: bool,
    /// Print the plans of the eligible query and of `claim_next` on seeded tables instead.
    #[arg(long)]
    pub explain: bool,
    /// Run only the scenarios whose name contains one of these words (for example `claim`).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// A transaction-pooling PgBouncer in front of the same server (`cargo xtask bench` starts
    /// one): the idle pickup is also measured through it, with wake-ups from a direct `LISTEN`
    /// URL and by polling.
    #[arg(long, env = "OUTBOX_BENCH_PGBOUNCER_URL")]
    pub pgbouncer_url: Option<String>,
}

/// Sizes of one run.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    pub quick: bool,
    /// Events of a drain.
    pub drain_events: usize,
    /// Records the drain's events are about.
    pub records: usize,
    /// How long each ceiling runs per connection count.
    pub ceiling_run: Duration,
    /// How long a head-of-line block lasts.
    pub block: Duration,
    /// Events that flow during the block.
    pub block_events: usize,
    /// Events of the hot key and of the other keys in the hot-key drain.
    pub hot_events: usize,
    /// Events of the slow-handler run.
    pub slow_events: usize,
    /// Backlog sizes of the select-and-claim measurement.
    pub claim_backlogs: &'static [usize],
    /// The hot key's backlogs in the select-and-claim measurement (each ahead of 10k rows).
    pub claim_hot_backlogs: &'static [usize],
    /// Keys of the one-row-per-key shape in the select-and-claim measurement.
    pub claim_spread_keys: usize,
    /// Claims timed per backlog shape.
    pub claim_samples: usize,
    /// Longest time spent timing one query on one shape (at least five claims are timed).
    pub claim_budget: Duration,
    /// Idle pickups timed.
    pub idle_samples: usize,
    /// Connection counts of the drains and ceilings.
    pub workers: &'static [usize],
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                quick,
                drain_events: 2_000,
                records: 1_000,
                ceiling_run: Duration::from_secs(2),
                block: Duration::from_secs(5),
                block_events: 2_000,
                hot_events: 1_000,
                slow_events: 320,
                claim_backlogs: &[10_000, 100_000],
                claim_hot_backlogs: &[100_000],
                claim_spread_keys: 100_000,
                claim_samples: 100,
                claim_budget: Duration::from_secs(3),
                idle_samples: 6,
                workers: &[2, 8, 32],
            }
        } else {
            Self {
                quick,
                drain_events: 20_000,
                records: 1_000,
                ceiling_run: Duration::from_secs(5),
                block: Duration::from_secs(10),
                block_events: 5_000,
                hot_events: 10_000,
                slow_events: 1_280,
                claim_backlogs: &[10_000, 100_000, 1_000_000],
                claim_hot_backlogs: &[100_000, 1_000_000],
                claim_spread_keys: 100_000,
                claim_samples: 300,
                claim_budget: Duration::from_secs(10),
                idle_samples: 30,
                workers: &[2, 8, 32],
            }
        }
    }
}

/// The bench database: created fresh, dropped at the end.
struct BenchDb {
    /// The URL of the bench database.
    pub url: String,
    admin: PgConnectOptions,
    name: String,
    /// The bench database through a transaction-pooling PgBouncer (`--pgbouncer-url`).
    pooled_url: Option<String>,
}

impl BenchDb {
    async fn create(url: &str) -> Result<Self> {
        let admin = PgConnectOptions::from_str(url).with_context(|| {
            format!(
                "invalid database url {}",
                outbox_persistence::redact_url(url)
            )
        })?;
        let name = format!("outbox_bench_{}", uuid::Uuid::now_v7().simple());
        let mut conn = admin.connect().await.context("cannot reach PostgreSQL")?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        let url = outbox_persistence::test_support::with_database(url, &name);
        let db = Database::connect(&url, ConnectConfig::default()).await?;
        db.migrate().await?;
        db.close().await;
        Ok(Self {
            url,
            admin,
            name,
            pooled_url: None,
        })
    }

    async fn drop_database(&self) -> Result<()> {
        let mut conn = self.admin.connect().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut conn)
        .await?;
        conn.close().await?;
        Ok(())
    }

    /// A pool of `connections` on the bench database through the PgBouncer (`None` without
    /// one), its wake-ups on the direct URL when `listen`, by polling otherwise.
    pub async fn connect_pooled(&self, connections: u32, listen: bool) -> Result<Option<Database>> {
        let Some(url) = &self.pooled_url else {
            return Ok(None);
        };
        let config = ConnectConfig {
            max_connections: connections,
            acquire_timeout: Duration::from_secs(60),
            listen_url: listen.then(|| self.url.clone()),
            ..ConnectConfig::default()
        };
        Ok(Some(Database::connect(url, config).await?))
    }

    /// A pool of `connections` on the bench database.
    pub async fn connect(&self, connections: u32) -> Result<Database> {
        let config = ConnectConfig {
            max_connections: connections,
            acquire_timeout: Duration::from_secs(60),
            ..ConnectConfig::default()
        };
        Ok(Database::connect(&self.url, config).await?)
    }
}

fn main() -> ExitCode {
    let args = BenchArgs::parse();
    outbox_cli::init_tracing("error");
    outbox_cli::block_on(run(args))
}

/// Runs the benchmark (or the plans, with `--explain`).
async fn run(args: BenchArgs) -> Result<ExitCode> {
    let Some(url) = args.database_url.as_deref() else {
        bail!("no database given: {}", outbox_cli::db::URL_HELP);
    };
    if !url.starts_with("postgres") {
        bail!("`outbox-bench` measures PostgreSQL; point --database-url at a PostgreSQL server");
    }
    let sizes = Sizes::new(args.quick);
    let mut db = BenchDb::create(url).await?;
    db.pooled_url = args.pgbouncer_url.as_deref().map(|pooler| {
        let url = outbox_persistence::test_support::with_database(pooler, &db.name);
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}outbox_pooler=transaction")
    });
    eprintln!("bench database {} created", db.name);
    let result = if args.explain {
        claim::explain(&db, &sizes).await.map(|()| None)
    } else {
        run_scenarios(&db, sizes, &args.only).await.map(Some)
    };
    if let Err(e) = db.drop_database().await {
        eprintln!(
            "warning: could not drop the bench database {}: {e:#}",
            db.name
        );
    }
    if let Some(report) = result? {
        print!("{}", report.table());
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report.json())?);
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn run_scenarios(db: &BenchDb, sizes: Sizes, only: &[String]) -> Result<Report> {
    let mut report = Report::new(sizes.quick, db).await?;
    let wanted = |name: &str| only.is_empty() || only.iter().any(|w| name.contains(w.as_str()));
    if wanted("ceiling") {
        ceiling::run(db, &sizes, &mut report).await?;
    }
    if wanted("drain") {
        scenarios::drains(db, &sizes, &mut report).await?;
    }
    if wanted("writing-drain") && std::env::var_os("OUTBOX_BENCH_AB").is_none() {
        writing::writing_drains(db, &sizes, &mut report).await?;
    }
    if wanted("relay") {
        relay::relay(db, &sizes, &mut report).await?;
    }
    if wanted("webhooks") {
        webhooks::webhooks(db, &sizes, &mut report).await?;
    }
    if wanted("head-of-line") {
        head_of_line::head_of_line(db, &sizes, &mut report).await?;
    }
    if wanted("hot") {
        hot_key::hot_key(db, &sizes, &mut report).await?;
    }
    if wanted("slow") {
        slow::slow_handlers(db, &sizes, &mut report).await?;
        slow::slow_among_fast(db, &mut report).await?;
    }
    if wanted("enqueue") {
        enqueue::enqueue_rate(db, &sizes, &mut report).await?;
    }
    if wanted("idle") {
        idle::idle_pickup(db, &sizes, &mut report).await?;
    }
    if wanted("cost") {
        cost::cost(db, &sizes, &mut report).await?;
    }
    if wanted("claim") {
        claim::select_and_claim(db, &sizes, &mut report).await?;
        claim_sqlite::select_and_claim_sqlite(&sizes, &mut report).await?;
    }
    if wanted("sqlite") {
        sqlite::sqlite_drains(&sizes, &mut report).await?;
    }
    if wanted("retention") {
        retention::retention(db, &sizes, &mut report).await?;
    }
    // Last: it installs the process's metrics recorder, which stays (switched off).
    if wanted("metrics-cost") {
        metrics_cost::metrics_cost(db, &sizes, &mut report).await?;
    }
    // Last: once a pool behind a transaction pooler exists, every statement of this process
    // is sent unnamed (`postgres::caches_statements`), which would change the figures above.
    if wanted("idle") {
        idle::idle_pickup_pooled(db, &sizes, &mut report).await?;
    }
    report.finish().await;
    Ok(report)
}
