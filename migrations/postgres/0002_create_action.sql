-- Gap-free autonumber counters for the create action (crates/create-action). One row per
-- (object, field), keyed by the folded (lower-case) names; NextValue is the next value to hand
-- out. A draw increments the row inside the creating transaction, so the row lock serialises
-- the creators of one object until they commit, and a rolled-back draw is handed out again.
-- See docs/create-action.md.
CREATE TABLE _System_Autonumber (
    ObjectName TEXT   NOT NULL,
    FieldName  TEXT   NOT NULL,
    NextValue  BIGINT NOT NULL DEFAULT 1,
    CONSTRAINT autonumber_pkey PRIMARY KEY (ObjectName, FieldName),
    CONSTRAINT autonumber_next_value_valid CHECK (NextValue >= 1)
);
