-- Issues 36 and 37: the batch settle moves its records' heads once per statement, set-based,
-- instead of once per ended row through the row trigger. See docs/queries.md ("Why a head
-- cannot hide a row") and docs/benchmarks.md.
--
-- Measured before (pg_stat_statements and pg_stat_user_functions, the keyed no-op drain at 8
-- workers, 20,000 events over 1,000 records): _System_OutboxHeadRemove ran 20,000 times, about
-- 44 us each (a plpgsql call from a plpgsql trigger per ended row, a lock probe of the head, a
-- probe of the key's rows and a head UPDATE), a quarter of the server time of the whole drain;
-- on 1,000 ended rows in one statement the row trigger cost 29 us per row against the UPDATE's
-- own 9 us. A batch's settle ends up to 32 rows of up to 32 records in one statement.
--
-- Now _System_OutboxSettleMany sets `outbox.heads_by_statement` to its transaction's id around
-- its UPDATE (`set_config(…, true)`, at run time: a role without superuser rights may not store
-- a custom setting in a function's SET clause, and any role may set one at run time) and clears
-- it after. An error in between aborts the transaction, or the subtransaction of the savepoint
-- the caller rolls back to, and either takes the setting back with it. The row trigger's
-- function returns at once for the rows that UPDATE changes (the setting names the current
-- transaction: a value set by hand in a session, or left over from another transaction, names
-- none; the settle only ends rows, it never changes a key or a place, nor makes a row open),
-- and the settle then calls _System_OutboxHeadRemoveMany once for the keyed rows it ended. The
-- setting is the outbox's own: nothing else should set it. _System_OutboxHeadRemoveMany is
-- _System_OutboxHeadRemove (migration 0011) for many keys at once, statement by statement:
--
-- 1. Lock, SKIP LOCKED, the head of every key whose head names an ended row of the call or a
--    row no longer open (one lock per key, as the row triggers' first removal of a chain took;
--    the chain's other removals then found the head on an open row and stopped).
-- 2. In a statement of its own (a fresh snapshot, as the single function's probe), move each
--    locked head to its key's oldest open row, and collect the locked keys that have none.
-- 3. At READ COMMITTED only, lock those heads FOR UPDATE, SKIP LOCKED, and in a statement of
--    its own delete the ones whose key still has no open row.
--
-- No step waits for a lock (SKIP LOCKED throughout, on rows this transaction locks in any
-- order), so no deadlock is added. What the heads table promises is unchanged: PRESENCE exact,
-- POSITION best effort (migrations 0009 and 0011). Every other writer (the single settle, the
-- claim's give-backs, an operator, a foreign writer, retention) still goes through the row
-- trigger.

-- Second: every statement that finds a claimed row by its id and fence (the beats, the fence
-- checks, the settles, the releases) compares `Status` under the "C" collation. The column's
-- own collation is the database default, so the clause no longer implies the predicate of the
-- partial index on in-flight rows (outbox_in_flight_idx, `WHERE Status = 'processing'`), and
-- the planner can only reach the row through the primary key. Before, a plan made while the
-- statistics counted few or no rows in `processing` (an outbox analysed while idle, or before
-- its first claims) walked that whole index and filtered by id: one beat or fence check of one
-- row read every in-flight row (1,000 of them at 32 workers with batches of 32), a settle of
-- 32 rows 32 times that. For ASCII values the "C" comparison is the same test.

CREATE FUNCTION _System_OutboxHeadRemoveMany(ks text[], ids uuid[]) RETURNS void
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
                WHERE e.Id = h.Id AND e.RecordKey = h.RecordKey
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

-- The row trigger's function, as migration 0004 made it, but a no-op for the rows the batch
-- settle changes (the setting names this transaction). The trigger itself is left as it is:
-- replacing a trigger takes an ACCESS EXCLUSIVE lock on the outbox table, which would wait for
-- every running attempt (each holds the table from its fence check on) while every enqueue,
-- beat and claim queued behind it; replacing its function takes no lock on the table.
CREATE OR REPLACE FUNCTION outbox_head_on_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox.heads_by_statement', true) = txid_current()::text THEN
        RETURN NULL;
    END IF;
    IF OLD.RecordKey IS NOT NULL AND OLD.Status NOT IN ('processed', 'failed') THEN
        PERFORM _System_OutboxHeadRemove(OLD.RecordKey, OLD.Id);
    END IF;
    IF NEW.RecordKey IS NOT NULL AND NEW.Status NOT IN ('processed', 'failed') THEN
        PERFORM _System_OutboxHeadAdd(ARRAY[NEW.RecordKey], ARRAY[NEW.CreatedDate], ARRAY[NEW.Id]);
    END IF;
    RETURN NULL;
END;
$$;

-- The batch settle (migration 0012), with its heads moved once per call.
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
RETURNING e.Id, e.RecordKey
)
SELECT array_agg(x.Id), array_agg(x.RecordKey) FILTER (WHERE x.RecordKey IS NOT NULL),
       array_agg(x.Id) FILTER (WHERE x.RecordKey IS NOT NULL)
INTO done, ks, kids
FROM ended x;
ELSE
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
RETURNING e.Id, e.RecordKey
)
SELECT array_agg(x.Id), array_agg(x.RecordKey) FILTER (WHERE x.RecordKey IS NOT NULL),
       array_agg(x.Id) FILTER (WHERE x.RecordKey IS NOT NULL)
INTO done, ks, kids
FROM ended x;
END IF;
PERFORM set_config('outbox.heads_by_statement', '', true);
IF ks IS NOT NULL THEN
    PERFORM _System_OutboxHeadRemoveMany(ks, kids);
END IF;
RETURN QUERY SELECT u FROM unnest(done) AS u;
END;
$fn$;

-- The fenced statements of migration 0012, their id lookups pinned to the primary key.

CREATE OR REPLACE FUNCTION _System_OutboxBeat(clock_shift interval, event_id uuid, written timestamptz,
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
WHERE e.Id = $2 AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = $3
RETURNING e.LastModifiedDate, e.xmin::text::bigint;
END;
$fn$;

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
          WHERE e.Id = f.id AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = f.written)
FROM f LEFT JOIN moved m ON m.Id = f.id;
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

CREATE OR REPLACE FUNCTION _System_OutboxSettle(clock_shift interval, event_id uuid, written timestamptz,
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
    WHERE e.Id = $2 AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = $3;
ELSIF $7 = 'failed' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'failed',
        RetryCount = e.RetryCount + 1,
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond'),
        LastError = $4
    WHERE e.Id = $2 AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = $3;
ELSIF $7 = 'retry' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'pending',
        RetryCount = e.RetryCount + 1,
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval) + $5::interval, e.LastModifiedDate + interval '1 microsecond'),
        LastError = $4
    WHERE e.Id = $2 AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = $3;
ELSIF $7 = 'release' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'pending',
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond'),
        LastError = CASE WHEN e.LastError LIKE 'worker died:%' THEN e.LastError ELSE $4 END
    WHERE e.Id = $2 AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = $3;
ELSE
    RAISE EXCEPTION 'unknown outbox outcome %', $7 USING ERRCODE = '22023';
END IF;
GET DIAGNOSTICS settled = ROW_COUNT;
RETURN settled;
END;
$fn$;

CREATE OR REPLACE FUNCTION _System_OutboxReleaseMany(clock_shift interval, event_ids uuid[],
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
WHERE e.Id = f.id AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = f.written
RETURNING e.Id;
END;
$fn$;

CREATE OR REPLACE FUNCTION _System_OutboxCheckFence(p_id uuid, p_written timestamptz) RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_material = off
SET jit = off
AS $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM _System_OutboxEvent
        WHERE Id = p_id AND Status = 'processing' COLLATE "C" AND LastModifiedDate = p_written
    ) THEN
        RAISE EXCEPTION 'outbox claim % was lost before its attempt began', p_id
            USING ERRCODE = 'OB001';
    END IF;
END;
$$;
