//! A PgBouncer in `pool_mode = transaction` in front of the PostgreSQL server under test, for
//! the runs that must pass through one (`cargo xtask test`, `demo`, `faults`): started from
//! Debian's `pgbouncer` package with a configuration of its own in a temporary directory,
//! stopped when the guard is dropped.
//!
//! Every database is reachable through it in transaction mode; `outbox_statement_mode` is the
//! server's `test` database in statement mode, for the test that `outbox migrate` refuses such
//! a pooler.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::postgres::{self, Endpoint};

/// How long PgBouncer gets to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// A running PgBouncer; stopped on drop.
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    /// `postgres://USER@127.0.0.1:PORT/DATABASE` of the server URL, through the pooler.
    pub url: String,
}

impl PgBouncer {
    /// Starts PgBouncer in front of the server `server_url` names, on a free port.
    pub fn start(server_url: &str) -> Result<Self> {
        let Endpoint { host, port } = postgres::endpoint(server_url).map_err(anyhow::Error::msg)?;
        let binary = which("pgbouncer").context(
            "pgbouncer is not installed (Debian's package: apt-get install pgbouncer; .ci/run installs it)",
        )?;
        let listen = free_port()?;
        let dir = std::env::temp_dir().join(format!("outbox-pgbouncer-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let user = postgres::user(server_url);
        std::fs::write(
            dir.join("users.txt"),
            format!("\"{user}\" \"\"\n\"postgres\" \"\"\n"),
        )?;
        std::fs::write(
            dir.join("pgbouncer.ini"),
            format!(
                "[databases]
outbox_statement_mode = host={host} port={port} dbname=test pool_mode=statement
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen}
unix_socket_dir =
auth_type = trust
auth_file = {users}
pool_mode = transaction
max_client_conn = 2000
default_pool_size = 20
ignore_startup_parameters = extra_float_digits
server_reset_query =
server_login_retry = 1
logfile = {log}
",
                users = dir.join("users.txt").display(),
                log = dir.join("pgbouncer.log").display(),
            ),
        )?;
        let mut command = Command::new(binary);
        // PgBouncer refuses to run as root; `-u` drops to the server's usual user.
        if is_root() {
            let _ = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&dir)
                .status();
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(dir.join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("stderr.txt"))?)
            .spawn()
            .context("starting pgbouncer")?;
        let url = postgres::with_port(server_url, listen);
        let mut bouncer = Self { child, dir, url };
        let started = Instant::now();
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", listen)).is_ok() {
                break;
            }
            if let Some(status) = bouncer.child.try_wait()? {
                let log = ["stderr.txt", "pgbouncer.log"]
                    .iter()
                    .filter_map(|f| std::fs::read_to_string(bouncer.dir.join(f)).ok())
                    .collect::<Vec<_>>()
                    .join("\n");
                bail!("pgbouncer exited ({status}) before accepting connections:\n{log}");
            }
            if started.elapsed() > START_TIMEOUT {
                bail!(
                    "pgbouncer did not accept connections on port {listen} within {START_TIMEOUT:?}"
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("pgbouncer (transaction pooling) at 127.0.0.1:{listen}");
        bouncer.url = postgres::with_port(server_url, listen);
        Ok(bouncer)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

pub(crate) fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
