-- Issue 15: the application's write path. See docs/state-machine.md ("Waking idle workers").
--
-- The statement-level NOTIFY trigger of 0001 made every enqueueing transaction take
-- PostgreSQL's notify lock at commit: a database-wide lock that serializes the commits (WAL
-- flush included) of every transaction that issued NOTIFY. Measured with pgbench, one-row
-- inserts: 8 writers -54% and 32 writers -57% against the same insert without the trigger. The
-- CRM's own transactions paid for our wake-up.
--
-- Now the trigger notifies only when no enqueue has notified in the last 5 ms. The time of the
-- last notification is kept in a sequence (its value is microseconds since the epoch), because
-- a sequence is not transactional: setval is visible to every session at once and holds no
-- lock until commit, so the check costs two buffer reads and, at most every 5 ms, one setval,
-- and never makes a writer wait for another. Under load, at most about 200 transactions a
-- second pay for the notify lock instead of every one; an enqueue into an idle queue (nothing
-- notified for 5 ms) notifies exactly as before.
--
-- What a skipped notification costs: the window starts when the notifying transaction inserts,
-- not when it commits. A transaction that skipped and commits after the workers that the
-- notification woke found the queue empty, or before a long notifying transaction commits,
-- waits for a worker's next look: workers that just worked look again after 10 ms, doubling to
-- the poll interval (500 ms by default). So do the rows of a window whose notifying
-- transaction rolls back (its NOTIFY is dropped, its setval stays). Nothing waits longer than
-- the poll interval, and nothing is lost. A clock that steps back notifies at once and restarts
-- the window. The window can be set per database, role or session with the custom setting
-- `outbox.notify_window_us` (microseconds; 0 notifies on every enqueue as before; anything
-- that is not a number is ignored).
--
-- The trigger runs with the rights of the role that ran this migration (SECURITY DEFINER), so
-- roles that only insert outbox rows need no privilege on the sequence. Its search_path is
-- pg_catalog and pg_temp only, and the sequence is named with the migration's schema, so no
-- object another role creates in a schema of its path (an operator, a `setval` overload) can
-- run with those rights: the function is created by dynamic SQL to spell the schema in.
CREATE SEQUENCE _System_OutboxNotifyClock AS bigint MINVALUE 0 START WITH 0;

DO $migration$
BEGIN
EXECUTE format($function$
CREATE OR REPLACE FUNCTION %1$I.outbox_notify() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
    now_us bigint := (extract(epoch FROM clock_timestamp()) * 1000000::numeric)::bigint;
    window_setting text := current_setting('outbox.notify_window_us', true);
    window_us bigint := 5000;
    last_us bigint;
BEGIN
    IF window_setting ~ '^[0-9]{1,12}$' THEN
        window_us := window_setting::bigint;
    END IF;
    SELECT last_value INTO last_us FROM %1$I._system_outboxnotifyclock;
    IF now_us - last_us >= window_us OR now_us < last_us THEN
        PERFORM setval(%2$L::regclass, now_us);
        PERFORM pg_notify('outbox_event', '');
    END IF;
    RETURN NULL;
END;
$body$
$function$, current_schema(), format('%I._system_outboxnotifyclock', current_schema()));
END;
$migration$;
