//! Arguments that a binary built on the outbox shares with `outbox`: `--json`, the worker
//! options (mapped onto [`WorkerConfig`]), the dispatch mode, and the operator commands'
//! arguments.

use std::time::Duration;

use clap::{Args, ValueEnum};
use outbox_events::{DispatchMode, WorkerConfig};
use uuid::Uuid;

/// `--json`.
#[derive(Debug, Args)]
pub struct JsonArg {
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Which dispatcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Independent pull workers.
    Pull,
    /// The legacy batch dispatcher.
    Legacy,
}

impl From<Mode> for DispatchMode {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Pull => DispatchMode::Pull,
            Mode::Legacy => DispatchMode::Legacy,
        }
    }
}

/// Worker settings for a binary that runs workers (flatten it into its arguments).
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Concurrent workers.
    #[arg(long, default_value_t = outbox_events::DEFAULT_WORKERS)]
    pub workers: usize,
    /// Share of handler attempts that fail on purpose (handler errors and lock timeouts).
    #[arg(long)]
    pub fault_rate: Option<f64>,
    /// Heartbeat interval in milliseconds.
    #[arg(long)]
    pub heartbeat_ms: Option<u64>,
    /// Stale-after in milliseconds.
    #[arg(long)]
    pub stale_after_ms: Option<u64>,
    /// Lock timeout of an attempt in milliseconds.
    #[arg(long)]
    pub lock_timeout_ms: Option<u64>,
    /// Base retry delay in milliseconds.
    #[arg(long)]
    pub retry_delay_ms: Option<u64>,
    /// Longest retry delay in milliseconds (the delay doubles per failure up to this).
    #[arg(long)]
    pub max_retry_delay_ms: Option<u64>,
    /// MaxRetryAttempts.
    #[arg(long)]
    pub max_retry_attempts: Option<i32>,
    /// The most events one attempt transaction runs (batched attempts; 1 turns them off).
    #[arg(long)]
    pub batch_max_events: Option<usize>,
    /// A batched attempt stops taking events once its handlers ran this long, in milliseconds.
    #[arg(long)]
    pub batch_budget_ms: Option<u64>,
    /// Writing handlers share a batch's transaction for up to this many milliseconds (at most
    /// 250; off by default), their later lock waits bounded: docs/state-machine.md, "Batched
    /// attempts", rule 11, says what it trades.
    #[arg(long)]
    pub shared_writes_ms: Option<u64>,
}

impl WorkerArgs {
    /// The worker configuration, on top of `base`.
    pub fn config(&self, base: WorkerConfig) -> WorkerConfig {
        let ms = Duration::from_millis;
        let mut c = base.with_workers(self.workers);
        if let Some(v) = self.heartbeat_ms {
            c = c.with_heartbeat_interval(ms(v));
        }
        if let Some(v) = self.stale_after_ms {
            c = c.with_stale_after(ms(v));
        }
        if let Some(v) = self.lock_timeout_ms {
            c = c.with_lock_timeout(ms(v));
        }
        if let Some(v) = self.retry_delay_ms {
            c = c.with_retry_delay(ms(v));
        }
        if let Some(v) = self.max_retry_delay_ms {
            c = c.with_max_retry_delay(ms(v));
        }
        if let Some(v) = self.max_retry_attempts {
            c = c.with_max_retry_attempts(v);
        }
        if self.batch_max_events.is_some() || self.batch_budget_ms.is_some() {
            let events = self.batch_max_events.unwrap_or(c.batch_max_events);
            let budget = self.batch_budget_ms.map_or(c.batch_budget, ms);
            c = c.with_batches(events, budget);
        }
        if let Some(v) = self.shared_writes_ms {
            c = c.with_shared_writes(ms(v));
        }
        c
    }
}

/// `outbox retry`.
#[derive(Debug, Args)]
pub struct RetryArgs {
    /// Return this failed row to pending.
    #[arg(long, conflicts_with = "failed", required_unless_present = "failed")]
    pub id: Option<Uuid>,
    /// Return every failed row to pending.
    #[arg(long)]
    pub failed: bool,
    /// With --failed: only rows of this event type.
    #[arg(long, requires = "failed")]
    pub event_type: Option<String>,
    /// Who acts (the audit log's actor).
    #[command(flatten)]
    pub actor: ActorArg,
}

/// Who acts, for the audit log.
#[derive(Debug, Args)]
pub struct ActorArg {
    /// Who is acting, as the audit log records it (default: `cli:` and the login name).
    #[arg(long, env = "OUTBOX_ACTOR")]
    pub actor: Option<String>,
}

impl ActorArg {
    /// The actor's name: `--actor`, else `cli:$USER`.
    pub fn name(&self) -> String {
        self.actor.clone().unwrap_or_else(|| {
            let user = std::env::var("USER")
                .or_else(|_| std::env::var("LOGNAME"))
                .unwrap_or_else(|_| "unknown".to_string());
            format!("cli:{user}")
        })
    }
}

/// `outbox pause` and `outbox resume`.
#[derive(Debug, Args)]
pub struct PauseArgs {
    /// The event type.
    pub event_type: String,
    /// Who acts (the audit log's actor).
    #[command(flatten)]
    pub actor: ActorArg,
}

/// `outbox audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// How many of the newest entries to print.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `outbox heads`.
#[derive(Debug, Args)]
pub struct HeadsArgs {
    /// Rebuild the heads table from the outbox rows (holds the outbox's writers off while it
    /// runs), then check again.
    #[arg(long, conflicts_with = "repair")]
    pub rebuild: bool,
    /// Repair the keys that differ without holding anybody off (what the dispatchers do
    /// periodically: a key another transaction holds is left as it is), then check again.
    #[arg(long)]
    pub repair: bool,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `outbox backfill-record-keys`.
#[derive(Debug, Args)]
pub struct BackfillArgs {
    /// Rows per batch.
    #[arg(long, default_value_t = 1_000)]
    pub batch: u32,
    /// Resume after this id (printed by an interrupted run).
    #[arg(long)]
    pub after: Option<Uuid>,
    /// Report what would change without writing.
    #[arg(long)]
    pub dry_run: bool,
}

/// `events`: which rows to list.
#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Only rows in these statuses (pending, processing, processed, failed; repeatable).
    #[arg(long, value_delimiter = ',')]
    pub status: Vec<String>,
    /// Only rows of this event type.
    #[arg(long)]
    pub event_type: Option<String>,
    /// Only these rows (repeatable).
    #[arg(long, value_delimiter = ',')]
    pub id: Vec<Uuid>,
    /// Only rows of this record key.
    #[arg(long)]
    pub key: Option<String>,
    /// At most this many rows.
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `outbox prune`: which terminal rows to delete.
#[derive(Debug, Args)]
pub struct PruneArgs {
    /// Delete `processed` rows that became terminal longer ago than this (`90s`, `30m`, `12h`,
    /// `7d`), or `never` to keep them.
    #[arg(long, default_value = "7d", value_parser = parse_age)]
    pub processed_older_than: Age,
    /// Delete `failed` rows that became terminal longer ago than this, or `never` (failed rows
    /// are evidence: kept longer by default).
    #[arg(long, default_value = "30d", value_parser = parse_age)]
    pub failed_older_than: Age,
    /// Rows per batch (per status); each batch is one short transaction.
    #[arg(long, default_value_t = outbox_persistence::DEFAULT_PRUNE_BATCH)]
    pub batch: u32,
    /// Pause between two full batches, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub pause_ms: u64,
    /// Count what would be deleted, deleting nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

/// An age given on the command line: a duration, or `None` for `never`.
pub type Age = Option<Duration>;

impl PruneArgs {
    /// The policy these arguments ask for.
    pub fn policy(&self) -> outbox_persistence::PrunePolicy {
        outbox_persistence::PrunePolicy::default()
            .processed_older_than(self.processed_older_than)
            .failed_older_than(self.failed_older_than)
            .batch_size(self.batch)
    }
}

/// Reads an age: a whole number with a unit (`s`, `m`, `h`, `d`), or `never`.
pub fn parse_age(text: &str) -> Result<Age, String> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("never") {
        return Ok(None);
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?}: give a unit (s, m, h or d), e.g. 7d"))?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?}: expected a number followed by s, m, h or d"))?;
    let seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        other => return Err(format!("{text:?}: unknown unit {other:?} (s, m, h or d)")),
    };
    n.checked_mul(seconds)
        .map(|s| Some(Duration::from_secs(s)))
        .ok_or_else(|| format!("{text:?}: too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_with_units_or_never() {
        assert_eq!(parse_age("90s"), Ok(Some(Duration::from_secs(90))));
        assert_eq!(parse_age("30m"), Ok(Some(Duration::from_secs(1_800))));
        assert_eq!(parse_age("12h"), Ok(Some(Duration::from_secs(43_200))));
        assert_eq!(parse_age("7d"), Ok(Some(Duration::from_secs(604_800))));
        assert_eq!(parse_age("never"), Ok(None));
        assert_eq!(parse_age("0s"), Ok(Some(Duration::ZERO)));
        for bad in ["7", "d", "7w", "-1d", "7 d", ""] {
            assert!(parse_age(bad).is_err(), "{bad}");
        }
    }
}
