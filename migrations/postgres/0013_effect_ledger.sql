-- Issue 38: the effect ledger. See docs/state-machine.md ("The effect ledger").
--
-- One row per external effect a handler completed for an event: `(EventId, HandlerId,
-- EffectKey)` names it (the event, the consumer's name, the effect's name in the handler),
-- `IdempotencyKey` is the key the effect was given (derived from those three, so every attempt
-- of the event gives the same one), `Result` what the effect returned (JSON), handed back to a
-- later attempt instead of running the effect again. A row is written in the attempt's
-- transaction when the effect completes (so it commits with the handler's own writes), and
-- again after the handler's failure is rolled back (so a retry does not repeat it).
--
-- The event id leads the primary key so that deleting an event (retention's prune) removes its
-- rows through the cascade below with one index probe. The foreign key is checked at COMMIT
-- (DEFERRABLE INITIALLY DEFERRED): its check takes FOR KEY SHARE on the event's row, which,
-- taken at the insert, would sit on the claimed row for the rest of the handler and hold back a
-- stale reclaim's FOR UPDATE (and a FOR UPDATE heartbeat) until the attempt's transaction ends.
CREATE TABLE _System_OutboxEffect (
    EventId        uuid        NOT NULL REFERENCES _System_OutboxEvent (Id) ON DELETE CASCADE
                               DEFERRABLE INITIALLY DEFERRED,
    HandlerId      text        NOT NULL,
    EffectKey      text        NOT NULL,
    IdempotencyKey text        NOT NULL,
    Result         text,
    RecordedDate   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (EventId, HandlerId, EffectKey)
);
