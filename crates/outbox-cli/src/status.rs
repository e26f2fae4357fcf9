//! `outbox status`: the queue's counts and the keys blocked the longest; with `--key`, one
//! record's non-terminal rows in order and why its head is not running now ("why is this
//! record stuck?").

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use chrono::{DateTime, SecondsFormat, Utc};
use clap::Args;
use outbox_events::{DEFAULT_MAX_RETRY_ATTEMPTS, DEFAULT_RETRY_DELAY, DEFAULT_STALE_AFTER};
use outbox_persistence::{
    BlockedKey, ClaimPolicy, ConnectConfig, EventRow, KeyReport, OutboxStats, PausedType,
};
use serde::Serialize;

use crate::db;

/// `status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// One record's rows and why its head is not running (the stored key, for example
    /// `lead:00Q5e00000AbCdE`).
    #[arg(long)]
    pub key: Option<String>,
    /// How many of the longest-blocked keys to list.
    #[arg(long, default_value_t = 10)]
    pub blocked: u32,
    /// The workers' stale-after, in milliseconds, to judge heartbeats by (their default when
    /// absent).
    #[arg(long)]
    pub stale_after_ms: Option<u64>,
    /// The workers' base retry delay, in milliseconds (their default when absent).
    #[arg(long)]
    pub retry_delay_ms: Option<u64>,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
    /// Read from this hot standby of the database (a streaming replica) instead of the
    /// primary; the output says how far behind it is.
    #[arg(long)]
    pub read_database_url: Option<String>,
}

impl StatusArgs {
    fn policy(&self) -> ClaimPolicy {
        ClaimPolicy::new(
            self.stale_after_ms
                .map_or(DEFAULT_STALE_AFTER, Duration::from_millis),
            self.retry_delay_ms
                .map_or(DEFAULT_RETRY_DELAY, Duration::from_millis),
            DEFAULT_MAX_RETRY_ATTEMPTS,
        )
    }
}

/// `status --json` without `--key`: the counts at the top level, and the blocked keys.
#[derive(Serialize)]
struct StatusDoc {
    #[serde(flatten)]
    stats: OutboxStats,
    blocked_keys: Vec<BlockedKey>,
    paused_event_types: Vec<PausedType>,
    /// The webhook endpoints (never their secrets).
    webhook_endpoints: Vec<outbox_webhooks::WebhookEndpoint>,
}

/// `outbox status`.
pub async fn run(url: Option<&str>, args: StatusArgs) -> Result<ExitCode> {
    let db = match &args.read_database_url {
        Some(standby) => {
            let db = db::open_standby(standby).await?;
            if let Some(lag) = outbox_persistence::console::replica_lag(&db).await? {
                let behind = lag
                    .behind_seconds
                    .map_or("no transaction replayed yet".to_string(), |s| {
                        format!("data as of {s:.1} s ago")
                    });
                let caught_up = match (lag.streaming, lag.caught_up) {
                    (false, _) => ", NOT streaming from the primary: the data may be old",
                    (true, true) => ", caught up",
                    (true, false) => ", replaying",
                };
                eprintln!("read from a hot standby: {behind}{caught_up}");
            } else {
                eprintln!("warning: --read-database-url is not a standby (not in recovery)");
            }
            db
        }
        None => db::open(url, ConnectConfig::default()).await?,
    };
    let repo = db.repository();
    let policy = args.policy();
    if let Some(key) = &args.key {
        let report = outbox_persistence::key_report(repo.as_ref(), key, policy).await?;
        db.close().await;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print_key(&report);
        }
        return Ok(ExitCode::SUCCESS);
    }
    let stats = repo.stats(policy).await?;
    let blocked = repo.blocked_keys(policy, args.blocked).await?;
    let paused = repo.paused_event_types().await?;
    // Best effort: a role refused the webhooks' table, or a database before their migration,
    // still gets the queue's status.
    let endpoints = match outbox_webhooks::Webhooks::new(repo, Default::default())
        .list()
        .await
    {
        Ok(endpoints) => endpoints,
        Err(e) => {
            eprintln!("warning: the webhook endpoints could not be read: {e}");
            Vec::new()
        }
    };
    db.close().await;
    if args.json {
        let doc = StatusDoc {
            stats,
            blocked_keys: blocked,
            paused_event_types: paused,
            webhook_endpoints: endpoints,
        };
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_stats(&stats, policy);
        print_paused(&paused);
        print_endpoints(&endpoints);
        print_blocked(&blocked);
    }
    Ok(ExitCode::SUCCESS)
}

fn ts(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn print_stats(stats: &OutboxStats, policy: ClaimPolicy) {
    println!("pending      {}", stats.pending);
    println!(
        "processing   {} ({} stale: heartbeat older than {:?})",
        stats.processing, stats.stale_claims, policy.stale_after
    );
    if stats.processed_estimated {
        println!(
            "processed    about {} (the planner's estimate: the table is large)",
            stats.processed
        );
    } else {
        println!("processed    {}", stats.processed);
    }
    println!("failed       {}", stats.failed);
    println!(
        "retrying     {} pending rows that failed before",
        stats.retrying
    );
    println!(
        "oldest pending  {}",
        stats
            .oldest_pending_age_seconds
            .map_or("none".to_string(), |s| format!("{s:.1} s"))
    );
    println!(
        "blocked keys    {} behind a running head, {} behind a stale head, {} behind a head waiting for its retry",
        stats.keys_blocked_by_running, stats.keys_blocked_by_stale, stats.keys_blocked_by_retry
    );
}

fn print_paused(paused: &[PausedType]) {
    for p in paused {
        if p.event_type
            .starts_with(outbox_webhooks::DELIVERY_TYPE_PREFIX)
        {
            // A disabled endpoint's deliveries: shown with the endpoint.
            continue;
        }
        println!(
            "paused          {} (by {} since {}; no worker claims it until `outbox resume`)",
            p.event_type,
            p.paused_by,
            ts(p.paused_at)
        );
    }
}

fn print_endpoints(endpoints: &[outbox_webhooks::WebhookEndpoint]) {
    if endpoints.is_empty() {
        return;
    }
    let disabled: Vec<_> = endpoints.iter().filter(|e| !e.enabled).collect();
    println!(
        "webhooks        {} endpoint(s), {} disabled",
        endpoints.len(),
        disabled.len()
    );
    for e in disabled {
        println!(
            "  DISABLED      {} ({}); its deliveries wait until `outbox webhooks enable {}`",
            e.name,
            e.disabled_reason.as_deref().unwrap_or("no reason given"),
            e.name
        );
    }
}

fn print_blocked(blocked: &[BlockedKey]) {
    if blocked.is_empty() {
        return;
    }
    println!();
    println!("longest-blocked keys (outbox status --key KEY explains one):");
    for b in blocked {
        println!(
            "  {}  {} waiting since {}; head {}: {}",
            b.head.record_key.as_ref().map_or("-", |k| k.as_str()),
            b.waiting,
            ts(b.waiting_since),
            b.head.id,
            b.state.describe()
        );
    }
}

fn print_row(r: &EventRow) {
    println!(
        "  {}  {:<10}  {:<24}  created {}  modified {}  retries {}{}",
        r.id,
        r.status,
        r.event_type,
        ts(r.created_date),
        ts(r.last_modified_date),
        r.retry_count,
        r.last_error
            .as_deref()
            .map_or(String::new(), |e| format!("  last error: {e}"))
    );
}

fn print_key(report: &KeyReport) {
    println!("key {} at {}", report.record_key, ts(report.now));
    match &report.head {
        None => println!("no pending or processing row: nothing is blocked"),
        Some(state) => {
            println!("head: {}", state.describe());
            if report.rows_total > report.rows.len() as u64 {
                println!(
                    "{}{} non-terminal row(s); the oldest {} shown:",
                    if report.rows_total_exact {
                        ""
                    } else {
                        "more than "
                    },
                    report.rows_total,
                    report.rows.len()
                );
            } else {
                println!("{} non-terminal row(s), oldest first:", report.rows.len());
            }
            for r in &report.rows {
                print_row(r);
            }
        }
    }
    if let Some(f) = &report.last_failed {
        println!("newest failed row (it released the rows behind it):");
        print_row(f);
    }
    if !report.effects.is_empty() {
        println!("external effects the ledger records for these rows (never run again):");
        for e in &report.effects {
            println!(
                "  {} {}/{} key {} at {} result {}",
                e.event_id,
                e.handler_id,
                e.effect_key,
                e.idempotency_key,
                ts(e.recorded_date),
                e.result.as_deref().unwrap_or("none")
            );
        }
    }
}
