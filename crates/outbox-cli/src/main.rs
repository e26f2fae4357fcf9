//! The `outbox` binary: the operator commands over the library API ([`outbox_cli`]),
//! `outbox relay` (the shipped NATS JetStream relay, whose consumers `consumers` and `gate`
//! judge when the `OUTBOX_RELAY_*` variables configure it), and `outbox demo`, which hands over
//! to the separate `outbox-demo` binary so that the binary operators deploy carries no demo
//! workload and no benchmark.

mod relay;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use outbox_cli::OperatorCommand;

/// Dispatches a CRM platform's post-commit events from a transactional outbox table.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about)]
struct Cli {
    /// The database: postgres://… or sqlite://PATH.
    #[arg(long, global = true, env = "DATABASE_URL")]
    database_url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Operator(OperatorCommand),
    /// Relay the events of the named event types to a NATS JetStream stream, in per-record
    /// order, deduplicated by the stream on Nats-Msg-Id (see docs/relay.md). Every relay
    /// option reads its OUTBOX_RELAY_* variable too, which `consumers` and `gate` read.
    Relay(Box<relay::RelayArgs>),
    /// Run the whole repair on a CRM workload and verify it from the database: runs the
    /// `outbox-demo` binary installed next to this one with the arguments given (see
    /// `outbox demo --help`).
    #[command(disable_help_flag = true)]
    Demo {
        /// Arguments for `outbox-demo`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo { args } => demo::run(cli.database_url.as_deref(), &args),
        Command::Relay(args) => {
            outbox_cli::init_tracing("warn");
            outbox_cli::block_on(relay::run(cli.database_url.as_deref(), *args))
        }
        Command::Operator(command) => {
            outbox_cli::init_tracing("warn");
            // The handlers of this binary are the relay's: `gate` and `consumers` judge it when
            // the OUTBOX_RELAY_* variables configure one, and no consumer otherwise (a service
            // mounts `OperatorCommand` in its own binary with its consumers).
            let url = cli.database_url;
            outbox_cli::block_on(async move {
                let consumers = match &command {
                    OperatorCommand::Consumers(_) | OperatorCommand::Gate(_) => {
                        relay::consumers_from_env()?
                    }
                    _ => Vec::new(),
                };
                outbox_cli::run_operator(url.as_deref(), command, &consumers).await
            })
        }
    }
}

mod demo {
    //! `outbox demo`: the demo workload lives in its own binary, `outbox-demo`, looked up next
    //! to this executable and then on `PATH`.

    use std::ffi::OsString;
    use std::path::PathBuf;
    use std::process::{Command, ExitCode};

    const DEMO_BINARY: &str = "outbox-demo";

    fn find() -> Option<PathBuf> {
        let name = format!("{DEMO_BINARY}{}", std::env::consts::EXE_SUFFIX);
        let beside = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|dir| dir.join(&name)))
            .filter(|p| p.is_file());
        beside.or_else(|| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|dir| dir.join(&name))
                    .find(|p| p.is_file())
            })
        })
    }

    /// Runs `outbox-demo ARGS` in place of this process (passing `--database-url` on when
    /// given).
    pub fn run(url: Option<&str>, args: &[OsString]) -> ExitCode {
        let Some(binary) = find() else {
            eprintln!(
                "error: the demo is the separate `{DEMO_BINARY}` binary, and none was found next to this one or on PATH; build it with `cargo build --release -p outbox-demo` (or run `cargo run --release -p outbox-demo`)"
            );
            return ExitCode::FAILURE;
        };
        let mut command = Command::new(&binary);
        if let Some(url) = url {
            command.env("DATABASE_URL", url);
        }
        command.args(args);
        // Become the demo (same pid, same terminal signals: Ctrl-C reaches the demo alone,
        // which finishes its in-flight attempts). `exec` returns only when it failed.
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            let e = command.exec();
            eprintln!("error: cannot run {}: {e}", binary.display());
            ExitCode::FAILURE
        }
        #[cfg(not(unix))]
        match command.status() {
            Ok(status) => match status.code() {
                Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
                None => {
                    eprintln!("error: {} was killed ({status})", binary.display());
                    ExitCode::FAILURE
                }
            },
            Err(e) => {
                eprintln!("error: cannot run {}: {e}", binary.display());
                ExitCode::FAILURE
            }
        }
    }
}
