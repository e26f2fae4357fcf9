-- Issue 39: a batch reads the effect ledger for its transaction-free handlers in one statement
-- before it runs them side by side (`find_effects`: every row of the group's events). Prepared
-- once per connection as `… WHERE EventId = ANY($1)`, its generic plan was made while the
-- ledger was small, a sequential scan (the cheapest then), and kept as the ledger grew: in the
-- webhooks bench (`outbox-bench --only webhooks`, 2026-12-06, auto_explain) every call read the
-- whole ledger ("Rows Removed by Filter: 1428 … 3222" and growing), 2.1 ms a call on average,
-- the third most expensive statement of the run in pg_stat_statements (7.9 s of 37 s).
-- In a function with the claim's planner settings only the ledger's primary key, which leads with
-- the event, can serve it, whatever the statistics say; planned once per connection (it reaches
-- rows by key alone, as `_System_OutboxCheckFence` does).
CREATE OR REPLACE FUNCTION _System_OutboxFindEffects(p_ids uuid[])
RETURNS TABLE (EventId uuid, HandlerId text, EffectKey text, IdempotencyKey text, Result text)
LANGUAGE plpgsql
STABLE
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
    RETURN QUERY
    SELECT e.EventId, e.HandlerId, e.EffectKey, e.IdempotencyKey, e.Result
    FROM _System_OutboxEffect e
    WHERE e.EventId = ANY (p_ids);
END;
$fn$;
