-- Issue 37: a record's head moves once per statement that ends a chain of its rows, not once per
-- row. See docs/queries.md ("Why a head cannot hide a row") and docs/benchmarks.md.
--
-- Before: every row that left its key's non-terminal rows called _System_OutboxHeadRemove,
-- which locked the key's head (FOR NO KEY UPDATE: a write to the head's tuple), probed the key's
-- oldest non-terminal row and moved the head there. A batch that writes `processed` for a chain
-- of 20 rows of one record in one statement paid 20 head locks and 20 probes of the record's
-- rows (each walking the chain's dead index entries); only the first wrote a head version.
--
-- Now a removal looks at the head only when the head names the removed row, or a row that is
-- no longer open (ended or gone: a head left behind by a removal that found it held, which
-- this one puts right). Every other head names an open row of the key, at worst out of place,
-- and the removal cannot have made it wrong. The row-level triggers of one statement fire after
-- the statement, and each sees all of its changes: the first removal of a chain that finds the
-- head on an ended row moves it past the whole chain (or deletes it), and every other removal
-- of the chain then finds it on an open row and stops, without a lock or a probe of the key's
-- rows. What the heads table promises is unchanged (migration 0009): PRESENCE exact (a head is
-- deleted under the same rule as before, and only a head naming no open row can be left over,
-- for the next removal or the repair), POSITION best effort (a head moved ahead of an older
-- open row by a race stays there until the row it names ends, or the repair runs, where before
-- any completion of the key put it right;
-- the claim reads each key's oldest open row itself, so a position only orders the claim's
-- walk).

CREATE OR REPLACE FUNCTION _System_OutboxHeadRemove(k text, i uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    n record;
BEGIN
    PERFORM 1 FROM _System_OutboxHead h
    WHERE h.RecordKey = k
      AND (h.Id = i OR NOT EXISTS (
            SELECT 1 FROM _System_OutboxEvent e
            WHERE e.Id = h.Id AND e.RecordKey = k AND e.Status NOT IN ('processed', 'failed')))
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
