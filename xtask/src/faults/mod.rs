//! `cargo xtask faults [--quick]`: the fault suite. Seeds the demo workload with handler faults
//! and a poison event, runs three `outbox-demo work` processes of four workers each (one of them
//! with its wall clock 40 s behind), and while they run kills a random process with SIGKILL every
//! few seconds (never the skewed one), cuts random worker connections with
//! `pg_terminate_backend`, restarts PostgreSQL once and holds row locks from an outside `psql`
//! session. Like a supervisor, it starts a new process for each one that died, including those
//! the poison event aborted, until the outbox is drained. Then it runs `outbox-demo verify
//! --json` and checks on top of it that no process that lived lost a claim, that every
//! reclaimed slow attempt belonged to a process the suite had killed before the reclaim (each
//! kill is journaled), and that the poison event ended `failed`. The same suite, minus what
//! SQLite cannot do (cut connections, restart a server, hold one row's lock), runs on SQLite.
//!
//! The suite drives the release binaries through their command lines only, like an operator
//! would, so xtask still depends on no workspace crate: `outbox-demo` runs the workload, and the
//! suite watches the queue through `outbox status --json` and `outbox events --json`
//! (`queue.rs`), never with SQL of its own on the outbox table.
//!
//! The pieces: `profile.rs` (sizes, paces, worker settings), `suite.rs` (one run on one
//! backend), `chaos.rs` (the loop that injects the faults), `workers.rs` (the work processes
//! and the kills), `queue.rs` (the view of the queue), `skew.rs` (the skewed clock) and
//! `report.rs` (the verdicts and the markdown).

mod app;
mod chaos;
mod profile;
mod queue;
mod reply_loss;
mod report;
mod skew;
mod steps;
mod suite;
mod workers;

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

use crate::binaries::{DEMO, OUTBOX, Release};
use crate::is_ci;
use profile::{Backend, FULL, Profile, QUICK};
use skew::Skew;
use suite::{Binaries, Suite};

/// The command-line options of `cargo xtask faults`.
#[derive(Debug)]
struct Options {
    quick: bool,
    backends: Vec<Backend>,
    report: Option<PathBuf>,
    seed: u64,
    /// A second PostgreSQL run whose processes go through a transaction-pooling PgBouncer.
    pgbouncer: bool,
    /// `--batch-max-events` of every work process.
    batch_max_events: usize,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut options = Options {
        quick: false,
        backends: vec![Backend::Postgres, Backend::Sqlite],
        report: None,
        pgbouncer: false,
        batch_max_events: profile::BATCH_MAX_EVENTS,
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
            "--pgbouncer" => options.pgbouncer = true,
            "--backend" => {
                options.backends = match value("--backend")?.as_str() {
                    "postgres" => vec![Backend::Postgres],
                    "sqlite" => vec![Backend::Sqlite],
                    "both" => vec![Backend::Postgres, Backend::Sqlite],
                    other => bail!("unknown backend `{other}` (postgres, sqlite or both)"),
                }
            }
            "--batch-max-events" => {
                options.batch_max_events = value("--batch-max-events")?
                    .parse()
                    .context("`--batch-max-events` takes a number")?
            }
            "--report" => options.report = Some(PathBuf::from(value("--report")?)),
            "--seed" => {
                options.seed = value("--seed")?
                    .parse()
                    .context("`--seed` takes a number")?
            }
            other => bail!(
                "unexpected argument `{other}`; usage: cargo xtask faults [--quick] [--backend postgres|sqlite|both] [--pgbouncer] [--batch-max-events N] [--report FILE] [--seed N]"
            ),
        }
    }
    Ok(options)
}

/// `cargo xtask faults [--quick] [--backend postgres|sqlite|both] [--pgbouncer]
/// [--batch-max-events N] [--report FILE] [--seed N]`. `--pgbouncer` adds a PostgreSQL run whose
/// processes (work, foreign writers, the CLI) go through a transaction-pooling PgBouncer, with
/// the same kills, cuts and restart. The work processes run batched attempts of up to
/// `--batch-max-events` events (32 unless told; 1 runs one event per attempt).
pub fn run(args: &[String]) -> Result<()> {
    let options = parse(args)?;
    let profile = if options.quick { QUICK } else { FULL };
    let backends: Vec<&str> = options.backends.iter().map(|b| b.name()).collect();
    println!(
        "fault suite ({} profile, seed {}, up to {} events per attempt), backends: {}",
        profile.name,
        options.seed,
        options.batch_max_events.max(1),
        backends.join(", ")
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
    let release = Release::build(&[OUTBOX, DEMO])?;
    let (outbox, demo) = (release.path(OUTBOX), release.path(DEMO));
    let binaries = Binaries {
        outbox: &outbox,
        demo: &demo,
    };
    let logs = release.target().join("faults");
    let mut reports = Vec::new();
    let mut failed = Vec::new();
    let bouncer = if options.pgbouncer && options.backends.contains(&Backend::Postgres) {
        Some(crate::pgbouncer::PgBouncer::start(
            &crate::postgres::database_url(),
        )?)
    } else {
        None
    };
    let mut runs: Vec<(Backend, Option<&str>)> =
        options.backends.iter().map(|b| (*b, None)).collect();
    if let Some(bouncer) = &bouncer {
        runs.insert(1, (Backend::Postgres, Some(bouncer.url.as_str())));
    }
    for (index, (backend, pooler)) in runs.iter().enumerate() {
        let mut rng = Rng(options.seed.wrapping_add(index as u64));
        let profile = Profile {
            batch_max_events: options.batch_max_events.max(1),
            ..profile.on(*backend)
        };
        let name = match pooler {
            Some(_) => "postgres through PgBouncer",
            None => backend.name(),
        };
        let outcome =
            Suite::new(*backend, &profile, &binaries, &skew, &logs, *pooler)?.run(&mut rng);
        match outcome {
            Ok(report) => {
                println!("\n{}", report.markdown);
                if !report.passed {
                    failed.push(format!("{name} ({})", report.failed.join("; ")));
                }
                reports.push(report.markdown);
            }
            Err(error) => {
                println!("\nfault suite on {name}: ERROR: {error:#}");
                failed.push(format!("{name} (error: {error:#})"));
            }
        }
    }
    finish(&options, &reports, &failed)
}

/// Writes the report file if asked for, and fails naming every failed run and its failed
/// invariants with the seed (the line a CI log's tail keeps).
fn finish(options: &Options, reports: &[String], failed: &[String]) -> Result<()> {
    if let Some(path) = &options.report {
        std::fs::write(path, reports.join("\n"))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("report written to {}", path.display());
    }
    if !failed.is_empty() {
        bail!(
            "the fault suite (seed {}) failed on {}",
            options.seed,
            failed.join(", ")
        );
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::profile::{MAX_RETRY_ATTEMPTS, POISON_LOG, STALE_AFTER_MS, STARTED_LOG};
    use super::*;
    use crate::project_root;

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

    /// The `.rs` files under `dir`, recursively.
    fn sources(dir: &std::path::Path, found: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                sources(&path, found);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }

    #[test]
    fn the_log_lines_are_the_demos() {
        let mut files = Vec::new();
        sources(&project_root().join("crates/outbox-demo/src"), &mut files);
        for (name, text) in [
            ("POISON_LOG", POISON_LOG),
            ("STARTED_LOG", STARTED_LOG),
            ("SIDE_URL_ENV", workers::SIDE_URL_ENV),
        ] {
            let defined = format!("{name}: &str = \"{text}\";");
            assert!(
                files
                    .iter()
                    .any(|f| std::fs::read_to_string(f).is_ok_and(|s| s.contains(&defined))),
                "no file of crates/outbox-demo/src defines {name} as {text:?}"
            );
        }
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
