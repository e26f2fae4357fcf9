-- Issue 27: pausing an event type, and the operators' audit log (as on PostgreSQL's 0010; see
-- docs/console.md). Timestamps are the outbox's fixed-width UTC text.
CREATE TABLE IF NOT EXISTS _System_OutboxPausedType (
    EventType TEXT PRIMARY KEY,
    PausedAt TEXT NOT NULL,
    PausedBy TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS _System_OutboxAudit (
    Id INTEGER PRIMARY KEY AUTOINCREMENT,
    At TEXT NOT NULL,
    Actor TEXT NOT NULL,
    Action TEXT NOT NULL,
    Detail TEXT NOT NULL
);
