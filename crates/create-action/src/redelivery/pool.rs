//! The kit's connection pool of either backend, the handler under test, and one delivery.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::str::FromStr;
use std::task::Poll;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{PgPool, SqlitePool};

use super::error::{BoxError, KitError};
use crate::ActionConn;

/// A connection pool of either backend, for the kit. It needs two connections at once for the
/// concurrent redelivery.
#[derive(Clone, Debug)]
pub enum Pool {
    /// A PostgreSQL pool.
    Postgres(PgPool),
    /// A SQLite pool.
    Sqlite(SqlitePool),
}

impl Pool {
    /// Connects to `postgres://…` or `sqlite:…` (the SQLite file must exist), with up to four
    /// connections.
    pub async fn connect(url: &str) -> Result<Self, KitError> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            // Through the outbox's connect, so that `?outbox_pooler=transaction` is understood
            // (docs/deployment.md).
            let config = outbox_persistence::ConnectConfig {
                max_connections: 4,
                ..Default::default()
            };
            match outbox_persistence::Database::connect(url, config).await {
                Ok(outbox_persistence::Database::Postgres(pool)) => Ok(Pool::Postgres(pool)),
                Ok(_) => unreachable!("a postgres:// URL connects to PostgreSQL"),
                Err(outbox_persistence::Error::InvalidUrl(url)) => Err(KitError::InvalidUrl(url)),
                Err(e) => Err(KitError::Outbox(e)),
            }
        } else if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)?;
            Ok(Pool::Sqlite(
                SqlitePoolOptions::new()
                    .max_connections(4)
                    .connect_with(options)
                    .await?,
            ))
        } else {
            Err(KitError::InvalidUrl(
                "expected postgres://… or sqlite:…".to_string(),
            ))
        }
    }
}

impl From<PgPool> for Pool {
    fn from(pool: PgPool) -> Self {
        Pool::Postgres(pool)
    }
}

impl From<SqlitePool> for Pool {
    fn from(pool: SqlitePool) -> Self {
        Pool::Sqlite(pool)
    }
}

/// The handler under test: runs an event's effects on the connection of an open transaction.
/// Implemented for every `async |conn: &mut dyn ActionConn, payload: &Value| -> Result<(), E>`
/// closure whose error converts into a boxed error (this crate's `Error`, `anyhow::Error`, …).
#[async_trait(?Send)]
pub trait EventHandler {
    /// Runs the effects of the event with `payload`.
    async fn handle(&self, conn: &mut dyn ActionConn, payload: &Value) -> Result<(), BoxError>;
}

#[async_trait(?Send)]
impl<F, E> EventHandler for F
where
    F: AsyncFn(&mut dyn ActionConn, &Value) -> Result<(), E>,
    E: Into<BoxError>,
{
    async fn handle(&self, conn: &mut dyn ActionConn, payload: &Value) -> Result<(), BoxError> {
        self(conn, payload).await.map_err(Into::into)
    }
}

/// One delivery: a committed transaction, opened as the outbox attempt opens it (PostgreSQL
/// `BEGIN`, read committed; SQLite `BEGIN IMMEDIATE`). A failed handler rolls it back.
pub(super) async fn deliver<H: EventHandler + ?Sized>(
    pool: &Pool,
    handler: &H,
    payload: &Value,
) -> Result<(), BoxError> {
    match pool {
        Pool::Postgres(pool) => {
            let mut tx = pool
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await?;
            handler.handle(&mut *tx, payload).await?;
            tx.commit().await?;
        }
        Pool::Sqlite(pool) => {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            handler.handle(&mut *tx, payload).await?;
            tx.commit().await?;
        }
    }
    Ok(())
}

/// Polls two futures on the current task until both are done (the handler's futures need not
/// be `Send`, so they cannot be spawned).
pub(super) async fn join2<A: Future, B: Future>(a: A, b: B) -> (A::Output, B::Output) {
    let (mut a, mut b) = (pin!(a), pin!(b));
    let (mut ra, mut rb) = (None, None);
    poll_fn(|cx| {
        if ra.is_none()
            && let Poll::Ready(v) = a.as_mut().poll(cx)
        {
            ra = Some(v);
        }
        if rb.is_none()
            && let Poll::Ready(v) = b.as_mut().poll(cx)
        {
            rb = Some(v);
        }
        if ra.is_some() && rb.is_some() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    match (ra, rb) {
        (Some(a), Some(b)) => (a, b),
        _ => unreachable!("poll_fn returned before both futures finished"),
    }
}
