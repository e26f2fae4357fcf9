//! The fan-out: a source event's attempt enqueues one delivery row per endpoint that subscribes
//! to its type, in the attempt's own transaction, with the body frozen. A disabled endpoint
//! gets its rows too: its deliveries' type is paused, so they wait in order and go out once it
//! is enabled again; nothing is dropped while it is off.

use std::sync::Arc;

use outbox_events::persistence::webhooks::{self, delivery_event_type};
use outbox_events::{
    AttemptContext, Consumer, EffectKind, Handler, HandlerError, NewEvent, OutboxEvent,
    OutboxRepository,
};
use serde::{Deserialize, Serialize};

use crate::WebhookConfig;

/// The fan-out's consumer name.
pub const FANOUT_CONSUMER: &str = "webhooks-fanout";

/// The namespace of `webhook-id`s (UUID version 5 names).
const ID_NAMESPACE: uuid::Uuid = uuid::Uuid::from_u128(0x7765_6268_6f6f_4b73_8f75_7462_6f78_0039);

/// The `webhook-id` of `source_event_id`'s delivery to `endpoint`: `msg_` and a name-based
/// UUID of the two, the same for every attempt, so a receiver can deduplicate on it.
pub fn webhook_id(source_event_id: &str, endpoint: &str) -> String {
    let name = format!("{}:{endpoint}|{source_event_id}", endpoint.len());
    format!(
        "msg_{}",
        uuid::Uuid::new_v5(&ID_NAMESPACE, name.as_bytes()).simple()
    )
}

/// The most bytes of a record id (the `record-key` crate's limit).
const MAX_RECORD_ID: usize = 255;

/// A delivery's record id: `<endpoint>|<subject>`, or `<endpoint>|h:<SHA-256 of the subject>`
/// when that would be too long for a record id (a source key near its own limit): one key per
/// (endpoint, record) either way.
fn delivery_record_id(endpoint: &str, subject: &str) -> String {
    let plain = format!("{endpoint}|{subject}");
    if plain.len() <= MAX_RECORD_ID {
        return plain;
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(subject.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{endpoint}|h:{hex}")
}

/// What a delivery row carries (its payload).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// `Webhook`: the delivery's record key is `webhook:<record_id>`.
    pub object: String,
    /// `<endpoint>|<the source event's record key>` (`<endpoint>|event:<id>` for an event
    /// about no record).
    pub record_id: String,
    /// The endpoint's name.
    pub endpoint: String,
    /// The source event.
    pub source_event_id: String,
    /// The source event's record key, if any.
    pub record: Option<String>,
    /// `<CreatedDate in Unix microseconds>.<source event id>`: the order within the record.
    pub sequence: String,
    /// The body as it is sent and signed, byte for byte.
    pub body: String,
}

/// The Standard Webhooks envelope.
#[derive(Serialize)]
struct Envelope<'a> {
    #[serde(rename = "type")]
    event_type: &'a str,
    timestamp: String,
    data: serde_json::Value,
}

/// The fan-out handler, registered for each source event type.
pub struct WebhookFanOut {
    repo: Arc<dyn OutboxRepository>,
    config: WebhookConfig,
    endpoints: crate::cache::Endpoints,
}

impl WebhookFanOut {
    /// A fan-out that enqueues through `repo` (the dispatcher's repository).
    pub fn new(repo: Arc<dyn OutboxRepository>, config: WebhookConfig) -> Self {
        Self {
            repo,
            config,
            endpoints: crate::cache::Endpoints::default(),
        }
    }

    /// Its consumer declaration for `event_type`: rows enqueued in the attempt's transaction,
    /// derived from the frozen event only, so a rolled-back attempt leaves none and a committed
    /// one never runs again.
    pub fn consumer(event_type: &str) -> Consumer {
        Consumer::new(FANOUT_CONSUMER, event_type).effect(
            EffectKind::DeterministicFieldSet,
            "enqueues one webhook delivery row per subscribed endpoint in the attempt's transaction (its body and webhook-id derived from the event alone)",
            None,
        )
    }

    /// The delivery rows of `event` for `endpoints`.
    fn deliveries(
        &self,
        event: &OutboxEvent,
        endpoints: &[webhooks::WebhookEndpoint],
    ) -> Result<Vec<NewEvent>, HandlerError> {
        let data: serde_json::Value = serde_json::from_str(&event.payload).map_err(|e| {
            HandlerError::permanent_from("the event's payload is not JSON; nothing to send", e)
        })?;
        let body = serde_json::to_string(&Envelope {
            event_type: &event.event_type,
            timestamp: event
                .created_date
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            data,
        })
        .expect("a JSON value serializes");
        if body.len() > self.config.max_body_bytes {
            return Err(HandlerError::Permanent(format!(
                "the webhook body is {} bytes, over the {}-byte limit: not sent to any endpoint",
                body.len(),
                self.config.max_body_bytes
            )));
        }
        let id = event.id.to_string();
        let record = event.record_key.as_ref().map(|k| k.as_str().to_string());
        let sequence = format!("{}.{id}", event.created_date.timestamp_micros());
        endpoints
            .iter()
            .map(|endpoint| {
                let subject = record.clone().unwrap_or_else(|| format!("event:{id}"));
                let delivery = Delivery {
                    object: "Webhook".into(),
                    record_id: delivery_record_id(&endpoint.name, &subject),
                    endpoint: endpoint.name.clone(),
                    source_event_id: id.clone(),
                    record: record.clone(),
                    sequence: sequence.clone(),
                    body: body.clone(),
                };
                let payload = serde_json::to_string(&delivery).expect("strings serialize");
                Ok(NewEvent::new(delivery_event_type(&endpoint.name), payload))
            })
            .collect()
    }
}

#[outbox_events::async_trait]
impl Handler for WebhookFanOut {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        // Lock-free (a batch's next handlers may share the transaction): a read, and rows
        // under keys only this record's fan-out writes, one attempt at a time (its claim). The
        // transaction is asked for only when the cached read is stale: a handler that never
        // asks for it costs its batch no savepoint. Beside others of its batch (no
        // transaction), the read goes through the pool.
        let all = match self.endpoints.cached() {
            Some(all) => all,
            None if ctx.has_tx() => self.endpoints.all(ctx.lock_free_tx()).await?,
            None => self.endpoints.all_pooled(self.repo.as_ref()).await?,
        };
        let endpoints: Vec<_> = all
            .iter()
            .filter(|e| e.subscribes_to(&event.event_type))
            .cloned()
            .collect();
        if endpoints.is_empty() {
            return Ok(());
        }
        let rows = self.deliveries(event, &endpoints)?;
        let count = rows.len();
        // In a batch, inserted at its settle with the segment's other fan-outs: one statement.
        ctx.enqueue_owned(self.repo.as_ref(), rows).await?;
        tracing::debug!(event_id = %event.id, deliveries = count, "fanned out to webhook endpoints");
        Ok(())
    }

    /// A fan-out needs no transaction: its read goes through the pool and its rows are owned
    /// rows, inserted at the settle; a batch runs its fan-outs side by side, one per record.
    fn runs_without_tx(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_record_key_is_hashed_into_a_record_id_that_fits() {
        let long = format!("account:{}", "x".repeat(250));
        let endpoint = "e".repeat(63);
        let id = delivery_record_id(&endpoint, &long);
        assert!(id.len() <= MAX_RECORD_ID && id.contains("|h:"), "{id}");
        assert_eq!(id, delivery_record_id(&endpoint, &long));
        assert_ne!(id, delivery_record_id(&endpoint, &format!("{long}y")));
        assert_eq!(delivery_record_id("crm", "lead:1"), "crm|lead:1");
        let envelope = format!(r#"{{"object":"Webhook","record_id":"{id}"}}"#);
        assert!(outbox_events::persistence::EventEnvelope::parse(&envelope).is_ok());
    }

    #[test]
    fn a_webhook_id_is_stable_per_event_and_endpoint() {
        let a = webhook_id("0190-a", "billing");
        assert_eq!(a, webhook_id("0190-a", "billing"));
        assert_ne!(a, webhook_id("0190-a", "crm"));
        assert_ne!(a, webhook_id("0190-b", "billing"));
        assert!(a.starts_with("msg_") && a.len() == 36, "{a}");
    }
}
