//! The operators' side on SQLite: `stats`, `retry_failed`, the `RecordKey` backfill and the
//! reads (`get_event`, `list_events`).

use sqlx::Row;

use super::claim::{event_from_row, row_from};
use super::time::{format_ts, next_written, parse_id, parse_ts};
use super::{SqliteOutbox, json_list, readable};
use crate::attempt::chrono_span;
use crate::stats::{STATUS_COUNTS, blocked_heads, count_blocked, count_statuses};
use crate::{
    BackfillPage, ClaimPolicy, EventFilter, EventId, EventRow, OutboxEvent, OutboxStats, Result,
    RetryFilter,
};

/// The oldest pending row's `CreatedDate`, stale claims (`?1`: the observed stale ids) and
/// retrying rows.
const QUEUE_AGES: &str = "SELECT
       (SELECT min(CreatedDate) FROM _System_OutboxEvent WHERE Status = 'pending'),
       (SELECT count(*) FROM _System_OutboxEvent
          WHERE Status = 'processing' AND Id IN (SELECT value FROM json_each(?1))),
       (SELECT count(*) FROM _System_OutboxEvent
          WHERE Status = 'pending' AND RetryCount > 0)";

/// Blocked keys by the state of their head: `?1` the observed stale ids, `?2` the retry cutoff.
const BLOCKED_KEYS: &str = concat!(
    "SELECT
       coalesce(sum(h.Status = 'processing' AND h.Id NOT IN (SELECT value FROM json_each(?1))), 0),
       coalesce(sum(h.Status = 'processing' AND h.Id IN (SELECT value FROM json_each(?1))), 0),
       coalesce(sum(h.Status = 'pending' AND h.RetryCount > 0 AND h.LastModifiedDate >= ?2), 0)",
    blocked_heads!()
);

const SELECT_BY_ID: &str = "\
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError,
       rowid
FROM _System_OutboxEvent WHERE Id = ?1";

/// The rows an [`EventFilter`] selects, without payloads: `?1` statuses, `?3` ids (JSON arrays
/// or NULL), `?2` event type, `?4` record key, `?5` limit (NULL: no limit).
const LIST_EVENTS: &str = "\
SELECT Id, EventType, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent
WHERE (?1 IS NULL OR Status IN (SELECT value FROM json_each(?1)))
  AND (?2 IS NULL OR EventType = ?2)
  AND (?3 IS NULL OR Id IN (SELECT value FROM json_each(?3)))
  AND (?4 IS NULL OR RecordKey = ?4)
ORDER BY CreatedDate, Id
LIMIT coalesce(?5, -1)";

/// The oldest `?2` non-terminal rows of the key `?1` (`outbox_record_key_idx`: its predicate
/// spelled as the index's, so that SQLite uses it).
const KEY_ROWS: &str = "\
SELECT Id, EventType, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent
WHERE RecordKey = ?1 AND Status NOT IN ('processed', 'failed')
ORDER BY CreatedDate, Id
LIMIT ?2";

/// How many non-terminal rows the key `?1` has, counted up to `?2`.
const KEY_ROWS_COUNT: &str = "\
SELECT count(*) FROM (
    SELECT 1 FROM _System_OutboxEvent
    WHERE RecordKey = ?1 AND Status NOT IN ('processed', 'failed')
    LIMIT ?2)";

/// The newest failed row of the key `?1` (`outbox_failed_by_record_idx`).
const KEY_NEWEST_FAILED: &str = "\
SELECT Id, EventType, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent
WHERE RecordKey = ?1 AND Status = 'failed'
ORDER BY CreatedDate DESC, Id DESC
LIMIT 1";

const BACKFILL_SCAN: &str = "SELECT Id, Payload, RecordKey FROM _System_OutboxEvent
     WHERE Status NOT IN ('processed', 'failed') AND (?1 IS NULL OR Id > ?1)
     ORDER BY Id LIMIT ?2";

impl SqliteOutbox {
    pub(super) async fn read_stats(&self, policy: ClaimPolicy) -> Result<OutboxStats> {
        let mut stats = OutboxStats::default();
        let mut conn = self.pool.acquire().await?;
        let counts = sqlx::query_as(STATUS_COUNTS).fetch_all(&mut *conn).await?;
        count_statuses(&mut stats, counts);
        let stale = self.stale_ids(&mut conn, policy.stale_after, None).await?;
        let now = self.now();
        let (oldest, stale_claims, retrying): (Option<String>, i64, i64) =
            sqlx::query_as(QUEUE_AGES)
                .bind(&stale)
                .fetch_one(&mut *conn)
                .await?;
        if let Some(oldest) = oldest {
            let age = now - parse_ts(&oldest)?;
            stats.oldest_pending_age_seconds =
                Some(age.num_microseconds().unwrap_or(0) as f64 / 1e6);
        }
        stats.stale_claims = stale_claims as u64;
        stats.retrying = retrying as u64;
        let blocked = sqlx::query_as(BLOCKED_KEYS)
            .bind(&stale)
            .bind(format_ts(now - chrono_span(policy.retry_delay)))
            .fetch_one(&mut *conn)
            .await?;
        count_blocked(&mut stats, blocked);
        Ok(stats)
    }

    /// Retries the failed rows `filter` selects; with an `actor`, its audit row commits with it.
    pub(super) async fn retry(&self, filter: RetryFilter, actor: Option<&str>) -> Result<u64> {
        // One writer: no claim runs while this transaction holds the write lock, and the
        // in-flight guard keeps the retried row waiting while its key has a live claim.
        let (mut tx, _) = self.begin_write().await?;
        let now = self.now();
        let (ids, all, event_type) = match &filter {
            RetryFilter::Id(id) => (vec![id.to_string()], false, None),
            RetryFilter::Ids(ids) => (ids.iter().map(|id| id.to_string()).collect(), false, None),
            RetryFilter::Failed { event_type } => (Vec::new(), true, event_type.clone()),
        };
        let ids = serde_json::to_string(&ids).expect("ids serialize");
        let failed: Vec<(String, String)> = sqlx::query_as(
            "SELECT Id, LastModifiedDate FROM _System_OutboxEvent
             WHERE Status = 'failed' AND ((?2 AND (?3 IS NULL OR EventType = ?3))
                                          OR Id IN (SELECT value FROM json_each(?1)))",
        )
        .bind(&ids)
        .bind(all)
        .bind(&event_type)
        .fetch_all(&mut *tx)
        .await?;
        let mut rows = 0;
        for (id, last_modified) in failed {
            let written = next_written(now, parse_ts(&last_modified).unwrap_or(now));
            rows += sqlx::query(
                "UPDATE _System_OutboxEvent SET Status = 'pending', RetryCount = 0,
                   LastModifiedDate = ?2
                 WHERE Id = ?1 AND Status = 'failed'",
            )
            .bind(id)
            .bind(format_ts(written))
            .execute(&mut *tx)
            .await?
            .rows_affected();
        }
        if let Some(actor) = actor {
            let detail = crate::pause::retry_detail(&filter, rows);
            super::pause::audit(&mut tx, now, actor, crate::pause::RETRY, &detail).await?;
        }
        tx.commit().await?;
        Ok(rows)
    }

    pub(super) async fn missing_record_keys(&self) -> Result<u64> {
        let mut missing = 0;
        let mut after: Option<(String, String)> = None;
        loop {
            let page: Vec<(String, String, String)> = sqlx::query_as(
                "SELECT CreatedDate, Id, Payload FROM _System_OutboxEvent
                 WHERE RecordKey IS NULL AND Status NOT IN ('processed', 'failed')
                   AND (?1 IS NULL OR CreatedDate > ?1 OR (CreatedDate = ?1 AND Id > ?2))
                 ORDER BY CreatedDate, Id LIMIT ?3",
            )
            .bind(after.as_ref().map(|a| a.0.clone()))
            .bind(after.as_ref().map(|a| a.1.clone()))
            .bind(i64::from(crate::UNKEYED_PAGE_ROWS))
            .fetch_all(&self.pool)
            .await?;
            missing += crate::derivable_keys(page.iter().map(|(_, _, p)| p.as_str()));
            match page.last() {
                Some((at, id, _)) if page.len() >= crate::UNKEYED_PAGE_ROWS as usize => {
                    after = Some((at.clone(), id.clone()));
                }
                _ => return Ok(missing),
            }
        }
    }

    pub(super) async fn backfill(
        &self,
        after: Option<EventId>,
        batch: u32,
        dry_run: bool,
    ) -> Result<BackfillPage> {
        let rows = sqlx::query(BACKFILL_SCAN)
            .bind(after.map(|id| id.to_string()))
            .bind(i64::from(batch))
            .fetch_all(&self.pool)
            .await?;
        let scanned: Vec<(EventId, String, Option<String>)> = rows
            .iter()
            .map(|r| {
                Ok((
                    parse_id(&r.try_get::<String, _>(0)?)?,
                    r.try_get(1)?,
                    r.try_get(2)?,
                ))
            })
            .collect::<Result<_>>()?;
        let (mut page, updates) = crate::classify_backfill(&scanned, batch);
        if !dry_run && !updates.is_empty() {
            let (mut tx, _) = self.begin_write().await?;
            let mut keyed = Vec::with_capacity(updates.len());
            // Only `pending` rows: keying a running row could put two rows of its new key in
            // flight (see `BackfillPage::in_flight`).
            for (id, key) in &updates {
                let done = sqlx::query(
                    "UPDATE _System_OutboxEvent SET RecordKey = ?2
                     WHERE Id = ?1 AND RecordKey IS NULL AND Status = 'pending'",
                )
                .bind(id.to_string())
                .bind(key)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if done > 0 {
                    keyed.push(*id);
                }
            }
            tx.commit().await?;
            let meant: Vec<EventId> = updates.iter().map(|(id, _)| *id).collect();
            page.settle(&meant, &keyed);
        }
        Ok(page)
    }

    pub(super) async fn read_event(&self, id: EventId) -> Result<Option<OutboxEvent>> {
        let row = sqlx::query(SELECT_BY_ID)
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(event_from_row).transpose()
    }

    pub(super) async fn read_key_page(&self, key: &str, limit: u32) -> Result<crate::KeyPage> {
        // One read transaction: one snapshot for the three reads.
        let mut tx = self.pool.begin().await?;
        let rows = sqlx::query(KEY_ROWS)
            .bind(key)
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        let counted: i64 = sqlx::query_scalar(KEY_ROWS_COUNT)
            .bind(key)
            .bind(crate::KEY_ROWS_COUNTED as i64 + 1)
            .fetch_one(&mut *tx)
            .await?;
        let failed = sqlx::query(KEY_NEWEST_FAILED)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        let rows = readable(&rows, row_from);
        let last_failed = failed
            .as_ref()
            .and_then(|r| readable(std::slice::from_ref(r), row_from).pop());
        Ok(crate::KeyPage::new(rows, counted, last_failed))
    }

    pub(super) async fn list(&self, filter: EventFilter) -> Result<Vec<EventRow>> {
        let statuses = filter
            .status_texts()
            .map(|s| serde_json::to_string(&s).expect("a list of strings serializes"));
        let ids: Option<Vec<String>> = filter
            .id_list()
            .map(|ids| ids.iter().map(EventId::to_string).collect());
        let rows = sqlx::query(LIST_EVENTS)
            .bind(statuses)
            .bind(filter.event_type.as_deref())
            .bind(json_list(ids.as_deref()))
            .bind(filter.record_key.as_deref())
            .bind(filter.limit.map(i64::from))
            .fetch_all(&self.pool)
            .await?;
        // As `get_pending_events`: a row that cannot be read is left out, with a warning.
        Ok(readable(&rows, row_from))
    }
}
