//! `cargo xtask ci`, the pipeline CI runs, and `cargo xtask test`, its last step.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::cmd::{Cmd, format_duration};
use crate::pgbouncer::PgBouncer;
use crate::standby::Standby;
use crate::{bench, demo, deps, is_ci, postgres, tidy};

/// What a CI step runs.
enum Action {
    /// A cargo command, with the environment variables it adds.
    Cargo {
        args: &'static [&'static str],
        env: &'static [(&'static str, &'static str)],
    },
    /// An xtask command, called in this process; `command` is how a person runs it alone.
    Xtask {
        command: &'static str,
        run: fn() -> Result<()>,
    },
}

/// One step of `cargo xtask ci`.
struct Step {
    /// A short name for the step, used in progress and failure messages.
    name: &'static str,
    action: Action,
}

impl Step {
    const fn cargo(name: &'static str, args: &'static [&'static str]) -> Self {
        Self::cargo_with_env(name, args, &[])
    }

    const fn cargo_with_env(
        name: &'static str,
        args: &'static [&'static str],
        env: &'static [(&'static str, &'static str)],
    ) -> Self {
        Self {
            name,
            action: Action::Cargo { args, env },
        }
    }

    const fn xtask(name: &'static str, command: &'static str, run: fn() -> Result<()>) -> Self {
        Self {
            name,
            action: Action::Xtask { command, run },
        }
    }

    /// The step as a command line a person could run.
    fn command_line(&self) -> String {
        match &self.action {
            Action::Cargo { args, env } => cargo_command(args, env).to_string(),
            Action::Xtask { command, .. } => format!("cargo xtask {command}"),
        }
    }

    fn run(&self) -> Result<()> {
        match &self.action {
            Action::Cargo { args, env } => cargo_command(args, env).run(),
            Action::Xtask { run, .. } => run(),
        }
    }
}

fn cargo_command(args: &[&str], env: &[(&str, &str)]) -> Cmd {
    env.iter()
        .fold(Cmd::cargo(args), |cmd, (key, value)| cmd.env(key, value))
}

/// The steps of `cargo xtask ci`, in the order they run; the first failure stops the run. Adding a
/// step is one line here. The static checks come first (tidy before the build, since it reads
/// only the source); the runs of the binaries after the tests. The benchmark prints its figures
/// without asserting them.
const STEPS: &[Step] = &[
    Step::cargo("format", &["fmt", "--all", "--", "--check"]),
    Step::xtask("source rules", "tidy", tidy::run),
    Step::cargo(
        "lint",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    ),
    Step::xtask("dependency direction", "deps", deps::run),
    Step::xtask(
        "consumer map is current",
        "consumer-map --check",
        demo::consumer_map_check,
    ),
    Step::cargo_with_env(
        "docs",
        &["doc", "--workspace", "--no-deps"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    ),
    Step::xtask("tests", "test", test_all),
    Step::xtask("demo on SQLite and PostgreSQL", "demo", demo::demo),
    Step::xtask(
        "embedding example on SQLite and PostgreSQL",
        "example",
        demo::example,
    ),
    Step::xtask(
        "fault suite (quick, with a PgBouncer run)",
        "faults --quick --pgbouncer",
        faults_quick,
    ),
    Step::xtask(
        "benchmark (figures, not asserted)",
        "bench --quick",
        bench::quick,
    ),
];

/// The CI fault step: `cargo xtask faults --quick --pgbouncer` on PostgreSQL (directly and
/// through a transaction-pooling PgBouncer) and SQLite.
fn faults_quick() -> Result<()> {
    crate::faults::run(&["--quick".to_string(), "--pgbouncer".to_string()])
}

/// Runs every CI step in order, printing each one's command and duration, and stops at the first
/// failure.
pub fn run() -> Result<()> {
    let started = Instant::now();
    let total = STEPS.len();
    let mut durations: Vec<(&str, Duration)> = Vec::with_capacity(total);
    for (index, step) in STEPS.iter().enumerate() {
        let number = index + 1;
        let command = step.command_line();
        println!("\n==> ci step {number}/{total}, {}: {command}", step.name);
        let step_started = Instant::now();
        let result = step.run();
        let took = step_started.elapsed();
        if let Err(error) = result {
            println!(
                "<== ci step {number}/{total}, {}: FAILED after {}",
                step.name,
                format_duration(took)
            );
            // The error names the failed command; the header above repeats it for xtask steps.
            bail!(
                "ci stopped at step {number}/{total} ({}): {error:#}",
                step.name
            );
        }
        println!(
            "<== ci step {number}/{total}, {}: ok in {}",
            step.name,
            format_duration(took)
        );
        durations.push((step.name, took));
    }
    println!(
        "\nci: all {total} steps passed in {}",
        format_duration(started.elapsed())
    );
    for (name, took) in durations {
        println!("  {:>10}  {name}", format_duration(took));
    }
    Ok(())
}

/// The CI test step: `cargo xtask test` with no extra arguments.
fn test_all() -> Result<()> {
    test(&[])
}

/// Runs `cargo test --workspace` (with `cargo_test_args` appended) on SQLite and, when it is
/// reachable, PostgreSQL. Then, or when `CI=true`, `OUTBOX_REQUIRE_POSTGRES=1` is set so that the
/// PostgreSQL tests fail instead of skipping. With `CI=true` an unreachable PostgreSQL fails the
/// run before any test.
pub fn test(cargo_test_args: &[String]) -> Result<()> {
    let url = postgres::database_url();
    let reachable = postgres::check_reachable(&url);
    let backends = match &reachable {
        Ok(()) => format!("sqlite, postgres ({})", postgres::redacted(&url)),
        Err(why) => format!("sqlite only (PostgreSQL unreachable: {why})"),
    };
    println!("backends: {backends}");
    if let Err(why) = &reachable
        && is_ci()
    {
        bail!(
            "CI=true requires PostgreSQL, but {} is unreachable: {why}; start it (`.ci/run` does) \
             or point DATABASE_URL at a running server",
            postgres::redacted(&url)
        );
    }
    let mut cargo_test = Cmd::cargo(&["test", "--workspace"]).args(cargo_test_args);
    // A reachable server is required from here on, so that a PostgreSQL test that cannot connect
    // fails instead of skipping; CI with an unreachable server has already stopped above.
    if reachable.is_ok() {
        cargo_test = cargo_test.env("OUTBOX_REQUIRE_POSTGRES", "1");
    }
    // The PgBouncer variants (the conformance suite, the worker tests, the DBA-defaults load)
    // run through a transaction-pooling PgBouncer started here; required under CI.
    let bouncer = match reachable.is_ok().then(|| PgBouncer::start(&url)) {
        Some(Ok(bouncer)) => Some(bouncer),
        Some(Err(e)) if is_ci() => return Err(e.context("CI=true requires PgBouncer")),
        Some(Err(e)) => {
            println!("skipping the PgBouncer variants: {e:#}");
            None
        }
        None => None,
    };
    if let Some(bouncer) = &bouncer {
        cargo_test = cargo_test
            .env("OUTBOX_TEST_PGBOUNCER_URL", &bouncer.url)
            .env("OUTBOX_REQUIRE_PGBOUNCER", "1");
    }
    // The reads from a replica (the console's and `outbox status`'s `--read-database-url`)
    // are tested against a hot standby made here; required under CI.
    let standby = match reachable.is_ok().then(|| Standby::start(&url)) {
        Some(Ok(standby)) => Some(standby),
        Some(Err(e)) if is_ci() => return Err(e.context("CI=true requires a hot standby")),
        Some(Err(e)) => {
            println!("skipping the hot-standby tests: {e:#}");
            None
        }
        None => None,
    };
    if let Some(standby) = &standby {
        cargo_test = cargo_test
            .env("OUTBOX_TEST_STANDBY_URL", &standby.url)
            .env("OUTBOX_REQUIRE_STANDBY", "1");
    }
    let result = cargo_test.run();
    drop(bouncer);
    drop(standby);
    let outcome = if result.is_ok() { "passed" } else { "failed" };
    println!("backends: {backends}; tests {outcome}");
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ci_runs_the_static_checks_first_and_the_runs_after_the_tests() {
        let commands: Vec<String> = STEPS.iter().map(Step::command_line).collect();
        let position = |c: &str| {
            commands
                .iter()
                .position(|x| x == c)
                .unwrap_or_else(|| panic!("no step `{c}` in {commands:?}"))
        };
        assert_eq!(position("cargo fmt --all -- --check"), 0);
        assert_eq!(position("cargo xtask tidy"), 1);
        let tests = position("cargo xtask test");
        for check in [
            "cargo clippy --workspace --all-targets -- -D warnings",
            "cargo xtask deps",
            "cargo xtask consumer-map --check",
            "RUSTDOCFLAGS='-D warnings' cargo doc --workspace --no-deps",
        ] {
            assert!(position(check) < tests, "{check} runs before the tests");
        }
        assert!(
            position("cargo xtask demo") > tests,
            "the demo runs after the tests"
        );
        assert!(
            position("cargo xtask bench --quick") > tests,
            "the benchmark runs after the tests"
        );
        assert!(
            position("cargo xtask faults --quick --pgbouncer") > tests,
            "the fault suite runs after the tests"
        );
    }
}
