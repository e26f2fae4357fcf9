//! How every transaction the outbox opens on PostgreSQL begins, and what a transaction-pooling
//! connection pooler changes.
//!
//! **Transactions.** The outbox never relies on a session's settings: the database's, the
//! role's or a pooler's defaults (`default_transaction_isolation`, `statement_timeout`,
//! `lock_timeout`, `idle_in_transaction_session_timeout`) are whatever a DBA chose. Every
//! transaction of its own (claims, attempts, heartbeats, bookkeeping, operator writes, reads,
//! the pruner, the heads repair, migrations) therefore begins with one simple-query message
//! that states them for that transaction only ([`begin_sql`]): `READ COMMITTED`, the outbox's
//! lock timeout and statement timeout, and for an attempt no idle-in-transaction timeout (its
//! claim is heartbeat-protected while the handler runs; see `docs/state-machine.md`,
//! "Isolation and timeouts"). `SET LOCAL` ends with the transaction, so the connection goes
//! back to the pool, or to the pooler, with the session untouched.
//!
//! **Transaction pooling.** Behind PgBouncer in `pool_mode = transaction` (and Supavisor, RDS
//! Proxy, pgcat) a client's consecutive transactions run on different server connections, and
//! between them the client owns none. Named prepared statements (sqlx caches each statement
//! under a name on the connection), session advisory locks, `LISTEN` and plain `SET` do not
//! survive from one transaction to the next. A statement sent outside a transaction block is
//! not safe either: sqlx parses it in one round trip and binds it in the next, and the pooler
//! may hand each to a different server. So when a database is declared behind such a pooler
//! ([`Pooler::Transaction`]) every outbox statement runs inside an explicit transaction (which
//! pins one server connection until `COMMIT`) as an unnamed statement, wake-ups use a direct
//! `LISTEN` URL or polling, and migrations take a transaction-scoped advisory lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

/// The statement timeout of the outbox's own transactions on PostgreSQL when none is
/// configured. Its statements are short by design (a claim, a fenced write, a batch of the
/// pruner, a page of the backfill); this bound only keeps a pathological plan from running
/// unbounded, whatever the database's default.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// What sits between the outbox and the PostgreSQL server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Pooler {
    /// The server itself, or a pooler that gives each client a session (`pool_mode =
    /// session`): named prepared statements and `LISTEN` on the pool work.
    #[default]
    Direct,
    /// A pooler that hands a server connection out for one transaction at a time (PgBouncer
    /// `pool_mode = transaction`, Supavisor's transaction mode, RDS Proxy, pgcat): no
    /// prepared statement is kept, wake-ups need a direct `LISTEN` URL or fall back to polling.
    Transaction,
}

impl Pooler {
    /// The URL query parameter that declares the pooler (`?outbox_pooler=transaction`); the
    /// outbox removes it before the URL reaches the driver.
    pub const URL_PARAMETER: &'static str = "outbox_pooler";

    /// Parses the parameter's value.
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "direct" | "session" | "none" => Some(Pooler::Direct),
            "transaction" => Some(Pooler::Transaction),
            _ => None,
        }
    }
}

/// What the outbox knows about a PostgreSQL pool beyond its connect options: set by
/// `Database::connect` and read by every repository built over the pool.
#[derive(Debug, Clone, Default)]
pub struct PgSettings {
    /// What sits between the outbox and the server.
    pub pooler: Pooler,
    /// A URL that reaches the server directly, for the wake-up `LISTEN` behind a transaction
    /// pooler. Without one, idle workers poll at their poll interval.
    pub listen_url: Option<String>,
    /// The statement timeout of the outbox's own transactions ([`DEFAULT_STATEMENT_TIMEOUT`]).
    pub statement_timeout: Option<Duration>,
}

impl PgSettings {
    /// Whether statements may be prepared under a name and cached on the connection.
    pub fn caches_statements(&self) -> bool {
        self.pooler == Pooler::Direct
    }

    /// The statement timeout of the outbox's transactions.
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout.unwrap_or(DEFAULT_STATEMENT_TIMEOUT)
    }
}

/// The settings of the pools this process connected, by the identity of their connect options
/// (a pool keeps one `Arc` of them for its life; the `Weak` kept here keeps the allocation, so
/// an address is never reused for another pool's). A pool holds no outbox data, and the
/// `Database::Postgres(PgPool)` variant stays as embedding services match on it. A pool whose
/// options are replaced (`PgPool::set_connect_options`, rotating credentials) gets a new
/// `Arc`: repositories built after that see the defaults, so register again with
/// [`crate::postgres::PgOutbox::with_settings`] (the statements stay unnamed meanwhile, through
/// the process-wide flag).
static REGISTRY: LazyLock<Registry> = LazyLock::new(Mutex::default);

/// Each pool's connect options (weakly: a dropped pool's entry goes) with its settings.
type Registry = Mutex<Vec<(Weak<PgConnectOptions>, PgSettings)>>;

/// Set once any pool of this process was declared behind a transaction pooler. Code that has
/// a connection but not its pool (an application's enqueue in its own transaction, the create
/// action inside a handler) then prepares no named statement: unnamed statements are correct
/// on a direct connection too, one round trip dearer.
static ANY_TRANSACTION_POOLER: AtomicBool = AtomicBool::new(false);

/// Records `settings` for `pool`.
pub(crate) fn register(pool: &PgPool, settings: PgSettings) {
    if settings.pooler == Pooler::Transaction {
        ANY_TRANSACTION_POOLER.store(true, Ordering::Relaxed);
    }
    let options = pool.connect_options();
    let mut registry = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    registry.retain(|(o, _)| o.strong_count() > 0 && !ptr_eq(o, &options));
    registry.push((Arc::downgrade(&options), settings));
}

fn ptr_eq(weak: &Weak<PgConnectOptions>, strong: &Arc<PgConnectOptions>) -> bool {
    std::ptr::eq(weak.as_ptr(), Arc::as_ptr(strong))
}

/// The settings `pool` was connected with (the defaults for a pool the outbox did not connect).
pub fn settings_of(pool: &PgPool) -> PgSettings {
    let options = pool.connect_options();
    let registry = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    registry
        .iter()
        .find(|(o, _)| ptr_eq(o, &options))
        .map(|(_, s)| s.clone())
        .unwrap_or_default()
}

/// Whether outbox code holding only a connection may prepare named statements: false once any
/// pool of this process is behind a transaction pooler. Pass it to sqlx's
/// `Query::persistent`.
pub fn caches_statements() -> bool {
    !ANY_TRANSACTION_POOLER.load(Ordering::Relaxed)
}

/// Whether statements on `pool` may be prepared under a name.
pub fn pool_caches_statements(pool: &PgPool) -> bool {
    caches_statements() && settings_of(pool).caches_statements()
}

/// What a transaction of the outbox states as it begins.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Begin {
    /// `READ ONLY` (reads; they then run on a hot standby too) or `READ WRITE`.
    pub(crate) read_only: bool,
    /// Its lock timeout.
    pub(crate) lock_timeout: Duration,
    /// Its statement timeout.
    pub(crate) statement_timeout: Duration,
    /// No idle-in-transaction timeout (an attempt, whose handler may run long).
    pub(crate) may_idle: bool,
    /// Commit without waiting for the WAL flush (`PgOutbox::with_async_claims`).
    pub(crate) async_commit: bool,
}

/// Milliseconds as PostgreSQL reads a timeout: zero (no timeout) stays zero, anything else is
/// at least one millisecond and at most `i32::MAX` (about 24.8 days; the server refuses more,
/// and a `SET LOCAL` that fails inside a begin string would leave the connection in a failed
/// transaction).
pub(crate) fn millis(d: Duration) -> u128 {
    if d.is_zero() {
        0
    } else {
        d.as_millis().clamp(1, i32::MAX as u128)
    }
}

/// The simple-query text that begins a transaction of the outbox: one round trip, and nothing
/// of it outlives the transaction. Every value is a number this code formats itself.
pub(crate) fn begin_sql(b: Begin) -> String {
    let mode = if b.read_only {
        "READ ONLY"
    } else {
        "READ WRITE"
    };
    let mut sql = format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED, {mode}; \
         SET LOCAL lock_timeout = '{}ms'; SET LOCAL statement_timeout = '{}ms'",
        millis(b.lock_timeout),
        millis(b.statement_timeout)
    );
    if b.read_only {
        // The operators' reads are short index reads; a misestimated plan over a big table
        // crosses `jit_above_cost` and spends ~0.5 s compiling what runs in milliseconds.
        sql.push_str("; SET LOCAL jit = off");
    }
    if b.may_idle {
        sql.push_str("; SET LOCAL idle_in_transaction_session_timeout = 0");
    }
    if b.async_commit {
        sql.push_str("; SET LOCAL synchronous_commit = off");
    }
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn begin_states_isolation_and_timeouts_for_the_transaction_only() {
        let sql = begin_sql(Begin {
            read_only: false,
            lock_timeout: Duration::from_millis(1500),
            statement_timeout: Duration::ZERO,
            may_idle: true,
            async_commit: false,
        });
        assert_eq!(
            sql,
            "BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE; SET LOCAL lock_timeout = '1500ms'; \
             SET LOCAL statement_timeout = '0ms'; SET LOCAL idle_in_transaction_session_timeout = 0"
        );
        assert!(
            !sql.contains("SET ")
                || sql.matches("SET ").count() == sql.matches("SET LOCAL").count()
        );
        let read = begin_sql(Begin {
            read_only: true,
            lock_timeout: Duration::from_micros(10),
            statement_timeout: Duration::from_secs(30),
            may_idle: false,
            async_commit: true,
        });
        assert!(read.contains("READ ONLY") && read.contains("'1ms'") && read.contains("'30000ms'"));
        assert!(read.ends_with("SET LOCAL synchronous_commit = off"));
        assert!(read.contains("SET LOCAL jit = off"), "{read}");
        assert!(
            !sql.contains("jit"),
            "the workers' transactions keep the server's setting"
        );
        assert!(!read.contains("idle_in_transaction"));
    }

    #[test]
    fn pooler_parameter_values() {
        assert_eq!(Pooler::parse("transaction"), Some(Pooler::Transaction));
        assert_eq!(Pooler::parse("session"), Some(Pooler::Direct));
        assert_eq!(Pooler::parse("statement"), None);
    }
}
