//! Time and identifiers as SQLite stores them: fixed-width UTC text, so that the design's
//! comparisons work on them as written (a trigger rewrites any other shape that other code
//! writes, see migration 0003), and ids as canonical UUID text.

use chrono::{DateTime, SecondsFormat, Utc};
use uuid::Uuid;

use crate::{ClockShift, Error, EventId, Result, truncate_micros};

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

/// Reads a stored id (any spelling of a UUID).
pub(crate) fn parse_id(s: &str) -> Result<EventId> {
    Uuid::parse_str(s)
        .map_err(|e| Error::Database(sqlx::Error::Decode(format!("bad id {s:?}: {e}").into())))
}

/// The host's time plus the clock shift, at the precision stored.
pub(super) fn host_now(shift: &ClockShift) -> DateTime<Utc> {
    truncate_micros(Utc::now() + shift.host_wall())
}

/// The value a fenced write stores: strictly after the value it replaces.
pub(super) fn next_written(now: DateTime<Utc>, previous: DateTime<Utc>) -> DateTime<Utc> {
    truncate_micros(now).max(previous + chrono::Duration::microseconds(1))
}
