//! The heartbeat of one claimed row (started once the attempt outlives its first interval), and
//! the fence it shares with the attempt's final write.
//!
//! The heartbeat refreshes `LastModifiedDate` on a connection of its own, outside the attempt
//! transaction, so other workers see the claim alive. Every fenced write (heartbeat or status)
//! holds the [`FenceCell`] lock while it runs, so the final write always compares against the
//! value the heartbeat wrote last. The task lives in a [`HeartbeatGuard`] that stops it on drop:
//! no early return can leave it beating.

use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{Fence, OutboxRepository};
use tokio::sync::{Mutex, MutexGuard};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::attempt::AttemptEnv;

/// The claim's current fence, and whether it was lost.
#[derive(Debug)]
pub(crate) struct FenceState {
    pub fence: Fence,
    pub lost: bool,
}

/// The fence shared by the heartbeat and the attempt, with a copy of the latest value that
/// can be read without waiting for the lock (the attempt holds the lock while it begins).
#[derive(Debug, Clone)]
pub(crate) struct FenceCell(Arc<Mutex<FenceState>>, Arc<std::sync::Mutex<Fence>>);

impl FenceCell {
    pub fn new(fence: Fence) -> Self {
        Self(
            Arc::new(Mutex::new(FenceState { fence, lost: false })),
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
        }
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, Option<HeartbeatGuard>> {
        self.guard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the heartbeat unless it runs; `beat_now` beats at once (the claim may have gone
    /// without beats so far).
    pub(crate) fn ensure_running(&self, beat_now: bool) {
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
        Ok(Some(next)) => {
            state.fence = next;
            fence.set_latest(next);
            true
        }
        Ok(None) => {
            state.lost = true;
            lost.cancel();
            tracing::warn!(event_id = %state.fence.id, "claim lost: the row was reclaimed or finished elsewhere");
            false
        }
        Err(e) => {
            // A missed beat is not a lost claim: the row stays ours until stale-after passes
            // without a successful beat.
            tracing::warn!(event_id = %state.fence.id, error = %e.chain(), "heartbeat failed; retrying at the next interval");
            true
        }
    }
}

impl Drop for HeartbeatGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}
