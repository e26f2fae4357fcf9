-- Issue 18: retention. `outbox prune` and the dispatcher's pruner delete terminal rows older
-- than an age, oldest first, in small batches. See docs/retention.md.
--
-- No index is added on SQLite: the status-led outbox_eligible_idx (Status, CreatedDate, Id) of
-- 0001 already serves "the terminal rows of one status in CreatedDate order". This version
-- exists so that both backends carry the same migration versions.
SELECT 1;
