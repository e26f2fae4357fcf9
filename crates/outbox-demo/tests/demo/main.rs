//! End-to-end tests of the `outbox-demo` binary (the demo's steps and the operator commands it
//! mounts) against real databases (fresh per test, on SQLite and on PostgreSQL when reachable).
//! One test binary for the package; each file under `tests/demo/` beside this `main.rs` is a
//! module.

mod metrics;
mod operator;
mod relay;
mod webhooks;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs the `outbox-demo` binary with `DATABASE_URL=url` and `args`.
pub fn outbox(url: &str, args: &[&str]) -> Output {
    outbox_with_env(url, args, &[])
}

/// The `outbox-demo` command with `DATABASE_URL=url` and `args`, run in `dir` (so that a process
/// that aborts leaves any core file there, not in the repository).
pub fn outbox_command(dir: &Path, url: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox-demo"));
    cmd.args(args)
        .current_dir(dir)
        .env("DATABASE_URL", url)
        .env_remove("OUTBOX_PULL_WORKER");
    cmd
}

/// A fresh, empty directory under the temporary directory for the child processes of a test.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "outbox-demo-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).expect("create a scratch directory");
    dir
}

/// Runs the `outbox-demo` binary with `DATABASE_URL=url`, `args` and extra environment.
pub fn outbox_with_env(url: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox-demo"));
    cmd.args(args)
        .env("DATABASE_URL", url)
        .env_remove("OUTBOX_PULL_WORKER");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run the outbox-demo binary")
}

/// The output's stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The output's stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
