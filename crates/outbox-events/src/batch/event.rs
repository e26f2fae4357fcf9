//! One event of a batched attempt (docs/state-machine.md, "Batched attempts", rules 2 and 3):
//! its handler runs under the segment's savepoint (the worker's unstarted claims given back if
//! it runs long, rule 8), and its outcome is decided, to be written at the settle.

use std::sync::Arc;
use std::time::Instant;

use outbox_persistence::{Attempt, Claim, EffectRecord, NewEvent};

use super::{Batch, Decision, Member, Step, Stop};
use crate::attempt::CatchPanic;
use crate::env::{AttemptEnv, AttemptOutcome};
use crate::handler::{AttemptContext, Handler, HandlerError};

/// What an event left in the segment's transaction.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Kept {
    /// Its handler succeeded and used the transaction: its effects stay.
    pub(super) effects: bool,
    /// Through `ctx.tx()`, whose statements may hold locks: the segment ends after it, unless
    /// it shares writes (rule 11).
    pub(super) locking: bool,
    /// It failed as a later handler of a segment that shares writes (its lock waits bounded):
    /// its effects are rolled back and it waits to run first in the next segment, uncounted
    /// (rule 11).
    pub(super) again: bool,
}

/// How a segment of the batch (one transaction) ended its events.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Segment {
    /// Every event ran or was given back.
    Done,
    /// A handler kept effects in the transaction that may hold locks (`ctx.tx()`): the
    /// segment settles and commits before another handler runs (rule 2), so the transaction
    /// never holds two handlers' locks; or a segment that shares writes (rule 11) ended.
    Effects,
}

/// A handler's result, or why it did not end (its claim lost, a hard stop).
type HandlerRun = Result<Result<(), HandlerError>, AttemptOutcome>;

impl Batch<'_> {
    /// One event: its handler (the worker's claims not started yet given back if it runs
    /// long), then its outcome decided. Returns what its effects left in the transaction.
    /// When earlier handlers of the segment kept effects, it runs under a savepoint of its
    /// own, so that its failure undoes only its own.
    pub(super) async fn event(&mut self, tx: &mut dyn Attempt, i: usize) -> Result<Kept, Stop> {
        let env = self.env;
        let Member { claim, beat, .. } = self.members[i];
        let own = self.segment_effects;
        if own {
            // A later handler of a segment that shares writes waits for locks no longer than
            // the bound, set again for each (a handler before it may have set its own).
            let bound = self.env.config.shared_writes_lock_wait();
            let savepoint = match bound {
                Some(bound) if self.locks_since.is_some() => tx.bounded_savepoint(bound).await,
                _ => tx.savepoint().await,
            };
            savepoint.map_err(|e| {
                Stop::Died(format!(
                    "setting an event's savepoint failed: {}",
                    e.chain()
                ))
            })?;
        }
        let time_before = self.handler_time;
        self.ran += 1;
        self.steps[i] = Step::Ran(None);
        let (result, (touched, locking), (sent, owned)) = self.run_handler(tx, i).await;
        match result {
            Err(AttemptOutcome::Cancelled) => {
                self.on_side.extend(sent);
                Err(Stop::Cancelled)
            }
            // Lost (found by its beat while the handler ran, or as it ended): its effects must
            // not commit, and nothing is written for it; the external ones it ran are kept in
            // the ledger on the side.
            Err(_) => {
                self.on_side.extend(sent);
                undo(tx, touched, own).await?;
                self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
                Ok(Kept::default())
            }
            Ok(Ok(())) if beat.lost.is_cancelled() => {
                self.on_side.extend(sent);
                undo(tx, touched, own).await?;
                self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
                Ok(Kept::default())
            }
            Ok(Ok(())) => {
                self.decide(i, Decision::processed(touched, sent, owned));
                Ok(Kept {
                    effects: touched,
                    locking: touched && locking,
                    again: false,
                })
            }
            Ok(Err(error)) if touched && self.locks_since.is_some() => {
                self.again(tx, i, &error, sent, time_before).await
            }
            Ok(Err(error)) => {
                if error.is_lock_timeout() {
                    env.metrics.lock_timeout(&claim.event.event_type);
                }
                let mut failure = env.handler_failure(claim, &error);
                failure.effects = sent;
                failure.log();
                if let Err(stop) = undo(tx, touched, own).await {
                    self.steps[i] = Step::Ran(Some(failure));
                    return Err(stop);
                }
                self.decide(i, Decision::failed(failure));
                Ok(Kept::default())
            }
        }
    }

    /// Event `i` failed as a later handler of a segment that shares writes, after using the
    /// transaction (rule 11): its lock waits were bounded, and a handler may wrap the bound's
    /// lock timeout into an error of its own, so no such failure is counted. Undone, it runs
    /// again first in the next segment, with the attempt's lock timeout, where a failure of its
    /// own is counted; its time is not the batch's, and what it sent is recorded once this
    /// segment ends (or with a segment that dies), so it is not sent again.
    async fn again(
        &mut self,
        tx: &mut dyn Attempt,
        i: usize,
        error: &HandlerError,
        sent: Vec<EffectRecord>,
        time_before: std::time::Duration,
    ) -> Result<Kept, Stop> {
        self.on_side.extend(sent);
        undo(tx, true, true).await?;
        let event_type = &self.members[i].claim.event.event_type;
        self.env.metrics.shared_write_rerun(event_type);
        tracing::debug!(error = %error, "failed in a shared segment; run again first in the next");
        self.handler_time = time_before;
        self.ran -= 1;
        self.steps[i] = Step::Waiting;
        Ok(Kept {
            again: true,
            ..Kept::default()
        })
    }

    /// Runs event `i`'s handler: its result (or why it did not end), whether it used the
    /// transaction (and through `ctx.tx()`), the effects it ran through the ledger and the
    /// owned rows it enqueued (deferred to the settle).
    async fn run_handler(
        &mut self,
        tx: &mut dyn Attempt,
        i: usize,
    ) -> (HandlerRun, (bool, bool), (Vec<EffectRecord>, Vec<NewEvent>)) {
        let env = self.env;
        let Member { claim, beat, .. } = self.members[i];
        let (name, handler) = match handler_of(env, claim) {
            Ok(found) => found,
            Err(missing) => return (Ok(Err(missing)), (false, false), Default::default()),
        };
        let mut ctx =
            AttemptContext::for_attempt(tx, &name, claim.event.id).deferring_owned_enqueues();
        let started = Instant::now();
        let result = self
            .unstarted
            .while_running(async {
                tokio::select! {
                    biased;
                    _ = beat.lost.cancelled() => Err(AttemptOutcome::LostClaim),
                    _ = env.hard_stop.cancelled() => Err(AttemptOutcome::Cancelled),
                    result = CatchPanic(handler.handle(&claim.event, &mut ctx)) => Ok(result),
                }
            })
            .await;
        let took = started.elapsed();
        self.handler_time += took;
        env.metrics.handler_ran(&claim.event.event_type, took);
        let sent = ctx.take_sent();
        let owned = ctx.take_deferred();
        (result, (ctx.touched(), ctx.locking()), (sent, owned))
    }
}

/// The handler of `claim`'s event type with its consumer's name (the ledger's handler id), or
/// the event's permanent failure when none is registered.
pub(super) fn handler_of(
    env: &AttemptEnv,
    claim: &Claim,
) -> Result<(String, Arc<dyn Handler>), HandlerError> {
    env.handlers
        .get_named(&claim.event.event_type)
        .map(|(name, h)| (name.to_owned(), h.clone()))
        .ok_or_else(|| {
            HandlerError::Permanent(format!(
                "no handler registered for event type {:?}",
                claim.event.event_type
            ))
        })
}

/// Undoes the running event's effects: rolls back to its own savepoint (`own`: earlier
/// handlers of the segment kept theirs) or the segment's, unless its handler never asked for
/// the transaction (nothing to undo). A failure is the transaction dying.
async fn undo(tx: &mut dyn Attempt, touched: bool, own: bool) -> Result<(), Stop> {
    if !touched {
        return Ok(());
    }
    let rolled_back = if own {
        tx.rollback_to_event_savepoint().await
    } else {
        tx.rollback_to_savepoint().await
    };
    rolled_back.map_err(|e| Stop::Died(format!("rollback to the savepoint failed: {}", e.chain())))
}
