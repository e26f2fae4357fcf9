//! `outbox-demo --relay nats://…`: the NATS JetStream relay as a second consumer of the demo's
//! outbox. Each application write also enqueues its record's change (`account.changed`,
//! `lead.changed`) in its transaction; the relay's dispatcher claims those types only, the
//! demo's handlers every other type, both at once on the same table. After the run the stream is
//! read back from NATS and audited against the outbox: every processed change exactly once (by
//! `Nats-Msg-Id`), each record's changes in enqueue order, nothing else.

use std::sync::Arc;

use anyhow::{Context, Result};
use outbox_events::persistence::{EventFilter, EventStatus};
use outbox_events::{
    DispatchMode, DispatcherHandle, MetricsSnapshot, OutboxRepository, WorkerConfig,
};
use outbox_relay::{Expected, NatsConnect, Relay, RelayConfig, StreamSpec, audit, read_stream};
use serde::Serialize;

use crate::commands::demo_worker_config;
use crate::verify::Check;
use crate::workload::FEED_TYPES;

/// The subject prefix of the demo's stream: `demo.account.changed`, `demo.lead.changed`.
pub const SUBJECT_PREFIX: &str = "demo";
/// Relay workers.
const RELAY_WORKERS: usize = 4;

/// What the relay did and what the stream read back from NATS holds.
#[derive(Debug, Serialize)]
pub struct RelayReport {
    /// The server, credentials redacted.
    pub url: String,
    /// The stream.
    pub stream: String,
    /// Change-feed rows in the outbox.
    pub events: usize,
    /// Of them, `processed`.
    pub processed: usize,
    /// Messages this run added to the stream, read back from NATS.
    pub messages: usize,
    /// Publishes acked as new by the stream.
    pub published: u64,
    /// Publishes the stream dropped as duplicates.
    pub duplicates: u64,
    /// Publishes that failed or were not acked in time (retried).
    pub failures: u64,
    /// The audit of the stream against the outbox.
    pub audit: outbox_relay::StreamAudit,
}

/// The running relay of a demo run.
pub struct DemoRelay {
    relay: Relay,
    url: String,
    first_sequence: u64,
    handle: DispatcherHandle,
}

impl DemoRelay {
    /// Connects to `url`, creates the stream unless it exists, notes where this run's messages
    /// start, and starts the relay's dispatcher over `repo`.
    pub async fn start(url: &str, stream: &str, repo: Arc<dyn OutboxRepository>) -> Result<Self> {
        let connect = NatsConnect::new(url);
        let client = connect.connect().await?;
        let relay = Relay::new(client, RelayConfig::new(stream, SUBJECT_PREFIX, FEED_TYPES))?;
        let worker = demo_worker_config(DispatchMode::Pull).with_workers(RELAY_WORKERS);
        relay
            .create_stream(&StreamSpec::for_relay(relay.config(), &worker))
            .await?;
        let mut info = relay
            .jetstream()
            .get_stream(stream)
            .await
            .context("reading the stream")?;
        let last = info
            .info()
            .await
            .context("reading the stream")?
            .state
            .last_sequence;
        let (dispatcher, _) = relay.dispatcher(repo, worker).await?;
        let handle = dispatcher.start().await?;
        Ok(Self {
            relay,
            url: connect.shown_url(),
            first_sequence: last + 1,
            handle,
        })
    }

    /// The demo's own workers: every event type but the relay's.
    pub fn scope_out(config: WorkerConfig) -> WorkerConfig {
        config.with_scope(outbox_events::Scope::Except(
            FEED_TYPES.iter().map(|t| t.to_string()).collect(),
        ))
    }

    /// Stops the relay (the queue is drained), reads this run's messages back from NATS and
    /// audits them against the outbox. Returns the report, its checks and the relay workers'
    /// counters.
    pub async fn finish(
        self,
        repo: &Arc<dyn OutboxRepository>,
    ) -> Result<(RelayReport, Vec<Check>, MetricsSnapshot)> {
        let metrics = self.handle.shutdown().await.metrics;
        let stream = self.relay.config().stream.clone();
        let messages: Vec<_> = read_stream(self.relay.jetstream(), &stream)
            .await?
            .into_iter()
            .filter(|m| m.sequence >= self.first_sequence)
            .collect();
        let mut rows = Vec::new();
        for t in FEED_TYPES {
            rows.extend(repo.list_events(EventFilter::new().event_type(t)).await?);
        }
        rows.sort_by_key(|r| (r.created_date, r.id));
        let expected: Vec<Expected> = rows
            .iter()
            .filter(|r| r.status == EventStatus::Processed)
            .map(|r| Expected {
                id: r.id.to_string(),
                record_key: r.record_key.as_ref().map(|k| k.as_str().to_string()),
            })
            .collect();
        let audit = audit(&messages, &expected);
        let m = self.relay.metrics();
        let report = RelayReport {
            url: self.url,
            stream,
            events: rows.len(),
            processed: expected.len(),
            messages: messages.len(),
            published: m.published,
            duplicates: m.duplicates,
            failures: m.failures,
            audit,
        };
        let checks = checks(&report);
        Ok((report, checks, metrics))
    }
}

/// The stream's invariants, read back from NATS.
fn checks(r: &RelayReport) -> Vec<Check> {
    let a = &r.audit;
    vec![
        Check {
            name: "relay: every processed change in the stream exactly once",
            ok: r.processed == r.events
                && a.missing.is_empty()
                && a.duplicated.is_empty()
                && a.unexpected.is_empty(),
            detail: format!(
                "{} of {} changes processed; {} messages read back from stream {}: {} missing, {} duplicated, {} of no processed change",
                r.processed,
                r.events,
                r.messages,
                r.stream,
                a.missing.len(),
                a.duplicated.len(),
                a.unexpected.len()
            ),
        },
        Check {
            name: "relay: each record's changes in the stream in enqueue order",
            ok: a.out_of_order.is_empty(),
            detail: format!("{} out of order", a.out_of_order.len()),
        },
    ]
}
