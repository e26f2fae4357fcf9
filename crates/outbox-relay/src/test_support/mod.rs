//! A `nats-server -js` of a test's own (feature `test-support`): a free port on 127.0.0.1 and a
//! temporary store directory, killed and removed on drop; [`NatsServer::restart`] stops it and
//! starts it again on the same port and store, as a server restart does.
//!
//! The server binary is `$NATS_SERVER`, or `nats-server` on `PATH` (Debian's package installs
//! `/usr/sbin/nats-server`).
//!
//! [`tls::TestCa`] makes a CA and a server certificate (with the `openssl` command) for a server
//! that requires TLS; [`creds::Operator`] makes operator, account and user keys and JWTs for a
//! server in operator mode (decentralised auth) and writes the user's `.creds` file.

pub mod creds;
pub mod tls;

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running test server.
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    config: Option<PathBuf>,
}

fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("NATS_SERVER") {
        return PathBuf::from(path);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|p| p.is_file())
    });
    on_path.unwrap_or_else(|| PathBuf::from("/usr/sbin/nats-server"))
}

/// The server's log (`server.log` in its directory, appended to across restarts).
fn log_file(dir: &std::path::Path) -> Stdio {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("server.log"))
        .map_or_else(|_| Stdio::null(), Stdio::from)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port")
        .port()
}

impl NatsServer {
    /// A JetStream server without authentication.
    pub fn start() -> Self {
        Self::launch(None)
    }

    /// A JetStream server with `config` (nats-server's configuration syntax, for example an
    /// `authorization { … }` block) added to its configuration file.
    pub fn start_with_config(config: &str) -> Self {
        Self::launch(Some(config))
    }

    fn launch(config: Option<&str>) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-nats-{}-{}",
            std::process::id(),
            chrono::Utc::now().timestamp_nanos_opt().unwrap_or_default()
        ));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        let config = config.map(|text| {
            let path = dir.join("server.conf");
            std::fs::write(&path, text).expect("write the server's configuration");
            path
        });
        let mut server = Self {
            child: None,
            port: free_port(),
            dir,
            config,
        };
        server.run();
        server
    }

    fn run(&mut self) {
        let mut command = Command::new(binary());
        command
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("-sd")
            .arg(self.dir.join("store"))
            .stdout(Stdio::null())
            .stderr(log_file(&self.dir));
        if let Some(config) = &self.config {
            command.arg("-c").arg(config);
        }
        let child = command.spawn().unwrap_or_else(|e| {
            panic!(
                "cannot start {} ({e}): install nats-server (apt-get install nats-server) or set NATS_SERVER",
                binary().display()
            )
        });
        self.child = Some(child);
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "nats-server did not listen on port {} within 10 s; its log:\n{}",
                self.port,
                std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's own directory (removed on drop): a place for its certificates and
    /// credentials.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Stops the server (SIGKILL: nothing it has acked is lost from a file-backed stream, which
    /// the server wrote before acking).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().ok();
            child.wait().ok();
        }
    }

    /// Stops the server and starts it again on the same port and store.
    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }

    /// Starts a stopped server again.
    pub fn start_again(&mut self) {
        if self.child.is_none() {
            self.run();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}
