-- Issue 27: pausing an event type, and the operators' audit log. See docs/console.md.
--
-- A row in _System_OutboxPausedType pauses its EventType: every dispatcher re-reads this table
-- every second (outbox_events::PAUSE_REFRESH) and stops claiming rows of the type; a record
-- whose head is of a paused type waits behind it in order. Deleting the row resumes.
-- _System_OutboxAudit records every pause, resume and retry made by the CLI or the console,
-- with who (the console token's name, or the CLI's actor) and when, in the action's own
-- transaction.
CREATE TABLE IF NOT EXISTS _System_OutboxPausedType (
    EventType text PRIMARY KEY,
    PausedAt timestamptz NOT NULL,
    PausedBy text NOT NULL
);

CREATE TABLE IF NOT EXISTS _System_OutboxAudit (
    Id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    At timestamptz NOT NULL,
    Actor text NOT NULL,
    Action text NOT NULL,
    Detail text NOT NULL
);
