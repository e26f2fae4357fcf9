//! The `otel` feature: the service's `tracing` spans exported to OpenTelemetry through
//! `tracing-opentelemetry`, the way `docs/embedding.md` describes. Each contact request is
//! enqueued inside a `contact.request` span, so `outbox_events::enqueue` writes that span's
//! W3C `traceparent` into the event's envelope, and the worker's `outbox.attempt` span links
//! back to it.
//!
//! No collector runs here, so the exporter keeps the finished spans in memory and
//! [`Tracing::check_links`] reports (and checks) the enqueue → attempt links; a real service
//! puts `opentelemetry-otlp`'s exporter where [`Collector`] is.

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};

use anyhow::{Result, bail};
use opentelemetry::trace::{TraceId, TracerProvider as _};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing_subscriber::layer::SubscriberExt;

/// The name of the span each contact request is enqueued in.
pub const REQUEST_SPAN: &str = "contact.request";

/// An exporter that keeps the spans it is given (in place of an OTLP exporter).
#[derive(Debug, Clone, Default)]
pub struct Collector(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Collector {
    fn export(&self, batch: Vec<SpanData>) -> impl Future<Output = OTelSdkResult> + Send {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend(batch);
        std::future::ready(Ok(()))
    }
}

/// The installed tracing pipeline.
pub struct Tracing {
    provider: SdkTracerProvider,
    spans: Collector,
}

/// Installs `tracing-opentelemetry`'s layer, over an OpenTelemetry tracer provider, as the
/// process's `tracing` subscriber.
pub fn install() -> Result<Tracing> {
    let spans = Collector::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(spans.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("contact-service"));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))?;
    Ok(Tracing { provider, spans })
}

/// The span a request is enqueued in.
pub fn request_span(id: &str) -> tracing::Span {
    tracing::info_span!(REQUEST_SPAN, request_id = id)
}

impl Tracing {
    /// Flushes the spans and checks that every processed attempt links to the trace of the
    /// request that enqueued it; prints the counts.
    pub fn check_links(self, processed: u64) -> Result<()> {
        self.provider.force_flush()?;
        let spans = self.spans.0.lock().unwrap_or_else(|p| p.into_inner());
        let requests: HashSet<TraceId> = spans
            .iter()
            .filter(|s| s.name == REQUEST_SPAN)
            .map(|s| s.span_context.trace_id())
            .collect();
        let attempts: Vec<&SpanData> = spans
            .iter()
            .filter(|s| s.name == "outbox.attempt")
            .collect();
        let linked = attempts
            .iter()
            .filter(|a| {
                a.links
                    .iter()
                    .any(|l| requests.contains(&l.span_context.trace_id()))
            })
            .count();
        println!(
            "otel: {} {REQUEST_SPAN} traces, {} outbox.attempt spans, {linked} linked to the \
             request that enqueued their event",
            requests.len(),
            attempts.len()
        );
        if (attempts.len() as u64) < processed || linked != attempts.len() {
            bail!("expected every attempt span to link to its request's trace");
        }
        drop(spans);
        self.provider.shutdown()?;
        Ok(())
    }
}
