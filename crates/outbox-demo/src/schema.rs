//! The demo application's tables: a small CRM whose record-triggered automation runs through
//! the outbox. They belong to the demo, not to the outbox schema, so `outbox migrate` never
//! creates them; the demo and `outbox-demo seed` create them when missing.

use anyhow::Result;
use outbox_persistence::{Database, with_conn};

const POSTGRES: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS DemoAccount (
        Id TEXT PRIMARY KEY, Name TEXT NOT NULL, Industry TEXT, Revision BIGINT NOT NULL,
        CapturedName TEXT, CapturedIndustry TEXT, CapturedRevision BIGINT)",
    "CREATE TABLE IF NOT EXISTS DemoLead (
        Id TEXT PRIMARY KEY, Company TEXT NOT NULL, Status TEXT NOT NULL, Revision BIGINT NOT NULL,
        CapturedStatus TEXT, CapturedRevision BIGINT)",
    "CREATE TABLE IF NOT EXISTS DemoOpportunity (
        SourceLeadId TEXT NOT NULL, Relation TEXT NOT NULL, OpportunityNumber BIGINT NOT NULL,
        Name TEXT NOT NULL,
        CONSTRAINT demo_opportunity_natural_key UNIQUE (SourceLeadId, Relation),
        CONSTRAINT demo_opportunity_number UNIQUE (OpportunityNumber))",
    "CREATE TABLE IF NOT EXISTS DemoEffectLog (
        Seq BIGSERIAL PRIMARY KEY, EventId TEXT NOT NULL, RecordKey TEXT, EventType TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS demo_effect_log_event ON DemoEffectLog (EventId)",
];

const SQLITE: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS DemoAccount (
        Id TEXT PRIMARY KEY, Name TEXT NOT NULL, Industry TEXT, Revision BIGINT NOT NULL,
        CapturedName TEXT, CapturedIndustry TEXT, CapturedRevision BIGINT)",
    "CREATE TABLE IF NOT EXISTS DemoLead (
        Id TEXT PRIMARY KEY, Company TEXT NOT NULL, Status TEXT NOT NULL, Revision BIGINT NOT NULL,
        CapturedStatus TEXT, CapturedRevision BIGINT)",
    "CREATE TABLE IF NOT EXISTS DemoOpportunity (
        SourceLeadId TEXT NOT NULL, Relation TEXT NOT NULL, OpportunityNumber BIGINT NOT NULL,
        Name TEXT NOT NULL,
        CONSTRAINT demo_opportunity_natural_key UNIQUE (SourceLeadId, Relation),
        CONSTRAINT demo_opportunity_number UNIQUE (OpportunityNumber))",
    "CREATE TABLE IF NOT EXISTS DemoEffectLog (
        Seq INTEGER PRIMARY KEY AUTOINCREMENT, EventId TEXT NOT NULL, RecordKey TEXT,
        EventType TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS demo_effect_log_event ON DemoEffectLog (EventId)",
];

/// The receiving side of the simulated mail provider: it keeps one row per idempotency key and
/// counts the duplicate sends it absorbed.
pub const MAILBOX: &str = "CREATE TABLE IF NOT EXISTS DemoMailbox (
    IdempotencyKey TEXT PRIMARY KEY, Recipient TEXT NOT NULL, Subject TEXT NOT NULL,
    Deliveries BIGINT NOT NULL)";

/// Creates the demo tables when missing, and installs the retry audit of the persistence
/// crate's test support: a trigger that records every change of `RetryCount`, in the
/// transaction that made it (so no crash can
/// separate a count from its audit row).
///
/// When the tables exist already it creates nothing, so a role without `CREATE` on the schema
/// (docs/deployment.md, the worker role) can run `work` on a database set up beforehand.
pub async fn ensure(db: &Database) -> Result<()> {
    if exists(db).await? {
        return Ok(());
    }
    let statements = match db {
        Database::Postgres(_) => POSTGRES,
        Database::Sqlite(_) => SQLITE,
    };
    for sql in statements {
        with_conn!(db, |pool| outbox_persistence::statement::query(*sql)
            .execute(pool)
            .await
            .map(|_| ()))?;
    }
    outbox_persistence::test_support::inspect::install_retry_audit(db).await?;
    Ok(())
}

/// Whether the demo tables exist (for `verify` on a database that never ran the demo).
pub async fn exists(db: &Database) -> Result<bool> {
    let sql = match db {
        Database::Postgres(_) => "SELECT to_regclass('demoeffectlog') IS NOT NULL",
        Database::Sqlite(_) => {
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'DemoEffectLog')"
        }
    };
    Ok(with_conn!(db, |pool| {
        outbox_persistence::statement::query_scalar::<_, bool>(sql)
            .fetch_one(pool)
            .await
    })?)
}
