//! Project automation, run as `cargo xtask <command>`; [`USAGE`] lists the commands (`cargo
//! xtask help` prints it). `ci.rs` holds the pipeline CI runs and the test run, `tidy.rs` and
//! `deps.rs` the checks of the source and of the dependency direction, and `demo.rs`, `bench.rs`
//! and `faults/` the drivers that run the release binaries (`binaries.rs`) as separate
//! processes against SQLite and PostgreSQL (`postgres.rs`).
//!
//! xtask depends on no workspace crate, so it builds, and its checks of the source and the
//! manifests run, even while the rest of the workspace does not compile.

mod bench;
mod binaries;
mod ci;
mod cmd;
mod demo;
mod deps;
mod faults;
mod pgbouncer;
mod postgres;
mod standby;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Result, bail};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  ci               run what CI runs: fmt, tidy, clippy, deps, consumer-map --check, doc, the
                   tests, then demo, example, faults --quick and bench --quick
  test [-- ARGS]   run `cargo test --workspace` on SQLite and, when reachable, PostgreSQL
                   (ARGS are passed to `cargo test`)
  tidy             check the source: the outbox table and backend pools named only where
                   allowed, a //! header on every file, no ignored test, missing_docs lints
                   on library crates, no long file or function outside tests
  deps             check the direction of dependencies between workspace crates
  bench [--quick] [--json] [--only WORDS]
                   run `outbox-bench`: throughput, latency, head-of-line blocking, scaling and
                   cost of the workers against PostgreSQL ceilings (fresh database, dropped
                   after)
  explain          run `outbox-bench --explain`: the PostgreSQL plans of the eligible query
                   and of claim_next on seeded tables (10k, 100k, 1M rows and a hot key's
                   backlog)
  console-timings  the console's pages and `outbox status` on big PostgreSQL tables (1M rows
                   recent, old and with a hot record; 10M rows), release build, each page's
                   best of three held to its bound (200 ms on 1M rows, 500 ms on 10M)
  consumer-map [--check]
                   write docs/consumer-map.md from `outbox-demo consumers` (--check: fail
                   when stale)
  demo             run `outbox demo` (which runs `outbox-demo`) on SQLite and on a fresh
                   PostgreSQL database
  example          run the embedding example (examples/contact-service) with pull workers on
                   SQLite and on a fresh PostgreSQL database
  faults [--quick] [--backend postgres|sqlite|both] [--report FILE] [--seed N]
                   the fault suite: killed workers, cut connections, a restarted PostgreSQL,
                   lock timeouts; then drain and verify (--quick: the CI size)
  help             print this message

environment:
  DATABASE_URL     the PostgreSQL server for tests and benchmarks (default postgres://root@127.0.0.1:5432/test)
  CI=true          an unreachable PostgreSQL is a failure instead of a skip";

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Vec<String>) -> Result<()> {
    let Some((command, rest)) = args.split_first() else {
        bail!("no command given\n\n{USAGE}");
    };
    match command.as_str() {
        "ci" => {
            no_arguments(command, rest)?;
            ci::run()
        }
        "test" => ci::test(test_arguments(rest)?),
        "deps" => {
            no_arguments(command, rest)?;
            deps::run()
        }
        "tidy" => {
            no_arguments(command, rest)?;
            tidy::run()
        }
        "consumer-map" => match rest {
            [] => demo::consumer_map(false),
            [flag] if flag == "--check" => demo::consumer_map(true),
            _ => bail!("usage: cargo xtask consumer-map [--check]"),
        },
        "demo" => {
            no_arguments(command, rest)?;
            demo::demo()
        }
        "example" => {
            no_arguments(command, rest)?;
            demo::example()
        }
        "faults" => faults::run(rest),
        "bench" => bench::run(&bench::BenchOptions::parse(rest)?),
        "explain" => {
            no_arguments(command, rest)?;
            bench::explain()
        }
        "console-timings" => {
            no_arguments(command, rest)?;
            bench::console_timings()
        }
        "help" | "-h" | "--help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown command `{other}`\n\n{USAGE}"),
    }
}

fn no_arguments(command: &str, rest: &[String]) -> Result<()> {
    if let Some(extra) = rest.first() {
        bail!("`cargo xtask {command}` takes no arguments, got `{extra}`\n\n{USAGE}");
    }
    Ok(())
}

/// The arguments after `--` in `cargo xtask test -- ARGS`, which go to `cargo test`.
fn test_arguments(rest: &[String]) -> Result<&[String]> {
    match rest.split_first() {
        None => Ok(&[]),
        Some((separator, passed_on)) if separator == "--" => Ok(passed_on),
        Some((other, _)) => {
            bail!(
                "unexpected argument `{other}`; pass arguments to cargo test after `--`\n\n{USAGE}"
            )
        }
    }
}

/// The workspace root, so that `cargo xtask` works from any directory inside it.
fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Whether this run is CI's, read the same way as the test harness in `tests/src/lib.rs` does.
fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|value| value == "true" || value == "1")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|arg| arg.to_string()).collect()
    }

    #[test]
    fn test_arguments_after_the_separator_go_to_cargo_test() {
        let args = strings(&["--", "--test", "it", "claim"]);
        assert_eq!(test_arguments(&args).unwrap(), &args[1..]);
        assert!(test_arguments(&[]).unwrap().is_empty());
    }

    #[test]
    fn test_arguments_without_the_separator_are_refused() {
        let error = test_arguments(&strings(&["claim"])).unwrap_err();
        assert!(error.to_string().contains("unexpected argument `claim`"));
    }

    #[test]
    fn unknown_commands_and_stray_arguments_are_refused() {
        assert!(run(strings(&["frobnicate"])).is_err());
        assert!(run(strings(&["deps", "--fix"])).is_err());
        assert!(run(strings(&["tidy", "--fix"])).is_err());
        assert!(run(Vec::new()).is_err());
    }
}
