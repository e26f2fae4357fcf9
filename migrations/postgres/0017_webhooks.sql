-- Issue 39: webhook endpoints and their delivery attempts. See docs/webhooks.md.
--
-- An endpoint receives the events its EventTypes name (a JSON array of strings; empty: every
-- type the fan-out handler is registered for). Each source event fans out, in its attempt's
-- transaction, into one outbox row per subscribed endpoint (event type `webhook:<Name>`, record
-- key `webhook:<Name>|<source key>`), so per-record order, retries, `failed`, pause and
-- retention apply per endpoint. A disabled endpoint's event type is paused: its deliveries wait
-- in order until it is enabled again.
--
-- Secrets are kept as given (`whsec_` + base64): HMAC needs the key itself. PreviousSecret is
-- still signed with until PreviousSecretUntil (a rotation's overlap).
CREATE TABLE IF NOT EXISTS _System_OutboxWebhookEndpoint (
    Name text PRIMARY KEY CHECK (Name ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    Url text NOT NULL,
    EventTypes text NOT NULL DEFAULT '[]',
    Secret text NOT NULL,
    PreviousSecret text,
    PreviousSecretUntil timestamptz,
    Enabled boolean NOT NULL DEFAULT true,
    DisabledReason text,
    ConsecutiveFailures integer NOT NULL DEFAULT 0,
    CreatedDate timestamptz NOT NULL DEFAULT clock_timestamp(),
    LastModifiedDate timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- One row per HTTP attempt of a delivery: what the receiver answered (or the error), how long
-- it took, and the first 4 KiB of its body. It references the delivery's outbox row, so
-- retention's prune of that row removes its attempts (a TRUNCATE of the outbox table must name
-- this table too).
CREATE TABLE IF NOT EXISTS _System_OutboxWebhookAttempt (
    Id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    Endpoint text NOT NULL,
    EventId uuid NOT NULL REFERENCES _System_OutboxEvent (Id) ON DELETE CASCADE,
    SourceEventId uuid NOT NULL,
    Attempt integer NOT NULL,
    At timestamptz NOT NULL DEFAULT clock_timestamp(),
    StatusCode integer,
    LatencyMs integer NOT NULL,
    ResponseBody text,
    Error text
);

CREATE INDEX IF NOT EXISTS outbox_webhook_attempt_endpoint_idx
    ON _System_OutboxWebhookAttempt (Endpoint, Id);
CREATE INDEX IF NOT EXISTS outbox_webhook_attempt_source_idx
    ON _System_OutboxWebhookAttempt (SourceEventId);
-- The cascade's probe when a delivery row is pruned.
CREATE INDEX IF NOT EXISTS outbox_webhook_attempt_event_idx
    ON _System_OutboxWebhookAttempt (EventId);
