//! The chaos: the work processes run while the suite kills them, cuts their connections, holds
//! row locks from outside and restarts PostgreSQL, each on its own clock ([`Profile`]'s
//! paces); then the calm (the processes are told to stop) and the drain by one process without
//! faults, restarted like a supervisor would while rows are left. [`Chaos`] records what was
//! done, for the report.
//!
//! [`Profile`]: super::profile::Profile

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::Value;

use super::Rng;
use super::app::AppWrites;
use super::profile::LOCK_TIMEOUT_MS;
use super::queue::lock_hold_sql;
use super::steps::{Step, claimed_rows_hold_sql, cut_at_step_sql};
use super::suite::{Server, Suite};
use super::workers::{KillWatch, Worker};
use crate::cmd::format_duration;
use crate::postgres;

/// How many claimed outbox rows one outside hold locks.
const CLAIMED_ROWS_HELD: usize = 6;

/// How long a restarted PostgreSQL may take to accept connections again.
const RESTART_LIMIT: Duration = Duration::from_secs(60);

/// Where the run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Work processes run while the suite injects faults.
    Chaos,
    /// The work processes were told to stop (SIGINT) and finish their attempts.
    Calm,
    /// One process without faults drains what is left.
    Drain,
}

/// What the chaos did.
#[derive(Default)]
pub(super) struct Chaos {
    /// The processes killed with SIGKILL.
    pub(super) kills: Vec<u32>,
    /// Kills that found their process between a held send and its commit.
    pub(super) kills_after_a_send: u64,
    /// The events whose held send a kill aimed at (each at most once).
    pub(super) aimed: std::collections::HashSet<String>,
    /// Processes a poison event aborted (SIGABRT after `POISON_LOG`), each replaced.
    pub(super) poison_deaths: usize,
    /// The skewed processes started (a poison abort may end one; another replaces it).
    pub(super) skewed_pids: Vec<u32>,
    pub(super) connections_cut: u64,
    pub(super) cut_rounds: u64,
    /// Cuts aimed at a step of an attempt (`steps.rs`), in [`Step::ALL`]'s order: the rounds
    /// tried, and those that found a connection at the step and cut it.
    pub(super) step_rounds: [u64; 4],
    pub(super) step_cuts: [u64; 4],
    /// Outside holds on claimed outbox rows (the settle's lock timeout).
    pub(super) claimed_holds: u64,
    pub(super) restarts: Vec<Duration>,
    pub(super) lock_holds: u64,
    pub(super) reclaim_ms: Vec<u64>,
    pub(super) crashed: Vec<String>,
    pub(super) startup_cuts: usize,
    pub(super) stopped_while_starting: usize,
    pub(super) process_reports: Vec<Value>,
    pub(super) spawned: usize,
    pub(super) chaos_time: Duration,
    /// The foreign writers' summary line (`outbox-demo foreign`), and the rows they committed.
    pub(super) foreign: Option<String>,
    pub(super) foreign_rows: u64,
    /// The application's own transactions beside the workers (`app.rs`).
    pub(super) app: AppWrites,
}

/// The state of the loop in [`Suite::chaos_loop`].
struct Run<'r, 'a> {
    suite: &'r Suite<'a>,
    rng: &'r mut Rng,
    chaos: &'r mut Chaos,
    workers: Vec<Worker>,
    start: Instant,
    next_kill: Instant,
    next_cut: Instant,
    next_lock: Instant,
    restarted: bool,
    watches: Vec<KillWatch>,
    /// The `psql` sessions holding row locks.
    holders: Vec<Child>,
    /// The foreign writers (`outbox-demo foreign`), until they exit.
    foreign: Option<Child>,
    last_status: Instant,
    last_progress: Instant,
    phase: Phase,
}

impl Suite<'_> {
    /// Runs the work processes and the chaos until the outbox is drained.
    pub(super) fn chaos_loop(&self, rng: &mut Rng, chaos: &mut Chaos) -> Result<()> {
        let p = self.profile;
        let mut workers: Vec<Worker> = Vec::new();
        for _ in 0..p.processes {
            let worker = self.spawn(chaos, &workers)?;
            workers.push(worker);
        }
        let foreign = self.spawn_foreign()?;
        let start = Instant::now();
        let mut run = Run {
            suite: self,
            rng,
            chaos,
            workers,
            start,
            next_kill: start + p.kill_every,
            next_cut: start + p.cut_every,
            next_lock: start + p.lock_every,
            restarted: false,
            watches: Vec::new(),
            holders: Vec::new(),
            foreign: Some(foreign),
            last_status: Instant::now(),
            last_progress: Instant::now(),
            // Chaos, then calm (the chaos processes stopping), then the final drain by one
            // process without faults.
            phase: Phase::Chaos,
        };
        while run.step()? {}
        for mut holder in run.holders {
            let _ = holder.wait();
        }
        if let Some(mut foreign) = run.foreign.take() {
            let _ = foreign.wait();
        }
        let summary = std::fs::read_to_string(self.dir.join("foreign.out")).unwrap_or_default();
        let line = summary.lines().find(|l| l.starts_with("foreign: "));
        run.chaos.foreign_rows = line
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        run.chaos.foreign = line.map(str::to_string);
        Ok(())
    }

    /// Starts `outbox-demo foreign`: writers that insert rows for the demo's records the way
    /// other code does (older `CreatedDate`s, sleeps inside their transactions, some rolled
    /// back) for [`super::profile::Profile::foreign_secs`], beside the work processes. Their
    /// connections are not among those the cuts pick.
    fn spawn_foreign(&self) -> Result<Child> {
        let url = match self.backend {
            super::profile::Backend::Postgres => {
                postgres::with_parameter(&self.client_url, "application_name", "outbox-foreign")
            }
            super::profile::Backend::Sqlite => self.url.clone(),
        };
        let out = self.dir.join("foreign.out");
        Ok(Command::new(self.binaries.demo)
            .args([
                "foreign",
                "--secs",
                &self.profile.foreign_secs.to_string(),
                "--writers",
                "4",
            ])
            .current_dir(&self.dir)
            .env("DATABASE_URL", &url)
            .env("RUST_LOG", "error")
            .stdout(std::fs::File::create(&out)?)
            .stderr(std::fs::File::create(out.with_extension("err"))?)
            .spawn()?)
    }

    /// Whether a kill, a cut or a lock hold now would blur the restart (the restart's own
    /// outage must not be mistaken for a killed worker's frozen rows).
    fn near_restart(&self, start: Instant, restarted: bool) -> bool {
        if self.pg.is_none() {
            return false;
        }
        let t = start.elapsed();
        let at = self.profile.restart_at;
        let (before, after) = (Duration::from_secs(2), Duration::from_secs(1));
        !restarted && t + before >= at || restarted && t < at + before + after
    }
}

impl Run<'_, '_> {
    /// One turn of the loop; `false` once the outbox is drained.
    fn step(&mut self) -> Result<bool> {
        let now = Instant::now();
        self.check_deadline(now)?;
        self.suite.reap(&mut self.workers, self.phase, self.chaos)?;
        if !self.watches.is_empty() {
            self.suite.follow_watches(&mut self.watches, self.chaos)?;
        }
        match self.phase {
            Phase::Chaos => self.inject(now)?,
            Phase::Calm => self.calm()?,
            Phase::Drain => return self.drain(),
        }
        Ok(true)
    }

    /// Fails the run when it is past the profile's deadline, naming the oldest unfinished rows.
    fn check_deadline(&mut self, now: Instant) -> Result<()> {
        let deadline = self.suite.profile.deadline;
        if now.duration_since(self.start) <= deadline {
            return Ok(());
        }
        for w in &mut self.workers {
            let _ = w.child.kill();
        }
        bail!(
            "not drained within {}; oldest unfinished rows:\n  {}",
            format_duration(deadline),
            self.suite.stuck_rows().join("\n  ")
        )
    }

    /// The calm: once every chaos process has stopped, one process without faults drains.
    fn calm(&mut self) -> Result<()> {
        if self.workers.is_empty() {
            println!(
                "  {:>6}  chaos processes stopped; one process without faults drains the rest",
                format_duration(self.start.elapsed())
            );
            let worker = self.suite.spawn_worker(self.chaos, false, false)?;
            self.workers.push(worker);
            self.phase = Phase::Drain;
        }
        std::thread::sleep(Duration::from_millis(100));
        Ok(())
    }

    /// The supervisor: a poison event aborts processes until it is failed, so start another
    /// while rows are left; `false` once none is.
    fn drain(&mut self) -> Result<bool> {
        if self.workers.is_empty() {
            if self.suite.unfinished()? == 0 {
                return Ok(false);
            }
            let worker = self.suite.spawn_worker(self.chaos, false, false)?;
            self.workers.push(worker);
        }
        std::thread::sleep(Duration::from_millis(100));
        Ok(true)
    }

    /// One turn of the chaos: replace missing processes, inject the faults that are due, print
    /// progress, and end the chaos when it is time.
    fn inject(&mut self, now: Instant) -> Result<()> {
        let suite = self.suite;
        if self.workers.len() < suite.profile.processes {
            let worker = suite.spawn(self.chaos, &self.workers)?;
            self.workers.push(worker);
        }
        if now >= self.next_kill && !suite.near_restart(self.start, self.restarted) {
            if let Some(watch) = suite.kill_one(self.rng, &mut self.workers, self.chaos)? {
                self.watches.push(watch);
            }
            self.next_kill = now + suite.profile.kill_every;
        }
        if let Some(server) = &suite.pg {
            self.cut_connections(now, server);
            self.hold_locks(now)?;
            self.restart(now, server)?;
        }
        self.holders
            .retain_mut(|h| h.try_wait().ok().flatten().is_none());
        // The application writes while the foreign writers do, never across the restart, and
        // on PostgreSQL only (see `app.rs`).
        let writing = suite.pg.is_some()
            && self.start.elapsed() < Duration::from_secs(suite.profile.foreign_secs)
            && !suite.near_restart(self.start, self.restarted);
        self.chaos.app.step(suite, writing)?;
        self.progress();
        self.end_chaos_when_due();
        std::thread::sleep(Duration::from_millis(150));
        Ok(())
    }

    /// Cuts connections, one round in two each way: about a quarter of the work processes'
    /// connections at random (`pg_terminate_backend`), or one connection at a step of an
    /// attempt (`steps.rs`), the steps in turn.
    fn cut_connections(&mut self, now: Instant, server: &Server) {
        if now < self.next_cut || self.suite.near_restart(self.start, self.restarted) {
            return;
        }
        let round = self.chaos.cut_rounds + self.chaos.step_rounds.iter().sum::<u64>();
        if round % 2 == 1 {
            let index = (round / 2) as usize % Step::ALL.len();
            let sql = cut_at_step_sql(&server.name, Step::ALL[index]);
            if let Ok(out) = postgres::psql(&server.admin, &sql) {
                self.chaos.step_rounds[index] += 1;
                let cut = out.trim().parse::<u64>().unwrap_or(0);
                self.chaos.step_cuts[index] += cut;
                self.chaos.connections_cut += cut;
            }
        } else {
            let sql = format!(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                 WHERE datname = '{}' AND application_name LIKE 'outbox-work-%'
                   AND pid <> pg_backend_pid() AND random() < 0.25",
                server.name
            );
            if let Ok(out) = postgres::psql(&server.admin, &sql) {
                self.chaos.connections_cut += out.trim().parse::<u64>().unwrap_or(0);
                self.chaos.cut_rounds += 1;
            }
        }
        self.next_cut = Instant::now() + self.suite.profile.cut_every;
    }

    /// Starts an outside `psql` session that holds row locks past the workers' lock timeout,
    /// in turn: a few demo accounts whose events are pending (the handlers' writes meet it), or
    /// a few claimed outbox rows (the settles' and beats' writes meet it).
    fn hold_locks(&mut self, now: Instant) -> Result<()> {
        if now < self.next_lock || self.suite.near_restart(self.start, self.restarted) {
            return Ok(());
        }
        self.next_lock = now + self.suite.profile.lock_every;
        let seconds = (LOCK_TIMEOUT_MS * 4) as f64 / 1000.0;
        let hold = if self.chaos.lock_holds > self.chaos.claimed_holds * 2 {
            self.chaos.claimed_holds += 1;
            claimed_rows_hold_sql(CLAIMED_ROWS_HELD, seconds)
        } else {
            // A lookup that fails (the server is busy coming back) skips this hold, as a hold
            // that cannot connect would.
            let Ok(accounts) = self.suite.accounts_to_lock(self.rng) else {
                return Ok(());
            };
            // Nothing to lock (no pending capture event that failed fewer than twice): no hold.
            if accounts.is_empty() {
                return Ok(());
            }
            self.chaos.lock_holds += 1;
            lock_hold_sql(&accounts, seconds)
        };
        let holder = postgres::psql_command(&self.suite.url, &hold)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.holders.push(holder);
        Ok(())
    }

    /// Restarts PostgreSQL once, at the profile's time, and waits until it is back.
    fn restart(&mut self, now: Instant, server: &Server) -> Result<()> {
        if self.restarted || now.duration_since(self.start) < self.suite.profile.restart_at {
            return Ok(());
        }
        self.restarted = true;
        let began = Instant::now();
        println!("restarting PostgreSQL {}/main", server.version);
        let status = Command::new("pg_ctlcluster")
            .args([
                "--skip-systemctl-redirect",
                "-m",
                "fast",
                &server.version,
                "main",
                "restart",
            ])
            .status()?;
        postgres::wait_ready(&server.admin, RESTART_LIMIT)?;
        if !status.success() {
            bail!("pg_ctlcluster restart exited with {status}");
        }
        self.chaos.restarts.push(began.elapsed());
        println!(
            "PostgreSQL is back after {}",
            format_duration(began.elapsed())
        );
        Ok(())
    }

    /// Every 5 s: the rows by status, the processes and the kills so far.
    fn progress(&mut self) {
        if self.last_progress.elapsed() < Duration::from_secs(5) {
            return;
        }
        self.last_progress = Instant::now();
        if let Ok(counts) = self.suite.counts() {
            println!(
                "  {:>6}  {}; {} processes, {} kills so far",
                format_duration(self.start.elapsed()),
                counts.line(),
                self.workers.len(),
                self.chaos.kills.len()
            );
        }
    }

    /// Every 500 ms: once few rows are left, or the chaos has run its limit (and the restart is
    /// behind), tell the work processes to stop (SIGINT) and enter the calm.
    fn end_chaos_when_due(&mut self) {
        if self.last_status.elapsed() < Duration::from_millis(500) {
            return;
        }
        self.last_status = Instant::now();
        let p = self.suite.profile;
        let unfinished = self.suite.unfinished().ok();
        let restart_done = self.suite.pg.is_none() || self.restarted;
        let calm =
            unfinished.is_some_and(|n| n <= p.calm_below) || self.start.elapsed() >= p.chaos_limit;
        // The foreign writers stop by themselves; the calm waits for them, so that the final
        // drain meets no new row.
        let foreign_done = self
            .foreign
            .as_mut()
            .is_none_or(|c| c.try_wait().ok().flatten().is_some());
        if !(calm && restart_done && foreign_done && !self.chaos.app.busy()) {
            return;
        }
        println!(
            "  {:>6}  chaos ends with {} rows unfinished ({} kills, {} connections cut, {} restart(s))",
            format_duration(self.start.elapsed()),
            unfinished.map_or("?".to_string(), |n| n.to_string()),
            self.chaos.kills.len(),
            self.chaos.connections_cut,
            self.chaos.restarts.len()
        );
        self.chaos.chaos_time = self.start.elapsed();
        for w in &self.workers {
            let _ = Command::new("kill")
                .args(["-INT", &w.child.id().to_string()])
                .status();
        }
        self.phase = Phase::Calm;
    }
}
