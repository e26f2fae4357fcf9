//! The values the repository reads and writes.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use record_key::RecordKey;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// An outbox row's `Id`: a UUIDv7, so that it orders like creation time. Ids made by one process
/// increase strictly, even within one millisecond and one batch, which the design relies on to
/// break `CreatedDate` ties.
pub type EventId = Uuid;

/// A new `Id` for an outbox row.
pub fn new_event_id() -> EventId {
    Uuid::now_v7()
}

/// The `Status` of an outbox row (see `docs/state-machine.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventStatus {
    /// Waiting to be claimed (first delivery, or a retry once its delay has passed).
    Pending,
    /// Claimed by a worker whose heartbeat keeps `LastModifiedDate` fresh.
    Processing,
    /// Terminal: the handler's effects committed with this status.
    Processed,
    /// Terminal: a permanent error, or `MaxRetryAttempts` failures.
    Failed,
}

impl EventStatus {
    /// The value stored in the `Status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            EventStatus::Pending => "pending",
            EventStatus::Processing => "processing",
            EventStatus::Processed => "processed",
            EventStatus::Failed => "failed",
        }
    }

    /// Whether the row is finished (`processed` or `failed`).
    pub fn is_terminal(self) -> bool {
        matches!(self, EventStatus::Processed | EventStatus::Failed)
    }
}

impl fmt::Display for EventStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EventStatus {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pending" => Ok(EventStatus::Pending),
            "processing" => Ok(EventStatus::Processing),
            "processed" => Ok(EventStatus::Processed),
            "failed" => Ok(EventStatus::Failed),
            other => Err(format!("unknown outbox status {other:?}")),
        }
    }
}

/// An event to enqueue. Its `RecordKey` is derived from the payload at enqueue. `Debug` shows
/// the payload's length, never its content.
#[derive(Clone, PartialEq, Eq)]
pub struct NewEvent {
    /// The `EventType`, which selects the handler.
    pub event_type: String,
    /// The JSON payload (see the envelope in the `record-key` crate).
    pub payload: String,
}

impl NewEvent {
    /// An event of `event_type` with a JSON `payload`.
    pub fn new(event_type: impl Into<String>, payload: impl Into<String>) -> Self {
        Self {
            event_type: event_type.into(),
            payload: payload.into(),
        }
    }

    /// The `RecordKey` enqueue derives from the payload: `None` for an event about no record,
    /// and for a payload that is not a valid envelope (which enqueue refuses).
    pub fn record_key(&self) -> Option<RecordKey> {
        record_key::record_key_from_payload(&self.payload)
            .ok()
            .flatten()
    }

    /// An event about one record: the payload is the envelope its `RecordKey` is derived from,
    /// `{"object": object, "record_id": record_id, "snapshot": snapshot}`, JSON-encoded here
    /// (values need no escaping by the caller), and the key is `object:record_id` with the
    /// object in lower case. `snapshot` is the frozen fields a handler reads: anything that
    /// serializes to a JSON object (a `BTreeMap`, a `#[derive(Serialize)]` struct,
    /// `serde_json::json!({…})`; a derived struct needs `serde` as a dependency of yours).
    /// Fails with [`crate::Error::InvalidPayload`], as enqueue would, when the object name or
    /// record id is not valid or the snapshot is not a JSON object (`null` included); a
    /// snapshot whose `Serialize` fails is reported as invalid JSON.
    ///
    /// ```
    /// use std::collections::BTreeMap;
    /// use outbox_persistence::{EventEnvelope, NewEvent, RecordKey};
    /// let snapshot = BTreeMap::from([("email", "a@example.com"), ("name", r#"Ann "A" Lee"#)]);
    /// let event = NewEvent::for_record("contact.requested", "ContactRequest", "req-1", &snapshot)?;
    /// let envelope = EventEnvelope::parse(&event.payload)?;
    /// assert_eq!(envelope.record_key(), Some(RecordKey::new("ContactRequest", "req-1")?));
    /// assert_eq!(envelope.snapshot["name"], r#"Ann "A" Lee"#);
    /// assert!(NewEvent::for_record("t", "Contact", "1", &"not an object").is_err());
    /// assert!(NewEvent::for_record("t", "Contact", "1", &()).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn for_record<S: Serialize + ?Sized>(
        event_type: impl Into<String>,
        object: &str,
        record_id: &str,
        snapshot: &S,
    ) -> crate::Result<Self> {
        let invalid = |e| crate::Error::InvalidPayload(record_key::RecordKeyError::InvalidJson(e));
        let snapshot = serde_json::to_value(snapshot).map_err(invalid)?;
        if !snapshot.is_object() {
            return Err(crate::Error::InvalidPayload(
                record_key::RecordKeyError::InvalidSnapshot,
            ));
        }
        let payload = serde_json::json!({
            "object": object,
            "record_id": record_id,
            "snapshot": snapshot,
        });
        let text = payload.to_string();
        record_key::EventEnvelope::from_value(payload).map_err(crate::Error::InvalidPayload)?;
        Ok(Self::new(event_type, text))
    }
}

/// One outbox row. Neither `Debug` nor `Serialize` shows the payload (customer data): `Debug`
/// prints its length instead, `Serialize` skips it.
#[derive(Clone, PartialEq, Eq, Serialize)]
pub struct OutboxEvent {
    /// `Id`.
    pub id: EventId,
    /// `EventType`.
    pub event_type: String,
    /// `Payload`: customer data; never log it.
    #[serde(skip)]
    pub payload: String,
    /// `Status`.
    pub status: EventStatus,
    /// `RetryCount`: the number of failed attempts so far.
    pub retry_count: i32,
    /// `RecordKey`, or `None` for an unordered event. A key read back from the table is the
    /// stored text exactly, also when other code wrote one that [`RecordKey::new`] would
    /// refuse: ordering compares the stored text, so such a row is still read and claimed.
    pub record_key: Option<RecordKey>,
    /// `CreatedDate`.
    pub created_date: DateTime<Utc>,
    /// `LastModifiedDate`: the heartbeat of a `processing` row, the retry clock of a retried one.
    pub last_modified_date: DateTime<Utc>,
    /// `LastError`: the error of the latest failed attempt.
    pub last_error: Option<String>,
}

impl OutboxEvent {
    /// A `pending` event of `event_type` with `payload`, as enqueue would store it (its
    /// `RecordKey` derived, or `None` when the payload names no record or cannot be read), for
    /// tests of handlers that do not go through the queue.
    pub fn for_test(event_type: impl Into<String>, payload: impl Into<String>) -> Self {
        let payload = payload.into();
        let now = crate::truncate_micros(Utc::now());
        Self {
            id: new_event_id(),
            event_type: event_type.into(),
            record_key: record_key::record_key_from_payload(&payload).ok().flatten(),
            payload,
            status: EventStatus::Pending,
            retry_count: 0,
            created_date: now,
            last_modified_date: now,
            last_error: None,
        }
    }
}

/// The rules that decide eligibility and count dead attempts. Durations only: the backend
/// reads the time itself (PostgreSQL: the database's `clock_timestamp()`; SQLite: the host's
/// clock for retry delays and a monotonic observation for staleness, see
/// `docs/state-machine.md`), so a worker whose host clock is skewed changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimPolicy {
    /// A `processing` row whose heartbeat has been silent this long is stale: its attempt is
    /// counted as failed and the row may be reclaimed.
    pub stale_after: Duration,
    /// A retried `pending` row is eligible once its `LastModifiedDate` (the failure time plus
    /// any extra backoff) is this far in the past.
    pub retry_delay: Duration,
    /// `MaxRetryAttempts`: a stale reclaim that counts the attempt reaching this number ends
    /// the row `failed` instead of claiming it (a poison event that kills its worker).
    pub max_retry_attempts: i32,
}

impl ClaimPolicy {
    /// A policy with a stale-after age, a base retry delay and `MaxRetryAttempts`.
    pub fn new(stale_after: Duration, retry_delay: Duration, max_retry_attempts: i32) -> Self {
        Self {
            stale_after,
            retry_delay,
            max_retry_attempts: max_retry_attempts.max(1),
        }
    }
}

/// A shift applied to the queue's clock, shared by the repositories that hold a clone of it.
/// It is zero unless a test moves it: the backends add it to the time they read (in SQL on
/// PostgreSQL), so a test can let time pass without sleeping and without a second clock.
/// [`ClockShift::step_host_clock`] moves only the host's wall clock, as an NTP step or a
/// skewed host does: PostgreSQL reads no host clock, SQLite stamps its rows with it.
#[derive(Debug, Clone, Default)]
pub struct ClockShift(Arc<AtomicI64>, Arc<AtomicI64>);

impl ClockShift {
    /// A shift of zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        let micros = i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        self.0.fetch_add(micros, Ordering::SeqCst);
    }

    /// Steps the host's wall clock alone by `d` (negative: back), leaving time as it passes
    /// (monotonic) and the database's clock alone.
    pub fn step_host_clock(&self, d: chrono::Duration) {
        let micros = d.num_microseconds().unwrap_or(i64::MAX);
        self.1.fetch_add(micros, Ordering::SeqCst);
    }

    /// The shift of every clock, in microseconds.
    pub fn micros(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }

    /// The shift of the host's wall clock: every clock's plus its own steps.
    pub fn host_wall(&self) -> chrono::Duration {
        chrono::Duration::microseconds(self.micros().saturating_add(self.1.load(Ordering::SeqCst)))
    }
}

/// What a worker holds after winning `claim_event`: the row and its fence. Its `Debug` shows
/// the event's (the payload's length, never its content).
#[derive(Clone, PartialEq, Eq)]
pub struct Claim {
    /// The row as claimed (`Status` is `processing`).
    pub event: OutboxEvent,
    /// The value to compare against on every later write.
    pub fence: Fence,
    /// Whether the row was a stale `processing` row taken over from a worker that stopped.
    pub reclaimed: bool,
}

impl Claim {
    /// A claim of `event` as a claim would return it (`processing`, fenced on its
    /// `LastModifiedDate`, not a reclaim), for tests that run an attempt over a mocked
    /// repository (`ClaimRunner` in `outbox-events`) without claiming a row.
    pub fn for_test(mut event: OutboxEvent) -> Self {
        event.status = EventStatus::Processing;
        let fence = Fence {
            id: event.id,
            last_written: event.last_modified_date,
        };
        Self {
            event,
            fence,
            reclaimed: false,
        }
    }
}

/// The `LastModifiedDate` this worker last wrote to a claimed row. A heartbeat or status write
/// applies only while the row still carries it, so a worker whose claim was taken over (stale
/// reclaim) or finished elsewhere writes nothing. Every write moves `LastModifiedDate` strictly
/// forward, so two claims never share a value. No owner token or lease column is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    /// The row.
    pub id: EventId,
    /// The `LastModifiedDate` this worker last wrote.
    pub last_written: DateTime<Utc>,
}

/// The result of a fenced write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceOutcome {
    /// The row was still this worker's; the write applied.
    Written,
    /// The row is no longer this worker's; nothing was written.
    Lost,
}

/// A terminal status for [`crate::OutboxRepository::update_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Terminal {
    /// `processed`.
    Processed,
    /// `failed`.
    Failed,
}

impl Terminal {
    /// The status this terminal value writes.
    pub fn status(self) -> EventStatus {
        match self {
            Terminal::Processed => EventStatus::Processed,
            Terminal::Failed => EventStatus::Failed,
        }
    }
}

/// How a snooze's `LastError` begins (`HandlerError::snooze`'s text in outbox-events): on
/// SQLite only a row whose error says so waits for its `LastModifiedDate` on a first attempt.
pub const SNOOZED_PREFIX: &str = "snoozed for ";

/// How a failed attempt is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureBookkeeping {
    /// Back to `pending` with `RetryCount + 1`; eligible again once `LastModifiedDate` (set to
    /// now plus `extra_delay`) is older than the retry cutoff. `extra_delay` is the backoff beyond
    /// the base retry delay.
    Retry {
        /// Backoff beyond the base retry delay.
        extra_delay: Duration,
    },
    /// `failed` with `RetryCount + 1`: a permanent error, or the last allowed attempt.
    Fail,
    /// Back to `pending` with `RetryCount` unchanged: not a failure, the handler asked to be
    /// run later (`HandlerError::snooze` in outbox-events). `LastModifiedDate` is set to now
    /// plus `delay`, so the row is not eligible before then (a row that failed before waits
    /// the retry cutoff beyond it too: the caller takes the base retry delay off).
    Snooze {
        /// How far ahead of now `LastModifiedDate` is set.
        delay: Duration,
    },
}

/// One page of a `RecordKey` backfill.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BackfillPage {
    /// Non-terminal rows read in this page.
    pub scanned: u64,
    /// Rows whose `RecordKey` was missing and is now set (or would be, in a dry run).
    pub updated: u64,
    /// Rows that already had a `RecordKey`.
    pub already_set: u64,
    /// Rows whose payload is about no record: they stay unordered.
    pub no_record: u64,
    /// Rows whose payload cannot yield a key, with the reason; left as they are.
    pub underivable: Vec<(EventId, String)>,
    /// Rows whose stored `RecordKey` differs from the one the payload derives; left as they are.
    pub mismatched: Vec<EventId>,
    /// Rows that were being run (`processing`) when the page keyed its rows: left unkeyed,
    /// since keying a running row could put two rows of one record in flight. They finish
    /// unordered, or get their key from a later backfill if they are pending again.
    pub in_flight: Vec<EventId>,
    /// Where the next page starts, or `None` when the scan is complete.
    pub next_after: Option<EventId>,
}

impl BackfillPage {
    /// Records which of the rows meant to be keyed (`meant`) were (`keyed`): `updated` counts
    /// those, the rest are in flight.
    pub(crate) fn settle(&mut self, meant: &[EventId], keyed: &[EventId]) {
        let keyed: std::collections::HashSet<&EventId> = keyed.iter().collect();
        self.in_flight = meant
            .iter()
            .filter(|id| !keyed.contains(id))
            .copied()
            .collect();
        self.updated = keyed.len() as u64;
    }
}

/// Which failed rows an operator returns to `pending`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetryFilter {
    /// One row by id (it must be `failed`).
    Id(EventId),
    /// These rows (those of them that are `failed`).
    Ids(Vec<EventId>),
    /// Every failed row, optionally of one event type.
    Failed {
        /// Only rows of this `EventType`.
        event_type: Option<String>,
    },
}

/// A read of the queue's health for operators and the rollout gate.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OutboxStats {
    /// Rows in `pending`.
    pub pending: u64,
    /// Rows in `processing`.
    pub processing: u64,
    /// Rows in `processed`: on PostgreSQL above [`crate::ESTIMATE_PROCESSED_ABOVE`] rows in
    /// the table, the planner's row estimate less the other counts (`processed_estimated`),
    /// so that reading the queue's health costs the same however much history the table keeps.
    pub processed: u64,
    /// Whether `processed` is an estimate (see `processed`).
    pub processed_estimated: bool,
    /// Rows in `failed`.
    pub failed: u64,
    /// Age in seconds of the oldest `pending` row.
    pub oldest_pending_age_seconds: Option<f64>,
    /// `processing` rows whose heartbeat stopped (older than the stale cutoff).
    pub stale_claims: u64,
    /// `pending` rows that failed before and wait for, or are ready for, a retry.
    pub retrying: u64,
    /// Keys with waiting successors whose head is `processing` with a live heartbeat.
    pub keys_blocked_by_running: u64,
    /// Keys with waiting successors whose head is a stale `processing` row.
    pub keys_blocked_by_stale: u64,
    /// Keys with waiting successors whose head waits for its retry delay.
    pub keys_blocked_by_retry: u64,
}

/// Which event types a dispatcher takes: all of them, only some (the legacy path for consumers
/// excluded from the pull rollout), or all but some (the pull workers then).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Scope {
    /// Every event type.
    #[default]
    All,
    /// Only these event types.
    Only(Vec<String>),
    /// Every event type but these.
    Except(Vec<String>),
}

impl Scope {
    /// The `Only` list, if any.
    pub fn only(&self) -> Option<&[String]> {
        match self {
            Scope::Only(types) => Some(types),
            _ => None,
        }
    }

    /// The `Except` list, if any.
    pub fn except(&self) -> Option<&[String]> {
        match self {
            Scope::Except(types) => Some(types),
            _ => None,
        }
    }
}

/// What `Debug` prints in place of a payload: its length, never its content.
struct Elided(usize);

impl fmt::Debug for Elided {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<{} bytes>", self.0)
    }
}

impl fmt::Debug for NewEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            event_type,
            payload,
        } = self;
        f.debug_struct("NewEvent")
            .field("event_type", event_type)
            .field("payload", &Elided(payload.len()))
            .finish()
    }
}

impl fmt::Debug for OutboxEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Destructured, so that a field added later must be placed here deliberately.
        let Self {
            id,
            event_type,
            payload,
            status,
            retry_count,
            record_key,
            created_date,
            last_modified_date,
            last_error,
        } = self;
        f.debug_struct("OutboxEvent")
            .field("id", id)
            .field("event_type", event_type)
            .field("payload", &Elided(payload.len()))
            .field("status", status)
            .field("retry_count", retry_count)
            .field("record_key", record_key)
            .field("created_date", created_date)
            .field("last_modified_date", last_modified_date)
            .field("last_error", last_error)
            .finish()
    }
}

impl fmt::Debug for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            event,
            fence,
            reclaimed,
        } = self;
        f.debug_struct("Claim")
            .field("event", event)
            .field("fence", fence)
            .field("reclaimed", reclaimed)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "4111-1111-1111-1111";

    fn payload() -> String {
        format!(r#"{{"object":"Lead","record_id":"L1","snapshot":{{"Card":"{SECRET}"}}}}"#)
    }

    #[test]
    fn debug_of_a_new_event_elides_the_payload() {
        let event = NewEvent::new("lead.updated", payload());
        let shown = format!("{event:?} {event:#?}");
        assert!(!shown.contains(SECRET), "{shown}");
        assert!(shown.contains("lead.updated"), "{shown}");
        assert!(
            shown.contains(&format!("<{} bytes>", payload().len())),
            "{shown}"
        );
    }

    #[test]
    fn debug_of_an_event_and_a_claim_elides_the_payload() {
        let event = OutboxEvent::for_test("lead.updated", payload());
        let claim = Claim {
            fence: Fence {
                id: event.id,
                last_written: event.last_modified_date,
            },
            reclaimed: false,
            event: event.clone(),
        };
        for shown in [
            format!("{event:?}"),
            format!("{event:#?}"),
            format!("{claim:?}"),
            format!("{claim:#?}"),
            format!("{:?}", Some(&claim)),
        ] {
            assert!(!shown.contains(SECRET), "{shown}");
            // Every other field is still there.
            for field in [
                "id",
                "event_type",
                "status",
                "retry_count",
                "record_key",
                "created_date",
                "last_modified_date",
                "last_error",
            ] {
                assert!(shown.contains(field), "{field} missing in {shown}");
            }
            assert!(shown.contains("lead:L1"), "{shown}");
            assert!(shown.contains("bytes>"), "{shown}");
        }
        assert!(!serde_json::to_string(&event).unwrap().contains(SECRET));
    }
}
