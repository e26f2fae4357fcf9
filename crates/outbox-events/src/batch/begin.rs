//! The begin of a batched attempt's segment (docs/state-machine.md, "Batched attempts", rule
//! 2): its transaction opened and every waiting claim's fence checked in one statement, retried
//! with backoff while the beats keep the claims; nothing is counted and no handler runs until
//! it has begun.

use outbox_persistence::Attempt;

use tokio::sync::OwnedMutexGuard;

use super::{Batch, Member, Step};
use crate::attempt::rollback_quietly;
use crate::detached::{DETACHED_FIRST_BACKOFF, DETACHED_MAX_BACKOFF, DETACHED_MAX_TRIES};
use crate::env::AttemptOutcome;
use crate::heartbeat::FenceState;

/// Why a batch's transaction did not begin.
pub(super) enum Begun {
    /// Its waiting events end so (their claims lost, a hard shutdown, given up).
    Ended(AttemptOutcome),
    /// A graceful shutdown began while it retried: its waiting events are given back.
    Stopping,
}

impl<'a> Batch<'a> {
    /// Locks the fence of every waiting member (each one found lost ends so, and blocks its
    /// record's later rows): the members' indexes and their held fences.
    async fn hold_waiting_fences(
        &mut self,
        members: &[Member<'a>],
    ) -> Vec<(usize, OwnedMutexGuard<FenceState>)> {
        let mut held = Vec::new();
        for (i, member) in members.iter().enumerate() {
            if !matches!(self.steps[i], Step::Waiting) {
                continue;
            }
            // After a failed beat the fence may be behind this worker's own beat that landed
            // (its reply lost): read back, as every fenced write does.
            let state = member.beat.fence.lock_for_write(&self.env.repo).await;
            if state.lost {
                self.steps[i] = Step::Done(AttemptOutcome::LostClaim);
                self.block(i);
            } else {
                held.push((i, state));
            }
        }
        held
    }

    /// Opens a transaction for the batch's waiting events, retried with backoff while the
    /// beats keep the claims (as a single attempt's begin is): nothing counted, no handler run.
    pub(super) async fn begin(&mut self) -> Result<Box<dyn Attempt>, Begun> {
        let env = self.env;
        let members = self.members.clone();
        let mut backoff = DETACHED_FIRST_BACKOFF;
        for try_number in 1..=DETACHED_MAX_TRIES {
            // The fences stay held until the beats of a backend whose batch excludes other
            // writers are stopped: a beat taken meanwhile would wait for the batch's write lock
            // while holding a fence the batch needs.
            let held = self.hold_waiting_fences(&members).await;
            if held.is_empty() {
                return Err(Begun::Ended(AttemptOutcome::LostClaim));
            }
            let fences = held.iter().map(|(_, state)| state.fence).collect();
            let begun = env
                .repo
                .begin_batch_attempt(env.config.lock_timeout, fences)
                .await;
            match begun {
                Ok((mut tx, lost)) => {
                    for &(i, _) in &held {
                        let member = members[i];
                        if lost.contains(&member.claim.event.id) {
                            // Lost, or waiting for an older row of its record outside the
                            // batch: given back first thing (a lost claim's release finds it
                            // lost), and its record's later rows with it.
                            self.recheck.push(i);
                            self.block(i);
                        }
                        if env.repo.serializes_writers() {
                            // The batch holds the only write lock: nobody can reclaim a row
                            // until it commits, and a beat (also of a row given back at the
                            // settle) would only wait for it, holding a fence the settle needs.
                            member.beat.stop();
                        }
                    }
                    drop(held);
                    if !self.steps.iter().any(|s| matches!(s, Step::Waiting)) {
                        rollback_quietly(tx.as_mut()).await;
                        return Err(Begun::Ended(AttemptOutcome::LostClaim));
                    }
                    return Ok(tx);
                }
                Err(e) => {
                    drop(held);
                    if e.is_lock_timeout() {
                        env.metrics.lock_timeout(&members[0].claim.event.event_type);
                    }
                    tracing::warn!(error = %e.chain(), try_number, "could not begin the batched attempt; the claims are kept while it retries");
                    for (i, member) in members.iter().enumerate() {
                        if matches!(self.steps[i], Step::Waiting) {
                            member.beat.ensure_running(true);
                        }
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = env.hard_stop.cancelled() => return Err(Begun::Ended(AttemptOutcome::Cancelled)),
                // A graceful shutdown: the claims go back for other workers (or this process's
                // next start) rather than waiting out the retries.
                _ = env.stop.cancelled() => return Err(Begun::Stopping),
            }
            backoff = (backoff * 2).min(DETACHED_MAX_BACKOFF);
        }
        tracing::error!(
            "giving up on beginning the batched attempt; its rows go stale and their reclaim counts an attempt each"
        );
        Err(Begun::Ended(AttemptOutcome::Abandoned))
    }
}
