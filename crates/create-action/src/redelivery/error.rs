//! The kit's own error type: what stops a redelivery check before it can report.

/// A boxed error from a handler under test, as the kit keeps it (this crate's
/// [`Error`](crate::Error), `anyhow::Error`, `sqlx::Error`, … convert into it).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why [`Redelivery::check`](super::Redelivery::check) or [`Pool::connect`](super::Pool::connect)
/// could not produce a report. A redelivery that fails is not an error: the report lists it
/// as [`Difference::DeliveryFailed`](super::Difference::DeliveryFailed).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KitError {
    /// A table or identity column name is not a safe SQL identifier; it was never sent to the
    /// database. Shown exactly as the crate's [`Error::InvalidIdentifier`](crate::Error).
    #[error(transparent)]
    InvalidIdentifier(crate::Error),
    /// A captured table does not exist.
    #[error("table {0} does not exist")]
    UnknownTable(String),
    /// The database URL is neither `postgres://…` nor `sqlite:…`.
    #[error("invalid database url: {0}")]
    InvalidUrl(String),
    /// The handler under test failed on the first delivery, so there is nothing to compare.
    #[error("the handler failed on the first delivery")]
    FirstDelivery(#[source] BoxError),
    /// A captured PostgreSQL row could not be read back from its JSON form.
    #[error("could not decode a row of {table}: {source}")]
    Decode {
        /// The table.
        table: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// A database error while connecting or capturing.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Connecting to PostgreSQL failed (as the outbox reports it: a pooler that refuses, a
    /// server that cannot be reached).
    #[error("{0}")]
    Outbox(#[source] outbox_persistence::Error),
}
