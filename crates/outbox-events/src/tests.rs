//! Unit tests of the attempt state machine over mocked repositories, under paused time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use outbox_persistence::{
    Attempt, BeatOutcome, Claim, Error, EventStatus, FailureBookkeeping, Fence, FenceOutcome,
    MockAttempt, MockOutboxRepository, OutboxEvent,
};
use tokio_util::sync::CancellationToken;

use crate::{
    AttemptContext, AttemptOutcome, ClaimRunner, Handler, HandlerError, Handlers, Metrics,
    WorkerConfig,
};

fn claim(event_type: &str, retry_count: i32) -> Claim {
    let now = outbox_persistence::truncate_micros(Utc::now());
    let id = outbox_persistence::new_event_id();
    Claim {
        event: OutboxEvent {
            id,
            event_type: event_type.into(),
            payload: "{}".into(),
            status: EventStatus::Processing,
            retry_count,
            record_key: Some(outbox_persistence::RecordKey::from_stored("Lead:1")),
            created_date: now,
            last_modified_date: now,
            last_error: None,
        },
        fence: Fence {
            id,
            last_written: now,
        },
        reclaimed: false,
    }
}

/// The row `id` as `get_event` reads it back.
fn row(id: outbox_persistence::EventId, status: EventStatus, retry_count: i32) -> OutboxEvent {
    let now = outbox_persistence::truncate_micros(Utc::now());
    OutboxEvent {
        id,
        event_type: "t".into(),
        payload: "{}".into(),
        status,
        retry_count,
        record_key: Some(outbox_persistence::RecordKey::from_stored("lead:1")),
        created_date: now,
        last_modified_date: now,
        last_error: None,
    }
}

/// A handler that waits `delay` (paused time) and then returns what `result` makes.
struct TestHandler {
    delay: Duration,
    result: fn() -> Result<(), HandlerError>,
}

#[async_trait]
impl Handler for TestHandler {
    async fn handle(
        &self,
        _: &OutboxEvent,
        _: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        (self.result)()
    }
}

fn handlers(delay: Duration, result: fn() -> Result<(), HandlerError>) -> Handlers {
    Handlers::new().register("t", TestHandler { delay, result })
}

fn config() -> WorkerConfig {
    WorkerConfig::default()
        .with_heartbeat_interval(Duration::from_secs(1))
        .with_stale_after(Duration::from_secs(10))
        .with_max_retry_attempts(5)
}

fn lock_timeout() -> Error {
    Error::LockTimeout(sqlx::Error::PoolTimedOut)
}

fn unavailable() -> Error {
    Error::Unavailable(sqlx::Error::PoolClosed)
}

/// An attempt whose handler succeeded: its `processed` is written, and its `COMMIT` reports an
/// error (the connection died: it may or may not have landed).
fn processed_whose_commit_fails() -> MockAttempt {
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed()
        .times(1)
        .returning(|_| Ok(FenceOutcome::Written));
    attempt
        .expect_commit()
        .times(1)
        .returning(|| Err(unavailable()));
    attempt
}

/// A repository whose heartbeats always succeed, logging each one in `log`.
fn repo_with(attempt: MockAttempt, log: Arc<Mutex<Vec<&'static str>>>) -> MockOutboxRepository {
    let mut repo = mock_repo();
    repo.expect_begin_attempt()
        .times(1)
        .return_once(move |_, _| Ok(Some(Box::new(attempt) as Box<dyn Attempt>)));
    repo.expect_heartbeat().returning(move |fence: Fence| {
        log.lock().unwrap().push("heartbeat");
        Ok(BeatOutcome::Beaten(Fence {
            id: fence.id,
            last_written: fence.last_written + chrono::Duration::microseconds(1),
        }))
    });
    repo
}

async fn run(
    repo: MockOutboxRepository,
    handlers: Handlers,
    claim: Claim,
    stop: CancellationToken,
) -> (AttemptOutcome, Arc<Metrics>) {
    let runner = ClaimRunner::new(Arc::new(repo), handlers, config()).with_hard_stop(stop);
    let outcome = runner.run(claim).await;
    (outcome, runner.metrics())
}

#[tokio::test(start_paused = true)]
async fn success_marks_processed_and_commits() {
    let c = claim("t", 0);
    let fence = c.fence;
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed()
        .withf(move |f| *f == fence)
        .times(1)
        .returning(|_| Ok(FenceOutcome::Written));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    attempt.expect_rollback_to_savepoint().never();
    let log = Arc::default();
    let repo = repo_with(attempt, Arc::clone(&log));
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::ZERO, || Ok(())),
        c,
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Processed);
    let m = metrics.snapshot();
    assert_eq!((m.claimed, m.processed), (1, 1));
    assert!(
        log.lock().unwrap().is_empty(),
        "no heartbeat for an attempt shorter than one interval"
    );
}

fn expect_failure(
    attempt: &mut MockAttempt,
    want: fn(&FailureBookkeeping) -> bool,
    message: &'static str,
) {
    attempt
        .expect_rollback_to_savepoint()
        .times(1)
        .returning(|| Ok(()));
    attempt
        .expect_record_failure()
        .withf(move |_, bookkeeping, error| want(bookkeeping) && error.contains(message))
        .times(1)
        .returning(|_, _, _| Ok(FenceOutcome::Written));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    attempt.expect_mark_processed().never();
}

#[tokio::test(start_paused = true)]
async fn handler_error_rolls_back_to_savepoint_and_retries() {
    let mut attempt = MockAttempt::new();
    expect_failure(
        &mut attempt,
        |b| matches!(b, FailureBookkeeping::Retry { .. }),
        "boom",
    );
    let repo = repo_with(attempt, Arc::default());
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::ZERO, || {
            Err(HandlerError::Retryable("boom".into()))
        }),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Retried);
    assert_eq!(metrics.snapshot().retried, 1);
}

/// A snooze is written as one whatever the count (the last allowed attempt included), counts
/// no failure, and waits its delay: less the base retry delay for a row that failed before,
/// whose retry cutoff adds it back.
#[tokio::test(start_paused = true)]
async fn a_snooze_is_uncounted_even_at_the_last_attempt() {
    let retry_delay = config().retry_delay;
    for (count, delay) in [
        (0, Duration::from_secs(30)),
        (4, Duration::from_secs(30) - retry_delay),
    ] {
        let mut attempt = MockAttempt::new();
        attempt
            .expect_rollback_to_savepoint()
            .times(1)
            .returning(|| Ok(()));
        attempt
            .expect_record_failure()
            .withf(move |_, bookkeeping, error| {
                *bookkeeping == FailureBookkeeping::Snooze { delay } && error.contains("quota")
            })
            .times(1)
            .returning(|_, _, _| Ok(FenceOutcome::Written));
        attempt.expect_commit().times(1).returning(|| Ok(()));
        let repo = repo_with(attempt, Arc::default());
        let (outcome, metrics) = run(
            repo,
            handlers(Duration::ZERO, || {
                Err(HandlerError::snooze(Duration::from_secs(30), "quota spent"))
            }),
            claim("t", count),
            CancellationToken::new(),
        )
        .await;
        assert_eq!(outcome, AttemptOutcome::Snoozed);
        let m = metrics.snapshot();
        assert_eq!((m.snoozed, m.retried, m.failed), (1, 0, 0));
    }
}

#[tokio::test(start_paused = true)]
async fn lock_timeout_is_retried_and_counted() {
    let mut attempt = MockAttempt::new();
    expect_failure(
        &mut attempt,
        |b| matches!(b, FailureBookkeeping::Retry { .. }),
        "lock timeout",
    );
    let repo = repo_with(attempt, Arc::default());
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::ZERO, || {
            Err(HandlerError::Database(lock_timeout()))
        }),
        claim("t", 1),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Retried);
    let m = metrics.snapshot();
    assert_eq!((m.retried, m.lock_timeouts), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn retries_exhausted_ends_failed() {
    let mut attempt = MockAttempt::new();
    expect_failure(&mut attempt, |b| *b == FailureBookkeeping::Fail, "boom");
    let repo = repo_with(attempt, Arc::default());
    // The fifth failure with MaxRetryAttempts = 5.
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::ZERO, || {
            Err(HandlerError::Retryable("boom".into()))
        }),
        claim("t", 4),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Failed);
    assert_eq!(metrics.snapshot().failed, 1);
}

#[tokio::test(start_paused = true)]
async fn permanent_error_fails_at_once() {
    let mut attempt = MockAttempt::new();
    expect_failure(
        &mut attempt,
        |b| *b == FailureBookkeeping::Fail,
        "unreadable payload",
    );
    let repo = repo_with(attempt, Arc::default());
    let (outcome, _) = run(
        repo,
        handlers(Duration::ZERO, || {
            Err(HandlerError::Permanent("unreadable payload".into()))
        }),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Failed);
}

#[tokio::test(start_paused = true)]
async fn unknown_event_type_fails_with_a_clear_error() {
    let mut attempt = MockAttempt::new();
    expect_failure(
        &mut attempt,
        |b| *b == FailureBookkeeping::Fail,
        "no handler registered for event type \"nobody.handles.this\"",
    );
    let repo = repo_with(attempt, Arc::default());
    let (outcome, _) = run(
        repo,
        handlers(Duration::ZERO, || Ok(())),
        claim("nobody.handles.this", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Failed);
}

/// The commit of the attempt fails: the retry lands on the detached path, tried again while
/// the heartbeat keeps beating, and the heartbeat stops once it landed.
#[tokio::test(start_paused = true)]
async fn failed_attempt_transaction_lands_bookkeeping_detached_with_heartbeat() {
    let log: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let attempt = processed_whose_commit_fails();
    let mut repo = repo_with(attempt, Arc::clone(&log));
    // The commit did not land: the row still shows the claim.
    repo.expect_get_event()
        .returning(|id| Ok(Some(row(id, EventStatus::Processing, 0))));
    let tries = Arc::new(Mutex::new(0));
    let (l, t) = (Arc::clone(&log), Arc::clone(&tries));
    repo.expect_increment_retry()
        .withf(|_, _, error| error.contains("commit failed"))
        .times(4)
        .returning(move |_, _, _| {
            let mut t = t.lock().unwrap();
            *t += 1;
            if *t < 4 {
                l.lock().unwrap().push("bookkeeping failed");
                Err(unavailable())
            } else {
                l.lock().unwrap().push("bookkeeping landed");
                Ok(FenceOutcome::Written)
            }
        });
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::from_millis(500), || Ok(())),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Retried);
    assert_eq!(metrics.snapshot().detached_bookkeeping, 1);
    // Let any heartbeat that would outlive the attempt show itself.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let log = log.lock().unwrap().clone();
    let first_failure = log.iter().position(|e| *e == "bookkeeping failed").unwrap();
    let landed = log.iter().position(|e| *e == "bookkeeping landed").unwrap();
    assert!(
        log[first_failure..landed].contains(&"heartbeat"),
        "the heartbeat keeps the claim while the bookkeeping retries: {log:?}"
    );
    assert!(
        !log[landed..].contains(&"heartbeat"),
        "the heartbeat stops once the bookkeeping landed: {log:?}"
    );
}

/// The heartbeat finds the row taken over: the attempt is abandoned, rolled back, and nothing
/// is written.
#[tokio::test(start_paused = true)]
async fn lost_claim_abandons_the_attempt() {
    let mut attempt = MockAttempt::new();
    attempt.expect_rollback().times(1).returning(|| Ok(()));
    attempt.expect_mark_processed().never();
    attempt.expect_record_failure().never();
    attempt.expect_commit().never();
    let mut repo = MockOutboxRepository::new();
    repo.expect_note_alive().returning(|_| ());
    repo.expect_serializes_writers().return_const(false);
    repo.expect_begin_attempt()
        .times(1)
        .return_once(move |_, _| Ok(Some(Box::new(attempt) as Box<dyn Attempt>)));
    repo.expect_heartbeat()
        .times(1)
        .returning(|_| Ok(BeatOutcome::Lost));
    repo.expect_increment_retry().never();
    repo.expect_update_status().never();
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::from_secs(60), || Ok(())),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::LostClaim);
    assert_eq!(metrics.snapshot().lost_claims, 1);
}

/// A heartbeat that fails transiently is not a lost claim.
#[tokio::test(start_paused = true)]
async fn a_failed_heartbeat_is_not_a_lost_claim() {
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed()
        .times(1)
        .returning(|_| Ok(FenceOutcome::Written));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    let mut repo = MockOutboxRepository::new();
    repo.expect_note_alive().returning(|_| ());
    repo.expect_serializes_writers().return_const(false);
    repo.expect_begin_attempt()
        .times(1)
        .return_once(move |_, _| Ok(Some(Box::new(attempt) as Box<dyn Attempt>)));
    repo.expect_heartbeat()
        .times(2)
        .returning(|_| Err(unavailable()));
    // A beat that failed did not land (only one whose `COMMIT` got no answer may have): the
    // final write goes under the claim's fence, with no read-back.
    repo.expect_beat_landed().never();
    repo.expect_get_event().never();
    let (outcome, _) = run(
        repo,
        handlers(Duration::from_millis(2500), || Ok(())),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Processed);
}

/// The final write finds the fence moved (the row was reclaimed between beats): roll back.
#[tokio::test(start_paused = true)]
async fn fenced_out_final_write_rolls_back() {
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed()
        .times(1)
        .returning(|_| Ok(FenceOutcome::Lost));
    attempt.expect_rollback().times(1).returning(|| Ok(()));
    attempt.expect_commit().never();
    let repo = repo_with(attempt, Arc::default());
    let (outcome, _) = run(
        repo,
        handlers(Duration::ZERO, || Ok(())),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::LostClaim);
}

/// A hard shutdown mid-attempt rolls back and leaves the row to stale reclaim.
#[tokio::test(start_paused = true)]
async fn shutdown_mid_attempt_rolls_back() {
    let mut attempt = MockAttempt::new();
    attempt.expect_rollback().times(1).returning(|| Ok(()));
    attempt.expect_mark_processed().never();
    attempt.expect_commit().never();
    let mut repo = repo_with(attempt, Arc::default());
    repo.expect_increment_retry().never();
    let stop = CancellationToken::new();
    let trigger = stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        trigger.cancel();
    });
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::from_secs(60), || Ok(())),
        claim("t", 0),
        stop,
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Cancelled);
    assert_eq!(metrics.snapshot().cancelled, 1);
}

/// The attempt transaction cannot begin for a while (database down): nothing is counted, the
/// claim is kept alive by the heartbeat, and the attempt runs once beginning works again.
#[tokio::test(start_paused = true)]
async fn attempt_that_cannot_begin_yet_is_retried_uncounted() {
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed()
        .times(1)
        .returning(|_| Ok(FenceOutcome::Written));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    let mut repo = MockOutboxRepository::new();
    repo.expect_note_alive().returning(|_| ());
    repo.expect_serializes_writers().return_const(false);
    let mut begins = 0;
    let mut attempt = Some(attempt);
    // Six failures: 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s of backoff, longer than the 1 s heartbeat.
    repo.expect_begin_attempt().times(7).returning(move |_, _| {
        begins += 1;
        if begins < 7 {
            Err(unavailable())
        } else {
            Ok(Some(Box::new(attempt.take().unwrap()) as Box<dyn Attempt>))
        }
    });
    let beats = Arc::new(Mutex::new(0));
    let b = Arc::clone(&beats);
    repo.expect_heartbeat().returning(move |fence: Fence| {
        *b.lock().unwrap() += 1;
        Ok(BeatOutcome::Beaten(Fence {
            id: fence.id,
            last_written: fence.last_written + chrono::Duration::microseconds(1),
        }))
    });
    repo.expect_increment_retry().never();
    repo.expect_update_status().never();
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::ZERO, || Ok(())),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Processed);
    assert_eq!(metrics.snapshot().retried, 0);
    assert!(
        *beats.lock().unwrap() >= 1,
        "the claim was kept alive while beginning was retried"
    );
}

/// An attempt that never begins is abandoned without counting a failure: the row goes stale
/// and is reclaimed as it was.
#[tokio::test(start_paused = true)]
async fn attempt_that_never_begins_is_abandoned_uncounted() {
    let mut repo = MockOutboxRepository::new();
    repo.expect_note_alive().returning(|_| ());
    repo.expect_serializes_writers().return_const(true);
    repo.expect_begin_attempt()
        .returning(|_, _| Err(Error::LockTimeout(sqlx::Error::PoolTimedOut)));
    repo.expect_heartbeat()
        .returning(|f| Ok(BeatOutcome::Beaten(f)));
    repo.expect_increment_retry().never();
    repo.expect_update_status().never();
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::ZERO, || Ok(())),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Abandoned);
    let m = metrics.snapshot();
    assert_eq!((m.retried, m.failed), (0, 0));
    assert!(m.lock_timeouts > 0);
}

/// A panicking handler does not take its worker down: the attempt rolls back to the savepoint
/// and is retried like any failure.
#[tokio::test(start_paused = true)]
async fn a_panicking_handler_is_a_retryable_failure() {
    let mut attempt = MockAttempt::new();
    expect_failure(
        &mut attempt,
        |b| matches!(b, FailureBookkeeping::Retry { .. }),
        "handler panicked: boom",
    );
    let repo = repo_with(attempt, Arc::default());
    let (outcome, _) = run(
        repo,
        handlers(Duration::ZERO, || panic!("boom")),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Retried);
}

/// On a backend whose attempts exclude other writers (SQLite), no heartbeat runs during the
/// attempt; it starts when the bookkeeping must land on the side.
#[tokio::test(start_paused = true)]
async fn serialized_backend_heartbeats_only_for_detached_bookkeeping() {
    let log: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let attempt = processed_whose_commit_fails();
    let mut repo = MockOutboxRepository::new();
    repo.expect_note_alive().returning(|_| ());
    repo.expect_serializes_writers().return_const(true);
    repo.expect_get_event()
        .returning(|id| Ok(Some(row(id, EventStatus::Processing, 0))));
    repo.expect_begin_attempt()
        .times(1)
        .return_once(move |_, _| Ok(Some(Box::new(attempt) as Box<dyn Attempt>)));
    let l = Arc::clone(&log);
    repo.expect_heartbeat().returning(move |fence: Fence| {
        l.lock().unwrap().push("heartbeat");
        Ok(BeatOutcome::Beaten(Fence {
            id: fence.id,
            last_written: fence.last_written + chrono::Duration::microseconds(1),
        }))
    });
    let (l, tries) = (Arc::clone(&log), Arc::new(Mutex::new(0)));
    repo.expect_increment_retry().returning(move |_, _, _| {
        let mut t = tries.lock().unwrap();
        *t += 1;
        if *t < 12 {
            l.lock().unwrap().push("bookkeeping failed");
            Err(unavailable())
        } else {
            l.lock().unwrap().push("bookkeeping landed");
            Ok(FenceOutcome::Written)
        }
    });
    // The handler runs longer than several heartbeat intervals.
    let (outcome, _) = run(
        repo,
        handlers(Duration::from_secs(5), || Ok(())),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Retried);
    let log = log.lock().unwrap().clone();
    let first = log.iter().position(|e| *e == "bookkeeping failed").unwrap();
    assert!(
        !log[..first].contains(&"heartbeat"),
        "no heartbeat during the attempt: {log:?}"
    );
    assert!(
        log[first..].contains(&"heartbeat"),
        "the heartbeat keeps the detached claim: {log:?}"
    );
}

/// The commit reports an error but landed (the reply was lost): the row reads back
/// `processed` with the claim's `RetryCount`, so the attempt is processed, not retried and not
/// counted as a lost claim.
#[tokio::test(start_paused = true)]
async fn commit_that_landed_despite_an_error_counts_as_processed() {
    let mut attempt = processed_whose_commit_fails();
    attempt.expect_rollback().returning(|| Ok(()));
    let mut repo = repo_with(attempt, Arc::default());
    repo.expect_get_event()
        .times(1)
        .returning(|id| Ok(Some(row(id, EventStatus::Processed, 2))));
    repo.expect_increment_retry().never();
    repo.expect_update_status().never();
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::ZERO, || Ok(())),
        claim("t", 2),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Processed);
    let m = metrics.snapshot();
    assert_eq!((m.processed, m.lost_claims, m.retried), (1, 0, 0));
}

/// The success commit fails without landing; the detached retry's first try fails too, but
/// landed with its reply lost, and another worker then claimed the retried row fresh and
/// finished it (`processed`, one count past the claim, `LastError` cleared) `after` the claim.
/// The second try finds the claim gone and reads the row back.
async fn retry_landed_then_finished_elsewhere(after: chrono::Duration) -> AttemptOutcome {
    let attempt = processed_whose_commit_fails();
    let mut repo = repo_with(attempt, Arc::default());
    let c = claim("t", 0);
    let claimed_at = c.event.last_modified_date;
    let reads = Arc::new(Mutex::new(0));
    repo.expect_get_event().returning(move |id| {
        let mut n = reads.lock().unwrap();
        *n += 1;
        if *n == 1 {
            // The check for the success commit: still this claim.
            return Ok(Some(row(id, EventStatus::Processing, 0)));
        }
        let mut finished = row(id, EventStatus::Processed, 1);
        finished.last_modified_date = claimed_at + after;
        Ok(Some(finished))
    });
    let tries = Arc::new(Mutex::new(0));
    repo.expect_increment_retry().returning(move |_, _, _| {
        let mut t = tries.lock().unwrap();
        *t += 1;
        if *t == 1 {
            Err(unavailable())
        } else {
            Ok(FenceOutcome::Lost)
        }
    });
    let (outcome, _) = run(
        repo,
        handlers(Duration::ZERO, || Ok(())),
        c,
        CancellationToken::new(),
    )
    .await;
    outcome
}

/// Finished sooner after the claim than any reclaim could have taken it (stale-after is 10 s):
/// the retry landed, so the attempt was retried, not a lost claim.
#[tokio::test(start_paused = true)]
async fn a_retry_that_landed_and_was_finished_elsewhere_is_not_a_lost_claim() {
    let outcome = retry_landed_then_finished_elsewhere(chrono::Duration::milliseconds(200)).await;
    assert_eq!(outcome, AttemptOutcome::Retried);
}

/// Finished later than a reclaim could have taken the row: the count may be the reclaim's (a
/// processed row no longer says the worker died), so it stays a lost claim.
#[tokio::test(start_paused = true)]
async fn a_row_finished_after_a_possible_reclaim_is_a_lost_claim() {
    let outcome = retry_landed_then_finished_elsewhere(chrono::Duration::seconds(11)).await;
    assert_eq!(outcome, AttemptOutcome::LostClaim);
}

/// A row that another worker finished after a reclaim carries a higher `RetryCount`: the
/// commit error is then a lost claim, never mistaken for this attempt's success.
#[tokio::test(start_paused = true)]
async fn commit_error_with_a_reclaimed_row_is_a_lost_claim() {
    let attempt = processed_whose_commit_fails();
    let mut repo = repo_with(attempt, Arc::default());
    repo.expect_get_event()
        .returning(|id| Ok(Some(row(id, EventStatus::Processed, 1))));
    repo.expect_increment_retry()
        .times(1)
        .returning(|_, _, _| Ok(FenceOutcome::Lost));
    let (outcome, _) = run(
        repo,
        handlers(Duration::ZERO, || Ok(())),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::LostClaim);
}

/// Heartbeats move the fence; the final write compares against the fence the last heartbeat
/// wrote, not the claim's.
#[tokio::test(start_paused = true)]
async fn final_write_uses_the_fence_the_last_heartbeat_wrote() {
    let c = claim("t", 0);
    let claimed = c.fence;
    let beats = Arc::new(Mutex::new(Vec::new()));
    let mut repo = mock_repo();
    let b = Arc::clone(&beats);
    repo.expect_heartbeat().returning(move |fence: Fence| {
        let next = Fence {
            id: fence.id,
            last_written: fence.last_written + chrono::Duration::seconds(1),
        };
        b.lock().unwrap().push(next);
        Ok(BeatOutcome::Beaten(next))
    });
    let b = Arc::clone(&beats);
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed()
        .times(1)
        .withf(move |f| {
            let last = *b.lock().unwrap().last().expect("the heartbeat ran");
            *f == last && *f != claimed
        })
        .returning(|_| Ok(FenceOutcome::Written));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    repo.expect_begin_attempt()
        .times(1)
        .return_once(move |_, _| Ok(Some(Box::new(attempt) as Box<dyn Attempt>)));
    // The handler runs 3.5 heartbeat intervals: three beats before the final write.
    let (outcome, _) = run(
        repo,
        handlers(Duration::from_millis(3500), || Ok(())),
        c,
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Processed);
    assert_eq!(beats.lock().unwrap().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn the_metrics_facade_counts_by_event_type_and_outcome_never_by_key() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed()
        .returning(|_| Ok(FenceOutcome::Written));
    attempt.expect_commit().returning(|| Ok(()));
    let repo = repo_with(attempt, Arc::default());
    let (outcome, _) = run(
        repo,
        handlers(Duration::from_millis(30), || Ok(())),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Processed);
    let mut attempt = MockAttempt::new();
    expect_failure(
        &mut attempt,
        |b| matches!(b, FailureBookkeeping::Retry { .. }),
        "boom",
    );
    let repo = repo_with(attempt, Arc::default());
    let (outcome, _) = run(
        repo,
        handlers(Duration::ZERO, || {
            Err(HandlerError::Retryable("boom".into()))
        }),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Retried);
    let text = handle.render();
    for line in [
        r#"outbox_claims_total{event_type="t"} 2"#,
        r#"outbox_attempts_total{event_type="t",outcome="processed"} 1"#,
        r#"outbox_attempts_total{event_type="t",outcome="retried"} 1"#,
        r#"outbox_handler_duration_seconds_count{event_type="t"} 2"#,
        r#"outbox_enqueue_to_processed_seconds_count{event_type="t"} 1"#,
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
    assert!(
        !text.contains("record_key") && !text.contains("event_id"),
        "{text}"
    );
}

/// A database that is away while the service starts (the gate's read fails as unavailable, then
/// as a lock timeout) delays the decision instead of failing it; an error that repeats does not.
#[tokio::test(start_paused = true)]
async fn decide_rides_out_a_database_that_is_briefly_away() {
    let mut repo = MockOutboxRepository::new();
    repo.expect_check_schema().returning(|| Ok(()));
    let mut seq = mockall::Sequence::new();
    repo.expect_count_missing_record_keys()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|| Err(Error::Unavailable(sqlx::Error::PoolTimedOut)));
    repo.expect_count_missing_record_keys()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|| Err(lock_timeout()));
    repo.expect_count_missing_record_keys()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|| Ok(0));
    let repo: Arc<dyn outbox_persistence::OutboxRepository> = Arc::new(repo);
    let pull = config().with_mode(crate::DispatchMode::Pull);
    let dispatcher = crate::Dispatcher::new(repo, Handlers::new(), pull.clone());
    let decision = dispatcher
        .decide()
        .await
        .expect("decided once the database is back");
    assert_eq!(decision.mode, crate::DispatchMode::Pull);

    let mut repo = MockOutboxRepository::new();
    repo.expect_check_schema().returning(|| Ok(()));
    repo.expect_count_missing_record_keys()
        .times(1)
        .returning(|| Err(Error::Database(sqlx::Error::RowNotFound)));
    let repo: Arc<dyn outbox_persistence::OutboxRepository> = Arc::new(repo);
    let dispatcher = crate::Dispatcher::new(repo, Handlers::new(), pull.clone());
    assert!(matches!(dispatcher.decide().await, Err(Error::Database(_))));

    // Still away after `DECIDE_RETRY_FOR`: the error is returned.
    let mut repo = MockOutboxRepository::new();
    repo.expect_check_schema().returning(|| Ok(()));
    repo.expect_count_missing_record_keys()
        .returning(|| Err(Error::Unavailable(sqlx::Error::PoolTimedOut)));
    let repo: Arc<dyn outbox_persistence::OutboxRepository> = Arc::new(repo);
    let dispatcher = crate::Dispatcher::new(repo, Handlers::new(), pull);
    let started = tokio::time::Instant::now();
    assert!(matches!(
        dispatcher.decide().await,
        Err(Error::Unavailable(_))
    ));
    assert!(started.elapsed() <= crate::DECIDE_RETRY_FOR);
    assert!(started.elapsed() >= crate::DECIDE_RETRY_FOR - Duration::from_secs(6));
}

/// A database without this build's migrations starts nothing and says so, before the gate
/// reads anything. A newer schema (a rolling deploy), a check that fails (a role that may not
/// read the migrations' table) or a database away at the check is logged, checked once, and the
/// decision goes on.
#[tokio::test(start_paused = true)]
async fn decide_refuses_a_database_without_the_build_s_migrations() {
    let pull = config().with_mode(crate::DispatchMode::Pull);
    let decide = |check: fn() -> Result<(), Error>, gate_reads: usize| {
        let mut repo = MockOutboxRepository::new();
        repo.expect_check_schema().times(1).returning(check);
        repo.expect_count_missing_record_keys()
            .times(gate_reads)
            .returning(|| Ok(0));
        let repo: Arc<dyn outbox_persistence::OutboxRepository> = Arc::new(repo);
        crate::Dispatcher::new(repo, Handlers::new(), pull.clone())
    };
    let missing = decide(|| Err(Error::NotMigrated { missing: vec![24] }), 0);
    let Err(e) = missing.decide().await else {
        panic!("decided on a database without migration 24");
    };
    assert!(
        e.to_string().contains("[24]") && e.to_string().contains("migrate"),
        "{e}"
    );
    for check in [
        (|| Err(Error::SchemaTooNew { unknown: vec![99] })) as fn() -> Result<(), Error>,
        || Err(Error::Database(sqlx::Error::RowNotFound)),
        || Err(Error::Unavailable(sqlx::Error::PoolTimedOut)),
    ] {
        let decided = decide(check, 1).decide().await.unwrap();
        assert_eq!(decided.mode, crate::DispatchMode::Pull);
    }
}

/// `n` first-attempt claims of distinct records, claimed together (a batch's).
fn batch_claims(n: usize) -> Vec<Claim> {
    (0..n)
        .map(|i| {
            let mut c = claim("t", 0);
            c.event.record_key = Some(outbox_persistence::RecordKey::from_stored(format!(
                "Lead:{i}"
            )));
            c
        })
        .collect()
}

/// Every batch beat of `repo` lands.
fn beats_land(repo: &mut MockOutboxRepository) {
    repo.expect_heartbeat_many()
        .returning(|fences: Vec<Fence>| {
            Ok(fences
                .into_iter()
                .map(outbox_persistence::BeatOutcome::Beaten)
                .collect())
        });
}

/// The mocked repository most unit tests start from: liveness notes taken, a backend whose
/// writers run side by side.
fn mock_repo() -> MockOutboxRepository {
    let mut repo = MockOutboxRepository::new();
    repo.expect_note_alive().returning(|_| ());
    repo.expect_backend_name().return_const("mock");
    repo.expect_serializes_writers().return_const(false);
    repo
}

/// [`mock_repo`] of a backend whose attempt holds the only write lock (SQLite's).
fn serialized_mock_repo() -> MockOutboxRepository {
    let mut repo = MockOutboxRepository::new();
    repo.expect_note_alive().returning(|_| ());
    repo.expect_backend_name().return_const("mock");
    repo.expect_serializes_writers().return_const(true);
    repo
}

/// A beat whose `COMMIT` got no answer may have landed: the next beat then finds the row moved
/// past the fence it holds. The read-back (tried again while it fails) finds the row still the
/// version that beat wrote, so it is this worker's own beat: its value becomes the fence, the claim is not lost, and the
/// outcome is written under it.
#[tokio::test(start_paused = true)]
async fn a_beat_whose_reply_was_lost_is_not_a_lost_claim() {
    let c = claim("t", 0);
    let landed = Fence {
        id: c.fence.id,
        last_written: c.fence.last_written + chrono::Duration::seconds(1),
    };
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed()
        .times(1)
        .withf(move |fence| *fence == landed)
        .returning(|_| Ok(FenceOutcome::Written));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    let mut repo = MockOutboxRepository::new();
    repo.expect_note_alive().returning(|_| ());
    repo.expect_serializes_writers().return_const(false);
    repo.expect_begin_attempt()
        .times(1)
        .return_once(move |_, _| Ok(Some(Box::new(attempt) as Box<dyn Attempt>)));
    let mut seq = mockall::Sequence::new();
    // The first beat lands but its `COMMIT` reply is lost; the second finds the row moved on.
    repo.expect_heartbeat()
        .times(1)
        .in_sequence(&mut seq)
        .returning(move |_| {
            Ok(BeatOutcome::Unsure {
                written: landed,
                writer: 7,
            })
        });
    repo.expect_heartbeat()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(BeatOutcome::Lost));
    // Its read-back fails twice (the database is briefly away) before it answers.
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    repo.expect_beat_landed()
        .times(3)
        .withf(move |written, writer| *written == landed && *writer == 7)
        .returning(move |_, _| {
            if reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 2 {
                Err(unavailable())
            } else {
                Ok(true)
            }
        });
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::from_millis(2500), || Ok(())),
        c,
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Processed);
    assert_eq!(metrics.snapshot().lost_claims, 0);
}

/// A batch's claims beat together: one `heartbeat_many` per interval for every running claim,
/// never one heartbeat per claim, and the settle's one `processed` statement uses each fence
/// its last group beat wrote.
#[tokio::test(start_paused = true)]
async fn a_batch_beats_its_claims_with_one_statement_per_interval() {
    let claims = batch_claims(4);
    let claimed: Vec<Fence> = claims.iter().map(|c| c.fence).collect();
    let beats: Arc<Mutex<Vec<Vec<Fence>>>> = Arc::default();
    let mut repo = mock_repo();
    repo.expect_heartbeat().never();
    let b = Arc::clone(&beats);
    repo.expect_heartbeat_many()
        .returning(move |fences: Vec<Fence>| {
            let next: Vec<Fence> = fences
                .iter()
                .map(|f| Fence {
                    id: f.id,
                    last_written: f.last_written + chrono::Duration::seconds(1),
                })
                .collect();
            b.lock().unwrap().push(next.clone());
            Ok(next
                .into_iter()
                .map(outbox_persistence::BeatOutcome::Beaten)
                .collect())
        });
    let b = Arc::clone(&beats);
    let mut attempt = MockAttempt::new();
    // The test handler never asks for the transaction: nothing to keep, so no savepoint.
    attempt.expect_savepoint().never();
    attempt
        .expect_mark_processed_many()
        .times(1)
        .withf(move |fences: &Vec<Fence>| {
            let beaten = b.lock().unwrap();
            let last = |id| beaten.iter().flatten().rfind(|f| f.id == id).copied();
            fences.len() == 4
                && fences
                    .iter()
                    .all(|f| Some(*f) == last(f.id) && !claimed.contains(f))
        })
        .returning(|fences| Ok(vec![FenceOutcome::Written; fences.len()]));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    repo.expect_begin_batch_attempt()
        .times(1)
        .return_once(move |_, _| Ok((Box::new(attempt) as Box<dyn Attempt>, Vec::new())));
    let config = config().with_batches(32, Duration::from_secs(60));
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::from_millis(3500), || Ok(())),
        config,
    );
    let (_, ran) = runner.run_batch(claims).await;
    assert_eq!(ran, 4);
    assert_eq!(runner.metrics().snapshot().processed, 4);
    let beats = beats.lock().unwrap();
    // 14 s of handlers, one beat a second: about 14 statements, where one beat per claim
    // would have written about 4 x 14.
    assert!(
        (12..=15).contains(&beats.len()),
        "{} beats for 14 s",
        beats.len()
    );
    assert_eq!(beats[0].len(), 4, "the first beat covers every claim");
}

/// An event whose handler ended keeps being beaten while the batch's later handlers run: its
/// outcome is written only at the settle, once every handler ran, so until then the
/// transaction has not locked its row and the beat keeps its claim fresh (rule 4).
#[tokio::test(start_paused = true)]
async fn a_decided_event_is_beaten_while_later_handlers_run_and_written_at_the_settle() {
    let claims = batch_claims(2);
    let first = claims[0].event.id;
    let beats: Arc<Mutex<Vec<Vec<Fence>>>> = Arc::default();
    let mut repo = mock_repo();
    let b = Arc::clone(&beats);
    repo.expect_heartbeat_many()
        .returning(move |fences: Vec<Fence>| {
            b.lock().unwrap().push(fences.clone());
            Ok(fences
                .into_iter()
                .map(outbox_persistence::BeatOutcome::Beaten)
                .collect())
        });
    let mut attempt = MockAttempt::new();
    attempt.expect_savepoint().returning(|| Ok(()));
    let started = tokio::time::Instant::now();
    attempt
        .expect_mark_processed_many()
        .times(1)
        // Both handlers ran 3.5 s each before either outcome is written.
        .withf(move |fences| fences.len() == 2 && started.elapsed() >= Duration::from_millis(7_000))
        .returning(|fences| Ok(vec![FenceOutcome::Written; fences.len()]));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    repo.expect_begin_batch_attempt()
        .times(1)
        .return_once(move |_, _| Ok((Box::new(attempt) as Box<dyn Attempt>, Vec::new())));
    let config = config().with_batches(32, Duration::from_secs(60));
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::from_millis(3500), || Ok(())),
        config,
    );
    let (_, ran) = runner.run_batch(claims).await;
    assert_eq!(ran, 2);
    let beats = beats.lock().unwrap();
    let first_beaten = beats
        .iter()
        .filter(|fences| fences.iter().any(|f| f.id == first))
        .count();
    // 3 beats during its own handler, 3 more during the second one's.
    assert!(
        first_beaten >= 6,
        "the first event was beaten {first_beaten} times in {} beats",
        beats.len()
    );
}

/// A claim the batch's begin finds lost is given back at the settle, finds itself lost there
/// and writes nothing, and takes nothing else with it: it has no effects in the transaction, so
/// the others' outcomes are written and committed (no give-back of the batch).
#[tokio::test(start_paused = true)]
async fn a_claim_lost_before_it_ran_does_not_take_the_batch_back() {
    let claims = batch_claims(3);
    let lost = claims[1].fence;
    let mut repo = mock_repo();
    repo.expect_release_claim().never();
    let mut attempt = MockAttempt::new();
    attempt
        .expect_release()
        .times(1)
        .withf(move |fence, _| *fence == lost)
        .returning(|_, _| Ok(FenceOutcome::Lost));
    attempt
        .expect_mark_processed_many()
        .times(1)
        .withf(move |fences| fences.len() == 2 && !fences.contains(&lost))
        .returning(|fences| Ok(vec![FenceOutcome::Written; fences.len()]));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    attempt.expect_rollback().never();
    repo.expect_begin_batch_attempt()
        .times(1)
        .return_once(move |_, _| Ok((Box::new(attempt) as Box<dyn Attempt>, vec![lost.id])));
    let config = config().with_batches(32, Duration::from_secs(60));
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::from_millis(1), || Ok(())),
        config,
    );
    let (_, ran) = runner.run_batch(claims).await;
    assert_eq!(ran, 2);
    let metrics = runner.metrics().snapshot();
    assert_eq!(
        (metrics.processed, metrics.lost_claims),
        (2, 1),
        "{metrics:?}"
    );
    assert_eq!(metrics.released + metrics.not_run, 0, "{metrics:?}");
}

/// A lock timeout on the settle's `processed` write is no event's fault: the batch rolls back
/// whole and gives every event back uncounted, on the side (`Released`: their handlers ran),
/// instead of committing some of them or counting a failure.
#[tokio::test(start_paused = true)]
async fn a_lock_timeout_at_the_settle_gives_the_batch_back_uncounted() {
    let claims = batch_claims(3);
    let fences: Vec<Fence> = claims.iter().map(|c| c.fence).collect();
    let mut repo = mock_repo();
    repo.expect_release_claim()
        .times(3)
        .withf(move |fence, _| fences.contains(fence))
        .returning(|_, _| Ok(FenceOutcome::Written));
    repo.expect_increment_retry().never();
    // The releases on the side keep the claims beaten while they land.
    beats_land(&mut repo);
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed_many()
        .times(1)
        .returning(|_| Err(lock_timeout()));
    attempt.expect_rollback().times(1).returning(|| Ok(()));
    attempt.expect_commit().never();
    repo.expect_begin_batch_attempt()
        .times(1)
        .return_once(move |_, _| Ok((Box::new(attempt) as Box<dyn Attempt>, Vec::new())));
    let config = config().with_batches(32, Duration::from_secs(60));
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::from_millis(1), || Ok(())),
        config,
    );
    let (_, ran) = runner.run_batch(claims).await;
    assert_eq!(ran, 3);
    let metrics = runner.metrics().snapshot();
    assert_eq!(
        (metrics.processed, metrics.released, metrics.retried),
        (0, 3, 0),
        "{metrics:?}"
    );
    assert_eq!(metrics.lock_timeouts, 1, "{metrics:?}");
}

/// Finding 4 of the batched-attempts review (`f2_readback_adopts_foreign_claim.sh`): a release
/// whose reply was lost may have landed, and another worker may then have claimed the row
/// afresh, with the same `RetryCount` (a release does not count) and a later
/// `LastModifiedDate`. After a failed beat, the retried release must not read that row back as
/// this worker's own landed beat and release the other worker's live claim with its fence.
#[tokio::test(start_paused = true)]
async fn a_release_whose_reply_was_lost_never_adopts_the_next_claim() {
    let c = claim("t", 0);
    let ours = c.fence;
    let theirs = Fence {
        id: ours.id,
        last_written: ours.last_written + chrono::Duration::seconds(1),
    };
    let mut attempt = MockAttempt::new();
    // The handler succeeded; its `processed` hits a lock timeout: released uncounted.
    attempt
        .expect_mark_processed()
        .times(1)
        .returning(|_| Err(lock_timeout()));
    attempt.expect_rollback().times(1).returning(|| Ok(()));
    let mut repo = mock_repo();
    repo.expect_begin_attempt()
        .times(1)
        .return_once(move |_, _| Ok(Some(Box::new(attempt) as Box<dyn Attempt>)));
    // Every beat fails (the connection is flapping) before its `COMMIT`: none landed, and the
    // row that looks like a landed beat is never read back as one.
    repo.expect_heartbeat().returning(|_| Err(unavailable()));
    repo.expect_beat_landed().never();
    let released: Arc<Mutex<Vec<Fence>>> = Arc::default();
    let r = Arc::clone(&released);
    let mut seq = mockall::Sequence::new();
    // The first release lands, its reply lost; the row is then another worker's claim.
    repo.expect_release_claim()
        .times(1)
        .in_sequence(&mut seq)
        .returning(move |fence, _| {
            r.lock().unwrap().push(fence);
            Err(unavailable())
        });
    let r = Arc::clone(&released);
    repo.expect_release_claim()
        .in_sequence(&mut seq)
        .returning(move |fence, _| {
            r.lock().unwrap().push(fence);
            Ok(if fence == theirs {
                FenceOutcome::Written
            } else {
                FenceOutcome::Lost
            })
        });
    repo.expect_get_event().returning(move |id| {
        let mut claimed = row(id, EventStatus::Processing, 0);
        claimed.last_modified_date = theirs.last_written;
        Ok(Some(claimed))
    });
    let (outcome, _) = run(
        repo,
        handlers(Duration::ZERO, || Ok(())),
        c,
        CancellationToken::new(),
    )
    .await;
    let released = released.lock().unwrap().clone();
    assert!(
        released.iter().all(|fence| *fence == ours),
        "a release used another worker's fence: {released:?}"
    );
    // The row still carries the claim's `RetryCount` (another worker's fresh claim keeps it; a
    // reclaim would have counted one more): the first release landed, so the event was
    // released, never a lost claim.
    assert_eq!(outcome, AttemptOutcome::Released);
}

/// A handler failed on a claim at `count`; the attempt's `COMMIT` (with the retry in it)
/// failed without landing, and so did the detached retry's first try; meanwhile a beat's
/// `COMMIT` got no answer, and the row reads back `processing` at the same count under the
/// value that beat wrote. `landed`: whether that row version is the beat's own (the
/// repository's `beat_landed`), or another transaction's look-alike. Returns the outcome, the
/// fences the detached retry was written under, and the beat's value.
async fn counted_outcome_then_an_unsure_beat(
    count: i32,
    landed: bool,
) -> (AttemptOutcome, Vec<Fence>, Fence) {
    let c = claim("t", count);
    let ours = c.fence;
    let beat = Fence {
        id: c.fence.id,
        last_written: c.fence.last_written + chrono::Duration::milliseconds(500),
    };
    let mut attempt = MockAttempt::new();
    attempt.expect_rollback_to_savepoint().returning(|| Ok(()));
    attempt
        .expect_record_failure()
        .withf(|_, bookkeeping, _| matches!(bookkeeping, FailureBookkeeping::Retry { .. }))
        .returning(|_, _, _| Ok(FenceOutcome::Written));
    attempt.expect_commit().returning(|| Err(unavailable()));
    attempt.expect_rollback().returning(|| Ok(()));
    let mut repo = mock_repo();
    repo.expect_begin_attempt()
        .times(1)
        .return_once(move |_, _| Ok(Some(Box::new(attempt) as Box<dyn Attempt>)));
    // Under the claim's fence: the first beat's `COMMIT` gets no answer, later ones find the
    // row moved on; under the beat's value, beats land.
    let unsure_sent = Arc::new(std::sync::atomic::AtomicBool::new(false));
    repo.expect_heartbeat().returning(move |fence| {
        Ok(if fence == beat && landed {
            BeatOutcome::Beaten(fence)
        } else if fence == ours && !unsure_sent.swap(true, std::sync::atomic::Ordering::SeqCst) {
            BeatOutcome::Unsure {
                written: beat,
                writer: 7,
            }
        } else {
            BeatOutcome::Lost
        })
    });
    repo.expect_beat_landed()
        .withf(move |written, writer| *written == beat && *writer == 7)
        .returning(move |_, _| Ok(landed));
    repo.expect_get_event().returning(move |id| {
        let mut look_alike = row(id, EventStatus::Processing, count);
        look_alike.last_modified_date = beat.last_written;
        Ok(Some(look_alike))
    });
    let written: Arc<Mutex<Vec<Fence>>> = Arc::default();
    let w = Arc::clone(&written);
    repo.expect_increment_retry().returning(move |fence, _, _| {
        let mut w = w.lock().unwrap();
        w.push(fence);
        if w.len() == 1 {
            return Err(unavailable());
        }
        Ok(if fence == beat && landed {
            FenceOutcome::Written
        } else {
            FenceOutcome::Lost
        })
    });
    let (outcome, _) = run(
        repo,
        handlers(Duration::ZERO, || {
            Err(HandlerError::Retryable("boom".into()))
        }),
        c,
        CancellationToken::new(),
    )
    .await;
    let written = written.lock().unwrap().clone();
    (outcome, written, beat)
}

/// After a counted outcome was sent (it may have landed, its reply lost), a beat whose
/// `COMMIT` got no answer and landed is still this worker's claim, at any count: the read-back
/// names the row version the beat wrote, so the retry is written under the beat's value and
/// the failure is counted, not reported as a lost claim (seed 35's PgBouncer label). A
/// look-alike of the same values written by another transaction (another worker's fresh claim
/// after an operator's retry reset the count, finding 4 of the batched-attempts review) is
/// never adopted: the claim is reported lost and nothing is written under that value.
#[tokio::test(start_paused = true)]
async fn an_unsure_beat_is_adopted_only_when_its_own_version_is_read_back() {
    for count in [0, 1] {
        let (outcome, written, beat) = counted_outcome_then_an_unsure_beat(count, true).await;
        assert_eq!(
            outcome,
            AttemptOutcome::Retried,
            "count {count}: {written:?}"
        );
        assert_eq!(written.last(), Some(&beat), "count {count}: {written:?}");
        let (outcome, written, beat) = counted_outcome_then_an_unsure_beat(count, false).await;
        assert_eq!(
            outcome,
            AttemptOutcome::LostClaim,
            "count {count}: {written:?}"
        );
        assert!(!written.contains(&beat), "count {count}: {written:?}");
    }
}

/// Finding 2: rows reclaimed together from a dead worker run in attempts of their own; when
/// the first one's handler runs long, the others are given back (uncounted, on the side) at
/// once for idle workers instead of waiting for it in this worker, one after another.
#[tokio::test(start_paused = true)]
async fn a_long_handler_gives_back_its_workers_reclaimed_rows() {
    let mut claims = batch_claims(3);
    for c in &mut claims {
        c.reclaimed = true;
        c.event.retry_count = 1;
    }
    let first = claims[0].fence;
    let others: Vec<Fence> = claims[1..].iter().map(|c| c.fence).collect();
    let mut repo = mock_repo();
    beats_land(&mut repo);
    let started = tokio::time::Instant::now();
    let given_back: Arc<Mutex<Vec<(Fence, Duration)>>> = Arc::default();
    let g = Arc::clone(&given_back);
    repo.expect_release_claim()
        .times(2)
        .returning(move |fence, why| {
            assert!(why.contains("ran long"), "{why}");
            g.lock().unwrap().push((fence, started.elapsed()));
            Ok(FenceOutcome::Written)
        });
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed()
        .times(1)
        .withf(move |fence| fence.id == first.id)
        .returning(|_| Ok(FenceOutcome::Written));
    attempt.expect_commit().times(1).returning(|| Ok(()));
    repo.expect_begin_attempt()
        .times(1)
        .return_once(move |_, _| Ok(Some(Box::new(attempt) as Box<dyn Attempt>)));
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::from_secs(30), || Ok(())),
        config(),
    );
    let (_, ran) = runner.run_batch(claims).await;
    assert_eq!(ran, 1, "only the first handler ran here");
    let given_back = given_back.lock().unwrap().clone();
    assert_eq!(
        given_back.iter().map(|(f, _)| *f).collect::<Vec<_>>(),
        others
    );
    assert!(
        given_back
            .iter()
            .all(|(_, at)| *at < Duration::from_secs(1)),
        "given back within a heartbeat interval of the slow handler's start: {given_back:?}"
    );
    let metrics = runner.metrics().snapshot();
    assert_eq!((metrics.processed, metrics.not_run), (1, 2), "{metrics:?}");
}

/// A long handler's give-back pass that stops part way (a release retried on the side ends
/// it) can give back a record's row and leave the record's later row claimed by the worker
/// (here in the worker's next batch, of two events each): that later row must not run before
/// the row given back. It is given back too, unrun.
#[tokio::test(start_paused = true)]
async fn a_record_s_later_claim_is_given_back_with_a_row_a_long_handler_gave_back() {
    let mut claims = batch_claims(4);
    for c in &mut claims[2..] {
        c.event.record_key = Some(outbox_persistence::RecordKey::from_stored("Lead:R"));
    }
    let (first, other, older, later) = (
        claims[0].fence,
        claims[1].fence,
        claims[2].fence,
        claims[3].fence,
    );
    let mut repo = mock_repo();
    beats_land(&mut repo);
    repo.expect_release_claim()
        .withf(move |fence, _| fence.id == other.id)
        .returning(|_, _| Ok(FenceOutcome::Written));
    // The older row's release: its first try's reply is lost and no beat confirms the claim,
    // so it is settled on the side (retried), which ends the pass before the later row.
    let tries = Arc::new(Mutex::new(0));
    let t = Arc::clone(&tries);
    repo.expect_release_claim()
        .withf(move |fence, _| fence.id == older.id)
        .returning(move |_, _| {
            let mut tries = t.lock().unwrap();
            *tries += 1;
            if *tries == 1 {
                Err(unavailable())
            } else {
                Ok(FenceOutcome::Lost)
            }
        });
    repo.expect_heartbeat().returning(|_| Err(unavailable()));
    repo.expect_get_event()
        .returning(|id| Ok(Some(row(id, EventStatus::Pending, 0))));
    // The first batch: the long handler's event written `processed`.
    let mut first_batch = MockAttempt::new();
    first_batch
        .expect_mark_processed()
        .times(1)
        .withf(move |fence| fence.id == first.id)
        .returning(|_| Ok(FenceOutcome::Written));
    first_batch.expect_commit().times(1).returning(|| Ok(()));
    // The second: the later row given back unrun.
    let mut second_batch = MockAttempt::new();
    second_batch
        .expect_release()
        .times(1)
        .withf(move |fence, why| fence.id == later.id && why.contains("older event of its record"))
        .returning(|_, _| Ok(FenceOutcome::Written));
    second_batch.expect_commit().times(1).returning(|| Ok(()));
    let attempts = Mutex::new(vec![second_batch, first_batch]);
    repo.expect_begin_batch_attempt()
        .times(2)
        .returning(move |_, _| {
            let attempt = attempts.lock().unwrap().pop().unwrap();
            Ok((Box::new(attempt) as Box<dyn Attempt>, Vec::new()))
        });
    let config = config().with_batches(2, Duration::from_millis(10));
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::from_secs(30), || Ok(())),
        config,
    );
    let (_, ran) = runner.run_batch(claims).await;
    assert_eq!(ran, 1, "only the first handler ran");
    assert!(
        *tries.lock().unwrap() >= 2,
        "the older row's release was retried"
    );
    let metrics = runner.metrics().snapshot();
    assert_eq!(metrics.processed, 1, "{metrics:?}");
}

/// Finding 5: a graceful stop while an attempt cannot begin (the database is away) gives the
/// claim back uncounted at once instead of retrying past the shutdown.
#[tokio::test(start_paused = true)]
async fn a_graceful_stop_while_beginning_gives_the_claim_back() {
    let mut repo = mock_repo();
    repo.expect_begin_attempt()
        .returning(|_, _| Err(unavailable()));
    repo.expect_heartbeat()
        .returning(|fence: Fence| Ok(BeatOutcome::Beaten(fence)));
    repo.expect_release_claim().times(1).returning(|_, why| {
        assert!(why.contains("shutting down"), "{why}");
        Ok(FenceOutcome::Written)
    });
    let stop = CancellationToken::new();
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::ZERO, || Ok(())),
        config(),
    )
    .with_stop(stop.clone());
    let started = tokio::time::Instant::now();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.cancel();
    });
    let outcome = runner.run(claim("t", 0)).await;
    assert_eq!(outcome, AttemptOutcome::NotRun);
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// A batch's COMMIT whose reply was lost after it landed (the fault suite's reply-loss proxy):
/// the rows it wrote `processed` read back as processed, and the claim it gave back in the
/// transaction (here one the begin found waiting for an older row) reads back `pending` with
/// its own `RetryCount`, so its release on the side, which finds the claim gone, reports it
/// given back, never a lost claim.
#[tokio::test(start_paused = true)]
async fn a_release_whose_commit_landed_despite_an_error_is_not_a_lost_claim() {
    let claims = batch_claims(3);
    let given_back = claims[1].fence;
    let mut repo = mock_repo();
    beats_land(&mut repo);
    repo.expect_release_claim()
        .times(1)
        .withf(move |fence, _| *fence == given_back)
        .returning(|_, _| Ok(FenceOutcome::Lost));
    repo.expect_increment_retry().never();
    repo.expect_get_event().returning(move |id| {
        let status = if id == given_back.id {
            EventStatus::Pending
        } else {
            EventStatus::Processed
        };
        Ok(Some(row(id, status, 0)))
    });
    let mut attempt = MockAttempt::new();
    attempt
        .expect_release()
        .times(1)
        .withf(move |fence, _| *fence == given_back)
        .returning(|_, _| Ok(FenceOutcome::Written));
    attempt
        .expect_mark_processed_many()
        .times(1)
        .returning(|fences| Ok(vec![FenceOutcome::Written; fences.len()]));
    attempt
        .expect_commit()
        .times(1)
        .returning(|| Err(unavailable()));
    repo.expect_begin_batch_attempt()
        .times(1)
        .return_once(move |_, _| Ok((Box::new(attempt) as Box<dyn Attempt>, vec![given_back.id])));
    let config = config().with_batches(32, Duration::from_secs(60));
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::from_millis(1), || Ok(())),
        config,
    );
    runner.run_batch(claims).await;
    let metrics = runner.metrics().snapshot();
    assert_eq!(
        (metrics.processed, metrics.not_run, metrics.lost_claims),
        (2, 1, 0),
        "{metrics:?}"
    );
}

/// A release on the side whose COMMIT reply was lost (the fault suite's reply-loss proxy)
/// landed: its retry finds the claim gone, and the row read back still carries the claim's
/// `RetryCount` (a reclaim would have counted one more), so the event was released, not lost.
#[tokio::test(start_paused = true)]
async fn a_release_retried_after_its_reply_was_lost_is_not_a_lost_claim() {
    let claims = batch_claims(2);
    let tries: Arc<Mutex<std::collections::HashMap<outbox_persistence::EventId, u32>>> =
        Arc::default();
    let mut repo = mock_repo();
    beats_land(&mut repo);
    let t = Arc::clone(&tries);
    repo.expect_release_claim().returning(move |fence, _| {
        let mut tries = t.lock().unwrap();
        let n = tries.entry(fence.id).or_default();
        *n += 1;
        // The first try lands with its reply lost; the second finds the row released.
        if *n == 1 {
            Err(unavailable())
        } else {
            Ok(FenceOutcome::Lost)
        }
    });
    repo.expect_get_event()
        .returning(|id| Ok(Some(row(id, EventStatus::Pending, 0))));
    let mut attempt = MockAttempt::new();
    attempt
        .expect_mark_processed_many()
        .times(1)
        .returning(|_| Err(lock_timeout()));
    attempt.expect_rollback().times(1).returning(|| Ok(()));
    repo.expect_begin_batch_attempt()
        .times(1)
        .return_once(move |_, _| Ok((Box::new(attempt) as Box<dyn Attempt>, Vec::new())));
    let config = config().with_batches(32, Duration::from_secs(60));
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::from_millis(1), || Ok(())),
        config,
    );
    runner.run_batch(claims).await;
    let metrics = runner.metrics().snapshot();
    assert_eq!(
        (metrics.released, metrics.lost_claims),
        (2, 0),
        "{metrics:?}"
    );
    assert!(tries.lock().unwrap().values().all(|n| *n == 2));
}

/// The failure bookkeeping's commit reported an error but landed, and another worker claimed
/// the retried row at once (a short retry delay): the row reads back `processing` under that
/// claim with one more failure counted and this attempt's error. That is this attempt's retry,
/// not a lost claim; a stale reclaim (whose `LastError` says the worker died) would not be.
#[tokio::test(start_paused = true)]
async fn a_retry_that_landed_and_was_claimed_again_is_not_a_lost_claim() {
    let mut attempt = MockAttempt::new();
    attempt
        .expect_rollback_to_savepoint()
        .times(1)
        .returning(|| Ok(()));
    let recorded: Arc<Mutex<String>> = Arc::default();
    let r = Arc::clone(&recorded);
    attempt
        .expect_record_failure()
        .times(1)
        .returning(move |_, _, error| {
            *r.lock().unwrap() = error.to_string();
            Ok(FenceOutcome::Written)
        });
    attempt
        .expect_commit()
        .times(1)
        .returning(|| Err(unavailable()));
    attempt.expect_rollback().returning(|| Ok(()));
    let mut repo = repo_with(attempt, Arc::default());
    repo.expect_get_event().returning(move |id| {
        let mut claimed = row(id, EventStatus::Processing, 1);
        claimed.last_error = Some(recorded.lock().unwrap().clone());
        Ok(Some(claimed))
    });
    repo.expect_increment_retry().never();
    let (outcome, metrics) = run(
        repo,
        handlers(Duration::ZERO, || {
            Err(HandlerError::Retryable("boom".into()))
        }),
        claim("t", 0),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(outcome, AttemptOutcome::Retried);
    assert_eq!(metrics.snapshot().lost_claims, 0);
}

/// Issue 36 review: a give-back whose release failed may still land (its reply lost, or a
/// commit in doubt), so the worker keeps the claim only once a fenced beat confirms it; it
/// then runs it under the fence that beat wrote (the old release can no longer apply).
#[tokio::test(start_paused = true)]
async fn a_give_back_that_failed_is_confirmed_by_a_beat_before_the_worker_keeps_it() {
    let mut claims = batch_claims(3);
    for c in &mut claims {
        c.reclaimed = true;
        c.event.retry_count = 1;
    }
    let kept = claims[1].fence;
    let confirmed = Fence {
        id: kept.id,
        last_written: kept.last_written + chrono::Duration::seconds(1),
    };
    let mut repo = mock_repo();
    beats_land(&mut repo);
    repo.expect_heartbeat()
        .times(1)
        .withf(move |fence| *fence == kept)
        .returning(move |_| Ok(BeatOutcome::Beaten(confirmed)));
    let releases = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let r = Arc::clone(&releases);
    repo.expect_release_claim().returning(move |fence, _| {
        let n = r.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n == 0 {
            assert_eq!(fence, kept);
            Err(unavailable())
        } else {
            Ok(FenceOutcome::Written)
        }
    });
    let begun: Arc<Mutex<Vec<Fence>>> = Arc::default();
    let b = Arc::clone(&begun);
    repo.expect_begin_attempt().returning(move |_, fence| {
        b.lock().unwrap().push(fence);
        let mut attempt = MockAttempt::new();
        attempt
            .expect_mark_processed()
            .returning(|_| Ok(FenceOutcome::Written));
        attempt.expect_commit().returning(|| Ok(()));
        Ok(Some(Box::new(attempt) as Box<dyn Attempt>))
    });
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::from_secs(30), || Ok(())),
        config(),
    );
    runner.run_batch(claims.clone()).await;
    let begun = begun.lock().unwrap().clone();
    assert_eq!(
        begun,
        vec![claims[0].fence, confirmed],
        "the kept claim runs under the fence its confirming beat wrote"
    );
    let metrics = runner.metrics().snapshot();
    assert_eq!(
        (metrics.processed, metrics.not_run, metrics.lost_claims),
        (2, 1, 0),
        "{metrics:?}"
    );
}

/// A claim found gone after its release reported an error: the row still carrying the claim's
/// `RetryCount`, or one more with another attempt's error, was released by it; one more with a
/// stale reclaim's error was lost to a reclaim. A processed row one count on was the release's
/// (another worker failed once, then finished it) only when it was written sooner after the
/// claim's last write than a reclaim could have taken it, and only where the database dates
/// every write.
#[test]
fn a_release_that_landed_is_told_from_a_reclaim() {
    use crate::detached::{Held, released_by_us};
    let id = outbox_persistence::new_event_id();
    let mut r = row(id, EventStatus::Processing, 0);
    let ours = Held {
        count: 0,
        written: r.last_modified_date,
        stale_after: Duration::from_secs(10),
        dated_by_the_database: true,
    };
    assert!(released_by_us(&r, ours), "claimed afresh after the release");
    r.retry_count = 1;
    r.last_error = Some("retryable: the next attempt failed".into());
    assert!(released_by_us(&r, ours), "the next worker's attempt failed");
    r.last_error = Some(format!(
        "{} attempt 1 stopped heartbeating",
        outbox_persistence::WORKER_DIED
    ));
    assert!(!released_by_us(&r, ours), "a stale reclaim");
    let mut done = row(id, EventStatus::Processed, 1);
    done.last_error = None;
    done.last_modified_date = ours.written + chrono::Duration::seconds(11);
    assert!(!released_by_us(&done, ours), "reclaimed, then processed");
    done.last_modified_date = ours.written + chrono::Duration::milliseconds(150);
    assert!(
        released_by_us(&done, ours),
        "failed once and finished by others before any reclaim could have happened"
    );
    let sqlite = Held {
        dated_by_the_database: false,
        ..ours
    };
    assert!(
        !released_by_us(&done, sqlite),
        "a reclaim on SQLite is dated by its host's clock"
    );
}

/// A graceful stop while a batch's begin retries (on SQLite, another process holds the
/// writer): its members are given back one by one, each release retried after a failure, and
/// the group's beat runs between them. It never sends the spent fence of a member already
/// released: that member's beat stops before its fence is let go (it used to keep beating
/// until the batch ended, and each such beat logged the claim lost).
#[tokio::test(start_paused = true)]
async fn a_batch_given_back_at_a_stop_never_beats_a_released_claim() {
    let mut repo = serialized_mock_repo();
    repo.expect_begin_batch_attempt()
        .returning(|_, _| Err(unavailable()));
    let released: Arc<Mutex<Vec<outbox_persistence::EventId>>> = Arc::default();
    let tries: Arc<Mutex<Vec<outbox_persistence::EventId>>> = Arc::default();
    let (r, t) = (Arc::clone(&released), Arc::clone(&tries));
    repo.expect_release_claim()
        .returning(move |fence: Fence, _| {
            let mut tries = t.lock().unwrap();
            let first = !tries.contains(&fence.id);
            tries.push(fence.id);
            if first {
                // Fails once (the writer is busy): the release backs off, and the group beats.
                return Err(unavailable());
            }
            r.lock().unwrap().push(fence.id);
            Ok(FenceOutcome::Written)
        });
    let stale: Arc<Mutex<Vec<Fence>>> = Arc::default();
    let (r, s) = (Arc::clone(&released), Arc::clone(&stale));
    repo.expect_heartbeat_many()
        .returning(move |fences: Vec<Fence>| {
            let released = r.lock().unwrap();
            Ok(fences
                .into_iter()
                .map(|f| {
                    if released.contains(&f.id) {
                        s.lock().unwrap().push(f);
                        BeatOutcome::Lost
                    } else {
                        BeatOutcome::Beaten(Fence {
                            id: f.id,
                            last_written: f.last_written + chrono::Duration::microseconds(1),
                        })
                    }
                })
                .collect())
        });
    let stop = CancellationToken::new();
    let runner = ClaimRunner::new(
        Arc::new(repo),
        handlers(Duration::ZERO, || Ok(())),
        config(),
    )
    .with_stop(stop.clone());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.cancel();
    });
    let (_, ran) = runner.run_batch(batch_claims(4)).await;
    assert_eq!(ran, 0);
    assert_eq!(released.lock().unwrap().len(), 4, "every member given back");
    assert!(
        stale.lock().unwrap().is_empty(),
        "a released claim was beaten under its spent fence: {:?}",
        stale.lock().unwrap()
    );
    let metrics = runner.metrics().snapshot();
    assert_eq!(
        (metrics.not_run, metrics.lost_claims),
        (4, 0),
        "{metrics:?}"
    );
}
