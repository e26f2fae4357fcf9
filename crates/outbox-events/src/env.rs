//! The floor every attempt driver stands on (docs/state-machine.md, "The attempt"): how an
//! event's attempt ends ([`AttemptOutcome`]), the failure it records, and what a worker needs to
//! run attempts ([`AttemptEnv`]). The modules of the attempt machine are laid in floors, each
//! importing only from floors below it (`cargo xtask tidy` checks it): this one; the fences and
//! beats (`heartbeat`); the bookkeeping on the side (`detached`); one event's attempt
//! (`attempt`) and the batched attempt (`batch`), the two drivers of one per-event state
//! machine; the runner and the workers' loops (`runner`, `waits`, `legacy`); the dispatcher on
//! top.

use std::sync::Arc;

use outbox_persistence::{Claim, FailureBookkeeping, OutboxRepository};
use tokio_util::sync::CancellationToken;

use crate::config::WorkerConfig;
use crate::handlers::Handlers;
use crate::metrics::{Ended, Metrics};

/// Why a claim is given back unrun when its worker is stopping.
pub(crate) const STOPPING: &str = "not run: its worker is shutting down";

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// `processed`, committed with the handler's effects.
    Processed,
    /// Back to `pending` for another attempt.
    Retried,
    /// Back to `pending`, not counted: the handler asked to run later
    /// ([`crate::HandlerError::snooze`]).
    Snoozed,
    /// `failed`: a permanent error or the last allowed attempt.
    Failed,
    /// The claim was no longer this worker's; nothing was written.
    LostClaim,
    /// A hard shutdown cancelled the attempt; rolled back and left to stale reclaim.
    Cancelled,
    /// The attempt could not begin, or its detached bookkeeping could not land; the row will go
    /// stale and be reclaimed.
    Abandoned,
    /// The handler succeeded but the outbox could not write `processed` (a lock timeout, a
    /// serialization failure or deadlock on its own statement): the effects rolled back and
    /// the row went back to `pending` without counting the attempt.
    Released,
    /// A batched attempt gave the claim back before running it (its time budget was spent, an
    /// older event of the record failed, or the batch's transaction died first): back to
    /// `pending`, not counted.
    NotRun,
}

impl AttemptOutcome {
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            AttemptOutcome::Processed => "processed",
            AttemptOutcome::Retried => "retried",
            AttemptOutcome::Snoozed => "snoozed",
            AttemptOutcome::Failed => "failed",
            AttemptOutcome::LostClaim => "lost_claim",
            AttemptOutcome::Cancelled => "cancelled",
            AttemptOutcome::Abandoned => "abandoned",
            AttemptOutcome::Released => "released",
            AttemptOutcome::NotRun => "not_run",
        }
    }
}

/// What the worker needs to run attempts.
pub(crate) struct AttemptEnv {
    pub repo: Arc<dyn OutboxRepository>,
    pub handlers: Handlers,
    pub config: WorkerConfig,
    pub metrics: Arc<Metrics>,
    /// Cancelled at hard shutdown: in-flight attempts roll back.
    pub hard_stop: CancellationToken,
    /// Cancelled when a graceful shutdown begins: running handlers finish, but a worker's
    /// claims whose handlers have not started are given back unrun rather than run.
    pub stop: CancellationToken,
    /// One permit per worker: a pull worker or a legacy slot holds one from its claim to the
    /// end of the attempt, so that at most `workers` claims and attempts run at once across
    /// both paths (pull mode runs the legacy dispatcher beside the pull workers for excluded
    /// event types), each on one connection: the pool of `workers + 3` holds them.
    pub attempts: Arc<tokio::sync::Semaphore>,
    /// The paused event types, as this process last read them.
    pub paused: crate::pause::Paused,
}

impl AttemptEnv {
    /// Waits for an attempt permit, or for `stop` (`None`).
    pub(crate) async fn attempt_permit(
        &self,
        stop: &CancellationToken,
    ) -> Option<tokio::sync::SemaphorePermit<'_>> {
        tokio::select! {
            _ = stop.cancelled() => None,
            permit = self.attempts.acquire() => Some(permit.expect("the attempt semaphore is never closed")),
        }
    }
}

/// The failure to record, decided from the handler's error and the row's retry count.
pub(crate) struct Failure {
    pub(crate) bookkeeping: FailureBookkeeping,
    pub(crate) message: String,
    /// The effects the handler ran through the ledger before it failed: recorded with the
    /// failure's bookkeeping (after the rollback that undid the handler's writes), so a retry
    /// does not run them again.
    pub(crate) effects: Vec<outbox_persistence::EffectRecord>,
}

impl AttemptEnv {
    pub(crate) fn failure(&self, claim: &Claim, retryable: bool, message: String) -> Failure {
        self.failure_after(claim, retryable, None, message)
    }

    /// The failure a handler's error records: retried (not sooner than the delay it asked
    /// for, [`crate::HandlerError::retry_in`]) or `failed`.
    pub(crate) fn handler_failure(&self, claim: &Claim, error: &crate::HandlerError) -> Failure {
        if let crate::HandlerError::Snooze { delay, .. } = error {
            return self.snooze(claim, *delay, error.to_string());
        }
        self.failure_after(
            claim,
            error.is_retryable(),
            error.retry_delay(),
            error.to_string(),
        )
    }

    /// A snooze: uncounted, not eligible before `delay`. A row that failed before is eligible
    /// only once its `LastModifiedDate` is older than the retry cutoff, so the base retry delay
    /// is taken off its delay (the longer of the two is waited).
    fn snooze(&self, claim: &Claim, delay: std::time::Duration, message: String) -> Failure {
        let delay = delay.min(crate::handler::MAX_SNOOZE);
        let delay = if claim.event.retry_count > 0 {
            delay.saturating_sub(self.config.retry_delay)
        } else {
            delay
        };
        Failure {
            bookkeeping: FailureBookkeeping::Snooze { delay },
            message,
            effects: Vec::new(),
        }
    }

    fn failure_after(
        &self,
        claim: &Claim,
        retryable: bool,
        asked: Option<std::time::Duration>,
        message: String,
    ) -> Failure {
        let failures = claim.event.retry_count.saturating_add(1);
        let bookkeeping = if retryable && failures < self.config.max_retry_attempts {
            // The row waits `retry_delay` + `extra_delay`: a handler's own wait replaces the
            // worker's backoff when it is longer.
            let own = self.config.extra_retry_delay(failures);
            let asked = asked.map_or(own, |a| a.saturating_sub(self.config.retry_delay));
            FailureBookkeeping::Retry {
                extra_delay: own.max(asked),
            }
        } else {
            FailureBookkeeping::Fail
        };
        Failure {
            bookkeeping,
            message,
            effects: Vec::new(),
        }
    }
}

impl Failure {
    /// Logs a handler's failure (at info; a snooze, which is no failure, at debug).
    pub(crate) fn log(&self) {
        match self.bookkeeping {
            FailureBookkeeping::Snooze { .. } => {
                tracing::debug!(error = %self.message, "handler snoozed");
            }
            _ => tracing::info!(error = %self.message, "handler failed"),
        }
    }
}

pub(crate) fn failure_outcome(failure: &Failure) -> AttemptOutcome {
    match failure.bookkeeping {
        FailureBookkeeping::Retry { .. } => AttemptOutcome::Retried,
        FailureBookkeeping::Snooze { .. } => AttemptOutcome::Snoozed,
        FailureBookkeeping::Fail => AttemptOutcome::Failed,
    }
}

impl From<&AttemptOutcome> for Ended {
    fn from(outcome: &AttemptOutcome) -> Self {
        use AttemptOutcome as O;
        match outcome {
            O::Processed => Ended::Processed,
            O::Retried => Ended::Retried,
            O::Snoozed => Ended::Snoozed,
            O::Failed => Ended::Failed,
            O::LostClaim => Ended::LostClaim,
            O::Cancelled => Ended::Cancelled,
            O::Abandoned => Ended::Abandoned,
            O::Released => Ended::Released,
            O::NotRun => Ended::NotRun,
        }
    }
}
