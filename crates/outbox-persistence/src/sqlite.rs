//! The SQLite repository: the embedded default.
//!
//! SQLite has one writer at a time. Claims and attempts take the write lock up front
//! (`BEGIN IMMEDIATE`), so a read-then-write transaction never fails on a stale snapshot; waits
//! are bounded by the busy timeout, which surfaces as [`Error::LockTimeout`]. Timestamps are
//! fixed-width UTC text, so the design's comparisons work on them as written; a trigger rewrites
//! any other shape that other code writes (see migration 0003).
//!
//! Time: SQLite lives on one host, so its timestamps come from that host's clock (plus the
//! repository's [`ClockShift`]). Staleness does not: a `processing` row is stale when this
//! repository has *observed* its `LastModifiedDate` unchanged for `stale_after` of monotonic
//! time, so a step of the wall clock never makes a live claim look stale. A repository that has
//! just started therefore waits one `stale_after` before it reclaims anything, and it restarts
//! its observations whenever it could not look for a while (the write lock was held by a long
//! attempt, which cannot heartbeat meanwhile).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, SecondsFormat, Utc};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection, SqlitePool};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::{
    Attempt, BackfillPage, Claim, ClaimPolicy, ClockShift, Error, EventId, EventStatus,
    FailureBookkeeping, Fence, FenceOutcome, NewEvent, OutboxEvent, OutboxRepository, OutboxStats,
    Result, RetryFilter, Scope, Terminal, Tx, clip_error, new_event_id, truncate_micros,
};

/// The design's eligible-event query, as written in the design (SQLite placeholders). The
/// repository runs [`ELIGIBLE_OBSERVED`], which decides staleness by observation instead of a
/// clock cutoff and adds the in-flight guard; this text is kept to show the design's query runs
/// unchanged on the schema.
pub const ELIGIBLE_QUERY: &str = "\
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent e
WHERE
  (e.Status = 'pending'
   OR (e.Status = 'processing' AND e.LastModifiedDate < ?1))
  AND (e.Status <> 'pending'
       OR e.RetryCount = 0
       OR e.LastModifiedDate < ?2)
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
LIMIT ?3";

/// The eligible query the repository runs: the design's rule, with a `processing` row stale
/// exactly when its id is in `?1` (a JSON array of the ids this repository observed silent for
/// `stale_after`), the retry cutoff `?2`, the limit `?3`, the scope's event types `?4`/`?5`
/// (JSON arrays or NULL), and the in-flight guard: a keyed row is never eligible while another
/// row of its key is `processing` and not stale. The last column is the `rowid`, so a row that
/// cannot be decoded can still be failed.
pub const ELIGIBLE_OBSERVED: &str = "\
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError,
       e.rowid
FROM _System_OutboxEvent e
WHERE
  (e.Status = 'pending'
   OR (e.Status = 'processing' AND e.Id IN (SELECT value FROM json_each(?1))))
  AND (e.Status <> 'pending'
       OR e.RetryCount = 0
       OR e.LastModifiedDate < ?2)
  AND (
    e.RecordKey IS NULL
    OR (NOT EXISTS (
      SELECT 1
      FROM _System_OutboxEvent older
      WHERE older.RecordKey = e.RecordKey
        AND (
          older.CreatedDate < e.CreatedDate
          OR (older.CreatedDate = e.CreatedDate AND older.Id < e.Id)
        )
        AND older.Status NOT IN ('processed', 'failed')
    )
    AND NOT EXISTS (
      SELECT 1
      FROM _System_OutboxEvent f
      WHERE f.RecordKey = e.RecordKey
        AND f.Status = 'processing'
        AND f.Id <> e.Id
        AND f.Id NOT IN (SELECT value FROM json_each(?1))
    ))
  )
  AND (?4 IS NULL OR e.EventType IN (SELECT value FROM json_each(?4)))
  AND (?5 IS NULL OR e.EventType NOT IN (SELECT value FROM json_each(?5)))
ORDER BY e.CreatedDate ASC, e.Id ASC
LIMIT ?3";

const SELECT_BY_ID: &str = "\
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError,
       rowid
FROM _System_OutboxEvent WHERE Id = ?1";

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

/// How many candidates one claim looks at before it reports nothing: each one it passes was
/// failed as undecodable, failed as exhausted by dead workers, or lost a race.
const MAX_CANDIDATES_PER_CLAIM: u32 = 16;

fn json_list(types: Option<&[String]>) -> Option<String> {
    types.map(|t| serde_json::to_string(t).expect("a list of strings serializes"))
}

/// Formats a time as stored: `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
pub fn format_ts(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Reads a stored timestamp: the canonical shape, any RFC 3339 time, or SQLite's
/// `YYYY-MM-DD HH:MM:SS[.fff]` (UTC).
pub fn parse_ts(s: &str) -> Result<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    for format in ["%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H:%M:%S%.f"] {
        if let Ok(t) = chrono::NaiveDateTime::parse_from_str(s, format) {
            return Ok(t.and_utc());
        }
    }
    Err(Error::Database(sqlx::Error::Decode(
        format!("bad timestamp {s:?}").into(),
    )))
}

fn parse_id(s: &str) -> Result<EventId> {
    Uuid::parse_str(s)
        .map_err(|e| Error::Database(sqlx::Error::Decode(format!("bad id {s:?}: {e}").into())))
}

/// The value a fenced write stores: strictly after the value it replaces.
fn next_written(now: DateTime<Utc>, previous: DateTime<Utc>) -> DateTime<Utc> {
    truncate_micros(now).max(previous + chrono::Duration::microseconds(1))
}

fn event_from_row(row: &SqliteRow) -> Result<OutboxEvent> {
    let status: String = row.try_get(3)?;
    let record_key: Option<String> = row.try_get(5)?;
    Ok(OutboxEvent {
        id: parse_id(&row.try_get::<String, _>(0)?)?,
        event_type: row.try_get(1)?,
        payload: row.try_get(2)?,
        status: status
            .parse()
            .map_err(|e: String| Error::Database(sqlx::Error::Decode(e.into())))?,
        retry_count: row.try_get(4)?,
        record_key,
        created_date: parse_ts(&row.try_get::<String, _>(6)?)?,
        last_modified_date: parse_ts(&row.try_get::<String, _>(7)?)?,
        last_error: row.try_get(8)?,
    })
}

fn outcome(rows: u64) -> FenceOutcome {
    if rows == 1 {
        FenceOutcome::Written
    } else {
        FenceOutcome::Lost
    }
}

fn delay(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

/// Inserts `events` in order on `conn` (the caller's transaction), deriving each `RecordKey`.
///
/// It takes the database's write lock first (SQLite's one writer), then draws `CreatedDate`
/// from the host clock, never earlier than the newest non-terminal row of the same key plus one
/// microsecond: one record's events are ordered as their transactions commit, even when the
/// application opened a deferred transaction or the clock stepped back.
pub async fn enqueue(conn: &mut SqliteConnection, events: &[NewEvent]) -> Result<Vec<EventId>> {
    enqueue_shifted(conn, events, &ClockShift::default()).await
}

async fn enqueue_shifted(
    conn: &mut SqliteConnection,
    events: &[NewEvent],
    shift: &ClockShift,
) -> Result<Vec<EventId>> {
    let mut rows = Vec::with_capacity(events.len());
    for event in events {
        let key =
            record_key::record_key_from_payload(&event.payload).map_err(Error::InvalidPayload)?;
        rows.push((new_event_id(), key.map(record_key::RecordKey::into_string)));
    }
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    // A write that changes nothing takes the write lock of a deferred transaction, so the
    // time drawn below is after every earlier writer committed.
    sqlx::query("UPDATE _System_OutboxEvent SET Status = Status WHERE 0")
        .execute(&mut *conn)
        .await?;
    let now = truncate_micros(Utc::now() + shift.host_wall());
    let mut newest: HashMap<String, DateTime<Utc>> = HashMap::new();
    for (event, (id, key)) in events.iter().zip(&rows) {
        let mut created = now;
        if let Some(key) = key {
            let floor = match newest.get(key) {
                Some(t) => Some(*t),
                None => {
                    let stored: Option<String> = sqlx::query_scalar(
                        "SELECT max(CreatedDate) FROM _System_OutboxEvent
                         WHERE RecordKey = ?1 AND Status NOT IN ('processed', 'failed')",
                    )
                    .bind(key)
                    .fetch_one(&mut *conn)
                    .await?;
                    stored.as_deref().map(parse_ts).transpose()?
                }
            };
            if let Some(floor) = floor {
                created = created.max(floor + chrono::Duration::microseconds(1));
            }
            newest.insert(key.clone(), created);
        }
        let created = format_ts(created);
        sqlx::query(
            "INSERT INTO _System_OutboxEvent
               (Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate)
             VALUES (?1, ?2, ?3, 'pending', 0, ?4, ?5, ?5)",
        )
        .bind(id.to_string())
        .bind(&event.event_type)
        .bind(&event.payload)
        .bind(key)
        .bind(&created)
        .execute(&mut *conn)
        .await?;
    }
    Ok(rows.into_iter().map(|(id, _)| id).collect())
}

/// What this repository has seen of the `processing` rows: each row's `LastModifiedDate` and
/// since when (monotonic, plus the clock shift) it has been seen unchanged. A row unchanged for
/// `stale_after` is stale.
///
/// A look that holds the write lock keeps the books: when the repository could not look for a
/// while (it waited long for the write lock, a lock wait timed out, or its last look is long
/// ago), a claim's holder may have been inside an attempt, which holds the write lock and
/// cannot heartbeat; that blind interval is not counted as silence (each row's clock moves
/// forward by it). A row observed unchanged for [`SILENCE_CAP`] times `stale_after` is stale
/// whatever the blind intervals, so steady load cannot keep a dead claim from being reclaimed.
/// Looks without the lock (`stats`, `get_pending_events`) only add what they see first, and
/// fresher values; they never touch the books.
#[derive(Debug)]
struct Liveness {
    origin: Instant,
    seen: HashMap<String, Seen>,
    last_look: Option<Duration>,
    restart_since: Option<Duration>,
}

/// A row's observation.
#[derive(Debug)]
struct Seen {
    last_modified: String,
    /// Since when it counts as silent (moved forward over blind intervals).
    since_micros: i64,
    /// When this value was first seen (never moved).
    first_micros: i64,
}

/// A row observed unchanged for this many times `stale_after` is stale, blind intervals or not.
const SILENCE_CAP: i64 = 3;

impl Liveness {
    fn new() -> Self {
        Self {
            origin: Instant::now(),
            seen: HashMap::new(),
            last_look: None,
            restart_since: None,
        }
    }

    /// Monotonic microseconds since the origin, plus the clock shift.
    fn now_micros(&self, shift: &ClockShift) -> i64 {
        i64::try_from(self.origin.elapsed().as_micros())
            .unwrap_or(i64::MAX)
            .saturating_add(shift.micros())
    }

    /// Records a fresh `LastModifiedDate` this repository wrote or holds (a claim, a
    /// heartbeat, an attempt that is about to release the write lock): alive now.
    fn note(&mut self, id: EventId, last_modified: DateTime<Utc>, shift: &ClockShift) {
        let now = self.now_micros(shift);
        self.seen.insert(
            id.to_string(),
            Seen {
                last_modified: format_ts(last_modified),
                since_micros: now,
                first_micros: now,
            },
        );
    }

    /// A lock wait failed: the time from the last look to the next one is blind.
    fn lock_wait_failed(&mut self) {
        if self.restart_since.is_none() {
            self.restart_since = Some(self.last_look.unwrap_or_default());
        }
    }

    /// Takes one look at the `processing` rows and returns the ids observed silent for
    /// `stale_after`. `lock_wait` is how long the write lock took, when the look holds it;
    /// `None` for a look without the lock, which keeps no books.
    fn look(
        &mut self,
        processing: Vec<(String, String)>,
        stale_after: Duration,
        lock_wait: Option<Duration>,
        shift: &ClockShift,
    ) -> Vec<String> {
        let now = self.now_micros(shift);
        if let Some(wait) = lock_wait {
            let real = self.origin.elapsed();
            let gap = self.last_look.map(|last| real.saturating_sub(last));
            let blind = if let Some(since) = self.restart_since.take() {
                Some(real.saturating_sub(since))
            } else if wait > stale_after / 3 {
                Some(wait)
            } else {
                gap.filter(|gap| *gap > stale_after / 2)
            };
            if let Some(blind) = blind {
                let blind = i64::try_from(blind.as_micros()).unwrap_or(i64::MAX);
                for seen in self.seen.values_mut() {
                    seen.since_micros = seen.since_micros.saturating_add(blind).min(now);
                }
            }
            self.last_look = Some(real);
        }
        let mut next = HashMap::with_capacity(processing.len());
        for (id, last_modified) in processing {
            let seen = match self.seen.remove(&id) {
                Some(seen) if seen.last_modified == last_modified => seen,
                _ => Seen {
                    last_modified,
                    since_micros: now,
                    first_micros: now,
                },
            };
            next.insert(id, seen);
        }
        self.seen = next;
        let stale_micros = i64::try_from(stale_after.as_micros()).unwrap_or(i64::MAX);
        let cap_micros = stale_micros.saturating_mul(SILENCE_CAP);
        let mut stale: Vec<String> = self
            .seen
            .iter()
            .filter(|(_, seen)| {
                now.saturating_sub(seen.since_micros) >= stale_micros
                    || now.saturating_sub(seen.first_micros) >= cap_micros
            })
            .map(|(id, _)| id.clone())
            .collect();
        stale.sort();
        stale
    }
}

/// Fails a row other code wrote that this code cannot read, with the reason, by `rowid`.
async fn fail_unreadable(
    conn: &mut SqliteConnection,
    rowid: i64,
    reason: &str,
) -> Result<Candidate> {
    tracing::warn!(rowid, error = %reason, "failing an outbox row that cannot be read");
    sqlx::query(
        "UPDATE _System_OutboxEvent SET Status = 'failed', LastError = ?2
         WHERE rowid = ?1 AND Status NOT IN ('processed', 'failed')",
    )
    .bind(rowid)
    .bind(clip_error(reason))
    .execute(&mut *conn)
    .await?;
    Ok(Candidate::Failed)
}

/// What became of one candidate.
enum Candidate {
    /// Claimed.
    Claimed(Claim),
    /// Failed here (unreadable, or its dead attempts used up `MaxRetryAttempts`): the rows
    /// behind it may be eligible now.
    Failed,
    /// Changed since it was read: look at the next one.
    Passed,
}

/// Claims the candidate `row` (read inside the write transaction on `conn`) when its state
/// allows. A stale `processing` row's dead attempt is counted as failed, and ends the row
/// `failed` when that reaches `MaxRetryAttempts`; a row that cannot be decoded is failed with
/// the reason.
async fn claim_on(
    conn: &mut SqliteConnection,
    row: &SqliteRow,
    now: DateTime<Utc>,
    policy: ClaimPolicy,
) -> Result<Candidate> {
    let rowid: i64 = row.try_get(9)?;
    let event = match event_from_row(row) {
        Ok(event) => event,
        Err(e) => {
            let reason = format!("unreadable outbox row written by other code: {}", e.chain());
            return fail_unreadable(conn, rowid, &reason).await;
        }
    };
    let raw_id: String = row.try_get(0)?;
    if raw_id != event.id.to_string() {
        // A UUID in another spelling (upper case, braces, no hyphens), written by other code:
        // every fenced write compares the canonical text, so store that.
        let canonical = sqlx::query("UPDATE _System_OutboxEvent SET Id = ?2 WHERE rowid = ?1")
            .bind(rowid)
            .bind(event.id.to_string())
            .execute(&mut *conn)
            .await;
        if let Err(e) = canonical {
            let reason = format!(
                "outbox row id {raw_id:?} written by other code cannot be stored as {}: {e}",
                event.id
            );
            return fail_unreadable(conn, rowid, &reason).await;
        }
    }
    let raw_last_modified: String = row.try_get(7)?;
    let reclaimed = event.status == EventStatus::Processing;
    let written = next_written(now, event.last_modified_date);
    let exhausted = reclaimed && event.retry_count.saturating_add(1) >= policy.max_retry_attempts;
    let (status, retry_count, last_error) = if reclaimed {
        let error = format!(
            "{} attempt {} stopped heartbeating (last beat {}) and wrote no outcome; counted as a failed attempt",
            crate::WORKER_DIED,
            event.retry_count + 1,
            raw_last_modified
        );
        let status = if exhausted {
            EventStatus::Failed
        } else {
            EventStatus::Processing
        };
        (status, event.retry_count + 1, Some(error))
    } else {
        (
            EventStatus::Processing,
            event.retry_count,
            event.last_error.clone(),
        )
    };
    let rows = sqlx::query(
        "UPDATE _System_OutboxEvent
         SET Status = ?2, LastModifiedDate = ?3, RetryCount = ?4, LastError = ?5
         WHERE rowid = ?1 AND Status = ?6 AND LastModifiedDate = ?7",
    )
    .bind(rowid)
    .bind(status.as_str())
    .bind(format_ts(written))
    .bind(retry_count)
    .bind(last_error.as_deref().map(clip_error))
    .bind(event.status.as_str())
    .bind(&raw_last_modified)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if rows != 1 {
        return Ok(Candidate::Passed);
    }
    if exhausted {
        tracing::warn!(
            event_id = %event.id,
            event_type = %event.event_type,
            retry_count,
            "a stale claim used up MaxRetryAttempts (its worker died on every attempt): the event is failed"
        );
        return Ok(Candidate::Failed);
    }
    Ok(Candidate::Claimed(Claim {
        fence: Fence {
            id: event.id,
            last_written: written,
        },
        reclaimed,
        event: OutboxEvent {
            status: EventStatus::Processing,
            last_modified_date: written,
            retry_count,
            last_error,
            ..event
        },
    }))
}

/// The SQLite outbox repository.
#[derive(Debug, Clone)]
pub struct SqliteOutbox {
    pool: SqlitePool,
    enqueued: Arc<Notify>,
    shift: ClockShift,
    liveness: Arc<Mutex<Liveness>>,
}

impl SqliteOutbox {
    /// A repository over `pool`.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            enqueued: Arc::default(),
            shift: ClockShift::default(),
            liveness: Arc::new(Mutex::new(Liveness::new())),
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
        truncate_micros(Utc::now() + self.shift.host_wall())
    }

    fn liveness(&self) -> std::sync::MutexGuard<'_, Liveness> {
        self.liveness.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens a write transaction, timing the wait for the lock (a long wait restarts the
    /// liveness observations; a failed one too).
    async fn begin_write(&self) -> Result<(sqlx::Transaction<'static, sqlx::Sqlite>, Duration)> {
        let started = Instant::now();
        match self.pool.begin_with("BEGIN IMMEDIATE").await {
            Ok(tx) => Ok((tx, started.elapsed())),
            Err(e) => {
                self.liveness().lock_wait_failed();
                Err(e.into())
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
        let processing: Vec<(String, String)> = sqlx::query_as(
            "SELECT Id, LastModifiedDate FROM _System_OutboxEvent WHERE Status = 'processing'",
        )
        .fetch_all(&mut *conn)
        .await?;
        let stale = self
            .liveness()
            .look(processing, stale_after, lock_wait, &self.shift);
        Ok(serde_json::to_string(&stale).expect("a list of strings serializes"))
    }

    async fn fenced(
        &self,
        sql: &'static str,
        fence: Fence,
        written: DateTime<Utc>,
        error: Option<&str>,
    ) -> Result<FenceOutcome> {
        let rows = sqlx::query(sql)
            .bind(fence.id.to_string())
            .bind(format_ts(written))
            .bind(format_ts(fence.last_written))
            .bind(error.map(clip_error))
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(outcome(rows))
    }

    /// One claim transaction: the eligible rows (`limit` candidates, or the one `id`) are tried
    /// oldest first until one is claimed.
    async fn claim_in_tx(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        id: Option<EventId>,
    ) -> Result<Option<Claim>> {
        let (mut tx, waited) = self.begin_write().await?;
        let stale = self
            .stale_ids(&mut tx, policy.stale_after, Some(waited))
            .await?;
        let now = self.now();
        let mut claim = None;
        // A candidate failed here may release the rows behind it: look again (bounded).
        for _ in 0..MAX_CANDIDATES_PER_CLAIM {
            let (found, failed_some) = self
                .claim_round(&mut tx, &stale, now, policy, scope, id)
                .await?;
            claim = found;
            if claim.is_some() || !failed_some {
                break;
            }
        }
        tx.commit().await?;
        if let Some(claim) = &claim {
            self.liveness()
                .note(claim.fence.id, claim.fence.last_written, &self.shift);
        }
        Ok(claim)
    }

    /// One pass over the eligible candidates: the claim, if any, and whether a candidate was
    /// failed on the way.
    async fn claim_round(
        &self,
        tx: &mut SqliteConnection,
        stale: &str,
        now: DateTime<Utc>,
        policy: ClaimPolicy,
        scope: &Scope,
        id: Option<EventId>,
    ) -> Result<(Option<Claim>, bool)> {
        let retry_cutoff = format_ts(now - delay(policy.retry_delay));
        let rows = match id {
            None => {
                sqlx::query(ELIGIBLE_OBSERVED)
                    .bind(stale)
                    .bind(&retry_cutoff)
                    .bind(i64::from(MAX_CANDIDATES_PER_CLAIM))
                    .bind(json_list(scope.only()))
                    .bind(json_list(scope.except()))
                    .fetch_all(&mut *tx)
                    .await?
            }
            Some(id) => {
                // The same rule, narrowed to one id.
                let sql = ELIGIBLE_OBSERVED.replacen("WHERE\n", "WHERE e.Id = ?6 AND\n", 1);
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(stale)
                    .bind(&retry_cutoff)
                    .bind(1_i64)
                    .bind(json_list(scope.only()))
                    .bind(json_list(scope.except()))
                    .bind(id.to_string())
                    .fetch_all(&mut *tx)
                    .await?
            }
        };
        let mut failed_some = false;
        for row in &rows {
            match claim_on(&mut *tx, row, now, policy).await? {
                Candidate::Claimed(claim) => return Ok((Some(claim), failed_some)),
                Candidate::Failed => failed_some = true,
                Candidate::Passed => {}
            }
        }
        Ok((None, failed_some))
    }
}

#[async_trait]
impl OutboxRepository for SqliteOutbox {
    fn backend_name(&self) -> &'static str {
        "sqlite"
    }

    async fn begin(&self) -> Result<Tx> {
        Ok(Tx::Sqlite(self.pool.begin_with("BEGIN IMMEDIATE").await?))
    }

    async fn enqueue(&self, tx: &mut Tx, events: &[NewEvent]) -> Result<Vec<EventId>> {
        let ids = match tx {
            Tx::Sqlite(tx) => enqueue_shifted(tx, events, &self.shift).await?,
            other => {
                return Err(Error::BackendMismatch {
                    expected: "sqlite",
                    given: other.backend_name(),
                });
            }
        };
        self.enqueued.notify_waiters();
        Ok(ids)
    }

    async fn get_pending_events(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>> {
        let mut conn = self.pool.acquire().await?;
        let stale = self.stale_ids(&mut conn, policy.stale_after, None).await?;
        let retry_cutoff = format_ts(self.now() - delay(policy.retry_delay));
        let rows = sqlx::query(ELIGIBLE_OBSERVED)
            .bind(&stale)
            .bind(&retry_cutoff)
            .bind(i64::from(limit))
            .bind(json_list(scope.only()))
            .bind(json_list(scope.except()))
            .fetch_all(&mut *conn)
            .await?;
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            match event_from_row(row) {
                Ok(event) => events.push(event),
                // A row that cannot be read is failed by the claim that meets it; listing it
                // here would only hand the caller an id it cannot parse.
                Err(e) => tracing::warn!(error = %e.chain(), "skipping an unreadable outbox row"),
            }
        }
        Ok(events)
    }

    async fn claim_event(&self, id: EventId, policy: ClaimPolicy) -> Result<Option<Claim>> {
        self.claim_in_tx(policy, &Scope::All, Some(id)).await
    }

    async fn claim_next(&self, policy: ClaimPolicy, scope: &Scope) -> Result<Option<Claim>> {
        self.claim_in_tx(policy, scope, None).await
    }

    async fn heartbeat(&self, fence: Fence) -> Result<Option<Fence>> {
        // This process holds the claim and is alive: say so to its own observers at once,
        // before the write waits for the lock (another attempt may hold it for a while).
        self.liveness()
            .note(fence.id, fence.last_written, &self.shift);
        let written = next_written(self.now(), fence.last_written);
        let rows = sqlx::query(
            "UPDATE _System_OutboxEvent SET LastModifiedDate = ?2
             WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?3",
        )
        .bind(fence.id.to_string())
        .bind(format_ts(written))
        .bind(format_ts(fence.last_written))
        .execute(&self.pool)
        .await?
        .rows_affected();
        if rows != 1 {
            return Ok(None);
        }
        self.liveness().note(fence.id, written, &self.shift);
        Ok(Some(Fence {
            id: fence.id,
            last_written: written,
        }))
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
        _lock_timeout: Duration,
        fence: Fence,
    ) -> Result<Option<Box<dyn Attempt>>> {
        // The busy timeout of the pool's connections bounds lock waits on SQLite. The write
        // lock is held from here to commit, so once the fence is checked nobody can reclaim
        // the row during the attempt.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let held: Option<i64> = sqlx::query_scalar(
            "SELECT 1 FROM _System_OutboxEvent
             WHERE Id = ?1 AND Status = 'processing' AND LastModifiedDate = ?2",
        )
        .bind(fence.id.to_string())
        .bind(format_ts(fence.last_written))
        .fetch_optional(&mut *tx)
        .await?;
        if held.is_none() {
            tx.rollback().await?;
            return Ok(None);
        }
        sqlx::query("SAVEPOINT outbox_claimed")
            .execute(&mut *tx)
            .await?;
        Ok(Some(Box::new(SqliteAttempt {
            tx: Some(Tx::Sqlite(tx)),
            shift: self.shift.clone(),
            liveness: self.liveness.clone(),
            fence,
        })))
    }

    async fn increment_retry(
        &self,
        fence: Fence,
        extra_delay: Duration,
        error: &str,
    ) -> Result<FenceOutcome> {
        let written = next_written(self.now() + delay(extra_delay), fence.last_written);
        self.fenced(FENCED_RETRY, fence, written, Some(error)).await
    }

    async fn update_status(
        &self,
        fence: Fence,
        status: Terminal,
        error: Option<String>,
    ) -> Result<FenceOutcome> {
        let written = next_written(self.now(), fence.last_written);
        match status {
            Terminal::Processed => self.fenced(FENCED_PROCESSED, fence, written, None).await,
            Terminal::Failed => {
                self.fenced(
                    FENCED_FAILED,
                    fence,
                    written,
                    Some(error.as_deref().unwrap_or("failed")),
                )
                .await
            }
        }
    }

    async fn backfill_record_keys(
        &self,
        after: Option<EventId>,
        batch: u32,
        dry_run: bool,
    ) -> Result<BackfillPage> {
        let rows = sqlx::query(
            "SELECT Id, Payload, RecordKey FROM _System_OutboxEvent
             WHERE Status NOT IN ('processed', 'failed') AND (?1 IS NULL OR Id > ?1)
             ORDER BY Id LIMIT ?2",
        )
        .bind(after.map(|id| id.to_string()))
        .bind(i64::from(batch))
        .fetch_all(&self.pool)
        .await?;
        let scanned: Vec<(EventId, String, Option<String>)> = rows
            .iter()
            .map(|r| {
                Ok((
                    parse_id(&r.try_get::<String, _>(0)?)?,
                    r.try_get(1)?,
                    r.try_get(2)?,
                ))
            })
            .collect::<Result<_>>()?;
        let (mut page, updates) = crate::classify_backfill(&scanned, batch);
        if !dry_run && !updates.is_empty() {
            let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
            let mut done = 0;
            for (id, key) in &updates {
                done += sqlx::query(
                    "UPDATE _System_OutboxEvent SET RecordKey = ?2 WHERE Id = ?1 AND RecordKey IS NULL",
                )
                .bind(id.to_string())
                .bind(key)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            }
            tx.commit().await?;
            page.updated = done;
        }
        Ok(page)
    }

    async fn stats(&self, policy: ClaimPolicy) -> Result<OutboxStats> {
        let mut stats = OutboxStats::default();
        let mut conn = self.pool.acquire().await?;
        let counts =
            sqlx::query("SELECT Status, count(*) FROM _System_OutboxEvent GROUP BY Status")
                .fetch_all(&mut *conn)
                .await?;
        for row in counts {
            let status: String = row.try_get(0)?;
            let n = row.try_get::<i64, _>(1)? as u64;
            match status.as_str() {
                "pending" => stats.pending = n,
                "processing" => stats.processing = n,
                "processed" => stats.processed = n,
                "failed" => stats.failed = n,
                _ => {}
            }
        }
        let stale = self.stale_ids(&mut conn, policy.stale_after, None).await?;
        let now = self.now();
        let row = sqlx::query(
            "SELECT
               (SELECT min(CreatedDate) FROM _System_OutboxEvent WHERE Status = 'pending'),
               (SELECT count(*) FROM _System_OutboxEvent
                  WHERE Status = 'processing' AND Id IN (SELECT value FROM json_each(?1))),
               (SELECT count(*) FROM _System_OutboxEvent
                  WHERE Status = 'pending' AND RetryCount > 0)",
        )
        .bind(&stale)
        .fetch_one(&mut *conn)
        .await?;
        let oldest: Option<String> = row.try_get(0)?;
        if let Some(oldest) = oldest {
            let age = now - parse_ts(&oldest)?;
            stats.oldest_pending_age_seconds =
                Some(age.num_microseconds().unwrap_or(0) as f64 / 1e6);
        }
        stats.stale_claims = row.try_get::<i64, _>(1)? as u64;
        stats.retrying = row.try_get::<i64, _>(2)? as u64;
        let blocked = sqlx::query(
            "SELECT
               coalesce(sum(h.Status = 'processing' AND h.Id NOT IN (SELECT value FROM json_each(?1))), 0),
               coalesce(sum(h.Status = 'processing' AND h.Id IN (SELECT value FROM json_each(?1))), 0),
               coalesce(sum(h.Status = 'pending' AND h.RetryCount > 0 AND h.LastModifiedDate >= ?2), 0)
             FROM _System_OutboxEvent h
             WHERE h.RecordKey IS NOT NULL AND h.Status NOT IN ('processed', 'failed')
               AND NOT EXISTS (
                 SELECT 1 FROM _System_OutboxEvent o
                 WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
                   AND (o.CreatedDate < h.CreatedDate OR (o.CreatedDate = h.CreatedDate AND o.Id < h.Id)))
               AND EXISTS (
                 SELECT 1 FROM _System_OutboxEvent y
                 WHERE y.RecordKey = h.RecordKey AND y.Status NOT IN ('processed', 'failed')
                   AND (y.CreatedDate > h.CreatedDate OR (y.CreatedDate = h.CreatedDate AND y.Id > h.Id)))",
        )
        .bind(&stale)
        .bind(format_ts(now - delay(policy.retry_delay)))
        .fetch_one(&mut *conn)
        .await?;
        stats.keys_blocked_by_running = blocked.try_get::<i64, _>(0)? as u64;
        stats.keys_blocked_by_stale = blocked.try_get::<i64, _>(1)? as u64;
        stats.keys_blocked_by_retry = blocked.try_get::<i64, _>(2)? as u64;
        Ok(stats)
    }

    async fn retry_failed(&self, filter: RetryFilter) -> Result<u64> {
        // One writer: no claim runs while this transaction holds the write lock, and the
        // in-flight guard keeps the retried row waiting while its key has a live claim.
        let (mut tx, _) = self.begin_write().await?;
        let now = self.now();
        let (id, all, event_type) = match filter {
            RetryFilter::Id(id) => (Some(id.to_string()), false, None),
            RetryFilter::Failed { event_type } => (None, true, event_type),
        };
        let failed: Vec<(String, String)> = sqlx::query_as(
            "SELECT Id, LastModifiedDate FROM _System_OutboxEvent
             WHERE Status = 'failed' AND ((?2 AND (?3 IS NULL OR EventType = ?3)) OR Id = ?1)",
        )
        .bind(&id)
        .bind(all)
        .bind(&event_type)
        .fetch_all(&mut *tx)
        .await?;
        let mut rows = 0;
        for (id, last_modified) in failed {
            let written = next_written(now, parse_ts(&last_modified).unwrap_or(now));
            rows += sqlx::query(
                "UPDATE _System_OutboxEvent SET Status = 'pending', RetryCount = 0,
                   LastModifiedDate = ?2
                 WHERE Id = ?1 AND Status = 'failed'",
            )
            .bind(id)
            .bind(format_ts(written))
            .execute(&mut *tx)
            .await?
            .rows_affected();
        }
        tx.commit().await?;
        Ok(rows)
    }

    async fn get_event(&self, id: EventId) -> Result<Option<OutboxEvent>> {
        let row = sqlx::query(SELECT_BY_ID)
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(event_from_row).transpose()
    }

    async fn wait_for_work(&self, timeout: Duration) -> Result<()> {
        // In-process enqueues wake the workers; other processes are seen at the next poll.
        let _ = tokio::time::timeout(timeout, self.enqueued.notified()).await;
        Ok(())
    }
}

/// The attempt transaction on SQLite.
struct SqliteAttempt {
    tx: Option<Tx>,
    shift: ClockShift,
    /// The repository's observations: the attempt notes its claim alive before it releases
    /// the write lock, so that its own process does not take the claim for stale at once.
    liveness: Arc<Mutex<Liveness>>,
    /// The fence the attempt began with (no heartbeat moves it while the attempt holds the
    /// write lock).
    fence: Fence,
}

impl SqliteAttempt {
    /// Notes the claim alive: the attempt is about to release the write lock, and a claim
    /// whose attempt fails is kept by its detached bookkeeping's heartbeat from then on.
    fn note_alive(&self) {
        self.liveness
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .note(self.fence.id, self.fence.last_written, &self.shift);
    }
}

impl SqliteAttempt {
    fn conn(&mut self) -> Result<&mut SqliteConnection> {
        match self.tx.as_mut() {
            Some(Tx::Sqlite(tx)) => Ok(&mut **tx),
            Some(other) => Err(Error::BackendMismatch {
                expected: "sqlite",
                given: other.backend_name(),
            }),
            None => Err(Error::AttemptFinished),
        }
    }

    async fn fenced(
        &mut self,
        sql: &'static str,
        fence: Fence,
        written: DateTime<Utc>,
        error: Option<&str>,
    ) -> Result<FenceOutcome> {
        let rows = sqlx::query(sql)
            .bind(fence.id.to_string())
            .bind(format_ts(written))
            .bind(format_ts(fence.last_written))
            .bind(error.map(clip_error))
            .execute(self.conn()?)
            .await?
            .rows_affected();
        Ok(outcome(rows))
    }
}

#[async_trait]
impl Attempt for SqliteAttempt {
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
        let now = truncate_micros(Utc::now() + self.shift.host_wall());
        let written = next_written(now, fence.last_written);
        self.fenced(FENCED_PROCESSED, fence, written, None).await
    }

    async fn record_failure(
        &mut self,
        fence: Fence,
        bookkeeping: FailureBookkeeping,
        error: &str,
    ) -> Result<FenceOutcome> {
        let now = truncate_micros(Utc::now() + self.shift.host_wall());
        match bookkeeping {
            FailureBookkeeping::Retry { extra_delay } => {
                let written = next_written(now + delay(extra_delay), fence.last_written);
                self.fenced(FENCED_RETRY, fence, written, Some(error)).await
            }
            FailureBookkeeping::Fail => {
                let written = next_written(now, fence.last_written);
                self.fenced(FENCED_FAILED, fence, written, Some(error))
                    .await
            }
        }
    }

    async fn commit(&mut self) -> Result<()> {
        self.note_alive();
        self.tx.take().ok_or(Error::AttemptFinished)?.commit().await
    }

    async fn rollback(&mut self) -> Result<()> {
        self.note_alive();
        self.tx
            .take()
            .ok_or(Error::AttemptFinished)?
            .rollback()
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALE: Duration = Duration::from_secs(30);

    fn rows(last_modified: &str) -> Vec<(String, String)> {
        vec![("a".to_string(), last_modified.to_string())]
    }

    #[test]
    fn silence_is_measured_from_the_first_look() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.advance(Duration::from_secs(29));
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.advance(Duration::from_secs(1));
        assert_eq!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift),
            ["a"]
        );
        // A heartbeat (a new value) makes it live again.
        assert!(
            l.look(rows("t2"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
    }

    #[test]
    fn a_wall_clock_step_changes_nothing() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.step_host_clock(chrono::Duration::hours(1));
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
    }

    #[test]
    fn blind_intervals_do_not_count_but_the_cap_does() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        // Every look waited 11 s for the write lock (an attempt held it, and a claim cannot
        // beat meanwhile): blind each time, so silence does not accumulate from those waits;
        // but a row unchanged for three stale-after periods is stale all the same.
        let mut stale_after_secs = None;
        for step in 1..=20 {
            shift.advance(Duration::from_secs(10));
            let wait = Some(Duration::from_secs(11));
            if !l.look(rows("t1"), STALE, wait, &shift).is_empty() {
                stale_after_secs = Some(step * 10);
                break;
            }
        }
        assert_eq!(stale_after_secs, Some(90));
    }

    #[test]
    fn a_failed_lock_wait_is_blind_and_a_look_without_the_lock_keeps_it() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        assert!(
            l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.advance(Duration::from_secs(25));
        l.lock_wait_failed();
        // `stats` looks without the lock: it neither clears the blind mark nor counts.
        shift.advance(Duration::from_secs(10));
        assert_eq!(l.look(rows("t1"), STALE, None, &shift), ["a"]);
        // The next look with the lock does not count the blind time (here real time, tiny:
        // the shift stands for time that passed while nobody could look).
        assert!(l.restart_since.is_some());
        l.look(rows("t1"), STALE, Some(Duration::ZERO), &shift);
        assert!(l.restart_since.is_none());
    }

    #[test]
    fn a_note_keeps_a_claim_alive() {
        let shift = ClockShift::new();
        let mut l = Liveness::new();
        let id = Uuid::now_v7();
        let t = truncate_micros(Utc::now());
        let rows = vec![(id.to_string(), format_ts(t))];
        assert!(
            l.look(rows.clone(), STALE, Some(Duration::ZERO), &shift)
                .is_empty()
        );
        shift.advance(Duration::from_secs(29));
        l.note(id, t, &shift);
        shift.advance(Duration::from_secs(29));
        assert!(l.look(rows, STALE, Some(Duration::ZERO), &shift).is_empty());
    }
}
