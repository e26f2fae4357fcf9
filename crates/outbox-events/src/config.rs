//! Worker configuration with named defaults, and the `OUTBOX_PULL_WORKER` switch.

use std::time::Duration;

use outbox_persistence::Scope;

/// The environment variable that selects the pull workers (`true`) over the legacy
/// dispatcher. The rollout gate decides whether it may take effect.
pub const OUTBOX_PULL_WORKER: &str = "OUTBOX_PULL_WORKER";

/// Default number of concurrent workers.
pub const DEFAULT_WORKERS: usize = 8;
/// Default longest wait of an idle worker before it looks again (PostgreSQL wakes it sooner
/// through `LISTEN/NOTIFY`).
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Default interval between heartbeats of a running attempt.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// Default age of the last heartbeat after which a `processing` row counts as stale.
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(30);
/// Default base delay before a failed row is retried.
pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(1);
/// Default cap of the exponential retry backoff.
pub const DEFAULT_MAX_RETRY_DELAY: Duration = Duration::from_secs(300);
/// Default `MaxRetryAttempts`: failed attempts after which a row is `failed`.
pub const DEFAULT_MAX_RETRY_ATTEMPTS: i32 = 5;
/// Default lock timeout of an attempt's transaction: the persistence crate's one default.
pub use outbox_persistence::DEFAULT_LOCK_TIMEOUT;
/// Default time in-flight attempts get to finish at shutdown before they are cancelled.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default most events of one attempt transaction ([`WorkerConfig::batch_max_events`]):
/// batched attempts on, [`RECOMMENDED_BATCH_MAX_EVENTS`] (see docs/state-machine.md,
/// "Batched attempts", rule 7, for the measurements behind it); `without_batches()` runs one
/// event per attempt.
pub const DEFAULT_BATCH_MAX_EVENTS: usize = RECOMMENDED_BATCH_MAX_EVENTS;
/// The batch size the measurements support: 32 events.
pub const RECOMMENDED_BATCH_MAX_EVENTS: usize = 32;
/// Default handler time after which a batched attempt stops taking events
/// ([`WorkerConfig::batch_budget`]).
pub const DEFAULT_BATCH_BUDGET: Duration = Duration::from_millis(10);
/// The longest window [`WorkerConfig::shared_writes`] accepts: well under PostgreSQL's default
/// `deadlock_timeout` (1 s), so that an application transaction that waits for a lock a
/// segment holds has not run its one deadlock check while a later handler of the segment may
/// still wait for a lock (docs/state-machine.md, "Batched attempts", rule 11).
pub const MAX_SHARED_WRITES_WINDOW: Duration = Duration::from_millis(250);
/// The longest a later handler of a segment that shares writes waits for a lock: past it, its
/// statement fails with a lock timeout, its effects are rolled back, and it runs again first
/// in the next segment, uncounted.
pub const MAX_SHARED_WRITES_LOCK_WAIT: Duration = Duration::from_millis(5);
/// Default interval of the heads repair ([`WorkerConfig::heads_repair`]).
pub const DEFAULT_HEADS_REPAIR_EVERY: Duration = Duration::from_secs(30);

/// Which dispatcher runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchMode {
    /// Independent pull workers (the repair).
    Pull,
    /// The legacy batch dispatcher: fetch a batch, hash records into slots, wait for the whole
    /// batch before the next fetch.
    Legacy,
}

impl DispatchMode {
    /// The mode `OUTBOX_PULL_WORKER` asks for: `Pull` for `true`/`1`/`yes`/`on`, `Legacy`
    /// otherwise (also when unset).
    pub fn from_env() -> Self {
        Self::from_flag(std::env::var(OUTBOX_PULL_WORKER).ok().as_deref())
    }

    /// The mode a value of `OUTBOX_PULL_WORKER` asks for (`None`: unset), for a service that
    /// reads its configuration from elsewhere than the process environment.
    pub fn from_flag(value: Option<&str>) -> Self {
        match value {
            Some(v) if matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "yes" | "on") => {
                DispatchMode::Pull
            }
            _ => DispatchMode::Legacy,
        }
    }
}

/// How the workers run. Build with [`WorkerConfig::default`] (pure: the named defaults, legacy
/// mode) or [`WorkerConfig::from_env`] (the same, with the mode `OUTBOX_PULL_WORKER` asks for),
/// and the `with_*` methods.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// Pull workers, or legacy slots.
    pub mode: DispatchMode,
    /// Concurrent workers (pull) or slots (legacy).
    pub workers: usize,
    /// Longest wait of an idle worker before it looks again.
    pub poll_interval: Duration,
    /// Interval between heartbeats of a running attempt.
    pub heartbeat_interval: Duration,
    /// Age of the last heartbeat after which a claim is stale and may be reclaimed.
    pub stale_after: Duration,
    /// Base delay before a failed row is retried; doubled per failure.
    pub retry_delay: Duration,
    /// Cap of the retry backoff.
    pub max_retry_delay: Duration,
    /// `MaxRetryAttempts`: the failure that reaches this count ends the row `failed`.
    pub max_retry_attempts: i32,
    /// Lock timeout of the attempt transaction (PostgreSQL `lock_timeout`).
    pub lock_timeout: Duration,
    /// Time in-flight attempts get at shutdown before they are cancelled.
    pub shutdown_timeout: Duration,
    /// Legacy dispatcher: rows fetched per batch.
    pub legacy_batch_size: u32,
    /// Pull mode: event types kept off the pull workers (consumers excluded from the rollout);
    /// a legacy batch loop runs them instead. Ordering still holds across both paths, because
    /// both use the same eligibility rule over every event type. The rollout gate adds the
    /// event types of consumers declared excluded.
    pub excluded_event_types: Vec<String>,
    /// How often the dispatcher reads the queue to refresh the queue gauges of the `metrics`
    /// facade (rows by status, oldest pending age, stale claims, blocked keys); `None` (the
    /// default) reads nothing. See `docs/observability.md`.
    pub queue_gauges: Option<Duration>,
    /// Pull mode without the rollout gate, and why: see
    /// [`WorkerConfig::dangerously_skip_rollout_gate`]. `None` (the default) keeps the gate.
    pub rollout_gate_skipped: Option<String>,
    /// The event types this dispatcher claims at all, on every path (pull workers and legacy
    /// loop): [`Scope::All`] by default. A dispatcher that owns some event types (a relay) runs
    /// on `Scope::Only(its types)`, and the service beside it on `Scope::Except(those types)`,
    /// so that neither claims, and fails for want of a handler, the other's events.
    pub scope: Scope,
    /// Pull mode: the most idle workers one claim statement serves (see
    /// `docs/state-machine.md`, "Claiming for several workers"): the workers that ask for a row
    /// while another claims queue behind it and share its next statement. `None`, the default,
    /// lets one statement serve every worker; `Some(1)` makes each worker claim for itself.
    pub max_claim_batch: Option<usize>,
    /// The background pruner (retention of terminal rows); `None`, the default, deletes
    /// nothing: deleting rows cannot be undone and terminal rows are what operators and audits
    /// read, so the embedding service chooses the ages. See [`crate::RetentionConfig`] and
    /// `docs/retention.md`.
    pub retention: Option<crate::RetentionConfig>,
    /// How often the dispatcher repairs the heads table
    /// ([`outbox_persistence::OutboxRepository::repair_heads`], at most
    /// [`outbox_persistence::DEFAULT_HEADS_REPAIR_KEYS`] keys a run, first one interval after
    /// the start); `None` never. Default [`DEFAULT_HEADS_REPAIR_EVERY`]. The claim does not
    /// depend on it (it reads each key's oldest row itself); a head out of place only changes
    /// which record is looked at first, and is put right within this interval (see
    /// `docs/queries.md`, "Why a head cannot hide a row"). Each key repaired is logged and
    /// counted (`outbox_heads_repaired_total`).
    pub heads_repair: Option<Duration>,
    /// Pull mode: the most claimed events one attempt transaction runs, each under a savepoint
    /// of its own (see `docs/state-machine.md`, "Batched attempts"); 1 runs one event per
    /// attempt. At most [`outbox_persistence::MAX_BATCH_EVENTS`]. A worker asks for as many as
    /// its handlers' recent times fit in [`WorkerConfig::batch_budget`], starting at one, so
    /// slow handlers still run one per attempt. Default [`DEFAULT_BATCH_MAX_EVENTS`] (on, 32);
    /// `without_batches()` turns them off.
    pub batch_max_events: usize,
    /// Pull mode: a batched attempt stops taking events once its handlers have run this long
    /// (the events claimed for it and not run yet go back to `pending`, uncounted), which
    /// bounds how long a record's effects wait for the batch's commit. Default
    /// [`DEFAULT_BATCH_BUDGET`].
    pub batch_budget: Duration,
    /// Pull mode on PostgreSQL, off by default: writing handlers share a batch's segment
    /// (docs/state-machine.md, "Batched attempts", rule 11). Off, a handler that used
    /// `ctx.tx()` ends its segment, so a transaction never holds two handlers' locks (rule 2).
    /// With a window, later handlers join a segment that holds a writing handler's locks
    /// until this long after that handler started (at most 16 writers), each with its lock
    /// waits bounded by [`WorkerConfig::shared_writes_lock_wait`] (one that fails after using
    /// the transaction, the bound's lock timeout or not, runs again first in the next segment,
    /// uncounted). The trade: an application transaction that waits for a row such a handler
    /// wrote waits up to the window (and the last joined handler's time) longer, and rule 11
    /// names a rare deadlock residue. At most [`MAX_SHARED_WRITES_WINDOW`].
    pub shared_writes: Option<Duration>,
}

impl Default for WorkerConfig {
    /// The named defaults, in [`DispatchMode::Legacy`]: reads nothing from the environment, so
    /// a default is the same wherever it runs. [`WorkerConfig::from_env`] takes the mode from
    /// `OUTBOX_PULL_WORKER`; [`WorkerConfig::with_mode`] sets it in code. Pull mode still runs
    /// only when the rollout gate passes (`Dispatcher::start`).
    fn default() -> Self {
        Self {
            mode: DispatchMode::Legacy,
            workers: DEFAULT_WORKERS,
            poll_interval: DEFAULT_POLL_INTERVAL,
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            stale_after: DEFAULT_STALE_AFTER,
            retry_delay: DEFAULT_RETRY_DELAY,
            max_retry_delay: DEFAULT_MAX_RETRY_DELAY,
            max_retry_attempts: DEFAULT_MAX_RETRY_ATTEMPTS,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            legacy_batch_size: 100,
            excluded_event_types: Vec::new(),
            rollout_gate_skipped: None,
            scope: Scope::All,
            retention: None,
            queue_gauges: None,
            max_claim_batch: None,
            heads_repair: Some(DEFAULT_HEADS_REPAIR_EVERY),
            batch_max_events: DEFAULT_BATCH_MAX_EVENTS,
            batch_budget: DEFAULT_BATCH_BUDGET,
            shared_writes: None,
        }
    }
}

impl WorkerConfig {
    /// The named defaults with the mode `OUTBOX_PULL_WORKER` asks for
    /// ([`DispatchMode::from_env`]): legacy unless the flag is on. The default never reads the
    /// flag; a service calls this where it reads the rest of its configuration.
    pub fn from_env() -> Self {
        Self::default().with_mode(DispatchMode::from_env())
    }

    /// The claim rules these settings give the repository: stale-after, the base retry delay
    /// and `MaxRetryAttempts`.
    pub fn claim_policy(&self) -> outbox_persistence::ClaimPolicy {
        outbox_persistence::ClaimPolicy::new(
            self.stale_after,
            self.retry_delay,
            self.max_retry_attempts,
        )
    }

    /// Sets the dispatch mode.
    pub fn with_mode(mut self, mode: DispatchMode) -> Self {
        self.mode = mode;
        self
    }
    /// Sets the number of workers.
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = workers.max(1);
        self
    }
    /// Bounds how many idle pull workers one claim statement serves
    /// ([`WorkerConfig::max_claim_batch`]; at least 1).
    pub fn with_max_claim_batch(mut self, max: usize) -> Self {
        self.max_claim_batch = Some(max.max(1));
        self
    }
    /// How many rows one claim statement of the pull workers takes at most: the workers, or
    /// fewer when [`WorkerConfig::max_claim_batch`] says so.
    pub fn claim_batch(&self) -> usize {
        self.max_claim_batch
            .map_or(self.workers, |max| max.min(self.workers))
            .max(1)
    }
    /// Batched attempts of at most `max_events` events (1: one event per attempt), stopping
    /// once their handlers have run for `budget` (see [`WorkerConfig::batch_max_events`]).
    pub fn with_batches(mut self, max_events: usize, budget: Duration) -> Self {
        self.batch_max_events = max_events.clamp(1, outbox_persistence::MAX_BATCH_EVENTS);
        self.batch_budget = budget;
        self
    }
    /// Writing handlers share a batch's segment for up to `window` (at most
    /// [`MAX_SHARED_WRITES_WINDOW`]; see [`WorkerConfig::shared_writes`]).
    pub fn with_shared_writes(mut self, window: Duration) -> Self {
        self.shared_writes = Some(window.min(MAX_SHARED_WRITES_WINDOW));
        self
    }
    /// How long a later handler of a segment that shares writes waits for a lock: a quarter
    /// of the window, between 1 ms and [`MAX_SHARED_WRITES_LOCK_WAIT`].
    pub fn shared_writes_lock_wait(&self) -> Option<Duration> {
        self.shared_writes
            .map(|window| (window / 4).clamp(Duration::from_millis(1), MAX_SHARED_WRITES_LOCK_WAIT))
    }
    /// One event per attempt transaction (no batches).
    pub fn without_batches(self) -> Self {
        let budget = self.batch_budget;
        self.with_batches(1, budget)
    }
    /// The most events a pull worker runs in one attempt transaction: 1 when batches are off,
    /// and when `MaxRetryAttempts` is 1 (a batch whose transaction dies counts a failure for
    /// every event that ran in it, which would end them all `failed`).
    pub fn batch_events(&self) -> usize {
        if self.max_retry_attempts < 2 {
            1
        } else {
            self.batch_max_events
                .clamp(1, outbox_persistence::MAX_BATCH_EVENTS)
        }
    }
    /// Refreshes the queue gauges every `every` (one read of the queue per dispatcher; see
    /// [`WorkerConfig::queue_gauges`]).
    pub fn with_queue_gauges(mut self, every: Duration) -> Self {
        self.queue_gauges = Some(every);
        self
    }
    /// Sets the idle poll interval.
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }
    /// Sets the heartbeat interval.
    pub fn with_heartbeat_interval(mut self, d: Duration) -> Self {
        self.heartbeat_interval = d;
        self
    }
    /// Sets the stale-after age.
    pub fn with_stale_after(mut self, d: Duration) -> Self {
        self.stale_after = d;
        self
    }
    /// Sets the base retry delay.
    pub fn with_retry_delay(mut self, d: Duration) -> Self {
        self.retry_delay = d;
        self
    }
    /// Sets the cap of the retry backoff.
    pub fn with_max_retry_delay(mut self, d: Duration) -> Self {
        self.max_retry_delay = d;
        self
    }
    /// Sets `MaxRetryAttempts`.
    pub fn with_max_retry_attempts(mut self, n: i32) -> Self {
        self.max_retry_attempts = n.max(1);
        self
    }
    /// Sets the attempt lock timeout.
    pub fn with_lock_timeout(mut self, d: Duration) -> Self {
        self.lock_timeout = d;
        self
    }
    /// Sets the shutdown timeout.
    pub fn with_shutdown_timeout(mut self, d: Duration) -> Self {
        self.shutdown_timeout = d;
        self
    }
    /// Runs pull workers without evaluating the rollout gate, for `why` (logged as a warning
    /// at every start). For tests of the worker mechanics and benchmarks, or an operator who
    /// has checked the consumers by other means: pull workers redeliver, and an undeclared
    /// external consumer may then repeat its effect.
    pub fn dangerously_skip_rollout_gate(mut self, why: impl Into<String>) -> Self {
        self.rollout_gate_skipped = Some(why.into());
        self
    }

    /// Keeps these event types off the pull workers (see
    /// [`WorkerConfig::excluded_event_types`]).
    pub fn with_excluded_event_types(mut self, types: Vec<String>) -> Self {
        self.excluded_event_types = types;
        self
    }
    /// Claims only the event types `scope` names (see [`WorkerConfig::scope`]).
    pub fn with_scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }
    /// Sets the legacy batch size.
    pub fn with_legacy_batch_size(mut self, n: u32) -> Self {
        self.legacy_batch_size = n.max(1);
        self
    }
    /// Sets the heads repair's interval (`None`: never); see [`WorkerConfig::heads_repair`].
    pub fn with_heads_repair(mut self, every: Option<Duration>) -> Self {
        self.heads_repair = every;
        self
    }

    /// Runs the background pruner with `retention` (see [`WorkerConfig::retention`]).
    pub fn with_retention(mut self, retention: crate::RetentionConfig) -> Self {
        self.retention = Some(retention);
        self
    }

    /// The backoff beyond the base retry delay after the `failures`-th failure:
    /// `retry_delay * 2^(failures-1)`, capped at `max_retry_delay`, minus the base delay.
    pub fn extra_retry_delay(&self, failures: i32) -> Duration {
        let exponent = failures.saturating_sub(1).clamp(0, 20) as u32;
        let total = self
            .retry_delay
            .saturating_mul(1u32 << exponent)
            .min(self.max_retry_delay.max(self.retry_delay));
        total.saturating_sub(self.retry_delay)
    }

    /// Checks the settings fit together: a stale-after shorter than three heartbeats would
    /// reclaim live work.
    pub fn validate(&self) -> Result<(), String> {
        if self.heartbeat_interval.is_zero() {
            return Err("heartbeat interval must be positive".into());
        }
        if self.stale_after < self.heartbeat_interval * 3 {
            return Err(format!(
                "stale-after ({:?}) must be at least three heartbeat intervals ({:?})",
                self.stale_after, self.heartbeat_interval
            ));
        }
        if let Some(window) = self.shared_writes
            && window > MAX_SHARED_WRITES_WINDOW
        {
            return Err(format!(
                "the shared-writes window ({window:?}) must be at most {MAX_SHARED_WRITES_WINDOW:?}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let c = WorkerConfig::default()
            .with_retry_delay(Duration::from_secs(1))
            .with_max_retry_delay(Duration::from_secs(10));
        assert_eq!(c.extra_retry_delay(1), Duration::ZERO);
        assert_eq!(c.extra_retry_delay(2), Duration::from_secs(1));
        assert_eq!(c.extra_retry_delay(3), Duration::from_secs(3));
        assert_eq!(c.extra_retry_delay(4), Duration::from_secs(7));
        assert_eq!(c.extra_retry_delay(5), Duration::from_secs(9));
        assert_eq!(c.extra_retry_delay(50), Duration::from_secs(9));
    }

    #[test]
    fn stale_after_must_cover_heartbeats() {
        let c = WorkerConfig::default()
            .with_heartbeat_interval(Duration::from_secs(2))
            .with_stale_after(Duration::from_secs(5));
        assert!(c.validate().is_err());
        assert!(WorkerConfig::default().validate().is_ok());
    }

    /// The default is legacy whatever the environment says; the flag's spellings.
    #[test]
    fn the_default_is_legacy_and_the_flag_reads_its_spellings() {
        assert_eq!(WorkerConfig::default().mode, DispatchMode::Legacy);
        for on in ["true", "1", "yes", "on", "TRUE", "On"] {
            assert_eq!(
                DispatchMode::from_flag(Some(on)),
                DispatchMode::Pull,
                "{on}"
            );
        }
        for off in [None, Some(""), Some("false"), Some("0"), Some("pull")] {
            assert_eq!(
                DispatchMode::from_flag(off),
                DispatchMode::Legacy,
                "{off:?}"
            );
        }
    }
}
