//! Measures what zero-burn autonumbers cost on PostgreSQL: natural-key creates per second with
//! the `_System_Autonumber` counter row, without an autonumber, and for redeliveries that find
//! the row; then the same creates with extra work held inside each transaction, which is where
//! serialising the creators of one object shows.
//!
//! ```text
//! cargo run --release -p create-action --example zero_burn -- [CREATES] [WORKERS] [HOLD_MS]
//! ```
//!
//! It connects to `DATABASE_URL` (default `postgres://root@127.0.0.1:5432/test`), works in a
//! scratch database of its own and drops it at the end. Each create is one transaction on its
//! own key; `WORKERS` connections create concurrently.

use std::sync::Arc;
use std::time::{Duration, Instant};

use create_action::{ColumnType, EventEnvelope, FindOrCreate, ObjectDef, Source, autonumber};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};

const DEFAULT_URL: &str = "postgres://root@127.0.0.1:5432/test";

const SCHEMA: &str = "
CREATE TABLE Plain (
    Id           BIGSERIAL PRIMARY KEY,
    SourceLeadId TEXT NOT NULL,
    Name         TEXT NOT NULL,
    CONSTRAINT plain_natural_key UNIQUE (SourceLeadId)
);
CREATE TABLE Numbered (
    Id           BIGSERIAL PRIMARY KEY,
    SourceLeadId TEXT   NOT NULL,
    Name         TEXT   NOT NULL,
    Number       BIGINT NOT NULL,
    CONSTRAINT numbered_natural_key UNIQUE (SourceLeadId)
);";

fn action(table: &str, with_autonumber: bool) -> FindOrCreate {
    let mut def = ObjectDef::builder(table)
        .read_only("Id", ColumnType::Integer)
        .natural_key("SourceLeadId", ColumnType::Text)
        .field("Name", ColumnType::Text);
    if with_autonumber {
        def = def.autonumber("Number");
    }
    FindOrCreate::builder(Arc::new(def.build().expect("a valid definition")))
        .key("SourceLeadId", Source::RecordId)
        .field("Name", Source::snapshot("Company"))
        .build()
        .expect("a valid action")
}

/// Runs `creates` find-or-creates of keys `{prefix}-{i}` on `workers` connections; returns
/// creates per second and how many rows were created.
async fn run(
    pool: &PgPool,
    action: &Arc<FindOrCreate>,
    prefix: &str,
    creates: usize,
    workers: usize,
    hold: Duration,
) -> (f64, usize) {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (pool, action, prefix) = (pool.clone(), Arc::clone(action), prefix.to_string());
        tasks.push(tokio::spawn(async move {
            let mut created = 0;
            for i in (w..creates).step_by(workers) {
                let event = EventEnvelope::from_value(json!({
                    "object": "Lead",
                    "record_id": format!("{prefix}-{i}"),
                    "snapshot": {"Company": "Acme"},
                }))
                .expect("a valid event");
                let mut tx = pool.begin().await.expect("begin");
                let outcome = action.run(&mut *tx, &event).await.expect("find-or-create");
                if !hold.is_zero() {
                    // Other work of the same attempt, after the create: the counter row stays
                    // locked until commit.
                    sqlx::query("SELECT pg_sleep($1)")
                        .bind(hold.as_secs_f64())
                        .execute(&mut *tx)
                        .await
                        .expect("hold");
                }
                tx.commit().await.expect("commit");
                created += usize::from(outcome.created);
            }
            created
        }));
    }
    let mut created = 0;
    for task in tasks {
        created += task.await.expect("a worker");
    }
    (creates as f64 / started.elapsed().as_secs_f64(), created)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg =
        |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (creates, workers, hold_ms) = (arg(0, 4000), arg(1, 4), arg(2, 1));
    let hold = Duration::from_millis(hold_ms as u64);
    let admin_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_string());
    let name = format!("create_action_bench_{}", std::process::id());
    let mut admin = PgConnection::connect(&admin_url).await.expect("connect");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("create the scratch database");
    let (base, _) = admin_url.rsplit_once('/').expect("a database in the URL");
    let pool = PgPoolOptions::new()
        .max_connections(workers as u32 + 1)
        .connect(&format!("{base}/{name}"))
        .await
        .expect("connect to the scratch database");
    sqlx::raw_sql(include_str!(
        "../../../migrations/postgres/0002_create_action.sql"
    ))
    .execute(&pool)
    .await
    .expect("the counter table");
    sqlx::raw_sql(SCHEMA)
        .execute(&pool)
        .await
        .expect("the schema");

    let plain = Arc::new(action("Plain", false));
    let numbered = Arc::new(action("Numbered", true));
    println!("{creates} creates per scenario, {workers} workers, PostgreSQL");
    let scenarios: [(&str, &Arc<FindOrCreate>, &str, Duration); 5] = [
        ("no autonumber", &plain, "a", Duration::ZERO),
        ("autonumber (counter row)", &numbered, "a", Duration::ZERO),
        ("redelivery, finds the row", &numbered, "a", Duration::ZERO),
        ("no autonumber, hold", &plain, "b", hold),
        ("autonumber, hold", &numbered, "b", hold),
    ];
    for (label, action, prefix, hold) in scenarios {
        let (per_sec, created) = run(&pool, action, prefix, creates, workers, hold).await;
        let label = if hold.is_zero() {
            label.to_string()
        } else {
            format!("{label} {} ms", hold.as_millis())
        };
        println!("{label:<36} {per_sec:>9.0} /s   created {created}");
    }
    let mut conn = pool.acquire().await.expect("a connection");
    let next = autonumber::next_value(&mut *conn, "Numbered", "Number")
        .await
        .expect("the counter");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM Numbered")
        .fetch_one(&mut *conn)
        .await
        .expect("count");
    let gaps: i64 = sqlx::query_scalar("SELECT max(Number) - count(*) FROM Numbered")
        .fetch_one(&mut *conn)
        .await
        .expect("gaps");
    println!("numbered rows {rows}, next value {next:?}, gaps {gaps}");
    drop(conn);
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {name} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await
    .expect("drop the scratch database");
}
