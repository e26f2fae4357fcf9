-- Issue 37, "a hot record that slows no one". The claim's head pick (migration 0009) reads each
-- key's oldest non-terminal row in a LATERAL probe, `first`, and joins the row itself, `e`, by
-- its id; the re-check `e.RecordKey = h.RecordKey` was an indexable join clause, so the planner
-- was free to reach `e` through `outbox_record_key_idx` by the head's key instead (rows behind a
-- key are estimated from the average, a handful), or to join every row of the key before
-- `first`, and drop all but one by a join filter. A record with thousands of pending rows made
-- every claim that passed its head read all of them: measured with `auto_explain` in the bench's
-- hot-record scenario (10,000 events on one record, then 10,000 over 1,000 records, 8 workers),
-- claims of 40-60 ms each (165,000 buffers: "Rows Removed by Join Filter: 7173"), the other
-- records at 0.18-0.21x of their rate alone, and 0.01x with one event per attempt (the hot record
-- itself at 47/s).
--
-- The re-check is now `e.RecordKey IS NOT DISTINCT FROM h.RecordKey`: the same test for the
-- non-null keys of heads (it still runs on the locked row's newest version when SKIP LOCKED's
-- recheck reads it), but no index or join method can use it, so the row is reached by its
-- primary key from `first` alone.
--
-- And `e` is the row version `first` read, fetched by its `ctid` (`e.ctid = first.at AND
-- e.Id = first.Id`: a TID scan, one tuple), and the functions now run with
-- `join_collapse_limit = 1`, so `e` is joined after `first`, in the order written. Free to
-- join `e` first, the planner walked a whole index for it at each head whenever the statistics
-- made that index look empty: on statistics taken while the backlog was empty (the bench's
-- retention scenario, 200,000 terminal rows analyzed and then a backlog: claims of 17 ms at the
-- median, 61 ms logged with "Rows Removed by Join Filter: 34377") it walked all of
-- `outbox_record_key_idx`; on a plan cached while the table was tiny, the whole primary key. A
-- row updated after the statement's snapshot fails the `ctid` on the re-check SKIP LOCKED makes
-- on its newest version, and is passed over as a locked row is (the next claim takes it), on
-- minor releases with the TID scan's re-check (backpatched to PostgreSQL 13 in 2025); on older
-- ones the pick behaves as with the join by id.
--
-- Second, a key with a live claim is passed before its rows are read. The heads in flight sit
-- at the front of the walk (about one per claimed row, 300 at 8 workers with batches), and each
-- cost the lateral read of its oldest row and that row's fetch before the guard dropped it. The
-- lateral read now starts with the in-flight probe for the head's key (`outbox_in_flight_idx`;
-- it depends on the head alone, so it is a one-time filter of the read and cannot become an
-- anti-join): on 20,000 rows over 1,000 keys with 300 heads in flight, a claim of 32 read 1,521
-- buffers instead of 2,697. The rule is unchanged: a key with a fresh `processing` row has no
-- claimable row (its head is that row, or waits behind it), a stale one does not count; the
-- guard on the picked row is kept as it was (both read the statement's snapshot).
--
-- Both functions are replaced whole (CREATE OR REPLACE takes no lock on the outbox table); only
-- these lines differ from migration 0009, and the claim texts are still CLAIM_NEXT_ALL,
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
    WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = h.RecordKey
          AND f.Status = 'processing'
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
    ORDER BY o.CreatedDate, o.Id
    LIMIT 1
  ) first
  JOIN _System_OutboxEvent e ON e.ctid = first.at AND e.Id = first.Id
  WHERE e.RecordKey IS NOT DISTINCT FROM h.RecordKey AND
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
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
  CROSS JOIN LATERAL (
    SELECT o.Id, o.ctid AS at
    FROM _System_OutboxEvent o
    WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = h.RecordKey
          AND f.Status = 'processing'
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
    ORDER BY o.CreatedDate, o.Id
    LIMIT 1
  ) first
  JOIN _System_OutboxEvent e ON e.ctid = first.at AND e.Id = first.Id
  WHERE e.RecordKey IS NOT DISTINCT FROM h.RecordKey AND
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
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
    WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = h.RecordKey
          AND f.Status = 'processing'
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
    ORDER BY o.CreatedDate, o.Id
    LIMIT 1
  ) first
  JOIN _System_OutboxEvent e ON e.ctid = first.at AND e.Id = first.Id
  WHERE e.RecordKey IS NOT DISTINCT FROM h.RecordKey AND
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
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
  CROSS JOIN LATERAL (
    SELECT o.Id, o.ctid AS at
    FROM _System_OutboxEvent o
    WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = h.RecordKey
          AND f.Status = 'processing'
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
      )
    ORDER BY o.CreatedDate, o.Id
    LIMIT 1
  ) first
  JOIN _System_OutboxEvent e ON e.ctid = first.at AND e.Id = first.Id
  WHERE e.RecordKey IS NOT DISTINCT FROM h.RecordKey AND
    (e.Status = 'pending'
     OR (e.Status = 'processing' AND e.LastModifiedDate < (SELECT now FROM clock) - $2::interval))
    AND (e.Status <> 'pending'
         OR (e.RetryCount = 0 AND e.LastModifiedDate <= (SELECT now FROM clock))
         OR e.LastModifiedDate < (SELECT now FROM clock) - $3::interval)
      AND NOT EXISTS (
        SELECT 1
        FROM _System_OutboxEvent f
        WHERE f.RecordKey = e.RecordKey
          AND f.Status = 'processing'
          AND f.Id <> e.Id
          AND f.LastModifiedDate >= (SELECT now FROM clock) - $2::interval
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
