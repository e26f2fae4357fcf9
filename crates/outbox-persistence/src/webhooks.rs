//! Webhook endpoints and their delivery attempts (`_System_OutboxWebhookEndpoint`,
//! `_System_OutboxWebhookAttempt`: migrations 0017 on PostgreSQL, 0010 on SQLite; see
//! docs/webhooks.md). The `outbox-webhooks` crate fans events out to the endpoints and
//! delivers them; this module only reads and writes the two tables, in a transaction the
//! caller holds, and audits every change an operator makes.
//!
//! A disabled endpoint's event type (`webhook:<name>`) is paused in the same transaction, so
//! its deliveries wait in order until it is enabled again (`_System_OutboxPausedType`).

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::Row;

use crate::{Error, EventId, Result, Tx};

mod attempts;
pub use attempts::{
    AttemptsOf, clip_body, delivery_attempts, record_delivery_attempt, record_delivery_attempts,
};

/// The event type of an endpoint's deliveries.
pub fn delivery_event_type(endpoint: &str) -> String {
    format!("{DELIVERY_TYPE_PREFIX}{endpoint}")
}

/// What every delivery's event type starts with.
pub const DELIVERY_TYPE_PREFIX: &str = "webhook:";

/// The most bytes of a receiver's response body an attempt keeps.
pub const RESPONSE_BODY_KEPT: usize = 4096;

/// A secret as the endpoint keeps it; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretText(pub String);

impl fmt::Debug for SecretText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretText(<redacted>)")
    }
}

/// An endpoint, as the table keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WebhookEndpoint {
    /// Its name (lower-case letters, digits, `-` and `_`, up to 63): part of its deliveries'
    /// event type and record keys.
    pub name: String,
    /// Where deliveries are POSTed.
    pub url: String,
    /// The event types it receives; empty: every type the fan-out is registered for.
    pub event_types: Vec<String>,
    /// Whether it receives deliveries now.
    pub enabled: bool,
    /// Why it was disabled (an operator, a 410, sustained failure).
    pub disabled_reason: Option<String>,
    /// Failed attempts since its last success.
    pub consecutive_failures: i32,
    /// The secret deliveries are signed with.
    #[serde(skip)]
    pub secret: SecretText,
    /// The secret before the last rotation, still signed with until `previous_secret_until`.
    #[serde(skip)]
    pub previous_secret: Option<SecretText>,
    /// When the rotation's overlap ends.
    pub previous_secret_until: Option<DateTime<Utc>>,
    /// When it was added.
    pub created_date: DateTime<Utc>,
}

impl WebhookEndpoint {
    /// Whether it receives `event_type`.
    pub fn subscribes_to(&self, event_type: &str) -> bool {
        self.event_types.is_empty() || self.event_types.iter().any(|t| t == event_type)
    }

    /// The secrets to sign with at `now`: the current one, and the previous one during a
    /// rotation's overlap.
    pub fn signing_secrets(&self, now: DateTime<Utc>) -> Vec<&str> {
        let mut secrets = vec![self.secret.0.as_str()];
        if let (Some(previous), Some(until)) = (&self.previous_secret, self.previous_secret_until)
            && now < until
        {
            secrets.push(previous.0.as_str());
        }
        secrets
    }
}

/// One HTTP attempt of a delivery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeliveryAttempt {
    /// The endpoint's name.
    pub endpoint: String,
    /// The delivery's outbox row.
    pub event_id: EventId,
    /// The event the delivery carries.
    pub source_event_id: EventId,
    /// 1 for the first attempt.
    pub attempt: i32,
    /// When it was made (the database's clock on PostgreSQL).
    pub at: Option<DateTime<Utc>>,
    /// The receiver's status, if it answered.
    pub status_code: Option<i32>,
    /// From the request's start to the response's end (or the error).
    pub latency_ms: i32,
    /// The first [`RESPONSE_BODY_KEPT`] bytes of the response body.
    pub response_body: Option<String>,
    /// What went wrong, if anything (a status that is not 2xx, a timeout, a refused address).
    pub error: Option<String>,
}

/// Whether a name may name an endpoint.
pub fn valid_endpoint_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-' || *b == b'_')
}

const COLUMNS: &str = "Name, Url, EventTypes, Secret, PreviousSecret, PreviousSecretUntil, Enabled, \
                       DisabledReason, ConsecutiveFailures, CreatedDate";

fn now_text() -> String {
    crate::sqlite::format_ts(crate::truncate_micros(Utc::now()))
}

fn endpoint_of_pg(row: &sqlx::postgres::PgRow) -> Result<WebhookEndpoint> {
    Ok(WebhookEndpoint {
        name: row.try_get(0)?,
        url: row.try_get(1)?,
        event_types: parse_types(&row.try_get::<String, _>(2)?)?,
        secret: SecretText(row.try_get(3)?),
        previous_secret: row.try_get::<Option<String>, _>(4)?.map(SecretText),
        previous_secret_until: row.try_get(5)?,
        enabled: row.try_get(6)?,
        disabled_reason: row.try_get(7)?,
        consecutive_failures: row.try_get(8)?,
        created_date: row.try_get(9)?,
    })
}

fn endpoint_of_sqlite(row: &sqlx::sqlite::SqliteRow) -> Result<WebhookEndpoint> {
    let until: Option<String> = row.try_get(5)?;
    Ok(WebhookEndpoint {
        name: row.try_get(0)?,
        url: row.try_get(1)?,
        event_types: parse_types(&row.try_get::<String, _>(2)?)?,
        secret: SecretText(row.try_get(3)?),
        previous_secret: row.try_get::<Option<String>, _>(4)?.map(SecretText),
        previous_secret_until: until.as_deref().map(crate::sqlite::parse_ts).transpose()?,
        enabled: row.try_get::<i64, _>(6)? != 0,
        disabled_reason: row.try_get(7)?,
        consecutive_failures: row.try_get::<i64, _>(8)? as i32,
        created_date: crate::sqlite::parse_ts(&row.try_get::<String, _>(9)?)?,
    })
}

fn parse_types(text: &str) -> Result<Vec<String>> {
    serde_json::from_str(text)
        .map_err(|e| Error::Invalid(format!("an endpoint's EventTypes is not a JSON list: {e}")))
}

/// [`COLUMNS`] without the secrets (read as empty): what a listing needs, so that a reader
/// role may be refused the secret columns.
const LISTED: &str = "Name, Url, EventTypes, '' AS Secret, NULL AS PreviousSecret, PreviousSecretUntil, \
                      Enabled, DisabledReason, ConsecutiveFailures, CreatedDate";

/// The endpoints, by name, without their secrets ([`WebhookEndpoint::secret`] is empty: read
/// one endpoint with [`endpoint`] to sign).
pub async fn endpoints(tx: &mut Tx) -> Result<Vec<WebhookEndpoint>> {
    read_endpoints(tx, LISTED).await
}

/// The endpoints, by name, with their secrets: what a sender signs with.
pub async fn endpoints_to_send(tx: &mut Tx) -> Result<Vec<WebhookEndpoint>> {
    read_endpoints(tx, COLUMNS).await
}

async fn read_endpoints(tx: &mut Tx, columns: &str) -> Result<Vec<WebhookEndpoint>> {
    let sql = format!("SELECT {columns} FROM _System_OutboxWebhookEndpoint ORDER BY Name");
    match tx {
        Tx::Postgres(tx) => crate::statement::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&mut **tx)
            .await?
            .iter()
            .map(endpoint_of_pg)
            .collect(),
        Tx::Sqlite(tx) => crate::statement::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&mut **tx)
            .await?
            .iter()
            .map(endpoint_of_sqlite)
            .collect(),
    }
}

/// The endpoint `name`, if there is one.
pub async fn endpoint(tx: &mut Tx, name: &str) -> Result<Option<WebhookEndpoint>> {
    let sql = format!("SELECT {COLUMNS} FROM _System_OutboxWebhookEndpoint WHERE Name = $1");
    match tx {
        Tx::Postgres(tx) => crate::statement::query(sqlx::AssertSqlSafe(sql))
            .bind(name)
            .fetch_optional(&mut **tx)
            .await?
            .as_ref()
            .map(endpoint_of_pg)
            .transpose(),
        Tx::Sqlite(tx) => crate::statement::query(sqlx::AssertSqlSafe(sql))
            .bind(name)
            .fetch_optional(&mut **tx)
            .await?
            .as_ref()
            .map(endpoint_of_sqlite)
            .transpose(),
    }
}

/// An endpoint to add.
#[derive(Debug, Clone)]
pub struct NewEndpoint {
    /// See [`WebhookEndpoint::name`].
    pub name: String,
    /// See [`WebhookEndpoint::url`].
    pub url: String,
    /// See [`WebhookEndpoint::event_types`].
    pub event_types: Vec<String>,
    /// The secret to sign with (`whsec_` + base64).
    pub secret: SecretText,
}

/// Adds `endpoint`, audited as `actor`'s; `false` when an endpoint of that name exists (left
/// as it is).
pub async fn add_endpoint(tx: &mut Tx, endpoint: &NewEndpoint, actor: &str) -> Result<bool> {
    if !valid_endpoint_name(&endpoint.name) {
        return Err(Error::Invalid(format!(
            "{:?} cannot name an endpoint: lower-case letters, digits, '-' and '_', up to 63, starting with a letter or digit",
            endpoint.name
        )));
    }
    let types = serde_json::to_string(&endpoint.event_types).expect("strings serialize");
    let added = match tx {
        Tx::Postgres(tx) => crate::statement::query(
            "INSERT INTO _System_OutboxWebhookEndpoint (Name, Url, EventTypes, Secret)
             VALUES ($1, $2, $3, $4) ON CONFLICT (Name) DO NOTHING",
        )
        .bind(&endpoint.name)
        .bind(&endpoint.url)
        .bind(&types)
        .bind(&endpoint.secret.0)
        .execute(&mut **tx)
        .await?
        .rows_affected(),
        Tx::Sqlite(tx) => crate::statement::query(
            "INSERT INTO _System_OutboxWebhookEndpoint
               (Name, Url, EventTypes, Secret, CreatedDate, LastModifiedDate)
             VALUES ($1, $2, $3, $4, $5, $5) ON CONFLICT (Name) DO NOTHING",
        )
        .bind(&endpoint.name)
        .bind(&endpoint.url)
        .bind(&types)
        .bind(&endpoint.secret.0)
        .bind(now_text())
        .execute(&mut **tx)
        .await?
        .rows_affected(),
    } == 1;
    if added {
        let detail = format!(
            "endpoint {:?}: {} for {}",
            endpoint.name,
            endpoint.url,
            if endpoint.event_types.is_empty() {
                "every event type".to_string()
            } else {
                endpoint.event_types.join(", ")
            }
        );
        audit(tx, actor, "webhook-add", &detail).await?;
    }
    Ok(added)
}

/// Enables or disables the endpoint `name` (`reason`: why it is disabled), pausing or resuming
/// its deliveries' event type in the same transaction, audited as `actor`'s; `false` when there
/// is no such endpoint or it already was so.
pub async fn set_endpoint_enabled(
    tx: &mut Tx,
    name: &str,
    enabled: bool,
    reason: Option<&str>,
    actor: &str,
) -> Result<bool> {
    let changed = match tx {
        Tx::Postgres(tx) => crate::statement::query(
            "UPDATE _System_OutboxWebhookEndpoint
             SET Enabled = $2, DisabledReason = $3, ConsecutiveFailures = 0,
                 LastModifiedDate = clock_timestamp()
             WHERE Name = $1 AND Enabled <> $2",
        )
        .bind(name)
        .bind(enabled)
        .bind(reason.filter(|_| !enabled))
        .execute(&mut **tx)
        .await?
        .rows_affected(),
        Tx::Sqlite(tx) => crate::statement::query(
            "UPDATE _System_OutboxWebhookEndpoint
             SET Enabled = $2, DisabledReason = $3, ConsecutiveFailures = 0,
                 LastModifiedDate = $4
             WHERE Name = $1 AND Enabled <> $2",
        )
        .bind(name)
        .bind(enabled as i64)
        .bind(reason.filter(|_| !enabled))
        .bind(now_text())
        .execute(&mut **tx)
        .await?
        .rows_affected(),
    } == 1;
    if changed {
        let event_type = delivery_event_type(name);
        pause_deliveries(tx, &event_type, !enabled, actor).await?;
        if enabled {
            due_now(tx, &event_type).await?;
        }
    }
    if changed {
        let (action, detail) = if enabled {
            ("webhook-enable", format!("endpoint {name:?}"))
        } else {
            (
                "webhook-disable",
                format!("endpoint {name:?}: {}", reason.unwrap_or("by an operator")),
            )
        };
        audit(tx, actor, action, &detail).await?;
    }
    Ok(changed)
}

/// Makes an enabled endpoint's waiting deliveries due now: a retry's wait that ran past the
/// enable (a schedule's hours) would hold the endpoint's records for nothing. Pending rows
/// only: a claimed row's `LastModifiedDate` is its worker's fence.
async fn due_now(tx: &mut Tx, event_type: &str) -> Result<()> {
    match tx {
        Tx::Postgres(tx) => crate::statement::query(
            "UPDATE _System_OutboxEvent SET LastModifiedDate = clock_timestamp()
             WHERE EventType = $1 AND Status = 'pending' AND LastModifiedDate > clock_timestamp()",
        )
        .bind(event_type)
        .execute(&mut **tx)
        .await
        .map(drop)?,
        Tx::Sqlite(tx) => crate::statement::query(
            "UPDATE _System_OutboxEvent SET LastModifiedDate = $2
             WHERE EventType = $1 AND Status = 'pending' AND LastModifiedDate > $2",
        )
        .bind(event_type)
        .bind(now_text())
        .execute(&mut **tx)
        .await
        .map(drop)?,
    }
    Ok(())
}

/// Pauses (`pause`) or resumes an endpoint's deliveries' event type.
async fn pause_deliveries(tx: &mut Tx, event_type: &str, pause: bool, actor: &str) -> Result<()> {
    const RESUME: &str = "DELETE FROM _System_OutboxPausedType WHERE EventType = $1";
    match (tx, pause) {
        (Tx::Postgres(tx), true) => crate::statement::query(
            "INSERT INTO _System_OutboxPausedType (EventType, PausedAt, PausedBy)
             VALUES ($1, clock_timestamp(), $2) ON CONFLICT (EventType) DO NOTHING",
        )
        .bind(event_type)
        .bind(actor)
        .execute(&mut **tx)
        .await
        .map(drop)?,
        (Tx::Sqlite(tx), true) => crate::statement::query(
            "INSERT INTO _System_OutboxPausedType (EventType, PausedAt, PausedBy)
             VALUES ($1, $2, $3) ON CONFLICT (EventType) DO NOTHING",
        )
        .bind(event_type)
        .bind(now_text())
        .bind(actor)
        .execute(&mut **tx)
        .await
        .map(drop)?,
        (Tx::Postgres(tx), false) => crate::statement::query(RESUME)
            .bind(event_type)
            .execute(&mut **tx)
            .await
            .map(drop)?,
        (Tx::Sqlite(tx), false) => crate::statement::query(RESUME)
            .bind(event_type)
            .execute(&mut **tx)
            .await
            .map(drop)?,
    }
    Ok(())
}

/// Replaces the endpoint's secret with `secret`; the old one is still signed with for
/// `overlap`. Audited (without either secret) as `actor`'s; `false` when there is no such
/// endpoint.
pub async fn rotate_endpoint_secret(
    tx: &mut Tx,
    name: &str,
    secret: &SecretText,
    overlap: Duration,
    actor: &str,
) -> Result<bool> {
    let overlap = chrono::Duration::from_std(overlap)
        .map_err(|_| Error::Invalid("the rotation's overlap is too long".into()))?;
    let rotated = match tx {
        Tx::Postgres(tx) => crate::statement::query(
            "UPDATE _System_OutboxWebhookEndpoint
             SET PreviousSecret = Secret, Secret = $2,
                 PreviousSecretUntil = clock_timestamp() + make_interval(secs => $3),
                 LastModifiedDate = clock_timestamp()
             WHERE Name = $1",
        )
        .bind(name)
        .bind(&secret.0)
        .bind(overlap.num_milliseconds() as f64 / 1000.0)
        .execute(&mut **tx)
        .await?
        .rows_affected(),
        Tx::Sqlite(tx) => crate::statement::query(
            "UPDATE _System_OutboxWebhookEndpoint
             SET PreviousSecret = Secret, Secret = $2, PreviousSecretUntil = $3,
                 LastModifiedDate = $4
             WHERE Name = $1",
        )
        .bind(name)
        .bind(&secret.0)
        .bind(crate::sqlite::format_ts(crate::truncate_micros(
            Utc::now() + overlap,
        )))
        .bind(now_text())
        .execute(&mut **tx)
        .await?
        .rows_affected(),
    } == 1;
    if rotated {
        let detail = format!(
            "endpoint {name:?}: new secret; the previous one signs too for {}s",
            overlap.num_seconds()
        );
        audit(tx, actor, "webhook-rotate", &detail).await?;
    }
    Ok(rotated)
}

/// Counts a delivery's outcome on its endpoint: a success clears the failures, a failure adds
/// one. Returns the failures since the last success. A success with none to clear writes
/// nothing (the endpoint's row is every delivery's: no lock, no dead version for it).
pub async fn note_delivery(tx: &mut Tx, name: &str, succeeded: bool) -> Result<i32> {
    const NOTE: &str = "UPDATE _System_OutboxWebhookEndpoint
         SET ConsecutiveFailures = CASE WHEN $2 THEN 0 ELSE ConsecutiveFailures + 1 END
         WHERE Name = $1 AND NOT ($2 AND ConsecutiveFailures = 0)
         RETURNING ConsecutiveFailures";
    let failures: Option<i64> = match tx {
        Tx::Postgres(tx) => crate::statement::query_scalar::<_, i32>(NOTE)
            .bind(name)
            .bind(succeeded)
            .fetch_optional(&mut **tx)
            .await?
            .map(i64::from),
        Tx::Sqlite(tx) => {
            crate::statement::query_scalar(NOTE)
                .bind(name)
                .bind(succeeded)
                .fetch_optional(&mut **tx)
                .await?
        }
    };
    Ok(failures.unwrap_or(0) as i32)
}

/// An endpoint with its newest attempts, as the console shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointView {
    /// The endpoint (its secrets are never serialized or printed).
    pub endpoint: WebhookEndpoint,
    /// Its newest attempts, newest first.
    pub attempts: Vec<DeliveryAttempt>,
}

/// Every endpoint with its newest `attempts` attempts, read in one read-only transaction (on
/// a hot standby too): the console's webhooks page.
pub async fn console_view(db: &crate::Database, attempts: u32) -> Result<Vec<EndpointView>> {
    let mut tx = match db {
        crate::Database::Postgres(pool) => Tx::Postgres(crate::console::begin_read(pool).await?),
        crate::Database::Sqlite(pool) => Tx::Sqlite(pool.begin().await?),
    };
    let mut views = Vec::new();
    for endpoint in endpoints(&mut tx).await? {
        let of = AttemptsOf::Endpoint(endpoint.name.clone());
        let attempts = delivery_attempts(&mut tx, &of, attempts).await?;
        views.push(EndpointView { endpoint, attempts });
    }
    tx.rollback().await?;
    Ok(views)
}

/// One audit row in `tx`.
async fn audit(tx: &mut Tx, actor: &str, action: &str, detail: &str) -> Result<()> {
    match tx {
        Tx::Postgres(tx) => {
            crate::statement::query(
                "INSERT INTO _System_OutboxAudit (At, Actor, Action, Detail)
                 VALUES (clock_timestamp(), $1, $2, $3)",
            )
            .bind(actor)
            .bind(action)
            .bind(detail)
            .execute(&mut **tx)
            .await?;
        }
        Tx::Sqlite(tx) => {
            crate::statement::query(
                "INSERT INTO _System_OutboxAudit (At, Actor, Action, Detail) VALUES ($1, $2, $3, $4)",
            )
            .bind(now_text())
            .bind(actor)
            .bind(action)
            .bind(detail)
            .execute(&mut **tx)
            .await?;
        }
    }
    Ok(())
}
