-- Issue 37, "plans that hold": the statistics trap that migration 0022 closed for the claim, closed
-- for the rest of the attempt's path. `outbox_eligible_idx` (CreatedDate, Id),
-- `outbox_record_key_idx` (RecordKey, CreatedDate, Id) and `outbox_in_flight_idx` are partial
-- indexes on the open rows; statistics taken while no row was open (an ANALYZE of a table of
-- terminal rows: a quiet period over a large retained history) make every scan of them cost the
-- same, and these functions plan at each call on the statistics of the moment. Their probes of a
-- record's open rows were written `RecordKey = k … ORDER BY CreatedDate, Id`, an order
-- `outbox_eligible_idx` gives too (the key is constant), so the planner read them from it with
-- the record as a filter: every open row of the table from the oldest one, once per record.
-- Measured with auto_explain on a scratch table (300,000 terminal rows analyzed, then 20,000
-- open rows over 1,000 records, 256 heads in flight), calls for 32 claimed heads:
--   `_System_OutboxClaimChains`: 16,491 buffers (its chains' walk 7,992 rows removed by filter per
--     head; its UPDATE joined the picked ids to a walk of `outbox_eligible_idx`, 4,422,432 rows
--     removed by join filter) -> 5,265-5,611 (most of it the row trigger's head checks);
--   `_System_OutboxSettleMany` with chains: 850 + 9,337 buffers in `_System_OutboxHeadRemoveMany`
--     (984 rows removed per record to find its next head) -> 1,888-1,902 in all;
--   `_System_OutboxLostFences`: 541 -> 337-359 (grows with the open rows older than a chain's end).
--
-- The rewrite, as in 0022: a probe bounds the key by a range and is ordered by `RecordKey` first,
-- an order only the key's indexes give; under the functions' `enable_sort = off` no statistics
-- make `outbox_eligible_idx` the cheaper. A bound on the row's place must not become a filter
-- the B-tree walks the record with: PostgreSQL (15 here) ends a scan at a row comparison only
-- when its first column decides it, so `(CreatedDate, Id) < (c, i)` beside a range on the key,
-- or `(RecordKey, CreatedDate, Id) < (k, c, i)`, walks the whole record when no row matches (a
-- hot record's 20,000 pending rows: 302 index pages per settle in tests/it/stale_statistics.rs, against 16).
-- So the chains' walk starts at its head, `(RecordKey, CreatedDate, Id) > (k, c, i)`, and ends at
-- the key's range or its LIMIT; the begin check and the settle look for the record's first open
-- row that is not one of the call's (`Id <> ALL`, a walk of at most the call's rows) and compare
-- its place afterwards: the same answer as "an older open row not in the call" (the oldest such
-- row is older than the member exactly when any is).
-- Statements that reach rows by id compare `Status` under `COLLATE "C"` (the same test: equality
-- of text is byte equality under both collations), which no partial index's predicate is proven
-- from, so only the primary key serves them (migration 0014's device): the chains' UPDATE and the
-- heads' check that the head's row is still open. The rules are unchanged.
--
-- Replaced whole (CREATE OR REPLACE takes no lock on the outbox table; grants carry over; the SET
-- clauses are written out again, since CREATE OR REPLACE replaces them): `_System_OutboxClaimChains`
-- (0012), `_System_OutboxLostFences` (0014), `_System_OutboxSettleMany` (0019),
-- `_System_OutboxHeadRemoveMany` and `_System_OutboxHeadRemove` (0020; the latter keeps 0021's
-- `plan_cache_mode = auto`). Only the probes differ. Test: tests/it/stale_statistics.rs.

CREATE OR REPLACE FUNCTION _System_OutboxClaimChains(clock_shift interval, keys text[], created timestamptz[],
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
    WHERE (o.RecordKey, o.CreatedDate, o.Id) > (h.k, h.c, h.i) AND o.RecordKey <= h.k
      AND o.Status NOT IN ('processed', 'failed')
    ORDER BY o.RecordKey, o.CreatedDate, o.Id
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
WHERE t.Id = picked.Id AND t.Status = 'pending' COLLATE "C" AND t.RetryCount = 0
RETURNING t.Id, t.EventType, t.Payload, t.Status, t.RetryCount, t.RecordKey, t.CreatedDate,
          t.LastModifiedDate, t.LastError, 'pending'::text AS old_status;
END;
$fn$;
CREATE OR REPLACE FUNCTION _System_OutboxLostFences(event_ids uuid[], written timestamptz[])
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
  WHERE e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = f.written
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
    WHERE older.RecordKey >= n.k AND older.RecordKey <= n.k
      AND older.Status NOT IN ('processed', 'failed')
      AND older.Id <> ALL($1)
    ORDER BY older.RecordKey, older.CreatedDate, older.Id
    LIMIT 1
  ) o
  WHERE (o.CreatedDate, o.Id) < (n.c, n.i)
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
  CROSS JOIN LATERAL (
    SELECT older.CreatedDate AS c, older.Id AS i FROM _System_OutboxEvent older
    WHERE older.RecordKey >= fi.k AND older.RecordKey <= fi.k
      AND older.Status NOT IN ('processed', 'failed')
      AND older.Id <> ALL($2)
    ORDER BY older.RecordKey, older.CreatedDate, older.Id
    LIMIT 1
  ) o
  WHERE (o.c, o.i) < (fi.c, fi.i)
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
                  AND e.Status COLLATE "C" NOT IN ('processed', 'failed')))
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
            WHERE e.RecordKey >= k.k AND e.RecordKey <= k.k
              AND e.Status NOT IN ('processed', 'failed')
            ORDER BY e.RecordKey, e.CreatedDate, e.Id
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
      AND (SELECT 1 FROM _System_OutboxEvent e
           WHERE e.RecordKey >= h.RecordKey AND e.RecordKey <= h.RecordKey
             AND e.Status NOT IN ('processed', 'failed')
           ORDER BY e.RecordKey
           LIMIT 1) IS NULL;
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
SET plan_cache_mode = auto
AS $$
DECLARE
    n record;
BEGIN
    PERFORM 1 FROM _System_OutboxHead h
    WHERE h.RecordKey = k
      AND (h.Id = i OR NOT EXISTS (
            SELECT 1 FROM _System_OutboxEvent e
            WHERE e.Id = h.Id AND e.RecordKey IS NOT DISTINCT FROM k AND e.Status COLLATE "C" NOT IN ('processed', 'failed')))
    FOR NO KEY UPDATE OF h SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT e.CreatedDate, e.Id INTO n
    FROM _System_OutboxEvent e
    WHERE e.RecordKey >= k AND e.RecordKey <= k AND e.Status NOT IN ('processed', 'failed')
    ORDER BY e.RecordKey, e.CreatedDate, e.Id
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
    WHERE e.RecordKey >= k AND e.RecordKey <= k AND e.Status NOT IN ('processed', 'failed')
    ORDER BY e.RecordKey
    LIMIT 1;
    IF NOT FOUND THEN
        DELETE FROM _System_OutboxHead WHERE RecordKey = k;
    END IF;
END;
$$;