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
/// `clock` CTE and the stale-after interval as `$2`). The unkeyed pick's and `claim_event`'s;
/// the head pick has its own ordered form of it (migration 0022, in `claim_candidate!`). The
/// equality-keyed probes here are still open to the statistics trap in `claim_event` (the
/// legacy dispatcher's claim by id; docs/queries.md).
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
/// that its cost follows neither the backlog's size nor its shape (see `docs/queries.md`).
///
/// A keyed row can be eligible only as the oldest non-terminal row of its key, so the
/// candidates are each key's head, read oldest first from `_System_OutboxHead` (derived state,
/// maintained by triggers in the same transactions as the rows: migration 0004), and the unkeyed
/// non-terminal rows, read oldest first from `outbox_unkeyed_idx`. Each stream picks and locks
/// (`FOR UPDATE OF e SKIP LOCKED`) its first row that passes the design's whole rule on the
/// outbox row itself (state, the `NOT EXISTS` key-order probe, written as a row comparison so
/// that the index bounds it, the in-flight guard: a keyed row is never claimed while another row
/// of its key is `processing` with a live heartbeat, and the scope); the older of the two picks
/// is the candidate. A hot or blocked key is one candidate however deep its backlog, and a head
/// that is out of date can make a claim miss a row but never claim one the design would not.
/// The pick that loses stays locked until the statement ends (milliseconds): another claim
/// skips it meanwhile, as it skips any row being claimed. The unkeyed stream scans the outbox
/// rows directly rather than joining an index-only stream back to them: under concurrent claims
/// the joined form took 8x longer per claim (a drain of unkeyed rows collapsed to 0.08x of the
/// ceiling), see `docs/queries.md`.
///
/// The head's row `e` is the row version `first` read, fetched by its `ctid` (a TID scan, one
/// tuple, whatever the statistics say), its id checked too, and joined after `first` in the
/// order written (`join_collapse_limit = 1` among [`CLAIM_PLAN_SETTINGS`]); its re-check against
/// the head's key is written `IS NOT DISTINCT FROM`, which no index or join method can use. As an
/// equality the key let the planner reach `e` through `outbox_record_key_idx` by the key,
/// reading every pending row of a hot record at every claim that passed its head; free to join
/// `e` before `first`, on statistics taken while the backlog was empty (every partial index
/// looked empty) it walked a whole index per head. A row updated after the statement's snapshot
/// fails the `ctid` on the re-check `SKIP LOCKED` makes on its newest version and is passed
/// over, as a locked row is (the next claim takes it), on minor releases with the TID scan's
/// re-check (backpatched to PostgreSQL 13 in 2025); on older ones the re-check passes and the
/// pick behaves as with the join by id (the state rules re-checked on the newest version).
/// Migration 0018. And a key with a live claim is passed before its rows are read: the lateral
/// read of the key's oldest row first probes `outbox_in_flight_idx` for the head's key (a
/// one-time filter of the read, which depends on the head alone), so the heads in flight, at the
/// front of the walk and about one per claimed row, cost one probe each instead of two row
/// reads (the claim's statement read 43% fewer buffers past 300 heads in flight). The guard on
/// the picked row is the same rule; like the pre-filter it reads the statement's snapshot. Since
/// migration 0022 it is a subquery in the filter of the head's row (no longer an anti-join), so
/// `SKIP LOCKED`'s re-check of a locked row's newest version runs it again, on that snapshot:
/// the same answer.
///
/// Migration 0022: the head's probes name their index by their order. `outbox_eligible_idx`,
/// `outbox_record_key_idx` and `outbox_in_flight_idx` are all partial indexes on the open rows;
/// statistics taken while no row was open (an `ANALYZE` of a table of terminal rows) make
/// every scan of them cost the same, and the planner read a record's oldest row and its
/// in-flight rows from `outbox_eligible_idx` with the key as a filter: every open row per head
/// (claims of 100-800 ms after the bench's retention scenario, 487-511 ms against 4-7 ms on a
/// scratch table). The key is bounded by a range (`>=` and `<=`, not an equality, whose
/// ordering column the planner drops as constant) and each probe is ordered by `RecordKey`
/// first, an order only the key's indexes give, so under `enable_sort = off` no statistics
/// make the other index the cheaper; the in-flight probes are scalar subqueries with that
/// `ORDER BY` (an `EXISTS` drops its `ORDER BY`). The same rows, the same rule.
///
/// Time is the database's (`clock` below, read once per statement). Parameters: `$1` the clock
/// shift, `$2` stale-after, `$3` retry delay (intervals), `$4` `MaxRetryAttempts`; `$limit` is
/// how many rows each stream picks and the statement claims (`"1"`, or `"$7"` for a batch);
/// `$scope` is spliced in, empty for `Scope::All` (so that the statement has no parameter that
/// changes its plan) or `scope_filter!()`.
macro_rules! claim_candidate {
    ($limit:literal, $($scope:tt)*) => {
        concat!(
            "\
WITH clock AS (SELECT ", db_now!(), " AS now),
head_pick AS (
  SELECT e.Id, e.Status AS old_status, e.CreatedDate
  FROM _System_OutboxHead h
  CROSS JOIN LATERAL (
    SELECT o.Id, o.ctid AS at
    FROM _System_OutboxEvent o
    WHERE o.RecordKey >= h.RecordKey AND o.RecordKey <= h.RecordKey
      AND o.Status NOT IN ('processed', 'failed')
      AND (SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey >= h.RecordKey AND f.RecordKey <= h.RecordKey
          AND f.Status = 'processing'
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
        ORDER BY f.RecordKey LIMIT 1) IS NULL
    ORDER BY o.RecordKey, o.CreatedDate, o.Id
    LIMIT 1
  ) first
  JOIN _System_OutboxEvent e ON e.ctid = first.at AND e.Id = first.Id
  WHERE e.RecordKey IS NOT DISTINCT FROM h.RecordKey AND
",
            claimable_state!(),
            "      AND (SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey >= e.RecordKey AND f.RecordKey <= e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
        ORDER BY f.RecordKey LIMIT 1) IS NULL
",
            $($scope)*,
            "  ORDER BY h.CreatedDate, h.Id
  LIMIT ", $limit, "
  FOR UPDATE OF e SKIP LOCKED
),
unkeyed_pick AS (
  SELECT e.Id, e.Status AS old_status, e.CreatedDate
  FROM _System_OutboxEvent e
  WHERE e.RecordKey IS NULL AND e.Status NOT IN ('processed', 'failed') AND
",
            claimable_state!(),
            key_order!(),
            $($scope)*,
            "  ORDER BY e.CreatedDate, e.Id
  LIMIT ", $limit, "
  FOR UPDATE OF e SKIP LOCKED
),
candidate AS (
  SELECT p.Id, p.old_status
  FROM (SELECT * FROM head_pick UNION ALL SELECT * FROM unkeyed_pick) p
  ORDER BY p.CreatedDate, p.Id
  LIMIT ", $limit, "
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

/// Record chains (see `docs/state-machine.md`, "Record chains"), `_System_OutboxClaimChains`
/// (migration 0012): in the claim's transaction, after its statement, each head just claimed
/// (`$2` keys, `$3` their `CreatedDate`, `$4` their ids; keyed heads on a first attempt only)
/// brings up to `$5` of its record's next consecutive first-attempt rows that are due and in
/// scope (`$6`/`$7` as the claim's), at most `$8` rows in all, rank by rank across the chains.
/// `$1` the clock shift.
pub(super) const CLAIM_CHAINS: &str =
    "SELECT * FROM _System_OutboxClaimChains($1, $2, $3, $4, $5, $6, $7, $8)";

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
/// `outbox explain` shows this one-row form.
pub(crate) const CLAIM_NEXT: &str =
    concat!(claim_candidate!("1", scope_filter!()), claim_update!());

/// [`CLAIM_NEXT`] for `Scope::All`: the same statement without the scope predicates, as
/// `_System_OutboxClaimNext` (migration 0006, kept for the previous release's binaries) runs
/// it.
#[cfg(test)]
const CLAIM_NEXT_ALL: &str = concat!(claim_candidate!("1", ""), claim_update!());

/// Select-and-claim of up to `$7` rows in one statement: [`CLAIM_NEXT`] with each candidate
/// stream picking, and the statement claiming, up to `$7` rows. The keyed candidates are heads
/// of distinct keys, so one statement never claims two rows of one key.
#[cfg(test)]
const CLAIM_BATCH: &str = concat!(claim_candidate!("$7", scope_filter!()), claim_update!());

/// [`CLAIM_BATCH`] for `Scope::All`.
#[cfg(test)]
const CLAIM_BATCH_ALL: &str = concat!(claim_candidate!("$7", ""), claim_update!());

/// What `claim_next` and `claim_batch` send: a call of `_System_OutboxClaimBatch` (migration
/// 0008), which runs the batch statement without the scope predicates when both scope
/// parameters are NULL and with them otherwise, under [`CLAIM_PLAN_SETTINGS`]. A statement
/// prepared by the client runs from a generic plan cached after five executions; one cached
/// while the queue was nearly empty keeps sequential scans when the backlog grows (see
/// `docs/queries.md`, "Plan stability"), and planning at every call costs more than the claim.
/// Inside the function the settings leave only the index plan. Parameters: as [`CLAIM_NEXT`],
/// `$7` the most rows to claim (1 to 256) and `$8` the call's lock timeout (text such as
/// `5000ms`). It runs in a READ COMMITTED transaction of its own (`PgOutbox::claim_oldest`),
/// which `PgOutbox::with_async_claims` begins with `SET LOCAL synchronous_commit = off`.
pub(super) const CLAIM_BATCH_CALL: &str =
    "SELECT * FROM _System_OutboxClaimBatch($1, $2, $3, $4, $5, $6, $7, $8)";

/// The planner settings the claim functions run the claim under (their `SET` clauses in
/// migrations 0006 and 0008): every access path but the ordered index walk priced out, and no JIT (a
/// priced-out node's cost would trigger it). `outbox explain` applies them too.
pub(crate) const CLAIM_PLAN_SETTINGS: &[(&str, &str)] = &[
    ("enable_seqscan", "off"),
    ("enable_bitmapscan", "off"),
    ("enable_hashjoin", "off"),
    ("enable_mergejoin", "off"),
    ("enable_sort", "off"),
    ("enable_material", "off"),
    ("jit", "off"),
    ("join_collapse_limit", "1"),
];

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
    fn the_claim_reads_candidates_from_the_heads_and_the_unkeyed_rows() {
        for sql in [CLAIM_NEXT, CLAIM_NEXT_ALL, CLAIM_BATCH, CLAIM_BATCH_ALL] {
            assert!(sql.contains("FROM _System_OutboxHead h"));
            // The head only orders the keys: the key's oldest non-terminal row is read here.
            assert!(sql.contains("CROSS JOIN LATERAL"));
            assert!(!sql.contains("e.Id = h.Id"));
            assert!(sql.contains("WHERE e.RecordKey IS NULL AND e.Status NOT IN"));
            assert_eq!(sql.matches("FOR UPDATE OF e SKIP LOCKED").count(), 2);
            assert!(!sql.contains("WITH RECURSIVE"));
        }
    }

    #[test]
    fn only_the_scoped_statements_carry_the_scope() {
        assert_eq!(CLAIM_NEXT.matches("$5::text[] IS NULL").count(), 2);
        assert!(!CLAIM_NEXT_ALL.contains("$5"));
        assert_eq!(ELIGIBLE_GUARDED.matches("$6::text[] IS NULL").count(), 1);
    }

    /// Migrations 0006 and 0008 created `_System_OutboxClaimNext` and
    /// `_System_OutboxClaimBatch`; migrations 0009, 0018 and 0022 replaced both: their bodies must be
    /// these constants, verbatim, and their settings [`CLAIM_PLAN_SETTINGS`].
    #[test]
    fn the_claim_functions_run_these_statements_under_these_settings() {
        let latest = include_str!("../../../../migrations/postgres/0022_claim_probes_by_order.sql");
        for (name, sql) in [
            ("CLAIM_NEXT_ALL", CLAIM_NEXT_ALL),
            ("CLAIM_NEXT", CLAIM_NEXT),
            ("CLAIM_BATCH_ALL", CLAIM_BATCH_ALL),
            ("CLAIM_BATCH", CLAIM_BATCH),
        ] {
            assert!(
                latest.contains(&format!("RETURN QUERY\n{sql};\n")),
                "a claim function no longer runs {name} verbatim: replace it in a new migration"
            );
        }
        let functions = latest
            .matches("CREATE OR REPLACE FUNCTION _System_OutboxClaim")
            .count();
        assert_eq!(functions, 2);
        for (setting, value) in CLAIM_PLAN_SETTINGS {
            assert_eq!(
                latest
                    .matches(&format!("\nSET {setting} = {value}\n"))
                    .count(),
                functions
            );
        }
        let set_clauses = latest
            .lines()
            .filter(|l| l.starts_with("SET ") && !l.starts_with("SET Status"))
            .count();
        assert_eq!(set_clauses, CLAIM_PLAN_SETTINGS.len() * functions);
        // Each takes the claim-exclusion lock in a statement of its own, before its claim.
        assert_eq!(
            latest
                .matches(&format!(
                    "PERFORM pg_advisory_xact_lock_shared({}, 0);",
                    super::super::CLAIM_EXCLUSION_NAMESPACE
                ))
                .count(),
            functions
        );
    }

    #[test]
    fn the_batch_function_refuses_more_rows_than_a_batch_may_claim() {
        for batch in [
            include_str!("../../../../migrations/postgres/0008_claim_batch.sql"),
            include_str!("../../../../migrations/postgres/0009_heads_never_wedge.sql"),
            include_str!("../../../../migrations/postgres/0018_hot_record_claim.sql"),
            include_str!("../../../../migrations/postgres/0022_claim_probes_by_order.sql"),
        ] {
            assert!(batch.contains(&format!("max_claims > {}", crate::MAX_CLAIM_BATCH)));
        }
    }

    #[test]
    fn a_batch_claims_as_many_rows_as_its_limit_in_both_streams() {
        for sql in [CLAIM_BATCH, CLAIM_BATCH_ALL] {
            assert_eq!(sql.matches("LIMIT $7\n").count(), 3);
            // The only `LIMIT 1` is the lateral read of each key's oldest row.
            assert_eq!(sql.matches("LIMIT 1\n").count(), 1);
            assert!(sql.contains("LIMIT 1\n  ) first"));
        }
    }
}
