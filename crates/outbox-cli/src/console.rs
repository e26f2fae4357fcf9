//! `outbox console`: the operator console (`outbox-console`) served over the command's
//! database, with the calling binary's consumers on its gate page (docs/console.md).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use outbox_console::{Console, ConsoleConfig, NamedToken};
use outbox_events::{
    Consumer, DEFAULT_MAX_RETRY_ATTEMPTS, DEFAULT_RETRY_DELAY, DEFAULT_STALE_AFTER,
};
use outbox_persistence::{ClaimPolicy, ConnectConfig};
use tokio_util::sync::CancellationToken;

use crate::db;

/// `outbox console`.
#[derive(Debug, Args)]
pub struct ConsoleArgs {
    /// Where to listen. An address other than loopback needs a token.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub bind: SocketAddr,
    /// Serve the actions (retry, pause, resume); read-only without it.
    #[arg(long)]
    pub allow_actions: bool,
    /// Show payloads on the event page (they carry customer data).
    #[arg(long)]
    pub show_payloads: bool,
    /// A token `NAME:SECRET` requests authenticate with (`Authorization: Bearer SECRET` or the
    /// login form); NAME is the actor the audit log records. Repeatable.
    #[arg(
        long = "token",
        env = "OUTBOX_CONSOLE_TOKENS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub tokens: Vec<String>,
    /// The workers' stale-after, in milliseconds, to judge heartbeats by (their default when
    /// absent).
    #[arg(long)]
    pub stale_after_ms: Option<u64>,
    /// The workers' base retry delay, in milliseconds (their default when absent).
    #[arg(long)]
    pub retry_delay_ms: Option<u64>,
}

impl ConsoleArgs {
    fn config(&self) -> Result<ConsoleConfig> {
        let tokens = self
            .tokens
            .iter()
            .map(|t| NamedToken::parse(t.trim()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ConsoleConfig {
            allow_actions: self.allow_actions,
            show_payloads: self.show_payloads,
            tokens,
            claim_policy: ClaimPolicy::new(
                self.stale_after_ms
                    .map_or(DEFAULT_STALE_AFTER, Duration::from_millis),
                self.retry_delay_ms
                    .map_or(DEFAULT_RETRY_DELAY, Duration::from_millis),
                DEFAULT_MAX_RETRY_ATTEMPTS,
            ),
            ..ConsoleConfig::default()
        })
    }
}

/// Serves the console until SIGINT or SIGTERM.
pub async fn run(url: Option<&str>, args: ConsoleArgs, consumers: &[Consumer]) -> Result<ExitCode> {
    let config = args.config()?;
    outbox_console::bind_check(args.bind, &config)?;
    let db = db::open(url, ConnectConfig::default()).await?;
    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .with_context(|| format!("cannot listen on {}", args.bind))?;
    eprintln!(
        "outbox console on http://{} ({}{})",
        listener.local_addr()?,
        if config.allow_actions {
            "actions allowed"
        } else {
            "read-only"
        },
        if config.tokens.is_empty() {
            ""
        } else {
            ", token required"
        }
    );
    let console = Console::new(db.clone(), consumers.to_vec(), config);
    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        crate::shutdown_signal().await;
        on_signal.cancel();
    });
    outbox_console::serve(listener, console, shutdown).await?;
    db.close().await;
    Ok(ExitCode::SUCCESS)
}
