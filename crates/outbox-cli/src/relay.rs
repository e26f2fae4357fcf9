//! `outbox relay`: the NATS JetStream relay (`outbox-relay`) as an operator runs it, without
//! writing Rust. Its declaration (which event types, which stream and subjects, the ack timeout
//! and the retry and stale settings that give the window it needs) comes from [`RelaySpec`],
//! whose every option also reads an `OUTBOX_RELAY_*` variable: `outbox consumers` and
//! `outbox gate` read the same variables ([`RelaySpec::from_env`]) and judge the relay's
//! consumers, so the three commands agree when they share an environment.
//!
//! Secrets never come from a flag (a flag shows in `ps` and shell history): the password and
//! the token are read from `NATS_PASSWORD`/`NATS_TOKEN` or from a file named by a flag, and are
//! never printed, logged or shown by `--help`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, FromArgMatches};
use outbox_events::{Consumer, DispatchMode, WorkerConfig};
use outbox_persistence::ConnectConfig;
use outbox_relay::{
    NatsAuth, NatsConnect, Relay, RelayConfig, Secret, StreamSpec, human, relayed_rows_left,
};

/// What the relay relays, and the settings that shape the duplicate window it needs. Every
/// option reads its `OUTBOX_RELAY_*` variable too.
#[derive(Debug, Clone, Args)]
pub struct RelaySpec {
    /// The JetStream stream the relay publishes to.
    #[arg(long, env = "OUTBOX_RELAY_STREAM")]
    pub stream: Option<String>,
    /// Subjects are `<prefix>.<EventType>` unless overridden with --subject.
    #[arg(long, env = "OUTBOX_RELAY_SUBJECT_PREFIX", default_value = outbox_relay::DEFAULT_SUBJECT_PREFIX)]
    pub subject_prefix: String,
    /// An event type to relay (repeatable, or comma separated): the relay claims these and
    /// no other.
    #[arg(
        long = "event-type",
        env = "OUTBOX_RELAY_EVENT_TYPES",
        value_delimiter = ','
    )]
    pub event_types: Vec<String>,
    /// A subject for one event type instead of `<prefix>.<EventType>`: `TYPE=SUBJECT`
    /// (repeatable, or comma separated).
    #[arg(long = "subject", env = "OUTBOX_RELAY_SUBJECTS", value_delimiter = ',', value_parser = parse_override)]
    pub subjects: Vec<(String, String)>,
    /// The longest wait for the stream's ack of a publish, in milliseconds; past it the attempt
    /// is retried.
    #[arg(long, env = "OUTBOX_RELAY_ACK_TIMEOUT_MS", default_value_t = 5_000)]
    pub ack_timeout_ms: u64,
    /// Heartbeat interval in milliseconds.
    #[arg(long, env = "OUTBOX_RELAY_HEARTBEAT_MS")]
    pub heartbeat_ms: Option<u64>,
    /// Stale-after in milliseconds.
    #[arg(long, env = "OUTBOX_RELAY_STALE_AFTER_MS")]
    pub stale_after_ms: Option<u64>,
    /// Base retry delay in milliseconds.
    #[arg(long, env = "OUTBOX_RELAY_RETRY_DELAY_MS")]
    pub retry_delay_ms: Option<u64>,
    /// Longest retry delay in milliseconds.
    #[arg(long, env = "OUTBOX_RELAY_MAX_RETRY_DELAY_MS")]
    pub max_retry_delay_ms: Option<u64>,
    /// MaxRetryAttempts.
    #[arg(long, env = "OUTBOX_RELAY_MAX_RETRY_ATTEMPTS")]
    pub max_retry_attempts: Option<i32>,
}

fn parse_override(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((t, s)) if !t.is_empty() && !s.is_empty() => Ok((t.to_string(), s.to_string())),
        _ => Err(format!("{text:?}: expected TYPE=SUBJECT")),
    }
}

impl RelaySpec {
    /// The spec the `OUTBOX_RELAY_*` variables give, or `None` when they name no event type
    /// (no relay configured): what `outbox consumers` and `outbox gate` judge.
    pub fn from_env() -> Result<Option<Self>> {
        let command = Self::augment_args(clap::Command::new("outbox"));
        let matches = command
            .try_get_matches_from(["outbox"])
            .context("reading the OUTBOX_RELAY_* variables")?;
        let spec =
            Self::from_arg_matches(&matches).context("reading the OUTBOX_RELAY_* variables")?;
        Ok((!spec.event_types.is_empty()).then_some(spec))
    }

    /// The relay's configuration (checked).
    pub fn relay_config(&self) -> Result<RelayConfig> {
        let Some(stream) = &self.stream else {
            bail!("no stream given: pass --stream or set OUTBOX_RELAY_STREAM");
        };
        let mut config = RelayConfig::new(stream, &self.subject_prefix, &self.event_types)
            .with_ack_timeout(Duration::from_millis(self.ack_timeout_ms));
        for (event_type, subject) in &self.subjects {
            config = config.with_subject(event_type, subject);
        }
        config.validate()?;
        Ok(config)
    }

    /// The worker settings on top of `base`.
    pub fn worker_config(&self, base: WorkerConfig) -> WorkerConfig {
        let ms = Duration::from_millis;
        let mut c = base;
        if let Some(v) = self.heartbeat_ms {
            c = c.with_heartbeat_interval(ms(v));
        }
        if let Some(v) = self.stale_after_ms {
            c = c.with_stale_after(ms(v));
        }
        if let Some(v) = self.retry_delay_ms {
            c = c.with_retry_delay(ms(v));
        }
        if let Some(v) = self.max_retry_delay_ms {
            c = c.with_max_retry_delay(ms(v));
        }
        if let Some(v) = self.max_retry_attempts {
            c = c.with_max_retry_attempts(v);
        }
        c
    }

    /// The relay's consumer declarations.
    pub fn consumers(&self) -> Result<Vec<Consumer>> {
        let worker = self.worker_config(WorkerConfig::default());
        Ok(self.relay_config()?.consumers(&worker))
    }
}

/// The consumers `outbox consumers` and `outbox gate` judge: the relay's, when the
/// `OUTBOX_RELAY_*` variables configure one (said on stderr), none otherwise.
pub fn consumers_from_env() -> Result<Vec<Consumer>> {
    match RelaySpec::from_env()? {
        None => Ok(Vec::new()),
        Some(spec) => {
            let consumers = spec.consumers()?;
            eprintln!(
                "judging the relay configured by OUTBOX_RELAY_* ({} event type(s) to stream {})",
                consumers.len(),
                spec.stream.as_deref().unwrap_or("?")
            );
            Ok(consumers)
        }
    }
}

/// How to reach and authenticate to NATS.
#[derive(Debug, Clone, Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma separated.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// User name; the password comes from NATS_PASSWORD or --nats-password-file.
    #[arg(long, env = "NATS_USER")]
    pub nats_user: Option<String>,
    /// A file holding the password (a mounted secret).
    #[arg(long, env = "NATS_PASSWORD_FILE", requires = "nats_user")]
    pub nats_password_file: Option<PathBuf>,
    /// A file holding the token (or set NATS_TOKEN).
    #[arg(long, env = "NATS_TOKEN_FILE", conflicts_with = "nats_user")]
    pub nats_token_file: Option<PathBuf>,
    /// A `.creds` file (user JWT and nkey seed).
    #[arg(long, env = "NATS_CREDS", conflicts_with_all = ["nats_user", "nats_token_file"])]
    pub nats_creds: Option<PathBuf>,
    /// A CA file (PEM) to verify the server's certificate; implies TLS.
    #[arg(long, env = "NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// A client certificate (PEM), for servers that verify clients.
    #[arg(long, env = "NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, env = "NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
    /// Require TLS (verified against the system's roots without --nats-tls-ca).
    #[arg(long, env = "NATS_TLS")]
    pub nats_tls: bool,
}

/// A secret from `variable`, or from `file`, or none.
fn secret(variable: &str, file: Option<&PathBuf>, what: &'static str) -> Result<Option<Secret>> {
    if let Some(path) = file {
        return Ok(Some(Secret::from_file(path, what)?));
    }
    Ok(std::env::var(variable)
        .ok()
        .filter(|v| !v.is_empty())
        .map(Secret::new))
}

impl NatsArgs {
    /// The connection settings, with the secrets read.
    pub fn connect(&self) -> Result<NatsConnect> {
        let auth = if let Some(creds) = &self.nats_creds {
            NatsAuth::CredsFile(creds.clone())
        } else if let Some(user) = &self.nats_user {
            let Some(password) = secret(
                "NATS_PASSWORD",
                self.nats_password_file.as_ref(),
                "password file",
            )?
            else {
                bail!(
                    "--nats-user {user} needs a password: set NATS_PASSWORD or pass --nats-password-file"
                );
            };
            NatsAuth::UserPassword {
                user: user.clone(),
                password,
            }
        } else if let Some(token) =
            secret("NATS_TOKEN", self.nats_token_file.as_ref(), "token file")?
        {
            NatsAuth::Token(token)
        } else {
            NatsAuth::None
        };
        let mut connect = NatsConnect::new(&self.nats_url).with_auth(auth);
        connect.tls_ca = self.nats_tls_ca.clone();
        connect.tls_client = self.nats_tls_cert.clone().zip(self.nats_tls_key.clone());
        connect.tls_required = self.nats_tls;
        Ok(connect)
    }
}

/// `outbox relay`.
#[derive(Debug, Args)]
pub struct RelayArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub spec: RelaySpec,
    /// Concurrent workers.
    #[arg(long, default_value_t = outbox_events::DEFAULT_WORKERS)]
    pub workers: usize,
    /// Lock timeout of an attempt in milliseconds.
    #[arg(long)]
    pub lock_timeout_ms: Option<u64>,
    /// Select the pull workers (`true`) or the legacy dispatcher; overrides
    /// OUTBOX_PULL_WORKER. Pull mode still needs the rollout gate to pass.
    #[arg(long)]
    pub pull_worker: Option<bool>,
    /// Exit when no row of the relayed event types is left pending or processing.
    #[arg(long)]
    pub until_drained: bool,
    /// Create the stream when it does not exist (an existing stream is only checked).
    #[arg(long)]
    pub create_stream: bool,
    /// With --create-stream: a subject the stream captures (repeatable; default
    /// `<prefix>.>` and every --subject).
    #[arg(long, requires = "create_stream")]
    pub stream_subject: Vec<String>,
    /// With --create-stream: its duplicate window in seconds (default: the window the
    /// settings need, rounded up to whole minutes, two at least).
    #[arg(long, requires = "create_stream")]
    pub duplicate_window_secs: Option<u64>,
    /// With --create-stream: keep messages in memory (lost when the server restarts).
    #[arg(long, requires = "create_stream")]
    pub memory_storage: bool,
    #[command(flatten)]
    pub metrics: outbox_cli::metrics::MetricsArgs,
}

impl RelayArgs {
    fn worker_config(&self) -> WorkerConfig {
        // `from_env`: OUTBOX_PULL_WORKER, unless `--pull-worker` says otherwise.
        let mut base = WorkerConfig::from_env().with_workers(self.workers);
        if let Some(pull) = self.pull_worker {
            base = base.with_mode(if pull {
                DispatchMode::Pull
            } else {
                DispatchMode::Legacy
            });
        }
        if let Some(ms) = self.lock_timeout_ms {
            base = base.with_lock_timeout(Duration::from_millis(ms));
        }
        self.metrics.apply(self.spec.worker_config(base))
    }

    fn stream_spec(&self, config: &RelayConfig, worker: &WorkerConfig) -> StreamSpec {
        let mut spec = StreamSpec::for_relay(config, worker);
        if !self.stream_subject.is_empty() {
            spec.subjects = self.stream_subject.clone();
        }
        if let Some(secs) = self.duplicate_window_secs {
            spec.duplicate_window = Duration::from_secs(secs);
        }
        spec.memory = self.memory_storage;
        spec
    }
}

/// Runs the relay until SIGINT/SIGTERM, or until drained with `--until-drained`.
pub async fn run(url: Option<&str>, args: RelayArgs) -> Result<ExitCode> {
    let config = args.spec.relay_config()?;
    let worker = args.worker_config();
    worker.validate().map_err(anyhow::Error::msg)?;
    args.metrics.install()?;
    let connect = args.nats.connect()?;
    let client = connect.connect().await?;
    let relay = Relay::new(client, config.clone())?;
    if args.create_stream {
        let spec = args.stream_spec(&config, &worker);
        if relay.create_stream(&spec).await? {
            eprintln!(
                "created stream {} (subjects {:?}, duplicate window {})",
                config.stream,
                spec.subjects,
                human(spec.duplicate_window)
            );
        }
    }
    let db = open_db(url, &worker).await?;
    let repo = db.repository();
    let (dispatcher, check) = relay.dispatcher(repo.clone(), worker).await?;
    for warning in &check.warnings {
        eprintln!("warning: stream {}: {warning}", check.stream);
    }
    let decision = dispatcher.decide().await?;
    if !decision.refused.is_empty() {
        eprintln!(
            "OUTBOX_PULL_WORKER asks for pull workers, but the rollout gate refuses; running the legacy dispatcher:\n  {}",
            decision.refused.join("\n  ")
        );
    }
    eprintln!(
        "relaying {} to stream {} at {} (duplicate window {}, at least {} needed; {:?} mode)",
        config
            .subjects()
            .iter()
            .map(|(t, s)| format!("{t} -> {s}"))
            .collect::<Vec<_>>()
            .join(", "),
        check.stream,
        connect.shown_url(),
        human(check.duplicate_window),
        human(check.required_window),
        decision.mode
    );
    let started = Instant::now();
    let handle = dispatcher.start_decided(decision);
    let stop = handle.stop_token();
    let waited = wait(&repo, &config, args.until_drained, &stop).await;
    let report = handle.shutdown().await;
    db.close().await;
    waited?;
    let m = relay.metrics();
    println!(
        "relayed in {:.1} s: {} processed, {} retried, {} failed; {} published, {} duplicates dropped by the stream, {} publish failures",
        started.elapsed().as_secs_f64(),
        report.metrics.processed,
        report.metrics.retried,
        report.metrics.failed,
        m.published,
        m.duplicates,
        m.failures
    );
    Ok(if report.metrics.failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

async fn open_db(url: Option<&str>, worker: &WorkerConfig) -> Result<outbox_persistence::Database> {
    let config = ConnectConfig {
        lock_timeout: worker.lock_timeout,
        ..ConnectConfig::for_workers(worker.workers)
    };
    outbox_cli::db::open(url, config).await
}

/// Waits for a signal, or for the relayed rows to drain.
async fn wait(
    repo: &std::sync::Arc<dyn outbox_persistence::OutboxRepository>,
    config: &RelayConfig,
    until_drained: bool,
    stop: &outbox_events::CancellationToken,
) -> Result<()> {
    let signal = outbox_cli::shutdown_signal();
    tokio::pin!(signal);
    loop {
        tokio::select! {
            _ = &mut signal => {
                eprintln!("stopping: finishing in-flight attempts");
                return Ok(());
            }
            _ = stop.cancelled() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(200)), if until_drained => {
                if relayed_rows_left(repo, config).await? == 0 {
                    return Ok(());
                }
            }
        }
    }
}
