-- A handler may ask to be run later without failing: `HandlerError::snooze(delay, why)` in
-- outbox-events (Oban's snooze, River's JobSnooze). The row goes back to `pending` with
-- `RetryCount` unchanged and `LastModifiedDate` at now plus the delay, so it is not eligible
-- before then (the claim's rule is unchanged: a pending row is eligible from its
-- `LastModifiedDate` on, and one that failed before once that is older than the retry
-- cutoff). The webhook sender uses it to hold deliveries to an endpoint that answers slowly
-- without counting a failure against it (docs/webhooks.md).
--
-- `_System_OutboxSettle` of migration 0016 is replaced whole with one more outcome,
-- `snooze` ($5 carries its delay, as it carries a retry's extra backoff). CREATE OR REPLACE
-- sets the function's settings from this definition, so migration 0021's
-- `plan_cache_mode = force_generic_plan` is restated. Binaries of the previous release never
-- send `snooze`; this release's binaries refuse to start on a schema without this migration.

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
SET plan_cache_mode = force_generic_plan
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
ELSIF $7 = 'snooze' THEN
    UPDATE _System_OutboxEvent e
    SET Status = 'pending',
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
