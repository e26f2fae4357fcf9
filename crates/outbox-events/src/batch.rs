//! Batched attempts: the events a pull worker claimed together, run in one attempt transaction,
//! each under a savepoint of its own, with one `COMMIT` (see `docs/state-machine.md`, "Batched
//! attempts"). Every event keeps the single attempt's rules (its fence, its heartbeat, its
//! effects and fenced outcome committed together); the outcomes are decided after each handler
//! and written together at the settle before the `COMMIT`, so no claimed row is locked by the
//! transaction while handlers run; a row that failed before or was reclaimed runs in an
//! attempt of its own.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use outbox_persistence::{Attempt, Claim, EffectRecord, RecordKey};
use tokio::sync::OwnedMutexGuard;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::attempt::{self, rollback_quietly};
use crate::env::{AttemptEnv, AttemptOutcome, Failure, STOPPING};
use begin::Begun;
use decision::Decision;
use event::Segment;

mod begin;
mod decision;
mod died;
mod event;
mod group;
mod settle;
mod shared;
mod slow;
use crate::heartbeat::{Beat, BeatGroup, FenceCell, FenceState};
use slow::Unstarted;

/// Why events still claimed for a batch are given back unrun.
const BUDGET_SPENT: &str = "not run: the batched attempt reached its time budget";
const OLDER_FAILED: &str = "not run: an older event of its record did not succeed in the batch";
const BATCH_DIED: &str = "not run: the batched attempt's transaction failed first";
const WAITS_FOR_OLDER: &str =
    "not run: an older row of its record became non-terminal after the claim";

/// Whether a claim may share an attempt transaction: a row that failed before, or was
/// reclaimed from a dead worker, runs alone (rule 1), so that an event that kills transactions
/// is found and counted on its own.
pub(crate) fn may_share(claim: &Claim) -> bool {
    !claim.reclaimed && claim.event.retry_count == 0
}

/// Runs `claims` (claimed together for this worker): those that may share one transaction in
/// a batch, the others each in an attempt of its own, every claim beating from one heartbeat
/// interval after the claim, all of them in one statement per interval. A handler that runs
/// long gives the worker's claims not started yet back for other workers (rule 8). Returns the
/// handlers' total time and how many ran.
pub(crate) async fn run(env: &AttemptEnv, claims: Vec<Claim>) -> (Duration, usize) {
    let claimed_at = Instant::now();
    // One heartbeat task and one statement per interval for all of them (rule 7).
    let group = BeatGroup::new(env);
    let beats: Vec<Beat<'_>> = claims
        .iter()
        .map(|c| {
            Beat::grouped(
                env,
                FenceCell::new(c.fence, c.event.retry_count),
                CancellationToken::new(),
                &group,
            )
        })
        .collect();
    let unstarted = Unstarted::new(env, &beats);
    let body = async {
        let (shared, alone): (Vec<usize>, Vec<usize>) =
            (0..claims.len()).partition(|&i| may_share(&claims[i]));
        let mut took = (Duration::ZERO, 0);
        if shared.len() > 1 {
            // A record whose row did not succeed: its later rows (its chain) are given back
            // unrun, also from the batches after this one.
            let mut blocked = HashSet::new();
            for chunk in shared.chunks(env.config.batch_events().max(1)) {
                let members: Vec<Member<'_>> = chunk
                    .iter()
                    .map(|&i| Member {
                        claim: &claims[i],
                        beat: &beats[i],
                        index: i,
                    })
                    .collect();
                let (time, ran) = Batch::new(env, members, claimed_at, &mut blocked, &unstarted)
                    .run()
                    .await;
                took = (took.0 + time, took.1 + ran);
            }
        }
        let singles = if shared.len() == 1 {
            shared
        } else {
            Vec::new()
        };
        let (time, ran) = run_alone(
            env,
            &claims,
            &beats,
            &unstarted,
            singles.into_iter().chain(alone),
            claimed_at,
        )
        .await;
        (took.0 + time, took.1 + ran)
    };
    tokio::pin!(body);
    tokio::select! {
        biased;
        took = &mut body => took,
        _ = tokio::time::sleep(env.config.heartbeat_interval) => {
            for beat in &beats {
                beat.start_after_first_interval();
            }
            body.await
        }
    }
}

/// Runs each of `which` of the worker's claims in an attempt of its own (a row that may not
/// share, or a lone one), unless it was given back meanwhile or the worker is stopping.
async fn run_alone(
    env: &AttemptEnv,
    claims: &[Claim],
    beats: &[Beat<'_>],
    unstarted: &Unstarted<'_>,
    which: impl Iterator<Item = usize>,
    claimed_at: Instant,
) -> (Duration, usize) {
    let mut took = (Duration::ZERO, 0);
    for i in which {
        let given_back = if !unstarted.start(i) {
            // Given back while an earlier handler ran long (rule 8).
            Some(unstarted.outcome(i))
        } else if env.stop.is_cancelled() {
            // A graceful shutdown: given back unrun (uncounted), for other workers now.
            Some(crate::detached::give_back(env, &beats[i], STOPPING).await)
        } else {
            None
        };
        if let Some(outcome) = given_back {
            env.metrics
                .claimed(&claims[i].event.event_type, claims[i].reclaimed);
            beats[i].stop();
            let _span = attempt::attempt_span(&claims[i]).entered();
            attempt::ended(env, &claims[i], &outcome, claimed_at);
            continue;
        }
        let (_, handler_time) = unstarted
            .while_running(attempt::one(env, &claims[i], &beats[i], claimed_at))
            .await;
        // An attempt whose handler never ran (its claim lost, its begin given up) is no
        // sample of the handlers' time: counted, it would pull the batch sizer's mean to 0.
        if handler_time > Duration::ZERO {
            took = (took.0 + handler_time, took.1 + 1);
        }
    }
    took
}

/// One claim of a batch: the claim, its beat, and its index among the worker's claims.
#[derive(Clone, Copy)]
struct Member<'a> {
    claim: &'a Claim,
    beat: &'a Beat<'a>,
    index: usize,
}

/// Where one event of a batch stands.
enum Step {
    /// Not run yet.
    Waiting,
    /// Its handler ran (or it is given back unrun) and its outcome is decided; the write waits
    /// for the settle (rule 2). Until then the transaction has not touched its row, so the beat
    /// keeps the claim fresh while later handlers run.
    Decided(Decision),
    /// Its outcome is written in the transaction at the settle; its fence is held until the
    /// batch ends (let go before its detached bookkeeping, if the batch dies).
    Written(Decision, Option<OwnedMutexGuard<FenceState>>),
    /// Its handler ran and no outcome was decided: the transaction died meanwhile.
    Ran(Option<Failure>),
    /// Ended.
    Done(AttemptOutcome),
}

/// How a batch stopped early.
enum Stop {
    /// The transaction failed (the error's text); the detached path accounts for the batch.
    Died(String),
    /// A write at the settle could not land for a reason that is no event's fault (a lock
    /// timeout, a conflict): rolled back whole, every event given back (rule 3).
    GiveBack(String),
    /// A hard shutdown: rolled back, left to stale reclaim.
    Cancelled,
}

struct Batch<'a> {
    env: &'a AttemptEnv,
    members: Vec<Member<'a>>,
    /// Records with a row that did not succeed in this worker's batches: their later rows
    /// are given back unrun.
    blocked: &'a mut HashSet<RecordKey>,
    /// The worker's claims not started yet: a handler that runs long gives them back.
    unstarted: &'a Unstarted<'a>,
    steps: Vec<Step>,
    /// Members the begin's check says may not run now: given back before any event runs.
    recheck: Vec<usize>,
    claimed_at: Instant,
    handler_time: Duration,
    ran: usize,
    /// Effects that ran for events whose outcome will not carry them (a claim lost, a
    /// transaction that died): recorded in the ledger on the side once the segment's
    /// transaction has ended (before that, its uncommitted rows would hold the side write).
    on_side: Vec<EffectRecord>,
    /// A handler of the running segment kept effects in its transaction (lock-free ones, or a
    /// writer's when writes are shared: the segment goes on): the next handler runs under a
    /// savepoint of its own.
    segment_effects: bool,
    /// The running segment holds a writing handler's locks and shares writes (rule 11): since
    /// that handler's start, until which later handlers join it, each with its lock waits
    /// bounded.
    locks_since: Option<Instant>,
    /// Writing handlers whose effects the running segment keeps (rule 11 caps them).
    segment_writers: usize,
}

impl<'a> Batch<'a> {
    fn new(
        env: &'a AttemptEnv,
        members: Vec<Member<'a>>,
        claimed_at: Instant,
        blocked: &'a mut HashSet<RecordKey>,
        unstarted: &'a Unstarted<'a>,
    ) -> Self {
        let steps = members.iter().map(|_| Step::Waiting).collect();
        Self {
            env,
            members,
            blocked,
            unstarted,
            steps,
            recheck: Vec::new(),
            claimed_at,
            handler_time: Duration::ZERO,
            ran: 0,
            on_side: Vec::new(),
            segment_effects: false,
            locks_since: None,
            segment_writers: 0,
        }
    }

    async fn run(mut self) -> (Duration, usize) {
        for member in &self.members {
            self.env
                .metrics
                .claimed(&member.claim.event.event_type, member.claim.reclaimed);
        }
        // One transaction per segment: the events up to a handler that kept effects in it
        // (rule 2). Events whose handlers never ask for the transaction share one.
        loop {
            self.take_given_back();
            if !self.steps.iter().any(|s| matches!(s, Step::Waiting)) {
                break;
            }
            let mut tx = match self.begin().await {
                Ok(tx) => tx,
                Err(Begun::Stopping) => {
                    self.release_waiting(STOPPING).await;
                    break;
                }
                Err(Begun::Ended(outcome)) => {
                    self.end_waiting(outcome);
                    break;
                }
            };
            let (settled, more) = self.segment(tx.as_mut()).await;
            let ended = match settled {
                Ok(()) => match tx.commit().await {
                    Ok(()) => Ok(()),
                    Err(e) => Err((Stop::Died(format!("commit failed: {}", e.chain())), true)),
                },
                Err(stop) => {
                    rollback_quietly(tx.as_mut()).await;
                    Err((stop, false))
                }
            };
            // The effects of claims lost in the segment (`on_side`) are written on the side
            // once the segment's transaction has ended: here after a commit, with the dead or
            // given-back segment's own in `account` (its fences let go first).
            match ended {
                Ok(()) => {
                    self.committed();
                    if self.env.repo.serializes_writers() {
                        // The next segment's `BEGIN IMMEDIATE` may wait its turn behind other
                        // workers: its claims must not look silent meanwhile.
                        self.beat_waiting();
                    }
                    let on_side = std::mem::take(&mut self.on_side);
                    crate::detached::record_on_side(self.env, &on_side).await;
                }
                Err((Stop::Cancelled, _)) => {
                    // The effects its handlers ran would have committed with the segment: one
                    // bounded try on the side, so that the stale reclaim skips them.
                    let mut on_side = std::mem::take(&mut self.on_side);
                    on_side.extend(self.uncommitted_effects());
                    crate::detached::record_on_side_briefly(self.env, &on_side).await;
                    self.cancelled();
                    break;
                }
                Err((Stop::Died(error), commit)) => {
                    self.died(&error, commit).await;
                    break;
                }
                Err((Stop::GiveBack(why), _)) => {
                    self.gave_back(&why).await;
                    break;
                }
            }
            if !more {
                break;
            }
        }
        self.take_given_back();
        self.account_ended();
        (self.handler_time, self.ran)
    }

    /// Runs a segment's events and settles it: the settle's result, and whether events are
    /// left for a next segment.
    async fn segment(&mut self, tx: &mut dyn Attempt) -> (Result<(), Stop>, bool) {
        self.segment_effects = false;
        self.locks_since = None;
        self.segment_writers = 0;
        match self.events(tx).await {
            Ok(segment) => (self.settle_segment(tx).await, segment == Segment::Effects),
            Err(stop) => (Err(stop), false),
        }
    }

    /// Counts how every event of the batch ended; a record whose event did not succeed keeps
    /// its later rows out of the worker's next batches.
    fn account_ended(&mut self) {
        if self.ran > 1 {
            self.env.metrics.batch();
        }
        for member in &self.members {
            // Ended: a beat started by a later batch's first interval would only find it gone.
            member.beat.stop();
        }
        for (i, step) in self.steps.iter().enumerate() {
            let Step::Done(outcome) = step else {
                continue;
            };
            let claim = self.members[i].claim;
            if *outcome != AttemptOutcome::Processed
                && let Some(key) = &claim.event.record_key
            {
                self.blocked.insert(key.clone());
            }
            let _span = attempt::attempt_span(claim).entered();
            attempt::ended(self.env, claim, outcome, self.claimed_at);
        }
    }

    /// Restarts the beats of the members still waiting (their begin stopped them).
    pub(super) fn beat_waiting(&self) {
        for (i, member) in self.members.iter().enumerate() {
            if matches!(self.steps[i], Step::Waiting) {
                member.beat.ensure_running(false);
            }
        }
    }

    /// Members given back while an earlier handler ran long (rule 8) end as their release did.
    fn take_given_back(&mut self) {
        for i in 0..self.members.len() {
            if matches!(self.steps[i], Step::Waiting)
                && self.unstarted.is_given_back(self.members[i].index)
            {
                self.given_back_unstarted(i);
            }
        }
    }

    /// Member `i` was given back while an earlier handler ran long (rule 8): it ends as its
    /// release did. A release pass may stop part way (a release whose reply was lost), so a
    /// record's later claims can still be this worker's: its record is blocked, so that they
    /// are given back unrun (here or in the worker's next batches) rather than run before it.
    fn given_back_unstarted(&mut self, i: usize) {
        let outcome = self.unstarted.outcome(self.members[i].index);
        let ended = outcome != AttemptOutcome::Processed;
        self.steps[i] = Step::Done(outcome);
        if ended {
            self.block(i);
        }
    }

    /// Runs the waiting events in claim order, under the segment's savepoint, until the time
    /// budget is spent (the rest given back) or a handler keeps effects in the transaction
    /// (the segment ends there), deciding each one's outcome (rule 2).
    async fn events(&mut self, tx: &mut dyn Attempt) -> Result<Segment, Stop> {
        for i in std::mem::take(&mut self.recheck) {
            self.decide(i, Decision::not_run(WAITS_FOR_OLDER));
        }
        for i in 0..self.members.len() {
            if !matches!(self.steps[i], Step::Waiting) {
                continue;
            }
            if self.ran > 0 && self.handler_time >= self.env.config.batch_budget {
                self.give_back(i, |_| true, BUDGET_SPENT);
                return Ok(Segment::Done);
            }
            if self.env.stop.is_cancelled() {
                // A graceful shutdown: what has not started goes back for other workers now,
                // rather than running past the shutdown timeout.
                self.give_back(i, |_| true, STOPPING);
                return Ok(Segment::Done);
            }
            let member = self.members[i];
            if member
                .claim
                .event
                .record_key
                .as_ref()
                .is_some_and(|key| self.blocked.contains(key))
            {
                self.decide(i, Decision::not_run(OLDER_FAILED));
                continue;
            }
            if self.window_closed() {
                // The segment holds a writer's locks and its window is over (rule 11).
                return Ok(Segment::Effects);
            }
            if self.locks_since.is_some() && self.runs_without_tx(i) {
                // Its sends (grouped or alone) would hold a writer's locks as long as they take.
                return Ok(Segment::Effects);
            }
            let group = self.group_from(i);
            if !group.is_empty() {
                // Transaction-free handlers, side by side (rule 10).
                self.run_group(tx, group).await?;
                continue;
            }
            if !self.unstarted.start(member.index) {
                // Given back while an earlier handler ran long (rule 8).
                self.given_back_unstarted(i);
                continue;
            }
            let span = attempt::attempt_span(member.claim);
            let started = Instant::now();
            let kept = self.event(tx, i).instrument(span).await?;
            if kept.again {
                // It failed as a later handler of a shared segment: it runs first in the next.
                return Ok(Segment::Effects);
            }
            self.hold_back_record(i);
            self.segment_effects |= kept.effects;
            if kept.locking && !self.share_locks(started) {
                return Ok(Segment::Effects);
            }
        }
        Ok(Segment::Done)
    }

    /// Member `i` ran: unless it ended `processed`, a record's later events wait for it, so
    /// none of them runs in this batch (given back) or the worker's next ones (blocked).
    fn hold_back_record(&mut self, i: usize) {
        if matches!(self.outcome(i), Some(AttemptOutcome::Processed)) {
            return;
        }
        if let Some(key) = self.members[i].claim.event.record_key.clone() {
            let members = self.members.clone();
            let same = move |j: usize| members[j].claim.event.record_key.as_ref() == Some(&key);
            self.give_back(i + 1, same, OLDER_FAILED);
        }
        self.block(i);
    }

    /// Member `i` did not succeed: its record's later rows, in this batch and the worker's next
    /// ones, are given back unrun.
    fn block(&mut self, i: usize) {
        if let Some(key) = &self.members[i].claim.event.record_key {
            self.blocked.insert(key.clone());
        }
    }

    /// The outcome event `i` has so far.
    fn outcome(&self, i: usize) -> Option<&AttemptOutcome> {
        match &self.steps[i] {
            Step::Decided(decision) | Step::Written(decision, _) => Some(&decision.outcome),
            Step::Done(outcome) => Some(outcome),
            _ => None,
        }
    }

    /// Event `i`'s outcome is decided; written at the settle. One given back meanwhile (rule
    /// 8) ends as its release did instead.
    fn decide(&mut self, i: usize, decision: Decision) {
        let index = self.members[i].index;
        self.steps[i] = if self.unstarted.start(index) {
            Step::Decided(decision)
        } else {
            Step::Done(self.unstarted.outcome(index))
        };
    }

    /// Gives back, unrun, the waiting events from `from` on that `which` selects.
    fn give_back(&mut self, from: usize, which: impl Fn(usize) -> bool, why: &'static str) {
        for j in from..self.members.len() {
            if matches!(self.steps[j], Step::Waiting) && which(j) {
                self.decide(j, Decision::not_run(why));
            }
        }
    }

    /// Gives back, on the side, every event still waiting (the batch cannot begin, and its
    /// worker is stopping).
    async fn release_waiting(&mut self, why: &'static str) {
        self.take_given_back();
        for i in 0..self.members.len() {
            if matches!(self.steps[i], Step::Waiting) && self.unstarted.start(self.members[i].index)
            {
                let outcome = crate::detached::give_back(self.env, self.members[i].beat, why).await;
                self.steps[i] = Step::Done(outcome);
            }
        }
    }

    /// The segment committed: every written outcome stands. Their beats stop before their
    /// fences are let go: the batch's later segments may run long, and a beat of a row that is
    /// no longer `processing` would only find it gone.
    fn committed(&mut self) {
        for (i, step) in self.steps.iter_mut().enumerate() {
            if let Step::Written(decision, _) = step {
                self.members[i].beat.stop();
                *step = Step::Done(decision.outcome.clone());
            }
        }
    }

    /// The effects of the events whose outcomes were decided or written in a segment that
    /// did not commit, taken.
    fn uncommitted_effects(&mut self) -> Vec<EffectRecord> {
        let mut effects = Vec::new();
        for step in &mut self.steps {
            match step {
                Step::Decided(decision) | Step::Written(decision, _) => {
                    effects.append(&mut decision.take_effects());
                }
                Step::Ran(Some(failure)) => effects.append(&mut failure.effects),
                _ => {}
            }
        }
        effects
    }

    /// A hard shutdown rolled the batch back: what was not ended is left to stale reclaim.
    fn cancelled(&mut self) {
        self.take_given_back();
        tracing::warn!("batched attempt cancelled by shutdown; its rows are left to stale reclaim");
        for step in &mut self.steps {
            if !matches!(step, Step::Done(_)) {
                *step = Step::Done(AttemptOutcome::Cancelled);
            }
        }
    }

    /// Every event not ended yet ends as `outcome` (its transaction never began).
    fn end_waiting(&mut self, outcome: AttemptOutcome) {
        for step in &mut self.steps {
            if matches!(step, Step::Waiting) {
                *step = Step::Done(outcome.clone());
            }
        }
    }
}
