//! `cargo xtask faults [--quick]`: the fault suite. Seeds the demo workload with handler faults,
//! runs three `outbox work` processes of four workers each, and while they run kills a random
//! process with SIGKILL every few seconds (starting a new one), cuts random worker connections
//! with `pg_terminate_backend`, restarts PostgreSQL once and holds row locks from an outside
//! `psql` session. Then it drains, runs `outbox verify --json` and checks on top of it that every
//! slow attempt that was reclaimed belonged to a process the suite had killed. The same suite,
//! minus what SQLite cannot do (cut connections, restart a server, hold one row's lock), runs on
//! SQLite.
//!
//! The suite drives the release binary through its command line only, like an operator would,
//! so xtask still depends on no workspace crate.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::cmd::{Cmd, format_duration};
use crate::{postgres, project_root};

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
/// The event type of the slow handler (`report.slow` in the demo workload).
const SLOW_EVENT_TYPE: &str = "report.slow";

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
    Cmd::cargo(&["build", "--release", "-p", "outbox-cli"]).run()?;
    let binary = project_root().join("target/release/outbox");
    let mut reports = Vec::new();
    let mut failed = Vec::new();
    for (index, backend) in options.backends.iter().enumerate() {
        let mut rng = Rng(options.seed.wrapping_add(index as u64));
        let profile = profile.on(*backend);
        let outcome = Suite::new(*backend, &profile, &binary)?.run(&mut rng);
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

/// Milliseconds since the Unix epoch, the clock the slow journal uses.
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

/// Whether a work process's stderr says its connection was cut while it started (before any
/// worker ran): it exits non-zero with the error, as a supervisor expects, and is replaced.
fn startup_cut(stderr: &str) -> bool {
    stderr.contains("terminating connection due to administrator command")
        || stderr.contains("the database system is")
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
    kills: Vec<(i64, i64)>,
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
    fn new(backend: Backend, profile: &'a Profile, binary: &'a Path) -> Result<Self> {
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
        let (events, records, slow, slow_ms) = (
            p.events.to_string(),
            p.records.to_string(),
            p.slow_events.to_string(),
            p.slow_ms.to_string(),
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
            "500",
            "--stale-after-ms",
            "3000",
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
            workers.push(self.spawn(chaos)?);
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
            // Reap processes that ended by themselves (drained, stopped, or failed).
            let mut index = 0;
            while index < workers.len() {
                if let Some(status) = workers[index].child.try_wait()? {
                    let w = workers.remove(index);
                    let out = std::fs::read_to_string(&w.stdout).unwrap_or_default();
                    let err =
                        std::fs::read_to_string(w.stdout.with_extension("err")).unwrap_or_default();
                    match out.lines().last().map(serde_json::from_str::<Value>) {
                        Some(Ok(doc)) if status.success() => chaos.process_reports.push(doc),
                        _ if startup_cut(&err) => chaos.startup_cuts += 1,
                        // SIGINT sent at the end of the chaos reached a process that was still
                        // starting, before it listens for SIGINT: stopped, not crashed.
                        _ if phase == Phase::Calm && status.signal() == Some(SIGINT) => {
                            chaos.stopped_while_starting += 1
                        }
                        _ => chaos.crashed.push(format!(
                            "work process {} exited with {status}: {}",
                            w.number,
                            err.trim()
                        )),
                    }
                } else {
                    index += 1;
                }
            }
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
                        workers.push(self.spawn_worker(chaos, false)?);
                        phase = Phase::Drain;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                Phase::Drain => {
                    if workers.is_empty() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            }
            if workers.len() < p.processes {
                workers.push(self.spawn(chaos)?);
            }
            if now >= next_kill && !workers.is_empty() && !self.near_restart(start, restarted) {
                let victim = rng.below(workers.len());
                let mut w = workers.remove(victim);
                let rows = self.processing_rows()?;
                w.child.kill()?;
                let _ = w.child.wait();
                chaos.kills.push((i64::from(w.child.id()), unix_ms()));
                watches.push(KillWatch {
                    at: Instant::now(),
                    rows: rows
                        .into_iter()
                        .map(|(id, lmd)| (id, (lmd, false)))
                        .collect(),
                });
                workers.push(self.spawn(chaos)?);
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
                    let hold = format!(
                        "BEGIN; SELECT Id FROM DemoAccount WHERE Id IN (
                           SELECT split_part(RecordKey, ':', 2) FROM _System_OutboxEvent
                           WHERE Status = 'pending' AND EventType = 'account.updated'
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
                let unfinished = self.count(
                    "SELECT count(*) FROM _System_OutboxEvent WHERE Status IN ('pending', 'processing')",
                );
                let unfinished = unfinished.ok();
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

    fn spawn(&self, chaos: &mut Chaos) -> Result<Worker> {
        self.spawn_worker(chaos, true)
    }

    /// Starts an `outbox work --until-drained` process, with the demo's injected faults when
    /// `faults`.
    fn spawn_worker(&self, chaos: &mut Chaos, faults: bool) -> Result<Worker> {
        chaos.spawned += 1;
        let number = chaos.spawned;
        let url = if self.backend == Backend::Postgres {
            format!("{}?application_name=outbox-work-{number}", self.url)
        } else {
            self.url.clone()
        };
        let stdout = self.dir.join(format!("work-{number}.out"));
        let workers = self.profile.workers.to_string();
        let child = Command::new(self.binary)
            .args([
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
                &STALE_AFTER_MS.to_string(),
                "--lock-timeout-ms",
                &LOCK_TIMEOUT_MS.to_string(),
                "--retry-delay-ms",
                "50",
                "--max-retry-delay-ms",
                "2000",
                "--max-retry-attempts",
                "10",
            ])
            .env("DATABASE_URL", &url)
            .env("RUST_LOG", "error")
            .env_remove("OUTBOX_PULL_WORKER")
            .stdout(File::create(&stdout)?)
            .stderr(File::create(stdout.with_extension("err"))?)
            .spawn()
            .context("starting an outbox work process")?;
        Ok(Worker {
            number,
            child,
            stdout,
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
            Backend::Sqlite => {
                let path = self.url.trim_start_matches("sqlite://");
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
                String::from_utf8_lossy(&output.stdout).into_owned()
            }
        };
        Ok(out
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| l.split('|').map(str::to_string).collect())
            .collect())
    }

    fn count(&self, sql: &str) -> Result<i64> {
        let rows = self.query(sql)?;
        rows.first()
            .and_then(|r| r.first())
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no count from {sql}"))
    }

    fn report(
        &self,
        chaos: &Chaos,
        verification: &Value,
        processing: i64,
        drain_time: Duration,
        total: Duration,
    ) -> SuiteReport {
        let p = self.profile;
        let pg = self.backend == Backend::Postgres;
        let mut checks: Vec<(String, bool, String)> = Vec::new();
        if let Some(list) = verification["checks"].as_array() {
            for c in list {
                checks.push((
                    c["name"].as_str().unwrap_or("?").to_string(),
                    c["ok"].as_bool().unwrap_or(false),
                    c["detail"].as_str().unwrap_or_default().to_string(),
                ));
            }
        } else {
            checks.push((
                "outbox verify --json".into(),
                false,
                verification.to_string(),
            ));
        }
        checks.push((
            "no row left processing".into(),
            processing == 0,
            format!("{processing} rows in processing after the drain"),
        ));
        // A slow attempt superseded by a later attempt of the same try must have died with a
        // process the suite killed, before the later attempt started.
        let kills: HashMap<i64, i64> = chaos.kills.iter().copied().collect();
        let superseded = verification["slow_superseded"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let live_reclaims = superseded
            .iter()
            .filter(|s| {
                let pid = s["pid"].as_i64().unwrap_or(-1);
                let next = s["next_started_ms"].as_i64().unwrap_or(0);
                kills.get(&pid).is_none_or(|killed_at| *killed_at > next)
            })
            .count();
        checks.push((
            "a slow handler with a live heartbeat is never reclaimed".into(),
            live_reclaims == 0,
            format!(
                "{} slow attempts; {} reclaimed after their process was killed, {live_reclaims} reclaimed while their process lived",
                verification["slow_attempts"],
                superseded.len() - live_reclaims
            ),
        ));
        checks.push((
            "no worker process crashed".into(),
            chaos.crashed.is_empty(),
            if chaos.crashed.is_empty() {
                format!(
                    "{} processes started, {} killed by the suite, {} refused to start because their connection was cut while starting (exit 1 with the error, replaced), {} stopped by the end-of-chaos SIGINT while still starting, the rest exited 0",
                    chaos.spawned,
                    chaos.kills.len(),
                    chaos.startup_cuts,
                    chaos.stopped_while_starting
                )
            } else {
                chaos.crashed.join("; ")
            },
        ));
        let mut coverage = format!("{} SIGKILLs", chaos.kills.len());
        let mut covered = !chaos.kills.is_empty();
        if pg {
            write!(
                coverage,
                ", {} connections cut, {} restart(s), {} outside lock holds",
                chaos.connections_cut,
                chaos.restarts.len(),
                chaos.lock_holds
            )
            .ok();
            covered &=
                chaos.connections_cut > 0 && chaos.restarts.len() == 1 && chaos.lock_holds > 0;
        }
        checks.push(("every fault was injected".into(), covered, coverage));

        let failures = &verification["failures_by_cause"];
        let cause = |name: &str| failures[name].as_i64().unwrap_or(0);
        let mut reclaim = chaos.reclaim_ms.clone();
        reclaim.sort_unstable();
        let reclaim_text = if reclaim.is_empty() {
            "n/a (no killed process held a row)".to_string()
        } else {
            format!(
                "p50 {} ms, max {} ms over {} rows (stale-after {} ms, heartbeat {} ms)",
                reclaim[reclaim.len() / 2],
                reclaim[reclaim.len() - 1],
                reclaim.len(),
                STALE_AFTER_MS,
                HEARTBEAT_MS
            )
        };
        let sum = |key: &str| -> u64 {
            chaos
                .process_reports
                .iter()
                .map(|r| r["metrics"][key].as_u64().unwrap_or(0))
                .sum()
        };
        let passed = checks.iter().all(|c| c.1);
        let mut md = String::new();
        let _ = writeln!(
            md,
            "### Fault suite on {} ({} profile): {}\n",
            self.backend.name(),
            p.name,
            if passed { "PASSED" } else { "FAILED" }
        );
        let mut rows: Vec<(&'static str, String)> = Vec::new();
        let mut add = |k: &'static str, v: String| rows.push((k, v));
        add(
            "events",
            format!(
                "{} ({} processed, {} failed) over {} records, {} of them slow ({} ms)",
                p.events + p.slow_events,
                verification["processed"],
                verification["failed"],
                p.records,
                p.slow_events,
                p.slow_ms
            ),
        );
        add(
            "workers",
            format!(
                "{} `outbox work` processes of {} workers at a time; {} started in all",
                p.processes, p.workers, chaos.spawned
            ),
        );
        add(
            "time",
            format!(
                "{} of chaos, {} from the first worker to drained; {} in all",
                format_duration(chaos.chaos_time),
                format_duration(drain_time),
                format_duration(total)
            ),
        );
        add("processes killed (SIGKILL)", chaos.kills.len().to_string());
        if pg {
            add(
                "connections cut (pg_terminate_backend)",
                format!("{} in {} rounds", chaos.connections_cut, chaos.cut_rounds),
            );
            add(
                "PostgreSQL restarts",
                chaos
                    .restarts
                    .iter()
                    .map(|d| format!("1 (back after {})", format_duration(*d)))
                    .collect::<Vec<_>>()
                    .join(", "),
            );
            add(
                "outside row-lock holds (psql)",
                chaos.lock_holds.to_string(),
            );
        } else {
            add(
                "not applicable on SQLite",
                "connection cuts, server restart, outside row locks (the work processes' own lock holder takes SQLite's write lock)".into(),
            );
        }
        add(
            "lock timeouts hit (counted failures)",
            cause("lock_timeout").to_string(),
        );
        add(
            "retries (sum of RetryCount)",
            format!(
                "{} = {} injected handler faults + {} lock timeouts + {} lost connections + {} other",
                verification["retries"],
                cause("injected"),
                cause("lock_timeout"),
                cause("connection_lost"),
                cause("other") + cause("no_error_recorded")
            ),
        );
        add("kill to reclaim", reclaim_text);
        add(
            "seen by the processes that exited normally",
            format!(
                "{} claims, {} stale reclaims, {} lost claims, {} detached bookkeeping",
                sum("claimed"),
                sum("stale_reclaims"),
                sum("lost_claims"),
                sum("detached_bookkeeping")
            ),
        );
        let _ = writeln!(md, "| measure | value |\n|---|---|");
        for (k, v) in &rows {
            let _ = writeln!(md, "| {k} | {v} |");
        }
        let _ = writeln!(md, "\n| invariant | result | measured |\n|---|---|---|");
        for (name, ok, detail) in &checks {
            let _ = writeln!(
                md,
                "| {name} | {} | {} |",
                if *ok { "ok" } else { "**FAIL**" },
                detail.replace('|', "/")
            );
        }
        let _ = writeln!(md, "\nLogs of each work process: `{}`", self.dir.display());
        SuiteReport {
            markdown: md,
            passed,
        }
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
    fn quick_profile_fits_in_ci() {
        assert!(QUICK.deadline <= Duration::from_secs(90));
        assert!(QUICK.restart_at < QUICK.chaos_limit && QUICK.chaos_limit < QUICK.deadline);
    }
}
