-- Issue 38: the effect ledger. See docs/state-machine.md ("The effect ledger") and the
-- PostgreSQL migration 0013, which this one mirrors. Foreign keys are enforced on connections
-- that enable them (sqlx's default, `PRAGMA foreign_keys = ON`).
CREATE TABLE _System_OutboxEffect (
    EventId        TEXT NOT NULL REFERENCES _System_OutboxEvent (Id) ON DELETE CASCADE,
    HandlerId      TEXT NOT NULL,
    EffectKey      TEXT NOT NULL,
    IdempotencyKey TEXT NOT NULL,
    Result         TEXT,
    RecordedDate   TEXT NOT NULL,
    PRIMARY KEY (EventId, HandlerId, EffectKey)
);
