//! The operator console: the queue's health, "why is this record stuck", failed rows and
//! their retry, pause and resume of an event type, the consumer map with the rollout gate and
//! retention, as server-rendered pages in a browser.
//!
//! [`router`] serves a [`Console`] as an `axum` [`Router`]; an embedding service mounts it
//! under a prefix of its own with `Router::nest`, with its own consumers so the gate page is
//! real. [`serve`] runs it on a listener until a [`CancellationToken`] fires (the `outbox
//! console` command). See `docs/console.md`.
//!
//! Safe by default: read-only unless [`ConsoleConfig::allow_actions`]; once a token is
//! configured every request needs one ([`bind_check`] refuses a non-loopback address without
//! one); actions are `POST` with a CSRF token; every response carries a Content-Security-Policy
//! without inline script and the other headers of [`security`]; every value from the table is
//! escaped by the templates (`maud`). The console reads through the repository and
//! `outbox_persistence::console`, whose reads use the indexes and lock no row.

#![warn(missing_docs)]

mod actions;
mod consumers;
mod failed;
mod layout;
mod overview;
mod records;
pub mod security;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use outbox_events::Consumer;
use outbox_persistence::{ClaimPolicy, Database, OutboxRepository, PrunePolicy};
use tokio_util::sync::CancellationToken;

/// The address `outbox console` binds by default: loopback only.
pub const DEFAULT_BIND: &str = "127.0.0.1:8080";

/// How many of the longest-blocked keys the overview lists.
pub const BLOCKED_KEYS_SHOWN: u32 = 10;

/// How many audit entries the overview shows.
pub const AUDIT_ENTRIES_SHOWN: u32 = 20;

/// The shortest secret [`NamedToken::parse`] accepts.
pub const MIN_SECRET_LEN: usize = 16;

/// A token a request may authenticate with: its `name` is the actor the audit log records.
#[derive(Clone, PartialEq, Eq)]
pub struct NamedToken {
    /// Who holds it (recorded with every action taken with it).
    pub name: String,
    /// The secret sent as `Authorization: Bearer <secret>` or through the login form.
    pub secret: String,
}

impl NamedToken {
    /// A token named `name` with `secret`.
    pub fn new(name: impl Into<String>, secret: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            secret: secret.into(),
        }
    }

    /// Parses `NAME:SECRET` (the `--token` flag and `OUTBOX_CONSOLE_TOKENS`, comma-separated);
    /// the secret has at least [`MIN_SECRET_LEN`] characters.
    pub fn parse(text: &str) -> Result<Self, ConsoleError> {
        match text.split_once(':') {
            Some((name, secret)) if !name.is_empty() && secret.len() >= MIN_SECRET_LEN => {
                Ok(Self::new(name, secret))
            }
            _ => Err(ConsoleError::BadToken),
        }
    }
}

impl std::fmt::Debug for NamedToken {
    /// The name only: a secret is never printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamedToken")
            .field("name", &self.name)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// How the console behaves. The path prefix is the embedder's (`Router::nest`).
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// Whether the `POST /actions/...` (retry, pause, resume) are served; read-only otherwise.
    pub allow_actions: bool,
    /// Whether the event page shows payloads (customer data).
    pub show_payloads: bool,
    /// The tokens requests may authenticate with; none: no authentication (loopback only).
    pub tokens: Vec<NamedToken>,
    /// How heartbeats and retry delays are judged (the workers' settings).
    pub claim_policy: ClaimPolicy,
    /// The retention policy the retention page counts against.
    pub prune_policy: PrunePolicy,
}

impl Default for ConsoleConfig {
    /// Read-only, no payloads, no tokens, the workers' default policy and retention.
    fn default() -> Self {
        Self {
            allow_actions: false,
            show_payloads: false,
            tokens: Vec::new(),
            claim_policy: ClaimPolicy::new(
                outbox_events::DEFAULT_STALE_AFTER,
                outbox_events::DEFAULT_RETRY_DELAY,
                outbox_events::DEFAULT_MAX_RETRY_ATTEMPTS,
            ),
            prune_policy: PrunePolicy::default(),
        }
    }
}

/// The console's errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// A non-loopback address without a token.
    #[error(
        "refusing to serve the console on {addr} without a token: an address other than loopback \
         needs at least one (--token NAME:SECRET or OUTBOX_CONSOLE_TOKENS), or bind 127.0.0.1"
    )]
    UnauthenticatedBind {
        /// The address.
        addr: SocketAddr,
    },
    /// A token that is not `NAME:SECRET`.
    #[error("a console token must be NAME:SECRET, with a secret of at least 16 characters")]
    BadToken,
    /// The listener failed.
    #[error("serving the console failed")]
    Io(
        #[from]
        #[source]
        std::io::Error,
    ),
}

/// Refuses to bind `addr` unless it is loopback or `config` has at least one token.
pub fn bind_check(addr: SocketAddr, config: &ConsoleConfig) -> Result<(), ConsoleError> {
    if addr.ip().is_loopback() || !config.tokens.is_empty() {
        Ok(())
    } else {
        Err(ConsoleError::UnauthenticatedBind { addr })
    }
}

/// The console's state: the database, the service's consumers and the configuration.
#[derive(Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database,
    repo: Arc<dyn OutboxRepository>,
    consumers: Vec<Consumer>,
    config: ConsoleConfig,
    /// The CSRF token of this console's run: random, from a UUID v4's bytes.
    csrf: String,
    /// Login sessions: the cookie's value, the token name it stands for, and when it began
    /// (at most [`security::MAX_SESSIONS`], each for [`security::SESSION_TTL`]).
    sessions: Mutex<Vec<(String, String, std::time::Instant)>>,
}

impl Console {
    /// A console over `db` (read through `db.repository()`) for a service whose consumers are
    /// `consumers`.
    pub fn new(db: Database, consumers: Vec<Consumer>, config: ConsoleConfig) -> Self {
        let repo = db.repository();
        Self {
            inner: Arc::new(Inner {
                db,
                repo,
                consumers,
                config,
                csrf: security::random_secret(),
                sessions: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ConsoleConfig {
        &self.inner.config
    }

    pub(crate) fn db(&self) -> &Database {
        &self.inner.db
    }

    pub(crate) fn repo(&self) -> &Arc<dyn OutboxRepository> {
        &self.inner.repo
    }

    pub(crate) fn consumers(&self) -> &[Consumer] {
        &self.inner.consumers
    }

    pub(crate) fn csrf(&self) -> &str {
        &self.inner.csrf
    }
}

/// The console as a router: mount it with `Router::nest("/prefix", router(console))` or serve
/// it with [`serve`].
pub fn router(state: Console) -> Router {
    Router::new()
        .route("/", get(overview::page))
        .route("/fragments/overview", get(overview::fragment))
        .route("/records", get(records::record_page))
        .route("/events/{id}", get(records::event_page))
        .route("/failed", get(failed::page))
        .route("/consumers", get(consumers::consumers_page))
        .route("/retention", get(consumers::retention_page))
        .route("/audit", get(overview::audit_page))
        .route("/actions/retry", post(actions::retry))
        .route("/actions/pause", post(actions::pause))
        .route("/actions/resume", post(actions::resume))
        .route("/login", get(security::login_page).post(security::login))
        .route("/assets/console.css", get(security::css))
        .route("/assets/console.js", get(security::js))
        .fallback(security::not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            security::authenticate,
        ))
        .layer(axum::middleware::from_fn(security::headers))
        .with_state(state)
}

/// How long [`serve`] lets open requests finish after `shutdown` fires.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Serves `console` on `listener` until `shutdown` fires, then lets open requests finish.
/// Refuses, as [`bind_check`], a non-loopback listener without a token.
pub async fn serve(
    listener: tokio::net::TcpListener,
    console: Console,
    shutdown: CancellationToken,
) -> Result<(), ConsoleError> {
    bind_check(listener.local_addr()?, console.config())?;
    tracing::info!(addr = %listener.local_addr()?, actions = console.config().allow_actions, "serving the operator console");
    let app = router(console);
    let wait = shutdown.clone();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { wait.cancelled().await })
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_loopback_bind_needs_a_token() {
        let mut config = ConsoleConfig::default();
        let public: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let err = bind_check(public, &config).unwrap_err();
        assert!(err.to_string().contains("without a token"), "{err}");
        assert!(bind_check("127.0.0.1:8080".parse().unwrap(), &config).is_ok());
        assert!(bind_check("[::1]:8080".parse().unwrap(), &config).is_ok());
        config.tokens.push(NamedToken::new("ops", "s3cret"));
        assert!(bind_check(public, &config).is_ok());
    }

    #[test]
    fn tokens_parse_and_never_print_their_secret() {
        let t = NamedToken::parse("alice:pa:ss-0123456789abcdef").unwrap();
        assert_eq!(
            (t.name.as_str(), t.secret.as_str()),
            ("alice", "pa:ss-0123456789abcdef")
        );
        assert!(!format!("{t:?}").contains("pa:ss"));
        assert!(NamedToken::parse("nosecret").is_err());
        assert!(NamedToken::parse(":x0123456789abcdef").is_err());
        assert!(
            NamedToken::parse("bob:short").is_err(),
            "a secret shorter than 16 characters is refused"
        );
    }
}
