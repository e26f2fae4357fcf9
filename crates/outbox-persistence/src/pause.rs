//! What the pause, resume and retry of an operator write in the audit log, alike on both
//! backends (`_System_OutboxPausedType`, `_System_OutboxAudit`: migrations 0010 on PostgreSQL,
//! 0006 on SQLite).

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::RetryFilter;

/// The audit log's `Action` of a retry.
pub(crate) const RETRY: &str = "retry";
/// The audit log's `Action` of a pause.
pub(crate) const PAUSE: &str = "pause";
/// The audit log's `Action` of a resume.
pub(crate) const RESUME: &str = "resume";

/// The most ids a retry's audit row names one by one.
const IDS_NAMED: usize = 20;

/// The audit log's `Detail` of a retry that changed `rows` rows.
pub(crate) fn retry_detail(filter: &RetryFilter, rows: u64) -> String {
    let what = match filter {
        RetryFilter::Id(id) => format!("event {id}"),
        RetryFilter::Ids(ids) => {
            let named: Vec<String> = ids
                .iter()
                .take(IDS_NAMED)
                .map(|id| id.to_string())
                .collect();
            let more = ids.len().saturating_sub(IDS_NAMED);
            if more > 0 {
                format!("events {} and {more} more", named.join(", "))
            } else {
                format!("events {}", named.join(", "))
            }
        }
        RetryFilter::Failed { event_type: None } => "every failed event".to_string(),
        RetryFilter::Failed {
            event_type: Some(event_type),
        } => format!("every failed event of type {event_type:?}"),
    };
    format!("{what}: {rows} row(s) back to pending")
}

/// A webhook endpoint's deliveries (`webhook:<name>`) are paused while it is disabled and
/// resumed by enabling it: resumed alone, every delivery would be claimed, find the endpoint
/// disabled and burn an attempt, until all ended `failed`.
pub(crate) fn refuse_webhook_resume(event_type: &str, pause: bool) -> crate::Result<()> {
    match event_type.strip_prefix(crate::webhooks::DELIVERY_TYPE_PREFIX) {
        Some(endpoint) if !pause => Err(crate::Error::Invalid(format!(
            "{event_type:?} holds the deliveries of webhook endpoint {endpoint:?}: enable the endpoint (`outbox webhooks enable {endpoint}`), which resumes them"
        ))),
        _ => Ok(()),
    }
}

/// The audit log's `Detail` of a pause or resume.
pub(crate) fn type_detail(event_type: &str) -> String {
    format!("event type {event_type:?}")
}

/// An event type an operator paused: dispatchers claim none of its rows until it is resumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PausedType {
    /// The paused `EventType`.
    pub event_type: String,
    /// When it was paused (the database's clock).
    pub paused_at: DateTime<Utc>,
    /// Who paused it (a console token's name, or the CLI's actor).
    pub paused_by: String,
}

/// One operator action (a pause, a resume, a retry), as the audit log keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuditEntry {
    /// When (the database's clock).
    pub at: DateTime<Utc>,
    /// Who: a console token's name, or the CLI's actor.
    pub actor: String,
    /// `pause`, `resume` or `retry`.
    pub action: String,
    /// What it acted on and how many rows it changed.
    pub detail: String,
}
