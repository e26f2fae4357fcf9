//! The settle of a batched attempt (docs/state-machine.md, "Batched attempts", rules 2 and 3):
//! once its events ran, every decided outcome is written in the transaction, each under its
//! fence, held until the batch ends: the `processed` writes in one statement, then each retry,
//! `failed` or release.

use outbox_persistence::{Attempt, Error, Fence, FenceOutcome};
use tokio::sync::OwnedMutexGuard;

use super::{Batch, Decision, Step, Stop};
use crate::attempt::AttemptOutcome;
use crate::heartbeat::FenceState;

/// A decided event at the settle: its index, its decision and its fence, held.
type Held = (usize, Decision, OwnedMutexGuard<FenceState>);

impl Batch<'_> {
    /// Writes every decided outcome, fenced, in the transaction. A claim found lost writes
    /// nothing; if its effects are in the transaction (they cannot be undone alone), the batch
    /// stops as a give-back, as it does on a lock timeout or conflict; any other error is the
    /// transaction dying.
    pub(super) async fn settle(&mut self, tx: &mut dyn Attempt) -> Result<(), Stop> {
        let mut held: Vec<Held> = Vec::new();
        for i in 0..self.steps.len() {
            let step = std::mem::replace(&mut self.steps[i], Step::Waiting);
            let Step::Decided(decision) = step else {
                self.steps[i] = step;
                continue;
            };
            let cell = &self.members[i].1.fence;
            let fence = cell.lock_for_write(&self.env.repo).await;
            if fence.lost {
                drop(fence);
                if decision.kept_effects {
                    self.undecided(held);
                    return Err(self.lost_at_settle(i));
                }
                self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
                continue;
            }
            held.push((i, decision, fence));
        }
        if held.is_empty() {
            return Ok(());
        }
        let outcomes = match write_all(tx, &held).await {
            Ok(outcomes) => outcomes,
            Err(e) => {
                let (i, _, _) = &held[0];
                if e.is_lock_timeout() {
                    let claim = self.members[*i].0;
                    self.env.metrics.lock_timeout(&claim.event.event_type);
                }
                let error = format!("writing the outcomes failed: {}", e.chain());
                self.undecided(held);
                return Err(if e.is_lock_timeout() || e.is_conflict() {
                    Stop::GiveBack(error)
                } else {
                    Stop::Died(error)
                });
            }
        };
        let taken_back = held
            .iter()
            .zip(&outcomes)
            .find(|((_, decision, _), outcome)| {
                **outcome == FenceOutcome::Lost && decision.kept_effects
            })
            .map(|((i, _, _), _)| *i);
        if let Some(i) = taken_back {
            let others = held.into_iter().filter(|(j, _, _)| *j != i).collect();
            self.undecided(others);
            return Err(self.lost_at_settle(i));
        }
        for ((i, decision, fence), outcome) in held.into_iter().zip(outcomes) {
            // A lost claim without effects here (given back, failed and rolled back, or a
            // handler that never used the transaction) wrote nothing: it alone ends lost.
            self.steps[i] = match outcome {
                FenceOutcome::Written => Step::Written(decision, Some(fence)),
                FenceOutcome::Lost => Step::Done(AttemptOutcome::LostClaim),
            };
        }
        Ok(())
    }

    /// The settle stopped: these events' outcomes are decided, not written (fences let go).
    fn undecided(&mut self, held: Vec<Held>) {
        for (i, decision, _) in held {
            self.steps[i] = Step::Decided(decision);
        }
    }

    /// Event `i`'s claim turned out lost at the settle (reclaimed after its beats failed for
    /// `stale_after`) with its effects in the transaction, under later events' work: the batch
    /// gives back all.
    fn lost_at_settle(&mut self, i: usize) -> Stop {
        tracing::warn!(
            event_id = %self.members[i].0.event.id,
            "a claim of the batch was lost before its outcome was written; rolling the batch back and giving its events back"
        );
        self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
        Stop::GiveBack("a claim of the batch was lost before its outcome was written".into())
    }
}

/// Writes every held decision: the `processed` ones in one statement (several) or one, then
/// each of the others. One outcome per held event, in order; the first error stops it.
async fn write_all(tx: &mut dyn Attempt, held: &[Held]) -> Result<Vec<FenceOutcome>, Error> {
    let processed: Vec<usize> = (0..held.len())
        .filter(|&k| is_processed(&held[k].1))
        .collect();
    let mut outcomes = vec![FenceOutcome::Written; held.len()];
    let fences: Vec<Fence> = processed.iter().map(|&k| held[k].2.fence).collect();
    let written = match fences.as_slice() {
        [] => Vec::new(),
        [one] => vec![tx.mark_processed(*one).await?],
        _ => tx.mark_processed_many(fences).await?,
    };
    for (&k, outcome) in processed.iter().zip(written) {
        outcomes[k] = outcome;
    }
    for (k, (_, decision, fence)) in held.iter().enumerate() {
        outcomes[k] = match (&decision.release, &decision.failure) {
            (Some(why), _) => tx.release(fence.fence, why).await?,
            (None, Some(failure)) => {
                tx.record_failure(fence.fence, failure.bookkeeping, &failure.message)
                    .await?
            }
            (None, None) => continue,
        };
    }
    Ok(outcomes)
}

/// Whether `decision` is `processed` (written with the others in one statement).
fn is_processed(decision: &Decision) -> bool {
    decision.release.is_none() && decision.failure.is_none()
}
