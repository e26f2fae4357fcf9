//! Enqueue on SQLite: the write lock first, then `CreatedDate` from the host's clock, never
//! earlier than the newest non-terminal row of the same key.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::SqliteConnection;

use super::time::{format_ts, host_now, parse_ts};
use crate::{ClockShift, Error, EventId, NewEvent, Result, new_event_id};

/// Inserts `events` in order on `conn` (the caller's transaction), deriving each `RecordKey`.
///
/// It takes the database's write lock first (SQLite's one writer), then draws `CreatedDate`
/// from the host clock, never earlier than the newest non-terminal row of the same key plus one
/// microsecond: one record's events are ordered as their transactions commit, even when the
/// application opened a deferred transaction or the clock stepped back.
pub async fn enqueue(conn: &mut SqliteConnection, events: &[NewEvent]) -> Result<Vec<EventId>> {
    enqueue_shifted(conn, events, &ClockShift::default()).await
}

/// [`enqueue`] with the repository's clock shift.
pub(super) async fn enqueue_shifted(
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
    let now = host_now(shift);
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
