//! The outbox repository: every fact about `_System_OutboxEvent` lives here.
//!
//! [`OutboxRepository`] holds the operations the design names (`enqueue`, `get_pending_events`,
//! `claim_event`, `heartbeat`, `increment_retry`, `update_status`) plus what operators and the
//! rollout need (`backfill_record_keys`, `stats`, `retry_failed`, `list_events`). Each backend
//! implements it in its own module with its own SQL: [`postgres`] (production) and [`sqlite`]
//! (embedded default). What does not depend on the dialect lives here once: the attempt's
//! life cycle and fenced writes (`attempt`), the status counts of `stats`, the operators' row
//! listing types ([`EventFilter`], [`EventRow`]).
//!
//! A handler's effects commit atomically with `processed` because they run inside an
//! [`Attempt`]: a transaction opened after the claim committed, with a savepoint right after it.
//!
//! Time comes from one clock, never the caller's: on PostgreSQL every queue timestamp is the
//! database's `clock_timestamp()`, so a worker or application host whose clock is skewed
//! changes nothing; SQLite (one host) uses that host's clock and decides staleness by observing
//! heartbeats on a monotonic clock. Callers pass durations ([`ClaimPolicy`]); tests move a
//! [`ClockShift`] instead of sleeping.

#![warn(missing_docs)]

mod attempt;
mod backfill;
mod beat;
pub mod console;
mod database;
mod effects;
mod error;
mod heads;
mod keys;
mod listing;
mod macros;
mod model;
mod pause;
pub mod postgres;
mod retention;
pub mod sqlite;
pub mod statement;
mod stats;
pub use stats::ESTIMATE_PROCESSED_ABOVE;
#[cfg(feature = "test-support")]
pub mod test_support;
mod tx;
mod wakeups;
pub mod webhooks;

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, SubsecRound, Utc};

pub use attempt::clip_error;
/// The `mockall` version the mocks are generated with (feature `mock`), for its `Sequence`
/// and `predicate` in tests that use [`MockOutboxRepository`] and [`MockAttempt`].
#[cfg(feature = "mock")]
pub use mockall;
pub use sqlx;

pub use beat::BeatOutcome;
pub use database::{
    CONNECTIONS_BESIDE_WORKERS, ConnectConfig, DEFAULT_LOCK_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    Database, MIGRATE_LOCK_NAMESPACE, MIGRATIONS_TABLE, MIN_POSTGRES_VERSION, redact as redact_url,
};
pub use effects::{
    EFFECTS_EVENTS_LOOKED_UP, EFFECTS_SHOWN, EffectRecord, RecordedEffect, effects_of, find_effect,
    find_effects, idempotency_key, ledger_table_exists, record_effect, record_effects_in,
};
pub use error::{Error, ErrorClass, classify as classify_error};
pub use heads::{DEFAULT_HEADS_REPAIR_KEYS, HeadsRepair};
pub use keys::{
    BlockedKey, HeadState, KEY_ROWS_COUNTED, KEY_ROWS_SHOWN, KeyPage, KeyReport, explain_head,
    key_report,
};
pub use listing::{EventFilter, EventRow};
pub use model::*;
pub use pause::{AuditEntry, PausedType};
pub use tx::Tx;
pub use wakeups::WakeMark;

pub(crate) use backfill::{UNKEYED_PAGE_ROWS, classify_backfill, derivable_keys};
/// The payload's envelope (`object`, `record_id`, `snapshot`) that the `RecordKey` is derived
/// from; a handler parses its event's payload with [`EventEnvelope::parse`].
pub use record_key::EventEnvelope;
/// The `RecordKey` type of [`OutboxEvent::record_key`] and [`EventRow::record_key`].
pub use record_key::RecordKey;
pub use retention::{
    DEFAULT_FAILED_RETENTION, DEFAULT_PROCESSED_RETENTION, DEFAULT_PRUNE_BATCH, PrunePolicy,
    PruneReport,
};

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How `LastError` starts when a stale reclaim counted a dead attempt (its worker died, or
/// lost the database, without writing an outcome). Both backends write it.
pub const WORKER_DIED: &str = "worker died:";

/// The name of the outbox table, as the design spells it.
pub const OUTBOX_TABLE: &str = "_System_OutboxEvent";

/// Truncates a time to whole microseconds, the precision both backends store, so that a value
/// read back compares equal to the value written (the fence relies on it).
pub fn truncate_micros(t: DateTime<Utc>) -> DateTime<Utc> {
    t.trunc_subsecs(6)
}

/// The most rows one [`OutboxRepository::claim_batch`] call claims.
pub const MAX_CLAIM_BATCH: usize = 256;

/// The most events one batched attempt runs ([`OutboxRepository::begin_batch_attempt`]): each
/// writes under a savepoint of its own, and PostgreSQL keeps a backend's subtransactions in a
/// cache of 64; past it every snapshot in the database gets slower.
pub const MAX_BATCH_EVENTS: usize = 32;

/// The repository: one implementation per backend, one conformance suite for all.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait OutboxRepository: Send + Sync + 'static {
    /// The backend's name (`postgres` or `sqlite`).
    fn backend_name(&self) -> &'static str;

    /// Opens a transaction for the application's own writes; enqueue into it with
    /// [`OutboxRepository::enqueue`] so that the record and its events commit together.
    async fn begin(&self) -> Result<Tx>;

    /// Inserts `events` in the caller's transaction, in order, deriving each `RecordKey` from
    /// its payload. Ids increase in the order given. Refuses the whole batch, writing nothing,
    /// when a payload is not a valid envelope.
    ///
    /// `CreatedDate` comes from the database's clock, drawn after a per-record lock held to the
    /// end of the caller's transaction (PostgreSQL: transaction-scoped advisory locks; SQLite:
    /// the write lock), so one record's events are ordered as their transactions commit.
    async fn enqueue(&self, tx: &mut Tx, events: &[NewEvent]) -> Result<Vec<EventId>>;

    /// [`OutboxRepository::enqueue`] for records **only the calling attempt writes, one at a
    /// time**: a handler that enqueues follow-up rows under keys derived from its own claimed
    /// record (a webhook fan-out's `webhook:<endpoint>|<key>`), whose claim already orders
    /// them. On PostgreSQL it takes no enqueue lock, so it holds none across the handlers of a
    /// batched attempt that share its transaction (`AttemptContext::lock_free_tx`), where an
    /// application's bulk enqueue could wait for it in a cycle. SQLite: as `enqueue` (the
    /// attempt holds the write lock already). Rows of keys anybody else enqueues must go
    /// through `enqueue`.
    async fn enqueue_owned(&self, tx: &mut Tx, events: &[NewEvent]) -> Result<Vec<EventId>> {
        self.enqueue(tx, events).await
    }

    /// Holds, in `tx`, the heads of the records `keys` (those of the owned rows, from
    /// [`NewEvent::record_key`]), before a batch's settle writes the outcomes whose owned rows
    /// they are (inserted after them with [`OutboxRepository::enqueue_owned`]). On PostgreSQL a settle moves the heads of the
    /// records it ended and then inserts its owned rows, whose heads another settle may have
    /// moved meanwhile: held first, they are left alone by other settles, and the inserts wait
    /// for no one (two settles that crossed records deadlocked; migration 0026). Default, and
    /// SQLite: nothing (one writer at a time).
    async fn hold_owned_heads(&self, tx: &mut Tx, keys: &[RecordKey]) -> Result<()> {
        let _ = (tx, keys);
        Ok(())
    }

    /// The design's eligible-event query: `pending` rows (a retried one once its
    /// `LastModifiedDate` is older than `retry_cutoff`) and stale `processing` rows, skipping a
    /// row while an older row with the same `RecordKey` is not terminal, oldest first; and never
    /// a row while another row of its key is `processing` with a live heartbeat (the in-flight
    /// guard). `scope` narrows the event types; the ordering rule still looks at every type.
    async fn get_pending_events(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>>;

    /// `ClaimEvent`: atomically moves row `id` from `pending`, or stale `processing`, to
    /// `processing`, committed before this returns, when it is eligible (the same rules as
    /// `get_pending_events`). `None` when it is not, or another worker won.
    ///
    /// Reclaiming a stale row counts its dead attempt as failed (`RetryCount + 1`, `LastError`
    /// starting `worker died:`); when that count reaches `MaxRetryAttempts` the row ends
    /// `failed` instead and this returns `None`.
    async fn claim_event(&self, id: EventId, policy: ClaimPolicy) -> Result<Option<Claim>>;

    /// Selects the oldest eligible row and claims it, in as few round trips as the backend
    /// allows. Same rules as `get_pending_events` followed by `claim_event`. Committed and
    /// durable before this returns, unless the PostgreSQL repository was built
    /// `with_async_claims` (committed, visible, not yet flushed: see
    /// `docs/state-machine.md`, "Claims that do not wait for the disk").
    async fn claim_next(&self, policy: ClaimPolicy, scope: &Scope) -> Result<Option<Claim>>;

    /// Claims up to `max` eligible rows at once, oldest first, each with the rules and the
    /// commit of [`OutboxRepository::claim_next`]: for a process whose `max` workers are idle at
    /// the same moment (the dispatcher's pull workers share one call; see
    /// `docs/state-machine.md`, "Claiming for several workers"). The keyed rows are of distinct
    /// record keys, so no two of them wait on each other. Each claim is committed and its
    /// heartbeat interval runs from this call on, so the caller must start every attempt at
    /// once: a claim held back longer than the stale-after interval is reclaimed, and its
    /// unstarted attempt counted as a dead worker's. Fewer than `max` (possibly none) when
    /// fewer are eligible, or when exhausted stale rows (ended `failed` instead of claimed)
    /// took places in the batch (PostgreSQL); `max` is clamped to `1..=`[`MAX_CLAIM_BATCH`].
    ///
    /// The default calls `claim_next` until it has `max` rows or none is left (a committed
    /// claim is returned even when a later call fails). PostgreSQL claims the batch in one
    /// statement (a statement that found only exhausted stale rows, which it ends `failed`,
    /// runs again, committed on its own), SQLite in one write transaction.
    async fn claim_batch(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        max: usize,
    ) -> Result<Vec<Claim>> {
        let mut claims = Vec::new();
        while claims.len() < max.clamp(1, MAX_CLAIM_BATCH) {
            match self.claim_next(policy, scope).await {
                Ok(Some(claim)) => claims.push(claim),
                Ok(None) => break,
                Err(e) if claims.is_empty() => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e.chain(), "claiming the rest of a batch failed; returning the claims made");
                    break;
                }
            }
        }
        Ok(claims)
    }

    /// [`OutboxRepository::claim_batch`] with record chains: each claimed row that is its
    /// record's head on a first attempt (`pending`, `RetryCount` 0) brings up to `chain` of
    /// the record's next rows, in order, as long as they are consecutive and each is `pending`
    /// on a first attempt, due, and in `scope` (the first that is not ends the chain), claimed
    /// in the same transaction (see `docs/state-machine.md`, "Record chains"). A chain's rows
    /// must run in order, after their head, in one attempt that gives the rest back unrun when
    /// one of them does not succeed. Returned oldest first (a chain's rows after its head).
    /// `max` bounds the heads and the chain rows together (chains fill what the heads leave).
    /// The default claims no chains.
    async fn claim_chains(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        max: usize,
        chain: usize,
    ) -> Result<Vec<Claim>> {
        let _ = chain;
        self.claim_batch(policy, scope, max).await
    }

    /// Refreshes `LastModifiedDate` of a row this worker still holds, on a connection of its
    /// own: [`BeatOutcome::Beaten`] with the new fence, [`BeatOutcome::Lost`] when the row is
    /// no longer this worker's (reclaimed, or finished elsewhere), [`BeatOutcome::Unsure`] when
    /// the beat's `COMMIT` got no answer. An error means the beat did not land.
    async fn heartbeat(&self, fence: Fence) -> Result<BeatOutcome>;

    /// Whether the beat that reported [`BeatOutcome::Unsure`] with `written` and `writer`
    /// landed and the row is still that beat's version: `processing` under `written`, written
    /// by `writer` (PostgreSQL compares the version's `xmin`: no later write passes for it).
    async fn beat_landed(&self, written: Fence, writer: i64) -> Result<bool>;

    /// Beats several claims of this worker at once, in one statement where the backend can:
    /// one outcome per fence, in order. A row another transaction holds locked is skipped
    /// ([`BeatOutcome::Busy`]) rather than waited for, so one locked row never delays the
    /// others' beats. The default beats them one by one; a beat that fails after others
    /// were written reports its claim [`BeatOutcome::Busy`] (beaten at the next interval), so
    /// the fences already moved are never forgotten; it fails only when every beat failed.
    async fn heartbeat_many(&self, fences: Vec<Fence>) -> Result<Vec<BeatOutcome>> {
        beat::one_by_one(self, fences).await
    }

    /// Tells the backend that this process still holds the claim `fence`, at no cost and
    /// without waiting for any lock: the heartbeat calls it every interval, also while its
    /// write waits. SQLite's own observers then never take the claim for stale (its write may
    /// wait behind another attempt's write lock for a while); PostgreSQL needs nothing.
    fn note_alive(&self, _fence: Fence) {}

    /// Whether attempt transactions exclude every other writer while they run (SQLite). Then
    /// nobody can reclaim a row during its attempt, `begin_attempt` checks the fence, and the
    /// worker heartbeats only outside the attempt transaction (a heartbeat would wait for the
    /// attempt's own write lock).
    fn serializes_writers(&self) -> bool {
        false
    }

    /// Opens the attempt transaction for a claimed row: begin, lock timeout, fence check,
    /// post-claim savepoint. Returns `None` when the fence moved (the row was reclaimed or
    /// finished before the attempt began), so a handler never starts on a lost claim.
    async fn begin_attempt(
        &self,
        lock_timeout: Duration,
        fence: Fence,
    ) -> Result<Option<Box<dyn Attempt>>>;

    /// Opens one attempt transaction for several claimed rows (a batch, see
    /// `docs/state-machine.md`, "Batched attempts"): begin, lock timeout, the first post-claim
    /// savepoint, and one check of every row. Returns the attempt and the ids of the rows that
    /// may not run now: their claim is lost, or an older row of their record outside the batch
    /// is not terminal (an operator retry, or a row other code wrote, since the claim). The
    /// caller gives those back unrun ([`Attempt::release`], which finds a lost claim lost). Before each event after the
    /// first, the caller takes a new savepoint ([`Attempt::savepoint`]); at most
    /// [`MAX_BATCH_EVENTS`] rows.
    async fn begin_batch_attempt(
        &self,
        lock_timeout: Duration,
        fences: Vec<Fence>,
    ) -> Result<(Box<dyn Attempt>, Vec<EventId>)>;

    /// `IncrementRetry` on a connection of its own (the detached bookkeeping path): back to
    /// `pending` with a higher `RetryCount`, fenced.
    async fn increment_retry(
        &self,
        fence: Fence,
        extra_delay: Duration,
        error: &str,
    ) -> Result<FenceOutcome>;

    /// A snooze on a connection of its own (the detached bookkeeping path): back to `pending`
    /// with `RetryCount` unchanged, `LastModifiedDate` now plus `delay` and `error` in
    /// `LastError`, fenced ([`FailureBookkeeping::Snooze`]). The default, for a repository
    /// written before snoozes, gives the claim back at once ([`OutboxRepository::release_claim`]):
    /// uncounted as well, only sooner.
    async fn snooze_claim(
        &self,
        fence: Fence,
        delay: Duration,
        error: &str,
    ) -> Result<FenceOutcome> {
        let _ = delay;
        self.release_claim(fence, error).await
    }

    /// Releases a claim without counting its attempt, on a connection of its own: back to
    /// `pending` with `RetryCount` unchanged and `error` in `LastError`, fenced. For an attempt
    /// whose handler succeeded but whose outcome the outbox could not write (a lock timeout, a
    /// serialization failure or deadlock on its own statement): the event runs again (at once
    /// unless it had failed before, then after the retry delay), uncharged.
    async fn release_claim(&self, fence: Fence, error: &str) -> Result<FenceOutcome>;

    /// [`OutboxRepository::release_claim`] of several claims, one outcome each, in order.
    async fn release_claims(&self, fences: Vec<Fence>, error: &str) -> Result<Vec<FenceOutcome>> {
        let mut outcomes = Vec::new();
        for fence in fences {
            outcomes.push(self.release_claim(fence, error).await?);
        }
        Ok(outcomes)
    }

    /// Records completed external effects in the ledger, on a transaction of its own (their
    /// attempt's rolled back while the worker lives); kept rows stay; not fenced (they ran).
    async fn record_effects(&self, effects: &[EffectRecord]) -> Result<()> {
        effects::record_on_own_tx(self.begin().await?, effects).await
    }

    /// The effects the ledger records for `event_ids` ([`effects_of`]: oldest first, at most
    /// [`EFFECTS_SHOWN`], none without the ledger's table), read in a rolled-back transaction.
    async fn effects_of(&self, event_ids: &[EventId]) -> Result<Vec<RecordedEffect>> {
        let mut tx = self.begin().await?;
        let effects = effects::effects_of(&mut tx, event_ids).await?;
        tx.rollback().await?;
        Ok(effects)
    }

    /// The schema's verdict for a dispatcher's start (`Database::check_schema_for_workers`).
    async fn check_schema(&self) -> Result<()>;
    /// Whether the effect ledger's table is migrated on this database (the gate checks it).
    async fn effect_ledger_ready(&self) -> Result<bool> {
        effects::ledger_ready(self.begin().await?).await
    }

    /// `UpdateStatus` on a connection of its own: a terminal status, fenced. `failed` also
    /// counts the failure in `RetryCount`.
    async fn update_status(
        &self,
        fence: Fence,
        status: Terminal,
        error: Option<String>,
    ) -> Result<FenceOutcome>;

    /// How many non-terminal rows lack the `RecordKey` their payload derives (what a backfill
    /// would set): the rollout gate's check. Reads only rows without a key, through the
    /// unkeyed index, a page at a time. The default pages through the dry-run backfill.
    async fn count_missing_record_keys(&self) -> Result<u64> {
        let (mut missing, mut after) = (0, None);
        loop {
            let page = self.backfill_record_keys(after, 1000, true).await?;
            missing += page.updated;
            after = page.next_after;
            if after.is_none() {
                return Ok(missing);
            }
        }
    }

    /// One page of the `RecordKey` backfill over non-terminal rows, in `Id` order after
    /// `after`. Sets missing keys with the enqueue derivation unless `dry_run`; never changes a
    /// key that is set, and reports what it could not derive.
    async fn backfill_record_keys(
        &self,
        after: Option<EventId>,
        batch: u32,
        dry_run: bool,
    ) -> Result<BackfillPage>;

    /// Counts by status, the oldest pending age, stale claims and blocked keys.
    async fn stats(&self, policy: ClaimPolicy) -> Result<OutboxStats>;

    /// Returns `failed` rows to `pending` with `RetryCount` 0 (operator action); the number of
    /// rows changed. A retried row keeps its place in its key's order: younger rows of its key
    /// that have not run yet wait for it, and it waits while another row of its key is in
    /// flight (it never runs beside it).
    async fn retry_failed(&self, filter: RetryFilter) -> Result<u64>;

    /// [`OutboxRepository::retry_failed`] by an operator: the retry and its audit row
    /// ([`OutboxRepository::audit_log`], action `retry`, naming `actor`) commit together.
    async fn retry_failed_by(&self, filter: RetryFilter, actor: &str) -> Result<u64>;

    /// Pauses `event_type` on behalf of `actor`: every dispatcher stops claiming its rows within
    /// its next refresh of the paused types (`outbox_events::PAUSE_REFRESH`); a record whose
    /// head is of that type waits behind it in order. `false` when it was paused already
    /// (nothing written). The pause and its audit row commit together.
    async fn pause_event_type(&self, event_type: &str, actor: &str) -> Result<bool>;

    /// Resumes a paused `event_type` on behalf of `actor` (audited); `false` when it was not
    /// paused. Nothing else is needed: its rows are claimable again at the next refresh.
    async fn resume_event_type(&self, event_type: &str, actor: &str) -> Result<bool>;

    /// The paused event types, by name.
    async fn paused_event_types(&self) -> Result<Vec<PausedType>>;

    /// The newest `limit` operator actions (pauses, resumes, retries), newest first.
    async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>>;

    /// Reads one row.
    async fn get_event(&self, id: EventId) -> Result<Option<OutboxEvent>>;

    /// Lists the rows `filter` selects, without their payloads, oldest first (`CreatedDate`,
    /// then `Id`): for operators (`outbox events`) and for tools that watch rows change
    /// between polls ([`EventRow`]'s timestamps are the stored values exactly). Reads only,
    /// takes no lock. On SQLite a row that other code wrote and this code cannot read is left
    /// out, with a warning, as `get_pending_events` does (the claim that meets it fails it).
    async fn list_events(&self, filter: EventFilter) -> Result<Vec<EventRow>>;

    /// A record's rows as its page shows them ([`key_report`]): the oldest `limit` non-terminal
    /// rows of `record_key` (through `outbox_record_key_idx`), how many there are (counted up to
    /// [`KEY_ROWS_COUNTED`]), and its newest `failed` row (through
    /// `outbox_failed_by_record_idx`). Every read is bounded, however many rows the key has.
    /// Reads only, takes no lock.
    async fn key_page(&self, record_key: &str, limit: u32) -> Result<KeyPage>;

    /// The queue's clock now: the database's `clock_timestamp()` on PostgreSQL, the host's
    /// clock on SQLite (each with the test clock shift), the time every queue statement uses.
    async fn clock_now(&self) -> Result<DateTime<Utc>>;

    /// The keys with rows waiting behind a head that has not finished, the longest wait first
    /// (at most `limit`), each with its head's state under `policy` (see [`KeyReport`] for
    /// one key's whole picture). For operators: it reads every non-terminal row.
    async fn blocked_keys(&self, policy: ClaimPolicy, limit: u32) -> Result<Vec<BlockedKey>>;

    /// Waits until an enqueue may have happened (PostgreSQL `LISTEN/NOTIFY`) or `timeout`
    /// passed. Backends without notifications just wait `timeout`. A wake-up that comes while
    /// the caller is not waiting (during its claim) is not seen: a worker uses
    /// [`OutboxRepository::wake_mark`] and [`OutboxRepository::wait_for_work_since`].
    async fn wait_for_work(&self, timeout: Duration) -> Result<()>;

    /// Where this repository's wake-ups stand: read it before a claim, and pass it to
    /// [`OutboxRepository::wait_for_work_since`] when the claim found nothing. Both backends
    /// count their wake-ups (PostgreSQL's notifications, SQLite's in-process enqueues); the
    /// default, for a repository without them, never moves.
    fn wake_mark(&self) -> WakeMark {
        WakeMark::default()
    }

    /// [`OutboxRepository::wait_for_work`], except that it returns at once when a wake-up came
    /// after `since` was read (while the caller's claim ran, whose snapshot may predate the
    /// woken row's commit).
    async fn wait_for_work_since(&self, since: WakeMark, timeout: Duration) -> Result<()> {
        let _ = since;
        self.wait_for_work(timeout).await
    }

    /// Retention: deletes one batch of terminal rows that `policy` lets go (at most
    /// `batch_size` `processed` rows, then at most `batch_size` `failed` rows, each batch in
    /// one short transaction of its own), oldest first. Never touches a `pending` or
    /// `processing` row. Call it again while the report says `more`. Concurrent callers, in
    /// this process or others, take disjoint batches (PostgreSQL: `FOR UPDATE SKIP LOCKED`;
    /// SQLite: one writer at a time) and never wait for each other's rows. See
    /// `docs/retention.md`.
    async fn prune(&self, policy: PrunePolicy) -> Result<PruneReport>;

    /// A dry run of retention: counts every row [`OutboxRepository::prune`] would delete now
    /// under `policy` (all batches), changing nothing. `more` is `false`.
    async fn count_prunable(&self, policy: PrunePolicy) -> Result<PruneReport>;

    /// Puts the heads table right for at most `max_keys` keys whose head differs from the
    /// outbox rows: a head out of place moves to its key's oldest non-terminal row, a head
    /// whose key has none left is deleted, a key with non-terminal rows and no head gets one.
    /// Never waits for a lock: a head another transaction holds is left for the next call.
    /// The claim never depends on a head's position (it reads each key's oldest row itself),
    /// so this is upkeep, not a precondition; the dispatcher calls it periodically
    /// (`WorkerConfig::heads_repair`) and counts what it changed. On PostgreSQL one caller
    /// repairs at a time (others get [`HeadsRepair::skipped`]).
    async fn repair_heads(&self, max_keys: u32) -> Result<HeadsRepair>;
}

/// The attempt transaction of one claimed row. The handler's effects go through
/// [`Attempt::tx`]; the bookkeeping writes are fenced like every other write.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait Attempt: Send {
    /// The open transaction, for the handler's effects.
    fn tx(&mut self) -> &mut Tx;

    /// Rolls back to the post-claim savepoint (in a batch, the segment's: every handler's
    /// effects in it are undone), the transaction stays open for bookkeeping.
    async fn rollback_to_savepoint(&mut self) -> Result<()>;

    /// Takes an event's savepoint in a batch's segment (`outbox_event`; the post-claim one
    /// stays): what the events before it kept stays when that event rolls back to it
    /// ([`Attempt::rollback_to_event_savepoint`]).
    async fn savepoint(&mut self) -> Result<()>;

    /// Rolls back to the latest event's savepoint ([`Attempt::savepoint`]): that handler's
    /// effects are undone, the earlier ones' stay.
    async fn rollback_to_event_savepoint(&mut self) -> Result<()>;

    /// [`Attempt::savepoint`] for a later handler of shared writes (docs/state-machine.md,
    /// "Batched attempts", rule 11): lock waits bounded by `bound` first, in one round trip.
    async fn bounded_savepoint(&mut self, bound: std::time::Duration) -> Result<()>;

    /// The attempt's lock timeout again, after a shared segment's bounded handlers.
    async fn unbound_lock_waits(&mut self) -> Result<()>;

    /// Back to `pending` in this transaction, `RetryCount` unchanged, fenced: a batch's event
    /// not counted (it did not run, or its handler succeeded and its `processed` write failed).
    async fn release(&mut self, fence: Fence, error: &str) -> Result<FenceOutcome>;

    /// `processed`, in this transaction, fenced.
    async fn mark_processed(&mut self, fence: Fence) -> Result<FenceOutcome>;

    /// `processed` for several claims, in this transaction, each fenced: one outcome per
    /// fence, in order (PostgreSQL: one statement; a batched attempt's settle).
    async fn mark_processed_many(&mut self, fences: Vec<Fence>) -> Result<Vec<FenceOutcome>>;

    /// [`Attempt::mark_processed_many`] for a batch that holds two or more rows of a record (a
    /// chain): no row of a record is written while an older row of it outside `fences` is not
    /// terminal (an operator retry, or a row other code wrote, since the batch began); such a
    /// row is reported [`FenceOutcome::Lost`] though it still carries its fence, for the
    /// caller to read back (docs/state-machine.md, "Batched attempts", rule 3).
    async fn mark_processed_chains(&mut self, fences: Vec<Fence>) -> Result<Vec<FenceOutcome>> {
        self.mark_processed_many(fences).await
    }

    /// Retry or failed state, in this transaction, fenced.
    async fn record_failure(
        &mut self,
        fence: Fence,
        bookkeeping: FailureBookkeeping,
        error: &str,
    ) -> Result<FenceOutcome>;

    /// Commits the attempt.
    async fn commit(&mut self) -> Result<()>;

    /// Rolls the attempt back (abandoned: the claim stays for its holder or for stale
    /// reclaim).
    async fn rollback(&mut self) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::clip_error;

    #[test]
    fn error_text_is_storable_and_bounded() {
        assert_eq!(clip_error("a\0b"), "a\u{FFFD}b");
        let long = "é".repeat(3000);
        let clipped = clip_error(&long);
        assert!(clipped.len() <= 2003 && clipped.ends_with('…'));
        assert_eq!(clip_error("fine"), "fine");
    }
}
