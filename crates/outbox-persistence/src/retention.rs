//! Retention: which terminal rows [`OutboxRepository::prune`](crate::OutboxRepository::prune)
//! deletes ([`PrunePolicy`]) and what it reports ([`PruneReport`]). See `docs/retention.md`.

use std::time::Duration;

use serde::Serialize;

/// Default age after which a `processed` row may be pruned: 7 days.
pub const DEFAULT_PROCESSED_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default age after which a `failed` row may be pruned: 30 days. Failed rows are evidence
/// (their `LastError`, their payload for `outbox retry`), so they are kept longer.
pub const DEFAULT_FAILED_RETENTION: Duration = Duration::from_secs(30 * 24 * 3600);
/// Default number of rows one prune batch deletes per status.
pub const DEFAULT_PRUNE_BATCH: u32 = 1_000;

/// Which terminal rows may be deleted: a `processed` (or `failed`) row whose `LastModifiedDate`
/// (the time it became terminal) and `CreatedDate` are both older than the age for its status.
/// For every row the library writes, `CreatedDate <= LastModifiedDate`, so the age is judged
/// on `LastModifiedDate`; the `CreatedDate` bound lets PostgreSQL walk an index, and only ever
/// keeps a row longer (one written by other code with a `LastModifiedDate` before its
/// `CreatedDate`).
///
/// "Older" is measured on the queue's clock: PostgreSQL's `clock_timestamp()`, SQLite's host
/// clock (plus the repository's `ClockShift`). `pending` and `processing` rows are never
/// touched, whatever their age.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrunePolicy {
    /// Age after which a `processed` row may be deleted; `None` keeps them all.
    pub processed_older_than: Option<Duration>,
    /// Age after which a `failed` row may be deleted; `None` keeps them all.
    pub failed_older_than: Option<Duration>,
    /// Rows deleted per status by one call of `prune`, in one short transaction each.
    pub batch_size: u32,
}

impl Default for PrunePolicy {
    /// [`DEFAULT_PROCESSED_RETENTION`], [`DEFAULT_FAILED_RETENTION`], [`DEFAULT_PRUNE_BATCH`].
    fn default() -> Self {
        Self {
            processed_older_than: Some(DEFAULT_PROCESSED_RETENTION),
            failed_older_than: Some(DEFAULT_FAILED_RETENTION),
            batch_size: DEFAULT_PRUNE_BATCH,
        }
    }
}

impl PrunePolicy {
    /// Sets the age of `processed` rows (`None`: keep them).
    pub fn processed_older_than(mut self, age: Option<Duration>) -> Self {
        self.processed_older_than = age;
        self
    }

    /// Sets the age of `failed` rows (`None`: keep them).
    pub fn failed_older_than(mut self, age: Option<Duration>) -> Self {
        self.failed_older_than = age;
        self
    }

    /// Sets the batch size (at least 1).
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// The batch size the backends use: at least one row.
    pub(crate) fn batch(&self) -> i64 {
        i64::from(self.batch_size.max(1))
    }
}

/// What one prune batch deleted, or what a dry run counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PruneReport {
    /// `processed` rows deleted (a dry run: that would be deleted now).
    pub processed: u64,
    /// `failed` rows deleted (a dry run: that would be deleted now).
    pub failed: u64,
    /// Whether a batch was full, so more rows may be eligible: call `prune` again.
    pub more: bool,
}

impl PruneReport {
    /// Rows of both statuses.
    pub fn total(&self) -> u64 {
        self.processed + self.failed
    }

    /// Adds `other`'s counts to this report (`more` is `other`'s).
    pub fn add(&mut self, other: PruneReport) {
        self.processed += other.processed;
        self.failed += other.failed;
        self.more = other.more;
    }
}
