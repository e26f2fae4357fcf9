//! The application beside the workers: while the foreign writers write, the suite runs
//! `outbox-demo seed` again and again, each run one application transaction that upserts
//! [`APP_EVENTS`] events' accounts and leads (the rows the demo's handlers write) and enqueues
//! their events, the way a CRM writes records while the outbox drains. The application must
//! never pay for the workers: a run that fails with a deadlock, a lock timeout or a
//! serialization failure fails the suite (issue 36, finding 1). A run the server restart cut
//! is reported, not held against the workers.
//!
//! PostgreSQL only. SQLite has no row locks to deadlock on: its writers queue for one lock, and
//! an application transaction that holds it keeps every worker's beats out meanwhile, so one
//! longer than stale-after makes other processes' claims look stale (the SQLite limit
//! docs/state-machine.md states, "SQLite"). The SQLite run measured that, not the batches: with 100-event
//! seeds beside 12 workers, a worker waited 5 s for the writer and lost its claims.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::profile::Backend;
use super::suite::Suite;
use crate::postgres;

/// Events (one transaction) per application run.
pub(super) const APP_EVENTS: usize = 100;
/// Between the end of one application run and the start of the next.
const APP_PAUSE: Duration = Duration::from_millis(100);

/// What the application's writes met.
#[derive(Default)]
pub(super) struct AppWrites {
    /// Runs that committed.
    pub(super) committed: u64,
    /// Runs that failed because of the workers (deadlock, lock timeout, serialization), with
    /// what they printed.
    pub(super) failed: Vec<String>,
    /// Runs that lost their connection to the server's restart.
    pub(super) cut_by_restart: u64,
    /// The run under way, and when the next may start.
    running: Option<Child>,
    next: Option<Instant>,
}

/// Whether a failed application run's stderr says the workers cost it: a lock conflict, not
/// the server going away.
fn workers_cost_it(stderr: &str) -> bool {
    !super::workers::database_away(stderr)
}

impl AppWrites {
    /// Whether a run is under way.
    pub(super) fn busy(&self) -> bool {
        self.running.is_some()
    }

    /// Reaps the run under way when it ended, and starts the next when `writing` (and none runs).
    pub(super) fn step(&mut self, suite: &Suite<'_>, writing: bool) -> Result<()> {
        if let Some(child) = &mut self.running {
            let Some(_) = child.try_wait()? else {
                return Ok(());
            };
            let output = self.running.take().expect("a run").wait_with_output()?;
            let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
            if output.status.success() {
                self.committed += 1;
            } else if workers_cost_it(&stderr) {
                self.failed.push(stderr.trim().to_string());
            } else {
                self.cut_by_restart += 1;
            }
            self.next = Some(Instant::now() + APP_PAUSE);
        }
        if writing && self.next.is_none_or(|at| Instant::now() >= at) {
            self.running = Some(suite.spawn_app()?);
        }
        Ok(())
    }
}

impl Suite<'_> {
    /// Starts one application run: `outbox-demo seed` of [`APP_EVENTS`] events over the
    /// workload's records, in one transaction.
    fn spawn_app(&self) -> Result<Child> {
        let url = match self.backend {
            Backend::Postgres => {
                postgres::with_parameter(&self.client_url, "application_name", "outbox-app")
            }
            Backend::Sqlite => self.url.clone(),
        };
        Ok(Command::new(self.binaries.demo)
            .args([
                "seed",
                "--events",
                &APP_EVENTS.to_string(),
                "--records",
                &self.profile.records.to_string(),
                "--fault-rate",
                "0.05",
            ])
            .current_dir(&self.dir)
            .env("DATABASE_URL", &url)
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()?)
    }
}

#[cfg(test)]
mod tests {
    use super::workers_cost_it;

    #[test]
    fn a_lock_conflict_is_the_workers_a_restart_is_not() {
        assert!(workers_cost_it("error: deadlock detected"));
        assert!(workers_cost_it(
            "error: canceling statement due to lock timeout"
        ));
        assert!(!workers_cost_it(
            "error: FATAL: terminating connection due to administrator command"
        ));
    }
}
