//! Connecting to NATS the way deployments authenticate: user and password, a token, a `.creds`
//! file (JWT and nkey seed), TLS with a CA file (and a client certificate). Secrets are held in
//! [`Secret`], whose `Debug` and `Display` print nothing of them, and URLs are shown with their
//! credentials redacted.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::RelayError;

/// A secret value (password, token). Formatting it prints `<redacted>`; read it with
/// [`Secret::expose`] only to hand it to the client.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// Reads a secret from a file (a mounted secret): its content without the trailing line
    /// break.
    pub fn from_file(path: &std::path::Path, what: &'static str) -> Result<Self, RelayError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| RelayError::Secret { what, source })?;
        Ok(Self(text.trim_end_matches(['\r', '\n']).to_string()))
    }

    /// The value, for the client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// How the relay authenticates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials (or credentials in the URL, which are used and never printed).
    #[default]
    None,
    /// A user and password.
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: Secret,
    },
    /// A token.
    Token(Secret),
    /// A `.creds` file (a user JWT and its nkey seed), as `nsc` writes it.
    CredsFile(PathBuf),
}

/// Where and how to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsConnect {
    /// One or more server URLs, comma separated (`nats://host:4222`, `tls://…`).
    pub url: String,
    /// The credentials.
    pub auth: NatsAuth,
    /// A CA file to verify the server's certificate (PEM); implies TLS.
    pub tls_ca: Option<PathBuf>,
    /// A client certificate and its key (PEM), for servers that verify clients.
    pub tls_client: Option<(PathBuf, PathBuf)>,
    /// Require TLS even without a CA file (the system roots verify the server).
    pub tls_required: bool,
    /// The connection's name, shown by the server's monitoring.
    pub name: String,
    /// How long the first connection may take.
    pub connect_timeout: Duration,
}

impl NatsConnect {
    /// `url` without credentials or TLS.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            auth: NatsAuth::None,
            tls_ca: None,
            tls_client: None,
            tls_required: false,
            name: "outbox-relay".into(),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// Sets the credentials.
    pub fn with_auth(mut self, auth: NatsAuth) -> Self {
        self.auth = auth;
        self
    }

    /// The URL as it may be shown: credentials replaced by `***`.
    pub fn shown_url(&self) -> String {
        redact_url(&self.url)
    }

    /// Connects. The client reconnects by itself after a lost connection (publishes meanwhile
    /// fail or time out, and their attempts are retried).
    pub async fn connect(&self) -> Result<async_nats::Client, RelayError> {
        let mut options = match &self.auth {
            NatsAuth::None => async_nats::ConnectOptions::new(),
            NatsAuth::UserPassword { user, password } => {
                async_nats::ConnectOptions::with_user_and_password(
                    user.clone(),
                    password.expose().to_string(),
                )
            }
            NatsAuth::Token(token) => {
                async_nats::ConnectOptions::with_token(token.expose().to_string())
            }
            NatsAuth::CredsFile(path) => async_nats::ConnectOptions::with_credentials_file(path)
                .await
                .map_err(|source| RelayError::Secret {
                    what: "credentials file",
                    source,
                })?,
        };
        if let Some(ca) = &self.tls_ca {
            std::fs::metadata(ca).map_err(|source| RelayError::Secret {
                what: "TLS CA file",
                source,
            })?;
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((cert, key)) = &self.tls_client {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if self.tls_required {
            options = options.require_tls(true);
        }
        let servers: Vec<&str> = self.url.split(',').map(str::trim).collect();
        options
            .name(&self.name)
            .connection_timeout(self.connect_timeout)
            .connect(servers.as_slice())
            .await
            .map_err(|source| RelayError::Connect {
                url: self.shown_url(),
                source,
            })
    }
}

/// `url` with any `user:password@` or `token@` replaced by `***@` (each of a comma-separated
/// list).
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let one = one.trim();
            let (scheme, rest) = match one.find("://") {
                Some(i) => (&one[..i + 3], &one[i + 3..]),
                None => ("", one),
            };
            match rest.rfind('@') {
                Some(at) => format!("{scheme}***@{}", &rest[at + 1..]),
                None => one.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_shown_without_credentials() {
        assert_eq!(redact_url("nats://u:p@h:4222"), "nats://***@h:4222");
        assert_eq!(redact_url("tok@h"), "***@h");
        assert_eq!(
            redact_url("nats://a:b@h1:4222, nats://h2:4222"),
            "nats://***@h1:4222,nats://h2:4222"
        );
        assert_eq!(redact_url("nats://h"), "nats://h");
    }

    #[test]
    fn secrets_never_format() {
        let auth = NatsAuth::UserPassword {
            user: "relay".into(),
            password: Secret::new("hunter2"),
        };
        let shown = format!("{auth:?} {}", Secret::new("tok"));
        assert!(
            !shown.contains("hunter2") && !shown.contains("tok\""),
            "{shown}"
        );
        assert!(shown.contains("<redacted>"));
    }
}
