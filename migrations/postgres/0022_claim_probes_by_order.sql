-- Issue 37, "plans that hold": the claim's probes name their index by their order. The head
-- pick reads each head's record twice: its oldest open row (`first`) and its in-flight rows
-- (the pre-filter, and the guard on the picked row). `outbox_eligible_idx`,
-- `outbox_record_key_idx` and `outbox_in_flight_idx` are all partial indexes on the open rows,
-- and statistics taken while no row was open (an ANALYZE of a table of terminal rows, which is
-- what a quiet period over a large retained history leaves) make every scan of them cost the
-- same: the planner then read both probes from `outbox_eligible_idx`, with the record as a
-- filter, every open row of the table per head. Measured with auto_explain in the bench's
-- retention scenario (1,000,000 terminal rows analyzed, then a keyed backlog): 1,198 claims
-- over 100 ms, up to 819 ms, drains at 135-138/s and ~400/s where 1,173-15,317/s was the rate
-- on fresh statistics; on a scratch table (300,000 terminal rows analyzed, then 20,000 open
-- over 1,000 records, 256 in flight) a claim of 108 rows 487-511 ms, 6.3 ms after an ANALYZE.
-- A custom plan is made at each call on the statistics of the moment, so only the next ANALYZE
-- ended it (autovacuum: about 100,000 changed rows on a table of 1,000,000).
--
-- Each probe now bounds the key by a range (`>=` and `<=`: the same rows as the equality, but
-- not a constant the planner drops from the ordering) and is ordered by `RecordKey` first, an
-- order only the key's indexes give; under the functions' `enable_sort = off` no statistics
-- can make `outbox_eligible_idx` the cheaper. The in-flight probes are scalar subqueries with
-- that order (`… LIMIT 1) IS NULL`: an EXISTS drops its ORDER BY). On the scratch table: 4.4-6.9
-- ms per claim, the plan the fresh statistics give. The rule is unchanged.
--
-- Both functions are replaced whole (CREATE OR REPLACE takes no lock on the outbox table); only
-- these probes differ from migration 0018, and the claim texts are still CLAIM_NEXT_ALL,
-- CLAIM_NEXT, CLAIM_BATCH_ALL and CLAIM_BATCH of crates/outbox-persistence/src/postgres/sql.rs,
-- verbatim (a unit test holds them to this file).

CREATE OR REPLACE FUNCTION _System_OutboxClaimNext(
    clock_shift interval,
    stale_after interval,
    retry_delay interval,
    max_retry_attempts integer,
    only_types text[],
    except_types text[]
)
RETURNS TABLE (Id uuid, EventType text, Payload text, Status text, RetryCount integer,
               RecordKey text, CreatedDate timestamptz, LastModifiedDate timestamptz,
               LastError text, old_status text)
LANGUAGE plpgsql
VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_material = off
SET jit = off
SET join_collapse_limit = 1
AS $claim$
#variable_conflict use_column
BEGIN
-- The previous release's binaries call this one during a rolling deploy: the same rules.
PERFORM pg_advisory_xact_lock_shared(3479, 0);
IF only_types IS NULL AND except_types IS NULL THEN
RETURN QUERY
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
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
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
      AND (SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey >= e.RecordKey AND f.RecordKey <= e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
        ORDER BY f.RecordKey LIMIT 1) IS NULL
  ORDER BY h.CreatedDate, h.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
unkeyed_pick AS (
  SELECT e.Id, e.Status AS old_status, e.CreatedDate
  FROM _System_OutboxEvent e
  WHERE e.RecordKey IS NULL AND e.Status NOT IN ('processed', 'failed') AND
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
    AND (
      e.RecordKey IS NULL
      OR (NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent older
        WHERE older.RecordKey = e.RecordKey
          AND (older.CreatedDate, older.Id) < (e.CreatedDate, e.Id)
          AND older.Status NOT IN ('processed', 'failed')
      )
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
      )
    )
  ORDER BY e.CreatedDate, e.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
candidate AS (
  SELECT p.Id, p.old_status
  FROM (SELECT * FROM head_pick UNION ALL SELECT * FROM unkeyed_pick) p
  ORDER BY p.CreatedDate, p.Id
  LIMIT 1
)
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
          t.LastModifiedDate, t.LastError, c.old_status;
ELSE
RETURN QUERY
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
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
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
      AND (SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey >= e.RecordKey AND f.RecordKey <= e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
        ORDER BY f.RecordKey LIMIT 1) IS NULL
    AND ($5::text[] IS NULL OR e.EventType = ANY($5))
    AND ($6::text[] IS NULL OR e.EventType <> ALL($6))
  ORDER BY h.CreatedDate, h.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
unkeyed_pick AS (
  SELECT e.Id, e.Status AS old_status, e.CreatedDate
  FROM _System_OutboxEvent e
  WHERE e.RecordKey IS NULL AND e.Status NOT IN ('processed', 'failed') AND
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
    AND (
      e.RecordKey IS NULL
      OR (NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent older
        WHERE older.RecordKey = e.RecordKey
          AND (older.CreatedDate, older.Id) < (e.CreatedDate, e.Id)
          AND older.Status NOT IN ('processed', 'failed')
      )
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
      )
    )
    AND ($5::text[] IS NULL OR e.EventType = ANY($5))
    AND ($6::text[] IS NULL OR e.EventType <> ALL($6))
  ORDER BY e.CreatedDate, e.Id
  LIMIT 1
  FOR UPDATE OF e SKIP LOCKED
),
candidate AS (
  SELECT p.Id, p.old_status
  FROM (SELECT * FROM head_pick UNION ALL SELECT * FROM unkeyed_pick) p
  ORDER BY p.CreatedDate, p.Id
  LIMIT 1
)
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
          t.LastModifiedDate, t.LastError, c.old_status;
END IF;
END;
$claim$;

CREATE OR REPLACE FUNCTION _System_OutboxClaimBatch(
    clock_shift interval,
    stale_after interval,
    retry_delay interval,
    max_retry_attempts integer,
    only_types text[],
    except_types text[],
    max_claims integer,
    claim_lock_timeout text
)
RETURNS TABLE (Id uuid, EventType text, Payload text, Status text, RetryCount integer,
               RecordKey text, CreatedDate timestamptz, LastModifiedDate timestamptz,
               LastError text, old_status text)
LANGUAGE plpgsql
VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_material = off
SET jit = off
SET join_collapse_limit = 1
AS $claim$
#variable_conflict use_column
DECLARE
    caller_lock_timeout text := current_setting('lock_timeout');
BEGIN
IF max_claims IS NULL OR max_claims < 1 OR max_claims > 256 THEN
    RAISE EXCEPTION 'max_claims must be 1 to 256, got %', max_claims
        USING ERRCODE = 'invalid_parameter_value';
END IF;
-- The call's lock waits are bounded, for this call only: the claim-exclusion lock below (held
-- exclusively by an operator retry or the backfill for a moment), nothing else.
PERFORM set_config('lock_timeout', claim_lock_timeout, true);
-- In a statement of its own, so that the claim's snapshot is taken after it.
PERFORM pg_advisory_xact_lock_shared(3479, 0);
IF only_types IS NULL AND except_types IS NULL THEN
RETURN QUERY
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
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
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
      AND (SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey >= e.RecordKey AND f.RecordKey <= e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
        ORDER BY f.RecordKey LIMIT 1) IS NULL
  ORDER BY h.CreatedDate, h.Id
  LIMIT $7
  FOR UPDATE OF e SKIP LOCKED
),
unkeyed_pick AS (
  SELECT e.Id, e.Status AS old_status, e.CreatedDate
  FROM _System_OutboxEvent e
  WHERE e.RecordKey IS NULL AND e.Status NOT IN ('processed', 'failed') AND
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
    AND (
      e.RecordKey IS NULL
      OR (NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent older
        WHERE older.RecordKey = e.RecordKey
          AND (older.CreatedDate, older.Id) < (e.CreatedDate, e.Id)
          AND older.Status NOT IN ('processed', 'failed')
      )
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
      )
    )
  ORDER BY e.CreatedDate, e.Id
  LIMIT $7
  FOR UPDATE OF e SKIP LOCKED
),
candidate AS (
  SELECT p.Id, p.old_status
  FROM (SELECT * FROM head_pick UNION ALL SELECT * FROM unkeyed_pick) p
  ORDER BY p.CreatedDate, p.Id
  LIMIT $7
)
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
          t.LastModifiedDate, t.LastError, c.old_status;
ELSE
RETURN QUERY
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
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
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
      AND (SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey >= e.RecordKey AND f.RecordKey <= e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
        ORDER BY f.RecordKey LIMIT 1) IS NULL
    AND ($5::text[] IS NULL OR e.EventType = ANY($5))
    AND ($6::text[] IS NULL OR e.EventType <> ALL($6))
  ORDER BY h.CreatedDate, h.Id
  LIMIT $7
  FOR UPDATE OF e SKIP LOCKED
),
unkeyed_pick AS (
  SELECT e.Id, e.Status AS old_status, e.CreatedDate
  FROM _System_OutboxEvent e
  WHERE e.RecordKey IS NULL AND e.Status NOT IN ('processed', 'failed') AND
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
    AND (
      e.RecordKey IS NULL
      OR (NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent older
        WHERE older.RecordKey = e.RecordKey
          AND (older.CreatedDate, older.Id) < (e.CreatedDate, e.Id)
          AND older.Status NOT IN ('processed', 'failed')
      )
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
      )
    )
    AND ($5::text[] IS NULL OR e.EventType = ANY($5))
    AND ($6::text[] IS NULL OR e.EventType <> ALL($6))
  ORDER BY e.CreatedDate, e.Id
  LIMIT $7
  FOR UPDATE OF e SKIP LOCKED
),
candidate AS (
  SELECT p.Id, p.old_status
  FROM (SELECT * FROM head_pick UNION ALL SELECT * FROM unkeyed_pick) p
  ORDER BY p.CreatedDate, p.Id
  LIMIT $7
)
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
          t.LastModifiedDate, t.LastError, c.old_status;
END IF;
PERFORM set_config('lock_timeout', caller_lock_timeout, true);
END;
$claim$;
