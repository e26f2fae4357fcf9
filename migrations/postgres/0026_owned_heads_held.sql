-- Issue 39 (found by an outside service written from docs/webhooks.md): two batches' settles
-- deadlocked. A settle writes its events' outcomes, which move or delete the heads of the
-- records it ended (`_System_OutboxHeadRemoveMany`: SKIP LOCKED, never waiting), and then
-- inserts its handlers' owned rows (`enqueue_owned`: a webhook fan-out's deliveries), whose
-- head trigger waits for any transaction that has moved or deleted the same head and not yet
-- committed. One batch that ended record A's delivery and fanned out record B's next event,
-- beside another that ended B's delivery and fanned out A's, each waited for the other:
-- PostgreSQL aborted one after `deadlock_timeout` (1 s), its segment given back and run again
-- (2 deadlocks in 4 runs of 63 events over 7 records; `tests/it/owned_heads.rs`: one in each
-- run of 720 events over 6 records, 8 workers).
--
-- A settle with owned rows now holds their records' heads first, before it writes anything,
-- in key order (`FOR NO KEY UPDATE`: other settles' head moves skip a held head, as they skip
-- any head another transaction holds, leaving it for its holder; an enqueue's `FOR KEY SHARE`
-- does not conflict with it). Its owned rows' inserts then never wait for another settle's
-- move: the heads they meet are held by their own transaction, or were absent when it held
-- the others (only one attempt at a time writes a record's owned rows, so another settle does
-- not insert them). Between two settles that leaves no cycle: a settle waits here, before it
-- has moved any head, only for settles past this point, which wait for no other settle.
--
-- The hold first takes the outbox table's ROW EXCLUSIVE lock, which the settle's writes take a
-- moment later anyway: the heads rebuild (`outbox heads --rebuild`) locks the table in SHARE
-- mode and then deletes every head, so a hold that locked a head before the table would wait
-- for the rebuild at its next write while the rebuild waited for its head (found by a review,
-- reproduced in psql). Tables are locked in the order every writer of the outbox takes them:
-- the outbox table, then its heads.
CREATE FUNCTION _System_OutboxHeadHold(ks text[]) RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_material = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
BEGIN
    LOCK TABLE _System_OutboxEvent IN ROW EXCLUSIVE MODE;
    PERFORM 1 FROM _System_OutboxHead h
    WHERE h.RecordKey = ANY (ks)
    ORDER BY h.RecordKey
    FOR NO KEY UPDATE;
END;
$fn$;
