//! Pausing and resuming an event type, and the audit log of operator actions, on SQLite.

use chrono::{DateTime, Utc};

use super::time::{format_ts, parse_ts};
use super::{SqliteOutbox, WriteTx};
use crate::pause::{PAUSE, RESUME, type_detail};
use crate::{AuditEntry, PausedType, Result};

/// Writes one audit row in `tx`, at `at`.
pub(super) async fn audit(
    tx: &mut WriteTx,
    at: DateTime<Utc>,
    actor: &str,
    action: &str,
    detail: &str,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO _System_OutboxAudit (At, Actor, Action, Detail) VALUES (?1, ?2, ?3, ?4)",
    )
    .bind(format_ts(at))
    .bind(actor)
    .bind(action)
    .bind(detail)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl SqliteOutbox {
    /// Pauses (`pause`) or resumes `event_type`, audited when it changed anything.
    pub(super) async fn set_paused(
        &self,
        event_type: &str,
        actor: &str,
        pause: bool,
    ) -> Result<bool> {
        crate::pause::refuse_webhook_resume(event_type, pause)?;
        let (mut tx, _) = self.begin_write().await?;
        let now = self.now();
        let changed = if pause {
            sqlx::query(
                "INSERT INTO _System_OutboxPausedType (EventType, PausedAt, PausedBy)
                 VALUES (?1, ?2, ?3) ON CONFLICT (EventType) DO NOTHING",
            )
            .bind(event_type)
            .bind(format_ts(now))
            .bind(actor)
            .execute(&mut *tx)
            .await?
        } else {
            sqlx::query("DELETE FROM _System_OutboxPausedType WHERE EventType = ?1")
                .bind(event_type)
                .execute(&mut *tx)
                .await?
        }
        .rows_affected()
            > 0;
        if changed {
            let action = if pause { PAUSE } else { RESUME };
            audit(&mut tx, now, actor, action, &type_detail(event_type)).await?;
        }
        tx.commit().await?;
        Ok(changed)
    }

    pub(super) async fn paused(&self) -> Result<Vec<PausedType>> {
        let rows: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT EventType, PausedAt, PausedBy FROM _System_OutboxPausedType ORDER BY EventType",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(event_type, paused_at, paused_by)| {
                Ok(PausedType {
                    event_type,
                    paused_at: parse_ts(&paused_at)?,
                    paused_by,
                })
            })
            .collect()
    }

    pub(super) async fn audit_entries(&self, limit: u32) -> Result<Vec<AuditEntry>> {
        let rows: Vec<(String, String, String, String)> = sqlx::query_as(
            "SELECT At, Actor, Action, Detail FROM _System_OutboxAudit ORDER BY Id DESC LIMIT ?1",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(at, actor, action, detail)| {
                Ok(AuditEntry {
                    at: parse_ts(&at)?,
                    actor,
                    action,
                    detail,
                })
            })
            .collect()
    }
}
