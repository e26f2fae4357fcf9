-- Issue 37, "plans that hold", two traps a review measured in the functions of migrations
-- 0011, 0012 and 0014. Bodies otherwise unchanged; CREATE OR REPLACE takes no lock on the
-- outbox table, grants carry over, and the SET clauses are written out again (CREATE OR
-- REPLACE replaces them with the ones it is given).
--
-- 1. `_System_OutboxBeatMany` walked the outbox table's whole primary key at every batch beat:
--    its `held` read ended in `ORDER BY e.Id`, and under the function's `enable_sort = off` a
--    sort is priced 10^10, so the planner took the one plan that yields ids in order without
--    one: the primary key from its first entry, each row joined to the call's ids by filter
--    (20,060 buffers for a beat of 32 claims beside 20,000 processed rows; 448 without the
--    order). The order bought nothing: the rows are locked with SKIP LOCKED, so the beat never
--    waits for a lock and cannot be one side of a deadlock, whatever order it locks in. It is
--    dropped.
--
-- 2. `_System_OutboxHeadRemove` and `_System_OutboxHeadRemoveMany` check that the head's row is
--    still open with `e.Id = h.Id AND e.RecordKey = h.RecordKey AND e.Status NOT IN (…)`. The
--    key's equality and the status make `outbox_record_key_idx` (RecordKey, CreatedDate, Id,
--    partial on open rows) a candidate with the id as a second, non-leading condition: an
--    index-only scan of every open entry of the record (10,000 for a hot record) to find one
--    id, chosen whenever the statistics price both one row. The key is compared with
--    `IS NOT DISTINCT FROM` now (the same test for the non-null keys heads hold, and not an
--    index condition), which leaves the primary key alone, as in migration 0018's claim.
--    `_System_OutboxHeadRemove` also gains the settings the others have (0012 gave them with
--    ALTER FUNCTION, which CREATE OR REPLACE drops).

CREATE OR REPLACE FUNCTION _System_OutboxBeatMany(clock_shift interval, event_ids uuid[], written timestamptz[])
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
  WHERE e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = f.written
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
          WHERE e.Id = f.id AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = f.written)
FROM f LEFT JOIN moved m ON m.Id = f.id;
END;
$fn$;

CREATE OR REPLACE FUNCTION _System_OutboxHeadRemoveMany(ks text[], ids uuid[]) RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_material = off
SET jit = off
AS $$
DECLARE
    locked text[];
    empty text[];
BEGIN
    SELECT array_agg(l.RecordKey) INTO locked
    FROM (
        SELECT h.RecordKey
        FROM _System_OutboxHead h
        WHERE h.RecordKey = ANY(ks)
          AND (h.Id = ANY(ids) OR NOT EXISTS (
                SELECT 1 FROM _System_OutboxEvent e
                WHERE e.Id = h.Id AND e.RecordKey IS NOT DISTINCT FROM h.RecordKey
                  AND e.Status NOT IN ('processed', 'failed')))
        FOR NO KEY UPDATE OF h SKIP LOCKED
    ) l;
    IF locked IS NULL THEN
        RETURN;
    END IF;
    WITH firsts AS (
        SELECT k.k, n.CreatedDate AS c, n.Id AS i
        FROM unnest(locked) AS k(k)
        LEFT JOIN LATERAL (
            SELECT e.CreatedDate, e.Id
            FROM _System_OutboxEvent e
            WHERE e.RecordKey = k.k AND e.Status NOT IN ('processed', 'failed')
            ORDER BY e.CreatedDate, e.Id
            LIMIT 1
        ) n ON true
    ),
    moved AS (
        UPDATE _System_OutboxHead h SET CreatedDate = f.c, Id = f.i
        FROM firsts f
        WHERE h.RecordKey = f.k AND f.i IS NOT NULL
          AND (h.CreatedDate, h.Id) IS DISTINCT FROM (f.c, f.i)
        RETURNING 1
    )
    SELECT array_agg(f.k) FILTER (WHERE f.i IS NULL) INTO empty FROM firsts f;
    -- As in _System_OutboxHeadRemove (migration 0009): the re-look needs READ COMMITTED.
    IF empty IS NULL OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN;
    END IF;
    SELECT array_agg(l.RecordKey) INTO empty
    FROM (
        SELECT h.RecordKey FROM _System_OutboxHead h
        WHERE h.RecordKey = ANY(empty)
        FOR UPDATE SKIP LOCKED
    ) l;
    IF empty IS NULL THEN
        RETURN;
    END IF;
    DELETE FROM _System_OutboxHead h
    WHERE h.RecordKey = ANY(empty)
      AND NOT EXISTS (
            SELECT 1 FROM _System_OutboxEvent e
            WHERE e.RecordKey = h.RecordKey AND e.Status NOT IN ('processed', 'failed'));
END;
$$;

CREATE OR REPLACE FUNCTION _System_OutboxHeadRemove(k text, i uuid) RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_material = off
SET jit = off
AS $$
DECLARE
    n record;
BEGIN
    PERFORM 1 FROM _System_OutboxHead h
    WHERE h.RecordKey = k
      AND (h.Id = i OR NOT EXISTS (
            SELECT 1 FROM _System_OutboxEvent e
            WHERE e.Id = h.Id AND e.RecordKey IS NOT DISTINCT FROM k AND e.Status NOT IN ('processed', 'failed')))
    FOR NO KEY UPDATE OF h SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT e.CreatedDate, e.Id INTO n
    FROM _System_OutboxEvent e
    WHERE e.RecordKey = k AND e.Status NOT IN ('processed', 'failed')
    ORDER BY e.CreatedDate, e.Id
    LIMIT 1;
    IF FOUND THEN
        UPDATE _System_OutboxHead SET CreatedDate = n.CreatedDate, Id = n.Id
        WHERE RecordKey = k AND (CreatedDate, Id) IS DISTINCT FROM (n.CreatedDate, n.Id);
        RETURN;
    END IF;
    -- As in _System_OutboxHeadRemove (migration 0009): the re-look needs READ COMMITTED.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN;
    END IF;
    PERFORM 1 FROM _System_OutboxHead WHERE RecordKey = k FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    PERFORM 1 FROM _System_OutboxEvent e
    WHERE e.RecordKey = k AND e.Status NOT IN ('processed', 'failed');
    IF NOT FOUND THEN
        DELETE FROM _System_OutboxHead WHERE RecordKey = k;
    END IF;
END;
$$;
