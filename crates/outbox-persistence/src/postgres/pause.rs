//! Pausing and resuming an event type, and the audit log of operator actions, on PostgreSQL.

use chrono::{DateTime, Utc};

use super::PgOutbox;
use super::sql::db_now;
use crate::pause::{PAUSE, RESUME, type_detail};
use crate::{AuditEntry, PausedType, Result};

const PAUSE_TYPE: &str = concat!(
    "INSERT INTO _System_OutboxPausedType (EventType, PausedAt, PausedBy) VALUES ($2, ",
    db_now!(),
    ", $3) ON CONFLICT (EventType) DO NOTHING"
);

const RESUME_TYPE: &str = "DELETE FROM _System_OutboxPausedType WHERE EventType = $1";

const PAUSED: &str =
    "SELECT EventType, PausedAt, PausedBy FROM _System_OutboxPausedType ORDER BY EventType";

const AUDIT: &str = concat!(
    "INSERT INTO _System_OutboxAudit (At, Actor, Action, Detail) VALUES (",
    db_now!(),
    ", $2, $3, $4)"
);

const AUDIT_LOG: &str = "SELECT At, Actor, Action, Detail FROM _System_OutboxAudit \
     ORDER BY Id DESC LIMIT $1";

impl PgOutbox {
    /// Writes one audit row in `tx`.
    pub(super) async fn audit(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
        actor: &str,
        action: &str,
        detail: &str,
    ) -> Result<()> {
        sqlx::query(AUDIT)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(actor)
            .bind(action)
            .bind(detail)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Pauses (`pause`) or resumes `event_type`, audited when it changed anything.
    pub(super) async fn set_paused(
        &self,
        event_type: &str,
        actor: &str,
        pause: bool,
    ) -> Result<bool> {
        crate::pause::refuse_webhook_resume(event_type, pause)?;
        let mut tx = self.begin_write().await?;
        let changed = if pause {
            sqlx::query(PAUSE_TYPE)
                .persistent(self.cached())
                .bind(self.shift())
                .bind(event_type)
                .bind(actor)
                .execute(&mut *tx)
                .await?
        } else {
            sqlx::query(RESUME_TYPE)
                .persistent(self.cached())
                .bind(event_type)
                .execute(&mut *tx)
                .await?
        }
        .rows_affected()
            > 0;
        if changed {
            let action = if pause { PAUSE } else { RESUME };
            self.audit(&mut tx, actor, action, &type_detail(event_type))
                .await?;
        }
        tx.commit().await?;
        Ok(changed)
    }

    pub(super) async fn paused(&self) -> Result<Vec<PausedType>> {
        let mut read = self.begin_read().await?;
        let rows: Vec<(String, DateTime<Utc>, String)> = sqlx::query_as(PAUSED)
            .persistent(self.cached())
            .fetch_all(&mut *read)
            .await?;
        read.commit().await?;
        Ok(rows
            .into_iter()
            .map(|(event_type, paused_at, paused_by)| PausedType {
                event_type,
                paused_at,
                paused_by,
            })
            .collect())
    }

    pub(super) async fn audit_entries(&self, limit: u32) -> Result<Vec<AuditEntry>> {
        let mut read = self.begin_read().await?;
        let rows: Vec<(DateTime<Utc>, String, String, String)> = sqlx::query_as(AUDIT_LOG)
            .persistent(self.cached())
            .bind(i64::from(limit))
            .fetch_all(&mut *read)
            .await?;
        read.commit().await?;
        Ok(rows
            .into_iter()
            .map(|(at, actor, action, detail)| AuditEntry {
                at,
                actor,
                action,
                detail,
            })
            .collect())
    }
}
