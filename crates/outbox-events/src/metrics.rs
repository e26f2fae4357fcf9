//! Counters the embedding application can read.

use std::sync::atomic::{AtomicU64, Ordering};

/// Attempt counters, shared by all workers of a dispatcher.
#[derive(Debug, Default)]
pub struct Metrics {
    claimed: AtomicU64,
    processed: AtomicU64,
    retried: AtomicU64,
    failed: AtomicU64,
    lost_claims: AtomicU64,
    stale_reclaims: AtomicU64,
    lock_timeouts: AtomicU64,
    detached_bookkeeping: AtomicU64,
    cancelled: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Rows claimed.
    pub claimed: u64,
    /// Attempts that committed `processed`.
    pub processed: u64,
    /// Attempts that ended in a retry.
    pub retried: u64,
    /// Attempts that ended `failed`.
    pub failed: u64,
    /// Attempts abandoned because the claim was taken over or finished elsewhere.
    pub lost_claims: u64,
    /// Claims of stale `processing` rows (a worker's heartbeat had stopped).
    pub stale_reclaims: u64,
    /// Failures that were database lock timeouts.
    pub lock_timeouts: u64,
    /// Failures recorded on the detached path because the attempt transaction died.
    pub detached_bookkeeping: u64,
    /// Attempts cancelled by a hard shutdown (left to stale reclaim).
    pub cancelled: u64,
}

macro_rules! counters {
    ($($name:ident => $inc:ident),* $(,)?) => {
        impl Metrics {
            $(
                pub(crate) fn $inc(&self) {
                    self.$name.fetch_add(1, Ordering::Relaxed);
                }
            )*

            /// The counters now.
            pub fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }
    };
}

counters!(
    claimed => inc_claimed,
    processed => inc_processed,
    retried => inc_retried,
    failed => inc_failed,
    lost_claims => inc_lost_claims,
    stale_reclaims => inc_stale_reclaims,
    lock_timeouts => inc_lock_timeouts,
    detached_bookkeeping => inc_detached_bookkeeping,
    cancelled => inc_cancelled,
);
