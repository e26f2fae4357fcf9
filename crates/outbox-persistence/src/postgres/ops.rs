//! The operators' side on PostgreSQL: `stats`, `retry_failed`, the `RecordKey` backfill, the
//! reads (`get_event`, `list_events`) and the plans `outbox explain` prints.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::claim::{event_from_row, row_from};
use super::sql::{CLAIM_NEXT, CLAIM_PLAN_SETTINGS, ELIGIBLE_QUERY, db_now};
use super::{PgOutbox, interval, span};
use crate::stats::{ESTIMATE_PROCESSED_ABOVE, count_blocked};
use crate::{
    BackfillPage, ClaimPolicy, EventFilter, EventId, EventRow, OutboxEvent, OutboxStats, Result,
    RetryFilter,
};

/// Rows by status but `processed`, from the partial indexes alone (an index-only count of
/// `outbox_eligible_idx`'s non-terminal rows less `outbox_in_flight_idx`'s processing ones;
/// `outbox_terminal_idx` for `failed`: a count of `Status = 'pending'` read every row's status
/// from the table, seconds on 10M rows), and the table's row estimate: `stats` counts the
/// `processed` rows ([`PROCESSED_COUNT`]) only when the estimate is below
/// [`ESTIMATE_PROCESSED_ABOVE`].
const STATUS_COUNTS: &str = "SELECT
   (SELECT count(*) FROM _System_OutboxEvent WHERE Status NOT IN ('processed', 'failed'))
     - (SELECT count(*) FROM _System_OutboxEvent
         WHERE Status NOT IN ('processed', 'failed') AND Status = 'processing'),
   (SELECT count(*) FROM _System_OutboxEvent
     WHERE Status NOT IN ('processed', 'failed') AND Status = 'processing'),
   (SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'failed'),
   (SELECT reltuples::float8 FROM pg_class WHERE oid = '_system_outboxevent'::regclass)";

/// The `processed` rows, counted (a small table).
const PROCESSED_COUNT: &str = "SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processed'";

/// Age of the oldest pending row, stale claims and retrying rows. `$1` the clock shift, `$2`
/// stale-after.
const QUEUE_AGES: &str = concat!(
    "WITH clock AS (SELECT ",
    db_now!(),
    " AS now)
     SELECT
       (SELECT EXTRACT(EPOCH FROM ((SELECT now FROM clock) - min(CreatedDate)))::float8
          FROM _System_OutboxEvent
         WHERE Status NOT IN ('processed', 'failed') AND Status = 'pending'),
       (SELECT count(*) FROM _System_OutboxEvent
          WHERE Status NOT IN ('processed', 'failed') AND Status = 'processing'
            AND LastModifiedDate < (SELECT now FROM clock) - $2::interval),
       (SELECT count(*) FROM _System_OutboxEvent
          WHERE Status NOT IN ('processed', 'failed') AND Status = 'pending' AND RetryCount > 0)"
);

/// Blocked keys by the state of their head. `$1` the clock shift, `$2` stale-after, `$3` the
/// retry delay. Only a head that is `processing` or retrying counts, so the walk starts from
/// those rows (`outbox_in_flight_idx` and `outbox_retrying_idx` of migration 0016) instead of
/// every non-terminal row (a hot record's 100,000 pending rows took 300 ms), keeps each
/// record's oldest of them, and probes its record for an older and a younger open row through
/// `outbox_record_key_idx` (10,000 retrying rows of one record: 13 ms, against 120 ms probing
/// each).
const BLOCKED_KEYS: &str = concat!(
    "WITH clock AS (SELECT ",
    db_now!(),
    " AS now),
     candidates AS MATERIALIZED (
       SELECT c.Id, c.RecordKey, c.CreatedDate, c.Status, c.RetryCount, c.LastModifiedDate
       FROM _System_OutboxEvent c
       WHERE c.RecordKey IS NOT NULL AND c.Status NOT IN ('processed', 'failed')
         AND (c.Status = 'processing' OR c.RetryCount > 0))
     SELECT
       count(*) FILTER (WHERE h.Status = 'processing'
                          AND h.LastModifiedDate >= (SELECT now FROM clock) - $2::interval),
       count(*) FILTER (WHERE h.Status = 'processing'
                          AND h.LastModifiedDate < (SELECT now FROM clock) - $2::interval),
       count(*) FILTER (WHERE h.Status = 'pending' AND h.RetryCount > 0
                          AND h.LastModifiedDate >= (SELECT now FROM clock) - $3::interval)
     FROM (SELECT DISTINCT ON (c.RecordKey) c.* FROM candidates c
           ORDER BY c.RecordKey, c.CreatedDate, c.Id) h
     WHERE NOT EXISTS (
         SELECT 1 FROM _System_OutboxEvent o
         WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
           AND (o.CreatedDate, o.Id) < (h.CreatedDate, h.Id))
       AND EXISTS (
         SELECT 1 FROM _System_OutboxEvent y
         WHERE y.RecordKey = h.RecordKey AND y.Status NOT IN ('processed', 'failed')
           AND (y.CreatedDate, y.Id) > (h.CreatedDate, h.Id))"
);

/// Holds every claim off until this transaction ends (see [`super::CLAIM_EXCLUSION_NAMESPACE`]):
/// a claim that is running commits first, and one that starts later takes its snapshot after
/// this transaction committed. Taken as the last statement before `COMMIT`, after the writes:
/// a write that waits for a lock (the head trigger's insert behind an application's open
/// enqueue) then never holds the claims of every process behind it.
pub(super) const EXCLUDE_CLAIMS: &str = "SELECT pg_advisory_xact_lock(3479, 0)::text";

/// `failed` rows back to `pending`, claimable at once (no claim straddles this transaction:
/// [`EXCLUDE_CLAIMS`]).
const RETRY_FAILED: &str = concat!(
    "UPDATE _System_OutboxEvent SET Status = 'pending', RetryCount = 0,
       LastModifiedDate = GREATEST(",
    db_now!(),
    ", LastModifiedDate + interval '1 microsecond')
     WHERE Status = 'failed'
       AND (($3 AND ($4::text IS NULL OR EventType = $4)) OR Id = ANY($2))"
);

const SELECT_BY_ID: &str = "SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, \
     CreatedDate, LastModifiedDate, LastError FROM _System_OutboxEvent WHERE Id = $1";

/// The rows an [`EventFilter`] selects, without payloads. `LIMIT NULL` is no limit.
const LIST_EVENTS: &str = "\
SELECT Id, EventType, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent
WHERE ($1::text[] IS NULL OR Status = ANY($1))
  AND ($2::text IS NULL OR EventType = $2)
  AND ($3::uuid[] IS NULL OR Id = ANY($3))
  AND ($4::text IS NULL OR RecordKey = $4)
ORDER BY CreatedDate, Id
LIMIT $5";

/// The oldest `$2` non-terminal rows of the key `$1` (`outbox_record_key_idx`).
const KEY_ROWS: &str = "\
SELECT Id, EventType, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent
WHERE RecordKey = $1 AND Status NOT IN ('processed', 'failed')
ORDER BY CreatedDate, Id
LIMIT $2";

/// How many non-terminal rows the key `$1` has, counted up to `$2`.
const KEY_ROWS_COUNT: &str = "\
SELECT count(*) FROM (
    SELECT 1 FROM _System_OutboxEvent
    WHERE RecordKey = $1 AND Status NOT IN ('processed', 'failed')
    LIMIT $2) AS counted";

/// The newest failed row of the key `$1` (`outbox_failed_by_record_idx`).
const KEY_NEWEST_FAILED: &str = "\
SELECT Id, EventType, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent
WHERE RecordKey = $1 AND Status = 'failed'
ORDER BY CreatedDate DESC, Id DESC
LIMIT 1";

/// A page of unkeyed non-terminal rows' payloads in `outbox_unkeyed_idx` order, after
/// (`$1`, `$2`).
const UNKEYED_PAGE: &str = "SELECT CreatedDate, Id, Payload FROM _System_OutboxEvent
     WHERE RecordKey IS NULL AND Status NOT IN ('processed', 'failed')
       AND ($1::timestamptz IS NULL OR (CreatedDate, Id) > ($1, $2))
     ORDER BY CreatedDate, Id LIMIT $3";

const BACKFILL_SCAN: &str = "SELECT Id, Payload, RecordKey FROM _System_OutboxEvent
     WHERE Status NOT IN ('processed', 'failed') AND ($1::uuid IS NULL OR Id > $1)
     ORDER BY Id LIMIT $2";

/// Keys only `pending` rows: a row being run keeps running unkeyed (keying it would put a
/// second row of its key in flight); see [`BackfillPage::in_flight`].
const BACKFILL_SET: &str = "UPDATE _System_OutboxEvent t SET RecordKey = u.key
     FROM UNNEST($1::uuid[], $2::text[]) AS u(id, key)
     WHERE t.Id = u.id AND t.RecordKey IS NULL AND t.Status = 'pending'
     RETURNING t.Id";

impl PgOutbox {
    pub(super) async fn read_stats(&self, policy: ClaimPolicy) -> Result<OutboxStats> {
        let mut stats = OutboxStats::default();
        let mut tx = self.begin_read().await?;
        let (pending, processing, failed, rows): (i64, i64, i64, Option<f64>) =
            sqlx::query_as(STATUS_COUNTS)
                .persistent(self.cached())
                .fetch_one(&mut *tx)
                .await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        (stats.pending, stats.processing, stats.failed) = (n(pending), n(processing), n(failed));
        match rows.filter(|r| *r >= ESTIMATE_PROCESSED_ABOVE) {
            Some(rows) => {
                stats.processed = n(rows as i64 - pending - processing - failed);
                stats.processed_estimated = true;
            }
            None => {
                let processed: i64 = sqlx::query_scalar(PROCESSED_COUNT)
                    .persistent(self.cached())
                    .fetch_one(&mut *tx)
                    .await?;
                stats.processed = n(processed);
            }
        }
        let (oldest, stale, retrying): (Option<f64>, i64, i64) = sqlx::query_as(QUEUE_AGES)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(span(policy.stale_after))
            .fetch_one(&mut *tx)
            .await?;
        stats.oldest_pending_age_seconds = oldest;
        stats.stale_claims = stale as u64;
        stats.retrying = retrying as u64;
        let blocked = sqlx::query_as(BLOCKED_KEYS)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(span(policy.stale_after))
            .bind(span(policy.retry_delay))
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        count_blocked(&mut stats, blocked);
        Ok(stats)
    }

    /// Retries the failed rows `filter` selects; with an `actor`, its audit row commits with it.
    pub(super) async fn retry(&self, filter: RetryFilter, actor: Option<&str>) -> Result<u64> {
        let (ids, all, event_type) = match &filter {
            RetryFilter::Id(id) => (vec![*id], false, None),
            RetryFilter::Ids(ids) => (ids.clone(), false, None),
            RetryFilter::Failed { event_type } => (Vec::new(), true, event_type.clone()),
        };
        let mut tx = self.begin_write().await?;
        let rows = sqlx::query(RETRY_FAILED)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(&ids)
            .bind(all)
            .bind(event_type.as_deref())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if let Some(actor) = actor {
            let detail = crate::pause::retry_detail(&filter, rows);
            self.audit(&mut tx, actor, crate::pause::RETRY, &detail)
                .await?;
        }
        self.commit_excluding_claims(tx).await?;
        Ok(rows)
    }

    pub(super) async fn missing_record_keys(&self) -> Result<u64> {
        let mut missing = 0;
        let mut after: Option<(DateTime<Utc>, EventId)> = None;
        loop {
            let mut read = self.begin_read().await?;
            let page: Vec<(DateTime<Utc>, EventId, String)> = sqlx::query_as(UNKEYED_PAGE)
                .persistent(self.cached())
                .bind(after.map(|a| a.0))
                .bind(after.map(|a| a.1))
                .bind(i64::from(crate::UNKEYED_PAGE_ROWS))
                .fetch_all(&mut *read)
                .await?;
            read.commit().await?;
            missing += crate::derivable_keys(page.iter().map(|(_, _, p)| p.as_str()));
            match page.last() {
                Some((at, id, _)) if page.len() >= crate::UNKEYED_PAGE_ROWS as usize => {
                    after = Some((*at, *id));
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
        let mut read = self.begin_read().await?;
        let scanned: Vec<(EventId, String, Option<String>)> = sqlx::query_as(BACKFILL_SCAN)
            .persistent(self.cached())
            .bind(after)
            .bind(i64::from(batch))
            .fetch_all(&mut *read)
            .await?;
        read.commit().await?;
        let (mut page, updates) = crate::classify_backfill(&scanned, batch);
        if !dry_run && !updates.is_empty() {
            let ids: Vec<EventId> = updates.iter().map(|(id, _)| *id).collect();
            let keys: Vec<&str> = updates.iter().map(|(_, k)| k.as_str()).collect();
            // Like a retry, the backfill holds claims off while it keys rows, so no claim
            // reads a row as unkeyed and claims it, or a row of its new key, after the key is
            // set.
            let mut tx = self.begin_write().await?;
            let keyed: Vec<EventId> = sqlx::query_scalar(BACKFILL_SET)
                .persistent(self.cached())
                .bind(&ids)
                .bind(&keys)
                .fetch_all(&mut *tx)
                .await?;
            self.commit_excluding_claims(tx).await?;
            page.settle(&ids, &keyed);
        }
        Ok(page)
    }

    pub(super) async fn read_event(&self, id: EventId) -> Result<Option<OutboxEvent>> {
        let mut tx = self.begin_read().await?;
        let row = sqlx::query(SELECT_BY_ID)
            .persistent(self.cached())
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        row.as_ref().map(event_from_row).transpose()
    }

    pub(super) async fn list(&self, filter: EventFilter) -> Result<Vec<EventRow>> {
        let mut tx = self.begin_read().await?;
        let rows = sqlx::query(LIST_EVENTS)
            .persistent(self.cached())
            .bind(filter.status_texts())
            .bind(filter.event_type.as_deref())
            .bind(filter.id_list())
            .bind(filter.record_key.as_deref())
            .bind(filter.limit.map(i64::from))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        rows.iter().map(row_from).collect()
    }

    pub(super) async fn read_key_page(&self, key: &str, limit: u32) -> Result<crate::KeyPage> {
        let mut tx = self.begin_read().await?;
        let rows = sqlx::query(KEY_ROWS)
            .persistent(self.cached())
            .bind(key)
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        let counted: i64 = sqlx::query_scalar(KEY_ROWS_COUNT)
            .persistent(self.cached())
            .bind(key)
            .bind(crate::KEY_ROWS_COUNTED as i64 + 1)
            .fetch_one(&mut *tx)
            .await?;
        let failed = sqlx::query(KEY_NEWEST_FAILED)
            .persistent(self.cached())
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        let rows = rows.iter().map(row_from).collect::<Result<Vec<_>>>()?;
        let last_failed = failed.as_ref().map(row_from).transpose()?;
        Ok(crate::KeyPage::new(rows, counted, last_failed))
    }

    /// Takes the claim-exclusion lock ([`EXCLUDE_CLAIMS`]) and commits: the claims running at
    /// that moment commit first, and those that start meanwhile take their snapshot after this
    /// commit.
    async fn commit_excluding_claims(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    ) -> Result<()> {
        sqlx::query(EXCLUDE_CLAIMS)
            .persistent(self.cached())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// The plans (`EXPLAIN`, nothing run) of the design's eligible query as written and of the
/// claim statement, named, for `outbox explain`.
pub async fn explain(
    pool: &PgPool,
    policy: ClaimPolicy,
) -> Result<Vec<(&'static str, Vec<String>)>> {
    plans(pool, policy, "EXPLAIN").await
}

/// The same plans run: `EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)`, each inside a transaction that
/// is rolled back, so the claim changes no row (for `outbox-bench --explain`). The claim is
/// planned as `claim_next` runs it with a scope (its `Scope::All` statement differs only by
/// the scope predicates).
pub async fn explain_analyze(
    pool: &PgPool,
    policy: ClaimPolicy,
) -> Result<Vec<(&'static str, Vec<String>)>> {
    plans(pool, policy, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)").await
}

async fn plans(
    pool: &PgPool,
    policy: ClaimPolicy,
    explain: &str,
) -> Result<Vec<(&'static str, Vec<String>)>> {
    let cached = super::pool_caches_statements(pool);
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?;
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .persistent(cached)
        .fetch_one(&mut *tx)
        .await?;
    let cutoff = |d: Duration| now - chrono::Duration::from_std(d).unwrap_or_default();
    let design: Vec<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("{explain} {ELIGIBLE_QUERY}")))
            .persistent(cached)
            .bind(cutoff(policy.stale_after))
            .bind(cutoff(policy.retry_delay))
            .bind(1_i64)
            .fetch_all(&mut *tx)
            .await?;
    let no_types: Option<Vec<String>> = None;
    // The claim runs inside `_System_OutboxClaimBatch` under these settings (migration 0008);
    // `EXPLAIN` cannot see into a function, so the statement is planned under them here.
    for (setting, value) in CLAIM_PLAN_SETTINGS {
        sqlx::query("SELECT set_config($1, $2, true)")
            .persistent(cached)
            .bind(setting)
            .bind(value)
            .execute(&mut *tx)
            .await?;
    }
    let claim: Vec<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("{explain} {CLAIM_NEXT}")))
            .persistent(cached)
            .bind(interval(0))
            .bind(span(policy.stale_after))
            .bind(span(policy.retry_delay))
            .bind(policy.max_retry_attempts)
            .bind(&no_types)
            .bind(&no_types)
            .fetch_all(&mut *tx)
            .await?;
    tx.rollback().await?;
    Ok(vec![
        ("eligible-event query (the design's, as written)", design),
        ("select-and-claim (claim_next)", claim),
    ])
}
