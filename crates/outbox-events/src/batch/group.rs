//! Transaction-free handlers of a batch run side by side (docs/state-machine.md, "Batched
//! attempts", rule 10): the waiting events whose handlers declare
//! [`Handler::runs_without_tx`](crate::Handler::runs_without_tx), one per record (each the
//! first waiting event of its record, so a record's events still run one after another, in
//! order), run concurrently in a group, each with a context that holds no transaction. The
//! ledger is read for the whole group in one statement before it runs; each event's outcome is
//! then decided in claim order, as if they had run one after another, and written at the
//! settle with the effects they ran.

use std::time::Instant;

use outbox_persistence::{Attempt, EffectRecord, EventId, NewEvent, RecordKey};
use tracing::Instrument;

use super::{Batch, Decision, Member, Step, Stop};
use crate::attempt::{self, CatchPanic};
use crate::env::AttemptOutcome;
use crate::handler::{AttemptContext, HandlerError};

/// The most events one group runs at once: a batch of slow sends to one receiver opens at
/// most this many requests per worker.
pub(crate) const GROUP_MAX: usize = 16;

/// One member's run: its index, its handler's result (or why it did not end), the effects it
/// ran through the ledger and the owned rows it enqueued.
type Ran = (
    usize,
    Result<Result<(), HandlerError>, AttemptOutcome>,
    Vec<EffectRecord>,
    Vec<NewEvent>,
);

impl Batch<'_> {
    /// The waiting events, from `first` on in claim order, that may run side by side with
    /// `first`: of its event type, each the first waiting event of its record, not of a record
    /// blocked by an earlier failure, at most [`GROUP_MAX`]. Empty unless `first`
    /// is one of them and at least two are; always empty on a backend whose attempt holds the
    /// one write lock (SQLite: a handler without the transaction reads through the pool,
    /// which an in-memory database's one connection, held by the attempt, cannot serve).
    pub(super) fn group_from(&self, first: usize) -> Vec<usize> {
        if self.env.repo.serializes_writers() || !self.runs_without_tx(first) {
            return Vec::new();
        }
        let mut records: Vec<&RecordKey> = Vec::new();
        let mut group = Vec::new();
        for j in first..self.members.len() {
            if group.len() == GROUP_MAX {
                break;
            }
            if !matches!(self.steps[j], Step::Waiting) {
                continue;
            }
            let key = self.members[j].claim.event.record_key.as_ref();
            if let Some(key) = key {
                // A record's later event waits for its first, grouped or not.
                if records.contains(&key) {
                    continue;
                }
                records.push(key);
                if self.blocked.contains(key) {
                    continue;
                }
            }
            // One event type per group: a slow handler's events (a webhook endpoint that
            // hangs) hold back only their own kind, as they would one after another.
            let first_type = &self.members[first].claim.event.event_type;
            if self.members[j].claim.event.event_type == *first_type && self.runs_without_tx(j) {
                group.push(j);
            }
        }
        if group.len() < 2 {
            group.clear();
        }
        group
    }

    /// Whether member `i`'s handler declares it runs without the transaction.
    pub(super) fn runs_without_tx(&self, i: usize) -> bool {
        self.env
            .handlers
            .get(&self.members[i].claim.event.event_type)
            .is_some_and(|h| h.runs_without_tx())
    }

    /// Runs `group` side by side (the worker's unstarted claims given back if it runs long,
    /// rule 8), then decides each event's outcome in claim order; a record whose event did
    /// not succeed gives its later events back. Reading the ledger failing is the transaction
    /// dying; a hard stop cancels the batch.
    pub(super) async fn run_group(
        &mut self,
        tx: &mut dyn Attempt,
        group: Vec<usize>,
    ) -> Result<(), Stop> {
        let ids: Vec<EventId> = group
            .iter()
            .map(|&i| self.members[i].claim.event.id)
            .collect();
        let prior = outbox_persistence::find_effects(tx.tx(), &ids)
            .await
            .map_err(|e| Stop::Died(format!("reading the effect ledger failed: {}", e.chain())))?;
        let mut started = Vec::with_capacity(group.len());
        for i in group {
            let index = self.members[i].index;
            if self.unstarted.start(index) {
                self.ran += 1;
                self.steps[i] = Step::Ran(None);
                started.push(i);
            } else {
                // Given back while an earlier handler ran long (rule 8).
                self.given_back_unstarted(i);
            }
        }
        let runs = started.iter().map(|&i| self.run_member(i, &prior));
        let began = Instant::now();
        let results = self
            .unstarted
            .while_running(futures_util::future::join_all(runs))
            .await;
        self.handler_time += began.elapsed();
        if self.env.hard_stop.is_cancelled()
            || results
                .iter()
                .any(|(_, r, _, _)| matches!(r, Err(AttemptOutcome::Cancelled)))
        {
            // Rolled back and left to stale reclaim: what ran goes to the ledger on the side.
            for (_, _, sent, _) in results {
                self.on_side.extend(sent);
            }
            return Err(Stop::Cancelled);
        }
        for (i, result, sent, owned) in results {
            self.decide_member(i, result, sent, owned);
        }
        Ok(())
    }

    /// Runs member `i`'s handler with a detached context (`prior`: the ledger's rows for the
    /// group), until it ends, its claim is found lost or a hard stop.
    fn run_member(
        &self,
        i: usize,
        prior: &[EffectRecord],
    ) -> impl std::future::Future<Output = Ran> + use<'_> {
        let env = self.env;
        let Member { claim, beat, .. } = self.members[i];
        let handler = super::event::handler_of(env, claim);
        let mine: Vec<EffectRecord> = prior
            .iter()
            .filter(|e| e.event_id == claim.event.id)
            .cloned()
            .collect();
        async move {
            let (name, handler) = match handler {
                Ok(found) => found,
                Err(missing) => return (i, Ok(Err(missing)), Vec::new(), Vec::new()),
            };
            let mut ctx = AttemptContext::detached(&name, claim.event.id, mine);
            let started = Instant::now();
            let result = tokio::select! {
                biased;
                _ = beat.lost.cancelled() => Err(AttemptOutcome::LostClaim),
                _ = env.hard_stop.cancelled() => Err(AttemptOutcome::Cancelled),
                result = CatchPanic(handler.handle(&claim.event, &mut ctx)) => Ok(result),
            };
            env.metrics
                .handler_ran(&claim.event.event_type, started.elapsed());
            (i, result, ctx.take_sent(), ctx.take_deferred())
        }
        .instrument(attempt::attempt_span(claim))
    }

    /// Decides member `i`'s outcome from its run, as [`Batch::event`] does for a handler run
    /// alone (nothing of it is in the transaction to undo): its effects are written at the
    /// settle with it.
    fn decide_member(
        &mut self,
        i: usize,
        result: Result<Result<(), HandlerError>, AttemptOutcome>,
        sent: Vec<EffectRecord>,
        owned: Vec<NewEvent>,
    ) {
        let Member { claim, beat, .. } = self.members[i];
        let _span = attempt::attempt_span(claim).entered();
        match result {
            // Lost (found by its beat while the handler ran, or as it ended): nothing is
            // written for it; the effects it ran are kept in the ledger on the side.
            Err(_) => {
                self.on_side.extend(sent);
                self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
            }
            Ok(Ok(())) if beat.lost.is_cancelled() => {
                self.on_side.extend(sent);
                self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
            }
            Ok(Ok(())) => self.decide(i, Decision::processed(false, sent, owned).unrecorded()),
            Ok(Err(error)) => {
                if error.is_lock_timeout() {
                    self.env.metrics.lock_timeout(&claim.event.event_type);
                }
                let mut failure = self.env.handler_failure(claim, &error);
                failure.effects = sent;
                failure.log();
                self.decide(i, Decision::failed(failure));
            }
        }
        self.hold_back_record(i);
    }
}
