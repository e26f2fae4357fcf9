//! The queue's clock and the blocked keys on SQLite (see [`crate::keys`]).

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::SqliteOutbox;
use super::claim::row_from;
use super::time::{parse_id, parse_ts};
use crate::keys::{BlockedKey, blocked_key, blocked_keys_sql};
use crate::{ClaimPolicy, Result};

impl SqliteOutbox {
    /// The host's clock plus the clock shift: the time every queue statement uses here.
    pub(super) fn read_clock(&self) -> DateTime<Utc> {
        self.now()
    }

    pub(super) async fn read_blocked_keys(
        &self,
        policy: ClaimPolicy,
        limit: u32,
    ) -> Result<Vec<BlockedKey>> {
        // A database without the pause table (not migrated yet) has nothing paused.
        let paused = self.paused().await.unwrap_or_default();
        let rows = sqlx::query(sqlx::AssertSqlSafe(blocked_keys_sql(limit)))
            .fetch_all(self.pool())
            .await?;
        let now = self.read_clock();
        rows.iter()
            .map(|row| {
                let running: Option<String> = row.try_get("RunningId")?;
                let beat: Option<String> = row.try_get("RunningBeat")?;
                let running = match running.zip(beat) {
                    Some((id, beat)) => Some((parse_id(&id)?, parse_ts(&beat)?)),
                    None => None,
                };
                Ok(blocked_key(
                    row_from(row)?,
                    (
                        row.try_get("Waiting")?,
                        parse_ts(&row.try_get::<String, _>("WaitingSince")?)?,
                    ),
                    running,
                    now,
                    policy,
                ))
            })
            .collect::<Result<Vec<_>>>()
            .map(|keys| crate::keys::mark_paused(keys, &paused))
    }
}
