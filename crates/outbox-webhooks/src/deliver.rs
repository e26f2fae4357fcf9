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
use crate::probe::{Admission, Probes, SlowLimit};
use crate::side::{SideWrite, SideWriter};
use crate::{WebhookConfig, headers, signature, webhook_id};

/// The delivery's consumer name (the ledger's handler id).
pub const DELIVERY_CONSUMER: &str = "webhooks";

/// The longest a send may take on SQLite, whose attempt holds the database's one write lock
/// while it runs: below the default lock timeout (5 s), so that the application's own writes
/// wait for it rather than fail.
pub const SQLITE_SEND_LIMIT: Duration = Duration::from_secs(3);

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
    client: Client,
    config: WebhookConfig,
    side: SideWriter,
    probes: Probes,
    endpoints: crate::cache::Endpoints,
    /// The dispatcher's repository: the endpoints' reads of a delivery run without the
    /// attempt's transaction.
    repo: Arc<dyn OutboxRepository>,
}

impl WebhookDelivery {
    /// A sender with `config`, keeping its attempts through `repo` (the dispatcher's). On a
    /// backend whose attempt holds the one write lock (SQLite) a send's timeouts are held
    /// below its lock timeout, [`SQLITE_SEND_LIMIT`]: every other writer waits while a
    /// delivery runs.
    pub fn new(repo: Arc<dyn OutboxRepository>, config: WebhookConfig) -> Self {
        let mut config = config;
        let mut probe_spacing = Duration::from_secs(1);
        if repo.serializes_writers() {
            config.total_timeout = config.total_timeout.min(SQLITE_SEND_LIMIT);
            config.connect_timeout = config.connect_timeout.min(SQLITE_SEND_LIMIT);
            probe_spacing = Duration::from_secs(10);
        }
        let slow = SlowLimit {
            after: config.slow_after,
            sends: config.max_slow_sends,
        };
        Self {
            client: Client::new(config.clone()),
            side: SideWriter::new(repo.clone(), config.disable_after_failures),
            repo,
            config,
            probes: Probes::new(probe_spacing, slow),
            endpoints: crate::cache::Endpoints::default(),
        }
    }

    /// Waits until the records of every attempt made so far (the attempt log, the endpoints'
    /// failures in a row, disables) are written, or given up after their tries (logged): they
    /// are written beside the attempts, by a task of their own. Call it after the dispatcher has
    /// stopped, before the process exits (see `Webhooks::flush`).
    pub async fn flush(&self) {
        self.side.flush().await;
    }

    /// The writer of its side records (shared with [`crate::Webhooks`], which flushes it).
    pub(crate) fn side(&self) -> SideWriter {
        self.side.clone()
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

    /// What the answer (or its absence) makes of the attempt `failures` (1 for the first):
    /// `Ok` when delivered, the retry otherwise. A 410 disables the endpoint; so does a
    /// delivery's failure that leaves it one attempt (of the workers' `MaxRetryAttempts`): it
    /// never ends `failed` for an endpoint that is down, it waits for it to be enabled.
    fn judge(
        &self,
        endpoint: &str,
        delivery_id: EventId,
        failures: i32,
        answer: &Result<Answer, SendError>,
    ) -> Result<(), HandlerError> {
        let wait = self
            .config
            .retry_wait(failures, jitter(delivery_id, failures));
        let (outcome, why) = match answer {
            Ok(a) => (classify(a.status), format!("HTTP {}", a.status)),
            Err(e) => (Outcome::Failed, e.to_string()),
        };
        let disable = |reason: String| {
            self.side.send(SideWrite::Disable {
                endpoint: endpoint.to_string(),
                reason,
            });
        };
        let last = failures + 1 >= self.config.max_attempts && self.config.max_attempts > 1;
        match outcome {
            Outcome::Delivered => Ok(()),
            Outcome::Gone => {
                disable("the receiver answered 410 Gone".into());
                // Held by the pause until it is enabled; then at once.
                Err(HandlerError::retry_in(
                    PAUSED_WAIT,
                    format!(
                        "{why}: the endpoint is disabled; the delivery waits for it to be enabled"
                    ),
                ))
            }
            _ if last => {
                disable(format!(
                    "a delivery failed {failures} attempts ({why}); its last attempt waits for the endpoint to be enabled"
                ));
                Err(HandlerError::retry_in(PAUSED_WAIT, why))
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
}

/// The wait of a delivery whose endpoint is (being) disabled: long, so that it is not claimed
/// again (and counted again) before the pause reaches every worker; enabling the endpoint makes
/// it due at once (`set_endpoint_enabled`).
const PAUSED_WAIT: Duration = Duration::from_secs(3600);

/// The bounds of the wait of a delivery snoozed because its slow endpoint has its share of
/// sends in flight: about the endpoint's answer time, held to these.
const SLOW_WAIT_MIN: Duration = Duration::from_secs(1);
const SLOW_WAIT_MAX: Duration = Duration::from_secs(60);

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
        // A read: lock-free, as are the ledger's rows (keyed by this event alone). Beside
        // other deliveries of its batch (no transaction), through the pool.
        let endpoint = if ctx.has_tx() {
            self.endpoints
                .get(ctx.lock_free_tx(), &delivery.endpoint)
                .await?
        } else {
            self.endpoints
                .get_pooled(self.repo.as_ref(), &delivery.endpoint)
                .await?
        };
        let attempt = event.retry_count + 1;
        // A delivery the ledger records as sent is not sent again, whatever became of its
        // endpoint since: the checks run only when it is to be sent.
        let status: u16 = ctx
            .effect(EFFECT)
            .once(|_key| async {
                let Some(endpoint) = endpoint else {
                    return Err(HandlerError::Permanent(format!(
                        "no webhook endpoint is named {:?} any more",
                        delivery.endpoint
                    )));
                };
                if !endpoint.enabled {
                    // Claimed before the pause reached this worker: held by it from now on.
                    return Err(HandlerError::retry_in(
                        PAUSED_WAIT,
                        "the endpoint is disabled; the delivery waits for it to be enabled",
                    ));
                }
                let started = Instant::now();
                let answer = self
                    .probed_send(&endpoint, &delivery, event.id, attempt)
                    .await?;
                self.keep(event, &delivery, &endpoint.name, attempt, started, &answer);
                self.judge(&endpoint.name, event.id, attempt, &answer)
                    .map(|()| answer.map(|a| a.status).unwrap_or_default())
            })
            .await?;
        tracing::debug!(event_id = %event.id, endpoint = %delivery.endpoint, status, "webhook delivered");
        Ok(())
    }

    /// A delivery needs no transaction: its send is an effect through the ledger and its
    /// endpoint a read, so a batch's deliveries (one per endpoint and record) are sent side by
    /// side.
    fn runs_without_tx(&self) -> bool {
        true
    }
}

impl WebhookDelivery {
    /// Sends, unless the endpoint gave no answer and another delivery of this process is
    /// probing it (`probe.rs`): then the delivery is not sent and fails like the send would
    /// have. It does not wait for that probe, also beside others of its batch: every worker
    /// whose batch held a delivery to the endpoint would then wait for the one probe. A slow
    /// endpoint with its share of sends in flight is not sent to either: the delivery is
    /// snoozed (`Err`), not counted, and comes back after one to two of its answer times (the
    /// answer time held to 1 s..1 min first). An endpoint that asked this process to wait
    /// (`Retry-After` on a slow-down status) is not sent to until then: the delivery is snoozed
    /// until about that time, not counted.
    async fn probed_send(
        &self,
        endpoint: &webhooks::WebhookEndpoint,
        delivery: &Delivery,
        id: EventId,
        attempt: i32,
    ) -> Result<Result<Answer, SendError>, HandlerError> {
        let failing = endpoint.consecutive_failures > 0;
        let _probe = match self.probes.admit(&endpoint.name, failing) {
            Admission::Send(probe) => probe,
            Admission::Hold(since) => {
                return Ok(Err(SendError::Held(format!(
                    "the endpoint has given this process no answer for {}s; one delivery at a time probes it",
                    since.elapsed().as_secs()
                ))));
            }
            Admission::Throttled(left) => {
                // Back once its time is up, spread over a quarter of it more: the receiver
                // asked for the wait, so none comes before it.
                return Err(HandlerError::snooze(
                    left.min(outbox_events::MAX_SNOOZE)
                        .mul_f64(1.125 + 0.125 * jitter(id, attempt)),
                    format!(
                        "not sent: the endpoint asked this process to wait (Retry-After), {:.1}s left",
                        left.as_secs_f64()
                    ),
                ));
            }
            Admission::Busy(sending, answer) => {
                // About one answer's time, spread over up to twice that: the waiting deliveries
                // come back about as often as a send ends, not every second.
                let wait = answer.clamp(SLOW_WAIT_MIN, SLOW_WAIT_MAX);
                return Err(HandlerError::snooze(
                    wait.mul_f64(1.5 + 0.5 * jitter(id, attempt)),
                    format!(
                        "not sent: the endpoint answers slowly (in {:.1}s) and {sending} sends to it from this process are in flight",
                        answer.as_secs_f64()
                    ),
                ));
            }
        };
        let started = Instant::now();
        let answer = self.send(endpoint, delivery, attempt).await;
        match &answer {
            Ok(a) => {
                let asked = match classify(a.status) {
                    Outcome::SlowDown => a.retry_after.map(|d| self.config.bounded_retry_after(d)),
                    _ => None,
                };
                self.probes
                    .answered(&endpoint.name, started.elapsed(), asked);
            }
            Err(e) if e.silent() => self.probes.silent(&endpoint.name, started),
            Err(_) => {}
        }
        Ok(answer)
    }

    /// Queues the attempt's record.
    fn keep(
        &self,
        event: &OutboxEvent,
        delivery: &Delivery,
        endpoint: &str,
        attempt: i32,
        started: Instant,
        answer: &Result<Answer, SendError>,
    ) {
        let delivered = matches!(answer, Ok(a) if classify(a.status) == Outcome::Delivered);
        let record = DeliveryAttempt {
            endpoint: endpoint.to_string(),
            event_id: event.id,
            source_event_id: delivery.source_event_id.parse().unwrap_or_default(),
            attempt,
            at: None,
            status_code: answer.as_ref().ok().map(|a| i32::from(a.status)),
            latency_ms: i32::try_from(started.elapsed().as_millis()).unwrap_or(i32::MAX),
            response_body: answer.as_ref().ok().map(|a| a.body.clone()),
            error: match answer {
                Ok(a) if !delivered => Some(format!("HTTP {}", a.status)),
                Ok(_) => None,
                Err(e) => Some(e.to_string()),
            },
        };
        self.side.send(SideWrite::Attempt(record, delivered));
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
    fn jitter_spreads_deliveries_and_replays_the_same() {
        let all: Vec<f64> = (0..1000u128)
            .map(|n| jitter(EventId::from_u128(n * 7919), (n % 9) as i32))
            .collect();
        assert!(all.iter().all(|j| (-1.0..=1.0).contains(j)));
        let below = all.iter().filter(|j| **j < 0.0).count();
        assert!(
            (300..700).contains(&below),
            "{below} of 1000 below 0: not spread"
        );
        assert_eq!(
            jitter(EventId::from_u128(42), 3),
            jitter(EventId::from_u128(42), 3)
        );
    }
}
