-- Issue 16: claim cost independent of the backlog's shape. See docs/queries.md and
-- docs/schema.md.
--
-- _System_OutboxHead is DERIVED state: for every RecordKey with a non-terminal row, the oldest
-- one (CreatedDate, then Id), i.e. the only row of that key the design's rule can ever make
-- eligible. It is no lane, lease or owner token: it says nothing about who works on what, the
-- claim still applies the design's whole rule (state, the NOT EXISTS key-order probe, the
-- in-flight guard) to the outbox row itself, and the table can be rebuilt from the outbox rows at
-- any time (Database::rebuild_heads; Database::check_heads lists the keys where it differs).
-- It is maintained by the triggers below in the same transactions as the rows, so rows written
-- by other code are covered too.
CREATE TABLE _System_OutboxHead (
    RecordKey   TEXT        PRIMARY KEY,
    CreatedDate TIMESTAMPTZ NOT NULL,
    Id          UUID        NOT NULL
) WITH (fillfactor = 70);

-- The claim walks the heads oldest first.
CREATE INDEX outbox_head_order_idx ON _System_OutboxHead (CreatedDate, Id);

-- Unkeyed non-terminal rows in the design's order: the claim's other candidate stream (a
-- partial index, so only rows without RecordKey pay for it).
CREATE INDEX outbox_unkeyed_idx ON _System_OutboxEvent (CreatedDate, Id)
    WHERE RecordKey IS NULL AND Status NOT IN ('processed', 'failed');

-- Locking (why enqueue never waits for a worker, and a worker waits for an enqueue only when
-- its key drains): a transaction that adds rows to key k holds k's head row FOR KEY SHARE to
-- its end (or has inserted it), which does not conflict with a worker moving the head on (FOR NO
-- KEY UPDATE, an UPDATE of non-key columns). Only deleting the head (the key drained as far as
-- the worker can see) conflicts: the worker then waits for those transactions, and looks again.

-- Non-terminal rows joined their keys: (ks[n], cs[n], ids[n]) is the oldest new row of key
-- ks[n], one entry per key. Each key gets a head row (inserted, or the existing one locked FOR KEY SHARE so
-- that it cannot be deleted before this transaction commits), and the head becomes the older of
-- the two. Retries when a worker deleted a head between the insert and the lock.
CREATE FUNCTION _System_OutboxHeadAdd(ks text[], cs timestamptz[], ids uuid[]) RETURNS void
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
    WHERE h.RecordKey = a.k AND (a.c, a.i) < (h.CreatedDate, h.Id);
END;
$$;

-- Row i of key k left the key's non-terminal rows (it ended, was deleted, or changed key or
-- place). When it was the head, the head moves to the key's next non-terminal row, or the key
-- leaves the table. Each statement of this VOLATILE function reads a fresh snapshot (READ
-- COMMITTED). The next row is share-locked and read again, so a row that another transaction is
-- ending at this moment is waited for and passed over. Before deleting, the head row is locked
-- FOR UPDATE, which waits for the transactions that added rows to k and are still open; the
-- key is then looked at again.
CREATE FUNCTION _System_OutboxHeadRemove(k text, i uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    n record;
BEGIN
    PERFORM 1 FROM _System_OutboxHead WHERE RecordKey = k AND Id = i FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    LOOP
        SELECT e.CreatedDate, e.Id INTO n
        FROM _System_OutboxEvent e
        WHERE e.RecordKey = k AND e.Status NOT IN ('processed', 'failed')
        ORDER BY e.CreatedDate, e.Id
        LIMIT 1;
        IF FOUND THEN
            UPDATE _System_OutboxHead SET CreatedDate = n.CreatedDate, Id = n.Id
            WHERE RecordKey = k;
            PERFORM 1 FROM _System_OutboxEvent e
            WHERE e.Id = n.Id AND e.RecordKey = k AND e.Status NOT IN ('processed', 'failed')
            FOR SHARE;
            IF FOUND THEN
                RETURN;
            END IF;
        ELSE
            PERFORM 1 FROM _System_OutboxHead WHERE RecordKey = k FOR UPDATE;
            IF NOT FOUND THEN
                RETURN;
            END IF;
            PERFORM 1 FROM _System_OutboxEvent e
            WHERE e.RecordKey = k AND e.Status NOT IN ('processed', 'failed');
            IF NOT FOUND THEN
                DELETE FROM _System_OutboxHead WHERE RecordKey = k;
                RETURN;
            END IF;
        END IF;
    END LOOP;
END;
$$;

-- Insert: once per statement, over the statement's new rows (a bulk enqueue pays one call).
CREATE FUNCTION outbox_head_on_insert() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ks text[];
    cs timestamptz[];
    ids uuid[];
BEGIN
    SELECT array_agg(a.RecordKey), array_agg(a.CreatedDate), array_agg(a.Id) INTO ks, cs, ids
    FROM (
        SELECT DISTINCT ON (n.RecordKey) n.RecordKey, n.CreatedDate, n.Id
        FROM new_rows n
        WHERE n.RecordKey IS NOT NULL AND n.Status NOT IN ('processed', 'failed')
        ORDER BY n.RecordKey, n.CreatedDate, n.Id
    ) a;
    IF ks IS NOT NULL THEN
        PERFORM _System_OutboxHeadAdd(ks, cs, ids);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_head_insert
    AFTER INSERT ON _System_OutboxEvent
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION outbox_head_on_insert();

-- Update: only when a row enters or leaves its key's non-terminal rows, or its key or place
-- changes (the WHEN clause keeps claims and heartbeats, which change none of these, off it).
CREATE FUNCTION outbox_head_on_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.RecordKey IS NOT NULL AND OLD.Status NOT IN ('processed', 'failed') THEN
        PERFORM _System_OutboxHeadRemove(OLD.RecordKey, OLD.Id);
    END IF;
    IF NEW.RecordKey IS NOT NULL AND NEW.Status NOT IN ('processed', 'failed') THEN
        PERFORM _System_OutboxHeadAdd(ARRAY[NEW.RecordKey], ARRAY[NEW.CreatedDate], ARRAY[NEW.Id]);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_head_update
    AFTER UPDATE ON _System_OutboxEvent
    FOR EACH ROW
    WHEN ((OLD.Status IN ('processed', 'failed')) IS DISTINCT FROM (NEW.Status IN ('processed', 'failed'))
          OR OLD.RecordKey IS DISTINCT FROM NEW.RecordKey
          OR OLD.CreatedDate IS DISTINCT FROM NEW.CreatedDate
          OR OLD.Id IS DISTINCT FROM NEW.Id)
    EXECUTE FUNCTION outbox_head_on_update();

CREATE FUNCTION outbox_head_on_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM _System_OutboxHeadRemove(OLD.RecordKey, OLD.Id);
    RETURN NULL;
END;
$$;

-- Pruning deletes terminal rows only: the WHEN clause keeps it off them.
CREATE TRIGGER outbox_head_delete
    AFTER DELETE ON _System_OutboxEvent
    FOR EACH ROW
    WHEN (OLD.RecordKey IS NOT NULL AND OLD.Status NOT IN ('processed', 'failed'))
    EXECUTE FUNCTION outbox_head_on_delete();

CREATE FUNCTION outbox_head_on_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE _System_OutboxHead;
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_head_truncate
    AFTER TRUNCATE ON _System_OutboxEvent
    FOR EACH STATEMENT
    EXECUTE FUNCTION outbox_head_on_truncate();

-- The heads of the rows already there (the same statement as Database::rebuild_heads).
INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
SELECT DISTINCT ON (RecordKey) RecordKey, CreatedDate, Id
FROM _System_OutboxEvent
WHERE RecordKey IS NOT NULL AND Status NOT IN ('processed', 'failed')
ORDER BY RecordKey, CreatedDate, Id;
