//! The PostgreSQL claim-path statements, composed from fragments: the design's state rule, its
//! key-order rule, the in-flight guard and the scope filter are each written once and spliced
//! into `claim_next`'s select-and-claim (with and without a scope), `claim_event` and
//! `get_pending_events`. See `docs/queries.md` for why the claim is shaped this way.

/// The database's time, shifted by the repository's `ClockShift` (`$1`; zero unless a test
/// moved it). Every queue timestamp on PostgreSQL is this expression.
macro_rules! db_now {
    () => {
        "(clock_timestamp() + $1::interval)"
    };
}
pub(super) use db_now;

/// Bounds the statement's lock waits by the outbox's own lock timeout (parameter `$n`, text
/// such as `5000ms`), for this statement's transaction only: the outbox never sets
/// `lock_timeout` on a session, which the application may share. An uncorrelated subquery, so
/// it runs once, before the statement waits for any row.
macro_rules! lock_guard {
    ($n:literal) => {
        concat!(
            "\n  AND (SELECT set_config('lock_timeout', $",
            $n,
            ", true)) IS NOT NULL"
        )
    };
}
pub(super) use lock_guard;

/// The design's state rules for the candidate `e`: `pending` (a retried row once its retry
/// delay passed, any row from its `LastModifiedDate` on) or a stale `processing` row. Needs a
/// `clock` CTE, stale-after `$2` and the retry delay `$3`.
macro_rules! claimable_state {
    () => {
        "    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
"
    };
}

/// No other row of the candidate `e`'s key is `processing` with a live heartbeat (needs a
/// `clock` CTE and the stale-after interval as `$2`).
macro_rules! in_flight_guard {
    () => {
        "      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
"
    };
}

/// The design's ordering rule for the candidate `e` (no older non-terminal row of its key; the
/// `(CreatedDate, Id)` comparison as a row comparison, which the index bounds) and the
/// in-flight guard.
macro_rules! key_order {
    () => {
        concat!(
            "    AND (
      e.RecordKey IS NULL
      OR (NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent older
        WHERE older.RecordKey = e.RecordKey
          AND (older.CreatedDate, older.Id) < (e.CreatedDate, e.Id)
          AND older.Status NOT IN ('processed', 'failed')
      )
",
            in_flight_guard!(),
            "      )
    )
"
        )
    };
}

/// The scope predicates of a narrowed read or claim: `$5` event types only, `$6` event types
/// except (each NULL for none).
macro_rules! scope_filter {
    () => {
        "    AND ($5::text[] IS NULL OR e.EventType = ANY($5))
    AND ($6::text[] IS NULL OR e.EventType <> ALL($6))
"
    };
}

/// The candidate selection of `claim_next`: the design's eligible set and order, computed so
/// that its cost does not grow with the backlog or with one hot key (see `docs/queries.md`).
///
/// 1. `in_prefix`: the design's query over the oldest [`super::CLAIM_PREFIX_ROWS`]
///    non-terminal rows. Every row older than the oldest eligible one is non-terminal and
///    inside that prefix, so a hit here is the oldest eligible row overall. The same-key probe
///    is the design's `NOT EXISTS`, with the `(CreatedDate, Id)` comparison written as a row
///    comparison so that the index bounds it: a key's head costs one index descent, not a walk
///    of its backlog.
/// 2. `by_head` (only when the prefix holds nothing claimable, for example a hot key's backlog
///    fills it): a keyed row is eligible only as the first non-terminal row of its key, so the
///    candidates are each key's head (a skip scan over `outbox_record_key_idx`, one descent per
///    key with non-terminal rows) and the unkeyed rows, sorted first (`OFFSET 0` keeps the
///    planner from sorting after the join) and then checked oldest first until one is
///    claimable. A blocked key's backlog is never walked; the cost is one descent per key.
///
/// Both add the in-flight guard to the design's rule: a keyed row is never claimed while
/// another row of its key is `processing` with a live heartbeat, whichever path made it
/// eligible (an operator retry of an older row, an older row written late by other code).
/// `outbox_in_flight_idx` answers it with one probe.
///
/// Time is the database's (`clock` below, read once per statement). Parameters: `$1` the clock
/// shift, `$2` stale-after, `$3` retry delay (intervals), `$4` `MaxRetryAttempts`; `$scope` is
/// spliced in twice, empty for `Scope::All` (so that the statement has no parameter that
/// changes its plan) or `scope_filter!()`.
macro_rules! claim_candidate {
    ($($scope:tt)*) => {
        concat!(
            "\
WITH RECURSIVE
clock AS (SELECT ", db_now!(), " AS now),
heads AS (
  (SELECT h.RecordKey, h.CreatedDate, h.Id
   FROM _System_OutboxEvent h
   WHERE h.RecordKey IS NOT NULL AND h.Status NOT IN ('processed', 'failed')
   ORDER BY h.RecordKey, h.CreatedDate, h.Id
   LIMIT 1)
  UNION ALL
  SELECT n.RecordKey, n.CreatedDate, n.Id
  FROM heads p
  CROSS JOIN LATERAL (
    SELECT x.RecordKey, x.CreatedDate, x.Id
    FROM _System_OutboxEvent x
    WHERE x.RecordKey > p.RecordKey AND x.Status NOT IN ('processed', 'failed')
    ORDER BY x.RecordKey, x.CreatedDate, x.Id
    LIMIT 1
  ) n
),
in_prefix AS (
  SELECT e.Id, e.Status AS old_status
  FROM (
    SELECT w.Id, w.CreatedDate
    FROM _System_OutboxEvent w
    WHERE w.Status NOT IN ('processed', 'failed')
    ORDER BY w.CreatedDate, w.Id
    LIMIT 64
  ) w
  JOIN _System_OutboxEvent e ON e.Id = w.Id
  WHERE
",
            claimable_state!(),
            key_order!(),
            $($scope)*,
            "  ORDER BY w.CreatedDate, w.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
by_head AS (
  SELECT e.Id, e.Status AS old_status
  FROM (
    SELECT heads.Id, heads.CreatedDate FROM heads
    UNION ALL
    SELECT u.Id, u.CreatedDate
    FROM _System_OutboxEvent u
    WHERE u.RecordKey IS NULL AND u.Status NOT IN ('processed', 'failed')
    ORDER BY 2, 1
    OFFSET 0
  ) c
  JOIN _System_OutboxEvent e ON e.Id = c.Id
  WHERE
",
            claimable_state!(),
            "    AND (e.RecordKey IS NULL OR (TRUE
",
            in_flight_guard!(),
            "    ))
",
            $($scope)*,
            "  ORDER BY c.CreatedDate, c.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
candidate AS (
  SELECT Id, old_status FROM in_prefix
  UNION ALL
  SELECT Id, old_status FROM by_head
  LIMIT 1
)"
        )
    };
}

/// The claim itself: the candidate moves to `processing`, its `LastModifiedDate` strictly
/// forward. A stale `processing` candidate's previous attempt died without bookkeeping: it is
/// counted as a failed attempt, and when that count reaches `MaxRetryAttempts` (`$4`) the row
/// ends `failed` instead of being claimed, so an event that kills its worker ends.
macro_rules! claim_update {
    () => {
        "
UPDATE _System_OutboxEvent t
SET Status = CASE WHEN c.old_status = 'processing' AND t.RetryCount + 1 >= $4
                  THEN 'failed' ELSE 'processing' END,
    RetryCount = t.RetryCount + CASE WHEN c.old_status = 'processing' THEN 1 ELSE 0 END,
    LastError = CASE WHEN c.old_status = 'processing'
                     THEN format('worker died: attempt %s stopped heartbeating (last beat %s) and wrote no outcome; counted as a failed attempt',
                                 t.RetryCount + 1, t.LastModifiedDate)
                     ELSE t.LastError END,
    LastModifiedDate = GREATEST((SELECT now FROM clock), t.LastModifiedDate + interval '1 microsecond')
FROM candidate c
WHERE t.Id = c.Id
RETURNING t.Id, t.EventType, t.Payload, t.Status, t.RetryCount, t.RecordKey, t.CreatedDate,
          t.LastModifiedDate, t.LastError, c.old_status"
    };
}

/// The design's eligible-event query, as written in the design (identifiers unquoted); what
/// `outbox explain` shows beside the claim. Parameters: `$1` stale cutoff, `$2` retry cutoff,
/// `$3` limit.
pub(crate) const ELIGIBLE_QUERY: &str = "\
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent e
WHERE
  (e.Status = 'pending'
   OR (e.Status = 'processing' AND e.LastModifiedDate < $1))
  AND (e.Status <> 'pending'
       OR e.RetryCount = 0
       OR e.LastModifiedDate < $2)
  AND (
    e.RecordKey IS NULL
    OR NOT EXISTS (
      SELECT 1
      FROM _System_OutboxEvent older
      WHERE older.RecordKey = e.RecordKey
        AND (
          older.CreatedDate < e.CreatedDate
          OR (older.CreatedDate = e.CreatedDate AND older.Id < e.Id)
        )
        AND older.Status NOT IN ('processed', 'failed')
    )
  )
ORDER BY e.CreatedDate ASC, e.Id ASC
LIMIT $3";

/// Select-and-claim in one statement: the candidate selection above locks its row with
/// `FOR UPDATE OF e SKIP LOCKED` and the update moves it to `processing`. Parameters: `$1` the
/// clock shift, `$2` stale-after, `$3` retry delay, `$4` `MaxRetryAttempts`, `$5`/`$6` the
/// scope's event types.
pub(crate) const CLAIM_NEXT: &str = concat!(claim_candidate!(scope_filter!()), claim_update!());

/// [`CLAIM_NEXT`] for `Scope::All`: the same statement without the scope predicates.
/// Parameters: `$1` the clock shift, `$2` stale-after, `$3` retry delay, `$4`
/// `MaxRetryAttempts`.
pub(super) const CLAIM_NEXT_ALL: &str = concat!(claim_candidate!(""), claim_update!());

/// `ClaimEvent` by id, with the same rules as `claim_next` (retry delay, stale reclaim counted,
/// the key's ordering and in-flight guard). Parameters: `$1`..`$4` as [`CLAIM_NEXT`], `$5` the id.
pub(super) const CLAIM_EVENT: &str = concat!(
    "\
WITH clock AS (SELECT ",
    db_now!(),
    " AS now),
candidate AS (
  SELECT e.Id, e.Status AS old_status
  FROM _System_OutboxEvent e
  WHERE e.Id = $5 AND
",
    claimable_state!(),
    key_order!(),
    "  FOR UPDATE OF e SKIP LOCKED
)",
    claim_update!()
);

/// The design's eligible-event query with the in-flight guard and the database's clock: what
/// `get_pending_events` runs. Parameters: `$1` the clock shift, `$2` stale-after, `$3` retry
/// delay, `$4` limit, `$5`/`$6` the scope's event types (NULL for none).
pub(super) const ELIGIBLE_GUARDED: &str = concat!(
    "\
WITH clock AS (SELECT ",
    db_now!(),
    " AS now)
SELECT Id, EventType, Payload, Status, RetryCount, RecordKey, CreatedDate, LastModifiedDate, LastError
FROM _System_OutboxEvent e
WHERE
",
    claimable_state!(),
    key_order!(),
    scope_filter!(),
    "ORDER BY e.CreatedDate ASC, e.Id ASC
LIMIT $4"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_the_claim_inspects_is_claim_prefix_rows() {
        let limit = format!("LIMIT {}\n", super::super::CLAIM_PREFIX_ROWS);
        assert!(CLAIM_NEXT.contains(&limit) && CLAIM_NEXT_ALL.contains(&limit));
    }

    #[test]
    fn only_the_scoped_statements_carry_the_scope() {
        assert_eq!(CLAIM_NEXT.matches("$5::text[] IS NULL").count(), 2);
        assert!(!CLAIM_NEXT_ALL.contains("$5"));
        assert_eq!(ELIGIBLE_GUARDED.matches("$6::text[] IS NULL").count(), 1);
    }
}
