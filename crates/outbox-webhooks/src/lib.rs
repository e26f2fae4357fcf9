//! Webhooks from the outbox (see `docs/webhooks.md`).
//!
//! - [`WebhookFanOut`]: a handler for the source event types. In the source event's attempt
//!   transaction it enqueues one delivery row per endpoint that subscribes to the type (a disabled one's wait):
//!   event type `webhook:<endpoint>`, record key `webhook:<endpoint>|<source record key>`. Every
//!   guarantee the outbox gives a row (per-record order, retries, `failed`, pause, the
//!   console, retention) then holds per endpoint and record, and a failing endpoint or record
//!   holds back no one else.
//! - [`WebhookDelivery`]: the handler of every `webhook:*` row. It POSTs the body the fan-out
//!   froze, signed by the Standard Webhooks scheme ([`signature`]), through the effect ledger
//!   (a delivery acknowledged by a committed attempt is never sent again; one whose attempt
//!   died after the send goes again with the same `webhook-id`), and keeps each attempt
//!   (status, latency, the first 4 KiB of the answer) in `_System_OutboxWebhookAttempt`.
//! - [`Webhooks`]: the endpoints (add, list, enable, disable, rotate a secret, attempts),
//!   audited like the console's actions.
//!
//! Sends go only to public addresses, checked after DNS on the address connected to
//! ([`AddressPolicy`]), unless an operator allows a subnet.

#![warn(missing_docs)]

mod admin;
mod cache;
mod client;
mod config;
mod deliver;
mod error;
mod fanout;
mod probe;
mod side;
pub mod signature;

pub use admin::{Webhooks, validate_url};
pub use client::{AddressPolicy, Subnet};
pub use config::{DEFAULT_RETRY_SCHEDULE, WebhookConfig};
pub use deliver::{
    DELIVERY_CONSUMER, Delivery, Outcome, SQLITE_SEND_LIMIT, WebhookDelivery, classify,
};
pub use error::Error;
pub use fanout::{FANOUT_CONSUMER, WebhookFanOut, webhook_id};
pub use outbox_events::persistence::webhooks::{
    DELIVERY_TYPE_PREFIX, DeliveryAttempt, WebhookEndpoint, delivery_event_type,
};

/// Headers every delivery carries beside the standard ones.
pub mod headers {
    /// The Standard Webhooks message id: the same for every attempt of one event to one
    /// endpoint.
    pub const ID: &str = "webhook-id";
    /// Unix seconds of the attempt.
    pub const TIMESTAMP: &str = "webhook-timestamp";
    /// `v1,<base64>` per signing secret, space-separated.
    pub const SIGNATURE: &str = "webhook-signature";
    /// The record the event is about (`object:record_id`), absent for an event about no record.
    pub const RECORD: &str = "outbox-record";
    /// The event's position in its record: its `CreatedDate` in Unix microseconds, then its
    /// id, as `<micros>.<event id>`. Ordered per record, so a receiver can drop what is older
    /// than what it already applied.
    pub const SEQUENCE: &str = "outbox-sequence";
    /// The outbox attempt (1 for the first).
    pub const ATTEMPT: &str = "outbox-attempt";
}
