//! The operators' read of the queue: [`EventFilter`] selects rows, [`EventRow`] is one row
//! without its payload. `OutboxRepository::list_events` runs it on either backend.

use chrono::{DateTime, SecondsFormat, Utc};
use record_key::RecordKey;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{EventId, EventStatus, OutboxEvent};

/// Which rows [`crate::OutboxRepository::list_events`] returns: every condition that is set
/// must hold (an empty list sets none). Build it with the methods below:
///
/// ```
/// use outbox_persistence::{EventFilter, EventStatus};
/// let stuck = EventFilter::new()
///     .statuses([EventStatus::Pending, EventStatus::Processing])
///     .event_type("lead.updated")
///     .limit(100);
/// assert_eq!(stuck.limit, Some(100));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventFilter {
    /// Only rows in one of these statuses.
    pub statuses: Vec<EventStatus>,
    /// Only rows of this `EventType`.
    pub event_type: Option<String>,
    /// Only these rows.
    pub ids: Vec<EventId>,
    /// Only rows whose stored `RecordKey` is exactly this text (as `RecordKey::as_str`
    /// prints it, for example `lead:00Q5e00000AbCdE`).
    pub record_key: Option<String>,
    /// At most this many rows (the oldest); `None` for every matching row.
    pub limit: Option<u32>,
}

impl EventFilter {
    /// Every row.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only rows in one of `statuses`.
    pub fn statuses(mut self, statuses: impl IntoIterator<Item = EventStatus>) -> Self {
        self.statuses = statuses.into_iter().collect();
        self
    }

    /// Only rows of `event_type`.
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// Only the rows `ids`.
    pub fn ids(mut self, ids: impl IntoIterator<Item = EventId>) -> Self {
        self.ids = ids.into_iter().collect();
        self
    }

    /// Only rows whose stored `RecordKey` is `record_key`.
    pub fn record_key(mut self, record_key: impl Into<String>) -> Self {
        self.record_key = Some(record_key.into());
        self
    }

    /// At most `limit` rows, the oldest.
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = Some(limit);
        self
    }

    /// The statuses as stored, or `None` when any status will do.
    pub(crate) fn status_texts(&self) -> Option<Vec<&'static str>> {
        (!self.statuses.is_empty()).then(|| self.statuses.iter().map(|s| s.as_str()).collect())
    }

    /// The ids, or `None` when any id will do.
    pub(crate) fn id_list(&self) -> Option<&[EventId]> {
        (!self.ids.is_empty()).then_some(self.ids.as_slice())
    }
}

/// One outbox row as operators see it: every column but the payload, which holds customer data.
///
/// Serialized (for `outbox events --json`) with its timestamps in RFC 3339 UTC with exactly six
/// fractional digits, for example `2026-01-05T10:00:00.123400Z`. Both backends store
/// microseconds, so this is the stored value exactly: two reads of an unchanged row print the
/// same text, and the text parses back (this type deserializes it) to the value
/// [`OutboxEvent::last_modified_date`] and the fence carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventRow {
    /// `Id`.
    pub id: EventId,
    /// `EventType`.
    pub event_type: String,
    /// `Status`.
    pub status: EventStatus,
    /// `RecordKey`, exactly as stored, or `None` for an unordered event.
    pub record_key: Option<RecordKey>,
    /// `CreatedDate`.
    #[serde(with = "micros")]
    pub created_date: DateTime<Utc>,
    /// `LastModifiedDate`: moves with every heartbeat and status write.
    #[serde(with = "micros")]
    pub last_modified_date: DateTime<Utc>,
    /// `RetryCount`: the number of failed attempts so far.
    pub retry_count: i32,
    /// `LastError`: the error of the latest failed attempt.
    pub last_error: Option<String>,
}

impl EventRow {
    /// The full event, with `payload`.
    pub(crate) fn with_payload(self, payload: String) -> OutboxEvent {
        OutboxEvent {
            id: self.id,
            event_type: self.event_type,
            payload,
            status: self.status,
            retry_count: self.retry_count,
            record_key: self.record_key,
            created_date: self.created_date,
            last_modified_date: self.last_modified_date,
            last_error: self.last_error,
        }
    }
}

impl From<OutboxEvent> for EventRow {
    /// The row without its payload.
    fn from(event: OutboxEvent) -> Self {
        Self {
            id: event.id,
            event_type: event.event_type,
            status: event.status,
            record_key: event.record_key,
            created_date: event.created_date,
            last_modified_date: event.last_modified_date,
            retry_count: event.retry_count,
            last_error: event.last_error,
        }
    }
}

/// Timestamps as RFC 3339 UTC text with exactly six fractional digits.
mod micros {
    use super::*;

    pub(super) fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::Micros, true))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        let text = String::deserialize(d)?;
        DateTime::parse_from_rfc3339(&text)
            .map(|t| t.with_timezone(&Utc))
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_round_trips_through_json_to_the_microsecond() {
        let event = OutboxEvent::for_test("t", r#"{"object":"Lead","record_id":"1"}"#);
        let mut row = EventRow::from(event);
        row.last_modified_date = DateTime::parse_from_rfc3339("2026-01-05T10:00:00.120000Z")
            .unwrap()
            .with_timezone(&Utc);
        row.record_key = Some(RecordKey::from_stored("Lead:Foreign"));
        let json = serde_json::to_value(&row).unwrap();
        assert_eq!(json["last_modified_date"], "2026-01-05T10:00:00.120000Z");
        assert_eq!(json["record_key"], "Lead:Foreign");
        assert_eq!(json["status"], "pending");
        assert!(json.get("payload").is_none());
        let back: EventRow = serde_json::from_value(json).unwrap();
        assert_eq!(back, row);
    }

    #[test]
    fn a_filter_names_its_conditions() {
        let f = EventFilter::new();
        assert_eq!((f.status_texts(), f.id_list(), f.limit), (None, None, None));
        let f = f.statuses([EventStatus::Failed]).limit(3);
        assert_eq!(f.status_texts(), Some(vec!["failed"]));
    }
}
