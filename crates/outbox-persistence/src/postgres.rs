//! The PostgreSQL repository: the production backend.
//!
//! Claims use one statement: the design's eligible-row selection with `FOR UPDATE SKIP LOCKED`
//! feeding the `pending`/stale `processing` -> `processing` update, so concurrent workers skip
//! each other's rows instead of queueing behind them. Idle workers wake on `LISTEN outbox_event`
//! (a statement-level trigger notifies on enqueue).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::types::PgInterval;
use sqlx::postgres::{PgListener, PgRow};
use sqlx::{PgPool, Row};
use tokio::sync::{Notify, OnceCell};

use crate::{
    Attempt, BackfillPage, Claim, ClaimPolicy, ClockShift, Error, EventId, EventStatus,
    FailureBookkeeping, Fence, FenceOutcome, NewEvent, OutboxEvent, OutboxRepository, OutboxStats,
    Result, RetryFilter, Scope, Terminal, Tx, clip_error, new_event_id,
};

/// The notification channel the enqueue trigger signals.
pub const NOTIFY_CHANNEL: &str = "outbox_event";

const COLUMNS: &str = "Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError";

/// The design's eligible-event query, as written in the design (identifiers unquoted).
pub const ELIGIBLE_QUERY: &str = "\
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent e
WHERE
  (e.Status = 'pending'
   OR (e.Status = 'processing' AND e.LastModifiedDate < $1))
  AND (e.Status <> 'pending'
       OR e.RetryCount = 0
       OR e.LastModifiedDate < $2)
  AND (
    e.RecordKey IS NULL
    OR NOT EXISTS (
      SELECT 1
      FROM _System_OutboxEvent older
      WHERE older.RecordKey = e.RecordKey
        AND (
          older.CreatedDate < e.CreatedDate
          OR (older.CreatedDate = e.CreatedDate AND older.Id < e.Id)
        )
        AND older.Status NOT IN ('processed', 'failed')
    )
  )
ORDER BY e.CreatedDate ASC, e.Id ASC
LIMIT $3";

/// How many of the oldest non-terminal rows `claim_next` inspects before it falls back to
/// generating candidates per key. More than the workers that can hold a claim at once, so that
/// in a flowing queue the oldest eligible row is almost always inside this prefix. The query
/// spells it as `LIMIT 64`.
pub const CLAIM_PREFIX_ROWS: u32 = 64;

/// The advisory-lock namespace of enqueue's per-record lock (the first key of the two-key form
/// `pg_advisory_xact_lock(int, int)`, whose lock space never overlaps the one-key form an
/// application may use). The second key is a stable hash of the `RecordKey`.
pub const ENQUEUE_LOCK_NAMESPACE: i32 = 3477;

/// How long a row returned to `pending` by `retry_failed` waits before it may be claimed: its
/// `LastModifiedDate` is set this far ahead, and a pending row is never claimed before its
/// `LastModifiedDate`. A claim statement that read the row as still `failed` and is claiming a
/// younger row of its record has committed long before (claims never wait on locks), so the
/// retried row then sees that row running and waits for it (the in-flight guard).
pub const RETRY_NOT_BEFORE: Duration = Duration::from_secs(2);

/// The SQLSTATE `_System_OutboxCheckFence` raises when an attempt's claim was taken over
/// before the attempt began.
pub const CLAIM_LOST_SQLSTATE: &str = "OB001";

/// The database's time, shifted by the repository's [`ClockShift`] (`$1`; zero unless a test
/// moved it). Every queue timestamp on PostgreSQL is this expression.
macro_rules! db_now {
    () => {
        "(clock_timestamp() + $1::interval)"
    };
}

/// The design's state rules for the candidate `e`: `pending` (a retried row once its retry
/// delay passed, any row from its `LastModifiedDate` on) or a stale `processing` row. Needs a
/// `clock` CTE, stale-after `$2` and the retry delay `$3`.
macro_rules! claimable_state {
    () => {
        "    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
"
    };
}

/// The design's ordering rule for the candidate `e` (no older non-terminal row of its key; the
/// `(CreatedDate, Id)` comparison as a row comparison, which the index bounds) and the
/// in-flight guard.
macro_rules! key_order {
    () => {
        concat!(
            "    AND (
      e.RecordKey IS NULL
      OR (NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent older
        WHERE older.RecordKey = e.RecordKey
          AND (older.CreatedDate, older.Id) < (e.CreatedDate, e.Id)
          AND older.Status NOT IN ('processed', 'failed')
      )
",
            in_flight_guard!(),
            "      )
    )
"
        )
    };
}

/// The candidate selection of `claim_next`: the design's eligible set and order, computed so
/// that its cost does not grow with the backlog or with one hot key (see `docs/queries.md`).
///
/// 1. `in_prefix`: the design's query over the oldest [`CLAIM_PREFIX_ROWS`] non-terminal rows.
///    Every row older than the oldest eligible one is non-terminal and inside that prefix, so a
///    hit here is the oldest eligible row overall. The same-key probe is the design's
///    `NOT EXISTS`, with the `(CreatedDate, Id)` comparison written as a row comparison so that
///    the index bounds it: a key's head costs one index descent, not a walk of its backlog.
/// 2. `by_head` (only when the prefix holds nothing claimable, for example a hot key's backlog
///    fills it): a keyed row is eligible only as the first non-terminal row of its key, so the
///    candidates are each key's head (a skip scan over `outbox_record_key_idx`, one descent per
///    key with non-terminal rows) and the unkeyed rows, sorted first (`OFFSET 0` keeps the
///    planner from sorting after the join) and then checked oldest first until one is
///    claimable. A blocked key's backlog is never walked; the cost is one descent per key.
///
/// Both add the in-flight guard to the design's rule: a keyed row is never claimed while
/// another row of its key is `processing` with a live heartbeat, whichever path made it
/// eligible (an operator retry of an older row, an older row written late by other code).
/// `outbox_in_flight_idx` answers it with one probe.
///
/// Time is the database's (`clock` below, read once per statement). Parameters: `$1` the clock
/// shift, `$2` stale-after, `$3` retry delay (intervals), `$4` `MaxRetryAttempts`; `$scope` is
/// spliced in twice, empty for [`Scope::All`] (so that the statement has no parameter that
/// changes its plan) or `scope_filter!()`.
macro_rules! claim_candidate {
    ($($scope:tt)*) => {
        concat!(
            "\
WITH RECURSIVE
clock AS (SELECT ", db_now!(), " AS now),
heads AS (
  (SELECT h.RecordKey, h.CreatedDate, h.Id
   FROM _System_OutboxEvent h
   WHERE h.RecordKey IS NOT NULL AND h.Status NOT IN ('processed', 'failed')
   ORDER BY h.RecordKey, h.CreatedDate, h.Id
   LIMIT 1)
  UNION ALL
  SELECT n.RecordKey, n.CreatedDate, n.Id
  FROM heads p
  CROSS JOIN LATERAL (
    SELECT x.RecordKey, x.CreatedDate, x.Id
    FROM _System_OutboxEvent x
    WHERE x.RecordKey > p.RecordKey AND x.Status NOT IN ('processed', 'failed')
    ORDER BY x.RecordKey, x.CreatedDate, x.Id
    LIMIT 1
  ) n
),
in_prefix AS (
  SELECT e.Id, e.Status AS old_status
  FROM (
    SELECT w.Id, w.CreatedDate
    FROM _System_OutboxEvent w
    WHERE w.Status NOT IN ('processed', 'failed')
    ORDER BY w.CreatedDate, w.Id
    LIMIT 64
  ) w
  JOIN _System_OutboxEvent e ON e.Id = w.Id
  WHERE
",
            claimable_state!(),
            key_order!(),
            $($scope)*,
            "  ORDER BY w.CreatedDate, w.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
by_head AS (
  SELECT e.Id, e.Status AS old_status
  FROM (
    SELECT heads.Id, heads.CreatedDate FROM heads
    UNION ALL
    SELECT u.Id, u.CreatedDate
    FROM _System_OutboxEvent u
    WHERE u.RecordKey IS NULL AND u.Status NOT IN ('processed', 'failed')
    ORDER BY 2, 1
    OFFSET 0
  ) c
  JOIN _System_OutboxEvent e ON e.Id = c.Id
  WHERE
",
            claimable_state!(),
            "    AND (e.RecordKey IS NULL OR (TRUE
",
            in_flight_guard!(),
            "    ))
",
            $($scope)*,
            "  ORDER BY c.CreatedDate, c.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
candidate AS (
  SELECT Id, old_status FROM in_prefix
  UNION ALL
  SELECT Id, old_status FROM by_head
  LIMIT 1
)"
        )
    };
}

/// No other row of the candidate `e`'s key is `processing` with a live heartbeat (needs a
/// `clock` CTE and the stale-after interval as `$2`).
macro_rules! in_flight_guard {
    () => {
        "      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
"
    };
}

/// The scope predicates of a narrowed claim: `$5` event types only, `$6` event types except.
macro_rules! scope_filter {
    () => {
        "    AND ($5::text[] IS NULL OR e.EventType = ANY($5))
    AND ($6::text[] IS NULL OR e.EventType <> ALL($6))
"
    };
}

/// The claim itself: the candidate moves to `processing`, its `LastModifiedDate` strictly
/// forward. A stale `processing` candidate's previous attempt died without bookkeeping: it is
/// counted as a failed attempt, and when that count reaches `MaxRetryAttempts` (`$4`) the row
/// ends `failed` instead of being claimed, so an event that kills its worker ends.
macro_rules! claim_update {
    () => {
        "
UPDATE _System_OutboxEvent t
SET Status = CASE WHEN c.old_status = 'processing' AND t.RetryCount + 1 >= $4
                  THEN 'failed' ELSE 'processing' END,
    RetryCount = t.RetryCount + CASE WHEN c.old_status = 'processing' THEN 1 ELSE 0 END,
    LastError = CASE WHEN c.old_status = 'processing'
                     THEN format('worker died: attempt %s stopped heartbeating (last beat %s) and wrote no outcome; counted as a failed attempt',
                                 t.RetryCount + 1, t.LastModifiedDate)
                     ELSE t.LastError END,
    LastModifiedDate = GREATEST((SELECT now FROM clock), t.LastModifiedDate + interval '1 microsecond')
FROM candidate c
WHERE t.Id = c.Id
RETURNING t.Id, t.EventType, t.Payload, t.Status, t.RetryCount, t.RecordKey, t.CreatedDate,
          t.LastModifiedDate, t.LastError, c.old_status"
    };
}

/// Select-and-claim in one statement: the candidate selection above locks its row with
/// `FOR UPDATE OF e SKIP LOCKED` and the update moves it to `processing`. Parameters: `$1` the
/// clock shift, `$2` stale-after, `$3` retry delay, `$4` `MaxRetryAttempts`, `$5`/`$6` the
/// scope's event types.
pub const CLAIM_NEXT: &str = concat!(claim_candidate!(scope_filter!()), claim_update!());

/// [`CLAIM_NEXT`] for [`Scope::All`]: the same statement without the scope predicates.
/// Parameters: `$1` the clock shift, `$2` stale-after, `$3` retry delay, `$4`
/// `MaxRetryAttempts`.
pub const CLAIM_NEXT_ALL: &str = concat!(claim_candidate!(""), claim_update!());

/// `ClaimEvent` by id, with the same rules as `claim_next` (retry delay, stale reclaim counted,
/// the key's ordering and in-flight guard). Parameters: `$1`..`$4` as [`CLAIM_NEXT`], `$5` the id.
const CLAIM_EVENT: &str = concat!(
    "\
WITH clock AS (SELECT ",
    db_now!(),
    " AS now),
candidate AS (
  SELECT e.Id, e.Status AS old_status
  FROM _System_OutboxEvent e
  WHERE e.Id = $5 AND
",
    claimable_state!(),
    key_order!(),
    "  FOR UPDATE OF e SKIP LOCKED
)",
    claim_update!()
);

/// The design's eligible-event query with the in-flight guard and the database's clock: what
/// `get_pending_events` runs. Parameters: `$1` the clock shift, `$2` stale-after, `$3` retry
/// delay, `$4` limit, `$5`/`$6` the scope's event types (NULL for none).
const ELIGIBLE_GUARDED: &str = concat!(
    "\
WITH clock AS (SELECT ",
    db_now!(),
    " AS now)
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent e
WHERE
",
    claimable_state!(),
    key_order!(),
    "  AND ($5::text[] IS NULL OR e.EventType = ANY($5))
  AND ($6::text[] IS NULL OR e.EventType <> ALL($6))
ORDER BY e.CreatedDate ASC, e.Id ASC
LIMIT $4"
);

/// Bounds the statement's lock waits by the outbox's own lock timeout (parameter `$n`, text
/// such as `5000ms`), for this statement's transaction only: the outbox never sets
/// `lock_timeout` on a session, which the application may share. An uncorrelated subquery, so
/// it runs once, before the statement waits for any row.
macro_rules! lock_guard {
    ($n:literal) => {
        concat!(
            "\n  AND (SELECT set_config('lock_timeout', $",
            $n,
            ", true)) IS NOT NULL"
        )
    };
}

const HEARTBEAT: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET LastModifiedDate = GREATEST(",
    db_now!(),
    ", LastModifiedDate + interval '1 microsecond')
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("4"),
    "
RETURNING LastModifiedDate"
);

const MARK_PROCESSED: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET Status = 'processed',
    LastModifiedDate = GREATEST(",
    db_now!(),
    ", LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("4")
);

const MARK_FAILED: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET Status = 'failed',
    RetryCount = RetryCount + 1,
    LastModifiedDate = GREATEST(",
    db_now!(),
    ", LastModifiedDate + interval '1 microsecond'),
    LastError = $4
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("5")
);

/// Back to `pending`: `LastModifiedDate` is the database's time plus the extra backoff (`$5`).
const INCREMENT_RETRY: &str = concat!(
    "\
UPDATE _System_OutboxEvent
SET Status = 'pending',
    RetryCount = RetryCount + 1,
    LastModifiedDate = GREATEST(",
    db_now!(),
    " + $5::interval, LastModifiedDate + interval '1 microsecond'),
    LastError = $4
WHERE Id = $2 AND Status = 'processing' AND LastModifiedDate = $3",
    lock_guard!("6")
);

/// The plans (`EXPLAIN`, nothing run) of the design's eligible query as written and of the
/// claim statement, named, for `outbox explain`.
pub async fn explain(
    pool: &PgPool,
    policy: ClaimPolicy,
) -> Result<Vec<(&'static str, Vec<String>)>> {
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await?;
    let cutoff = |d: Duration| now - chrono::Duration::from_std(d).unwrap_or_default();
    let design: Vec<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {ELIGIBLE_QUERY}")))
            .bind(cutoff(policy.stale_after))
            .bind(cutoff(policy.retry_delay))
            .bind(1_i64)
            .fetch_all(pool)
            .await?;
    // EXPLAIN without ANALYZE runs nothing, so the claim's UPDATE changes no row.
    let no_types: Option<Vec<String>> = None;
    let claim: Vec<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {CLAIM_NEXT}")))
            .bind(interval(0))
            .bind(span(policy.stale_after))
            .bind(span(policy.retry_delay))
            .bind(policy.max_retry_attempts)
            .bind(&no_types)
            .bind(&no_types)
            .fetch_all(pool)
            .await?;
    Ok(vec![
        ("eligible-event query (the design's, as written)", design),
        ("select-and-claim (claim_next)", claim),
    ])
}

/// The PostgreSQL outbox repository.
#[derive(Debug, Clone)]
pub struct PgOutbox {
    pool: PgPool,
    wake: Arc<Wake>,
    shift: ClockShift,
    lock_timeout: Duration,
}

#[derive(Debug, Default)]
struct Wake {
    notify: Notify,
    listener: OnceCell<()>,
}

impl PgOutbox {
    /// A repository over `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            wake: Arc::default(),
            shift: ClockShift::default(),
            lock_timeout: crate::DEFAULT_LOCK_TIMEOUT,
        }
    }

    /// Bounds the lock waits of the outbox's own writes outside attempts (heartbeats, detached
    /// bookkeeping, operator retries) by `lock_timeout` (default [`crate::DEFAULT_LOCK_TIMEOUT`]).
    /// It is set per statement or transaction, never on a session, so the application's own
    /// transactions on the same pool keep their settings.
    pub fn with_lock_timeout(mut self, lock_timeout: Duration) -> Self {
        self.lock_timeout = lock_timeout;
        self
    }

    fn lock_timeout(&self) -> String {
        format!("{}ms", self.lock_timeout.as_millis().max(1))
    }

    /// Shares `shift` as this repository's clock shift (tests move it instead of sleeping).
    pub fn with_clock_shift(mut self, shift: ClockShift) -> Self {
        self.shift = shift;
        self
    }

    fn shift(&self) -> PgInterval {
        interval(self.shift.micros())
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn start_listener(&self) {
        let pool = self.pool.clone();
        let wake = Arc::downgrade(&self.wake);
        self.wake
            .listener
            .get_or_init(|| async move {
                tokio::spawn(async move {
                    loop {
                        let listener = async {
                            let mut l = PgListener::connect_with(&pool).await?;
                            l.listen(NOTIFY_CHANNEL).await?;
                            Ok::<_, sqlx::Error>(l)
                        };
                        let mut listener = match listener.await {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::debug!(error = %e, "outbox listener cannot connect; retrying");
                                if wake.strong_count() == 0 || pool.is_closed() {
                                    return;
                                }
                                tokio::time::sleep(Duration::from_secs(1)).await;
                                continue;
                            }
                        };
                        loop {
                            let received = listener.try_recv().await;
                            let Some(wake) = wake.upgrade() else { return };
                            // A lost connection also wakes the workers: they poll once and
                            // fall back to their poll interval while the listener reconnects.
                            wake.notify.notify_waiters();
                            match received {
                                Ok(Some(_)) => {}
                                Ok(None) => {}
                                Err(_) => break,
                            }
                        }
                        if pool.is_closed() {
                            return;
                        }
                    }
                });
            })
            .await;
    }
}

fn event_from_row(row: &PgRow) -> Result<OutboxEvent> {
    let status: String = row.try_get("status")?;
    Ok(OutboxEvent {
        id: row.try_get("id")?,
        event_type: row.try_get("eventtype")?,
        payload: row.try_get("payload")?,
        status: status
            .parse()
            .map_err(|e: String| Error::Database(sqlx::Error::Decode(e.into())))?,
        retry_count: row.try_get("retrycount")?,
        record_key: row.try_get("recordkey")?,
        created_date: row.try_get("createddate")?,
        last_modified_date: row.try_get("lastmodifieddate")?,
        last_error: row.try_get("lasterror")?,
    })
}

fn claim_from_row(row: &PgRow) -> Result<Claim> {
    let event = event_from_row(row)?;
    let old_status: String = row.try_get("old_status")?;
    Ok(Claim {
        fence: Fence {
            id: event.id,
            last_written: event.last_modified_date,
        },
        reclaimed: old_status == "processing",
        event,
    })
}

fn pg_tx(tx: &mut Tx) -> Result<&mut sqlx::Transaction<'static, sqlx::Postgres>> {
    match tx {
        Tx::Postgres(tx) => Ok(tx),
        other => Err(Error::BackendMismatch {
            expected: "postgres",
            given: other.backend_name(),
        }),
    }
}

fn outcome(rows: u64) -> FenceOutcome {
    if rows == 1 {
        FenceOutcome::Written
    } else {
        FenceOutcome::Lost
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

/// Whether a returned claim row is a real claim: a stale row whose dead attempt used up
/// `MaxRetryAttempts` comes back `failed` instead.
fn claimed_or_exhausted(row: &PgRow) -> Result<Option<Claim>> {
    let claim = claim_from_row(row)?;
    if claim.event.status == EventStatus::Failed {
        tracing::warn!(
            event_id = %claim.event.id,
            event_type = %claim.event.event_type,
            retry_count = claim.event.retry_count,
            "a stale claim used up MaxRetryAttempts (its worker died on every attempt): the event is failed"
        );
        return Ok(None);
    }
    Ok(Some(claim))
}

/// How many exhausted stale rows one `claim_next` call fails before it reports nothing to
/// claim (the worker calls again at once after an empty answer only when woken).
const MAX_EXHAUSTED_PER_CLAIM: usize = 16;

/// Inserts `events` in the caller's transaction, deriving each `RecordKey`, with the
/// database's clock, in one statement. Before `CreatedDate` is drawn it takes the records'
/// enqueue locks (see `docs/state-machine.md`), held to the end of the caller's transaction, so one
/// record's events are ordered as their transactions commit: an enqueue that waits for another
/// transaction of the same record draws its `CreatedDate` after that one committed. Ids
/// increase in the order given, breaking ties.
pub async fn enqueue(conn: &mut sqlx::PgConnection, events: &[NewEvent]) -> Result<Vec<EventId>> {
    enqueue_shifted(conn, events, &ClockShift::default()).await
}

/// The advisory-lock namespace of the lock buckets enqueue takes (one of 64 per record key).
pub const ENQUEUE_BUCKET_NAMESPACE: i32 = 3478;

/// How many lock buckets the record keys hash into.
const ENQUEUE_BUCKETS: u32 = 64;

/// Up to this many distinct records, an enqueue locks each record; beyond, whole buckets.
const ENQUEUE_KEY_LOCKS_MAX: usize = 32;

/// The transaction-scoped advisory locks an enqueue of `keys` takes, in the order to take
/// them: `(namespace, id, shared)`. A few records: each record's bucket in shared mode, then
/// each record exclusively (`ENQUEUE_LOCK_NAMESPACE`, a hash of the key), so enqueues of
/// different records never wait for each other. Many records (a bulk enqueue): each of their
/// buckets exclusively, so a transaction never holds more than [`ENQUEUE_BUCKETS`] locks (the
/// server's lock table is finite) and still excludes every other enqueue of its records. All in
/// ascending order, buckets first, so two enqueues never deadlock on these locks.
fn enqueue_locks<'a>(keys: impl Iterator<Item = &'a str>) -> Vec<(i32, i32, bool)> {
    let hashes: std::collections::BTreeSet<i32> = keys.map(key_hash).collect();
    let buckets: std::collections::BTreeSet<i32> = hashes
        .iter()
        .map(|h| (*h as u32 % ENQUEUE_BUCKETS) as i32)
        .collect();
    if hashes.len() > ENQUEUE_KEY_LOCKS_MAX {
        return buckets
            .into_iter()
            .map(|b| (ENQUEUE_BUCKET_NAMESPACE, b, false))
            .collect();
    }
    buckets
        .into_iter()
        .map(|b| (ENQUEUE_BUCKET_NAMESPACE, b, true))
        .chain(
            hashes
                .into_iter()
                .map(|h| (ENQUEUE_LOCK_NAMESPACE, h, false)),
        )
        .collect()
}

/// A stable 32-bit hash of a record key (FNV-1a): the same in every process and release.
fn key_hash(key: &str) -> i32 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in key.bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash as i32
}

async fn enqueue_shifted(
    conn: &mut sqlx::PgConnection,
    events: &[NewEvent],
    shift: &ClockShift,
) -> Result<Vec<EventId>> {
    let mut ids = Vec::with_capacity(events.len());
    let mut types = Vec::with_capacity(events.len());
    let mut payloads = Vec::with_capacity(events.len());
    let mut keys = Vec::with_capacity(events.len());
    for event in events {
        let key =
            record_key::record_key_from_payload(&event.payload).map_err(Error::InvalidPayload)?;
        ids.push(new_event_id());
        types.push(event.event_type.as_str());
        payloads.push(event.payload.as_str());
        keys.push(key.map(record_key::RecordKey::into_string));
    }
    if ids.is_empty() {
        return Ok(ids);
    }
    let locks = enqueue_locks(keys.iter().flatten().map(String::as_str));
    let (lock_spaces, lock_ids, lock_shared): (Vec<i32>, Vec<i32>, Vec<bool>) =
        locks.into_iter().fold(
            (Vec::new(), Vec::new(), Vec::new()),
            |(mut a, mut b, mut c), (space, id, shared)| {
                a.push(space);
                b.push(id);
                c.push(shared);
                (a, b, c)
            },
        );
    // The locks CTE is materialized and joined, so every lock is held before any row's
    // CreatedDate is drawn (each row reads the clock as it is inserted).
    sqlx::query(concat!(
        "WITH locks AS MATERIALIZED (
           SELECT count((CASE WHEN l.shared THEN pg_advisory_xact_lock_shared(l.space, l.id)
                              ELSE pg_advisory_xact_lock(l.space, l.id) END)::text) AS taken
           FROM UNNEST($6::int4[], $7::int4[], $8::bool[]) AS l(space, id, shared)
         )
         INSERT INTO _System_OutboxEvent
           (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
         SELECT n.id, n.event_type, n.payload, 'pending', 0, n.record_key, n.created, n.created
         FROM locks,
              LATERAL (
                SELECT u.*, ",
        db_now!(),
        " AS created
                FROM UNNEST($2::uuid[], $3::text[], $4::text[], $5::text[])
                  WITH ORDINALITY AS u(id, event_type, payload, record_key, ord)
              ) n
         WHERE locks.taken >= 0
         ORDER BY n.ord"
    ))
    .bind(interval(shift.micros()))
    .bind(&ids)
    .bind(&types)
    .bind(&payloads)
    .bind(&keys)
    .bind(&lock_spaces)
    .bind(&lock_ids)
    .bind(&lock_shared)
    .execute(conn)
    .await?;
    Ok(ids)
}

#[async_trait]
impl OutboxRepository for PgOutbox {
    fn backend_name(&self) -> &'static str {
        "postgres"
    }

    async fn begin(&self) -> Result<Tx> {
        Ok(Tx::Postgres(self.pool.begin().await?))
    }

    async fn enqueue(&self, tx: &mut Tx, events: &[NewEvent]) -> Result<Vec<EventId>> {
        enqueue_shifted(pg_tx(tx)?, events, &self.shift).await
    }

    async fn get_pending_events(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>> {
        let rows = sqlx::query(ELIGIBLE_GUARDED)
            .bind(self.shift())
            .bind(span(policy.stale_after))
            .bind(span(policy.retry_delay))
            .bind(i64::from(limit))
            .bind(scope.only())
            .bind(scope.except())
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(event_from_row).collect()
    }

    async fn claim_event(&self, id: EventId, policy: ClaimPolicy) -> Result<Option<Claim>> {
        let row = sqlx::query(CLAIM_EVENT)
            .bind(self.shift())
            .bind(span(policy.stale_after))
            .bind(span(policy.retry_delay))
            .bind(policy.max_retry_attempts)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(row) => claimed_or_exhausted(&row),
            None => Ok(None),
        }
    }

    async fn claim_next(&self, policy: ClaimPolicy, scope: &Scope) -> Result<Option<Claim>> {
        for _ in 0..MAX_EXHAUSTED_PER_CLAIM {
            let query = match scope {
                Scope::All => sqlx::query(CLAIM_NEXT_ALL),
                _ => sqlx::query(CLAIM_NEXT),
            };
            let query = query
                .bind(self.shift())
                .bind(span(policy.stale_after))
                .bind(span(policy.retry_delay))
                .bind(policy.max_retry_attempts);
            let query = match scope {
                Scope::All => query,
                _ => query.bind(scope.only()).bind(scope.except()),
            };
            let Some(row) = query.fetch_optional(&self.pool).await? else {
                return Ok(None);
            };
            if let Some(claim) = claimed_or_exhausted(&row)? {
                return Ok(Some(claim));
            }
        }
        Ok(None)
    }

    async fn heartbeat(&self, fence: Fence) -> Result<Option<Fence>> {
        let written: Option<DateTime<Utc>> = sqlx::query_scalar(HEARTBEAT)
            .bind(self.shift())
            .bind(fence.id)
            .bind(fence.last_written)
            .bind(self.lock_timeout())
            .fetch_optional(&self.pool)
            .await?;
        Ok(written.map(|last_written| Fence {
            id: fence.id,
            last_written,
        }))
    }

    async fn begin_attempt(
        &self,
        lock_timeout: Duration,
        fence: Fence,
    ) -> Result<Option<Box<dyn Attempt>>> {
        // One round trip: the fence check (raises CLAIM_LOST_SQLSTATE when the claim was
        // taken over meanwhile), BEGIN, the attempt's lock timeout and the post-claim savepoint.
        // The check comes first: when it raises, the statements after it never run and the
        // connection is left idle, not inside a failed transaction (a read that precedes BEGIN
        // in one query string joins the transaction BEGIN opens). The values are a UUID and a
        // timestamp this code formats itself.
        let ms = lock_timeout.as_millis().max(1);
        let begin = format!(
            "SELECT _System_OutboxCheckFence('{}'::uuid, '{}'::timestamptz); \
             BEGIN; SET LOCAL lock_timeout = '{ms}ms'; SAVEPOINT outbox_claimed",
            fence.id,
            fence
                .last_written
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        );
        match self.pool.begin_with(sqlx::AssertSqlSafe(begin)).await {
            Ok(tx) => Ok(Some(Box::new(PgAttempt {
                tx: Some(Tx::Postgres(tx)),
                shift: self.shift.clone(),
                lock_timeout: format!("{ms}ms"),
            }))),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(CLAIM_LOST_SQLSTATE) => {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn increment_retry(
        &self,
        fence: Fence,
        extra_delay: Duration,
        error: &str,
    ) -> Result<FenceOutcome> {
        let rows = sqlx::query(INCREMENT_RETRY)
            .bind(self.shift())
            .bind(fence.id)
            .bind(fence.last_written)
            .bind(clip_error(error))
            .bind(span(extra_delay))
            .bind(self.lock_timeout())
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(outcome(rows))
    }

    async fn update_status(
        &self,
        fence: Fence,
        status: Terminal,
        error: Option<String>,
    ) -> Result<FenceOutcome> {
        let query = match status {
            Terminal::Processed => sqlx::query(MARK_PROCESSED)
                .bind(self.shift())
                .bind(fence.id)
                .bind(fence.last_written)
                .bind(self.lock_timeout()),
            Terminal::Failed => sqlx::query(MARK_FAILED)
                .bind(self.shift())
                .bind(fence.id)
                .bind(fence.last_written)
                .bind(clip_error(error.as_deref().unwrap_or("failed")))
                .bind(self.lock_timeout()),
        };
        let rows = query.execute(&self.pool).await?.rows_affected();
        Ok(outcome(rows))
    }

    async fn backfill_record_keys(
        &self,
        after: Option<EventId>,
        batch: u32,
        dry_run: bool,
    ) -> Result<BackfillPage> {
        let rows = sqlx::query(
            "SELECT Id, Payload, RecordKey FROM _System_OutboxEvent
             WHERE Status NOT IN ('processed', 'failed') AND ($1::uuid IS NULL OR Id > $1)
             ORDER BY Id LIMIT $2",
        )
        .bind(after)
        .bind(i64::from(batch))
        .fetch_all(&self.pool)
        .await?;
        let scanned: Vec<(EventId, String, Option<String>)> = rows
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
            .collect::<Result<_, sqlx::Error>>()?;
        let (mut page, updates) = crate::classify_backfill(&scanned, batch);
        if !dry_run && !updates.is_empty() {
            let ids: Vec<EventId> = updates.iter().map(|(id, _)| *id).collect();
            let keys: Vec<&str> = updates.iter().map(|(_, k)| k.as_str()).collect();
            let done = sqlx::query(
                "UPDATE _System_OutboxEvent t SET RecordKey = u.key
                 FROM UNNEST($1::uuid[], $2::text[]) AS u(id, key)
                 WHERE t.Id = u.id AND t.RecordKey IS NULL",
            )
            .bind(&ids)
            .bind(&keys)
            .execute(&self.pool)
            .await?
            .rows_affected();
            page.updated = done;
        }
        Ok(page)
    }

    async fn stats(&self, policy: ClaimPolicy) -> Result<OutboxStats> {
        let mut stats = OutboxStats::default();
        let counts =
            sqlx::query("SELECT Status, count(*) FROM _System_OutboxEvent GROUP BY Status")
                .fetch_all(&self.pool)
                .await?;
        for row in counts {
            let status: String = row.try_get(0)?;
            let n: i64 = row.try_get(1)?;
            let n = n as u64;
            match status.as_str() {
                "pending" => stats.pending = n,
                "processing" => stats.processing = n,
                "processed" => stats.processed = n,
                "failed" => stats.failed = n,
                _ => {}
            }
        }
        let row = sqlx::query(concat!(
            "WITH clock AS (SELECT ",
            db_now!(),
            " AS now)
             SELECT
               (SELECT EXTRACT(EPOCH FROM ((SELECT now FROM clock) - min(CreatedDate)))::float8
                  FROM _System_OutboxEvent WHERE Status = 'pending'),
               (SELECT count(*) FROM _System_OutboxEvent
                  WHERE Status = 'processing'
                    AND LastModifiedDate < (SELECT now FROM clock) - $2::interval),
               (SELECT count(*) FROM _System_OutboxEvent
                  WHERE Status = 'pending' AND RetryCount > 0)"
        ))
        .bind(self.shift())
        .bind(span(policy.stale_after))
        .fetch_one(&self.pool)
        .await?;
        stats.oldest_pending_age_seconds = row.try_get(0)?;
        stats.stale_claims = row.try_get::<i64, _>(1)? as u64;
        stats.retrying = row.try_get::<i64, _>(2)? as u64;
        let blocked = sqlx::query(concat!(
            "WITH clock AS (SELECT ",
            db_now!(),
            " AS now)
             SELECT
               count(*) FILTER (WHERE h.Status = 'processing'
                                  AND h.LastModifiedDate >= (SELECT now FROM clock) - $2::interval),
               count(*) FILTER (WHERE h.Status = 'processing'
                                  AND h.LastModifiedDate < (SELECT now FROM clock) - $2::interval),
               count(*) FILTER (WHERE h.Status = 'pending' AND h.RetryCount > 0
                                  AND h.LastModifiedDate >= (SELECT now FROM clock) - $3::interval)
             FROM _System_OutboxEvent h
             WHERE h.RecordKey IS NOT NULL AND h.Status NOT IN ('processed', 'failed')
               AND NOT EXISTS (
                 SELECT 1 FROM _System_OutboxEvent o
                 WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
                   AND (o.CreatedDate < h.CreatedDate OR (o.CreatedDate = h.CreatedDate AND o.Id < h.Id)))
               AND EXISTS (
                 SELECT 1 FROM _System_OutboxEvent y
                 WHERE y.RecordKey = h.RecordKey AND y.Status NOT IN ('processed', 'failed')
                   AND (y.CreatedDate > h.CreatedDate OR (y.CreatedDate = h.CreatedDate AND y.Id > h.Id)))"
        ))
        .bind(self.shift())
        .bind(span(policy.stale_after))
        .bind(span(policy.retry_delay))
        .fetch_one(&self.pool)
        .await?;
        stats.keys_blocked_by_running = blocked.try_get::<i64, _>(0)? as u64;
        stats.keys_blocked_by_stale = blocked.try_get::<i64, _>(1)? as u64;
        stats.keys_blocked_by_retry = blocked.try_get::<i64, _>(2)? as u64;
        Ok(stats)
    }

    async fn retry_failed(&self, filter: RetryFilter) -> Result<u64> {
        let (id, all, event_type) = match filter {
            RetryFilter::Id(id) => (Some(id), false, None),
            RetryFilter::Failed { event_type } => (None, true, event_type),
        };
        let mut tx = self
            .pool
            .begin_with(sqlx::AssertSqlSafe(format!(
                "BEGIN; SET LOCAL lock_timeout = '{}'",
                self.lock_timeout()
            )))
            .await?;
        // Wait for every claim that holds a row of the affected keys: it commits first, so the
        // retried row is then seen beside that `processing` row and waits for it (the in-flight
        // guard). A claim that read the row as still `failed` but locks a younger row of its key
        // only after this commits is covered by RETRY_NOT_BEFORE.
        sqlx::query(
            "SELECT 1 FROM _System_OutboxEvent k
             WHERE k.Status NOT IN ('processed', 'failed')
               AND k.RecordKey IN (
                 SELECT f.RecordKey FROM _System_OutboxEvent f
                 WHERE f.Status = 'failed' AND f.RecordKey IS NOT NULL
                   AND (($2 AND ($3::text IS NULL OR f.EventType = $3)) OR f.Id = $1))
             ORDER BY k.Id
             FOR UPDATE OF k",
        )
        .bind(id)
        .bind(all)
        .bind(event_type.as_deref())
        .execute(&mut *tx)
        .await?;
        let rows = sqlx::query(concat!(
            "UPDATE _System_OutboxEvent SET Status = 'pending', RetryCount = 0,
               LastModifiedDate = GREATEST(",
            db_now!(),
            " + $5::interval, LastModifiedDate + interval '1 microsecond')
             WHERE Status = 'failed'
               AND (($3 AND ($4::text IS NULL OR EventType = $4)) OR Id = $2)"
        ))
        .bind(self.shift())
        .bind(id)
        .bind(all)
        .bind(event_type.as_deref())
        .bind(span(RETRY_NOT_BEFORE))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(rows)
    }

    async fn get_event(&self, id: EventId) -> Result<Option<OutboxEvent>> {
        let sql = format!("SELECT {COLUMNS} FROM _System_OutboxEvent WHERE Id = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(event_from_row).transpose()
    }

    async fn wait_for_work(&self, timeout: Duration) -> Result<()> {
        self.start_listener().await;
        let _ = tokio::time::timeout(timeout, self.wake.notify.notified()).await;
        Ok(())
    }
}

/// The attempt transaction on PostgreSQL.
struct PgAttempt {
    tx: Option<Tx>,
    shift: ClockShift,
    /// The attempt's lock timeout, as its bookkeeping statements restate it.
    lock_timeout: String,
}

impl PgAttempt {
    fn conn(&mut self) -> Result<&mut sqlx::PgConnection> {
        match self.tx.as_mut() {
            Some(Tx::Postgres(tx)) => Ok(&mut **tx),
            Some(other) => Err(Error::BackendMismatch {
                expected: "postgres",
                given: other.backend_name(),
            }),
            None => Err(Error::AttemptFinished),
        }
    }
}

#[async_trait]
impl Attempt for PgAttempt {
    fn tx(&mut self) -> &mut Tx {
        self.tx
            .as_mut()
            .expect("the attempt transaction is open until commit or rollback")
    }

    async fn rollback_to_savepoint(&mut self) -> Result<()> {
        sqlx::query("ROLLBACK TO SAVEPOINT outbox_claimed")
            .execute(self.conn()?)
            .await?;
        Ok(())
    }

    async fn mark_processed(&mut self, fence: Fence) -> Result<FenceOutcome> {
        let shift = interval(self.shift.micros());
        let rows = sqlx::query(MARK_PROCESSED)
            .bind(shift)
            .bind(fence.id)
            .bind(fence.last_written)
            .bind(&self.lock_timeout)
            .execute(self.conn()?)
            .await?
            .rows_affected();
        Ok(outcome(rows))
    }

    async fn record_failure(
        &mut self,
        fence: Fence,
        bookkeeping: FailureBookkeeping,
        error: &str,
    ) -> Result<FenceOutcome> {
        let shift = interval(self.shift.micros());
        let query = match bookkeeping {
            FailureBookkeeping::Retry { extra_delay } => sqlx::query(INCREMENT_RETRY)
                .bind(shift)
                .bind(fence.id)
                .bind(fence.last_written)
                .bind(clip_error(error))
                .bind(span(extra_delay))
                .bind(self.lock_timeout.clone()),
            FailureBookkeeping::Fail => sqlx::query(MARK_FAILED)
                .bind(shift)
                .bind(fence.id)
                .bind(fence.last_written)
                .bind(clip_error(error))
                .bind(self.lock_timeout.clone()),
        };
        let rows = query.execute(self.conn()?).await?.rows_affected();
        Ok(outcome(rows))
    }

    async fn commit(&mut self) -> Result<()> {
        self.tx.take().ok_or(Error::AttemptFinished)?.commit().await
    }

    async fn rollback(&mut self) -> Result<()> {
        self.tx
            .take()
            .ok_or(Error::AttemptFinished)?
            .rollback()
            .await
    }
}
