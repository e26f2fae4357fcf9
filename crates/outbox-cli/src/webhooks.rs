//! `outbox webhooks`: the webhook endpoints (add, list, disable, enable, rotate a secret, an
//! endpoint's recent attempts), through `outbox_webhooks::Webhooks`, every change audited.
//! A secret is printed once, when made; never listed.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Subcommand};
use outbox_events::ConnectConfig;
use outbox_webhooks::{WebhookConfig, Webhooks};

use crate::args::ActorArg;
use crate::db;

/// `outbox webhooks …`.
#[derive(Debug, Subcommand)]
pub enum WebhooksCommand {
    /// Add an endpoint; prints its new secret (shown once).
    Add(AddArgs),
    /// The endpoints: URL, event types, state, failures in a row (never their secrets).
    List(ListArgs),
    /// Disable an endpoint: its deliveries wait, in order, until it is enabled.
    Disable(DisableArgs),
    /// Enable an endpoint: its waiting deliveries resume in order.
    Enable(NameArgs),
    /// Give an endpoint a new secret (printed once); the old one still signs during the overlap.
    Rotate(RotateArgs),
    /// An endpoint's newest delivery attempts: status, latency, error, the answer's start.
    Attempts(AttemptsArgs),
}

/// `outbox webhooks add`.
#[derive(Debug, Args)]
pub struct AddArgs {
    /// The endpoint's name: lower-case letters, digits, `-` and `_`.
    pub name: String,
    /// Where deliveries are POSTed (http or https).
    pub url: String,
    /// An event type it receives (repeat for more; none: every type the fan-out takes).
    #[arg(long = "event-type")]
    pub event_types: Vec<String>,
    /// Who acts (the audit log's actor).
    #[command(flatten)]
    pub actor: ActorArg,
}

/// `outbox webhooks list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// An endpoint's name and who acts.
#[derive(Debug, Args)]
pub struct NameArgs {
    /// The endpoint's name.
    pub name: String,
    /// Who acts (the audit log's actor).
    #[command(flatten)]
    pub actor: ActorArg,
}

/// `outbox webhooks disable`.
#[derive(Debug, Args)]
pub struct DisableArgs {
    /// The endpoint's name.
    pub name: String,
    /// Why (kept on the endpoint and in the audit log).
    #[arg(long, default_value = "disabled by an operator")]
    pub reason: String,
    /// Who acts (the audit log's actor).
    #[command(flatten)]
    pub actor: ActorArg,
}

/// `outbox webhooks rotate`.
#[derive(Debug, Args)]
pub struct RotateArgs {
    /// The endpoint's name.
    pub name: String,
    /// How long the old secret still signs, in hours.
    #[arg(long, default_value_t = 24.0)]
    pub overlap_hours: f64,
    /// Who acts (the audit log's actor).
    #[command(flatten)]
    pub actor: ActorArg,
}

/// `outbox webhooks attempts`.
#[derive(Debug, Args)]
pub struct AttemptsArgs {
    /// The endpoint's name.
    pub name: String,
    /// How many of the newest attempts.
    #[arg(long, default_value_t = 20)]
    pub limit: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs one `outbox webhooks` command.
pub async fn run(url: Option<&str>, command: WebhooksCommand) -> Result<ExitCode> {
    let db = db::open(url, ConnectConfig::default()).await?;
    let hooks = Webhooks::new(db.repository(), WebhookConfig::default());
    let done = run_with(&hooks, command).await;
    db.close().await;
    done
}

async fn run_with(hooks: &Webhooks, command: WebhooksCommand) -> Result<ExitCode> {
    match command {
        WebhooksCommand::Add(a) => {
            let (added, secret) = hooks
                .add(&a.name, &a.url, &a.event_types, &a.actor.name())
                .await?;
            if !added {
                eprintln!("an endpoint named {:?} exists; nothing changed", a.name);
                return Ok(ExitCode::FAILURE);
            }
            println!("added endpoint {:?} -> {}", a.name, a.url);
            println!("secret (shown once; give it to the receiver): {secret}");
        }
        WebhooksCommand::List(a) => list(hooks, a.json).await?,
        WebhooksCommand::Disable(a) => {
            let changed = hooks.disable(&a.name, &a.reason, &a.actor.name()).await?;
            println!(
                "{:?} {}",
                a.name,
                if changed {
                    "disabled: its deliveries wait in order"
                } else {
                    "was disabled already; nothing changed"
                }
            );
        }
        WebhooksCommand::Enable(a) => {
            let changed = hooks.enable(&a.name, &a.actor.name()).await?;
            println!(
                "{:?} {}",
                a.name,
                if changed {
                    "enabled: its waiting deliveries resume in order"
                } else {
                    "was enabled already; nothing changed"
                }
            );
        }
        WebhooksCommand::Rotate(a) => {
            if !(a.overlap_hours.is_finite() && a.overlap_hours >= 0.0) {
                anyhow::bail!("--overlap-hours must be 0 or more");
            }
            let secret = outbox_webhooks::signature::generate_secret()?;
            let overlap = Duration::from_secs_f64(a.overlap_hours * 3600.0);
            hooks
                .rotate_with(&a.name, &secret, overlap, &a.actor.name())
                .await?;
            println!("new secret for {:?} (shown once): {secret}", a.name);
            println!("the previous secret signs too for {} h", a.overlap_hours);
        }
        WebhooksCommand::Attempts(a) => attempts(hooks, &a).await?,
    }
    Ok(ExitCode::SUCCESS)
}

async fn list(hooks: &Webhooks, json: bool) -> Result<()> {
    let endpoints = hooks.list().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&endpoints)?);
        return Ok(());
    }
    if endpoints.is_empty() {
        println!("no webhook endpoints");
    }
    for e in endpoints {
        let types = if e.event_types.is_empty() {
            "every type".to_string()
        } else {
            e.event_types.join(", ")
        };
        let state = if e.enabled {
            "enabled".to_string()
        } else {
            format!(
                "DISABLED ({})",
                e.disabled_reason.as_deref().unwrap_or("no reason given")
            )
        };
        println!(
            "{}  {}  [{types}]  {state}  {} failed in a row{}",
            e.name,
            e.url,
            e.consecutive_failures,
            e.previous_secret_until
                .filter(|until| *until > chrono::Utc::now())
                .map(|until| format!("  rotating until {until}"))
                .unwrap_or_default()
        );
    }
    Ok(())
}

async fn attempts(hooks: &Webhooks, a: &AttemptsArgs) -> Result<()> {
    hooks.get(&a.name).await?;
    let attempts = hooks.attempts(&a.name, a.limit).await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&attempts)?);
        return Ok(());
    }
    if attempts.is_empty() {
        println!("no attempts for {:?}", a.name);
    }
    for t in attempts {
        let at = t.at.map(|at| at.to_rfc3339()).unwrap_or_default();
        let status = t
            .status_code
            .map_or("no answer".to_string(), |s| format!("HTTP {s}"));
        let body: String = t
            .response_body
            .unwrap_or_default()
            .chars()
            .take(120)
            .collect();
        println!(
            "{at}  event {} (source {}) attempt {}  {status}  {} ms  {}  {body:?}",
            t.event_id,
            t.source_event_id,
            t.attempt,
            t.latency_ms,
            t.error.as_deref().unwrap_or("ok"),
        );
    }
    Ok(())
}
