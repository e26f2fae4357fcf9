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
}

impl BenchOptions {
    /// Reads `[--quick] [--json]`.
    pub fn parse(args: &[String]) -> Result<Self> {
        let mut options = Self::default();
        for arg in args {
            match arg.as_str() {
                "--quick" => options.quick = true,
                "--json" => options.json = true,
                other => bail!("`cargo xtask bench` takes --quick and --json, got `{other}`"),
            }
        }
        Ok(options)
    }
}

/// `cargo xtask bench [--quick] [--json]`: `outbox-bench [--quick] [--json]`.
pub fn run(options: &BenchOptions) -> Result<()> {
    let mut args = Vec::new();
    if options.quick {
        args.push("--quick");
    }
    if options.json {
        args.push("--json");
    }
    run_bench(&args)
}

/// The CI step: `cargo xtask bench --quick` (figures printed, not asserted).
pub fn quick() -> Result<()> {
    run(&BenchOptions {
        quick: true,
        json: false,
    })
}

/// `cargo xtask explain`: `outbox-bench --explain`, the plans of the design's eligible query and
/// of `claim_next` on seeded tables (10k, 100k and 1M rows, and a hot key's backlog).
pub fn explain() -> Result<()> {
    run_bench(&["--explain"])
}

/// Builds `outbox-bench` in release and runs it with `args` against the PostgreSQL server under
/// test (`DATABASE_URL`).
fn run_bench(args: &[&str]) -> Result<()> {
    let url = postgres::database_url();
    postgres::require(&url, "the benchmark")?;
    let release = Release::build(&[BENCH])?;
    Cmd::program(&release.path(BENCH).to_string_lossy(), args)
        .env("DATABASE_URL", &url)
        .run()
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
                json: true
            }
        );
        assert_eq!(BenchOptions::parse(&[]).unwrap(), BenchOptions::default());
        assert!(BenchOptions::parse(&strings(&["--full"])).is_err());
    }
}
