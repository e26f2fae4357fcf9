//! Opening the database a command names, with messages an operator can act on.

use anyhow::{Context, Result, bail};
use outbox_persistence::{ConnectConfig, Database, Error};

/// Where the database URL comes from, in messages.
pub const URL_HELP: &str =
    "pass --database-url or set DATABASE_URL (postgres://… or sqlite://PATH)";

/// Connects to `url` and checks that the schema is exactly the one this binary knows.
pub async fn open(url: Option<&str>, config: ConnectConfig) -> Result<Database> {
    let db = connect(url, config).await?;
    check_schema(&db).await?;
    Ok(db)
}

/// Opens a hot standby of the primary for reads (`--read-database-url`): a pool that gives up
/// on a connection within 3 s, so a stopped standby is a clear error, not a wait. Its schema
/// is the primary's (it is a streaming replica), checked as the primary's is.
pub async fn open_standby(url: &str) -> Result<Database> {
    let config = ConnectConfig {
        acquire_timeout: std::time::Duration::from_secs(3),
        ..ConnectConfig::default()
    };
    open(Some(url), config)
        .await
        .with_context(|| format!("cannot read from the standby at {}", redact(url)))
}

/// `url` without its password.
fn redact(url: &str) -> String {
    match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, rest)), Some(at)) if rest.contains('@') => {
            let creds = &url[scheme.len() + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{scheme}://{user}@{}", &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

/// The environment variable that names a direct URL of the server for the wake-up `LISTEN`,
/// when the database URL goes through a transaction pooler (`?outbox_pooler=transaction`).
pub const LISTEN_URL_ENV: &str = "OUTBOX_LISTEN_URL";

/// Connects to `url` without checking the schema (for `migrate`). A direct `LISTEN` URL comes
/// from [`LISTEN_URL_ENV`] unless `config` names one.
pub async fn connect(url: Option<&str>, mut config: ConnectConfig) -> Result<Database> {
    let Some(url) = url else {
        bail!("no database given: {URL_HELP}");
    };
    if config.listen_url.is_none() {
        config.listen_url = std::env::var(LISTEN_URL_ENV).ok().filter(|u| !u.is_empty());
    }
    let shown = outbox_persistence::redact_url(url);
    Database::connect(url, config).await.map_err(|e| match e {
        Error::InvalidUrl(msg) => anyhow::anyhow!("invalid database url {msg}; {URL_HELP}"),
        e if e.is_transient() => {
            anyhow::anyhow!("cannot reach the database at {shown}: {}", e.chain())
        }
        e => anyhow::anyhow!("cannot open the database at {shown}: {}", e.chain()),
    })
}

/// Fails with an actionable message when the schema is not migrated, or newer than this binary.
pub async fn check_schema(db: &Database) -> Result<()> {
    match db.check_schema().await {
        Ok(()) => Ok(()),
        Err(Error::NotMigrated { missing }) => bail!(
            "the database schema is not migrated (missing migrations {missing:?}); run `outbox migrate` first"
        ),
        Err(Error::SchemaTooNew { unknown }) => bail!(
            "the database schema is newer than this binary (unknown migrations {unknown:?}); upgrade outbox before running it against this database"
        ),
        Err(e) => Err(anyhow::anyhow!(e.chain())).context("cannot read the schema version"),
    }
}
