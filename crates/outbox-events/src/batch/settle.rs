//! The settle of a batched attempt (docs/state-machine.md, "Batched attempts", rules 2 and 3):
//! once its events ran, every decided outcome is written in the transaction, in claim order,
//! each under its fence, held until the batch ends.

use outbox_persistence::{Attempt, Fence, FenceOutcome};

use super::{Batch, Decision, Step, Stop};
use crate::attempt::AttemptOutcome;

impl Batch<'_> {
    /// Writes every decided outcome, fenced, in the transaction. A write that finds its claim
    /// lost, or hits a lock timeout or conflict, stops the batch as a give-back (its event's
    /// effects cannot be undone alone); any other error is the transaction dying.
    pub(super) async fn settle(&mut self, tx: &mut dyn Attempt) -> Result<(), Stop> {
        for i in 0..self.steps.len() {
            let step = std::mem::replace(&mut self.steps[i], Step::Waiting);
            let Step::Decided(decision) = step else {
                self.steps[i] = step;
                continue;
            };
            let (claim, beat) = self.members[i];
            let fence = beat.fence.lock_owned().await;
            if fence.lost {
                return Err(self.lost_at_settle(i, decision));
            }
            let written = write(tx, &decision, fence.fence).await;
            match written {
                Ok(FenceOutcome::Written) => self.steps[i] = Step::Written(decision, Some(fence)),
                Ok(FenceOutcome::Lost) => {
                    drop(fence);
                    return Err(self.lost_at_settle(i, decision));
                }
                Err(e) => {
                    drop(fence);
                    self.steps[i] = Step::Decided(decision);
                    if e.is_lock_timeout() {
                        self.env.metrics.lock_timeout(&claim.event.event_type);
                    }
                    let error = format!("writing an outcome failed: {}", e.chain());
                    return Err(if e.is_lock_timeout() || e.is_conflict() {
                        Stop::GiveBack(error)
                    } else {
                        Stop::Died(error)
                    });
                }
            }
        }
        Ok(())
    }

    /// Event `i`'s claim turned out lost at the settle (reclaimed after its beats failed for
    /// `stale_after`): its effects sit under later events' work, so the batch gives back all.
    fn lost_at_settle(&mut self, i: usize, _decision: Decision) -> Stop {
        tracing::warn!(
            event_id = %self.members[i].0.event.id,
            "a claim of the batch was lost before its outcome was written; rolling the batch back and giving its events back"
        );
        self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
        Stop::GiveBack("a claim of the batch was lost before its outcome was written".into())
    }
}

/// The fenced write of `decision`.
async fn write(
    tx: &mut dyn Attempt,
    decision: &Decision,
    fence: Fence,
) -> outbox_persistence::Result<FenceOutcome> {
    match (&decision.release, &decision.failure) {
        (Some(why), _) => tx.release(fence, why).await,
        (None, Some(failure)) => {
            tx.record_failure(fence, failure.bookkeeping, &failure.message)
                .await
        }
        (None, None) => tx.mark_processed(fence).await,
    }
}
