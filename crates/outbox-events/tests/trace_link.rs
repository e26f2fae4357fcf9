//! The enqueue → attempt trace link on a real SQLite outbox, exported through
//! `tracing-opentelemetry` into OpenTelemetry's in-memory exporter: an event enqueued inside a
//! traced span gets that span's `traceparent` in its envelope, and its attempt span carries the
//! field and a link to the enqueueing trace; a caller's own `traceparent` is kept; an invalid
//! one is ignored and the event still runs; an event enqueued outside any trace stays as given.

use std::collections::HashMap;

use opentelemetry::trace::{TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_events::{
    AttemptContext, AttemptOutcome, ClaimRunner, ConnectConfig, Database, Handler, HandlerError,
    Handlers, NewEvent, OutboxEvent, OutboxRepository, Scope, TraceParent, WorkerConfig,
    async_trait,
};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

const EVENT_TYPE: &str = "contact.requested";
/// A trace of the caller's own, set in the payload before enqueue.
const CALLERS: &str = "00-11111111111111111111111111111111-2222222222222222-01";

struct Noop;

#[async_trait]
impl Handler for Noop {
    async fn handle(
        &self,
        _: &OutboxEvent,
        _: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn payload(record: &str, extra: &str) -> String {
    format!(r#"{{{extra}"object":"Contact","record_id":"{record}","snapshot":{{}}}}"#)
}

async fn sqlite() -> (Database, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!(
        "outbox-events-trace-{}-{}.db",
        std::process::id(),
        uuid::Uuid::now_v7().simple()
    ));
    let url = format!("sqlite://{}", path.display());
    let db = Database::connect(&url, ConnectConfig::default())
        .await
        .unwrap();
    db.migrate().await.unwrap();
    (db, path)
}

async fn enqueue_one(repo: &dyn OutboxRepository, payload: String) {
    let mut tx = repo.begin().await.unwrap();
    outbox_events::enqueue(repo, &mut tx, &[NewEvent::new(EVENT_TYPE, payload)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

#[tokio::test]
async fn an_attempt_links_to_the_trace_that_enqueued_its_event() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("trace-link-test")));
    // A current-thread runtime: the default subscriber covers every task of the test.
    let _default = tracing::subscriber::set_default(subscriber);

    let (db, path) = sqlite().await;
    let repo = db.repository();
    let request = tracing::info_span!("contact.request");
    let enqueuing_trace = request.context().span().span_context().trace_id();
    assert_ne!(enqueuing_trace, TraceId::INVALID, "the layer is installed");
    {
        let _entered = request.enter();
        enqueue_one(&*repo, payload("traced", "")).await;
        enqueue_one(
            &*repo,
            payload("callers", &format!(r#""traceparent":"{CALLERS}","#)),
        )
        .await;
        enqueue_one(
            &*repo,
            payload("invalid", r#""traceparent":"00-nonsense","#),
        )
        .await;
    }
    drop(request);
    enqueue_one(&*repo, payload("untraced", "")).await;

    let handlers = Handlers::new().register(EVENT_TYPE, Noop);
    let config = WorkerConfig::default();
    let runner = ClaimRunner::new(repo.clone(), handlers, config.clone());
    let mut payloads = HashMap::new();
    while let Some(claim) = repo
        .claim_next(config.claim_policy(), &Scope::All)
        .await
        .unwrap()
    {
        payloads.insert(claim.event.id.to_string(), claim.event.payload.clone());
        assert_eq!(runner.run(claim).await, AttemptOutcome::Processed);
    }
    assert_eq!(payloads.len(), 4);

    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let attempts: HashMap<String, &SpanData> = spans
        .iter()
        .filter(|s| s.name == "outbox.attempt")
        .map(|s| (attribute(s, "record_key").unwrap(), s))
        .collect();
    assert_eq!(attempts.len(), 4, "one attempt span per event");
    let links = |key: &str| -> Vec<(TraceId, String)> {
        attempts[key]
            .links
            .iter()
            .map(|l| {
                (
                    l.span_context.trace_id(),
                    l.span_context.span_id().to_string(),
                )
            })
            .collect()
    };

    // Enqueued inside the request's span: its trace, its span as the parent id.
    let traced = &attempts["contact:traced"];
    let field = attribute(traced, "traceparent").expect("the field is recorded");
    let tp = TraceParent::parse(&field).unwrap();
    assert_eq!(tp.trace_id(), enqueuing_trace.to_bytes());
    assert_eq!(links("contact:traced").len(), 1);
    assert_eq!(links("contact:traced")[0].0, enqueuing_trace);
    assert_ne!(
        traced.span_context.trace_id(),
        enqueuing_trace,
        "a link, not a parent: the attempt is a trace of its own"
    );

    // The caller's own traceparent wins over the current span's.
    assert_eq!(
        attribute(attempts["contact:callers"], "traceparent").as_deref(),
        Some(CALLERS)
    );
    let callers = links("contact:callers");
    assert_eq!(callers.len(), 1);
    assert_eq!(
        callers[0],
        (
            TraceId::from_hex("11111111111111111111111111111111").unwrap(),
            "2222222222222222".to_string()
        )
    );

    // An invalid one is ignored (no field, no link) and the event ran all the same.
    assert_eq!(attribute(attempts["contact:invalid"], "traceparent"), None);
    assert!(links("contact:invalid").is_empty());

    // Outside any trace nothing is injected.
    assert_eq!(attribute(attempts["contact:untraced"], "traceparent"), None);
    assert!(links("contact:untraced").is_empty());
    assert!(
        payloads
            .values()
            .filter(|p| p.contains("traceparent"))
            .count()
            == 3,
        "only the traced, the caller's and the invalid payload carry one: {payloads:?}"
    );

    db.close().await;
    for suffix in ["", "-wal", "-shm"] {
        std::fs::remove_file(format!("{}{suffix}", path.display())).ok();
    }
}
