//! Outbox workers: independent pull workers (the repair) and the legacy batch dispatcher they
//! replace, sharing one attempt state machine.
//!
//! A pull worker loops: claim the oldest eligible row (committed before any handler work),
//! run its attempt, repeat. There is no batch barrier: a slow or blocked record holds up its own
//! successors only. See `docs/state-machine.md` for the row's states and `ARCHITECTURE.md` for
//! how the pieces fit.
//!
//! This crate names no concrete database: it speaks to [`OutboxRepository`] and hands handlers
//! the attempt's [`Tx`].
//!
//! An embedding service imports from one place, [`prelude`] (`use outbox_events::prelude::*;`),
//! which covers `docs/embedding.md`. Features: `mock` (the mocked repository and attempt, for
//! unit tests: `outbox_events::mock`), `prometheus` (the Prometheus recorder with the outbox's histogram
//! buckets: `outbox_events::prometheus`), `otel` (W3C trace context through OpenTelemetry).

#![warn(missing_docs)]

mod attempt;
mod batch;
mod claims;
mod config;
mod consumer;
mod detached;
mod dispatcher;
mod effect;
mod env;
mod gate;
mod gauges;
mod handler;
mod handlers;
mod heads;
mod heartbeat;
mod legacy;
mod metrics;
mod pause;
mod prune;
mod runner;
pub mod trace;
mod waits;

pub use config::{
    DEFAULT_BATCH_BUDGET, DEFAULT_BATCH_MAX_EVENTS, DEFAULT_HEADS_REPAIR_EVERY,
    DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_LOCK_TIMEOUT, DEFAULT_MAX_RETRY_ATTEMPTS,
    DEFAULT_MAX_RETRY_DELAY, DEFAULT_POLL_INTERVAL, DEFAULT_RETRY_DELAY, DEFAULT_SHUTDOWN_TIMEOUT,
    DEFAULT_STALE_AFTER, DEFAULT_WORKERS, DispatchMode, MAX_SHARED_WRITES_LOCK_WAIT,
    MAX_SHARED_WRITES_WINDOW, OUTBOX_PULL_WORKER, RECOMMENDED_BATCH_MAX_EVENTS, WorkerConfig,
};
pub use consumer::{Consumer, DeclaredEffect, EffectKind, ExternalKind, Safeguard, Verdict};
pub use dispatcher::{DECIDE_RETRY_FOR, Dispatcher, DispatcherHandle, ShutdownReport, StartError};
pub use effect::Effect;
pub use env::AttemptOutcome;
pub use gate::{GateReport, ModeDecision, evaluate_gate};
pub use handler::{AttemptContext, BoxError, Handler, HandlerError, MAX_SNOOZE};
pub use handlers::Handlers;
pub use legacy::slot_for_event;
pub use metrics::{
    HISTOGRAMS, Metrics, MetricsSnapshot, SECONDS_BUCKETS, describe_metrics, names as metric_names,
    record_queue_gauges,
};
pub use pause::PAUSE_REFRESH;
pub use prune::{
    DEFAULT_PRUNE_BATCH_PAUSE, DEFAULT_PRUNE_INTERVAL, DEFAULT_PRUNE_PAUSE_FACTOR, PrunePacing,
    RetentionConfig, prune_until_done,
};
pub use runner::ClaimRunner;
pub use trace::{TraceParent, TraceParentError, enqueue};

// What the signatures above need, so that a service depends on this crate alone to write,
// register and test a handler (see `docs/embedding.md` once written; `docs/state-machine.md`).
pub use async_trait::async_trait;
pub use outbox_persistence::{
    self as persistence, Attempt, BeatOutcome, Claim, ClaimPolicy, ConnectConfig, Database,
    EffectRecord, EventEnvelope, EventFilter, EventId, EventRow, EventStatus, FailureBookkeeping,
    Fence, FenceOutcome, MIGRATIONS_TABLE, NewEvent, OutboxEvent, OutboxRepository, RecordKey,
    Scope, Tx, idempotency_key, with_conn, with_pool, with_tx,
};
pub use outbox_persistence::{AuditEntry, PausedType, PrunePolicy, PruneReport, RetryFilter};
pub use tokio_util::sync::CancellationToken;

/// What an embedding service uses, in one import: `use outbox_events::prelude::*;` brings the
/// dispatcher and its configuration, handlers and consumer declarations, the queue's types
/// (events, filters, ids, statuses, claims and fences), the database and its macros, and the
/// re-exported `async_trait` and `CancellationToken`. Everything else stays at the crate's top
/// level (metric names, defaults, the gate's report) and in [`persistence`].
pub mod prelude {
    pub use crate::{
        Attempt, CancellationToken, Claim, ClaimPolicy, ConnectConfig, Database, EventEnvelope,
        EventFilter, EventId, EventRow, EventStatus, FailureBookkeeping, Fence, FenceOutcome,
        MIGRATIONS_TABLE, NewEvent, OutboxEvent, OutboxRepository, RecordKey, Scope, Tx,
        async_trait, with_conn, with_pool, with_tx,
    };
    pub use crate::{
        AttemptContext, AttemptOutcome, BoxError, ClaimRunner, Consumer, DispatchMode, Dispatcher,
        DispatcherHandle, Effect, EffectKind, ExternalKind, Handler, HandlerError, Handlers,
        ModeDecision, RetentionConfig, Safeguard, ShutdownReport, StartError, WorkerConfig,
    };
    /// `sqlx`'s statement constructors for the service's own SQL beside the outbox, unnamed
    /// behind a transaction pooler.
    pub use outbox_persistence::statement;
}

#[cfg(feature = "mock")]
pub mod mock {
    //! The mocked repository and attempt (`mockall`), for unit tests of the attempt state machine
    //! and of code that takes an `Arc<dyn OutboxRepository>` (feature `mock`; enable it in
    //! `[dev-dependencies]`).
    //!
    //! A [`ClaimRunner`](crate::ClaimRunner) over a [`MockOutboxRepository`] runs one claim as
    //! a worker does. The repository's mock always needs `serializes_writers` and
    //! `begin_attempt` (returning `Ok(Some(Box::new(attempt)))` with the [`MockAttempt`]
    //! below); `heartbeat` and `note_alive` once the attempt outlasts a heartbeat interval
    //! (`WorkerConfig::heartbeat_interval`, 2 s by default) or its begin is retried;
    //! `get_event` before the outcome's fenced write when a heartbeat failed (a beat whose reply
    //! was lost may have landed); and `get_event`, `increment_retry`, `snooze_claim`,
    //! `update_status` or `release_claim` on the detached paths below. Several claims run together (a dispatcher's
    //! batched attempts) need `begin_batch_attempt` instead, and the attempt's `savepoint` (after a handler that used
    //! the transaction) and `mark_processed_many` (the settle). What the attempt must expect for
    //! one claim, by the handler's result:
    //!
    //! | handler | the attempt's calls, in order |
    //! |---|---|
    //! | `Ok(())` | `tx` (only if the handler writes), `mark_processed(fence)` returning `FenceOutcome::Written`, `commit` |
    //! | `Err(HandlerError::Retryable(_))` below `MaxRetryAttempts` | `rollback_to_savepoint`, `record_failure(fence, FailureBookkeeping::Retry { .. }, message)`, `commit` |
    //! | `Err(HandlerError::Snooze { .. })`, whatever the count | `rollback_to_savepoint`, `record_failure(fence, FailureBookkeeping::Snooze { delay }, message)`, `commit` |
    //! | `Err(HandlerError::Permanent(_))`, or the last allowed failure | `rollback_to_savepoint`, `record_failure(fence, FailureBookkeeping::Fail, message)`, `commit` |
    //! | any, when the fenced write returns `FenceOutcome::Lost` | then `rollback` instead of `commit` (`AttemptOutcome::LostClaim`) |
    //!
    //! When `commit` fails, the bookkeeping goes to the repository on the side: `get_event`, then
    //! `increment_retry`, `snooze_claim` or `update_status` (see `docs/state-machine.md`, "The attempt", rule 6).
    //!
    //! `MockAttempt::tx` returns a `&mut Tx`, which must be a real transaction: a handler that
    //! writes is tested over mocks with `attempt.expect_tx().return_var(tx)`, `tx` from
    //! [`Database::sqlite_in_memory`](crate::Database::sqlite_in_memory) (no server, no file), or
    //! more simply without mocks, through [`AttemptContext::new`](crate::AttemptContext::new) on
    //! such a transaction (see its example). `examples/contact-service/src/tests.rs` has both,
    //! and a failure's expectations in order (`Sequence`).
    //!
    //! A dispatcher's idle workers over the mock call `wake_mark` before each claim and
    //! `wait_for_work_since(mark, timeout)` when it found nothing (not `wait_for_work`);
    //! `WakeMark::from(n)` makes a mark that moved.

    pub use outbox_persistence::mockall::{self, Sequence, predicate};
    pub use outbox_persistence::{MockAttempt, MockOutboxRepository};
}

#[cfg(feature = "prometheus")]
pub mod prometheus;

#[cfg(test)]
mod tests;
