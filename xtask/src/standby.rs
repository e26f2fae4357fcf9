//! A hot standby of the PostgreSQL server under test, for the console's and `outbox status`'s
//! reads from a replica (`cargo xtask test`): a second cluster made with `pg_basebackup -R`
//! from the server, in a temporary directory, started on a free port with `pg_ctl` as the
//! `postgres` user, stopped and removed when the guard is dropped.
//!
//! It needs what Debian's packages give (`/usr/lib/postgresql/VERSION/bin`, a `postgres` user,
//! `runuser`) and a replication entry for 127.0.0.1 in the server's `pg_hba.conf`, which
//! `.ci/run` adds (`host replication all 127.0.0.1/32 trust`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::pgbouncer::{free_port, is_root};
use crate::postgres::{self, Endpoint};

/// How long the standby gets to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running hot standby; stopped and removed on drop.
pub struct Standby {
    dir: PathBuf,
    bin: PathBuf,
    /// The server's URL with the standby's port.
    pub url: String,
}

impl Standby {
    /// Makes and starts a hot standby of the server `server_url` names.
    pub fn start(server_url: &str) -> Result<Self> {
        if !is_root() {
            bail!("the standby is made as the `postgres` user through runuser, which needs root");
        }
        let Endpoint { host, port } = postgres::endpoint(server_url).map_err(anyhow::Error::msg)?;
        let version = postgres::psql(server_url, "SHOW server_version_num")?;
        let major = version
            .trim()
            .parse::<u32>()
            .context("the server's version")?
            / 10_000;
        let bin = PathBuf::from(format!("/usr/lib/postgresql/{major}/bin"));
        if !bin.join("pg_basebackup").is_file() {
            bail!(
                "no pg_basebackup in {} (Debian's postgresql-{major})",
                bin.display()
            );
        }
        remove_stale(&bin);
        // A hot standby refuses to start with less of these than its primary.
        let mut settings = String::new();
        for name in [
            "max_connections",
            "max_worker_processes",
            "max_locks_per_transaction",
            "max_prepared_transactions",
            "max_wal_senders",
        ] {
            let value = postgres::psql(server_url, &format!("SHOW {name}"))?;
            settings.push_str(&format!("{name} = {}\n", value.trim()));
        }
        let listen = free_port()?;
        let dir = std::env::temp_dir().join(format!("outbox-standby-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let standby = Self {
            dir: dir.clone(),
            bin: bin.clone(),
            url: postgres::with_port(server_url, listen),
        };
        chown_postgres(&dir)?;
        as_postgres(&bin.join("pg_basebackup"))
            .args(["-h", &host, "-p", &port.to_string(), "-U", "postgres", "-R", "-X", "stream", "--checkpoint=fast"])
            .arg("-D")
            .arg(&dir)
            .run_quietly("pg_basebackup (the server's pg_hba.conf needs a replication entry for 127.0.0.1; .ci/run adds one)")?;
        std::fs::write(
            dir.join("postgresql.conf"),
            format!(
                "port = {listen}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nhot_standby = on\nshared_buffers = 32MB\n{settings}",
                dir.display()
            ),
        )?;
        std::fs::write(
            dir.join("pg_hba.conf"),
            "local all all trust\nhost all all 127.0.0.1/32 trust\n",
        )?;
        std::fs::write(dir.join("pg_ident.conf"), "")?;
        chown_postgres(&dir)?;
        as_postgres(&bin.join("pg_ctl"))
            .arg("-D")
            .arg(&dir)
            .arg("-l")
            .arg(dir.join("standby.log"))
            .args(["-w", "-t", &START_TIMEOUT.as_secs().to_string(), "start"])
            .run_quietly("pg_ctl start (the standby)")
            .map_err(|e| e.context(log_tail(&dir)))?;
        postgres::wait_ready(&standby.url, START_TIMEOUT).map_err(|e| e.context(log_tail(&dir)))?;
        println!("hot standby (pg_basebackup -R) at 127.0.0.1:{listen}");
        Ok(standby)
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        let _ = as_postgres(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(&self.dir)
            .args(["-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Gives `dir` to the `postgres` user, readable by it alone (the server refuses a data
/// directory others may read).
/// The end of the standby's log, for an error (the directory goes with the guard).
fn log_tail(dir: &Path) -> String {
    let log = std::fs::read_to_string(dir.join("standby.log")).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(10).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    format!("the standby's log ends:\n{}", tail.join("\n"))
}

/// Stops and removes standbys that earlier runs left (a run stopped by Ctrl-C skips the guard,
/// and `pg_ctl` detaches the server): each holds one of the primary's WAL senders.
fn remove_stale(bin: &Path) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    let mine = format!("outbox-standby-{}", std::process::id());
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // Only those whose run is gone (another run's standby is in use).
        let owner_alive = name
            .strip_prefix("outbox-standby-")
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if name.starts_with("outbox-standby-") && name != mine && !owner_alive {
            let _ = as_postgres(&bin.join("pg_ctl"))
                .arg("-D")
                .arg(entry.path())
                .args(["-m", "immediate", "stop"])
                .output();
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn chown_postgres(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    let status = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(dir)
        .status()?;
    if !status.success() {
        bail!("chown postgres {} failed", dir.display());
    }
    Ok(())
}

fn as_postgres(binary: &Path) -> Command {
    let mut command = Command::new("runuser");
    command.args(["-u", "postgres", "--"]).arg(binary);
    command
}

trait RunQuietly {
    fn run_quietly(&mut self, what: &str) -> Result<()>;
}

impl RunQuietly for Command {
    /// Runs the command; its output only in the error when it fails.
    fn run_quietly(&mut self, what: &str) -> Result<()> {
        let out = self.output().with_context(|| format!("starting {what}"))?;
        if !out.status.success() {
            bail!(
                "{what} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}
