-- Issue 40: operator reads whose cost does not grow with the table's history. First, the
-- console's chart of rows processed per minute, from a rollup whose size does not grow with
-- the table. Before, the chart counted the `processed` rows created in the last 6 h
-- (341 ms for `/` on a busy 1M-row table, and more the busier the outbox).
--
-- _System_OutboxThroughput holds, per minute (UTC, by the ended row's `LastModifiedDate`) and
-- per server backend (`pg_backend_pid()`), how many rows the outbox's settles marked
-- `processed`. The two settle functions (_System_OutboxSettle for one event,
-- _System_OutboxSettleMany for a batch) count the rows their UPDATE ended, in the same
-- transaction, through _System_OutboxTally: a rolled-back attempt (a failed handler, a killed
-- worker, a cut connection) takes its counts back with it, and a committed one keeps them.
-- Pruning rows does not touch the counts: they say when rows were processed, not which rows
-- are still kept.
--
-- Why a row per backend: two transactions never write one rollup row at once (a backend runs
-- one transaction at a time), so a tally never waits for a lock and adds no deadlock, however
-- many workers settle in the same minute. A minute has as many rows as backends that settled
-- in it; the chart reads the last 60 minutes' rows by the primary key. A backend's first
-- tally of a minute also deletes up to 64 rows older than a day, SKIP LOCKED (never waiting).
--
-- Why not a trigger: a row trigger costs a function call and an upsert per ended row (the
-- heads trigger measured 29 us per row, migration 0014), and a statement trigger with
-- transition tables fires on every UPDATE of the table, beats and claims included (10-15% of
-- a 32-row UPDATE's throughput in a pgbench A/B). Rows that other code sets `processed` with its
-- own SQL are therefore not counted: the chart is the outbox workers' throughput.
--
-- _System_OutboxTally runs with the rights of the role that ran this migration (SECURITY
-- DEFINER, as outbox_notify of 0007), so worker roles need no privilege on the new table; its
-- search_path is pg_catalog and pg_temp, and the table is named with the migration's schema.
-- It keeps PostgreSQL's default EXECUTE for PUBLIC (the settles run as the workers' role and
-- call it), so any role that can connect could add counts to the chart: the chart informs, it
-- is no audit (the audit log and the rows are).
-- Readers (the console) need SELECT on it, which a default privilege for the migrating role's
-- tables gives (docs/deployment.md).

CREATE TABLE _System_OutboxThroughput (
    Minute    timestamptz NOT NULL,
    Backend   integer     NOT NULL,
    Processed bigint      NOT NULL,
    PRIMARY KEY (Minute, Backend)
);

DO $migration$
BEGIN
EXECUTE format($function$
CREATE FUNCTION %1$I._System_OutboxTally(ended timestamptz[]) RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $body$
DECLARE
    fresh boolean;
    -- A value, not clock_timestamp() in the statement: a volatile call is evaluated per row,
    -- so the trim would filter every row of the day instead of reading the key's range.
    cutoff timestamptz := clock_timestamp() - interval '1 day';
BEGIN
    WITH counted AS (
        INSERT INTO %1$I._system_outboxthroughput AS t (Minute, Backend, Processed)
        SELECT date_trunc('minute', e AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', pg_backend_pid(),
               count(*)
        FROM unnest(ended) AS e
        WHERE e IS NOT NULL
        GROUP BY 1
        ORDER BY 1
        ON CONFLICT (Minute, Backend) DO UPDATE SET Processed = t.Processed + excluded.Processed
        RETURNING t.xmax = 0 AS inserted
    )
    SELECT bool_or(inserted) INTO fresh FROM counted;
    IF fresh THEN
        DELETE FROM %1$I._system_outboxthroughput t
        WHERE (t.Minute, t.Backend) IN (
            SELECT o.Minute, o.Backend FROM %1$I._system_outboxthroughput o
            WHERE o.Minute < cutoff
            ORDER BY o.Minute
            LIMIT 64
            FOR UPDATE SKIP LOCKED);
    END IF;
END;
$body$
$function$, current_schema());
END;
$migration$;

-- Second: the rows that failed before and are not terminal, indexed on their own. The queue's
-- counts (`stats`, `outbox status`, the console) count the retrying rows and find the heads of
-- keys blocked by a retry wait; with only `outbox_eligible_idx` (which holds no status and no
-- RetryCount) that read every pending row from the table: 0.7 s for 450,000 pending rows on a
-- 10M-row table, 4.5 ms with this index. It holds only rows with `RetryCount > 0`. Heartbeats
-- never write `Status` or `RetryCount`, so they stay HOT updates; a retry and a settle change
-- `Status`, which other indexes hold already; a stale reclaim (processing to processing with
-- `RetryCount + 1`) was a HOT update and no longer is (a reclaim is rare). Its build locks the
-- table against writes for its duration (0.6 s on 10M rows, 450,000 of them pending, on a
-- 2-core machine).
CREATE INDEX outbox_retrying_idx ON _System_OutboxEvent (Status, CreatedDate)
    WHERE RetryCount > 0 AND Status NOT IN ('processed', 'failed');

-- The settles of migration 0014, each tallying the rows it marked `processed`.

CREATE OR REPLACE FUNCTION _System_OutboxSettleMany(clock_shift interval, event_ids uuid[],
                                                    written timestamptz[], lock_timeout text,
                                                    chains boolean)
RETURNS SETOF uuid
LANGUAGE plpgsql
VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_material = off
SET jit = off
AS $fn$
DECLARE
    done uuid[];
    ks text[];
    kids uuid[];
    stamps timestamptz[];
BEGIN
PERFORM set_config('lock_timeout', $4, true);
PERFORM set_config('outbox.heads_by_statement', txid_current()::text, true);
IF NOT $5 THEN
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
ended AS (
UPDATE _System_OutboxEvent e
SET Status = 'processed',
    LastModifiedDate = GREATEST((SELECT now FROM clock) + f.ord * interval '1 microsecond',
                                e.LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
FROM unnest($2::uuid[], $3::timestamptz[]) WITH ORDINALITY AS f(id, written, ord)
WHERE e.Id = f.id AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = f.written
RETURNING e.Id, e.RecordKey, e.LastModifiedDate
)
SELECT array_agg(x.Id), array_agg(x.RecordKey) FILTER (WHERE x.RecordKey IS NOT NULL),
       array_agg(x.Id) FILTER (WHERE x.RecordKey IS NOT NULL), array_agg(x.LastModifiedDate)
INTO done, ks, kids, stamps
FROM ended x;
ELSE
WITH clock AS (SELECT (clock_timestamp() + $1::interval) AS now),
firsts AS (
  SELECT DISTINCT ON (x.RecordKey) x.RecordKey AS k, x.CreatedDate AS c, x.Id AS i
  FROM _System_OutboxEvent x
  WHERE x.Id = ANY($2) AND x.RecordKey IS NOT NULL
  ORDER BY x.RecordKey, x.CreatedDate, x.Id
),
waits AS (
  SELECT fi.k FROM firsts fi
  WHERE EXISTS (
    SELECT 1 FROM _System_OutboxEvent older
    WHERE older.RecordKey = fi.k
      AND (older.CreatedDate, older.Id) < (fi.c, fi.i)
      AND older.Status NOT IN ('processed', 'failed')
      AND older.Id <> ALL($2))
),
ended AS (
UPDATE _System_OutboxEvent e
SET Status = 'processed',
    LastModifiedDate = GREATEST((SELECT now FROM clock) + f.ord * interval '1 microsecond',
                                e.LastModifiedDate + interval '1 microsecond'),
    LastError = NULL
FROM unnest($2::uuid[], $3::timestamptz[]) WITH ORDINALITY AS f(id, written, ord)
WHERE e.Id = f.id AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = f.written
  AND (e.RecordKey IS NULL OR e.RecordKey NOT IN (SELECT k FROM waits))
RETURNING e.Id, e.RecordKey, e.LastModifiedDate
)
SELECT array_agg(x.Id), array_agg(x.RecordKey) FILTER (WHERE x.RecordKey IS NOT NULL),
       array_agg(x.Id) FILTER (WHERE x.RecordKey IS NOT NULL), array_agg(x.LastModifiedDate)
INTO done, ks, kids, stamps
FROM ended x;
END IF;
PERFORM set_config('outbox.heads_by_statement', '', true);
IF ks IS NOT NULL THEN
    PERFORM _System_OutboxHeadRemoveMany(ks, kids);
END IF;
IF stamps IS NOT NULL THEN
    PERFORM _System_OutboxTally(stamps);
END IF;
RETURN QUERY SELECT u FROM unnest(done) AS u;
END;
$fn$;

CREATE OR REPLACE FUNCTION _System_OutboxSettle(clock_shift interval, event_id uuid, written timestamptz,
                                     error text, extra_delay interval, lock_timeout text,
                                     outcome text)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_material = off
SET jit = off
AS $fn$
DECLARE
    settled integer;
    stamp timestamptz;
BEGIN
PERFORM set_config('lock_timeout', $6, true);
IF $7 = 'processed' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'processed',
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond'),
        LastError = NULL
    WHERE e.Id = $2 AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = $3
    RETURNING e.LastModifiedDate INTO stamp;
    GET DIAGNOSTICS settled = ROW_COUNT;
    IF settled = 1 THEN
        PERFORM _System_OutboxTally(ARRAY[stamp]);
    END IF;
    RETURN settled;
ELSIF $7 = 'failed' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'failed',
        RetryCount = e.RetryCount + 1,
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond'),
        LastError = $4
    WHERE e.Id = $2 AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = $3;
ELSIF $7 = 'retry' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'pending',
        RetryCount = e.RetryCount + 1,
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval) + $5::interval, e.LastModifiedDate + interval '1 microsecond'),
        LastError = $4
    WHERE e.Id = $2 AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = $3;
ELSIF $7 = 'release' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'pending',
        LastModifiedDate = GREATEST((clock_timestamp() + $1::interval), e.LastModifiedDate + interval '1 microsecond'),
        LastError = CASE WHEN e.LastError LIKE 'worker died:%' THEN e.LastError ELSE $4 END
    WHERE e.Id = $2 AND e.Status = 'processing' COLLATE "C" AND e.LastModifiedDate = $3;
ELSE
    RAISE EXCEPTION 'unknown outbox outcome %', $7 USING ERRCODE = '22023';
END IF;
GET DIAGNOSTICS settled = ROW_COUNT;
RETURN settled;
END;
$fn$;
