//! A batched attempt whose transaction died (docs/state-machine.md, "Batched attempts", rule
//! 5): none of it is processed; each event that ran is counted on the detached path, each event
//! not run is given back uncounted.

use outbox_persistence::Claim;

use super::{BATCH_DIED, Batch, Step};
use crate::attempt::{AttemptOutcome, Failure};
use crate::detached::{detached, release};

impl Batch<'_> {
    /// The transaction died (`commit`: its `COMMIT` reported `error`, so it may have landed):
    /// none of the batch is processed. Each event that ran is counted on the detached path,
    /// each event not run is given back uncounted (rule 5).
    pub(super) async fn died(&mut self, error: &str, commit: bool) {
        tracing::warn!(
            error,
            "the batched attempt's transaction failed; accounting for each of its events on the side"
        );
        // Every fence held for the commit is let go first: the detached bookkeeping below takes
        // each in turn, and the heartbeats of those waiting their turn must beat meanwhile.
        let mut steps = std::mem::take(&mut self.steps);
        for step in &mut steps {
            if let Step::Written { fence, .. } = step {
                fence.take();
            }
        }
        for (i, step) in steps.into_iter().enumerate() {
            let (claim, beat) = self.members[i];
            let outcome = match step {
                Step::Done(outcome) => outcome,
                Step::Waiting => not_run(release(self.env, beat, BATCH_DIED).await),
                Step::Written {
                    outcome: AttemptOutcome::NotRun,
                    ..
                } => not_run(release(self.env, beat, BATCH_DIED).await),
                Step::Written {
                    failure, landed, ..
                } => {
                    let failure = failure.unwrap_or_else(|| self.dead_failure(claim, error));
                    let landed = if commit { landed } else { None };
                    detached(self.env, claim, beat, failure, landed).await
                }
                Step::Ran(failure) => {
                    let failure = failure.unwrap_or_else(|| self.dead_failure(claim, error));
                    detached(self.env, claim, beat, failure, None).await
                }
            };
            self.steps.push(Step::Done(outcome));
        }
    }

    /// The counted failure of an event whose batch's transaction died.
    fn dead_failure(&self, claim: &Claim, error: &str) -> Failure {
        self.env.failure(
            claim,
            true,
            format!("the batched attempt's transaction failed: {error}"),
        )
    }
}

/// A release after the batch died is a claim given back unrun.
fn not_run(outcome: AttemptOutcome) -> AttemptOutcome {
    match outcome {
        AttemptOutcome::Released => AttemptOutcome::NotRun,
        other => other,
    }
}
