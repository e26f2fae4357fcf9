//! The relay put together: a JetStream context whose waits are bounded by the ack timeout, one
//! [`RelayHandler`] per relayed event type registered with its consumer declaration, and a
//! [`Dispatcher`] that claims the relay's event types only and starts after the stream check.

use std::sync::Arc;

use async_nats::jetstream::context::{Context, ContextBuilder};
use outbox_events::persistence::{EventFilter, EventStatus};
use outbox_events::{Dispatcher, Handlers, OutboxRepository, WorkerConfig};

use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::handler::{RelayHandler, RelayMetrics, RelayMetricsSnapshot};
use crate::stream::{self, StreamCheck, StreamSpec};

/// A relay over one NATS connection.
#[derive(Clone)]
pub struct Relay {
    jetstream: Context,
    config: RelayConfig,
    metrics: Arc<RelayMetrics>,
}

impl Relay {
    /// A relay publishing through `client` as `config` says (checked by
    /// [`RelayConfig::validate`]).
    pub fn new(client: async_nats::Client, config: RelayConfig) -> Result<Self, RelayError> {
        config.validate()?;
        let jetstream = ContextBuilder::new()
            .timeout(config.ack_timeout)
            .backpressure_on_inflight(true)
            .build(client);
        Ok(Self {
            jetstream,
            config,
            metrics: Arc::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// The JetStream context (to read the stream back, for example).
    pub fn jetstream(&self) -> &Context {
        &self.jetstream
    }

    /// The publish counters.
    pub fn metrics(&self) -> RelayMetricsSnapshot {
        self.metrics.snapshot()
    }

    /// One handler per relayed event type, each registered with its consumer declaration
    /// (judged by the rollout gate; `worker`'s settings give the window it names).
    pub fn handlers(&self, worker: &WorkerConfig) -> Handlers {
        let mut handlers = Handlers::new();
        for consumer in self.config.consumers(worker) {
            let handler = RelayHandler::new(
                self.jetstream.clone(),
                self.config.subject_for(&consumer.event_type),
                self.config.stream.clone(),
                self.config.ack_timeout,
                self.metrics.clone(),
            );
            handlers = handlers.register_with_broker_dedup(consumer, handler);
        }
        handlers
    }

    /// `worker` restricted to the relay's event types: the relay never claims another type.
    pub fn worker_config(&self, worker: WorkerConfig) -> WorkerConfig {
        worker.with_scope(self.config.scope())
    }

    /// Creates the stream from `spec` unless it exists (an existing stream is left as it is);
    /// `true` when created.
    pub async fn create_stream(&self, spec: &StreamSpec) -> Result<bool, RelayError> {
        stream::create_stream(&self.jetstream, &self.config, spec).await
    }

    /// Checks the stream against `worker`'s settings (see [`stream::check_stream`]).
    pub async fn check_stream(&self, worker: &WorkerConfig) -> Result<StreamCheck, RelayError> {
        stream::check_stream(&self.jetstream, &self.config, worker).await
    }

    /// Checks the stream, then builds the dispatcher that relays: the relay's handlers, its
    /// scope, `worker`'s settings. It refuses (and says why) when the stream cannot keep the
    /// promise. Start it as any dispatcher (`Dispatcher::start`: the rollout gate judges the
    /// relay's declarations and the rows' record keys).
    pub async fn dispatcher(
        &self,
        repo: Arc<dyn OutboxRepository>,
        worker: WorkerConfig,
    ) -> Result<(Dispatcher, StreamCheck), RelayError> {
        let check = self.check_stream(&worker).await?;
        for warning in &check.warnings {
            tracing::warn!(stream = %check.stream, "{warning}");
        }
        let handlers = self.handlers(&worker);
        let dispatcher = Dispatcher::new(repo, handlers, self.worker_config(worker));
        Ok((dispatcher, check))
    }
}

/// Rows of the relayed event types still `pending` or `processing` (at most one per type is
/// read: zero means the relay's share of the queue is drained).
pub async fn relayed_rows_left(
    repo: &Arc<dyn OutboxRepository>,
    config: &RelayConfig,
) -> Result<u64, RelayError> {
    let mut left = 0;
    for event_type in &config.event_types {
        let filter = EventFilter::new()
            .statuses([EventStatus::Pending, EventStatus::Processing])
            .event_type(event_type.clone())
            .limit(1);
        left += repo.list_events(filter).await?.len() as u64;
    }
    Ok(left)
}
