//! The delivery: the handler of every `webhook:*` row. It sends the frozen body, signed, through
//! the effect ledger, keeps the attempt, and turns the receiver's answer into the row's outcome
//! (docs/webhooks.md, "Delivery semantics").

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::body::Bytes;
use outbox_events::persistence::webhooks::{self, DeliveryAttempt};
use outbox_events::{
    AttemptContext, Consumer, EffectKind, EventId, ExternalKind, Handler, HandlerError,
    OutboxEvent, OutboxRepository, Safeguard,
};

use crate::client::{Answer, Client, SendError};
pub use crate::fanout::Delivery;
use crate::{WebhookConfig, headers, signature, webhook_id};

/// The delivery's consumer name (the ledger's handler id).
pub const DELIVERY_CONSUMER: &str = "webhooks";

/// How often a side write (attempt log, endpoint state) is tried.
const SIDE_TRIES: u32 = 10;

/// The ledger's name of the one effect of a delivery.
const EFFECT: &str = "deliver";

/// What a receiver's answer means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// 2xx: delivered.
    Delivered,
    /// 410 Gone: the endpoint is disabled, the delivery waits for it to be enabled.
    Gone,
    /// 429, 502, 503, 504: the receiver asks to slow down; its `Retry-After` is honoured
    /// within bounds.
    SlowDown,
    /// Any other status (3xx included: redirects are not followed), or no answer.
    Failed,
}

/// What `status` means for a delivery.
pub fn classify(status: u16) -> Outcome {
    match status {
        200..=299 => Outcome::Delivered,
        410 => Outcome::Gone,
        429 | 502 | 503 | 504 => Outcome::SlowDown,
        _ => Outcome::Failed,
    }
}

/// The delivery handler, registered for `webhook:*` (see [`WebhookDelivery::consumer`]).
pub struct WebhookDelivery {
    repo: Arc<dyn OutboxRepository>,
    client: Client,
    config: WebhookConfig,
}

impl WebhookDelivery {
    /// A sender with `config`, keeping its attempts through `repo` (the dispatcher's).
    pub fn new(repo: Arc<dyn OutboxRepository>, config: WebhookConfig) -> Self {
        Self {
            repo,
            client: Client::new(config.clone()),
            config,
        }
    }

    /// Its consumer declaration: a webhook call through the effect ledger, to be registered
    /// with `Handlers::register_with_ledger` for `webhook:*`.
    pub fn consumer() -> Consumer {
        Consumer::new(
            DELIVERY_CONSUMER,
            format!("{}*", webhooks::DELIVERY_TYPE_PREFIX),
        )
        .effect(
            EffectKind::External {
                kind: ExternalKind::Webhook,
            },
            "POST of the event, signed (Standard Webhooks), to each subscribed endpoint; webhook-id stable per event and endpoint",
            Some(Safeguard::Ledger),
        )
    }

    /// Sends `delivery` once: the answer, or why there is none.
    async fn send(
        &self,
        endpoint: &webhooks::WebhookEndpoint,
        delivery: &Delivery,
        attempt: i32,
    ) -> Result<Answer, SendError> {
        let url: hyper::Uri = endpoint
            .url
            .parse()
            .map_err(|e| SendError::Refused(format!("the endpoint's URL does not parse: {e}")))?;
        let now = chrono::Utc::now();
        let timestamp = now.timestamp();
        let id = webhook_id(&delivery.source_event_id, &endpoint.name);
        let signatures = signature::signature_header(
            &endpoint.signing_secrets(now),
            &id,
            timestamp,
            delivery.body.as_bytes(),
        )
        .map_err(|e| SendError::Refused(e.to_string()))?;
        let mut sent = vec![
            (headers::ID, id),
            (headers::TIMESTAMP, timestamp.to_string()),
            (headers::SIGNATURE, signatures),
            (headers::SEQUENCE, delivery.sequence.clone()),
            (headers::ATTEMPT, attempt.to_string()),
        ];
        if let Some(record) = &delivery.record {
            sent.push((headers::RECORD, record.clone()));
        }
        self.client
            .post(&url, &sent, Bytes::from(delivery.body.clone()))
            .await
    }

    /// What the answer (or its absence) makes of the attempt: `Ok` when delivered, the
    /// retry otherwise (a 410 disables the endpoint first).
    async fn judge(
        &self,
        endpoint: &str,
        delivery_id: EventId,
        failures: i32,
        answer: &Result<Answer, SendError>,
    ) -> Result<(), HandlerError> {
        let jitter = jitter(delivery_id, failures);
        let wait = self.config.retry_wait(failures, jitter);
        let (outcome, why) = match answer {
            Ok(a) => (classify(a.status), format!("HTTP {}", a.status)),
            Err(e) => (Outcome::Failed, e.to_string()),
        };
        match outcome {
            Outcome::Delivered => Ok(()),
            Outcome::Gone => {
                self.disable(endpoint, "the receiver answered 410 Gone")
                    .await;
                Err(HandlerError::retry_in(
                    wait,
                    format!(
                        "{why}: the endpoint is disabled; the delivery waits for it to be enabled"
                    ),
                ))
            }
            Outcome::SlowDown => {
                let asked = answer
                    .as_ref()
                    .ok()
                    .and_then(|a| a.retry_after)
                    .map(|d| self.config.bounded_retry_after(d));
                let wait = asked.map_or(wait, |asked| asked.max(wait));
                Err(HandlerError::retry_in(wait, format!("{why}: slowing down")))
            }
            Outcome::Failed => Err(HandlerError::retry_in(wait, why)),
        }
    }

    /// Disables `endpoint` on a transaction of its own (the attempt's rolls back with its
    /// failure).
    async fn disable(&self, endpoint: &str, reason: &str) {
        let endpoint = endpoint.to_string();
        let reason = reason.to_string();
        self.on_the_side(move |mut tx| {
            let (endpoint, reason) = (endpoint.clone(), reason.clone());
            async move {
                webhooks::set_endpoint_enabled(
                    &mut tx,
                    &endpoint,
                    false,
                    Some(&reason),
                    "webhooks",
                )
                .await?;
                tx.commit().await
            }
        })
        .await;
    }

    /// Runs `write` on a transaction of its own, tried again with backoff for about 10 s: at
    /// once on PostgreSQL; on SQLite, whose one writer is the attempt itself, in a task that
    /// waits for it to end.
    async fn on_the_side<F, Fut>(&self, write: F)
    where
        F: Fn(outbox_events::Tx) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = outbox_events::persistence::Result<()>> + Send,
    {
        let repo = self.repo.clone();
        let run = async move {
            let mut backoff = Duration::from_millis(50);
            for try_number in 1..=SIDE_TRIES {
                let written = match repo.begin().await {
                    Ok(tx) => write(tx).await,
                    Err(e) => Err(e),
                };
                match written {
                    Ok(()) => return,
                    Err(e) if try_number == SIDE_TRIES => {
                        tracing::warn!(error = %e, "a webhook's side write failed (its attempt log or endpoint state); giving up");
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, try_number, "a webhook's side write failed; trying again");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
        };
        if self.repo.serializes_writers() {
            tokio::spawn(run);
        } else {
            run.await;
        }
    }

    /// Keeps the attempt and counts it on its endpoint, disabling it after sustained failure.
    async fn keep(&self, attempt: DeliveryAttempt, delivered: bool) {
        let disable_after = self.config.disable_after_failures;
        self.on_the_side(move |mut tx| {
            let attempt = attempt.clone();
            async move {
            webhooks::record_delivery_attempt(&mut tx, &attempt).await?;
            let failures = webhooks::note_delivery(&mut tx, &attempt.endpoint, delivered).await?;
            if !delivered && failures >= disable_after {
                let reason = format!("{failures} failed attempts in a row");
                webhooks::set_endpoint_enabled(
                    &mut tx,
                    &attempt.endpoint,
                    false,
                    Some(&reason),
                    "webhooks",
                )
                .await?;
                tracing::warn!(endpoint = %attempt.endpoint, failures, "webhook endpoint disabled after sustained failure");
            }
            tx.commit().await
            }
        })
        .await;
    }
}

/// -1.0..=1.0 from the delivery and its failure count: spread, and the same on every replay.
fn jitter(id: EventId, failures: i32) -> f64 {
    let bits = id.as_u128() ^ (failures as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let folded = (bits as u64) ^ ((bits >> 64) as u64);
    (folded % 2001) as f64 / 1000.0 - 1.0
}

#[outbox_events::async_trait]
impl Handler for WebhookDelivery {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let delivery: Delivery = serde_json::from_str(&event.payload).map_err(|e| {
            HandlerError::permanent_from("not a webhook delivery row the fan-out wrote", e)
        })?;
        let Some(endpoint) = webhooks::endpoint(ctx.tx(), &delivery.endpoint).await? else {
            return Err(HandlerError::Permanent(format!(
                "no webhook endpoint is named {:?} any more",
                delivery.endpoint
            )));
        };
        if !endpoint.enabled {
            // Claimed before the pause reached this worker: its type is paused, so it is not
            // claimed again until the endpoint is enabled; then it goes first, in order.
            return Err(HandlerError::retry_in(
                Duration::from_secs(1),
                "the endpoint is disabled; the delivery waits for it to be enabled",
            ));
        }
        let attempt = event.retry_count + 1;
        let effect = ctx.effect(EFFECT);
        let sent = effect
            .once(|_key| async {
                let started = Instant::now();
                let answer = self.send(&endpoint, &delivery, attempt).await;
                let latency_ms = i32::try_from(started.elapsed().as_millis()).unwrap_or(i32::MAX);
                let delivered =
                    matches!(&answer, Ok(a) if classify(a.status) == Outcome::Delivered);
                let source_event_id = delivery.source_event_id.parse().unwrap_or_default();
                self.keep(
                    DeliveryAttempt {
                        endpoint: endpoint.name.clone(),
                        event_id: event.id,
                        source_event_id,
                        attempt,
                        at: None,
                        status_code: answer.as_ref().ok().map(|a| i32::from(a.status)),
                        latency_ms,
                        response_body: answer.as_ref().ok().map(|a| a.body.clone()),
                        error: match &answer {
                            Ok(a) if !delivered => Some(format!("HTTP {}", a.status)),
                            Ok(_) => None,
                            Err(e) => Some(e.to_string()),
                        },
                    },
                    delivered,
                )
                .await;
                self.judge(&endpoint.name, event.id, attempt, &answer)
                    .await
                    .map(|()| answer.map(|a| a.status).unwrap_or_default())
            })
            .await;
        sent.map(|status: u16| {
            tracing::debug!(event_id = %event.id, endpoint = %endpoint.name, status, "webhook delivered");
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_mean_what_the_semantics_table_says() {
        assert_eq!(classify(200), Outcome::Delivered);
        assert_eq!(classify(204), Outcome::Delivered);
        assert_eq!(classify(301), Outcome::Failed);
        assert_eq!(classify(400), Outcome::Failed);
        assert_eq!(classify(410), Outcome::Gone);
        for slow in [429, 502, 503, 504] {
            assert_eq!(classify(slow), Outcome::SlowDown);
        }
        assert_eq!(classify(500), Outcome::Failed);
    }

    #[test]
    fn jitter_stays_in_its_bounds() {
        for n in 0..1000u128 {
            let j = jitter(EventId::from_u128(n * 7919), (n % 9) as i32);
            assert!((-1.0..=1.0).contains(&j), "{j}");
        }
    }
}
