//! `cargo xtask bench` and `cargo xtask explain`: build the `outbox` binary in release and run
//! its hidden `bench` command against PostgreSQL, which creates a fresh database, measures, and
//! drops it.

use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::cmd::Cmd;
use crate::{postgres, project_root};

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

/// `cargo xtask bench [--quick] [--json]`.
pub fn run(options: &BenchOptions) -> Result<()> {
    let mut args = vec!["bench"];
    if options.quick {
        args.push("--quick");
    }
    if options.json {
        args.push("--json");
    }
    run_outbox(&args)
}

/// The CI step: `cargo xtask bench --quick` (figures printed, not asserted).
pub fn quick() -> Result<()> {
    run(&BenchOptions {
        quick: true,
        json: false,
    })
}

/// `cargo xtask explain`: the plans of the design's eligible query and of `claim_next` on
/// seeded tables (10k, 100k and 1M rows, and a hot key's backlog).
pub fn explain() -> Result<()> {
    run_outbox(&["bench", "--explain"])
}

fn run_outbox(args: &[&str]) -> Result<()> {
    let url = postgres::database_url();
    if let Err(why) = postgres::check_reachable(&url) {
        bail!(
            "the benchmark needs PostgreSQL, but {} is unreachable: {why}",
            postgres::redacted(&url)
        );
    }
    Cmd::cargo(&["build", "--release", "-p", "outbox-cli"]).run()?;
    let binary = target_dir().join("release").join("outbox");
    Cmd::program(&binary.to_string_lossy(), args)
        .env("DATABASE_URL", &url)
        .run()
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set, else `target/` in the workspace.
fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => project_root().join(dir),
        None => project_root().join("target"),
    }
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
