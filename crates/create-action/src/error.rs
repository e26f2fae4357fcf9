//! The error type of this crate.

use crate::registry::ColumnType;

/// Everything that can go wrong while defining or running an action.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A table, column or key name is not a safe SQL identifier; it was never sent to the
    /// database.
    #[error("invalid identifier {name:?}: {reason}")]
    InvalidIdentifier {
        /// The refused name, as given.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// An object of this name (compared without case) is already registered.
    #[error("object {0} is already registered")]
    DuplicateObject(String),
    /// No object of this name is registered.
    #[error("unknown object {0}")]
    UnknownObject(String),
    /// An object definition names the same column twice (compared without case).
    #[error("object {object} declares column {column} twice")]
    DuplicateColumn {
        /// The object.
        object: String,
        /// The repeated column.
        column: String,
    },
    /// An object definition declares more than one autonumber field.
    #[error("object {0} declares more than one autonumber field")]
    SecondAutonumber(String),
    /// An action names a column its object does not register.
    #[error("object {object} has no registered column {column}")]
    UnknownColumn {
        /// The object.
        object: String,
        /// The unknown column.
        column: String,
    },
    /// An action tries to write a column that it may not write (a natural-key column, the
    /// autonumber field or a read-only column).
    #[error("column {column} of {object} is a {role} column and cannot be written by {action}")]
    NotWritable {
        /// The object.
        object: String,
        /// The column.
        column: String,
        /// The column's role (`natural-key`, `autonumber`, `read-only`).
        role: &'static str,
        /// The action that tried (`find-or-create`, `a field set`).
        action: &'static str,
    },
    /// A find-or-create was requested on an object without a natural key.
    #[error("object {0} has no natural key, so it cannot be found or created idempotently")]
    NoNaturalKey(String),
    /// A find-or-create does not give a value for every natural-key column.
    #[error("find-or-create on {object} gives no value for natural-key column {column}")]
    MissingKey {
        /// The object.
        object: String,
        /// The natural-key column without a value.
        column: String,
    },
    /// A field set names no target column, so it would update every row.
    #[error("field set on {0} has no target: it would update every row")]
    NoTarget(String),
    /// A field set assigns nothing.
    #[error("field set on {0} assigns no field")]
    EmptyFieldSet(String),
    /// The same column is given twice in one action.
    #[error("column {column} of {object} is given twice")]
    RepeatedColumn {
        /// The object.
        object: String,
        /// The repeated column.
        column: String,
    },
    /// A natural-key or target value is null: null never matches, so the row could not be
    /// found again.
    #[error("key column {column} of {object} is null")]
    NullKey {
        /// The object.
        object: String,
        /// The column whose value is null.
        column: String,
    },
    /// A value does not fit its column's registered type.
    #[error("column {column} is {expected}, but the value is {found}")]
    TypeMismatch {
        /// The column.
        column: String,
        /// The column's registered type.
        expected: ColumnType,
        /// What the value is (`a string`, `a fractional number`, …).
        found: &'static str,
    },
    /// A right-hand side cannot write a column of this type (for example `Append` on a number).
    #[error("{rhs} cannot write column {column} of type {ty}")]
    UnsupportedRhs {
        /// The column.
        column: String,
        /// The right-hand side kind.
        rhs: &'static str,
        /// The column's registered type.
        ty: ColumnType,
    },
    /// The event snapshot lacks a field an action reads.
    #[error("the event snapshot has no field {0}")]
    MissingSnapshotField(String),
    /// An action reads the event's `record_id`, but the event is about no record.
    #[error("the event has no record_id")]
    MissingRecordId,
    /// An event payload is not a valid envelope.
    #[error("invalid event payload: {0}")]
    InvalidPayload(#[source] record_key::RecordKeyError),
    /// The natural-key insert conflicted but the winning row could not be read back, several
    /// times in a row (it was deleted as fast as it was created): retry later.
    #[error("the natural-key insert into {0} conflicted but no row could be read back")]
    ConflictWithoutRow(String),
    /// A row could not be decoded.
    #[error("could not decode column {column}: {reason}")]
    Decode {
        /// The column.
        column: String,
        /// What was wrong.
        reason: String,
    },
    /// Any database error, including a unique violation on a constraint other than the
    /// natural key.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Database(e)
    }
}

impl Error {
    /// Whether this is a unique violation (sqlx's portable `ErrorKind::UniqueViolation`).
    pub fn is_unique_violation(&self) -> bool {
        matches!(self, Error::Database(sqlx::Error::Database(e))
            if e.kind() == sqlx::error::ErrorKind::UniqueViolation)
    }

    /// Whether the action may succeed if the attempt is retried later: a lock timeout, a
    /// deadlock or serialization failure, SQLite busy, an unavailable database or lost
    /// connection (classified by the workspace's one classifier,
    /// [`outbox_persistence::classify_error`]), or a conflict whose winner vanished.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::ConflictWithoutRow(_) => true,
            Error::Database(e) => outbox_persistence::classify_error(e).is_transient(),
            _ => false,
        }
    }

    /// Whether this is a lock wait that ran into the lock timeout (or SQLite busy). A deadlock
    /// or serialization failure is a conflict ([`outbox_persistence::ErrorClass::Conflict`]),
    /// transient too.
    pub fn is_lock_timeout(&self) -> bool {
        matches!(self, Error::Database(e)
            if outbox_persistence::classify_error(e) == outbox_persistence::ErrorClass::LockTimeout)
    }
}
