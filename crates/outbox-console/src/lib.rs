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
pub mod login;
mod overview;
mod records;
pub mod security;
mod serve;
mod webhooks;

pub use overview::OVERVIEW_REFRESH;
pub use serve::ConnectionLimits;

use std::net::SocketAddr;
use std::sync::Arc;
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

/// The shortest secret a console takes ([`NamedToken::parse`] and [`Console::new`]).
pub const MIN_SECRET_LEN: usize = 16;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Reads every page; no action.
    #[default]
    Viewer,
    /// Reads, and acts (retry, pause, resume) when the console allows actions.
    Operator,
}

impl Role {
    /// `viewer` or `operator`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A token a request may authenticate with: its `name` is the actor the audit log records,
/// its `role` what it may do.
#[derive(Clone, PartialEq, Eq)]
pub struct NamedToken {
    /// Who holds it (recorded with every action taken with it).
    pub name: String,
    /// The secret sent as `Authorization: Bearer <secret>` or through the login form (at
    /// least [`MIN_SECRET_LEN`] characters: [`Console::new`] refuses a shorter one).
    pub secret: String,
    /// What it may do.
    pub role: Role,
}

impl NamedToken {
    /// A viewer's token named `name` with `secret`.
    pub fn new(name: impl Into<String>, secret: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            secret: secret.into(),
            role: Role::Viewer,
        }
    }

    /// An operator's token named `name` with `secret`.
    pub fn operator(name: impl Into<String>, secret: impl Into<String>) -> Self {
        Self {
            role: Role::Operator,
            ..Self::new(name, secret)
        }
    }

    /// Parses `NAME:SECRET`, `NAME:SECRET:viewer` or `NAME:SECRET:operator` (the lines of
    /// `--token-file`, and `OUTBOX_CONSOLE_TOKENS`, comma-separated): a viewer unless it says
    /// `operator`; the secret has at least [`MIN_SECRET_LEN`] characters.
    pub fn parse(text: &str) -> Result<Self, ConsoleError> {
        let (rest, role) = match text.rsplit_once(':') {
            Some((rest, "operator")) => (rest, Role::Operator),
            Some((rest, "viewer")) => (rest, Role::Viewer),
            // `NAME:SECRET:Operator`, `NAME:SECRET:admin`: a role misspelt, not a secret's end.
            Some((rest, last))
                if rest.contains(':')
                    && (1..=12).contains(&last.len())
                    && last.chars().all(|c| c.is_ascii_alphabetic()) =>
            {
                return Err(ConsoleError::UnknownRole(last.to_string()));
            }
            _ => (text, Role::Viewer),
        };
        match rest.split_once(':') {
            Some((name, secret)) if !name.is_empty() && security::weak_secret(secret).is_none() => {
                Ok(Self {
                    role,
                    ..Self::new(name, secret)
                })
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
            .field("role", &self.role)
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
    /// The origins a proxy in front of the console serves it under (for example
    /// `https://ops.example.com`): a `POST` may come from them, and a console without tokens
    /// answers requests naming their host. Empty: only the request's own host.
    pub public_origins: Vec<String>,
    /// The header a proxy that authenticates users names them in (for example
    /// `X-Forwarded-User`): every request must carry it, and it is the actor the audit log
    /// records, an operator. Only behind such a proxy, with the console on loopback:
    /// [`Console::new`] refuses it beside tokens, [`serve`] on another address.
    pub proxy_user_header: Option<String>,
    /// The limits [`serve`] puts on connections.
    pub limits: ConnectionLimits,
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
            public_origins: Vec::new(),
            proxy_user_header: None,
            limits: ConnectionLimits::default(),
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
         needs at least one (--token-file or OUTBOX_CONSOLE_TOKENS), or bind 127.0.0.1"
    )]
    UnauthenticatedBind {
        /// The address.
        addr: SocketAddr,
    },
    /// A token that is not `NAME:SECRET[:ROLE]`.
    #[error(
        "a console token must be NAME:SECRET, NAME:SECRET:viewer or NAME:SECRET:operator, with a \
         secret of at least 16 characters"
    )]
    BadToken,
    /// A token whose secret is empty or short, or the same as another token's.
    #[error(
        "the console token {name:?} is refused: {why} (generate a secret: openssl rand -hex 24)"
    )]
    WeakToken {
        /// The token's name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A token whose role is neither `viewer` nor `operator`.
    #[error("unknown console role {0:?}: a token's role is viewer or operator")]
    UnknownRole(String),
    /// A configuration that contradicts itself.
    #[error("the console's configuration is refused: {0}")]
    Config(&'static str),
    /// The listener failed.
    #[error("serving the console failed")]
    Io(
        #[from]
        #[source]
        std::io::Error,
    ),
}

/// Refuses to bind `addr` unless it is loopback or `config` has at least one token (a console
/// that trusts a proxy's user header listens on loopback only).
pub fn bind_check(addr: SocketAddr, config: &ConsoleConfig) -> Result<(), ConsoleError> {
    if addr.ip().is_loopback() || (!config.tokens.is_empty() && config.proxy_user_header.is_none())
    {
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
    /// Where pages read: the primary, or a hot standby ([`Console::reading_from`]).
    db: Database,
    repo: Arc<dyn OutboxRepository>,
    /// Where actions and their audit rows go: always the primary.
    writer: Arc<dyn OutboxRepository>,
    /// Whether `db` is a standby (its lag is shown, its failures named).
    standby: bool,
    consumers: Vec<Consumer>,
    config: ConsoleConfig,
    /// The CSRF token of this console's run without tokens (random, from UUID v4s' bytes).
    csrf: String,
    /// The CSRF token of each bearer token's forms (random per run, in `config.tokens`' order).
    token_csrf: Vec<String>,
    /// Login sessions and failed-login limits.
    logins: login::Logins,
    /// The overview's live part, shared by every request for `OVERVIEW_REFRESH`.
    overview: overview::OverviewCache,
}

impl Console {
    /// A console over `db` (read through `db.repository()`) for a service whose consumers are
    /// `consumers`. Refuses a token with an empty name, a secret shorter than
    /// [`MIN_SECRET_LEN`] or one secret for two tokens, however the tokens were built.
    pub fn new(
        db: Database,
        consumers: Vec<Consumer>,
        config: ConsoleConfig,
    ) -> Result<Self, ConsoleError> {
        security::check_config(&config)?;
        let repo = db.repository();
        let writer = repo.clone();
        let token_csrf = config
            .tokens
            .iter()
            .map(|_| security::random_secret())
            .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                db,
                repo,
                writer,
                standby: false,
                consumers,
                config,
                csrf: security::random_secret(),
                token_csrf,
                logins: login::Logins::default(),
                overview: overview::OverviewCache::default(),
            }),
        })
    }

    /// Sends every read (pages, the overview, the gate's counts) to `standby`, a streaming
    /// replica of the primary this console was made with; actions (retry, pause, resume) and
    /// their audit rows still go to the primary. The overview shows how far behind the
    /// standby is. Call before serving (the console is shared once served).
    pub fn reading_from(self, standby: Database) -> Self {
        let inner = Arc::try_unwrap(self.inner).unwrap_or_else(|shared| {
            // Clones made before (a router already built) keep reading the primary, with
            // their own sessions: only this console and its later clones read the standby.
            tracing::warn!("Console::reading_from on a console already shared: its earlier clones keep reading the primary");
            Inner {
            db: shared.db.clone(),
            repo: shared.repo.clone(),
            writer: shared.writer.clone(),
            standby: shared.standby,
            consumers: shared.consumers.clone(),
            config: shared.config.clone(),
            csrf: shared.csrf.clone(),
            token_csrf: shared.token_csrf.clone(),
            logins: login::Logins::default(),
            overview: overview::OverviewCache::default(),
        }
        });
        let repo = standby.repository();
        Self {
            inner: Arc::new(Inner {
                db: standby,
                repo,
                standby: true,
                ..inner
            }),
        }
    }

    /// Where actions write: the primary.
    pub(crate) fn writer(&self) -> &Arc<dyn OutboxRepository> {
        &self.inner.writer
    }

    /// Whether pages read from a standby.
    pub(crate) fn reads_standby(&self) -> bool {
        self.inner.standby
    }

    /// The index of the token whose secret is `secret` (every token is compared, whichever
    /// matches).
    pub(crate) fn token_index(&self, secret: &str) -> Option<usize> {
        let mut found = None;
        for (i, token) in self.config().tokens.iter().enumerate() {
            if security::constant_time_eq(&token.secret, secret) && found.is_none() {
                found = Some(i);
            }
        }
        found
    }

    /// The name and role of the token whose secret is `secret`.
    pub(crate) fn token_of(&self, secret: &str) -> Option<(String, Role)> {
        let token = &self.config().tokens[self.token_index(secret)?];
        Some((token.name.clone(), token.role))
    }

    pub(crate) fn overview_cache(&self) -> &overview::OverviewCache {
        &self.inner.overview
    }

    /// Counts a read of the overview that failed without failing the page
    /// (`outbox_console_read_failures_total{read}`, through the `metrics` facade).
    pub(crate) fn note_read_failure(&self, read: &'static str) {
        metrics::counter!("outbox_console_read_failures_total", "read" => read).increment(1);
    }

    /// The CSRF token of the forms of the token at `index`.
    pub(crate) fn token_csrf(&self, index: usize) -> &str {
        &self.inner.token_csrf[index]
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
        .route("/webhooks", get(webhooks::page))
        .route("/audit", get(overview::audit_page))
        .route("/actions/retry", post(actions::retry))
        .route("/actions/pause", post(actions::pause))
        .route("/actions/resume", post(actions::resume))
        .route("/login", get(login::login_page).post(login::login))
        .route("/logout", post(login::logout))
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

/// Serves `console` on `listener` until `shutdown` fires, then lets open requests finish
/// for up to [`SHUTDOWN_GRACE`]. Refuses, as [`bind_check`], a non-loopback listener without a
/// token. Connections are limited by [`ConsoleConfig::limits`]: a header-read timeout (also
/// for idle keep-alive connections), a cap on open connections and a timeout per request.
pub async fn serve(
    listener: tokio::net::TcpListener,
    console: Console,
    shutdown: CancellationToken,
) -> Result<(), ConsoleError> {
    bind_check(listener.local_addr()?, console.config())?;
    tracing::info!(addr = %listener.local_addr()?, actions = console.config().allow_actions, "serving the operator console");
    let limits = console.config().limits;
    serve::serve(listener, router(console), limits, shutdown, SHUTDOWN_GRACE).await;
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
        config
            .tokens
            .push(NamedToken::new("ops", "s3cret-0123456789"));
        assert!(bind_check(public, &config).is_ok());
        config.tokens.clear();
        config.proxy_user_header = Some("x-forwarded-user".into());
        assert!(bind_check(public, &config).is_err());
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
        assert_eq!(t.role, Role::Viewer, "a viewer by default");
        let op = NamedToken::parse("ops:0123456789abcdef:operator").unwrap();
        assert_eq!(
            (op.secret.as_str(), op.role),
            ("0123456789abcdef", Role::Operator)
        );
        let v = NamedToken::parse("ro:0123456789abcdef:viewer").unwrap();
        assert_eq!(v.role, Role::Viewer);
        assert!(NamedToken::parse("ops:short:operator").is_err());
        let typo = NamedToken::parse("ops:0123456789abcdef:Operator");
        assert!(
            matches!(typo, Err(ConsoleError::UnknownRole(_))),
            "{typo:?}"
        );
    }

    #[test]
    fn weak_or_ambiguous_tokens_are_refused_however_built() {
        let config = |tokens: Vec<NamedToken>| ConsoleConfig {
            tokens,
            ..ConsoleConfig::default()
        };
        let err = security::check_config(&config(vec![NamedToken::new("ops", "")])).unwrap_err();
        assert!(err.to_string().contains("shorter than 16"), "{err}");
        assert!(security::check_config(&config(vec![NamedToken::new("ops", "aaaaaaaa")])).is_err());
        let repetitive = NamedToken::new("ops", "a".repeat(16));
        assert!(security::check_config(&config(vec![repetitive])).is_err());
        assert!(NamedToken::parse("ops:aaaaaaaaaaaaaaaa").is_err());
        assert!(
            security::check_config(&config(vec![NamedToken::new("", "0123456789abcdef")])).is_err()
        );
        let same = vec![
            NamedToken::new("a", "0123456789abcdef"),
            NamedToken::operator("b", "0123456789abcdef"),
        ];
        assert!(security::check_config(&config(same)).is_err());
        let same_name = vec![
            NamedToken::new("ops", "0123456789abcdef"),
            NamedToken::operator("ops", "fedcba9876543210"),
        ];
        assert!(security::check_config(&config(same_name)).is_err());
        let origins = |o: &str| ConsoleConfig {
            public_origins: vec![o.to_string()],
            ..ConsoleConfig::default()
        };
        assert!(security::check_config(&origins("https://ops.example.com")).is_ok());
        assert!(security::check_config(&origins("ops.example.com")).is_err());
        assert!(security::check_config(&origins("https://ops.example.com/console")).is_err());
        assert!(
            security::check_config(&config(vec![NamedToken::new("ops", "0123456789abcdef")]))
                .is_ok()
        );
    }
}
