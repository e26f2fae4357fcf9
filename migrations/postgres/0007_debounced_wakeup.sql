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
-- What a skipped notification costs: a transaction that skipped commits after the one that
-- notified, and after the workers that notification woke found the queue empty. Its rows wait
-- for a worker's next look: workers that just worked look again after 10 ms, doubling to the
-- poll interval (500 ms by default). So does a notifying transaction that rolls back (its
-- NOTIFY is dropped, its setval stays). A clock that steps back notifies at once and restarts
-- the window. The window can be set per database, role or session with the custom setting
-- `outbox.notify_window_us` (microseconds; 0 notifies on every enqueue as before; anything
-- that is not a number is ignored). The trigger runs with the rights of the role that ran this migration
-- (SECURITY DEFINER, search_path fixed to the migration's), so roles that only insert outbox
-- rows need no privilege on the sequence.
CREATE SEQUENCE _System_OutboxNotifyClock AS bigint MINVALUE 0 START WITH 0;

CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    now_us bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    window_setting text := current_setting('outbox.notify_window_us', true);
    window_us bigint := 5000;
    last_us bigint;
BEGIN
    IF window_setting ~ '^[0-9]{1,12}$' THEN
        window_us := window_setting::bigint;
    END IF;
    SELECT last_value INTO last_us FROM _System_OutboxNotifyClock;
    IF now_us - last_us >= window_us OR now_us < last_us THEN
        PERFORM setval('_System_OutboxNotifyClock', now_us);
        PERFORM pg_notify('outbox_event', '');
    END IF;
    RETURN NULL;
END;
$$;
