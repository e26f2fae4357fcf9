-- Issue 12: correct under an adopter's real conditions.
-- See docs/schema.md and docs/state-machine.md.

-- Serves the in-flight guard: "is another row of this key `processing`?" with one probe.
CREATE INDEX outbox_in_flight_idx ON _System_OutboxEvent (RecordKey)
    WHERE Status = 'processing';

-- Timestamps are compared as text, so every stored timestamp must have the one fixed-width
-- shape (YYYY-MM-DDTHH:MM:SS.ffffffZ). A row written by other code with another shape SQLite's
-- date functions read ('2026-11-30T00:00:00Z', '2026-11-30 00:00:00', '+01:00' offsets) or a bare
-- number (read as Unix seconds, not as the Julian day SQLite would assume) is rewritten to it (UTC, millisecond precision) as it is written; one whose
-- timestamp cannot be read at all is failed with a LastError that quotes it, so it never stalls
-- the queue. Writes of this code are already in shape and skip the rewrite (the WHEN clause).
CREATE TRIGGER outbox_timestamps_insert AFTER INSERT ON _System_OutboxEvent
WHEN (NEW.CreatedDate NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' OR NEW.LastModifiedDate NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' OR typeof(NEW.CreatedDate) <> 'text' OR typeof(NEW.LastModifiedDate) <> 'text')
BEGIN
    UPDATE _System_OutboxEvent
    SET CreatedDate = coalesce(CASE
        WHEN NEW.CreatedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.CreatedDate
        WHEN NEW.CreatedDate NOT GLOB '*[^0-9.]*' AND NEW.CreatedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate) || '000Z'
    END, strftime('%Y-%m-%dT%H:%M:%f', 'now') || '000Z'),
        LastModifiedDate = coalesce(CASE
        WHEN NEW.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.LastModifiedDate
        WHEN NEW.LastModifiedDate NOT GLOB '*[^0-9.]*' AND NEW.LastModifiedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate) || '000Z'
    END, strftime('%Y-%m-%dT%H:%M:%f', 'now') || '000Z'),
        Status = CASE
            WHEN (CASE
        WHEN NEW.CreatedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.CreatedDate
        WHEN NEW.CreatedDate NOT GLOB '*[^0-9.]*' AND NEW.CreatedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate) || '000Z'
    END) IS NULL OR (CASE
        WHEN NEW.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.LastModifiedDate
        WHEN NEW.LastModifiedDate NOT GLOB '*[^0-9.]*' AND NEW.LastModifiedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate) || '000Z'
    END) IS NULL THEN
                CASE WHEN Status IN ('processed', 'failed') THEN Status ELSE 'failed' END
            ELSE Status END,
        LastError = CASE
            WHEN ((CASE
        WHEN NEW.CreatedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.CreatedDate
        WHEN NEW.CreatedDate NOT GLOB '*[^0-9.]*' AND NEW.CreatedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate) || '000Z'
    END) IS NULL OR (CASE
        WHEN NEW.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.LastModifiedDate
        WHEN NEW.LastModifiedDate NOT GLOB '*[^0-9.]*' AND NEW.LastModifiedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate) || '000Z'
    END) IS NULL) AND Status NOT IN ('processed', 'failed')
                THEN 'unreadable timestamp written by other code: CreatedDate ' || quote(NEW.CreatedDate)
                     || ', LastModifiedDate ' || quote(NEW.LastModifiedDate)
            ELSE LastError END
    WHERE rowid = NEW.rowid;
END;

CREATE TRIGGER outbox_timestamps_update AFTER UPDATE OF CreatedDate, LastModifiedDate
ON _System_OutboxEvent
WHEN (NEW.CreatedDate NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' OR NEW.LastModifiedDate NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' OR typeof(NEW.CreatedDate) <> 'text' OR typeof(NEW.LastModifiedDate) <> 'text')
BEGIN
    UPDATE _System_OutboxEvent
    SET CreatedDate = coalesce(CASE
        WHEN NEW.CreatedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.CreatedDate
        WHEN NEW.CreatedDate NOT GLOB '*[^0-9.]*' AND NEW.CreatedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate) || '000Z'
    END, strftime('%Y-%m-%dT%H:%M:%f', 'now') || '000Z'),
        LastModifiedDate = coalesce(CASE
        WHEN NEW.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.LastModifiedDate
        WHEN NEW.LastModifiedDate NOT GLOB '*[^0-9.]*' AND NEW.LastModifiedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate) || '000Z'
    END, strftime('%Y-%m-%dT%H:%M:%f', 'now') || '000Z'),
        Status = CASE
            WHEN (CASE
        WHEN NEW.CreatedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.CreatedDate
        WHEN NEW.CreatedDate NOT GLOB '*[^0-9.]*' AND NEW.CreatedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate) || '000Z'
    END) IS NULL OR (CASE
        WHEN NEW.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.LastModifiedDate
        WHEN NEW.LastModifiedDate NOT GLOB '*[^0-9.]*' AND NEW.LastModifiedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate) || '000Z'
    END) IS NULL THEN
                CASE WHEN Status IN ('processed', 'failed') THEN Status ELSE 'failed' END
            ELSE Status END,
        LastError = CASE
            WHEN ((CASE
        WHEN NEW.CreatedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.CreatedDate
        WHEN NEW.CreatedDate NOT GLOB '*[^0-9.]*' AND NEW.CreatedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.CreatedDate) || '000Z'
    END) IS NULL OR (CASE
        WHEN NEW.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN NEW.LastModifiedDate
        WHEN NEW.LastModifiedDate NOT GLOB '*[^0-9.]*' AND NEW.LastModifiedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', NEW.LastModifiedDate) || '000Z'
    END) IS NULL) AND Status NOT IN ('processed', 'failed')
                THEN 'unreadable timestamp written by other code: CreatedDate ' || quote(NEW.CreatedDate)
                     || ', LastModifiedDate ' || quote(NEW.LastModifiedDate)
            ELSE LastError END
    WHERE rowid = NEW.rowid;
END;

-- Rows already written in another shape.
UPDATE _System_OutboxEvent
    SET CreatedDate = coalesce(CASE
        WHEN _System_OutboxEvent.CreatedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN _System_OutboxEvent.CreatedDate
        WHEN _System_OutboxEvent.CreatedDate NOT GLOB '*[^0-9.]*' AND _System_OutboxEvent.CreatedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.CreatedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.CreatedDate) || '000Z'
    END, strftime('%Y-%m-%dT%H:%M:%f', 'now') || '000Z'),
        LastModifiedDate = coalesce(CASE
        WHEN _System_OutboxEvent.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN _System_OutboxEvent.LastModifiedDate
        WHEN _System_OutboxEvent.LastModifiedDate NOT GLOB '*[^0-9.]*' AND _System_OutboxEvent.LastModifiedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.LastModifiedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.LastModifiedDate) || '000Z'
    END, strftime('%Y-%m-%dT%H:%M:%f', 'now') || '000Z'),
        Status = CASE
            WHEN (CASE
        WHEN _System_OutboxEvent.CreatedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN _System_OutboxEvent.CreatedDate
        WHEN _System_OutboxEvent.CreatedDate NOT GLOB '*[^0-9.]*' AND _System_OutboxEvent.CreatedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.CreatedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.CreatedDate) || '000Z'
    END) IS NULL OR (CASE
        WHEN _System_OutboxEvent.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN _System_OutboxEvent.LastModifiedDate
        WHEN _System_OutboxEvent.LastModifiedDate NOT GLOB '*[^0-9.]*' AND _System_OutboxEvent.LastModifiedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.LastModifiedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.LastModifiedDate) || '000Z'
    END) IS NULL THEN
                CASE WHEN Status IN ('processed', 'failed') THEN Status ELSE 'failed' END
            ELSE Status END,
        LastError = CASE
            WHEN ((CASE
        WHEN _System_OutboxEvent.CreatedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN _System_OutboxEvent.CreatedDate
        WHEN _System_OutboxEvent.CreatedDate NOT GLOB '*[^0-9.]*' AND _System_OutboxEvent.CreatedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.CreatedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.CreatedDate) || '000Z'
    END) IS NULL OR (CASE
        WHEN _System_OutboxEvent.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' THEN _System_OutboxEvent.LastModifiedDate
        WHEN _System_OutboxEvent.LastModifiedDate NOT GLOB '*[^0-9.]*' AND _System_OutboxEvent.LastModifiedDate GLOB '[0-9]*'
            THEN strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.LastModifiedDate, 'unixepoch') || '000Z'
        ELSE strftime('%Y-%m-%dT%H:%M:%f', _System_OutboxEvent.LastModifiedDate) || '000Z'
    END) IS NULL) AND Status NOT IN ('processed', 'failed')
                THEN 'unreadable timestamp written by other code: CreatedDate ' || quote(_System_OutboxEvent.CreatedDate)
                     || ', LastModifiedDate ' || quote(_System_OutboxEvent.LastModifiedDate)
            ELSE LastError END
WHERE (_System_OutboxEvent.CreatedDate NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' OR _System_OutboxEvent.LastModifiedDate NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]Z' OR typeof(_System_OutboxEvent.CreatedDate) <> 'text' OR typeof(_System_OutboxEvent.LastModifiedDate) <> 'text');

-- RecordKey folds the object name's case (object API names are case-insensitive identifiers,
-- as create-action treats them), so `Lead:1` and `lead:1` are one record. Enqueue derives
-- folded keys; a row written by other code with another case is folded as it is written.
CREATE TRIGGER outbox_fold_record_key_insert AFTER INSERT ON _System_OutboxEvent
WHEN NEW.RecordKey IS NOT NULL AND instr(NEW.RecordKey, ':') > 0
  AND substr(NEW.RecordKey, 1, instr(NEW.RecordKey, ':') - 1)
      <> lower(substr(NEW.RecordKey, 1, instr(NEW.RecordKey, ':') - 1))
BEGIN
    UPDATE _System_OutboxEvent
    SET RecordKey = lower(substr(NEW.RecordKey, 1, instr(NEW.RecordKey, ':') - 1))
        || substr(NEW.RecordKey, instr(NEW.RecordKey, ':'))
    WHERE rowid = NEW.rowid;
END;

CREATE TRIGGER outbox_fold_record_key_update AFTER UPDATE OF RecordKey ON _System_OutboxEvent
WHEN NEW.RecordKey IS NOT NULL AND instr(NEW.RecordKey, ':') > 0
  AND substr(NEW.RecordKey, 1, instr(NEW.RecordKey, ':') - 1)
      <> lower(substr(NEW.RecordKey, 1, instr(NEW.RecordKey, ':') - 1))
BEGIN
    UPDATE _System_OutboxEvent
    SET RecordKey = lower(substr(NEW.RecordKey, 1, instr(NEW.RecordKey, ':') - 1))
        || substr(NEW.RecordKey, instr(NEW.RecordKey, ':'))
    WHERE rowid = NEW.rowid;
END;

-- Rows already written: fold the keys of rows still to run.
UPDATE _System_OutboxEvent
SET RecordKey = lower(substr(RecordKey, 1, instr(RecordKey, ':') - 1)) || substr(RecordKey, instr(RecordKey, ':'))
WHERE RecordKey IS NOT NULL
  AND Status NOT IN ('processed', 'failed')
  AND instr(RecordKey, ':') > 0
  AND substr(RecordKey, 1, instr(RecordKey, ':') - 1) <> lower(substr(RecordKey, 1, instr(RecordKey, ':') - 1));
