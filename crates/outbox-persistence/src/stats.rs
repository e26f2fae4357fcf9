//! What both backends' `stats` share: the status counts and the rows they classify as the
//! heads of blocked keys. Each backend decides staleness and reads the clock its own way.

use crate::OutboxStats;

/// Above this many rows in the table (the planner's estimate, `pg_class.reltuples`), PostgreSQL's
/// `stats` and the console's counts estimate the `processed` rows instead of counting them:
/// counting takes about 100 ms per million rows, and they are the table's history, not its
/// queue.
pub const ESTIMATE_PROCESSED_ABOVE: f64 = 200_000.0;

/// Rows per `Status` (SQLite: one walk of the status-led index).
pub(crate) const STATUS_COUNTS: &str =
    "SELECT Status, count(*) FROM _System_OutboxEvent GROUP BY Status";

/// The heads of blocked keys, as `h`: the oldest non-terminal row of a key that has younger
/// non-terminal rows waiting behind it. A backend's `stats` selects its counts over these.
macro_rules! blocked_heads {
    () => {
        "
             FROM _System_OutboxEvent h
             WHERE h.RecordKey IS NOT NULL AND h.Status NOT IN ('processed', 'failed')
               AND NOT EXISTS (
                 SELECT 1 FROM _System_OutboxEvent o
                 WHERE o.RecordKey = h.RecordKey AND o.Status NOT IN ('processed', 'failed')
                   AND (o.CreatedDate < h.CreatedDate OR (o.CreatedDate = h.CreatedDate AND o.Id < h.Id)))
               AND EXISTS (
                 SELECT 1 FROM _System_OutboxEvent y
                 WHERE y.RecordKey = h.RecordKey AND y.Status NOT IN ('processed', 'failed')
                   AND (y.CreatedDate > h.CreatedDate OR (y.CreatedDate = h.CreatedDate AND y.Id > h.Id)))"
    };
}
pub(crate) use blocked_heads;

/// Fills the per-status counts from [`STATUS_COUNTS`]'s rows (an unknown status is ignored).
pub(crate) fn count_statuses(stats: &mut OutboxStats, counts: Vec<(String, i64)>) {
    for (status, n) in counts {
        let n = u64::try_from(n).unwrap_or(0);
        match status.as_str() {
            "pending" => stats.pending = n,
            "processing" => stats.processing = n,
            "processed" => stats.processed = n,
            "failed" => stats.failed = n,
            _ => {}
        }
    }
}

/// Fills the blocked-key counts: heads running, stale, and waiting for their retry delay.
pub(crate) fn count_blocked(stats: &mut OutboxStats, (running, stale, retry): (i64, i64, i64)) {
    stats.keys_blocked_by_running = u64::try_from(running).unwrap_or(0);
    stats.keys_blocked_by_stale = u64::try_from(stale).unwrap_or(0);
    stats.keys_blocked_by_retry = u64::try_from(retry).unwrap_or(0);
}
