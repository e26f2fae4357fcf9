//! `outbox-demo`: the whole repair on a CRM workload, with faults injected on purpose and every
//! invariant read back from the database. It is built on the library crates exactly as an
//! embedding service would be (handlers, consumers, a dispatcher, the operator commands), and is
//! not part of the `outbox` binary that operators deploy; `outbox demo` runs it.

mod args;
mod commands;
mod demo;
mod faults;
mod foreign;
mod handlers;
mod integrity;
mod journal;
mod relay;
mod schema;
mod sink;
mod verify;
mod webhooks;
mod work;
mod workload;

use std::process::ExitCode;

use clap::Parser;

pub use handlers::{Actions, Faults, consumers};

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    // The demo injects faults on purpose and reports them; its default log shows errors only.
    let default_level = match cli.command {
        None => "error",
        Some(_) => "warn",
    };
    outbox_cli::init_tracing(default_level);
    outbox_cli::block_on(commands::run(cli))
}
