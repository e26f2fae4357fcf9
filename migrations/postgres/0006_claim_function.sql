-- Issue 16: a claim whose plan does not depend on when it was planned. See docs/queries.md
-- ("Plan stability").
--
-- claim_next's statement is prepared once per connection and, after five executions, runs
-- from a cached generic plan. A plan built while the queue was empty (a fresh deployment, a
-- drained and analyzed table, a truncate) reads a one-page table: sequential scans and hash
-- joins are cheapest there, and the cached plan keeps them when the backlog then grows to
-- 100k rows (each claim scans the table, and the key-order probes scan it again per
-- candidate) until an ANALYZE happens to invalidate it. Planning at every call avoids that
-- and costs about 1 ms of server CPU per claim, more than the claim itself.
--
-- The statement therefore runs inside this function, whose SET clauses hold for the
-- statements it runs and for their planning: with sequential scans, hash and merge joins,
-- sorts, materialization and bitmap scans priced out, the only plan left at any table size is
-- the ordered index walk of docs/queries.md, so caching it is safe. JIT is off because a
-- priced-out node can push a plan's estimated cost past jit_above_cost. The settings end with
-- the function (they never reach the caller's session). graphile-worker keeps its get_job
-- the same way, as a function in its migrations.
--
-- The two statements are CLAIM_NEXT_ALL and CLAIM_NEXT of
-- crates/outbox-persistence/src/postgres/sql.rs, verbatim ($1..$6 are this function's
-- parameters); a unit test there fails if they drift apart. A later change to the claim
-- replaces this function in a new migration. The result columns are the outbox row's, so a
-- migration that changes a column's type must replace the function too.
CREATE FUNCTION _System_OutboxClaimNext(
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
AS $claim$
#variable_conflict use_column
BEGIN
IF only_types IS NULL AND except_types IS NULL THEN
RETURN QUERY
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
head_pick AS (
  SELECT e.Id, e.Status AS old_status, e.CreatedDate
  FROM _System_OutboxHead h
  JOIN _System_OutboxEvent e ON e.Id = h.Id
  WHERE
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
  JOIN _System_OutboxEvent e ON e.Id = h.Id
  WHERE
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
