//! A handler that runs long gives back the claims its worker has not started (docs/state-machine.md,
//! "Batched attempts", rule 8): a worker holds the rows it claimed together (a batch, a record's
//! chain, rows reclaimed together) and runs them one after another, so without this every one of
//! them would wait for the slow handler, and their records' later rows with them, while other
//! workers sit idle. Their rows are untouched by the running transaction (outcomes are written
//! at the settle), so each is released on a connection of its own under its own fence,
//! uncounted, and is at once eligible for the idle workers.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use outbox_persistence::{BeatOutcome, FenceOutcome};

use crate::detached::release_from;
use crate::env::{AttemptEnv, AttemptOutcome};
use crate::heartbeat::{Beat, FenceCell};

/// Why a claim is given back while another handler of its worker runs long.
pub(crate) const SLOW_HANDLER: &str =
    "not run: another handler of its worker ran long; given back for an idle worker";

/// The shortest a handler runs before its worker's unstarted claims are given back: long
/// enough that a handler a little over the batch budget does not churn its worker's chain
/// through a release and a claim per row, short next to the heartbeat interval (2 s by default)
/// within which the issue asks the rows to be back.
const MIN_GIVE_BACK_AFTER: Duration = Duration::from_millis(100);

/// A claim's state.
const UNSTARTED: u8 = 0;
const STARTED: u8 = 1;
const GIVEN_BACK: u8 = 2;

/// The claims a worker holds and has not started: which ones, and how those given back ended.
pub(crate) struct Unstarted<'a> {
    env: &'a AttemptEnv,
    beats: &'a [Beat<'a>],
    state: Vec<AtomicU8>,
    outcomes: Mutex<Vec<Option<AttemptOutcome>>>,
}

impl<'a> Unstarted<'a> {
    pub(crate) fn new(env: &'a AttemptEnv, beats: &'a [Beat<'a>]) -> Self {
        Self {
            env,
            beats,
            state: beats.iter().map(|_| AtomicU8::new(UNSTARTED)).collect(),
            outcomes: Mutex::new(vec![None; beats.len()]),
        }
    }

    /// How long a handler runs before the others are given back.
    pub(crate) fn give_back_after(config: &crate::config::WorkerConfig) -> Duration {
        config.batch_budget.max(MIN_GIVE_BACK_AFTER)
    }

    /// Claim `i` is this worker's to run or decide (it is started now, or was before);
    /// `false`: it was given back.
    pub(crate) fn start(&self, i: usize) -> bool {
        self.state[i]
            .compare_exchange(UNSTARTED, STARTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            || self.state[i].load(Ordering::Acquire) == STARTED
    }

    /// Whether claim `i` was given back.
    pub(crate) fn is_given_back(&self, i: usize) -> bool {
        self.state[i].load(Ordering::Acquire) == GIVEN_BACK
    }

    /// How a given-back claim's release ended.
    pub(crate) fn outcome(&self, i: usize) -> AttemptOutcome {
        self.outcomes.lock().unwrap_or_else(|e| e.into_inner())[i]
            .clone()
            .unwrap_or(AttemptOutcome::NotRun)
    }

    fn any_unstarted(&self) -> bool {
        self.state
            .iter()
            .any(|s| s.load(Ordering::Acquire) == UNSTARTED)
    }

    /// Runs `work` (a handler, or a single attempt); if it runs for longer than
    /// [`Unstarted::give_back_after`], the worker's unstarted claims are released meanwhile.
    /// A release under way when `work` ends is finished first: its outcome must be known.
    /// Nothing is given back on a backend whose attempts exclude other writers (SQLite): no
    /// other worker could run them meanwhile, and a release would wait for this attempt's lock.
    pub(crate) async fn while_running<T>(&self, work: impl Future<Output = T>) -> T {
        if self.env.repo.serializes_writers() || !self.any_unstarted() {
            return work.await;
        }
        let releasing = AtomicBool::new(false);
        let give_back = self.give_back(&releasing);
        tokio::pin!(work, give_back);
        let mut gave_back = false;
        let out = loop {
            tokio::select! {
                biased;
                out = &mut work => break out,
                _ = &mut give_back, if !gave_back => gave_back = true,
            }
        };
        if releasing.load(Ordering::Acquire) && !gave_back {
            give_back.await;
        }
        out
    }

    /// One fenced release of a claim, uncounted. A try that fails may have landed with its
    /// reply lost (or still land: a commit in doubt), and another worker may then run the row:
    /// the claim is never run by this worker unchecked. A fenced beat confirms it: it lands
    /// only while the row is still this claim, and once it has, the release (fenced on the old
    /// value) can never apply, so the worker keeps the claim under the new fence (`None`).
    /// Otherwise the release is settled on the side, which reads back whether it landed;
    /// `Some((outcome, true))` says it was retried there (the pass ends after it).
    async fn release_once(&self, beat: &Beat<'_>) -> Option<(AttemptOutcome, bool)> {
        {
            let mut state = beat.fence.lock_for_write(&self.env.repo).await;
            if state.lost {
                return Some((AttemptOutcome::LostClaim, false));
            }
            match self.env.repo.release_claim(state.fence, SLOW_HANDLER).await {
                Ok(FenceOutcome::Written) => {
                    // The row is no longer this worker's: its beat stops before the fence is
                    // let go (a group's beat taken after would send the spent fence and report
                    // the claim lost), as in `release_from`.
                    beat.stop();
                    return Some((AttemptOutcome::NotRun, false));
                }
                Ok(FenceOutcome::Lost) => return Some((AttemptOutcome::LostClaim, false)),
                Err(e) => {
                    tracing::warn!(error = %e.chain(), "giving back a claim of a long handler's worker failed; confirming the claim");
                    match self.env.repo.heartbeat(state.fence).await {
                        Ok(BeatOutcome::Beaten(next)) => {
                            beat.fence.beaten(&mut state, next);
                            return None;
                        }
                        // The release on the side reads it back before its first write.
                        Ok(BeatOutcome::Unsure { written, writer }) => {
                            FenceCell::unsure(&mut state, written, writer)
                        }
                        _ => {}
                    }
                }
            }
        }
        let outcome = match release_from(self.env, beat, SLOW_HANDLER, true).await {
            AttemptOutcome::Released => AttemptOutcome::NotRun,
            other => other,
        };
        Some((outcome, true))
    }

    /// After [`Unstarted::give_back_after`], releases every claim still unstarted.
    async fn give_back(&self, releasing: &AtomicBool) {
        tokio::time::sleep(Self::give_back_after(&self.env.config)).await;
        releasing.store(true, Ordering::Release);
        let mut count = 0;
        for (i, beat) in self.beats.iter().enumerate() {
            if self.state[i]
                .compare_exchange(UNSTARTED, GIVEN_BACK, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            let Some((outcome, retried)) = self.release_once(beat).await else {
                // The release did not land (the database is away): the claim stays this
                // worker's to run, and the pass ends (the running handler's transaction never
                // waits for a pass that retries against a database that is away).
                self.state[i].store(UNSTARTED, Ordering::Release);
                break;
            };
            beat.stop();
            self.outcomes.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(outcome);
            count += 1;
            if retried {
                // The database is flaky: the other claims stay this worker's to run rather than
                // keep the running handler's transaction waiting for more retries.
                break;
            }
        }
        if count > 0 {
            tracing::info!(
                claims = count,
                "a handler ran long; gave back the worker's claims it had not started"
            );
        }
    }
}
