-- Issue 28: the heads table can never wedge a record. See docs/queries.md ("Why a head cannot
-- hide a row") and docs/state-machine.md ("Operator retries and the backfill beside claims").
--
-- Before: the claim joined each head to its outbox row by Id and trusted it. A row that became
-- open in a transaction committing after a worker had moved the key's head past it (a foreign
-- INSERT with an older CreatedDate, the RecordKey backfill, a hand-written UPDATE back to
-- pending) was never a head, so the head never passed the key-order rule and the key was never
-- offered again. And keeping the head exact made completions wait for open enqueues (the
-- FOR UPDATE before deleting a head), which also stalled a shared claim that ended a stale row
-- failed behind an open enqueue.
--
-- Now the heads table promises only what can be kept without waiting for anybody:
--
-- * PRESENCE, exact: every key with a committed non-terminal row has a head row. An adder
--   inserts the head or locks it FOR KEY SHARE to its commit (as before); a head row is deleted
--   only under a FOR UPDATE lock taken with SKIP LOCKED (so never while an adder holds its
--   KEY SHARE, and never by waiting for one), after a look at the key's rows in a snapshot
--   taken after that lock. An adder that reaches its lock after such a delete finds no row and
--   inserts the head again (the loop in _System_OutboxHeadAdd).
-- * POSITION, best effort: the head's (CreatedDate, Id) is the key's oldest non-terminal row
--   when nothing raced, and only orders the keys in the claim's walk. The claim no longer joins
--   a head to a row: for each head it reads the key's oldest non-terminal row itself (one
--   descent of outbox_record_key_idx, the probe the key-order rule made before) and applies the
--   design's rule to that row. A head out of place changes which key is looked at first, never
--   which row of a key may run. Positions are put right by the key's next completion, by an
--   adder of an older row, and by _System_OutboxHeadRepair, which the dispatchers run
--   periodically (counted in outbox_heads_repaired_total and logged).
--
-- No trigger function waits for a lock on a head row: a head that another transaction is
-- moving, deleting or holding is left as it is (its position is repaired later). So a
-- worker's processed or failed write, and a claim that ends an exhausted stale row failed,
-- never wait for an application's open transaction.
--
-- Claims also take the claim-exclusion lock (advisory namespace 3479, shared) in a statement
-- of their own before the claim statement, whose snapshot is therefore taken after it: an
-- operator retry and the RecordKey backfill take it exclusively, so no claim straddles their
-- commit (a claim that read a retried row as still failed can no longer lock a younger row of
-- its key after the retry committed). This replaces the retry's two-second not-before, which
-- assumed claims never wait.

-- An adder (a row entered its key's non-terminal rows): presence as before; the head is moved
-- back to an older new row only where no other transaction holds it (SKIP LOCKED), so an
-- enqueue never waits for a worker moving the head, nor a worker for the enqueue.
CREATE OR REPLACE FUNCTION _System_OutboxHeadAdd(ks text[], cs timestamptz[], ids uuid[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    locked bigint;
BEGIN
    LOOP
        INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
        SELECT a.k, a.c, a.i FROM unnest(ks, cs, ids) AS a(k, c, i) ORDER BY a.k
        ON CONFLICT (RecordKey) DO NOTHING;
        PERFORM 1 FROM _System_OutboxHead h
        WHERE h.RecordKey = ANY(ks)
        ORDER BY h.RecordKey
        FOR KEY SHARE;
        GET DIAGNOSTICS locked = ROW_COUNT;
        EXIT WHEN locked >= cardinality(ks);
    END LOOP;
    UPDATE _System_OutboxHead h SET CreatedDate = a.c, Id = a.i
    FROM unnest(ks, cs, ids) AS a(k, c, i)
    WHERE h.RecordKey = a.k AND (a.c, a.i) < (h.CreatedDate, h.Id)
      AND h.RecordKey IN (
        SELECT x.RecordKey
        FROM _System_OutboxHead x
        JOIN unnest(ks, cs, ids) AS b(k, c, i) ON x.RecordKey = b.k
        WHERE (b.c, b.i) < (x.CreatedDate, x.Id)
        FOR NO KEY UPDATE OF x SKIP LOCKED);
END;
$$;

-- Row i of key k left the key's non-terminal rows (it ended, was deleted, or changed key or
-- place). Each statement reads a fresh snapshot (VOLATILE, READ COMMITTED). The head moves to
-- the key's oldest non-terminal row; when the key has none, the head is deleted if no adder
-- holds it (FOR UPDATE SKIP LOCKED) and the key still has none in a snapshot taken after that
-- lock. Nothing here waits: a head row held by another transaction is left for it, or for the
-- repair.
CREATE OR REPLACE FUNCTION _System_OutboxHeadRemove(k text, i uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    n record;
BEGIN
    PERFORM 1 FROM _System_OutboxHead WHERE RecordKey = k FOR NO KEY UPDATE SKIP LOCKED;
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
    -- The re-look below must see rows committed after the lock: only READ COMMITTED gives a
    -- statement a new snapshot. A transaction at a stricter level leaves the head (left over
    -- at worst, which the repair deletes).
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

-- The periodic repair: every key (at most max_keys) whose head differs from its oldest
-- non-terminal row is looked at again with locks that never wait, and put right: a head out of
-- place is moved ('misplaced'), a head whose key has no non-terminal row is deleted under the
-- same rule as a completion ('left over'), and a key with non-terminal rows and no head (rows
-- written with the triggers disabled: session_replication_role = replica, a restore, a
-- disabled trigger) gets one ('missing'). Returns what it changed. Only one caller repairs at
-- a time (advisory namespace 3480, tried, never waited for); a key another transaction holds
-- is left for the next run. Reads every non-terminal keyed row once (like check_heads).
CREATE FUNCTION _System_OutboxHeadRepair(max_keys integer)
RETURNS TABLE (RecordKey text, repair text)
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
DECLARE
    d record;
    n record;
    caller_lock_timeout text := current_setting('lock_timeout');
BEGIN
    -- Its re-looks need a fresh snapshot per statement (see _System_OutboxHeadRemove).
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION '_System_OutboxHeadRepair must run at READ COMMITTED, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    IF NOT pg_try_advisory_xact_lock(3480, 0) THEN
        RETURN;
    END IF;
    FOR d IN
        WITH truth AS (
          SELECT DISTINCT ON (t.RecordKey) t.RecordKey AS k, t.CreatedDate AS c, t.Id AS i
          FROM _System_OutboxEvent t
          WHERE t.RecordKey IS NOT NULL AND t.Status NOT IN ('processed', 'failed')
          ORDER BY t.RecordKey, t.CreatedDate, t.Id
        )
        SELECT coalesce(truth.k, h.RecordKey) AS k
        FROM truth FULL JOIN _System_OutboxHead h ON h.RecordKey = truth.k
        WHERE truth.i IS DISTINCT FROM h.Id OR truth.c IS DISTINCT FROM h.CreatedDate
        ORDER BY 1
        LIMIT max_keys
    LOOP
        SELECT e.CreatedDate, e.Id INTO n
        FROM _System_OutboxEvent e
        WHERE e.RecordKey = d.k AND e.Status NOT IN ('processed', 'failed')
        ORDER BY e.CreatedDate, e.Id
        LIMIT 1;
        PERFORM 1 FROM _System_OutboxHead x WHERE x.RecordKey = d.k FOR NO KEY UPDATE SKIP LOCKED;
        IF FOUND THEN
            -- Looked at again after the lock: a completion may have moved it meanwhile.
            SELECT e.CreatedDate, e.Id INTO n
            FROM _System_OutboxEvent e
            WHERE e.RecordKey = d.k AND e.Status NOT IN ('processed', 'failed')
            ORDER BY e.CreatedDate, e.Id
            LIMIT 1;
            IF FOUND THEN
                UPDATE _System_OutboxHead x SET CreatedDate = n.CreatedDate, Id = n.Id
                WHERE x.RecordKey = d.k
                  AND (x.CreatedDate, x.Id) IS DISTINCT FROM (n.CreatedDate, n.Id);
                IF FOUND THEN
                    RecordKey := d.k;
                    repair := 'misplaced';
                    RETURN NEXT;
                END IF;
            ELSE
                PERFORM 1 FROM _System_OutboxHead x WHERE x.RecordKey = d.k FOR UPDATE SKIP LOCKED;
                IF FOUND AND NOT EXISTS (
                    SELECT 1 FROM _System_OutboxEvent e
                    WHERE e.RecordKey = d.k AND e.Status NOT IN ('processed', 'failed')
                ) THEN
                    DELETE FROM _System_OutboxHead x WHERE x.RecordKey = d.k;
                    RecordKey := d.k;
                    repair := 'left over';
                    RETURN NEXT;
                END IF;
            END IF;
        ELSIF n.Id IS NOT NULL
              AND NOT EXISTS (SELECT 1 FROM _System_OutboxHead x WHERE x.RecordKey = d.k) THEN
            BEGIN
                -- Waits at most 100 ms for an uncommitted head row of this key (an adder
                -- that inserted it is still open, and will commit it).
                PERFORM set_config('lock_timeout', '100ms', true);
                INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
                VALUES (d.k, n.CreatedDate, n.Id)
                ON CONFLICT ON CONSTRAINT _system_outboxhead_pkey DO NOTHING;
                IF FOUND THEN
                    RecordKey := d.k;
                    repair := 'missing';
                    RETURN NEXT;
                END IF;
                -- (A lock timeout rolls this block back, the setting with it.)
                PERFORM set_config('lock_timeout', caller_lock_timeout, true);
            EXCEPTION WHEN lock_not_available THEN
                NULL;
            END;
        END IF;
    END LOOP;
END;
$$;

-- The claim functions of migrations 0006 and 0008, replaced with the claim that reads each
-- key's oldest non-terminal row itself (CLAIM_NEXT_ALL, CLAIM_NEXT, CLAIM_BATCH_ALL and
-- CLAIM_BATCH of crates/outbox-persistence/src/postgres/sql.rs, verbatim; a unit test there
-- holds them to this text). Same signatures and results, so binaries of the previous releases
-- calling them get the repaired claim too.
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
    SELECT o.Id
    FROM _System_OutboxEvent o
    WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
    ORDER BY o.CreatedDate, o.Id
    LIMIT 1
  ) first
  JOIN _System_OutboxEvent e ON e.Id = first.Id
  WHERE e.RecordKey = h.RecordKey AND
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
    SELECT o.Id
    FROM _System_OutboxEvent o
    WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
    ORDER BY o.CreatedDate, o.Id
    LIMIT 1
  ) first
  JOIN _System_OutboxEvent e ON e.Id = first.Id
  WHERE e.RecordKey = h.RecordKey AND
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
    SELECT o.Id
    FROM _System_OutboxEvent o
    WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
    ORDER BY o.CreatedDate, o.Id
    LIMIT 1
  ) first
  JOIN _System_OutboxEvent e ON e.Id = first.Id
  WHERE e.RecordKey = h.RecordKey AND
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
    SELECT o.Id
    FROM _System_OutboxEvent o
    WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
    ORDER BY o.CreatedDate, o.Id
    LIMIT 1
  ) first
  JOIN _System_OutboxEvent e ON e.Id = first.Id
  WHERE e.RecordKey = h.RecordKey AND
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
