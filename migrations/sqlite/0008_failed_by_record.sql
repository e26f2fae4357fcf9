-- Issue 41: the record page's newest failed row of a key, through an index of failed rows only.
-- See the PostgreSQL migration 0015, which this one mirrors.
CREATE INDEX outbox_failed_by_record_idx ON _System_OutboxEvent (RecordKey, CreatedDate, Id)
    WHERE Status = 'failed';
