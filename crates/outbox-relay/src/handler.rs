//! The relay's handler: publishes one event to its subject and waits, bounded, for the stream's
//! ack before the attempt may write `processed`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::Context;
use async_nats::jetstream::message::PublishMessage as Publish;
use chrono::SecondsFormat;
use outbox_events::{AttemptContext, Handler, HandlerError, OutboxEvent, async_trait};
use serde::Serialize;

/// The headers of a relayed message.
pub mod headers {
    /// The broker's dedup key: the event's id.
    pub const MSG_ID: &str = "Nats-Msg-Id";
    /// The event's `RecordKey` (absent for an unordered event).
    pub const RECORD_KEY: &str = "Outbox-Record-Key";
    /// The event's `EventType`.
    pub const EVENT_TYPE: &str = "Outbox-Event-Type";
    /// The event's `CreatedDate` (RFC 3339, microseconds, UTC).
    pub const CREATED_DATE: &str = "Outbox-Created-Date";
    /// The attempt that published this copy (1 for the first).
    pub const ATTEMPT: &str = "Outbox-Attempt";
}

/// The relay's counters.
#[derive(Debug, Default)]
pub struct RelayMetrics {
    published: AtomicU64,
    duplicates: AtomicU64,
    failures: AtomicU64,
}

/// The relay's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RelayMetricsSnapshot {
    /// Publishes the stream acked as new messages.
    pub published: u64,
    /// Publishes the stream acked as duplicates of a message it holds (a redelivery).
    pub duplicates: u64,
    /// Publishes that failed or were not acked in time (each a retryable attempt failure).
    pub failures: u64,
}

impl RelayMetrics {
    /// The counters now.
    pub fn snapshot(&self) -> RelayMetricsSnapshot {
        RelayMetricsSnapshot {
            published: self.published.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
        }
    }
}

/// Publishes an event to a fixed subject; register one per relayed event type (see
/// [`crate::Relay::handlers`]).
#[derive(Clone)]
pub struct RelayHandler {
    jetstream: Context,
    subject: String,
    stream: String,
    ack_timeout: Duration,
    metrics: Arc<RelayMetrics>,
}

impl RelayHandler {
    pub(crate) fn new(
        jetstream: Context,
        subject: String,
        stream: String,
        ack_timeout: Duration,
        metrics: Arc<RelayMetrics>,
    ) -> Self {
        Self {
            jetstream,
            subject,
            stream,
            ack_timeout,
            metrics,
        }
    }

    /// The subject this handler publishes to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    fn fail(&self, context: String, source: impl Into<outbox_events::BoxError>) -> HandlerError {
        self.metrics.failures.fetch_add(1, Ordering::Relaxed);
        HandlerError::retryable_from(context, source)
    }
}

/// The message for `event`: its payload as stored, its id as `Nats-Msg-Id`, and its metadata.
pub fn message(event: &OutboxEvent) -> Publish {
    let mut h = HeaderMap::new();
    h.insert(headers::MSG_ID, event.id.to_string().as_str());
    h.insert(headers::EVENT_TYPE, event.event_type.as_str());
    if let Some(key) = &event.record_key {
        h.insert(headers::RECORD_KEY, key.as_str());
    }
    h.insert(
        headers::CREATED_DATE,
        event
            .created_date
            .to_rfc3339_opts(SecondsFormat::Micros, true)
            .as_str(),
    );
    h.insert(
        headers::ATTEMPT,
        event.retry_count.saturating_add(1).to_string().as_str(),
    );
    Publish::build()
        .headers(h)
        .payload(event.payload.clone().into_bytes().into())
}

#[async_trait]
impl Handler for RelayHandler {
    async fn handle(
        &self,
        event: &OutboxEvent,
        _ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let publish = async {
            let ack = self
                .jetstream
                .send_publish(self.subject.clone(), message(event))
                .await
                .map_err(|e| self.fail(format!("publish to {}", self.subject), e))?;
            ack.await
                .map_err(|e| self.fail(format!("ack of the publish to {}", self.subject), e))
        };
        // The bounded wait is this consumer's contract: past it the attempt is a retry.
        let ack = match tokio::time::timeout(self.ack_timeout, publish).await {
            Ok(ack) => ack?,
            Err(_) => {
                return Err(self.fail(
                    format!("publish to {}", self.subject),
                    format!("no ack within {:?}", self.ack_timeout),
                ));
            }
        };
        if ack.stream != self.stream {
            // Another stream captured the subject: the dedup and order promised are the
            // configured stream's, so this is not a delivery the relay can vouch for.
            return Err(self.fail(
                format!("publish to {}", self.subject),
                format!(
                    "acked by stream {:?}, not the relay's stream {:?}",
                    ack.stream, self.stream
                ),
            ));
        }
        let counter = if ack.duplicate {
            &self.metrics.duplicates
        } else {
            &self.metrics.published
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            event_id = %event.id,
            subject = %self.subject,
            sequence = ack.sequence,
            duplicate = ack.duplicate,
            "published"
        );
        Ok(())
    }
}
