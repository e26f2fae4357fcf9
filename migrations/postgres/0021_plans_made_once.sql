-- Issue 37: the attempt's and the heads' functions plan their statements once per connection, not
-- at every call.
--
-- Migration 0012 moved the attempt's statements into PL/pgSQL functions so that their cached
-- plans stay index plans as the table grows. A function caches a plan per statement and
-- connection, but by default PostgreSQL's plan cache (`plan_cache_mode = auto`) keeps making a
-- custom plan for the call's parameter values while the generic plan's estimate is higher than
-- the custom plans' average, and an array parameter (`unnest(ks, cs, ids)`, `= ANY(ids)`) is
-- estimated at a few elements in a custom plan against ten or more in the generic one: so it
-- never switched. Measured with `pg_stat_statements` (`track = all`, `track_planning = on`) on
-- the bench's keyed drain and webhook drain: the heads trigger's head update inside
-- `_System_OutboxHeadAdd` was planned at 5,045 of its 5,304 calls (706 ms of planning against
-- 99 ms of execution), its key lock 5,055 times (211 ms against 49 ms), the settle's heads
-- statements at 1,337-1,549 of 1,540 calls, the claim's head pick at 343 of 805 calls (1.0 ms
-- per planning: 344 ms against 618 ms of execution), on a server whose two cores the workers
-- saturate. In a loop on one connection, `_System_OutboxHeadAdd` of one key took 0.145 ms per
-- call as shipped and 0.038 ms with a generic plan: every enqueue (the application's own, and
-- a webhook's fan-out row) runs it.
--
-- `SET plan_cache_mode = force_generic_plan` on the attempt's and the heads' functions (not the
-- claim's, below): their statements are planned at
-- their first call on a connection and the plan is reused after. That is the plan stability
-- 0012 meant to buy: under the functions' settings only index walks are left, so the generic
-- plan is an index plan whatever the table's size; `tests/it/plans.rs` checks the shapes that
-- failed before (every row of the primary key, a partial index walked per head) with these
-- settings, and that every function keeps them. ALTER FUNCTION … SET adds the setting and keeps
-- the others; it locks the function's catalog row, not the outbox table.
--
-- The trade, measured by a review: which index a plan walks still depends on the statistics
-- it was made with, and a generic plan is kept until an ANALYZE of the table invalidates it,
-- where `auto` would plan again at the next call. On statistics that count no open row (40,000
-- processed rows analyzed, then a backlog), the batch settle's check for older rows walked
-- `outbox_eligible_idx` without a bound in both modes, three times slower in the generic plan
-- (150-234 ms against 47-69 ms per call), until the next ANALYZE (which autovacuum runs once
-- a tenth of the table has changed). With statistics taken on any
-- backlog the generic and custom plans read the same buffers. docs/queries.md, "Planned once
-- per connection".
--
-- The claim's functions (_System_OutboxClaimBatch, _System_OutboxClaimChains) keep the plan
-- cache's default. Forced generic, the keyed drain ran 13% faster (14,409 and 13,333 per s
-- against 12,121 and 12,304, alternated) but the head-of-line scenario's p99 (one record
-- blocked, the others offered at 500/s) rose from 15-18 ms to 30-44 ms in the same sitting,
-- against a target of 20 ms: a claim at low load ran slower from its generic plan. Latency
-- for every record is not traded for drain throughput.

ALTER FUNCTION _System_OutboxHeadAdd(text[], timestamptz[], uuid[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxHeadRemove(text, uuid)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxHeadRemoveMany(text[], uuid[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxCheckFence(uuid, timestamptz)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxBeat(interval, uuid, timestamptz, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxBeatMany(interval, uuid[], timestamptz[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxLostFences(uuid[], timestamptz[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxSettle(interval, uuid, timestamptz, text, interval, text, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxSettleMany(interval, uuid[], timestamptz[], text, boolean)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxReleaseMany(interval, uuid[], timestamptz[], text, text)
    SET plan_cache_mode = force_generic_plan;
-- The chart's tally (migration 0016) had none of the index-only settings: a plan made while
-- `_System_OutboxThroughput` was empty walked it with a sequential scan per row of its trim
-- once it had grown (a review measured 1.1 s for a trim over 45,000 rows, with the plan
-- cache's default too, after five calls). It gets them with the others.
ALTER FUNCTION _System_OutboxTally(timestamptz[])
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET enable_sort = off SET enable_material = off
    SET plan_cache_mode = force_generic_plan;
