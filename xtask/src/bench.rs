//! `cargo xtask bench` and `cargo xtask explain`: build the `outbox-bench` binary in release and
//! run it against PostgreSQL; it creates a fresh database, measures (or prints the plans), and
//! drops it.

use anyhow::{Result, bail};

use crate::binaries::{BENCH, Release};
use crate::cmd::Cmd;
use crate::postgres;

/// What `cargo xtask bench` was asked for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BenchOptions {
    /// The CI size: under two minutes on two cores.
    pub quick: bool,
    /// Also print one JSON document.
    pub json: bool,
    /// Only the scenarios whose names contain one of these words (`--only claim,hot`).
    pub only: Option<String>,
}

impl BenchOptions {
    /// Reads `[--quick] [--json] [--only WORDS]`.
    pub fn parse(args: &[String]) -> Result<Self> {
        let mut options = Self::default();
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--quick" => options.quick = true,
                "--json" => options.json = true,
                "--only" => match args.next() {
                    Some(words) => options.only = Some(words.clone()),
                    None => bail!("`--only` takes scenario words, for example `--only claim,hot`"),
                },
                other => bail!(
                    "`cargo xtask bench` takes --quick, --json and --only WORDS, got `{other}`"
                ),
            }
        }
        Ok(options)
    }
}

/// `cargo xtask bench [--quick] [--json] [--only WORDS]`: `outbox-bench` with the same flags.
pub fn run(options: &BenchOptions) -> Result<()> {
    let mut args = Vec::new();
    if options.quick {
        args.push("--quick");
    }
    if options.json {
        args.push("--json");
    }
    if let Some(words) = &options.only {
        args.extend(["--only", words.as_str()]);
    }
    run_bench(&args)
}

/// The CI step: `cargo xtask bench --quick` (figures printed, not asserted).
pub fn quick() -> Result<()> {
    run(&BenchOptions {
        quick: true,
        ..BenchOptions::default()
    })
}

/// `cargo xtask explain`: `outbox-bench --explain`, the plans of the design's eligible query and
/// of `claim_next` on seeded tables (10k, 100k and 1M rows, and a hot key's backlog).
pub fn explain() -> Result<()> {
    run_bench(&["--explain"])
}

/// The console's timing test on every table shape, 10M rows included, in a release build, held
/// to its bounds (crates/outbox-console/tests/console/timings.rs; docs/console.md keeps the
/// figures). About five minutes, most of it filling the tables.
pub fn console_timings() -> Result<()> {
    let url = postgres::database_url();
    postgres::require(&url, "the console timings")?;
    Cmd::cargo(&[
        "test",
        "--release",
        "-p",
        "outbox-console",
        "--test",
        "console",
        "timings",
        "--",
        "--nocapture",
    ])
    .env("DATABASE_URL", &url)
    .env("OUTBOX_REQUIRE_POSTGRES", "1")
    .env("OUTBOX_CONSOLE_TIMINGS", "full")
    .env("OUTBOX_CONSOLE_TIMING_LIMITS", "1")
    .run()
}

/// Builds `outbox-bench` in release and runs it with `args` against the PostgreSQL server under
/// test (`DATABASE_URL`).
fn run_bench(args: &[&str]) -> Result<()> {
    let url = postgres::database_url();
    postgres::require(&url, "the benchmark")?;
    let release = Release::build(&[BENCH])?;
    // The idle pickup is also measured through a transaction-pooling PgBouncer when one can
    // be started (Debian's package; skipped with a line when it is not installed).
    let bouncer = match crate::pgbouncer::PgBouncer::start(&url) {
        Ok(bouncer) => Some(bouncer),
        Err(e) => {
            println!("no PgBouncer for the pooled idle pickup: {e:#}");
            None
        }
    };
    let mut cmd =
        Cmd::program(&release.path(BENCH).to_string_lossy(), args).env("DATABASE_URL", &url);
    if let Some(bouncer) = &bouncer {
        cmd = cmd.env("OUTBOX_BENCH_PGBOUNCER_URL", &bouncer.url);
    }
    cmd.run()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn options_are_read_and_strays_refused() {
        assert_eq!(
            BenchOptions::parse(&strings(&["--json", "--quick"])).unwrap(),
            BenchOptions {
                quick: true,
                json: true,
                only: None,
            }
        );
        assert_eq!(
            BenchOptions::parse(&strings(&["--only", "claim,hot"]))
                .unwrap()
                .only
                .as_deref(),
            Some("claim,hot")
        );
        assert!(BenchOptions::parse(&strings(&["--only"])).is_err());
        assert_eq!(BenchOptions::parse(&[]).unwrap(), BenchOptions::default());
        assert!(BenchOptions::parse(&strings(&["--full"])).is_err());
    }
}
