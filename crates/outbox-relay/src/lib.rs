//! The outbox's relay to NATS JetStream: a shipped consumer that publishes each event of the
//! event types it owns to a subject derived from its type, in per-record order, and lets the
//! stream drop redeliveries as duplicates (`Nats-Msg-Id` = the event's id).
//!
//! The relay is an ordinary consumer of the workers ([`outbox_events`]): one [`RelayHandler`]
//! per relayed event type, declared as an external effect protected by the broker's dedup, so
//! the rollout gate judges it like any handler. Its attempt waits, bounded by the ack timeout,
//! for the stream's ack before it writes `processed`; a publish error or a missing ack is a
//! retryable failure. It starts only on a stream that can keep the promise: a
//! `duplicate_window` at least the redelivery horizon of the worker settings
//! ([`RelayConfig::required_duplicate_window`]), every relayed subject captured, acks on.
//!
//! ```no_run
//! use outbox_events::{Database, WorkerConfig};
//! use outbox_relay::{NatsConnect, Relay, RelayConfig};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let db = Database::connect("postgres://localhost/app", Default::default()).await?;
//! let client = NatsConnect::new("nats://127.0.0.1:4222").connect().await?;
//! let relay = Relay::new(client, RelayConfig::new("CRM", "crm", ["account.updated"]))?;
//! let (dispatcher, check) = relay.dispatcher(db.repository(), WorkerConfig::from_env()).await?;
//! println!("stream {} holds {} messages", check.stream, check.messages);
//! let handle = dispatcher.start().await?;
//! # handle.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! See `docs/relay.md` for what it promises and what it does not.

#![warn(missing_docs)]

mod audit;
mod config;
mod connect;
mod error;
mod handler;
mod relay;
mod stream;
#[cfg(feature = "test-support")]
pub mod test_support;

pub use audit::{Expected, StreamAudit, StreamMessage, audit, read_stream};
pub use config::{DEFAULT_ACK_TIMEOUT, DEFAULT_SUBJECT_PREFIX, RELAY_CONSUMER, RelayConfig, human};
pub use connect::{NatsAuth, NatsConnect, Secret, redact_url};
pub use error::RelayError;
pub use handler::{RelayHandler, RelayMetrics, RelayMetricsSnapshot, headers, message};
pub use relay::{Relay, relayed_rows_left};
pub use stream::{StreamCheck, StreamSpec, check_stream, create_stream};

/// The NATS client this crate is built on, for callers that read the stream themselves.
pub use async_nats;
