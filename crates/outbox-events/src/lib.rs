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

#![warn(missing_docs)]

mod attempt;
mod claims;
mod config;
mod consumer;
mod detached;
mod dispatcher;
mod gate;
mod gauges;
mod handler;
mod heads;
mod heartbeat;
mod legacy;
mod metrics;
mod prune;
pub mod trace;

pub use attempt::{AttemptOutcome, ClaimRunner};
pub use config::{
    DEFAULT_HEADS_REPAIR_EVERY, DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_LOCK_TIMEOUT,
    DEFAULT_MAX_RETRY_ATTEMPTS, DEFAULT_MAX_RETRY_DELAY, DEFAULT_POLL_INTERVAL,
    DEFAULT_RETRY_DELAY, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_STALE_AFTER, DEFAULT_WORKERS,
    DispatchMode, OUTBOX_PULL_WORKER, WorkerConfig,
};
pub use consumer::{Consumer, DeclaredEffect, EffectKind, ExternalKind, Safeguard, Verdict};
pub use dispatcher::{DECIDE_RETRY_FOR, Dispatcher, DispatcherHandle, ShutdownReport};
pub use gate::{GateReport, ModeDecision, evaluate_gate};
pub use handler::{AttemptContext, BoxError, Handler, HandlerError, Handlers};
pub use legacy::slot_for_event;
pub use metrics::{
    Metrics, MetricsSnapshot, describe_metrics, names as metric_names, record_queue_gauges,
};
pub use prune::{
    DEFAULT_PRUNE_BATCH_PAUSE, DEFAULT_PRUNE_INTERVAL, DEFAULT_PRUNE_PAUSE_FACTOR, PrunePacing,
    RetentionConfig, prune_until_done,
};
pub use trace::{TraceParent, TraceParentError, enqueue};

// What the signatures above need, so that a service depends on this crate alone to write,
// register and test a handler (see `docs/embedding.md` once written; `docs/state-machine.md`).
pub use async_trait::async_trait;
pub use outbox_persistence::{
    self as persistence, ClaimPolicy, ConnectConfig, Database, NewEvent, OutboxEvent,
    OutboxRepository, Scope, Tx, with_pool, with_tx,
};
pub use outbox_persistence::{PrunePolicy, PruneReport};
pub use tokio_util::sync::CancellationToken;

#[cfg(test)]
mod tests;
