//! A batched attempt whose transaction died (docs/state-machine.md, "Batched attempts", rule
//! 5): none of it is processed; each event that ran is counted on the detached path, each event
//! not run is given back uncounted. And one rolled back at its settle for no event's fault
//! (rule 3): each event is given back uncounted, a failed handler's failure still counted.

use outbox_persistence::Claim;

use super::{BATCH_DIED, Batch, Decision, Step};
use crate::detached::{Landed, detached, give_back, give_back_landed, record_on_side, release};
use crate::env::{AttemptOutcome, Failure};
use crate::heartbeat::Beat;

/// Why the events of a batch rolled back at its settle are given back.
const GIVEN_BACK: &str = "not run: the batched attempt was rolled back at its settle";

/// How the batch's transaction ended without committing.
#[derive(Clone, Copy)]
enum Ending<'e> {
    /// It died (`commit`: its `COMMIT` reported `error`, so it may have landed).
    Died { error: &'e str, commit: bool },
    /// It was rolled back at the settle for no event's fault.
    GaveBack,
}

impl Ending<'_> {
    /// Why an event not run is given back.
    fn why(self) -> &'static str {
        match self {
            Ending::Died { .. } => BATCH_DIED,
            Ending::GaveBack => GIVEN_BACK,
        }
    }
}

impl Batch<'_> {
    /// The transaction died (`commit`: its `COMMIT` reported `error`, so it may have landed):
    /// none of the batch is processed. Each event that ran is counted on the detached path,
    /// each event not run is given back uncounted (rule 5).
    pub(super) async fn died(&mut self, error: &str, commit: bool) {
        tracing::warn!(
            error,
            "the batched attempt's transaction failed; accounting for each of its events on the side"
        );
        self.account(Ending::Died { error, commit }).await;
    }

    /// The batch was rolled back at its settle (a claim lost, a lock timeout or a conflict on
    /// an outcome's write): every event is given back uncounted to run again, except that a
    /// failed handler's failure is still recorded (rule 3).
    pub(super) async fn gave_back(&mut self, why: &str) {
        tracing::warn!(
            why,
            "the batched attempt was rolled back at its settle; giving its events back"
        );
        self.account(Ending::GaveBack).await;
    }

    /// Accounts on the side for every event the rolled-back transaction did not end.
    async fn account(&mut self, ending: Ending<'_>) {
        // Claims given back meanwhile (rule 8) are not released twice.
        self.take_given_back();
        // A `COMMIT` that reported an error may have landed whatever this worker tracked as
        // written: every give-back and outcome then reads the row back when the claim turns
        // out gone (a reclaim is told apart by its count and error).
        let may_have_landed = matches!(ending, Ending::Died { commit: true, .. });
        // Every fence held for the settle is let go first: the bookkeeping below takes each in
        // turn, and the heartbeats of those waiting their turn must beat meanwhile. A written
        // outcome that may have landed is marked so first: a beat finding its row finished is
        // the read-back's to judge, not a lost claim to report.
        for step in &mut self.steps {
            if let Step::Written(_, fence) = step {
                if let Some(held) = fence.as_mut() {
                    held.outcome_unsure = may_have_landed;
                }
                fence.take();
            }
        }
        // The effects the handlers ran were rolled back with the transaction: kept in the
        // ledger on the side, in one write (a failure's with its bookkeeping, on the detached
        // path).
        // With them, those of the segment's lost claims (`on_side`). The claims not ended beat
        // meanwhile (on a backend that serializes writers they went without beats during the
        // segment).
        let mut effects = std::mem::take(&mut self.on_side);
        for (i, step) in self.steps.iter_mut().enumerate() {
            if let Step::Decided(d) | Step::Written(d, _) = step {
                effects.append(&mut d.effects);
            }
            if !matches!(step, Step::Done(_)) {
                self.members[i].beat.ensure_running(true);
            }
        }
        record_on_side(self.env, &effects).await;
        for (i, step) in std::mem::take(&mut self.steps).into_iter().enumerate() {
            let (claim, beat) = (self.members[i].claim, self.members[i].beat);
            let why = ending.why();
            let outcome = match step {
                Step::Done(outcome) => outcome,
                Step::Waiting if !self.unstarted.start(self.members[i].index) => {
                    self.unstarted.outcome(self.members[i].index)
                }
                // A decided give-back may have been written by the settle before the `COMMIT`;
                // a waiting member never is (the batch only reads it), so a plain release.
                Step::Decided(Decision {
                    release: Some(_), ..
                }) if may_have_landed => give_back_landed(self.env, claim, beat, why).await,
                Step::Written(d, _) if d.release.is_some() && may_have_landed => {
                    give_back_landed(self.env, claim, beat, why).await
                }
                Step::Waiting => give_back(self.env, beat, why).await,
                Step::Decided(d) | Step::Written(d, _) if d.release.is_some() => {
                    give_back(self.env, beat, why).await
                }
                Step::Written(d, _) | Step::Decided(d) => {
                    let landed = if may_have_landed { d.landed() } else { None };
                    self.ran(claim, beat, d.failure, landed, ending).await
                }
                Step::Ran(failure) => self.ran(claim, beat, failure, None, ending).await,
            };
            // Its row is no longer this worker's claim: beating it would only find it gone.
            beat.stop();
            self.steps.push(Step::Done(outcome));
        }
    }

    /// Accounts for an event whose handler ran (`failure`: its own, if it failed) in a batch
    /// that ended so: counted on the detached path if the batch died or the handler failed,
    /// otherwise given back uncounted.
    async fn ran(
        &self,
        claim: &Claim,
        beat: &Beat<'_>,
        failure: Option<Failure>,
        landed: Option<Landed>,
        ending: Ending<'_>,
    ) -> AttemptOutcome {
        match (failure, ending) {
            (Some(failure), _) => detached(self.env, claim, beat, failure, landed).await,
            (None, Ending::Died { error, .. }) => {
                let failure = self.dead_failure(claim, error);
                detached(self.env, claim, beat, failure, landed).await
            }
            (None, Ending::GaveBack) => release(self.env, beat, GIVEN_BACK).await,
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
