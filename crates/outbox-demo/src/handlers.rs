//! The demo's consumers, each registered with its declared effects (the consumer map is built
//! from these declarations), and the faults the demo injects into them on purpose.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use async_trait::async_trait;
use create_action::{Effect, EventEnvelope, FieldSet, FindOrCreate, ObjectDef, Rhs, Source};
use outbox_events::{
    AttemptContext, Consumer, EffectKind, ExternalKind, Handler, HandlerError, Handlers,
    OutboxEvent, Safeguard,
};
use outbox_persistence::with_tx;

use super::journal::{JournaledRun, Mark};
use super::sink::MailSink;
use super::workload::{
    ACCOUNT_UPDATED, LEAD_CONVERTED, LEAD_UPDATED, RECORD_TOUCHED, SLOW_REPORT, WELCOME_EMAIL,
};

/// The welcome mail's consumer: its name is the handler id the effect ledger keys its sends by.
pub const WELCOME_HANDLER_ID: &str = "welcome-mail";
/// The welcome mail's effect, as the ledger names it.
pub const WELCOME_EFFECT: &str = "welcome-mail";

/// Faults injected into handler attempts, and what was injected.
#[derive(Debug, Default)]
pub struct Faults {
    /// Share of attempts that fail on purpose.
    pub rate: f64,
    /// Handler errors injected at random.
    pub random_errors: AtomicU64,
    /// First attempts failed because the seed marked the event.
    pub marked_errors: AtomicU64,
}

impl Faults {
    /// Faults at `rate`.
    pub fn at(rate: f64) -> Self {
        Self {
            rate: rate.clamp(0.0, 1.0),
            ..Self::default()
        }
    }

    /// Fails this attempt when the seed marked the event or the random draw says so. `phase`
    /// separates the draws before and after the effects (the latter exercise the savepoint).
    fn check(
        &self,
        event: &OutboxEvent,
        envelope: &EventEnvelope,
        phase: u64,
    ) -> Result<(), HandlerError> {
        if phase == 0
            && event.retry_count == 0
            && envelope.raw.get("demo_fault").and_then(|v| v.as_str()) == Some(FAIL_FIRST_ATTEMPT)
        {
            self.marked_errors.fetch_add(1, Ordering::Relaxed);
            return Err(HandlerError::Retryable(format!(
                "injected fault: the first attempt of a marked event fails ({})",
                attempt_tag(event)
            )));
        }
        if self.rate > 0.0 && draw(event, phase) < self.rate / 2.0 {
            self.random_errors.fetch_add(1, Ordering::Relaxed);
            let when = if phase == 0 { "before" } else { "after" };
            return Err(HandlerError::Retryable(format!(
                "injected handler error {when} the effects ({})",
                attempt_tag(event)
            )));
        }
        Ok(())
    }
}

/// The `demo_fault` mark of an event whose first attempt fails on purpose.
pub const FAIL_FIRST_ATTEMPT: &str = "fail_first_attempt";

/// Names the attempt an injected failure belongs to, so that verification can prove from
/// `LastError` that attempt N's failure is the N-th count in `RetryCount`, and no other.
fn attempt_tag(event: &OutboxEvent) -> String {
    format!("{INJECTED_ATTEMPT_TAG}{}", event.retry_count + 1)
}

/// The text before the attempt number in an injected failure's message.
pub const INJECTED_ATTEMPT_TAG: &str = "injected at attempt ";

/// A stable draw in `[0, 1)` per event, attempt and phase.
fn draw(event: &OutboxEvent, phase: u64) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ phase.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for b in event
        .id
        .as_bytes()
        .iter()
        .chain(&event.retry_count.to_le_bytes())
    {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// The registered object metadata and actions of the demo.
pub struct Actions {
    account_capture: FieldSet,
    lead_capture: FieldSet,
    convert: FindOrCreate,
}

impl Actions {
    /// Registers the demo objects and builds the actions.
    pub fn new() -> anyhow::Result<Self> {
        use create_action::ColumnType::{Integer, Text};
        let account = Arc::new(
            ObjectDef::builder("DemoAccount")
                .natural_key("Id", Text)
                .field("CapturedName", Text)
                .field("CapturedIndustry", Text)
                .field("CapturedRevision", Integer)
                .build()?,
        );
        let lead = Arc::new(
            ObjectDef::builder("DemoLead")
                .natural_key("Id", Text)
                .field("CapturedStatus", Text)
                .field("CapturedRevision", Integer)
                .build()?,
        );
        let opportunity = Arc::new(
            ObjectDef::builder("DemoOpportunity")
                .natural_key("SourceLeadId", Text)
                .natural_key("Relation", Text)
                .field("Name", Text)
                .autonumber("OpportunityNumber")
                .build()?,
        );
        Ok(Self {
            account_capture: FieldSet::builder(account)
                .target("Id", Source::RecordId)
                .set("CapturedName", Rhs::snapshot("Name"))
                .set("CapturedIndustry", Rhs::snapshot("Industry"))
                .set("CapturedRevision", Rhs::snapshot("Revision"))
                .build()?,
            lead_capture: FieldSet::builder(lead)
                .target("Id", Source::RecordId)
                .set("CapturedStatus", Rhs::snapshot("Status"))
                .set("CapturedRevision", Rhs::snapshot("Revision"))
                .build()?,
            convert: FindOrCreate::builder(opportunity)
                .key("SourceLeadId", Source::RecordId)
                .key("Relation", Source::literal("converted_opportunity"))
                .field("Name", Source::snapshot("Company"))
                .build()?,
        })
    }
}

/// Declares a field set's effect from the action's own classification.
fn field_set_effect(action: &FieldSet, consumer: Consumer, description: &str) -> Consumer {
    action.effect_class().declare(consumer, description)
}

fn envelope(event: &OutboxEvent) -> Result<EventEnvelope, HandlerError> {
    EventEnvelope::parse(&event.payload)
        .map_err(|e| HandlerError::permanent_from("unreadable payload", e))
}

/// Appends to the effect log, in the attempt transaction: the audit trail of processing order.
async fn log_effect(ctx: &mut AttemptContext<'_>, event: &OutboxEvent) -> Result<(), HandlerError> {
    with_tx!(ctx.tx(), |conn| {
        outbox_persistence::statement::query(
            "INSERT INTO DemoEffectLog (EventId, RecordKey, EventType) VALUES ($1, $2, $3)",
        )
        .bind(event.id.to_string())
        .bind(event.record_key.as_ref().map(|k| k.as_str()))
        .bind(&event.event_type)
        .execute(conn)
        .await
        .map(|_| ())
    })
    .map_err(HandlerError::db)
}

/// An after-save field capture: one deterministic field set from the snapshot, in the attempt.
struct Capture {
    action: FieldSet,
    faults: Arc<Faults>,
}

#[async_trait]
impl Handler for Capture {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let envelope = envelope(event)?;
        self.faults.check(event, &envelope, 0)?;
        let action = &self.action;
        with_tx!(ctx.tx(), |conn| action
            .run(conn, &envelope, SystemTime::now())
            .await)
        .map_err(HandlerError::from)?;
        log_effect(ctx, event).await?;
        self.faults.check(event, &envelope, 1)
    }
}

struct LeadConversion {
    actions: Arc<Actions>,
    faults: Arc<Faults>,
}

#[async_trait]
impl Handler for LeadConversion {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let envelope = envelope(event)?;
        self.faults.check(event, &envelope, 0)?;
        let (convert, capture) = (&self.actions.convert, &self.actions.lead_capture);
        with_tx!(ctx.tx(), |conn| convert
            .run(conn, &envelope)
            .await
            .map(|_| ()))
        .map_err(HandlerError::from)?;
        with_tx!(ctx.tx(), |conn| capture
            .run(conn, &envelope, SystemTime::now())
            .await)
        .map_err(HandlerError::from)?;
        log_effect(ctx, event).await?;
        self.faults.check(event, &envelope, 1)
    }
}

/// Sends the welcome email through the simulated provider, through the library's effect
/// ledger (`ctx.effect`): a redelivery of an event whose attempt committed, or a retry after a
/// failure that followed the send, does not send again; the provider receives the ledger's
/// idempotency key, which absorbs the one repeat the ledger cannot prevent (a process that died
/// between the send and its commit).
struct WelcomeMail {
    sink: MailSink,
    faults: Arc<Faults>,
}

#[async_trait]
impl Handler for WelcomeMail {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let envelope = envelope(event)?;
        self.faults.check(event, &envelope, 0)?;
        let recipient = envelope
            .snapshot
            .get("Email")
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                HandlerError::Permanent("welcome email without Email in the snapshot".into())
            })?
            .to_string();
        let subject = format!(
            "Welcome, {}",
            envelope.record_id.as_deref().unwrap_or("customer")
        );
        let claim = event.last_modified_date.to_rfc3339();
        let sink = &self.sink;
        let sent_now = std::sync::atomic::AtomicBool::new(false);
        let sent = &sent_now;
        ctx.effect(WELCOME_EFFECT)
            .once(|key| async move {
                sink.send(&key, (event.retry_count, &claim), &recipient, &subject)
                    .await
                    .map_err(|e| HandlerError::retryable_from("mail provider", e))?;
                sent.store(true, Ordering::Relaxed);
                Ok(())
            })
            .await?;
        if let Some(ms) = envelope
            .snapshot
            .get(HOLD_AFTER_SEND_MS)
            .and_then(|v| v.as_u64())
            .filter(|_| sent_now.load(Ordering::Relaxed))
        {
            // A held send (this attempt sent; a skip holds nothing): journaled on the side,
            // then the attempt waits before it commits (its heartbeat keeps the claim), a
            // window the fault suite aims its kills at.
            let id = event.id.to_string();
            if let Err(e) = sink.journal(Mark::Sent, &id, event.retry_count).await {
                tracing::warn!(error = %e, "could not journal a held send");
            }
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        log_effect(ctx, event).await?;
        self.faults.check(event, &envelope, 1)
    }
}

/// The snapshot field that makes a welcome email's attempt wait after its send, before it
/// commits (`outbox-demo seed --held-sends`).
pub const HOLD_AFTER_SEND_MS: &str = "HoldAfterSendMs";

/// A slow handler: sleeps the snapshot's `SleepMs` (its heartbeat keeps the claim alive),
/// journaling its start and the end of its sleep on the side, then writes its effect-log row.
/// A reclaim while it is alive would show in the journal as another start of the same event
/// before this run ended.
struct SlowReport {
    sink: MailSink,
}

#[async_trait]
impl Handler for SlowReport {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        let envelope = envelope(event)?;
        let sleep_ms = envelope
            .snapshot
            .get("SleepMs")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| HandlerError::Permanent("slow report without SleepMs".into()))?;
        let journal = |e: anyhow::Error| HandlerError::Retryable(format!("slow journal: {e:#}"));
        let run = JournaledRun::start(&self.sink, event.id.to_string(), event.retry_count)
            .await
            .map_err(journal)?;
        tokio::time::sleep(std::time::Duration::from_millis(sleep_ms)).await;
        run.end(Mark::Finish).await.map_err(journal)?;
        log_effect(ctx, event).await
    }
}

/// The `demo_fault` mark of a poison event: its handler aborts the process on every attempt.
pub const ABORT_PROCESS: &str = "abort_process";

/// What a process writes to stderr just before a poison event aborts it (the fault suite
/// recognises a poison death by it; `cargo xtask faults` keeps a copy of this text).
pub const POISON_LOG: &str = "poison event: aborting the process";

/// Any demo handler, made mortal: an event marked `"demo_fault": "abort_process"` journals its
/// attempt and its death on the side store, then aborts the whole process, as a handler that
/// segfaults in a native library or is OOM-killed would. Every other event goes to the wrapped
/// handler. The outbox must count each such death when it reclaims the row, so that the event
/// ends `failed` after `MaxRetryAttempts` and its record's later events run.
pub struct Poisonable<H> {
    inner: H,
    sink: MailSink,
}

impl<H> Poisonable<H> {
    /// Wraps `inner`.
    pub fn new(inner: H, sink: MailSink) -> Self {
        Self { inner, sink }
    }
}

/// Whether an event with this payload is a poison event.
pub fn is_poison(payload: &str) -> bool {
    payload.contains(ABORT_PROCESS)
        && EventEnvelope::parse(payload).is_ok_and(|envelope| {
            envelope.raw.get("demo_fault").and_then(|v| v.as_str()) == Some(ABORT_PROCESS)
        })
}

#[async_trait]
impl<H: Handler> Handler for Poisonable<H> {
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        if !is_poison(&event.payload) {
            return self.inner.handle(event, ctx).await;
        }
        // The journal rows are best effort: the process dies either way.
        match JournaledRun::start(&self.sink, event.id.to_string(), event.retry_count).await {
            Ok(run) => {
                if let Err(e) = run.end(Mark::Died).await {
                    tracing::error!(error = %e, "could not journal a poison death");
                }
            }
            Err(e) => tracing::error!(error = %e, "could not journal a poison attempt"),
        }
        // Written straight to stderr, whatever the log filter: the supervisor reads it.
        eprintln!(
            "{POISON_LOG} (event {}, attempt {})",
            event.id,
            event.retry_count + 1
        );
        std::process::abort();
    }
}

/// The demo's consumer declarations, derived from the actions themselves where they can
/// classify their own effects. This list is the binary's consumer map.
pub fn consumers(actions: &Actions) -> [Consumer; 6] {
    let account = field_set_effect(
        &actions.account_capture,
        Consumer::new("account-field-capture", ACCOUNT_UPDATED),
        "DemoAccount.Captured{Name,Industry,Revision} from the snapshot",
    );
    let lead = field_set_effect(
        &actions.lead_capture,
        Consumer::new("lead-field-capture", LEAD_UPDATED),
        "DemoLead.Captured{Status,Revision} from the snapshot",
    );
    let conversion = field_set_effect(
        &actions.lead_capture,
        actions.convert.effect_class().declare(
            Consumer::new("lead-conversion", LEAD_CONVERTED),
            "the converted lead's opportunity, numbered by an autonumber drawn after the find",
        ),
        "DemoLead.Captured{Status,Revision} from the snapshot",
    );
    let mail = Consumer::new(WELCOME_HANDLER_ID, WELCOME_EMAIL).effect(
        EffectKind::External {
            kind: ExternalKind::Email,
        },
        "welcome email through the mail provider, the ledger's idempotency key as the provider's",
        Some(Safeguard::Ledger),
    );
    let slow = Consumer::new("slow-report", SLOW_REPORT).effect(
        EffectKind::DeterministicFieldSet,
        "no record change: sleeps SleepMs from the snapshot, then appends its effect-log row (a slow handler for the fault suite)",
        None,
    );
    let touched = Consumer::new("foreign-touch", RECORD_TOUCHED).effect(
        EffectKind::DeterministicFieldSet,
        "no effect: rows written by other code beside the workers (the fault suite's foreign writers)",
        None,
    );
    [account, lead, conversion, mail, slow, touched]
}

/// The consumers as the demo registers them: the registry's declarations (so the mail consumer
/// shows as registered through the effect ledger), for the operator commands and the consumer
/// map. The handlers are built around an in-memory provider that nothing sends to.
pub async fn registered_consumers(actions: Arc<Actions>) -> anyhow::Result<Vec<Consumer>> {
    let sink = MailSink {
        db: outbox_persistence::Database::sqlite_in_memory().await?,
    };
    Ok(handlers(actions, sink, Arc::new(Faults::at(0.0))).consumers())
}

/// The demo's handlers, each registered with its consumer declaration and made
/// [`Poisonable`] (the declarations, and so the consumer map and the gate, do not change).
pub fn handlers(actions: Arc<Actions>, sink: MailSink, faults: Arc<Faults>) -> Handlers {
    let [account, lead, conversion, mail, slow, touched] = consumers(&actions);
    Handlers::new()
        .register_consumer(
            account,
            Poisonable::new(
                Capture {
                    action: actions.account_capture.clone(),
                    faults: faults.clone(),
                },
                sink.clone(),
            ),
        )
        .register_consumer(
            lead,
            Poisonable::new(
                Capture {
                    action: actions.lead_capture.clone(),
                    faults: faults.clone(),
                },
                sink.clone(),
            ),
        )
        .register_consumer(
            conversion,
            Poisonable::new(
                LeadConversion {
                    actions,
                    faults: faults.clone(),
                },
                sink.clone(),
            ),
        )
        .register_with_ledger(
            mail,
            Poisonable::new(
                WelcomeMail {
                    sink: sink.clone(),
                    faults,
                },
                sink.clone(),
            ),
        )
        .register_consumer(
            slow,
            Poisonable::new(SlowReport { sink: sink.clone() }, sink.clone()),
        )
        .register_consumer(touched, Poisonable::new(Touched, sink))
}

/// The handler of [`RECORD_TOUCHED`] rows: nothing to do (the rows exist to be written out of
/// order beside the workers; running them in their record's order is the outbox's part).
struct Touched;

#[async_trait]
impl Handler for Touched {
    async fn handle(
        &self,
        _event: &OutboxEvent,
        _ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}
