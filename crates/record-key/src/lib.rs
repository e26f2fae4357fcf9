//! The event envelope and the one derivation of `RecordKey` from an event payload.
//!
//! Enqueue and the `RecordKey` backfill both call [`record_key_from_payload`], so a row written
//! before the column existed gets exactly the key that enqueue would have given it.
//!
//! # The envelope
//!
//! An outbox payload is a JSON object. Three members carry meaning here; any other member is
//! ignored by the derivation (handlers may read it):
//!
//! | member      | type   | meaning                                                           |
//! |-------------|--------|-------------------------------------------------------------------|
//! | `object`    | string | the object's API name, for example `Lead` (`[A-Za-z][A-Za-z0-9_]*`)|
//! | `record_id` | string | the record's identifier within that object                        |
//! | `snapshot`  | object | the frozen field snapshot taken when the event was written         |
//!
//! A fourth member, `traceparent` (a W3C trace context string, written by `outbox-events`'
//! `enqueue` with its `otel` feature), ties the event's attempts to the trace that enqueued it;
//! it never affects the key, and `outbox-events` (`TraceParent`) is where it is read.
//!
//! An event *about a record* has `record_id`; it must then also have `object`, and its key is
//! `object:record_id` with the object name in lower case (for example `lead:00Q5e00000AbCdE`:
//! object API names are case-insensitive identifiers, so `Lead` and `lead` must give one key). An event about no record has no
//! `record_id` member (or `record_id: null`) and gets no key: it is unordered.
//!
//! A payload that claims a record but is malformed (a `record_id` that is not a non-empty string
//! without surrounding white space or control characters, a missing or invalid `object`) is an
//! error, never a guess: apart from folding the object name's case, the derivation does not
//! trim, lowercase or convert numbers, because a silently different key would put the record's
//! events in two unordered groups.

#![warn(missing_docs)]

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The longest object API name accepted, in bytes.
pub const MAX_OBJECT_LEN: usize = 64;
/// The longest record identifier accepted, in bytes.
pub const MAX_RECORD_ID_LEN: usize = 255;

/// The ordering key of an outbox row: events with the same key are processed in enqueue order.
///
/// # Invariants
///
/// A key built by [`RecordKey::new`] or derived by [`record_key_from_payload`] (and
/// [`EventEnvelope::record_key`]) is always `object:record_id`: the object API name folded to
/// ASCII lower case (a valid identifier of at most [`MAX_OBJECT_LEN`] bytes), a colon, and the
/// record identifier unchanged (non-empty, at most [`MAX_RECORD_ID_LEN`] bytes, no surrounding
/// white space, no control characters). Equal records give equal keys, different records
/// different keys. These are the only ways to make a key for a *new* event.
///
/// A key read back from the `RecordKey` column ([`RecordKey::from_stored`], and
/// deserialisation, which is transparent and does not validate either) holds the stored text
/// as is: a row written by foreign code or an older release may hold text that `new` would
/// refuse, and reading it must never fail. Such a key compares, hashes and displays as its
/// text; it never changes on the way through.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RecordKey(String);

impl RecordKey {
    /// Builds the key of one record from its object API name and record identifier, with the
    /// same validation as [`record_key_from_payload`].
    pub fn new(object: &str, record_id: &str) -> Result<Self, RecordKeyError> {
        validate_object(object)?;
        validate_record_id(record_id)?;
        Ok(Self::join(object, record_id))
    }

    /// `object:record_id` with the object name folded to ASCII lower case: object API names
    /// are case-insensitive identifiers (`Lead` and `lead` name one object, as the create
    /// action's registry treats them), so both spellings must give one key. The record id is
    /// never changed.
    fn join(object: &str, record_id: &str) -> Self {
        Self(format!("{}:{record_id}", object.to_ascii_lowercase()))
    }

    /// The key of a row as stored in its `RecordKey` column, taken as is: no validation, no
    /// case folding, no trimming, so that reading a row never fails and writing the key back
    /// gives the same text.
    ///
    /// This is for text read back from the outbox table (which foreign code or an older release
    /// may have written without [`RecordKey::new`]'s rules). It is **not** for deriving the key
    /// of a new event: use [`record_key_from_payload`] or [`RecordKey::new`], which validate and
    /// fold the object name's case, so that one record always gets one key.
    ///
    /// ```
    /// use record_key::RecordKey;
    /// let stored = RecordKey::from_stored("Lead: legacy key ");
    /// assert_eq!(stored.as_str(), "Lead: legacy key ");
    /// assert_eq!(RecordKey::from_stored("lead:00Q1"), RecordKey::new("Lead", "00Q1").unwrap());
    /// ```
    pub fn from_stored(text: impl Into<String>) -> Self {
        Self(text.into())
    }

    /// The key as stored in the `RecordKey` column.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a payload could not yield a `RecordKey`.
///
/// [`RecordKeyError::InvalidJson`] keeps the parser's error as its
/// [`source`](std::error::Error::source) (with its line and column); the other variants hold
/// no underlying error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordKeyError {
    /// The payload is not valid JSON; the parser's error is the source.
    #[error("payload is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    /// The payload is JSON but not an object.
    #[error("payload is not a JSON object")]
    NotAnObject,
    /// The payload has a `record_id` but no `object` naming the record's object.
    #[error("payload has a record_id but no object")]
    MissingObject,
    /// The `object` member is not a valid object API name.
    #[error("object is not a valid object API name: {0}")]
    InvalidObject(String),
    /// The `record_id` member is not a usable record identifier.
    #[error("record_id is invalid: {0}")]
    InvalidRecordId(String),
    /// The `snapshot` member is present but not a JSON object.
    #[error("snapshot is not a JSON object")]
    InvalidSnapshot,
}

/// The parsed envelope of an outbox event payload. Its `Debug` names the record and the
/// snapshot's field names only: the values are customer data and are never printed.
#[derive(Clone, PartialEq)]
pub struct EventEnvelope {
    /// The object API name, when the event names one.
    pub object: Option<String>,
    /// The record identifier, when the event is about one record.
    pub record_id: Option<String>,
    /// The frozen field snapshot (empty when the payload carries none).
    pub snapshot: Map<String, Value>,
    /// The whole payload, for members the envelope does not name.
    pub raw: Map<String, Value>,
}

impl fmt::Debug for EventEnvelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fields: Vec<&str> = self.snapshot.keys().map(String::as_str).collect();
        f.debug_struct("EventEnvelope")
            .field("object", &self.object)
            .field("record_id", &self.record_id)
            .field("snapshot_fields", &fields)
            .finish_non_exhaustive()
    }
}

impl EventEnvelope {
    /// Parses and validates a payload. Fails exactly when [`record_key_from_payload`] fails.
    pub fn parse(payload: &str) -> Result<Self, RecordKeyError> {
        let value: Value = serde_json::from_str(payload).map_err(RecordKeyError::InvalidJson)?;
        Self::from_value(value)
    }

    /// Validates an already parsed payload.
    pub fn from_value(value: Value) -> Result<Self, RecordKeyError> {
        let Value::Object(raw) = value else {
            return Err(RecordKeyError::NotAnObject);
        };
        let object = match raw.get("object") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                validate_object(s)?;
                Some(s.clone())
            }
            Some(other) => {
                return Err(RecordKeyError::InvalidObject(format!(
                    "expected a string, found {}",
                    json_kind(other)
                )));
            }
        };
        let record_id = match raw.get("record_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                validate_record_id(s)?;
                Some(s.clone())
            }
            Some(other) => {
                return Err(RecordKeyError::InvalidRecordId(format!(
                    "expected a string, found {}",
                    json_kind(other)
                )));
            }
        };
        if record_id.is_some() && object.is_none() {
            return Err(RecordKeyError::MissingObject);
        }
        let snapshot = match raw.get("snapshot") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(_) => return Err(RecordKeyError::InvalidSnapshot),
        };
        Ok(Self {
            object,
            record_id,
            snapshot,
            raw,
        })
    }

    /// The record key of this event, or `None` for an event about no record.
    pub fn record_key(&self) -> Option<RecordKey> {
        match (&self.object, &self.record_id) {
            (Some(object), Some(record_id)) => Some(RecordKey::join(object, record_id)),
            _ => None,
        }
    }
}

/// Derives the `RecordKey` of an event payload: `Ok(None)` for an event about no record, an
/// error for a payload that is not a valid envelope.
///
/// ```
/// use record_key::record_key_from_payload;
/// let key = record_key_from_payload(r#"{"object":"Lead","record_id":"00Q1","snapshot":{}}"#);
/// assert_eq!(key.unwrap().unwrap().as_str(), "lead:00Q1");
/// assert_eq!(record_key_from_payload(r#"{"kind":"nightly-digest"}"#).unwrap(), None);
/// ```
pub fn record_key_from_payload(payload: &str) -> Result<Option<RecordKey>, RecordKeyError> {
    EventEnvelope::parse(payload).map(|envelope| envelope.record_key())
}

fn validate_object(object: &str) -> Result<(), RecordKeyError> {
    let mut chars = object.chars();
    let valid_start = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    let valid_rest = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if object.len() > MAX_OBJECT_LEN {
        return Err(RecordKeyError::InvalidObject(format!(
            "longer than {MAX_OBJECT_LEN} bytes"
        )));
    }
    if !valid_start || !valid_rest {
        return Err(RecordKeyError::InvalidObject(format!("{object:?}")));
    }
    Ok(())
}

fn validate_record_id(record_id: &str) -> Result<(), RecordKeyError> {
    if record_id.is_empty() {
        return Err(RecordKeyError::InvalidRecordId("empty".into()));
    }
    if record_id.len() > MAX_RECORD_ID_LEN {
        return Err(RecordKeyError::InvalidRecordId(format!(
            "longer than {MAX_RECORD_ID_LEN} bytes"
        )));
    }
    if record_id.trim() != record_id {
        return Err(RecordKeyError::InvalidRecordId(
            "leading or trailing white space".into(),
        ));
    }
    if record_id.chars().any(char::is_control) {
        return Err(RecordKeyError::InvalidRecordId(
            "contains a control character".into(),
        ));
    }
    Ok(())
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests;
