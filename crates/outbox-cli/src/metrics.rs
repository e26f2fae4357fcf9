//! `--metrics-addr`: the Prometheus scrape endpoint of a binary that runs workers (the demo's
//! `work`, the relay), over the `metrics` facade the workers record into, served by
//! `outbox_events::prometheus` (the outbox's histograms get fixed buckets: real Prometheus
//! histograms, aggregatable across processes); the queue gauges are refreshed by one read of
//! the queue per interval.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use outbox_events::WorkerConfig;

/// The outbox's histogram buckets, now in `outbox_events` (kept here for callers of earlier
/// releases).
pub use outbox_events::SECONDS_BUCKETS;

/// The metrics options of a binary that runs workers.
#[derive(Debug, Clone, Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at this address (for example 127.0.0.1:9464); off when absent.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// How often the queue gauges (rows by status, oldest pending age, stale claims, blocked
    /// keys) are refreshed, in milliseconds: one read of the queue each time.
    #[arg(long, default_value_t = 15_000)]
    pub gauges_every_ms: u64,
}

impl MetricsArgs {
    /// Installs the exporter when `--metrics-addr` is given (call it inside the runtime).
    pub fn install(&self) -> Result<()> {
        if let Some(addr) = self.metrics_addr {
            serve_prometheus(addr)?;
        }
        Ok(())
    }

    /// `config` with the queue gauges on when metrics are served.
    pub fn apply(&self, config: WorkerConfig) -> WorkerConfig {
        match self.metrics_addr {
            Some(_) => {
                config.with_queue_gauges(Duration::from_millis(self.gauges_every_ms.max(100)))
            }
            None => config,
        }
    }
}

/// Installs the Prometheus recorder as the process's `metrics` recorder and serves it over
/// HTTP at `addr` (any path answers): `outbox_events::prometheus::serve`, which an embedding
/// service calls without this crate. Call it once, inside the Tokio runtime.
pub fn serve_prometheus(addr: SocketAddr) -> Result<()> {
    outbox_events::prometheus::serve(addr).with_context(|| format!("serving metrics at {addr}"))
}
