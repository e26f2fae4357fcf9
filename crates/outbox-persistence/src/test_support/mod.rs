//! Test support (feature `test-support`, off by default): what the demo's verification, the
//! benchmark and the fault suite need to read or shape in the outbox table, so that no crate
//! outside this one writes SQL against `_System_OutboxEvent`.
//!
//! Nothing here is for production code: these functions bypass the state machine (they seed
//! shaped backlogs, mark rows processed without an attempt, install audit triggers) to measure
//! and verify it. A service that embeds the outbox never needs this feature.

pub mod bench;
pub mod foreign;
pub mod inspect;
pub mod retention;

/// `url` (a PostgreSQL URL) with its database name replaced by `name`, keeping the user, host,
/// port and query parameters: how the harnesses address a fresh database per test or run.
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{}", &base[..path_start], name);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// A READ COMMITTED transaction on `pool` for the test support's own statements: behind a
/// transaction pooler a statement must run inside one. Reads drop it (rolled back); writes
/// commit it.
pub(crate) async fn read(
    pool: &sqlx::PgPool,
) -> crate::Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    Ok(pool
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?)
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn with_database_replaces_only_the_name() {
        assert_eq!(
            with_database("postgres://root@127.0.0.1:5432/test", "b"),
            "postgres://root@127.0.0.1:5432/b"
        );
        assert_eq!(
            with_database("postgres://u:p@h/x?sslmode=disable", "b"),
            "postgres://u:p@h/b?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "b"), "postgres://h/b");
    }
}
