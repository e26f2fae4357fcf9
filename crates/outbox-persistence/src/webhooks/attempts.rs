//! The delivery attempts' log (`_System_OutboxWebhookAttempt`): one row per HTTP attempt.

use sqlx::Row;

use super::{DeliveryAttempt, RESPONSE_BODY_KEPT, now_text};
use crate::{EventId, Result, Tx};

/// The first [`RESPONSE_BODY_KEPT`] bytes of `body`, cut at a character boundary, without NUL
/// (PostgreSQL's `text` refuses it; a receiver may send anything).
pub fn clip_body(body: &str) -> String {
    let body = body.replace('\0', "\u{fffd}");
    let mut end = body.len().min(RESPONSE_BODY_KEPT);
    while !body.is_char_boundary(end) {
        end -= 1;
    }
    body[..end].to_string()
}

/// Keeps one attempt of a delivery; nothing when its outbox row is gone (pruned meanwhile: its
/// attempts go with it).
pub async fn record_delivery_attempt(tx: &mut Tx, attempt: &DeliveryAttempt) -> Result<()> {
    let body = attempt.response_body.as_deref().map(clip_body);
    let error = attempt.error.as_deref().map(clip_body);
    match tx {
        Tx::Postgres(tx) => {
            crate::statement::query(
                "INSERT INTO _System_OutboxWebhookAttempt
                   (Endpoint, EventId, SourceEventId, Attempt, StatusCode, LatencyMs, ResponseBody, Error)
                 SELECT $1, $2, $3, $4, $5, $6, $7, $8
                 WHERE EXISTS (SELECT 1 FROM _System_OutboxEvent WHERE Id = $2)",
            )
            .bind(&attempt.endpoint)
            .bind(attempt.event_id)
            .bind(attempt.source_event_id)
            .bind(attempt.attempt)
            .bind(attempt.status_code)
            .bind(attempt.latency_ms)
            .bind(body)
            .bind(error)
            .execute(&mut **tx)
            .await?;
        }
        Tx::Sqlite(tx) => {
            crate::statement::query(
                "INSERT INTO _System_OutboxWebhookAttempt
                   (Endpoint, EventId, SourceEventId, Attempt, StatusCode, LatencyMs, ResponseBody, Error, At)
                 SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9
                 WHERE EXISTS (SELECT 1 FROM _System_OutboxEvent WHERE Id = $2)",
            )
            .bind(&attempt.endpoint)
            .bind(attempt.event_id.to_string())
            .bind(attempt.source_event_id.to_string())
            .bind(attempt.attempt)
            .bind(attempt.status_code)
            .bind(attempt.latency_ms)
            .bind(body)
            .bind(error)
            .bind(now_text())
            .execute(&mut **tx)
            .await?;
        }
    }
    Ok(())
}

/// Keeps several attempts, in their order ([`delivery_attempts`] reads them newest first),
/// each as [`record_delivery_attempt`] keeps one: nothing for one whose outbox row is gone. On
/// PostgreSQL in one statement (the webhooks' side writer keeps a batch's attempts with it);
/// on SQLite one after another.
pub async fn record_delivery_attempts(tx: &mut Tx, attempts: &[DeliveryAttempt]) -> Result<()> {
    match tx {
        Tx::Postgres(pg) if attempts.len() > 1 => {
            let clipped = |f: fn(&DeliveryAttempt) -> &Option<String>| -> Vec<Option<String>> {
                attempts
                    .iter()
                    .map(|a| f(a).as_deref().map(clip_body))
                    .collect()
            };
            crate::statement::query(
                "INSERT INTO _System_OutboxWebhookAttempt
                   (Endpoint, EventId, SourceEventId, Attempt, StatusCode, LatencyMs, ResponseBody, Error)
                 SELECT a.Endpoint, a.EventId, a.SourceEventId, a.Attempt, a.StatusCode, a.LatencyMs,
                        a.ResponseBody, a.Error
                 FROM unnest($1::text[], $2::uuid[], $3::uuid[], $4::integer[], $5::integer[],
                             $6::integer[], $7::text[], $8::text[]) WITH ORDINALITY
                      AS a (Endpoint, EventId, SourceEventId, Attempt, StatusCode, LatencyMs,
                            ResponseBody, Error, N)
                 WHERE EXISTS (SELECT 1 FROM _System_OutboxEvent e WHERE e.Id = a.EventId)
                 ORDER BY a.N",
            )
            .bind(attempts.iter().map(|a| a.endpoint.clone()).collect::<Vec<_>>())
            .bind(attempts.iter().map(|a| a.event_id).collect::<Vec<_>>())
            .bind(attempts.iter().map(|a| a.source_event_id).collect::<Vec<_>>())
            .bind(attempts.iter().map(|a| a.attempt).collect::<Vec<_>>())
            .bind(attempts.iter().map(|a| a.status_code).collect::<Vec<_>>())
            .bind(attempts.iter().map(|a| a.latency_ms).collect::<Vec<_>>())
            .bind(clipped(|a| &a.response_body))
            .bind(clipped(|a| &a.error))
            .execute(&mut **pg)
            .await?;
        }
        _ => {
            for attempt in attempts {
                record_delivery_attempt(tx, attempt).await?;
            }
        }
    }
    Ok(())
}

/// Which attempts [`delivery_attempts`] reads.
#[derive(Debug, Clone)]
pub enum AttemptsOf {
    /// An endpoint's newest.
    Endpoint(String),
    /// Those carrying these source events (the first 500), for every endpoint.
    SourceEvents(Vec<EventId>),
}

/// Delivery attempts, newest first, at most `limit`.
pub async fn delivery_attempts(
    tx: &mut Tx,
    of: &AttemptsOf,
    limit: u32,
) -> Result<Vec<DeliveryAttempt>> {
    const COLS: &str =
        "Endpoint, EventId, SourceEventId, Attempt, At, StatusCode, LatencyMs, ResponseBody, Error";
    let (filter, binds): (String, Vec<String>) = match of {
        AttemptsOf::Endpoint(name) => ("Endpoint = $1".into(), vec![name.clone()]),
        AttemptsOf::SourceEvents(ids) => {
            let ids: Vec<String> = ids.iter().take(500).map(|id| id.to_string()).collect();
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            let marks: Vec<String> = match tx {
                Tx::Postgres(_) => (1..=ids.len()).map(|i| format!("${i}::uuid")).collect(),
                Tx::Sqlite(_) => (1..=ids.len()).map(|i| format!("${i}")).collect(),
            };
            (format!("SourceEventId IN ({})", marks.join(", ")), ids)
        }
    };
    // Built from constants and numbered placeholders: every value is bound.
    let sql = format!(
        "SELECT {COLS} FROM _System_OutboxWebhookAttempt WHERE {filter} ORDER BY Id DESC LIMIT {limit}"
    );
    let mut out = Vec::new();
    match tx {
        Tx::Postgres(tx) => {
            let mut query = crate::statement::query(sqlx::AssertSqlSafe(sql));
            for b in &binds {
                query = query.bind(b);
            }
            for row in query.fetch_all(&mut **tx).await? {
                out.push(DeliveryAttempt {
                    endpoint: row.try_get(0)?,
                    event_id: row.try_get(1)?,
                    source_event_id: row.try_get(2)?,
                    attempt: row.try_get(3)?,
                    at: Some(row.try_get(4)?),
                    status_code: row.try_get(5)?,
                    latency_ms: row.try_get(6)?,
                    response_body: row.try_get(7)?,
                    error: row.try_get(8)?,
                });
            }
        }
        Tx::Sqlite(tx) => {
            let mut query = crate::statement::query(sqlx::AssertSqlSafe(sql));
            for b in &binds {
                query = query.bind(b);
            }
            for row in query.fetch_all(&mut **tx).await? {
                out.push(DeliveryAttempt {
                    endpoint: row.try_get(0)?,
                    event_id: crate::sqlite::parse_id(&row.try_get::<String, _>(1)?)?,
                    source_event_id: crate::sqlite::parse_id(&row.try_get::<String, _>(2)?)?,
                    attempt: row.try_get::<i64, _>(3)? as i32,
                    at: Some(crate::sqlite::parse_ts(&row.try_get::<String, _>(4)?)?),
                    status_code: row.try_get::<Option<i64>, _>(5)?.map(|c| c as i32),
                    latency_ms: row.try_get::<i64, _>(6)? as i32,
                    response_body: row.try_get(7)?,
                    error: row.try_get(8)?,
                });
            }
        }
    }
    Ok(out)
}
