-- Issue 39: webhook endpoints and their delivery attempts (as on PostgreSQL's 0017; see
-- docs/webhooks.md). Timestamps are the outbox's fixed-width UTC text.
CREATE TABLE IF NOT EXISTS _System_OutboxWebhookEndpoint (
    Name TEXT PRIMARY KEY,
    Url TEXT NOT NULL,
    EventTypes TEXT NOT NULL DEFAULT '[]',
    Secret TEXT NOT NULL,
    PreviousSecret TEXT,
    PreviousSecretUntil TEXT,
    Enabled INTEGER NOT NULL DEFAULT 1,
    DisabledReason TEXT,
    ConsecutiveFailures INTEGER NOT NULL DEFAULT 0,
    CreatedDate TEXT NOT NULL,
    LastModifiedDate TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS _System_OutboxWebhookAttempt (
    Id INTEGER PRIMARY KEY AUTOINCREMENT,
    Endpoint TEXT NOT NULL,
    EventId TEXT NOT NULL REFERENCES _System_OutboxEvent (Id) ON DELETE CASCADE,
    SourceEventId TEXT NOT NULL,
    Attempt INTEGER NOT NULL,
    At TEXT NOT NULL,
    StatusCode INTEGER,
    LatencyMs INTEGER NOT NULL,
    ResponseBody TEXT,
    Error TEXT
);

CREATE INDEX IF NOT EXISTS outbox_webhook_attempt_endpoint_idx
    ON _System_OutboxWebhookAttempt (Endpoint, Id);
CREATE INDEX IF NOT EXISTS outbox_webhook_attempt_source_idx
    ON _System_OutboxWebhookAttempt (SourceEventId);
CREATE INDEX IF NOT EXISTS outbox_webhook_attempt_event_idx
    ON _System_OutboxWebhookAttempt (EventId);
