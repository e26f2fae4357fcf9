//! What a heartbeat found, and the beat of many claims one by one (the default of
//! [`crate::OutboxRepository::heartbeat_many`]).

use crate::{Fence, OutboxRepository, Result};

/// What one claim's heartbeat found, from [`crate::OutboxRepository::heartbeat_many`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BeatOutcome {
    /// The row was still this worker's; its fence is now this one.
    Beaten(Fence),
    /// The row is no longer this worker's (reclaimed, or finished elsewhere).
    Lost,
    /// The row was still this worker's but another transaction held its lock, so it was not
    /// beaten this time (a beat of many claims never waits for one of them).
    Busy,
    /// The beat wrote the row, and its `COMMIT` was sent but no answer came (a cut connection,
    /// a lost reply): it landed or it did not, and the worker cannot tell from here. `written`
    /// is the claim's fence if it landed; `writer` names the transaction that wrote it
    /// (PostgreSQL: its transaction id, the `xmin` of the row version it wrote), so
    /// [`crate::OutboxRepository::beat_landed`] tells that row version from any later write,
    /// another worker's claim with the same `RetryCount` and timestamp included.
    Unsure {
        /// The fence the beat wrote, if it landed.
        written: Fence,
        /// The writing transaction (PostgreSQL's transaction id).
        writer: i64,
    },
}

impl BeatOutcome {
    /// The claim's new fence when the beat landed and said so.
    pub fn beaten(self) -> Option<Fence> {
        match self {
            BeatOutcome::Beaten(fence) => Some(fence),
            _ => None,
        }
    }
}

/// Beats `fences` one after another: a beat that fails after others were written reports its
/// claim [`BeatOutcome::Busy`] (beaten at the next interval), so the fences already moved are
/// never forgotten; fails only when every beat failed.
pub(crate) async fn one_by_one<R: OutboxRepository + ?Sized>(
    repo: &R,
    fences: Vec<Fence>,
) -> Result<Vec<BeatOutcome>> {
    let mut outcomes = Vec::with_capacity(fences.len());
    let mut first_error = None;
    for fence in fences {
        outcomes.push(match repo.heartbeat(fence).await {
            Ok(outcome) => outcome,
            Err(e) => {
                first_error.get_or_insert(e);
                BeatOutcome::Busy
            }
        });
    }
    match first_error {
        Some(e) if outcomes.iter().all(|o| *o == BeatOutcome::Busy) => Err(e),
        _ => Ok(outcomes),
    }
}
