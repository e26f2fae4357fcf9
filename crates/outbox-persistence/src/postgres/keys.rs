//! The queue's clock and the blocked keys on PostgreSQL (see [`crate::keys`]).

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::PgOutbox;
use super::claim::row_from;
use crate::keys::{BlockedKey, blocked_key, blocked_keys_sql};
use crate::{ClaimPolicy, Result};

impl PgOutbox {
    /// `clock_timestamp()` plus the clock shift: the time every queue statement uses.
    pub(super) async fn read_clock(&self) -> Result<DateTime<Utc>> {
        let mut tx = self.begin_read().await?;
        let now = sqlx::query_scalar("SELECT clock_timestamp() + $1::interval")
            .persistent(self.cached())
            .bind(self.shift())
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(now)
    }

    pub(super) async fn read_blocked_keys(
        &self,
        policy: ClaimPolicy,
        limit: u32,
    ) -> Result<Vec<BlockedKey>> {
        // A database without the pause table (not migrated yet) has nothing paused.
        let paused = self.paused().await.unwrap_or_default();
        let mut tx = self.begin_read().await?;
        let rows = sqlx::query(sqlx::AssertSqlSafe(blocked_keys_sql(limit)))
            .persistent(self.cached())
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let now = self.read_clock().await?;
        rows.iter()
            .map(|row| {
                let running: Option<uuid::Uuid> = row.try_get("runningid")?;
                let beat: Option<DateTime<Utc>> = row.try_get("runningbeat")?;
                Ok(blocked_key(
                    row_from(row)?,
                    (row.try_get("waiting")?, row.try_get("waitingsince")?),
                    running.zip(beat),
                    now,
                    policy,
                ))
            })
            .collect::<Result<Vec<_>>>()
            .map(|keys| crate::keys::mark_paused(keys, &paused))
    }
}
