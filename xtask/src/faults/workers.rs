//! The work processes: starting an `outbox-demo work --until-drained` process (with the demo's
//! injected faults, and the skewed clock for one of them), telling how one that ended by itself
//! ended, and killing one with SIGKILL while watching the rows it held until they are
//! reclaimed.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::Value;

use super::Rng;
use super::chaos::{Chaos, Phase};
use super::profile::{
    Backend, HEARTBEAT_MS, LOCK_TIMEOUT_MS, MAX_RETRY_ATTEMPTS, ORPHAN_AFTER, POISON_LOG,
    STARTED_LOG, work_log,
};
use super::skew::{self, Skew};
use super::suite::Suite;
use crate::postgres;

/// The demo's `SIDE_URL_ENV` (a copy: xtask depends on no workspace crate).
pub(super) const SIDE_URL_ENV: &str = "OUTBOX_DEMO_SIDE_URL";

/// The signal number of SIGINT.
const SIGINT: i32 = 2;
/// The signal number of SIGABRT (`std::process::abort`).
const SIGABRT: i32 = 6;
/// The signal number of SIGKILL.
const SIGKILL: i32 = 9;

/// One `outbox-demo work` process.
pub(super) struct Worker {
    number: usize,
    pub(super) child: Child,
    stdout: PathBuf,
    /// Whether its wall clock runs behind (the suite never kills it).
    skewed: bool,
}

/// A kill whose orphaned rows are being watched until they are reclaimed.
pub(super) struct KillWatch {
    at: Instant,
    /// Rows in `processing` at the kill, with their `LastModifiedDate`; `true` once seen
    /// frozen past [`ORPHAN_AFTER`].
    rows: HashMap<String, (String, bool)>,
}

/// Whether a work process's stderr says it could not start because its database was away
/// (connection cut, server restarting or refusing connections) before its workers started
/// ([`STARTED_LOG`]): it exits non-zero with the error, as a supervisor expects, and is
/// replaced. After its workers start, a database that is away is theirs to ride out: an exit
/// then is a crash.
fn startup_cut(stderr: &str) -> bool {
    !stderr.contains(STARTED_LOG) && database_away(stderr)
}

/// Whether `stderr` says the database went away (a cut, a restart, a refused connection).
pub(super) fn database_away(stderr: &str) -> bool {
    [
        "terminating connection due to administrator command",
        "the database system is",
        "database unavailable",
        "error communicating with database",
        "Connection refused",
        "Connection reset by peer",
    ]
    .iter()
    .any(|cause| stderr.contains(cause))
}

/// Records how a work process that ended by itself ended: drained or stopped (its JSON report),
/// aborted by a poison event (SIGABRT after [`POISON_LOG`]), refused to start, stopped while
/// starting; anything else crashed.
fn ended(w: &Worker, backend: Backend, status: ExitStatus, phase: Phase, chaos: &mut Chaos) {
    let out = std::fs::read_to_string(&w.stdout).unwrap_or_default();
    let err = std::fs::read_to_string(w.stdout.with_extension("err")).unwrap_or_default();
    match out.lines().last().map(serde_json::from_str::<Value>) {
        Some(Ok(doc)) if status.success() => chaos.process_reports.push(doc),
        _ if status.signal() == Some(SIGABRT) && err.contains(POISON_LOG) => {
            chaos.poison_deaths += 1
        }
        // Only PostgreSQL is cut or restarted by the suite: on SQLite such an exit is a crash.
        _ if backend == Backend::Postgres && status.code() == Some(1) && startup_cut(&err) => {
            chaos.startup_cuts += 1
        }
        // SIGINT sent at the end of the chaos reached a process that was still starting,
        // before it listens for SIGINT: stopped, not crashed.
        _ if phase == Phase::Calm && status.signal() == Some(SIGINT) => {
            chaos.stopped_while_starting += 1
        }
        _ => chaos.crashed.push(format!(
            "work process {} exited with {status}: {}",
            w.number,
            err.trim()
        )),
    }
}

impl Suite<'_> {
    /// Reaps the processes that ended by themselves (see [`ended`]).
    pub(super) fn reap(
        &self,
        workers: &mut Vec<Worker>,
        phase: Phase,
        chaos: &mut Chaos,
    ) -> Result<()> {
        let mut index = 0;
        while index < workers.len() {
            let Some(status) = workers[index].child.try_wait()? else {
                index += 1;
                continue;
            };
            let w = workers.remove(index);
            ended(&w, self.backend, status, phase, chaos);
        }
        Ok(())
    }

    /// SIGKILLs a random work process other than the skewed one (whose report must survive),
    /// journals the kill in the side store (so that verification can order it against the
    /// reclaims), starts a replacement, and returns the watch of the rows it held.
    pub(super) fn kill_one(
        &self,
        rng: &mut Rng,
        workers: &mut Vec<Worker>,
        chaos: &mut Chaos,
    ) -> Result<Option<KillWatch>> {
        let candidates: Vec<usize> = (0..workers.len()).filter(|i| !workers[*i].skewed).collect();
        if candidates.is_empty() {
            return Ok(None);
        }
        // Rows that do not move over a heartbeat interval before the kill were orphaned
        // already (a poison abort, an earlier kill): not this kill's to measure.
        let before: HashMap<String, String> = self.processing_rows()?.into_iter().collect();
        std::thread::sleep(Duration::from_millis(HEARTBEAT_MS + 200));
        let rows: Vec<(String, String)> = self
            .processing_rows()?
            .into_iter()
            .filter(|(id, lmd)| before.get(id) != Some(lmd))
            .collect();
        // A process between a held send and its commit, when one is: the kill aims at it (at
        // each event once: a resend holds again).
        let held = self.held_send(workers, &candidates, &chaos.aimed)?;
        if let Some((_, id, _)) = &held {
            chaos.aimed.insert(id.clone());
        }
        let index = match held {
            Some((i, _, _)) => i,
            None => candidates[rng.below(candidates.len())],
        };
        let mut w = workers.remove(index);
        w.child.kill()?;
        let status = w.child.wait()?;
        if status.signal() != Some(SIGKILL) {
            // It had ended by itself (a poison event aborted it) before the signal.
            ended(&w, self.backend, status, Phase::Chaos, chaos);
            let worker = self.spawn(chaos, workers)?;
            workers.push(worker);
            return Ok(None);
        }
        let at = Instant::now();
        let pid = w.child.id();
        chaos.kills.push(pid);
        // Journaled at once (a rerun is judged against it), with the held send it aimed at.
        let (event_id, count) = held
            .as_ref()
            .map_or((String::new(), 0), |(_, id, count)| (id.clone(), *count));
        self.side_execute(&format!(
            "INSERT INTO DemoAttemptJournal (Mark, EventId, RetryCount, Pid) VALUES ('killed', '{event_id}', {count}, {pid})"
        ))?;
        let watch = KillWatch {
            at,
            rows: rows
                .into_iter()
                .map(|(id, lmd)| (id, (lmd, false)))
                .collect(),
        };
        let worker = self.spawn(chaos, workers)?;
        workers.push(worker);
        // The held send's row still `processing` at the sender's count once the process is
        // gone: the attempt died between its send and its commit. Otherwise the kill was not
        // aimed after all (the attempt had ended, or given the row back): the journal says so.
        if let Some((_, id, count)) = held {
            if self.still_processing_at(&id, count)? {
                chaos.kills_after_a_send += 1;
            } else {
                self.side_execute(&format!(
                    "UPDATE DemoAttemptJournal SET EventId = '', RetryCount = 0
                     WHERE Mark = 'killed' AND Pid = {pid}"
                ))?;
            }
        }
        Ok(Some(watch))
    }

    /// A process among `candidates` (indexes into `workers`) whose journal says it made a held
    /// send (`sent`) whose row is still `processing` at the sender's `RetryCount`: its index,
    /// the event and the count.
    fn held_send(
        &self,
        workers: &[Worker],
        candidates: &[usize],
        aimed: &HashSet<String>,
    ) -> Result<Option<(usize, String, i64)>> {
        let sent = self.side_query(
            "SELECT EventId, RetryCount, Pid FROM DemoAttemptJournal WHERE Mark = 'sent'
             ORDER BY Seq DESC LIMIT 50",
        )?;
        if sent.trim().is_empty() {
            return Ok(None);
        }
        let processing = self.processing_state()?;
        for line in sent.lines() {
            let mut cols = line.split('|');
            let (Some(id), Some(count), Some(pid)) = (cols.next(), cols.next(), cols.next()) else {
                continue;
            };
            let (Ok(count), Ok(pid)) = (count.trim().parse::<i64>(), pid.trim().parse::<u32>())
            else {
                continue;
            };
            if aimed.contains(id) || processing.get(id).map(|(c, _)| *c) != Some(count) {
                continue;
            }
            if let Some(&i) = candidates.iter().find(|&&i| workers[i].child.id() == pid) {
                return Ok(Some((i, id.to_string(), count)));
            }
        }
        Ok(None)
    }

    /// Whether the row `id` is `processing` at `RetryCount` `count` and frozen, read a moment
    /// after its process was killed (a `COMMIT` it sent just before has landed by then) and
    /// again two heartbeat intervals later: a row that still moves is another process's claim
    /// at the same count (the killed one's attempt had given it back uncounted).
    fn still_processing_at(&self, id: &str, count: i64) -> Result<bool> {
        std::thread::sleep(Duration::from_millis(300));
        let first = self.processing_state()?.remove(id);
        std::thread::sleep(Duration::from_millis(2 * HEARTBEAT_MS));
        Ok(first.as_ref().is_some_and(|(c, _)| *c == count)
            && self.processing_state()?.remove(id) == first)
    }

    /// Starts a chaos process: the skewed one when the skew is available and none of
    /// `running` is skewed (a poison event may have aborted it), otherwise an ordinary one.
    pub(super) fn spawn(&self, chaos: &mut Chaos, running: &[Worker]) -> Result<Worker> {
        let skewed = matches!(self.skew, Skew::Ready(_)) && !running.iter().any(|w| w.skewed);
        self.spawn_worker(chaos, true, skewed)
    }

    /// Starts an `outbox-demo work --until-drained` process in the run's directory (where a
    /// process that aborts leaves any core file), with the demo's injected faults when `faults`
    /// and its wall clock [`skew::SKEW_SECONDS`] behind when `skewed`.
    pub(super) fn spawn_worker(
        &self,
        chaos: &mut Chaos,
        faults: bool,
        skewed: bool,
    ) -> Result<Worker> {
        chaos.spawned += 1;
        let number = chaos.spawned;
        // Every other chaos process (never the skewed one) reaches the outbox through the proxy
        // that loses COMMIT replies, and its side store (the journal and work runs verification
        // reads, the mail provider) directly (`OUTBOX_DEMO_SIDE_URL`).
        let base = match &self.reply_loss {
            Some(proxy) if faults && !skewed && number.is_multiple_of(2) => &proxy.url,
            _ => &self.client_url,
        };
        // The connection cuts pick the work processes' connections by this name.
        let named = |base: &str| match self.backend {
            Backend::Postgres => {
                postgres::with_parameter(base, "application_name", &format!("outbox-work-{number}"))
            }
            Backend::Sqlite => self.url.clone(),
        };
        let (url, side_url) = (named(base), named(&self.client_url));
        let stdout = self.dir.join(format!("work-{number}.out"));
        let mut cmd = Command::new(self.binaries.demo);
        cmd.args(self.work_arguments(faults))
            .current_dir(&self.dir)
            .env("DATABASE_URL", &url)
            .env("OUTBOX_LISTEN_URL", self.listen_url())
            .env(
                SIDE_URL_ENV,
                if self.pg.is_some() {
                    side_url.as_str()
                } else {
                    ""
                },
            )
            .env("RUST_LOG", work_log())
            .env_remove("OUTBOX_PULL_WORKER")
            .stdout(File::create(&stdout)?)
            .stderr(File::create(stdout.with_extension("err"))?);
        if let (true, Skew::Ready(library)) = (skewed, self.skew) {
            skew::apply(&mut cmd, library);
        }
        let child = cmd
            .spawn()
            .context("starting an outbox-demo work process")?;
        if skewed {
            chaos.skewed_pids.push(child.id());
        }
        Ok(Worker {
            number,
            child,
            stdout,
            skewed,
        })
    }

    /// The arguments of a chaos or drain `outbox-demo work` process.
    fn work_arguments(&self, faults: bool) -> Vec<String> {
        let workers = self.profile.workers.to_string();
        let heartbeat = HEARTBEAT_MS.to_string();
        let stale_after = self.stale_after_ms().to_string();
        let lock_timeout = LOCK_TIMEOUT_MS.to_string();
        let max_attempts = MAX_RETRY_ATTEMPTS.to_string();
        let batch = self.profile.batch_max_events.to_string();
        let args: Vec<&str> = vec![
            "work",
            "--until-drained",
            "--json",
            "--pull-worker",
            "true",
            "--workers",
            &workers,
            "--fault-rate",
            if faults { "0.04" } else { "0" },
            "--heartbeat-ms",
            &heartbeat,
            "--stale-after-ms",
            &stale_after,
            "--lock-timeout-ms",
            &lock_timeout,
            "--retry-delay-ms",
            "50",
            "--max-retry-delay-ms",
            "2000",
            "--max-retry-attempts",
            &max_attempts,
            "--batch-max-events",
            &batch,
        ];
        args.into_iter().map(str::to_string).collect()
    }

    /// Updates the kill watches: rows frozen past [`ORPHAN_AFTER`] are the killed process's; the
    /// moment such a row changes is its reclaim.
    pub(super) fn follow_watches(
        &self,
        watches: &mut Vec<KillWatch>,
        chaos: &mut Chaos,
    ) -> Result<()> {
        let ids: Vec<&str> = watches
            .iter()
            .flat_map(|w| w.rows.keys().map(String::as_str))
            .collect();
        if ids.is_empty() {
            watches.clear();
            return Ok(());
        }
        let now = self.rows_by_id(&ids)?;
        for watch in watches.iter_mut() {
            let age = watch.at.elapsed();
            watch.rows.retain(|id, (frozen, orphan)| {
                let changed = now
                    .get(id)
                    .is_none_or(|(status, lmd)| status != "processing" || lmd != frozen);
                if !changed {
                    if age >= ORPHAN_AFTER {
                        *orphan = true;
                    }
                    return true;
                }
                if *orphan {
                    chaos.reclaim_ms.push(age.as_millis() as u64);
                }
                false
            });
        }
        watches.retain(|w| !w.rows.is_empty());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{STARTED_LOG, startup_cut};

    #[test]
    fn a_database_away_counts_as_a_startup_cut_only_before_the_workers_started() {
        let reset = "error: database unavailable: error communicating with database: Connection reset by peer (os error 104)";
        assert!(startup_cut(reset));
        assert!(startup_cut(
            "error: FATAL: the database system is shutting down"
        ));
        assert!(!startup_cut(&format!("{STARTED_LOG}\n{reset}")));
        assert!(!startup_cut("error: no such table: DemoAttemptJournal"));
    }
}
