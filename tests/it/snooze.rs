//! Snoozes (`HandlerError::snooze`): a handler that asks to be run later puts its row back
//! `pending` without counting the attempt, not eligible before the delay, its record's later
//! rows waiting behind it; on both backends, in the attempt and on the detached path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, DispatchMode, Dispatcher, Handler, HandlerError, Handlers, OutboxEvent,
    WorkerConfig,
};
use outbox_persistence::{
    ClaimPolicy, EventStatus, FailureBookkeeping, FenceOutcome, NewEvent, Scope, Terminal,
};
use outbox_tests::{TestDb, backend_tests, drain};

use crate::repository::{enqueue, lead};

fn policy() -> ClaimPolicy {
    ClaimPolicy::new(Duration::from_secs(30), Duration::from_secs(10), 2)
}

/// The repository's half: the attempt's snooze and the detached one write `pending` with the
/// count unchanged and the message, keep the row (and its record's later rows) from every claim
/// until the delay has passed, and are fenced.
async fn a_snooze_waits_uncounted_and_holds_its_record(db: TestDb) {
    let repo = db.repository();
    let ids = enqueue(
        &repo,
        &[
            NewEvent::new("t", lead("S")),
            NewEvent::new("t", lead("S")),
            NewEvent::new("t", lead("T")),
        ],
    )
    .await;
    let claim = repo.claim_event(ids[0], policy()).await.unwrap().unwrap();
    let mut attempt = repo
        .begin_attempt(Duration::from_secs(5), claim.fence)
        .await
        .unwrap()
        .expect("the claim holds");
    let snooze = FailureBookkeeping::Snooze {
        delay: Duration::from_secs(60),
    };
    assert_eq!(
        attempt
            .record_failure(claim.fence, snooze, "busy")
            .await
            .unwrap(),
        FenceOutcome::Written
    );
    attempt.commit().await.unwrap();
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.retry_count, row.last_error.as_deref()),
        (EventStatus::Pending, 0, Some("snoozed for 60s: busy"))
    );
    let key = row.record_key.clone().expect("keyed");
    let report = outbox_persistence::key_report(repo.as_ref(), key.as_str(), policy())
        .await
        .unwrap();
    let said = report.head.expect("a head").describe();
    assert!(said.starts_with("snoozed until"), "{said}");
    // Only the other record's row may run: the snoozed row is not due, its successor waits.
    let other = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(other.event.id, ids[2]);
    repo.update_status(other.fence, Terminal::Processed, None)
        .await
        .unwrap();
    assert!(
        repo.claim_next(policy(), &Scope::All)
            .await
            .unwrap()
            .is_none()
    );
    db.clock.advance(Duration::from_secs(59));
    assert!(
        repo.claim_next(policy(), &Scope::All)
            .await
            .unwrap()
            .is_none(),
        "not before its delay"
    );
    db.clock.advance(Duration::from_secs(2));
    let again = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((again.event.id, again.event.retry_count), (ids[0], 0));

    // Detached, on a connection of its own: the same, fenced.
    assert_eq!(
        repo.snooze_claim(again.fence, Duration::from_secs(60), "later")
            .await
            .unwrap(),
        FenceOutcome::Written
    );
    let row = repo.get_event(ids[0]).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.retry_count, row.last_error.as_deref()),
        (EventStatus::Pending, 0, Some("snoozed for 60s: later"))
    );
    assert_eq!(
        repo.snooze_claim(again.fence, Duration::from_secs(60), "twice")
            .await
            .unwrap(),
        FenceOutcome::Lost,
        "a snooze of a claim that is gone writes nothing"
    );
    assert!(
        repo.claim_next(policy(), &Scope::All)
            .await
            .unwrap()
            .is_none()
    );
    db.clock.advance(Duration::from_secs(61));
    let last = repo
        .claim_next(policy(), &Scope::All)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((last.event.id, last.event.retry_count), (ids[0], 0));
}

/// Snoozes each event [`SNOOZES`] times, then succeeds; keeps when each attempt began and the
/// order in which each record's events succeeded.
struct Snoozy {
    attempts: Arc<Mutex<HashMap<uuid::Uuid, Vec<Instant>>>>,
    done: Arc<Mutex<HashMap<String, Vec<uuid::Uuid>>>>,
    /// Events that fail (retryable, counted) at their first attempt before they snooze.
    fail_first: Vec<uuid::Uuid>,
}

const SNOOZES: usize = 2;
const SNOOZE: Duration = Duration::from_millis(300);

#[async_trait]
impl Handler for Snoozy {
    async fn handle(
        &self,
        event: &OutboxEvent,
        _ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let runs = {
            let mut attempts = self.attempts.lock().unwrap();
            let runs = attempts.entry(event.id).or_default();
            runs.push(Instant::now());
            runs.len()
        };
        let failing = usize::from(self.fail_first.contains(&event.id));
        if runs <= failing {
            return Err(HandlerError::Retryable("once".into()));
        }
        if runs <= failing + SNOOZES {
            return Err(HandlerError::snooze(SNOOZE, "not yet"));
        }
        let key = event.record_key.as_ref().unwrap().as_str().to_string();
        self.done
            .lock()
            .unwrap()
            .entry(key)
            .or_default()
            .push(event.id);
        Ok(())
    }
}

/// Pull workers: every event snoozes twice with `MaxRetryAttempts` at 2 (counted snoozes would
/// end them `failed`), each attempt at least the snooze's delay after the last, and every
/// record's events succeed in their order. An event that failed once waits out the retry delay
/// and its snooze, and keeps its one failure.
async fn snoozed_events_run_later_in_order_and_uncounted(db: TestDb) {
    let repo = db.repository();
    let events: Vec<NewEvent> = (0..20)
        .map(|i| NewEvent::new("snoozy", lead(&format!("R{}", i % 4))))
        .collect();
    let ids = enqueue(&repo, &events).await;
    let handler = Snoozy {
        attempts: Arc::default(),
        done: Arc::default(),
        fail_first: vec![ids[5]],
    };
    let (attempts, done) = (handler.attempts.clone(), handler.done.clone());
    let config = WorkerConfig::default()
        .with_mode(DispatchMode::Pull)
        .dangerously_skip_rollout_gate("a test of snoozes with an undeclared handler")
        .with_workers(4)
        .with_poll_interval(Duration::from_millis(50))
        .with_retry_delay(Duration::from_millis(400))
        .with_max_retry_delay(Duration::from_millis(400))
        .with_max_retry_attempts(2)
        .with_lock_timeout(Duration::from_millis(500));
    let dispatcher = Dispatcher::new(
        repo.clone(),
        Handlers::new().register("snoozy", handler),
        config,
    )
    .start()
    .await
    .unwrap();
    drain(&repo, Duration::from_secs(60)).await;
    let report = dispatcher.shutdown().await;
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'")
            .await,
        20
    );
    assert_eq!(
        db.count("SELECT count(*) FROM _System_OutboxEvent WHERE RetryCount > 0")
            .await,
        1,
        "only the failure is counted"
    );
    let m = report.metrics;
    assert_eq!(m.retried, 1);
    // A handler run again without a wait: a segment given back at its settle (a lock timeout
    // on a loaded machine) or a lost claim. Then the counts and gaps below are not exact.
    let reruns = m.not_run + m.released + m.lost_claims;
    assert!(m.snoozed >= 20 * SNOOZES as u64, "{m:?}");
    let attempts = attempts.lock().unwrap().clone();
    for (id, runs) in &attempts {
        let expected = SNOOZES + 1 + usize::from(*id == ids[5]);
        assert!(runs.len() >= expected, "{id}: {runs:?}");
        for pair in runs.windows(2) {
            let gap = pair[1] - pair[0];
            // The failed attempt waits the retry delay (400 ms); a snooze of a row that failed
            // before waits the longer of its delay and the retry delay (400 ms) too.
            assert!(
                gap >= SNOOZE - Duration::from_millis(20) || reruns > 0,
                "{id}: an attempt {gap:?} after the one before ({m:?})"
            );
        }
    }
    if reruns == 0 {
        assert_eq!(m.snoozed, 20 * SNOOZES as u64);
        let failed_once = &attempts[&ids[5]];
        assert!(
            failed_once[2] - failed_once[1] >= Duration::from_millis(380),
            "a snooze after a failure waits out the retry delay too: {:?}",
            failed_once[2] - failed_once[1]
        );
    }
    let done = done.lock().unwrap().clone();
    for r in 0..4 {
        let key = format!("Lead:R{r}");
        let expected: Vec<uuid::Uuid> = ids.iter().skip(r).step_by(4).copied().collect();
        let ran = done
            .iter()
            .find(|(k, _)| k.ends_with(&format!("R{r}")))
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("{key}: no event ran"));
        assert_eq!(ran, expected, "{key}: events succeeded out of order");
    }
}

backend_tests!(
    a_snooze_waits_uncounted_and_holds_its_record,
    snoozed_events_run_later_in_order_and_uncounted,
);
