-- Issue 37, "plans that hold". The batch settle of chains (`_System_OutboxSettleMany` with
-- `chains`, migration 0016) ended its rows by a full walk of the outbox table's primary key:
-- "Rows Removed by Filter: 19968" on a table of 20,000 rows, 24,848 buffers for a settle of 32,
-- 5 ms at every chain settle, growing with the table (processed rows count until they are
-- pruned). Found with `auto_explain` in the bench's hot-record scenario, where it was the
-- largest item of the hot record's serial rate.
--
-- Why: the function runs with `enable_sort = off` (migration 0012: only the index plans are
-- left). A disabled node is not forbidden, it is priced 10^10; the statement's `firsts` (each
-- record's first row of the call, `DISTINCT ON` over at most 256 rows) needs a sort, and the
-- `waits` it feeds is a hashed subplan in the UPDATE's filter. Joined by the primary key, the
-- UPDATE would rescan the outbox once per id of the call and pay that subplan's startup, 10^10,
-- at each rescan; one walk of the whole key pays it once. So the planner walked the table.
-- With the sort priced as it is, the same statement reaches each row by its id (557 buffers).
--
-- Allowing the sort is not enough: a review measured the walk again for calls of 16 ids and
-- more (the planner still prices the `waits` subplan's build once per id it looks up, so the
-- gap grows with the square of the call's size; 149,968 rows removed on 150,000 rows for 32
-- ids). Now `waits` is `MATERIALIZED`: computed once, read as a CTE scan, and the `UPDATE`
-- reaches each row by its id under the settings of migration 0012 (670 buffers for 32 ids). The
-- body is migration 0016's otherwise (CREATE OR REPLACE takes no lock on the outbox table;
-- grants carry over).

CREATE OR REPLACE FUNCTION _System_OutboxSettleMany(clock_shift interval, event_ids uuid[],
                                                    written timestamptz[], lock_timeout text,
                                                    chains boolean)
RETURNS SETOF uuid
LANGUAGE plpgsql
VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_material = off
SET jit = off
AS $fn$
DECLARE
    done uuid[];
    ks text[];
    kids uuid[];
    stamps timestamptz[];
BEGIN
PERFORM set_config('lock_timeout', $4, true);
PERFORM set_config('outbox.heads_by_statement', txid_current()::text, true);
IF NOT $5 THEN
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
ended AS (
UPDATE _System_OutboxEvent e
SET Status = 'processed',
    LastModifiedDate = GREATEST((SELECT now FROM clock) + f.ord * interval '1 microsecond',
                                e.LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
FROM unnest($2::uuid[], $3::timestamptz[]) WITH ORDINALITY AS f(id, written, ord)
WHERE e.Id = f.id AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = f.written
RETURNING e.Id, e.RecordKey, e.LastModifiedDate
)
SELECT array_agg(x.Id), array_agg(x.RecordKey) FILTER (WHERE x.RecordKey IS NOT NULL),
       array_agg(x.Id) FILTER (WHERE x.RecordKey IS NOT NULL), array_agg(x.LastModifiedDate)
INTO done, ks, kids, stamps
FROM ended x;
ELSE
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
firsts AS (
  SELECT DISTINCT ON (x.RecordKey) x.RecordKey AS k, x.CreatedDate AS c, x.Id AS i
  FROM _System_OutboxEvent x
  WHERE x.Id = ANY($2) AND x.RecordKey IS NOT NULL
  ORDER BY x.RecordKey, x.CreatedDate, x.Id
),
waits AS MATERIALIZED (
  SELECT fi.k FROM firsts fi
  WHERE EXISTS (
    SELECT 1 FROM _System_OutboxEvent older
    WHERE older.RecordKey = fi.k
      AND (older.CreatedDate, older.Id) < (fi.c, fi.i)
      AND older.Status NOT IN ('processed', 'failed')
      AND older.Id <> ALL($2))
),
ended AS (
UPDATE _System_OutboxEvent e
SET Status = 'processed',
    LastModifiedDate = GREATEST((SELECT now FROM clock) + f.ord * interval '1 microsecond',
                                e.LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
FROM unnest($2::uuid[], $3::timestamptz[]) WITH ORDINALITY AS f(id, written, ord)
WHERE e.Id = f.id AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = f.written
  AND (e.RecordKey IS NULL OR e.RecordKey NOT IN (SELECT k FROM waits))
RETURNING e.Id, e.RecordKey, e.LastModifiedDate
)
SELECT array_agg(x.Id), array_agg(x.RecordKey) FILTER (WHERE x.RecordKey IS NOT NULL),
       array_agg(x.Id) FILTER (WHERE x.RecordKey IS NOT NULL), array_agg(x.LastModifiedDate)
INTO done, ks, kids, stamps
FROM ended x;
END IF;
PERFORM set_config('outbox.heads_by_statement', '', true);
IF ks IS NOT NULL THEN
    PERFORM _System_OutboxHeadRemoveMany(ks, kids);
END IF;
IF stamps IS NOT NULL THEN
    PERFORM _System_OutboxTally(stamps);
END IF;
RETURN QUERY SELECT u FROM unnest(done) AS u;
END;
$fn$;
