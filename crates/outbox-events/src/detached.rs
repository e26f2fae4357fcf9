//! The attempt's bookkeeping on connections of its own, once its transaction is gone or
//! could not record the outcome: the detached failure bookkeeping and the uncounted release,
//! each retried while the heartbeat keeps the claim alive.

use std::time::Duration;

use outbox_persistence::{
    Attempt, Claim, EffectRecord, EventId, EventStatus, FailureBookkeeping, FenceOutcome, Terminal,
    clip_error,
};

use crate::env::{AttemptEnv, AttemptOutcome, Failure, failure_outcome};
use crate::heartbeat::{Beat, READ_BACK_FIRST_BACKOFF, READ_BACK_MAX_BACKOFF, READ_BACK_TRIES};

/// Releases the claim without counting the attempt (see [`AttemptOutcome::Released`]), on a
/// connection of its own, retried while the heartbeat keeps the claim alive as the detached
/// bookkeeping is.
pub(crate) async fn release(env: &AttemptEnv, beat: &Beat<'_>, message: &str) -> AttemptOutcome {
    release_from(env, beat, message, false).await
}

/// [`release`] after a release of the claim that failed and may have landed (`unsure`): a
/// claim found gone is then read back from the first try on.
pub(crate) async fn release_from(
    env: &AttemptEnv,
    beat: &Beat<'_>,
    message: &str,
    unsure: bool,
) -> AttemptOutcome {
    beat.ensure_running(true);
    let (fence, lost) = (beat.fence.clone(), beat.lost.clone());
    let (id, ours) = {
        let state = fence.lock().await;
        (
            state.fence.id,
            Held::new(env, state.retry_count(), state.fence.last_written),
        )
    };
    // A try that failed may have landed with its reply lost: the claim then turns out gone,
    // and the row read back tells whether this release took it.
    let mut unsure = unsure;
    let mut backoff = DETACHED_FIRST_BACKOFF;
    for try_number in 1..=DETACHED_MAX_TRIES {
        {
            let state = fence.lock_for_write(&env.repo).await;
            if state.lost {
                return released_or_lost(env, id, ours, unsure).await;
            }
            match env.repo.release_claim(state.fence, message).await {
                Ok(FenceOutcome::Written) => {
                    // The row is no longer this worker's: its beat stops before the fence is
                    // let go (a group's beat taken after would send the spent fence and log
                    // the claim lost).
                    beat.stop();
                    return AttemptOutcome::Released;
                }
                Ok(FenceOutcome::Lost) => {
                    drop(state);
                    return released_or_lost(env, id, ours, unsure).await;
                }
                Err(e) => {
                    unsure = true;
                    tracing::warn!(
                        error = %e.chain(),
                        try_number,
                        "releasing the claim failed; the heartbeat keeps it while it retries"
                    )
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = lost.cancelled() => return released_or_lost(env, id, ours, unsure).await,
            _ = env.hard_stop.cancelled() => return AttemptOutcome::Cancelled,
        }
        backoff = (backoff * 2).min(DETACHED_MAX_BACKOFF);
    }
    tracing::error!("giving up on releasing the claim; the row goes stale and will be reclaimed");
    AttemptOutcome::Abandoned
}

/// The claim `id` (`RetryCount` `ours`) turned out gone during its release: when an earlier try
/// failed (`unsure`: it may have landed with its reply lost), a row that still carries `ours`
/// was released by that try (a reclaim always counts one more; another worker's fresh claim of
/// the released row keeps it), so the release landed. Otherwise the claim was lost.
async fn released_or_lost(
    env: &AttemptEnv,
    id: EventId,
    ours: Held,
    unsure: bool,
) -> AttemptOutcome {
    if !unsure {
        return AttemptOutcome::LostClaim;
    }
    match read_back(env, id).await {
        Some(row) if released_by_us(&row, ours) => {
            tracing::info!("a release that reported an error had landed");
            AttemptOutcome::Released
        }
        _ => AttemptOutcome::LostClaim,
    }
}

/// What a worker knows of a claim it holds when it reads the row back: its `RetryCount`, the
/// last value it wrote (`LastModifiedDate`), and what a reclaim would need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held {
    pub(crate) count: i32,
    pub(crate) written: chrono::DateTime<chrono::Utc>,
    pub(crate) stale_after: Duration,
    /// Every timestamp is the database's (PostgreSQL). On SQLite a reclaim is judged by
    /// monotonic observation and dated by the reclaiming host's clock, which may run behind.
    pub(crate) dated_by_the_database: bool,
}

impl Held {
    pub(crate) fn new(
        env: &AttemptEnv,
        count: i32,
        written: chrono::DateTime<chrono::Utc>,
    ) -> Self {
        Self {
            count,
            written,
            stale_after: env.config.stale_after,
            dated_by_the_database: !env.repo.serializes_writers(),
        }
    }
}

/// Whether `row`, found no longer under a claim held as `ours`, shows that claim's own release
/// landed: the count is still ours (a release keeps it, and so does another worker's fresh
/// claim of the released row), or one more that no reclaim made ([`not_a_reclaims_count`]:
/// another worker's attempt of the released row failed).
pub(crate) fn released_by_us(row: &outbox_persistence::OutboxEvent, ours: Held) -> bool {
    row.retry_count == ours.count
        || row.retry_count == ours.count + 1 && not_a_reclaims_count(row, ours)
}

/// Whether `row`, one count past the claim held as `ours`, got that count from something other
/// than a stale reclaim of the claim: its error is not a reclaim's (a reclaim counts with
/// `worker died: …`, which a give-back keeps; any other error is an attempt's, or a fresh
/// claim's give-back); or, where the database dates every write, it is `processed` (which
/// clears the error) sooner after the claim's last write than any reclaim could have taken it:
/// a reclaim needs the claim silent for `stale_after` on the database's clock first, and the
/// `processed` write comes after it (writes only move `LastModifiedDate` forward). On SQLite
/// such a row stays a reclaim's.
fn not_a_reclaims_count(row: &outbox_persistence::OutboxEvent, ours: Held) -> bool {
    match row.last_error.as_deref() {
        Some(error) => !error.starts_with(outbox_persistence::WORKER_DIED),
        None => {
            ours.dated_by_the_database
                && row.status == EventStatus::Processed
                && chrono::Duration::from_std(ours.stale_after)
                    .ok()
                    .and_then(|stale| ours.written.checked_add_signed(stale))
                    .is_some_and(|reclaimable| row.last_modified_date < reclaimable)
        }
    }
}

/// The row `id`, read back after a write whose reply may have been lost: tried for a few
/// seconds, since the read can meet the same flaky connection, a server coming back from a
/// restart, or a pooler refusing logins meanwhile (PgBouncer's `server_login_retry`); `None`
/// when it is gone or stays unreadable (then the claim is reported lost: the label is the only
/// thing at stake, nothing is written on it).
async fn read_back(env: &AttemptEnv, id: EventId) -> Option<outbox_persistence::OutboxEvent> {
    let mut backoff = READ_BACK_FIRST_BACKOFF;
    for try_number in 1..=READ_BACK_TRIES {
        match env.repo.get_event(id).await {
            Ok(row) => return row,
            Err(e) => {
                tracing::debug!(error = %e.chain(), try_number, "could not read the row back");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(READ_BACK_MAX_BACKOFF);
            }
        }
    }
    tracing::warn!(event_id = %id, "could not read the row back; its claim is reported lost");
    None
}

/// Gives back a claim whose handler never ran (uncounted, on a connection of its own): a
/// release that lands is [`AttemptOutcome::NotRun`].
pub(crate) async fn give_back(env: &AttemptEnv, beat: &Beat<'_>, why: &str) -> AttemptOutcome {
    match release(env, beat, why).await {
        AttemptOutcome::Released => AttemptOutcome::NotRun,
        other => other,
    }
}

/// [`give_back`] of a claim whose release was written in a transaction whose `COMMIT` reported
/// an error: a release that finds the claim gone reads the row back, and the claim's own
/// `RetryCount` there means the lost commit released it after all (a reclaim always counts one
/// more), so the event was given back, not lost.
pub(crate) async fn give_back_landed(
    env: &AttemptEnv,
    claim: &Claim,
    beat: &Beat<'_>,
    why: &str,
) -> AttemptOutcome {
    match give_back(env, beat, why).await {
        AttemptOutcome::LostClaim => match read_back(env, claim.event.id).await {
            Some(row)
                if released_by_us(
                    &row,
                    Held::new(
                        env,
                        claim.event.retry_count,
                        beat.fence.latest().last_written,
                    ),
                ) =>
            {
                tracing::info!("the commit reported an error but its release landed");
                AttemptOutcome::NotRun
            }
            _ => AttemptOutcome::LostClaim,
        },
        other => other,
    }
}

/// How often, and how long, the detached bookkeeping is tried before the worker gives up.
pub(crate) const DETACHED_FIRST_BACKOFF: Duration = Duration::from_millis(100);
pub(crate) const DETACHED_MAX_BACKOFF: Duration = Duration::from_secs(5);
pub(crate) const DETACHED_MAX_TRIES: u32 = 12;

/// What the row shows when an attempt's commit landed although it reported an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Landed {
    /// The success commit: `processed` with the claim's `RetryCount`.
    Processed,
    /// The failure bookkeeping's commit: its retry or `failed` with one more failure counted.
    Failure,
}

/// Whether the commit that reported an error landed after all. `RetryCount` tells this
/// attempt's write from anyone else's: a reclaim counts the dead attempt first, so another
/// worker's outcome always carries a higher count.
async fn landed_anyway(
    env: &AttemptEnv,
    claim: &Claim,
    landed: Landed,
    failure: &Failure,
) -> Option<AttemptOutcome> {
    let row = read_back(env, claim.event.id).await?;
    let ours = claim.event.retry_count;
    let matches = match (landed, failure.bookkeeping) {
        (Landed::Processed, _) => row.status == EventStatus::Processed && row.retry_count == ours,
        // Its retry landed: one more failure counted, with this attempt's error (a stale
        // reclaim's says the worker died). The row may be another worker's fresh claim by now
        // (the retry delay can be short): a claim keeps both.
        (Landed::Failure, FailureBookkeeping::Retry { .. }) => {
            row.retry_count == ours + 1
                && not_a_reclaims_count(&row, Held::new(env, ours, claim.fence.last_written))
        }
        // With this attempt's error: an exhausted stale reclaim also ends `failed` one count
        // on, but says the worker died.
        // A snooze counts nothing: the row is `pending` with this attempt's count and message
        // (a release or a give-back writes another message, a stale reclaim counts one more).
        (Landed::Failure, FailureBookkeeping::Snooze { .. }) => {
            row.status == EventStatus::Pending
                && row.retry_count == ours
                && row.last_error.as_deref() == Some(clip_error(&failure.message).as_str())
        }
        (Landed::Failure, FailureBookkeeping::Fail) => {
            row.status == EventStatus::Failed
                && row.retry_count == ours + 1
                && row.last_error.as_deref() == Some(clip_error(&failure.message).as_str())
        }
    };
    if !matches {
        return None;
    }
    tracing::info!("the commit reported an error but landed; nothing more to record");
    Some(match landed {
        Landed::Processed => AttemptOutcome::Processed,
        Landed::Failure => failure_outcome(failure),
    })
}

/// The attempt transaction is gone: land the failure bookkeeping on connections of its own
/// while the heartbeat (still running) keeps the claim alive. `landed` says which outcome the
/// lost transaction may have committed after all (its commit reported an error): a fenced
/// write that finds the claim gone then checks whether the row carries that outcome.
pub(crate) async fn detached(
    env: &AttemptEnv,
    claim: &Claim,
    beat: &Beat<'_>,
    failure: Failure,
    landed: Option<Landed>,
) -> AttemptOutcome {
    if let Some(landed) = landed
        && let Some(outcome) = landed_anyway(env, claim, landed, &failure).await
    {
        return outcome;
    }
    env.metrics.detached_bookkeeping(&claim.event.event_type);
    // The claim must stay visibly alive while the bookkeeping lands (at once: on a backend that
    // serializes writers it went without beats during the attempt).
    beat.ensure_running(true);
    // The effects the handler ran are facts whoever holds the claim: recorded first.
    record_on_side(env, &failure.effects).await;
    let (fence, lost) = (beat.fence.clone(), beat.lost.clone());
    let mut backoff = DETACHED_FIRST_BACKOFF;
    // Once a try failed it may have landed with its reply lost: a claim found gone after that
    // is checked for this bookkeeping's own outcome too.
    let mut tried = false;
    for attempt in 1..=DETACHED_MAX_TRIES {
        {
            let state = fence.lock_for_write(&env.repo).await;
            if state.lost {
                return lost_or_landed(env, claim, &failure, landed, tried).await;
            }
            let written = match failure.bookkeeping {
                FailureBookkeeping::Retry { extra_delay } => {
                    env.repo
                        .increment_retry(state.fence, extra_delay, &failure.message)
                        .await
                }
                FailureBookkeeping::Snooze { delay } => {
                    env.repo
                        .snooze_claim(state.fence, delay, &failure.message)
                        .await
                }
                FailureBookkeeping::Fail => {
                    env.repo
                        .update_status(state.fence, Terminal::Failed, Some(failure.message.clone()))
                        .await
                }
            };
            match written {
                Ok(FenceOutcome::Written) => {
                    // As for a release: no beat of a row that is no longer this worker's.
                    beat.stop();
                    return failure_outcome(&failure);
                }
                Ok(FenceOutcome::Lost) => {
                    drop(state);
                    return lost_or_landed(env, claim, &failure, landed, tried).await;
                }
                Err(e) => {
                    tried = true;
                    tracing::warn!(
                        error = %e.chain(),
                        try_number = attempt,
                        "detached bookkeeping failed; the heartbeat keeps the claim while it retries"
                    )
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = lost.cancelled() => return lost_or_landed(env, claim, &failure, landed, tried).await,
            _ = env.hard_stop.cancelled() => return AttemptOutcome::Cancelled,
        }
        backoff = (backoff * 2).min(DETACHED_MAX_BACKOFF);
    }
    tracing::error!(
        "giving up on the detached bookkeeping; the row goes stale and will be reclaimed"
    );
    AttemptOutcome::Abandoned
}

/// The claim is gone: either the lost transaction's commit (`landed`) landed after all, or a
/// try of the bookkeeping that failed (`tried`) did, or another worker holds the row now.
async fn lost_or_landed(
    env: &AttemptEnv,
    claim: &Claim,
    failure: &Failure,
    landed: Option<Landed>,
    tried: bool,
) -> AttemptOutcome {
    let candidates = landed
        .into_iter()
        .chain((tried && landed != Some(Landed::Failure)).then_some(Landed::Failure));
    for candidate in candidates {
        if let Some(outcome) = landed_anyway(env, claim, candidate, failure).await {
            return outcome;
        }
    }
    AttemptOutcome::LostClaim
}

/// Records `effects` in the ledger in the attempt's transaction (after a rollback to its
/// savepoint undid them with the handler's writes).
pub(crate) async fn record_in(
    tx: &mut dyn Attempt,
    effects: &[EffectRecord],
) -> outbox_persistence::Result<()> {
    if effects.is_empty() {
        return Ok(());
    }
    outbox_persistence::record_effects_in(tx.tx(), effects).await
}

/// Records `effects` in the ledger on a transaction of its own (their attempt's transaction
/// rolled back or is gone), tried with the detached bookkeeping's backoff and as often (12
/// tries over about 36 s, each bounded by [`SIDE_TRY_LIMIT`]): an effect that ran is a fact
/// whoever holds the claim, and a record that lands keeps the next attempt from running it
/// again. A hard shutdown ends it early, with one last bounded try
/// ([`record_on_side_briefly`]). A record that never lands is logged: the effect then runs
/// again on the next attempt, with the same idempotency key.
pub(crate) async fn record_on_side(env: &AttemptEnv, effects: &[EffectRecord]) {
    if effects.is_empty() {
        return;
    }
    let mut backoff = DETACHED_FIRST_BACKOFF;
    for try_number in 1..=DETACHED_MAX_TRIES {
        if env.hard_stop.is_cancelled() {
            return record_on_side_briefly(env, effects).await;
        }
        let tried = tokio::select! {
            tried = tokio::time::timeout(SIDE_TRY_LIMIT, env.repo.record_effects(effects)) => tried,
            _ = env.hard_stop.cancelled() => return record_on_side_briefly(env, effects).await,
        };
        match tried {
            Ok(Ok(())) => return,
            Ok(Err(e)) => tracing::warn!(
                error = %e.chain(),
                try_number,
                "recording completed effects in the ledger failed"
            ),
            Err(_) => tracing::warn!(
                try_number,
                "recording completed effects in the ledger timed out"
            ),
        }
        if try_number == DETACHED_MAX_TRIES {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = env.hard_stop.cancelled() => return record_on_side_briefly(env, effects).await,
        }
        backoff = (backoff * 2).min(DETACHED_MAX_BACKOFF);
    }
    unrecorded(effects);
}

/// The longest one try of [`record_on_side`] may take (a lock it meets, a pool that cannot
/// connect): the try is then dropped (its transaction with it) and the next one made.
pub(crate) const SIDE_TRY_LIMIT: Duration = Duration::from_secs(10);

/// How long a hard shutdown waits for the one try of recording the effects its attempts ran.
pub(crate) const RECORD_AT_HARD_STOP: Duration = Duration::from_secs(2);

/// One try, bounded by [`RECORD_AT_HARD_STOP`], of recording `effects` on the side: what a
/// hard shutdown still does for the effects its cancelled attempts ran (their rows are left to
/// stale reclaim, whose attempt then skips them).
pub(crate) async fn record_on_side_briefly(env: &AttemptEnv, effects: &[EffectRecord]) {
    if effects.is_empty() {
        return;
    }
    match tokio::time::timeout(RECORD_AT_HARD_STOP, env.repo.record_effects(effects)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e.chain(), "recording completed effects in the ledger failed");
            unrecorded(effects);
        }
        Err(_) => unrecorded(effects),
    }
}

fn unrecorded(effects: &[EffectRecord]) {
    tracing::error!(
        effects = effects.len(),
        "could not record completed effects in the ledger: the next attempt runs them again, with the same idempotency keys"
    );
}
