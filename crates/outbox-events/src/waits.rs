//! How a pull or legacy worker waits: for work (woken by the database or its poll interval),
//! and after a failed claim (backing off); the claim rules it claims under.

use std::time::Duration;

use outbox_persistence::{ClaimPolicy, WakeMark};
use tokio_util::sync::CancellationToken;

use crate::env::AttemptEnv;

/// The first wait of a worker that found nothing to claim; it doubles up to the poll interval.
pub(crate) const FIRST_IDLE_WAIT: Duration = Duration::from_millis(10);
/// The first wait after a failed claim (database down); it doubles up to five seconds.
pub(crate) const FIRST_ERROR_BACKOFF: Duration = Duration::from_millis(100);
pub(crate) const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(5);

/// The claim rules of the configuration.
pub(crate) fn policy(env: &AttemptEnv) -> ClaimPolicy {
    env.config.claim_policy()
}

/// Waits for work or for `stop`, whichever comes first. `since` was read before the claim that
/// found nothing: a wake-up during that claim ends the wait at once.
pub(crate) async fn idle(
    env: &AttemptEnv,
    stop: &CancellationToken,
    since: WakeMark,
    wait: Duration,
) {
    tokio::select! {
        _ = stop.cancelled() => {}
        result = env.repo.wait_for_work_since(since, wait) => {
            if let Err(e) = result {
                tracing::debug!(error = %e.chain(), "waiting for work failed");
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// Sleeps after a failed claim, unless `stop` comes first.
pub(crate) async fn back_off(stop: &CancellationToken, backoff: &mut Duration) {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(*backoff) => {}
    }
    *backoff = (*backoff * 2).min(MAX_ERROR_BACKOFF);
}
