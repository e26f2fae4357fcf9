//! Operator commands: migrate, status, events, retry, explain, backfill, the consumer map, the
//! gate and prune. Each one changes only what it was asked to change.

use std::process::ExitCode;

use anyhow::{Context, Result};
use chrono::SecondsFormat;
use outbox_events::{
    Consumer, DEFAULT_RETRY_DELAY, DEFAULT_STALE_AFTER, Safeguard, Verdict, evaluate_gate,
};
use outbox_persistence::{
    ClaimPolicy, ConnectConfig, Database, EventFilter, EventStatus, RetryFilter,
};
use serde::Serialize;

use crate::args::{
    AuditArgs, BackfillArgs, EventsArgs, HeadsArgs, PauseArgs, PruneArgs, RetryArgs,
};
use crate::db;

/// `outbox migrate`.
pub async fn migrate(url: Option<&str>) -> Result<ExitCode> {
    let db = db::connect(url, ConnectConfig::default()).await?;
    // A newer schema would make the migrator fail with `VersionMissing`; say what it means.
    if let Err(outbox_persistence::Error::SchemaTooNew { .. }) = db.check_schema().await {
        db::check_schema(&db).await?;
    }
    db.migrate()
        .await
        .map_err(|e| anyhow::anyhow!(e.chain()))
        .context("migrating")?;
    db::check_schema(&db).await?;
    println!("migrations applied ({})", db.backend_name());
    db.close().await;
    Ok(ExitCode::SUCCESS)
}

fn cutoffs() -> ClaimPolicy {
    ClaimPolicy::new(
        DEFAULT_STALE_AFTER,
        DEFAULT_RETRY_DELAY,
        outbox_events::DEFAULT_MAX_RETRY_ATTEMPTS,
    )
}

/// `outbox retry`.
pub async fn retry(url: Option<&str>, args: RetryArgs) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    let filter = match (args.id, args.failed) {
        (Some(id), _) => RetryFilter::Id(id),
        (None, _) => RetryFilter::Failed {
            event_type: args.event_type.clone(),
        },
    };
    let actor = args.actor.name();
    let changed = db
        .repository()
        .retry_failed_by(filter.clone(), &actor)
        .await?;
    tracing::warn!(
        ?filter,
        changed,
        actor,
        "operator returned failed rows to pending"
    );
    println!("{changed} failed row(s) returned to pending");
    db.close().await;
    if changed == 0 && args.id.is_some() {
        eprintln!("no failed row with that id");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// `outbox pause` (`pause`) and `outbox resume`.
pub async fn pause(url: Option<&str>, args: PauseArgs, pause: bool) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    let repo = db.repository();
    let actor = args.actor.name();
    let changed = if pause {
        repo.pause_event_type(&args.event_type, &actor).await?
    } else {
        repo.resume_event_type(&args.event_type, &actor).await?
    };
    db.close().await;
    let (done, already) = if pause {
        ("paused: workers stop claiming it", "was paused already")
    } else {
        ("resumed: workers claim it again", "was not paused")
    };
    if changed {
        tracing::warn!(
            event_type = args.event_type,
            actor,
            pause,
            "operator changed a pause"
        );
        println!(
            "{:?} {done} within {:?}",
            args.event_type,
            outbox_events::PAUSE_REFRESH
        );
    } else {
        println!("{:?} {already}; nothing changed", args.event_type);
    }
    Ok(ExitCode::SUCCESS)
}

/// `outbox audit`.
pub async fn audit(url: Option<&str>, args: AuditArgs) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    let entries = db.repository().audit_log(args.limit).await?;
    db.close().await;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&entries)?);
    } else {
        for e in &entries {
            println!(
                "{}  {:<8} {:<20} {}",
                e.at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                e.action,
                e.actor,
                e.detail
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What `outbox heads` found (and did).
#[derive(Debug, Serialize)]
struct HeadsReport {
    /// Keys whose head differed from the outbox rows (at most 1,000).
    differing_keys: Vec<String>,
    /// Heads after a rebuild, when `--rebuild` ran one.
    rebuilt_heads: Option<u64>,
    /// Keys `--repair` put right, by kind.
    repaired: Option<RepairedHeads>,
    /// Keys that still differ after the rebuild or repair (after a repair: keys another
    /// transaction held, or that writers changed meanwhile).
    differing_after_rebuild: Option<Vec<String>>,
}

/// The keys one repair changed.
#[derive(Debug, Serialize)]
struct RepairedHeads {
    misplaced: Vec<String>,
    left_over: Vec<String>,
    missing: Vec<String>,
}

/// `outbox heads [--rebuild | --repair]`: the claim's candidate list (`_System_OutboxHead`,
/// derived state) checked against the outbox rows; exits 1 when they differ (and still differ
/// after a rebuild or repair). While writers race, a key can differ until the dispatchers'
/// next repair (see `docs/queries.md`, "Why a head cannot hide a row").
pub async fn heads(url: Option<&str>, args: HeadsArgs) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    let differing_keys = db.check_heads().await?;
    let mut report = HeadsReport {
        differing_keys,
        rebuilt_heads: None,
        repaired: None,
        differing_after_rebuild: None,
    };
    if args.rebuild {
        report.rebuilt_heads = Some(db.rebuild_heads().await?);
        report.differing_after_rebuild = Some(db.check_heads().await?);
    } else if args.repair && !report.differing_keys.is_empty() {
        let mut repair = db
            .repository()
            .repair_heads(outbox_persistence::DEFAULT_HEADS_REPAIR_KEYS)
            .await?;
        if repair.skipped {
            // A dispatcher is repairing at this moment: let it finish, then repair again.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            repair = db
                .repository()
                .repair_heads(outbox_persistence::DEFAULT_HEADS_REPAIR_KEYS)
                .await?;
        }
        report.repaired = Some(RepairedHeads {
            misplaced: repair.misplaced,
            left_over: repair.left_over,
            missing: repair.missing,
        });
        report.differing_after_rebuild = Some(db.check_heads().await?);
    }
    db.close().await;
    let consistent = match &report.differing_after_rebuild {
        Some(after) => after.is_empty(),
        None => report.differing_keys.is_empty(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_heads(&report);
    }
    Ok(if consistent {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_heads(report: &HeadsReport) {
    if report.differing_keys.is_empty() {
        println!("heads: consistent with the outbox rows");
    } else {
        println!(
            "heads: {} keys differ from the outbox rows (their records still run; the order in which records are looked at is off, or the table holds rows it need not, until repaired):",
            report.differing_keys.len()
        );
        for key in &report.differing_keys {
            println!("  {key}");
        }
    }
    if let Some(n) = report.rebuilt_heads {
        println!("rebuilt: {n} heads");
    }
    if let Some(r) = &report.repaired {
        println!(
            "repaired: {} out of place, {} left over, {} missing",
            r.misplaced.len(),
            r.left_over.len(),
            r.missing.len()
        );
    }
    match &report.differing_after_rebuild {
        Some(after) if after.is_empty() => println!("heads: consistent now"),
        Some(after) => println!(
            "heads: {} keys still differ (held by another transaction, or changed meanwhile): run again",
            after.len()
        ),
        None => {}
    }
}

/// `outbox explain`: the PostgreSQL plans of the eligible query and the claim.
pub async fn explain(url: Option<&str>) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    let Database::Postgres(pool) = &db else {
        anyhow::bail!(
            "`outbox explain` prints PostgreSQL plans; point --database-url at PostgreSQL"
        );
    };
    for (name, plan) in outbox_persistence::postgres::explain(pool, cutoffs()).await? {
        println!("== {name}");
        print_plan(&plan);
    }
    db.close().await;
    Ok(ExitCode::SUCCESS)
}

fn print_plan(plan: &[String]) {
    for line in plan {
        println!("{line}");
    }
    println!();
}

/// `outbox backfill-record-keys`.
pub async fn backfill(url: Option<&str>, args: BackfillArgs) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    let repo = db.repository();
    let mut after = args.after;
    let (mut scanned, mut updated, mut already, mut no_record) = (0, 0, 0, 0);
    let mut in_flight = Vec::new();
    let mut underivable = Vec::new();
    let mut mismatched = Vec::new();
    loop {
        let page = repo
            .backfill_record_keys(after, args.batch, args.dry_run)
            .await?;
        scanned += page.scanned;
        updated += page.updated;
        already += page.already_set;
        no_record += page.no_record;
        underivable.extend(page.underivable);
        mismatched.extend(page.mismatched);
        in_flight.extend(page.in_flight);
        after = page.next_after;
        match after {
            Some(last) => eprintln!(
                "… {scanned} rows scanned, {updated} keys {}; resume with --after {last}",
                if args.dry_run { "to set" } else { "set" }
            ),
            None => break,
        }
    }
    println!(
        "backfill {}: {scanned} non-terminal rows scanned, {updated} keys {}, {already} already set, {no_record} about no record, {} underivable, {} stored keys that differ from the payload, {} in flight (left unkeyed: run again to key them if they return to pending)",
        if args.dry_run {
            "(dry run)"
        } else {
            "complete"
        },
        if args.dry_run { "missing" } else { "set" },
        underivable.len(),
        mismatched.len(),
        in_flight.len()
    );
    for (id, why) in &underivable {
        println!("  underivable {id}: {why}");
    }
    for id in &mismatched {
        println!("  mismatched  {id}");
    }
    for id in &in_flight {
        println!("  in flight   {id}");
    }
    db.close().await;
    Ok(ExitCode::SUCCESS)
}

/// One row of the consumer map.
#[derive(Debug, Serialize)]
pub struct MapRow {
    event_type: String,
    consumer: String,
    effect_class: String,
    effect: String,
    contract_or_exclusion: String,
    verdict: String,
}

fn class_name(kind: &outbox_events::EffectKind) -> String {
    use outbox_events::EffectKind::*;
    match kind {
        DeterministicFieldSet => "deterministic field set".into(),
        NonDeterministicFieldSet { reasons } => {
            format!("non-deterministic field set ({})", reasons.join("; "))
        }
        NaturalKeyCreate { natural_key } => format!("natural-key create {natural_key}"),
        StateDependent => "state-dependent".into(),
        External { kind } => format!("external ({kind:?})").to_lowercase(),
    }
}

fn verdict_name(v: &Verdict) -> String {
    match v {
        Verdict::Safe => "safe".into(),
        Verdict::Protected => "protected".into(),
        Verdict::Excluded => "excluded".into(),
        Verdict::Blocked(why) => format!("BLOCKED: {why}"),
    }
}

/// The consumer map of this binary's registered consumers.
pub fn consumer_map(consumers: &[Consumer]) -> Vec<MapRow> {
    let mut rows = Vec::new();
    for c in consumers {
        let verdict = verdict_name(&c.verdict());
        if c.effects.is_empty() {
            rows.push(MapRow {
                event_type: c.event_type.clone(),
                consumer: c.name.clone(),
                effect_class: "undeclared".into(),
                effect: String::new(),
                contract_or_exclusion: String::new(),
                verdict: verdict.clone(),
            });
        }
        for e in &c.effects {
            rows.push(MapRow {
                event_type: c.event_type.clone(),
                consumer: c.name.clone(),
                effect_class: class_name(&e.kind),
                effect: e.description.clone(),
                contract_or_exclusion: e
                    .safeguard
                    .as_ref()
                    .map_or_else(|| "-".into(), Safeguard::describe),
                verdict: verdict.clone(),
            });
        }
    }
    rows
}

/// Renders the consumer map as a Markdown table (also the body of `docs/consumer-map.md`).
pub fn consumer_map_markdown(rows: &[MapRow]) -> String {
    let mut out = String::from(
        "| event type | consumer | effect class | effect | contract or exclusion | verdict |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} | {} |\n",
            r.event_type, r.consumer, r.effect_class, r.effect, r.contract_or_exclusion, r.verdict
        ));
    }
    out
}

/// `outbox consumers`.
pub fn consumers(consumers: &[Consumer], json: bool) -> Result<ExitCode> {
    if consumers.is_empty() && !json {
        eprintln!(
            "this binary registers no consumers; the map of a service's consumers comes from its own binary (mount outbox_cli::OperatorCommand, as outbox-demo does)"
        );
    }
    let rows = consumer_map(consumers);
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", consumer_map_markdown(&rows));
    }
    Ok(ExitCode::SUCCESS)
}

/// `outbox gate`.
pub async fn gate(url: Option<&str>, consumers: &[Consumer], json: bool) -> Result<ExitCode> {
    // A binary that registers no consumer has nothing to judge: the flag's safety depends on
    // the consumers of the service that runs the workers. Fail closed, never "passed".
    if consumers.is_empty() {
        eprintln!(
            "gate refused: this binary registers no consumers, so it cannot judge whether OUTBOX_PULL_WORKER may flip; run the gate from the service that registers the handlers (mount outbox_cli::OperatorCommand in its binary, as outbox-demo does)"
        );
        return Ok(ExitCode::FAILURE);
    }
    let db = db::open(url, ConnectConfig::default()).await?;
    let report = evaluate_gate(&db.repository(), consumers).await?;
    db.close().await;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else if report.passes() {
        println!(
            "gate passed: OUTBOX_PULL_WORKER may flip ({} consumers; excluded, kept on the legacy path: {:?})",
            report.consumers.len(),
            report.excluded_event_types()
        );
    } else {
        for reason in &report.reasons {
            println!("{reason}");
        }
    }
    Ok(if report.passes() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `outbox events`: the rows as [`outbox_persistence::EventRow`] prints them (never a
/// payload; timestamps with microseconds, so equal stored values print equal).
pub async fn events(url: Option<&str>, args: EventsArgs) -> Result<ExitCode> {
    let mut filter = EventFilter::new().limit(args.limit);
    let mut statuses = Vec::new();
    for s in &args.status {
        statuses.push(
            s.parse::<EventStatus>()
                .map_err(|e| anyhow::anyhow!("--status {s}: {e}"))?,
        );
    }
    if !statuses.is_empty() {
        filter = filter.statuses(statuses);
    }
    if let Some(t) = &args.event_type {
        filter = filter.event_type(t.clone());
    }
    if !args.id.is_empty() {
        filter = filter.ids(args.id.iter().copied());
    }
    if let Some(k) = &args.key {
        filter = filter.record_key(k.clone());
    }
    let db = db::open(url, ConnectConfig::default()).await?;
    let rows = db.repository().list_events(filter).await?;
    db.close().await;
    if args.json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    let micros = |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(SecondsFormat::Micros, true);
    for r in &rows {
        println!(
            "{}  {:<10}  {:<24}  {:<24}  created {}  modified {}  retries {}{}",
            r.id,
            r.status,
            r.event_type,
            r.record_key.as_ref().map_or("-", |k| k.as_str()),
            micros(r.created_date),
            micros(r.last_modified_date),
            r.retry_count,
            r.last_error
                .as_deref()
                .map_or(String::new(), |e| format!("  last error: {e}"))
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `outbox prune`: deletes terminal rows older than the ages given, batch after batch, until a
/// batch is not full; `--dry-run` counts them instead. Safe beside running workers and other
/// pruners (see `docs/retention.md`).
pub async fn prune(url: Option<&str>, args: PruneArgs) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    let repo = db.repository();
    let policy = args.policy();
    let report = if args.dry_run {
        repo.count_prunable(policy).await?
    } else {
        let mut total = outbox_persistence::PruneReport::default();
        let mut batches = 0_u64;
        loop {
            let batch = repo.prune(policy).await?;
            total.add(batch);
            batches += 1;
            if !batch.more {
                break;
            }
            if batches.is_multiple_of(100) && !args.json {
                eprintln!("… {} rows deleted so far", total.total());
            }
            tokio::time::sleep(std::time::Duration::from_millis(args.pause_ms)).await;
        }
        total
    };
    db.close().await;
    tracing::info!(
        ?policy,
        ?report,
        dry_run = args.dry_run,
        "operator pruned terminal rows"
    );
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "dry_run": args.dry_run,
                "processed": report.processed,
                "failed": report.failed,
            })
        );
    } else {
        let age = |a: Option<std::time::Duration>| a.map_or("never".into(), |d| format!("{d:?}"));
        println!(
            "{} {} processed row(s) older than {} and {} failed row(s) older than {}",
            if args.dry_run {
                "would delete"
            } else {
                "deleted"
            },
            report.processed,
            age(policy.processed_older_than),
            report.failed,
            age(policy.failed_older_than),
        );
    }
    Ok(ExitCode::SUCCESS)
}
