//! Where an action's values come from ([`Source`]), and how a JSON value becomes a bound
//! parameter of its column's type.

use std::time::{SystemTime, UNIX_EPOCH};

use record_key::EventEnvelope;
use serde_json::Value;

use crate::registry::{Column, ColumnType};
use crate::{Error, Result};

/// A deterministic value: a pure function of the frozen event.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// The named field of the event's frozen `snapshot`.
    Snapshot(String),
    /// The event's `record_id` (the record the event is about).
    RecordId,
    /// A constant.
    Literal(Value),
}

impl Source {
    /// The named snapshot field.
    pub fn snapshot(field: impl Into<String>) -> Self {
        Source::Snapshot(field.into())
    }

    /// A constant.
    pub fn literal(value: impl Into<Value>) -> Self {
        Source::Literal(value.into())
    }

    /// The value for `event`.
    pub(crate) fn resolve<'e>(&'e self, event: &'e EventEnvelope) -> Result<Value> {
        match self {
            Source::Snapshot(field) => event
                .snapshot
                .get(field)
                .cloned()
                .ok_or_else(|| Error::MissingSnapshotField(field.clone())),
            Source::RecordId => event
                .record_id
                .clone()
                .map(Value::String)
                .ok_or(Error::MissingRecordId),
            Source::Literal(value) => Ok(value.clone()),
        }
    }
}

impl From<Value> for Source {
    fn from(value: Value) -> Self {
        Source::Literal(value)
    }
}

/// A value ready to bind, typed by its column. A null keeps its column's type, so that a
/// statement is always prepared with the same parameter types.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum BindValue {
    /// A null of the given column type.
    Null(ColumnType),
    /// Text.
    Text(String),
    /// An integer.
    Integer(i64),
    /// A double.
    Real(f64),
    /// A boolean.
    Boolean(bool),
    /// A JSON document, serialized.
    Json(String),
    /// RFC 3339 text.
    Timestamp(String),
}

impl BindValue {
    /// The column type this value binds as.
    pub(crate) fn ty(&self) -> ColumnType {
        match self {
            BindValue::Null(ty) => *ty,
            BindValue::Text(_) => ColumnType::Text,
            BindValue::Integer(_) => ColumnType::Integer,
            BindValue::Real(_) => ColumnType::Real,
            BindValue::Boolean(_) => ColumnType::Boolean,
            BindValue::Json(_) => ColumnType::Json,
            BindValue::Timestamp(_) => ColumnType::Timestamp,
        }
    }

    /// Whether this is a null.
    pub(crate) fn is_null(&self) -> bool {
        matches!(self, BindValue::Null(_))
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a fractional number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Converts `value` for `column`, refusing a value of another type rather than guessing.
pub(crate) fn to_bind(column: &Column, value: &Value) -> Result<BindValue> {
    to_bind_as(column.name().as_str(), column.ty(), value)
}

/// Converts `value` to a bound value of type `ty`; `column` names it in errors.
pub(crate) fn to_bind_as(column: &str, ty: ColumnType, value: &Value) -> Result<BindValue> {
    let mismatch = || Error::TypeMismatch {
        column: column.to_string(),
        expected: ty,
        found: kind(value),
    };
    if value.is_null() {
        return Ok(BindValue::Null(ty));
    }
    Ok(match ty {
        ColumnType::Text => BindValue::Text(value.as_str().ok_or_else(mismatch)?.to_string()),
        ColumnType::Integer => BindValue::Integer(value.as_i64().ok_or_else(mismatch)?),
        ColumnType::Real => BindValue::Real(value.as_f64().ok_or_else(mismatch)?),
        ColumnType::Boolean => BindValue::Boolean(value.as_bool().ok_or_else(mismatch)?),
        ColumnType::Json => BindValue::Json(value.to_string()),
        ColumnType::Timestamp => {
            BindValue::Timestamp(value.as_str().ok_or_else(mismatch)?.to_string())
        }
    })
}

/// Formats `t` as RFC 3339 UTC text with microseconds (`YYYY-MM-DDTHH:MM:SS.ffffffZ`), the
/// format SQLite stores and PostgreSQL parses. Times before 1970 are clamped to the epoch.
pub fn format_timestamp(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let micros = since.subsec_micros();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Howard Hinnant's `civil_from_days`: the proleptic Gregorian date `days` after 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc_with_microseconds() {
        assert_eq!(format_timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        let t = UNIX_EPOCH + Duration::from_micros(951_782_400_123_456);
        assert_eq!(format_timestamp(t), "2000-02-29T00:00:00.123456Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_767_225_599);
        assert_eq!(format_timestamp(t), "2025-12-31T23:59:59.000000Z");
    }

    #[test]
    fn values_must_fit_their_column_type() {
        let bind = |ty, v| to_bind_as("C", ty, &v);
        assert_eq!(
            bind(ColumnType::Text, json!("x")).unwrap(),
            BindValue::Text("x".into())
        );
        assert_eq!(
            bind(ColumnType::Integer, json!(7)).unwrap(),
            BindValue::Integer(7)
        );
        assert_eq!(
            bind(ColumnType::Real, json!(7)).unwrap(),
            BindValue::Real(7.0)
        );
        assert_eq!(
            bind(ColumnType::Json, json!([1])).unwrap(),
            BindValue::Json("[1]".into())
        );
        assert_eq!(
            bind(ColumnType::Integer, json!(null)).unwrap(),
            BindValue::Null(ColumnType::Integer)
        );
        let err = bind(ColumnType::Integer, json!(1.5)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "column C is integer, but the value is a fractional number"
        );
        assert!(bind(ColumnType::Text, json!(7)).is_err());
        assert!(bind(ColumnType::Boolean, json!("true")).is_err());
    }

    #[test]
    fn sources_resolve_against_the_frozen_event() {
        let event = EventEnvelope::from_value(json!({
            "object": "Lead", "record_id": "00Q1", "snapshot": {"Company": "Acme"}
        }))
        .unwrap();
        assert_eq!(Source::RecordId.resolve(&event).unwrap(), json!("00Q1"));
        assert_eq!(
            Source::snapshot("Company").resolve(&event).unwrap(),
            json!("Acme")
        );
        assert_eq!(Source::literal(3).resolve(&event).unwrap(), json!(3));
        assert!(matches!(
            Source::snapshot("Missing").resolve(&event),
            Err(Error::MissingSnapshotField(_))
        ));
        let no_record = EventEnvelope::from_value(json!({"kind": "digest"})).unwrap();
        assert!(matches!(
            Source::RecordId.resolve(&no_record),
            Err(Error::MissingRecordId)
        ));
    }
}
