//! The dispatcher: starts the pull workers (or the legacy batch loop), and shuts them down in
//! three steps: stop claiming, let in-flight attempts finish within the shutdown timeout, then
//! cancel what is left (rolled back, left to stale reclaim).

use std::sync::Arc;
use std::time::Duration;

use outbox_persistence::{ClaimPolicy, OutboxRepository, Scope};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::attempt;
use crate::batch;
use crate::claims::{Claims, Reply};
use crate::config::{DispatchMode, WorkerConfig};
use crate::env::AttemptEnv;
use crate::gate::ModeDecision;
use crate::handlers::Handlers;
use crate::legacy;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::pause::narrow;
use crate::waits::{FIRST_ERROR_BACKOFF, FIRST_IDLE_WAIT, back_off, idle, policy};

/// How long [`Dispatcher::decide`] rides out a database that is away (unavailable, or a lock
/// timeout) before it returns the error.
pub const DECIDE_RETRY_FOR: Duration = Duration::from_secs(30);

/// Why [`Dispatcher::start_pull`] started nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The rollout gate's inputs could not be read, or the schema lacks this build's
    /// migrations (see [`Dispatcher::decide`]).
    #[error(transparent)]
    Database(#[from] outbox_persistence::Error),
    /// The rollout gate refused pull mode; the decision holds its reasons
    /// ([`ModeDecision::refused`]).
    #[error("the rollout gate refuses pull workers: {}", .0.refused.join("; "))]
    PullRefused(ModeDecision),
}

/// Runs outbox workers over a repository.
pub struct Dispatcher {
    repo: Arc<dyn OutboxRepository>,
    handlers: Handlers,
    config: WorkerConfig,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
    /// Started by `start_pull`: pull workers or nothing.
    pull_required: bool,
}

impl Dispatcher {
    /// A dispatcher over `repo`. Workers read no clock of their own: the repository takes
    /// every queue time from the database (see `docs/state-machine.md`).
    pub fn new(repo: Arc<dyn OutboxRepository>, handlers: Handlers, config: WorkerConfig) -> Self {
        Self {
            repo,
            handlers,
            config,
            metrics: Arc::default(),
            stop: CancellationToken::new(),
            pull_required: false,
        }
    }

    /// Stops claiming when `stop` is cancelled (for example the service's own shutdown token,
    /// cancelled on SIGTERM); [`DispatcherHandle::shutdown`] then finishes the shutdown. The
    /// dispatcher makes a token of its own otherwise.
    pub fn with_stop_token(mut self, stop: CancellationToken) -> Self {
        self.stop = stop;
        self
    }

    /// Decides what to run: pull workers when the configuration asks for them
    /// ([`WorkerConfig::mode`]; [`WorkerConfig::from_env`] reads `OUTBOX_PULL_WORKER`) and the rollout gate passes over the
    /// registered consumers ([`crate::evaluate_gate`]), or the configuration skips the gate by
    /// name; the legacy dispatcher otherwise (fail closed). The decision and its reasons are
    /// logged.
    ///
    /// First, in either mode, the database's outbox migrations are checked against this
    /// build's ([`OutboxRepository::check_schema`]): a database that lacks some is returned as
    /// [`outbox_persistence::Error::NotMigrated`] (naming them) and nothing starts; a newer
    /// schema (a rolling deploy), or a check that fails or takes over 5 s, is logged and the
    /// start goes on.
    ///
    /// The gate reads the database. A database that is briefly away while the service starts
    /// (restarting, a connection cut, a lock timeout) does not fail the start: the decision is
    /// tried again with backoff while less than [`DECIDE_RETRY_FOR`] has passed (a try under
    /// way then may take up to the pool's acquire timeout more), or until the stop token is
    /// cancelled; any other error (a closed pool among them), or a database still away after
    /// that, is returned.
    pub async fn decide(&self) -> Result<ModeDecision, outbox_persistence::Error> {
        let started = tokio::time::Instant::now();
        let mut backoff = FIRST_ERROR_BACKOFF;
        loop {
            let consumers = self.handlers.consumers();
            match ModeDecision::make(&self.repo, &consumers, &self.config, self.pull_required).await
            {
                // A closed pool stays closed: only a database that may come back is waited for.
                Err(e)
                    if e.is_transient()
                        && !matches!(
                            e,
                            outbox_persistence::Error::Unavailable(
                                outbox_persistence::sqlx::Error::PoolClosed
                            )
                        )
                        && started.elapsed() + backoff < DECIDE_RETRY_FOR
                        && !self.stop.is_cancelled() =>
                {
                    tracing::warn!(error = %e.chain(), "cannot read the rollout gate's inputs yet; trying again");
                    back_off(&self.stop, &mut backoff).await;
                }
                result => return result,
            }
        }
    }

    /// Decides ([`Dispatcher::decide`]) and starts the workers: pull workers, or the legacy
    /// dispatcher when the configuration does not ask for pull mode or the rollout gate refuses
    /// it (the design's fallback; `handle.decision()` says which and why).
    pub async fn start(self) -> Result<DispatcherHandle, outbox_persistence::Error> {
        let decision = self.decide().await?;
        Ok(self.start_decided(decision))
    }

    /// Starts pull workers or nothing: for a service that must not fall back to the legacy
    /// dispatcher. Asks for pull mode whatever [`WorkerConfig::mode`] says (the service chose
    /// it in code; `OUTBOX_PULL_WORKER` is not read, so rolling such a service back to legacy
    /// is a change of its own code or configuration, see `docs/rollout.md`), decides as
    /// [`Dispatcher::start`] does, and returns [`StartError::PullRefused`] with the gate's
    /// reasons, having started nothing, when the rollout gate refuses. When it passes, it
    /// starts what `start` starts in pull mode: the pull workers, and the legacy loop for the
    /// event types of consumers declared excluded. The gate still decides: only
    /// [`WorkerConfig::dangerously_skip_rollout_gate`] skips it.
    pub async fn start_pull(mut self) -> Result<DispatcherHandle, StartError> {
        self.config.mode = DispatchMode::Pull;
        self.pull_required = true;
        let decision = self.decide().await?;
        if decision.mode != DispatchMode::Pull {
            return Err(StartError::PullRefused(decision));
        }
        Ok(self.start_decided(decision))
    }

    /// Starts the workers `decision` (made by [`Dispatcher::decide`] on this dispatcher) asks
    /// for: for a caller that reports or records the decision before the workers start.
    pub fn start_decided(mut self, decision: ModeDecision) -> DispatcherHandle {
        self.config.mode = decision.mode;
        self.config.excluded_event_types = decision.excluded_event_types.clone();
        let mut handle = self.start_mode();
        handle.decision = decision;
        handle
    }

    fn start_mode(self) -> DispatcherHandle {
        let stop = self.stop;
        let hard_stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        let env = Arc::new(AttemptEnv {
            repo: self.repo,
            handlers: self.handlers,
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            hard_stop: hard_stop.clone(),
            stop: stop.clone(),
            attempts: Arc::new(tokio::sync::Semaphore::new(self.config.workers.max(1))),
            paused: crate::pause::Paused::unread(),
        });
        tracing::info!(
            mode = ?self.config.mode,
            workers = self.config.workers,
            backend = env.repo.backend_name(),
            "outbox dispatcher starting"
        );
        crate::metrics::describe_metrics();
        spawn_background(&tracker, &env, &stop);
        match self.config.mode {
            DispatchMode::Pull => {
                let excluded = self.config.excluded_event_types.clone();
                let scope = if excluded.is_empty() {
                    self.config.scope.clone()
                } else {
                    tracing::info!(
                        ?excluded,
                        "event types excluded from the pull rollout run on the legacy path"
                    );
                    tracker.spawn(legacy::run(
                        env.clone(),
                        stop.clone(),
                        narrow(&self.config.scope, Scope::Only(excluded.clone())),
                    ));
                    narrow(&self.config.scope, Scope::Except(excluded))
                };
                let claims = Arc::new(Claims::new(self.config.claim_batch()));
                for worker in 0..self.config.workers {
                    tracker.spawn(pull_worker(
                        env.clone(),
                        claims.clone(),
                        stop.clone(),
                        scope.clone(),
                        worker,
                    ));
                }
            }
            DispatchMode::Legacy => {
                tracker.spawn(legacy::run(
                    env.clone(),
                    stop.clone(),
                    self.config.scope.clone(),
                ));
            }
        }
        DispatcherHandle {
            stop,
            hard_stop,
            tracker,
            metrics: self.metrics,
            shutdown_timeout: self.config.shutdown_timeout,
            repo: env.repo.clone(),
            policy: self.config.claim_policy(),
            decision: ModeDecision::placeholder(),
        }
    }
}

/// The dispatcher's background tasks: the paused-types refresh, and the queue gauges, the
/// heads repair and the pruner where configured.
fn spawn_background(tracker: &TaskTracker, env: &Arc<AttemptEnv>, stop: &CancellationToken) {
    tracker.spawn(crate::pause::run(
        env.repo.clone(),
        env.paused.clone(),
        stop.clone(),
    ));
    if let Some(every) = env.config.queue_gauges {
        tracker.spawn(crate::gauges::run(
            env.repo.clone(),
            env.config.claim_policy(),
            every,
            stop.clone(),
        ));
    }
    if let Some(every) = env.config.heads_repair {
        tracker.spawn(crate::heads::run(env.repo.clone(), every, stop.clone()));
    }
    if let Some(retention) = env.config.retention {
        tracker.spawn(crate::prune::run(env.repo.clone(), retention, stop.clone()));
    }
}

pub(crate) async fn pull_worker(
    env: Arc<AttemptEnv>,
    claims: Arc<Claims>,
    stop: CancellationToken,
    scope: Scope,
    worker: usize,
) {
    let mut idle_wait = FIRST_IDLE_WAIT;
    let mut error_backoff = FIRST_ERROR_BACKOFF;
    let mut sizer = BatchSizer::default();
    while !stop.is_cancelled() {
        // Held from the claim to the attempt's end, released while idle or backing off.
        let Some(permit) = env.attempt_permit(&stop).await else {
            break;
        };
        // The workers that ask at the same moment share one claim statement (`Claims`).
        let want = sizer.want(&env.config);
        let scope = env.paused.narrow(&scope, &stop).await;
        // Read before the claim: a wake-up while it runs ends the idle wait after it.
        let since = env.repo.wake_mark();
        match claims
            .claim(env.repo.as_ref(), &env.metrics, policy(&env), &scope, want)
            .await
        {
            Reply::Claimed(mut claimed) => {
                idle_wait = FIRST_IDLE_WAIT;
                error_backoff = FIRST_ERROR_BACKOFF;
                let (handler_time, ran) = if claimed.len() == 1 {
                    let claim = claimed.pop().expect("one claim");
                    let (_, handler_time) = attempt::run_timed(&env, claim).await;
                    (handler_time, 1)
                } else {
                    batch::run(&env, claimed).await
                };
                sizer.observe(handler_time, ran);
                drop(permit);
            }
            Reply::Nothing => {
                drop(permit);
                idle(&env, &stop, since, idle_wait).await;
                idle_wait = (idle_wait * 2).min(env.config.poll_interval);
            }
            Reply::Failed(error) => {
                drop(permit);
                // A database that is down, or a lock timeout on the claim: nothing was
                // claimed, so nothing is lost; try again after a pause. The worker that led
                // the claim reports its error; the others that shared it back off quietly.
                match error {
                    Some(e) if e.is_lock_timeout() => {
                        tracing::debug!(worker, error = %e.chain(), "claiming hit the lock timeout; backing off");
                    }
                    Some(e) => {
                        tracing::warn!(worker, error = %e.chain(), "claiming failed; backing off");
                    }
                    None => {}
                }
                back_off(&stop, &mut error_backoff).await;
            }
        }
    }
    tracing::debug!(worker, "pull worker stopped");
}

/// How many events a pull worker asks for next: as many as its handlers' recent mean time fits
/// in the batch budget, between one and the batch's most (see `docs/state-machine.md`,
/// "Batched attempts", rule 6). It starts at one, measured before it batches.
#[derive(Debug, Default)]
struct BatchSizer {
    /// The handlers' mean time per event, smoothed over the worker's recent attempts.
    mean: Option<Duration>,
}

impl BatchSizer {
    fn want(&self, config: &WorkerConfig) -> usize {
        let most = config.batch_events();
        match self.mean {
            _ if most == 1 => 1,
            None => 1,
            Some(mean) => {
                let fits = config.batch_budget.as_nanos() / mean.as_nanos().max(1_000);
                (fits.min(most as u128) as usize).max(1)
            }
        }
    }

    /// `ran` handlers took `took` in all.
    fn observe(&mut self, took: Duration, ran: usize) {
        if ran == 0 {
            return;
        }
        let sample = took / ran as u32;
        self.mean = Some(match self.mean {
            None => sample,
            Some(mean) => (mean + sample) / 2,
        });
    }
}

/// A running dispatcher.
pub struct DispatcherHandle {
    stop: CancellationToken,
    hard_stop: CancellationToken,
    tracker: TaskTracker,
    metrics: Arc<Metrics>,
    shutdown_timeout: Duration,
    repo: Arc<dyn OutboxRepository>,
    policy: ClaimPolicy,
    decision: ModeDecision,
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Whether every in-flight attempt finished within the shutdown timeout.
    pub graceful: bool,
    /// The counters at the end.
    pub metrics: MetricsSnapshot,
}

impl DispatcherHandle {
    /// What the dispatcher decided to run, and why.
    pub fn decision(&self) -> &ModeDecision {
        &self.decision
    }

    /// The counters now.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// The shared counters.
    pub fn metrics_handle(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// A token that stops claiming when cancelled (the first step of shutdown).
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Waits until the queue holds no `pending` or `processing` row (read from the database
    /// every `poll`), or until claiming stops. `Ok(true)` when drained, `Ok(false)` when
    /// stopped first; a failed read of the queue is returned (the caller decides to retry).
    /// Rows this dispatcher's scope excludes (also those outside [`WorkerConfig::scope`]), or
    /// that wait for a retry delay, count too.
    pub async fn drained(&self, poll: Duration) -> Result<bool, outbox_persistence::Error> {
        loop {
            let stats = self.repo.stats(self.policy).await?;
            if stats.pending + stats.processing == 0 {
                return Ok(true);
            }
            tokio::select! {
                _ = self.stop.cancelled() => return Ok(false),
                _ = tokio::time::sleep(poll) => {}
            }
        }
    }

    /// Stops claiming, waits up to the shutdown timeout for in-flight attempts, then cancels
    /// the rest.
    pub async fn shutdown(self) -> ShutdownReport {
        self.stop.cancel();
        self.tracker.close();
        let graceful = tokio::time::timeout(self.shutdown_timeout, self.tracker.wait())
            .await
            .is_ok();
        if !graceful {
            tracing::warn!("shutdown timeout passed; cancelling in-flight attempts");
            self.hard_stop.cancel();
            self.tracker.wait().await;
        }
        ShutdownReport {
            graceful,
            metrics: self.metrics.snapshot(),
        }
    }
}

#[cfg(test)]
mod scope_tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn narrowing_keeps_the_types_both_scopes_name() {
        let only = Scope::Only(names(&["a", "b"]));
        assert_eq!(
            narrow(&Scope::All, Scope::Except(names(&["a"]))),
            Scope::Except(names(&["a"]))
        );
        assert_eq!(narrow(&only, Scope::All), only);
        assert_eq!(
            narrow(&only, Scope::Only(names(&["b", "c"]))),
            Scope::Only(names(&["b"]))
        );
        assert_eq!(
            narrow(&only, Scope::Except(names(&["a"]))),
            Scope::Only(names(&["b"]))
        );
        let except = Scope::Except(names(&["a"]));
        assert_eq!(
            narrow(&except, Scope::Only(names(&["a", "c"]))),
            Scope::Only(names(&["c"]))
        );
        assert_eq!(
            narrow(&except, Scope::Except(names(&["b"]))),
            Scope::Except(names(&["b", "a"]))
        );
    }
}
