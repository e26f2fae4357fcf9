//! An example service that embeds the outbox crates the way a platform team does (see
//! `docs/embedding.md`): its own tables and sqlx migrations next to the outbox's, an enqueue in
//! the transaction that writes its own record, a handler that creates one contact per email with
//! `FindOrCreate`, pull workers behind the rollout gate (`OUTBOX_PULL_WORKER=true`), and a
//! graceful shutdown on SIGTERM or Ctrl-C.
//!
//! `contact-service DATABASE_URL [REQUESTS] [--require-pull]` writes REQUESTS contact requests
//! (over fewer distinct emails, so that several requests meet one contact), runs the workers
//! until the queue is drained or a signal arrives, and checks the result from the database and
//! from its Prometheus metrics. Without `--require-pull` it runs pull workers when
//! `OUTBOX_PULL_WORKER` asks for them and the rollout gate passes, and the legacy dispatcher
//! otherwise (the design's fallback); with it, it starts pull workers or exits with the gate's
//! reasons.
//!
//! Everything comes from one import, `outbox_events::prelude`; `sqlx` is a dependency of its
//! own only for `sqlx::migrate!`, which embeds the service's migrations at compile time.
//!
//! With the `otel` feature (`cargo run -p contact-service --features otel -- URL`) it also
//! exports its `tracing` spans to OpenTelemetry: each request is enqueued in a span whose W3C
//! `traceparent` goes into the event's envelope, and every attempt span links back to it
//! (`otel.rs`).

#[cfg(feature = "otel")]
mod otel;

use std::sync::Arc;
use std::time::Duration;

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use create_action::{ColumnType, Effect, FindOrCreate, ObjectDef, Source};
use outbox_events::prelude::*;
use outbox_events::prometheus::exporter::{PrometheusBuilder, PrometheusHandle};

/// The service's migrations, embedded at compile time (so a binary built from the published
/// crate carries them; nothing is read from the source tree at run time).
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

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
        let envelope = EventEnvelope::parse(&event.payload)
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
    with_pool!(db, |pool| MIGRATOR.run(pool).await)?;
    db.migrate().await?;
    db.check_schema().await?;
    Ok(())
}

/// Writes one contact request and its event in one transaction of the service's own.
pub async fn request_contact(db: &Database, id: &str, email: &str, name: &str) -> Result<()> {
    let repo = db.repository();
    let mut tx = repo.begin().await?;
    with_tx!(&mut tx, |conn| {
        // `statement::query` is `sqlx::query`, sent unnamed when the pool sits behind a
        // transaction pooler (docs/deployment.md).
        statement::query("INSERT INTO contact_request (id, email, name) VALUES ($1, $2, $3)")
            .bind(id)
            .bind(email)
            .bind(name)
            .execute(conn)
            .await
            .map(|done| done.rows_affected())
    })?;
    // The payload `{"object":"ContactRequest","record_id":id,"snapshot":{…}}`: its RecordKey
    // is `contactrequest:<id>`, so the requests of one record run in order.
    let snapshot = BTreeMap::from([("email", email), ("name", name)]);
    let event = NewEvent::for_record(CONTACT_REQUESTED, "ContactRequest", id, &snapshot)?;
    // `outbox_events::enqueue` is `repo.enqueue` plus the caller's trace context (with the
    // `otel` feature, inside a traced span): the attempt spans link back to this request.
    outbox_events::enqueue(&*repo, &mut tx, &[event]).await?;
    tx.commit().await?;
    Ok(())
}

async fn count(db: &Database, sql: &'static str) -> Result<i64> {
    // One statement in a READ COMMITTED transaction of its own on PostgreSQL (`with_conn!`).
    Ok(with_conn!(db, |conn| statement::query_scalar(sql)
        .fetch_one(conn)
        .await)?)
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

/// The command line: `DATABASE_URL [REQUESTS] [--require-pull]`.
struct Args {
    url: String,
    requests: usize,
    require_pull: bool,
}

impl Args {
    fn parse() -> Result<Self> {
        let usage = "usage: contact-service DATABASE_URL [REQUESTS] [--require-pull]";
        let (flags, positional): (Vec<String>, Vec<String>) =
            std::env::args().skip(1).partition(|a| a.starts_with("--"));
        let require_pull = match flags.as_slice() {
            [] => false,
            [flag] if flag == "--require-pull" => true,
            _ => bail!("{usage}"),
        };
        let mut positional = positional.into_iter();
        let url = positional.next().context(usage)?;
        let requests = positional.next().map(|n| n.parse()).transpose()?;
        Ok(Self {
            url,
            requests: requests.unwrap_or(200),
            require_pull,
        })
    }
}

/// The service's own Prometheus recorder, with the outbox's histogram buckets on the outbox's
/// series (its own would keep theirs); a real service serves `handle.render()` on its
/// metrics endpoint.
fn install_metrics() -> Result<PrometheusHandle> {
    let builder = outbox_events::prometheus::with_outbox_buckets(PrometheusBuilder::new())?;
    let handle = builder.install_recorder()?;
    outbox_events::describe_metrics();
    Ok(handle)
}

/// Checks the scrape: the processed attempts counted, and the attempt durations as a real
/// histogram (buckets, not a summary).
fn check_metrics(handle: &PrometheusHandle, processed: u64) -> Result<()> {
    let text = handle.render();
    let counted: u64 = text
        .lines()
        .filter(|l| l.starts_with("outbox_attempts_total{") && l.contains("outcome=\"processed\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    let buckets = text
        .lines()
        .any(|l| l.starts_with("outbox_attempt_duration_seconds_bucket{"));
    println!(
        "metrics: {counted} processed attempts counted; attempt durations bucketed: {buckets}"
    );
    if counted != processed || !buckets {
        bail!("expected {processed} processed attempts and bucketed durations in the scrape");
    }
    Ok(())
}

/// Writes `requests` contact requests over a quarter as many emails.
async fn write_requests(db: &Database, requests: usize) -> Result<usize> {
    let emails = (requests / 4).max(1);
    for i in 0..requests {
        let n = i % emails;
        let (id, email, name) = (
            format!("req-{i}"),
            format!("c{n}@example.com"),
            format!("Contact \"{n}\""),
        );
        let request = request_contact(db, &id, &email, &name);
        #[cfg(feature = "otel")]
        let request = tracing::Instrument::instrument(request, otel::request_span(&id));
        request.await?;
    }
    Ok(emails)
}

/// Starts the dispatcher: pull workers or the design's fallback to the legacy dispatcher, or,
/// with `require_pull`, pull workers or an error naming the gate's reasons.
async fn start(
    db: &Database,
    stop: &CancellationToken,
    require_pull: bool,
) -> Result<DispatcherHandle> {
    let action = CreateContact::new()?;
    let handlers = Handlers::new().register_consumer(action.consumer(), action);
    // `from_env`: the mode OUTBOX_PULL_WORKER asks for (`default()` reads no environment).
    let config = WorkerConfig::from_env().with_workers(WORKERS);
    let dispatcher =
        Dispatcher::new(db.repository(), handlers, config).with_stop_token(stop.clone());
    let handle = if require_pull {
        dispatcher.start_pull().await?
    } else {
        dispatcher.start().await?
    };
    println!("dispatcher: {:?} mode", handle.decision().mode);
    Ok(handle)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse()?;
    #[cfg(feature = "otel")]
    let tracing = otel::install()?;
    let metrics = install_metrics()?;
    // The pool the workers need (`workers + 3`); the requests below run before they start.
    let db = Database::connect(&args.url, ConnectConfig::for_workers(WORKERS)).await?;
    migrate(&db).await?;
    let emails = write_requests(&db, args.requests).await?;
    let stop = CancellationToken::new();
    on_signal(stop.clone());
    let handle = start(&db, &stop, args.require_pull).await?;
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
    let requests = args.requests;
    println!("{requests} requests over {emails} emails: {contacts} contacts, numbered 1..={top}");
    if contacts != emails as i64 || numbers != contacts || top != contacts {
        bail!("expected {emails} contacts numbered 1..={emails}");
    }
    check_metrics(&metrics, report.metrics.processed)?;
    #[cfg(feature = "otel")]
    tracing.check_links(report.metrics.processed)?;
    db.close().await;
    Ok(())
}

#[cfg(test)]
mod tests;
