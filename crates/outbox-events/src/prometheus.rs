//! The Prometheus recorder with the outbox's histogram buckets (feature `prometheus`), without
//! the operator binary's command line or the relay.
//!
//! The outbox records through the `metrics` facade; a process has one global recorder. A
//! service without an exporter of its own serves the outbox's series with [`serve`]. A service
//! that builds its own `PrometheusBuilder` passes it through [`with_outbox_buckets`] before it
//! installs it, so the outbox's histograms are real Prometheus histograms (aggregatable across
//! processes) instead of summaries, and its own metrics keep their settings:
//!
//! ```no_run
//! use outbox_events::prometheus::{exporter::PrometheusBuilder, with_outbox_buckets};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let handle = with_outbox_buckets(PrometheusBuilder::new())?.install_recorder()?;
//! outbox_events::describe_metrics();
//! // … serve `handle.render()` from the service's own HTTP endpoint.
//! # Ok(()) }
//! ```
//!
//! A service on another recorder (OpenTelemetry metrics, StatsD) gives the names in
//! [`crate::HISTOGRAMS`] the bounds in [`crate::SECONDS_BUCKETS`] its own way.

use std::net::SocketAddr;

/// The exporter crate (`metrics-exporter-prometheus`, the version this crate is built with), so
/// a service needs no dependency line of its own for it.
pub use metrics_exporter_prometheus as exporter;
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};

use crate::metrics::{HISTOGRAMS, SECONDS_BUCKETS};

/// `builder` with [`SECONDS_BUCKETS`] for each of the outbox's histograms ([`HISTOGRAMS`], by
/// full name: the service's own histograms are left as it configured them).
pub fn with_outbox_buckets(builder: PrometheusBuilder) -> Result<PrometheusBuilder, BuildError> {
    HISTOGRAMS.iter().try_fold(builder, |builder, name| {
        builder.set_buckets_for_metric(Matcher::Full((*name).to_string()), SECONDS_BUCKETS)
    })
}

/// Installs the Prometheus recorder (with the outbox's buckets) as the process's `metrics`
/// recorder, serves it over HTTP at `addr` (any path answers) and describes the outbox's
/// series. Call it once, inside the Tokio runtime; it fails when a recorder is installed
/// already or the address cannot be bound.
pub fn serve(addr: SocketAddr) -> Result<(), BuildError> {
    with_outbox_buckets(PrometheusBuilder::new())?
        .with_http_listener(addr)
        .install()?;
    crate::describe_metrics();
    tracing::info!(%addr, "serving Prometheus metrics");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The outbox's histograms get the buckets; a service's own histogram keeps the
    /// exporter's default (a summary).
    #[test]
    fn outbox_histograms_get_buckets_and_others_keep_theirs() {
        let recorder = with_outbox_buckets(PrometheusBuilder::new())
            .unwrap()
            .build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            metrics::histogram!(crate::metric_names::HANDLER_DURATION, "event_type" => "t")
                .record(0.003);
            metrics::histogram!("service_request_seconds").record(0.003);
        });
        let text = handle.render();
        assert!(
            text.contains(
                "outbox_handler_duration_seconds_bucket{event_type=\"t\",le=\"0.005\"} 1"
            ),
            "{text}"
        );
        assert!(!text.contains("service_request_seconds_bucket"), "{text}");
        assert!(text.contains("service_request_seconds{quantile="), "{text}");
    }
}
