//! `outbox relay` end to end, a test binary of its own (it needs `nats-server`): each test starts
//! its own `nats-server -js` on a free port with a temporary store, and runs the real `outbox`
//! binary against a fresh database on SQLite and on PostgreSQL. Each file under `tests/relay/`
//! beside this `main.rs` is a module.

mod drain;
mod kills;
mod metrics;
mod secure;

use std::process::{Command, Output};

use outbox_relay::test_support::NatsServer;

/// The password of the servers that use user/password authentication.
pub const PASSWORD: &str = "relay-pw-0d1f";
/// The relayed event types.
pub const TYPES: &str = "account.updated,lead.updated";

/// The `outbox` command with `DATABASE_URL=url`, `args` and `env`, with no NATS variable of
/// the caller's environment leaking in.
pub fn outbox_command(url: &str, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.args(args)
        .env("DATABASE_URL", url)
        .env_remove("OUTBOX_PULL_WORKER");
    for name in [
        "NATS_URL",
        "NATS_USER",
        "NATS_PASSWORD",
        "NATS_TOKEN",
        "NATS_CREDS",
        "NATS_TLS_CA",
    ] {
        cmd.env_remove(name);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs the `outbox` binary to its end.
pub fn outbox_with_env(url: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    outbox_command(url, args, env)
        .output()
        .expect("run the outbox binary")
}

/// The output's stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The output's stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The relay's variables for `nats` (no authentication).
pub fn open_env(nats: &NatsServer) -> Vec<(&'static str, String)> {
    vec![
        ("NATS_URL", nats.url()),
        ("OUTBOX_RELAY_STREAM", "CRM".into()),
        ("OUTBOX_RELAY_SUBJECT_PREFIX", "crm".into()),
        ("OUTBOX_RELAY_EVENT_TYPES", TYPES.into()),
        ("OUTBOX_PULL_WORKER", "true".into()),
    ]
}

/// The relay's variables for `nats` with user `relay` and [`PASSWORD`].
pub fn relay_env(nats: &NatsServer) -> Vec<(&'static str, String)> {
    let mut env = open_env(nats);
    env.push(("NATS_USER", "relay".into()));
    env.push(("NATS_PASSWORD", PASSWORD.into()));
    env
}

/// Borrows `env` as the command helpers take it.
pub fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'a str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Runs the `outbox` binary with `env` to its end.
pub fn run(url: &str, args: &[&str], env: &[(&'static str, String)]) -> Output {
    outbox_with_env(url, args, &borrowed(env))
}

/// What the stream must hold: every outbox row but the `invoice.sent` row, which no relay in
/// these tests is scoped to, with its record key (the audit's input).
pub fn expected_in_stream(rows: &[outbox_persistence::EventRow]) -> Vec<outbox_relay::Expected> {
    rows.iter()
        .filter(|r| r.event_type != "invoice.sent")
        .map(|r| outbox_relay::Expected {
            id: r.id.to_string(),
            record_key: r.record_key.as_ref().map(|k| k.as_str().to_string()),
        })
        .collect()
}
