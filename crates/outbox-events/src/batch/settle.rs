//! The settle of a batched attempt's segment (docs/state-machine.md, "Batched attempts", rules 2
//! and 3): once its events ran, every decided outcome is written in the transaction, each under
//! its fence, held until the segment ends: the `processed` writes in one statement, then each
//! retry, `failed` or release. A claim found lost never lets a later event of its record end
//! before it: that event is given back instead, its writes (and the segment's handlers'
//! effects, if a lost claim's are among them) rolled back to the segment's savepoint, and an
//! event given back takes its record's later events with it.

use outbox_persistence::{
    Attempt, EffectRecord, Error, EventStatus, Fence, FenceOutcome, NewEvent, RecordKey,
};
use tokio::sync::OwnedMutexGuard;

use super::{Batch, Decision, Step, Stop};
use crate::detached::record_in;
use crate::env::AttemptOutcome;
use crate::heartbeat::FenceState;

/// Why an event is given back at the settle when an older event of its record was lost there.
const OLDER_LOST: &str =
    "not run to its end: an older event of its record lost its claim at the batch's settle";
/// Why an event is given back at the settle when an older row of its record became
/// non-terminal after its segment began (an operator retry, a row other code wrote).
const OLDER_REOPENED: &str =
    "not run to its end: an older row of its record became non-terminal while its batch ran";
/// Why an event whose handler's effects were rolled back at the settle is given back.
const EFFECTS_ROLLED_BACK: &str =
    "given back: its effects were rolled back at the batch's settle (another claim was lost)";

/// Why a record's later event is given back when an older one's effects were rolled back at
/// the settle.
const OLDER_GIVEN_BACK: &str =
    "given back: an older event of its record was given back at the batch's settle";

/// Records with an event lost or given back at the settle, each with the claim order of its
/// earliest such event.
type Records = Vec<(usize, RecordKey)>;

/// A decided event at the settle: its index, its decision and its fence, held.
type Held = (usize, Decision, OwnedMutexGuard<FenceState>);

impl Batch<'_> {
    /// Writes every decided outcome, fenced, in the transaction. A claim found lost writes
    /// nothing and ends lost alone, except that the later events of its record in the segment
    /// are given back (uncounted) instead of ending before it: when one of them was written, or
    /// a lost or given-back event's effects are in the transaction, the segment rolls back to
    /// its savepoint first (undoing its writes and its handlers' effects: one handler's that
    /// used `ctx.tx()`, or several lock-free ones'; each such event that is not the lost one is
    /// given back too, with its record's later events) and writes again. A lock timeout or
    /// conflict on a write gives the segment back; any other error is the transaction dying.
    pub(super) async fn settle(&mut self, tx: &mut dyn Attempt) -> Result<(), Stop> {
        let (mut held, mut lost, mut effects_lost) = self.hold_decided().await;
        // Events given back at this settle (their records' later events must follow them).
        let mut given: Vec<(usize, RecordKey)> = Vec::new();
        loop {
            let undo = self.give_back_followers(&mut held, &lost, &given) || effects_lost;
            if undo {
                // No effects are left in the segment after this: a later round has none to undo.
                held = self.undo_writes(tx, held, &mut given).await?;
                effects_lost = false;
            }
            if held.is_empty() {
                return Ok(());
            }
            // Before any head moves (migration 0026); each round: a rollback releases it.
            held = self.hold_owned_heads(tx, held).await?;
            let chain = self.holds_chain(&held);
            let outcomes = match write_all(tx, &held, chain).await {
                Ok(outcomes) => outcomes,
                Err(e) => {
                    let (i, _, _) = &held[0];
                    if e.is_lock_timeout() {
                        let claim = self.members[*i].claim;
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
            let (kept, unwritten, found_lost, waits_with_effects) = self
                .classify(held, outcomes, (&mut lost, &mut given), &mut effects_lost)
                .await;
            held = kept;
            // A release of a later event of a lost claim's record, or of one given back, may
            // stand (its row is `pending` again); a `processed` or a failure written for one
            // may not.
            let written_after_lost = held
                .iter()
                .any(|(i, d, _)| d.release.is_none() && self.after_lost(*i, &lost));
            let written_after_given = held
                .iter()
                .any(|(i, d, _)| d.release.is_none() && self.after_lost(*i, &given));
            if (found_lost && (effects_lost || written_after_lost))
                || waits_with_effects
                || written_after_given
            {
                // Something written must not stand (a later event of a lost claim's record or
                // of one given back, effects of a lost claim, or of an event that must wait for
                // an older row): undo every write of this settle and write again. Each round
                // ends one more claim lost or given back, so this ends.
                held = self.undo_writes(tx, held, &mut given).await?;
                effects_lost = false;
                continue;
            }
            if let Err(stop) = self
                .release_unwritten(tx, &held, unwritten, &mut lost)
                .await
            {
                held.retain(|(i, _, _)| !matches!(self.steps[*i], Step::Done(_)));
                self.undecided(held);
                return Err(stop);
            }
            held.retain(|(i, _, _)| !matches!(self.steps[*i], Step::Done(_)));
            if let Err(stop) = self.enqueue_owned(tx, &mut held).await {
                self.undecided(held);
                return Err(stop);
            }
            for (i, decision, fence) in held {
                self.steps[i] = Step::Written(decision, Some(fence));
            }
            return Ok(());
        }
    }

    /// Inserts the owned rows of the events written `processed` by this settle (their handlers'
    /// `ctx.enqueue_owned`, deferred to here), in claim order, in one statement. A lock timeout
    /// or conflict gives the segment back, as on an outcome's write; any other error is the
    /// transaction dying.
    async fn enqueue_owned(&self, tx: &mut dyn Attempt, held: &mut [Held]) -> Result<(), Stop> {
        let rows: Vec<NewEvent> = held
            .iter_mut()
            .filter(|(_, decision, _)| is_processed(decision))
            .flat_map(|(_, decision, _)| std::mem::take(&mut decision.owned))
            .collect();
        if rows.is_empty() {
            return Ok(());
        }
        match self.env.repo.enqueue_owned(tx.tx(), &rows).await {
            Ok(_) => Ok(()),
            Err(e) => {
                if e.is_lock_timeout() {
                    let (i, _, _) = &held[0];
                    let claim = self.members[*i].claim;
                    self.env.metrics.lock_timeout(&claim.event.event_type);
                }
                let error = format!("enqueuing the handlers' owned rows failed: {}", e.chain());
                Err(if e.is_lock_timeout() || e.is_conflict() {
                    Stop::GiveBack(error)
                } else {
                    Stop::Died(error)
                })
            }
        }
    }

    /// Holds the heads of the records of the owned rows that the events decided `processed`
    /// will insert at the end of this settle ([`OutboxRepository::hold_owned_heads`]), before
    /// the outcomes' writes move any head: two settles that each moved a head and then
    /// inserted under the other's deadlocked. A lock timeout or conflict gives the segment
    /// back; any other error is the transaction dying (the held events left undecided either
    /// way, as on a failed write).
    ///
    /// [`OutboxRepository::hold_owned_heads`]: outbox_persistence::OutboxRepository::hold_owned_heads
    async fn hold_owned_heads(
        &mut self,
        tx: &mut dyn Attempt,
        held: Vec<Held>,
    ) -> Result<Vec<Held>, Stop> {
        if self.env.repo.serializes_writers() {
            return Ok(held);
        }
        let keys: Vec<RecordKey> = held
            .iter()
            .filter(|(_, decision, _)| is_processed(decision))
            .flat_map(|(_, decision, _)| decision.owned.iter().filter_map(NewEvent::record_key))
            .collect();
        if keys.is_empty() {
            return Ok(held);
        }
        let Err(e) = self.env.repo.hold_owned_heads(tx.tx(), &keys).await else {
            return Ok(held);
        };
        self.undecided(held);
        let error = format!("holding the owned rows' heads failed: {}", e.chain());
        Err(if e.is_lock_timeout() || e.is_conflict() {
            Stop::GiveBack(error)
        } else {
            Stop::Died(error)
        })
    }

    /// Gives back the later events of a record whose claim was lost here, or whose event was
    /// given back here; `true` when one of them kept effects in the transaction.
    fn give_back_followers(&self, held: &mut [Held], lost: &Records, given: &Records) -> bool {
        let mut kept_effects = false;
        for (i, decision, _) in held {
            if decision.release.is_some() {
                continue;
            }
            if self.after_lost(*i, lost) {
                kept_effects |= decision.kept_effects;
                decision.give_back(OLDER_LOST);
            } else if self.after_lost(*i, given) {
                kept_effects |= decision.kept_effects;
                decision.give_back(OLDER_GIVEN_BACK);
            }
        }
        kept_effects
    }

    /// Rolls the segment back to its savepoint, undoing this settle's writes and its handlers'
    /// effects: their events are given back, with their records' later events. When the
    /// rollback fails (the transaction dying), the held events go back to decided, for the
    /// detached path.
    async fn undo_writes(
        &mut self,
        tx: &mut dyn Attempt,
        mut held: Vec<Held>,
        given: &mut Vec<(usize, RecordKey)>,
    ) -> Result<Vec<Held>, Stop> {
        if let Err(stop) = rolled_back_to_savepoint(tx).await {
            self.undecided(held);
            return Err(stop);
        }
        // Lock-free handlers keep effects without ending the segment, so a record's later
        // events may have run after one whose effects go here: they are given back too (here
        // and at the next round's start), and its record waits in the worker's next batches
        // (it must not end before its older event).
        for (i, decision, _) in &mut held {
            if decision.kept_effects {
                decision.give_back(EFFECTS_ROLLED_BACK);
                self.given_here(*i, given);
            }
        }
        for (j, decision, _) in &mut held {
            if decision.release.is_none() && self.after_lost(*j, given) {
                decision.give_back(OLDER_GIVEN_BACK);
            }
        }
        Ok(held)
    }

    /// Writes the releases of the events that must wait for an older row of their record
    /// (`unwritten`: their indexes in `held`); one found lost ends lost.
    async fn release_unwritten(
        &mut self,
        tx: &mut dyn Attempt,
        held: &[Held],
        unwritten: Vec<usize>,
        lost: &mut Vec<(usize, RecordKey)>,
    ) -> Result<(), Stop> {
        for k in unwritten {
            let (i, decision, fence) = &held[k];
            // What its handler ran (already in the transaction unless it ran without it: a
            // row recorded twice is kept once).
            record_in(tx, &decision.effects)
                .await
                .map_err(|e| Stop::Died(format!("recording effects failed: {}", e.chain())))?;
            let outcome = tx
                .release(fence.fence, OLDER_REOPENED)
                .await
                .map_err(|e| Stop::Died(format!("writing a release failed: {}", e.chain())))?;
            if outcome == FenceOutcome::Lost {
                self.lost_here(*i, lost);
            }
        }
        Ok(())
    }

    /// Sorts the settle's writes: a claim found lost ends lost (`lost`, `effects_lost` updated);
    /// a `processed` write that found its row still under this worker's fence was held back
    /// because an older row of its record became non-terminal after the segment began (an
    /// operator retry, a row other code wrote): it is given back instead, unwritten so far.
    /// Returns the held events, the indexes (among them) of those still to be written, whether
    /// a claim was found lost, and whether one of those given back kept effects.
    async fn classify(
        &mut self,
        held: Vec<Held>,
        outcomes: Vec<FenceOutcome>,
        (lost, given): (&mut Records, &mut Records),
        effects_lost: &mut bool,
    ) -> (Vec<Held>, Vec<usize>, bool, bool) {
        let mut kept = Vec::with_capacity(held.len());
        let (mut unwritten, mut found_lost, mut waits_with_effects) = (Vec::new(), false, false);
        for ((i, mut decision, fence), outcome) in held.into_iter().zip(outcomes) {
            if outcome == FenceOutcome::Written {
                kept.push((i, decision, fence));
                continue;
            }
            if is_processed(&decision) && self.still_ours(&fence).await {
                waits_with_effects |= decision.kept_effects;
                decision.give_back(OLDER_REOPENED);
                self.given_here(i, given);
                unwritten.push(kept.len());
                kept.push((i, decision, fence));
                continue;
            }
            drop(fence);
            *effects_lost |= decision.kept_effects;
            found_lost = true;
            self.on_side.extend(decision.take_effects());
            self.lost_here(i, lost);
        }
        (kept, unwritten, found_lost, waits_with_effects)
    }

    /// Whether the row is still `processing` under `fence` (read on a connection of its own;
    /// not written by this settle, so its committed state is its state). An error reads as
    /// lost: the row then stays `processing` unbeaten and is reclaimed once stale.
    async fn still_ours(&self, fence: &FenceState) -> bool {
        match self.env.repo.get_event(fence.fence.id).await {
            Ok(Some(row)) => {
                row.status == EventStatus::Processing
                    && row.last_modified_date == fence.fence.last_written
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(error = %e.chain(), "could not read a row back at the settle; taking its claim for lost");
                false
            }
        }
    }

    /// Whether two or more of the held `processed` decisions share a record (a chain).
    fn holds_chain(&self, held: &[Held]) -> bool {
        let mut keys: Vec<&RecordKey> = held
            .iter()
            .filter(|(_, decision, _)| is_processed(decision))
            .filter_map(|(i, _, _)| self.members[*i].claim.event.record_key.as_ref())
            .collect();
        keys.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        keys.windows(2).any(|pair| pair[0] == pair[1])
    }

    /// Takes every decided event's fence, in claim order (held until the segment ends): the
    /// held ones, the records with a claim found lost (each ends lost), and whether a lost one
    /// kept effects in the transaction.
    async fn hold_decided(&mut self) -> (Vec<Held>, Vec<(usize, RecordKey)>, bool) {
        let mut held: Vec<Held> = Vec::new();
        // Records with a claim lost at this settle, and the claim order of the first one.
        let mut lost: Vec<(usize, RecordKey)> = Vec::new();
        let mut effects_lost = false;
        for i in 0..self.steps.len() {
            let step = std::mem::replace(&mut self.steps[i], Step::Waiting);
            let Step::Decided(decision) = step else {
                self.steps[i] = step;
                continue;
            };
            let cell = &self.members[i].beat.fence;
            let fence = cell.lock_for_write(&self.env.repo).await;
            if fence.lost {
                drop(fence);
                effects_lost |= decision.kept_effects;
                let mut decision = decision;
                self.on_side.extend(decision.take_effects());
                self.lost_here(i, &mut lost);
                continue;
            }
            held.push((i, decision, fence));
        }
        (held, lost, effects_lost)
    }

    /// Event `i`'s claim turned out lost at the settle: it ends lost, and its record's later
    /// events (here and in the worker's next batches) must not end before it.
    fn lost_here(&mut self, i: usize, lost: &mut Vec<(usize, RecordKey)>) {
        tracing::warn!(
            event_id = %self.members[i].claim.event.id,
            "a claim of the batch was lost before its outcome was written; it writes nothing"
        );
        self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
        self.members[i].beat.stop();
        self.given_here(i, lost);
    }

    /// Event `i` is given back (or lost) at this settle: its record's later events, here and
    /// in the worker's next batches, must not end before it (`records` keeps each record's
    /// earliest such event in claim order).
    fn given_here(&mut self, i: usize, records: &mut Vec<(usize, RecordKey)>) {
        self.block(i);
        let Some(key) = &self.members[i].claim.event.record_key else {
            return;
        };
        match records.iter_mut().find(|(_, k)| k == key) {
            Some(entry) => entry.0 = entry.0.min(i),
            None => records.push((i, key.clone())),
        }
    }

    /// Whether event `i` follows, in claim order, an event of its record in `records` (lost or
    /// given back at this settle).
    fn after_lost(&self, i: usize, lost: &[(usize, RecordKey)]) -> bool {
        self.members[i]
            .claim
            .event
            .record_key
            .as_ref()
            .is_some_and(|key| lost.iter().any(|(j, k)| k == key && *j < i))
    }

    /// The settle stopped: these events' outcomes are decided, not written (fences let go).
    fn undecided(&mut self, held: Vec<Held>) {
        for (i, decision, _) in held {
            self.steps[i] = Step::Decided(decision);
        }
    }
}

/// Rolls the segment back to its savepoint (`outbox_claimed`, taken at its begin, before any
/// handler's effects); a failure is the transaction dying.
async fn rolled_back_to_savepoint(tx: &mut dyn Attempt) -> Result<(), Stop> {
    tx.rollback_to_savepoint().await.map_err(|e| {
        Stop::Died(format!(
            "rollback to the savepoint at the settle failed: {}",
            e.chain()
        ))
    })
}

/// Writes every held decision: the `processed` ones in one statement (several) or one, then
/// each of the others (`chain`: two or more of the `processed` ones share a record). One
/// outcome per held event, in order; the first error stops it.
async fn write_all(
    tx: &mut dyn Attempt,
    held: &[Held],
    chain: bool,
) -> Result<Vec<FenceOutcome>, Error> {
    let processed: Vec<usize> = (0..held.len())
        .filter(|&k| is_processed(&held[k].1))
        .collect();
    let mut outcomes = vec![FenceOutcome::Written; held.len()];
    let fences: Vec<Fence> = processed.iter().map(|&k| held[k].2.fence).collect();
    let written = match fences.as_slice() {
        [] => Vec::new(),
        [one] => vec![tx.mark_processed(*one).await?],
        // A chain: hold back a record's rows when an older row of it reopened after the
        // segment began (rule 3). A record with one row here was in flight when it reopened,
        // and the reopened row waits for it, as for any running row.
        _ if chain => tx.mark_processed_chains(fences).await?,
        _ => tx.mark_processed_many(fences).await?,
    };
    for (&k, outcome) in processed.iter().zip(written) {
        outcomes[k] = outcome;
    }
    // The effects of handlers run without the transaction (rule 10), with their `processed`
    // where it was written (a claim found lost has its own recorded on the side).
    let unrecorded: Vec<EffectRecord> = processed
        .iter()
        .filter(|&&k| held[k].1.unrecorded && outcomes[k] == FenceOutcome::Written)
        .flat_map(|&k| held[k].1.effects.iter().cloned())
        .collect();
    record_in(tx, &unrecorded).await?;
    for (k, (_, decision, fence)) in held.iter().enumerate() {
        outcomes[k] = match (&decision.release, &decision.failure) {
            (Some(why), _) => {
                // Effects its handler ran before it was given back are kept (the ledger).
                record_in(tx, &decision.effects).await?;
                tx.release(fence.fence, why).await?
            }
            (None, Some(failure)) => {
                record_in(tx, &failure.effects).await?;
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
