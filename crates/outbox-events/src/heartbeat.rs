//! The heartbeat of one claimed row, and the fence it shares with the attempt's final write.
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

/// The claim's current fence, and whether it was lost.
#[derive(Debug)]
pub(crate) struct FenceState {
    pub fence: Fence,
    pub lost: bool,
}

/// The fence shared by the heartbeat and the attempt.
#[derive(Debug, Clone)]
pub(crate) struct FenceCell(Arc<Mutex<FenceState>>);

impl FenceCell {
    pub fn new(fence: Fence) -> Self {
        Self(Arc::new(Mutex::new(FenceState { fence, lost: false })))
    }

    /// Locks the fence for one fenced write; heartbeats wait meanwhile.
    pub async fn lock(&self) -> MutexGuard<'_, FenceState> {
        self.0.lock().await
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
                let mut state = fence.lock().await;
                if state.lost {
                    return;
                }
                match repo.heartbeat(state.fence).await {
                    Ok(Some(next)) => state.fence = next,
                    Ok(None) => {
                        state.lost = true;
                        lost.cancel();
                        tracing::warn!(event_id = %state.fence.id, "claim lost: the row was reclaimed or finished elsewhere");
                        return;
                    }
                    Err(e) => {
                        // A missed beat is not a lost claim: the row stays ours until
                        // stale-after passes without a successful beat.
                        tracing::warn!(event_id = %state.fence.id, error = %e.chain(), "heartbeat failed; retrying at the next interval");
                    }
                }
            }
        });
        Self { task }
    }
}

impl Drop for HeartbeatGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}
