//! Reading eligible rows and claiming them on SQLite. A claim holds the write lock
//! (`BEGIN IMMEDIATE`) from the liveness look to its commit: it reads the eligible candidates
//! oldest first and claims the first whose state still allows, failing on the way the rows it
//! cannot read and the stale rows whose dead attempts used up `MaxRetryAttempts`.

use chrono::{DateTime, Utc};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection};

use super::sql::{
    CHAIN_CANDIDATES, CLAIM_CANDIDATES, CLAIM_CHAIN_ROWS, CLAIM_ROWS, ELIGIBLE, ELIGIBLE_BY_ID,
};
use super::time::{format_ts, next_written, parse_id, parse_ts};
use super::{SqliteOutbox, json_list};
use crate::attempt::chrono_span;
use crate::{
    Claim, ClaimPolicy, Error, EventId, EventRow, EventStatus, Fence, OutboxEvent, RecordKey,
    Result, Scope, clip_error,
};

/// How many rounds one claim transaction reads candidates in: a round after the first runs only
/// when the one before failed a candidate (undecodable, or exhausted by dead workers), which may
/// have released the rows behind it.
const MAX_ROUNDS_PER_CLAIM: u32 = 16;

/// Decodes the columns every read selects but the payload, by name. The `RecordKey` is kept
/// exactly as stored.
pub(super) fn row_from(row: &SqliteRow) -> Result<EventRow> {
    let status: String = row.try_get("Status")?;
    let record_key: Option<String> = row.try_get("RecordKey")?;
    Ok(EventRow {
        id: parse_id(&row.try_get::<String, _>("Id")?)?,
        event_type: row.try_get("EventType")?,
        status: status
            .parse()
            .map_err(|e: String| Error::Database(sqlx::Error::Decode(e.into())))?,
        record_key: record_key.map(RecordKey::from_stored),
        created_date: parse_ts(&row.try_get::<String, _>("CreatedDate")?)?,
        last_modified_date: parse_ts(&row.try_get::<String, _>("LastModifiedDate")?)?,
        retry_count: row.try_get("RetryCount")?,
        last_error: row.try_get("LastError")?,
    })
}

/// Decodes a full row, payload included.
pub(super) fn event_from_row(row: &SqliteRow) -> Result<OutboxEvent> {
    Ok(row_from(row)?.with_payload(row.try_get("Payload")?))
}

/// Fails a row other code wrote that this code cannot read, with the reason, by `rowid`.
async fn fail_unreadable(
    conn: &mut SqliteConnection,
    rowid: i64,
    reason: &str,
) -> Result<Candidate> {
    tracing::warn!(rowid, error = %reason, "failing an outbox row that cannot be read");
    sqlx::query(
        "UPDATE _System_OutboxEvent SET Status = 'failed', LastError = ?2
         WHERE rowid = ?1 AND Status NOT IN ('processed', 'failed')",
    )
    .bind(rowid)
    .bind(clip_error(reason))
    .execute(&mut *conn)
    .await?;
    Ok(Candidate::Failed)
}

/// What became of one candidate.
enum Candidate {
    /// Claimed.
    Claimed(Claim),
    /// Failed here (unreadable, or its dead attempts used up `MaxRetryAttempts`): the rows
    /// behind it may be eligible now.
    Failed,
    /// Changed since it was read: look at the next one.
    Passed,
}

/// The state a claim writes to its candidate.
struct Claimed {
    status: EventStatus,
    retry_count: i32,
    last_error: Option<String>,
    written: DateTime<Utc>,
    /// A stale `processing` row taken over.
    reclaimed: bool,
    /// Its dead attempts used up `MaxRetryAttempts`: it ends `failed` instead.
    exhausted: bool,
}

impl Claimed {
    /// A stale `processing` row's dead attempt is counted as failed, and ends the row `failed`
    /// when that reaches `MaxRetryAttempts`; a `pending` row just moves to `processing`.
    fn of(
        event: &OutboxEvent,
        raw_last_modified: &str,
        now: DateTime<Utc>,
        policy: ClaimPolicy,
    ) -> Self {
        let written = next_written(now, event.last_modified_date);
        if event.status != EventStatus::Processing {
            return Self {
                status: EventStatus::Processing,
                retry_count: event.retry_count,
                last_error: event.last_error.clone(),
                written,
                reclaimed: false,
                exhausted: false,
            };
        }
        let exhausted = event.retry_count.saturating_add(1) >= policy.max_retry_attempts;
        let error = format!(
            "{} attempt {} stopped heartbeating (last beat {}) and wrote no outcome; counted as a failed attempt",
            crate::WORKER_DIED,
            event.retry_count + 1,
            raw_last_modified
        );
        Self {
            status: if exhausted {
                EventStatus::Failed
            } else {
                EventStatus::Processing
            },
            retry_count: event.retry_count + 1,
            last_error: Some(error),
            written,
            reclaimed: true,
            exhausted,
        }
    }

    /// The claim a worker holds afterwards.
    fn into_claim(self, event: OutboxEvent) -> Claim {
        Claim {
            fence: Fence {
                id: event.id,
                last_written: self.written,
            },
            reclaimed: self.reclaimed,
            event: OutboxEvent {
                status: EventStatus::Processing,
                last_modified_date: self.written,
                retry_count: self.retry_count,
                last_error: self.last_error,
                ..event
            },
        }
    }
}

/// Stores the canonical spelling of an id that other code wrote in another one (upper case,
/// braces, no hyphens): every fenced write compares the canonical text. Fails the row when it
/// cannot be stored so.
async fn canonicalize_id(
    conn: &mut SqliteConnection,
    row: &SqliteRow,
    rowid: i64,
    id: EventId,
) -> Result<Option<Candidate>> {
    let raw_id: String = row.try_get("Id")?;
    if raw_id == id.to_string() {
        return Ok(None);
    }
    let canonical = sqlx::query("UPDATE _System_OutboxEvent SET Id = ?2 WHERE rowid = ?1")
        .bind(rowid)
        .bind(id.to_string())
        .execute(&mut *conn)
        .await;
    match canonical {
        Ok(_) => Ok(None),
        Err(e) => {
            let reason = format!(
                "outbox row id {raw_id:?} written by other code cannot be stored as {id}: {e}"
            );
            fail_unreadable(conn, rowid, &reason).await.map(Some)
        }
    }
}

/// A record chain's candidate: its `rowid` and the row as read.
type ChainRow = (i64, Claim);

/// Claims rows of record chains (`chosen`: one rank of the chains, each row read `pending` on a
/// first attempt in this transaction) in one statement, by `rowid`; the claims, in order, and
/// `None` for a row not claimed (then its chain ends there).
async fn claim_chain_rows(
    tx: &mut SqliteConnection,
    chosen: &[&ChainRow],
    now: DateTime<Utc>,
) -> Result<Vec<Option<Claim>>> {
    let claims: Vec<(i64, Claim)> = chosen
        .iter()
        .map(|(rowid, candidate)| {
            let written = next_written(now, candidate.event.last_modified_date);
            let mut event = candidate.event.clone();
            event.status = EventStatus::Processing;
            event.last_modified_date = written;
            let fence = Fence {
                id: event.id,
                last_written: written,
            };
            let claim = Claim {
                fence,
                event,
                reclaimed: false,
            };
            (*rowid, claim)
        })
        .collect();
    let rows: Vec<(i64, String)> = claims
        .iter()
        .map(|(rowid, c)| (*rowid, format_ts(c.fence.last_written)))
        .collect();
    let landed: Vec<i64> = sqlx::query_scalar(CLAIM_CHAIN_ROWS)
        .bind(serde_json::to_string(&rows).expect("rows serialize"))
        .fetch_all(&mut *tx)
        .await?;
    let mut landed: std::collections::HashSet<i64> = landed.into_iter().collect();
    // A row chosen twice (heads that disagree with the rows) is claimed once.
    Ok(claims
        .into_iter()
        .map(|(rowid, claim)| landed.remove(&rowid).then_some(claim))
        .collect())
}

/// A candidate read, decoded and ready to be claimed (see [`claim_ready`]).
struct Ready {
    rowid: i64,
    event: OutboxEvent,
    /// `LastModifiedDate` as stored (the fence of the claim's own write).
    raw_last_modified: String,
    next: Claimed,
}

/// Prepares the candidate `row` (read inside the write transaction on `conn`) for its claim
/// (see [`Claimed::of`]); a row that cannot be decoded is failed with the reason.
async fn prepare_claim(
    conn: &mut SqliteConnection,
    row: &SqliteRow,
    now: DateTime<Utc>,
    policy: ClaimPolicy,
) -> Result<std::result::Result<Ready, Candidate>> {
    let rowid: i64 = row.try_get("rowid")?;
    let event = match event_from_row(row) {
        Ok(event) => event,
        Err(e) => {
            let reason = format!("unreadable outbox row written by other code: {}", e.chain());
            return fail_unreadable(conn, rowid, &reason).await.map(Err);
        }
    };
    if let Some(failed) = canonicalize_id(conn, row, rowid, event.id).await? {
        return Ok(Err(failed));
    }
    let raw_last_modified: String = row.try_get("LastModifiedDate")?;
    let next = Claimed::of(&event, &raw_last_modified, now, policy);
    Ok(Ok(Ready {
        rowid,
        event,
        raw_last_modified,
        next,
    }))
}

/// Claims the `ready` candidates in one statement (`CLAIM_ROWS`), each while its state is
/// still the one it was read with; what became of each, in order.
async fn claim_ready(conn: &mut SqliteConnection, ready: Vec<Ready>) -> Result<Vec<Candidate>> {
    if ready.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<serde_json::Value> = ready
        .iter()
        .map(|r| {
            serde_json::json!([
                r.rowid,
                r.next.status.as_str(),
                format_ts(r.next.written),
                r.next.retry_count,
                r.next.last_error.as_deref().map(clip_error),
                r.event.status.as_str(),
                r.raw_last_modified,
            ])
        })
        .collect();
    let claimed: Vec<i64> = sqlx::query_scalar(CLAIM_ROWS)
        .bind(serde_json::Value::from(rows).to_string())
        .fetch_all(&mut *conn)
        .await?;
    Ok(ready
        .into_iter()
        .map(|r| {
            if !claimed.contains(&r.rowid) {
                return Candidate::Passed;
            }
            if r.next.exhausted {
                tracing::warn!(
                    event_id = %r.event.id,
                    event_type = %r.event.event_type,
                    retry_count = r.next.retry_count,
                    "a stale claim used up MaxRetryAttempts (its worker died on every attempt): the event is failed"
                );
                return Candidate::Failed;
            }
            Candidate::Claimed(r.next.into_claim(r.event))
        })
        .collect())
}

impl SqliteOutbox {
    pub(super) async fn eligible(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>> {
        let mut conn = self.pool.acquire().await?;
        let stale = self.stale_ids(&mut conn, policy.stale_after, None).await?;
        let now = self.now();
        let retry_cutoff = format_ts(now - chrono_span(policy.retry_delay));
        let rows = sqlx::query(ELIGIBLE)
            .bind(&stale)
            .bind(&retry_cutoff)
            .bind(i64::from(limit))
            .bind(json_list(scope.only()))
            .bind(json_list(scope.except()))
            .bind(format_ts(now))
            .fetch_all(&mut *conn)
            .await?;
        // A row that cannot be read is failed by the claim that meets it; listing it here
        // would only hand the caller an id it cannot parse.
        Ok(super::readable(&rows, event_from_row))
    }

    /// One claim transaction: the eligible rows (a few candidates, or the one `id`) are tried
    /// oldest first until `max` are claimed (the candidates are heads of distinct keys and
    /// unkeyed rows, so no two claims share a key) or none is left.
    pub(super) async fn claim_in_tx(
        &self,
        policy: ClaimPolicy,
        scope: &Scope,
        id: Option<EventId>,
        max: usize,
        chain: usize,
    ) -> Result<Vec<Claim>> {
        let max = if id.is_some() {
            1
        } else {
            max.clamp(1, crate::MAX_CLAIM_BATCH)
        };
        let (mut tx, waited) = self.begin_write().await?;
        let stale = self
            .stale_ids(&mut tx, policy.stale_after, Some(waited))
            .await?;
        let now = self.now();
        let mut claims = Vec::with_capacity(max);
        // A candidate failed here may release the rows behind it: look again (bounded).
        for _ in 0..MAX_ROUNDS_PER_CLAIM {
            let failed_some = self
                .claim_round(&mut tx, &stale, now, policy, scope, id, max, &mut claims)
                .await?;
            if claims.len() == max || !failed_some {
                break;
            }
        }
        if chain > 0 && claims.len() < max {
            // Rank by rank across the chains, as on PostgreSQL: `max` rows in all.
            let heads = claims.clone();
            let mut chains: Vec<Vec<ChainRow>> = Vec::with_capacity(heads.len());
            let extra = max - claims.len();
            for head in &heads {
                let limit = chain.min(extra);
                chains.push(
                    self.chain_candidates(&mut tx, head, now, scope, limit)
                        .await?,
                );
            }
            // Rank by rank, one statement per rank: a chain whose row at a rank was not
            // claimed ends there.
            let mut open = vec![true; chains.len()];
            let mut taken = 0;
            for rank in 0..chain {
                let mut chosen: Vec<(usize, &ChainRow)> = Vec::new();
                for (c, candidates) in chains.iter().enumerate() {
                    match candidates.get(rank) {
                        Some(row) if open[c] && taken + chosen.len() < extra => {
                            chosen.push((c, row));
                        }
                        _ => open[c] = false,
                    }
                }
                if chosen.is_empty() {
                    break;
                }
                let rows: Vec<&ChainRow> = chosen.iter().map(|(_, row)| *row).collect();
                let landed = claim_chain_rows(&mut tx, &rows, now).await?;
                for ((c, _), claim) in chosen.into_iter().zip(landed) {
                    match claim {
                        Some(claim) => {
                            claims.push(claim);
                            taken += 1;
                        }
                        None => open[c] = false,
                    }
                }
            }
        }
        tx.commit().await?;
        // A later round may claim an older row than an earlier one did (one released by a
        // failed candidate): hand them out oldest first.
        claims.sort_by_key(|c| (c.event.created_date, c.event.id));
        for claim in &claims {
            self.liveness()
                .note(claim.fence.id, claim.fence.last_written, &self.shift);
        }
        Ok(claims)
    }

    /// The candidates of `head`'s record chain, `head` just claimed in `tx` (see
    /// `docs/state-machine.md`, "Record chains"): up to `limit` of its record's next
    /// non-terminal rows, in order, while each is `pending` on a first attempt, due and in
    /// `scope`; the first that is not ends it. The write lock keeps every other writer out.
    async fn chain_candidates(
        &self,
        tx: &mut SqliteConnection,
        head: &Claim,
        now: DateTime<Utc>,
        scope: &Scope,
        limit: usize,
    ) -> Result<Vec<ChainRow>> {
        let Some(key) = &head.event.record_key else {
            return Ok(Vec::new());
        };
        if head.reclaimed || head.event.retry_count != 0 || limit == 0 {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(CHAIN_CANDIDATES)
            .bind(key.as_str())
            .bind(format_ts(head.event.created_date))
            .bind(head.event.id.to_string())
            .bind(limit as i64)
            .fetch_all(&mut *tx)
            .await?;
        let mut candidates = Vec::new();
        for row in &rows {
            let Ok(event) = event_from_row(row) else {
                break;
            };
            // An id other code wrote in another spelling is made canonical by the claim that
            // takes it as its record's head: a chain ends before it.
            let rowid: i64 = row.try_get("rowid")?;
            if row.try_get::<String, _>("Id")? != event.id.to_string() {
                break;
            }
            let in_scope = scope
                .only()
                .is_none_or(|only| only.contains(&event.event_type))
                && scope
                    .except()
                    .is_none_or(|except| !except.contains(&event.event_type));
            let due = event.last_modified_date <= now;
            if event.status != EventStatus::Pending || event.retry_count != 0 || !due || !in_scope {
                break;
            }
            candidates.push((rowid, Claim::for_test(event)));
        }
        Ok(candidates)
    }

    /// One pass over the eligible candidates: claims into `claims` until it holds `max`, and
    /// tells whether a candidate was failed on the way.
    #[expect(
        clippy::too_many_arguments,
        reason = "one claim transaction's state, passed down from claim_in_tx"
    )]
    async fn claim_round(
        &self,
        tx: &mut SqliteConnection,
        stale: &str,
        now: DateTime<Utc>,
        policy: ClaimPolicy,
        scope: &Scope,
        id: Option<EventId>,
        max: usize,
        claims: &mut Vec<Claim>,
    ) -> Result<bool> {
        let retry_cutoff = format_ts(now - chrono_span(policy.retry_delay));
        let query = match id {
            None => sqlx::query(CLAIM_CANDIDATES)
                .bind(stale)
                .bind(&retry_cutoff)
                // As many as the batch: each candidate read costs its rule's probes, and under
                // the write lock a candidate read is a candidate claimed, unless it is failed
                // (then the next round reads on), or a stale row this transaction has already
                // reclaimed (it still reads as stale, and is skipped below; there are at most
                // as many of those as claims, so `max` leaves room for the rest).
                .bind(max as i64)
                .bind(json_list(scope.only()))
                .bind(json_list(scope.except()))
                .bind(format_ts(now)),
            Some(id) => sqlx::query(ELIGIBLE_BY_ID)
                .bind(stale)
                .bind(&retry_cutoff)
                .bind(id.to_string())
                .bind(None::<String>)
                .bind(None::<String>)
                .bind(format_ts(now)),
        };
        let rows = query.fetch_all(&mut *tx).await?;
        let mut failed_some = false;
        let mut ready = Vec::new();
        for row in &rows {
            // A stale row claimed by an earlier round of this transaction still reads as stale
            // (the stale ids were observed before it): never claim it twice.
            let id = row
                .try_get::<String, _>("Id")
                .ok()
                .and_then(|id| parse_id(&id).ok());
            if claims.iter().any(|c| Some(c.event.id) == id) {
                continue;
            }
            // A row read twice (heads that disagree with the rows) is claimed once.
            let rowid = row.try_get::<i64, _>("rowid").ok();
            if ready.iter().any(|r: &Ready| Some(r.rowid) == rowid) {
                continue;
            }
            match prepare_claim(&mut *tx, row, now, policy).await? {
                Ok(candidate) => {
                    ready.push(candidate);
                    if claims.len() + ready.len() == max {
                        break;
                    }
                }
                Err(Candidate::Failed) => failed_some = true,
                Err(_) => {}
            }
        }
        // One statement for the round's claims (each statement is a round trip to the
        // connection's thread).
        for candidate in claim_ready(&mut *tx, ready).await? {
            match candidate {
                Candidate::Claimed(claim) => claims.push(claim),
                Candidate::Failed => failed_some = true,
                Candidate::Passed => {}
            }
        }
        Ok(failed_some)
    }
}
