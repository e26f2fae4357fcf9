-- The service's own schema, applied by its own sqlx migrator (recorded in `_sqlx_migrations`).
-- Its version, 1, is also the outbox's first: each records its versions in a table of its own.
-- Portable SQL: one file serves PostgreSQL and SQLite.
CREATE TABLE contact_request (
    id    TEXT PRIMARY KEY,
    email TEXT NOT NULL,
    name  TEXT NOT NULL
);

-- Contacts are created from requests by the outbox handler: one per email (the natural key,
-- backed by its UNIQUE constraint), numbered by an autonumber drawn only when one is created.
CREATE TABLE contact (
    email          TEXT   NOT NULL,
    name           TEXT   NOT NULL,
    contact_number BIGINT NOT NULL,
    CONSTRAINT contact_email UNIQUE (email),
    CONSTRAINT contact_number UNIQUE (contact_number)
);
