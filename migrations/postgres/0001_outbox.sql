-- The transactional outbox table. Identifiers are unquoted so that the design's eligible-event
-- query runs as written (PostgreSQL folds them to lower case; SQLite ignores case).
-- See docs/schema.md for the reasoning behind every index.
CREATE TABLE _System_OutboxEvent (
    Id               UUID        PRIMARY KEY,
    EventType        TEXT        NOT NULL,
    Payload          TEXT        NOT NULL,
    Status           TEXT        NOT NULL DEFAULT 'pending',
    RetryCount       INTEGER     NOT NULL DEFAULT 0,
    RecordKey        TEXT,
    CreatedDate      TIMESTAMPTZ NOT NULL,
    LastModifiedDate TIMESTAMPTZ NOT NULL,
    LastError        TEXT,
    CONSTRAINT outbox_status_valid CHECK (Status IN ('pending', 'processing', 'processed', 'failed')),
    CONSTRAINT outbox_retry_count_valid CHECK (RetryCount >= 0)
) WITH (fillfactor = 85);

-- Walks non-terminal rows in the design's order (CreatedDate, Id). Terminal rows, which are the
-- bulk of an old table, are not in it, so its size follows the backlog, not the history.
CREATE INDEX outbox_eligible_idx ON _System_OutboxEvent (CreatedDate, Id)
    WHERE Status NOT IN ('processed', 'failed');

-- Serves the same-key probe (an older non-terminal row with the same RecordKey) with one index
-- descent, and the per-key head lookup.
CREATE INDEX outbox_record_key_idx ON _System_OutboxEvent (RecordKey, CreatedDate, Id)
    WHERE Status NOT IN ('processed', 'failed');

-- Wakes idle pull workers when an event is enqueued (LISTEN outbox_event). One notification per
-- statement, not per row, so a batch insert costs one.
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_event', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify_insert
    AFTER INSERT ON _System_OutboxEvent
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
