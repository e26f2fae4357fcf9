-- Issue 16: claim cost independent of the backlog's shape. See docs/queries.md and
-- docs/schema.md.
--
-- _System_OutboxHead is DERIVED state: for every RecordKey with a non-terminal row, the oldest
-- one (CreatedDate, then Id), the only row of that key the design's rule can make eligible. No
-- lane, lease or owner token: the claim applies the design's whole rule to the outbox row
-- itself, and the table can be rebuilt from the rows at any time (Database::rebuild_heads;
-- Database::check_heads lists the keys where it differs). The triggers below keep it in the same
-- transactions as the rows (SQLite has one writer, so no ordering between writers to think of).
CREATE TABLE _System_OutboxHead (
    RecordKey   TEXT PRIMARY KEY,
    CreatedDate TEXT NOT NULL,
    Id          TEXT NOT NULL
);

-- The claim walks the heads oldest first.
CREATE INDEX outbox_head_order_idx ON _System_OutboxHead (CreatedDate, Id);

-- Unkeyed non-terminal rows in the design's order: the claim's other candidate stream.
CREATE INDEX outbox_unkeyed_idx ON _System_OutboxEvent (CreatedDate, Id)
    WHERE RecordKey IS NULL AND Status NOT IN ('processed', 'failed');

-- A new non-terminal keyed row: the head becomes the older of the two.
CREATE TRIGGER outbox_head_insert AFTER INSERT ON _System_OutboxEvent
WHEN NEW.RecordKey IS NOT NULL AND NEW.Status NOT IN ('processed', 'failed')
BEGIN
    INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
    VALUES (NEW.RecordKey, NEW.CreatedDate, NEW.Id)
    ON CONFLICT (RecordKey) DO UPDATE SET CreatedDate = excluded.CreatedDate, Id = excluded.Id
    WHERE excluded.CreatedDate < _System_OutboxHead.CreatedDate
       OR (excluded.CreatedDate = _System_OutboxHead.CreatedDate AND excluded.Id < _System_OutboxHead.Id);
END;

-- A row entered or left its key's non-terminal rows, or its key or place changed (claims and
-- heartbeats change none of these): both keys' heads are looked up again.
CREATE TRIGGER outbox_head_update AFTER UPDATE ON _System_OutboxEvent
WHEN (OLD.Status IN ('processed', 'failed')) IS NOT (NEW.Status IN ('processed', 'failed'))
  OR OLD.RecordKey IS NOT NEW.RecordKey
  OR OLD.CreatedDate IS NOT NEW.CreatedDate
  OR OLD.Id IS NOT NEW.Id
BEGIN
    DELETE FROM _System_OutboxHead WHERE RecordKey IN (OLD.RecordKey, NEW.RecordKey);
    INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
    SELECT e.RecordKey, e.CreatedDate, e.Id FROM _System_OutboxEvent e
    WHERE e.RecordKey = OLD.RecordKey AND e.Status NOT IN ('processed', 'failed')
    ORDER BY e.CreatedDate, e.Id LIMIT 1;
    INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
    SELECT e.RecordKey, e.CreatedDate, e.Id FROM _System_OutboxEvent e
    WHERE e.RecordKey = NEW.RecordKey AND NEW.RecordKey IS NOT OLD.RecordKey
      AND e.Status NOT IN ('processed', 'failed')
    ORDER BY e.CreatedDate, e.Id LIMIT 1;
END;

-- Pruning deletes terminal rows only: the WHEN clause keeps it off them.
CREATE TRIGGER outbox_head_delete AFTER DELETE ON _System_OutboxEvent
WHEN OLD.RecordKey IS NOT NULL AND OLD.Status NOT IN ('processed', 'failed')
BEGIN
    DELETE FROM _System_OutboxHead WHERE RecordKey = OLD.RecordKey;
    INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
    SELECT e.RecordKey, e.CreatedDate, e.Id FROM _System_OutboxEvent e
    WHERE e.RecordKey = OLD.RecordKey AND e.Status NOT IN ('processed', 'failed')
    ORDER BY e.CreatedDate, e.Id LIMIT 1;
END;

-- The heads of the rows already there (the same statement as Database::rebuild_heads).
INSERT INTO _System_OutboxHead (RecordKey, CreatedDate, Id)
SELECT e.RecordKey, e.CreatedDate, e.Id FROM _System_OutboxEvent e
WHERE e.RecordKey IS NOT NULL AND e.Status NOT IN ('processed', 'failed')
  AND NOT EXISTS (
    SELECT 1 FROM _System_OutboxEvent o
    WHERE o.RecordKey = e.RecordKey AND o.Status NOT IN ('processed', 'failed')
      AND (o.CreatedDate, o.Id) < (e.CreatedDate, e.Id));
