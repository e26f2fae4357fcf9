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
    /// A file of tokens, one `NAME:SECRET[:viewer|:operator]` per line (`#` starts a comment;
    /// a viewer unless it says operator): the documented way, with the environment variable.
    #[arg(long)]
    pub token_file: Option<std::path::PathBuf>,
    /// A token `NAME:SECRET[:viewer|:operator]`, repeatable. Any local user can read the
    /// command line (`ps`): prefer `--token-file` or `OUTBOX_CONSOLE_TOKENS`.
    #[arg(long = "token")]
    pub tokens: Vec<String>,
    /// The origin a proxy in front of the console serves it under (for example
    /// `https://ops.example.com`), repeatable: actions may come from it, and a console without
    /// tokens answers requests for its host.
    #[arg(long = "public-origin")]
    pub public_origins: Vec<String>,
    /// The header a proxy that authenticates users names them in (for example
    /// `X-Forwarded-User`): required on every request and recorded as the actor. Loopback
    /// only, without tokens.
    #[arg(long)]
    pub proxy_user_header: Option<String>,
    /// Read every page from this hot standby of the database (a streaming replica); actions
    /// and their audit rows still go to the primary (`--database-url`). The overview shows how
    /// far behind the standby is.
    #[arg(long)]
    pub read_database_url: Option<String>,
    /// The workers' stale-after, in milliseconds, to judge heartbeats by (their default when
    /// absent).
    #[arg(long)]
    pub stale_after_ms: Option<u64>,
    /// The workers' base retry delay, in milliseconds (their default when absent).
    #[arg(long)]
    pub retry_delay_ms: Option<u64>,
}

/// The environment variable of console tokens (`NAME:SECRET[:ROLE]`, comma-separated).
pub const TOKENS_ENV: &str = "OUTBOX_CONSOLE_TOKENS";

/// The tokens of a token file's text: one per line, blank lines and `#` comments skipped.
fn parse_token_file(text: &str) -> Result<Vec<NamedToken>> {
    text.lines()
        .enumerate()
        .map(|(n, line)| (n + 1, line.trim()))
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
        .map(|(n, line)| NamedToken::parse(line).with_context(|| format!("line {n}")))
        .collect()
}

/// Warns when the token file can be read by its group or others.
fn warn_if_readable_by_others(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(path = %path.display(), "the console's token file is readable by others; chmod 600 it");
        eprintln!(
            "warning: the token file {} is readable by its group or others; chmod 600 it",
            path.display()
        );
    }
}

impl ConsoleArgs {
    /// Every token: the file's, the environment's, then the command line's (with a warning:
    /// any local user reads a command line).
    fn tokens(&self) -> Result<Vec<NamedToken>> {
        let mut tokens = Vec::new();
        if let Some(path) = &self.token_file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the token file {}", path.display()))?;
            let found = parse_token_file(&text)
                .with_context(|| format!("the token file {}", path.display()))?;
            // Given but empty would leave the console without tokens, silently.
            anyhow::ensure!(
                !found.is_empty(),
                "the token file {} holds no token",
                path.display()
            );
            warn_if_readable_by_others(path);
            tokens.extend(found);
        }
        match std::env::var(TOKENS_ENV) {
            Ok(list) => {
                let before = tokens.len();
                // Comma-separated: a secret with a comma cannot be given here (use the token
                // file, one token per line, where commas are part of the secret).
                for token in list.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                    tokens.push(NamedToken::parse(token).with_context(|| {
                        format!("{TOKENS_ENV} (tokens are comma-separated, so a secret there cannot hold a comma; put such a token in --token-file)")
                    })?);
                }
                anyhow::ensure!(
                    tokens.len() > before,
                    "{TOKENS_ENV} is set but holds no token"
                );
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                anyhow::bail!("{TOKENS_ENV} is not valid UTF-8")
            }
            Err(std::env::VarError::NotPresent) => {}
        }
        if !self.tokens.is_empty() {
            tracing::warn!(
                tokens = self.tokens.len(),
                "console secrets given with --token are readable by any local user (ps, /proc); use --token-file or {TOKENS_ENV}"
            );
            eprintln!(
                "warning: secrets given with --token are readable by any local user (ps, /proc/PID/cmdline); use --token-file or {TOKENS_ENV}"
            );
        }
        for token in &self.tokens {
            tokens.push(NamedToken::parse(token.trim())?);
        }
        Ok(tokens)
    }

    fn config(&self) -> Result<ConsoleConfig> {
        Ok(ConsoleConfig {
            allow_actions: self.allow_actions,
            show_payloads: self.show_payloads,
            tokens: self.tokens()?,
            public_origins: self.public_origins.clone(),
            proxy_user_header: self.proxy_user_header.clone(),
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
        match (&config.proxy_user_header, config.tokens.is_empty()) {
            (Some(_), _) => ", users named by the proxy",
            (None, true) => "",
            (None, false) => ", token required",
        }
    );
    let mut console = Console::new(db.clone(), consumers.to_vec(), config)?;
    if let Some(standby) = &args.read_database_url {
        console = console.reading_from(db::open_standby(standby).await?);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_file_holds_one_token_per_line() {
        let text =
            "# the console's tokens\nops:0123456789abcdef:operator\n\n  ro:fedcba9876543210  \n";
        let tokens = parse_token_file(text).unwrap();
        assert_eq!(tokens.len(), 2);
        assert_eq!(tokens[0].role, outbox_console::Role::Operator);
        assert_eq!(tokens[1].name, "ro");
        assert_eq!(tokens[1].role, outbox_console::Role::Viewer);
        // A secret may hold a comma in the file (not in the comma-separated variable).
        let comma = parse_token_file("ops:0123,456789abcdef:operator\n").unwrap();
        assert_eq!(comma[0].secret, "0123,456789abcdef");
        let err = parse_token_file("ops:short\n").unwrap_err();
        assert!(format!("{err:#}").contains("line 1"), "{err:#}");
    }
}
