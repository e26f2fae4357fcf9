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
