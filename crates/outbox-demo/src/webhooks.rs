//! `outbox-demo --webhooks`: the webhooks (`outbox-webhooks`) as a second consumer of the demo's
//! outbox. Each application write also enqueues its record's change (`account.changed`,
//! `lead.changed`) in its transaction; a dispatcher of their own fans those out to one endpoint,
//! a receiver in this process on a loopback port, and delivers them, signed, while the demo's
//! handlers run every other type. The receiver checks each request's Standard Webhooks
//! signature itself (HMAC-SHA256 over `{webhook-id}.{webhook-timestamp}.{body}` with the
//! endpoint's secret, computed here from the spec, not by the sender's code) and refuses a bad
//! one with 401. After the run its log is checked against the outbox: every processed change
//! delivered and verified, each record's deliveries in enqueue order, a redelivery only under its
//! event's one `webhook-id`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use anyhow::Result;
use base64::Engine;
use hmac::{Hmac, Mac};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use outbox_events::persistence::{EventFilter, EventStatus, Scope};
use outbox_events::{DispatchMode, Dispatcher, DispatcherHandle, Handlers, MetricsSnapshot};
use outbox_events::{OutboxRepository, WorkerConfig};
use outbox_webhooks::{AddressPolicy, WebhookConfig, Webhooks, delivery_event_type, headers};
use serde::Serialize;

use crate::commands::demo_worker_config;
use crate::verify::Check;
use crate::workload::FEED_TYPES;

/// The demo's endpoint.
pub const ENDPOINT: &str = "demo-receiver";
/// Webhook workers.
const WEBHOOK_WORKERS: usize = 4;

/// What the receiver got, as checked after the run.
#[derive(Debug, Serialize)]
pub struct WebhooksReport {
    /// The receiver's URL.
    pub url: String,
    /// Change-feed rows in the outbox.
    pub events: usize,
    /// Of them, `processed`.
    pub processed: usize,
    /// Requests the receiver got.
    pub requests: usize,
    /// Changes acknowledged (2xx) at least once.
    pub delivered: usize,
    /// Requests whose signature did not verify.
    pub unverified: usize,
    /// Acknowledgements of a change already acknowledged (a redelivery).
    pub redelivered: usize,
    /// Acknowledgements of a record's change after a younger change of that record.
    pub out_of_order: usize,
    /// Changes sent under more than one `webhook-id`.
    pub ids_changed: usize,
}

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Received {
    id: String,
    record: String,
    /// `(CreatedDate µs, event id)` from `outbox-sequence`.
    sequence: (i64, String),
    verified: bool,
}

/// The receiver: verifies, answers 200 (401 when the signature does not verify), keeps a log.
struct Receiver {
    url: String,
    log: Arc<Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

/// Whether `signatures` (the `webhook-signature` header) holds a `v1` signature of
/// `{id}.{timestamp}.{body}` under `secret` (`whsec_` + base64), per the Standard Webhooks
/// spec.
fn verifies(secret: &str, id: &str, timestamp: &str, body: &[u8], signatures: &str) -> bool {
    let b64 = base64::engine::general_purpose::STANDARD;
    let Ok(key) = b64.decode(secret.trim_start_matches("whsec_")) else {
        return false;
    };
    let Ok(mut mac) = Hmac::<sha2::Sha256>::new_from_slice(&key) else {
        return false;
    };
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    let expected = format!("v1,{}", b64.encode(mac.finalize().into_bytes()));
    signatures.split(' ').any(|s| s == expected)
}

impl Receiver {
    async fn start(secret: Arc<Mutex<String>>) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/hooks", listener.local_addr()?);
        let log: Arc<Mutex<Vec<Received>>> = Arc::default();
        let kept = log.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (kept, secret) = (kept.clone(), secret.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        receive(request, kept.clone(), secret.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Self { url, log, task })
    }
}

async fn receive(
    request: hyper::Request<hyper::body::Incoming>,
    log: Arc<Mutex<Vec<Received>>>,
    secret: Arc<Mutex<String>>,
) -> Result<hyper::Response<Full<Bytes>>, hyper::Error> {
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let (id, timestamp, signatures) = (
        header(headers::ID),
        header(headers::TIMESTAMP),
        header(headers::SIGNATURE),
    );
    let (record, sequence) = (header(headers::RECORD), header(headers::SEQUENCE));
    let body = request.into_body().collect().await?.to_bytes();
    let secret = secret.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let verified = verifies(&secret, &id, &timestamp, &body, &signatures);
    let (micros, event) = sequence.split_once('.').unwrap_or(("0", ""));
    log.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Received {
            id,
            record,
            sequence: (micros.parse().unwrap_or(0), event.to_string()),
            verified,
        });
    let mut response = hyper::Response::new(Full::new(Bytes::new()));
    if !verified {
        *response.status_mut() = hyper::StatusCode::UNAUTHORIZED;
    }
    Ok(response)
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The running webhooks of a demo run.
pub struct DemoWebhooks {
    receiver: Receiver,
    handle: DispatcherHandle,
    /// Flushed after the dispatcher stops: the attempt log is complete before it is read.
    hooks: Webhooks,
}

/// The event types the webhooks' dispatcher claims: the change feed and its deliveries.
fn owned_types() -> Vec<String> {
    let mut types: Vec<String> = FEED_TYPES.iter().map(|t| t.to_string()).collect();
    types.push(delivery_event_type(ENDPOINT));
    types
}

impl DemoWebhooks {
    /// Starts the receiver, adds the endpoint on it (loopback allowed, as an operator allows a
    /// subnet) and starts the webhooks' dispatcher over `repo`.
    pub async fn start(repo: Arc<dyn OutboxRepository>) -> Result<Self> {
        let secret = Arc::new(Mutex::new(String::new()));
        let receiver = Receiver::start(secret.clone()).await?;
        let hooks = Webhooks::new(
            repo.clone(),
            WebhookConfig::default()
                .with_addresses(AddressPolicy::default().allow("127.0.0.0/8".parse()?)),
        );
        let (_, made) = hooks.add(ENDPOINT, &receiver.url, &[], "demo").await?;
        *secret.lock().unwrap_or_else(|e| e.into_inner()) = made;
        let worker = demo_worker_config(DispatchMode::Pull)
            .with_workers(WEBHOOK_WORKERS)
            .with_scope(Scope::Only(owned_types()));
        let handlers = hooks.register(Handlers::new(), &FEED_TYPES, &worker)?;
        let handle = Dispatcher::new(repo, handlers, worker).start().await?;
        Ok(Self {
            receiver,
            handle,
            hooks,
        })
    }

    /// The demo's own workers: every event type but the webhooks'.
    pub fn scope_out(config: WorkerConfig) -> WorkerConfig {
        config.with_scope(Scope::Except(owned_types()))
    }

    /// Stops the webhooks' dispatcher (the queue is drained) and checks the receiver's log
    /// against the outbox. Returns the report, its checks and the dispatcher's counters.
    pub async fn finish(
        self,
        repo: &Arc<dyn OutboxRepository>,
    ) -> Result<(WebhooksReport, Vec<Check>, MetricsSnapshot)> {
        let metrics = self.handle.shutdown().await.metrics;
        self.hooks.flush().await;
        let mut rows = Vec::new();
        for t in FEED_TYPES {
            rows.extend(repo.list_events(EventFilter::new().event_type(t)).await?);
        }
        let processed: Vec<String> = rows
            .iter()
            .filter(|r| r.status == EventStatus::Processed)
            .map(|r| outbox_webhooks::webhook_id(&r.id.to_string(), ENDPOINT))
            .collect();
        let log = self
            .receiver
            .log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let report = audit(&self.receiver.url, rows.len(), &processed, &log);
        let checks = checks(&report);
        Ok((report, checks, metrics))
    }
}

fn audit(url: &str, events: usize, processed: &[String], log: &[Received]) -> WebhooksReport {
    let acked: Vec<&Received> = log.iter().filter(|r| r.verified).collect();
    let ids: HashSet<&str> = acked.iter().map(|r| r.id.as_str()).collect();
    let mut last: HashMap<&str, &(i64, String)> = HashMap::new();
    let mut out_of_order = 0;
    for r in &acked {
        if last
            .get(r.record.as_str())
            .is_some_and(|prev| **prev > r.sequence)
        {
            out_of_order += 1;
        }
        last.insert(&r.record, &r.sequence);
    }
    let mut id_of: HashMap<&(i64, String), HashSet<&str>> = HashMap::new();
    for r in log {
        id_of.entry(&r.sequence).or_default().insert(&r.id);
    }
    WebhooksReport {
        url: url.to_string(),
        events,
        processed: processed.len(),
        requests: log.len(),
        delivered: processed
            .iter()
            .filter(|id| ids.contains(id.as_str()))
            .count(),
        unverified: log.len() - acked.len(),
        redelivered: acked.len() - ids.len(),
        out_of_order,
        ids_changed: id_of.values().filter(|ids| ids.len() > 1).count(),
    }
}

/// The receiver's invariants.
fn checks(r: &WebhooksReport) -> Vec<Check> {
    vec![
        Check {
            name: "webhooks: every processed change delivered, every signature verified",
            ok: r.events > 0
                && r.requests > 0
                && r.processed == r.events
                && r.delivered == r.processed
                && r.unverified == 0,
            detail: format!(
                "{} of {} changes processed, {} delivered to {}; {} requests, {} not verified, {} redeliveries",
                r.processed, r.events, r.delivered, r.url, r.requests, r.unverified, r.redelivered
            ),
        },
        Check {
            name: "webhooks: each record's deliveries in enqueue order, one webhook-id per change",
            ok: r.out_of_order == 0 && r.ids_changed == 0,
            detail: format!(
                "{} out of order, {} changes under two ids",
                r.out_of_order, r.ids_changed
            ),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Standard Webhooks spec's example: secret, id, timestamp, body and signature.
    #[test]
    fn the_receiver_verifies_the_specs_example_and_refuses_a_changed_body() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let (id, ts) = ("msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330");
        let body = br#"{"test": 2432232314}"#;
        let signature = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        assert!(verifies(secret, id, ts, body, signature));
        assert!(verifies(
            secret,
            id,
            ts,
            body,
            &format!("v1,other {signature}")
        ));
        assert!(!verifies(
            secret,
            id,
            ts,
            br#"{"test": 2432232315}"#,
            signature
        ));
    }
}
