//! An example service that embeds the outbox crates the way a platform team does (see
//! `docs/embedding.md`): its own tables and sqlx migrations next to the outbox's, an enqueue in
//! the transaction that writes its own record, a handler that creates one contact per email with
//! `FindOrCreate`, pull workers behind the rollout gate (`OUTBOX_PULL_WORKER=true`), and a
//! graceful shutdown on SIGTERM or Ctrl-C.
//!
//! `contact-service DATABASE_URL [REQUESTS]` writes REQUESTS contact requests (over fewer
//! distinct emails, so that several requests meet one contact), runs the workers until the
//! queue is drained or a signal arrives, and checks the result from the database.
//!
//! With the `otel` feature (`cargo run -p contact-service --features otel -- URL`) it also
//! exports its `tracing` spans to OpenTelemetry: each request is enqueued in a span whose W3C
//! `traceparent` goes into the event's envelope, and every attempt span links back to it
//! (`otel.rs`).

#[cfg(feature = "otel")]
mod otel;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use create_action::{ColumnType, Effect, FindOrCreate, ObjectDef, Source};
use outbox_events::persistence::sqlx::migrate::Migrator;
use outbox_events::{
    AttemptContext, CancellationToken, ConnectConfig, Consumer, Database, Dispatcher, Handler,
    HandlerError, Handlers, NewEvent, OutboxEvent, WorkerConfig, async_trait, with_pool, with_tx,
};

/// The event a contact request enqueues.
pub const CONTACT_REQUESTED: &str = "contact.requested";

/// Finds or creates the contact of a request's email.
pub struct CreateContact {
    action: FindOrCreate,
}

impl CreateContact {
    /// The action over the service's `contact` table.
    pub fn new() -> Result<Self> {
        let contact = Arc::new(
            ObjectDef::builder("contact")
                .natural_key("email", ColumnType::Text)
                .field("name", ColumnType::Text)
                .autonumber("contact_number")
                .build()?,
        );
        let action = FindOrCreate::builder(contact)
            .key("email", Source::snapshot("email"))
            .field("name", Source::snapshot("name"))
            .build()?;
        Ok(Self { action })
    }

    /// The consumer declaration, from the action's own classification (a natural-key create:
    /// safe under redelivery, so the rollout gate passes).
    pub fn consumer(&self) -> Consumer {
        self.action.effect_class().declare(
            Consumer::new("contact-create", CONTACT_REQUESTED),
            "one contact per email, numbered when created",
        )
    }
}

#[async_trait]
impl Handler for CreateContact {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let envelope = create_action::EventEnvelope::parse(&event.payload)
            .map_err(|e| HandlerError::permanent_from("unreadable payload", e))?;
        let action = &self.action;
        with_tx!(ctx.tx(), |conn| action
            .run(conn, &envelope)
            .await
            .map(|_| ()))?;
        Ok(())
    }
}

/// Applies the service's migrations (sqlx's default table) and the outbox's (its own table).
pub async fn migrate(db: &Database) -> Result<()> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
    let service = Migrator::new(std::path::Path::new(dir)).await?;
    with_pool!(db, |pool| service.run(pool).await)?;
    db.migrate().await?;
    db.check_schema().await?;
    Ok(())
}

/// Writes one contact request and its event in one transaction of the service's own.
pub async fn request_contact(db: &Database, id: &str, email: &str, name: &str) -> Result<()> {
    let repo = db.repository();
    let mut tx = repo.begin().await?;
    with_tx!(&mut tx, |conn| {
        outbox_events::persistence::sqlx::query(
            "INSERT INTO contact_request (id, email, name) VALUES ($1, $2, $3)",
        )
        .bind(id)
        .bind(email)
        .bind(name)
        .execute(conn)
        .await
        .map(|done| done.rows_affected())
    })?;
    let payload = format!(
        r#"{{"object":"ContactRequest","record_id":"{id}","snapshot":{{"email":"{email}","name":"{name}"}}}}"#
    );
    // `outbox_events::enqueue` is `repo.enqueue` plus the caller's trace context (with the
    // `otel` feature, inside a traced span): the attempt spans link back to this request.
    outbox_events::enqueue(
        &*repo,
        &mut tx,
        &[NewEvent::new(CONTACT_REQUESTED, payload)],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

async fn count(db: &Database, sql: &'static str) -> Result<i64> {
    Ok(with_pool!(db, |pool| {
        outbox_events::persistence::sqlx::query_scalar(sql)
            .fetch_one(pool)
            .await
    })?)
}

/// Cancels `stop` on SIGTERM or Ctrl-C.
fn on_signal(stop: CancellationToken) {
    tokio::spawn(async move {
        #[cfg(unix)]
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut term) => {
                    term.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let term = std::future::pending::<()>();
        tokio::select! {
            _ = term => eprintln!("SIGTERM: finishing in-flight attempts"),
            _ = tokio::signal::ctrl_c() => eprintln!("interrupted: finishing in-flight attempts"),
        }
        stop.cancel();
    });
}

/// The pull workers this service runs.
const WORKERS: usize = 4;

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .context("usage: contact-service DATABASE_URL [REQUESTS]")?;
    let requests: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(200);
    #[cfg(feature = "otel")]
    let tracing = otel::install()?;
    // The pool the workers need (`workers + 3`); the requests below run before they start.
    let db = Database::connect(&url, ConnectConfig::for_workers(WORKERS)).await?;
    migrate(&db).await?;
    let emails = (requests / 4).max(1);
    for i in 0..requests {
        let n = i % emails;
        let (id, email, name) = (
            format!("req-{i}"),
            format!("c{n}@example.com"),
            format!("Contact {n}"),
        );
        let request = request_contact(&db, &id, &email, &name);
        #[cfg(feature = "otel")]
        let request = tracing::Instrument::instrument(request, otel::request_span(&id));
        request.await?;
    }
    let action = CreateContact::new()?;
    let handlers = Handlers::new().register_consumer(action.consumer(), action);
    let stop = CancellationToken::new();
    on_signal(stop.clone());
    let handle = Dispatcher::new(
        db.repository(),
        handlers,
        WorkerConfig::default().with_workers(WORKERS),
    )
    .with_stop_token(stop.clone())
    .start()
    .await?;
    println!("dispatcher: {:?} mode", handle.decision().mode);
    let drained = handle.drained(Duration::from_millis(50)).await?;
    stop.cancel();
    let report = handle.shutdown().await;
    println!(
        "{} processed, {} retried, {} failed; graceful shutdown: {}",
        report.metrics.processed, report.metrics.retried, report.metrics.failed, report.graceful
    );
    if !drained {
        println!("stopped before the queue drained");
        return Ok(());
    }
    let contacts = count(&db, "SELECT count(*) FROM contact").await?;
    let numbers = count(&db, "SELECT count(DISTINCT contact_number) FROM contact").await?;
    let top = count(&db, "SELECT coalesce(max(contact_number), 0) FROM contact").await?;
    println!("{requests} requests over {emails} emails: {contacts} contacts, numbered 1..={top}");
    if contacts != emails as i64 || numbers != contacts || top != contacts {
        bail!("expected {emails} contacts numbered 1..={emails}");
    }
    #[cfg(feature = "otel")]
    tracing.check_links(report.metrics.processed)?;
    db.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handler run twice on one event (a redelivery), against a real SQLite transaction
    /// through the test kit: one contact, one number.
    #[tokio::test]
    async fn a_redelivered_request_creates_one_contact() {
        let path = std::env::temp_dir().join(format!("contact-service-{}.db", std::process::id()));
        let db = Database::connect(
            &format!("sqlite://{}", path.display()),
            ConnectConfig::default(),
        )
        .await
        .unwrap();
        migrate(&db).await.unwrap();
        let event = OutboxEvent::for_test(
            CONTACT_REQUESTED,
            r#"{"object":"ContactRequest","record_id":"r1","snapshot":{"email":"a@example.com","name":"A"}}"#,
        );
        let handler = CreateContact::new().unwrap();
        let repo = db.repository();
        for _ in 0..2 {
            let mut tx = repo.begin().await.unwrap();
            handler
                .handle(&event, &mut AttemptContext::new(&mut tx))
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
        assert_eq!(count(&db, "SELECT count(*) FROM contact").await.unwrap(), 1);
        assert_eq!(
            count(&db, "SELECT max(contact_number) FROM contact")
                .await
                .unwrap(),
            1
        );
        db.close().await;
        for suffix in ["", "-wal", "-shm"] {
            std::fs::remove_file(format!("{}{suffix}", path.display())).ok();
        }
    }
}
