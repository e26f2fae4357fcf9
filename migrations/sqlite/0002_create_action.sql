-- Gap-free autonumber counters for the create action (crates/create-action). One row per
-- (object, field), keyed by the folded (lower-case) names; NextValue is the next value to hand
-- out. SQLite has one writer at a time, so a draw holds the database write lock until the
-- creating transaction ends. See docs/create-action.md.
CREATE TABLE _System_Autonumber (
    ObjectName TEXT    NOT NULL,
    FieldName  TEXT    NOT NULL,
    NextValue  INTEGER NOT NULL DEFAULT 1,
    CONSTRAINT autonumber_pkey PRIMARY KEY (ObjectName, FieldName),
    CONSTRAINT autonumber_next_value_valid CHECK (NextValue >= 1)
) WITHOUT ROWID;
