//! The heartbeat of one claimed row (started once the attempt outlives its first interval), and
//! the fence it shares with the attempt's final write.
//!
//! The heartbeat refreshes `LastModifiedDate` on a connection of its own, outside the attempt
//! transaction, so other workers see the claim alive. Every fenced write (heartbeat or status)
//! holds the [`FenceCell`] lock while it runs, so the final write always compares against the
//! value the heartbeat wrote last. The task lives in a [`HeartbeatGuard`] that stops it on drop:
//! no early return can leave it beating. The claims a worker holds together (a batch's) share
//! one task in a [`BeatGroup`], which beats them all with one statement per interval.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_persistence::{BeatOutcome, Fence, OutboxRepository};
use tokio::sync::{Mutex, MutexGuard, Notify, OwnedMutexGuard};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::env::AttemptEnv;

/// The claim's current fence, and whether it was lost.
#[derive(Debug)]
pub(crate) struct FenceState {
    pub fence: Fence,
    pub lost: bool,
    /// A beat whose `COMMIT` got no answer since the last one that was answered
    /// ([`BeatOutcome::Unsure`]): the fence it wrote if it landed, and the transaction that
    /// wrote it. A beat that failed otherwise did not land (the repository's contract), so
    /// this is the only way the row can be ahead of `fence` while still this worker's.
    unsure: Option<(Fence, i64)>,
    /// The claim's `RetryCount` (the detached bookkeeping's read-backs compare it).
    retry_count: i32,
    /// Its outcome was written in a batch whose `COMMIT` reported an error and may have
    /// landed: a beat that finds the row finished is not news until the read-back says whose
    /// it was (the died path reads it back), so it is not logged as a lost claim.
    pub(crate) outcome_unsure: bool,
}

impl FenceState {
    /// The claim's `RetryCount`.
    pub(crate) fn retry_count(&self) -> i32 {
        self.retry_count
    }
}

/// The fence shared by the heartbeat and the attempt, with a copy of the latest value that
/// can be read without waiting for the lock (the attempt holds the lock while it begins).
#[derive(Debug, Clone)]
pub(crate) struct FenceCell(Arc<Mutex<FenceState>>, Arc<std::sync::Mutex<Fence>>);

impl FenceCell {
    pub fn new(fence: Fence, retry_count: i32) -> Self {
        Self(
            Arc::new(Mutex::new(FenceState {
                fence,
                lost: false,
                unsure: None,
                retry_count,
                outcome_unsure: false,
            })),
            Arc::new(std::sync::Mutex::new(fence)),
        )
    }

    /// The fence the heartbeat wrote last, without waiting for the lock.
    pub fn latest(&self) -> Fence {
        *self.1.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_latest(&self, fence: Fence) {
        *self.1.lock().unwrap_or_else(|e| e.into_inner()) = fence;
    }

    /// Locks the fence for one fenced write; heartbeats wait meanwhile.
    pub async fn lock(&self) -> MutexGuard<'_, FenceState> {
        self.0.lock().await
    }

    /// Locks the fence until the guard is dropped: a batched attempt holds the fence of an
    /// event whose bookkeeping it wrote until the batch commits.
    pub async fn lock_owned(&self) -> tokio::sync::OwnedMutexGuard<FenceState> {
        self.0.clone().lock_owned().await
    }

    /// The fence's lock if nobody holds it (a beat of many claims skips a held one).
    fn try_lock_owned(&self) -> Option<tokio::sync::OwnedMutexGuard<FenceState>> {
        self.0.clone().try_lock_owned().ok()
    }

    /// A beat landed: `next` is the claim's fence now.
    pub(crate) fn beaten(&self, state: &mut FenceState, next: Fence) {
        state.fence = next;
        state.unsure = None;
        self.set_latest(next);
    }

    /// A beat's `COMMIT` got no answer: the row is at `written` if it landed.
    pub(crate) fn unsure(state: &mut FenceState, written: Fence, writer: i64) {
        tracing::warn!(event_id = %written.id, "a heartbeat's COMMIT got no answer; it may have landed (read back before the next fenced write)");
        state.unsure = Some((written, writer));
    }

    /// Locks the fence for a fenced write of the claim's outcome. After a beat whose `COMMIT`
    /// got no answer, the fence this worker holds may be behind that beat (see
    /// [`own_beat_landed`]): the row is read back first and the beat's value taken when it
    /// landed (no read otherwise).
    pub(crate) async fn lock_for_write(
        &self,
        repo: &Arc<dyn OutboxRepository>,
    ) -> OwnedMutexGuard<FenceState> {
        let mut state = self.lock_owned().await;
        if let Some(landed) = own_beat_landed(repo, &state).await {
            self.beaten(&mut state, landed);
        }
        state
    }

    fn lost(state: &mut FenceState, lost: &CancellationToken) {
        state.lost = true;
        lost.cancel();
        if state.outcome_unsure {
            tracing::debug!(event_id = %state.fence.id, "the row is no longer this claim's: its batch's COMMIT reported an error and may have landed; the read-back decides");
        } else {
            tracing::warn!(event_id = %state.fence.id, last_written = %state.fence.last_written, "claim lost: the row was reclaimed or finished elsewhere");
        }
    }
}

/// Stops the heartbeat task when dropped.
pub(crate) struct HeartbeatGuard {
    task: JoinHandle<()>,
}

impl HeartbeatGuard {
    /// Starts beating every `interval`: the first beat after one interval (so an attempt that
    /// finishes sooner costs no heartbeat write), or at once with `beat_now` (a claim that went
    /// without heartbeats until now). `lost` is cancelled when the row turns out to
    /// be no longer this worker's.
    pub fn start(
        repo: Arc<dyn OutboxRepository>,
        fence: FenceCell,
        interval: Duration,
        lost: CancellationToken,
        beat_now: bool,
    ) -> Self {
        let task = tokio::spawn(async move {
            let mut first = beat_now;
            loop {
                if !std::mem::take(&mut first) {
                    tokio::time::sleep(interval).await;
                }
                // Alive, every interval, also while the beat below waits: for the fence (the
                // attempt holds it while it waits for SQLite's write lock) or for its write
                // (behind another attempt's write lock).
                repo.note_alive(fence.latest());
                let beat = beat_once(&repo, &fence, &lost);
                tokio::pin!(beat);
                let go_on = loop {
                    tokio::select! {
                        go_on = &mut beat => break go_on,
                        _ = tokio::time::sleep(interval) => repo.note_alive(fence.latest()),
                    }
                };
                if !go_on {
                    return;
                }
            }
        });
        Self { task }
    }
}

/// The heartbeat of one attempt, started when the attempt outlives its first interval or
/// when the backend needs it.
pub(crate) struct Beat<'a> {
    env: &'a AttemptEnv,
    pub(crate) fence: FenceCell,
    pub(crate) lost: CancellationToken,
    guard: std::sync::Mutex<Option<HeartbeatGuard>>,
    /// Stopped by a backend whose attempt excludes other writers: the first interval passing
    /// does not start it again.
    stopped: std::sync::atomic::AtomicBool,
    /// The group whose one task beats this claim with the others (a worker's batch), and this
    /// claim's switch in it; `None`: the claim beats in a task of its own.
    group: Option<(&'a BeatGroup, Arc<AtomicBool>)>,
}

impl<'a> Beat<'a> {
    /// The beat of a claim fenced by `fence`, not running yet; `lost` is cancelled when the
    /// claim turns out lost.
    pub(crate) fn new(env: &'a AttemptEnv, fence: FenceCell, lost: CancellationToken) -> Self {
        Self {
            env,
            fence,
            lost,
            guard: std::sync::Mutex::new(None),
            stopped: std::sync::atomic::AtomicBool::new(false),
            group: None,
        }
    }

    /// The beat of a claim held with others in `group`: one task and one statement beat every
    /// running member of the group together.
    pub(crate) fn grouped(
        env: &'a AttemptEnv,
        fence: FenceCell,
        lost: CancellationToken,
        group: &'a BeatGroup,
    ) -> Self {
        let running = Arc::new(AtomicBool::new(false));
        group.join(GroupMember {
            fence: fence.clone(),
            lost: lost.clone(),
            running: running.clone(),
        });
        Self {
            group: Some((group, running)),
            ..Self::new(env, fence, lost)
        }
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, Option<HeartbeatGuard>> {
        self.guard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the heartbeat unless it runs; `beat_now` beats at once (the claim may have gone
    /// without beats so far).
    pub(crate) fn ensure_running(&self, beat_now: bool) {
        if let Some((group, running)) = &self.group {
            running.store(true, Ordering::Release);
            group.start(beat_now);
            return;
        }
        let mut guard = self.guard();
        if guard.is_none() {
            *guard = Some(HeartbeatGuard::start(
                self.env.repo.clone(),
                self.fence.clone(),
                self.env.config.heartbeat_interval,
                self.lost.clone(),
                beat_now,
            ));
        }
    }

    /// The first heartbeat interval since the claim has passed with the attempt still running:
    /// beat now and every interval from here, unless the backend stopped the beat.
    pub(crate) fn start_after_first_interval(&self) {
        if !self.stopped.load(std::sync::atomic::Ordering::Acquire) {
            self.ensure_running(true);
        }
    }

    /// Stops the heartbeat (a backend whose attempt excludes other writers needs none).
    pub(crate) fn stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
        if let Some((_, running)) = &self.group {
            running.store(false, Ordering::Release);
        }
        self.guard().take();
    }
}

/// One fenced heartbeat write. `false` when the claim is lost (nothing more to beat).
async fn beat_once(
    repo: &Arc<dyn OutboxRepository>,
    fence: &FenceCell,
    lost: &CancellationToken,
) -> bool {
    let mut state = fence.lock().await;
    if state.lost {
        return false;
    }
    match repo.heartbeat(state.fence).await {
        Ok(BeatOutcome::Beaten(next)) => {
            fence.beaten(&mut state, next);
            true
        }
        Ok(BeatOutcome::Unsure { written, writer }) => {
            FenceCell::unsure(&mut state, written, writer);
            true
        }
        Ok(BeatOutcome::Busy) => true,
        Ok(BeatOutcome::Lost) => {
            if let Some(landed) = own_beat_landed(repo, &state).await {
                fence.beaten(&mut state, landed);
                return true;
            }
            FenceCell::lost(&mut state, lost);
            false
        }
        Err(e) => {
            // A missed beat is not a lost claim: the row stays ours until stale-after passes
            // without a successful beat. It did not land: the fence stands.
            tracing::warn!(event_id = %state.fence.id, error = %e.chain(), "heartbeat failed; retrying at the next interval");
            true
        }
    }
}

/// After a beat whose `COMMIT` got no answer, a write that finds the claim lost may only have
/// found that beat's own write (its `COMMIT` landed, its reply did not): the row read back
/// still `processing` under the value the beat wrote, in the row version the beat's own
/// transaction wrote ([`OutboxRepository::beat_landed`]: on PostgreSQL the version's `xmin`),
/// is still this worker's claim, fenced by that value. Nothing else can pass for it: another
/// worker's fresh claim of the row, even one with the same `RetryCount` after this worker's
/// release landed, is another transaction's version (finding 4 of the batched-attempts
/// review, `../shared/repro/batches/f2_readback_adopts_foreign_claim.sh`). The read is tried
/// again with backoff (reads fail for a while right after a lost reply: a pooler's login
/// retry, a restart); one that never succeeds adopts nothing: the write goes under the fence
/// the worker holds, or finds the claim lost.
async fn own_beat_landed(repo: &Arc<dyn OutboxRepository>, state: &FenceState) -> Option<Fence> {
    let (written, writer) = state.unsure?;
    let mut backoff = READ_BACK_FIRST_BACKOFF;
    for try_number in 1..=READ_BACK_TRIES {
        match repo.beat_landed(written, writer).await {
            Ok(true) => {
                tracing::info!(event_id = %written.id, "a beat whose reply was lost had landed; the claim is still this worker's");
                return Some(written);
            }
            Ok(false) => return None,
            Err(e) => {
                tracing::debug!(event_id = %written.id, error = %e.chain(), try_number, "could not read back a heartbeat whose reply was lost");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(READ_BACK_MAX_BACKOFF);
            }
        }
    }
    tracing::warn!(event_id = %written.id, "could not read back a heartbeat whose reply was lost; writing under the fence held before it");
    None
}

/// How often a row is read back after a write whose reply was lost (a beat here, the detached
/// bookkeeping in `detached.rs`), the first pause between tries and the longest (about 4 s in
/// all: a restart or a pooler's login retry lasts a few seconds; four tries over 0.75 s
/// reported claims lost whose writes had landed, in the fault suite's PgBouncer run).
pub(crate) const READ_BACK_TRIES: u32 = 8;
pub(crate) const READ_BACK_FIRST_BACKOFF: Duration = Duration::from_millis(50);
pub(crate) const READ_BACK_MAX_BACKOFF: Duration = Duration::from_secs(1);

impl Drop for HeartbeatGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How soon a group's beat is tried again after it failed (doubling up to the interval).
const FIRST_RETRY_AFTER_FAILED_BEAT: Duration = Duration::from_millis(50);

/// One claim of a [`BeatGroup`].
struct GroupMember {
    fence: FenceCell,
    lost: CancellationToken,
    /// Whether its beat runs (started after the first interval, stopped when it ends).
    running: Arc<AtomicBool>,
}

/// What the group's task shares with the group.
struct GroupInner {
    repo: Arc<dyn OutboxRepository>,
    interval: Duration,
    members: std::sync::Mutex<Vec<GroupMember>>,
    /// Asks for a beat now rather than at the next interval.
    now: Notify,
}

/// The heartbeat of the claims a worker holds together (a batch's): one task beats every
/// running member with one statement per interval ([`OutboxRepository::heartbeat_many`]), so a
/// worker holding N claims writes one heartbeat per interval, not N on the pool's spare
/// connections. A member whose fence the attempt holds (writing its outcome) is skipped that
/// interval, as is a row another transaction holds locked; the task stops when the group is
/// dropped.
pub(crate) struct BeatGroup {
    inner: Arc<GroupInner>,
    task: std::sync::Mutex<Option<HeartbeatGuard>>,
}

impl BeatGroup {
    pub(crate) fn new(env: &AttemptEnv) -> Self {
        Self {
            inner: Arc::new(GroupInner {
                repo: env.repo.clone(),
                interval: env.config.heartbeat_interval,
                members: std::sync::Mutex::new(Vec::new()),
                now: Notify::new(),
            }),
            task: std::sync::Mutex::new(None),
        }
    }

    fn join(&self, member: GroupMember) {
        self.inner
            .members
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(member);
    }

    /// Starts the group's task unless it runs; `beat_now` beats at once.
    fn start(&self, beat_now: bool) {
        let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
        if beat_now {
            self.inner.now.notify_one();
        }
        if task.is_none() {
            let inner = self.inner.clone();
            *task = Some(HeartbeatGuard {
                task: tokio::spawn(async move { inner.run().await }),
            });
        }
    }
}

impl GroupInner {
    async fn run(&self) {
        // After a failed beat (a cut connection, a server coming back) the next try comes soon,
        // backing off to the interval: a pool's dead connections are flushed one per try, and
        // a claim must not go stale while they are.
        let mut wait = self.interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.now.notified() => {}
            }
            wait = if self.beat_once().await {
                self.interval
            } else if wait >= self.interval {
                FIRST_RETRY_AFTER_FAILED_BEAT
            } else {
                (wait * 2).min(self.interval)
            };
        }
    }

    /// The running members: each one's fence cell, its lock unless the attempt holds it, and
    /// its lost token.
    fn running(&self) -> Vec<Held> {
        let members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        members
            .iter()
            .filter(|m| m.running.load(Ordering::Acquire) && !m.lost.is_cancelled())
            .map(|m| Held {
                // Checked again once locked: a member stopped meanwhile is not beaten.
                state: m
                    .fence
                    .try_lock_owned()
                    .filter(|state| !state.lost && m.running.load(Ordering::Acquire)),
                cell: m.fence.clone(),
                lost: m.lost.clone(),
            })
            .collect()
    }

    /// One statement for every running member whose fence is free; alive for all of them.
    /// `false` when the statement failed or its `COMMIT` got no answer.
    async fn beat_once(&self) -> bool {
        let mut running = self.running();
        for member in &running {
            self.repo.note_alive(member.cell.latest());
        }
        running.retain(|member| member.state.is_some());
        let fences: Vec<Fence> = running.iter().filter_map(Held::fence).collect();
        if fences.is_empty() {
            return true;
        }
        let beat = self.repo.heartbeat_many(fences.clone());
        tokio::pin!(beat);
        let beaten = loop {
            tokio::select! {
                beaten = &mut beat => break beaten,
                _ = tokio::time::sleep(self.interval) => {
                    for fence in &fences {
                        self.repo.note_alive(*fence);
                    }
                }
            }
        };
        let outcomes = match beaten {
            Ok(outcomes) => outcomes,
            Err(e) => {
                // A missed beat is not a lost claim (as for one claim's heartbeat); it did not
                // land.
                tracing::warn!(error = %e.chain(), claims = fences.len(), "heartbeat of the worker's claims failed; retrying soon");
                return false;
            }
        };
        // A beat whose `COMMIT` got no answer may not have landed: try again soon, as after a
        // failed one.
        let answered = !outcomes
            .iter()
            .any(|o| matches!(o, BeatOutcome::Unsure { .. }));
        for (member, outcome) in running.iter_mut().zip(outcomes) {
            let Some(state) = member.state.as_mut() else {
                continue;
            };
            match outcome {
                BeatOutcome::Beaten(next) => member.cell.beaten(state, next),
                BeatOutcome::Unsure { written, writer } => {
                    FenceCell::unsure(state, written, writer)
                }
                BeatOutcome::Lost => match own_beat_landed(&self.repo, state).await {
                    Some(landed) => member.cell.beaten(state, landed),
                    None => FenceCell::lost(state, &member.lost),
                },
                BeatOutcome::Busy => {
                    tracing::debug!(event_id = %state.fence.id, "the claim's row is locked by another transaction; beating it at the next interval");
                }
            }
        }
        answered
    }
}

/// A running member of a group, during one beat.
struct Held {
    cell: FenceCell,
    /// Its fence's lock; `None` while the attempt holds it (not beaten this interval).
    state: Option<OwnedMutexGuard<FenceState>>,
    lost: CancellationToken,
}

impl Held {
    fn fence(&self) -> Option<Fence> {
        self.state.as_ref().map(|state| state.fence)
    }
}
