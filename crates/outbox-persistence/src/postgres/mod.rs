//! The PostgreSQL repository: the production backend.
//!
//! Claims use one statement: the design's eligible-row selection with `FOR UPDATE SKIP LOCKED`
//! feeding the `pending`/stale `processing` -> `processing` update, so concurrent workers skip
//! each other's rows instead of queueing behind them. Idle workers wake on `LISTEN outbox_event`
//! (a statement-level trigger notifies on enqueue).
//!
//! The pieces: `sql` (the claim-path statements, composed from fragments), `claim` (reads and
//! claims), `enqueue`, `fenced` (heartbeat, attempt, bookkeeping), `ops` (stats, operator
//! retries, backfill, listing, plans) and `listen` (the wake-up listener). The attempt's life
//! cycle is the crate's, shared with SQLite.

mod claim;
mod enqueue;
mod fenced;
mod keys;
mod listen;
pub(crate) mod migrate;
mod ops;
mod pause;
mod prune;
mod session;
mod sql;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use sqlx::postgres::types::PgInterval;

pub use enqueue::enqueue;
pub use ops::{explain, explain_analyze};
pub(crate) use session::{Begin, begin_sql, register};
pub use session::{
    DEFAULT_STATEMENT_TIMEOUT, PgSettings, Pooler, caches_statements, pool_caches_statements,
    settings_of,
};

use crate::attempt::FencedWrite;
use crate::{
    Attempt, AuditEntry, BackfillPage, BeatOutcome, BlockedKey, Claim, ClaimPolicy, ClockShift,
    EventFilter, EventId, EventRow, Fence, FenceOutcome, HeadsRepair, NewEvent, OutboxEvent,
    OutboxRepository, OutboxStats, PausedType, PrunePolicy, PruneReport, Result, RetryFilter,
    Scope, Terminal, Tx,
};

/// The notification channel the enqueue trigger signals.
pub const NOTIFY_CHANNEL: &str = "outbox_event";

/// The advisory-lock namespace of enqueue's per-record lock (the first key of the two-key form
/// `pg_advisory_xact_lock(int, int)`, whose lock space never overlaps the one-key form an
/// application may use). The second key is a stable hash of the `RecordKey`.
pub const ENQUEUE_LOCK_NAMESPACE: i32 = 3477;

/// The advisory-lock namespace of the lock buckets enqueue takes (one of 64 per record key).
pub const ENQUEUE_BUCKET_NAMESPACE: i32 = 3478;

/// The advisory-lock namespace of the claim exclusion (`(3479, 0)`, the two-key form). Every
/// claim takes it shared, in a statement of its own before the claim statement (whose snapshot
/// is therefore taken after it); an operator retry and the `RecordKey` backfill take it
/// exclusively for their one short transaction. So no claim straddles their commit: a claim
/// either committed before they changed a row, or reads their rows as committed. (Before
/// migration 0009 a retried row was held back two seconds instead, which assumed claims never
/// wait.)
pub const CLAIM_EXCLUSION_NAMESPACE: i32 = 3479;

/// The advisory-lock namespace (`(3480, 0)`) that `_System_OutboxHeadRepair` tries, so that one
/// repair runs at a time across every process; the others skip their run.
pub const HEADS_REPAIR_NAMESPACE: i32 = 3480;

/// The SQLSTATE `_System_OutboxCheckFence` raises when an attempt's claim was taken over
/// before the attempt began.
pub const CLAIM_LOST_SQLSTATE: &str = "OB001";

/// The PostgreSQL outbox repository.
#[derive(Debug, Clone)]
pub struct PgOutbox {
    pool: PgPool,
    wake: Arc<listen::Wake>,
    shift: ClockShift,
    lock_timeout: Duration,
    async_claims: bool,
    settings: PgSettings,
}

impl PgOutbox {
    /// A repository over `pool`, with the settings `Database::connect` recorded for it (its
    /// [`Pooler`], direct `LISTEN` URL and statement timeout; the defaults for a pool made
    /// elsewhere, which [`PgOutbox::with_settings`] replaces).
    pub fn new(pool: PgPool) -> Self {
        let settings = settings_of(&pool);
        Self {
            pool,
            wake: Arc::default(),
            shift: ClockShift::default(),
            lock_timeout: crate::DEFAULT_LOCK_TIMEOUT,
            async_claims: false,
            settings,
        }
    }

    /// Uses `settings` (for a pool this process did not connect through `Database::connect`):
    /// behind a transaction pooler, statements are unnamed and wake-ups use
    /// `settings.listen_url` or polling.
    pub fn with_settings(mut self, settings: PgSettings) -> Self {
        if settings.pooler == Pooler::Transaction {
            register(&self.pool, settings.clone());
        }
        self.settings = settings;
        self
    }

    /// Lets the claims (`claim_next`, `claim_batch`) commit without waiting for the WAL flush
    /// (`synchronous_commit = off` for the claim's own transaction only). Off by default: a
    /// server crash, or a failover to a standby, can lose such a claim while its handler still
    /// runs, and the row is then claimable again at once, so until that handler's next
    /// heartbeat notices the loss the event can run twice at the same time and its record's
    /// next event can start beside it (their network effects out of order), and the dead
    /// attempt is not counted towards `MaxRetryAttempts`. In exchange each event waits for
    /// one WAL flush instead of two. Turn it on only when every handler's effects tolerate
    /// that; see `docs/state-machine.md`, "Claims that do not wait for the disk".
    pub fn with_async_claims(mut self, on: bool) -> Self {
        self.async_claims = on;
        self
    }

    /// Bounds the lock waits of the outbox's own writes outside attempts (heartbeats, detached
    /// bookkeeping, operator retries) by `lock_timeout` (default [`crate::DEFAULT_LOCK_TIMEOUT`]).
    /// It is set per statement or transaction, never on a session, so the application's own
    /// transactions on the same pool keep their settings.
    pub fn with_lock_timeout(mut self, lock_timeout: Duration) -> Self {
        self.lock_timeout = lock_timeout;
        self
    }

    /// Shares `shift` as this repository's clock shift (tests move it instead of sleeping).
    pub fn with_clock_shift(mut self, shift: ClockShift) -> Self {
        self.shift = shift;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The lock timeout as the statements restate it (`5000ms`).
    fn lock_timeout(&self) -> String {
        format!("{}ms", session::millis(self.lock_timeout))
    }

    /// Whether this repository's statements may be prepared under a name (not behind a
    /// transaction pooler): the value of every statement's `persistent`.
    fn cached(&self) -> bool {
        caches_statements() && self.settings.caches_statements()
    }

    /// How the repository's own transactions begin: READ COMMITTED, its lock timeout and
    /// statement timeout (see `session`).
    fn begin_spec(&self, read_only: bool) -> Begin {
        Begin {
            read_only,
            lock_timeout: self.lock_timeout,
            statement_timeout: self.settings.statement_timeout(),
            may_idle: false,
            async_commit: false,
        }
    }

    /// A reading transaction without a statement timeout, for the operator's full-table reads
    /// (`check_heads`, `count_prunable`), which take what the table's size takes.
    async fn begin_unbounded_read(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        let mut spec = self.begin_spec(true);
        spec.statement_timeout = Duration::ZERO;
        self.begin_as(spec).await
    }

    /// Begins one of the repository's own transactions as `spec` says.
    async fn begin_as(&self, spec: Begin) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        Ok(self
            .pool
            .begin_with(sqlx::AssertSqlSafe(begin_sql(spec)))
            .await?)
    }

    /// A writing transaction of the repository's own.
    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        self.begin_as(self.begin_spec(false)).await
    }

    /// A reading transaction of the repository's own (`READ ONLY`, so reads run on a standby).
    async fn begin_read(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        self.begin_as(self.begin_spec(true)).await
    }

    /// The clock shift as an interval (`$1` of every statement that reads the clock).
    fn shift(&self) -> PgInterval {
        interval(self.shift.micros())
    }
}

/// An interval of `micros` microseconds.
fn interval(micros: i64) -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        microseconds: micros,
    }
}

/// A duration as an interval (saturating at about 292,000 years).
fn span(d: Duration) -> PgInterval {
    interval(i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

#[async_trait]
impl OutboxRepository for PgOutbox {
    fn backend_name(&self) -> &'static str {
        "postgres"
    }

    async fn check_schema(&self) -> Result<()> {
        crate::Database::Postgres(self.pool.clone())
            .check_schema_for_workers(self)
            .await
    }

    async fn begin(&self) -> Result<Tx> {
        // The application's transaction: READ COMMITTED whatever the database's default (the
        // enqueue trigger's key lock raises a serialization failure at REPEATABLE READ when a
        // worker moved the key's head meanwhile); its timeouts stay the session's.
        Ok(Tx::Postgres(
            self.pool
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await?,
        ))
    }

    async fn enqueue(&self, tx: &mut Tx, events: &[NewEvent]) -> Result<Vec<EventId>> {
        enqueue::enqueue_shifted(tx.postgres()?, events, &self.shift, (self.cached(), true)).await
    }

    async fn enqueue_owned(&self, tx: &mut Tx, events: &[NewEvent]) -> Result<Vec<EventId>> {
        enqueue::enqueue_shifted(tx.postgres()?, events, &self.shift, (self.cached(), false)).await
    }

    async fn hold_owned_heads(&self, tx: &mut Tx, keys: &[crate::RecordKey]) -> Result<()> {
        enqueue::hold_heads(tx.postgres()?, keys, self.cached()).await
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
        self.claim_by_id(id, policy).await
    }

    async fn claim_next(&self, policy: ClaimPolicy, scope: &Scope) -> Result<Option<Claim>> {
        Ok(self.claim_oldest(policy, scope, 1, 0).await?.pop())
    }

    async fn claim_batch(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        max: usize,
    ) -> Result<Vec<Claim>> {
        self.claim_oldest(policy, scope, max, 0).await
    }

    async fn claim_chains(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        max: usize,
        chain: usize,
    ) -> Result<Vec<Claim>> {
        self.claim_oldest(policy, scope, max, chain).await
    }

    async fn heartbeat(&self, fence: Fence) -> Result<BeatOutcome> {
        self.beat(fence).await
    }

    async fn beat_landed(&self, written: Fence, writer: i64) -> Result<bool> {
        self.read_back_beat(written, writer).await
    }

    async fn heartbeat_many(&self, fences: Vec<Fence>) -> Result<Vec<BeatOutcome>> {
        self.beat_many(fences).await
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

    async fn release_claims(&self, fences: Vec<Fence>, error: &str) -> Result<Vec<FenceOutcome>> {
        self.release_many(&fences, error).await
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
        self.read_clock().await
    }

    async fn blocked_keys(&self, policy: ClaimPolicy, limit: u32) -> Result<Vec<BlockedKey>> {
        self.read_blocked_keys(policy, limit).await
    }

    async fn list_events(&self, filter: EventFilter) -> Result<Vec<EventRow>> {
        self.list(filter).await
    }

    async fn key_page(&self, record_key: &str, limit: u32) -> Result<crate::KeyPage> {
        self.read_key_page(record_key, limit).await
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
        self.wait_for_work_since(self.wake_mark(), timeout).await
    }

    fn wake_mark(&self) -> crate::WakeMark {
        self.wake.wakes.mark()
    }

    async fn wait_for_work_since(&self, since: crate::WakeMark, timeout: Duration) -> Result<()> {
        self.wait_for_work_after(since, timeout).await;
        Ok(())
    }
}
