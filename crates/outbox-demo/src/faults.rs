//! Faults the demo injects on purpose, beside the handler errors of [`super::Faults`]: row locks
//! held from a second connection (so handlers hit the lock timeout), and one worker task killed
//! mid-attempt (so its row must come back through stale reclaim).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_events::{
    AttemptContext, ClaimRunner, Handler, HandlerError, Handlers, OutboxEvent, WorkerConfig,
};
use outbox_persistence::{Database, EventStatus, OutboxRepository, Scope};
use serde::Serialize;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::workload::ACCOUNT_UPDATED;

/// What was injected.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FaultReport {
    /// Handler errors injected (filled in from the handlers' counters).
    pub handler_errors: u64,
    /// Row locks held from a second connection for longer than the lock timeout.
    pub lock_holds: u64,
    /// Worker tasks killed mid-attempt.
    pub killed_workers: u64,
    /// From the kill to another worker's reclaim of the killed attempt's row.
    pub kill_to_reclaim_ms: Option<u64>,
}

/// The running fault tasks.
pub struct FaultInjector {
    stop: CancellationToken,
    task: JoinHandle<FaultReport>,
}

impl FaultInjector {
    /// Starts holding locks (when `rate > 0`) and killing one worker mid-attempt (when
    /// `kill_one`).
    pub fn start(
        db: Database,
        repo: Arc<dyn OutboxRepository>,
        handlers: Handlers,
        config: WorkerConfig,
        rate: f64,
        kill_one: bool,
    ) -> Self {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut report = FaultReport::default();
            let kill = async {
                if kill_one {
                    kill_a_worker(&repo, &handlers, &config, &token).await
                } else {
                    None
                }
            };
            let locks = async {
                if rate > 0.0 {
                    hold_locks(&db, &config, &token).await
                } else {
                    0
                }
            };
            let (killed, holds) = tokio::join!(kill, locks);
            report.lock_holds = holds;
            if let Some(ms) = killed {
                report.killed_workers = 1;
                report.kill_to_reclaim_ms = ms;
            }
            report
        });
        Self { stop, task }
    }

    /// Stops injecting and returns what was injected.
    pub async fn stop(self) -> FaultReport {
        self.stop.cancel();
        self.task.await.unwrap_or_default()
    }
}

/// Every second, holds the row of a random record with a pending capture event, from a
/// connection of its own, for three lock timeouts.
async fn hold_locks(db: &Database, config: &WorkerConfig, stop: &CancellationToken) -> u64 {
    let hold = config.lock_timeout * 3;
    let mut holds = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return holds,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        match hold_one(db, hold, stop).await {
            Ok(true) => holds += 1,
            Ok(false) => {}
            Err(e) => tracing::debug!(error = %e, "could not hold a lock"),
        }
    }
}

async fn hold_one(
    db: &Database,
    hold: Duration,
    stop: &CancellationToken,
) -> Result<bool, outbox_persistence::Error> {
    // A random record with a pending capture event that has not failed twice yet: the holds
    // exercise lock timeouts, and must not fail one event again and again (an event left
    // pending behind a long head, say, would otherwise be picked every time).
    let wait = async {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(hold) => {}
        }
    };
    let key = outbox_persistence::test_support::inspect::random_pending_key(
        db,
        crate::workload::ACCOUNT_UPDATED,
        2,
    )
    .await?;
    let Some(id) = key.and_then(|k| k.split_once(':').map(|(_, id)| id.to_string())) else {
        return Ok(false);
    };
    match db {
        Database::Postgres(pool) => {
            let mut tx = pool
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await?;
            outbox_persistence::statement::query(
                "SELECT 1 FROM DemoAccount WHERE Id = $1 FOR UPDATE",
            )
            .bind(&id)
            .execute(&mut *tx)
            .await?;
            wait.await;
            tx.rollback().await?;
        }
        Database::Sqlite(pool) => {
            // SQLite has no row locks: holding its write lock blocks every writer.
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            outbox_persistence::statement::query(
                "UPDATE DemoAccount SET Revision = Revision WHERE Id = $1",
            )
            .bind(&id)
            .execute(&mut *tx)
            .await?;
            wait.await;
            tx.rollback().await?;
        }
    }
    Ok(true)
}

/// Parks until aborted, after saying it started.
struct Parked(Arc<Notify>);

#[async_trait]
impl Handler for Parked {
    async fn handle(
        &self,
        _: &OutboxEvent,
        _: &mut AttemptContext<'_>,
    ) -> Result<(), HandlerError> {
        self.0.notify_one();
        std::future::pending::<()>().await;
        Ok(())
    }
}

/// Claims one event as an extra worker, kills that worker mid-attempt, and measures how long
/// the row takes to come back through stale reclaim. `None` when there was nothing to claim.
async fn kill_a_worker(
    repo: &Arc<dyn OutboxRepository>,
    handlers: &Handlers,
    config: &WorkerConfig,
    stop: &CancellationToken,
) -> Option<Option<u64>> {
    let policy = config.claim_policy();
    let scope = Scope::Only(vec![ACCOUNT_UPDATED.to_string()]);
    // The workers start first; the claim may find every eligible row taken, or SQLite's
    // writer busy, so it is tried again for a while.
    let mut claim = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if stop.is_cancelled() {
            return None;
        }
        if let Ok(Some(c)) = repo.claim_next(policy, &scope).await {
            claim = Some(c);
            break;
        }
    }
    let claim = claim?;
    let id = claim.event.id;
    let entered = Arc::new(Notify::new());
    let doomed = Handlers::new().register(claim.event.event_type.clone(), Parked(entered.clone()));
    let _ = handlers;
    let runner = ClaimRunner::new(repo.clone(), doomed, config.clone());
    let worker = tokio::spawn(async move { runner.run(claim).await });
    let _ = tokio::time::timeout(Duration::from_secs(10), entered.notified()).await;
    worker.abort();
    let _ = worker.await;
    let killed = Instant::now();
    tracing::info!(event_id = %id, "killed a worker mid-attempt; its row waits for stale reclaim");
    let frozen = repo.get_event(id).await.ok().flatten()?.last_modified_date;
    loop {
        if stop.is_cancelled() {
            return Some(None);
        }
        if let Ok(Some(row)) = repo.get_event(id).await {
            let reclaimed =
                row.status != EventStatus::Processing || row.last_modified_date != frozen;
            if reclaimed {
                return Some(Some(killed.elapsed().as_millis() as u64));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
