//! What the workers count, two ways: [`Metrics`], counters the embedding application reads in
//! process ([`MetricsSnapshot`]), and the same events through the [`metrics`] facade, which the
//! application exports with the recorder of its choice (Prometheus, StatsD, …; `outbox_cli`'s
//! `--metrics-addr` installs a Prometheus endpoint). Without a recorder installed the facade's
//! calls do nothing.
//!
//! Labels are the event type and the outcome only: never a record key, an event id or a
//! payload, so a series' count is bounded by the registered event types. The names follow
//! Prometheus conventions; [`names`] lists them and `docs/observability.md` explains each, with
//! alert rules.

use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use outbox_persistence::{OutboxStats, PruneReport};

/// The names of the series the outbox records through the `metrics` facade.
pub mod names {
    /// Counter, `event_type`: rows claimed (fresh or stale reclaims).
    pub const CLAIMS: &str = "outbox_claims_total";
    /// Counter: claim calls of the pull workers (one `claim_batch` for every worker that asked
    /// at that moment, or one `claim_next` with a batch of one; `outbox_claims_total` over this
    /// is the mean batch).
    pub const CLAIM_STATEMENTS: &str = "outbox_claim_statements_total";
    /// Counter, `event_type`: claims of stale `processing` rows (a worker had stopped).
    pub const STALE_RECLAIMS: &str = "outbox_stale_reclaims_total";
    /// Counter, `event_type`, `outcome` (`processed`, `retried`, `failed`, `lost_claim`,
    /// `cancelled`, `abandoned`): attempts by how they ended.
    pub const ATTEMPTS: &str = "outbox_attempts_total";
    /// Counter, `event_type`: failures that were lock timeouts.
    pub const LOCK_TIMEOUTS: &str = "outbox_lock_timeouts_total";
    /// Counter, `event_type`: later handlers of a batch's segment that shares writes that failed
    /// after using the transaction (a lock wait that reached its bound, or an error of their
    /// own), run again first in the next segment, where a failure counts (not failures).
    pub const SHARED_WRITE_RERUNS: &str = "outbox_shared_write_reruns_total";
    /// Counter, `event_type`: failures recorded on the detached path (the attempt transaction
    /// died).
    pub const DETACHED_BOOKKEEPING: &str = "outbox_detached_bookkeeping_total";
    /// Histogram (seconds), `event_type`, `outcome`: from the claim to the attempt's end.
    pub const ATTEMPT_DURATION: &str = "outbox_attempt_duration_seconds";
    /// Histogram (seconds), `event_type`: the handler's own time.
    pub const HANDLER_DURATION: &str = "outbox_handler_duration_seconds";
    /// Histogram (seconds), `event_type`: from `CreatedDate` to the commit of `processed`.
    pub const ENQUEUE_TO_PROCESSED: &str = "outbox_enqueue_to_processed_seconds";
    /// Gauge, `status`: rows by status (from the periodic queue read).
    pub const ROWS: &str = "outbox_rows";
    /// Gauge, `status="retrying"` rows are counted in [`ROWS`] under `pending` too.
    pub const RETRYING: &str = "outbox_retrying_rows";
    /// Gauge (seconds): age of the oldest `pending` row.
    pub const OLDEST_PENDING_AGE: &str = "outbox_oldest_pending_age_seconds";
    /// Gauge: `processing` rows whose heartbeat is older than stale-after.
    pub const STALE_CLAIMS: &str = "outbox_stale_claims";
    /// Gauge, `reason` (`running`, `stale`, `retry_wait`): keys with rows waiting behind a head
    /// that is not claimable now.
    pub const BLOCKED_KEYS: &str = "outbox_blocked_keys";
    /// Counter: periodic queue reads that failed (the gauges keep their last values).
    pub const GAUGE_READ_ERRORS: &str = "outbox_gauge_read_errors_total";
    /// Counter: reads of the paused event types that failed (the dispatcher keeps the last set
    /// it read; a database not migrated to the pause table fails every one).
    pub const PAUSE_READ_ERRORS: &str = "outbox_pause_read_errors_total";
    /// Counter, `status` (`processed`, `failed`): terminal rows deleted by the pruner
    /// ([`crate::prune_until_done`], the dispatcher's retention task).
    pub const PRUNED_ROWS: &str = "outbox_pruned_rows_total";
    /// Counter, `repair` (`misplaced`, `left_over`, `missing`): record keys whose head the
    /// dispatcher's heads repair put right (see `docs/queries.md`, "Why a head cannot hide a
    /// row"). `missing` means rows were written around the outbox's triggers.
    pub const HEADS_REPAIRED: &str = "outbox_heads_repaired_total";
    /// Counter, `handler`, `effect`, `outcome` (`run`: the effect ran and was recorded;
    /// `skipped`: the effect ledger recorded it already, it was not run again): external
    /// effects through `ctx.effect(…).once(…)`. The labels are the consumer's name and the
    /// effect's name in code, bounded like the event types.
    pub const EFFECTS: &str = "outbox_effects_total";
}

/// Attempt counters, shared by all workers of a dispatcher.
#[derive(Debug, Default)]
pub struct Metrics {
    claimed: AtomicU64,
    claim_statements: AtomicU64,
    processed: AtomicU64,
    retried: AtomicU64,
    snoozed: AtomicU64,
    failed: AtomicU64,
    lost_claims: AtomicU64,
    stale_reclaims: AtomicU64,
    lock_timeouts: AtomicU64,
    detached_bookkeeping: AtomicU64,
    cancelled: AtomicU64,
    released: AtomicU64,
    not_run: AtomicU64,
    batches: AtomicU64,
    shared_write_reruns: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Rows claimed.
    pub claimed: u64,
    /// Claim calls of the pull workers (a call claims for every worker that asked at that
    /// moment): `claimed / claim_statements` is the mean batch.
    pub claim_statements: u64,
    /// Attempts that committed `processed`.
    pub processed: u64,
    /// Attempts that ended in a retry.
    pub retried: u64,
    /// Attempts whose handler asked to run later (`HandlerError::snooze`): back to `pending`,
    /// not counted towards `MaxRetryAttempts`.
    pub snoozed: u64,
    /// Attempts that ended `failed`.
    pub failed: u64,
    /// Attempts abandoned because the claim was taken over or finished elsewhere.
    pub lost_claims: u64,
    /// Claims of stale `processing` rows (a worker's heartbeat had stopped).
    pub stale_reclaims: u64,
    /// Failures that were database lock timeouts.
    pub lock_timeouts: u64,
    /// Failures recorded on the detached path because the attempt transaction died.
    pub detached_bookkeeping: u64,
    /// Attempts cancelled by a hard shutdown (left to stale reclaim).
    pub cancelled: u64,
    /// Attempts whose handler succeeded but whose `processed` write hit a lock timeout, a
    /// serialization failure or a deadlock: back to `pending`, not counted towards
    /// `MaxRetryAttempts`.
    pub released: u64,
    /// Claims a batched attempt gave back before running them (its time budget was spent, an
    /// older event of their record failed, or its transaction died first): back to `pending`,
    /// not counted.
    pub not_run: u64,
    /// Attempt transactions that ran more than one event (see `docs/state-machine.md`,
    /// "Batched attempts").
    pub batches: u64,
    /// Later handlers of a segment that shares writes that failed after using the transaction
    /// (a lock wait that reached its bound, or an error of their own): rolled back and run
    /// again first in the next segment, not counted (`WorkerConfig::shared_writes`).
    pub shared_write_reruns: u64,
}

/// How an attempt ended, as the metrics label it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    Processed,
    Retried,
    Snoozed,
    Failed,
    LostClaim,
    Cancelled,
    Abandoned,
    Released,
    NotRun,
}

impl Ended {
    fn label(self) -> &'static str {
        match self {
            Ended::Processed => "processed",
            Ended::Retried => "retried",
            Ended::Snoozed => "snoozed",
            Ended::Failed => "failed",
            Ended::LostClaim => "lost_claim",
            Ended::Cancelled => "cancelled",
            Ended::Abandoned => "abandoned",
            Ended::Released => "released",
            Ended::NotRun => "not_run",
        }
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Metrics {
    /// A row of `event_type` was claimed (`reclaimed`: from a worker that had stopped).
    pub(crate) fn claimed(&self, event_type: &str, reclaimed: bool) {
        bump(&self.claimed);
        counter!(names::CLAIMS, "event_type" => event_type.to_owned()).increment(1);
        if reclaimed {
            bump(&self.stale_reclaims);
            counter!(names::STALE_RECLAIMS, "event_type" => event_type.to_owned()).increment(1);
        }
    }

    /// The pull workers made a claim call.
    pub(crate) fn claim_statement(&self) {
        bump(&self.claim_statements);
        counter!(names::CLAIM_STATEMENTS).increment(1);
    }

    /// An attempt ended after `attempt` (from its claim); `queued` is the time from
    /// `CreatedDate` to the claim, for a processed row.
    pub(crate) fn ended(
        &self,
        event_type: &str,
        ended: Ended,
        attempt: Duration,
        queued: Option<Duration>,
    ) {
        bump(match ended {
            Ended::Processed => &self.processed,
            Ended::Retried => &self.retried,
            Ended::Snoozed => &self.snoozed,
            Ended::Failed => &self.failed,
            Ended::LostClaim => &self.lost_claims,
            Ended::Cancelled => &self.cancelled,
            Ended::Abandoned => return self.ended_uncounted(event_type, attempt),
            Ended::Released => &self.released,
            Ended::NotRun => &self.not_run,
        });
        let labels = [
            ("event_type", event_type.to_owned()),
            ("outcome", ended.label().to_owned()),
        ];
        counter!(names::ATTEMPTS, &labels).increment(1);
        histogram!(names::ATTEMPT_DURATION, &labels).record(attempt.as_secs_f64());
        if let (Ended::Processed, Some(queued)) = (ended, queued) {
            histogram!(names::ENQUEUE_TO_PROCESSED, "event_type" => event_type.to_owned())
                .record((queued + attempt).as_secs_f64());
        }
    }

    /// An attempt abandoned (not counted in [`MetricsSnapshot`]: the row is reclaimed as it
    /// was), still visible in the facade.
    fn ended_uncounted(&self, event_type: &str, attempt: Duration) {
        let labels = [
            ("event_type", event_type.to_owned()),
            ("outcome", Ended::Abandoned.label().to_owned()),
        ];
        counter!(names::ATTEMPTS, &labels).increment(1);
        histogram!(names::ATTEMPT_DURATION, &labels).record(attempt.as_secs_f64());
    }

    /// The handler of `event_type` ran for `took`.
    pub(crate) fn handler_ran(&self, event_type: &str, took: Duration) {
        histogram!(names::HANDLER_DURATION, "event_type" => event_type.to_owned())
            .record(took.as_secs_f64());
    }

    /// A failure of `event_type` was a lock timeout.
    pub(crate) fn lock_timeout(&self, event_type: &str) {
        bump(&self.lock_timeouts);
        counter!(names::LOCK_TIMEOUTS, "event_type" => event_type.to_owned()).increment(1);
    }

    /// A row claimed beyond what its worker asked for, given back unrun at once: claimed, and
    /// ended not run.
    pub(crate) fn beyond_want(&self, event_type: &str, reclaimed: bool) {
        self.claimed(event_type, reclaimed);
        self.ended(event_type, Ended::NotRun, Duration::ZERO, None);
    }

    /// An attempt transaction ran more than one event.
    pub(crate) fn batch(&self) {
        bump(&self.batches);
    }

    /// A later handler of a segment that shares writes failed and runs again in the next.
    pub(crate) fn shared_write_rerun(&self, event_type: &str) {
        bump(&self.shared_write_reruns);
        counter!(names::SHARED_WRITE_RERUNS, "event_type" => event_type.to_owned()).increment(1);
    }

    /// A failure of `event_type` was recorded on the detached path.
    pub(crate) fn detached_bookkeeping(&self, event_type: &str) {
        bump(&self.detached_bookkeeping);
        counter!(names::DETACHED_BOOKKEEPING, "event_type" => event_type.to_owned()).increment(1);
    }

    /// The counters now.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            claimed: load(&self.claimed),
            claim_statements: load(&self.claim_statements),
            processed: load(&self.processed),
            retried: load(&self.retried),
            snoozed: load(&self.snoozed),
            failed: load(&self.failed),
            lost_claims: load(&self.lost_claims),
            stale_reclaims: load(&self.stale_reclaims),
            lock_timeouts: load(&self.lock_timeouts),
            detached_bookkeeping: load(&self.detached_bookkeeping),
            cancelled: load(&self.cancelled),
            released: load(&self.released),
            not_run: load(&self.not_run),
            batches: load(&self.batches),
            shared_write_reruns: load(&self.shared_write_reruns),
        }
    }
}

/// Sets the queue gauges from one read of the queue ([`outbox_persistence::OutboxRepository::stats`]).
pub fn record_queue_gauges(stats: &OutboxStats) {
    for (status, n) in [
        ("pending", stats.pending),
        ("processing", stats.processing),
        ("processed", stats.processed),
        ("failed", stats.failed),
    ] {
        gauge!(names::ROWS, "status" => status).set(n as f64);
    }
    gauge!(names::RETRYING).set(stats.retrying as f64);
    gauge!(names::OLDEST_PENDING_AGE).set(stats.oldest_pending_age_seconds.unwrap_or(0.0));
    gauge!(names::STALE_CLAIMS).set(stats.stale_claims as f64);
    for (reason, n) in [
        ("running", stats.keys_blocked_by_running),
        ("stale", stats.keys_blocked_by_stale),
        ("retry_wait", stats.keys_blocked_by_retry),
    ] {
        gauge!(names::BLOCKED_KEYS, "reason" => reason).set(n as f64);
    }
}

/// Counts the rows one prune batch deleted, by status.
pub(crate) fn pruned(batch: &PruneReport) {
    for (status, n) in [("processed", batch.processed), ("failed", batch.failed)] {
        if n > 0 {
            counter!(names::PRUNED_ROWS, "status" => status).increment(n);
        }
    }
}

/// Counts the keys one heads repair put right, by kind.
pub(crate) fn heads_repaired(report: &outbox_persistence::HeadsRepair) {
    for (repair, keys) in [
        ("misplaced", &report.misplaced),
        ("left_over", &report.left_over),
        ("missing", &report.missing),
    ] {
        if !keys.is_empty() {
            counter!(names::HEADS_REPAIRED, "repair" => repair).increment(keys.len() as u64);
        }
    }
}

/// Counts a failed queue read of the gauge task.
pub(crate) fn gauge_read_failed() {
    counter!(names::GAUGE_READ_ERRORS).increment(1);
}

/// Counts a failed read of the paused event types.
pub(crate) fn pause_read_failed() {
    counter!(names::PAUSE_READ_ERRORS).increment(1);
}

/// Bucket bounds, in seconds, of the outbox's histograms ([`HISTOGRAMS`]): 1 ms to 5 minutes.
/// An exporter that makes summaries unless told the buckets (the Prometheus exporter does)
/// should get these for those names: the `prometheus` feature's
/// `outbox_events::prometheus::with_outbox_buckets` sets them on a `PrometheusBuilder`.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// The names of the outbox's histograms, each in seconds.
pub const HISTOGRAMS: &[&str] = &[
    names::ATTEMPT_DURATION,
    names::HANDLER_DURATION,
    names::ENQUEUE_TO_PROCESSED,
];

/// Describes every series to the installed recorder (units and help text), once per process.
/// The dispatcher calls it when it starts; call it yourself after installing a recorder if you
/// record before starting one.
pub fn describe_metrics() {
    static DESCRIBED: Once = Once::new();
    DESCRIBED.call_once(|| {
        describe_counter!(
            names::CLAIMS,
            "Rows claimed by pull workers, stale reclaims included."
        );
        describe_counter!(
            names::EFFECTS,
            "External effects through the effect ledger: run (and recorded), or skipped (recorded by an earlier attempt)."
        );
        describe_counter!(
            names::CLAIM_STATEMENTS,
            "Claim calls of the pull workers; each claims for every worker that asked at that moment."
        );
        describe_counter!(
            names::STALE_RECLAIMS,
            "Claims of stale processing rows whose worker had stopped."
        );
        describe_counter!(names::ATTEMPTS, "Attempts by how they ended (outcome).");
        describe_counter!(
            names::LOCK_TIMEOUTS,
            "Attempt failures that were database lock timeouts."
        );
        describe_counter!(
            names::DETACHED_BOOKKEEPING,
            "Failures recorded on a connection of their own because the attempt transaction died."
        );
        describe_histogram!(
            names::ATTEMPT_DURATION,
            Unit::Seconds,
            "Time from the claim to the end of the attempt."
        );
        describe_histogram!(
            names::HANDLER_DURATION,
            Unit::Seconds,
            "Time spent in the handler."
        );
        describe_histogram!(
            names::ENQUEUE_TO_PROCESSED,
            Unit::Seconds,
            "Time from CreatedDate to the commit of processed."
        );
        describe_gauge!(
            names::ROWS,
            "Outbox rows by status, from the periodic queue read."
        );
        describe_gauge!(names::RETRYING, "Pending rows that failed before.");
        describe_gauge!(
            names::OLDEST_PENDING_AGE,
            Unit::Seconds,
            "Age of the oldest pending row."
        );
        describe_gauge!(
            names::STALE_CLAIMS,
            "Processing rows whose heartbeat is older than stale-after."
        );
        describe_gauge!(
            names::BLOCKED_KEYS,
            "Record keys with rows waiting behind a head that is not claimable now, by reason."
        );
        describe_counter!(
            names::GAUGE_READ_ERRORS,
            "Periodic queue reads that failed."
        );
        describe_counter!(
            names::PAUSE_READ_ERRORS,
            "Reads of the paused event types that failed (the last set read is kept)."
        );
        describe_counter!(
            names::PRUNED_ROWS,
            "Terminal rows deleted by the retention pruner, by status."
        );
        describe_counter!(
            names::HEADS_REPAIRED,
            "Record keys whose head the heads repair put right, by repair."
        );
    });
}
