//! The persistence error type, classified so that a worker can tell what to do.

use record_key::RecordKeyError;

/// An error from the outbox repository.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A lock wait exceeded the lock timeout (PostgreSQL `lock_timeout`, SQLite busy or
    /// locked): retry later.
    #[error("lock timeout: {0}")]
    LockTimeout(#[source] sqlx::Error),
    /// The server aborted the transaction to resolve a conflict with another one: a
    /// serialization failure (SQLSTATE 40001) or a deadlock (40P01). Retry the transaction.
    #[error("transaction conflict: {0}")]
    Conflict(#[source] sqlx::Error),
    /// The database could not be reached, or the connection was lost mid-operation: retry later.
    #[error("database unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// The database URL is not one this binary understands.
    #[error("invalid database url: {0}")]
    InvalidUrl(String),
    /// The schema lacks outbox migrations this code needs: apply them with
    /// [`crate::Database::migrate`] (the CLI's `outbox migrate`).
    #[error(
        "the outbox schema is not migrated: missing migration(s) {missing:?}; apply them with Database::migrate (outbox migrate)"
    )]
    NotMigrated {
        /// Versions this binary knows that the database has not applied.
        missing: Vec<i64>,
    },
    /// The database has migrations this binary does not know: it is older than the schema.
    #[error("schema is newer than this binary: unknown migration(s) {unknown:?}")]
    SchemaTooNew {
        /// Versions applied in the database that this binary does not know.
        unknown: Vec<i64>,
    },
    /// The server, or what stands in front of it, cannot run the outbox as configured (a
    /// read-only standby, a release older than the supported one, a pooler in statement
    /// mode, a transaction pooler not declared): the message says what to change.
    #[error("{0}")]
    Unsupported(String),
    /// A value given to the repository that it refuses (an endpoint's name), or a stored
    /// value it cannot read: the message says which.
    #[error("invalid: {0}")]
    Invalid(String),
    /// Running migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// An event payload is not a valid envelope; enqueue refuses it.
    #[error("invalid event payload: {0}")]
    InvalidPayload(#[source] RecordKeyError),
    /// A transaction of one backend was handed to a repository of the other.
    #[error("backend mismatch: a {given} transaction was given to a {expected} repository")]
    BackendMismatch {
        /// The repository's backend.
        expected: &'static str,
        /// The transaction's backend.
        given: &'static str,
    },
    /// The attempt transaction was already finished (committed or rolled back).
    #[error("the attempt transaction is already finished")]
    AttemptFinished,
    /// Any other database error.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
}

impl Error {
    /// Whether the operation may succeed if tried again later (a lock timeout, a serialization
    /// failure or deadlock, an unavailable database), as opposed to an error that repeats.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::LockTimeout(_) | Error::Conflict(_) | Error::Unavailable(_)
        )
    }

    /// Whether the server aborted the transaction for a serialization failure or a deadlock.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Conflict(_))
    }

    /// Whether this is a lock timeout.
    pub fn is_lock_timeout(&self) -> bool {
        matches!(self, Error::LockTimeout(_))
    }

    /// The error and its causes as one line, for logs and `LastError`. `Display` already
    /// names the direct cause; deeper causes are added unless their text is already there.
    pub fn chain(&self) -> String {
        let mut out = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            let text = s.to_string();
            if !out.contains(&text) {
                out.push_str(": ");
                out.push_str(&text);
            }
            source = s.source();
        }
        out
    }
}

/// How a database error should be treated: the one classifier of the workspace (the create
/// action uses it too, through [`classify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorClass {
    /// A lock wait ran into the lock timeout, SQLite busy or locked: retry later.
    LockTimeout,
    /// A serialization failure (40001) or a deadlock (40P01): the server aborted the
    /// transaction; retry it.
    Conflict,
    /// The database could not be reached or the connection was lost: retry later.
    Unavailable,
    /// Anything else: it repeats if retried as it is.
    Other,
}

impl ErrorClass {
    /// Whether an operation that failed this way may succeed if tried again later.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            ErrorClass::LockTimeout | ErrorClass::Conflict | ErrorClass::Unavailable
        )
    }
}

/// Classifies a sqlx error by its backend's error code (PostgreSQL SQLSTATE or SQLite result
/// code) or its kind.
pub fn classify(e: &sqlx::Error) -> ErrorClass {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            let sqlite = db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some();
            let lock = if sqlite {
                is_sqlite_lock_code(&code)
            } else {
                is_postgres_lock_code(&code)
            };
            if lock {
                ErrorClass::LockTimeout
            } else if !sqlite && is_postgres_conflict_code(&code) {
                ErrorClass::Conflict
            } else if !sqlite && is_unavailable_code(&code) {
                ErrorClass::Unavailable
            } else {
                ErrorClass::Other
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => ErrorClass::Unavailable,
        _ => ErrorClass::Other,
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        if let Some(message) = pooler_refusal(&e) {
            return Error::Unsupported(message);
        }
        match classify(&e) {
            ErrorClass::LockTimeout => Error::LockTimeout(e),
            ErrorClass::Conflict => Error::Conflict(e),
            ErrorClass::Unavailable => Error::Unavailable(e),
            ErrorClass::Other => Error::Database(e),
        }
    }
}

impl From<sqlx::migrate::MigrateError> for Error {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        Error::Migrate(e)
    }
}

/// What a pooler in front of the server answered, when the answer says the outbox is
/// configured for another kind of pooler: a transaction pooler that was not declared (a named
/// prepared statement missing or already there on the server connection it was handed) or a
/// pooler in statement mode (no transaction blocks).
fn pooler_refusal(e: &sqlx::Error) -> Option<String> {
    let sqlx::Error::Database(db) = e else {
        return None;
    };
    let message = db.message();
    let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
    if matches!(code.as_str(), "42P05" | "26000") && message.contains("sqlx_s_") {
        return Some(format!(
            "{message}: a transaction-pooling connection pooler (PgBouncer pool_mode = transaction, Supavisor, RDS Proxy, pgcat) seems to stand in front of the server; declare it with `outbox_pooler=transaction` in the database URL (ConnectConfig::pooler = Pooler::Transaction), or connect to the server directly"
        ));
    }
    if message.contains("statement pooling mode") {
        return Some(format!(
            "{message}: the connection pooler runs in statement mode, which allows no transaction; the outbox needs transactions: use a pool in transaction mode (with `outbox_pooler=transaction`) or session mode, or the server directly"
        ));
    }
    None
}

/// PostgreSQL lock_not_available.
fn is_postgres_lock_code(code: &str) -> bool {
    code == "55P03"
}

/// PostgreSQL serialization_failure and deadlock_detected.
fn is_postgres_conflict_code(code: &str) -> bool {
    matches!(code, "40001" | "40P01")
}

/// SQLite BUSY and LOCKED, with their extended codes (the primary code is the low byte). Only
/// for SQLite errors: an all-digit SQLSTATE such as PostgreSQL's 22021 would match too.
fn is_sqlite_lock_code(code: &str) -> bool {
    code.parse::<i32>().is_ok_and(|c| matches!(c & 0xff, 5 | 6))
}

/// PostgreSQL connection exceptions (class 08) and operator intervention (class 57: shutdown,
/// terminated backends, cannot connect now), but not a canceled statement (57014).
fn is_unavailable_code(code: &str) -> bool {
    code.starts_with("08") || (code.starts_with("57") && code != "57014")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PostgreSQL error as a pooler relays it.
    #[derive(Debug)]
    struct Relayed {
        code: &'static str,
        message: &'static str,
    }

    impl std::fmt::Display for Relayed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.message)
        }
    }

    impl std::error::Error for Relayed {}

    impl sqlx::error::DatabaseError for Relayed {
        fn message(&self) -> &str {
            self.message
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.code.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn relayed(code: &'static str, message: &'static str) -> Error {
        sqlx::Error::Database(Box::new(Relayed { code, message })).into()
    }

    #[test]
    fn pooler_answers_name_the_setting() {
        let undeclared = relayed("42P05", r#"prepared statement "sqlx_s_1" already exists"#);
        assert!(
            matches!(undeclared, Error::Unsupported(_))
                && undeclared.to_string().contains("outbox_pooler=transaction"),
            "{undeclared}"
        );
        let missing = relayed("26000", r#"prepared statement "sqlx_s_7" does not exist"#);
        assert!(
            missing.to_string().contains("outbox_pooler=transaction"),
            "{missing}"
        );
        let statement_mode = relayed(
            "08P01",
            "transaction blocks not allowed in statement pooling mode",
        );
        assert!(
            statement_mode.to_string().contains("statement mode"),
            "{statement_mode}"
        );
        // An application's own statement of that name is not the pooler's doing.
        let other = relayed("42P05", r#"prepared statement "mine" already exists"#);
        assert!(matches!(other, Error::Database(_)), "{other}");
        let conflict = relayed("40001", "could not serialize access");
        assert!(conflict.is_conflict() && conflict.is_transient() && !conflict.is_lock_timeout());
    }

    #[test]
    fn codes_are_classified() {
        assert!(is_postgres_lock_code("55P03"));
        assert!(!is_postgres_lock_code("40P01") && !is_postgres_lock_code("40001"));
        assert!(is_postgres_conflict_code("40P01") && is_postgres_conflict_code("40001"));
        assert!(!is_postgres_conflict_code("55P03"));
        assert!(
            !is_postgres_lock_code("22021"),
            "an all-digit SQLSTATE is not SQLite's BUSY"
        );
        assert!(!is_postgres_lock_code("23505"));
        assert!(is_sqlite_lock_code("5"));
        assert!(is_sqlite_lock_code("517"));
        assert!(is_sqlite_lock_code("6"));
        assert!(!is_sqlite_lock_code("19"));
        assert!(!is_unavailable_code("57014"));
        assert!(is_unavailable_code("57P01"));
        assert!(is_unavailable_code("08006"));
        assert!(!is_unavailable_code("23505"));
        // Not transient: permission denied, an untranslatable character (all digits, but a
        // PostgreSQL SQLSTATE, never SQLite's BUSY).
        assert!(!is_unavailable_code("42501") && !is_postgres_lock_code("42501"));
        assert!(!is_unavailable_code("22021") && !is_postgres_lock_code("22021"));
        assert!(is_unavailable_code("57P03"), "cannot connect now");
    }
}
