//! End-to-end tests of the `outbox` binary against real databases (fresh per test, on SQLite
//! and on PostgreSQL when reachable). One test binary for the package; each file under
//! `tests/cli/` beside this `main.rs` is a module.

mod errors;
mod events;
mod heads;
mod pause;
mod production;
mod standby;
mod webhooks;

use std::process::{Command, Output};

/// Runs the `outbox` binary with `DATABASE_URL=url` and `args`.
pub fn outbox(url: &str, args: &[&str]) -> Output {
    outbox_with_env(url, args, &[])
}

/// Runs the `outbox` binary with `DATABASE_URL=url`, `args` and extra environment.
pub fn outbox_with_env(url: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.args(args)
        .env("DATABASE_URL", url)
        .env_remove("OUTBOX_PULL_WORKER");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run the outbox binary")
}

/// The output's stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The output's stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
