//! "Why is this record stuck?": a key's non-terminal rows in order, with the reason its head
//! is not running now ([`KeyReport`]), and the keys blocked the longest ([`BlockedKey`]). The
//! reasons follow the claim's own rules (the design's state rule, the retry delay, stale-after,
//! the in-flight guard), judged at the queue's clock ([`crate::OutboxRepository::clock_now`]).
//!
//! On SQLite a `processing` row is judged stale by its `LastModifiedDate` here, while the
//! workers judge it by the silence they observe (see `docs/state-machine.md`): a stale verdict
//! there means "its heartbeat stopped writing", and the reclaim follows once a worker has seen
//! that silence for stale-after.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{ClaimPolicy, EventRow, EventStatus, OutboxRepository, PausedType, Result};

/// Why a key's head (its oldest non-terminal row) is where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
#[non_exhaustive]
pub enum HeadState {
    /// A worker runs it: its heartbeat is live.
    Running {
        /// The heartbeat's last write (`LastModifiedDate`).
        last_beat: DateTime<Utc>,
        /// When it goes stale if the heartbeat stops now.
        stale_at: DateTime<Utc>,
    },
    /// Its worker stopped (no heartbeat for stale-after): the next claim reclaims it, counting
    /// the dead attempt.
    Stale {
        /// The heartbeat's last write.
        last_beat: DateTime<Utc>,
        /// Since when it is stale.
        stale_since: DateTime<Utc>,
    },
    /// It failed and waits for its retry delay, or (`failures` 0) its handler snoozed it.
    WaitingForRetry {
        /// When it becomes claimable again.
        until: DateTime<Utc>,
        /// Failed attempts so far (`RetryCount`).
        failures: i32,
    },
    /// It is pending but another row of its key is running (an operator retried an older row
    /// while a younger one ran): it runs once that row ends.
    WaitingForInFlight {
        /// The running row.
        running: crate::EventId,
    },
    /// Claimable now: it waits for a free worker (or for a worker whose scope takes its event
    /// type).
    Ready,
    /// Its event type is paused by an operator: no worker claims it (nor, so, its record's
    /// later rows) until the type is resumed.
    Paused {
        /// When the type was paused.
        since: DateTime<Utc>,
        /// Who paused it.
        by: String,
    },
}

impl HeadState {
    /// One sentence for the head's state, as `outbox status` and the console say it.
    pub fn describe(&self) -> String {
        let ts = |t: &DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        match self {
            HeadState::Running {
                last_beat,
                stale_at,
            } => format!(
                "running, heartbeat live (last beat {}; stale at {} if it stops)",
                ts(last_beat),
                ts(stale_at)
            ),
            HeadState::Stale {
                last_beat,
                stale_since,
            } => format!(
                "stale since {} (last beat {}): its worker stopped; the next claim reclaims it and counts the dead attempt",
                ts(stale_since),
                ts(last_beat)
            ),
            // Only a snooze leaves a row that never failed due later (its handler asked).
            HeadState::WaitingForRetry { until, failures: 0 } => format!(
                "snoozed until {}: its handler asked to run later (not counted as a failure)",
                ts(until)
            ),
            HeadState::WaitingForRetry { until, failures } => format!(
                "waiting for its retry until {} after {failures} failed attempt(s)",
                ts(until)
            ),
            HeadState::WaitingForInFlight { running } => {
                format!("pending, waits for row {running} of its key, which is running")
            }
            HeadState::Ready => "claimable now: waiting for a free worker (or for a worker whose \
                                 scope takes its event type)"
                .to_string(),
            HeadState::Paused { since, by } => format!(
                "pending, its event type paused by {by} since {}: no worker claims it, and its \
                 record's later rows wait behind it, until the type is resumed (outbox resume TYPE)",
                ts(since)
            ),
        }
    }
}

/// A pending head of a paused event type is held by the pause, whatever else it waits for.
fn pause_state(head: &EventRow, state: HeadState, paused: &[PausedType]) -> HeadState {
    if head.status != EventStatus::Pending {
        return state;
    }
    match paused.iter().find(|p| p.event_type == head.event_type) {
        Some(p) => HeadState::Paused {
            since: p.paused_at,
            by: p.paused_by.clone(),
        },
        None => state,
    }
}

/// `keys` with the heads of paused event types marked [`HeadState::Paused`].
pub(crate) fn mark_paused(keys: Vec<BlockedKey>, paused: &[PausedType]) -> Vec<BlockedKey> {
    keys.into_iter()
        .map(|mut key| {
            key.state = pause_state(&key.head, key.state, paused);
            key
        })
        .collect()
}

/// How many of a key's non-terminal rows [`key_report`] reads (the oldest; the count says
/// how many there are): a record blocked behind 100,000 rows is exactly the one an operator
/// opens during an incident, and its page stays small.
pub const KEY_ROWS_SHOWN: u32 = 100;

/// How far [`OutboxRepository::key_page`] counts a key's non-terminal rows: beyond it the count
/// reads "more than 100,000" rather than walking the whole key.
pub const KEY_ROWS_COUNTED: u64 = 100_000;

/// A record's rows as [`OutboxRepository::key_page`] reads them.
#[derive(Debug, Clone, Default)]
pub struct KeyPage {
    /// The oldest non-terminal rows, oldest first.
    pub rows: Vec<EventRow>,
    /// How many non-terminal rows the key has (at most [`KEY_ROWS_COUNTED`]; see `exact`).
    pub rows_total: u64,
    /// Whether `rows_total` is the count, or the key has more than [`KEY_ROWS_COUNTED`].
    pub rows_total_exact: bool,
    /// The newest `failed` row, if any.
    pub last_failed: Option<EventRow>,
}

impl KeyPage {
    /// The page of `rows`, `counted` non-terminal rows (counted up to one past
    /// [`KEY_ROWS_COUNTED`]) and `last_failed`.
    pub(crate) fn new(rows: Vec<EventRow>, counted: i64, last_failed: Option<EventRow>) -> Self {
        let counted = u64::try_from(counted).unwrap_or(0).max(rows.len() as u64);
        Self {
            rows,
            rows_total: counted.min(KEY_ROWS_COUNTED),
            rows_total_exact: counted <= KEY_ROWS_COUNTED,
            last_failed,
        }
    }
}

/// A key's state: its oldest non-terminal rows (at most [`KEY_ROWS_SHOWN`]) and how many there
/// are, its head's reason, and the newest `failed` row of the key (a failure releases the
/// key's younger rows; it shows why the record's effects may be missing).
#[derive(Debug, Clone, Serialize)]
pub struct KeyReport {
    /// The key, as stored.
    pub record_key: String,
    /// The queue's clock when the report was read.
    pub now: DateTime<Utc>,
    /// Non-terminal rows, oldest first, at most [`KEY_ROWS_SHOWN`]; the first is the head.
    pub rows: Vec<EventRow>,
    /// How many non-terminal rows the key has (`rows` holds the oldest of them), at most
    /// [`KEY_ROWS_COUNTED`].
    pub rows_total: u64,
    /// Whether `rows_total` is the count, or the key has more than [`KEY_ROWS_COUNTED`].
    pub rows_total_exact: bool,
    /// Why the head is not running now (or that it is), when the key has rows.
    pub head: Option<HeadState>,
    /// The newest `failed` row of the key, if any.
    pub last_failed: Option<EventRow>,
    /// The external effects the ledger records for the rows above (a row that ran a send
    /// before it failed, or one that is running), oldest first, at most
    /// [`crate::EFFECTS_SHOWN`].
    pub effects: Vec<crate::RecordedEffect>,
}

/// Judges `head` at `now` under `policy`; `others` are the key's other non-terminal rows.
pub fn explain_head(
    head: &EventRow,
    others: &[EventRow],
    now: DateTime<Utc>,
    policy: ClaimPolicy,
) -> HeadState {
    let running = others
        .iter()
        .filter(|r| r.status == EventStatus::Processing)
        .map(|r| (r.id, r.last_modified_date));
    head_state(head, running, now, policy)
}

/// [`explain_head`] over the `(Id, LastModifiedDate)` of the key's other `processing` rows.
fn head_state(
    head: &EventRow,
    mut running: impl Iterator<Item = (crate::EventId, DateTime<Utc>)>,
    now: DateTime<Utc>,
    policy: ClaimPolicy,
) -> HeadState {
    let span = |d: std::time::Duration| chrono::Duration::from_std(d).unwrap_or_default();
    match head.status {
        EventStatus::Processing => {
            let stale_at = head.last_modified_date + span(policy.stale_after);
            if stale_at <= now {
                HeadState::Stale {
                    last_beat: head.last_modified_date,
                    stale_since: stale_at,
                }
            } else {
                HeadState::Running {
                    last_beat: head.last_modified_date,
                    stale_at,
                }
            }
        }
        _ => {
            let until = if head.retry_count > 0 {
                head.last_modified_date + span(policy.retry_delay)
            } else {
                head.last_modified_date
            };
            if until > now {
                return HeadState::WaitingForRetry {
                    until,
                    failures: head.retry_count,
                };
            }
            match running.find(|(_, beat)| *beat + span(policy.stale_after) > now) {
                Some((id, _)) => HeadState::WaitingForInFlight { running: id },
                None => HeadState::Ready,
            }
        }
    }
}

/// Reads `record_key`'s report (exactly the stored key text, for example `lead:00Q5e…`).
pub async fn key_report(
    repo: &dyn OutboxRepository,
    record_key: &str,
    policy: ClaimPolicy,
) -> Result<KeyReport> {
    let KeyPage {
        rows,
        rows_total,
        rows_total_exact,
        last_failed,
    } = repo.key_page(record_key, KEY_ROWS_SHOWN).await?;
    let now = repo.clock_now().await?;
    // A database without the pause table (not migrated yet) has nothing paused.
    let paused = repo.paused_event_types().await.unwrap_or_default();
    let head = rows
        .split_first()
        .map(|(head, others)| pause_state(head, explain_head(head, others, now, policy), &paused));
    let ids: Vec<crate::EventId> = rows.iter().chain(&last_failed).map(|r| r.id).collect();
    // The report stands without them (a role that may not read the ledger, say).
    let effects = repo.effects_of(&ids).await.unwrap_or_else(|e| {
        tracing::warn!(error = %e.chain(), "could not read the effect ledger for the key's rows");
        Vec::new()
    });
    Ok(KeyReport {
        record_key: record_key.to_string(),
        now,
        rows,
        rows_total,
        rows_total_exact,
        head,
        last_failed,
        effects,
    })
}

/// A key with rows waiting behind a head that has not finished, from
/// [`crate::OutboxRepository::blocked_keys`].
#[derive(Debug, Clone, Serialize)]
pub struct BlockedKey {
    /// The key's head (its oldest non-terminal row).
    pub head: EventRow,
    /// Why the head is where it is, at the queue's clock.
    pub state: HeadState,
    /// Rows waiting behind the head.
    pub waiting: u64,
    /// `CreatedDate` of the oldest waiting row: the key has been blocked at least since then.
    pub waiting_since: DateTime<Utc>,
}

/// The heads of keys with waiting rows and the waits behind them, oldest wait first, at most
/// `limit` (as text: the integer is spliced, never a value from outside). Both dialects.
pub(crate) fn blocked_keys_sql(limit: u32) -> String {
    // Driven by the heads table (one row per key with a non-terminal row, written by triggers
    // in the rows' own transactions, repaired if it ever drifts: `outbox heads`): for each head
    // only the first younger non-terminal row of its key is read (one probe), the `limit`
    // oldest waits are kept, and only for those are the waits counted and the running rows
    // read. (Counting every head's waits, or checking each head again with an anti-join, made
    // PostgreSQL plan per outbox row: seconds on a backlog of 60,000 rows.)
    format!(
        "SELECT h.Id, h.EventType, h.Status, h.RecordKey, h.CreatedDate, h.LastModifiedDate,
                h.RetryCount, h.LastError,
                (SELECT count(*) FROM _System_OutboxEvent y
                 WHERE y.RecordKey = h.RecordKey AND y.Status NOT IN ('processed', 'failed')
                   AND (y.CreatedDate > h.CreatedDate
                        OR (y.CreatedDate = h.CreatedDate AND y.Id > h.Id))) AS Waiting,
                b.WaitingSince AS WaitingSince,
                (SELECT y.Id FROM _System_OutboxEvent y
                 WHERE y.RecordKey = h.RecordKey AND y.Status = 'processing' AND y.Id <> h.Id
                 ORDER BY y.LastModifiedDate DESC LIMIT 1) AS RunningId,
                (SELECT max(y.LastModifiedDate) FROM _System_OutboxEvent y
                 WHERE y.RecordKey = h.RecordKey AND y.Status = 'processing'
                   AND y.Id <> h.Id) AS RunningBeat
         FROM (
           SELECT a.Id, a.WaitingSince FROM (
             SELECT hd.Id,
                    (SELECT y.CreatedDate FROM _System_OutboxEvent y
                     WHERE y.RecordKey = hd.RecordKey AND y.Status NOT IN ('processed', 'failed')
                       AND (y.CreatedDate > hd.CreatedDate
                            OR (y.CreatedDate = hd.CreatedDate AND y.Id > hd.Id))
                     ORDER BY y.CreatedDate, y.Id LIMIT 1) AS WaitingSince
             FROM _System_OutboxHead hd
           ) a
           WHERE a.WaitingSince IS NOT NULL
           ORDER BY a.WaitingSince, a.Id
           LIMIT {limit}
         ) b
         JOIN _System_OutboxEvent h ON h.Id = b.Id
         WHERE h.Status NOT IN ('processed', 'failed')
         ORDER BY b.WaitingSince, b.Id"
    )
}

/// Builds a [`BlockedKey`] from a head row, its waits and the key's other running row (its
/// `Id` and heartbeat), judged at `now`.
pub(crate) fn blocked_key(
    head: EventRow,
    (waiting, waiting_since): (i64, DateTime<Utc>),
    running: Option<(crate::EventId, DateTime<Utc>)>,
    now: DateTime<Utc>,
    policy: ClaimPolicy,
) -> BlockedKey {
    let state = head_state(&head, running.into_iter(), now, policy);
    BlockedKey {
        head,
        state,
        waiting: u64::try_from(waiting).unwrap_or(0),
        waiting_since,
    }
}
