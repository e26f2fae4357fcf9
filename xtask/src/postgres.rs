//! The PostgreSQL server xtask's runs use: finding it, checking that it accepts connections,
//! naming a database on it ([`with_database`]), running a statement with `psql` ([`psql`]), and
//! running something on a fresh database that is dropped after ([`with_fresh_database`]).

use std::io::ErrorKind;
use std::net::{TcpStream, ToSocketAddrs};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::cmd::format_duration;

/// The PostgreSQL server tests use when `DATABASE_URL` is not set; the same as the test harness's
/// `outbox_tests::DEFAULT_POSTGRES_URL`.
pub const DEFAULT_DATABASE_URL: &str = "postgres://root@127.0.0.1:5432/test";

/// The port PostgreSQL listens on when a URL names none.
const DEFAULT_PORT: u16 = 5432;

/// How long the TCP fallback waits for each address to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The PostgreSQL URL under test: `DATABASE_URL` when it names a PostgreSQL server, else
/// [`DEFAULT_DATABASE_URL`]. The test harness reads it the same way.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|url| url.starts_with("postgres"))
        .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_string())
}

/// The host and port of a PostgreSQL server.
#[derive(Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// A host name or IP address (without brackets for IPv6).
    pub host: String,
    /// The TCP port.
    pub port: u16,
}

/// The host and port named by a `postgres://` or `postgresql://` URL. A URL without a host means
/// `localhost`, one without a port means 5432; of several hosts, the first is used.
pub fn endpoint(url: &str) -> Result<Endpoint, String> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .ok_or_else(|| format!("`{url}` is not a postgres:// URL"))?;
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
    let first = hosts.split(',').next().unwrap_or_default();
    let (host, port) = if let Some(bracketed) = first.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| format!("unclosed `[` in the host of `{url}`"))?;
        (host, after.strip_prefix(':'))
    } else {
        match first.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (first, None),
        }
    };
    let port = match port {
        None | Some("") => DEFAULT_PORT,
        Some(port) => port
            .parse()
            .map_err(|_| format!("`{port}` is not a port number in `{url}`"))?,
    };
    let host = if host.is_empty() { "localhost" } else { host };
    Ok(Endpoint {
        host: host.to_string(),
        port,
    })
}

/// `url` with its password, if any, replaced by `***`, for printing.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{hosts}{tail}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// Checks that the server at `url` accepts connections: with `pg_isready -h HOST -p PORT` when
/// that program is installed, else with a TCP connect. The error says why it is unreachable.
pub fn check_reachable(url: &str) -> Result<(), String> {
    let Endpoint { host, port } = endpoint(url)?;
    let pg_isready = Command::new("pg_isready")
        .args(["-h", &host, "-p", &port.to_string()])
        .output();
    match pg_isready {
        Ok(output) if output.status.success() => Ok(()),
        Ok(output) => {
            let said = String::from_utf8_lossy(&output.stdout);
            let said = said.trim();
            let said = if said.is_empty() { "no output" } else { said };
            Err(format!("pg_isready: {said} ({})", output.status))
        }
        Err(error) if error.kind() == ErrorKind::NotFound => tcp_connect(&host, port),
        Err(error) => Err(format!("could not run pg_isready: {error}")),
    }
}

/// Whether some address of `host:port` accepts a TCP connection.
fn tcp_connect(host: &str, port: u16) -> Result<(), String> {
    let addresses = (host, port)
        .to_socket_addrs()
        .map_err(|error| format!("cannot resolve {host}:{port}: {error}"))?;
    let mut last_error = format!("{host}:{port} resolves to no address");
    for address in addresses {
        match TcpStream::connect_timeout(&address, CONNECT_TIMEOUT) {
            Ok(_) => return Ok(()),
            Err(error) => last_error = format!("TCP connect to {address}: {error}"),
        }
    }
    Err(last_error)
}

/// The user a `postgres://` URL names (`postgres` when it names none).
pub fn user(url: &str) -> String {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .unwrap_or(url);
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    match authority.rsplit_once('@') {
        Some((userinfo, _)) => userinfo.split(':').next().unwrap_or("postgres").to_string(),
        None => "postgres".to_string(),
    }
}

/// `url` with `user` (no password) in place of the user and password it names.
pub fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    format!("{scheme}://{user}@{hosts}{tail}")
}

/// `url` pointed at 127.0.0.1:`port` instead of its host and port (user, database and
/// parameters kept).
pub fn with_port(url: &str, port: u16) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let userinfo = authority
        .rsplit_once('@')
        .map_or(String::new(), |(u, _)| format!("{u}@"));
    format!("{scheme}://{userinfo}127.0.0.1:{port}{tail}")
}

/// `url` with its database name replaced by `name`; the query string (`?sslmode=…`) is kept.
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(base, query)| (base, Some(query)));
    let start = base.find("://").map_or(0, |i| i + 3);
    let end = base[start..].find('/').map_or(base.len(), |i| start + i);
    match query {
        Some(query) => format!("{}/{name}?{query}", &base[..end]),
        None => format!("{}/{name}", &base[..end]),
    }
}

/// `url` with one more query parameter `key=value` (after `?` or `&`, whichever fits).
pub fn with_parameter(url: &str, key: &str, value: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{key}={value}")
}

/// The `psql` command that runs `sql` against `url`: no `~/.psqlrc`, quiet, unaligned tuples
/// only with `|` between fields, stopping at the first error. Spawn it to run it in the
/// background (the fault suite's lock holds); [`psql`] runs it and returns its output.
pub fn psql_command(url: &str, sql: &str) -> Command {
    let mut command = Command::new("psql");
    command.args([
        "-X",
        "-q",
        "-At",
        "-F",
        "|",
        "-v",
        "ON_ERROR_STOP=1",
        "-d",
        url,
        "-c",
        sql,
    ]);
    command
}

/// Runs `sql` with `psql` against `url` and returns its output: one line per row, fields
/// separated by `|`.
pub fn psql(url: &str, sql: &str) -> Result<String> {
    let output = psql_command(url, sql)
        .output()
        .context("could not start psql")?;
    if !output.status.success() {
        bail!(
            "psql failed on `{sql}`: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Creates the database `name` on the server of `admin` (dropping a leftover of that name
/// first), runs `body` with its URL, and drops it again (`WITH (FORCE)`, after waiting up to
/// 30 s for the server, which `body` may have restarted), whatever `body` returned. A failed
/// drop is printed, not returned: `body`'s result is the one that matters.
pub fn with_fresh_database<T>(
    admin: &str,
    name: &str,
    body: impl FnOnce(&str) -> Result<T>,
) -> Result<T> {
    psql(admin, &format!("DROP DATABASE IF EXISTS {name}"))?;
    psql(admin, &format!("CREATE DATABASE {name}"))?;
    let result = body(&with_database(admin, name));
    let dropped = wait_ready(admin, Duration::from_secs(30)).and_then(|()| {
        psql(
            admin,
            &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        )
    });
    if let Err(error) = dropped {
        eprintln!("could not drop database {name}: {error:#}");
    }
    result
}

/// Waits until the server of `url` accepts connections, checking every 100 ms for up to
/// `limit`.
pub fn wait_ready(url: &str, limit: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        match check_reachable(url) {
            Ok(()) => return Ok(()),
            Err(why) if start.elapsed() > limit => {
                bail!(
                    "PostgreSQL not ready after {}: {why}",
                    format_duration(limit)
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Fails, saying why, when the server of `url` is unreachable; `needed_by` names what needs it.
pub fn require(url: &str, needed_by: &str) -> Result<()> {
    check_reachable(url).map_err(|why| {
        anyhow::anyhow!(
            "{needed_by} needs PostgreSQL, but {} is unreachable: {why}",
            redacted(url)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_and_port_of_a_url() {
        assert_eq!(user("postgres://root@127.0.0.1:5432/test"), "root");
        assert_eq!(user("postgres://u:pw@h/db"), "u");
        assert_eq!(user("postgres://h/db"), "postgres");
        assert_eq!(
            as_user("postgres://u:pw@h:1/db?x=1", "w"),
            "postgres://w@h:1/db?x=1"
        );
        assert_eq!(as_user("postgres://h/db", "w"), "postgres://w@h/db");
        assert_eq!(
            with_port("postgres://root@127.0.0.1:5432/test?x=1", 6432),
            "postgres://root@127.0.0.1:6432/test?x=1"
        );
    }

    fn endpoint_of(url: &str) -> (String, u16) {
        let Endpoint { host, port } = endpoint(url).unwrap();
        (host, port)
    }

    #[test]
    fn endpoint_reads_host_and_port_from_the_url() {
        assert_eq!(
            endpoint_of(DEFAULT_DATABASE_URL),
            ("127.0.0.1".into(), 5432)
        );
        assert_eq!(
            endpoint_of("postgresql://u:p%40ss@db.internal:6543/app?sslmode=disable"),
            ("db.internal".into(), 6543)
        );
        assert_eq!(endpoint_of("postgres://[::1]:5433/x"), ("::1".into(), 5433));
        assert_eq!(endpoint_of("postgres://[::1]/x"), ("::1".into(), 5432));
        assert_eq!(
            endpoint_of("postgres://h1:5001,h2:5002/x"),
            ("h1".into(), 5001)
        );
        assert_eq!(endpoint_of("postgres:///test"), ("localhost".into(), 5432));
        assert_eq!(
            endpoint_of("postgres://root@localhost"),
            ("localhost".into(), 5432)
        );
    }

    #[test]
    fn endpoint_refuses_what_is_not_a_postgres_url() {
        assert!(endpoint("sqlite://outbox.db").is_err());
        assert!(endpoint("postgres://host:port/db").is_err());
        assert!(endpoint("postgres://[::1/db").is_err());
    }

    #[test]
    fn tcp_connect_tells_a_listening_port_from_a_closed_one() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_eq!(tcp_connect("127.0.0.1", port), Ok(()));
        drop(listener);
        let error = tcp_connect("127.0.0.1", port).unwrap_err();
        assert!(error.starts_with("TCP connect to 127.0.0.1:"), "{error}");
    }

    #[test]
    fn database_name_is_replaced_and_the_query_kept() {
        assert_eq!(
            with_database("postgres://root@h:5432/test", "x"),
            "postgres://root@h:5432/x"
        );
        assert_eq!(
            with_database("postgres://h/test?sslmode=disable", "x"),
            "postgres://h/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
        assert_eq!(
            with_database("postgres://root@127.0.0.1:5432/test?sslmode=disable", "x"),
            "postgres://root@127.0.0.1:5432/x?sslmode=disable"
        );
    }

    #[test]
    fn a_parameter_is_appended_after_the_right_separator() {
        assert_eq!(
            with_parameter("postgres://h/x", "application_name", "w-1"),
            "postgres://h/x?application_name=w-1"
        );
        assert_eq!(
            with_parameter("postgres://h/x?sslmode=disable", "application_name", "w-1"),
            "postgres://h/x?sslmode=disable&application_name=w-1"
        );
    }

    #[test]
    fn redacted_hides_only_the_password() {
        assert_eq!(
            redacted("postgres://app:secret@db:5432/x?sslmode=require"),
            "postgres://app:***@db:5432/x?sslmode=require"
        );
        assert_eq!(redacted(DEFAULT_DATABASE_URL), DEFAULT_DATABASE_URL);
    }
}
