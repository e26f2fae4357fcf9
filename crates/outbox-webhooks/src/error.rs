//! The crate's error.

/// What went wrong managing or signing for an endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A secret that is not `whsec_` + base64 of 24 to 64 bytes, or one that could not be made.
    #[error("secret: {0}")]
    Secret(String),
    /// A URL the endpoint cannot take (not `http` or `https`, no host, credentials in it).
    #[error("url: {0}")]
    Url(String),
    /// A name, event type or setting that is refused.
    #[error("{0}")]
    Invalid(String),
    /// There is no endpoint of that name.
    #[error("no webhook endpoint is named {0:?}")]
    NoSuchEndpoint(String),
    /// The database.
    #[error(transparent)]
    Database(#[from] outbox_events::persistence::Error),
}
