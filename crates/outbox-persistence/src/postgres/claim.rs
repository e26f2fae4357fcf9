//! Reading eligible rows and claiming them on PostgreSQL: each is one statement (see
//! [`super::sql`]), so concurrent workers skip each other's rows instead of queueing behind
//! them; and decoding the rows those statements return.

use std::time::Duration;

use sqlx::Row;
use sqlx::postgres::PgRow;

use super::sql::{CLAIM_BATCH_CALL, CLAIM_CHAINS, CLAIM_EVENT, ELIGIBLE_GUARDED};
use super::{PgOutbox, span};
use crate::{
    Claim, ClaimPolicy, Error, EventId, EventRow, EventStatus, Fence, HeadsRepair, OutboxEvent,
    RecordKey, Result, Scope,
};

/// The keys where `_System_OutboxHead` differs from the oldest non-terminal row of each key.
const HEADS_DIFF: &str = "\
WITH truth AS (
  SELECT DISTINCT ON (RecordKey) RecordKey, CreatedDate, Id
  FROM _System_OutboxEvent
  WHERE RecordKey IS NOT NULL AND Status NOT IN ('processed', 'failed')
  ORDER BY RecordKey, CreatedDate, Id
)
SELECT coalesce(t.RecordKey, h.RecordKey)
FROM truth t FULL JOIN _System_OutboxHead h ON h.RecordKey = t.RecordKey
WHERE t.Id IS DISTINCT FROM h.Id OR t.CreatedDate IS DISTINCT FROM h.CreatedDate
ORDER BY 1
LIMIT 1000";

/// Rebuilds `_System_OutboxHead` (the statement migration 0004 seeds it with), with the outbox's
/// writers held off. The transaction sets its lock timeout first, so that a rebuild queued
/// behind a long application transaction gives up instead of holding every enqueue and claim
/// behind its own lock request.
const HEADS_REBUILD: &str = "\
LOCK TABLE _System_OutboxEvent IN SHARE MODE;
DELETE FROM _System_OutboxHead;
INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
SELECT DISTINCT ON (RecordKey) RecordKey, CreatedDate, Id
FROM _System_OutboxEvent
WHERE RecordKey IS NOT NULL AND Status NOT IN ('processed', 'failed')
ORDER BY RecordKey, CreatedDate, Id;";

/// Takes the claim-exclusion lock shared (see `super::CLAIM_EXCLUSION_NAMESPACE`).
const CLAIMS_SHARE_EXCLUSION: &str = "SELECT pg_advisory_xact_lock_shared(3479, 0)::text";

/// Whether another caller is repairing the heads now (the function tries the same lock and
/// returns nothing when it is taken; asking first tells a skipped run from a clean one).
const HEADS_REPAIR_FREE: &str = "SELECT pg_try_advisory_xact_lock(3480, 0)";

/// The repair (migration 0009): `(RecordKey, repair)` for every key it changed.
const HEADS_REPAIR: &str = "SELECT * FROM _System_OutboxHeadRepair($1)";

/// How many claim statements one `claim_next` or `claim_batch` call runs while each returns
/// only exhausted stale rows (failed, not claimed) before it reports nothing to claim (the
/// worker calls again at once after an empty answer only when woken).
const MAX_EXHAUSTED_PER_CLAIM: usize = 16;

/// Decodes the columns every read selects but the payload (by name: PostgreSQL folds the
/// unquoted identifiers to lower case). The `RecordKey` is kept exactly as stored.
pub(super) fn row_from(row: &PgRow) -> Result<EventRow> {
    let status: String = row.try_get("status")?;
    let record_key: Option<String> = row.try_get("recordkey")?;
    Ok(EventRow {
        id: row.try_get("id")?,
        event_type: row.try_get("eventtype")?,
        status: status
            .parse()
            .map_err(|e: String| Error::Database(sqlx::Error::Decode(e.into())))?,
        record_key: record_key.map(RecordKey::from_stored),
        created_date: row.try_get("createddate")?,
        last_modified_date: row.try_get("lastmodifieddate")?,
        retry_count: row.try_get("retrycount")?,
        last_error: row.try_get("lasterror")?,
    })
}

/// Decodes a full row, payload included.
pub(super) fn event_from_row(row: &PgRow) -> Result<OutboxEvent> {
    Ok(row_from(row)?.with_payload(row.try_get("payload")?))
}

fn claim_from_row(row: &PgRow) -> Result<Claim> {
    let event = event_from_row(row)?;
    let old_status: String = row.try_get("old_status")?;
    Ok(Claim {
        fence: Fence {
            id: event.id,
            last_written: event.last_modified_date,
        },
        reclaimed: old_status == "processing",
        event,
    })
}

/// Whether a returned claim row is a real claim: a stale row whose dead attempt used up
/// `MaxRetryAttempts` comes back `failed` instead.
fn claimed_or_exhausted(row: &PgRow) -> Result<Option<Claim>> {
    let claim = claim_from_row(row)?;
    if claim.event.status == EventStatus::Failed {
        tracing::warn!(
            event_id = %claim.event.id,
            event_type = %claim.event.event_type,
            retry_count = claim.event.retry_count,
            "a stale claim used up MaxRetryAttempts (its worker died on every attempt): the event is failed"
        );
        return Ok(None);
    }
    Ok(Some(claim))
}

impl PgOutbox {
    /// The record keys whose head in `_System_OutboxHead` differs from the outbox rows (see
    /// [`crate::Database::check_heads`]).
    pub async fn check_heads(&self) -> Result<Vec<String>> {
        let mut tx = self.begin_unbounded_read().await?;
        let keys = sqlx::query_scalar(HEADS_DIFF)
            .persistent(self.cached())
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(keys)
    }

    /// Repairs the heads of at most `max_keys` keys (see
    /// [`crate::OutboxRepository::repair_heads`]): one call of `_System_OutboxHeadRepair`
    /// (migration 0009) in a transaction of its own, under the repository's lock timeout.
    pub(super) async fn repair_head_rows(&self, max_keys: u32) -> Result<HeadsRepair> {
        let mut tx = self.begin_write().await?;
        let free: bool = sqlx::query_scalar(HEADS_REPAIR_FREE)
            .persistent(self.cached())
            .fetch_one(&mut *tx)
            .await?;
        let mut report = HeadsRepair::default();
        if !free {
            report.skipped = true;
            tx.rollback().await?;
            return Ok(report);
        }
        let rows: Vec<(String, String)> = sqlx::query_as(HEADS_REPAIR)
            .persistent(self.cached())
            .bind(i32::try_from(max_keys).unwrap_or(i32::MAX))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        for (key, kind) in rows {
            report.add(key, &kind);
        }
        Ok(report)
    }

    /// Rebuilds `_System_OutboxHead` from the outbox rows (see
    /// [`crate::Database::rebuild_heads`]); returns the number of heads.
    pub async fn rebuild_heads(&self) -> Result<u64> {
        // The rebuild reads the whole table: no statement timeout.
        let mut spec = self.begin_spec(false);
        spec.statement_timeout = Duration::ZERO;
        let mut tx = self.begin_as(spec).await?;
        sqlx::raw_sql(HEADS_REBUILD).execute(&mut *tx).await?;
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM _System_OutboxHead")
            .persistent(self.cached())
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(n as u64)
    }

    pub(super) async fn eligible(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>> {
        let mut tx = self.begin_read().await?;
        let rows = sqlx::query(ELIGIBLE_GUARDED)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(span(policy.stale_after))
            .bind(span(policy.retry_delay))
            .bind(i64::from(limit))
            .bind(scope.only())
            .bind(scope.except())
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        rows.iter().map(event_from_row).collect()
    }

    pub(super) async fn claim_by_id(
        &self,
        id: EventId,
        policy: ClaimPolicy,
    ) -> Result<Option<Claim>> {
        // The claim-exclusion lock in a statement of its own, so that the claim's snapshot is
        // taken after it (as `_System_OutboxClaimBatch` does; see
        // `super::CLAIM_EXCLUSION_NAMESPACE`).
        let mut tx = self.begin_write().await?;
        sqlx::query(CLAIMS_SHARE_EXCLUSION)
            .persistent(self.cached())
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(CLAIM_EVENT)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(span(policy.stale_after))
            .bind(span(policy.retry_delay))
            .bind(policy.max_retry_attempts)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        match row {
            Some(row) => claimed_or_exhausted(&row),
            None => Ok(None),
        }
    }

    /// Claims up to `max` of the oldest eligible rows in one statement. A statement that
    /// returned only rows it ended `failed` as exhausted (their dead attempts used up
    /// `MaxRetryAttempts`) claimed nothing, and the rows behind them may be eligible now: it
    /// runs again, a bounded number of times. Once a statement claimed a row, its claims are
    /// returned at once (committed claims never wait for, or get lost in, another statement),
    /// even when exhausted rows took some of the batch's places. The claims come oldest
    /// first.
    pub(super) async fn claim_oldest(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        max: usize,
        chain: usize,
    ) -> Result<Vec<Claim>> {
        let chain = chain.min(crate::MAX_BATCH_EVENTS);
        let max = max.clamp(1, crate::MAX_CLAIM_BATCH);
        for _ in 0..MAX_EXHAUSTED_PER_CLAIM {
            // The statement runs inside `_System_OutboxClaimBatch` (migration 0008), whose
            // settings leave the planner only the ordered index walk, so the plan cached for
            // this prepared call stays right however the table's size moved since it was
            // planned (`CLAIM_BATCH_CALL`). It runs in a transaction of its own at READ
            // COMMITTED (the function takes the claim-exclusion lock in a statement before
            // its claim, whose snapshot is then taken after it; at a stricter level the
            // transaction's one snapshot would precede the lock). Its commit waits for the
            // disk unless the repository was built `with_async_claims`.
            let mut spec = self.begin_spec(false);
            spec.async_commit = self.async_claims;
            let mut tx = self.begin_as(spec).await?;
            let rows = sqlx::query(CLAIM_BATCH_CALL)
                .persistent(self.cached())
                .bind(self.shift())
                .bind(span(policy.stale_after))
                .bind(span(policy.retry_delay))
                .bind(policy.max_retry_attempts)
                .bind(scope.only())
                .bind(scope.except())
                .bind(max as i32)
                .bind(self.lock_timeout())
                .fetch_all(&mut *tx)
                .await?;
            let extra = max.saturating_sub(rows.len());
            let chains = if chain > 0 && extra > 0 {
                self.claim_chain_rows(&mut tx, &rows, scope, (chain, extra))
                    .await?
            } else {
                Vec::new()
            };
            let committed = tx.commit().await;
            let rows: Vec<PgRow> = rows.into_iter().chain(chains).collect();
            if let Err(e) = committed {
                return self.claims_that_landed(&rows, e.into()).await;
            }
            if rows.is_empty() {
                break;
            }
            let mut claims = Vec::with_capacity(rows.len());
            let mut undecodable = None;
            for row in &rows {
                // Every returned row is committed: decode them all before reporting an error,
                // so that no committed claim is dropped unseen.
                match claimed_or_exhausted(row) {
                    Ok(Some(claim)) => claims.push(claim),
                    Ok(None) => {}
                    Err(e) => undecodable = Some(e),
                }
            }
            if let Some(e) = undecodable {
                if claims.is_empty() {
                    return Err(e);
                }
                tracing::error!(error = %e.chain(), "a claimed row could not be decoded; it will be reclaimed when stale");
            }
            if !claims.is_empty() {
                claims.sort_by_key(|c| (c.event.created_date, c.event.id));
                return Ok(claims);
            }
        }
        Ok(Vec::new())
    }

    /// The claim's `COMMIT` reported an error, but it may have landed with its reply lost (a
    /// connection cut as the reply was on its way): the rows the statement returned are read
    /// back, and those still under exactly the fence this claim wrote (`processing`, its
    /// `LastModifiedDate` and `RetryCount`: no other write produces that value, every write
    /// moves `LastModifiedDate` forward) are this claim's, returned as claims. Without the
    /// read-back they were left to stale reclaim, which counts an attempt that never ran.
    /// When nothing landed, or the rows cannot be read back, the commit's error is returned.
    async fn claims_that_landed(&self, rows: &[PgRow], error: Error) -> Result<Vec<Claim>> {
        let sent: Vec<Claim> = rows
            .iter()
            .filter_map(|row| claimed_or_exhausted(row).ok().flatten())
            .collect();
        if sent.is_empty() {
            return Err(error);
        }
        let mut landed = Vec::new();
        for claim in sent {
            let Some(row) = self.read_back(claim.event.id).await else {
                // Unreadable: its rows (if the claim landed) go stale and are reclaimed.
                return if landed.is_empty() {
                    Err(error)
                } else {
                    Ok(landed)
                };
            };
            if row.status == EventStatus::Processing
                && row.last_modified_date == claim.fence.last_written
                && row.retry_count == claim.event.retry_count
            {
                landed.push(claim);
            }
        }
        if landed.is_empty() {
            return Err(error);
        }
        tracing::info!(error = %error.chain(), claims = landed.len(), "the claim's commit reported an error but landed; its rows are taken");
        landed.sort_by_key(|c| (c.event.created_date, c.event.id));
        Ok(landed)
    }

    /// The row `id` read back after a commit whose reply may have been lost: tried for about
    /// two seconds, since the pool may still hold connections the same cut closed, and a pooler
    /// may refuse logins for a while after it.
    async fn read_back(&self, id: EventId) -> Option<OutboxEvent> {
        let mut backoff = Duration::from_millis(20);
        for _ in 0..8 {
            match crate::OutboxRepository::get_event(self, id).await {
                Ok(row) => return row,
                Err(_) => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
            }
        }
        None
    }

    /// The record chains of the heads just claimed in `tx` (rows of the claim statement):
    /// each keyed head on a first attempt brings up to `chain` of its record's next
    /// consecutive first-attempt rows, `extra` rows in all (see [`CLAIM_CHAINS`]).
    async fn claim_chain_rows(
        &self,
        tx: &mut sqlx::PgConnection,
        heads: &[PgRow],
        scope: &Scope,
        (chain, extra): (usize, usize),
    ) -> Result<Vec<PgRow>> {
        let (mut keys, mut created, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        for row in heads {
            let Ok(Some(head)) = claimed_or_exhausted(row) else {
                continue;
            };
            if let Some(key) = &head.event.record_key
                && !head.reclaimed
                && head.event.retry_count == 0
            {
                keys.push(key.as_str().to_owned());
                created.push(head.event.created_date);
                ids.push(head.event.id);
            }
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        Ok(sqlx::query(CLAIM_CHAINS)
            .persistent(self.cached())
            .bind(self.shift())
            .bind(keys)
            .bind(created)
            .bind(ids)
            .bind(chain as i64)
            .bind(scope.only())
            .bind(scope.except())
            .bind(extra as i64)
            .fetch_all(&mut *tx)
            .await?)
    }
}
