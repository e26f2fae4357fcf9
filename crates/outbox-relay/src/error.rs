//! The relay's one error type. Messages never carry a secret: URLs are shown with their
//! credentials redacted, and authentication material is never formatted.

/// What can go wrong when configuring, connecting or checking the relay.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The relay's configuration is inconsistent (an event type that maps to no valid subject,
    /// no event types, an empty stream name…).
    #[error("relay configuration: {0}")]
    Config(String),
    /// Reading a secret (password, token, credentials file, CA file) failed.
    #[error("reading the {what}: {source}")]
    Secret {
        /// Which secret, for example "password file".
        what: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Connecting to NATS failed.
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect {
        /// The server URL, credentials redacted.
        url: String,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
    /// The stream the relay publishes to does not exist (and `--create-stream` was not given).
    #[error(
        "JetStream stream {stream:?} not found: create it (outbox relay --create-stream) or name an existing one"
    )]
    StreamNotFound {
        /// The stream's name.
        stream: String,
    },
    /// The stream exists but cannot keep the relay's promise; every reason is listed.
    #[error("the relay refuses to start on stream {stream:?}:\n  {}", reasons.join("\n  "))]
    StreamRefused {
        /// The stream's name.
        stream: String,
        /// One sentence per reason.
        reasons: Vec<String>,
    },
    /// A JetStream API call failed.
    #[error("JetStream {what}: {source}")]
    JetStream {
        /// What the relay was doing.
        what: &'static str,
        /// The client's error.
        #[source]
        source: async_nats::Error,
    },
    /// The outbox database failed.
    #[error("outbox database: {}", .0.chain())]
    Database(#[from] outbox_events::persistence::Error),
}

impl RelayError {
    /// A JetStream error while doing `what`.
    pub(crate) fn js(what: &'static str, source: impl Into<async_nats::Error>) -> Self {
        RelayError::JetStream {
            what,
            source: source.into(),
        }
    }
}
