-- The transactional outbox table. Identifiers are unquoted so that the design's eligible-event
-- query runs as written on both backends. Timestamps are fixed-width UTC text
-- (YYYY-MM-DDTHH:MM:SS.ffffffZ), so text order is time order.
-- See docs/schema.md for the reasoning behind every index.
CREATE TABLE _System_OutboxEvent (
    Id               TEXT    PRIMARY KEY NOT NULL,
    EventType        TEXT    NOT NULL,
    Payload          TEXT    NOT NULL,
    Status           TEXT    NOT NULL DEFAULT 'pending',
    RetryCount       INTEGER NOT NULL DEFAULT 0,
    RecordKey        TEXT,
    CreatedDate      TEXT    NOT NULL,
    LastModifiedDate TEXT    NOT NULL,
    LastError        TEXT,
    CONSTRAINT outbox_status_valid CHECK (Status IN ('pending', 'processing', 'processed', 'failed')),
    CONSTRAINT outbox_retry_count_valid CHECK (RetryCount >= 0)
);

CREATE INDEX outbox_eligible_idx ON _System_OutboxEvent (Status, CreatedDate, Id);

CREATE INDEX outbox_record_key_idx ON _System_OutboxEvent (RecordKey, CreatedDate, Id)
    WHERE Status NOT IN ('processed', 'failed');
