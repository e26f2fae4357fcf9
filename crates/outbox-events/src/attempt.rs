//! The attempt state machine of one claimed row (see `docs/state-machine.md`):
//!
//! 1. begin the attempt transaction, set its lock timeout, take the post-claim savepoint;
//! 2. run the handler in it;
//! 3. success: write `processed` (fenced) and commit;
//! 4. handler error or lock timeout: roll back to the savepoint, write the retry or `failed`
//!    state (fenced) and commit, and only then release the attempt;
//! 5. if the attempt transaction itself fails (lost connection, commit error, restart), the
//!    heartbeat keeps the claim alive while the same bookkeeping lands on a connection of its
//!    own, retried with backoff; a worker that gives up lets the row go stale, to be reclaimed;
//!    an attempt that cannot even begin is retried the same way but counts nothing (its handler
//!    never ran);
//! 6. a claim found lost (reclaimed, or finished elsewhere) is abandoned: roll back, write
//!    nothing.

use std::time::{Duration, Instant};

use outbox_persistence::{Attempt, Claim, EffectRecord, FenceOutcome};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, field};

use crate::detached::{
    DETACHED_FIRST_BACKOFF, DETACHED_MAX_BACKOFF, DETACHED_MAX_TRIES, Landed, detached, record_in,
    record_on_side, record_on_side_briefly, release,
};
use crate::env::{AttemptEnv, AttemptOutcome, Failure, STOPPING, failure_outcome};
use crate::handler::{AttemptContext, HandlerError};
use crate::heartbeat::{Beat, FenceCell};
use crate::metrics::Ended;

pub(crate) async fn run(env: &AttemptEnv, claim: Claim) -> AttemptOutcome {
    run_timed(env, claim).await.0
}

/// [`run`], and how long its handler ran (zero when it did not run).
pub(crate) async fn run_timed(env: &AttemptEnv, claim: Claim) -> (AttemptOutcome, Duration) {
    let claimed_at = Instant::now();
    let fence = FenceCell::new(claim.fence, claim.event.retry_count);
    let lost = CancellationToken::new();
    let beat = Beat::new(env, fence, lost);
    // The claim beats from one heartbeat interval after the claim on. An attempt that ends
    // sooner (most do) never needs a heartbeat task: the first interval is timed here, in
    // the attempt's own task, and the task that beats is spawned only when it passes. A
    // backend whose attempts exclude other writers stops the beat once the attempt has
    // begun (nobody can reclaim the row until the attempt commits, and the beat could not
    // write meanwhile); until then the claim may wait for the write lock behind other
    // attempts, and must not look silent.
    let body = one(env, &claim, &beat, claimed_at);
    tokio::pin!(body);
    tokio::select! {
        biased;
        outcome = &mut body => outcome,
        _ = tokio::time::sleep(env.config.heartbeat_interval) => {
            beat.start_after_first_interval();
            body.await
        }
    }
}

/// The attempt of one claim whose beat is `beat` (not started before its first interval),
/// claimed at `claimed_at`: its span, its metrics, and how long its handler ran.
pub(crate) async fn one(
    env: &AttemptEnv,
    claim: &Claim,
    beat: &Beat<'_>,
    claimed_at: Instant,
) -> (AttemptOutcome, Duration) {
    let span = attempt_span(claim);
    async move {
        let event_type = claim.event.event_type.as_str();
        env.metrics.claimed(event_type, claim.reclaimed);
        let (outcome, handler_time) = attempt(env, claim, beat).await;
        beat.stop();
        ended(env, claim, &outcome, claimed_at);
        (outcome, handler_time)
    }
    .instrument(span)
    .await
}

/// The span of one event's attempt.
pub(crate) fn attempt_span(claim: &Claim) -> tracing::Span {
    let span = tracing::info_span!(
        "outbox.attempt",
        event_id = %claim.event.id,
        event_type = %claim.event.event_type,
        record_key = claim.event.record_key.as_ref().map_or("", |k| k.as_str()),
        attempt = claim.event.retry_count + 1,
        reclaimed = claim.reclaimed,
        outcome = field::Empty,
        traceparent = field::Empty,
    );
    crate::trace::note_on_span(&span, &claim.event.payload);
    span
}

/// Counts how an event's attempt ended (in the current span).
pub(crate) fn ended(
    env: &AttemptEnv,
    claim: &Claim,
    outcome: &AttemptOutcome,
    claimed_at: Instant,
) {
    // Both ends of the wait in the queue are the database's times (`CreatedDate` and the
    // claim's `LastModifiedDate`); the attempt itself is timed on this host's monotonic
    // clock. A skewed host clock changes neither.
    let queued = (claim.fence.last_written - claim.event.created_date)
        .to_std()
        .ok();
    env.metrics.ended(
        &claim.event.event_type,
        Ended::from(outcome),
        claimed_at.elapsed(),
        queued,
    );
    tracing::Span::current().record("outcome", outcome.as_str());
    if *outcome == AttemptOutcome::LostClaim {
        // Never expected of a live worker: worth a line with the claim's history around it.
        tracing::warn!(event_id = %claim.event.id, retry_count = claim.event.retry_count, reclaimed = claim.reclaimed, attempt_ms = claimed_at.elapsed().as_millis() as u64, "claim lost: the attempt ended without writing its outcome");
    } else {
        tracing::debug!("attempt finished");
    }
}

/// Opens the attempt transaction. A failure to begin (the database is down, the pool is
/// exhausted, SQLite's writer is busy) is not a failed attempt: the handler never ran, so
/// nothing is counted. The claim is kept alive while beginning is retried with backoff; a
/// worker that gives up leaves the row to go stale and be reclaimed as it was.
async fn begin(
    env: &AttemptEnv,
    event_type: &str,
    beat: &Beat<'_>,
) -> Result<Box<dyn Attempt>, AttemptOutcome> {
    let mut backoff = DETACHED_FIRST_BACKOFF;
    for try_number in 1..=DETACHED_MAX_TRIES {
        let begun = {
            // The fence cannot move while the attempt checks it (SQLite checks it at begin);
            // after a failed beat it is read back first (its own beat may have landed).
            let state = beat.fence.lock_for_write(&env.repo).await;
            if state.lost {
                return Err(AttemptOutcome::LostClaim);
            }
            env.repo
                .begin_attempt(env.config.lock_timeout, state.fence)
                .await
        };
        match begun {
            Ok(Some(tx)) => {
                if env.repo.serializes_writers() {
                    // The attempt now holds the only write lock: a heartbeat could not write
                    // and nobody can reclaim the row until it commits.
                    beat.stop();
                }
                return Ok(tx);
            }
            Ok(None) => return Err(AttemptOutcome::LostClaim),
            Err(e) => {
                if e.is_lock_timeout() {
                    env.metrics.lock_timeout(event_type);
                }
                tracing::warn!(
                    error = %e.chain(),
                    try_number,
                    "could not begin the attempt; the claim is kept while it retries"
                );
                beat.ensure_running(true);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = beat.lost.cancelled() => return Err(AttemptOutcome::LostClaim),
            _ = env.hard_stop.cancelled() => return Err(AttemptOutcome::Cancelled),
            // A graceful shutdown: the claim goes back (uncounted) rather than waiting out the
            // retries; its handler never ran.
            _ = env.stop.cancelled() => {
                return Err(crate::detached::give_back(env, beat, STOPPING).await);
            }
        }
        backoff = (backoff * 2).min(DETACHED_MAX_BACKOFF);
    }
    tracing::error!(
        "giving up on beginning the attempt; the row goes stale and its reclaim counts an attempt"
    );
    Err(AttemptOutcome::Abandoned)
}

async fn attempt(env: &AttemptEnv, claim: &Claim, beat: &Beat<'_>) -> (AttemptOutcome, Duration) {
    let mut tx = match begin(env, &claim.event.event_type, beat).await {
        Ok(tx) => tx,
        Err(outcome) => return (outcome, Duration::ZERO),
    };
    let lost = beat.lost.clone();
    let lost = &lost;

    let handler = env
        .handlers
        .get_named(&claim.event.event_type)
        .map(|(name, h)| (name.to_owned(), h.clone()));
    let mut handler_time = Duration::ZERO;
    let mut sent = Vec::new();
    let result = match handler {
        None => Ok(Err(HandlerError::Permanent(format!(
            "no handler registered for event type {:?}",
            claim.event.event_type
        )))),
        Some((name, handler)) => {
            let mut ctx = AttemptContext::for_attempt(tx.as_mut(), &name, claim.event.id);
            let started = Instant::now();
            let result = tokio::select! {
                biased;
                _ = lost.cancelled() => Err(AttemptOutcome::LostClaim),
                _ = env.hard_stop.cancelled() => Err(AttemptOutcome::Cancelled),
                result = CatchPanic(handler.handle(&claim.event, &mut ctx)) => Ok(result),
            };
            handler_time = started.elapsed();
            env.metrics
                .handler_ran(&claim.event.event_type, handler_time);
            sent = ctx.take_sent();
            result
        }
    };
    let result = match result {
        Ok(result) => result,
        Err(interrupted) => {
            rollback_quietly(tx.as_mut()).await;
            if interrupted == AttemptOutcome::Cancelled {
                // Past the shutdown timeout the row is left to stale reclaim; the effects its
                // handler ran get one bounded try in the ledger, so that the reclaim skips them.
                tracing::warn!("attempt cancelled by shutdown; the row is left to stale reclaim");
                record_on_side_briefly(env, &sent).await;
            } else {
                record_on_side(env, &sent).await;
            }
            return (interrupted, handler_time);
        }
    };

    let outcome = match result {
        Ok(()) => finish_success(env, claim, beat, tx, sent).await,
        Err(error) => {
            if error.is_lock_timeout() {
                env.metrics.lock_timeout(&claim.event.event_type);
            }
            let mut failure = env.handler_failure(claim, &error);
            failure.effects = sent;
            failure.log();
            finish_failure(env, claim, beat, tx, failure).await
        }
    };
    (outcome, handler_time)
}

async fn finish_success(
    env: &AttemptEnv,
    claim: &Claim,
    beat: &Beat<'_>,
    mut tx: Box<dyn Attempt>,
    sent: Vec<EffectRecord>,
) -> AttemptOutcome {
    let fence = beat.fence.clone();
    let state = fence.lock_for_write(&env.repo).await;
    if state.lost {
        drop(state);
        rollback_quietly(tx.as_mut()).await;
        record_on_side(env, &sent).await;
        return AttemptOutcome::LostClaim;
    }
    let written = tx.mark_processed(state.fence).await;
    match written {
        Ok(FenceOutcome::Written) => match tx.commit().await {
            Ok(()) => AttemptOutcome::Processed,
            Err(e) => {
                drop(state);
                // The effects did not commit (or the outcome is unknown): record a retry on
                // the side. If the commit did land, the row is `processed` and the fenced
                // write finds nothing to change.
                let mut failure = env.failure(claim, true, format!("commit failed: {}", e.chain()));
                failure.effects = sent;
                detached(env, claim, beat, failure, Some(Landed::Processed)).await
            }
        },
        Ok(FenceOutcome::Lost) => {
            drop(state);
            rollback_quietly(tx.as_mut()).await;
            record_on_side(env, &sent).await;
            AttemptOutcome::LostClaim
        }
        Err(e) => {
            drop(state);
            rollback_quietly(tx.as_mut()).await;
            if e.is_lock_timeout() {
                env.metrics.lock_timeout(&claim.event.event_type);
            }
            let message = format!("could not mark processed: {}", e.chain());
            if e.is_lock_timeout() || e.is_conflict() {
                // The handler succeeded; the outbox's own write waited too long for a lock, or
                // the server aborted it to resolve a conflict. Not the event's fault: it runs
                // again without being counted. (A lost connection is the attempt transaction
                // dying, which is counted: the event may be what kills it.)
                tracing::warn!(error = %message, "the handler succeeded but its outcome could not be written; releasing the claim uncounted");
                record_on_side(env, &sent).await;
                return release(env, beat, &message).await;
            }
            let mut failure = env.failure(claim, true, message);
            failure.effects = sent;
            detached(env, claim, beat, failure, None).await
        }
    }
}

async fn finish_failure(
    env: &AttemptEnv,
    claim: &Claim,
    beat: &Beat<'_>,
    mut tx: Box<dyn Attempt>,
    failure: Failure,
) -> AttemptOutcome {
    let fence = beat.fence.clone();
    if let Err(e) = tx.rollback_to_savepoint().await {
        tracing::warn!(error = %e.chain(), "rollback to the post-claim savepoint failed; recording the failure on the side");
        rollback_quietly(tx.as_mut()).await;
        return detached(env, claim, beat, failure, None).await;
    }
    let state = fence.lock_for_write(&env.repo).await;
    if state.lost {
        drop(state);
        rollback_quietly(tx.as_mut()).await;
        record_on_side(env, &failure.effects).await;
        return AttemptOutcome::LostClaim;
    }
    let written = match record_in(tx.as_mut(), &failure.effects).await {
        Ok(()) => {
            tx.record_failure(state.fence, failure.bookkeeping, &failure.message)
                .await
        }
        Err(e) => Err(e),
    };
    match written {
        Ok(FenceOutcome::Written) => match tx.commit().await {
            Ok(()) => failure_outcome(&failure),
            Err(e) => {
                drop(state);
                tracing::warn!(error = %e.chain(), "commit of the failure bookkeeping failed; recording it on the side");
                detached(env, claim, beat, failure, Some(Landed::Failure)).await
            }
        },
        Ok(FenceOutcome::Lost) => {
            drop(state);
            rollback_quietly(tx.as_mut()).await;
            record_on_side(env, &failure.effects).await;
            AttemptOutcome::LostClaim
        }
        Err(e) => {
            drop(state);
            tracing::warn!(error = %e.chain(), "failure bookkeeping in the attempt failed; recording it on the side");
            rollback_quietly(tx.as_mut()).await;
            detached(env, claim, beat, failure, None).await
        }
    }
}

pub(crate) async fn rollback_quietly(tx: &mut dyn Attempt) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e.chain(), "rollback failed (the transaction is gone with its connection)");
    }
}

/// Turns a handler's panic into a retryable error, so a panicking handler never takes its
/// worker down; a handler that always panics ends `failed` at `MaxRetryAttempts`.
pub(crate) struct CatchPanic<F>(pub(crate) F);

impl<F> std::future::Future for CatchPanic<F>
where
    F: std::future::Future<Output = Result<(), HandlerError>> + Unpin,
{
    type Output = Result<(), HandlerError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let inner = &mut self.0;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            std::pin::Pin::new(inner).poll(cx)
        })) {
            Ok(poll) => poll,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-string panic".to_string());
                std::task::Poll::Ready(Err(HandlerError::Retryable(format!(
                    "handler panicked: {message}"
                ))))
            }
        }
    }
}
