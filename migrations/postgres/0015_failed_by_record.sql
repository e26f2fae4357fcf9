-- Issue 41: the record page (`outbox status --key`, the console's `/records?key=`) reads a key's
-- newest failed row. The partial indexes of 0001 hold only non-terminal rows and
-- outbox_terminal_idx is ordered by status and date, so that read walked the failed rows of
-- every key newest first until it met one of this key: all of them for a key that never failed.
-- This index holds failed rows only (a few; rows rarely fail), so its write cost is one entry
-- per row that fails, and nothing for rows that succeed or heartbeats.
CREATE INDEX outbox_failed_by_record_idx ON _System_OutboxEvent (RecordKey, CreatedDate, Id)
    WHERE Status = 'failed';
