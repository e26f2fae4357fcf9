//! One run of the fault suite on one backend ([`Suite`]): its fresh database (or SQLite file)
//! and directory of logs, the binaries it drives, the seed, the chaos (`chaos.rs`), the last
//! drain, the verification and the report (`report.rs`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::chaos::Chaos;
use super::profile::{Backend, HEARTBEAT_MS, HELD_MS, Profile, STALE_AFTER_MS};
use super::reply_loss::ReplyLoss;
use super::skew::Skew;
use super::{Rng, unix_ms};
use crate::postgres;

/// The processes that go through the reply-loss proxy lose the reply of one COMMIT in this
/// many.
const COMMIT_REPLY_LOST_ONE_IN: u64 = 25;

/// The PostgreSQL side of a run: the run's database on the server under test.
pub(super) struct Server {
    /// The run's database.
    pub(super) name: String,
    /// The URL of the server's default database, for what runs outside the run's database
    /// (create, drop, cut connections, wait for the restart).
    pub(super) admin: String,
    /// The version of the machine's cluster, which `pg_ctlcluster` restarts.
    pub(super) version: String,
}

/// The release binaries a run drives.
pub(super) struct Binaries<'a> {
    /// `outbox`: `migrate`, and the suite's view of the queue (`status`, `events`).
    pub(super) outbox: &'a Path,
    /// `outbox-demo`: `seed`, `work` and `verify`.
    pub(super) demo: &'a Path,
}

/// One run of the suite on one backend.
pub(super) struct Suite<'a> {
    pub(super) backend: Backend,
    pub(super) profile: &'a Profile,
    pub(super) binaries: &'a Binaries<'a>,
    pub(super) skew: &'a Skew,
    /// Where each work process's stdout and stderr go (and any core file).
    pub(super) dir: PathBuf,
    /// The run's database, reached directly (the suite's own `psql` statements and cuts).
    pub(super) url: String,
    /// The URL the processes under test use: `url`, or through a transaction-pooling
    /// PgBouncer (`?outbox_pooler=transaction`) for the run `--pgbouncer` adds.
    pub(super) client_url: String,
    /// PostgreSQL only.
    pub(super) pg: Option<Server>,
    /// PostgreSQL only: the proxy that loses COMMIT replies, which every other chaos process
    /// goes through (see [`Suite::spawn_worker`]).
    pub(super) reply_loss: Option<ReplyLoss>,
}

/// The run's outcome.
pub(super) struct SuiteReport {
    pub(super) markdown: String,
    pub(super) passed: bool,
    /// The invariants that failed, each with what was measured: repeated in the suite's last
    /// line, which is what a CI log's tail keeps.
    pub(super) failed: Vec<String>,
}

impl<'a> Suite<'a> {
    /// A run on `backend`, keeping its logs in a new directory under `logs`.
    pub(super) fn new(
        backend: Backend,
        profile: &'a Profile,
        binaries: &'a Binaries<'a>,
        skew: &'a Skew,
        logs: &Path,
        pooler: Option<&str>,
    ) -> Result<Self> {
        let stamp = unix_ms();
        let through = if pooler.is_some() { "-pgbouncer" } else { "" };
        let dir = logs.join(format!(
            "{}{through}-{}-{stamp}",
            backend.name(),
            profile.name
        ));
        std::fs::create_dir_all(&dir)?;
        let (url, pg) = match backend {
            Backend::Postgres => {
                let admin = postgres::database_url();
                postgres::require(&admin, "the fault suite on PostgreSQL")?;
                let name = format!("outbox_faults_{stamp}");
                let url = postgres::with_database(&admin, &name);
                let version = cluster_version()?;
                let server = Server {
                    name,
                    admin,
                    version,
                };
                (url, Some(server))
            }
            Backend::Sqlite => (
                format!("sqlite://{}", dir.join("outbox.db").display()),
                None,
            ),
        };
        let client_url = match (pooler, &pg) {
            (Some(pooler), Some(server)) => postgres::with_parameter(
                &postgres::with_database(pooler, &server.name),
                "outbox_pooler",
                "transaction",
            ),
            _ => url.clone(),
        };
        let reply_loss = match pg {
            Some(_) => Some(ReplyLoss::start(
                &client_url,
                COMMIT_REPLY_LOST_ONE_IN,
                stamp as u64,
            )?),
            None => None,
        };
        Ok(Self {
            backend,
            profile,
            binaries,
            skew,
            dir,
            url,
            client_url,
            pg,
            reply_loss,
        })
    }

    /// Runs the suite, on PostgreSQL in a fresh database that is dropped after.
    pub(super) fn run(self, rng: &mut Rng) -> Result<SuiteReport> {
        match &self.pg {
            Some(server) => postgres::with_fresh_database(&server.admin, &server.name, |_| {
                self.run_in_database(rng)
            }),
            None => self.run_in_database(rng),
        }
    }

    /// Runs `outbox ARGS` against the run's database and returns its stdout.
    pub(super) fn outbox(&self, args: &[&str]) -> Result<String> {
        self.run_binary(self.binaries.outbox, "outbox", args)
    }

    /// Runs `outbox-demo ARGS` against the run's database and returns its stdout. Only
    /// `verify` may exit non-zero (its JSON says what failed).
    pub(super) fn demo(&self, args: &[&str]) -> Result<String> {
        self.run_binary(self.binaries.demo, "outbox-demo", args)
    }

    fn run_binary(&self, binary: &Path, name: &str, args: &[&str]) -> Result<String> {
        let run = || {
            Command::new(binary)
                .args(args)
                .current_dir(&self.dir)
                .env("DATABASE_URL", &self.client_url)
                .env("OUTBOX_LISTEN_URL", self.listen_url())
                .env("RUST_LOG", "error")
                .env_remove("OUTBOX_PULL_WORKER")
                .output()
                .with_context(|| format!("running {name} {}", args.join(" ")))
        };
        let mut output = run()?;
        // Behind PgBouncer, a server restart leaves the pooler refusing logins for a while
        // (`server_login_retry`) after the server is back: an operator's command says the
        // database is unavailable and is run again, as an operator would.
        let mut tries = 0;
        while self.pooled()
            && name == "outbox"
            && !output.status.success()
            && String::from_utf8_lossy(&output.stderr).contains("database unavailable")
            && tries < 60
        {
            tries += 1;
            std::thread::sleep(std::time::Duration::from_millis(500));
            output = run()?;
        }
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        if !output.status.success() && args.first() != Some(&"verify") {
            bail!(
                "`{name} {}` exited with {}: {}{}",
                args.join(" "),
                output.status,
                stdout,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(stdout)
    }

    fn run_in_database(&self, rng: &mut Rng) -> Result<SuiteReport> {
        let started = Instant::now();
        self.outbox(&["migrate"])?;
        self.seed()?;
        let mut chaos = Chaos::default();
        let run_started = Instant::now();
        self.chaos_loop(rng, &mut chaos)?;
        let drain_time = run_started.elapsed();
        // A last drain by one process, then the verification.
        let last = self.demo(&[
            "work",
            "--until-drained",
            "--json",
            "--pull-worker",
            "true",
            "--heartbeat-ms",
            &HEARTBEAT_MS.to_string(),
            "--stale-after-ms",
            &self.stale_after_ms().to_string(),
        ])?;
        if let Some(line) = last.lines().last()
            && let Ok(doc) = serde_json::from_str::<Value>(line)
        {
            chaos.process_reports.push(doc);
        }
        let verify_out = self.demo(&["verify", "--json"])?;
        let verification: Value = serde_json::from_str(&verify_out).with_context(|| {
            format!("`outbox-demo verify --json` printed no JSON: {verify_out}")
        })?;
        let processing = self.counts()?.processing as i64;
        Ok(self.report(
            &chaos,
            &verification,
            processing,
            drain_time,
            started.elapsed(),
        ))
    }

    /// Enqueues the profile's workload with `outbox-demo seed` and prints what it says.
    fn seed(&self) -> Result<()> {
        let p = self.profile;
        let (events, records, slow, slow_ms, poison) = (
            p.events.to_string(),
            p.records.to_string(),
            p.slow_events.to_string(),
            p.slow_ms.to_string(),
            p.poison_events.to_string(),
        );
        let (held, held_ms) = (p.held_sends.to_string(), HELD_MS.to_string());
        let said = self.demo(&[
            "seed",
            "--events",
            &events,
            "--records",
            &records,
            "--fault-rate",
            "0.05",
            "--slow-events",
            &slow,
            "--slow-ms",
            &slow_ms,
            "--held-sends",
            &held,
            "--held-ms",
            &held_ms,
            "--poison-events",
            &poison,
        ])?;
        print!("{said}");
        Ok(())
    }

    /// The direct URL for the processes' wake-up `LISTEN` behind the pooler (empty otherwise).
    pub(super) fn listen_url(&self) -> &str {
        if self.client_url == self.url {
            ""
        } else {
            &self.url
        }
    }

    /// Whether the processes under test go through PgBouncer.
    pub(super) fn pooled(&self) -> bool {
        self.client_url != self.url
    }

    /// Stale-after of the work processes (see [`STALE_AFTER_MS`]).
    pub(super) fn stale_after_ms(&self) -> u64 {
        STALE_AFTER_MS
    }

    /// Runs a statement on the side store (the demo's mail provider and journals: the same
    /// database on PostgreSQL, a sibling file on SQLite).
    pub(super) fn side_execute(&self, sql: &str) -> Result<()> {
        self.side_query(sql).map(|_| ())
    }

    /// Runs a query on the side store and returns its rows, one per line, columns separated
    /// by `|`.
    pub(super) fn side_query(&self, sql: &str) -> Result<String> {
        match self.backend {
            Backend::Postgres => postgres::psql(&self.url, sql),
            Backend::Sqlite => {
                let path = format!("{}-mailbox.db", self.url.trim_start_matches("sqlite://"));
                sqlite3(&path, sql)
            }
        }
    }
}

/// Runs one statement with `sqlite3` on the file at `path` and returns its output.
fn sqlite3(path: &str, sql: &str) -> Result<String> {
    let output = Command::new("sqlite3")
        .args(["-cmd", ".timeout 5000", "-separator", "|", path, sql])
        .output()
        .context("running sqlite3")?;
    if !output.status.success() {
        bail!(
            "sqlite3 failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The version of the machine's first PostgreSQL cluster (`pg_lsclusters -h`).
fn cluster_version() -> Result<String> {
    let output = Command::new("pg_lsclusters")
        .arg("-h")
        .output()
        .context("running pg_lsclusters")?;
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .map(str::to_string)
        .context("pg_lsclusters lists no cluster")
}
