-- Issue 37: the functions that reach rows by key plan their statements once per connection, not
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
-- `SET plan_cache_mode = force_generic_plan` on the functions whose statements reach rows only
-- by a key no statistics can mislead: the heads trigger's `_System_OutboxHeadAdd` (the heads
-- table by its primary key), the fenced one-row and by-id statements (`_System_OutboxBeat`,
-- `…BeatMany`, `…CheckFence`, `…Settle`, `…ReleaseMany`: the primary key alone since
-- migration 0014's `COLLATE "C"`) and the chart's tally. Their statements are planned at their
-- first call on a connection and the plan is reused after. ALTER FUNCTION … SET adds the
-- setting and keeps the others; it locks the function's catalog row, not the outbox table.
--
-- Not the functions that read a record's open rows through a partial index (the claim's
-- `_System_OutboxClaimBatch` and `…ClaimChains`, `…LostFences`, `…SettleMany`,
-- `…HeadRemove`, `…HeadRemoveMany`): which index those walk depends on the statistics the plan
-- is made with, and a generic plan is kept until an ANALYZE invalidates it, where the default
-- plans again at the next call. Measured: with all of them forced generic, a review saw the
-- batch settle's check for older rows walk `outbox_eligible_idx` without a bound on statistics
-- that counted no open row (150-234 ms per call against 47-69 ms under the default); in a full
-- bench run with those functions forced generic and the claim on the default, the retention
-- scenario's first drain (1,000,000 terminal rows analyzed, then a keyed backlog) ran at 114/s
-- (855/s in the run before, 795-909/s before this migration); with the claim forced generic
-- too, the head-of-line scenario's p99 rose from 15-18 ms to 30-44 ms (target 20 ms), though
-- the keyed drain ran 13% faster. Latency and
-- robustness are not traded for drain throughput. docs/queries.md, "Planned once per
-- connection".

ALTER FUNCTION _System_OutboxHeadAdd(text[], timestamptz[], uuid[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxCheckFence(uuid, timestamptz)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxBeat(interval, uuid, timestamptz, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxBeatMany(interval, uuid[], timestamptz[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxSettle(interval, uuid, timestamptz, text, interval, text, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION _System_OutboxReleaseMany(interval, uuid[], timestamptz[], text, text)
    SET plan_cache_mode = force_generic_plan;
-- A function's settings hold for what it calls: the row trigger that `_System_OutboxSettle`'s
-- UPDATE fires runs `_System_OutboxHeadRemove`, which reads the record's open rows through a
-- partial index, so it is given the plan cache's default explicitly.
ALTER FUNCTION _System_OutboxHeadRemove(text, uuid)
    SET plan_cache_mode = auto;
-- The chart's tally (migration 0016) had none of the index-only settings: a plan made while
-- `_System_OutboxThroughput` was empty walked it with a sequential scan per row of its trim
-- once it had grown (a review measured 1.1 s for a trim over 45,000 rows, with the plan
-- cache's default too, after five calls). It gets them with the others.
ALTER FUNCTION _System_OutboxTally(timestamptz[])
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
    SET enable_mergejoin = off SET enable_sort = off SET enable_material = off
    SET plan_cache_mode = force_generic_plan;
