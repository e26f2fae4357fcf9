-- Issue 37, "plans that hold": every statement of the attempt's hot path runs inside a function
-- under the claim's planner settings (migrations 0006 and 0008), so its plan is an index plan
-- whatever the table's size when the plan was made. See docs/queries.md ("Plan stability").
--
-- A statement prepared by the client (sqlx caches them under a name) runs from a generic plan
-- after five executions. One made while the outbox table was nearly empty reads it with a
-- sequential scan, and keeps doing so when the table grows a thousandfold until an ANALYZE of
-- the table invalidates it: measured, the batch's fence check read 260,273 rows of a
-- 20,000-row table for 6 batches of 3 rows. Planning every call instead costs about 0.36 ms of
-- server time per statement, more than most of these statements take. A PL/pgSQL function
-- caches its statements' plans per connection too, but under its SET clauses every access
-- path but the ordered index walk is priced out, so the cached plan is the index plan at any
-- size; with a pooler that shares no prepared statements, the function's plans are still
-- cached on the server's connection.
--
-- The lock timeout (`lock_timeout` parameter, text such as `5000ms`) is set for the rest of
-- the calling transaction, as the statements' inline `set_config(…, true)` did: a function's
-- SET clauses restore only their own settings when it returns. Parameters are read by
-- position ($1, …), as in the statements these functions replace.

-- The trigger functions and the fence check keep their bodies and gain the settings: they run
-- in every enqueue and every attempt.
ALTER FUNCTION _System_OutboxCheckFence(uuid, timestamptz)
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET enable_sort = off SET enable_material = off SET jit = off;
ALTER FUNCTION _System_OutboxHeadAdd(text[], timestamptz[], uuid[])
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET enable_sort = off SET enable_material = off SET jit = off;
ALTER FUNCTION _System_OutboxHeadRemove(text, uuid)
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET enable_sort = off SET enable_material = off SET jit = off;

-- One claim's heartbeat: the row (`$2`) still `processing` under its fence (`$3`) moves
-- `LastModifiedDate` forward; returns the value written and the writing transaction (`xmin`),
-- which a beat whose COMMIT got no answer reads back. `$1` the clock shift.
CREATE FUNCTION _System_OutboxBeat(clock_shift interval, event_id uuid, written timestamptz,
                                   lock_timeout text)
RETURNS TABLE (beaten timestamptz, writer bigint)
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
BEGIN
PERFORM set_config('lock_timeout', $4, true);
RETURN QUERY
UPDATE _System_OutboxEvent e
SET LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond')
WHERE e.Id = $2 AND e.Status = 'processing' AND e.LastModifiedDate = $3
RETURNING e.LastModifiedDate, e.xmin::text::bigint;
END;
$fn$;

-- Beats several claims in one statement: the rows (`$2`) still `processing` under their fence
-- (`$3`, in the same order) that no other transaction holds locked move `LastModifiedDate`
-- forward. One row per fence: its new `LastModifiedDate` and writer when beaten, else whether
-- it is still this worker's as last committed (`busy`: locked by someone else, not beaten this
-- time) or lost. The outer `EXISTS` reads the statement's snapshot, from before the update. No
-- lock wait: the rows are locked with SKIP LOCKED, in the mode the UPDATE takes (FOR NO KEY
-- UPDATE), which does not conflict with the FOR KEY SHARE that the attempt's own effect-ledger
-- rows take on their event's row (migration 0013's foreign key): FOR UPDATE did, and skipped
-- the beat of every claim whose handler had run an effect until its transaction ended.
CREATE FUNCTION _System_OutboxBeatMany(clock_shift interval, event_ids uuid[], written timestamptz[])
RETURNS TABLE (event_id uuid, beaten timestamptz, writer bigint, mine boolean)
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
BEGIN
RETURN QUERY
WITH f AS (SELECT * FROM unnest($2::uuid[], $3::timestamptz[]) AS f(id, written)),
held AS (
  SELECT e.Id FROM _System_OutboxEvent e JOIN f ON e.Id = f.id
  WHERE e.Status = 'processing' AND e.LastModifiedDate = f.written
  ORDER BY e.Id
  FOR NO KEY UPDATE OF e SKIP LOCKED
),
moved AS (
  UPDATE _System_OutboxEvent e
  SET LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond')
  FROM held WHERE e.Id = held.Id
  RETURNING e.Id, e.LastModifiedDate, e.xmin::text::bigint AS by_xact
)
SELECT f.id, m.LastModifiedDate, m.by_xact,
  EXISTS (SELECT 1 FROM _System_OutboxEvent e
          WHERE e.Id = f.id AND e.Status = 'processing' AND e.LastModifiedDate = f.written)
FROM f LEFT JOIN moved m ON m.Id = f.id;
END;
$fn$;

-- A batch's fence check: the ids (`$1`) that may not run now: their row is no longer
-- `processing` under its fence (`$2`, in the same order), or an older row of its record outside
-- the batch is not terminal (an operator retry, or a row other code wrote, since the claim).
-- One probe per record, not per member: the record's oldest open row outside the batch and
-- older than its newest member, read with `ORDER BY … LIMIT 1` from the record's first index
-- entry; a member waits when that row is older than it. `outside` is MATERIALIZED: inlined
-- into the last `NOT EXISTS`, its probes ran once per member and record (32 x 32).
CREATE FUNCTION _System_OutboxLostFences(event_ids uuid[], written timestamptz[])
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
BEGIN
RETURN QUERY
WITH held AS (
  SELECT e.Id, f.written, e.RecordKey, e.CreatedDate
  FROM unnest($1::uuid[], $2::timestamptz[]) AS f(id, written)
  JOIN _System_OutboxEvent e ON e.Id = f.id
  WHERE e.Status = 'processing' AND e.LastModifiedDate = f.written
),
newest AS (
  SELECT DISTINCT ON (h.RecordKey) h.RecordKey AS k, h.CreatedDate AS c, h.Id AS i
  FROM held h
  WHERE h.RecordKey IS NOT NULL
  ORDER BY h.RecordKey, h.CreatedDate DESC, h.Id DESC
),
outside AS MATERIALIZED (
  SELECT n.k, o.CreatedDate AS c, o.Id AS i
  FROM newest n
  CROSS JOIN LATERAL (
    SELECT older.CreatedDate, older.Id FROM _System_OutboxEvent older
    WHERE older.RecordKey = n.k
      AND (older.CreatedDate, older.Id) < (n.c, n.i)
      AND older.Status NOT IN ('processed', 'failed')
      AND older.Id <> ALL($1)
    ORDER BY older.CreatedDate, older.Id
    LIMIT 1
  ) o
)
SELECT f.id FROM unnest($1::uuid[], $2::timestamptz[]) AS f(id, written)
WHERE NOT EXISTS (
  SELECT 1 FROM held h
  WHERE h.Id = f.id AND h.written = f.written
    AND NOT EXISTS (
      SELECT 1 FROM outside o
      WHERE o.k = h.RecordKey AND (o.c, o.i) < (h.CreatedDate, h.Id)));
END;
$fn$;

-- One claim's outcome (`$7`: processed, failed, retry or release), fenced: the row (`$2`)
-- still `processing` under its fence (`$3`) is written, `LastModifiedDate` strictly forward on
-- the database's clock (`$1` the clock shift). Returns the rows written (0 or 1).
--   failed:  RetryCount + 1, LastError `$4`;
--   retry:   back to `pending`, RetryCount + 1, LastError `$4`, due after the extra backoff `$5`;
--   release: back to `pending` with RetryCount unchanged (the attempt is not counted: its
--            handler succeeded and the outbox's own write of the outcome failed); LastError
--            `$4`, unless it says a stale reclaim counted a dead worker: that is kept, so a
--            row given back by its reclaimer never reads as the earlier holder's own release.
CREATE FUNCTION _System_OutboxSettle(clock_shift interval, event_id uuid, written timestamptz,
                                     error text, extra_delay interval, lock_timeout text,
                                     outcome text)
RETURNS integer
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
    settled integer;
BEGIN
PERFORM set_config('lock_timeout', $6, true);
IF $7 = 'processed' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'processed',
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond'),
        LastError = NULL
    WHERE e.Id = $2 AND e.Status = 'processing' AND e.LastModifiedDate = $3;
ELSIF $7 = 'failed' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'failed',
        RetryCount = e.RetryCount + 1,
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond'),
        LastError = $4
    WHERE e.Id = $2 AND e.Status = 'processing' AND e.LastModifiedDate = $3;
ELSIF $7 = 'retry' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'pending',
        RetryCount = e.RetryCount + 1,
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval) + $5::interval, e.LastModifiedDate + interval '1 microsecond'),
        LastError = $4
    WHERE e.Id = $2 AND e.Status = 'processing' AND e.LastModifiedDate = $3;
ELSIF $7 = 'release' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'pending',
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond'),
        LastError = CASE WHEN e.LastError LIKE 'worker died:%' THEN e.LastError ELSE $4 END
    WHERE e.Id = $2 AND e.Status = 'processing' AND e.LastModifiedDate = $3;
ELSE
    RAISE EXCEPTION 'unknown outbox outcome %', $7 USING ERRCODE = '22023';
END IF;
GET DIAGNOSTICS settled = ROW_COUNT;
RETURN settled;
END;
$fn$;

-- `processed` for several claims (`$2`, fenced on `$3` in the same order): the ids written.
-- The clock is read once, and each row's `processed` time follows its place in the claim order
-- (a microsecond apart), so a record's rows written together keep their order in time whatever
-- order the server updates them in. With `$5` (a batch holding a record chain), no row of a
-- record is written while an older row of the record outside the batch is not terminal (an
-- operator retry of an older failed row, or a row other code wrote, that appeared after the
-- segment's begin check): those rows are left `processing` under their fences, for the worker
-- to give back. One probe per record, from its oldest row in the batch.
CREATE FUNCTION _System_OutboxSettleMany(clock_shift interval, event_ids uuid[],
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
BEGIN
PERFORM set_config('lock_timeout', $4, true);
IF NOT $5 THEN
RETURN QUERY
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now)
UPDATE _System_OutboxEvent e
SET Status = 'processed',
    LastModifiedDate = GREATEST((SELECT now FROM clock) + f.ord * interval '1 microsecond',
                                e.LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
FROM unnest($2::uuid[], $3::timestamptz[]) WITH ORDINALITY AS f(id, written, ord)
WHERE e.Id = f.id AND e.Status = 'processing' AND e.LastModifiedDate = f.written
RETURNING e.Id;
ELSE
RETURN QUERY
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
firsts AS (
  SELECT DISTINCT ON (x.RecordKey) x.RecordKey AS k, x.CreatedDate AS c, x.Id AS i
  FROM _System_OutboxEvent x
  WHERE x.Id = ANY($2) AND x.RecordKey IS NOT NULL
  ORDER BY x.RecordKey, x.CreatedDate, x.Id
),
waits AS (
  SELECT fi.k FROM firsts fi
  WHERE EXISTS (
    SELECT 1 FROM _System_OutboxEvent older
    WHERE older.RecordKey = fi.k
      AND (older.CreatedDate, older.Id) < (fi.c, fi.i)
      AND older.Status NOT IN ('processed', 'failed')
      AND older.Id <> ALL($2))
)
UPDATE _System_OutboxEvent e
SET Status = 'processed',
    LastModifiedDate = GREATEST((SELECT now FROM clock) + f.ord * interval '1 microsecond',
                                e.LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
FROM unnest($2::uuid[], $3::timestamptz[]) WITH ORDINALITY AS f(id, written, ord)
WHERE e.Id = f.id AND e.Status = 'processing' AND e.LastModifiedDate = f.written
  AND (e.RecordKey IS NULL OR e.RecordKey NOT IN (SELECT k FROM waits))
RETURNING e.Id;
END IF;
END;
$fn$;

-- The release of several claims uncounted (`$2`, fenced on `$3` in the same order; LastError
-- `$4` as `_System_OutboxSettle`'s release): the ids released.
CREATE FUNCTION _System_OutboxReleaseMany(clock_shift interval, event_ids uuid[],
                                          written timestamptz[], error text, lock_timeout text)
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
BEGIN
PERFORM set_config('lock_timeout', $5, true);
RETURN QUERY
UPDATE _System_OutboxEvent e
SET Status = 'pending',
    LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond'),
    LastError = CASE WHEN e.LastError LIKE 'worker died:%' THEN e.LastError ELSE $4 END
FROM unnest($2::uuid[], $3::timestamptz[]) AS f(id, written)
WHERE e.Id = f.id AND e.Status = 'processing' AND e.LastModifiedDate = f.written
RETURNING e.Id;
END;
$fn$;

-- Record chains (see docs/state-machine.md, "Record chains"): in the claim's transaction,
-- after its statement, each head just claimed (`$2` keys, `$3` their `CreatedDate`, `$4` their
-- ids; keyed heads on a first attempt only) brings up to `$5` of its record's next
-- non-terminal rows, in order, as long as each is `pending` on a first attempt (`RetryCount`
-- 0), due (`LastModifiedDate` not in the future) and in scope (`$6`/`$7` as the claim's): the
-- first row that is not ends the chain (`bool_and` over the rows so far), so a chain never
-- skips a row of its record. At most `$8` rows in all, taken rank by rank across the chains
-- (every chain's first row, then every chain's second, …), so each chain is a prefix of its
-- record's rows. No other claim can take these rows meanwhile: each has an older non-terminal
-- row (its head, locked by this transaction). `$1` the clock shift.
CREATE FUNCTION _System_OutboxClaimChains(clock_shift interval, keys text[], created timestamptz[],
                                          heads uuid[], per_chain bigint, only_types text[],
                                          except_types text[], max_rows bigint)
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
AS $fn$
#variable_conflict use_column
BEGIN
RETURN QUERY
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
next AS (
  SELECT n.Id,
         bool_and(n.Status = 'pending' AND n.RetryCount = 0
                  AND n.LastModifiedDate <= (SELECT now FROM clock)
                  AND ($6::text[] IS NULL OR n.EventType = ANY($6))
                  AND ($7::text[] IS NULL OR n.EventType <> ALL($7)))
           OVER (PARTITION BY n.k ORDER BY n.CreatedDate, n.Id) AS unbroken,
         row_number() OVER (PARTITION BY n.k ORDER BY n.CreatedDate, n.Id) AS rank,
         n.c
  FROM unnest($2::text[], $3::timestamptz[], $4::uuid[]) AS h(k, c, i)
  CROSS JOIN LATERAL (
    SELECT o.Id, h.k, h.c, o.CreatedDate, o.Status, o.RetryCount, o.LastModifiedDate, o.EventType
    FROM _System_OutboxEvent o
    WHERE o.RecordKey = h.k AND o.Status NOT IN ('processed', 'failed')
      AND (o.CreatedDate, o.Id) > (h.c, h.i)
    ORDER BY o.CreatedDate, o.Id
    LIMIT $5
  ) n
),
picked AS (
  SELECT next.Id FROM next WHERE next.unbroken ORDER BY next.rank, next.c, next.Id LIMIT $8
)
UPDATE _System_OutboxEvent t
SET Status = 'processing',
    LastModifiedDate = GREATEST((SELECT now FROM clock), t.LastModifiedDate + interval '1 microsecond')
FROM picked
WHERE t.Id = picked.Id AND t.Status = 'pending' AND t.RetryCount = 0
RETURNING t.Id, t.EventType, t.Payload, t.Status, t.RetryCount, t.RecordKey, t.CreatedDate,
          t.LastModifiedDate, t.LastError, 'pending'::text AS old_status;
END;
$fn$;
