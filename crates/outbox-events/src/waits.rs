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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use outbox_persistence::{MockOutboxRepository, Scope, WakeMark};

    use super::*;
    use crate::{Handlers, WorkerConfig};

    fn env(repo: MockOutboxRepository, stop: &CancellationToken) -> Arc<AttemptEnv> {
        Arc::new(AttemptEnv {
            repo: Arc::new(repo),
            handlers: Handlers::new(),
            config: WorkerConfig::default().with_workers(1),
            metrics: Arc::default(),
            hard_stop: CancellationToken::new(),
            stop: stop.clone(),
            attempts: Arc::new(tokio::sync::Semaphore::new(1)),
            paused: crate::pause::Paused::default(),
        })
    }

    /// The repository of a worker whose look (`look`, set up by the caller) finds nothing:
    /// the mark is read before the look, and the wait after it is since that mark; the wait
    /// stops the worker.
    fn marks_around(
        look: impl FnOnce(&mut MockOutboxRepository, &mut mockall::Sequence),
        stop: &CancellationToken,
    ) -> MockOutboxRepository {
        let mut seq = mockall::Sequence::new();
        let mut repo = MockOutboxRepository::new();
        repo.expect_wake_mark()
            .times(1)
            .in_sequence(&mut seq)
            .return_const(WakeMark::from(7));
        look(&mut repo, &mut seq);
        let stop = stop.clone();
        repo.expect_wait_for_work_since()
            .times(1)
            .in_sequence(&mut seq)
            .returning(move |since, _| {
                assert_eq!(since, WakeMark::from(7), "the mark read before the look");
                stop.cancel();
                Ok(())
            });
        repo.expect_wait_for_work().never();
        repo
    }

    /// A pull worker reads the wake mark before its claim and, when the claim finds nothing,
    /// waits since that mark: a wake-up during the claim is not lost.
    #[tokio::test(start_paused = true)]
    async fn a_pull_worker_waits_since_the_mark_it_read_before_its_claim() {
        let stop = CancellationToken::new();
        let repo = marks_around(
            |repo, seq| {
                repo.expect_claim_next()
                    .times(1)
                    .in_sequence(seq)
                    .returning(|_, _| Ok(None));
            },
            &stop,
        );
        let claims = Arc::new(crate::claims::Claims::new(1));
        crate::dispatcher::pull_worker(env(repo, &stop), claims, stop.clone(), Scope::All, 0).await;
        assert!(stop.is_cancelled());
    }

    /// The legacy dispatcher does the same around its read of pending rows.
    #[tokio::test(start_paused = true)]
    async fn the_legacy_dispatcher_waits_since_the_mark_it_read_before_its_read() {
        let stop = CancellationToken::new();
        let repo = marks_around(
            |repo, seq| {
                repo.expect_get_pending_events()
                    .times(1)
                    .in_sequence(seq)
                    .returning(|_, _, _| Ok(Vec::new()));
            },
            &stop,
        );
        crate::legacy::run(env(repo, &stop), stop.clone(), Scope::All).await;
        assert!(stop.is_cancelled());
    }
}
