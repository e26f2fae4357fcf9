//! One event of a batched attempt (docs/state-machine.md, "Batched attempts", rules 2 and 3):
//! its handler runs under the segment's savepoint (the worker's unstarted claims given back if
//! it runs long, rule 8), and its outcome is decided, to be written at the settle.

use std::time::Instant;

use outbox_persistence::Attempt;

use super::{Batch, Decision, Member, Step, Stop};
use crate::attempt::CatchPanic;
use crate::env::AttemptOutcome;
use crate::handler::{AttemptContext, HandlerError};

impl Batch<'_> {
    /// One event: its handler (the worker's claims not started yet given back if it runs
    /// long), then its outcome decided. Returns whether its effects stay in the transaction
    /// (its handler succeeded and used it): the segment then ends.
    pub(super) async fn event(&mut self, tx: &mut dyn Attempt, i: usize) -> Result<bool, Stop> {
        let env = self.env;
        let Member { claim, beat, .. } = self.members[i];
        self.ran += 1;
        self.steps[i] = Step::Ran(None);
        let handler = env
            .handlers
            .get_named(&claim.event.event_type)
            .map(|(name, h)| (name.to_owned(), h.clone()));
        let (result, touched, sent) = match handler {
            None => (
                Ok(Err(HandlerError::Permanent(format!(
                    "no handler registered for event type {:?}",
                    claim.event.event_type
                )))),
                false,
                Vec::new(),
            ),
            Some((name, handler)) => {
                let mut ctx = AttemptContext::for_attempt(tx, &name, claim.event.id);
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
                (result, ctx.touched(), sent)
            }
        };
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
                undo(tx, touched).await?;
                self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
                Ok(false)
            }
            Ok(Ok(())) if beat.lost.is_cancelled() => {
                self.on_side.extend(sent);
                undo(tx, touched).await?;
                self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
                Ok(false)
            }
            Ok(Ok(())) => {
                self.decide(i, Decision::processed(touched, sent));
                Ok(touched)
            }
            Ok(Err(error)) => {
                if error.is_lock_timeout() {
                    env.metrics.lock_timeout(&claim.event.event_type);
                }
                let mut failure = env.handler_failure(claim, &error);
                failure.effects = sent;
                tracing::info!(error = %failure.message, "handler failed");
                if let Err(stop) = undo(tx, touched).await {
                    self.steps[i] = Step::Ran(Some(failure));
                    return Err(stop);
                }
                self.decide(i, Decision::failed(failure));
                Ok(false)
            }
        }
    }
}

/// Undoes the running event's effects: rolls back to its savepoint, unless its handler never
/// asked for the transaction (nothing to undo).
async fn undo(tx: &mut dyn Attempt, touched: bool) -> Result<(), Stop> {
    if touched {
        rolled_back(tx).await
    } else {
        Ok(())
    }
}

/// Rolls back to the segment's savepoint; a failure there is the transaction dying.
async fn rolled_back(tx: &mut dyn Attempt) -> Result<(), Stop> {
    tx.rollback_to_savepoint()
        .await
        .map_err(|e| Stop::Died(format!("rollback to the savepoint failed: {}", e.chain())))
}
