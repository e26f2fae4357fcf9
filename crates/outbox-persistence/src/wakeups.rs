//! Wake-ups of idle workers, without a lost one: a count of the signals so far beside the
//! waiters. A worker reads the count ([`WakeMark`]) before its claim; a signal that comes
//! while the claim runs (after the claim's snapshot was taken, so the claim may not have seen
//! its row) moves the count, and the wait that follows a claim that found nothing returns at
//! once instead of sleeping through it. Without the count a signal sent while no worker waited
//! (every idle worker inside its claim) woke no one, and the row waited for the next poll.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// Where a repository's wake-ups stood when a worker looked ([`crate::OutboxRepository::wake_mark`]),
/// before a claim. Pass it to [`crate::OutboxRepository::wait_for_work_since`] after a claim
/// that found nothing: a wake-up since then ends the wait at once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WakeMark(u64);

impl From<u64> for WakeMark {
    /// A mark at `count` wake-ups: for repositories of one's own and for mocks.
    fn from(count: u64) -> Self {
        Self(count)
    }
}

/// The signals and their waiters.
#[derive(Debug, Default)]
pub(crate) struct WakeUps {
    count: AtomicU64,
    notify: Notify,
}

impl WakeUps {
    pub(crate) fn mark(&self) -> WakeMark {
        WakeMark(self.count.load(Ordering::Acquire))
    }

    /// Wakes every waiting worker, and the next wait of every worker that read its mark
    /// before now.
    pub(crate) fn wake(&self) {
        self.count.fetch_add(1, Ordering::AcqRel);
        self.notify.notify_waiters();
    }

    /// Waits for a wake-up or `timeout`; returns at once when one came after `since` was read.
    pub(crate) async fn wait(&self, since: WakeMark, timeout: Duration) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        // Registered before the count is read: a wake-up between the two is not lost.
        notified.as_mut().enable();
        if since != self.mark() {
            return;
        }
        let _ = tokio::time::timeout(timeout, notified).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wake-up while nobody waited (the workers were claiming) ends the next wait of a worker
    /// that read its mark before it; a worker that read its mark after it waits.
    #[tokio::test(start_paused = true)]
    async fn a_wake_up_while_nobody_waits_is_not_lost() {
        let wakes = WakeUps::default();
        let before = wakes.mark();
        wakes.wake();
        let started = tokio::time::Instant::now();
        wakes.wait(before, Duration::from_secs(60)).await;
        assert_eq!(started.elapsed(), Duration::ZERO);

        let after = wakes.mark();
        wakes.wait(after, Duration::from_secs(60)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(60));
    }

    /// A waiting worker is woken by the next signal.
    #[tokio::test(start_paused = true)]
    async fn a_waiting_worker_is_woken() {
        let wakes = std::sync::Arc::new(WakeUps::default());
        let mark = wakes.mark();
        let waiter = tokio::spawn({
            let wakes = wakes.clone();
            async move {
                let started = tokio::time::Instant::now();
                wakes.wait(mark, Duration::from_secs(60)).await;
                started.elapsed()
            }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        wakes.wake();
        let waited = waiter.await.expect("the waiter ends");
        assert_eq!(waited, Duration::from_secs(1));
    }
}
