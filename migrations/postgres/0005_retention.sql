-- Issue 18: retention. `outbox prune` and the dispatcher's pruner delete terminal rows older
-- than an age, oldest first, in small batches. See docs/retention.md and docs/schema.md.

-- Serves the prune batches: the terminal rows of one status in CreatedDate order, so a batch
-- reads its rows and stops at the cutoff instead of scanning the table (the partial indexes of
-- 0001 hold only non-terminal rows). Its write cost is one index entry per row that becomes
-- terminal (that update changes Status, which the partial predicates name, so it is never HOT
-- anyway); heartbeats stay HOT because neither column here changes on a heartbeat, and
-- LastModifiedDate, which heartbeats write, is deliberately not indexed.
CREATE INDEX outbox_terminal_idx ON _System_OutboxEvent (Status, CreatedDate)
    WHERE Status IN ('processed', 'failed');
