//! Decentralised authentication for a test server: an operator, an account with JetStream
//! enabled and users, each with its nkey pair and a JWT signed by its issuer (operator → account
//! → user), as `nsc` makes them. [`Operator::server_config`] runs a server in operator mode with
//! the account preloaded in a memory resolver; [`Operator::user_creds`] is a user's `.creds`
//! file (its JWT and its nkey seed).
//!
//! The JWTs are built by hand in the format of nats-server's `jwt/v2` package: a header
//! `{"typ":"JWT","alg":"ed25519-nkey"}`, the claims, and the issuer's ed25519 signature of both,
//! each part base64url without padding.

use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use nkeys::KeyPair;

/// An operator, its system account (JetStream needs one in operator mode) and its one
/// account for users (JetStream enabled, no limits).
pub struct Operator {
    operator: KeyPair,
    account: KeyPair,
    system: KeyPair,
    operator_jwt: String,
    account_jwt: String,
    system_jwt: String,
}

/// A JWT with `claims` (`nats` being the type-specific part) issued by `issuer` about `subject`.
fn jwt(issuer: &KeyPair, subject: &str, name: &str, nats: &str) -> String {
    let header = URL_SAFE_NO_PAD.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let now = chrono::Utc::now();
    let claims = format!(
        r#"{{"jti":"T{}{}","iat":{},"iss":"{}","name":"{name}","sub":"{subject}","nats":{nats}}}"#,
        now.timestamp_nanos_opt().unwrap_or_default(),
        &subject[..8],
        now.timestamp(),
        issuer.public_key(),
    );
    let signed = format!("{header}.{}", URL_SAFE_NO_PAD.encode(claims));
    let signature = issuer.sign(signed.as_bytes()).expect("sign the JWT");
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature))
}

/// The account's claims: everything unlimited, JetStream on (memory and file storage).
const ACCOUNT_CLAIMS: &str = r#"{"limits":{"subs":-1,"data":-1,"payload":-1,"imports":-1,"exports":-1,"wildcards":true,"conn":-1,"leaf":-1,"mem_storage":-1,"disk_storage":-1,"streams":-1,"consumer":-1},"default_permissions":{"pub":{},"sub":{}},"type":"account","version":2}"#;

/// The system account's claims: no limits, no JetStream.
const SYSTEM_CLAIMS: &str = r#"{"limits":{"subs":-1,"data":-1,"payload":-1,"imports":-1,"exports":-1,"wildcards":true,"conn":-1,"leaf":-1},"default_permissions":{"pub":{},"sub":{}},"type":"account","version":2}"#;

/// A user's claims: no limits, no permission restrictions.
const USER_CLAIMS: &str =
    r#"{"pub":{},"sub":{},"subs":-1,"data":-1,"payload":-1,"type":"user","version":2}"#;

impl Operator {
    /// A new operator with its account.
    pub fn new() -> Self {
        let operator = KeyPair::new_operator();
        let account = KeyPair::new_account();
        let system = KeyPair::new_account();
        let operator_jwt = jwt(
            &operator,
            &operator.public_key(),
            "outbox-test-operator",
            &format!(
                r#"{{"system_account":"{}","type":"operator","version":2}}"#,
                system.public_key()
            ),
        );
        let system_jwt = jwt(&operator, &system.public_key(), "SYS", SYSTEM_CLAIMS);
        let account_jwt = jwt(
            &operator,
            &account.public_key(),
            "outbox-test-account",
            ACCOUNT_CLAIMS,
        );
        Self {
            operator,
            account,
            system,
            operator_jwt,
            account_jwt,
            system_jwt,
        }
    }

    /// The operator's public key.
    pub fn public_key(&self) -> String {
        self.operator.public_key()
    }

    /// The server's configuration for operator mode: this operator trusted, its accounts
    /// preloaded in a memory resolver.
    pub fn server_config(&self) -> String {
        format!(
            "operator: \"{}\"\nsystem_account: {}\nresolver: MEMORY\nresolver_preload: {{\n  {}: \"{}\"\n  {}: \"{}\"\n}}\n",
            self.operator_jwt,
            self.system.public_key(),
            self.account.public_key(),
            self.account_jwt,
            self.system.public_key(),
            self.system_jwt
        )
    }

    /// A new user of the account: the content of its `.creds` file.
    pub fn user_creds(&self, name: &str) -> String {
        let user = KeyPair::new_user();
        let user_jwt = jwt(&self.account, &user.public_key(), name, USER_CLAIMS);
        creds_file(&user_jwt, &user.seed().expect("the user's seed"))
    }

    /// Writes a new user's `.creds` file into `dir` (mode 0600) and returns its path.
    pub fn write_user_creds(&self, dir: &Path, name: &str) -> PathBuf {
        write_creds(dir, name, &self.user_creds(name))
    }
}

impl Default for Operator {
    fn default() -> Self {
        Self::new()
    }
}

/// A `.creds` file's content as `nsc` writes it.
pub fn creds_file(user_jwt: &str, seed: &str) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    )
}

/// Writes `content` to `dir/name.creds` (mode 0600 on Unix) and returns its path.
pub fn write_creds(dir: &Path, name: &str, content: &str) -> PathBuf {
    let path = dir.join(format!("{name}.creds"));
    std::fs::write(&path, content).expect("write the .creds file");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).ok();
    }
    path
}

/// The nkey seed in a `.creds` file's content (to check that it never shows).
pub fn seed_of(creds: &str) -> &str {
    creds
        .lines()
        .find(|l| l.starts_with("SU"))
        .expect("a user seed in the .creds file")
}
