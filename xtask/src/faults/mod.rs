//! `cargo xtask faults [--quick]`: the fault suite. Seeds the demo workload with handler faults
//! and a poison event, runs three `outbox work` processes of four workers each (one of them with
//! its wall clock 40 s behind), and while they run kills a random process with SIGKILL every few
//! seconds (never the skewed one), cuts random worker connections with `pg_terminate_backend`,
//! restarts PostgreSQL once and holds row locks from an outside `psql` session. Like a
//! supervisor, it starts a new process for each one that died, including those the poison event
//! aborted, until the outbox is drained. Then it runs `outbox verify --json` and checks on top of
//! it that no process that lived lost a claim, that every reclaimed slow attempt belonged to a
//! process the suite had killed before the reclaim (each kill is journaled), and that the poison
//! event ended `failed`. The same suite, minus what SQLite cannot do (cut connections, restart a
//! server, hold one row's lock), runs on SQLite.
//!
//! The suite drives the release binary through its command line only, like an operator would,
//! so xtask still depends on no workspace crate.

mod report;
mod skew;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::cmd::{Cmd, format_duration};
use crate::{is_ci, postgres, project_root};
use skew::Skew;

/// Which backends a run covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Postgres,
    Sqlite,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        }
    }
}

/// The size and pace of a run.
#[derive(Debug, Clone)]
struct Profile {
    name: &'static str,
    events: usize,
    records: usize,
    processes: usize,
    workers: usize,
    slow_events: usize,
    slow_ms: u64,
    /// Poison events: each aborts every process that runs it until it is counted `failed`.
    poison_events: usize,
    /// Between two SIGKILLs.
    kill_every: Duration,
    /// Between two rounds of `pg_terminate_backend`.
    cut_every: Duration,
    /// Between two outside row-lock holds.
    lock_every: Duration,
    /// When, after the workers start, PostgreSQL restarts.
    restart_at: Duration,
    /// The chaos stops after this, or once no more than `calm_below` rows are unfinished;
    /// the work processes are then stopped (SIGINT) and one process without faults drains the
    /// rest, so that the last rows are not starved by lock holds aimed at them.
    chaos_limit: Duration,
    calm_below: i64,
    /// The whole run must drain within this.
    deadline: Duration,
}

const FULL: Profile = Profile {
    name: "full",
    events: 20_000,
    records: 500,
    processes: 3,
    workers: 4,
    slow_events: 20,
    slow_ms: 5_000,
    poison_events: 1,
    kill_every: Duration::from_secs(3),
    cut_every: Duration::from_secs(2),
    lock_every: Duration::from_millis(1_500),
    restart_at: Duration::from_secs(8),
    chaos_limit: Duration::from_secs(150),
    calm_below: 100,
    deadline: Duration::from_secs(600),
};

const QUICK: Profile = Profile {
    name: "quick",
    events: 12_000,
    records: 300,
    processes: 3,
    workers: 4,
    slow_events: 4,
    slow_ms: 4_000,
    poison_events: 1,
    kill_every: Duration::from_millis(1_500),
    cut_every: Duration::from_secs(1),
    lock_every: Duration::from_secs(1),
    restart_at: Duration::from_secs(3),
    chaos_limit: Duration::from_secs(30),
    calm_below: 40,
    deadline: Duration::from_secs(80),
};

impl Profile {
    /// The profile on `backend`. SQLite has one writer for all processes (about a tenth of
    /// PostgreSQL's throughput under this chaos, and a slow handler holds that writer for its
    /// whole sleep), so it runs a quarter of the events, fewer slow ones, and kills less often.
    fn on(&self, backend: Backend) -> Profile {
        match backend {
            Backend::Postgres => self.clone(),
            Backend::Sqlite => Profile {
                events: self.events / 8,
                records: self.records / 2,
                slow_events: self.slow_events / 4,
                slow_ms: STALE_AFTER_MS + 500,
                kill_every: self.kill_every * 2,
                chaos_limit: self.chaos_limit / 2,
                calm_below: self.calm_below / 2,
                ..self.clone()
            },
        }
    }
}

/// Worker settings of every `outbox work` process: short heartbeats so that reclaims happen
/// within the run.
const HEARTBEAT_MS: u64 = 500;
const STALE_AFTER_MS: u64 = 3_000;
const LOCK_TIMEOUT_MS: u64 = 300;
/// A row frozen this long after a kill belongs to the killed process (live claims heartbeat
/// every `HEARTBEAT_MS`).
const ORPHAN_AFTER: Duration = Duration::from_millis(2_000);
/// MaxRetryAttempts of every work process: a poison event aborts this many processes, each
/// followed by at least stale-after (on SQLite up to three times that, when its one writer is
/// busy) before the next claim counts the death. Six keeps that chain inside the quick run's
/// deadline, and still lets an ordinary event fail only when six attempts in a row fail.
const MAX_RETRY_ATTEMPTS: i32 = 6;
/// The event type of the slow handler (`report.slow` in the demo workload).
const SLOW_EVENT_TYPE: &str = "report.slow";
/// What a work process writes to stderr before a poison event aborts it: a copy of
/// `outbox-cli`'s `demo::POISON_LOG` (a unit test keeps the two equal).
const POISON_LOG: &str = "poison event: aborting the process";

/// The command-line options of `cargo xtask faults`.
#[derive(Debug)]
struct Options {
    quick: bool,
    backends: Vec<Backend>,
    report: Option<PathBuf>,
    seed: u64,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut options = Options {
        quick: false,
        backends: vec![Backend::Postgres, Backend::Sqlite],
        report: None,
        seed: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .cloned()
                .with_context(|| format!("`{name}` needs a value"))
        };
        match arg.as_str() {
            "--quick" => options.quick = true,
            "--backend" => {
                options.backends = match value("--backend")?.as_str() {
                    "postgres" => vec![Backend::Postgres],
                    "sqlite" => vec![Backend::Sqlite],
                    "both" => vec![Backend::Postgres, Backend::Sqlite],
                    other => bail!("unknown backend `{other}` (postgres, sqlite or both)"),
                }
            }
            "--report" => options.report = Some(PathBuf::from(value("--report")?)),
            "--seed" => {
                options.seed = value("--seed")?
                    .parse()
                    .context("`--seed` takes a number")?
            }
            other => bail!(
                "unexpected argument `{other}`; usage: cargo xtask faults [--quick] [--backend postgres|sqlite|both] [--report FILE] [--seed N]"
            ),
        }
    }
    Ok(options)
}

/// `cargo xtask faults [--quick] [--backend postgres|sqlite|both] [--report FILE] [--seed N]`.
pub fn run(args: &[String]) -> Result<()> {
    let options = parse(args)?;
    let profile = if options.quick { QUICK } else { FULL };
    println!(
        "fault suite ({} profile, seed {}), backends: {}",
        profile.name,
        options.seed,
        options
            .backends
            .iter()
            .map(|b| b.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let skew = skew::prepare(is_ci())?;
    match &skew {
        Skew::Ready(library) => println!(
            "one work process runs {} s behind (LD_PRELOAD={})",
            skew::SKEW_SECONDS,
            library.display()
        ),
        Skew::Unavailable(why) => println!("skipping the skewed-clock process: {why}"),
    }
    Cmd::cargo(&["build", "--release", "-p", "outbox-cli"]).run()?;
    let binary = project_root().join("target/release/outbox");
    let mut reports = Vec::new();
    let mut failed = Vec::new();
    for (index, backend) in options.backends.iter().enumerate() {
        let mut rng = Rng(options.seed.wrapping_add(index as u64));
        let profile = profile.on(*backend);
        let outcome = Suite::new(*backend, &profile, &binary, &skew)?.run(&mut rng);
        match outcome {
            Ok(report) => {
                println!("\n{}", report.markdown);
                if !report.passed {
                    failed.push(backend.name());
                }
                reports.push(report.markdown);
            }
            Err(error) => {
                println!("\nfault suite on {}: ERROR: {error:#}", backend.name());
                failed.push(backend.name());
            }
        }
    }
    if let Some(path) = &options.report {
        std::fs::write(path, reports.join("\n"))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("report written to {}", path.display());
    }
    if !failed.is_empty() {
        bail!("the fault suite failed on {}", failed.join(", "));
    }
    println!("fault suite passed");
    Ok(())
}

/// SplitMix64: the suite's choices, reproducible with `--seed`.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// Milliseconds since the Unix epoch (names the run's database and directory).
fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// One `outbox work` process.
struct Worker {
    number: usize,
    child: Child,
    stdout: PathBuf,
    /// Whether its wall clock runs behind (the suite never kills it).
    skewed: bool,
}

/// Where the run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Work processes run while the suite injects faults.
    Chaos,
    /// The work processes were told to stop (SIGINT) and finish their attempts.
    Calm,
    /// One process without faults drains what is left.
    Drain,
}

/// The signal number of SIGINT.
const SIGINT: i32 = 2;
/// The signal number of SIGABRT (`std::process::abort`).
const SIGABRT: i32 = 6;
/// The signal number of SIGKILL.
const SIGKILL: i32 = 9;

/// Whether a work process's stderr says its connection was cut while it started (before any
/// worker ran): it exits non-zero with the error, as a supervisor expects, and is replaced.
fn startup_cut(stderr: &str) -> bool {
    stderr.contains("terminating connection due to administrator command")
        || stderr.contains("the database system is")
}

/// Records how a work process that ended by itself ended: drained or stopped (its JSON report),
/// aborted by a poison event (SIGABRT after [`POISON_LOG`]), refused to start, stopped while
/// starting; anything else crashed.
fn ended(w: &Worker, status: ExitStatus, phase: Phase, chaos: &mut Chaos) {
    let out = std::fs::read_to_string(&w.stdout).unwrap_or_default();
    let err = std::fs::read_to_string(w.stdout.with_extension("err")).unwrap_or_default();
    match out.lines().last().map(serde_json::from_str::<Value>) {
        Some(Ok(doc)) if status.success() => chaos.process_reports.push(doc),
        _ if status.signal() == Some(SIGABRT) && err.contains(POISON_LOG) => {
            chaos.poison_deaths += 1
        }
        _ if startup_cut(&err) => chaos.startup_cuts += 1,
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

/// A kill whose orphaned rows are being watched until they are reclaimed.
struct KillWatch {
    at: Instant,
    /// Rows in `processing` at the kill, with their `LastModifiedDate`; `true` once seen
    /// frozen past [`ORPHAN_AFTER`].
    rows: HashMap<String, (String, bool)>,
}

/// What the chaos did.
#[derive(Default)]
struct Chaos {
    /// The processes killed with SIGKILL.
    kills: Vec<u32>,
    /// Processes a poison event aborted (SIGABRT after `POISON_LOG`), each replaced.
    poison_deaths: usize,
    /// The skewed processes started (a poison abort may end one; another replaces it).
    skewed_pids: Vec<u32>,
    connections_cut: u64,
    cut_rounds: u64,
    restarts: Vec<Duration>,
    lock_holds: u64,
    reclaim_ms: Vec<u64>,
    crashed: Vec<String>,
    startup_cuts: usize,
    stopped_while_starting: usize,
    process_reports: Vec<Value>,
    spawned: usize,
    chaos_time: Duration,
}

struct Suite<'a> {
    backend: Backend,
    profile: &'a Profile,
    binary: &'a Path,
    skew: &'a Skew,
    dir: PathBuf,
    url: String,
    /// PostgreSQL: the database's name, the admin URL and the cluster version.
    pg: Option<(String, String, String)>,
}

struct SuiteReport {
    markdown: String,
    passed: bool,
}

impl<'a> Suite<'a> {
    fn new(
        backend: Backend,
        profile: &'a Profile,
        binary: &'a Path,
        skew: &'a Skew,
    ) -> Result<Self> {
        let stamp = unix_ms();
        let dir = project_root().join("target/faults").join(format!(
            "{}-{}-{stamp}",
            backend.name(),
            profile.name
        ));
        std::fs::create_dir_all(&dir)?;
        let (url, pg) = match backend {
            Backend::Postgres => {
                let admin = postgres::database_url();
                postgres::check_reachable(&admin).map_err(anyhow::Error::msg)?;
                let name = format!("outbox_faults_{stamp}");
                let url = with_database(&admin, &name);
                let version = cluster_version()?;
                (url, Some((name, admin, version)))
            }
            Backend::Sqlite => (
                format!("sqlite://{}", dir.join("outbox.db").display()),
                None,
            ),
        };
        Ok(Self {
            backend,
            profile,
            binary,
            skew,
            dir,
            url,
            pg,
        })
    }

    fn run(self, rng: &mut Rng) -> Result<SuiteReport> {
        if let Some((name, admin, _)) = &self.pg {
            psql(admin, &format!("CREATE DATABASE {name}"))?;
        }
        let result = self.run_in_database(rng);
        if let Some((name, admin, _)) = &self.pg {
            let _ = wait_ready(admin, Duration::from_secs(30));
            if let Err(e) = psql(
                admin,
                &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            ) {
                eprintln!("could not drop {name}: {e:#}");
            }
        }
        result
    }

    fn outbox(&self, args: &[&str]) -> Result<String> {
        let output = Command::new(self.binary)
            .args(args)
            .current_dir(&self.dir)
            .env("DATABASE_URL", &self.url)
            .env("RUST_LOG", "error")
            .env_remove("OUTBOX_PULL_WORKER")
            .output()
            .with_context(|| format!("running outbox {}", args.join(" ")))?;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        if !output.status.success() && args[0] != "verify" {
            bail!(
                "`outbox {}` exited with {}: {}{}",
                args.join(" "),
                output.status,
                stdout,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(stdout)
    }

    fn run_in_database(&self, rng: &mut Rng) -> Result<SuiteReport> {
        let p = self.profile;
        let started = Instant::now();
        self.outbox(&["migrate"])?;
        let (events, records, slow, slow_ms, poison) = (
            p.events.to_string(),
            p.records.to_string(),
            p.slow_events.to_string(),
            p.slow_ms.to_string(),
            p.poison_events.to_string(),
        );
        print!(
            "{}",
            self.outbox(&[
                "seed",
                "--events",
                &events,
                "--records",
                &records,
                "--fault-rate",
                "0.05",
                "--slow-events",
                &slow,
                "--slow-ms",
                &slow_ms,
                "--poison-events",
                &poison,
            ])?
        );
        let mut chaos = Chaos::default();
        let run_started = Instant::now();
        self.chaos_loop(rng, &mut chaos)?;
        let drain_time = run_started.elapsed();
        // A last drain by one process, then the verification.
        let last = self.outbox(&[
            "work",
            "--until-drained",
            "--json",
            "--pull-worker",
            "true",
            "--heartbeat-ms",
            &HEARTBEAT_MS.to_string(),
            "--stale-after-ms",
            &self.stale_after_ms().to_string(),
        ])?;
        if let Some(line) = last.lines().last()
            && let Ok(doc) = serde_json::from_str::<Value>(line)
        {
            chaos.process_reports.push(doc);
        }
        let verify_out = self.outbox(&["verify", "--json"])?;
        let verification: Value = serde_json::from_str(&verify_out)
            .with_context(|| format!("`outbox verify --json` printed no JSON: {verify_out}"))?;
        let processing =
            self.count("SELECT count(*) FROM _System_OutboxEvent WHERE Status = 'processing'")?;
        Ok(self.report(
            &chaos,
            &verification,
            processing,
            drain_time,
            started.elapsed(),
        ))
    }

    /// Runs the work processes and the chaos until the outbox is drained.
    fn chaos_loop(&self, rng: &mut Rng, chaos: &mut Chaos) -> Result<()> {
        let p = self.profile;
        let mut workers: Vec<Worker> = Vec::new();
        for _ in 0..p.processes {
            let worker = self.spawn(chaos, &workers)?;
            workers.push(worker);
        }
        let start = Instant::now();
        let mut next_kill = start + p.kill_every;
        let mut next_cut = start + p.cut_every;
        let mut next_lock = start + p.lock_every;
        let mut restarted = false;
        let mut watches: Vec<KillWatch> = Vec::new();
        let mut holders: Vec<Child> = Vec::new();
        let mut last_status = Instant::now();
        let mut last_progress = Instant::now();
        // Chaos, then calm (the chaos processes stopping), then the final drain by one process
        // without faults.
        let mut phase = Phase::Chaos;
        loop {
            let now = Instant::now();
            if now.duration_since(start) > p.deadline {
                for w in &mut workers {
                    let _ = w.child.kill();
                }
                let stuck = self
                    .query(
                        "SELECT Id, EventType, Status, RetryCount, LastModifiedDate, LastError
                         FROM _System_OutboxEvent WHERE Status IN ('pending', 'processing')
                         ORDER BY CreatedDate, Id LIMIT 20",
                    )
                    .unwrap_or_default();
                let stuck: Vec<String> = stuck.iter().map(|r| r.join(" | ")).collect();
                bail!(
                    "not drained within {}; oldest unfinished rows:\n  {}",
                    format_duration(p.deadline),
                    stuck.join("\n  ")
                );
            }
            self.reap(&mut workers, phase, chaos)?;
            if !watches.is_empty() {
                self.follow_watches(&mut watches, chaos)?;
            }
            match phase {
                Phase::Chaos => {}
                Phase::Calm => {
                    if workers.is_empty() {
                        println!(
                            "  {:>6}  chaos processes stopped; one process without faults drains the rest",
                            format_duration(start.elapsed())
                        );
                        workers.push(self.spawn_worker(chaos, false, false)?);
                        phase = Phase::Drain;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                Phase::Drain => {
                    // The supervisor: a poison event aborts processes until it is failed, so
                    // start another while rows are left.
                    if workers.is_empty() {
                        if self.unfinished()? == 0 {
                            break;
                        }
                        workers.push(self.spawn_worker(chaos, false, false)?);
                    }
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            }
            if workers.len() < p.processes {
                let worker = self.spawn(chaos, &workers)?;
                workers.push(worker);
            }
            if now >= next_kill && !self.near_restart(start, restarted) {
                if let Some(watch) = self.kill_one(rng, &mut workers, chaos)? {
                    watches.push(watch);
                }
                next_kill = now + p.kill_every;
            }
            if let Some((name, admin, version)) = &self.pg {
                if now >= next_cut && !self.near_restart(start, restarted) {
                    let sql = format!(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                         WHERE datname = '{name}' AND application_name LIKE 'outbox-work-%'
                           AND pid <> pg_backend_pid() AND random() < 0.25"
                    );
                    if let Ok(out) = psql(admin, &sql) {
                        chaos.connections_cut += out.trim().parse::<u64>().unwrap_or(0);
                        chaos.cut_rounds += 1;
                    }
                    next_cut = now + p.cut_every;
                }
                if now >= next_lock && !self.near_restart(start, restarted) {
                    // Rows that failed twice are left alone: the holds exercise lock timeouts,
                    // they must not use up one event's attempts.
                    let hold = format!(
                        "BEGIN; SELECT Id FROM DemoAccount WHERE Id IN (
                           SELECT split_part(RecordKey, ':', 2) FROM _System_OutboxEvent
                           WHERE Status = 'pending' AND EventType = 'account.updated'
                             AND RetryCount < 2
                           ORDER BY random() LIMIT 3) FOR UPDATE;
                         SELECT pg_sleep({:.1}); ROLLBACK;",
                        (LOCK_TIMEOUT_MS * 4) as f64 / 1000.0
                    );
                    holders.push(
                        Command::new("psql")
                            .args(["-X", "-q", "-d", &self.url, "-c", &hold])
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .spawn()?,
                    );
                    chaos.lock_holds += 1;
                    next_lock = now + p.lock_every;
                }
                if !restarted && now.duration_since(start) >= p.restart_at {
                    restarted = true;
                    let began = Instant::now();
                    println!("restarting PostgreSQL {version}/main");
                    let status = Command::new("pg_ctlcluster")
                        .args([
                            "--skip-systemctl-redirect",
                            "-m",
                            "fast",
                            version,
                            "main",
                            "restart",
                        ])
                        .status()?;
                    wait_ready(admin, Duration::from_secs(60))?;
                    if !status.success() {
                        bail!("pg_ctlcluster restart exited with {status}");
                    }
                    chaos.restarts.push(began.elapsed());
                    println!(
                        "PostgreSQL is back after {}",
                        format_duration(began.elapsed())
                    );
                }
            }
            holders.retain_mut(|h| h.try_wait().ok().flatten().is_none());
            if last_progress.elapsed() >= Duration::from_secs(5) {
                last_progress = Instant::now();
                if let Ok(rows) = self.query(
                    "SELECT Status, count(*) FROM _System_OutboxEvent GROUP BY Status ORDER BY Status",
                ) {
                    let counts: Vec<String> = rows.iter().map(|r| r.join(" ")).collect();
                    println!(
                        "  {:>6}  {}; {} processes, {} kills so far",
                        format_duration(start.elapsed()),
                        counts.join(", "),
                        workers.len(),
                        chaos.kills.len()
                    );
                }
            }
            if last_status.elapsed() >= Duration::from_millis(500) {
                last_status = Instant::now();
                let unfinished = self.unfinished().ok();
                let restart_done = self.pg.is_none() || restarted;
                let calm = unfinished.is_some_and(|n| n <= p.calm_below)
                    || start.elapsed() >= p.chaos_limit;
                if calm && restart_done {
                    println!(
                        "  {:>6}  chaos ends with {} rows unfinished ({} kills, {} connections cut, {} restart(s))",
                        format_duration(start.elapsed()),
                        unfinished.map_or("?".to_string(), |n| n.to_string()),
                        chaos.kills.len(),
                        chaos.connections_cut,
                        chaos.restarts.len()
                    );
                    chaos.chaos_time = start.elapsed();
                    for w in &workers {
                        let _ = Command::new("kill")
                            .args(["-INT", &w.child.id().to_string()])
                            .status();
                    }
                    phase = Phase::Calm;
                }
            }
            std::thread::sleep(Duration::from_millis(150));
        }
        for mut h in holders {
            let _ = h.wait();
        }
        Ok(())
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

    /// Rows still pending or processing.
    fn unfinished(&self) -> Result<i64> {
        self.count(
            "SELECT count(*) FROM _System_OutboxEvent WHERE Status IN ('pending', 'processing')",
        )
    }

    /// Stale-after of the work processes (see [`STALE_AFTER_MS`]).
    fn stale_after_ms(&self) -> u64 {
        STALE_AFTER_MS
    }

    /// Reaps the processes that ended by themselves (see [`ended`]).
    fn reap(&self, workers: &mut Vec<Worker>, phase: Phase, chaos: &mut Chaos) -> Result<()> {
        let mut index = 0;
        while index < workers.len() {
            let Some(status) = workers[index].child.try_wait()? else {
                index += 1;
                continue;
            };
            let w = workers.remove(index);
            ended(&w, status, phase, chaos);
        }
        Ok(())
    }

    /// SIGKILLs a random work process other than the skewed one (whose report must survive),
    /// journals the kill in the side store (so that verification can order it against the
    /// reclaims), starts a replacement, and returns the watch of the rows it held.
    fn kill_one(
        &self,
        rng: &mut Rng,
        workers: &mut Vec<Worker>,
        chaos: &mut Chaos,
    ) -> Result<Option<KillWatch>> {
        let candidates: Vec<usize> = (0..workers.len()).filter(|i| !workers[*i].skewed).collect();
        if candidates.is_empty() {
            return Ok(None);
        }
        let mut w = workers.remove(candidates[rng.below(candidates.len())]);
        // Rows that do not move over a heartbeat interval before the kill were orphaned
        // already (a poison abort, an earlier kill): not this kill's to measure.
        let before: HashMap<String, String> = self.processing_rows()?.into_iter().collect();
        std::thread::sleep(Duration::from_millis(HEARTBEAT_MS + 200));
        let rows: Vec<(String, String)> = self
            .processing_rows()?
            .into_iter()
            .filter(|(id, lmd)| before.get(id) != Some(lmd))
            .collect();
        w.child.kill()?;
        let status = w.child.wait()?;
        if status.signal() != Some(SIGKILL) {
            // It had ended by itself (a poison event aborted it) before the signal.
            ended(&w, status, Phase::Chaos, chaos);
            let worker = self.spawn(chaos, workers)?;
            workers.push(worker);
            return Ok(None);
        }
        let pid = w.child.id();
        chaos.kills.push(pid);
        self.side_execute(&format!(
            "INSERT INTO DemoAttemptJournal (Mark, EventId, RetryCount, Pid) VALUES ('killed', '', 0, {pid})"
        ))?;
        let watch = KillWatch {
            at: Instant::now(),
            rows: rows
                .into_iter()
                .map(|(id, lmd)| (id, (lmd, false)))
                .collect(),
        };
        let worker = self.spawn(chaos, workers)?;
        workers.push(worker);
        Ok(Some(watch))
    }

    /// Starts a chaos process: the skewed one when the skew is available and none of
    /// `running` is skewed (a poison event may have aborted it), otherwise an ordinary one.
    fn spawn(&self, chaos: &mut Chaos, running: &[Worker]) -> Result<Worker> {
        let skewed = matches!(self.skew, Skew::Ready(_)) && !running.iter().any(|w| w.skewed);
        self.spawn_worker(chaos, true, skewed)
    }

    /// Starts an `outbox work --until-drained` process in the run's directory (where a process
    /// that aborts leaves any core file), with the demo's injected faults when `faults` and its
    /// wall clock [`skew::SKEW_SECONDS`] behind when `skewed`.
    fn spawn_worker(&self, chaos: &mut Chaos, faults: bool, skewed: bool) -> Result<Worker> {
        chaos.spawned += 1;
        let number = chaos.spawned;
        let url = if self.backend == Backend::Postgres {
            format!("{}?application_name=outbox-work-{number}", self.url)
        } else {
            self.url.clone()
        };
        let stdout = self.dir.join(format!("work-{number}.out"));
        let workers = self.profile.workers.to_string();
        let mut cmd = Command::new(self.binary);
        cmd.args([
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
            &HEARTBEAT_MS.to_string(),
            "--stale-after-ms",
            &self.stale_after_ms().to_string(),
            "--lock-timeout-ms",
            &LOCK_TIMEOUT_MS.to_string(),
            "--retry-delay-ms",
            "50",
            "--max-retry-delay-ms",
            "2000",
            "--max-retry-attempts",
            &MAX_RETRY_ATTEMPTS.to_string(),
        ])
        .current_dir(&self.dir)
        .env("DATABASE_URL", &url)
        .env("RUST_LOG", "error")
        .env_remove("OUTBOX_PULL_WORKER")
        .stdout(File::create(&stdout)?)
        .stderr(File::create(stdout.with_extension("err"))?);
        if let (true, Skew::Ready(library)) = (skewed, self.skew) {
            skew::apply(&mut cmd, library);
        }
        let child = cmd.spawn().context("starting an outbox work process")?;
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

    /// Rows in `processing`, with their `LastModifiedDate` (as text).
    fn processing_rows(&self) -> Result<Vec<(String, String)>> {
        let mut sql = String::from(
            "SELECT Id, LastModifiedDate FROM _System_OutboxEvent WHERE Status = 'processing'",
        );
        if self.backend == Backend::Sqlite {
            // SQLite attempts hold the write lock and heartbeat only outside it: a slow
            // handler's row stays frozen while it is alive, so it cannot be told from an orphan.
            write!(sql, " AND EventType <> '{SLOW_EVENT_TYPE}'")?;
        }
        Ok(self
            .query(&sql)?
            .into_iter()
            .filter_map(|mut r| Some((r.remove(0), r.pop()?)))
            .collect())
    }

    /// Updates the kill watches: rows frozen past [`ORPHAN_AFTER`] are the killed process's; the
    /// moment such a row changes is its reclaim.
    fn follow_watches(&self, watches: &mut Vec<KillWatch>, chaos: &mut Chaos) -> Result<()> {
        let ids: Vec<String> = watches
            .iter()
            .flat_map(|w| w.rows.keys().map(|id| format!("'{id}'")))
            .collect();
        if ids.is_empty() {
            watches.clear();
            return Ok(());
        }
        let rows = self.query(&format!(
            "SELECT Id, Status, LastModifiedDate FROM _System_OutboxEvent WHERE Id IN ({})",
            ids.join(", ")
        ))?;
        let now: HashMap<String, (String, String)> = rows
            .into_iter()
            .filter(|r| r.len() == 3)
            .map(|r| (r[0].clone(), (r[1].clone(), r[2].clone())))
            .collect();
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

    fn query(&self, sql: &str) -> Result<Vec<Vec<String>>> {
        let out = match self.backend {
            Backend::Postgres => psql(&self.url, sql)?,
            Backend::Sqlite => sqlite3(self.url.trim_start_matches("sqlite://"), sql)?,
        };
        Ok(out
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| l.split('|').map(str::to_string).collect())
            .collect())
    }

    /// Runs a statement on the side store (the demo's mail provider and journals: the same
    /// database on PostgreSQL, a sibling file on SQLite).
    fn side_execute(&self, sql: &str) -> Result<()> {
        match self.backend {
            Backend::Postgres => psql(&self.url, sql).map(|_| ()),
            Backend::Sqlite => {
                let path = format!("{}-mailbox.db", self.url.trim_start_matches("sqlite://"));
                sqlite3(&path, sql).map(|_| ())
            }
        }
    }

    fn count(&self, sql: &str) -> Result<i64> {
        let rows = self.query(sql)?;
        rows.first()
            .and_then(|r| r.first())
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no count from {sql}"))
    }
}

/// Runs one statement with `psql` against `url` and returns its unaligned output.
fn psql(url: &str, sql: &str) -> Result<String> {
    let output = Command::new("psql")
        .args([
            "-X",
            "-q",
            "-At",
            "-F",
            "|",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            url,
            "-c",
            sql,
        ])
        .output()
        .context("running psql")?;
    if !output.status.success() {
        bail!(
            "psql failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs one statement with `sqlite3` on the file at `path` and returns its output.
fn sqlite3(path: &str, sql: &str) -> Result<String> {
    let output = Command::new("sqlite3")
        .args(["-cmd", ".timeout 5000", "-separator", "|", path, sql])
        .output()
        .context("running sqlite3")?;
    if !output.status.success() {
        bail!(
            "sqlite3 failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Waits until the server of `url` accepts connections.
fn wait_ready(url: &str, limit: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        match postgres::check_reachable(url) {
            Ok(()) => return Ok(()),
            Err(why) if start.elapsed() > limit => {
                bail!(
                    "PostgreSQL not ready after {}: {why}",
                    format_duration(limit)
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// The version of the machine's first PostgreSQL cluster (`pg_lsclusters -h`).
fn cluster_version() -> Result<String> {
    let output = Command::new("pg_lsclusters")
        .arg("-h")
        .output()
        .context("running pg_lsclusters")?;
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .map(str::to_string)
        .context("pg_lsclusters lists no cluster")
}

/// Replaces the database name in a PostgreSQL URL.
fn with_database(url: &str, name: &str) -> String {
    let base = url.split('?').next().unwrap_or(url);
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    format!("{}/{name}", &base[..path_start])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse() {
        let args: Vec<String> = ["--quick", "--backend", "sqlite", "--seed", "7"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let o = parse(&args).unwrap();
        assert!(o.quick);
        assert_eq!(o.backends, vec![Backend::Sqlite]);
        assert_eq!(o.seed, 7);
        assert!(parse(&["--bogus".to_string()]).is_err());
    }

    #[test]
    fn database_name_is_replaced() {
        assert_eq!(
            with_database("postgres://root@127.0.0.1:5432/test?sslmode=disable", "x"),
            "postgres://root@127.0.0.1:5432/x"
        );
    }

    #[test]
    fn the_poison_log_line_is_the_binarys() {
        let path = project_root().join("crates/outbox-cli/src/demo/handlers.rs");
        let source = std::fs::read_to_string(&path).unwrap();
        assert!(
            source.contains(&format!("POISON_LOG: &str = \"{POISON_LOG}\";")),
            "{} no longer defines POISON_LOG as {POISON_LOG:?}",
            path.display()
        );
    }

    #[test]
    fn quick_profile_fits_in_ci() {
        assert!(QUICK.deadline <= Duration::from_secs(90));
        // A poison event's chain of deaths, each waiting out stale-after (three times that at
        // worst on SQLite), fits in the deadline.
        let chain = Duration::from_millis(STALE_AFTER_MS * 3) * MAX_RETRY_ATTEMPTS as u32;
        assert!(chain < QUICK.deadline, "{chain:?}");
        assert!(QUICK.restart_at < QUICK.chaos_limit && QUICK.chaos_limit < QUICK.deadline);
    }
}
