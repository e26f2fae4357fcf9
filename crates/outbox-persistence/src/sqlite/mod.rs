//! The SQLite repository: the embedded default.
//!
//! SQLite has one writer at a time. Claims and attempts take the write lock up front
//! (`BEGIN IMMEDIATE`), so a read-then-write transaction never fails on a stale snapshot; waits
//! are bounded by the busy timeout, which surfaces as [`crate::Error::LockTimeout`]. This
//! process's outbox writers on one file queue for it first, in order (`gate`), instead of
//! polling it in SQLite's busy handler. Timestamps are fixed-width UTC text, so the design's
//! comparisons work on them as written; a trigger rewrites any other shape that other code
//! writes (see migration 0003).
//!
//! Time: SQLite lives on one host, so its timestamps come from that host's clock (plus the
//! repository's [`ClockShift`]). Staleness does not: a `processing` row is stale when this
//! repository has *observed* its `LastModifiedDate` unchanged for `stale_after` of monotonic
//! time (`liveness`), so a step of the wall clock never makes a live claim look stale.
//!
//! The pieces: `sql` (the claim-path statements, composed from fragments), `claim` (reads and
//! claims), `enqueue`, `fenced` (heartbeat, attempt, bookkeeping), `ops` (stats, operator
//! retries, backfill, listing), `liveness` and `time`. The attempt's life cycle is the
//! crate's, shared with PostgreSQL.

mod claim;
mod enqueue;
mod fenced;
pub(crate) mod gate;
mod heads;
mod keys;
mod liveness;
mod ops;
mod pause;
mod prune;
mod sql;
mod time;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::sqlite::SqliteRow;
use sqlx::{SqliteConnection, SqlitePool};

pub use enqueue::enqueue;
pub(crate) use time::parse_id;
pub use time::{format_ts, parse_ts};

use crate::attempt::FencedWrite;
use crate::{
    Attempt, AuditEntry, BackfillPage, BeatOutcome, BlockedKey, Claim, ClaimPolicy, ClockShift,
    EventFilter, EventId, EventRow, Fence, FenceOutcome, HeadsRepair, NewEvent, OutboxEvent,
    OutboxRepository, OutboxStats, PausedType, PrunePolicy, PruneReport, Result, RetryFilter,
    Scope, Terminal, Tx,
};
use gate::{Gate, Turn};
use liveness::Liveness;

/// The SQLite outbox repository.
#[derive(Debug, Clone)]
pub struct SqliteOutbox {
    pool: SqlitePool,
    enqueued: Arc<crate::wakeups::WakeUps>,
    shift: ClockShift,
    liveness: Arc<Mutex<Liveness>>,
    /// This process's outbox writers on the file queue here (see `gate`).
    gate: Arc<Gate>,
}

/// A write transaction (`BEGIN IMMEDIATE`) that holds this process's writer turn until it
/// ends.
struct WriteTx {
    tx: sqlx::Transaction<'static, sqlx::Sqlite>,
    _turn: Turn,
}

impl WriteTx {
    async fn commit(self) -> Result<()> {
        Ok(self.tx.commit().await?)
    }

    async fn rollback(self) -> Result<()> {
        Ok(self.tx.rollback().await?)
    }
}

impl std::ops::Deref for WriteTx {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        &self.tx
    }
}

impl std::ops::DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.tx
    }
}

impl SqliteOutbox {
    /// A repository over `pool`.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            enqueued: Arc::default(),
            shift: ClockShift::default(),
            liveness: Arc::new(Mutex::new(Liveness::new())),
            gate: Gate::of(&pool),
            pool,
        }
    }

    /// Shares `shift` as this repository's clock shift (tests move it instead of sleeping).
    pub fn with_clock_shift(mut self, shift: ClockShift) -> Self {
        self.shift = shift;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The host's time plus the clock shift.
    fn now(&self) -> DateTime<Utc> {
        time::host_now(&self.shift)
    }

    fn liveness(&self) -> MutexGuard<'_, Liveness> {
        self.liveness.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens a write transaction, timing the wait for the lock (a long wait restarts the
    /// liveness observations; a failed one too). The wait includes the wait for this
    /// process's writer turn (see `gate`).
    async fn begin_write(&self) -> Result<(WriteTx, Duration)> {
        let started = Instant::now();
        let begun = match self.gate.turn().await {
            Ok(turn) => match self.pool.begin_with("BEGIN IMMEDIATE").await {
                Ok(tx) => Ok(WriteTx { tx, _turn: turn }),
                Err(e) => Err(e.into()),
            },
            Err(e) => Err(e),
        };
        match begun {
            Ok(tx) => Ok((tx, started.elapsed())),
            Err(e) => {
                self.liveness().lock_wait_failed();
                Err(e)
            }
        }
    }

    /// Looks at the `processing` rows and returns the JSON array of the stale ones' ids.
    async fn stale_ids(
        &self,
        conn: &mut SqliteConnection,
        stale_after: Duration,
        lock_wait: Option<Duration>,
    ) -> Result<String> {
        let processing: String = sqlx::query_scalar(sql::PROCESSING)
            .fetch_one(&mut *conn)
            .await?;
        let processing: Vec<(String, String)> = serde_json::from_str(&processing).map_err(|e| {
            crate::Error::Invalid(format!("the processing rows' ids and times: {e}"))
        })?;
        let stale = self
            .liveness()
            .look(processing, stale_after, lock_wait, &self.shift);
        Ok(serde_json::to_string(&stale).expect("a list of strings serializes"))
    }
}

/// A list of event types (or ids) as the JSON array the statements read with `json_each`.
fn json_list(items: Option<&[String]>) -> Option<String> {
    items.map(|t| serde_json::to_string(t).expect("a list of strings serializes"))
}

/// The rows `decode` can read; each other row is left out with a warning (other code wrote
/// it; the claim that meets it fails it with the reason).
fn readable<T>(rows: &[SqliteRow], decode: fn(&SqliteRow) -> Result<T>) -> Vec<T> {
    rows.iter()
        .filter_map(|row| match decode(row) {
            Ok(value) => Some(value),
            Err(e) => {
                tracing::warn!(error = %e.chain(), "skipping an unreadable outbox row");
                None
            }
        })
        .collect()
}

#[async_trait]
impl OutboxRepository for SqliteOutbox {
    fn backend_name(&self) -> &'static str {
        "sqlite"
    }

    async fn check_schema(&self) -> Result<()> {
        crate::Database::Sqlite(self.pool.clone())
            .check_schema_for_workers(self)
            .await
    }

    async fn begin(&self) -> Result<Tx> {
        Ok(Tx::Sqlite(self.pool.begin_with("BEGIN IMMEDIATE").await?))
    }

    async fn enqueue(&self, tx: &mut Tx, events: &[NewEvent]) -> Result<Vec<EventId>> {
        let ids = enqueue::enqueue_shifted(tx.sqlite()?, events, &self.shift).await?;
        self.enqueued.wake();
        Ok(ids)
    }

    async fn get_pending_events(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>> {
        self.eligible(policy, scope, limit).await
    }

    async fn claim_event(&self, id: EventId, policy: ClaimPolicy) -> Result<Option<Claim>> {
        Ok(self
            .claim_in_tx(policy, &Scope::All, Some(id), 1, 0)
            .await?
            .pop())
    }

    async fn claim_next(&self, policy: ClaimPolicy, scope: &Scope) -> Result<Option<Claim>> {
        Ok(self.claim_in_tx(policy, scope, None, 1, 0).await?.pop())
    }

    async fn claim_batch(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        max: usize,
    ) -> Result<Vec<Claim>> {
        self.claim_in_tx(policy, scope, None, max, 0).await
    }

    async fn claim_chains(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        max: usize,
        chain: usize,
    ) -> Result<Vec<Claim>> {
        self.claim_in_tx(policy, scope, None, max, chain).await
    }

    async fn heartbeat(&self, fence: Fence) -> Result<BeatOutcome> {
        self.beat(fence).await
    }

    /// SQLite never reports a beat [`BeatOutcome::Unsure`] (no reply crosses a network: an
    /// error means the beat did not land), so no beat of it is ever read back as landed.
    async fn beat_landed(&self, _written: Fence, _writer: i64) -> Result<bool> {
        Ok(false)
    }

    async fn heartbeat_many(&self, fences: Vec<Fence>) -> Result<Vec<BeatOutcome>> {
        self.beat_many(fences).await
    }

    fn note_alive(&self, fence: Fence) {
        self.liveness()
            .note(fence.id, fence.last_written, &self.shift);
    }

    fn serializes_writers(&self) -> bool {
        true
    }

    async fn begin_attempt(
        &self,
        lock_timeout: Duration,
        fence: Fence,
    ) -> Result<Option<Box<dyn Attempt>>> {
        self.open_attempt(lock_timeout, fence).await
    }

    async fn begin_batch_attempt(
        &self,
        lock_timeout: Duration,
        fences: Vec<Fence>,
    ) -> Result<(Box<dyn Attempt>, Vec<EventId>)> {
        self.open_batch_attempt(lock_timeout, fences).await
    }

    async fn increment_retry(
        &self,
        fence: Fence,
        extra_delay: Duration,
        error: &str,
    ) -> Result<FenceOutcome> {
        let write = FencedWrite::Retry { extra_delay, error };
        self.write_detached(fence, write).await
    }

    async fn snooze_claim(
        &self,
        fence: Fence,
        delay: Duration,
        error: &str,
    ) -> Result<FenceOutcome> {
        let write = FencedWrite::Snooze { delay, error };
        self.write_detached(fence, write).await
    }

    async fn update_status(
        &self,
        fence: Fence,
        status: Terminal,
        error: Option<String>,
    ) -> Result<FenceOutcome> {
        let write = FencedWrite::terminal(status, error.as_deref());
        self.write_detached(fence, write).await
    }

    async fn release_claim(&self, fence: Fence, error: &str) -> Result<FenceOutcome> {
        self.write_detached(fence, FencedWrite::Release { error })
            .await
    }

    async fn backfill_record_keys(
        &self,
        after: Option<EventId>,
        batch: u32,
        dry_run: bool,
    ) -> Result<BackfillPage> {
        self.backfill(after, batch, dry_run).await
    }

    async fn stats(&self, policy: ClaimPolicy) -> Result<OutboxStats> {
        self.read_stats(policy).await
    }

    async fn count_missing_record_keys(&self) -> Result<u64> {
        self.missing_record_keys().await
    }

    async fn retry_failed(&self, filter: RetryFilter) -> Result<u64> {
        self.retry(filter, None).await
    }

    async fn retry_failed_by(&self, filter: RetryFilter, actor: &str) -> Result<u64> {
        self.retry(filter, Some(actor)).await
    }

    async fn pause_event_type(&self, event_type: &str, actor: &str) -> Result<bool> {
        self.set_paused(event_type, actor, true).await
    }

    async fn resume_event_type(&self, event_type: &str, actor: &str) -> Result<bool> {
        self.set_paused(event_type, actor, false).await
    }

    async fn paused_event_types(&self) -> Result<Vec<PausedType>> {
        self.paused().await
    }

    async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>> {
        self.audit_entries(limit).await
    }

    async fn get_event(&self, id: EventId) -> Result<Option<OutboxEvent>> {
        self.read_event(id).await
    }

    async fn clock_now(&self) -> Result<DateTime<Utc>> {
        Ok(self.read_clock())
    }

    async fn blocked_keys(&self, policy: ClaimPolicy, limit: u32) -> Result<Vec<BlockedKey>> {
        self.read_blocked_keys(policy, limit).await
    }

    async fn key_page(&self, record_key: &str, limit: u32) -> Result<crate::KeyPage> {
        self.read_key_page(record_key, limit).await
    }

    async fn list_events(&self, filter: EventFilter) -> Result<Vec<EventRow>> {
        self.list(filter).await
    }

    async fn prune(&self, policy: PrunePolicy) -> Result<PruneReport> {
        self.prune_batch(policy).await
    }

    async fn count_prunable(&self, policy: PrunePolicy) -> Result<PruneReport> {
        self.count_prunable_rows(policy).await
    }

    async fn repair_heads(&self, max_keys: u32) -> Result<HeadsRepair> {
        self.repair_head_rows(max_keys).await
    }

    async fn wait_for_work(&self, timeout: Duration) -> Result<()> {
        // In-process enqueues wake the workers; other processes are seen at the next poll.
        self.wait_for_work_since(self.wake_mark(), timeout).await
    }

    fn wake_mark(&self) -> crate::WakeMark {
        self.enqueued.mark()
    }

    async fn wait_for_work_since(&self, since: crate::WakeMark, timeout: Duration) -> Result<()> {
        self.enqueued.wait(since, timeout).await;
        Ok(())
    }
}
