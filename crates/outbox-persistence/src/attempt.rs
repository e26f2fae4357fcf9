//! The backend-independent half of an attempt and of the fenced writes.
//!
//! An attempt is an open transaction that ends once (commit or rollback) and has a post-claim
//! savepoint; its bookkeeping is a fenced write. [`OpenAttempt`] holds that life cycle once for
//! both backends and maps the [`Attempt`] operations onto [`FencedWrite`]s; a backend supplies
//! only how a fenced write is written ([`AttemptWrites`]). The repositories' detached
//! bookkeeping (`increment_retry`, `update_status`) goes through the same [`FencedWrite`].

use std::time::Duration;

use async_trait::async_trait;

use crate::{
    Attempt, Error, FailureBookkeeping, Fence, FenceOutcome, Result, Terminal, Tx, with_tx,
};

/// Sets the post-claim savepoint, right after an attempt's `BEGIN`.
pub(crate) const SET_SAVEPOINT: &str = "SAVEPOINT outbox_claimed";
/// Undoes a handler's effects, keeping the attempt's transaction open for its bookkeeping.
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT outbox_claimed";
/// A batch's savepoint before one event's handler, when earlier handlers of its segment kept
/// effects in the transaction (`Attempt::savepoint`).
const SET_EVENT_SAVEPOINT: &str = "SAVEPOINT outbox_event";
const ROLLBACK_TO_EVENT_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT outbox_event";

/// One fenced write of a claimed row: it applies only while the row is `processing` and still
/// carries the fence's `LastModifiedDate`, and moves that value strictly forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FencedWrite<'a> {
    /// `processed`, `LastError` cleared.
    Processed,
    /// Back to `pending` with `RetryCount + 1`, eligible once `extra_delay` beyond the base
    /// retry delay has passed.
    Retry {
        /// Backoff beyond the base retry delay.
        extra_delay: Duration,
        /// The error, clipped before it is stored.
        error: &'a str,
    },
    /// `failed` with `RetryCount + 1`.
    Failed {
        /// The error, clipped before it is stored.
        error: &'a str,
    },
    /// Back to `pending` with `RetryCount` unchanged, not eligible before `delay` from now:
    /// the handler asked to be run later (a snooze), which is not a failure.
    Snooze {
        /// How far ahead of now `LastModifiedDate` is set.
        delay: Duration,
        /// Why, clipped before it is stored in `LastError`.
        error: &'a str,
    },
    /// Back to `pending` with `RetryCount` unchanged: an attempt not counted, because what
    /// failed was the outbox's own write of its outcome, not its handler.
    Release {
        /// Why, clipped before it is stored in `LastError`.
        error: &'a str,
    },
}

impl<'a> FencedWrite<'a> {
    /// The write that records a failed attempt.
    pub(crate) fn failure(bookkeeping: FailureBookkeeping, error: &'a str) -> Self {
        match bookkeeping {
            FailureBookkeeping::Retry { extra_delay } => FencedWrite::Retry { extra_delay, error },
            FailureBookkeeping::Fail => FencedWrite::Failed { error },
            FailureBookkeeping::Snooze { delay } => FencedWrite::Snooze { delay, error },
        }
    }

    /// The write of a terminal status (`failed` without an error text says `failed`).
    pub(crate) fn terminal(status: Terminal, error: Option<&'a str>) -> Self {
        match status {
            Terminal::Processed => FencedWrite::Processed,
            Terminal::Failed => FencedWrite::Failed {
                error: error.unwrap_or("failed"),
            },
        }
    }
}

/// A snooze's `LastError`: `error` when it says it is a snooze (`HandlerError::snooze`'s text),
/// else `error` after [`crate::SNOOZED_PREFIX`] and the delay, so that every snoozed row says so
/// (SQLite's claim reads it).
pub(crate) fn snoozed_error(delay: Duration, error: &str) -> String {
    if error.starts_with(crate::SNOOZED_PREFIX) {
        error.to_string()
    } else {
        format!("{}{}s: {error}", crate::SNOOZED_PREFIX, delay.as_secs_f64())
    }
}

/// A fenced write's outcome from the number of rows it changed.
pub(crate) fn fence_outcome(rows: u64) -> FenceOutcome {
    if rows == 1 {
        FenceOutcome::Written
    } else {
        FenceOutcome::Lost
    }
}

/// A `std` duration as a `chrono` one, saturating instead of failing.
pub(crate) fn chrono_span(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

/// What a backend adds to an attempt: how it writes a fenced write in the attempt's
/// transaction, and what it does as the attempt ends.
#[async_trait]
pub(crate) trait AttemptWrites: Send + Sync + 'static {
    /// Applies `write` in `tx`, fenced on `fence`.
    async fn write(
        &self,
        tx: &mut Tx,
        fence: Fence,
        write: FencedWrite<'_>,
    ) -> Result<FenceOutcome>;

    /// `processed` for several claims in `tx`, each fenced on its own: one outcome per fence,
    /// in order. One write after another unless the backend has a statement for all.
    async fn processed_many(&self, tx: &mut Tx, fences: &[Fence]) -> Result<Vec<FenceOutcome>> {
        let mut outcomes = Vec::with_capacity(fences.len());
        for fence in fences {
            outcomes.push(self.write(tx, *fence, FencedWrite::Processed).await?);
        }
        Ok(outcomes)
    }

    /// [`AttemptWrites::processed_many`] for a batch holding two or more rows of a record (a
    /// chain): no row of a record is written while an older row of it outside `fences` is not
    /// terminal (such rows read back as not written, still under their fences). The same as
    /// `processed_many` where nothing can reopen an older row meanwhile (SQLite: the attempt
    /// holds the write lock).
    async fn processed_chains(&self, tx: &mut Tx, fences: &[Fence]) -> Result<Vec<FenceOutcome>> {
        self.processed_many(tx, fences).await
    }

    /// The statement that bounds the transaction's lock waits by `bound` (`None`: back to the
    /// attempt's lock timeout), or `None` where a transaction waits for no row lock (SQLite:
    /// the attempt holds the one write lock).
    fn lock_waits_sql(&self, _bound: Option<Duration>) -> Option<String> {
        None
    }

    /// Called once, just before the transaction commits or rolls back.
    fn ending(&self) {}

    /// Called once the transaction has committed or rolled back (whether or not that
    /// succeeded).
    fn ended(&self) {}
}

/// The attempt transaction of one claimed row, on either backend: open until [`Attempt::commit`]
/// or [`Attempt::rollback`], then every operation fails with [`Error::AttemptFinished`].
pub(crate) struct OpenAttempt<W> {
    tx: Option<Tx>,
    writes: W,
}

impl<W: AttemptWrites> OpenAttempt<W> {
    /// Runs `sql` as a simple query in the open transaction: nothing prepared (behind a
    /// transaction pooler a named statement would be left on the server connection).
    async fn simple(&mut self, sql: impl Into<String>) -> Result<()> {
        let (tx, _) = self.open()?;
        let sql = sqlx::AssertSqlSafe(sql.into());
        with_tx!(tx, |conn| sqlx::raw_sql(sql)
            .execute(conn)
            .await
            .map(|_| ()))?;
        Ok(())
    }

    /// An attempt over `tx`, which has begun and set the savepoint ([`SET_SAVEPOINT`]).
    pub(crate) fn new(tx: Tx, writes: W) -> Self {
        Self {
            tx: Some(tx),
            writes,
        }
    }

    /// The open transaction and the backend's writes.
    fn open(&mut self) -> Result<(&mut Tx, &W)> {
        match self.tx.as_mut() {
            Some(tx) => Ok((tx, &self.writes)),
            None => Err(Error::AttemptFinished),
        }
    }

    /// Takes the transaction to end it.
    fn ending(&mut self) -> Result<Tx> {
        let tx = self.tx.take().ok_or(Error::AttemptFinished)?;
        self.writes.ending();
        Ok(tx)
    }
}

#[async_trait]
impl<W: AttemptWrites> Attempt for OpenAttempt<W> {
    fn tx(&mut self) -> &mut Tx {
        self.tx
            .as_mut()
            .expect("the attempt transaction is open until commit or rollback")
    }

    async fn rollback_to_savepoint(&mut self) -> Result<()> {
        self.simple(ROLLBACK_TO_SAVEPOINT).await
    }

    async fn savepoint(&mut self) -> Result<()> {
        self.simple(SET_EVENT_SAVEPOINT).await
    }

    async fn rollback_to_event_savepoint(&mut self) -> Result<()> {
        self.simple(ROLLBACK_TO_EVENT_SAVEPOINT).await
    }

    async fn bounded_savepoint(&mut self, bound: Duration) -> Result<()> {
        let (_, writes) = self.open()?;
        match writes.lock_waits_sql(Some(bound)) {
            // The bound before the savepoint: a rollback to it keeps the bound.
            Some(bound) => self.simple(format!("{bound}; {SET_EVENT_SAVEPOINT}")).await,
            None => self.simple(SET_EVENT_SAVEPOINT).await,
        }
    }

    async fn unbound_lock_waits(&mut self) -> Result<()> {
        let (_, writes) = self.open()?;
        match writes.lock_waits_sql(None) {
            Some(sql) => self.simple(sql).await,
            None => Ok(()),
        }
    }

    async fn release(&mut self, fence: Fence, error: &str) -> Result<FenceOutcome> {
        let (tx, writes) = self.open()?;
        writes
            .write(tx, fence, FencedWrite::Release { error })
            .await
    }

    async fn mark_processed(&mut self, fence: Fence) -> Result<FenceOutcome> {
        let (tx, writes) = self.open()?;
        writes.write(tx, fence, FencedWrite::Processed).await
    }

    async fn mark_processed_many(&mut self, fences: Vec<Fence>) -> Result<Vec<FenceOutcome>> {
        let (tx, writes) = self.open()?;
        writes.processed_many(tx, &fences).await
    }

    async fn mark_processed_chains(&mut self, fences: Vec<Fence>) -> Result<Vec<FenceOutcome>> {
        let (tx, writes) = self.open()?;
        writes.processed_chains(tx, &fences).await
    }

    async fn record_failure(
        &mut self,
        fence: Fence,
        bookkeeping: FailureBookkeeping,
        error: &str,
    ) -> Result<FenceOutcome> {
        let (tx, writes) = self.open()?;
        let write = FencedWrite::failure(bookkeeping, error);
        writes.write(tx, fence, write).await
    }

    async fn commit(&mut self) -> Result<()> {
        let result = self.ending()?.commit().await;
        self.writes.ended();
        result
    }

    async fn rollback(&mut self) -> Result<()> {
        let result = self.ending()?.rollback().await;
        self.writes.ended();
        result
    }
}

/// Caps an error text before it is stored in `LastError`.
pub fn clip_error(error: &str) -> String {
    const MAX: usize = 2000;
    // PostgreSQL text cannot hold NUL; an error that echoes payload bytes must still be storable,
    // or the failure could never be recorded.
    let cleaned;
    let error = if error.contains('\0') {
        cleaned = error.replace('\0', "\u{FFFD}");
        cleaned.as_str()
    } else {
        error
    };
    if error.len() <= MAX {
        return error.to_string();
    }
    let mut end = MAX;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &error[..end])
}
