//! A certificate authority of a test's own and a server certificate it signed for
//! `127.0.0.1`/`localhost`, made with the `openssl` command in a temporary directory (removed on
//! drop), for a `nats-server` that requires TLS.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A test CA and the server certificate it signed.
pub struct TestCa {
    dir: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run openssl ({e}): install it (apt-get install openssl)")
        });
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The server certificate's extensions: a leaf for TLS servers, valid for the loopback address.
const SERVER_EXTENSIONS: &str = "subjectAltName=IP:127.0.0.1,DNS:localhost
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
";

impl TestCa {
    /// Makes the CA (`ca.pem`) and the server's certificate and key (`server.pem`,
    /// `server.key`), P-256 keys valid for two days.
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-tls-{}-{}",
            std::process::id(),
            chrono::Utc::now().timestamp_nanos_opt().unwrap_or_default()
        ));
        std::fs::create_dir_all(&dir).expect("create the CA's directory");
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
        let mut ca = vec!["req", "-x509", "-nodes", "-days", "2"];
        ca.extend(ec);
        ca.extend([
            "-subj",
            "/CN=outbox-relay test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ]);
        openssl(&dir, &ca);
        let mut csr = vec!["req", "-new", "-nodes", "-subj", "/CN=127.0.0.1"];
        csr.extend(ec);
        csr.extend(["-keyout", "server.key", "-out", "server.csr"]);
        openssl(&dir, &csr);
        std::fs::write(dir.join("server.ext"), SERVER_EXTENSIONS).expect("write the extensions");
        openssl(
            &dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "server.ext",
                "-out",
                "server.pem",
            ],
        );
        Self { dir }
    }

    /// The CA's certificate (PEM): what a client verifies the server with.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The server's `tls { … }` block (nats-server configuration): TLS required of every
    /// client, with the certificate this CA signed.
    pub fn server_config(&self) -> String {
        format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  timeout: 5\n}}\n",
            self.dir.join("server.pem").display(),
            self.dir.join("server.key").display()
        )
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}
