//! Shared writes (docs/state-machine.md, "Batched attempts", rule 11; off unless
//! `WorkerConfig::shared_writes` sets a window): on PostgreSQL, a handler that kept effects
//! through `ctx.tx()` no longer ends its segment while the window opened by the segment's first
//! such handler lasts. Every later handler of the segment then waits at most
//! `WorkerConfig::shared_writes_lock_wait` for any lock (set again by each one's savepoint, so a
//! handler's own `SET LOCAL lock_timeout` lasts for its own statements only); one that fails
//! after using the
//! transaction (its wait reached the bound, whatever error it was wrapped in) is rolled back
//! and runs first in the next segment, uncounted. So the transaction waits for a lock beside
//! another handler's locks only that long, and only within the window, well before an
//! application transaction that waits for those locks runs its deadlock check
//! (`deadlock_timeout`, 1 s by default).

use std::time::Instant;

use outbox_persistence::Attempt;

use super::{Batch, Stop};

/// The most writing handlers one shared segment keeps: each runs under a savepoint of its own
/// and may take savepoints itself (a create action takes one per create), and a transaction
/// past PostgreSQL's per-backend cache of 64 subtransactions slows every snapshot on the
/// server. 16 writers, each under its savepoint with one of its own, stay under it (handlers
/// that take more savepoints each can pass it: a cap, not a guarantee).
pub(super) const SHARED_WRITERS_MAX: usize = 16;

impl Batch<'_> {
    /// A handler that started at `started` kept effects through `ctx.tx()`: whether later
    /// handlers may join the segment (writes shared, a backend with row locks, fewer than
    /// [`SHARED_WRITERS_MAX`] writers in it, the window of the segment's first writer not
    /// over). From then on each later handler's savepoint bounds its lock waits.
    pub(super) fn share_locks(&mut self, started: Instant) -> bool {
        let Some(window) = self.env.config.shared_writes else {
            return false;
        };
        if self.env.repo.serializes_writers() {
            // SQLite: the attempt holds the one write lock; rule 2 as it is.
            return false;
        }
        self.segment_writers += 1;
        if self.segment_writers >= SHARED_WRITERS_MAX {
            return false;
        }
        if self.locks_since.is_none() {
            if started.elapsed() >= window {
                return false;
            }
            // Each later handler's savepoint bounds its lock waits (`bounded_savepoint`).
            self.locks_since = Some(started);
        }
        !self.window_closed()
    }

    /// Whether the segment holds a writer's locks and its window is over: no handler joins it.
    pub(super) fn window_closed(&self) -> bool {
        match (self.locks_since, self.env.config.shared_writes) {
            (Some(since), Some(window)) => since.elapsed() >= window,
            _ => false,
        }
    }

    /// Settles the segment, its lock waits first back to the attempt's lock timeout when it
    /// shared writes (a settle's write waits for a beat's row lock, which a bound as short as
    /// a handler's would turn into the segment given back).
    pub(super) async fn settle_segment(&mut self, tx: &mut dyn Attempt) -> Result<(), Stop> {
        if self.locks_since.take().is_some() {
            tx.unbound_lock_waits().await.map_err(|e| {
                Stop::Died(format!(
                    "restoring the segment's lock timeout failed: {}",
                    e.chain()
                ))
            })?;
        }
        self.settle(tx).await
    }
}
