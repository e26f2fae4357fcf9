//! The record heads' check, repair and rebuild on SQLite (`_System_OutboxHead`, kept by the
//! migrations' triggers; see `crate::Database::check_heads`).

use super::SqliteOutbox;
use crate::{HeadsRepair, Result};

/// Each key's oldest non-terminal row, as the outbox rows say.
const TRUE_HEADS: &str = "\
SELECT e.RecordKey, e.CreatedDate, e.Id FROM _System_OutboxEvent e
WHERE e.RecordKey IS NOT NULL AND e.Status NOT IN ('processed', 'failed')
  AND NOT EXISTS (
    SELECT 1 FROM _System_OutboxEvent o
    WHERE o.RecordKey = e.RecordKey AND o.Status NOT IN ('processed', 'failed')
      AND (o.CreatedDate, o.Id) < (e.CreatedDate, e.Id))";

impl SqliteOutbox {
    /// The record keys whose head in `_System_OutboxHead` differs from the outbox rows (see
    /// [`crate::Database::check_heads`]).
    pub async fn check_heads(&self) -> Result<Vec<String>> {
        let sql = format!(
            "WITH truth AS ({TRUE_HEADS})
             SELECT t.RecordKey FROM truth t
             LEFT JOIN _System_OutboxHead h ON h.RecordKey = t.RecordKey
             WHERE h.Id IS NOT t.Id OR h.CreatedDate IS NOT t.CreatedDate
             UNION
             SELECT h.RecordKey FROM _System_OutboxHead h
             WHERE h.RecordKey NOT IN (SELECT RecordKey FROM truth)
             ORDER BY 1 LIMIT 1000"
        );
        Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?)
    }

    /// Repairs the heads of at most `max_keys` keys (see
    /// [`crate::OutboxRepository::repair_heads`]). SQLite has one writer, so its triggers keep
    /// the heads exact; what differs was written around them (a head changed by hand, rows
    /// copied in with the triggers dropped). The check reads without the write lock; only a
    /// difference takes it, and each key is looked at again under it.
    pub(super) async fn repair_head_rows(&self, max_keys: u32) -> Result<HeadsRepair> {
        let mut report = HeadsRepair::default();
        let keys = self.check_heads().await?;
        if keys.is_empty() {
            return Ok(report);
        }
        let (mut tx, _) = self.begin_write().await?;
        for key in keys.into_iter().take(max_keys as usize) {
            let truth: Option<(String, String)> = sqlx::query_as(
                "SELECT CreatedDate, Id FROM _System_OutboxEvent
                 WHERE RecordKey = ?1 AND Status NOT IN ('processed', 'failed')
                 ORDER BY CreatedDate, Id LIMIT 1",
            )
            .bind(&key)
            .fetch_optional(&mut *tx)
            .await?;
            let head: Option<(String, String)> = sqlx::query_as(
                "SELECT CreatedDate, Id FROM _System_OutboxHead WHERE RecordKey = ?1",
            )
            .bind(&key)
            .fetch_optional(&mut *tx)
            .await?;
            let kind = match (&truth, &head) {
                (Some(t), Some(h)) if t != h => "misplaced",
                (Some(_), None) => "missing",
                (None, Some(_)) => "left over",
                _ => continue,
            };
            sqlx::query("DELETE FROM _System_OutboxHead WHERE RecordKey = ?1")
                .bind(&key)
                .execute(&mut *tx)
                .await?;
            if let Some((created, id)) = truth {
                sqlx::query(
                    "INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id) VALUES (?1, ?2, ?3)",
                )
                .bind(&key)
                .bind(created)
                .bind(id)
                .execute(&mut *tx)
                .await?;
            }
            report.add(key, kind);
        }
        tx.commit().await?;
        Ok(report)
    }

    /// Rebuilds `_System_OutboxHead` from the outbox rows (see
    /// [`crate::Database::rebuild_heads`]); returns the number of heads.
    pub async fn rebuild_heads(&self) -> Result<u64> {
        let (mut tx, _) = self.begin_write().await?;
        sqlx::query("DELETE FROM _System_OutboxHead")
            .execute(&mut *tx)
            .await?;
        let sql =
            format!("INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id) {TRUE_HEADS}");
        let n = sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(n)
    }
}
