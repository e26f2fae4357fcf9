//! Fenced writes on SQLite: the heartbeat, the attempt's begin (write lock, fence check,
//! savepoint) and its bookkeeping, and the same bookkeeping detached. Every write applies only
//! while the row still carries the fence and moves `LastModifiedDate` strictly forward; the
//! liveness observations learn of every claim this process holds.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::SqliteExecutor;

use super::SqliteOutbox;
use super::liveness::Liveness;
use super::sql::{FENCED_PROCESSED_MANY, MAY_RUN_IN_BATCH};
use super::time::{format_ts, host_now, next_written};
use crate::attempt::{
    AttemptWrites, FencedWrite, OpenAttempt, chrono_span, fence_outcome, snoozed_error,
};
use crate::{
    Attempt, BeatOutcome, ClockShift, EventId, Fence, FenceOutcome, Result, Tx, clip_error,
};

const FENCED_PROCESSED: &str = "\
UPDATE _System_OutboxEvent SET Status = 'processed', LastModifiedDate = ?2, LastError = ?4
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3";

const FENCED_FAILED: &str = "\
UPDATE _System_OutboxEvent
SET Status = 'failed', RetryCount = RetryCount + 1, LastModifiedDate = ?2, LastError = ?4
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3";

const FENCED_RETRY: &str = "\
UPDATE _System_OutboxEvent
SET Status = 'pending', RetryCount = RetryCount + 1, LastModifiedDate = ?2, LastError = ?4
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3";

const FENCED_SNOOZE: &str = "\
UPDATE _System_OutboxEvent SET Status = 'pending', LastModifiedDate = ?2, LastError = ?4
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3";

const FENCED_RELEASE: &str = "\
UPDATE _System_OutboxEvent
SET Status = 'pending', LastModifiedDate = ?2,
    LastError = CASE WHEN LastError LIKE 'worker died:%' THEN LastError ELSE ?4 END
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3";

const HEARTBEAT: &str = "\
UPDATE _System_OutboxEvent SET LastModifiedDate = ?2
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3";

/// An attempt's `BEGIN IMMEDIATE` and its post-claim savepoint (`crate::attempt::SET_SAVEPOINT`).
const BEGIN_ATTEMPT: &str = "BEGIN IMMEDIATE; SAVEPOINT outbox_claimed";

const HOLDS_FENCE: &str = "\
SELECT 1 FROM _System_OutboxEvent
WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?2";

/// `now` plus `delay`, the delay held to a hundred years: a caller's `Duration::MAX` overflowed,
/// and a year past 9999 would leave the fixed-width text that keeps SQLite's times in order.
fn later(now: DateTime<Utc>, delay: Duration) -> DateTime<Utc> {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    now + chrono_span(delay.min(CENTURY))
}

/// `write`, fenced on `fence`, on `conn` (the attempt's transaction or the pool), at `now`
/// (the host's time plus the clock shift).
async fn write_fenced<'c>(
    conn: impl SqliteExecutor<'c>,
    now: DateTime<Utc>,
    fence: Fence,
    write: FencedWrite<'_>,
) -> Result<FenceOutcome> {
    let snoozed = match write {
        FencedWrite::Snooze { delay, error } => Some(snoozed_error(delay, error)),
        _ => None,
    };
    let (sql, written, error) = match write {
        FencedWrite::Processed => (FENCED_PROCESSED, now, None),
        FencedWrite::Failed { error } => (FENCED_FAILED, now, Some(error)),
        FencedWrite::Retry { extra_delay, error } => {
            (FENCED_RETRY, later(now, extra_delay), Some(error))
        }
        FencedWrite::Snooze { delay, .. } => (FENCED_SNOOZE, later(now, delay), snoozed.as_deref()),
        FencedWrite::Release { error } => (FENCED_RELEASE, now, Some(error)),
    };
    let rows = sqlx::query(sql)
        .bind(fence.id.to_string())
        .bind(format_ts(next_written(written, fence.last_written)))
        .bind(format_ts(fence.last_written))
        .bind(error.map(clip_error))
        .execute(conn)
        .await?
        .rows_affected();
    Ok(fence_outcome(rows))
}

/// What the SQLite attempt adds to [`OpenAttempt`]: its clock, and the note that keeps its
/// claim alive in this process's observations.
struct SqliteAttemptWrites {
    shift: ClockShift,
    /// The repository's observations: the attempt notes its claim alive before it releases
    /// the write lock, so that its own process does not take the claim for stale at once (a
    /// claim whose attempt fails is kept by its detached bookkeeping's heartbeat from then on).
    liveness: Arc<Mutex<Liveness>>,
    /// The fences the attempt began with, one per event of a batch (no heartbeat moves them
    /// while the attempt holds the write lock).
    fences: Vec<Fence>,
    /// This process's writer turn, given back as soon as the transaction has ended (the
    /// detached bookkeeping after a failed commit needs it again).
    turn: Mutex<Option<super::Turn>>,
}

#[async_trait]
impl AttemptWrites for SqliteAttemptWrites {
    async fn write(
        &self,
        tx: &mut Tx,
        fence: Fence,
        write: FencedWrite<'_>,
    ) -> Result<FenceOutcome> {
        write_fenced(tx.sqlite()?, host_now(&self.shift), fence, write).await
    }

    /// One statement for all (each statement is a round trip to the connection's thread).
    async fn processed_many(&self, tx: &mut Tx, fences: &[Fence]) -> Result<Vec<FenceOutcome>> {
        let now = host_now(&self.shift);
        let ids: Vec<String> = fences.iter().map(|f| f.id.to_string()).collect();
        let rows: Vec<[String; 3]> = fences
            .iter()
            .zip(&ids)
            .map(|(f, id)| {
                let written = next_written(now, f.last_written);
                [id.clone(), format_ts(written), format_ts(f.last_written)]
            })
            .collect();
        let written: Vec<String> = sqlx::query_scalar(FENCED_PROCESSED_MANY)
            .bind(serde_json::to_string(&rows).expect("strings serialize"))
            .fetch_all(tx.sqlite()?)
            .await?;
        let written: HashSet<&str> = written.iter().map(String::as_str).collect();
        Ok(ids
            .iter()
            .map(|id| fence_outcome(u64::from(written.contains(id.as_str()))))
            .collect())
    }

    fn ending(&self) {
        let mut liveness = self.liveness.lock().unwrap_or_else(|e| e.into_inner());
        for fence in &self.fences {
            liveness.note(fence.id, fence.last_written, &self.shift);
        }
    }

    fn ended(&self) {
        self.turn.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

impl SqliteOutbox {
    /// The detached bookkeeping: `write` on a connection of its own.
    pub(super) async fn write_detached(
        &self,
        fence: Fence,
        write: FencedWrite<'_>,
    ) -> Result<FenceOutcome> {
        // The time is read once this writer's turn has come: a wait at the gate must not
        // date the write (a retry's delay counts from it).
        let _turn = self.gate.turn().await?;
        write_fenced(&self.pool, self.now(), fence, write).await
    }

    pub(super) async fn beat(&self, fence: Fence) -> Result<BeatOutcome> {
        // This process holds the claim and is alive: say so to its own observers at once,
        // before the write waits for the lock (another attempt may hold it for a while).
        self.liveness()
            .note(fence.id, fence.last_written, &self.shift);
        let _turn = self.gate.turn().await?;
        let written = next_written(self.now(), fence.last_written);
        let rows = sqlx::query(HEARTBEAT)
            .bind(fence.id.to_string())
            .bind(format_ts(written))
            .bind(format_ts(fence.last_written))
            .execute(&self.pool)
            .await?
            .rows_affected();
        if rows != 1 {
            return Ok(BeatOutcome::Lost);
        }
        self.liveness().note(fence.id, written, &self.shift);
        Ok(BeatOutcome::Beaten(Fence {
            id: fence.id,
            last_written: written,
        }))
    }

    /// The beat of a worker's claims: one turn at the gate and one write transaction for all
    /// of them, so a beat of many claims waits for the write lock once (beaten one by one,
    /// each wait for a busy lock was paid per claim, and a worker holding a chain of 14 went
    /// seconds without beating any while the lock was contended: its claims looked stale to
    /// other processes, which reclaimed them). The statement of each claim is the single
    /// beat's; a claim whose fence moved is [`BeatOutcome::Lost`].
    pub(super) async fn beat_many(&self, fences: Vec<Fence>) -> Result<Vec<BeatOutcome>> {
        for fence in &fences {
            self.liveness()
                .note(fence.id, fence.last_written, &self.shift);
        }
        let _turn = self.gate.turn().await?;
        let now = self.now();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut outcomes = Vec::with_capacity(fences.len());
        for fence in &fences {
            let written = next_written(now, fence.last_written);
            let rows = sqlx::query(HEARTBEAT)
                .bind(fence.id.to_string())
                .bind(format_ts(written))
                .bind(format_ts(fence.last_written))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            outcomes.push(if rows == 1 {
                BeatOutcome::Beaten(Fence {
                    id: fence.id,
                    last_written: written,
                })
            } else {
                BeatOutcome::Lost
            });
        }
        tx.commit().await?;
        let mut liveness = self.liveness();
        for outcome in &outcomes {
            if let BeatOutcome::Beaten(fence) = outcome {
                liveness.note(fence.id, fence.last_written, &self.shift);
            }
        }
        Ok(outcomes)
    }

    pub(super) async fn open_attempt(
        &self,
        _lock_timeout: Duration,
        fence: Fence,
    ) -> Result<Option<Box<dyn Attempt>>> {
        // The busy timeout of the pool's connections bounds lock waits on SQLite. The write
        // lock is held from here to commit, so once the fence is checked nobody can reclaim
        // the row during the attempt.
        let turn = self.gate.turn().await?;
        // The write lock and the post-claim savepoint in one call to the connection's thread;
        // the fence is read after the savepoint (a read, it changes nothing the savepoint
        // would undo).
        let mut tx = self.pool.begin_with(BEGIN_ATTEMPT).await?;
        let held: Option<i64> = sqlx::query_scalar(HOLDS_FENCE)
            .bind(fence.id.to_string())
            .bind(format_ts(fence.last_written))
            .fetch_optional(&mut *tx)
            .await?;
        if held.is_none() {
            tx.rollback().await?;
            return Ok(None);
        }
        let writes = SqliteAttemptWrites {
            shift: self.shift.clone(),
            liveness: self.liveness.clone(),
            fences: vec![fence],
            turn: Mutex::new(Some(turn)),
        };
        Ok(Some(Box::new(OpenAttempt::new(Tx::Sqlite(tx), writes))))
    }

    /// A batch's attempt: one write transaction (`BEGIN IMMEDIATE` and the first savepoint),
    /// every fence read in it; returns the rows whose claim is lost.
    pub(super) async fn open_batch_attempt(
        &self,
        _lock_timeout: Duration,
        fences: Vec<Fence>,
    ) -> Result<(Box<dyn Attempt>, Vec<EventId>)> {
        let turn = self.gate.turn().await?;
        let mut tx = self.pool.begin_with(BEGIN_ATTEMPT).await?;
        let ids: Vec<String> = fences.iter().map(|f| f.id.to_string()).collect();
        let pairs: Vec<[String; 2]> = fences
            .iter()
            .map(|f| [f.id.to_string(), format_ts(f.last_written)])
            .collect();
        let held: Vec<String> = sqlx::query_scalar(MAY_RUN_IN_BATCH)
            .bind(serde_json::to_string(&pairs).expect("strings serialize"))
            .bind(serde_json::to_string(&ids).expect("strings serialize"))
            .fetch_all(&mut *tx)
            .await?;
        let held: HashSet<&str> = held.iter().map(String::as_str).collect();
        let mut lost = Vec::new();
        for (fence, id) in fences.iter().zip(&ids) {
            if !held.contains(id.as_str()) {
                lost.push(fence.id);
            }
        }
        let writes = SqliteAttemptWrites {
            shift: self.shift.clone(),
            liveness: self.liveness.clone(),
            fences,
            turn: Mutex::new(Some(turn)),
        };
        Ok((Box::new(OpenAttempt::new(Tx::Sqlite(tx), writes)), lost))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_attempt_begins_with_the_post_claim_savepoint() {
        assert_eq!(
            super::BEGIN_ATTEMPT,
            format!("BEGIN IMMEDIATE; {}", crate::attempt::SET_SAVEPOINT)
        );
    }

    /// A delay no clock can hold still writes a time in the text order of every other.
    #[test]
    fn a_delay_past_any_calendar_stays_a_four_digit_year() {
        let now = chrono::Utc::now();
        let far = super::later(now, std::time::Duration::MAX);
        let text = super::format_ts(far);
        assert_eq!(text.len(), super::format_ts(now).len(), "{text}");
        assert!(text > super::format_ts(now));
    }
}
