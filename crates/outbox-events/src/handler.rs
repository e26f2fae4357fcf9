//! The handler contract: one handler per `EventType`, running inside the attempt transaction.

use async_trait::async_trait;
use outbox_persistence::{
    Attempt, EffectRecord, EventEnvelope, NewEvent, OutboxEvent, OutboxRepository, Tx,
};

use crate::effect::{Effect, EffectScope};

/// A boxed error kept as the cause of a [`HandlerError`] (any `std::error::Error + Send + Sync`,
/// `anyhow::Error`, a `String` converts into it).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The longest a snooze waits ([`HandlerError::snooze`]): a longer delay is held to it.
pub const MAX_SNOOZE: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

/// What a handler's failure means for the row.
///
/// A failure built from another error keeps that error as its
/// [`source`](std::error::Error::source): build it with [`HandlerError::retryable_from`],
/// [`HandlerError::permanent_from`] or [`HandlerError::db`] (or `?` on an
/// `outbox_persistence::Error`), rather than formatting the error into a message. The message
/// (`Display`, which the row's error column records) still names the cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Try again later (up to `MaxRetryAttempts`). The message is all there is: for a failure
    /// caused by another error, see [`HandlerError::RetryableFrom`].
    #[error("retryable: {0}")]
    Retryable(String),
    /// Retrying cannot help (for example a payload the handler cannot read): `failed` now. For
    /// a failure caused by another error, see [`HandlerError::PermanentFrom`].
    #[error("permanent: {0}")]
    Permanent(String),
    /// Try again later because of `source`, another error the handler ran into (built by
    /// [`HandlerError::retryable_from`]).
    #[error("retryable: {}", with_cause(context, source.as_ref()))]
    RetryableFrom {
        /// What the handler was doing (may be empty).
        context: String,
        /// The error that made the attempt fail.
        #[source]
        source: BoxError,
    },
    /// `failed` now because of `source`, another error the handler ran into (built by
    /// [`HandlerError::permanent_from`]).
    #[error("permanent: {}", with_cause(context, source.as_ref()))]
    PermanentFrom {
        /// What the handler was doing (may be empty).
        context: String,
        /// The error that made the attempt fail.
        #[source]
        source: BoxError,
    },
    /// Try again, not sooner than `delay` from now (a receiver's `Retry-After`, a handler's
    /// own backoff schedule), up to `MaxRetryAttempts` like [`HandlerError::Retryable`]. The
    /// worker's own backoff applies when it is longer. Built by [`HandlerError::retry_in`].
    #[error("retryable in {}s: {message}", delay.as_secs_f64())]
    RetryIn {
        /// The shortest wait before the next attempt.
        delay: std::time::Duration,
        /// Why it failed.
        message: String,
    },
    /// Not a failure: run this event again, not sooner than `delay` from now, without counting
    /// the attempt towards `MaxRetryAttempts` (Oban's snooze, River's `JobSnooze`). For a
    /// handler that must wait for something outside the event: a quota spent, a receiver that
    /// is busy. Its record's later events wait with it, as they wait for a retry; a handler
    /// that snoozes for ever keeps its record waiting for ever (`outbox status --key` shows
    /// the row `pending` with this message). Effects the handler ran through the ledger are
    /// kept; its writes in the transaction are rolled back. A delay over [`MAX_SNOOZE`] (30
    /// days) is held to it. Built by [`HandlerError::snooze`].
    #[error("snoozed for {}s: {message}", delay.as_secs_f64())]
    Snooze {
        /// The shortest wait before the next attempt.
        delay: std::time::Duration,
        /// Why it waits.
        message: String,
    },
    /// A database error from the handler's own statements; a lock timeout or a lost connection
    /// is retried like [`HandlerError::Retryable`].
    #[error("database: {}", .0.chain())]
    Database(#[from] outbox_persistence::Error),
}

/// `context: cause` (just the cause when there is no context), with the cause's own sources,
/// so that the row's recorded error names what went wrong without a chain walker.
fn with_cause(context: &str, source: &(dyn std::error::Error + 'static)) -> String {
    let mut out = context.to_string();
    let mut next = Some(source);
    while let Some(error) = next {
        let text = error.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        next = error.source();
    }
    out
}

/// A handler's own statement failed: `?` on a `sqlx` result in a handler classifies it as
/// [`HandlerError::db`] does (a lock timeout or a lost connection is retried).
impl From<outbox_persistence::sqlx::Error> for HandlerError {
    fn from(e: outbox_persistence::sqlx::Error) -> Self {
        HandlerError::db(e)
    }
}

impl HandlerError {
    /// A database error from the handler's statements (`sqlx::Error` converts into
    /// `outbox_persistence::Error`, which classifies lock timeouts and lost connections).
    pub fn db(e: impl Into<outbox_persistence::Error>) -> Self {
        HandlerError::Database(e.into())
    }

    /// A retryable failure caused by `source`; `context` says what the handler was doing (for
    /// example `"mail provider"`; empty for none). Replaces
    /// `HandlerError::Retryable(format!("mail provider: {e}"))`, which keeps only the text.
    pub fn retryable_from(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        HandlerError::RetryableFrom {
            context: context.into(),
            source: source.into(),
        }
    }

    /// A permanent failure caused by `source`; `context` says what the handler was doing (for
    /// example `"unreadable payload"`; empty for none). Replaces
    /// `HandlerError::Permanent(format!("unreadable payload: {e}"))`, which keeps only the text.
    pub fn permanent_from(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        HandlerError::PermanentFrom {
            context: context.into(),
            source: source.into(),
        }
    }

    /// A retryable failure whose next attempt waits at least `delay`.
    pub fn retry_in(delay: std::time::Duration, message: impl Into<String>) -> Self {
        HandlerError::RetryIn {
            delay,
            message: message.into(),
        }
    }

    /// Run the event again not sooner than `delay` from now, uncounted: see
    /// [`HandlerError::Snooze`].
    pub fn snooze(delay: std::time::Duration, message: impl Into<String>) -> Self {
        HandlerError::Snooze {
            delay,
            message: message.into(),
        }
    }

    /// The shortest wait before the next attempt the handler asked for, if any.
    pub fn retry_delay(&self) -> Option<std::time::Duration> {
        match self {
            HandlerError::RetryIn { delay, .. } | HandlerError::Snooze { delay, .. } => {
                Some(*delay)
            }
            _ => None,
        }
    }

    /// Whether this failure is a database lock timeout.
    pub fn is_lock_timeout(&self) -> bool {
        matches!(self, HandlerError::Database(e) if e.is_lock_timeout())
    }

    /// Whether the row should be retried (as opposed to failed at once).
    pub fn is_retryable(&self) -> bool {
        !matches!(
            self,
            HandlerError::Permanent(_) | HandlerError::PermanentFrom { .. }
        )
    }
}

/// What a handler may touch during its attempt: the attempt transaction.
///
/// The workers build it around the attempt's transaction. A unit test of a handler builds it
/// around a transaction of its own, runs the handler and reads the effects back:
///
/// ```
/// use outbox_events::prelude::*;
///
/// struct Touch;
///
/// #[async_trait]
/// impl Handler for Touch {
///     async fn handle(
///         &self,
///         event: &OutboxEvent,
///         ctx: &mut AttemptContext<'_>,
///     ) -> Result<(), HandlerError> {
///         // Both backends' arms of `with_tx!` must give one type: map the query's result.
///         with_tx!(ctx.tx(), |conn| {
///             statement::query("INSERT INTO touched VALUES ($1)")
///                 .bind(event.id.to_string())
///                 .execute(conn)
///                 .await
///                 .map(|done| done.rows_affected())
///         })?; // a sqlx error converts, classified (a lock timeout is retried)
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // No server, no file: SQLite in memory, with the outbox's tables.
/// let db = Database::sqlite_in_memory().await?;
/// let repo = db.repository();
/// let mut tx = repo.begin().await?;
/// with_tx!(&mut tx, |conn| {
///     statement::query("CREATE TABLE touched (id TEXT)")
///         .execute(conn)
///         .await
///         .map(|done| done.rows_affected())
/// })?;
/// let event = OutboxEvent::for_test("lead.updated", r#"{"object":"Lead","record_id":"1"}"#);
/// Touch.handle(&event, &mut AttemptContext::new(&mut tx)).await?;
/// let n: i64 = with_tx!(&mut tx, |conn| {
///     statement::query_scalar("SELECT count(*) FROM touched")
///         .fetch_one(conn)
///         .await
/// })?;
/// assert_eq!(n, 1);
/// tx.rollback().await?;
/// # Ok(())
/// # }
/// ```
pub struct AttemptContext<'a> {
    inner: Inner<'a>,
    /// Whether the handler asked for the transaction: one that never did has no effects in
    /// it to keep or undo (a batch then needs no savepoint after it, nor a rollback).
    touched: bool,
    /// Whether it asked for it through [`AttemptContext::tx`], whose statements may take locks
    /// an application transaction holds or waits for: a batch's segment then ends after it
    /// (docs/state-machine.md, "Batched attempts", rule 2). [`AttemptContext::lock_free_tx`]
    /// does not set it.
    locking: bool,
    /// The event and handler, for the effect ledger's keys (`None`: a unit test's context
    /// built with [`AttemptContext::new`]).
    scope: Option<EffectScope>,
    /// The effects run through the ledger in this attempt ([`AttemptContext::effect`]): kept
    /// in the ledger if the transaction rolls back while the worker lives.
    pub(crate) sent: Vec<EffectRecord>,
    /// Owned rows to enqueue at the settle ([`AttemptContext::enqueue_owned`]), when the
    /// attempt defers them (a batch's); `None`: enqueued at once.
    deferred: Option<Vec<NewEvent>>,
}

/// The workers' attempt, or a transaction a test opened, or none: a transaction-free
/// handler run beside others of its batch ([`Handler::runs_without_tx`]), with what the ledger
/// recorded for its event before it ran.
enum Inner<'a> {
    Attempt(&'a mut dyn Attempt),
    Tx(&'a mut Tx),
    Detached(Vec<EffectRecord>),
}

/// What a detached context's handler meets when it asks for the transaction anyway: a panic
/// with this message, which the worker catches as the event's retryable failure; its next
/// attempt runs alone, with its transaction.
pub(crate) const NO_TX: &str = "this handler declared that it runs without the transaction (Handler::runs_without_tx) but asked for it; the event is retried in an attempt of its own";

impl<'a> AttemptContext<'a> {
    /// A context around `tx`, any open transaction: for a handler's unit test.
    pub fn new(tx: &'a mut Tx) -> Self {
        Self {
            inner: Inner::Tx(tx),
            touched: false,
            locking: false,
            scope: None,
            sent: Vec::new(),
            deferred: None,
        }
    }

    /// A context around `tx` for `event` run by the consumer named `handler_id`: for a unit
    /// test of a handler that runs effects through the ledger ([`AttemptContext::effect`]).
    pub fn for_event(tx: &'a mut Tx, handler_id: impl Into<String>, event: &OutboxEvent) -> Self {
        Self {
            scope: Some(EffectScope {
                event_id: event.id,
                handler_id: handler_id.into(),
            }),
            ..Self::new(tx)
        }
    }

    /// The context the workers give a handler: the attempt's transaction, for `event_id` run
    /// by the consumer named `handler_id`.
    pub(crate) fn for_attempt(
        attempt: &'a mut dyn Attempt,
        handler_id: &str,
        event_id: outbox_persistence::EventId,
    ) -> Self {
        Self::scoped(Inner::Attempt(attempt), handler_id, event_id)
    }

    /// A context around `inner` for `event_id` run by the consumer named `handler_id`.
    fn scoped(inner: Inner<'a>, handler_id: &str, event_id: outbox_persistence::EventId) -> Self {
        Self {
            inner,
            touched: false,
            locking: false,
            scope: Some(EffectScope {
                event_id,
                handler_id: handler_id.to_owned(),
            }),
            sent: Vec::new(),
            deferred: None,
        }
    }

    /// The context of a transaction-free handler run beside others of its batch
    /// ([`Handler::runs_without_tx`]): no transaction; `prior` is what the ledger recorded
    /// for this event before the batch ran it (read for the whole group in one statement);
    /// the effects it runs are recorded at the settle, and its owned rows inserted there.
    pub(crate) fn detached(
        handler_id: &str,
        event_id: outbox_persistence::EventId,
        prior: Vec<EffectRecord>,
    ) -> Self {
        Self::scoped(Inner::Detached(prior), handler_id, event_id).deferring_owned_enqueues()
    }

    /// Whether this context holds the attempt's transaction: `false` only for a handler that
    /// declared [`Handler::runs_without_tx`] run beside others of its batch, where
    /// [`AttemptContext::tx`] and [`AttemptContext::lock_free_tx`] must not be called (the
    /// handler reads what it needs through a pool of its own; [`AttemptContext::effect`] and
    /// [`AttemptContext::enqueue_owned`] work either way).
    pub fn has_tx(&self) -> bool {
        !matches!(self.inner, Inner::Detached(_))
    }

    /// What the ledger recorded for this event before a detached context's handler ran
    /// (`None`: the context has a transaction; read the ledger there).
    pub(crate) fn prior_effect(&self, effect_key: &str) -> Option<Option<Option<String>>> {
        let Inner::Detached(prior) = &self.inner else {
            return None;
        };
        let scope = self.scope.as_ref()?;
        // Also what it ran itself so far (with a transaction, the ledger's row in it).
        Some(
            prior
                .iter()
                .chain(&self.sent)
                .find(|e| e.handler_id == scope.handler_id && e.effect_key == effect_key)
                .map(|e| e.result.clone()),
        )
    }

    /// Defers this context's [`AttemptContext::enqueue_owned`] rows to the settle (a batch's
    /// attempt, which inserts a segment's in one statement).
    pub(crate) fn deferring_owned_enqueues(mut self) -> Self {
        self.deferred = Some(Vec::new());
        self
    }

    /// The owned rows deferred to the settle, taken.
    pub(crate) fn take_deferred(&mut self) -> Vec<NewEvent> {
        self.deferred
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Enqueues `events`, outbox rows under record keys that only this handler's attempts
    /// write (a fan-out's: see [`OutboxRepository::enqueue_owned`]), in the attempt's
    /// transaction: they commit if and only if this event ends `processed`. In a batched
    /// attempt they are inserted at its settle, with the other handlers' of its segment in one
    /// statement (by the dispatcher's repository), in claim order and after the outcome of
    /// this event is written; elsewhere (one event per attempt, a unit test's context) at once
    /// through `repo`, like `repo.enqueue_owned(ctx.lock_free_tx(), &events)`. Each row is
    /// checked here either way (a payload that is not a valid envelope, an empty event type or
    /// one holding a NUL is this handler's error); what the insert itself meets at the settle
    /// (a statement timeout, the database gone) is the segment's transaction dying.
    pub async fn enqueue_owned(
        &mut self,
        repo: &dyn OutboxRepository,
        events: Vec<NewEvent>,
    ) -> Result<(), HandlerError> {
        for event in &events {
            if event.event_type.is_empty() || event.event_type.contains('\0') {
                return Err(HandlerError::Permanent(format!(
                    "an owned row's event type {:?} is empty or holds a NUL",
                    event.event_type
                )));
            }
            EventEnvelope::parse(&event.payload).map_err(|e| {
                HandlerError::permanent_from("an owned row's payload is not a valid envelope", e)
            })?;
        }
        if let Some(deferred) = &mut self.deferred {
            deferred.extend(events);
            return Ok(());
        }
        repo.enqueue_owned(self.lock_free_tx(), &events).await?;
        Ok(())
    }

    /// An external effect of this handler for this event, named `name` (stable across
    /// releases: it keys the ledger): run it with [`Effect::once`], which runs it at most once
    /// per committed attempt and hands back what it returned (docs/state-machine.md, "The
    /// effect ledger").
    pub fn effect(&mut self, name: impl Into<String>) -> Effect<'_, 'a> {
        Effect {
            ctx: self,
            name: name.into(),
        }
    }

    /// The event and handler the ledger keys effects by.
    pub(crate) fn effect_scope(&self) -> Result<&EffectScope, HandlerError> {
        self.scope.as_ref().ok_or_else(|| {
            HandlerError::Permanent(
                "ctx.effect needs the event and its handler: the workers give them; a unit test builds its context with AttemptContext::for_event".into(),
            )
        })
    }

    /// The effects run through the ledger in this attempt, taken.
    pub(crate) fn take_sent(&mut self) -> Vec<EffectRecord> {
        std::mem::take(&mut self.sent)
    }

    /// Whether the handler asked for the transaction (so may have written to it).
    pub(crate) fn touched(&self) -> bool {
        self.touched
    }

    /// Whether the handler asked for the transaction through [`AttemptContext::tx`].
    pub(crate) fn locking(&self) -> bool {
        self.locking
    }

    /// The attempt transaction: the handler's database effects go here, so they commit
    /// atomically with `processed` and roll back with a failure. In a batched attempt, the
    /// transaction commits after a handler that used it and succeeded, before the next handler
    /// runs: it never holds two handlers' locks (docs/embedding.md, "Lock footprint"), unless
    /// the workers share writes (`WorkerConfig::with_shared_writes`, opt-in: later handlers
    /// join it with their lock waits bounded).
    pub fn tx(&mut self) -> &mut Tx {
        self.touched = true;
        self.locking = true;
        self.open()
    }

    /// The attempt transaction, for statements that **take no lock an application
    /// transaction may hold or wait for**: reads under READ COMMITTED, rows keyed by this event
    /// that nothing else writes (the effect ledger's), and enqueues of outbox rows whose record
    /// keys only this handler writes (a fan-out's). They commit and roll back with the attempt
    /// like [`AttemptContext::tx`]'s, but in a batched attempt the next handlers may run in the
    /// same transaction (each under a savepoint of its own), so up to a batch of such handlers
    /// share one commit. A statement that updates or deletes an application row, or inserts a
    /// key the application also writes, must go through [`AttemptContext::tx`]: a lock held
    /// across several handlers could close a cycle with the application's transactions.
    pub fn lock_free_tx(&mut self) -> &mut Tx {
        self.touched = true;
        self.open()
    }

    fn open(&mut self) -> &mut Tx {
        match &mut self.inner {
            Inner::Attempt(attempt) => attempt.tx(),
            Inner::Tx(tx) => tx,
            // Caught by the worker: the event's retryable failure (see `NO_TX`).
            Inner::Detached(_) => panic!("{NO_TX}"),
        }
    }
}

/// Handles the events of one `EventType`.
///
/// A handler must not block its thread (synchronous I/O, `std::thread::sleep`, long CPU work):
/// run such work with `tokio::task::spawn_blocking` and await it. The first heartbeat of an
/// attempt is timed in the attempt's own task, so a handler that blocks that task for longer than
/// `stale_after` leaves its claim silent, and another worker may reclaim it while it runs.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Runs the event's effects in `ctx`'s transaction. Must be safe to run again for the same
    /// event (redelivery): see the `create-action` crate.
    async fn handle(
        &self,
        event: &OutboxEvent,
        ctx: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError>;

    /// Whether this handler never asks for the attempt's transaction when its context has
    /// none ([`AttemptContext::has_tx`] is `false`): its effects are external, run through
    /// [`AttemptContext::effect`] (a webhook, a provider call), and its rows, if any, are
    /// owned rows ([`AttemptContext::enqueue_owned`]). A batch then runs such handlers side by
    /// side, one event per record at a time (a record's events still one after another, in
    /// order), instead of one after another: a batch of slow sends takes about the time of its
    /// slowest. The ledger is read for them before they run and written at the settle, with
    /// their outcomes. Default `false`. A handler that declares it and asks for the
    /// transaction anyway fails that attempt (retryable) and runs alone on the next, with its
    /// transaction (docs/state-machine.md, "Batched attempts", rule 10).
    fn runs_without_tx(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod error_tests {
    //! The cause chain of [`HandlerError`].

    use std::error::Error as _;

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("connection reset")]
    struct Reset;

    #[derive(Debug, thiserror::Error)]
    #[error("smtp send failed")]
    struct Smtp(#[source] Reset);

    /// SQLite's claim tells a snoozed row by its error's first words.
    #[test]
    fn a_snooze_says_it_is_one_in_the_words_the_claim_reads() {
        let snooze = HandlerError::snooze(std::time::Duration::from_millis(1500), "busy");
        assert!(snooze.is_retryable());
        assert_eq!(snooze.to_string(), "snoozed for 1.5s: busy");
        assert!(
            snooze
                .to_string()
                .starts_with(outbox_persistence::SNOOZED_PREFIX)
        );
    }

    #[test]
    fn a_failure_built_from_an_error_keeps_it_as_its_source() {
        let retry = HandlerError::retryable_from("mail provider", Smtp(Reset));
        assert!(retry.is_retryable());
        let source = retry.source().expect("the cause is kept");
        assert!(source.downcast_ref::<Smtp>().is_some(), "{source:?}");
        assert!(source.source().unwrap().downcast_ref::<Reset>().is_some());
        assert_eq!(
            retry.to_string(),
            "retryable: mail provider: smtp send failed: connection reset"
        );

        let permanent = HandlerError::permanent_from("", Smtp(Reset));
        assert!(!permanent.is_retryable());
        assert!(permanent.source().unwrap().downcast_ref::<Smtp>().is_some());
        assert_eq!(
            permanent.to_string(),
            "permanent: smtp send failed: connection reset"
        );
    }

    #[test]
    fn a_database_failure_keeps_the_repository_error_as_its_source() {
        let e = HandlerError::db(sqlx::Error::PoolTimedOut);
        let source = e.source().expect("the database error is kept");
        assert!(
            source.downcast_ref::<outbox_persistence::Error>().is_some(),
            "{source:?}"
        );
        assert!(e.is_retryable());
    }

    #[test]
    fn message_only_failures_have_no_source() {
        assert!(HandlerError::Retryable("busy".into()).source().is_none());
        let permanent = HandlerError::Permanent("bad payload".into());
        assert!(permanent.source().is_none());
        assert!(!permanent.is_retryable());
        assert_eq!(permanent.to_string(), "permanent: bad payload");
    }
}
