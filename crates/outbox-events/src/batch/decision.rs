//! An event's decided outcome in a batched attempt (docs/state-machine.md, "Batched
//! attempts", rules 2 and 3): what its handler's run decided, written at the settle.

use outbox_persistence::{EffectRecord, NewEvent};

use crate::detached::Landed;
use crate::env::{AttemptOutcome, Failure, failure_outcome};

/// An event's decided outcome and the fenced write that records it at the settle.
pub(super) struct Decision {
    pub(super) outcome: AttemptOutcome,
    /// Whether its effects are in the transaction (a handler that succeeded and used it): a
    /// claim found lost at the settle with effects kept takes the batch back with it.
    pub(super) kept_effects: bool,
    /// Its own failure (a failed handler): the retry or `failed` written, and recorded again
    /// on the side if the transaction dies.
    pub(super) failure: Option<Failure>,
    /// Why it is given back uncounted (a release), if it is.
    pub(super) release: Option<&'static str>,
    /// The effects its handler ran through the ledger (a failed handler's are its failure's):
    /// in the transaction while it is `processed`; written again with its release if it is
    /// given back after it ran, and on the side if the transaction rolls back.
    pub(super) effects: Vec<EffectRecord>,
    /// The owned rows its handler enqueued (`ctx.enqueue_owned`): inserted at the settle
    /// while it is `processed`, dropped otherwise.
    pub(super) owned: Vec<NewEvent>,
    /// Its effects are not in the transaction yet (a handler run without it, rule 10): the
    /// settle records them with its `processed`.
    pub(super) unrecorded: bool,
}

impl Decision {
    pub(super) fn processed(
        kept_effects: bool,
        effects: Vec<EffectRecord>,
        owned: Vec<NewEvent>,
    ) -> Self {
        Self {
            outcome: AttemptOutcome::Processed,
            kept_effects,
            failure: None,
            release: None,
            effects,
            owned,
            unrecorded: false,
        }
    }

    /// Its effects are recorded at the settle (its handler ran without the transaction).
    pub(super) fn unrecorded(mut self) -> Self {
        self.unrecorded = true;
        self
    }

    pub(super) fn failed(failure: Failure) -> Self {
        Self {
            outcome: failure_outcome(&failure),
            failure: Some(failure),
            ..Self::processed(false, Vec::new(), Vec::new())
        }
    }

    pub(super) fn not_run(why: &'static str) -> Self {
        Self {
            outcome: AttemptOutcome::NotRun,
            release: Some(why),
            ..Self::processed(false, Vec::new(), Vec::new())
        }
    }

    /// Given back uncounted (`why`) after it was decided: the effects its handler ran stay
    /// with it, to be recorded with the release.
    pub(super) fn give_back(&mut self, why: &'static str) {
        let effects = self.take_effects();
        *self = Decision::not_run(why);
        self.effects = effects;
    }

    /// The effects its handler ran through the ledger, taken (a failure's too).
    pub(super) fn take_effects(&mut self) -> Vec<EffectRecord> {
        let mut effects = std::mem::take(&mut self.effects);
        if let Some(failure) = &mut self.failure {
            effects.append(&mut failure.effects);
        }
        effects
    }

    /// What its row shows if a `COMMIT` that reported an error landed after all.
    pub(super) fn landed(&self) -> Option<Landed> {
        match (&self.failure, self.release) {
            (_, Some(_)) => None,
            (Some(_), None) => Some(Landed::Failure),
            (None, None) => Some(Landed::Processed),
        }
    }
}
