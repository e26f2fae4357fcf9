//! [`ClaimRunner`]: the attempt machine for a service that claims rows itself, and for tests
//! over mocked repositories; the same drivers the dispatcher's workers run.

use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{Claim, OutboxRepository};
use tokio_util::sync::CancellationToken;

use crate::config::WorkerConfig;
use crate::env::{AttemptEnv, AttemptOutcome};
use crate::handlers::Handlers;
use crate::metrics::Metrics;

/// Runs the attempt of one claimed row to its end, as a dispatcher's worker does: for an
/// application that claims rows itself (`OutboxRepository::claim_next`), and for tests of the
/// attempt state machine over mocked repositories (the expectations each path needs are
/// listed in `outbox_events::mock`, feature `mock`).
pub struct ClaimRunner {
    env: AttemptEnv,
}

impl ClaimRunner {
    /// A runner over `repo` with `handlers` and `config`, its own counters, and no hard stop.
    pub fn new(repo: Arc<dyn OutboxRepository>, handlers: Handlers, config: WorkerConfig) -> Self {
        Self {
            env: AttemptEnv {
                repo,
                handlers,
                config,
                metrics: Arc::default(),
                hard_stop: CancellationToken::new(),
                stop: CancellationToken::new(),
                attempts: Arc::new(tokio::sync::Semaphore::new(
                    tokio::sync::Semaphore::MAX_PERMITS,
                )),
                paused: crate::pause::Paused::default(),
            },
        }
    }

    /// Counts into `metrics` (for example a dispatcher's).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.env.metrics = metrics;
        self
    }

    /// Cancelling `hard_stop` rolls the running attempt back and leaves its row to stale
    /// reclaim (a hard shutdown).
    pub fn with_hard_stop(mut self, hard_stop: CancellationToken) -> Self {
        self.env.hard_stop = hard_stop;
        self
    }

    /// Cancelling `stop` begins a graceful stop: a running handler finishes, and claims whose
    /// handlers have not started (or whose attempt cannot begin yet) are given back uncounted.
    pub fn with_stop(mut self, stop: CancellationToken) -> Self {
        self.env.stop = stop;
        self
    }

    /// The counters.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.env.metrics.clone()
    }

    /// Runs `claim`'s attempt to its end.
    pub async fn run(&self, claim: Claim) -> AttemptOutcome {
        crate::attempt::run(&self.env, claim).await
    }

    /// Runs `claims`, claimed together (`OutboxRepository::claim_batch`), as a pull worker
    /// does: batched where they may share a transaction (docs/state-machine.md, "Batched
    /// attempts"), the others each in an attempt of its own. Call it as soon as the claims are
    /// made. Returns the handlers' total time and how many handlers ran.
    pub async fn run_batch(&self, claims: Vec<Claim>) -> (Duration, usize) {
        crate::batch::run(&self.env, claims).await
    }
}
