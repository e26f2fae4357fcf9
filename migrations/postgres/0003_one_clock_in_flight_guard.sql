-- Issue 12: correct under an adopter's real conditions.
-- See docs/schema.md and docs/state-machine.md.

-- Serves the in-flight guard: "is another row of this key `processing`?" with one probe. Only
-- claimed rows are in it (at most one per worker), and no heartbeat changes an indexed column,
-- so heartbeats stay HOT.
CREATE INDEX outbox_in_flight_idx ON _System_OutboxEvent (RecordKey)
    WHERE Status = 'processing';

-- The fence check at the start of an attempt: raises OB001 when the row no longer carries the
-- LastModifiedDate the worker wrote last (its claim was taken over before the attempt began),
-- so the handler never starts on a lost claim. Called inside the attempt's BEGIN round trip.
CREATE FUNCTION _System_OutboxCheckFence(p_id uuid, p_written timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM _System_OutboxEvent
        WHERE Id = p_id AND Status = 'processing' AND LastModifiedDate = p_written
    ) THEN
        RAISE EXCEPTION 'outbox claim % was lost before its attempt began', p_id
            USING ERRCODE = 'OB001';
    END IF;
END;
$$;

-- RecordKey folds the object name's case (object API names are case-insensitive identifiers,
-- as create-action treats them), so `Lead:1` and `lead:1` are one record. Enqueue derives
-- folded keys; a row written by other code with another case is folded as it is written (the
-- WHEN clause keeps the function off folded keys, so enqueue pays one comparison per row).
CREATE FUNCTION outbox_fold_record_key() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.RecordKey := lower(split_part(NEW.RecordKey, ':', 1))
        || substr(NEW.RecordKey, strpos(NEW.RecordKey, ':'));
    RETURN NEW;
END;
$$;

CREATE TRIGGER outbox_fold_record_key
    BEFORE INSERT OR UPDATE OF RecordKey ON _System_OutboxEvent
    FOR EACH ROW
    WHEN (NEW.RecordKey IS NOT NULL AND strpos(NEW.RecordKey, ':') > 0
          AND split_part(NEW.RecordKey, ':', 1) <> lower(split_part(NEW.RecordKey, ':', 1)))
    EXECUTE FUNCTION outbox_fold_record_key();

-- Fold the keys of rows that are still to run; terminal rows no longer take part in ordering.
UPDATE _System_OutboxEvent
SET RecordKey = lower(split_part(RecordKey, ':', 1)) || substr(RecordKey, strpos(RecordKey, ':'))
WHERE RecordKey IS NOT NULL
  AND Status NOT IN ('processed', 'failed')
  AND strpos(RecordKey, ':') > 0
  AND split_part(RecordKey, ':', 1) <> lower(split_part(RecordKey, ':', 1));
