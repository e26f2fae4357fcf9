-- Issue 40: the console's chart of rows processed per minute, from a rollup whose size does not
-- grow with the table (see the PostgreSQL migration 0016). SQLite has one writer at a time, so
-- one row per minute suffices, kept by a row trigger on every change of `Status` to
-- `processed`: in the writing transaction (a rolled-back attempt takes its count back), by
-- whichever code wrote it. The minute is the ended row's `LastModifiedDate` (UTC, as every
-- outbox timestamp on SQLite), or the host's clock when other code wrote one the outbox cannot
-- read (the timestamps trigger of 0003 rewrites it after this one). Each count also deletes the
-- rows older than a day (a probe of the primary key when there are none).
CREATE TABLE _System_OutboxThroughput (
    Minute    TEXT    NOT NULL PRIMARY KEY,
    Processed INTEGER NOT NULL
);

CREATE TRIGGER outbox_throughput_tally AFTER UPDATE OF Status ON _System_OutboxEvent
WHEN NEW.Status = 'processed' AND OLD.Status NOT IN ('processed', 'failed')
BEGIN
    INSERT INTO _System_OutboxThroughput (Minute, Processed)
    VALUES (CASE
                WHEN NEW.LastModifiedDate GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]*'
                    THEN substr(NEW.LastModifiedDate, 1, 16)
                ELSE strftime('%Y-%m-%dT%H:%M', 'now')
            END, 1)
    ON CONFLICT (Minute) DO UPDATE SET Processed = Processed + 1;
    DELETE FROM _System_OutboxThroughput
    WHERE Minute < strftime('%Y-%m-%dT%H:%M', 'now', '-1 day');
END;

-- The rows that failed before and are not terminal, for the retrying count and the heads of
-- keys blocked by a retry wait (see the PostgreSQL migration 0016).
CREATE INDEX outbox_retrying_idx ON _System_OutboxEvent (Status, CreatedDate)
    WHERE RetryCount > 0 AND Status NOT IN ('processed', 'failed');
