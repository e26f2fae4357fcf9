-- Issue 15: claim several heads in one statement. See docs/queries.md ("Claiming for several
-- workers at once").
--
-- _System_OutboxClaimBatch is _System_OutboxClaimNext (migration 0006) with the number of rows
-- to claim as its seventh parameter: each candidate stream picks and locks up to max_claims
-- rows that pass the design's whole rule, the oldest max_claims of both streams are claimed,
-- and every claimed row is returned. The keyed candidates are heads of distinct keys (one head
-- per key), so one statement never claims two rows of one key, and each row still passes the
-- in-flight guard against the rows other statements claimed. A dispatcher's idle workers share
-- one call (the leader claims for the workers waiting behind it) instead of running one claim
-- statement each: the statement's fixed cost (the function call, the clock, the two index
-- walks' start, the union) is paid once per batch, and concurrent claims no longer skip over
-- each other's locked heads.
--
-- The planner settings are 0006's, for the same reason (see that migration). The statements
-- are CLAIM_BATCH_ALL and CLAIM_BATCH of crates/outbox-persistence/src/postgres/sql.rs,
-- verbatim ($1..$7 are this function's parameters); a unit test there fails if they drift
-- apart. max_claims outside 1..256 is refused (NULL would mean no LIMIT). The eighth
-- parameter bounds the call's lock waits (text such as '5000ms'; the caller's setting is put
-- back after the call): a claim shared by every idle worker of a process must not wait
-- unbounded behind an application's open transaction. _System_OutboxClaimNext stays for binaries of the previous release during a rolling
-- deploy; this release calls only this function (claim_next is a batch of one).
CREATE FUNCTION _System_OutboxClaimBatch(
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
AS $claim$
#variable_conflict use_column
DECLARE
    caller_lock_timeout text := current_setting('lock_timeout');
BEGIN
IF max_claims IS NULL OR max_claims < 1 OR max_claims > 256 THEN
    RAISE EXCEPTION 'max_claims must be 1 to 256, got %', max_claims
        USING ERRCODE = 'invalid_parameter_value';
END IF;
-- A claim waits for a lock only in the head trigger of a stale row it ends failed (the key's
-- head, behind an open enqueue): bounded like every outbox statement, for this call only.
PERFORM set_config('lock_timeout', claim_lock_timeout, true);
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
